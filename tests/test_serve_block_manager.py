"""Block manager: block tables, reference counts, prefix hashing, LRU eviction, fragmentation."""

from __future__ import annotations

import pytest

from minifer.engine.block_manager import BlockManager, block_hash


def test_allocate_sizes_tables_and_free_returns_every_block():
    bm = BlockManager(10, 4)
    assert bm.allocate("a", list(range(9))) == 0  # 9 tokens -> 3 blocks, nothing cached
    assert len(bm.tables["a"]) == 3 and bm.num_free_blocks == 7
    bm.allocate("b", [1, 2, 3, 4])
    assert bm.num_used_blocks == 4 and len(set(bm.tables["a"] + bm.tables["b"])) == 4
    bm.append_slots("b", 5)  # one more token needs a fifth block
    assert len(bm.tables["b"]) == 2 and bm.num_used_blocks == 5
    bm.append_slots("b", 8)  # still fits
    assert len(bm.tables["b"]) == 2
    bm.check()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    bm.check()


def test_double_free_and_unknown_sequence_are_errors():
    bm = BlockManager(4, 2)
    bm.allocate("a", [1, 2, 3])
    bm.free("a")
    with pytest.raises(KeyError, match="already freed"):
        bm.free("a")
    bm.allocate("b", [1])
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("b", [1])


def test_can_allocate_and_can_append_tell_the_truth():
    bm = BlockManager(3, 4)
    assert bm.can_allocate(list(range(12))) and not bm.can_allocate(list(range(13)))
    bm.allocate("a", list(range(8)))
    assert bm.can_append("a", 12) and not bm.can_append("a", 13)
    with pytest.raises(RuntimeError, match="can_append"):
        bm.append_slots("a", 13)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate("b", list(range(5)))


def test_utilisation_fragmentation_and_bytes():
    bm = BlockManager(8, 4, bytes_per_token=100)
    assert bm.nbytes == 8 * 4 * 100
    assert bm.utilization == 0 and bm.internal_fragmentation == 0
    bm.allocate("a", list(range(5)))  # 2 blocks, 3 slots wasted
    bm.allocate("b", list(range(4)))  # 1 block, full
    assert bm.utilization == 3 / 8
    assert bm.wasted_slots == 3
    assert bm.internal_fragmentation == pytest.approx(3 / 12)


def test_block_hash_chains_through_the_parent():
    a = block_hash(None, [1, 2])
    assert a == block_hash(None, (1, 2))  # deterministic, list or tuple
    assert block_hash(a, [3, 4]) != block_hash(None, [3, 4])  # same tokens, other prefix
    assert block_hash(a, [3, 4]) != block_hash(a, [4, 3])


def test_prefix_blocks_are_shared_with_reference_counts():
    bm = BlockManager(10, 4, enable_prefix_caching=True)
    prefix = [7, 7, 7, 7, 8, 8, 8, 8]
    assert bm.allocate("a", prefix + [1, 2]) == 0
    bm.commit("a", prefix + [1, 2], 10)  # K/V now written: the two full blocks get names
    assert bm.cached_prefix_tokens(prefix + [5]) == 8
    assert bm.allocate("b", prefix + [5]) == 8
    assert bm.tables["b"][:2] == bm.tables["a"][:2]
    assert bm.tables["b"][2] != bm.tables["a"][2]  # partial blocks are never shared
    assert [bm.blocks[i].ref_count for i in bm.tables["a"]] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    bm.check()
    bm.free("a")
    assert [bm.blocks[i].ref_count for i in bm.tables["b"]] == [1, 1, 1]
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # freed, still reusable
    assert bm.allocate("c", prefix + [9]) == 8  # revived from the free list
    assert bm.hit_blocks == 4 and bm.queried_blocks == 6
    bm.check()


def test_uncommitted_blocks_are_not_hits_and_the_last_token_is_always_computed():
    bm = BlockManager(10, 4, enable_prefix_caching=True)
    bm.allocate("a", list(range(8)))
    assert bm.cached_prefix_tokens(list(range(9))) == 0  # not committed yet: no K/V
    bm.commit("a", list(range(8)), 8)
    # the same 8 tokens again: only the first block is reused, the last token's block is computed
    assert bm.cached_prefix_tokens(list(range(8))) == 4
    assert bm.cached_prefix_tokens(list(range(9))) == 8
    assert bm.cached_prefix_tokens([1] + list(range(1, 9))) == 0  # first block differs


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(10, 4)
    bm.allocate("a", list(range(9)))
    bm.commit("a", list(range(9)), 9)
    assert bm.allocate("b", list(range(9))) == 0
    assert not set(bm.tables["a"]) & set(bm.tables["b"])


