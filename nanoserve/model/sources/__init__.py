"""Where a model's files come from: a local path, a hub repository by name (`org/repo`,
`org/repo:QUANT`, `hf.co/org/repo:QUANT`) or an Ollama registry name (`qwen3.5:0.8b`).

A name is turned into local files here, once, at the edge (the CLI, `LLM(...)`, the router,
Ollama's `/api/pull`); the loader below sees only paths. Nothing here imports torch.
"""
