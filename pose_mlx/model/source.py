"""Model references, configs and loading: the one place every command turns `--model` into a model.

A reference is an alias (`ALIASES`: a hub id plus the model's original window), a local mlx-lm / Hugging Face
folder (config.json, weights, tokenizer files), a `.gguf` file (llama.cpp, Ollama, LM Studio; read by
`pose_mlx.model.gguf`), or a Hugging Face hub id `owner/name` (downloaded with huggingface_hub). `resolve` checks the
reference without loading weights, `read_config` gives its configuration (config.json, or the GGUF metadata; an
alias's config.json ships with the package, `configs/<alias>.json`, so planning one needs no network),
`load` the model and tokenizer - with the schedule of a folder written by `pose_mlx.finetune` re-applied
(`pose_mlx.json`), so schedules that a plain config cannot express come back exactly.
Everything the user can get wrong raises `UserError`.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import UserError
from .gguf import config_from_gguf, load_gguf

# Imported inside functions, on purpose: the hub client, MLX, mlx-lm and the package's MLX-backed modules, each where
# it is used: they are costly to import or unneeded on the paths that import this module (`--help`, `plan`, the
# NumPy-only parts).

ALIASES = {
    "llama-7b": ("huggyllama/llama-7b", 2048),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", 4096),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", 4096),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", 8192),
    "tinyllama": ("TinyLlama/TinyLlama_v1.1", 2048),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", 32768),
}
#: One of these makes a folder's tokenizer loadable by mlx-lm.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken", "tiktoken.model")
#: The file in which `pose_mlx.finetune` records the schedule of an exported model.
SCHEDULE_FILE = "pose_mlx.json"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ModelRef:
    """Where a model comes from: `path` is a local folder or a GGUF file; `window` the alias's original window."""

    name: str
    path: Path
    window: int | None = None
    config_file: Path | None = None  # the shipped config.json of an alias resolved without weights

    @property
    def is_gguf(self) -> bool:
        return self.config_file is None and self.path.is_file()


def is_gguf_file(path: Path) -> bool:
    """A GGUF file, recognised by its magic bytes (Ollama's blobs have no .gguf suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def describe_aliases() -> str:
    return "\n".join(f"  {k:<14} {repo:<40} original window {w}" for k, (repo, w) in ALIASES.items())


def shipped_config(alias: str) -> Path:
    """The config.json of alias `alias` as published on the hub, shipped with the package."""
    return Path(__file__).with_name("configs") / f"{alias}.json"


def resolve(name: str, weights: bool = True) -> ModelRef:
    """The local place of model reference `name`; a hub id is downloaded (only its config.json when not
    `weights`; an alias then needs no download: its config.json ships with the package). UserError for an
    unknown alias, a folder without config.json, an unreachable hub."""
    if not name:
        raise UserError("--model is required (a folder, a .gguf file, a hub id or an alias)")
    window = None
    if name in ALIASES:
        alias, (name, window) = name, ALIASES[name]
        if not weights:
            return ModelRef(name, shipped_config(alias).parent, window, shipped_config(alias))
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise UserError(f"--model {name}: no config.json in that folder")
        if path.is_file() and not is_gguf_file(path):
            raise UserError(f"--model {name}: a file, but not a .gguf model; pass a model folder or a .gguf file")
        return ModelRef(name, path, window)
    if not _HUB_ID.fullmatch(name):
        raise UserError(f"--model {name!r}: no such folder or file, and not a known alias ({', '.join(ALIASES)}) "
                        "or hub id (owner/name)")
    return ModelRef(name, _download(name, weights), window)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's endpoint (HF_ENDPOINT) opens within `timeout` seconds. False under
    HF_HUB_OFFLINE; True behind a proxy (HTTP(S)_PROXY), which only the HTTP client can go through. Without this
    probe an unreachable hub costs about 30 s of retries before huggingface_hub gives up."""
    from huggingface_hub import constants  # here: only a hub lookup needs the hub client

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True
    url = urlsplit(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except (OSError, ValueError):  # no DNS, refused, timed out, a malformed endpoint
        return False


def _download(repo_id: str, weights: bool) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    offline = not hub_reachable()  # then only the local cache is looked at: one line at once, not 30 s of retries
    try:
        if weights:
            return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS, local_files_only=offline))
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=offline)).parent
    except LocalEntryNotFoundError:  # no network, or HF_HUB_OFFLINE, and nothing cached
        raise UserError(f"--model {repo_id}: cannot reach the Hugging Face hub to download it (offline?) and it "
                        "is not in the local cache; pass a local folder or .gguf file") from None
    except Exception as error:  # huggingface-hub raises many types (404, gated repo, auth, HTTP)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise UserError(f"--model {repo_id}: cannot download it from the Hugging Face hub: {reason}") from None


