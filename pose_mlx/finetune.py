"""`python -m pose_mlx.finetune`: extend a RoPE model's context window with PoSE (or a baseline) and export it.

Pipeline: load (folder, hub id or alias) -> `pose_mlx.extend` (schedule `--scaling`, s = Lt / Lc) -> LoRA or
full fine-tuning on `--data` with the chosen sampler (`pose_mlx.train`) -> export a standard mlx-lm folder
(`pose_mlx.export`). Every flag can also be set in a YAML file given with `--config` (keys are the flag
names, `-` or `_`); flags on the command line win. Bad input ends with one `error:` line and exit code 1.
The run's state lives in `<output>.partial/` until the export is complete, then `<output>` appears at once.
Started by `mlx.launch`, it trains data-parallel (`pose_mlx.distributed`): `--batch-size` rows per rank, rank 0
tokenizes first, writes every file and prints progress; the other ranks read the same `--output` and cache.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import warnings
from pathlib import Path

from . import positions  # noqa: F401  (NumPy only; keeps the fast BLAS loaded before MLX)

ALIASES = {
    "llama-7b": ("huggyllama/llama-7b", 2048),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", 4096),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", 4096),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", 8192),
    "tinyllama": ("TinyLlama/TinyLlama_v1.1", 2048),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", 32768),
}
TRAIN_METHODS = ("pose", "pose-ref", "randpos", "full")
# settings that must not change between a run and its --resume
RESUME_KEYS = ("model", "target", "original", "scaling", "scaling_param", "method", "chunks", "content", "window",
               "full", "lora_rank", "lora_layers", "lora_scale", "lr", "steps", "batch_size", "grad_accum", "warmup",
               "max_grad_norm", "data", "min_length", "seed", "heldout", "eval_every")


class UsageError(ValueError):
    """Bad input: reported as one line, exit code 1."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag value as a UsageError (one line, exit 1) instead of usage + exit 2."""

    def error(self, message):
        raise UsageError(message)


