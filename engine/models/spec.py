"""Model specs: every weight and every kernel of a model, as the planner, the
simulator and the executor all read them.

A `ModelSpec` is built (engine.models.build_spec) from `conf/model/*.yaml`
(shapes, never weights) and the workload (token counts), so the same spec
answers "how many bytes" and "how many FLOPs".

Kernel granularity (one `Kernel` = one unit of launch order and of weight fetch):
- one kernel per linear, or per group of linears that share one input (to_q,
  to_k, to_v fused as `...qkv`, with the q/k RMSNorm weights they feed);
- one `attention` kernel per attention core (SDPA; reads no weights);
- norm kernels (norm + adaLN modulation) and `ada` kernels that read a block's
  scale_shift tables and produce its modulation values once per block.
Weights keep their checkpoint names (diffusers for DiT and FLUX, Hugging Face
for Llama); kernels are `blocks.{i}.<part>` inside blocks and the module path
outside them.

Saved-tensor accounting (`Kernel.saved`): what autograd keeps for backward in a
LoRA step, deduplicated by tensor (a tensor saved by two kernels is listed
once, at the first). Autograd saves an operand only when the other side needs
a gradient, and in a LoRA step only the adapters train, so:
- a frozen linear saves no activation (it saves its frozen weight, which is
  not listed: backward fetches weights again through `Kernel.weights`);
- an adapted linear saves its input (for lora_A) and the rank-r intermediate
  (for lora_B), once per adapter;
- RMSNorm saves its input and fp32 rstd; LayerNorm its input, mean and rstd;
  GELU its input; SwiGLU the gate, silu(gate) and up;
- attention saves q, k, v, its output and the fp32 logsumexp.
Nothing is saved for a tensor that needs no gradient (one that depends on no
adapter: the frozen embedders, block 0's input). Modulation operands of shape
(batch, 1, width) are left out: per-sample vectors, well under 0.1 % of the
total. The same accounting fills `saved` for every workload kind; consumers
that do not train ignore it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Protocol, Sequence

from omegaconf import MISSING

from engine.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of the checkpoint, by its checkpoint name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bf16"

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class SavedTensor:
    """A tensor autograd keeps from a forward kernel for its backward."""

    name: str
    nbytes: int
    layer: int


@dataclass(frozen=True)
class Kernel:
    """One unit of launch order: reads `weights`, does `flops`, touches `io_bytes`.

    `layer` is the block index (0..num_layers-1), or -1 outside the blocks.
    `op` says which time predictor applies (matmul-bound or memory-bound);
    `shape` is what its time depends on beyond `op` (engine/compute.py): a
    linear's (rows, output features summed over its fused linears, input
    features), an attention core's (batch x heads, query length, key length,
    head dim); empty for memory-bound ops, whose time follows `io_bytes`.
    `passes` are the memory-bound passes it runs besides its core op (norms,
    modulation, gates, residual adds, GELU, copies; engine/models/builder.py counts
    them, each by the kind of its cost per byte): bytes moved, where `io_bytes` counts its activations in and out (what
    is alive together) and its weights.
    """

    name: str
    layer: int
    op: str  # "linear" | "attention" | "norm" | "elementwise" | "embed"
    weights: tuple[str, ...]
    flops: int
    io_bytes: int = 0
    saved: tuple[SavedTensor, ...] = ()
    shape: tuple[int, ...] = ()
    passes: tuple[tuple[str, int], ...] = ()  # (kind, bytes moved) of its memory passes (engine/compute.py)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    num_layers: int
    weights: dict[str, WeightSpec]
    kernels: tuple[Kernel, ...]
    meta: dict = field(default_factory=dict)

    @property
    def param_count(self) -> int:
        return sum(w.numel for w in self.weights.values())

    @property
    def model_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())

    def kernel_bytes(self, k: Kernel) -> int:
        return sum(self.weights[w].nbytes for w in k.weights)


class SpecError(ConfigError):
    """A shape file or workload that cannot describe a model; the message names the field and the fix."""


@dataclass
class ModelConfig:
    """The fields every family's schema starts with. Each family subclasses it
    (engine/models/<family>.py) and conf/model/*.yaml extend the subclass through
    Hydra's ConfigStore, so a wrong key or type fails at compose time."""

    name: str = MISSING
    family: str = MISSING  # the key of engine.models.FAMILIES
    dtype: str = "bf16"  # of every weight and activation (DTYPE_BYTES)
    num_layers: int = MISSING  # transformer blocks


class WorkloadShape(Protocol):
    """What a spec needs from a workload (engine.config.WorkloadConfig has it)."""

    kind: str
    batch: int
    video_tokens: int
    audio_tokens: int
    text_tokens: int
    context_tokens: int
    lora_rank: int


def is_adapted(module: str, targets: Sequence[str]) -> bool:
    """True when LoRA targets the linear `module` (a target matches a trailing name part)."""
    return any(module == t or module.endswith("." + t) for t in targets)


# ---------------------------------------------------------------------------
# Checks the families' configs and builders share.


def check_positive(cfg: Any, *keys: str) -> None:
    """Every `model.<key>` is > 0."""
    for key in keys:
        value = getattr(cfg, key)
        if value <= 0:
            raise SpecError(f"model.{key}={value} must be positive; set it to the model's size")


def check_product(cfg: Any, heads: str, head_dim: str, dim: str) -> None:
    """`model.<heads> * model.<head_dim> == model.<dim>`."""
    h, hd, d = getattr(cfg, heads), getattr(cfg, head_dim), getattr(cfg, dim)
    if h * hd != d:
        raise SpecError(f"model.{heads}*model.{head_dim} = {h}*{hd} = {h * hd} != model.{dim}={d}; "
                        f"fix {heads} or {head_dim} so their product is {dim}")


def require_tokens(value: int, key: str, model: str) -> None:
    """A workload token count `workload.<key>` that model `model` needs is > 0."""
    if value <= 0:
        raise SpecError(f"workload.{key}={value} but model {model} needs it; set workload.{key} > 0")
