"""The paged KV cache's bookkeeping: block allocation, reference counts and the prefix cache.

The cache holds `num_blocks` blocks of `block_size` token positions. A request owns a list of
blocks (its block table). When prefix caching is on, every *full* block is also known by a hash
chained over (parent block's hash, the block's token ids), so a block's hash names its whole
prefix. A later request whose prompt starts with the same tokens reuses those blocks (their
reference count goes up) instead of computing them again.

A block whose reference count falls to 0 goes to the back of the free queue but keeps its hash
and contents, so it can still be reused until it is handed out again; allocation takes from the
front of the queue, so the least recently released block is evicted first.

With `record_events`, the manager also keeps what a router needs to know of the prefix cache
(engine/kv_events.py): the runs of blocks that became findable, and the hashes evicted; the
engine takes them after each step (`take_events`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from nanoserve.engine.block_hashes import (  # noqa: F401 (the cache's names for them)
    chain_hashes,
    hash_block,
    image_keys,
    salt_root,
)
from nanoserve.engine.kv_disk import KVDiskTier
from nanoserve.engine.kv_events import BlockRemoved, BlockStored, KVEvent, wire_hash
from nanoserve.engine.state_cache import NO_SOURCE, BlockHash, StateSnapshots

if TYPE_CHECKING:
    from nanoserve.engine.request import Request


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, refs={self.ref_count})"


class BlockPool:
    """Every block, the LRU free queue, and the hash -> block map of cached full blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b)
                                                                 for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.evicted: list[BlockHash] | None = None  # recorded only when a list is set
        # told of every evicted cached block, before it is reused: a hybrid's state snapshot
        # goes with it, the disk tier keeps its bytes
        self.evict_listeners: list[Callable[[BlockHash, KVBlock], None]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the front of the free queue, evicting their cached contents."""
        assert count <= len(self.free_queue), "caller must check num_free_blocks first"
        taken = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.evicted is not None:
                        self.evicted.append(block.block_hash)
                    for listener in self.evict_listeners:
                        listener(block.block_hash, block)
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Share cached blocks with one more request."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"{block} released twice"
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def register(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Make a full, computed block findable by its hash (the first block with a hash wins);
        True if this block became the one its hash finds."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False


class KVCacheManager:
    """Block tables per request, allocation with prefix-cache reuse, and the cache's counters.

    With several layer groups (model/kv_groups.py) a request has a block table per group, all
    drawn from the one pool; a windowed group gives back the blocks that fell out of its window
    (their table entries stay, stale, never read again: the kernels start at the window). A
    prefix is found only where every group still holds all of its blocks. One group (every
    model without mixed windows) is the plain paged cache."""

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, record_events: bool = False,
                 group_windows: Sequence[int] = (0,)) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks)
        # stored runs, in the order they became findable (evictions: the pool's list)
        self.stored: list[BlockStored] | None = [] if record_events else None
        if record_events:
            self.pool.evicted = []
        # per request, per group: its blocks (None where a window gave one back)
        self.req_blocks: dict[str, list[list[KVBlock | None]]] = {}
        # The same blocks' ids, appended to alongside: the runner copies only their new tail
        # into its per-slot table each step (block_table.py), never rebuilding a list.
        self.req_block_ids: dict[str, list[list[int]]] = {}
        self.req_num_registered: dict[str, int] = {}
        # per request, per group: how many of its first blocks a window has given back
        self.req_num_given_back: dict[str, list[int]] = {}
        # Prefix-cache counters, in tokens (vLLM's meaning): looked up, and found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # a hybrid model's DeltaNet state snapshots: a prefix is found only up to one
        self.states: StateSnapshots | None = None
        # the disk tier under the cache (engine/kv_disk.py), with the worker's block bytes
        self.disk: KVDiskTier | None = None
        self._block_io: tuple[Callable[[int], bytes], Callable[[int, bytes], None]] | None = None
        self._block_nbytes = 0

    def keep_disk_tier(self, disk: KVDiskTier, read_block: Callable[[int], bytes],
                       write_block: Callable[[int, bytes], None], block_nbytes: int) -> None:
        """Spill evicted blocks to `disk` and read a prompt's next blocks back from it on a RAM
        miss; `read_block(id)` / `write_block(id, bytes)` move a block's `block_nbytes` bytes
        out of and into the workers' cache."""
        self.disk = disk
        self._block_io = (read_block, write_block)
        self._block_nbytes = block_nbytes
        self.pool.evict_listeners.append(self._spill)

    def _spill(self, key: BlockHash, block: KVBlock) -> None:
        assert self.disk is not None and self._block_io is not None
        read_block = self._block_io[0]
        self.disk.write(key, lambda: read_block(block.block_id))

    def close_disk_tier(self) -> None:
        """Every cached block onto the disk tier (shutdown: a restart finds them), then wait
        for the writes."""
        if self.disk is None:
            return
        for key, block in list(self.pool.cached.items()):
            self._spill(key, block)
        self.disk.close()

    def keep_state_snapshots(self, states: StateSnapshots) -> None:
        """Find prefixes only where `states` holds a snapshot; drop one with its block."""
        self.states = states
        self.pool.evict_listeners.append(lambda key, _block: states.forget(key))

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block ids in order for one group: the live list (read it, do not
        change it)."""
        ids = self.req_block_ids.get(request_id)
        return ids[group] if ids else []

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Per group, the longest run of the request's full blocks already in the cache (the
        same length in every group), and its token count.

        At least one token is always left to compute, so the step that finishes the prompt
        produces logits to sample from.
        """
        request.state_source = NO_SOURCE
        if not self.enable_prefix_caching or request.computes_every_position:
            return [], 0  # prompt logprobs and mean pooling need every position computed
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[list[KVBlock]] = []
        for group in range(self.num_groups):
            found: list[KVBlock] = []
            for block_hash in hashes[: min([max_blocks, *map(len, hits)])]:
                block = self.pool.cached.get(_group_key(block_hash, group))
                if block is None:
                    break
                found.append(block)
            hits.append(found)
        num_hits = min(len(found) for found in hits)
        hits = [found[:num_hits] for found in hits]
        if self.disk is not None and self.disk.enabled and num_hits < max_blocks:
            num_hits = self._read_from_disk(hashes, hits, max_blocks)
        if self.states is not None:  # up to the last DeltaNet state snapshot in the run
            num_hits, request.state_source = self.states.longest_hit(hashes, num_hits)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hits * self.block_size
        return [found[:num_hits] for found in hits], num_hits * self.block_size

    def _read_from_disk(self, hashes: list[BlockHash], hits: list[list[KVBlock]],
                        max_blocks: int) -> int:
        """Extend the run of cached blocks (`hits`, per group, in place) from the disk tier:
        each next block of the chain, in every group, read into a free block and made
        findable. Stops at the first block missing, failing its checks, or with no room;
        returns the run's length. The run already found is held meanwhile, so a block read
        in never evicts it."""
        assert self.disk is not None and self._block_io is not None
        write_block = self._block_io[1]
        held = [block for found in hits for block in found]
        self.pool.touch(held)
        n = len(hits[0])
        try:
            while n < max_blocks:
                keys = [_group_key(hashes[n], g) for g in range(self.num_groups)]
                in_ram = [self.pool.cached.get(key) for key in keys]
                wanted = [key for key, block in zip(keys, in_ram, strict=True) if block is None]
                if not all(self.disk.has(key) for key in wanted):
                    self.disk.stats.misses += 1
                    break
                if self.pool.num_free_blocks - sum(b is not None and b.ref_count == 0
                                                   for b in in_ram) < len(wanted):
                    break
                payloads = [self.disk.read(key, self._block_nbytes) for key in wanted]
                if any(payload is None for payload in payloads):
                    break
                ram = [b for b in in_ram if b is not None]
                self.pool.touch(ram)  # held, so the allocation below cannot evict them
                fresh = self.pool.allocate(len(wanted))  # held too (allocated with one ref)
                held += ram + fresh
                for block, key, payload in zip(fresh, wanted, payloads, strict=True):
                    write_block(block.block_id, payload)  # type: ignore[arg-type]
                    self.pool.register(block, key)
                loaded = iter(fresh)
                for found, in_ram_block in zip(hits, in_ram, strict=True):
                    found.append(in_ram_block if in_ram_block is not None else next(loaded))
                n += 1
        finally:
            self.pool.release(held)
        return n

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[KVBlock]] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens in every group (a windowed
        group first gives back what fell out of its window); False (and no change but what
        was given back) if the free blocks do not suffice."""
        groups = self.req_blocks.setdefault(request.request_id,
                                            [[] for _ in self.group_windows])
        ids = self.req_block_ids.setdefault(request.request_id,
                                            [[] for _ in self.group_windows])
        computed = list(computed_blocks) or [[] for _ in self.group_windows]
        num_cached = request.num_computed_tokens + len(computed[0]) * self.block_size
        if any(self.group_windows):
            self._give_back_outside(request.request_id, groups, num_cached)
        num_total = -(-(num_cached + num_new_tokens) // self.block_size)
        needed = [num_total - len(blocks) - len(hit) for blocks, hit in zip(groups, computed,
                                                                            strict=True)]
        num_reclaimed = sum(1 for hit in computed for b in hit if b.ref_count == 0)
        if sum(max(n, 0) for n in needed) > self.pool.num_free_blocks - num_reclaimed:
            return False
        # every group's hits held before any group allocates: a hit in the free queue (a
        # preempted request's own blocks) would else be taken as another group's new block
        for hit in computed:
            self.pool.touch(hit)
        for blocks, block_ids, hit, num_needed in zip(groups, ids, computed, needed,
                                                      strict=True):
            new_blocks = [*hit, *(self.pool.allocate(num_needed) if num_needed > 0 else ())]
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        return True

    def _give_back_outside(self, request_id: str, groups: list[list[KVBlock | None]],
                           num_cached: int) -> None:
        """In each windowed group, release the blocks wholly before the first key the next
        query reads (num_cached - window + 1): no later query reads them. Each step looks only
        at the blocks past those given back before."""
        given = self.req_num_given_back.setdefault(request_id, [0] * len(groups))
        for g, (window, blocks) in enumerate(zip(self.group_windows, groups, strict=True)):
            if not window:
                continue
            end = min(len(blocks), max(num_cached - window + 1, 0) // self.block_size)
            for i in range(given[g], end):
                block = blocks[i]
                if block is not None:  # a prefix hit's block, or one computed here
                    self.pool.release((block,))
                    blocks[i] = None
            given[g] = max(given[g], end)

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed in this step."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self.req_num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        for group, blocks in enumerate(self.req_blocks[request.request_id]):
            run: list[int] = []  # this step's consecutive newly findable blocks, by index
            for i in range(start, num_full):
                block = blocks[i]
                if block is not None and self.pool.register(block, _group_key(hashes[i], group)):
                    run.append(i)
                elif run:
                    self._record_stored(request, hashes, run, group)
                    run = []
            if run:
                self._record_stored(request, hashes, run, group)
        self.req_num_registered[request.request_id] = num_full

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, evictions first (a block evicted and stored again
        in one step must end up stored); empty when not recording. A router sees the first
        group's blocks (a prefix cached there is cached in every group it fits)."""
        if self.stored is None or self.pool.evicted is None:
            return []
        events: list[KVEvent] = []
        evicted = [h for h in self.pool.evicted if len(h) == _HASH_BYTES]
        if evicted:
            events.append(BlockRemoved([wire_hash(h) for h in evicted]))
        self.pool.evicted.clear()
        events.extend(self.stored)
        self.stored.clear()
        return events

    def _record_stored(self, request: Request, hashes: list[BlockHash], run: list[int],
                       group: int) -> None:
        if self.stored is None or group:
            return
        first, size = run[0], self.block_size
        parent = wire_hash(hashes[first - 1]) if first > 0 else None
        self.stored.append(BlockStored(
            [wire_hash(hashes[i]) for i in run], parent,
            list(request.all_token_ids[first * size : (run[-1] + 1) * size]), size))

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks; the tail goes first so prefixes live longer."""
        groups = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        for blocks in groups:
            self.pool.release(b for b in reversed(blocks) if b is not None)
        self.req_num_registered.pop(request.request_id, None)
        self.req_num_given_back.pop(request.request_id, None)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks, extended as tokens arrive."""
        hashes = request.block_hashes
        root = salt_root(request.params.cache_salt) if not hashes else None
        return chain_hashes(request.all_token_ids, self.block_size, root, request.images,
                            hashes)


_HASH_BYTES = 16  # hash_block's digest


def _group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The pool's key for a block of `group`: the hash itself for the first group (what a
    router is told), the hash and the group's number after it for the others."""
    return block_hash if group == 0 else block_hash + bytes((group,))
