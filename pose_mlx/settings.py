"""The settings of one fine-tuning run: built once from flags and a YAML file (or, with `--resume`, from the run
folder's run.json), type-checked and validated once, saved in run.json, read by every stage.

Each setting is declared once, as a field of `RunSettings` whose `metadata` holds its flags (with their help),
the other YAML names it is known by, and the rule its value obeys; the argparse flags, the `--help` text, the YAML
keys accepted and the range checks of `validate` are generated from these declarations.

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
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import yaml

from .errors import ArgumentParser, UserError
from .files import write_atomic
from .lengths import parse_tokens, tokens
from .memory import parse_size
from .model.source import describe_aliases
from .places import check_output
from .rope import SCHEDULES, scaled_inv_freq, schedule_parameters
from .training.positions import CONTENT, REFERENCE_SAMPLERS, SAMPLERS

#: --sampler: the position samplers a run trains with, and `none` (no training: the schedule only).
RUN_SAMPLERS = tuple(s for s in SAMPLERS if s not in REFERENCE_SAMPLERS) + ("none",)
RUN_FILE = "run.json"
ALIGN_ROWS = ("auto", "on", "off")
#: Settings that may differ between a run and its --resume without changing what the run computes.
ADJUSTABLE = ("steps", "progress", "save_every", "cache_dir", "max_memory", "force")
#: The default --schedule until yarn became the default: what a run whose run.json names none was trained with.
SCHEDULE_BEFORE_YARN = "linear"


# ------------------------------------------------------------------------------------- the declarations


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a setting: a flag that takes a value (`sets` is None), or a switch that sets the
    setting to `sets` (True or False). `argparse`: extra keyword arguments of `add_argument` (metavar, choices)."""

    option: str
    help: str
    sets: bool | None = None
    argparse: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """What a setting's value must satisfy: `holds(value)`, else the UserError `message` formatted with the flag
    and the value. None is always allowed (it stands for the default). A rule with `choices` (a name among them)
    also takes the name in another case (`canonical_names` rewrites it) and suggests the closest on a miss."""

    holds: Callable
    message: str
    choices: tuple = ()

    def refusal(self, flag: str, value) -> str:
        """The one-line message for a `value` of `flag` that does not hold, with the closest choice if any."""
        message = self.message.format(flag=flag, value=value)
        close = difflib.get_close_matches(str(value).lower(), self.choices, n=1)
        return message + (f"; did you mean '{close[0]}'?" if close else "")


def between(low, high) -> Rule:
    """low <= value <= high."""
    return Rule(lambda v: low <= v <= high, f"{{flag}} must be between {low} and {high}, got {{value}}")


POSITIVE = Rule(lambda v: math.isfinite(v) and v > 0, "{flag} must be a finite number > 0, got {value}")


def one_of(choices: tuple) -> Rule:
    return Rule(lambda v: v in choices, f"{{flag}} {{value!r}} is not one of {', '.join(choices)}", choices)


