"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and one block table per sequence.

Reserving the maximum length for every request wastes most of it (claim KV-12). Paging cuts the
cache into blocks of `block_size` slots: token ``i`` lives in slot ``i % block_size`` of block
``table[i // block_size]`` of its sequence's *block table*, a new block taken when one fills.

**Prefix caching.** A full block is named by ``hash(parent_hash, tokens)``, so a sequence that
starts with the same tokens shares those blocks (reference counted). A freed block keeps its
contents and hash until it is handed out again, least recently freed first (LRU). No tensors
here: `kv_pool.PagedKVPool` holds the keys and values."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..checks import check_int

__all__ = ["Block", "BlockManager", "block_hash"]


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The name of a full block: its tokens chained with its parent's hash (tuples of ints hash
    the same in every run; a hit also compares the tokens, so a collision is harmless)."""
    return hash((-1 if parent is None else parent, tuple(tokens)))


@dataclass
class Block:
    """One block of `block_size` KV slots: who uses it and, once full, what it holds."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once full and computed; unique (`_by_hash` maps it back)
    tokens: tuple[int, ...] = ()  # the tokens behind `hash` (checked on every hit)


class BlockManager:
    """Hands out blocks to sequences; shares full blocks by content when prefix caching is on.
    A sequence's life: `can_allocate`, `allocate` (its leading tokens already cached need no
    compute), `can_append` / `append_slots` as it grows, `commit` as its K/V are written, `free`."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 bytes_per_token: int = 0) -> None:
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        check_int("bytes_per_token", bytes_per_token, 0)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.bytes_per_token = bytes_per_token
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, least recently freed first: the front is evicted first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}  # content hash -> block id holding it
        self.tables: dict[Hashable, list[int]] = {}
        self.num_tokens: dict[Hashable, int] = {}  # tokens each table is sized for
        self._hashed: dict[Hashable, int] = {}  # leading blocks of each table already named
        # counters (for lessons and benchmarks)
        self.hit_blocks = 0  # full blocks found in the cache instead of computed
        self.queried_blocks = 0  # full blocks looked up
        self.evictions = 0  # cached blocks handed out for new contents

    # ---- sizes -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a named prefix (revivable until evicted)."""
        return sum(1 for b in self._free if self.blocks[b].hash is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V the whole pool holds (all layers), used or not."""
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def utilization(self) -> float:
        """Fraction of the pool's blocks in use by some sequence."""
        return self.num_used_blocks / self.num_blocks

    @property
    def wasted_slots(self) -> int:
        """Slots reserved in used blocks but holding no token: the tails of last blocks."""
        return sum(len(t) * self.block_size - self.num_tokens[s] for s, t in self.tables.items())

    @property
    def internal_fragmentation(self) -> float:
        """Wasted slots / slots of the blocks in use (0 when nothing is in use)."""
        used = self.num_used_blocks * self.block_size
        return self.wasted_slots / used if used else 0.0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits / full blocks looked up (nan before any lookup)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else float("nan")

    # ---- allocation --------------------------------------------------------------------
    def _prefix_hits(self, tokens: Sequence[int]) -> list[int]:
        """Block ids of the cached blocks that hold the leading full blocks of `tokens`, up to
        the first miss; never the last token's block (its logits are needed: it is computed)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent, bs = [], None, self.block_size
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            bid = self._by_hash.get(h)
            if bid is None or self.blocks[bid].tokens != chunk:
                break
            hits.append(bid)
            parent = h
        return hits

    def cached_prefix_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` `allocate` would find already cached."""
        return len(self._prefix_hits(tokens)) * self.block_size

    def can_allocate(self, tokens: Sequence[int]) -> bool:
        """Whether `allocate` of a sequence holding `tokens` would find enough free blocks."""
        return self._fits(tokens, self._prefix_hits(tokens))

    def _fits(self, tokens: Sequence[int], hits: list[int]) -> bool:
        """Whether the free list holds the fresh blocks `tokens` needs beyond its cached `hits`,
        and the hits no sequence uses (they leave the free list too)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_for(len(tokens)) - len(hits)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Hashable, tokens: Sequence[int]) -> int:
        """Build `seq`'s block table for `tokens`; returns the number of leading tokens whose
        K/V are already cached (a multiple of `block_size`, always < len(tokens))."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already has blocks; free it first")
        hits = self._prefix_hits(tokens)
        if not self._fits(tokens, hits):
            raise RuntimeError(f"not enough free blocks for {len(tokens)} tokens "
                               f"({self.num_free_blocks} free); check can_allocate first")
        if self.enable_prefix_caching:
            self.queried_blocks += (len(tokens) - 1) // self.block_size
            self.hit_blocks += len(hits)
        for bid in hits:
            self._take(bid)
        table = hits + [self._take_fresh() for _ in range(self.blocks_for(len(tokens)) - len(hits))]
        self.tables[seq] = table
        self.num_tokens[seq] = len(tokens)
        self._hashed[seq] = len(hits)
        return len(hits) * self.block_size

    def block_table(self, seq: Hashable) -> list[int]:
        """`seq`'s block table: the block id of its tokens ``i * block_size ..`` at index ``i``."""
        return self.tables[seq]

    def can_append(self, seq: Hashable, num_tokens: int) -> bool:
        """Whether `seq` can grow to hold `num_tokens` tokens."""
        return self.blocks_for(num_tokens) - len(self.tables[seq]) <= self.num_free_blocks

    def append_slots(self, seq: Hashable, num_tokens: int) -> None:
        """Grow `seq`'s table (new blocks at the end) so it holds `num_tokens` tokens."""
        table = self.tables[seq]
        if not self.can_append(seq, num_tokens):
            raise RuntimeError(f"not enough free blocks to grow {seq!r} to {num_tokens} tokens; "
                               f"check can_append first")
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._take_fresh())
        self.num_tokens[seq] = max(self.num_tokens[seq], num_tokens)

    def commit(self, seq: Hashable, tokens: Sequence[int], num_computed: int) -> None:
        """The first `num_computed` of `tokens` now have K/V in `seq`'s blocks: name every
        block that became full, so later sequences can share it."""
        if not self.enable_prefix_caching:
            return
        table, bs = self.tables[seq], self.block_size
        done = self._hashed[seq]
        parent = self.blocks[table[done - 1]].hash if done else None
        while (done + 1) * bs <= num_computed:
            block = self.blocks[table[done]]
            chunk = tuple(tokens[done * bs:(done + 1) * bs])
            h = block_hash(parent, chunk)
            if block.hash is None and h not in self._by_hash:
                block.hash, block.tokens = h, chunk
                self._by_hash[h] = block.block_id
            # else: another sequence computed the same block first; this copy stays unnamed
            parent = h
            done += 1
        self._hashed[seq] = done

    def free(self, seq: Hashable) -> None:
        """Release `seq`'s blocks, last first: a prefix's leading blocks are evicted last."""
        table = self.tables.pop(seq, None)
        if table is None:
            raise KeyError(f"sequence {seq!r} holds no blocks (never allocated or already freed)")
        del self.num_tokens[seq], self._hashed[seq]
        for bid in reversed(table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[bid] = None  # at the end: most recently freed; a named block stays

    # ---- internals ---------------------------------------------------------------------
    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        bid, _ = self._free.popitem(last=False)  # least recently freed
        block = self.blocks[bid]
        if block.hash is not None:  # a cached prefix block, evicted for new contents
            del self._by_hash[block.hash]
            block.hash, block.tokens = None, ()
            self.evictions += 1
        block.ref_count = 1
        return bid

    def check(self) -> None:
        """Assert the bookkeeping is consistent (tests call this; cheap enough to call often)."""
        counts = Counter(bid for table in self.tables.values() for bid in table)
        for block, n in ((b, counts[b.block_id]) for b in self.blocks):
            assert block.ref_count == n, f"block {block.block_id}: ref {block.ref_count} != {n}"
            assert (n == 0) == (block.block_id in self._free), f"block {block.block_id} free list"
        for h, bid in self._by_hash.items():
            assert self.blocks[bid].hash == h, f"hash map points at block {bid} with another hash"
        for block in self.blocks:  # a name is unique: a block's hash maps back to the block
            assert block.hash is None or self._by_hash.get(block.hash) == block.block_id

    def __repr__(self) -> str:
        return (f"BlockManager(blocks={self.num_blocks}, block_size={self.block_size}, "
                f"used={self.num_used_blocks}, cached={self.num_cached_blocks}, "
                f"prefix_caching={self.enable_prefix_caching})")
