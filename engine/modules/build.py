"""A model config's real module: built from its `_target_` with parameters on the meta
device, its example inputs per family, and random weights for it.

A module model config (conf/model/ltx2_diffusers.yaml) names the class and its
arguments under `module` (Hydra's `_target_`, instantiated with every parameter
on the meta device, buffers real: nothing of the weights is allocated) and an
inputs builder under `inputs` (`_target_` of a function taking the module, the
workload, the device, the dtype and a seed, returning keyword arguments).

    build_module    instantiate the config's module (meta parameters, the config's dtype)
    example_inputs  the config's inputs builder for a workload
    first_output    the tensor a forward's output leads with (what runs are compared by)
    ltx2_inputs, flux_inputs, flux2_inputs, zimage_inputs, wan_inputs, hunyuan_video_inputs,
    hunyuan_video15_inputs, hunyuan_image_inputs, qwen_image_inputs, sd3_inputs, mochi_inputs,
    auraflow_inputs, llama_inputs   the shipped builders
"""
from __future__ import annotations

import importlib
import inspect
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from engine.errors import ConfigError
from engine.weightfile import torch_dtype

MODELS_EXTRA = "pip install 'offload-engine[models]' (diffusers, transformers, peft)"


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers inside goes to the meta device; buffers
    stay where they are made (rotary tables and the like are computed, not loaded)."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _resolve(target: str, key: str) -> Callable:
    """`target`'s object: the longest importable module prefix, then attributes, so a
    classmethod (`diffusers.FluxTransformer2DModel.from_config`) resolves as a class does."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name and cut > 1:
                continue  # an attribute of a shorter prefix, not a module
            raise ConfigError(f"{key}._target_={target}: module {err.name!r} is not installed; {MODELS_EXTRA}") \
                from None
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ConfigError(f"{key}._target_={target}: no such class or function; fix the name in the model yaml")


def _instantiate(node: Any, key: str) -> Any:
    """Hydra's `_target_` call, with a one-line error for a missing package."""
    if isinstance(node, Mapping) and "_target_" in node:
        fn = _resolve(str(node["_target_"]), key)
        kwargs = {k: _instantiate(v, f"{key}.{k}") for k, v in node.items() if k != "_target_"}
        return fn(**kwargs)
    if isinstance(node, Mapping):
        return {k: _instantiate(v, f"{key}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_instantiate(v, key) for v in node]
    return node


def build_module(model_cfg: Any) -> nn.Module:
    """The config's `module`, instantiated with its parameters on the meta device, in
    the config's dtype, in eval mode."""
    node = plain_config(model_cfg)
    if "module" not in node:
        raise ConfigError("this model config has no `module` (a `_target_` to build); it is a spec model")
    dtype = torch_dtype(node.get("dtype", "bf16"))
    with parameters_on_meta():
        module = _instantiate(node["module"], "model.module")
    if not isinstance(module, nn.Module):
        raise ConfigError(f"model.module._target_ built a {type(module).__name__}, not a torch.nn.Module; "
                          "point it at a model class")
    # nn.Module.to: diffusers' own `to` warns about float32 modules, which a cast on meta cannot upset.
    return nn.Module.to(module, dtype).eval()


def plain_config(cfg: Any) -> dict:
    """A config node (or a mapping) as a plain dict."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def example_inputs(model_cfg: Any, module: nn.Module, workload: Any, device: torch.device,
                   seed: int = 0) -> dict:
    """Keyword arguments of one forward, from the config's inputs builder."""
    node = plain_config(model_cfg)
    spec = node.get("inputs")
    if not (isinstance(spec, Mapping) and "_target_" in spec):
        raise ConfigError("model.inputs needs a `_target_` naming an inputs builder, e.g. "
                          "engine.modules.build.ltx2_inputs")
    fn = _resolve(str(spec["_target_"]), "model.inputs")
    extra = {k: v for k, v in spec.items() if k != "_target_"}
    dtype = torch_dtype(node.get("dtype", "bf16"))
    return fn(module=module, workload=workload, device=device, dtype=dtype, seed=seed, **extra)


def first_output(out: Any) -> torch.Tensor:
    """The tensor a forward's output leads with: itself, the first of a tuple or list
    (diffusers' return_dict=False; Z-Image's list, one sample each), a transformers output's
    logits, or else its first field (an encoder's last hidden state)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return first_output(out[0])
    logits = getattr(out, "logits", None)
    return logits if logits is not None else first_output(out[0])


def _grid(tokens: int) -> tuple[int, int, int]:
    """(frames, height, width) latent sizes with frames * height * width == tokens:
    the most frames up to 16 that divide it, then the squarest height x width."""
    if tokens < 1:
        raise ConfigError(f"workload.video_tokens={tokens}: a video model needs at least 1 token")
    frames = next(f for f in (16, 8, 4, 2, 1) if tokens % f == 0)
    return (frames, *_square(tokens // frames))


def _square(tokens: int) -> tuple[int, int]:
    """(height, width) with height * width == tokens, as square as the divisors allow."""
    height = max(h for h in range(1, math.isqrt(tokens) + 1) if tokens % h == 0)
    return height, tokens // height


def _image_shape(workload: Any, family: str) -> tuple[int, int, int, int, int]:
    """An image model's (batch, image tokens, text tokens, grid height, grid width): the
    workload's video_tokens are the image's packed latent tokens, on the squarest grid."""
    n = workload.video_tokens
    if n < 1:
        raise ConfigError(f"workload.video_tokens={n}: {family} needs at least 1 image token")
    return (workload.batch, n, max(1, workload.text_tokens), *_square(n))


def _embedded_grid(workload: Any, family: str, side: int, hint: str = "") -> tuple[int, int, int, int, int]:
    """`_image_shape`, refused where its grid is past a learned positional embedding of `side`
    tokens a side (`hint`: another way out, after the message's)."""
    b, n, text, h, w = _image_shape(workload, family)
    if max(h, w) > side:
        raise ConfigError(f"workload.video_tokens={n}: its {h} x {w} token grid is past {family}'s positional "
                          f"embedding ({side} tokens a side); pick a count whose squarest grid fits, at most "
                          f"{side * side}{hint}")
    return b, n, text, h, w


def _randn(g: torch.Generator, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def ltx2_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> dict:
    """diffusers LTX2VideoTransformer3DModel: video and audio latents, text for both, timestep."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b = workload.batch
    frames, height, width = _grid(workload.video_tokens)
    text = max(1, workload.text_tokens)
    return dict(
        hidden_states=_randn(g, (b, workload.video_tokens, c.in_channels), device, dtype),
        audio_hidden_states=_randn(g, (b, max(1, workload.audio_tokens), c.audio_in_channels), device, dtype),
        encoder_hidden_states=_randn(g, (b, text, c.caption_channels), device, dtype),
        audio_encoder_hidden_states=_randn(g, (b, text, c.caption_channels), device, dtype),
        timestep=torch.full((b,), 500.0, device=device),
        num_frames=frames, height=height, width=width, audio_num_frames=max(1, workload.audio_tokens),
        return_dict=False)


def _image_ids(h: int, w: int, axes: int) -> torch.Tensor:
    """FLUX's position ids of an h x w token grid, row-major: (h * w, axes), the row on axis 1 and
    the column on axis 2, the others 0."""
    ids = torch.zeros(h * w, axes)
    ids[:, 1] = torch.arange(h).repeat_interleave(w).float()
    ids[:, 2] = torch.arange(w).repeat(h).float()
    return ids


def flux_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> dict:
    """diffusers FluxTransformer2DModel: packed image latents, T5 text, CLIP pooled, ids."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, n, text, h, w = _image_shape(workload, "FLUX")
    img_ids = _image_ids(h, w, 3)
    out = dict(
        hidden_states=_randn(g, (b, n, c.in_channels), device, dtype),
        encoder_hidden_states=_randn(g, (b, text, c.joint_attention_dim), device, dtype),
        pooled_projections=_randn(g, (b, c.pooled_projection_dim), device, dtype),
        timestep=torch.full((b,), 0.5, device=device, dtype=dtype),
        img_ids=img_ids.to(device), txt_ids=torch.zeros(text, 3, device=device), return_dict=False)
    if c.guidance_embeds:
        out["guidance"] = torch.full((b,), 3.5, device=device, dtype=dtype)
    return out


def flux2_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> dict:
    """diffusers Flux2Transformer2DModel (FLUX.2): packed image latents, the text encoder's
    states, and four-axis position ids (time, height, width, layer), guidance where embedded."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, n, text, h, w = _image_shape(workload, "FLUX.2")
    img_ids = _image_ids(h, w, 4)
    txt_ids = torch.zeros(text, 4)
    txt_ids[:, 3] = torch.arange(text).float()
    out = dict(
        hidden_states=_randn(g, (b, n, c.in_channels), device, dtype),
        encoder_hidden_states=_randn(g, (b, text, c.joint_attention_dim), device, dtype),
        timestep=torch.full((b,), 0.5, device=device, dtype=dtype),
        img_ids=img_ids.to(device), txt_ids=txt_ids.to(device), return_dict=False)
    if c.guidance_embeds:
        out["guidance"] = torch.full((b,), 4.0, device=device, dtype=dtype)
    return out


def zimage_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                  seed: int = 0) -> dict:
    """diffusers ZImageTransformer2DModel (Z-Image): one latent image (channels, 1 frame, height,
    width) per sample on the squarest grid of the workload's image tokens (2 x 2 latent pixels
    each), its caption's features, timestep; as lists, one entry a sample."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, n, text, h, w = _image_shape(workload, "Z-Image")
    p = c.all_patch_size[0]
    return dict(x=[_randn(g, (c.in_channels, 1, h * p, w * p), device, dtype) for _ in range(b)],
                t=torch.full((b,), 0.5, device=device, dtype=dtype),
                cap_feats=[_randn(g, (text, c.cap_feat_dim), device, dtype) for _ in range(b)],
                patch_size=p, return_dict=False)


def wan_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> dict:
    """diffusers WanTransformer3DModel: a latent video (channels, frames, height, width), UMT5 text, timestep."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = c.patch_size
    frames, height, width = _grid(workload.video_tokens)
    return dict(
        hidden_states=_randn(g, (workload.batch, c.in_channels, frames * pt, height * ph, width * pw), device, dtype),
        timestep=torch.full((workload.batch,), 500, device=device, dtype=torch.long),
        encoder_hidden_states=_randn(g, (workload.batch, max(1, workload.text_tokens), c.text_dim), device, dtype),
        return_dict=False)


def hunyuan_video_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                         seed: int = 0) -> dict:
    """diffusers HunyuanVideoTransformer3DModel: a latent video (channels, frames, height, width),
    LLaVA text states with their mask, CLIP pooled, timestep and the distilled guidance."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b = workload.batch
    return dict(
        **_hunyuan_video(g, c, workload, device, dtype),
        timestep=torch.full((b,), 500, device=device, dtype=torch.long),
        pooled_projections=_randn(g, (b, c.pooled_projection_dim), device, dtype),
        guidance=torch.full((b,), 6000.0, device=device, dtype=dtype), return_dict=False)


def _hunyuan_video(g: torch.Generator, c: Any, workload: Any, device: torch.device, dtype: torch.dtype) -> dict:
    """What HunyuanVideo and HunyuanVideo 1.5 take alike: a latent video (channels, frames,
    height, width) on the workload's token grid and the LLM's text states with their mask."""
    b, text = workload.batch, max(1, workload.text_tokens)
    frames, height, width = _grid(workload.video_tokens)
    shape = (b, c.in_channels, frames * c.patch_size_t, height * c.patch_size, width * c.patch_size)
    return dict(hidden_states=_randn(g, shape, device, dtype),
                encoder_hidden_states=_randn(g, (b, text, c.text_embed_dim), device, dtype),
                encoder_attention_mask=torch.ones(b, text, device=device, dtype=torch.long))


def hunyuan_image_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                         seed: int = 0) -> dict:
    """diffusers HunyuanImageTransformer2DModel (HunyuanImage 2.1): one latent image (channels,
    height, width) per sample on the squarest grid of the workload's image tokens (a latent
    pixel each, patch size 1), its text states with their mask (the text joins every block's
    attention through it), timestep; the ByT5 states where the config reads them."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, n, text, h, w = _image_shape(workload, "HunyuanImage")
    ph, pw = c.patch_size[-2:]
    out = dict(hidden_states=_randn(g, (b, c.in_channels, h * ph, w * pw), device, dtype),
               timestep=torch.full((b,), 500.0, device=device, dtype=dtype),  # embedded in its own dtype
               encoder_hidden_states=_randn(g, (b, text, c.text_embed_dim), device, dtype),
               encoder_attention_mask=torch.ones(b, text, device=device, dtype=torch.long), return_dict=False)
    if c.text_embed_2_dim is not None:
        out.update(encoder_hidden_states_2=_randn(g, (b, text, c.text_embed_2_dim), device, dtype),
                   encoder_attention_mask_2=torch.ones(b, text, device=device, dtype=torch.long))
    if c.guidance_embeds:
        out["guidance"] = torch.full((b,), 3500.0, device=device, dtype=dtype)
    return out


# HunyuanVideo 1.5's image condition: SigLIP's 27 x 27 patch features of the first frame.
HUNYUAN_VIDEO15_IMAGE_TOKENS = 729


def hunyuan_video15_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                           seed: int = 0) -> dict:
    """diffusers HunyuanVideo15Transformer3DModel (HunyuanVideo 1.5): a latent video (channels,
    frames, height, width), the LLM's text states and ByT5's, each with its mask, the first
    frame's SigLIP features, timestep. The model gathers each prompt's valid tokens by its mask
    before the blocks (engine/modules/meta_values.py on the meta device)."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, text = workload.batch, max(1, workload.text_tokens)
    return dict(
        **_hunyuan_video(g, c, workload, device, dtype),
        timestep=torch.full((b,), 500.0, device=device, dtype=dtype),
        encoder_hidden_states_2=_randn(g, (b, text, c.text_embed_2_dim), device, dtype),
        encoder_attention_mask_2=torch.ones(b, text, device=device, dtype=torch.long),
        image_embeds=_randn(g, (b, HUNYUAN_VIDEO15_IMAGE_TOKENS, c.image_embed_dim), device, dtype),
        return_dict=False)


def qwen_image_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                      seed: int = 0) -> dict:
    """diffusers QwenImageTransformer2DModel: packed image latents on a square grid, Qwen2.5-VL
    text states with their mask, timestep."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, n, text, h, w = _image_shape(workload, "Qwen-Image")
    return dict(
        hidden_states=_randn(g, (b, n, c.in_channels), device, dtype),
        encoder_hidden_states=_randn(g, (b, text, c.joint_attention_dim), device, dtype),
        encoder_hidden_states_mask=torch.ones(b, text, device=device, dtype=torch.long),
        timestep=torch.full((b,), 0.5, device=device, dtype=dtype),
        img_shapes=[[(1, h, w)]] * b, return_dict=False)


def sd3_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> dict:
    """diffusers SD3Transformer2DModel (Stable Diffusion 3 and 3.5): latents on the squarest
    grid of the workload's image tokens (patch_size pixels of latent a side each), the CLIP
    and T5 text states, CLIP pooled, timestep."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, n, text, h, w = _embedded_grid(workload, "SD3", c.pos_embed_max_size)
    return dict(
        hidden_states=_randn(g, (b, c.in_channels, h * c.patch_size, w * c.patch_size), device, dtype),
        encoder_hidden_states=_randn(g, (b, text, c.joint_attention_dim), device, dtype),
        pooled_projections=_randn(g, (b, c.pooled_projection_dim), device, dtype),
        timestep=torch.full((b,), 500.0, device=device, dtype=dtype), return_dict=False)


def mochi_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> dict:
    """diffusers MochiTransformer3DModel: a latent video (channels, frames, height, width; patch_size
    pixels of latent a side per token, one frame deep), T5 text states with their mask, timestep."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, text = workload.batch, max(1, workload.text_tokens)
    if text > c.max_sequence_length:
        raise ConfigError(f"workload.text_tokens={text}: Mochi's caption pooling takes at most "
                          f"{c.max_sequence_length} text tokens; give workload.text_tokens<={c.max_sequence_length}")
    frames, height, width = _grid(workload.video_tokens)
    return dict(
        hidden_states=_randn(g, (b, c.in_channels, frames, height * c.patch_size, width * c.patch_size), device, dtype),
        encoder_hidden_states=_randn(g, (b, text, c.text_embed_dim), device, dtype),
        timestep=torch.full((b,), 500, device=device, dtype=torch.long),
        encoder_attention_mask=torch.ones(b, text, device=device, dtype=torch.bool), return_dict=False)


def auraflow_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                    seed: int = 0) -> dict:
    """diffusers AuraFlowTransformer2DModel: latents on the squarest grid of the workload's image
    tokens (patch_size pixels of latent a side each), the text encoder's states, timestep."""
    c = module.config
    g = torch.Generator().manual_seed(seed)
    b, n, text, h, w = _embedded_grid(workload, "AuraFlow", math.isqrt(c.pos_embed_max_size),
                                      ", or raise model.module.pos_embed_max_size")
    return dict(
        hidden_states=_randn(g, (b, c.in_channels, h * c.patch_size, w * c.patch_size), device, dtype),
        encoder_hidden_states=_randn(g, (b, text, c.joint_attention_dim), device, dtype),
        timestep=torch.full((b,), 500.0, device=device, dtype=dtype), return_dict=False)


def llama_inputs(module: nn.Module, workload: Any, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> dict:
    """A transformers causal LM (LlamaForCausalLM and its kin): decode (workload.kind decode)
    is one new token per sequence over a KV cache of workload.context_tokens random keys and
    values, every step reading it at that length (`_fixed_length`) so every step is the same;
    otherwise a forward over workload.text_tokens tokens: a prefill filling a new KV cache, as
    generate's does, or a training step's, without one."""
    from transformers import DynamicCache

    c = module.config
    g = torch.Generator().manual_seed(seed)
    b = workload.batch
    if workload.kind != "decode":
        ids = torch.randint(0, c.vocab_size, (b, max(1, workload.text_tokens)), generator=g)
        return dict(input_ids=ids.to(device), use_cache=workload.kind != "train_lora")
    ctx = workload.context_tokens
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = DynamicCache(config=c)
    for layer in range(c.num_hidden_layers):
        k = _randn(g, (b, c.num_key_value_heads, ctx, head_dim), device, dtype)
        cache.update(k, torch.randn_like(k), layer)
    return {"input_ids": torch.randint(0, c.vocab_size, (b, 1), generator=g).to(device),
            _cache_argument(module): _fixed_length(cache), "position_ids": torch.full((b, 1), ctx, device=device),
            "use_cache": True}


def _cache_argument(module: nn.Module) -> str:
    """The name `module`'s forward takes a KV cache by: `cache` in newer transformers, which
    deprecate `past_key_values`; `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _fixed_length(cache: Any) -> Any:
    """`cache`, read at the length it was built with by every forward: each layer's update
    returns the new token's keys and values appended, then the layer goes back to its built
    state (its keys and values; a sliding-window layer's count of the tokens it has seen). So
    between forwards the cache reads its built length, and the masks a forward sizes from it
    before any layer runs match the keys each layer returns."""
    built = [(layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in cache.layers]
    update = cache.update

    def update_and_restore(key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kw: Any) -> Any:
        out = update(key, value, layer_idx, *args, **kw)
        layer = cache.layers[layer_idx]
        layer.keys, layer.values, seen = built[layer_idx]
        if seen is not None:
            layer.cumulative_length = seen
        return out

    cache.update = update_and_restore
    return cache
