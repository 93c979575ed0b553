"""BlockTable: rows written once, then only their new tail; a cleared slot starts over."""

from __future__ import annotations

from nanoserve.engine.block_table import BlockTable


def test_sync_copies_only_what_is_new_and_clear_starts_over() -> None:
    table = BlockTable(num_slots=3, max_blocks_per_slot=4)
    blocks = [7, 2]
    table.sync(1, blocks)
    assert table.table[1, :2].tolist() == [7, 2] and table.num_blocks[1] == 2
    table.table[1, 0] = 99  # a row already synced is not rewritten ...
    blocks.append(5)
    table.sync(1, blocks)  # ... only the new block is copied
    assert table.table[1, :3].tolist() == [99, 2, 5] and table.num_blocks[1] == 3
    table.clear(1)
    table.sync(1, [4])  # the slot's next request: its own blocks from the start
    assert table.table[1, :1].tolist() == [4] and table.num_blocks[1] == 1
    assert table.num_blocks.tolist() == [0, 1, 0]
