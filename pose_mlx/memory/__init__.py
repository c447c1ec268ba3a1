"""How much memory a fine-tuning run (or an evaluation) will take, from the model's config.json alone.

PoSE's premise is that training memory depends on the training window, not on the target length; this package
turns that into numbers before a single weight is loaded. Inputs are shapes and dtypes only (a Hugging Face style
config dict and the run's settings); nothing here imports MLX at module level (each function that needs it
imports it where it is used: `--help`, `plan` and the NumPy-only parts never pay for it).

- `architecture`: the shapes that decide memory, from a config (`architecture`, `loaded_architecture`);
- `training`: the peak of one training step (`TrainSettings`, `training_memory`);
- `device`: the memory of the machine MLX computes on (`available_memory`, `parse_size`, `format_size`);
- `plan`: a prediction against that memory and the changes that make it fit (`plan_memory`, `check_fits`);
- `evaluation`: chunked-prefill evaluation (`eval_memory`).
"""

from .architecture import (DTYPE_BYTES, FAMILIES, REQUIRED_KEYS, Architecture, Family, Linear, architecture,
                           gguf_loaded, loaded_architecture)
from .device import (BACKENDS, CUDA_LIMIT_FRACTION, available_memory, compute_backend, cudnn_capable, format_count,
                     format_size, parse_size)
from .evaluation import GPU_EVAL_SCORES, KV_CACHE_STEP, TILE_BYTES, eval_memory
from .plan import Plan, check_fits, check_run, limit, plan_memory, run_settings
from .training import (BLOCKED_COUNTS, COUNTS, FUSED_BACKWARD_ROWS, FUSED_CPU_COUNTS, GPU_FACTORS, TRANSIENT, Counts,
                       Estimate, TrainSettings, attention_path, training_memory)

__all__ = ["BACKENDS", "BLOCKED_COUNTS", "COUNTS", "CUDA_LIMIT_FRACTION", "DTYPE_BYTES", "FAMILIES", "FUSED_BACKWARD_ROWS",
           "FUSED_CPU_COUNTS", "GPU_EVAL_SCORES", "GPU_FACTORS", "KV_CACHE_STEP", "REQUIRED_KEYS", "TILE_BYTES", "TRANSIENT",
           "Architecture", "Counts", "Estimate", "Family", "Linear", "Plan", "TrainSettings", "architecture",
           "attention_path", "available_memory", "check_fits", "check_run", "compute_backend", "cudnn_capable",
           "eval_memory", "format_count", "format_size", "gguf_loaded", "limit", "loaded_architecture",
           "parse_size", "plan_memory", "run_settings", "training_memory"]
