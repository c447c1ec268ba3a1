"""The memory of the machine MLX computes on (`available_memory`, `compute_backend`), and sizes read and written
in binary units (`parse_size`, `format_size`)."""

from __future__ import annotations

import math
import os
import re

from ..errors import UserError

BACKENDS = ("cpu", "metal", "cuda")


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_size(text) -> int:
    """'64GB' | '64G' | '16GiB' | '512M' | '1.5T' | 123456 (bytes) -> bytes. Units are binary (G = GiB = 2^30),
    as memory is sold and as `mx.get_peak_memory()` is usually read; a bare number is bytes."""
    if isinstance(text, bool):
        raise UserError(f"memory size {text!r} is not a size")
    if isinstance(text, (int, float)):
        if text <= 0 or (isinstance(text, float) and not math.isfinite(text)):
            raise UserError(f"memory size {text!r} must be positive")
        return int(text)
    match = _SIZE.fullmatch(str(text))
    if not match or (match.group(3) and not match.group(2)):
        raise UserError(f"memory size {text!r} is not a size: use e.g. 64GB, 64G, 16GiB, 512M or a number of bytes")
    value = float(match.group(1)) * 1024 ** " kmgtp".index(match.group(2).lower() or " ")
    if value < 1:
        raise UserError(f"memory size {text!r} must be at least one byte")
    return int(value)


def compute_backend() -> str:
    """Where MLX computes by default: "cuda", "metal" or "cpu" (also "cpu" when MLX is not importable)."""
    try:
        import mlx.core as mx
    except ImportError:
        return "cpu"
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "metal"


def cudnn_capable(info: dict | None = None) -> bool:
    """Whether MLX's CUDA backend may run cuDNN's fused attention on this GPU: compute capability 8 (Ampere) or
    newer, from `info` (default `mx.device_info()`); True when the device does not say."""
    if info is None:
        import mlx.core as mx

        info = mx.device_info()
    return int(info.get("compute_capability_major", 8)) >= 8


#: MLX's CUDA allocator caps its pool at this fraction of the GPU's total memory.
CUDA_LIMIT_FRACTION = 0.95


def available_memory(*, backend: str | None = None, info: dict | None = None,
                     meminfo: str = "/proc/meminfo") -> tuple[int, str]:
    """(bytes a run may use, where the number comes from), from the device MLX computes on (`compute_backend`):

    - cuda: the GPU's free memory (`mx.device_info()["free_memory"]`, cudaMemGetInfo), at most MLX's allocator
      limit of 95% of `total_memory`;
    - metal: the recommended working set (`max_recommended_working_set_size`; `memory_size` without it);
    - cpu: Linux's MemAvailable in `meminfo`, else the physical memory (os.sysconf).

    `backend` and `info` (a device_info dict) default to MLX's; tests pass them to check the contract. A GPU
    whose device_info names no memory falls back to the host's numbers."""
    backend = backend or compute_backend()
    if backend != "cpu":
        if info is None:
            import mlx.core as mx

            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        if backend == "cuda":
            total, free = int(info.get("total_memory", 0)), int(info.get("free_memory", 0))
            if total or free:
                limit = int(CUDA_LIMIT_FRACTION * total) if total else free
                return min(free or limit, limit), "the GPU's free memory, at most 95% of its total (mx.device_info)"
        else:
            size = int(info.get("max_recommended_working_set_size", 0))
            if size:
                return size, "the GPU's recommended working set (mx.device_info)"
            if int(info.get("memory_size", 0)):
                return int(info["memory_size"]), "the GPU's memory size (mx.device_info)"
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, f"MemAvailable in {meminfo}"
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory (os.sysconf)"
    except (ValueError, OSError, AttributeError):
        raise UserError("cannot tell how much memory this machine has; pass --max-memory") from None


def format_size(nbytes: int | float) -> str:
    """Bytes in binary units with three significant digits: '12.6 GiB', '340 MiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1000 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def format_count(n: int | float) -> str:
    """A count with three significant digits: '6.74 B', '20 M', '512'."""
    for scale, suffix in ((1e9, " B"), (1e6, " M"), (1e3, " K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"
