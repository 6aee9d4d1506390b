"""The floor: the smallest weight budget a residency policy runs with safely.

`floor(order, lookahead)` is the smallest budget any eviction policy
(engine/policy/eviction.py) runs safely with:

    pair_bytes     = max over consecutive positions i, i+1 of bytes(K_i ∪ K_{i+1});
                     cyclic, since steps repeat, so (last, first) is a pair too.
                     A weight read by both kernels counts once.
    headroom_bytes = max over i of bytes(K_{i+2} ∪ ... ∪ K_{i+L}) for lookahead
                     L >= 2; 0 for L <= 1.
    bytes          = pair_bytes + headroom_bytes

The pair is what must be on the device together: while kernel i+1 is issued,
kernel i may still be running on the GPU and reading its weights, so neither set
may be evicted. The headroom is the room the copy stream needs to have the rest
of the lookahead window (beyond the next kernel) in flight. Above the floor every
demand fetch finds room without evicting a weight of the current or the
previous kernel, so no policy ever causes a use-after-evict hazard.

`pair_bytes` is the hard minimum: under it K_{i-1} ∪ K_i cannot be resident
together and a hazard is certain. `bytes`, the floor, is the advised minimum and
the one execute refuses below: between the two nothing breaks (a demand fetch
evicts prefetched weights, never the pair), but the prefetches run short of the
lookahead and the step stalls on copies.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError
from engine.policy import AccessOrder


def reads(order: AccessOrder, position: int) -> tuple[str, ...]:
    """K_position without repeats, in read order."""
    return tuple(dict.fromkeys(order.reads[position]))


def widest_window(order: AccessOrder, length: int) -> tuple[int, int]:
    """(bytes, i) of the first cyclic window K_i ∪ ... ∪ K_{i+length-1} (length >= 1)
    with the most bytes; a weight read by several of its kernels counts once.

    The window slides one kernel at a time, counting how many of its kernels
    read each weight, so the cost is the reads, not the reads x length.
    """
    n, sizes = len(order), order.sizes
    length = min(length, n)  # a longer cyclic window holds every kernel already
    sets = [frozenset(r) for r in order.reads]
    readers: dict[str, int] = {}  # weight -> kernels in the window that read it
    held = 0  # bytes of the window's union

    def enter(p: int) -> None:
        nonlocal held
        for w in sets[p % n]:
            readers[w] = readers.get(w, 0) + 1
            if readers[w] == 1:
                held += sizes[w]

    def leave(p: int) -> None:
        nonlocal held
        for w in sets[p % n]:
            readers[w] -= 1
            if readers[w] == 0:
                held -= sizes[w]

    for p in range(length):
        enter(p)
    best, at = held, 0
    for i in range(1, n):
        leave(i - 1)
        enter(i + length - 1)
        if held > best:  # strict: the first widest window wins
            best, at = held, i
    return best, at


@dataclass(frozen=True)
class Floor:
    """The smallest budget that runs without hazards (module docstring)."""

    bytes: int
    pair_bytes: int
    headroom_bytes: int
    kernels: tuple[str, str]  # the consecutive pair that sets pair_bytes


def floor(order: AccessOrder, lookahead: int) -> Floor:
    """Floor of `order` with `lookahead` kernels prefetched ahead."""
    n = len(order)
    if n == 0:
        raise ConfigError("the access order is empty; the model spec produced no kernels")
    pair_bytes, pair_at = widest_window(order, 2)  # the first maximal pair names the floor
    # K_{i+2} ∪ ... ∪ K_{i+L} over every i: every window of L - 1 kernels
    headroom = widest_window(order, lookahead - 1)[0] if lookahead >= 2 else 0
    return Floor(
        bytes=pair_bytes + headroom,
        pair_bytes=pair_bytes,
        headroom_bytes=headroom,
        kernels=(order.kernels[pair_at], order.kernels[(pair_at + 1) % n]),
    )
