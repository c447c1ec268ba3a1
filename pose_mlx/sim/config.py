"""Simulator settings: the default (full) run, sized by a feasibility run on two CPU cores, and `--quick`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from dataclasses import asdict, dataclass, fields

from ..errors import ArgumentParser, UserError
from ..places import check_output

#: Llama-2's ratio of pre-training window to longest RoPE wavelength, 4096 / (2 pi 10^4).
LLAMA2_RATIO = 4096 / (2 * math.pi * 1e4)


def matched_base(window: int) -> float:
    """RoPE base b with window / (2 pi b) = 4096 / (2 pi 10^4), i.e. b = 10^4 * window / 4096."""
    return window / (2 * math.pi * LLAMA2_RATIO)


@dataclass
class SimConfig:
    out: str = "out/sim"
    corpus: str | None = None  # folder of text; None: the interpreter's standard library
    prose: str = "none"  # English prose added to the corpus: none, auto (Debian's python3.11-doc if installed), DIR
    corpus_chars: int | None = None  # stop reading the corpus (and the prose) after this many characters
    test_docs: int = 6
    test_tokens: int = 8192  # each test document is cut to its first this many tokens
    eval_docs: int = 3  # test documents scored by perplexity (sliding windows cost ~ 2 Lt / Lc passes per token)
    val_fraction: float = 0.02
    vocab: int = 2048
    window: int = 128  # Lc
    factor: int = 8  # Lt = factor * Lc
    rope_base: float | None = None  # None: matched_base(window)
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 320
    pretrain_steps: int = 3000
    pretrain_batch: int = 32
    pretrain_lr: float = 1e-3
    retrieval_fraction: float = 0.5  # share of pre-training sequences that are synthetic retrieval documents
    pretrained: str = "shipped"  # base used instead of pre-training when made alike: shipped, none, or a folder
    steps: int = 150  # fine-tuning updates per grid run
    full_batch: int = 4  # full-length sequences per update; window methods use full_batch * Lt / Lc
    lr: float = 2e-4
    finetune_retrieval: float = 0.1  # share of every method's fine-tuning examples that are retrieval documents
    seeds: int = 2  # seeds of the PoSE and full-length runs (claim b's intervals); the others run seed only
    cost_steps: int = 20  # updates of each cost run (equal sequences per update, Lt = 2 Lc .. target)
    passkey_trials: int = 20
    ruler_samples: int = 5  # samples per RULER task and length (original, pose-linear, pose-yarn)
    seed: int = 0
    reuse_results: str | None = None  # an earlier run's results.json whose runs are taken instead of re-run

    @property
    def target(self) -> int:
        return self.window * self.factor

    @property
    def base(self) -> float:
        return self.rope_base if self.rope_base is not None else matched_base(self.window)

    @property
    def lengths(self) -> list[int]:
        """Evaluation lengths Lc, 2 Lc, 4 Lc, ..., Lt."""
        out, n = [], self.window
        while n < self.target:
            out.append(n)
            n *= 2
        return out + [self.target]

    @property
    def eval_stride(self) -> int:
        """Tokens between perplexity windows: Lc / 2 at every length (sliding windows, as the paper's)."""
        return max(1, self.window // 2)

    @property
    def window_batch(self) -> int:
        """Sequences per update for window-length methods: same tokens per update as full-length."""
        return self.full_batch * self.target // self.window

    def to_dict(self) -> dict:
        settings = {k: v for k, v in asdict(self).items() if k != "reuse_results"}  # where numbers came from
        return {**settings, "target": self.target, "base": self.base, "lengths": self.lengths,
                "window_batch": self.window_batch, "eval_stride": self.eval_stride, "seeds": self.seed_list}

    @property
    def seed_list(self) -> list[int]:
        """Seeds of the PoSE and full-length runs: seed, seed + 1, ..."""
        return [self.seed + k for k in range(self.seeds)]


QUICK = dict(corpus_chars=400_000, test_docs=2, eval_docs=2, test_tokens=512, vocab=512, window=32, hidden=32, layers=2,
             heads=2, ffn=64, pretrain_steps=30, pretrain_batch=8, pretrain_lr=3e-3, steps=3, full_batch=1,
             lr=1e-3, cost_steps=2, passkey_trials=2, ruler_samples=1, factor=8)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m pose_mlx.sim", description=(
        "Small-scale simulator of the PoSE paper: pre-train a small llama at Lc, run the grid of context "
        "extensions with pose_mlx.finetune, evaluate with pose_mlx.perplexity / pose_mlx.passkey, and write "
        "report.md, results.json and PNGs. Every stage is cached in --out; rerun to resume."))
    p.add_argument("--quick", action="store_true", help="toy sizes (the whole pipeline in about 20 s; for CI)")
    defaults = SimConfig()
    helps = {
        "out": "working folder: every stage's output and cache, report.md, results.json, PNGs",
        "corpus": "folder of text: every UTF-8 file below it, any name (default: this interpreter's standard-library "
                  "sources)",
        "prose": "folder of English text added to the corpus; 'auto': Debian's python3.11-doc reST sources when "
                 "installed and no --corpus is given; 'none' (default): leave it out (with the prose, the default "
                 "base scores 0.28 on the passkey gate instead of 1.00; docs/simulator.md)",
        "corpus_chars": "stop reading the corpus, and the prose, after this many characters each (default: read "
                        "them all)",
        "test_docs": "held-out test documents: the longest documents of the corpus",
        "test_tokens": "each test document is cut to its first this many tokens (>= the target)",
        "eval_docs": "test documents scored by the sliding-window perplexity (windows Lc / 2 apart: each token "
                     "is computed about 2 L / Lc times at length L, so this sets most of the run's time); the "
                     "per-position NLL curves use every test document",
        "val_fraction": "share of the other documents held out for the pre-training validation loss",
        "vocab": "sentencepiece vocabulary size, trained on the training split",
        "window": "pre-training window Lc (tokens)",
        "factor": "extension factor: target Lt = factor * Lc",
        "rope_base": "RoPE base (default: 10^4 * Lc / 4096, so Lc / (2 pi base) equals Llama-2's)",
        "hidden": "model width", "layers": "transformer blocks", "heads": "attention heads",
        "ffn": "feed-forward (SwiGLU) width",
        "pretrain_steps": "pre-training updates", "pretrain_batch": "Lc-token sequences per pre-training update",
        "pretrain_lr": "peak pre-training learning rate",
        "retrieval_fraction": "share of pre-training sequences that are synthetic retrieval documents (needles, "
                              "lookup tables, repeated runs; never the passkey test's wording)",
        "pretrained": "a pre-trained base that replaces the pre-training stage when it was made with this run's "
                      "settings on this corpus (its pretrain.json records both): 'shipped' (default: the base in "
                      "pose_mlx/sim/pretrained, used only when it matches, else the run pre-trains), a folder (an "
                      "earlier run's <out>/pretrained; an error if it does not match), or 'none' (always pre-train)",
        "steps": "fine-tuning updates of every grid run",
        "full_batch": "full-length sequences per update; window methods use full_batch * Lt / Lc so that "
                      "every grid run trains on the same number of tokens (cost runs: full_batch for both)",
        "lr": "peak fine-tuning learning rate (full fine-tuning)",
        "finetune_retrieval": "share of every method's fine-tuning examples that are synthetic retrieval documents "
                              "of the method's example length (keeps the base's retrieval skill, favours no method)",
        "seeds": "seeds of the PoSE and full-length runs (seed, seed + 1, ...): their perplexities are reported "
                 "as mean and 95%% interval; the other runs use --seed only",
        "cost_steps": "updates of each cost run: PoSE and full-length at 2x ... the target, full_batch sequences "
                      "per update for both (timed only)",
        "passkey_trials": "passkey trials per evaluation length",
        "ruler_samples": "samples per task and length of the RULER subset (niah_single_1, niah_multikey_1, vt) "
                         "run on Original, PoSE + linear and PoSE + YaRN",
        "seed": "seed of the corpus split, initialisation, data sampling and passkey keys",
        "reuse_results": "an earlier run's results.json made with the same settings (its corpus, base and gates "
                         "are checked against this run's): every run, evaluation and curve it records is taken "
                         "from it, with its stage time, and only what it lacks runs (runs added to the grid since)",
    }
    # their help states the default
    extra = {"corpus": "", "prose": "", "corpus_chars": "", "rope_base": "", "pretrained": "", "reuse_results": ""}
    for f in fields(SimConfig):
        kind = {"int": int, "float": float}.get(str(f.type), str)
        if f.name in ("corpus_chars", "rope_base"):
            kind = int if f.name == "corpus_chars" else float
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                       help=helps[f.name] + extra.get(f.name, f" (default {getattr(defaults, f.name)})"))
    return p


