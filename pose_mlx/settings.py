"""The settings of one fine-tuning run: built once from flags and a YAML file (or, with `--resume`, from the run
folder's run.json), type-checked and validated once, saved in run.json, read by every stage.

Sources, later ones winning: the defaults of `RunSettings`, the YAML file of `--config` (keys are the settings'
names, the flags' names with `-` or `_`, or mlx-lm's names for the same things), the flags given on the command
line. With `--resume`, run.json replaces the defaults and the YAML file, and a flag that would change the run's
meaning is refused (only `ADJUSTABLE` settings may change; a new `--steps` stretches or shortens the linear decay
of the learning rate from the step reached on).

Vocabulary: the two context lengths are `original` (the window the model was pre-trained with) and `target`
(the one it is extended to); `window` is the training window (default: original); `sampler` says how position ids
are drawn (pose, pose-ref, randpos, full, none) and `schedule` how RoPE frequencies are scaled (linear, ntk, ...).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .errors import ArgumentParser, UserError
from .places import check_output
from .training.positions import CONTENT
from .rope import SCHEDULES, scaled_inv_freq, schedule_parameters

RUN_SAMPLERS = ("pose", "pose-ref", "pose-middle", "randpos", "full", "plain", "none")
RUN_FILE = "run.json"
ALIGN_ROWS = ("auto", "on", "off")
#: Settings that may differ between a run and its --resume without changing what the run computes.
ADJUSTABLE = ("steps", "progress", "save_every", "cache_dir", "max_memory", "force")


@dataclass
class RunSettings:
    """Every setting of a fine-tuning run; the field names are the flags' names."""

    model: str | None = None
    target: str | None = None
    original: int | None = None
    window: int | None = None
    schedule: str = "linear"
    schedule_params: dict = field(default_factory=dict)
    sampler: str = "pose"
    chunks: int = 2
    content: str = "uniform"
    short_share: float = 0.0
    full: bool = False
    lora_rank: int = 8
    lora_layers: int = -1
    lora_scale: float = 20.0
    fuse: bool = True
    lr: float = 2e-5
    steps: int = 1000
    batch_size: int = 1
    grad_accum: int = 1
    warmup: int = 10
    max_grad_norm: float = 1.0
    grad_checkpoint: bool = False
    compile: bool = True
    align_rows: str = "auto"
    data: str | None = None
    min_length: int | None = None
    cache_dir: str = "~/.cache/pose_mlx/tokens"
    heldout: float = 0.05
    eval_every: int = 0
    eval_batches: int = 8
    seed: int = 0
    output: str | None = None
    save_every: int = 100
    progress: bool = True
    max_memory: str | None = None
    force: bool = False

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Invocation:
    """What one command line asks for: the run's settings and what to do with an existing run folder."""

    settings: RunSettings
    resume: bool = False
    overwrite: bool = False
    given: frozenset = frozenset()  # the settings given explicitly (flags or YAML)


# --------------------------------------------------------------------------------------------- the flags

