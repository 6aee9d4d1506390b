"""The spec builder: a family declares its weights and kernels in launch order
through `SpecBuilder`, which counts FLOPs, IO bytes, the memory passes each
kernel runs around its core op, and the tensors autograd saves (the accounting
engine/models/spec.py describes).

Passes count bytes read plus bytes written over full-size activations, as the
forward (engine/models/<family>.py) runs them between one fetch and the next:
a norm reads and writes once (2x), a modulation x * (1 + scale) + shift twice
(4x), a residual add reads two and writes one (3x), a gated one first scales by
the gate (2x), a GELU or a copy reads and writes (2x). Each pass has the kind
(engine/compute.py PASSES) whose cost per byte it runs at: a full-width or a
per-head RMSNorm, a LayerNorm, a plain elementwise op, one with a per-sample
operand broadcast over the tokens, attention's heads copied back into rows, an
add on a transposed activation (`Act.transposed`), or its copy made contiguous."""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Iterable, NamedTuple, Sequence

from engine.models.spec import DTYPE_BYTES, Kernel, ModelConfig, ModelSpec, SavedTensor, WeightSpec, is_adapted

NORM, MODULATE, RESIDUAL, SCALE, ONE_PASS = 2, 4, 3, 2, 2  # bytes moved per activation byte


@dataclass(frozen=True)
class Tokens:
    """The workload as a builder needs it (stored as the spec's meta["workload"])."""

    kind: str
    batch: int
    video: int
    audio: int
    text: int
    context: int
    rank: int
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Act:
    """A named activation: `rows` = batch x tokens, `width` features. The name is
    its identity for saved-tensor deduplication; `grad` says whether it depends
    on an adapter (autograd saves for backward only what such tensors need).
    `transposed`: stored features-major (a conv's output flattened and transposed, never
    made contiguous); an add keeps that layout, and a norm copies it contiguous first."""

    name: str
    rows: int
    width: int
    grad: bool = False
    transposed: bool = False


class Out(NamedTuple):
    """One linear of a fused group and what follows it inside the kernel."""

    module: str
    features: int
    norm: str = ""  # weight of an RMSNorm on this output ("" = none)
    gelu: bool = False  # GELU-tanh on this output


