"""Model specs: every weight and every kernel of a model, built from a shape file.

A `ModelSpec` is what the planner, the simulator and the executor agree on. It
is built from `conf/model/*.yaml` (shapes, never weights) and the workload
(token counts), so the same spec answers "how many bytes" and "how many FLOPs".

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
(batch, 1, width) are left out: per-sample vectors, well under 0.1 %.
The same accounting fills `saved` for every workload kind; consumers that do
not train ignore it. Checked against CUDA autograd (torch 2.11, H100) on the
16-block LTX-2 LoRA step at 6144 video / 128 audio / 256 text tokens, rank 32,
running engine.models: 19.815 GB here, 19.818 GB of unique non-weight
storages packed by autograd (the difference: the per-sample operands).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass
from math import prod
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence, Union

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

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
    `op` says which time predictor applies (matmul-bound or memory-bound).
    """

    name: str
    layer: int
    op: str  # "linear" | "attention" | "norm" | "elementwise" | "embed"
    weights: tuple[str, ...]
    flops: int
    io_bytes: int = 0
    saved: tuple[SavedTensor, ...] = ()


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


# ---------------------------------------------------------------------------
# Family schemas: conf/model/*.yaml extend these through Hydra's ConfigStore,
# so a wrong key or type fails at compose time.


@dataclass
class DitModelConfig:
    """Diffusion transformers: LTX-Video / LTX-2 (variant "ltx") and Wan2.1 (variant "wan").

    `audio_dim > 0` adds LTX-2's audio stream with its a2v/v2a cross attentions;
    0 is the single-stream LTX-Video. Wan keeps some norms and embedders in fp32
    in diffusers; here every weight has `dtype` (parameter counts are unchanged).
    """

    name: str = MISSING
    family: str = "dit"
    dtype: str = "bf16"
    num_layers: int = MISSING
    variant: str = "ltx"  # ltx | wan
    dim: int = MISSING
    heads: int = MISSING
    head_dim: int = MISSING
    ffn_dim: int = MISSING
    in_channels: int = 128  # latent channels per token (LTX: already patchified)
    patch_size: list[int] = field(default_factory=lambda: [1, 1, 1])  # (t, h, w); wan: conv3d patches
    text_dim: int = 4096  # width of the text encoder's embeddings
    timestep_dim: int = 256  # sinusoidal timestep features
    audio_dim: int = 0
    audio_heads: int = 32
    audio_head_dim: int = 64
    audio_ffn_dim: int = 8192
    audio_in_channels: int = 128
    eps: float = 1e-6


@dataclass
class FluxModelConfig:
    """FLUX.1: `num_double_layers` double-stream blocks, then the rest single-stream."""

    name: str = MISSING
    family: str = "flux"
    dtype: str = "bf16"
    num_layers: int = MISSING  # double + single blocks
    num_double_layers: int = MISSING
    dim: int = 3072
    heads: int = 24
    head_dim: int = 128
    ffn_dim: int = 12288
    in_channels: int = 64
    text_dim: int = 4096  # T5
    pooled_dim: int = 768  # CLIP pooled
    timestep_dim: int = 256
    guidance_embeds: bool = True
    eps: float = 1e-6


@dataclass
class LlamaModelConfig:
    """Llama-3 decoder: SwiGLU MLP, RMSNorm, grouped-query attention, untied embeddings."""

    name: str = MISSING
    family: str = "llama"
    dtype: str = "bf16"
    num_layers: int = MISSING
    hidden: int = MISSING
    intermediate: int = MISSING
    heads: int = MISSING
    kv_heads: int = MISSING
    head_dim: int = 128
    vocab: int = 128256
    eps: float = 1e-5


ModelConfig = Union[DitModelConfig, FluxModelConfig, LlamaModelConfig]
MODEL_SCHEMAS: dict[str, type] = {"dit": DitModelConfig, "flux": FluxModelConfig, "llama": LlamaModelConfig}

# Adapted linears when the workload names none (module-name suffixes).
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "dit": ("to_q", "to_k", "to_v", "to_out.0"),
    "flux": ("to_q", "to_k", "to_v", "to_out.0"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj"),
}

MODEL_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"


class WorkloadShape(Protocol):
    """What a spec needs from a workload (engine.config.WorkloadConfig has it)."""

    kind: str
    batch: int
    video_tokens: int
    audio_tokens: int
    text_tokens: int
    context_tokens: int
    lora_rank: int