_HELP = {
    "model": "local mlx-lm/HF model folder, .gguf file, Hugging Face hub id, or an alias listed below",
    "target": "target context length: 32768, 32k, 32K, 1.5k (k = 1024) or 8x (times --original)",
    "original": "the model's original (pre-training) window (default: the alias's window, else the config's "
                "rope_scaling.original_max_position_embeddings, else its max_position_embeddings)",
    "window": "training window in tokens (default: --original)",
    "schedule": f"RoPE frequency schedule: {', '.join(SCHEDULES)} (default linear = Position Interpolation, "
                "as in the paper)",
    "schedule_params": "schedule parameter KEY=VALUE, repeatable, e.g. beta_fast=32, blend=wavelength, beta=500000 "
                       "(the keys of each schedule are listed below); --schedule yarn with attention_factor=1 keeps "
                       "YaRN's frequencies without its attention temperature (kept in-window retrieval where full "
                       "YaRN lost it; may cost perplexity on long inputs)",
    "sampler": "how position ids are drawn: pose (the paper), pose-ref (the authors' code), pose-middle (CREAM-style: "
               "head at 0, tail at the end of the target window, middle placed by a truncated Gaussian around the "
               "middle; trains both ends and the middle distances more, the other distances less than pose), "
               "randpos, full "
               "(full-length fine-tuning at the target), plain (ordinary fine-tuning: positions 0..window-1 with the "
               "original RoPE, the --schedule applied only at export; the control that gets PoSE's adaptation "
               "without its positions), none (schedule only: extend and export, no training)",
    "chunks": "number of PoSE chunks N (default 2)",
    "content": "PoSE content offsets v_i: uniform (paper), zero (v_i = 0), aligned (v_i = u_i)",
    "short_share": "mixed-window training (LongRoPE2): this fraction F of the training rows (0 <= F < 1, default 0) "
                   "read positions 0..window-1 with the model's original RoPE (attention factor 1), the rest come "
                   "from --sampler with the --schedule; meant to keep short-context skills. Costs: only 1 - F of "
                   "the tokens train the long positions (raise --steps by 1/(1 - F) for the same long-context "
                   "training); the same memory (same row length); the exported model uses the schedule everywhere",
    "lora_rank": "LoRA rank r (default 8)",
    "lora_layers": "LoRA in the last N transformer blocks (default -1: all)",
    "lora_scale": "LoRA output scale (mlx-lm's 'scale', default 20)",
    "lr": "peak learning rate of AdamW (default 2e-5)",
    "steps": "optimizer updates (default 1000); with --resume it may be changed, e.g. raised to train longer",
    "batch_size": "sequences per micro-batch (per rank under mlx.launch; default 1)",
    "grad_accum": "micro-batches per update (default 1)",
    "warmup": "linear warm-up updates, then linear decay to 0 (default 10)",
    "max_grad_norm": "clip the global gradient norm (default 1.0)",
    "grad_checkpoint": "recompute block activations in the backward pass: slower (a second forward of each block), "
                       "the memory saved depends on the run (Llama-2-7B LoRA at a 4k window: 94 -> 24 GiB on the CPU, "
                       "97 -> 32 GiB on a GPU; "
                       "`python -m pose_mlx.plan` predicts yours)",
    "align_rows": "pad every training row with masked tokens to a multiple of 128 inputs, the query length for "
                  "which MLX's CUDA attention differentiates through cuDNN's fused kernel instead of recomputing "
                  "the score matrices: auto (default: on with CUDA, off on Metal and the CPU, which train with "
                  "the unfused attention), on, off. Costs the padding's compute (up to 127 positions per row; "
                  "1 with the default window of a power of two); the loss and its gradient are unchanged",
    "data": "text file, folder of .txt/.md/.py/.jsonl files (mlx-lm's train/valid/test.jsonl layout included), "
            "or a hub dataset repo",
    "min_length": "skip documents shorter than this many tokens (default: the window; the target for "
                  "--sampler full)",
    "cache_dir": "where tokenized corpora are cached (default ~/.cache/pose_mlx/tokens)",
    "heldout": "fraction of documents held out for --eval-every when the data has no valid.jsonl (default 0.05)",
    "eval_every": "evaluate the held-out loss every N steps (0: never)",
    "eval_batches": "held-out batches per evaluation (default 8)",
    "seed": "seed of data sampling and LoRA initialisation (default 0)",
    "output": "output model folder (default: <model name>-<sampler>-<target>)",
    "save_every": "checkpoint every N steps (default 100; 0: only at the end and on Ctrl-C/SIGTERM)",
    "max_memory": "refuse to start when the predicted peak memory exceeds this (e.g. 48GB, 16GiB; default: the "
                  "memory available on this machine)",
    "force": "start even when the predicted peak memory exceeds --max-memory",
}
_DEPRECATED_FLAGS = {"--method": "--sampler", "--scaling": "--schedule", "--scaling-param": "--schedule-param"}


