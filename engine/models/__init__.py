"""Models: each family's schema, spec builder and forward, and the registry that
maps the model yaml's `family` key to them.

    spec.py      ModelSpec and its parts, ModelConfig (every family's base), SpecError
    builder.py   SpecBuilder: weights and kernels in launch order, FLOPs, IO, saved tensors
    run.py       the forward's fetch contract (Run), WeightSource, DictSource
    layers.py    the torch pieces the forwards share
    seeded.py    seeded inputs (Draw) and random_weights
    lora.py      LoRA adapters, the step's loss and its update
    liveness.py  the activation bytes the forward holds at its peak, traced on the meta device
    dit.py       family dit (its variants: ltx.py, wan.py); flux.py; llama.py

A family's file holds its config dataclass (a ModelConfig), `check`,
`LORA_TARGETS`, `build` (the spec), `forward` (the torch math, one kernel of the
spec at a time) and `inputs`. Adding one: that file, its entry in FAMILIES, and
conf/model/<name>.yaml with `defaults: [<family>_schema, _self_]`.

Building a spec does not load torch (the planner runs without it): this module
and the family files import run.py, layers.py and torch inside the functions
that compute, not at the top. The simulator loads it once per synthesized
inference trace, to trace the forward's live activations on the meta device
(liveness.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.models import dit, flux, llama, ltx, wan
from engine.models.builder import SpecBuilder, Tokens
from engine.models.spec import DTYPE_BYTES, ModelConfig, ModelSpec, SpecError, WorkloadShape, check_positive

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from engine.models.run import Run, WeightSource
    from engine.models.seeded import Draw


@dataclass(frozen=True)
class Architecture:
    """What one architecture provides: its spec builder, its forward and its inputs."""

    build: Callable[[SpecBuilder, Any], None]
    forward: Callable[[Run, Mapping[str, Tensor]], dict[str, Tensor]]
    inputs: Callable[[Mapping[str, Any], WorkloadShape, Draw], dict[str, Tensor]]


@dataclass(frozen=True)
class Family:
    """One value of the model yaml's `family` key."""

    config: type  # its schema, stored as "<family>_schema" for conf/model/*.yaml
    check: Callable[[Any], None]  # what the schema's types cannot say
    lora_targets: tuple[str, ...]  # adapted linears when the workload names none
    variants: Mapping[str, Architecture]  # by the yaml's `variant` key; "" for a family without one
    # The block counts (config fields) of its shortest model with every kind of block twice:
    # liveness.py traces that one (a kind's second block holds what every later one does).
    shortest: Mapping[str, int]


FAMILIES: dict[str, Family] = {
    "dit": Family(dit.DitModelConfig, dit.check, dit.LORA_TARGETS,
                  {"ltx": Architecture(ltx.build, ltx.forward, ltx.inputs),
                   "wan": Architecture(wan.build, wan.forward, wan.inputs)}, {"num_layers": 2}),
    "flux": Family(flux.FluxModelConfig, flux.check, flux.LORA_TARGETS,
                   {"": Architecture(flux.build, flux.forward, flux.inputs)},
                   {"num_layers": 4, "num_double_layers": 2}),
    "llama": Family(llama.LlamaModelConfig, llama.check, llama.LORA_TARGETS,
                    {"": Architecture(llama.build, llama.forward, llama.inputs)}, {"num_layers": 2}),
}
MODEL_SCHEMAS: dict[str, type] = {name: family.config for name, family in FAMILIES.items()}
MODEL_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"


def available_models() -> list[str]:
    """Spec models: names `load_spec` accepts (conf/model/*.yaml without a `module`, which
    names a real module: engine/modules)."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml") if "module" not in OmegaConf.load(p))


def model_config(model_cfg: Any) -> ModelConfig:
    """A typed, checked config from a dataclass, a dict or a (possibly untyped) DictConfig."""
    if is_dataclass(model_cfg) and not isinstance(model_cfg, type):
        cfg = model_cfg
    else:
        node = model_cfg if isinstance(model_cfg, DictConfig) else OmegaConf.create(dict(model_cfg))
        family = node.get("family")
        if family not in MODEL_SCHEMAS:
            raise SpecError(f"model.family={family!r} is not one of {', '.join(MODEL_SCHEMAS)}; "
                            "set family in the model yaml to one of them")
        node = OmegaConf.masked_copy(node, [k for k in node.keys() if k != "defaults"])
        try:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MODEL_SCHEMAS[family]), node))
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or "?"
            reason = str(err).splitlines()[0]
            raise SpecError(f"model.{key}: {reason}; fix that key in the model yaml "
                            f"(fields of {MODEL_SCHEMAS[family].__name__})") from None
    _check(cfg)
    return cfg


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Read `conf/model/NAME.yaml` (or a path) outside Hydra: the defaults list is dropped
    and the family's schema applied, as Hydra's compose would."""
    path = Path(name_or_path)
    if not path.suffix:
        path = MODEL_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise SpecError(f"no model file {path}; use one of: {', '.join(available_models())}")
    return model_config(OmegaConf.load(path))


