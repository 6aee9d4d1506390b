"""Real torch modules (a diffusers or transformers model, any nn.Module) on the engine.

    kernels.py     the module's kernels (blocks, or leaves) and the recording forward's order
    checkpoint.py  its weights from a safetensors file or model directory, mapped and checked
    streamed.py    StreamedModule: host side, placeholders, recorded order, hooks; remove() undoes it
    hooks.py       the forward hooks that fetch each kernel's weights from a source
    record.py      each kernel timed on the device -> a trace the simulator replays
    offload.py     the Python API: engine.offload(module, ...) and engine.record(module, ...)
    untouched.py   what set-up's own forwards must leave as they found it (gradients, buffers, RNG)
    build.py       a model config's `_target_` built with its parameters on the meta device,
                   its example inputs, and random weights for it (mode=materialize)
"""