def read_config(ref: ModelRef) -> dict:
    """The model's configuration (config.json, or the HF-style config of a GGUF file's metadata)."""
    if ref.is_gguf:
        return check_config(config_from_gguf(ref.path), ref.name)
    path = ref.config_file or ref.path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--model {ref.name}: config.json is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"--model {ref.name}: config.json holds a JSON {type(config).__name__}, not an object; "
                        "is this a model folder?")
    if "model_type" not in config:
        raise UserError(f"--model {ref.name}: config.json has no 'model_type'; is this a model folder?")
    return check_config(config, ref.name)


#: config keys that are a positive whole number wherever they appear (None allowed: the model's default).
_POSITIVE_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
                      "original_max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions")
_NULLABLE = ("num_key_value_heads", "head_dim")
#: config keys that are a RoPE base: a finite number > 1 (theta_j = base^(-2j/d) must decrease with j).
_BASE_KEYS = ("rope_theta", "rope_local_base_freq")


def check_config(config: dict, name: str) -> dict:
    """`config` when the keys the model is built from have their JSON types (sizes are positive integers, a
    RoPE base a finite number > 1, rope_scaling an object or null; also inside a multimodal `text_config`);
    UserError naming the first bad key otherwise. mlx-lm would fail on them deep inside, or not at all."""
    scopes = [("", config)]
    if isinstance(config.get("text_config"), dict):
        scopes.append(("text_config.", config["text_config"]))
    for prefix, scope in scopes:
        for key in _POSITIVE_INT_KEYS:
            if key not in scope or (scope[key] is None and key in _NULLABLE):
                continue
            value = scope[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"--model {name}: config.json: {prefix}{key} must be a positive whole number, "
                                f"got {value!r}")
        for key in _BASE_KEYS:
            if key not in scope:
                continue
            value = scope[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                       and value > 1):
                raise UserError(f"--model {name}: config.json: {prefix}{key} (the RoPE base) must be a finite "
                                f"number > 1, got {value!r}")
        for key in ("rope_scaling", "rope_parameters"):
            if scope.get(key) is not None and not isinstance(scope[key], dict):
                raise UserError(f"--model {name}: config.json: {prefix}{key} must be an object or null, got "
                                f"{scope[key]!r}")
            factor = (scope.get(key) or {}).get("factor")
            if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                       or not (math.isfinite(factor) and factor > 0)):
                raise UserError(f"--model {name}: config.json: {prefix}{key}.factor must be a finite number > 0, "
                                f"got {factor!r}")
    return config


