"""TransformerEngine-style sync dict: derivation, validation and the policy."""
from __future__ import annotations

import pytest

from engine.config import ActivationsConfig, PoolConfig
from engine.errors import ConfigError
from engine.policy import Decision
from engine.policy.sync import SyncDictPolicy, derive_sync_dict, validate_sync_dict

MB = 1_000_000


def test_derive_for_8_layers_3_offloaded():
    assert derive_sync_dict(8, 3) == {
        0: (5, -1, 5, -1),
        1: (6, -1, 6, -1),
        2: (7, -1, 7, -1),
    }


@pytest.mark.parametrize("k", [0, -1, 8, 9])
def test_derive_rejects_k_outside_1_to_n_minus_1(k):
    with pytest.raises(ConfigError, match=rf"num_offload_layers={k} must be in 1\.\.7"):
        derive_sync_dict(8, k)


@pytest.mark.parametrize("d, reason", [
    ({8: [9, -1, 9, -1]}, r"layer 8: outside 0\.\.7"),
    ({-1: [5, -1, 5, -1]}, r"layer -1: outside 0\.\.7"),
    ({2: [5, -1, 5]}, "layer 2: needs 4 integers"),
    ({2: [5, -1, 5, -1, 0]}, "layer 2: needs 4 integers"),
    ({2: [5, -1, 5.5, -1]}, "layer 2: needs 4 integers"),
    ({2: [2, -1, 5, -1]}, r"layer 2: offload_fwd=2 must be in 3\.\.7"),
    ({2: [1, -1, 5, -1]}, r"layer 2: offload_fwd=1 must be in 3\.\.7"),
    ({2: [8, -1, 5, -1]}, r"layer 2: offload_fwd=8 must be in 3\.\.7"),
    ({2: [5, 0, 5, 0]}, "layer 2: offload_num=0; use -1"),
    ({2: [5, -2, 5, -2]}, "layer 2: offload_num=-2; use -1"),
    ({2: [5, -1, 2, -1]}, r"layer 2: reload_fwd=2 must be in 3\.\.7.*too late"),
    ({2: [5, -1, 8, -1]}, r"layer 2: reload_fwd=8 must be in 3\.\.7"),
    ({2: [5, 2, 5, 1]}, "layer 2: reload_num=1 differs from offload_num=2"),
    ({"two": [5, -1, 5, -1]}, "key 'two' is not a layer number"),
])
def test_each_invalid_dict_is_rejected_with_its_reason(d, reason):
    with pytest.raises(ConfigError, match=reason):
        validate_sync_dict(d, 8)


def test_valid_dict_is_normalized_to_int_keys_and_tuples():
    assert validate_sync_dict({"1": [3, 2, 4, 2]}, 8) == {1: (3, 2, 4, 2)}


def act(**kw) -> ActivationsConfig:
    base = dict(mode="sync", num_offload_layers=2, min_tensor_bytes=MB,
                pool=PoolConfig(class_sizes_mb=[4], slabs_per_class=[1]))
    base.update(kw)
    return ActivationsConfig(**base)