class SpecBuilder:
    """Weights and kernels in launch order; each name is declared once."""

    def __init__(self, dtype: str, tok: Tokens):
        self.dtype = dtype
        self.act_bytes = DTYPE_BYTES[dtype]
        self.tok = tok
        self.weights: dict[str, WeightSpec] = {}
        self.kernels: list[Kernel] = []
        self._kernel_names: set[str] = set()
        self._saved_names: set[str] = set()

    def nbytes(self, a: Act) -> int:
        return a.rows * a.width * self.act_bytes

    def param(self, name: str, shape: Sequence[int]) -> str:
        if name in self.weights:
            raise RuntimeError(f"spec builder bug: weight {name} declared twice")
        self.weights[name] = WeightSpec(name, tuple(int(s) for s in shape), self.dtype)
        return name

    def kernel(self, name: str, layer: int, op: str, weights: Iterable[str], flops: int, io_bytes: int,
               saves: Iterable[tuple[str, int]] = (), shape: tuple[int, ...] = (),
               passes: Iterable[tuple[str, int]] = ()) -> None:
        """Declare a kernel; `io_bytes` counts its activations in and out, and the bytes
        of the weights it reads are added here (once, for every family)."""
        if name in self._kernel_names:
            raise RuntimeError(f"spec builder bug: kernel {name} declared twice")
        self._kernel_names.add(name)
        saved = []
        for tensor, nbytes in saves:
            if tensor not in self._saved_names:
                self._saved_names.add(tensor)
                saved.append(SavedTensor(tensor, nbytes, layer))
        weights = tuple(weights)
        passes = tuple((kind, int(n)) for kind, n in passes)
        if op != "embed":  # a kernel reads its weights whole; an embedding reads only its rows (in io_bytes)
            io_bytes += sum(self.weights[w].nbytes for w in weights)
        self.kernels.append(Kernel(name, layer, op, weights, int(flops), int(io_bytes), tuple(saved),
                                   tuple(int(d) for d in shape), passes))

    def passes(self, kname: str, *passes: tuple[str, int]) -> None:
        """Memory passes the forward runs after kernel `kname`, the last declared,
        before the next fetch (an epilogue: a residual add, a concatenation)."""
        k = self.kernels[-1]
        if k.name != kname:
            raise RuntimeError(f"spec builder bug: passes for {kname} after kernel {k.name}")
        self.kernels[-1] = replace(k, passes=k.passes + tuple((kind, int(n)) for kind, n in passes))

    def residual(self, kname: str, x: Act, y: Act, gated: bool = False) -> Act:
        """The residual stream after kernel `kname` added its output `y` into `x`
        (`gated`: y times a per-sample gate first)."""
        n = self.nbytes(x)
        scale = [("broadcast", SCALE * n)] if gated else []
        self.passes(kname, *scale, ("transposed" if x.transposed else "pointwise", RESIDUAL * n))
        return Act(f"{kname}.res", x.rows, x.width, x.grad or y.grad, x.transposed)

    def proj(self, kname: str, layer: int, x: Act, outs: Sequence[Out], *, bias: bool = True,
             norm_width: int = 0, extra_saves: Sequence[tuple[str, int]] = ()) -> list[Act]:
        """One kernel of linears sharing input `x` (and the norms/GELUs on their outputs).

        `norm_width` is the RMSNorm width when it is per head (FLUX), else the output width;
        `extra_saves` are kept when an output needs a gradient (SwiGLU's operands)."""
        weights: list[str] = []
        saves: list[tuple[str, int]] = []
        passes: list[tuple[str, int]] = []
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
            y = Act(f"{kname}.{part}", x.rows, out.features, x.grad or adapted)
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
                passes.append(("rms_norm" if width == out.features else "head_rms_norm", NORM * self.nbytes(y)))
                if y.grad:
                    saves += [(y.name, self.nbytes(y)), (f"{y.name}.rstd", rstd)]
                y = Act(f"{y.name}.normed", y.rows, y.width, y.grad)
            if out.gelu:
                passes.append(("pointwise", ONE_PASS * self.nbytes(y)))
                if y.grad:
                    saves.append((y.name, self.nbytes(y)))
                y = Act(f"{y.name}.gelu", y.rows, y.width, y.grad)
            results.append(y)
        if any(r.grad for r in results):
            saves += extra_saves
        io = self.nbytes(x) + sum(self.nbytes(r) for r in results)
        self.kernel(kname, layer, "linear", weights, flops, io, saves,
                    shape=(x.rows, sum(out.features for out in outs), x.width), passes=passes)
        return results

    def linear(self, module: str, layer: int, x: Act, features: int, *, bias: bool = True,
               gelu: bool = False) -> Act:
        """A kernel of one linear, named after its module."""
        return self.proj(module, layer, x, [Out(module, features, gelu=gelu)], bias=bias)[0]

    def attention(self, kname: str, layer: int, q: Act, k: Act, v: Act, heads: int, head_dim: int,
                  copied: Sequence[Act] = ()) -> Act:
        """The attention core (SDPA): a kernel that reads no weights. Its output's heads are
        copied back into rows (a pass); `copied` are inputs the forward copies first
        (a concatenation)."""
        b = self.tok.batch
        lq, lk = q.rows // b, k.rows // b
        out = Act(f"{kname}.out", q.rows, heads * head_dim, q.grad or k.grad or v.grad)
        lse = b * heads * lq * 4
        saves = [(t.name, self.nbytes(t)) for t in (q, k, v, out)] + [(f"{kname}.lse", lse)] if out.grad else []
        io = sum(self.nbytes(t) for t in (q, k, v, out))
        passes = [("pointwise", ONE_PASS * self.nbytes(t)) for t in copied] + [("head_copy", ONE_PASS * self.nbytes(out))]
        self.kernel(kname, layer, "attention", (), 4 * b * heads * lq * lk * head_dim, io, saves,
                    shape=(b * heads, lq, lk, head_dim), passes=passes)
        return out

    def norm(self, kname: str, layer: int, x: Act, *, layer_norm: bool = False,
             weights: Sequence[tuple[str, Sequence[int]]] = (), outputs: int = 1,
             modulated: bool = True) -> list[Act]:
        """Normalize `x`, then apply `outputs` modulations of it (adaLN shift/scale), or
        none when not `modulated` (a plain or affine norm)."""
        if not modulated and outputs != 1:
            raise RuntimeError(f"spec builder bug: {kname} has {outputs} outputs but no modulation")
        names = [self.param(n, s) for n, s in weights]
        stats = (2 if layer_norm else 1) * x.rows * 4
        outs = [Act(f"{kname}.out{j}" if outputs > 1 else f"{kname}.out", x.rows, x.width, x.grad)
                for j in range(outputs)]
        contiguous = [("transposed_copy", ONE_PASS * self.nbytes(x))] if x.transposed else []
        passes = [*contiguous, ("layer_norm" if layer_norm else "rms_norm", NORM * self.nbytes(x))]
        passes += [("broadcast", MODULATE * self.nbytes(x))] * (outputs if modulated else 0)
        saves = [(x.name, self.nbytes(x)), (f"{kname}.stats", stats)] if x.grad else []
        io = self.nbytes(x) * (1 + outputs)
        self.kernel(kname, layer, "norm", names, 5 * x.rows * x.width * outputs, io, saves, passes=passes)
        return outs

    def elementwise(self, kname: str, layer: int, weights: Sequence[tuple[str, Sequence[int]]]) -> None:
        """A kernel that turns small tables into per-sample values (adaLN scale/shift/gate)."""
        names = [self.param(n, s) for n, s in weights]
        numel = self.tok.batch * sum(prod(s) for _, s in weights)
        self.kernel(kname, layer, "elementwise", names, numel, 2 * numel * self.act_bytes)

    def attention_layer(self, kp: str, wp: str, layer: int, x: Act, ctx: Act | None, *, inner: int, heads: int,
                        head_dim: int, out_dim: int) -> Act:
        """Q/K/V projections with q/k RMSNorms, the attention core and to_out.0.

        Self attention (`ctx` None) fuses q, k, v into `{kp}.qkv`; cross attention
        has `{kp}.q` over `x` and `{kp}.kv` over `ctx`. Returns to_out's output."""
        q_out = Out(f"{wp}.to_q", inner, f"{wp}.norm_q.weight")
        kv_outs = [Out(f"{wp}.to_k", inner, f"{wp}.norm_k.weight"), Out(f"{wp}.to_v", inner)]
        if ctx is None:
            q, k, v = self.proj(f"{kp}.qkv", layer, x, [q_out, *kv_outs])
        else:
            (q,) = self.proj(f"{kp}.q", layer, x, [q_out])
            k, v = self.proj(f"{kp}.kv", layer, ctx, kv_outs)
        o = self.attention(f"{kp}.attention", layer, q, k, v, heads, head_dim)
        return self.proj(f"{kp}.to_out", layer, o, [Out(f"{wp}.to_out.0", out_dim)])[0]

    def ffn(self, kp: str, wp: str, layer: int, x: Act, hidden: int) -> Act:
        """GELU-tanh MLP: `{kp}.up` (net.0.proj + GELU) and `{kp}.down` (net.2)."""
        (h,) = self.proj(f"{kp}.up", layer, x, [Out(f"{wp}.net.0.proj", hidden, gelu=True)])
        return self.proj(f"{kp}.down", layer, h, [Out(f"{wp}.net.2", x.width)])[0]

    def finish(self, cfg: ModelConfig, meta: dict) -> ModelSpec:
        read = {w for k in self.kernels for w in k.weights}
        unread = [w for w in self.weights if w not in read]
        if unread:
            raise RuntimeError(f"spec builder bug: weights read by no kernel: {unread[:5]}")
        return ModelSpec(cfg.name, cfg.family, cfg.num_layers, dict(self.weights), tuple(self.kernels), meta)