def original_window(config: dict, ref: ModelRef | None = None) -> int | None:
    """The window the model was pre-trained with: the alias's, else rope_scaling's
    original_max_position_embeddings, else max_position_embeddings (or its older names); None when unknown."""
    if ref is not None and ref.window:
        return ref.window
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    maximum = config.get("max_position_embeddings")
    if kind == "linear" and "original_max_position_embeddings" not in scaling and isinstance(maximum, int):
        return int(round(maximum / float(scaling.get("factor", 1.0))))  # PI: max = factor * original
    for value in (scaling.get("original_max_position_embeddings"), config.get("original_max_position_embeddings"),
                  config.get("max_position_embeddings"), config.get("n_positions"), config.get("seq_length")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def declared_window(config: dict, original: int | None) -> int | None:
    """The longest input the model's config declares it reads: `max_position_embeddings` (or its older names), or
    its `rope_scaling` factor times the `original` window when that is longer (a config may keep the
    pre-training window in max_position_embeddings beside a YaRN factor, as Qwen2.5's does); None when unknown."""
    sizes = (config.get(k) for k in ("max_position_embeddings", "n_positions", "seq_length"))
    maximum = next((v for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
    factor = (config.get("rope_scaling") or {}).get("factor")
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1 and original:
        maximum = max(maximum or 0, int(round(factor * original)))
    return maximum


def model_classes(config: dict):
    """(Model, ModelArgs) of mlx-lm's module for `config["model_type"]` (its public remapping tables applied)."""
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UserError("the model config has no 'model_type'")
    architectures = config.get("architectures") or ()
    for architecture in [architectures] if isinstance(architectures, str) else architectures:
        if (model_type, architecture) in MODEL_ARCHITECTURE_REMAPPING:
            model_type = MODEL_ARCHITECTURE_REMAPPING[(model_type, architecture)]
            break
    else:
        model_type = MODEL_REMAPPING.get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        raise UserError(f"model type {model_type!r} is not supported by this mlx-lm version") from None
    return module.Model, module.ModelArgs


def build_model(config: dict, seed: int | None = None):
    """mlx-lm's model for `config`, freshly initialised (after `mx.random.seed(seed)` when given); lazy arrays
    until evaluated, so building even a large model only to inspect its layers is cheap."""
    import mlx.core as mx

    model_cls, args_cls = model_classes(config)
    if seed is not None:
        mx.random.seed(seed)
    return model_cls(args_cls.from_dict(config))


def quiet_transformers() -> None:
    """Quiet transformers' notices and warnings while models load (set TRANSFORMERS_VERBOSITY to see them; under
    mlx.launch they would print once per rank): the variable is read at import, and transformers is often
    imported (by mlx_lm) before this runs, so it is set directly too."""
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # no "PyTorch was not found" notice
        if "transformers" in sys.modules:  # e.g. "Unrecognized keys in `rope_parameters`"
            sys.modules["transformers"].logging.set_verbosity_error()


def load(ref: ModelRef | str | Path, *, return_config: bool = False, apply_schedule: bool = True):
    """(model, tokenizer) of `ref` - like `mlx_lm.load`, plus (with `return_config`) the config dict -, with the
    LoRA adapters of a folder exported with `--no-fuse` applied, and the schedule in its pose_mlx.json re-applied
    unless `apply_schedule=False` (then the model is exactly what its config.json describes)."""
    quiet_transformers()
    if not isinstance(ref, ModelRef):
        ref = resolve(str(ref))
    if ref.is_gguf:
        model, tokenizer, config = load_gguf(ref.path)
        return (model, tokenizer, config) if return_config else (model, tokenizer)
    if not any((ref.path / name).exists() for name in TOKENIZER_FILES):
        raise UserError(f"--model {ref.name}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); "
                        "copy them from the base model")
    config = read_config(ref)
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        model, config = load_model(ref.path, get_model_classes=model_classes)
        tokenizer = load_tokenizer(ref.path, eos_token_ids=config.get("eos_token_id"))
    except UserError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as error:  # missing/corrupt weights or tokenizer files
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise UserError(f"--model {ref.name}: cannot load it ({type(error).__name__}: {reason})") from None
    if (ref.path / "adapter_config.json").is_file() and (ref.path / "adapters.safetensors").is_file():
        from mlx_lm.utils import load_adapters  # a folder exported with --no-fuse: base weights + LoRA adapters

        model = load_adapters(model, str(ref.path))
        model.eval()
    if apply_schedule and (ref.path / SCHEDULE_FILE).is_file():
        from .patch import apply_saved_extension

        apply_saved_extension(model, ref.path / SCHEDULE_FILE)
    return (model, tokenizer, config) if return_config else (model, tokenizer)


__all__ = ["ALIASES", "ModelRef", "SCHEDULE_FILE", "TOKENIZER_FILES", "build_model", "check_config", "declared_window",
           "describe_aliases", "hub_reachable", "is_gguf_file", "load", "model_classes", "original_window",
           "quiet_transformers", "read_config", "resolve", "shipped_config"]
