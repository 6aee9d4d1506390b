"""The exact pinned pool for one step: `activations.pool.exact=true` (activations/pool=exact).

A fixed size-class pool whose classes do not fit the step's saved tensors sends
their spills to unpinned memory, and every such miss is a pageable copy that
blocks the host. The exact pool has one class per saved size the policy may
spill, with as many slabs as the policy books at once in the step, found by
putting the step's questions to a policy with room for everything: no miss, no
rounding, and no slab that is never used.

The questions come from a trace (`schedule.step_questions`, the order both
drivers ask in) or from an executor's recorded step. A recorded trace
(mode=record) holds the tensors autograd really saves, so its pool is exact for
the executor too; a synthesized trace approximates them (it lists, e.g., a
norm's saved input in the model dtype where autograd keeps float32), and the
executor's spills that do not fit a class then fall back to unpinned memory and
count as misses.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from engine.errors import ConfigError
from engine.policy.activations import build_activation_policy
from engine.policy.saved import SlabClasses
from engine.policy.schedule import Question, ask
from engine.units import MB


def exact_pool(act_cfg: Any, questions: Sequence[Question], num_layers: int) -> dict[str, list]:
    """`{"class_sizes_mb": [...], "slabs_per_class": [...]}` holding every spill of
    the step in `questions` under `act_cfg`'s policy (whose own pool is ignored)."""
    counts = Counter(q[2] for q in questions if q[0] == "save" and q[2] >= act_cfg.min_tensor_bytes)
    if not counts:
        raise ConfigError(f"activations.pool.exact: no saved tensor of this step reaches min_tensor_bytes="
                          f"{act_cfg.min_tensor_bytes}, so nothing can spill; lower min_tensor_bytes or use "
                          "activations=off")
    sizes = sorted(counts)
    roomy = SlabClasses([s / MB for s in sizes], [counts[s] for s in sizes])
    policy = build_activation_policy(act_cfg, num_layers, pool=roomy)
    books = policy.saved.pool
    most = [0] * len(sizes)
    for q in questions:
        for d in ask(policy, q):
            if d.action == "spill":
                most[d.detail] = max(most[d.detail], books.in_use(d.detail))
    used = [c for c in range(len(sizes)) if most[c]]
    if not used:  # the watermarks are never crossed: one slab of the smallest size keeps the pool valid
        return {"class_sizes_mb": [sizes[0] / MB], "slabs_per_class": [1]}
    slabs = [most[c] for c in used]
    cap = act_cfg.pool.max_mb
    if cap is not None:
        slabs = capped([sizes[c] for c in used], slabs, round(cap * MB))
    kept = [i for i, n in enumerate(slabs) if n]
    if not kept:
        raise ConfigError(f"activations.pool.max_mb={cap} holds no slab of this step (the smallest spill is "
                          f"{min(sizes[c] for c in used) / MB:.1f} MB); raise it or use activations=off")
    return {"class_sizes_mb": [sizes[used[i]] / MB for i in kept], "slabs_per_class": [slabs[i] for i in kept]}


def capped(sizes: Sequence[int], slabs: Sequence[int], cap_bytes: int) -> list[int]:
    """`slabs` per class of `sizes` bytes cut to fit `cap_bytes`: every class scaled by
    the same share, then the room left filled a slab at a time, smallest class first.
    The spills the cut slabs would have held go to unpinned memory (pool misses)."""
    total = sum(s * n for s, n in zip(sizes, slabs))
    if total <= cap_bytes:
        return list(slabs)
    out = [n * cap_bytes // total for n in slabs]
    room = cap_bytes - sum(s * n for s, n in zip(sizes, out))
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        extra = slabs[i] - out[i] if not sizes[i] else min(slabs[i] - out[i], room // sizes[i])
        out[i] += extra
        room -= extra * sizes[i]
    return out