def setting(default, help: str | None = None, *, flags: tuple = (), rule: Rule | None = None, aliases: tuple = (),
            deprecated: tuple = (), tokens: bool = False, **argparse_options):
    """A `RunSettings` field: `default`; one flag `--<name>` with `help` (and the `argparse_options`), or the
    `flags` given; the value's `rule`; `aliases`, other YAML keys for it (mlx-lm's names); `deprecated`, older
    names still accepted with a warning (flags when they start with --, else YAML keys only); `tokens`: a count of
    tokens, read with the length grammar (`8192` or `8k`, `pose_mlx.lengths.tokens`) from a flag or a YAML string."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    meta = {"help": help, "flags": flags, "argparse": argparse_options, "rule": rule, "aliases": aliases,
            "deprecated": deprecated, "tokens": tokens}
    return field(**factory, metadata=meta)


@dataclass
class RunSettings:
    """Every setting of a fine-tuning run; the field names are the flags' names (see `setting`)."""

    model: str | None = setting(
        None, "(required) local mlx-lm/HF model folder, .gguf file, Hugging Face hub id, or an alias listed below",
        metavar="MODEL")
    target: str | None = setting(
        None, "target context length: 32768, 32k, 1.5k (k = 1024) or 8x (times --original)",
        metavar="LENGTH")
    original: int | None = setting(
        None, "the model's pre-training window in tokens, e.g. 4096 or 4k (default: the alias's, else the model "
              "config's)", rule=between(2, 1 << 24), tokens=True)
    window: int | None = setting(None, "training window in tokens, e.g. 1024 or 1k (default: --original)",
                                 rule=between(2, 1 << 24), tokens=True, aliases=("max_seq_length",))
    schedule: str = setting(
        "yarn", "RoPE frequency schedule, one of those listed below (default yarn; linear = Position "
                "Interpolation, the PoSE paper's choice)", rule=one_of(tuple(SCHEDULES)), deprecated=("--scaling",),
        metavar="NAME")
    schedule_params: dict = setting(
        dict, flags=(Flag("--schedule-param", "a parameter of the schedule, KEY=VALUE, repeatable, e.g. beta_fast=32 "
                                              "(each schedule's keys and defaults are listed below)",
                          argparse={"action": "append", "metavar": "KEY=VALUE"}),),
        deprecated=("--scaling-param", "scaling_params"))
    sampler: str = setting(
        "pose", "how position ids are drawn (default pose): pose (the paper), pose-ref (the authors' code), "
                "pose-middle (CREAM-style middle focus), randpos, full (full-length fine-tuning at the target), "
                "plain (ordinary fine-tuning, the schedule applied at export), none (no training: extend and "
                "export)", rule=one_of(RUN_SAMPLERS), deprecated=("--method",), metavar="NAME")
    chunks: int = setting(2, "number of PoSE chunks N (default 2)", rule=between(1, 1 << 24))
    content: str = setting("uniform", "PoSE content offsets v_i: uniform (default, the paper's), zero (v_i = 0), "
                                      "aligned (v_i = u_i)", rule=one_of(CONTENT), metavar="NAME")
    short_share: float = setting(
        0.0, "mixed-window training: this share F of the rows (0 <= F < 1, default 0) reads positions "
             "0..window-1 with the original RoPE, the rest follow --sampler and --schedule",
        rule=Rule(lambda v: 0 <= v < 1, "{flag} must be a fraction in [0, 1), got {value!r}"), metavar="F")
    full: bool = setting(False, flags=(Flag("--lora", "train LoRA adapters (default; works on quantized bases)", False),
                                       Flag("--full", "train all weights", True)))
    lora_rank: int = setting(8, "LoRA rank r (default 8)", rule=between(1, 1 << 16))
    lora_layers: int = setting(
        -1, "LoRA in the last N transformer blocks (default -1: all)",
        rule=Rule(lambda v: v >= 1 or v == -1, "{flag} must be >= 1, or -1 for all blocks; got {value}"),
        aliases=("num_layers",))
    lora_scale: float = setting(20.0, "LoRA output scale (mlx-lm's 'scale', default 20)", rule=POSITIVE)
    fuse: bool = setting(True, flags=(Flag("--no-fuse", "keep LoRA adapters separate (adapters.safetensors) instead "
                                                        "of fusing them into the weights", False),))
    lr: float = setting(2e-5, "peak learning rate of AdamW (default 2e-5)", rule=POSITIVE, aliases=("learning_rate",))
    steps: int = setting(1000, "optimizer updates (default 1000); with --resume it may be changed: raised, it "
                               "trains an interrupted or a finished run longer", rule=between(1, 10**9),
                         aliases=("iters",))
    batch_size: int = setting(1, "sequences per micro-batch (per rank under mlx.launch; default 1)",
                              rule=between(1, 1 << 16))
    grad_accum: int = setting(1, "micro-batches per update (default 1)", rule=between(1, 1 << 16),
                              aliases=("grad_accumulation_steps",))
    warmup: int = setting(10, "linear warm-up updates, then linear decay to 0 (default 10)", rule=between(0, 10**9))
    max_grad_norm: float = setting(1.0, "clip the global gradient norm (default 1.0)", rule=POSITIVE)
    loss_scale: float | None = setting(
        None, "multiply the loss by this for the backward pass and divide the gradients by it, so that float16 "
              "gradients keep their digits (default: 4096 for a model computing in float16, else 1); lower it if "
              "a float16 run stops with a non-finite gradient norm",
        rule=Rule(lambda v: math.isfinite(v) and v >= 1, "{flag} must be a finite number >= 1, got {value}"))
    grad_checkpoint: bool = setting(False, flags=(Flag(
        "--grad-checkpoint", "recompute each block's activations in the backward pass: less memory, slower "
        "(`python -m pose_mlx.plan` predicts the saving)", True),))
    compile: bool = setting(True, flags=(Flag("--no-compile", "run the training step eagerly instead of under "
                                                              "mx.compile (same math)", False),))
    align_rows: str = setting(
        "auto", "pad each training row with masked tokens to a multiple of 128 inputs, so that MLX's CUDA attention "
                "can use its fused backward: auto (default: on with CUDA only), on, off; the loss is unchanged",
        rule=one_of(ALIGN_ROWS), choices=ALIGN_ROWS)
    data: str | None = setting(None, "(required unless --sampler none) text file, folder of .txt/.md/.py/.jsonl "
                                     "files (mlx-lm's train/valid/test.jsonl layout included), or a hub dataset repo",
                               metavar="PATH")
    min_length: int | None = setting(
        None, "skip documents shorter than this many tokens, e.g. 512 or 1k (default: the window; the target for "
              "--sampler full)", rule=between(1, 1 << 31), tokens=True)
    cache_dir: str = setting("~/.cache/pose_mlx/tokens",
                             "where tokenized corpora are cached (default ~/.cache/pose_mlx/tokens)", metavar="DIR")
    heldout: float = setting(
        0.05, "fraction of documents held out for --eval-every when the data has no valid.jsonl (default 0.05)",
        rule=Rule(lambda v: 0 < v < 1, "{flag} must be between 0 and 1 (a fraction of the documents), got {value}"))
    eval_every: int = setting(0, "evaluate the held-out loss every N steps (0: never)", rule=between(0, 10**9),
                              aliases=("steps_per_eval",))
    eval_batches: int = setting(8, "held-out batches per evaluation (default 8)", rule=between(1, 1 << 20),
                                aliases=("val_batches",))
    seed: int = setting(0, "seed of data sampling and LoRA initialisation (default 0)", rule=between(0, 2**32 - 1))
    output: str | None = setting(None, "output model folder (default: <model name>-<sampler>-<target>)",
                                 metavar="DIR")
    save_every: int = setting(100, "checkpoint every N steps (default 100; 0: only at the end and on "
                                   "Ctrl-C/SIGTERM)", rule=between(0, 10**9))
    progress: bool = setting(True, flags=(Flag("--no-progress", "no progress bar", False),))
    max_memory: str | None = setting(None, "refuse to start when the predicted peak memory exceeds this: a size with "
                                           "its unit, e.g. 48G, 48GB, 16GiB or 512M (binary units; a bare number is "
                                           "refused); default: the memory available on this machine",
                                     metavar="SIZE")
    force: bool = setting(False, flags=(Flag("--force", "start even when the predicted peak memory exceeds "
                                                        "--max-memory", True),))

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Invocation:
    """What one command line asks for: the run's settings and what to do with an existing run folder."""

    settings: RunSettings
    resume: bool = setting(False, flags=(Flag("--resume", "continue the unfinished run of --output (its settings "
                                              "are read from the run folder; no other flag is needed)", True),))
    overwrite: bool = setting(False, flags=(Flag("--overwrite", "replace an existing output folder / unfinished run "
                                                 "written by pose_mlx (never anything else)", True),))
    given: frozenset = frozenset()  # the settings given explicitly (flags or YAML)


