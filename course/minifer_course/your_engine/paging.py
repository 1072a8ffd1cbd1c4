"""Lesson 08: KV blocks and block tables. A pool of blocks, a free list (handed out from its
front, given back to its back) and one table per sequence; a sequence takes a new block only
when its last one is full.
"""

from __future__ import annotations


class Allocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))  # the pool's free block ids
        self.tables: dict[str, list[int]] = {}  # sequence → its block ids, in token order

    def grow(self, seq: str, num_tokens: int) -> bool:
        """Give `seq` blocks until it can hold `num_tokens` tokens; False (and nothing taken)
        if the pool has too few free blocks."""
        table = self.tables.get(seq, [])
        more = -(-num_tokens // self.block_size) - len(table)  # ceil(num_tokens / block_size) - held
        if more > len(self.free):
            return False
        self.tables[seq] = table + [self.free.pop(0) for _ in range(max(more, 0))]
        return True

    def release(self, seq: str) -> None:
        self.free.extend(reversed(self.tables.pop(seq, [])))  # back to the pool, last block first

    @property
    def num_used(self) -> int:
        return sum(len(t) for t in self.tables.values())
