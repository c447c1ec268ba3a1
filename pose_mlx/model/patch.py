"""Replace the RoPE layers of an mlx-lm model by ones that follow a frequency schedule and explicit positions.

RoPE (PoSE paper, eq. 1) rotates each pair (x_{2i}, x_{2i+1}) of a query/key at position m by the angle
m * theta_i. PoSE trains on a short window whose *position ids* skip ahead (eqs. 3-5), so the model must be
able to rotate token t by an arbitrary position p_t instead of (cache offset + t).

- `PositionRoPE`: a drop-in RoPE layer. With no positions set it calls `mx.fast.rope` with the scheduled
  frequencies and the cache offset (so generation, evaluation and chunked prefill are unchanged); inside
  `use_positions(model, ids)` it rotates token t by ids[..., t] (cos/sin built from ids * inv_freq).
- `extend(model, schedule, original, target, **params)`: swaps every RoPE layer in place and returns the
  `Extension` record of what it did, layer by layer (the exporter writes the config from it).
- `use_positions(model, position_ids, original_rows=None)`: context manager; the ids stay set for the forward
  *and* the backward pass (needed with gradient checkpointing, which re-runs the forward during backward);
  `original_rows` (B,) marks the rows that rotate with the model's original frequencies and attention factor 1
  (mixed-window training, `--short-share`).
- `use_length(model, n)`: dynamic NTK sets its base from the length of the whole sequence being read (n), as
  one forward pass over it would, however the sequence is split into prefill chunks.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils

from ..errors import UserError
from ..kernels import layers
from ..rope import dynamic_ntk_base, rope_inv_freq, scaled_inv_freq

#: Config keys that hold a RoPE base, in the order they are matched against a layer's base.
BASE_KEYS = ("rope_theta", "rope_local_base_freq", "rotary_emb_base", "rope_base")


class _Holder:
    """Plain (non-Module, non-array) holder shared by a model's RoPE layers, so MLX never treats its contents as
    parameters: the explicit position ids (or None), the per-row selector of the original frequencies (bool (B,)
    or None) and the declared sequence length for dynamic NTK (or None)."""

    __slots__ = ("positions", "original", "length", "tables")

    def __init__(self):
        self.positions = None
        self.original = None
        self.length = None
        self.tables = {}  # (cos, sin) of the angles at the positions set, by frequencies: every layer shares them


@dataclass
class RopeLayer:
    """One replaced RoPE layer: where it is, its raw base (and the config key it came from), its layout, the
    scheduled inverse frequencies it now uses, their per-pair factors lambda_i = theta_i / inv_freq_i against the
    raw ones, and its attention factor."""

    path: str
    base: float
    config_key: str | None
    dims: int
    traditional: bool
    inv_freq: list
    factors: list
    attention_factor: float


@dataclass
class Extension:
    """What `extend` did to a model (kept as `model.pose_extension`; the exporter and pose_mlx.json read it)."""

    schedule: str
    params: dict
    original: int
    target: int
    factor: float
    layers: list = field(default_factory=list)

    @property
    def dynamic(self) -> bool:
        return self.schedule == "dynamic"

    def to_dict(self) -> dict:
        return asdict(self)


class PositionRoPE(nn.Module):
    """RoPE with precomputed scheduled inverse frequencies and optional explicit per-token positions.

    angle(t, i) = p_t * inv_freq[i]; the first `dims` features of x (B, H, L, D) are rotated, in the
    interleaved (`traditional=True`: pairs 2i, 2i+1) or half-split (pairs i, i + dims/2) layout, after
    multiplying them by `attention_factor` (YaRN's mscale, applied to both q and k). With explicit positions and
    a row selector set (`use_positions(..., original_rows=)`), a selected row b uses angle(t, i) =
    p_{b,t} * original_inv_freq[i] and attention factor 1 instead: the model's own RoPE.
    """

    def __init__(
        self,
        dims: int,
        inv_freq: np.ndarray,
        traditional: bool,
        attention_factor: float = 1.0,
        holder: _Holder | None = None,
        dynamic: dict | None = None,
        original_inv_freq: np.ndarray | None = None,
    ):
        super().__init__()
        if dims % 2 or len(inv_freq) != dims // 2:
            raise ValueError(f"dims={dims} must be even and match len(inv_freq)={len(inv_freq)} * 2")
        self.dims = dims
        self.traditional = traditional
        self.attention_factor = float(attention_factor)
        self._inv_freq = mx.array(np.asarray(inv_freq, dtype=np.float32))
        self._inv_freq_key = np.asarray(inv_freq, dtype=np.float32).tobytes()
        self._freqs = mx.array((1.0 / np.asarray(inv_freq, dtype=np.float64)).astype(np.float32))
        original = inv_freq if original_inv_freq is None else original_inv_freq
        if len(original) != dims // 2:
            raise ValueError(f"original_inv_freq has {len(original)} entries, expected {dims // 2}")
        self._original_inv_freq = mx.array(np.asarray(original, dtype=np.float32))
        self._holder = holder or _Holder()
        self._dynamic = dynamic  # {"base", "factor", "original"} for dynamic NTK at inference

    def extra_repr(self) -> str:
        return f"{self.dims}, traditional={self.traditional}, attention_factor={self.attention_factor:.4f}"

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        positions, original = self._holder.positions, self._holder.original
        if positions is not None and original is not None:
            return self._rotate_mixed(x, positions, original)
        if positions is not None:
            return self._rotate_at(x, positions, scale=self.attention_factor)
        if self.attention_factor != 1.0:
            x = x.at[..., : self.dims].multiply(self.attention_factor)
        if self._dynamic is not None:
            return self._dynamic_rope(x, offset)
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )

    def _dynamic_rope(self, x: mx.array, offset) -> mx.array:
        """Dynamic NTK: the base is set by the sequence length, the declared one (`use_length`) when the whole
        sequence is known, else the length read so far (cache offset + new tokens, e.g. while generating)."""
        past = offset if isinstance(offset, int) else int(mx.max(offset).item())
        length = max(self._holder.length or 0, x.shape[-2] + past)
        base = dynamic_ntk_base(self._dynamic["base"], self.dims, self._dynamic["factor"],
                                self._dynamic["original"], length)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=base, scale=1.0, offset=offset)

    def _rotate_mixed(self, x: mx.array, positions: mx.array, original: mx.array) -> mx.array:
        """Rows b with original[b] rotate by the original frequencies with attention factor 1, the others by the
        scheduled ones after the attention factor; positions must be (B, L) and original (B,)."""
        if positions.ndim != 2 or original.shape != (x.shape[0],):
            raise ValueError(f"a row selector of shape {tuple(original.shape)} needs (B, L) position ids and one "
                             f"entry per row of the input (B={x.shape[0]}), got ids of shape {tuple(positions.shape)}")
        rows = original[:, None, None]  # (B, 1, 1) against (B, L, d/2)
        if self.attention_factor != 1.0:
            scale = mx.where(original, 1.0, self.attention_factor).astype(x.dtype)[:, None, None, None]
            x = mx.concatenate([x[..., : self.dims] * scale, x[..., self.dims:]], axis=-1)
        return self._rotate_at(x, positions, mx.where(rows, self._original_inv_freq, self._inv_freq))

    def _rotate_at(self, x: mx.array, positions: mx.array, inv_freq: mx.array | None = None,
                   scale: float = 1.0) -> mx.array:
        """Rotate token t of x (B, H, L, D) by positions[..., t] * inv_freq (default: the scheduled inverse
        frequencies) after scaling its first `dims` features by `scale`; positions is (L,) or (B, L), inv_freq
        (d/2,) or per row (B, 1, d/2). The scheduled angles' cos and sin are computed once for every layer."""
        length = x.shape[-2]
        if positions.shape[-1] != length:
            raise ValueError(f"position ids cover {positions.shape[-1]} tokens but the input has {length}")
        if inv_freq is None:  # the scheduled frequencies: every layer of the model shares the tables
            key = (id(positions), self._inv_freq_key)
            if key not in self._holder.tables:
                self._holder.tables[key] = _angle_tables(positions, self._inv_freq)
            tables = self._holder.tables[key]
        else:
            tables = _angle_tables(positions, inv_freq)
        return layers.rotate(x, *tables, self.dims, self.traditional, scale)


def _angle_tables(positions: mx.array, inv_freq: mx.array) -> tuple[mx.array, mx.array]:
    """cos and sin of positions[..., t] * inv_freq: (L, d/2), or (B, L, d/2)."""
    angles = positions.astype(mx.float32)[..., None] * inv_freq
    return mx.cos(angles), mx.sin(angles)


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
        raise UserError(f"unsupported RoPE layer type at {unknown[0]} ({type(dict(model.named_modules())[unknown[0]]).__name__})")
    return found


def _config_key(model: nn.Module, base: float) -> str | None:
    """The key of the model's config (`model.args`) that holds `base` (e.g. rope_local_base_freq for Gemma-3's
    local layers), or None."""
    args = getattr(model, "args", None)
    for key in BASE_KEYS:
        value = getattr(args, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isclose(value, base, rtol=1e-9):
            return key
    params = getattr(args, "rope_parameters", None)
    if isinstance(params, dict) and np.isclose(params.get("rope_theta", np.nan), base, rtol=1e-9):
        return "rope_theta"
    return None


class ScalingReplaced(UserWarning):
    """`extend` replaced a RoPE scaling that the model already applied (computed afresh from the raw base)."""


def _describe(path: str, module: nn.Module, model: nn.Module) -> tuple[int, bool, float, bool]:
    """(rotary dims, traditional layout, raw base, already scaled?) of an existing RoPE layer."""
    if isinstance(module, PositionRoPE):
        raise UserError("model is already extended; load the original model to extend it again")
    if isinstance(module, nn.RoPE):
        return module.dims, module.traditional, float(module.base), module.scale != 1.0
    if isinstance(module, rope_utils.DynamicNTKScalingRoPE):
        return module.dims, module.traditional, float(module.base), True
    args = getattr(model, "args", None)
    base = getattr(args, "rope_theta", None) or (getattr(args, "rope_parameters", None) or {}).get("rope_theta")
    if not base:
        raise UserError(f"cannot find the RoPE base of {path} ({type(module).__name__}: no rope_theta in the config)")
    if isinstance(module, rope_utils.SuScaledRoPE):
        return module.dim, False, float(base), True
    return module.dims, module.traditional, float(base), True


def _set_child(model: nn.Module, path: str, new: nn.Module) -> None:
    *parents, last = path.split(".")
    obj = model
    for part in parents:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    obj[last] = new


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def extend(model: nn.Module, schedule: str, original: int, target: int, **params) -> Extension:
    """Replace every RoPE layer of `model` (in place) by a `PositionRoPE` following `schedule`; returns the
    `Extension` record (also kept as `model.pose_extension`).

    Each layer's schedule is computed from its own raw base frequencies theta_i = base^(-2i/d) (Gemma-3's local
    and global layers have different bases) with factor s = target / original (or `factor=` in params); an
    existing scaling in the model (e.g. a rope_scaling in its config) is replaced, not compounded, with a warning.
    UserError when the model has no RoPE layer or the schedule's arguments do not fit it.
    """
    ropes = sorted(find_rope_modules(model), key=lambda item: _natural(item[0]))
    if not ropes:
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        raise UserError(f"model '{kind}' has no RoPE layers (it uses another position encoding); cannot extend it")
    layers = []
    for path, module in ropes:
        dims, traditional, base, scaled = _describe(path, module, model)
        if scaled and not layers:
            warnings.warn(f"{path} already applies a RoPE scaling ({type(module).__name__}); it is replaced by "
                          f"'{schedule}' computed from the raw base {base:g}", ScalingReplaced, stacklevel=2)
        layers.append((path, dims, traditional, base))
    return _install(model, layers, schedule, original, target, params)


def reschedule(model: nn.Module, schedule: str, original: int, target: int, **params) -> Extension:
    """Give a model that `extend` patched with the original frequencies (schedule ``none``, e.g. for ordinary
    fine-tuning at positions 0 .. window - 1) the frequencies of `schedule` instead, computed from each layer's
    recorded raw base exactly as `extend` computes them; returns the new `Extension` record. Trained weights
    (LoRA adapters included) are untouched: only the RoPE layers are replaced."""
    record = getattr(model, "pose_extension", None)
    if record is None or record.schedule != "none":
        raise ValueError("reschedule needs a model extended with schedule 'none'")
    layers = [(layer.path, layer.dims, layer.traditional, layer.base) for layer in record.layers]
    return _install(model, layers, schedule, original, target, params)


def _install(model: nn.Module, layers: list, schedule: str, original: int, target: int, params: dict) -> Extension:
    """Put a `PositionRoPE` following `schedule` at each (path, dims, traditional, raw base) of `layers`, all
    sharing one position holder; the record becomes `model.pose_extension`."""
    if original <= 0 or target <= 0:
        raise ValueError(f"original={original} and target={target} must be positive")
    params = dict(params)
    factor = float(params.pop("factor", target / original))
    holder = _Holder()
    record = Extension(schedule, params, int(original), int(target), factor)
    for path, dims, traditional, base in layers:
        try:
            inv_freq, attention_factor = scaled_inv_freq(schedule, dims, base, factor, original, **params)
        except ValueError as error:
            raise UserError(f"--schedule {schedule}: {error}") from None
        dynamic = {"base": base, "factor": factor, "original": original} if schedule == "dynamic" else None
        _set_child(model, path, PositionRoPE(dims, inv_freq, traditional, attention_factor, holder, dynamic,
                                             original_inv_freq=rope_inv_freq(dims, base)))
        record.layers.append(RopeLayer(path, base, _config_key(model, base), dims, traditional,
                                       [float(f) for f in inv_freq],
                                       [float(f) for f in rope_inv_freq(dims, base) / inv_freq],
                                       float(attention_factor)))
    model.pose_extension = record
    return record


def _as_position_array(position_ids) -> mx.array:
    ids = position_ids if isinstance(position_ids, mx.array) else mx.array(np.asarray(position_ids))
    if ids.ndim not in (1, 2):
        raise ValueError(f"position_ids must have shape (L,) or (B, L), got {tuple(ids.shape)}")
    if not mx.issubdtype(ids.dtype, mx.integer):
        raise ValueError(f"position_ids must be integers, got {ids.dtype}")
    return ids.astype(mx.int32)


def _holders(model: nn.Module, required: bool = True) -> list:
    """The model's position holders (one per `extend`); ValueError when there is none and one is `required`."""
    modules = model.named_modules() if isinstance(model, nn.Module) else []
    holders = {id(m._holder): m._holder for _, m in modules if isinstance(m, PositionRoPE)}
    if required and not holders:
        raise ValueError("model has no PositionRoPE layers; call pose_mlx.extend(model, ...) first")
    return list(holders.values())


@contextlib.contextmanager
def use_positions(model: nn.Module, position_ids, original_rows=None) -> Iterator[None]:
    """Within the block, every `PositionRoPE` of `model` rotates token t by position_ids[..., t].

    `original_rows` (bool, shape (B,), with position_ids of shape (B, L)) marks the rows that rotate with the
    model's original frequencies and attention factor 1 (mixed-window training); None: every row uses the
    schedule. Wrap the whole forward + backward (e.g. the `value_and_grad` call), not just the loss: gradient
    checkpointing recomputes the forward during the backward pass and must see the same positions.
    """
    holders = _holders(model)
    ids = _as_position_array(position_ids)
    rows = None
    if original_rows is not None:
        rows = original_rows if isinstance(original_rows, mx.array) else mx.array(np.asarray(original_rows))
        if ids.ndim != 2 or rows.shape != (ids.shape[0],):
            raise ValueError(f"original_rows must have shape (B,) for position ids (B, L), got {tuple(rows.shape)} "
                             f"and {tuple(ids.shape)}")
        rows = rows.astype(mx.bool_)
    previous = [(h, h.positions, h.original, h.tables) for h in holders]
    for h in holders:
        h.positions, h.original, h.tables = ids, rows, {}
    try:
        yield
    finally:
        for h, old, old_rows, old_tables in previous:
            h.positions, h.original, h.tables = old, old_rows, old_tables


@contextlib.contextmanager
def use_length(model: nn.Module, length: int) -> Iterator[None]:
    """Within the block, a dynamic-NTK model sets its base for a sequence of `length` tokens (the whole sequence
    being read through the KV cache), so chunked prefill gives the logits of one forward pass. Other schedules
    ignore it; a model that was not extended is left alone."""
    holders = _holders(model, required=False)
    previous = [h.length for h in holders]
    for h in holders:
        h.length = int(length)
    try:
        yield
    finally:
        for h, old in zip(holders, previous):
            h.length = old


def save_extension(model: nn.Module, folder: str | Path, **extra) -> Path:
    """Write `pose_mlx.json` (the schedule and anything in `extra`) into a model folder."""
    info = getattr(model, "pose_extension", None)
    if info is None:
        raise ValueError("model was not extended with pose_mlx.extend")
    path = Path(folder) / "pose_mlx.json"
    path.write_text(json.dumps({"schedule": info.to_dict(), **extra}, indent=1, default=float) + "\n")
    return path


def apply_saved_extension(model: nn.Module, record_path: str | Path) -> Extension:
    """Re-apply the schedule recorded in a pose_mlx.json to a freshly loaded model (also reads the records of
    earlier versions, which named the fields method / original_length / target_length)."""
    s = json.loads(Path(record_path).read_text())["schedule"]
    schedule = s.get("schedule", s.get("method"))
    original, target = s.get("original", s.get("original_length")), s.get("target", s.get("target_length"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exported config's own scaling is replaced by the exact one
        return extend(model, schedule, original, target, factor=s["factor"], **s["params"])


__all__ = ["Extension", "PositionRoPE", "RopeLayer", "ScalingReplaced", "apply_saved_extension", "extend", "find_rope_modules",
           "reschedule", "save_extension", "use_length", "use_positions"]
