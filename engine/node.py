"""Several GPUs of one host (`node`): each replica's share of the node's links, and
the node's host memory.

Every replica runs the same job at the same budget, in step, so when all of them
copy at once each gets at most an even share of what the node's shared path
carries (`node.shared_h2d_gbps`, `shared_d2h_gbps`): the simulator runs one
replica on its GPU's link capped at that share, and the node's figures follow
from it. Host memory: the weight file is mapped by every replica, so the page
cache holds it once (and a registered mapping pins those same pages once);
`weights.source=pinned` or `pageable` copies it into each replica instead. Each
replica's activation pool is pinned memory of its own: the node's pinned budget,
less the registered weights, split evenly (`replica_pool_mb`), caps each one.
"""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from engine.errors import ConfigError
from engine.units import MB

SHARED_SOURCES = ("mmap_registered", "mmap")  # the page cache holds one copy for every replica


def replica_hardware(cfg: Any) -> Any:
    """The hardware one replica sees when every replica of `cfg.node` copies at once."""
    node, hw = cfg.node, cfg.hardware
    share_h2d = node.shared_h2d_gbps / node.gpus if node.shared_h2d_gbps is not None else None
    share_d2h = node.shared_d2h_gbps / node.gpus if node.shared_d2h_gbps is not None else None
    changes: dict[str, Any] = {}
    if share_h2d is not None and share_h2d < hw.h2d_gbps:
        scale = share_h2d / hw.h2d_gbps
        changes.update({k: min(hw[k], share_h2d) for k in ("h2d_gbps", "pageable_gbps", "mmap_gbps",
                                                           "mmap_registered_gbps")})
        changes["small_copy_gbps"] = [g * scale for g in hw.small_copy_gbps]
    if share_d2h is not None and share_d2h < hw.d2h_gbps:
        changes["d2h_gbps"] = share_d2h
    if changes:
        h2d = changes.get("h2d_gbps", hw.h2d_gbps)
        d2h = changes.get("d2h_gbps", hw.d2h_gbps)
        changes["duplex_gbps"] = min(hw.duplex_gbps, h2d + d2h)
        changes["name"] = f"{hw.name} ({node.gpus} replicas on {node.name})"
        return OmegaConf.merge(hw, changes)
    return hw


def pool_bytes(cfg: Any) -> int:
    """Pinned bytes of one replica's activation pool (0 when nothing spills)."""
    act = cfg.activations
    if act.mode == "off":
        return 0
    return round(sum(s * n for s, n in zip(act.pool.class_sizes_mb, act.pool.slabs_per_class)) * MB)


def replica_pool_mb(pinned_budget_mb: float, pinned_weight_bytes: int, replicas: int) -> float:
    """One replica's share of a node's pinned budget for its activation pool (MB): what
    the pinned weights leave, split evenly between `replicas`."""
    share = (pinned_budget_mb * MB - pinned_weight_bytes) / replicas / MB
    if share <= 0:
        raise ConfigError(f"a node pinned budget of {pinned_budget_mb:.0f} MB leaves no pinned memory for the "
                          f"activation pools: the weights pin {pinned_weight_bytes / 1e9:.2f} GB; raise the "
                          "budget, or read the weights unregistered (source mmap)")
    return share


def pool_share_mb(cfg: Any, model_bytes: int) -> float | None:
    """`replica_pool_mb` of `cfg.node` (None without a node budget)."""
    node = cfg.node
    if node.pinned_budget_mb is None:
        return None
    return replica_pool_mb(node.pinned_budget_mb, pinned_weight_bytes(cfg, model_bytes), node.gpus)


def pinned_weight_bytes(cfg: Any, model_bytes: int) -> int:
    """Host bytes the node's weights pin: a registered mapping once (the page cache's pages
    serve every replica), a pinned copy once per replica, nothing for unpinned sources."""
    return {"mmap_registered": model_bytes, "pinned": cfg.node.gpus * model_bytes}.get(cfg.weights.source, 0)


def node_prediction(cfg: Any, pred: dict, model_bytes: int) -> dict:
    """The node's figures from one replica's prediction `pred`."""
    node, source, gpus = cfg.node, cfg.weights.source, cfg.node.gpus
    weights_host = model_bytes if source in SHARED_SOURCES else gpus * model_bytes
    pinned = gpus * pool_bytes(cfg) + pinned_weight_bytes(cfg, model_bytes)
    host = weights_host + gpus * pool_bytes(cfg)
    return {
        "node": node.name, "gpus": gpus, "replica_step_ms": pred["step_ms"],
        "steps_per_s": gpus * 1000 / pred["step_ms"] if pred["step_ms"] else None,
        "h2d_gbps": gpus * pred["h2d_bytes"] / (pred["step_ms"] * 1e6) if pred["step_ms"] else None,
        "host_weight_bytes": weights_host, "pinned_bytes": pinned, "host_bytes": host,
        "pinned_budget_bytes": None if node.pinned_budget_mb is None else round(node.pinned_budget_mb * MB),
        "host_ram_bytes": None if node.host_ram_mb is None else round(node.host_ram_mb * MB),
    }


def node_failures(figures: dict) -> list[str]:
    """One line per node limit the replicas would break."""
    out = []
    gb = 1e9
    if figures["pinned_budget_bytes"] is not None and figures["pinned_bytes"] > figures["pinned_budget_bytes"]:
        out.append(f"{figures['gpus']} replicas pin {figures['pinned_bytes'] / gb:.2f} GB of host memory, over "
                   f"node.pinned_budget_mb ({figures['pinned_budget_bytes'] / gb:.2f} GB)")
    if figures["host_ram_bytes"] is not None and figures["host_bytes"] > figures["host_ram_bytes"]:
        out.append(f"{figures['gpus']} replicas need {figures['host_bytes'] / gb:.2f} GB of host RAM (weights "
                   f"{figures['host_weight_bytes'] / gb:.2f} GB and their pinned pools), over the node's "
                   f"{figures['host_ram_bytes'] / gb:.2f} GB")
    return out