def test_eviction_takes_the_least_recently_freed_block_first():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    for name, toks in (("x", [1, 1]), ("y", [2, 2]), ("z", [3, 3])):
        bm.allocate(name, toks + [0])  # one full block and one partial block
        bm.commit(name, toks + [0], 3)
        bm.free(name)  # partial block back first, then the named one
    # y took the two least recently freed blocks (the spare one and x's partial); z then had to
    # take x's named block, the least recently freed: x's prefix is evicted, y's and z's survive
    assert bm.cached_prefix_tokens([1, 1, 0]) == 0
    assert bm.cached_prefix_tokens([2, 2, 0]) == 2
    assert bm.cached_prefix_tokens([3, 3, 0]) == 2
    assert bm.evictions == 1
    bm.check()


def test_lru_order_on_a_hand_made_history():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    names = {}
    for i in range(4):  # four sequences of exactly one full block, freed in order 0, 1, 2, 3
        toks = [10 + i, 10 + i]
        bm.allocate(i, toks)
        bm.commit(i, toks, 2)
        names[i] = bm.tables[i][0]
    for i in range(4):
        bm.free(i)
    assert bm.num_cached_blocks == 4
    bm.allocate("hit", [11, 11, 5])  # revives block of seq 1 (no longer free), + 1 fresh block
    assert bm.tables["hit"][0] == names[1]
    assert bm.tables["hit"][1] == names[0]  # the fresh block: least recently freed = seq 0's
    assert bm.evictions == 1
    assert bm.cached_prefix_tokens([10, 10, 0]) == 0  # seq 0's prefix was evicted
    assert bm.cached_prefix_tokens([12, 12, 0]) == 2  # seq 2's survives
    bm.check()


def test_duplicate_content_computed_twice_keeps_one_name():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3])
    bm.allocate("b", [1, 2, 4])  # not committed yet when b arrives: computed twice
    bm.commit("a", [1, 2, 3], 3)
    bm.commit("b", [1, 2, 4], 3)
    named = [i for i in bm.tables["a"] + bm.tables["b"] if bm.blocks[i].hash is not None]
    assert len(named) == 1
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 1
    bm.check()


@pytest.mark.parametrize("kwargs, word", [
    ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
    ({"num_blocks": 4, "block_size": 0}, "block_size"),
    ({"num_blocks": 4, "block_size": 2.0}, "block_size"),
    ({"num_blocks": 4, "block_size": 2, "bytes_per_token": -1}, "bytes_per_token"),
])
def test_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        BlockManager(**kwargs)


def test_a_block_is_found_only_behind_the_same_prefix():
    """Equal tokens behind different prefixes are different blocks (their K/V differ)."""
    bm = BlockManager(10, 2, enable_prefix_caching=True)
    for name, toks in (("a", [1, 1, 2, 2, 0]), ("b", [3, 3, 2, 2, 0])):
        bm.allocate(name, toks)
        bm.commit(name, toks, 5)
    assert bm.allocate("c", [3, 3, 2, 2, 9]) == 4
    assert bm.tables["c"][:2] == bm.tables["b"][:2]
    assert bm.cached_prefix_tokens([5, 5, 2, 2, 0]) == 0


def test_random_operations_keep_the_books_straight():
    """Random allocate / grow / commit / free with prefix caching: reference counts, the free
    list and the hash map stay consistent, every hit holds exactly the tokens asked for, and
    everything is free at the end."""
    import random

    rng = random.Random(0)
    bm = BlockManager(24, 3, enable_prefix_caching=True)
    content: dict[int, tuple[int, ...]] = {}  # what each named block really holds
    live: dict[int, list[int]] = {}
    for step in range(3000):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 3):
            seq = rng.choice(sorted(live))
            if rng.random() < 0.5:
                bm.free(seq)
                del live[seq]
            else:  # grow by a few tokens (from a tiny alphabet, so prefixes repeat), commit all
                toks = live[seq] + [rng.randrange(2) for _ in range(rng.randint(1, 4))]
                if bm.can_append(seq, len(toks)):
                    bm.append_slots(seq, len(toks))
                    live[seq] = toks
                    bm.commit(seq, toks, len(toks))
        else:
            toks = [rng.randrange(2) for _ in range(rng.randint(1, 10))]
            if bm.can_allocate(toks):
                cached = bm.allocate(step, toks)
                assert cached % 3 == 0 and cached < len(toks)
                for i, bid in enumerate(bm.tables[step][:cached // 3]):
                    assert content[bid] == tuple(toks[3 * i:3 * i + 3])
                live[step] = toks
                bm.commit(step, toks, len(toks))
        for block in bm.blocks:
            if block.hash is not None:
                content[block.block_id] = block.tokens
        bm.check()
    for seq in list(live):
        bm.free(seq)
    bm.check()
    assert bm.num_free_blocks == 24 and bm.hit_blocks > 100 and bm.evictions > 100