def available_models() -> list[str]:
    """Names accepted by `+model=NAME` and `load_spec`."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def is_adapted(module: str, targets: Sequence[str]) -> bool:
    """True when LoRA targets the linear `module` (a target matches a trailing name part)."""
    return any(module == t or module.endswith("." + t) for t in targets)


# ---------------------------------------------------------------------------
# Loading and checking a shape file.


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


def _positive(cfg: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(cfg, key)
        if value <= 0:
            raise SpecError(f"model.{key}={value} must be positive; set it to the model's size")


def _product(cfg: Any, heads: str, head_dim: str, dim: str) -> None:
    h, hd, d = getattr(cfg, heads), getattr(cfg, head_dim), getattr(cfg, dim)
    if h * hd != d:
        raise SpecError(f"model.{heads}*model.{head_dim} = {h}*{hd} = {h * hd} != model.{dim}={d}; "
                        f"fix {heads} or {head_dim} so their product is {dim}")


def _check(cfg: ModelConfig) -> None:
    expected = next(f for f, s in MODEL_SCHEMAS.items() if isinstance(cfg, s))
    if cfg.family != expected:
        raise SpecError(f"model.family={cfg.family!r} but the fields are {type(cfg).__name__}'s; "
                        f"set family: {expected}")
    if cfg.dtype not in DTYPE_BYTES:
        raise SpecError(f"model.dtype={cfg.dtype!r} is not one of {', '.join(DTYPE_BYTES)}; pick one of those")
    _positive(cfg, "num_layers")
    if isinstance(cfg, DitModelConfig):
        if cfg.variant not in _DIT_VARIANTS:
            raise SpecError(f"model.variant={cfg.variant!r} is not one of {', '.join(_DIT_VARIANTS)}; pick one")
        _positive(cfg, "dim", "heads", "head_dim", "ffn_dim", "in_channels", "text_dim", "timestep_dim")
        _product(cfg, "heads", "head_dim", "dim")
        if len(cfg.patch_size) != 3 or min(cfg.patch_size) <= 0:
            raise SpecError(f"model.patch_size={list(cfg.patch_size)} must be three positive sizes (t, h, w)")
        if cfg.variant == "ltx" and list(cfg.patch_size) != [1, 1, 1]:
            raise SpecError("model.patch_size must be [1, 1, 1] for variant ltx (its latents come "
                            "patchified); drop patch_size or use variant wan")
        if cfg.audio_dim < 0:
            raise SpecError(f"model.audio_dim={cfg.audio_dim} must be 0 (no audio) or positive")
        if cfg.audio_dim:
            if cfg.variant != "ltx":
                raise SpecError("model.audio_dim > 0 needs variant ltx (the LTX-2 audio stream); set audio_dim: 0")
            _positive(cfg, "audio_heads", "audio_head_dim", "audio_ffn_dim", "audio_in_channels")
            _product(cfg, "audio_heads", "audio_head_dim", "audio_dim")
    elif isinstance(cfg, FluxModelConfig):
        _positive(cfg, "num_double_layers", "dim", "heads", "head_dim", "ffn_dim", "in_channels",
                  "text_dim", "pooled_dim", "timestep_dim")
        _product(cfg, "heads", "head_dim", "dim")
        if cfg.num_double_layers > cfg.num_layers:
            raise SpecError(f"model.num_double_layers={cfg.num_double_layers} exceeds model.num_layers="
                            f"{cfg.num_layers} (double + single blocks); raise num_layers")
    else:
        _positive(cfg, "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")
        _product(cfg, "heads", "head_dim", "hidden")
        if cfg.heads % cfg.kv_heads:
            raise SpecError(f"model.heads={cfg.heads} is not a multiple of model.kv_heads={cfg.kv_heads}; "
                            "fix kv_heads")


# ---------------------------------------------------------------------------
# The builder: weights and kernels in launch order, with FLOPs, IO and saved tensors.


@dataclass(frozen=True)
class _Tokens:
    """The workload as a builder needs it."""

    kind: str
    batch: int
    video: int
    audio: int
    text: int
    context: int
    rank: int
    targets: tuple[str, ...]


@dataclass(frozen=True)
class _Act:
    """A named activation: `rows` = batch x tokens, `width` features. The name is
    its identity for saved-tensor deduplication; `grad` says whether it depends
    on an adapter (autograd saves for backward only what such tensors need)."""

    name: str
    rows: int
    width: int
    grad: bool = False


class _Out(NamedTuple):
    """One linear of a fused group and what follows it inside the kernel."""

    module: str
    features: int
    norm: str = ""  # weight of an RMSNorm on this output ("" = none)
    gelu: bool = False  # GELU-tanh on this output


class _Builder:
    def __init__(self, dtype: str, tok: _Tokens):
        self.dtype = dtype
        self.act_bytes = DTYPE_BYTES[dtype]
        self.tok = tok
        self.weights: dict[str, WeightSpec] = {}
        self.kernels: list[Kernel] = []
        self._kernel_names: set[str] = set()
        self._saved_names: set[str] = set()

    def nbytes(self, a: _Act) -> int:
        return a.rows * a.width * self.act_bytes

    def param(self, name: str, shape: Sequence[int]) -> str:
        if name in self.weights:
            raise RuntimeError(f"spec builder bug: weight {name} declared twice")
        self.weights[name] = WeightSpec(name, tuple(int(s) for s in shape), self.dtype)
        return name

    def kernel(self, name: str, layer: int, op: str, weights: Iterable[str], flops: int, io_bytes: int,
               saves: Iterable[tuple[str, int]] = ()) -> None:
        if name in self._kernel_names:
            raise RuntimeError(f"spec builder bug: kernel {name} declared twice")
        self._kernel_names.add(name)
        saved = []
        for tensor, nbytes in saves:
            if tensor not in self._saved_names:
                self._saved_names.add(tensor)
                saved.append(SavedTensor(tensor, nbytes, layer))
        self.kernels.append(Kernel(name, layer, op, tuple(weights), int(flops), int(io_bytes), tuple(saved)))

    def proj(self, kname: str, layer: int, x: _Act, outs: Sequence[_Out], *, bias: bool = True,
             norm_width: int = 0, extra_saves: Sequence[tuple[str, int]] = ()) -> list[_Act]:
        """One kernel of linears sharing input `x` (and the norms/GELUs on their outputs).

        `norm_width` is the RMSNorm width when it is per head (FLUX), else the output width;
        `extra_saves` are kept when an output needs a gradient (SwiGLU's operands)."""
        weights: list[str] = []
        saves: list[tuple[str, int]] = []
        flops = 0
        results = []
        tok = self.tok
        for out in outs:
            weights.append(self.param(f"{out.module}.weight", (out.features, x.width)))
            if bias:
                weights.append(self.param(f"{out.module}.bias", (out.features,)))
            flops += 2 * x.rows * out.features * x.width
            part = "out" if kname == out.module else out.module.rsplit(".", 1)[-1]
            adapted = is_adapted(out.module, tok.targets)
            y = _Act(f"{kname}.{part}", x.rows, out.features, x.grad or adapted)
            if adapted:
                saves.append((x.name, self.nbytes(x)))
                if tok.rank:
                    saves.append((f"{out.module}.lora_h", x.rows * tok.rank * self.act_bytes))
                if tok.kind == "train_lora":
                    flops += 2 * x.rows * tok.rank * (x.width + out.features)
            if out.norm:
                width = norm_width or out.features
                weights.append(self.param(out.norm, (width,)))
                rstd = x.rows * (out.features // width) * 4
                if y.grad:
                    saves += [(y.name, self.nbytes(y)), (f"{y.name}.rstd", rstd)]
                y = _Act(f"{y.name}.normed", y.rows, y.width, y.grad)
            if out.gelu:
                if y.grad:
                    saves.append((y.name, self.nbytes(y)))
                y = _Act(f"{y.name}.gelu", y.rows, y.width, y.grad)
            results.append(y)
        if any(r.grad for r in results):
            saves += extra_saves
        io = self.nbytes(x) + sum(self.nbytes(r) for r in results)
        self.kernel(kname, layer, "linear", weights, flops, io, saves)
        return results

    def linear(self, module: str, layer: int, x: _Act, features: int, *, bias: bool = True,
               gelu: bool = False) -> _Act:
        """A kernel of one linear, named after its module."""
        return self.proj(module, layer, x, [_Out(module, features, gelu=gelu)], bias=bias)[0]

    def attention(self, kname: str, layer: int, q: _Act, k: _Act, v: _Act, heads: int, head_dim: int) -> _Act:
        b = self.tok.batch
        lq, lk = q.rows // b, k.rows // b
        out = _Act(f"{kname}.out", q.rows, heads * head_dim, q.grad or k.grad or v.grad)
        lse = b * heads * lq * 4
        saves = [(t.name, self.nbytes(t)) for t in (q, k, v, out)] + [(f"{kname}.lse", lse)] if out.grad else []
        io = sum(self.nbytes(t) for t in (q, k, v, out))
        self.kernel(kname, layer, "attention", (), 4 * b * heads * lq * lk * head_dim, io, saves)
        return out

    def norm(self, kname: str, layer: int, x: _Act, *, layer_norm: bool = False,
             weights: Sequence[tuple[str, Sequence[int]]] = (), outputs: int = 1) -> list[_Act]:
        """Normalize `x` and apply `outputs` modulations of it (adaLN shift/scale)."""
        names = [self.param(n, s) for n, s in weights]
        stats = (2 if layer_norm else 1) * x.rows * 4
        outs = [_Act(f"{kname}.out{j}" if outputs > 1 else f"{kname}.out", x.rows, x.width, x.grad)
                for j in range(outputs)]
        io = self.nbytes(x) * (1 + outputs)
        saves = [(x.name, self.nbytes(x)), (f"{kname}.stats", stats)] if x.grad else []
        self.kernel(kname, layer, "norm", names, 5 * x.rows * x.width * outputs, io, saves)
        return outs

    def elementwise(self, kname: str, layer: int, weights: Sequence[tuple[str, Sequence[int]]]) -> None:
        """A kernel that turns small tables into per-sample values (adaLN scale/shift/gate)."""
        names = [self.param(n, s) for n, s in weights]
        numel = self.tok.batch * sum(prod(s) for _, s in weights)
        self.kernel(kname, layer, "elementwise", names, numel, 2 * numel * self.act_bytes)

    def finish(self, cfg: ModelConfig, meta: dict) -> ModelSpec:
        read = {w for k in self.kernels for w in k.weights}
        unread = [w for w in self.weights if w not in read]
        if unread:
            raise RuntimeError(f"spec builder bug: weights read by no kernel: {unread[:5]}")
        return ModelSpec(cfg.name, cfg.family, cfg.num_layers, dict(self.weights), tuple(self.kernels), meta)


def _res(kname: str, x: _Act, y: _Act) -> _Act:
    """The residual stream after kernel `kname` added its output `y` into `x`."""
    return _Act(f"{kname}.res", x.rows, x.width, x.grad or y.grad)


def _attn(b: _Builder, kp: str, wp: str, layer: int, x: _Act, ctx: _Act | None, *, inner: int, heads: int,
          head_dim: int, out_dim: int) -> _Act:
    """Q/K/V projections with q/k RMSNorms, the attention core and to_out.0.

    Self attention (`ctx` None) fuses q, k, v into `{kp}.qkv`; cross attention
    has `{kp}.q` over `x` and `{kp}.kv` over `ctx`. Returns to_out's output."""
    q_out = _Out(f"{wp}.to_q", inner, f"{wp}.norm_q.weight")
    kv_outs = [_Out(f"{wp}.to_k", inner, f"{wp}.norm_k.weight"), _Out(f"{wp}.to_v", inner)]
    if ctx is None:
        q, k, v = b.proj(f"{kp}.qkv", layer, x, [q_out, *kv_outs])
    else:
        (q,) = b.proj(f"{kp}.q", layer, x, [q_out])
        k, v = b.proj(f"{kp}.kv", layer, ctx, kv_outs)
    o = b.attention(f"{kp}.attention", layer, q, k, v, heads, head_dim)
    return b.proj(f"{kp}.to_out", layer, o, [_Out(f"{wp}.to_out.0", out_dim)])[0]


def _ffn(b: _Builder, kp: str, wp: str, layer: int, x: _Act, hidden: int) -> _Act:
    """GELU-tanh MLP: `{kp}.up` (net.0.proj + GELU) and `{kp}.down` (net.2)."""
    (h,) = b.proj(f"{kp}.up", layer, x, [_Out(f"{wp}.net.0.proj", hidden, gelu=True)])
    return b.proj(f"{kp}.down", layer, h, [_Out(f"{wp}.net.2", x.width)])[0]


# ----- DiT: LTX-Video, LTX-2, Wan2.1


def _adaln_single(b: _Builder, module: str, t: _Act, width: int, k: int) -> None:
    """PixArt adaLN-single: timestep embedder (linear_1, SiLU, linear_2), then SiLU and a k*width linear."""
    emb = f"{module}.emb.timestep_embedder"
    h = b.linear(f"{emb}.linear_1", -1, t, width)
    h = b.linear(f"{emb}.linear_2", -1, h, width)
    b.linear(f"{module}.linear", -1, h, k * width)


def _caption(b: _Builder, module: str, text: _Act, width: int) -> _Act:
    """PixArt caption projection: linear_1, GELU-tanh, linear_2."""
    h = b.linear(f"{module}.linear_1", -1, text, width, gelu=True)
    return b.linear(f"{module}.linear_2", -1, h, width)


def _build_ltx(b: _Builder, c: DitModelConfig) -> None:
    tok = b.tok
    bs, d, da = tok.batch, c.dim, c.audio_dim
    audio = da > 0
    t = _Act("timestep.freqs", bs, c.timestep_dim)
    text_in = _Act("text", bs * tok.text, c.text_dim)
    v = b.linear("proj_in", -1, _Act("video", bs * tok.video, c.in_channels), d)
    a = b.linear("audio_proj_in", -1, _Act("audio", bs * tok.audio, c.audio_in_channels), da) if audio else None
    adaln = [("time_embed", d, 6)]
    if audio:
        adaln += [("audio_time_embed", da, 6), ("av_cross_attn_video_scale_shift", d, 4),
                  ("av_cross_attn_audio_scale_shift", da, 4), ("av_cross_attn_video_a2v_gate", d, 1),
                  ("av_cross_attn_audio_v2a_gate", da, 1)]
    for module, width, k in adaln:
        _adaln_single(b, module, t, width, k)
    text = _caption(b, "caption_projection", text_in, d)
    atext = _caption(b, "audio_caption_projection", text_in, da) if audio else None

    vattn = dict(inner=d, heads=c.heads, head_dim=c.head_dim, out_dim=d)
    aattn = dict(inner=da, heads=c.audio_heads, head_dim=c.audio_head_dim, out_dim=da)
    for i in range(c.num_layers):
        kp, wp = f"blocks.{i}", f"transformer_blocks.{i}"
        tables = [(f"{wp}.scale_shift_table", (6, d))]
        if audio:
            tables += [(f"{wp}.audio_scale_shift_table", (6, da)),
                       (f"{wp}.video_a2v_cross_attn_scale_shift_table", (5, d)),
                       (f"{wp}.audio_a2v_cross_attn_scale_shift_table", (5, da))]
        b.elementwise(f"{kp}.ada", i, tables)
        # 1. self attention, video then audio
        (x,) = b.norm(f"{kp}.norm1", i, v)
        v = _res(f"{kp}.attn1.to_out", v, _attn(b, f"{kp}.attn1", f"{wp}.attn1", i, x, None, **vattn))
        if audio:
            (x,) = b.norm(f"{kp}.audio_norm1", i, a)
            y = _attn(b, f"{kp}.audio_attn1", f"{wp}.audio_attn1", i, x, None, **aattn)
            a = _res(f"{kp}.audio_attn1.to_out", a, y)
        # 2. cross attention to the text
        (x,) = b.norm(f"{kp}.norm2", i, v)
        v = _res(f"{kp}.attn2.to_out", v, _attn(b, f"{kp}.attn2", f"{wp}.attn2", i, x, text, **vattn))
        if audio:
            (x,) = b.norm(f"{kp}.audio_norm2", i, a)
            y = _attn(b, f"{kp}.audio_attn2", f"{wp}.audio_attn2", i, x, atext, **aattn)
            a = _res(f"{kp}.audio_attn2.to_out", a, y)
            # 3. audio-to-video (Q video) and video-to-audio (Q audio), in the audio's width
            v_a2v, v_v2a = b.norm(f"{kp}.audio_to_video_norm", i, v, outputs=2)
            a_a2v, a_v2a = b.norm(f"{kp}.video_to_audio_norm", i, a, outputs=2)
            y = _attn(b, f"{kp}.audio_to_video_attn", f"{wp}.audio_to_video_attn", i, v_a2v, a_a2v,
                      **{**aattn, "out_dim": d})
            v = _res(f"{kp}.audio_to_video_attn.to_out", v, y)
            y = _attn(b, f"{kp}.video_to_audio_attn", f"{wp}.video_to_audio_attn", i, a_v2a, v_v2a, **aattn)
            a = _res(f"{kp}.video_to_audio_attn.to_out", a, y)
        # 4. feed-forward
        (x,) = b.norm(f"{kp}.norm3", i, v)
        v = _res(f"{kp}.ff.down", v, _ffn(b, f"{kp}.ff", f"{wp}.ff", i, x, c.ffn_dim))
        if audio:
            (x,) = b.norm(f"{kp}.audio_norm3", i, a)
            a = _res(f"{kp}.audio_ff.down", a, _ffn(b, f"{kp}.audio_ff", f"{wp}.audio_ff", i, x, c.audio_ffn_dim))

    (x,) = b.norm("norm_out", -1, v, layer_norm=True, weights=[("scale_shift_table", (2, d))])
    b.linear("proj_out", -1, x, c.in_channels)
    if audio:
        (x,) = b.norm("audio_norm_out", -1, a, layer_norm=True, weights=[("audio_scale_shift_table", (2, da))])
        b.linear("audio_proj_out", -1, x, c.audio_in_channels)


def _build_wan(b: _Builder, c: DitModelConfig) -> None:
    tok = b.tok
    bs, d = tok.batch, c.dim
    patch = prod(c.patch_size)
    # Conv3d with kernel = stride = patch: a matmul over patchified tokens.
    x_in = _Act("video", bs * tok.video, c.in_channels * patch)
    v = _Act("patch_embedding.out", x_in.rows, d)
    w = b.param("patch_embedding.weight", (d, c.in_channels, *c.patch_size))
    bias = b.param("patch_embedding.bias", (d,))
    b.kernel("patch_embedding", -1, "linear", (w, bias), 2 * x_in.rows * d * x_in.width,
             b.nbytes(x_in) + b.nbytes(v))
    t = _Act("timestep.freqs", bs, c.timestep_dim)
    h = b.linear("condition_embedder.time_embedder.linear_1", -1, t, d)
    h = b.linear("condition_embedder.time_embedder.linear_2", -1, h, d)
    b.linear("condition_embedder.time_proj", -1, h, 6 * d)
    h = b.linear("condition_embedder.text_embedder.linear_1", -1, _Act("text", bs * tok.text, c.text_dim), d,
                 gelu=True)
    text = b.linear("condition_embedder.text_embedder.linear_2", -1, h, d)

    attn = dict(inner=d, heads=c.heads, head_dim=c.head_dim, out_dim=d)
    for i in range(c.num_layers):
        kp, wp = f"blocks.{i}", f"blocks.{i}"
        b.elementwise(f"{kp}.ada", i, [(f"{wp}.scale_shift_table", (1, 6, d))])
        (x,) = b.norm(f"{kp}.norm1", i, v, layer_norm=True)
        v = _res(f"{kp}.attn1.to_out", v, _attn(b, f"{kp}.attn1", f"{wp}.attn1", i, x, None, **attn))
        (x,) = b.norm(f"{kp}.norm2", i, v, layer_norm=True,
                      weights=[(f"{wp}.norm2.weight", (d,)), (f"{wp}.norm2.bias", (d,))])
        v = _res(f"{kp}.attn2.to_out", v, _attn(b, f"{kp}.attn2", f"{wp}.attn2", i, x, text, **attn))
        (x,) = b.norm(f"{kp}.norm3", i, v, layer_norm=True)
        v = _res(f"{kp}.ffn.down", v, _ffn(b, f"{kp}.ffn", f"{wp}.ffn", i, x, c.ffn_dim))

    (x,) = b.norm("norm_out", -1, v, layer_norm=True, weights=[("scale_shift_table", (1, 2, d))])
    b.linear("proj_out", -1, x, c.in_channels * patch)


_DIT_VARIANTS: dict[str, Callable[[_Builder, DitModelConfig], None]] = {"ltx": _build_ltx, "wan": _build_wan}


def _build_dit(b: _Builder, c: DitModelConfig) -> None:
    tok = b.tok
    _need(tok.video, "video_tokens", c.name)
    _need(tok.text, "text_tokens", c.name)
    if c.audio_dim:
        _need(tok.audio, "audio_tokens", c.name)
    _DIT_VARIANTS[c.variant](b, c)


# ----- FLUX.1


def _build_flux(b: _Builder, c: FluxModelConfig) -> None:
    tok = b.tok
    _need(tok.video, "video_tokens", c.name)
    _need(tok.text, "text_tokens", c.name)
    bs, d = tok.batch, c.dim
    img = b.linear("x_embedder", -1, _Act("image", bs * tok.video, c.in_channels), d)
    t = _Act("timestep.freqs", bs, c.timestep_dim)
    embedders = [("timestep_embedder", t)]
    if c.guidance_embeds:
        embedders.append(("guidance_embedder", _Act("guidance.freqs", bs, c.timestep_dim)))
    embedders.append(("text_embedder", _Act("pooled", bs, c.pooled_dim)))
    for name, x in embedders:
        h = b.linear(f"time_text_embed.{name}.linear_1", -1, x, d)
        b.linear(f"time_text_embed.{name}.linear_2", -1, h, d)
    temb = _Act("temb", bs, d)
    txt = b.linear("context_embedder", -1, _Act("text", bs * tok.text, c.text_dim), d)
    heads, hd = c.heads, c.head_dim

    for i in range(c.num_double_layers):
        kp, wp = f"double_blocks.{i}", f"transformer_blocks.{i}"
        b.proj(f"{kp}.norm1.linear", i, temb, [_Out(f"{wp}.norm1.linear", 6 * d)])
        b.proj(f"{kp}.norm1_context.linear", i, temb, [_Out(f"{wp}.norm1_context.linear", 6 * d)])
        (x,) = b.norm(f"{kp}.norm1", i, img, layer_norm=True)
        (cx,) = b.norm(f"{kp}.norm1_context", i, txt, layer_norm=True)
        q, k, v = b.proj(f"{kp}.attn.qkv", i, x, [
            _Out(f"{wp}.attn.to_q", d, f"{wp}.attn.norm_q.weight"),
            _Out(f"{wp}.attn.to_k", d, f"{wp}.attn.norm_k.weight"),
            _Out(f"{wp}.attn.to_v", d)], norm_width=hd)
        cq, ck, cv = b.proj(f"{kp}.attn.add_qkv", i, cx, [
            _Out(f"{wp}.attn.add_q_proj", d, f"{wp}.attn.norm_added_q.weight"),
            _Out(f"{wp}.attn.add_k_proj", d, f"{wp}.attn.norm_added_k.weight"),
            _Out(f"{wp}.attn.add_v_proj", d)], norm_width=hd)
        # Joint attention over [text, image]: the concatenations are new tensors.
        joint = [_Act(f"{kp}.attn.{n}", p.rows + r.rows, d, p.grad or r.grad)
                 for n, p, r in (("q", cq, q), ("k", ck, k), ("v", cv, v))]
        o = b.attention(f"{kp}.attn.attention", i, *joint, heads, hd)
        # The image and text parts are views of the output: saved once, through their base.
        o_img, o_txt = _Act(o.name, img.rows, d, o.grad), _Act(o.name, txt.rows, d, o.grad)
        (y,) = b.proj(f"{kp}.attn.to_out", i, o_img, [_Out(f"{wp}.attn.to_out.0", d)])
        img = _res(f"{kp}.attn.to_out", img, y)
        (y,) = b.proj(f"{kp}.attn.to_add_out", i, o_txt, [_Out(f"{wp}.attn.to_add_out", d)])
        txt = _res(f"{kp}.attn.to_add_out", txt, y)
        (x,) = b.norm(f"{kp}.norm2", i, img, layer_norm=True)
        img = _res(f"{kp}.ff.down", img, _ffn(b, f"{kp}.ff", f"{wp}.ff", i, x, c.ffn_dim))
        (cx,) = b.norm(f"{kp}.norm2_context", i, txt, layer_norm=True)
        txt = _res(f"{kp}.ff_context.down", txt, _ffn(b, f"{kp}.ff_context", f"{wp}.ff_context", i, cx, c.ffn_dim))

    s = _Act("single.in", txt.rows + img.rows, d, txt.grad or img.grad)  # [text, image] concatenated
    for j in range(c.num_layers - c.num_double_layers):
        i = c.num_double_layers + j
        kp, wp = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        b.proj(f"{kp}.norm.linear", i, temb, [_Out(f"{wp}.norm.linear", 3 * d)])
        (x,) = b.norm(f"{kp}.norm", i, s, layer_norm=True)
        q, k, v, mlp = b.proj(f"{kp}.qkv_mlp", i, x, [
            _Out(f"{wp}.attn.to_q", d, f"{wp}.attn.norm_q.weight"),
            _Out(f"{wp}.attn.to_k", d, f"{wp}.attn.norm_k.weight"),
            _Out(f"{wp}.attn.to_v", d),
            _Out(f"{wp}.proj_mlp", c.ffn_dim, gelu=True)], norm_width=hd)
        o = b.attention(f"{kp}.attention", i, q, k, v, heads, hd)
        # proj_out reads [attention output, GELU(mlp)] concatenated: a new tensor.
        cat = _Act(f"{kp}.cat", s.rows, d + c.ffn_dim, o.grad or mlp.grad)
        (y,) = b.proj(f"{kp}.proj_out", i, cat, [_Out(f"{wp}.proj_out", d)])
        s = _res(f"{kp}.proj_out", s, y)

    img = _Act(s.name, img.rows, d, s.grad)  # the image part of the last residual: a view
    b.linear("norm_out.linear", -1, temb, 2 * d)
    (x,) = b.norm("norm_out", -1, img, layer_norm=True)
    b.linear("proj_out", -1, x, c.in_channels)


# ----- Llama-3


def _build_llama(b: _Builder, c: LlamaModelConfig) -> None:
    tok = b.tok
    bs, hid, hd = tok.batch, c.hidden, c.head_dim
    if tok.kind == "decode":
        lq, lk = 1, tok.context + 1  # one new token per sequence, attending to the cache and itself
    else:
        _need(tok.text, "text_tokens", c.name)
        lq = lk = tok.text
    rows = bs * lq
    emb = b.param("model.embed_tokens.weight", (c.vocab, hid))
    x = _Act("model.embed_tokens.out", rows, hid)
    b.kernel("model.embed_tokens", -1, "embed", (emb,), 0, rows * 8 + b.nbytes(x))
    kv = c.kv_heads * hd
    for i in range(c.num_layers):
        kp, wp = f"layers.{i}", f"model.layers.{i}"
        (h,) = b.norm(f"{kp}.input_layernorm", i, x, weights=[(f"{wp}.input_layernorm.weight", (hid,))])
        q, k, v = b.proj(f"{kp}.self_attn.qkv", i, h, [
            _Out(f"{wp}.self_attn.q_proj", hid), _Out(f"{wp}.self_attn.k_proj", kv),
            _Out(f"{wp}.self_attn.v_proj", kv)], bias=False)
        if tok.kind == "decode":  # the cache, with this step's k and v appended
            k, v = _Act(f"{kp}.k_cache", bs * lk, kv, k.grad), _Act(f"{kp}.v_cache", bs * lk, kv, v.grad)
        o = b.attention(f"{kp}.self_attn.attention", i, q, k, v, c.heads, hd)
        (y,) = b.proj(f"{kp}.self_attn.o_proj", i, o, [_Out(f"{wp}.self_attn.o_proj", hid)], bias=False)
        x = _res(f"{kp}.self_attn.o_proj", x, y)
        (h,) = b.norm(f"{kp}.post_attention_layernorm", i, x,
                      weights=[(f"{wp}.post_attention_layernorm.weight", (hid,))])
        inter = rows * c.intermediate * b.act_bytes
        swiglu = [(f"{kp}.mlp.gate_up.{part}", inter) for part in ("gate", "up", "silu")]
        gate, _up = b.proj(f"{kp}.mlp.gate_up", i, h, [_Out(f"{wp}.mlp.gate_proj", c.intermediate),
                                                        _Out(f"{wp}.mlp.up_proj", c.intermediate)],
                           bias=False, extra_saves=swiglu)
        (y,) = b.proj(f"{kp}.mlp.down_proj", i, _Act(f"{kp}.mlp.h", rows, c.intermediate, gate.grad),
                      [_Out(f"{wp}.mlp.down_proj", hid)], bias=False)
        x = _res(f"{kp}.mlp.down_proj", x, y)
    (h,) = b.norm("model.norm", -1, x, weights=[("model.norm.weight", (hid,))])
    b.linear("lm_head", -1, h, c.vocab, bias=False)


def _need(value: int, key: str, model: str) -> None:
    if value <= 0:
        raise SpecError(f"workload.{key}={value} but model {model} needs it; set workload.{key} > 0")


_BUILDERS: dict[str, Callable[[_Builder, Any], None]] = {
    "dit": _build_dit, "flux": _build_flux, "llama": _build_llama,
}


def build_spec(model_cfg: Any, workload: WorkloadShape) -> ModelSpec:
    """Every weight and every forward kernel, in launch order, for this model and workload.

    `model_cfg`: a family dataclass, or a (Hydra-composed or plain) DictConfig / dict.
    `workload`: anything with kind, batch, video/audio/text/context tokens and
    lora_rank (and optionally lora_targets)."""
    cfg = model_config(model_cfg)
    if workload.batch <= 0:
        raise SpecError(f"workload.batch={workload.batch} must be positive")
    targets = tuple(getattr(workload, "lora_targets", None) or LORA_TARGETS[cfg.family])
    tok = _Tokens(workload.kind, workload.batch, workload.video_tokens, workload.audio_tokens,
                  workload.text_tokens, workload.context_tokens, max(workload.lora_rank, 0), targets)
    b = _Builder(cfg.dtype, tok)
    _BUILDERS[cfg.family](b, cfg)
    meta = {"config": asdict(cfg), "workload": asdict(tok), "lora_targets": targets}
    return b.finish(cfg, meta)


def load_spec(model: str | Path, workload: WorkloadShape) -> ModelSpec:
    """`build_spec` for a model by name (conf/model/NAME.yaml) or yaml path."""
    return build_spec(load_model_config(model), workload)