def _schedule_help() -> str:
    lines = []
    for name in SCHEDULES:
        keys = [f"{k}={v!r}" for k, v in schedule_parameters(name).items()]
        lines.append(f"  {name:<14} {' '.join(keys) or '(no parameters)'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m pose_mlx.finetune` (and of `python -m pose_mlx.plan`, which takes the same)."""
    from .model.source import describe_aliases

    p = ArgumentParser(
        prog="python -m pose_mlx.finetune", argument_default=argparse.SUPPRESS,
        description="Extend the context window of a RoPE language model with PoSE (positional skip-wise\n"
                    "training) or a baseline, and export a standard mlx-lm model folder.",
        epilog=f"model aliases (--model NAME):\n{describe_aliases()}\n\n"
               f"schedules (--schedule NAME) and their --schedule-param keys with defaults:\n{_schedule_help()}\n\n"
               "deprecated flags (still accepted): --method = --sampler, --scaling = --schedule, "
               "--scaling-param = --schedule-param",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", help="YAML file with any of these settings as keys (flag names with - or _, or mlx-lm's keys); "
                       "flags given on the command line win")
    a("--model", help=_HELP["model"])
    a("--target", help=_HELP["target"])
    a("--original", type=int, help=_HELP["original"])
    a("--window", type=int, help=_HELP["window"])
    a("--schedule", help=_HELP["schedule"])
    a("--schedule-param", dest="schedule_params", action="append", metavar="KEY=VALUE", help=_HELP["schedule_params"])
    a("--sampler", help=_HELP["sampler"])
    a("--chunks", type=int, help=_HELP["chunks"])
    a("--content", help=_HELP["content"])
    a("--short-share", type=float, metavar="F", help=_HELP["short_share"])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="full", action="store_false", help="train LoRA adapters (default; works on "
                                                                         "quantized bases)")
    mode.add_argument("--full", dest="full", action="store_true", help="train all weights")
    a("--lora-rank", type=int, help=_HELP["lora_rank"])
    a("--lora-layers", type=int, help=_HELP["lora_layers"])
    a("--lora-scale", type=float, help=_HELP["lora_scale"])
    a("--no-fuse", dest="fuse", action="store_false", help="keep LoRA adapters separate (adapters.safetensors) "
                                                           "instead of fusing them into the weights")
    a("--lr", type=float, help=_HELP["lr"])
    a("--steps", type=int, help=_HELP["steps"])
    a("--batch-size", type=int, help=_HELP["batch_size"])
    a("--grad-accum", type=int, help=_HELP["grad_accum"])
    a("--warmup", type=int, help=_HELP["warmup"])
    a("--max-grad-norm", type=float, help=_HELP["max_grad_norm"])
    a("--grad-checkpoint", action="store_true", help=_HELP["grad_checkpoint"])
    a("--no-compile", dest="compile", action="store_false",
      help="run the training step eagerly instead of under mx.compile (same math)")
    a("--align-rows", choices=ALIGN_ROWS, help=_HELP["align_rows"])
    a("--data", help=_HELP["data"])
    a("--min-length", type=int, help=_HELP["min_length"])
    a("--cache-dir", help=_HELP["cache_dir"])
    a("--heldout", type=float, help=_HELP["heldout"])
    a("--eval-every", type=int, help=_HELP["eval_every"])
    a("--eval-batches", type=int, help=_HELP["eval_batches"])
    a("--seed", type=int, help=_HELP["seed"])
    a("--output", help=_HELP["output"])
    a("--resume", action="store_true", help="continue the unfinished run of --output (its settings are read from "
                                            "the run folder; no other flag is needed)")
    a("--overwrite", action="store_true", help="replace an existing output folder / unfinished run written by "
                                               "pose_mlx (never anything else)")
    a("--save-every", type=int, help=_HELP["save_every"])
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a("--max-memory", help=_HELP["max_memory"])
    a("--force", action="store_true", help=_HELP["force"])
    for old, new in _DEPRECATED_FLAGS.items():
        kind = {"action": "append"} if old == "--scaling-param" else {}
        a(old, dest=f"deprecated{old.replace('-', '_')}", help=argparse.SUPPRESS, **kind)
    return p


def _from_flags(namespace: argparse.Namespace) -> dict:
    """{setting: value} of the flags given; deprecated flags mapped with a warning."""
    values = dict(vars(namespace))
    for old, new in _DEPRECATED_FLAGS.items():
        key = f"deprecated{old.replace('-', '_')}"
        if key in values:
            print(f"warning: {old} is deprecated; use {new}", file=sys.stderr)
            values[new.lstrip("-").replace("-", "_").replace("schedule_param", "schedule_params")] = values.pop(key)
    if "schedule_params" in values:
        values["schedule_params"] = dict(parse_param(item) for item in values["schedule_params"])
    return values


_WORDS = {"true": True, "false": False, "none": None, "null": None}


def parse_param(text: str) -> tuple[str, object]:
    """'key=value' with value read as JSON when possible (numbers, true/false, lists), else a string.
    True/False/None in any case are booleans/None too (the --help lists defaults in Python spelling)."""
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise UserError(f"--schedule-param {text!r} must look like key=value")
    if value.strip().lower() in _WORDS:
        return key.strip(), _WORDS[value.strip().lower()]
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


# ----------------------------------------------------------------------------------------- the YAML file

#: YAML keys that name a setting differently: flag spellings, deprecated names, and mlx-lm's keys.
_KEY_ALIASES = {
    "method": "sampler", "scaling": "schedule", "scaling_param": "schedule_params", "scaling_params": "schedule_params",
    "schedule_param": "schedule_params",
    "iters": "steps", "learning_rate": "lr", "max_seq_length": "window", "num_layers": "lora_layers",
    "grad_accumulation_steps": "grad_accum", "steps_per_eval": "eval_every", "val_batches": "eval_batches",
}
_NEGATED = {"no_fuse": "fuse", "no_compile": "compile", "no_progress": "progress", "lora": "full"}
_DEPRECATED_KEYS = {"method": "sampler", "scaling": "schedule", "scaling_param": "schedule_param",
                    "scaling_params": "schedule_params"}


class _Loader:
    """A safe YAML loader that also reads `1e-3` as a number (YAML 1.2; PyYAML's 1.1 rules read it as text)."""

    @staticmethod
    def make():
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
        return Loader


def read_yaml(path) -> dict:
    """{setting: value} of a YAML config file, every key known and every value of its setting's type."""
    import yaml

    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader.make())
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise UserError(f"--config {path}: cannot read it ({error.__class__.__name__})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of setting names to values")
    out = {}
    for key, value in data.items():
        out.update(_yaml_entry(path, str(key), value))
    return out