def _check(cfg: ModelConfig) -> None:
    expected = next(f for f, s in MODEL_SCHEMAS.items() if isinstance(cfg, s))
    if cfg.family != expected:
        raise SpecError(f"model.family={cfg.family!r} but the fields are {type(cfg).__name__}'s; "
                        f"set family: {expected}")
    if cfg.dtype not in DTYPE_BYTES:
        raise SpecError(f"model.dtype={cfg.dtype!r} is not one of {', '.join(DTYPE_BYTES)}; pick one of those")
    check_positive(cfg, "num_layers")
    family = FAMILIES[expected]
    if _variant(cfg) not in family.variants:
        raise SpecError(f"model.variant={_variant(cfg)!r} is not one of {', '.join(family.variants)}; pick one")
    family.check(cfg)


def _variant(cfg: ModelConfig) -> str:
    return getattr(cfg, "variant", "")


def build_spec(model_cfg: Any, workload: WorkloadShape) -> ModelSpec:
    """Every weight and every forward kernel, in launch order, for this model and workload.

    `model_cfg`: a family dataclass, or a (Hydra-composed or plain) DictConfig / dict.
    `workload`: anything with kind, batch, video/audio/text/context tokens and
    lora_rank (and optionally lora_targets)."""
    cfg = model_config(model_cfg)
    if workload.batch <= 0:
        raise SpecError(f"workload.batch={workload.batch} must be positive")
    family = FAMILIES[cfg.family]
    targets = tuple(getattr(workload, "lora_targets", None) or family.lora_targets)
    tok = Tokens(workload.kind, workload.batch, workload.video_tokens, workload.audio_tokens,
                 workload.text_tokens, workload.context_tokens, max(workload.lora_rank, 0), targets)
    b = SpecBuilder(cfg.dtype, tok)
    family.variants[_variant(cfg)].build(b, cfg)
    meta = {"config": asdict(cfg), "workload": asdict(tok), "lora_targets": targets}
    return b.finish(cfg, meta)


def load_spec(model: str | Path, workload: WorkloadShape) -> ModelSpec:
    """`build_spec` for a model by name (conf/model/NAME.yaml) or yaml path."""
    return build_spec(load_model_config(model), workload)


def shortest(spec: ModelSpec, workload: WorkloadShape) -> ModelSpec:
    """`spec` with its blocks cut to its family's `shortest` counts: the same blocks, the
    same layers outside them, fewer repeats (a model with fewer blocks: itself)."""
    cfg = spec.meta["config"]
    cut = {k: min(cfg[k], n) for k, n in FAMILIES[spec.family].shortest.items()}
    return spec if all(cfg[k] == n for k, n in cut.items()) else build_spec({**cfg, **cut}, workload)


def architecture(spec: ModelSpec) -> Architecture:
    """The family (and variant) code that runs `spec`: its forward and its inputs."""
    return FAMILIES[spec.family].variants[spec.meta["config"].get("variant", "")]


def forward(spec: ModelSpec, source: WeightSource, inputs: Mapping[str, Tensor],
            lora: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Run the model: `source.fetch(i)` once per kernel, in spec order, then kernel i's math
    (the contract engine/models/run.py states). LoRA adapters (`init_lora`) add
    `B(A(x))` (scale 1, i.e. alpha = rank) to the linears they target."""
    from engine.models.run import Run

    run = Run(spec, source, lora)
    out = architecture(spec).forward(run, inputs)
    run.finish()
    return out


def make_inputs(spec: ModelSpec, workload: WorkloadShape, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None, seed: int = 0) -> dict[str, Tensor]:
    """Random, seeded inputs of the shapes `forward` expects for this workload."""
    from engine.models.run import TORCH_DTYPES
    from engine.models.seeded import Draw

    c = spec.meta["config"]
    draw = Draw(seed, workload.batch, device, dtype or TORCH_DTYPES[c["dtype"]])
    return architecture(spec).inputs(c, workload, draw)
