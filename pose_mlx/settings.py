"""The settings of one fine-tuning run: built once from flags and a YAML file (or, with `--resume`, from the run
folder's run.json), type-checked and validated once, saved in run.json, read by every stage.

Each setting is declared once, in `pose_mlx.setting_fields` (a field of `RunSettings` with its flags, help, YAML
names and rule); the argparse flags, the `--help` text, the YAML keys accepted and the range checks of `validate`
are generated here from these declarations, and the declarations' names are importable from here too.

Sources, later ones winning: the defaults of `RunSettings`, the YAML file of `--config` (keys are the settings'
names, the flags' names with `-` or `_`, or mlx-lm's names for the same things), the flags given on the command
line. With `--resume`, run.json replaces the defaults and the YAML file, and a flag that would change the run's
meaning is refused (only `ADJUSTABLE` settings may change; a new `--steps` stretches or shortens the linear decay
of the learning rate from the step reached on).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import shlex
import sys
from dataclasses import Field, dataclass, fields, replace
from pathlib import Path

import yaml

from .errors import ArgumentParser, UserError
from .files import write_atomic
from .lengths import parse_tokens, tokens
from .memory import parse_size
from .model.source import describe_aliases
from .places import check_output
from .rope import SCHEDULES, scaled_inv_freq, schedule_parameters
from .setting_fields import (ALIGN_ROWS, RUN_SAMPLERS, Flag, Invocation, Rule, RunSettings, flags_of, kind_of,
                             setting)
from .words import counted

RUN_FILE = "run.json"
#: Settings that may differ between a run and its --resume without changing what the run computes.
ADJUSTABLE = ("steps", "progress", "save_every", "cache_dir", "max_memory", "force", "export_gguf")
#: The default --schedule until yarn became the default: what a run whose run.json names none was trained with.
SCHEDULE_BEFORE_YARN = "linear"


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
    settings, finished = _resume_settings(values) if resume else (RunSettings(**values), False)
    settings = _with_none_as_default(settings)
    validate(settings)
    return Invocation(settings, resume, overwrite, frozenset(from_yaml) | frozenset(given), finished)


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


def _resume_settings(given: dict) -> tuple[RunSettings, bool]:
    """The saved settings of the run at --output, with the given ones that may change applied, and whether that run
    is finished (its output complete: it is trained longer, `_finished_run`)."""
    if not given.get("output"):
        raise UserError("--resume needs --output (the folder the interrupted run was writing)")
    check_output("--output", given["output"])
    path = run_folder(given["output"]) / RUN_FILE
    finished = not path.is_file() and (Path(given["output"]) / "pose_mlx.json").is_file()
    saved = load_run_file(_finished_run(Path(given["output"]), given.get("steps")) if finished else path)
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
    return saved, finished


def _finished_run(output: Path, steps: int | None) -> Path:
    """The run.json of the finished run at `output`, which --resume trains on to `steps` from the checkpoint its
    folder kept (LoRA runs keep their last one, `pose_mlx.model.export.export_run`); UserError when there is
    nothing to continue: no checkpoint, or `steps` not above the steps trained."""
    state = output / "checkpoint" / "state.json"
    try:
        trained = int(json.loads(state.read_text())["step"])
    except FileNotFoundError:
        raise UserError(f"output folder {output} is already complete and kept no checkpoint to train it longer "
                        "from (only LoRA runs keep theirs); nothing to resume") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise UserError(f"--resume: {state} is damaged; the output folder is complete, nothing to resume") from None
    if steps is None or steps <= trained:
        raise UserError(f"output folder {output} is already complete ({counted(trained, 'step')}); nothing to "
                        "resume: pass "
                        f"--steps above {trained} with --resume to train it longer")
    return output / RUN_FILE


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


def command_line(settings: RunSettings, changes: dict | None = None,
                 prog: str = "python -m pose_mlx.finetune") -> str:
    """The command line (shell-quoted) that runs `settings` with `changes` applied ({setting: value}): `prog`, then
    the flag of every setting whose value is not its default, as `build_parser` reads it back."""
    s, defaults, words = replace(settings, **(changes or {})), RunSettings(), prog.split()
    for f in fields(RunSettings):
        value, declared = getattr(s, f.name), flags_of(f)
        if value == getattr(defaults, f.name):
            continue
        if f.name == "schedule_params":
            words += [x for key, v in value.items() for x in (declared[0].option, f"{key}={v}")]
        elif declared[0].sets is not None:
            words.append(next(flag.option for flag in declared if flag.sets == value))
        else:
            words += [declared[0].option, str(value)]
    return shlex.join(words)


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
           "SCHEDULE_BEFORE_YARN", "USAGE", "build_parser", "canonical_names", "command_line", "flags_of",
           "load_run_file", "parse_invocation", "parse_param", "read_yaml", "run_folder", "save_run_file",
           "saved_world_size", "setting", "validate"]
