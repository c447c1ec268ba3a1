"""Replace the RoPE layers of an mlx-lm model by ones that follow a frequency schedule and explicit positions.

RoPE (PoSE paper, eq. 1) rotates each pair (x_{2i}, x_{2i+1}) of a query/key at position m by the angle
m * theta_i. PoSE trains on a short window whose *position ids* skip ahead (eq. 3-5), so the model must be
able to rotate token t by an arbitrary position p_t instead of (cache offset + t).

- `PositionRoPE`: a drop-in RoPE layer. With no positions set it calls `mx.fast.rope` with the scheduled
  frequencies and the cache offset (so generation, evaluation and chunked prefill are unchanged); inside
  `use_positions(model, ids)` it rotates token t by ids[..., t] (cos/sin built from ids * inv_freq).
- `extend(model, method, original_length, target_length, **params)`: swaps every RoPE layer in place.
- `use_positions(model, position_ids)`: context manager; the ids stay set for the forward *and* the
  backward pass (needed with gradient checkpointing, which re-runs the forward during backward).
- `load(path)`: `mlx_lm.load` plus the schedule recorded in `pose_mlx.json`, for schedules that a plain
  mlx-lm config cannot express.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils

from .rope import dynamic_ntk_base, scaled_inv_freq

SCHEDULE_FILE = "pose_mlx.json"


class _PositionHolder:
    """Plain (non-Module, non-array) holder so MLX never treats the position ids as parameters."""

    __slots__ = ("positions",)

    def __init__(self):
        self.positions = None


@dataclass
class Extension:
    """What `extend` did to a model; kept on the model as `model.pose_extension` and exported."""

    method: str
    original_length: int
    target_length: int
    factor: float
    params: dict = field(default_factory=dict)
    base: float = 10000.0
    rotary_dims: int = 0
    traditional: bool = False
    attention_factor: float = 1.0
    replaced: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class PositionRoPE(nn.Module):
    """RoPE with precomputed scheduled inverse frequencies and optional explicit per-token positions.

    angle(t, i) = p_t * inv_freq[i]; the first `dims` features of x (B, H, L, D) are rotated, in the
    interleaved (`traditional=True`: pairs 2i, 2i+1) or half-split (pairs i, i + dims/2) layout, after
    multiplying them by `attention_factor` (YaRN's mscale, applied to both q and k).
    """

    def __init__(
        self,
        dims: int,
        inv_freq: np.ndarray,
        traditional: bool,
        attention_factor: float = 1.0,
        holder: _PositionHolder | None = None,
        dynamic: dict | None = None,
    ):
        super().__init__()
        if dims % 2 or len(inv_freq) != dims // 2:
            raise ValueError(f"dims={dims} must be even and match len(inv_freq)={len(inv_freq)} * 2")
        self.dims = dims
        self.traditional = traditional
        self.attention_factor = float(attention_factor)
        self._inv_freq = mx.array(np.asarray(inv_freq, dtype=np.float32))
        self._freqs = mx.array((1.0 / np.asarray(inv_freq, dtype=np.float64)).astype(np.float32))
        self._holder = holder or _PositionHolder()
        self._dynamic = dynamic  # {"base", "factor", "original_length"} for dynamic NTK at inference

    def extra_repr(self) -> str:
        return f"{self.dims}, traditional={self.traditional}, attention_factor={self.attention_factor:.4f}"

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if self.attention_factor != 1.0:
            x = x.at[..., : self.dims].multiply(self.attention_factor)
        positions = self._holder.positions
        if positions is not None:
            return self._rotate_at(x, positions)
        if self._dynamic is not None:
            return self._dynamic_rope(x, offset)
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )

    def _dynamic_rope(self, x: mx.array, offset) -> mx.array:
        """Dynamic NTK: the base grows with the current sequence length (cache offset + new tokens)."""
        past = offset if isinstance(offset, int) else int(mx.max(offset).item())
        base = dynamic_ntk_base(
            self._dynamic["base"], self.dims, self._dynamic["factor"],
            self._dynamic["original_length"], x.shape[-2] + past,
        )
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=base, scale=1.0, offset=offset)

    def _rotate_at(self, x: mx.array, positions: mx.array) -> mx.array:
        """Rotate token t of x (B, H, L, D) by positions[..., t]; positions is (L,) or (B, L)."""
        length = x.shape[-2]
        if positions.shape[-1] != length:
            raise ValueError(f"position ids cover {positions.shape[-1]} tokens but the input has {length}")
        angles = positions.astype(mx.float32)[..., None] * self._inv_freq  # (L, d/2) or (B, L, d/2)
        if angles.ndim == 3:
            angles = angles[:, None]  # broadcast over heads
        cos, sin = mx.cos(angles), mx.sin(angles)
        d, half = self.dims, self.dims // 2
        rot = x[..., :d].astype(mx.float32)
        if self.traditional:
            pairs = rot.reshape(*rot.shape[:-1], half, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
        else:
            a, b = rot[..., :half], rot[..., half:]
            out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        out = out.astype(x.dtype)
        if d < x.shape[-1]:
            out = mx.concatenate([out, x[..., d:]], axis=-1)
        return out


_ROPE_TYPES = (
    nn.RoPE,
    PositionRoPE,
    rope_utils.SuScaledRoPE,
    rope_utils.Llama3RoPE,
    rope_utils.YarnRoPE,
    rope_utils.DynamicNTKScalingRoPE,
)


def find_rope_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """All RoPE layers of the model as (dotted path, module), found by walking the module tree."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, _ROPE_TYPES)]
    unknown = [
        name for name, m in model.named_modules()
        if "rope" in type(m).__name__.lower() and not isinstance(m, _ROPE_TYPES)
    ]
    if unknown:
        raise ValueError(f"unsupported RoPE layer type at {unknown[0]} ({type(dict(model.named_modules())[unknown[0]]).__name__})")
    return found


def _config_base(model: nn.Module) -> float | None:
    """rope_theta from the model's args (mlx-lm keeps the parsed config in `model.args`)."""
    args = getattr(model, "args", None)
    for key in ("rope_theta", "rotary_emb_base"):
        value = getattr(args, key, None)
        if value:
            return float(value)
    params = getattr(args, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta"):
        return float(params["rope_theta"])
    return None


def _describe(module: nn.Module, model: nn.Module) -> tuple[int, bool, float, bool]:
    """(rotary dims, traditional layout, raw base, already scaled?) of an existing RoPE layer."""
    if isinstance(module, PositionRoPE):
        raise ValueError("model is already extended; load the original model to extend it again")
    if isinstance(module, nn.RoPE):
        return module.dims, module.traditional, float(module.base), module.scale != 1.0
    if isinstance(module, rope_utils.DynamicNTKScalingRoPE):
        return module.dims, module.traditional, float(module.base), True
    base = _config_base(model)
    if base is None:
        raise ValueError(f"cannot find the RoPE base of {type(module).__name__} (no rope_theta in model.args)")
    if isinstance(module, rope_utils.SuScaledRoPE):
        return module.dim, False, base, True
    return module.dims, module.traditional, base, True


def _set_child(model: nn.Module, path: str, new: nn.Module) -> None:
    *parents, last = path.split(".")
    obj = model
    for part in parents:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    obj[last] = new


def extend(model: nn.Module, method: str, original_length: int, target_length: int, **params) -> nn.Module:
    """Replace every RoPE layer of `model` (in place) by a `PositionRoPE` following `method`.

    The schedule is computed from the model's raw base frequencies theta_i = base^(-2i/d) with
    factor s = target_length / original_length (or `factor=` in params); an existing scaling in the model
    (e.g. a rope_scaling in its config) is replaced, not compounded, with a warning. Returns the model.
    """
    if original_length <= 0 or target_length <= 0:
        raise ValueError(f"original_length={original_length} and target_length={target_length} must be positive")
    params = dict(params)
    factor = float(params.pop("factor", target_length / original_length))
    ropes = find_rope_modules(model)
    if not ropes:
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        raise ValueError(f"model '{kind}' has no RoPE layers (it uses another position encoding); cannot extend it")
    holder = _PositionHolder()
    info = None
    for path, module in ropes:
        dims, traditional, base, scaled = _describe(module, model)
        if scaled and info is None:
            warnings.warn(
                f"{path} already applies a RoPE scaling ({type(module).__name__}); it is replaced by '{method}' "
                f"computed from the raw base {base:g}",
                stacklevel=2,
            )
        inv_freq, attention_factor = scaled_inv_freq(method, dims, base, factor, original_length, **params)
        dynamic = None
        if method == "dynamic":
            dynamic = {"base": base, "factor": factor, "original_length": original_length}
        new = PositionRoPE(dims, inv_freq, traditional, attention_factor, holder, dynamic)
        _set_child(model, path, new)
        if info is None:
            info = Extension(
                method=method, original_length=int(original_length), target_length=int(target_length),
                factor=factor, params=params, base=base, rotary_dims=dims, traditional=traditional,
                attention_factor=float(attention_factor),
            )
        info.replaced.append(path)
    model.pose_extension = info
    return model


def _as_position_array(position_ids) -> mx.array:
    ids = position_ids if isinstance(position_ids, mx.array) else mx.array(np.asarray(position_ids))
    if ids.ndim not in (1, 2):
        raise ValueError(f"position_ids must have shape (L,) or (B, L), got {tuple(ids.shape)}")
    if not mx.issubdtype(ids.dtype, mx.integer):
        raise ValueError(f"position_ids must be integers, got {ids.dtype}")
    return ids.astype(mx.int32)


@contextlib.contextmanager
def use_positions(model: nn.Module, position_ids) -> Iterator[None]:
    """Within the block, every `PositionRoPE` of `model` rotates token t by position_ids[..., t].

    Wrap the whole forward + backward (e.g. the `value_and_grad` call), not just the loss: gradient
    checkpointing recomputes the forward during the backward pass and must see the same positions.
    """
    holders = {id(m._holder): m._holder for _, m in model.named_modules() if isinstance(m, PositionRoPE)}
    if not holders:
        raise ValueError("model has no PositionRoPE layers; call pose_mlx.extend(model, ...) first")
    ids = _as_position_array(position_ids)
    previous = [(h, h.positions) for h in holders.values()]
    for h in holders.values():
        h.positions = ids
    try:
        yield
    finally:
        for h, old in previous:
            h.positions = old


def save_extension(model: nn.Module, folder: str | Path, **extra) -> Path:
    """Write `pose_mlx.json` (the schedule and anything in `extra`) into a model folder."""
    info = getattr(model, "pose_extension", None)
    if info is None:
        raise ValueError("model was not extended with pose_mlx.extend")
    path = Path(folder) / SCHEDULE_FILE
    record = {"schedule": info.to_dict(), **extra}
    path.write_text(json.dumps(record, indent=2, default=float) + "\n")
    return path


def load(path: str | Path, **kwargs):
    """`mlx_lm.load(path)` and, when the folder has a `pose_mlx.json`, re-apply its schedule exactly.

    Returns (model, tokenizer). Use this for schedules mlx-lm's config cannot express (dprope, the
    wavelength-blend YaRN); for the others plain `mlx_lm.load` gives the same model.
    """
    from mlx_lm import load as mlx_load

    model, tokenizer = mlx_load(str(path), **kwargs)
    apply_saved_extension(model, path)
    return model, tokenizer


def apply_saved_extension(model: nn.Module, folder: str | Path) -> bool:
    """Re-apply the schedule recorded in `folder/pose_mlx.json` to a freshly loaded model; False if none."""
    record_path = Path(folder) / SCHEDULE_FILE
    if not record_path.exists():
        return False
    s = json.loads(record_path.read_text())["schedule"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exported config's own scaling is replaced by the exact one
        extend(model, s["method"], s["original_length"], s["target_length"], factor=s["factor"], **s["params"])
    return True


__all__ = [
    "Extension", "PositionRoPE", "apply_saved_extension", "extend", "find_rope_modules", "load", "save_extension", "use_positions",
]
