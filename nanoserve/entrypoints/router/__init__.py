"""Several models behind one port (`nanoserve serve --models-dir DIR`): a router process that
starts one `nanoserve serve` per model on demand and forwards each request by its `model`."""
