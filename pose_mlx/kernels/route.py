"""Routing a model's attention and SwiGLU through other functions, by the names mlx-lm's model modules call.

mlx-lm's family modules (`mlx_lm.models.llama`, `qwen2`, ...) import `scaled_dot_product_attention` from
`mlx_lm.models.base` and `swiglu` from `mlx_lm.models.activations`, and call them by those module-level names.
`swapped(model, name, original, replacement)` rebinds the name in every module that defines one of `model`'s layers
and still holds `original` there, for the block, and restores it on exit (process-wide for those modules while the
block runs: another model of the same family evaluated meanwhile takes the same path, which computes the same
function). A family that computes attention or its MLP itself is left as it is.

`training_route(model)` is what training runs under: on a backend without a fused attention backward (the CPU;
Metal, which trains unfused) attention goes through `pose_mlx.kernels.attention` (blocks of queries, no L x L
scores kept); where the vectorized CPU kernels are built, SwiGLU and `nn.RMSNorm` go through them; on the CPU, mlx-lm's LoRA layers
compute through `kernels.lora` (the adapter's product accumulated into the base's). CUDA keeps cuDNN's attention.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from . import attention as blocked
from . import layers, lora, rows

# mlx-lm is imported where it is used: its package loads transformers (about a second on a 2-core CPU).

ATTENTION = "scaled_dot_product_attention"
SWIGLU = "swiglu"


def modules_calling(model: nn.Module, name: str, original) -> list:
    """The Python modules defining `model`'s layers whose module-level `name` is `original`."""
    found = {}
    layers = model.named_modules() if isinstance(model, nn.Module) else []
    for _, layer in layers:
        module = sys.modules.get(type(layer).__module__)
        if module is not None and getattr(module, name, None) is original:
            found[module.__name__] = module
    return list(found.values())


@contextlib.contextmanager
def rebound(owners: list, name: str, original, replacement) -> Iterator[None]:
    """Set attribute `name` of each of `owners` (modules or classes) to `replacement` for the block, then back to
    `original`, however the block ends."""
    for owner in owners:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner in owners:
            setattr(owner, name, original)


@contextlib.contextmanager
def swapped(model: nn.Module, name: str, original, replacement) -> Iterator[list]:
    """Bind `name` to `replacement` in `modules_calling(model, name, original)` for the block; yields their names."""
    modules = modules_calling(model, name, original)
    with rebound(modules, name, original, replacement):
        yield [module.__name__ for module in modules]


def lacks_fused_backward() -> bool:
    """Whether training on MLX's default device would keep L x L attention scores: the CPU, and Metal."""
    return mx.default_device().type == mx.DeviceType.cpu or mx.metal.is_available()


@contextlib.contextmanager
def in_order() -> Iterator[None]:
    """Evaluate MLX graphs without running ahead, within the block, on the CPU: what a graph itself holds.

    MLX's CPU backend hands each operation to a worker thread and allocates its output as it does, so the main
    thread may allocate the outputs of about a hundred operations before the worker has computed the first; the
    peak memory of a graph is then what it holds plus that lead. MLX waits for the worker whenever the active
    memory is over its memory limit; setting the limit to the memory in use when the block starts makes every
    evaluation inside wait, one task at a time. Tests and benchmarks measure the kernels' own memory this way.
    Training does not use it: MLX's wait busy-loops on its last task, which costs a core (about half of a
    2-core step), and the lead is bounded (`pose_mlx.memory` counts it). No effect off the CPU."""
    if mx.default_device().type != mx.DeviceType.cpu:
        yield
        return
    previous = mx.set_memory_limit(mx.get_active_memory())
    try:
        yield
    finally:
        mx.set_memory_limit(previous)


def blocked_attention(queries, keys, values, cache=None, scale: float = 1.0, mask=None, sinks=None):
    """Drop-in for mlx-lm's `scaled_dot_product_attention`: `pose_mlx.kernels.attention` without a KV cache or
    attention sinks, else mlx-lm's own function."""
    if cache is None and sinks is None:
        return blocked.attention(queries, keys, values, scale, mask)
    from mlx_lm.models import base

    return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                             sinks=sinks)


@contextlib.contextmanager
def rebound_call(model: nn.Module, cls: type, replacement) -> Iterator[list]:
    """Bind `cls.__call__` to `replacement(original call)` for the block, if `model` has layers of `cls`
    (process-wide for that class while the block runs, as `swapped`); yields the rebound name."""
    owners = [cls] if any(isinstance(layer, cls) for _, layer in model.named_modules()) else []
    original = cls.__call__
    with rebound(owners, "__call__", original, replacement(original)):
        yield [f"{cls.__module__}.{cls.__name__}.__call__" for _ in owners]


def fused_lora(model: nn.Module):
    """mlx-lm's `LoRALinear.__call__` bound to `kernels.lora.fused_call` for the block (`rebound_call`)."""
    from mlx_lm.tuner.lora import LoRALinear

    return rebound_call(model, LoRALinear, lora.fused_call)


def native_norms(model: nn.Module):
    """`nn.RMSNorm.__call__` bound to `kernels.layers.rms_norm` for the block (`rebound_call`)."""
    return rebound_call(model, nn.RMSNorm, layers.norm_call)


@contextlib.contextmanager
def training_route(model: nn.Module, kernels: str = "auto") -> Iterator[list]:
    """Route `model` for training on this backend (module docstring), or not at all with `kernels` "mlx"; yields
    the swapped names."""
    from mlx_lm.models import activations, base

    with contextlib.ExitStack() as stack:
        routed = []
        if kernels == "auto" and lacks_fused_backward():
            routed += stack.enter_context(swapped(model, ATTENTION, base.scaled_dot_product_attention,
                                                  blocked_attention))
        if kernels == "auto" and rows.native(mx.zeros(1)) is not None:
            routed += stack.enter_context(swapped(model, SWIGLU, activations.swiglu, rows.swiglu))
            routed += stack.enter_context(native_norms(model))
        if kernels == "auto" and mx.default_device().type == mx.DeviceType.cpu:
            routed += stack.enter_context(fused_lora(model))
        yield routed


__all__ = ["ATTENTION", "SWIGLU", "blocked_attention", "fused_lora", "in_order", "lacks_fused_backward",
           "modules_calling", "native_norms", "rebound_call", "swapped", "training_route"]
