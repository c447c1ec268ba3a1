"""`python -m pose_mlx.plan`: a fine-tuning run's peak memory, predicted before a single weight is loaded.

Takes `python -m pose_mlx.finetune`'s flags (flags it does not need, such as --data, and flags it does not know are
accepted and ignored) and reads only the model's config.json: from a local folder, or, for a hub id or one of
finetune's aliases, that one file from the Hugging Face hub. Prints what is alive at the peak of a training step
(weights, LoRA adapters, AdamW state, gradients, activations, attention scores, logits, temporaries; see
`pose_mlx.memory`), the memory this machine offers, whether the run fits, the largest batch and window that fit
and what to change otherwise, each with its predicted peak. `--json` prints the same as one JSON object.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

from . import errors, memory
from .errors import UserError

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_HUB_ERRORS = ("EntryNotFoundError", "GatedRepoError", "HfHubHTTPError", "LocalEntryNotFoundError",
               "OfflineModeIsEnabled", "RepositoryNotFoundError", "RevisionNotFoundError", "HFValidationError")


def _load_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: must hold a JSON object")
    return config


def read_model_config(ref) -> dict:
    """The config dict of `ref`: a model folder or a config.json file, one of finetune's aliases, or a Hugging
    Face hub id (only its config.json is downloaded, no weights). Raises UserError on anything unreadable."""
    from .finetune import ALIASES

    name = str(ref)
    if name in ALIASES:
        name = ALIASES[name][0]
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {ref}: no config.json in that folder")
        return _load_json(path / "config.json")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            raise UserError(f"--model {ref}: reading a GGUF file's configuration is not supported yet")
        return _load_json(path)
    if not _HUB_ID.fullmatch(name) or path.exists():
        raise UserError(f"--model {ref!r}: no such folder or file, and not a known alias ({', '.join(ALIASES)}) "
                        "or hub id (owner/name)")
    import huggingface_hub
    import huggingface_hub.errors as hub_errors

    caught = tuple(getattr(hub_errors, n) for n in _HUB_ERRORS if hasattr(hub_errors, n))
    try:
        return _load_json(Path(huggingface_hub.hf_hub_download(name, "config.json")))
    except caught as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--model {name}: cannot get its config.json from the Hugging Face hub (offline, or no "
                        f"such repository?): {reason}") from None


def _parser():
    from .finetune import build_parser

    parser = build_parser()
    parser.prog = "python -m pose_mlx.plan"
    parser.description = ("Predict the peak memory of `python -m pose_mlx.finetune` with the same flags, from the\n"
                          "model's config.json alone (nothing is loaded or trained; --data is not needed).")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--max-memory", metavar="SIZE",
                        help="memory the run may use, e.g. 64GB, 16GiB, 512M or bytes (default: what this machine "
                             "offers: Metal's recommended working set, else MemAvailable)")
    return parser


def parse_args(argv=None):
    """(finetune-style namespace with --json/--max-memory, flags nobody knows). Bad values -> UserError."""
    from .finetune import UsageError, _read_config

    parser = _parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if args.config:
            parser.set_defaults(**_read_config(args.config, parser))
            args, unknown = parser.parse_known_args(argv)
    except UsageError as exc:
        raise UserError(str(exc)) from None
    if args.full is None:
        args.full = False
    return args, unknown


def settings_from_args(args, config: dict) -> memory.TrainSettings:
    """The run's `memory.TrainSettings` from finetune's flags, with finetune's defaults and checks."""
    from .finetune import ALIASES, UsageError, check_values, original_window, parse_target

    if args.method == "none":
        raise UserError("--method none trains nothing: there is no training step to plan")
    try:
        check_values(args)
        alias_window = ALIASES[args.model][1] if args.model in ALIASES else None
        original = original_window(args, config, alias_window)
        target = parse_target(args.target, original) if args.target is not None else None
    except UsageError as exc:
        raise UserError(str(exc)) from None
    window = args.window if args.window is not None else original
    if target is not None and window > target:
        raise UserError(f"--window {window} must not exceed the target {target}")
    if args.method == "full" and target is None:
        raise UserError("--method full trains on rows of --target tokens: pass --target")
    return memory.TrainSettings(window=window, batch_size=args.batch_size, lora=not args.full,
                                lora_rank=args.lora_rank, lora_layers=args.lora_layers,
                                grad_checkpoint=args.grad_checkpoint, compile=not args.no_compile,
                                grad_accum=args.grad_accum, method=args.method, target=target)