def parse_config(argv=None) -> SimConfig:
    """Flags -> SimConfig: the defaults, overlaid with QUICK under --quick, then the flags given; validated
    (`validate`) before anything is created."""
    args = build_parser().parse_args(argv)
    values = dict(QUICK) if args.quick else {}
    if args.quick and args.out is None:
        values["out"] = "out/sim-quick"
    values.update({k: v for k, v in vars(args).items() if k != "quick" and v is not None})
    config = SimConfig(**values)
    validate(config)
    return config


#: The largest seed finetune takes (`pose_mlx.settings`); the simulator's runs use seed .. seed + seeds - 1.
MAX_SEED = 2**32 - 1


def validate(config: SimConfig) -> None:
    """Every setting in range, every folder named where it can be: UserError naming the flag otherwise."""
    for name in ("window", "factor", "vocab", "hidden", "layers", "heads", "ffn", "pretrain_steps",
                 "pretrain_batch", "steps", "full_batch", "cost_steps", "passkey_trials", "ruler_samples",
                 "test_docs", "eval_docs", "seeds"):
        if getattr(config, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    if config.vocab <= 260:  # pose_mlx.toy.train_tokenizer: 256 byte pieces, 4 specials, then merges
        raise UserError(f"--vocab must be more than 260 (256 byte pieces + 4 special pieces), got {config.vocab}")
    if config.window < 2:
        raise UserError(f"--window must be >= 2 (PoSE's two chunks), got {config.window}")
    if config.factor < 2:
        raise UserError(f"--factor must be >= 2, got {config.factor}")
    if config.corpus_chars is not None and config.corpus_chars < 1:
        raise UserError(f"--corpus-chars must be >= 1, got {config.corpus_chars}")
    if config.hidden % config.heads or (config.hidden // config.heads) % 2:
        raise UserError(f"--heads {config.heads} must divide --hidden {config.hidden} into heads of an even width "
                        "(RoPE rotates pairs of dimensions)")
    if config.rope_base is not None and not (math.isfinite(config.rope_base) and config.rope_base > 1):
        raise UserError(f"--rope-base must be a finite number > 1, got {config.rope_base:g}")
    for name in ("lr", "pretrain_lr"):
        if not (math.isfinite(getattr(config, name)) and getattr(config, name) > 0):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(config, name):g}")
    for name in ("val_fraction", "retrieval_fraction", "finetune_retrieval"):
        if not 0 <= getattr(config, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(config, name):g}")
    if not 0 <= config.seed <= MAX_SEED - config.seeds + 1:
        raise UserError(f"--seed must be between 0 and {MAX_SEED - config.seeds + 1} (the runs use --seed .. "
                        f"--seed + --seeds - 1), got {config.seed}")
    if config.corpus is not None and not Path(config.corpus).expanduser().exists():
        raise UserError(f"--corpus {config.corpus}: no such file or folder")
    if config.prose not in ("auto", "none") and not Path(config.prose).is_dir():
        raise UserError(f"--prose {config.prose}: not a folder (or use auto / none)")
    if config.pretrained not in ("shipped", "none") and not (Path(config.pretrained) / "pretrain.json").is_file():
        raise UserError(f"--pretrained {config.pretrained}: not a pre-trained base (no pretrain.json; or use "
                        "shipped / none)")
    if config.reuse_results is not None and not Path(config.reuse_results).is_file():
        raise UserError(f"--reuse-results {config.reuse_results}: no such file")
    if config.eval_docs > config.test_docs:
        raise UserError(f"--eval-docs ({config.eval_docs}) must be <= --test-docs ({config.test_docs})")
    if config.test_tokens < config.target:
        raise UserError(f"--test-tokens ({config.test_tokens}) must be >= the target {config.target}")
    check_output("--out", config.out, folder=True)
