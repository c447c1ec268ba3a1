"""LoRA adapters in mlx-lm's format: add them (`add_lora`), fold them into the weights (`fuse_lora`), or save
them beside the untouched base weights (`save_unfused`, loadable with `mlx_lm.load(folder, adapter_path=folder)`);
`weights_writer` picks one of the two for an export.

A LoRA layer computes W x + scale * B A x (rank r; A random, B zero at the start), so before training the model
is unchanged; fusing writes W + scale * B A (re-quantized for a quantized base, as `mlx_lm fuse` does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

# mlx-lm is imported inside the functions that use it: `plan` imports this module (for LoraSpec) and must not pay
# for mlx-lm, whose package loads transformers (~1.2 s on a 2-core CPU).


@dataclass(frozen=True)
class LoraSpec:
    """rank r, mlx-lm's output `scale`, and how many of the last transformer blocks carry adapters."""

    rank: int
    scale: float
    num_layers: int


def add_lora(model: nn.Module, spec: LoraSpec, seed: int) -> None:
    """Freeze the model and add LoRA adapters (mlx-lm's default projections) to its last `spec.num_layers` blocks;
    the adapters' random A matrices come from `seed`."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(seed)
    model.freeze()
    linear_to_lora_layers(model, spec.num_layers, {"rank": spec.rank, "scale": spec.scale, "dropout": 0.0})


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "fuse") and hasattr(m, "lora_a")]


def fuse_lora(model: nn.Module) -> None:
    """Fold every LoRA layer into its base layer in place (W <- W + scale * B A, re-quantized if needed)."""
    fused = [(n, m.fuse()) for n, m in lora_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))


def save_unfused(model: nn.Module, folder: Path, spec: LoraSpec) -> None:
    """Base weights as model*.safetensors plus adapters.safetensors + adapter_config.json (mlx-lm's format)."""
    from mlx_lm.utils import save_model

    loras = lora_modules(model)
    adapters = {}
    for name, m in loras:
        adapters[f"{name}.lora_a"] = m.lora_a
        adapters[f"{name}.lora_b"] = m.lora_b
    model.update_modules(tree_unflatten([(n, m.linear) for n, m in loras]))
    try:
        save_model(folder, model)
    finally:
        model.update_modules(tree_unflatten(loras))
    mx.save_safetensors(str(folder / "adapters.safetensors"), adapters)
    adapter_config = {"fine_tune_type": "lora", "num_layers": spec.num_layers,
                      "lora_parameters": {"rank": spec.rank, "scale": spec.scale, "dropout": 0.0}}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")


def weights_writer(spec: LoraSpec | None, fuse: bool) -> Callable[[nn.Module, Path], None]:
    """How an export writes the trained model's weights into a folder (`pose_mlx.model.export.export_model`'s
    `save_weights`): LoRA folded in (`fuse_lora`, then mlx-lm's `save_model`), or, for LoRA with `fuse` false,
    the base weights and the adapters apart (`save_unfused`). Without LoRA (`spec` None) the model as it is."""
    from mlx_lm.utils import save_model

    if spec is not None and not fuse:
        return lambda model, folder: save_unfused(model, folder, spec)

    def fused(model: nn.Module, folder: Path) -> None:
        fuse_lora(model)
        save_model(folder, model)

    return fused


__all__ = ["LoraSpec", "add_lora", "fuse_lora", "lora_modules", "save_unfused", "weights_writer"]
