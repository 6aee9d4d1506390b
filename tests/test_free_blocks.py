"""Freed blocks kept by exact size (FreeBlocks) and the backends that use them."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.executor.backend import Block, FreeBlocks
from engine.executor.cpu import CpuBackend


def _block(address: int, nbytes: int) -> Block:
    return Block(address, nbytes, torch.empty(0, dtype=torch.uint8))


def test_a_kept_block_is_reused_only_for_its_exact_size():
    free = FreeBlocks(limit_bytes=100)
    free.put(_block(1, 30))
    assert free.take(29) is None and free.take(31) is None
    assert free.take(30).address == 1
    assert free.take(30) is None and free.bytes == 0 and free.reused == 1


def test_overflow_gives_back_the_oldest_blocks_until_the_new_one_fits():
    free = FreeBlocks(limit_bytes=100)
    for address, nbytes in [(1, 20), (2, 30), (3, 20)]:
        free.put(_block(address, nbytes))
    # live 20 + kept 70 + new 20 = 110 > 100: the oldest (20 bytes) goes, then it fits.
    assert [b.address for b in free.overflow(live_bytes=20, nbytes=20)] == [1]
    assert free.bytes == 50 and len(free) == 2
    assert free.take(20).address == 3  # the younger block of that size survived
    # nothing fits a block over the limit: every kept block goes back
    assert [b.address for b in free.overflow(live_bytes=0, nbytes=101)] == [2]
    assert free.bytes == 0 and free.drain() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "take", "overflow"]),
                          st.sampled_from([4, 8, 16, 32])), max_size=60))
def test_books_stay_exact_under_any_sequence(ops):
    free, next_address, out = FreeBlocks(limit_bytes=64), 1, {}
    for op, nbytes in ops:
        if op == "put":
            block = _block(next_address, nbytes)
            next_address += 1
            free.put(block)
            out[block.address] = block
        elif op == "take":
            block = free.take(nbytes)
            if block is not None:
                assert block.nbytes == nbytes and out.pop(block.address) is block
        else:
            given_back = free.overflow(live_bytes=16, nbytes=nbytes)
            for block in given_back:
                assert out.pop(block.address) is block  # never handed out twice
            assert 16 + free.bytes + nbytes <= 64 or len(free) == 0
        assert free.bytes == sum(b.nbytes for b in out.values()) and len(free) == len(out)
    assert sorted(b.address for b in free.drain()) == sorted(out)


def test_host_arena_reuses_freed_blocks_and_stays_within_its_cap():
    arena = CpuBackend(cap_bytes=100)
    a, b = arena.alloc(40), arena.alloc(40)
    arena.free_after(a, None)
    assert arena.used_bytes() == 80 and arena.kept_bytes() == 40
    again = arena.alloc(40)
    assert again.address == a.address and again.data is a.data  # the same memory, not a new block
    arena.free_after(again, None)
    # 60 bytes do not fit beside the live 40 and the kept 40: the kept block is given back first.
    c = arena.alloc(60)
    assert arena.kept_bytes() == 0 and arena.used_bytes() == 100 and c.address not in (a.address, b.address)
    assert arena.peak_bytes() == 100
    arena.free_after(b, None)
    arena.free_after(c, None)
    arena.trim()
    assert arena.used_bytes() == 0 and arena.live_blocks() == 0