def parse_target(text, original: int | None) -> int:
    """'32768' | '32k' | '32K' | '1.5k' (k = 1024) | '8x' (times `original`) -> a whole number of tokens."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKxX]?)\s*", str(text))
    if not match:
        raise UsageError(f"--target {text!r} is not a length: use e.g. 32768, 32k, 1.5k or 8x")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "x":
        if original is None:
            raise UsageError(f"--target {text!r} is relative but the original window is unknown; pass --original")
        number *= original
    elif unit == "k":
        number *= 1024
    if number < 1 or abs(number - round(number)) > 1e-6:
        raise UsageError(f"--target {text!r} is not a whole positive number of tokens ({number:g})")
    return int(round(number))


_WORDS = {"true": True, "false": False, "none": None, "null": None}


def parse_param(text: str) -> tuple[str, object]:
    """'key=value' with value read as JSON when possible (numbers, true/false, lists), else a string.
    True/False/None in any case are booleans/None too (the --help lists defaults in Python spelling)."""
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--scaling-param {text!r} must look like key=value")
    if value.strip().lower() in _WORDS:
        return key.strip(), _WORDS[value.strip().lower()]
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _schedule_help() -> str:
    """One line per registered schedule: its --scaling-param keys with their defaults."""
    import inspect

    from .rope import SCHEDULES

    lines = []
    for name, fn in SCHEDULES.items():
        keys = [f"{q.name}={q.default!r}" if q.default is not q.empty else q.name
                for q in inspect.signature(fn).parameters.values() if q.kind is q.KEYWORD_ONLY]
        lines.append(f"  {name:<14} {' '.join(keys) or '(no parameters)'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    aliases = "\n".join(f"  {k:<14} {v[0]:<40} original window {v[1]}" for k, v in ALIASES.items())
    p = _Parser(
        prog="python -m pose_mlx.finetune",
        description="Extend the context window of a RoPE language model with PoSE (positional skip-wise\n"
                    "training) or a baseline, and export a standard mlx-lm model folder.",
        epilog=f"model aliases (--model NAME):\n{aliases}\n\n"
               f"schedules (--scaling NAME) and their --scaling-param keys with defaults:\n{_schedule_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--config", help="YAML file with any of these flags as keys (dashes or underscores); flags given on the "
                       "command line win")
    a("--model", help="local mlx-lm/HF model folder, Hugging Face hub id, or an alias listed below")
    a("--target", help="target context length Lt: 32768, 32k, 32K, 1.5k (k = 1024) or 8x (times --original)")
    a("--original", type=int, help="original context window Lc (default: the alias's window, else the model "
                                   "config's rope_scaling.original_max_position_embeddings, else its "
                                   "max_position_embeddings)")
    a("--scaling", default="linear", help="RoPE frequency schedule: none, linear (PI, default, as in the paper), "
                                          "ntk, dynamic, yarn, abf, llama3, longrope, dprope")
    a("--scaling-param", action="append", default=[], metavar="KEY=VALUE",
      help="schedule parameter, repeatable, e.g. beta_fast=32, blend=wavelength, beta=500000, bins=64")
    a("--method", default="pose", choices=TRAIN_METHODS + ("none",),
      help="pose (paper sampler), pose-ref (the authors' code), randpos, full (full-length fine-tuning at "
           "the target with the schedule), none (schedule only: patch and export, no training)")
    a("--chunks", type=int, default=2, help="number of PoSE chunks N (default 2)")
    a("--content", default="uniform", choices=("uniform", "zero", "aligned"),
      help="PoSE content offsets v_i: uniform (paper), zero (v_i = 0), aligned (v_i = u_i)")
    a("--window", type=int, help="training window Lc in tokens (default: --original)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="full", action="store_false", default=None,
                      help="train LoRA adapters (default; works on quantized bases)")
    mode.add_argument("--full", dest="full", action="store_true", help="train all weights")
    a("--lora-rank", type=int, default=8, help="LoRA rank r (default 8)")
    a("--lora-layers", type=int, default=-1, help="LoRA in the last N transformer blocks (default -1: all)")
    a("--lora-scale", type=float, default=20.0, help="LoRA output scale (mlx-lm's 'scale', default 20)")
    a("--no-fuse", action="store_true", help="keep LoRA adapters separate (adapters.safetensors) instead of "
                                             "fusing them into the weights")
    a("--lr", type=float, default=2e-5, help="peak learning rate of AdamW (default 2e-5)")
    a("--steps", type=int, default=1000, help="optimizer updates (default 1000)")
    a("--batch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    a("--grad-accum", type=int, default=1, help="micro-batches per update (default 1)")
    a("--warmup", type=int, default=10, help="linear warm-up steps, then linear decay to 0 (default 10)")
    a("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (default 1.0)")
    a("--grad-checkpoint", action="store_true", help="recompute activations in the backward pass "
                                                     "(~35%% less memory, ~50%% slower)")
    a("--no-compile", action="store_true", help="run the training step eagerly instead of under mx.compile "
                                                "(same math; compiling costs a few seconds at the first step)")
    a("--data", help="text file, folder of .txt/.jsonl ('text' field), or a hub dataset repo")
    a("--min-length", type=int, help="skip documents shorter than this many tokens (default: the window; "
                                     "the target for --method full)")
    a("--cache-dir", default="~/.cache/pose_mlx/tokens", help="where tokenized corpora are cached (default ~/.cache/pose_mlx/tokens)")
    a("--heldout", type=float, default=0.05, help="fraction of documents held out for --eval-every (default 0.05)")
    a("--eval-every", type=int, default=0, help="evaluate the held-out loss every N steps (0: never)")
    a("--eval-batches", type=int, default=8, help="held-out batches per evaluation (default 8)")
    a("--seed", type=int, default=0, help="seed of data sampling and LoRA initialisation (default 0)")
    a("--output", help="output model folder (default: <model name>-<method>-<target>)")
    a("--resume", action="store_true", help="continue the unfinished run in <output>.partial")
    a("--overwrite", action="store_true", help="replace an existing output folder / unfinished run")
    a("--save-every", type=int, default=100, help="checkpoint every N steps (default 100; 0: only at the end "
                                                  "and on Ctrl-C/SIGTERM)")
    a("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Flags, with defaults taken from the --config YAML where the flag is absent."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        parser.set_defaults(**_read_config(args.config, parser))
        args = parser.parse_args(argv)
    if args.full is None:
        args.full = False
    return args


def _read_config(path, parser) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold a mapping of flag names to values")
    known = {act.dest for act in parser._actions}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest == "lora":
            dest, value = "full", not value
        if dest == "scaling_params":
            dest = "scaling_param"
        if dest == "scaling_param" and isinstance(value, dict):
            value = [f"{k}={json.dumps(v)}" for k, v in value.items()]
        if dest not in known or dest in ("help", "config"):
            raise UsageError(f"--config {path}: unknown key {key!r}")
        out[dest] = value
    return out


# flag -> (smallest allowed value, whether the bound is exclusive); None values mean "use the default"
_BOUNDS = {"steps": (1, False), "batch_size": (1, False), "grad_accum": (1, False), "warmup": (0, False),
           "save_every": (0, False), "eval_every": (0, False), "eval_batches": (1, False), "chunks": (1, False),
           "lora_rank": (1, False), "window": (1, False), "min_length": (1, False), "lr": (0, True),
           "max_grad_norm": (0, True)}


def check_values(args) -> None:
    """Reject out-of-range numbers and unknown schedules before anything is loaded (one line each)."""
    from .rope import SCHEDULES

    for name, (low, exclusive) in _BOUNDS.items():
        value = getattr(args, name)
        if value is not None and (value <= low if exclusive else value < low):
            raise UsageError(f"--{name.replace('_', '-')} must be {'>' if exclusive else '>='} {low}, got {value}")
    if args.lora_layers == 0:
        raise UsageError("--lora-layers must be >= 1, or -1 for all blocks; got 0")
    if args.eval_every and not 0 < args.heldout < 1:
        raise UsageError(f"--heldout must be between 0 and 1 (a fraction of the documents), got {args.heldout}")
    if args.scaling not in SCHEDULES:
        raise UsageError(f"--scaling {args.scaling!r} is not a known schedule; choose one of {', '.join(SCHEDULES)}")


def resolve_model(name: str) -> tuple[Path, int | None]:
    """(local folder, alias window or None) for an alias, a folder or a hub id (downloaded with mlx-lm)."""
    alias_window = None
    if name in ALIASES:
        name, alias_window = ALIASES[name]
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {name}: no config.json in that folder")
        return path, alias_window
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise UsageError(f"--model {name!r}: no such folder and not a known alias ({', '.join(ALIASES)}) "
                         "or hub id (owner/name)")
    from huggingface_hub.errors import LocalEntryNotFoundError
    from mlx_lm.utils import _download

    try:
        return _download(name), alias_window
    except LocalEntryNotFoundError:  # no network, or HF_HUB_OFFLINE, and nothing cached
        raise UsageError(f"--model {name}: cannot reach the Hugging Face hub to download it (offline?) and it "
                         "is not in the local cache; pass a local folder") from None
    except Exception as exc:  # huggingface-hub raises many types (404, auth, ...)
        reason = str(exc).splitlines()[0][:160] if str(exc) else exc.__class__.__name__
        raise UsageError(f"--model {name}: cannot download it from the Hugging Face hub: {reason}") from None


def original_window(args, config: dict, alias_window: int | None) -> int:
    if args.original is not None:
        if args.original < 1:
            raise UsageError(f"--original must be positive, got {args.original}")
        return args.original
    if alias_window:
        return alias_window
    scaling = config.get("rope_scaling") or {}
    for value in (scaling.get("original_max_position_embeddings"), config.get("max_position_embeddings")):
        if value:
            return int(value)
    raise UsageError("the model config has neither rope_scaling.original_max_position_embeddings nor "
                     "max_position_embeddings; pass --original")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _output_paths(args, model_path: Path, target: int) -> tuple[Path, Path]:
    output = Path(args.output) if args.output else Path(f"{model_path.name}-{args.method}-{target}")
    return output, output.with_name(output.name + ".partial")


def _check_output(args, output: Path, partial: Path) -> None:
    """Refuse to touch finished or unfinished results unless asked to."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if output.exists() and not args.overwrite:
        if args.resume and not partial.exists():
            raise UsageError(f"output folder {output} is already complete; nothing to resume")
        if not args.resume:
            raise UsageError(f"output folder {output} exists; pass --overwrite to replace it or another --output")
    if args.resume and not partial.exists():
        raise UsageError(f"--resume: no unfinished run at {partial}")
    if partial.exists() and not (args.resume or args.overwrite):
        raise UsageError(f"{partial} holds an unfinished run; pass --resume to continue it or --overwrite "
                         "to start over")