def _yaml_entry(path, key: str, value) -> dict:
    name = key.replace("-", "_")
    if name in _DEPRECATED_KEYS:
        print(f"warning: --config {path}: '{key}' is deprecated; use '{_DEPRECATED_KEYS[name]}'", file=sys.stderr)
    if name == "train":  # mlx-lm's switch: this command always trains unless --sampler none
        _check_type(path, key, value, bool)
        return {}
    if name == "fine_tune_type":
        if value not in ("lora", "full"):
            raise UserError(f"--config {path}: fine_tune_type must be 'lora' or 'full', got {value!r}")
        return {"full": value == "full"}
    if name == "lora_parameters":
        if not isinstance(value, dict):
            raise UserError(f"--config {path}: lora_parameters must be a mapping (rank, scale, dropout)")
        out = {}
        for sub, v in value.items():
            if sub == "rank":
                out["lora_rank"] = _check_type(path, "lora_parameters.rank", v, int)
            elif sub == "scale":
                out["lora_scale"] = _check_type(path, "lora_parameters.scale", v, float)
            elif sub == "dropout":
                if _check_type(path, "lora_parameters.dropout", v, float) != 0:
                    raise UserError(f"--config {path}: lora_parameters.dropout must be 0 (this tool trains "
                                    "without LoRA dropout)")
            else:
                raise UserError(f"--config {path}: unknown key lora_parameters.{sub} (known: rank, scale, dropout)")
        return out
    if name in _NEGATED:
        return {_NEGATED[name]: not _check_type(path, key, value, bool)}
    if name == "align_rows" and isinstance(value, bool):  # YAML 1.1 reads on/off as booleans
        value = "on" if value else "off"
    if name in ("resume", "overwrite"):  # what to do with an existing run folder: strictly a YAML boolean
        return {name: _check_type(path, key, value, bool)}
    name = _KEY_ALIASES.get(name, name)
    kinds = {f.name: f.type for f in fields(RunSettings)}
    if name not in kinds:
        known = sorted(set(kinds) | set(_KEY_ALIASES) | set(_NEGATED) |
                       {"lora_parameters", "fine_tune_type", "resume", "overwrite"})
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"--config {path}: unknown key {key!r}{hint}")
    if name == "schedule_params":
        if isinstance(value, list):
            value = dict(parse_param(item) for item in value)
        if not isinstance(value, dict):
            raise UserError(f"--config {path}: {key} must be a mapping such as {{beta_fast: 32}}")
        return {name: value}
    return {name: _check_type(path, key, value, _python_type(kinds[name]))}


def _python_type(annotation: str):
    return {"int": int, "float": float, "bool": bool, "str": str}[annotation.split(" |")[0]]