def flags_of(f) -> tuple:
    """The flags of field `f`: the ones declared, else `--<name>` taking a value, with the field's help."""
    meta = f.metadata
    return meta["flags"] or (Flag("--" + f.name.replace("_", "-"), meta["help"], None, meta["argparse"]),)


def kind_of(f) -> type:
    """The Python type of field `f` from its annotation ("int | None" -> int)."""
    return {"int": int, "float": float, "bool": bool, "str": str, "dict": dict}[f.type.split(" |")[0]]


def _deprecated_flags() -> dict:
    """{old flag: (field, the flag that replaces it)}, in alphabetical order."""
    pairs = [(old, (f, flags_of(f)[0])) for f in fields(RunSettings) for old in f.metadata["deprecated"]
             if old.startswith("--")]
    return dict(sorted(pairs, key=lambda pair: pair[0]))


def _key(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


# --------------------------------------------------------------------------------------------- the flags


def _schedule_help() -> str:
    lines = []
    for name in SCHEDULES:
        keys = [f"{k}={v!r}" for k, v in schedule_parameters(name).items()]
        lines.append(f"  {name:<14} {' '.join(keys) or '(no parameters)'}")
    return "\n".join(lines)


def _add_flags(parser: argparse.ArgumentParser, f, shown: bool = True) -> None:
    """The flags of field `f`: a value flag typed by the annotation (`tokens` for a count of tokens) and named by
    its kind (N, X, TEXT) unless it declares a metavar or choices; switches (exclusive when several); left out of
    --help unless `shown`."""
    declared = flags_of(f)
    group = parser.add_mutually_exclusive_group() if len(declared) > 1 else parser
    for flag in declared:
        text = flag.help if shown else argparse.SUPPRESS
        if flag.sets is not None:
            group.add_argument(flag.option, dest=f.name, action=f"store_{str(flag.sets).lower()}", help=text)
            continue
        kind = kind_of(f)
        typed = {"type": tokens} if f.metadata["tokens"] else {"type": kind} if kind in (int, float) else {}
        shape = {} if "choices" in flag.argparse else {"metavar": {int: "N", float: "X", str: "TEXT"}.get(kind)}
        group.add_argument(flag.option, dest=f.name, help=text, **typed, **{**shape, **flag.argparse})


def _deprecated_dest(old: str) -> str:
    return "deprecated" + old.replace("-", "_")


#: finetune's usage line: the flags a run needs (argparse's `required` cannot say it: they may come from --config,
#: or from the run folder with --resume).
USAGE = """%(prog)s --model MODEL --target LENGTH --data PATH [options]
       %(prog)s --config FILE [options]
       %(prog)s --resume --output DIR [--steps N]"""


def build_parser(shown: tuple | None = None) -> argparse.ArgumentParser:
    """The flags of `python -m pose_mlx.finetune` (and of `python -m pose_mlx.plan`, which takes the same): one per
    field of `RunSettings` (the run-folder flags of `Invocation` after --output, which they act on). `shown`: the
    names of the fields whose flags --help lists (default: all); the others are accepted all the same."""
    deprecated = ", ".join(f"{old} = {new.option}" for old, (_, new) in _deprecated_flags().items())
    p = ArgumentParser(
        prog="python -m pose_mlx.finetune", argument_default=argparse.SUPPRESS, usage=USAGE,
        description="Extend the context window of a RoPE language model with PoSE (positional skip-wise\n"
                    "training) or a baseline, and export a standard mlx-lm model folder. --model, --target and\n"
                    "--data are required, on the command line or in --config. Reference, recipes and what was\n"
                    "measured: docs/finetune.md.",
        epilog=f"model aliases (--model NAME):\n{describe_aliases()}\n\n"
               f"schedules (--schedule NAME) and their --schedule-param keys with defaults:\n{_schedule_help()}\n\n"
               f"deprecated flags (still accepted): {deprecated}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML file with any of these settings as keys (flag names with "
                                                    "- or _, or mlx-lm's keys); flags given on the command line win")
    run_folder_fields = [f for f in fields(Invocation) if f.metadata.get("flags")]
    for f in fields(RunSettings):
        _add_flags(p, f, shown is None or f.name in shown)
        if f.name == "output":
            for g in run_folder_fields:
                _add_flags(p, g, shown is None or g.name in shown)
    for old, (f, new) in _deprecated_flags().items():
        p.add_argument(old, dest=_deprecated_dest(old), help=argparse.SUPPRESS,
                       **{k: v for k, v in new.argparse.items() if k == "action"})
    return p


def _from_flags(namespace: argparse.Namespace) -> dict:
    """{setting: value} of the flags given; deprecated flags mapped with a warning."""
    values = dict(vars(namespace))
    for old, (f, new) in _deprecated_flags().items():
        if _deprecated_dest(old) in values:
            print(f"warning: {old} is deprecated; use {new.option}", file=sys.stderr)
            values[f.name] = values.pop(_deprecated_dest(old))
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


@dataclass(frozen=True)
class _Name:
    """What a YAML (or run.json) key names: the setting (a field of `RunSettings`), whether the value is negated
    (`no_fuse: true` sets fuse false), and for a deprecated key the name that replaces it."""

    setting: Field
    negated: bool = False
    replaced_by: str | None = None


def _names() -> dict:
    """{key: _Name} of every key a setting is known by: its name, its flags' names (with `_` for `-`), its
    aliases (mlx-lm's names) and its deprecated names."""
    names = {}
    for f in fields(RunSettings):
        names[f.name] = _Name(f)
        for flag in flags_of(f):
            names[_key(flag.option)] = _Name(f, negated=flag.sets is False)
        names.update((alias, _Name(f)) for alias in f.metadata["aliases"])
        for old in f.metadata["deprecated"]:
            new = _key(flags_of(f)[0].option) if old.startswith("--") else f.name
            names[_key(old)] = _Name(f, replaced_by=new)
    return names


#: mlx-lm's keys whose values are structures (read by `_yaml_entry`), and the run-folder switches of `Invocation`.
_STRUCTURED_KEYS = ("lora_parameters", "fine_tune_type", "resume", "overwrite")


class _Loader(yaml.SafeLoader):
    """A safe YAML loader that also reads `1e-3` as a number (YAML 1.2; PyYAML's 1.1 rules read it as text)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def read_yaml(path) -> dict:
    """{setting: value} of a YAML config file, every key known and every value of its setting's type."""
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader)
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except yaml.MarkedYAMLError as error:  # where the parser stopped, as editors and compilers say it
        mark = error.problem_mark or error.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = error.problem or error.context or error.__class__.__name__
        raise UserError(f"--config {path}{where}: not valid YAML: {problem}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise UserError(f"--config {path}: cannot read it ({error.__class__.__name__})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of setting names to values")
    names = _names()
    out = {}
    for key, value in data.items():
        out.update(_yaml_entry(path, str(key), value, names))
    return out


def _yaml_entry(path, key: str, value, names: dict) -> dict:
    name = key.replace("-", "_")
    known = names.get(name)
    if known is not None and known.replaced_by:
        print(f"warning: --config {path}: '{key}' is deprecated; use '{known.replaced_by}'", file=sys.stderr)
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
    if name in ("resume", "overwrite"):  # what to do with an existing run folder: strictly a YAML boolean
        return {name: _check_type(path, key, value, bool)}
    if known is None:
        close = difflib.get_close_matches(name, sorted(set(names) | set(_STRUCTURED_KEYS)), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"--config {path}: unknown key {key!r}{hint}")
    f = known.setting
    if known.negated:
        return {f.name: not _check_type(path, key, value, bool)}
    if f.name == "align_rows" and isinstance(value, bool):  # YAML 1.1 reads on/off as booleans
        value = "on" if value else "off"
    if f.name == "schedule_params":
        if isinstance(value, list):
            value = dict(parse_param(item) for item in value)
        if not isinstance(value, dict):
            raise UserError(f"--config {path}: {key} must be a mapping such as {{beta_fast: 32}}")
        return {f.name: value}
    if f.metadata["tokens"] and isinstance(value, str):  # 8k, as on the command line
        return {f.name: parse_tokens(value, f"--config {path}: {key}")}
    return {f.name: _check_type(path, key, value, kind_of(f))}


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
    resume = bool(given.pop("resume", from_yaml.pop("resume", False)))
    overwrite = bool(given.pop("overwrite", from_yaml.pop("overwrite", False)))
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    values = canonical_names({**from_yaml, **given})
    settings = _resume_settings(values) if resume else RunSettings(**values)
    settings = _with_none_as_default(settings)
    validate(settings)
    return Invocation(settings, resume, overwrite, frozenset(from_yaml) | frozenset(given))


def canonical_names(values: dict) -> dict:
    """`values` ({setting: value}) with a name given in another case ('YaRN') replaced by the choice it names
    ('yarn'), for every setting whose rule has choices (--schedule, --sampler, --content, --align-rows)."""
    out = dict(values)
    for f in fields(RunSettings):
        rule, value = f.metadata["rule"], out.get(f.name)
        if rule is not None and isinstance(value, str) and value.lower() in rule.choices:
            out[f.name] = value.lower()
    return out


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
    names = _names()
    out = {"schedule": SCHEDULE_BEFORE_YARN}  # a run.json that names no schedule was trained with this one
    for key, value in values.items():
        if key not in names:
            continue
        name = names[key]
        if name.setting.name == "schedule_params" and isinstance(value, list):
            value = dict(parse_param(item) for item in value)
        out[name.setting.name] = not value if name.negated else value
    try:
        return RunSettings(**out)
    except TypeError as error:
        raise UserError(f"--resume: {path} is damaged ({error}); start over with --overwrite") from None


def save_run_file(settings: RunSettings, folder: Path, world_size: int) -> Path:
    path = Path(folder) / RUN_FILE
    record = {"settings": settings.to_json(), "world_size": world_size}
    return write_atomic(path, json.dumps(record, indent=1) + "\n")


def saved_world_size(folder: Path) -> int:
    """How many ranks the run saved in `folder` had (1 for runs saved before data parallelism)."""
    try:
        record = json.loads((Path(folder) / RUN_FILE).read_text())
        return int(record.get("world_size", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        raise UserError(f"--resume: {Path(folder) / RUN_FILE} is damaged; start over with --overwrite") from None


def validate(s: RunSettings) -> None:
    """Every check that needs no model: each setting's declared rule (its range or its choices), then the checks
    that involve several settings or a parser. UserError naming the flag."""
    for f in fields(RunSettings):
        rule, value = f.metadata["rule"], getattr(s, f.name)
        if rule is not None and value is not None and not rule.holds(value):
            raise UserError(rule.refusal(flags_of(f)[0].option, value))
    if not s.model:
        raise UserError("--model is required (a folder, a .gguf file, a hub id or an alias)")
    if s.short_share and s.sampler in ("full", "plain", "none"):
        raise UserError(f"--short-share mixes short rows into a sampler that skips positions; --sampler "
                        f"{s.sampler} has none to mix with")
    if s.max_memory is not None:
        if re.fullmatch(r"\s*\d+(\.\d+)?\s*", str(s.max_memory)):  # 8 GB or 8 bytes? ask, do not guess
            raise UserError(f"--max-memory {str(s.max_memory).strip()} has no unit: write e.g. "
                            f"{str(s.max_memory).strip()}G (units K, M, G, T are binary; B for bytes)")
        parse_size(s.max_memory)
    params = dict(s.schedule_params)
    factor = params.pop("factor", 2.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor >= 1):
        raise UserError(f"--schedule-param factor must be a number >= 1, got {factor!r}")
    try:  # the parameters' names and values, on a typical head (the real model is checked again when extended)
        scaled_inv_freq(s.schedule, 128, 10000.0, float(factor), 4096, **params)
    except (ValueError, TypeError) as error:
        raise UserError(f"--schedule-param: {error}") from None


__all__ = ["ADJUSTABLE", "ALIGN_ROWS", "Flag", "Invocation", "RUN_FILE", "RUN_SAMPLERS", "Rule", "RunSettings",
           "SCHEDULE_BEFORE_YARN", "USAGE", "build_parser", "canonical_names", "flags_of", "load_run_file", "parse_invocation", "parse_param", "read_yaml", "run_folder",
           "save_run_file", "saved_world_size", "setting", "validate"]
