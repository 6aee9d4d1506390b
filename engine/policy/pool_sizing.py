"""The exact pinned pool for one step: `activations.pool.exact=true` (activations/pool=exact).

A fixed size-class pool (Activation Stagehand's: two slabs each of 64 and 256
MB) sends most spills of an LTX-2 step to unpinned memory: its saved tensors
are 25-200 MB and a step spills dozens of them. Every such miss is a pageable
copy that blocks the host. The exact pool has one class per saved size the
policy may spill, with as many slabs as the policy books at once in the step,
found by putting the step's questions to a policy with room for everything:
no miss, no rounding, and no slab that is never used.

The questions come from the trace (the order the simulator asks them in) or
from an executor's recorded step. A recorded trace (mode=record) holds the
tensors autograd really saves, so its pool is exact for the executor too; a
synthesized trace approximates them (it lists, e.g., a norm's saved input in
the model dtype where autograd keeps float32), and the executor's spills that
do not fit a class then fall back to unpinned memory and count as misses.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterable, Sequence

from engine.errors import ConfigError
from engine.policy import Question, ask
from engine.units import MB



def step_questions(records: Iterable[Any]) -> list[Question]:
    """The questions one step of a trace's kernel records puts to the activation
    policy, in the simulator's order (sim/host.py): at a layer boundary the
    previous layer's end, then the new layer's start; a kernel's unpacks before it
    runs, its saves after."""
    out: list[Question] = []
    boundary: tuple[str, int] | None = None
    for rec in records:
        if boundary != (rec.phase, rec.layer):
            if boundary is not None and boundary[1] >= 0:
                out.append(("layer_end", *boundary))
            if rec.layer >= 0:
                out.append(("layer_start", rec.phase, rec.layer))
            boundary = (rec.phase, rec.layer)
        out += [("unpack", name) for name in rec.needs]
        out += [("save", s.name, s.nbytes, s.layer) for s in rec.saved]
    if boundary is not None and boundary[1] >= 0:
        out.append(("layer_end", *boundary))
    out.append(("step_end",))
    return out


def exact_pool(act_cfg: Any, questions: Sequence[Question], num_layers: int) -> dict[str, list]:
    """`{"class_sizes_mb": [...], "slabs_per_class": [...]}` holding every spill of
    the step in `questions` under `act_cfg`'s policy (whose own pool is ignored)."""
    from engine.config import ActivationsConfig, PoolConfig
    from engine.policy.activations import build_activation_policy

    counts = Counter(q[2] for q in questions if q[0] == "save" and q[2] >= act_cfg.min_tensor_bytes)
    if not counts:
        raise ConfigError(f"activations.pool.exact: no saved tensor of this step reaches min_tensor_bytes="
                          f"{act_cfg.min_tensor_bytes}, so nothing can spill; lower min_tensor_bytes or use "
                          "activations=off")
    sizes = sorted(counts)
    fields = {f.name: getattr(act_cfg, f.name) for f in dataclasses.fields(ActivationsConfig)}
    roomy = PoolConfig([s / MB for s in sizes], [counts[s] for s in sizes])
    policy = build_activation_policy(ActivationsConfig(**{**fields, "pool": roomy}), num_layers)
    books = policy.saved.pool
    most = [0] * len(sizes)
    for q in questions:
        for d in ask(policy, q):
            if d.action == "spill":
                most[d.detail] = max(most[d.detail], books.in_use(d.detail))
    used = [c for c in range(len(sizes)) if most[c]]
    if not used:  # the watermarks are never crossed: one slab of the smallest size keeps the pool valid
        return {"class_sizes_mb": [sizes[0] / MB], "slabs_per_class": [1]}
    return {"class_sizes_mb": [sizes[c] / MB for c in used], "slabs_per_class": [most[c] for c in used]}