def _run_settings(args) -> dict:
    return {k: getattr(args, k) for k in RESUME_KEYS}


def _check_resume(partial: Path, settings: dict) -> None:
    path = partial / "run.json"
    if not path.is_file():
        raise UsageError(f"--resume: {partial} has no run.json")
    saved = {"world_size": 1, **json.loads(path.read_text())}  # runs saved before data parallelism had one rank
    if saved["world_size"] != settings["world_size"]:
        raise UsageError(f"--resume: the interrupted run had {saved['world_size']} ranks (mlx.launch -n), this one "
                         f"has {settings['world_size']}; its batches cannot be continued with another count")
    for key, value in settings.items():
        if saved.get(key) != json.loads(json.dumps(value)):
            raise UsageError(f"--resume: --{key.replace('_', '-')} was {saved.get(key)!r} in the interrupted run, "
                             f"now {value!r}")


def _extend(model, args, config: dict, original: int, target: int):
    from .patch import extend

    params = dict(parse_param(p) for p in args.scaling_param)
    if config.get("rope_scaling"):
        _warn(f"the model already applies rope_scaling {config['rope_scaling']}; it is replaced by "
              f"'{args.scaling}' computed from the raw base, not compounded")
    if "factor" in params and not math.isclose(float(params["factor"]), target / original, rel_tol=1e-9):
        _warn(f"scaling factor {params['factor']} differs from target/original = {target}/{original} = "
              f"{target / original:g}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extend(model, args.scaling, original, target, **params)
    return model


def _add_lora(model, args) -> dict:
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    num_layers = len(model.layers) if args.lora_layers < 0 else args.lora_layers
    if not 1 <= num_layers <= len(model.layers):
        raise UsageError(f"--lora-layers {args.lora_layers} must be between 1 and the model's "
                         f"{len(model.layers)} blocks (or -1 for all)")
    lora = {"num_layers": num_layers, "rank": args.lora_rank, "scale": args.lora_scale}
    mx.random.seed(args.seed)
    model.freeze()
    linear_to_lora_layers(model, num_layers, {"rank": args.lora_rank, "scale": args.lora_scale, "dropout": 0.0})
    return lora


def _streams(args, tokenizer, window: int, target: int, world):
    from .data import ExampleStream, tokenize_corpus

    if not args.data:
        raise UsageError("--data is required unless --method none")
    min_length = args.min_length if args.min_length is not None else (target if args.method == "full" else window)

    def tokenize():
        return tokenize_corpus(args.data, tokenizer, Path(args.cache_dir).expanduser(), min_length,
                               progress=not args.no_progress and world.is_main)

    corpus = tokenize() if world.is_main else None
    world.barrier()  # the other ranks find rank 0's cache instead of tokenizing the corpus again
    if corpus is None:
        corpus = tokenize()
    if world.is_main:
        _report_skipped(args.data, corpus.meta)
    heldout = None
    if args.eval_every:
        corpus, heldout = corpus.split(args.heldout, args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    global_batch = args.batch_size * world.size

    def stream(c, seed, sharded: bool):
        """Global batches of `global_batch` rows; `sharded`: only this rank's `--batch-size` rows of each."""
        rank, ranks = (world.rank, world.size) if sharded else (0, 1)
        return ExampleStream(c, window, target, method=args.method, chunks=args.chunks, content=args.content,
                             batch_size=global_batch // ranks, seed=seed, pad_id=pad_id, rank=rank, world=ranks)

    eval_batches = None
    if heldout is not None:
        import itertools

        def eval_batches():  # rank 0 evaluates whole global batches
            return itertools.islice(iter(stream(heldout, args.seed + 1, sharded=False)), args.eval_batches)

    return corpus, stream(corpus, args.seed, sharded=True), eval_batches


def _report_skipped(source, meta: dict) -> None:
    """Warn (one line) when unreadable files were skipped while reading the corpus (counts from its cache)."""
    from .data import ReadStats

    stats = ReadStats(**meta.get("stats", {}))
    if stats.skipped():
        _warn(f"--data {source}: skipped {stats.skipped()} unreadable files or lines ({stats.describe()})")


def run(args) -> Path:
    """Do what `args` says; returns the output folder. Raises UsageError / ValueError on bad input."""
    if not args.model:
        raise UsageError("--model is required (a folder, hub id or alias)")
    check_values(args)
    model_path, alias_window = resolve_model(args.model)
    config = json.loads((model_path / "config.json").read_text())
    original = original_window(args, config, alias_window)
    target = parse_target(args.target, original) if args.target is not None else None
    if target is None:
        raise UsageError("--target is required (e.g. 32k or 8x)")
    if target <= original:
        raise UsageError(f"--target {target} must be larger than the original window {original}")
    window = args.window if args.window is not None else original
    if not 1 <= window <= target:
        raise UsageError(f"--window {window} must be between 1 and the target {target}")
    args.window, args.original = window, original
    output, partial = _output_paths(args, model_path, target)
    _check_output(args, output, partial)
    from .distributed import init

    world = init()
    world.barrier()  # every rank has checked the output folders before rank 0 changes them

    from mlx_lm.utils import load

    model, tokenizer = load(str(model_path))
    _extend(model, args, config, original, target)
    record = {"method": args.method, "Lc": window, "Lt": target, "chunks": args.chunks, "content": args.content,
              "steps": 0, "data_fingerprint": None, "final_loss": None, "source_model": args.model}
    if args.method == "none":
        if world.is_main:
            export(model, config, model_path, output, args, None, record, {})
        return output

    lora = None if args.full else _add_lora(model, args)
    if args.full:
        model.unfreeze()
    corpus, stream, eval_batches = _streams(args, tokenizer, window, target, world)
    from .train import TrainConfig, train

    tconfig = TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup, max_grad_norm=args.max_grad_norm,
                          grad_accum=args.grad_accum, grad_checkpoint=args.grad_checkpoint,
                          compile=not args.no_compile, save_every=args.save_every, eval_every=args.eval_every, progress=not args.no_progress)
    settings = {**_run_settings(args), "world_size": world.size}
    if args.resume:
        _check_resume(partial, settings)
    elif world.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        (partial / "run.json").write_text(json.dumps(settings, indent=1) + "\n")
    world.barrier()
    last = train(model, stream, tconfig, partial, eval_batches, resume=args.resume, world=world)
    if not world.is_main:
        return output
    record.update(steps=last["step"], final_loss=last["loss"], data_fingerprint=corpus.fingerprint,
                  tokens_per_step=last["tokens"], training="full" if args.full else "lora", lr=args.lr,
                  seed=args.seed, eval_loss=last.get("eval_loss"))
    export(model, config, model_path, output, args, lora, record,
           {"train_log.jsonl": partial / "log.jsonl", "run.json": partial / "run.json"})
    shutil.rmtree(partial, ignore_errors=True)
    return output


def export(model, config, model_path, output, args, lora, record, extra_files) -> dict:
    from .export import export_model

    info = export_model(model, config, model_path, output, fuse=not args.no_fuse, lora=lora, record=record,
                        extra_files=extra_files, overwrite=args.overwrite or args.resume)
    if not info["mlx_lm_exact"]:
        _warn(f"mlx-lm cannot express the '{args.scaling}' schedule exactly; load {output} with "
              "pose_mlx.load(path) (plain mlx_lm.load gets the closest config)")
    print(f"wrote {output}", file=sys.stderr)
    return info


def main(argv=None) -> int:
    """CLI entry point; returns the exit code (0 ok, 1 bad input or failure, 130/143 interrupted)."""
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from .longctx import quiet_transformers
    from .train import Interrupted, NonFiniteLoss

    quiet_transformers()  # its notices would otherwise print once per rank under mlx.launch
    try:
        run(args)
    except Interrupted as exc:
        if exc.world.is_main:  # rank 0 saved the checkpoint and reports for the group
            try:
                print(f"stopped: {exc}", file=sys.stderr)
            except OSError:  # stderr was a pipe to an mlx.launch stopped by the same Ctrl-C
                pass
        # mlx.launch terminates every rank once one exits with an error: the others wait for rank 0's report
        exc.world.barrier()
        return 128 + exc.signum
    except KeyboardInterrupt:  # outside the training loop (loading, tokenizing, exporting): nothing new saved
        print("stopped: interrupted outside the training loop; no checkpoint was written by it", file=sys.stderr)
        return 130
    except (ValueError, NonFiniteLoss, FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