_ROWS = (
    ("weights", "weights"),
    ("lora_adapters", "LoRA adapters"),
    ("optimizer_state", "AdamW state (m, v)"),
    ("gradients", "gradients"),
    ("activations", "activations"),
    ("attention_scores", "attention scores"),
    ("logits", "logits + loss"),
    ("backward_temporaries", "backward temporaries"),
    ("update_temporaries", "update temporaries"),
)


def _describe_run(s: memory.TrainSettings, plan: memory.Plan) -> str:
    d = plan.estimate.details
    mode = (f"LoRA rank {s.lora_rank} on {d['trained_blocks']} blocks" if s.lora else "full fine-tuning")
    sampler = (f"full-length rows of {s.target} tokens" if s.method == "full"
               else f"{s.method} window {s.window}" + (f" (target {s.target})" if s.target else ""))
    extras = [f"batch {s.batch_size}" + (f" x {s.grad_accum} accumulated" if s.grad_accum > 1 else ""),
              "compiled" if s.compile else "eager", "gradient checkpointing" if s.grad_checkpoint else "no checkpointing"]
    return f"{mode}, {sampler}, {', '.join(extras)}"


def render(plan: memory.Plan, arch: memory.Architecture, model: str, source: str) -> str:
    """The human-readable report."""
    est, d = plan.estimate, plan.estimate.details
    lines = [f"model: {model} ({arch.describe()})", f"run:   {_describe_run(plan.settings, plan)}", ""]
    notes = {
        "weights": f"{memory.format_count(d['parameters'])} parameters, {d['dtype']}"
                   + (f" ({arch.quant_bits}-bit)" if arch.quant_bits else ""),
        "lora_adapters": f"{memory.format_count(d['trainable_parameters'])} trainable (float32)" if plan.settings.lora else "",
        "optimizer_state": "two moments per trainable parameter",
        "activations": f"{memory.format_size(d['activation_bytes_per_block'])} per block at {d['tokens_per_row']} "
                       f"tokens x {plan.settings.batch_size}",
        "attention_scores": f"{memory.format_size(d['score_matrix_bytes'])} per score matrix (batch x heads x L x L)",
        "logits": f"{memory.format_size(d['logits_bytes'])} per copy (batch x L x vocabulary, float32)",
    }
    for key, label in _ROWS:
        value = est.breakdown.get(key, 0)
        if value or key in ("weights", "activations"):
            lines.append(f"  {label:<22} {memory.format_size(value):>11}   {notes.get(key, '')}".rstrip())
    lines.append(f"  {'peak':<22} {memory.format_size(est.peak):>11}   during the {est.phase} phase")
    lines.append("")
    lines.append(f"available: {memory.format_size(plan.available)} ({source})")
    if plan.fits:
        lines.append(f"verdict: fits ({memory.format_size(plan.available - est.peak)} to spare)")
    else:
        lines.append(f"verdict: does NOT fit ({memory.format_size(est.peak - plan.available)} more than available)")
    batch = str(plan.largest_batch) if plan.largest_batch else "none"
    window = "" if plan.settings.method == "full" else f"; largest window: {plan.largest_window or 'none'}"
    lines.append(f"largest batch that fits: {batch}{window}")
    if plan.suggestions:
        lines.append("changes and their predicted peaks:")
        for s in plan.suggestions:
            mark = "fits" if s["fits"] else "does not fit"
            lines.append(f"  {s['change']:<62} {memory.format_size(s['peak_bytes']):>11}   {mark}")
    for warning in d["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


@errors.command("pose_mlx.plan")
def main(argv=None) -> int:
    args, unknown = parse_args(argv)
    if not args.model:
        raise UserError("--model is required (a folder, a config.json, a hub id or an alias)")
    if unknown:
        print(f"note: ignoring flags the planner does not use: {' '.join(unknown)}", file=sys.stderr)
    config = read_model_config(args.model)
    arch = memory.architecture(config)
    settings = settings_from_args(args, config)
    if args.max_memory is not None:
        available, source = memory.parse_size(args.max_memory), "--max-memory"
    else:
        available, source = memory.available_memory()
    plan = memory.make_plan(arch, settings, available)
    if args.json:
        record = {**plan.as_dict(), "available_source": source, "model": args.model,
                  "architecture": {k: v for k, v in asdict(arch).items() if k not in ("spec", "warnings")},
                  "settings": asdict(settings), "warnings": list(arch.warnings)}
        print(json.dumps(record, indent=1))
    else:
        for warning in arch.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(render(plan, arch, args.model, source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