def run_step(policy: SyncDictPolicy, n: int) -> dict[str, list[Decision]]:
    """One training step: per layer a 2 MB tensor a{L} and a small b{L}."""
    out: dict[str, list[Decision]] = {}
    for layer in range(n):
        out[f"fwd start {layer}"] = policy.on_layer_start("fwd", layer)
        out[f"a{layer}"] = policy.on_save(f"a{layer}", 2 * MB, layer)
        out[f"b{layer}"] = policy.on_save(f"b{layer}", MB // 2, layer)
        out[f"fwd end {layer}"] = policy.on_layer_end("fwd", layer)
    for layer in reversed(range(n)):
        out[f"bwd start {layer}"] = policy.on_layer_start("bwd", layer)
        out[f"unpack b{layer}"] = policy.on_unpack(f"b{layer}")
        out[f"unpack a{layer}"] = policy.on_unpack(f"a{layer}")
        out[f"bwd end {layer}"] = policy.on_layer_end("bwd", layer)
    policy.on_step_end()
    return {k: v for k, v in out.items() if v}


def test_derived_schedule_worked_example():
    p = SyncDictPolicy(act(), 4)  # {0: (2,-1,2,-1), 1: (3,-1,3,-1)}
    assert run_step(p, 4) == {
        "a0": [Decision(0, 0, "spill", "a0", 0)],
        "b0": [Decision(0, 0, "keep", "b0")],  # under min_tensor_bytes
        "fwd end 0": [Decision(0, 0, "offload_group", "layer0", 0)],
        "a1": [Decision(0, 1, "miss", "a1")],  # the one 4 MB slab is taken
        "b1": [Decision(0, 1, "keep", "b1")],
        "fwd end 1": [Decision(0, 1, "offload_group", "layer1", 1)],
        "fwd start 2": [Decision(0, 2, "wait_offload", "layer0", 0)],
        "a2": [Decision(0, 2, "keep", "a2")],
        "b2": [Decision(0, 2, "keep", "b2")],
        "fwd start 3": [Decision(0, 3, "wait_offload", "layer1", 1)],
        "a3": [Decision(0, 3, "keep", "a3")],
        "b3": [Decision(0, 3, "keep", "b3")],
        "unpack b3": [Decision(0, 3, "release", "b3")],
        "unpack a3": [Decision(0, 3, "release", "a3")],
        "bwd end 3": [Decision(0, 3, "reload_group", "layer1", 1)],
        "unpack b2": [Decision(0, 2, "release", "b2")],
        "unpack a2": [Decision(0, 2, "release", "a2")],
        "bwd end 2": [Decision(0, 2, "reload_group", "layer0", 0)],
        "unpack b1": [Decision(0, 1, "release", "b1")],
        "unpack a1": [Decision(0, 1, "release", "a1")],
        "unpack b0": [Decision(0, 0, "release", "b0")],
        "unpack a0": [Decision(0, 0, "release", "a0")],
    }
    c = p.history[0]
    assert (c.saved, c.kept, c.spilled, c.restored, c.spill_bytes, c.restore_bytes) == (
        8, 6, 2, 2, 4 * MB, 4 * MB)
    assert (c.pool_hits, c.pool_misses) == (1, 1)
    # the groups leave the device at their wait: at the end of forward only
    # b0..b3, a2 and a3 are there
    assert c.peak_device_bytes == 4 * (MB // 2) + 2 * (2 * MB)
    assert p.saved.pool.in_use(0) == 0


def test_steps_repeat_with_the_same_decisions():
    p = SyncDictPolicy(act(), 4)
    first = run_step(p, 4)
    second = run_step(p, 4)
    assert [(d.action, d.target) for ds in first.values() for d in ds] == [
        (d.action, d.target) for ds in second.values() for d in ds]
    assert {d.step for ds in second.values() for d in ds} == {1}


def test_offload_num_takes_the_first_large_tensors_in_save_order():
    p = SyncDictPolicy(act(sync_dict={0: [1, 2, 1, 2]}, pool=PoolConfig()), 2)
    answers = [p.on_save(name, nbytes, 0)[0].action
               for name, nbytes in [("x", 3 * MB), ("small", 10), ("y", 3 * MB), ("z", 3 * MB)]]
    # without a pool every group member goes to unpinned host memory: a miss
    assert answers == ["miss", "keep", "miss", "keep"]
    assert p.counters.pool_misses == 2


def test_unpack_before_the_group_reload_restores_on_demand():
    p = SyncDictPolicy(act(), 4)
    p.on_save("a0", 2 * MB, 0)
    p.on_layer_end("fwd", 0)
    assert p.on_unpack("a0") == [Decision(0, 0, "restore", "a0"), Decision(0, 0, "release", "a0")]
    assert p.counters.restored == 1
    # the later group reload does not count it twice
    p.on_layer_end("bwd", 2)
    assert p.counters.restored == 1


def test_wait_before_the_group_was_offloaded_is_a_driver_error():
    p = SyncDictPolicy(act(), 4)
    with pytest.raises(ValueError, match="before the forward of layer 0 ended"):
        p.on_layer_start("fwd", 2)


def test_policy_rejects_an_invalid_dict_from_the_config():
    with pytest.raises(ConfigError, match="layer 1: reload_fwd=0"):
        SyncDictPolicy(act(sync_dict={1: [2, -1, 0, -1]}), 4)
    with pytest.raises(ConfigError, match="num_offload_layers=4 must be in 1..3"):
        SyncDictPolicy(act(num_offload_layers=4), 4)