def _check_type(path, key: str, value, kind):
    """`value` if it is of `kind` (a YAML boolean for bool; an integer for int; a number for float; a string or a
    number for str), else a one-line UserError naming the key. None stands for the default where one is allowed."""
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, (str, int, float)) and not isinstance(value, bool)}[kind]
    if value is None:
        return None
    if not ok:
        wanted = {bool: "true or false (unquoted)", int: "a whole number", float: "a number", str: "a string"}[kind]
        raise UserError(f"--config {path}: {key} must be {wanted}, got {value!r}")
    return float(value) if kind is float else str(value) if kind is str else value


# ------------------------------------------------------------------------------------- building and checks


def parse_invocation(argv=None) -> Invocation:
    """Flags (and the --config YAML, or run.json with --resume) -> validated settings."""
    parser = build_parser()
    given = _from_flags(parser.parse_args(argv))
    config = given.pop("config", None)
    from_yaml = read_yaml(config) if config else {}
    resume = bool(given.pop("resume", from_yaml.pop("resume", False) or False))
    overwrite = bool(given.pop("overwrite", from_yaml.pop("overwrite", False) or False))
    from_yaml.pop("resume", None), from_yaml.pop("overwrite", None)
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    if resume:
        settings = _resume_settings({**from_yaml, **given})
    else:
        settings = RunSettings(**{**from_yaml, **{k: v for k, v in given.items()}})
    settings = _with_none_as_default(settings)
    validate(settings)
    return Invocation(settings, resume, overwrite, frozenset(from_yaml) | frozenset(given))


def _with_none_as_default(settings: RunSettings) -> RunSettings:
    """A YAML `null` for a setting with a non-None default means that default."""
    defaults = RunSettings()
    for f in fields(RunSettings):
        if getattr(settings, f.name) is None:
            setattr(settings, f.name, getattr(defaults, f.name))
    return settings


def run_folder(output: str | Path) -> Path:
    """The folder holding an unfinished run of `output` (its checkpoints, log and run.json)."""
    output = Path(output)
    return output.with_name(output.name + ".partial")


def _resume_settings(given: dict) -> RunSettings:
    """The saved settings of the run at --output, with the given ones that may change applied."""
    if not given.get("output"):
        raise UserError("--resume needs --output (the folder the interrupted run was writing)")
    check_output("--output", given["output"])
    path = run_folder(given["output"]) / RUN_FILE
    if not path.is_file() and (Path(given["output"]) / "pose_mlx.json").is_file():
        raise UserError(f"output folder {given['output']} is already complete; nothing to resume")
    saved = load_run_file(path)
    changed = {k: (getattr(saved, k), v) for k, v in given.items() if k != "output" and getattr(saved, k) != v}
    refused = {k: pair for k, pair in changed.items() if k not in ADJUSTABLE}
    if refused:
        listing = "; ".join(f"--{k.replace('_', '-')} was {old!r}, now {new!r}" for k, (old, new) in refused.items())
        raise UserError(f"--resume: these flags would change the interrupted run: {listing} (drop them, or start "
                        "a new run with --overwrite)")
    for key, (_, new) in changed.items():
        setattr(saved, key, new)
    # The run folder is the one named now: run.json's output may name the folder a copied (or moved, or resumed
    # from elsewhere) run folder came from, and that one is never touched. Model and data stay as saved: they are
    # only read; so does the token cache, which is content-addressed (the same tokens wherever it lies).
    saved.output = given["output"]
    return saved


