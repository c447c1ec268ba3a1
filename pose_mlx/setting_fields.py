"""The declarations of a fine-tuning run's settings: each setting once, as a field of `RunSettings` whose
`metadata` holds its flags (with their help), the other YAML names it is known by, and the rule its value obeys.
`pose_mlx.settings` generates the argparse flags, the `--help` text, the YAML keys accepted and the range checks
of `validate` from them.

Vocabulary: the two context lengths are `original` (the window the model was pre-trained with) and `target`
(the one it is extended to); `window` is the training window (default: original); `sampler` says how position ids
are drawn (pose, pose-ref, randpos, full, none) and `schedule` how RoPE frequencies are scaled (yarn, linear, ...).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from .model.gguf.write import OUTTYPES
from .rope import SCHEDULES
from .training.positions import CONTENT, REFERENCE_SAMPLERS, SAMPLERS

#: --sampler: the position samplers a run trains with, and `none` (no training: the schedule only).
RUN_SAMPLERS = tuple(s for s in SAMPLERS if s not in REFERENCE_SAMPLERS) + ("none",)
ALIGN_ROWS = ("auto", "on", "off")
KERNELS = ("auto", "mlx")


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
    kernels: str = setting(
        "auto", "auto (default): blocked attention (fused on the CPU), chunked loss, C++ kernels (rows, norms, "
                "rotary, LoRA); mlx: MLX's own (docs/cpu-training.md)",
        rule=one_of(KERNELS), choices=KERNELS)
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
    export_gguf: str | None = setting(
        None, "also write <output>.gguf for llama.cpp, matrices in TYPE: f16 (default), f32, bf16, q8_0",
        rule=one_of(OUTTYPES),
        metavar="TYPE", nargs="?", const="f16")
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
                                              "are read from the run folder; no other flag is needed), or train a "
                                              "finished LoRA run longer with a larger --steps", True),))
    overwrite: bool = setting(False, flags=(Flag("--overwrite", "replace an existing output folder / unfinished run "
                                                 "written by pose_mlx (never anything else)", True),))
    given: frozenset = frozenset()  # the settings given explicitly (flags or YAML)
    finished: bool = False  # --resume of a finished output: trained longer from the checkpoint its folder kept


def flags_of(f) -> tuple:
    """The flags of field `f`: the ones declared, else `--<name>` taking a value, with the field's help."""
    meta = f.metadata
    return meta["flags"] or (Flag("--" + f.name.replace("_", "-"), meta["help"], None, meta["argparse"]),)


def kind_of(f) -> type:
    """The Python type of field `f` from its annotation ("int | None" -> int)."""
    return {"int": int, "float": float, "bool": bool, "str": str, "dict": dict}[f.type.split(" |")[0]]


__all__ = ["ALIGN_ROWS", "Flag", "KERNELS", "Invocation", "POSITIVE", "RUN_SAMPLERS", "Rule", "RunSettings", "between",
           "flags_of", "kind_of", "one_of", "setting"]