def load_run_file(path: Path) -> RunSettings:
    """The settings saved in a run.json (also the flat files of earlier versions, with their older key names)."""
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--resume: no unfinished run at {Path(path).parent} (no {RUN_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--resume: {path} is damaged ({error.__class__.__name__}); start over with "
                        "--overwrite") from None
    values = record.get("settings", record) if isinstance(record, dict) else None
    if not isinstance(values, dict):
        raise UserError(f"--resume: {path} does not hold a run's settings; start over with --overwrite")
    known = {f.name for f in fields(RunSettings)}
    out = {}
    for key, value in values.items():
        key = _KEY_ALIASES.get(key, key)
        if key == "schedule_params" and isinstance(value, list):
            value = dict(parse_param(item) for item in value)
        if key in ("no_fuse", "no_compile"):
            key, value = _NEGATED[key], not value
        if key in known:
            out[key] = value
    try:
        return RunSettings(**out)
    except TypeError as error:
        raise UserError(f"--resume: {path} is damaged ({error}); start over with --overwrite") from None


def save_run_file(settings: RunSettings, folder: Path, world_size: int) -> Path:
    path = Path(folder) / RUN_FILE
    record = {"settings": settings.to_json(), "world_size": world_size}
    tmp = path.with_name(f".{RUN_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def saved_world_size(folder: Path) -> int:
    """How many ranks the run saved in `folder` had (1 for runs saved before data parallelism)."""
    try:
        record = json.loads((Path(folder) / RUN_FILE).read_text())
        return int(record.get("world_size", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        raise UserError(f"--resume: {Path(folder) / RUN_FILE} is damaged; start over with --overwrite") from None


#: setting -> (smallest allowed, largest allowed, bounds exclusive?)
_BOUNDS = {
    "steps": (1, 10**9), "batch_size": (1, 1 << 16), "grad_accum": (1, 1 << 16), "warmup": (0, 10**9),
    "save_every": (0, 10**9), "eval_every": (0, 10**9), "eval_batches": (1, 1 << 20), "chunks": (1, 1 << 24),
    "lora_rank": (1, 1 << 16), "window": (2, 1 << 24), "min_length": (1, 1 << 31), "original": (2, 1 << 24),
    "seed": (0, 2**32 - 1),
}


def validate(s: RunSettings) -> None:
    """Every check that needs no model: types, ranges, names. UserError naming the flag."""
    for name, (low, high) in _BOUNDS.items():
        value = getattr(s, name)
        if value is not None and not low <= value <= high:
            raise UserError(f"--{name.replace('_', '-')} must be between {low} and {high}, got {value}")
    for name in ("lr", "max_grad_norm", "lora_scale"):
        value = getattr(s, name)
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    if s.lora_layers == 0 or s.lora_layers < -1:
        raise UserError(f"--lora-layers must be >= 1, or -1 for all blocks; got {s.lora_layers}")
    if not 0 < s.heldout < 1:
        raise UserError(f"--heldout must be between 0 and 1 (a fraction of the documents), got {s.heldout}")
    if not s.model:
        raise UserError("--model is required (a folder, a .gguf file, a hub id or an alias)")
    if s.sampler not in RUN_SAMPLERS:
        raise UserError(f"--sampler {s.sampler!r} is not one of {', '.join(RUN_SAMPLERS)}")
    if s.content not in CONTENT:
        raise UserError(f"--content {s.content!r} is not one of {', '.join(CONTENT)}")
    if not 0 <= s.short_share < 1:
        raise UserError(f"--short-share must be a fraction in [0, 1), got {s.short_share!r}")
    if s.short_share and s.sampler in ("full", "plain", "none"):
        raise UserError(f"--short-share mixes short rows into a sampler that skips positions; --sampler "
                        f"{s.sampler} has none to mix with")
    if s.align_rows not in ALIGN_ROWS:
        raise UserError(f"--align-rows {s.align_rows!r} is not one of {', '.join(ALIGN_ROWS)}")
    if s.schedule not in SCHEDULES:
        close = difflib.get_close_matches(s.schedule, SCHEDULES, n=1)
        raise UserError(f"--schedule {s.schedule!r} is not a known schedule"
                        + (f"; did you mean '{close[0]}'?" if close else f" ({', '.join(SCHEDULES)})"))
    if s.max_memory is not None:
        from .memory import parse_size

        parse_size(s.max_memory)
    params = dict(s.schedule_params)
    factor = params.pop("factor", 2.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor >= 1):
        raise UserError(f"--schedule-param factor must be a number >= 1, got {factor!r}")
    try:  # the parameters' names and values, on a typical head (the real model is checked again when extended)
        scaled_inv_freq(s.schedule, 128, 10000.0, float(factor), 4096, **params)
    except (ValueError, TypeError) as error:
        raise UserError(f"--schedule-param: {error}") from None


__all__ = ["ADJUSTABLE", "ALIGN_ROWS", "Invocation", "RUN_FILE", "RUN_SAMPLERS", "RunSettings", "build_parser", "load_run_file",
           "parse_invocation", "parse_param", "read_yaml", "run_folder", "save_run_file", "saved_world_size",
           "validate"]
