"""Offline end-to-end demo: extend the simulator's pre-trained model 8x with PoSE and measure what changed.

The base model ships with the package (`pose_mlx/sim/pretrained/`): the small llama that `python -m pose_mlx.sim`
pre-trained from scratch at Lc = 128 tokens on this project's default corpus (see its `pretrain.json`); it
retrieves a passkey inside its window. Steps, all through the real commands (no special cases):
  1. corpus: the running interpreter's standard-library .py files, the longest few held out as test documents,
     plus a share of synthetic retrieval documents of Lc tokens (`pose_mlx.sim.finetune_data`), so that
     fine-tuning keeps the retrieval skill;
  2. `pose_mlx.finetune --full --sampler pose --target 8x`: PoSE fine-tuning on Lc-token windows with position ids < 8 Lc
     (YaRN schedule by default: with PI the copy of a passkey does not survive, docs/simulator.md; full
     fine-tuning);
  3. `pose_mlx.perplexity` of three runs at Lc, 2 Lc, 4 Lc, 8 Lc on the test documents: "original" (the base,
     unchanged), "YaRN, no training" (the base with the schedule applied, no training) and "PoSE + YaRN" (the
     fine-tuned model);
  4. `pose_mlx.passkey` of the same three runs at the same lengths.
Writes each command's JSON and plots into --out (ppl-{original,yarn,pose}.json/.png, passkey-*.json, *_accuracy.png,
*_heatmap.png) and comparison.png: every run's perplexity and passkey accuracy by length, side by side.
Run again with the same settings, it reuses its corpus and fine-tuned model (steps 1-2, most of its time) and
says so; a changed setting, a model it did not finish, or `--fresh` trains again. A run replaces the results of
an earlier one in --out (it says so when it starts: copy them elsewhere to keep them, or give another --out).
`demo.json` in --out records what the corpus was made from; the model's own run.json, the settings it was
trained with.
The simulator's report (benchmarks/results/sim/report.md) has the paper's whole grid; this is its main line in
a few minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import sysconfig
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from . import finetune, toy
from .errors import ArgumentParser, UserError, command
from .eval import passkey, perplexity
from .lengths import parse_length
from .model import source
from .places import check_output
from .plots import panels, trials_note
from .rope import SCHEDULE_NAMES
from .settings import RUN_FILE, Invocation, RunSettings, load_run_file, validate
from .sim import SHIPPED_BASE, finetune_data
from .words import counted

PRETRAINED = SHIPPED_BASE
#: In --out: what the corpus of the finished fine-tuning was made from (`corpus_record`).
RECORD = "demo.json"
#: In --out: the results a run writes (each JSON with its plots beside it), which the next run replaces.
RESULTS = ("ppl-*.json", "passkey-*.json", "comparison.png")


def write_corpus(folder: Path, test_docs: int, train_docs: int | None, min_chars: int) -> tuple[Path, Path]:
    """Stdlib sources as .txt files: the `test_docs` longest go to test/, the next `train_docs` to train/."""
    texts = sorted(toy.stdlib_texts(min_chars=min_chars), key=len, reverse=True)
    if len(texts) <= test_docs:
        raise UserError(f"only {len(texts)} standard-library files found; the demo needs more than --test-docs")
    train, test = folder / "train", folder / "test"
    rest = texts[test_docs:] if train_docs is None else texts[test_docs:test_docs + train_docs]
    for sub, docs in ((test, texts[:test_docs]), (train, rest)):
        sub.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(docs):
            (sub / f"{i:05d}.txt").write_text(text, encoding="utf-8")
    return train, test


def run_labels(schedule: str) -> dict[str, str]:
    """The demo's three runs (keys: the stems of their files) named by what they are."""
    name = SCHEDULE_NAMES.get(schedule, schedule)
    return {"original": "original", schedule: f"{name}, no training", "pose": f"PoSE + {name}"}


def _table(rows: dict[str, dict[int, float]], lengths: list[int]) -> str:
    width = max(24, 2 + max(map(len, rows)))
    lines = [f"{'model':<{width}}" + "".join(f"{n:>10}" for n in lengths)]
    for name, row in rows.items():
        lines.append(f"{name:<{width}}" + "".join(f"{row[n]:>10.2f}" if n in row else f"{'-':>10}" for n in lengths))
    return "\n".join(lines)


def comparison(path: Path, lengths: list[int], ppl: dict, accuracy: dict, window: int, trials: int) -> Path:
    """Every run's perplexity (log scale) and passkey accuracy (`trials` per length) by length, two panels of one
    PNG."""
    def series(table):
        return {name: [row.get(n, float("nan")) for n in lengths] for name, row in table.items()}

    return panels(path, lengths, [(series(ppl), "perplexity (log scale)", True, None),
                                  (series(accuracy), "passkey accuracy (share of trials)", False, (-0.05, 1.05))],
                  f"Extending the pre-trained model {lengths[-1] // window}x: every run of the demo\n"
                  f"(passkey: {trials_note([trials])})", mark=window)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m pose_mlx.demo", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/demo", help="working folder (default out/demo)")
    p.add_argument("--model", default=str(PRETRAINED),
                   help="base model folder (default: the simulator's pre-trained model shipped with pose_mlx)")
    p.add_argument("--factor", type=int, default=8, help="extension factor: target = factor * Lc (default 8)")
    p.add_argument("--steps", type=int, default=150, help="fine-tuning updates (default 150, as the simulator's grid)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="Lc-token sequences per update (default 32, as the simulator's grid)")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (default 2e-4, as the simulator)")
    p.add_argument("--test-docs", type=int, default=4, help="held-out test documents (default 4)")
    p.add_argument("--train-docs", type=int, default=None, help="training documents (default: all the others)")
    p.add_argument("--schedule", default="yarn", help="RoPE schedule of the extension (default yarn; linear = PI)")
    p.add_argument("--retrieval", type=float, default=0.3,
                   help="share of the fine-tuning documents that are synthetic retrieval documents (default 0.3)")
    p.add_argument("--passkey-trials", type=int, default=10, help="passkey trials per length (default 10)")
    p.add_argument("--fresh", action="store_true",
                   help="write the corpus and fine-tune again even when --out holds a model trained with these "
                        "settings (by default it is reused)")
    return p


def _window(model: Path) -> int:
    """The base's pre-training window, from its checked config (`pose_mlx.model.source`)."""
    ref = source.resolve(str(model), weights=False)
    window = source.original_window(source.read_config(ref), ref)
    if window is None:
        raise UserError(f"--model {model}: its config.json does not say its window (max_position_embeddings)")
    return window


def _finetune_settings(args, model: Path, out: Path, train: Path):
    """Step 2, `pose_mlx.finetune`: full PoSE fine-tuning into out/pose, replacing an earlier demo's."""
    return Invocation(RunSettings(model=str(model), target=f"{args.factor}x", schedule=args.schedule, data=str(train),
                                  full=True, lr=args.lr, steps=args.steps, warmup=max(1, args.steps // 10),
                                  batch_size=args.batch_size, save_every=0, cache_dir=str(out / "cache"),
                                  output=str(out / "pose")), overwrite=True)


def _check(args) -> None:
    for name, low in (("factor", 2), ("steps", 1), ("batch_size", 1), ("test_docs", 1), ("train_docs", 1),
                      ("passkey_trials", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UserError(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 <= args.retrieval < 1:
        raise UserError(f"--retrieval must be in [0, 1), got {args.retrieval}")
    if not (Path(args.model) / "config.json").is_file():
        raise UserError(f"--model {args.model} has no config.json")
    check_output("--out", args.out, folder=True)


def _check_finetune(args, out: Path, model: Path, window: int) -> None:
    """Step 2's settings validated as finetune will validate them (the schedule's name, the ranges), and the
    target length, before the corpus is written."""
    parse_length(f"{args.factor}x", window, "--factor")
    validate(_finetune_settings(args, model, out, out / "corpus" / "finetune").settings)


def corpus_record(args, model: Path) -> dict:
    """What steps 1-2's corpus is made from: the base (its tokenizer), the document counts, the retrieval share
    and the interpreter whose standard library is the text."""
    return {"model": str(model.resolve()), "test_docs": args.test_docs, "train_docs": args.train_docs,
            "retrieval": args.retrieval, "python": platform.python_version(), "stdlib": sysconfig.get_paths()["stdlib"]}


def _changes(old: dict, new: dict) -> list[str]:
    return [f"{key} {old.get(key)!r} -> {value!r}" for key, value in new.items() if old.get(key) != value]


def why_train(out: Path, settings: RunSettings, corpus: dict) -> str | None:
    """None when `out`/pose is the finished model of a demo run with these fine-tuning `settings` and `corpus`,
    else why it has to be trained (no model, an unfinished one, or what changed)."""
    folder = Path(settings.output)
    if not (folder / "config.json").is_file() or not (folder / RUN_FILE).is_file():
        return "no fine-tuned model yet"
    try:
        record = json.loads((out / RECORD).read_text())
        saved = load_run_file(folder / RUN_FILE).to_json()
    except (OSError, ValueError, UserError):
        return f"{folder} was not finished by a demo run"
    changed = _changes(record.get("corpus", {}), corpus) + _changes(saved, settings.to_json())
    return f"the settings changed ({'; '.join(changed)})" if changed else None


def _clear_corpus(folder: Path) -> None:
    """Remove what an earlier `write_corpus` / `finetune_data.build` wrote there (numbered .txt files, the links to
    them, the retrieval documents), so that fewer documents now leave none of the earlier ones behind."""
    for sub in ("train", "test", "finetune"):
        for path in sorted((folder / sub).glob("*")) if (folder / sub).is_dir() else []:
            if re.fullmatch(r"\d{5}\.txt", path.name) or path.name == finetune_data.RETRIEVAL_FILE:
                path.unlink()


def train_or_reuse(args, out: Path, model: Path, window: int) -> Path:
    """Steps 1-2: the corpus and the fine-tuned model out/pose, reused when `why_train` finds nothing to redo
    (not with --fresh); returns the folder of the held-out test documents."""
    corpus, test = corpus_record(args, model), out / "corpus" / "test"
    plan = _finetune_settings(args, model, out, out / "corpus" / "finetune")
    why = "--fresh" if args.fresh else why_train(out, plan.settings, corpus)
    if why is None and len(list(test.glob("*.txt"))) == args.test_docs:
        print(f"[1/4] corpus: reusing {out / 'corpus'}")
        print(f"[2/4] reusing the fine-tuned model {out / 'pose'}: trained with these settings "
              "(--fresh trains it again)")
        return test
    (out / RECORD).unlink(missing_ok=True)  # until this run's model is finished
    print(f"[1/4] corpus: standard-library sources, {args.retrieval * 100:g}% of the fine-tuning documents "
          f"synthetic retrieval documents -> {out / 'corpus'}")
    _clear_corpus(out / "corpus")
    train, test = write_corpus(out / "corpus", args.test_docs, args.train_docs, min_chars=2000)
    finetune_data.build(out / "corpus" / "finetune", train, load_tokenizer(model), out / "cache", window,
                        args.retrieval, seed=0)
    print(f"[2/4] PoSE fine-tuning of {model} from {window} to {window * args.factor} tokens ({args.factor}x) -> "
          f"{out / 'pose'} ({why or 'the test documents are missing'})")
    finetune.run(plan)
    (out / RECORD).write_text(json.dumps({"corpus": corpus}, indent=1) + "\n")
    return test


@command("pose_mlx.demo")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    out, model = Path(args.out), Path(args.model)
    window = _window(model)
    _check_finetune(args, out, model, window)
    target = window * args.factor
    earlier = [pattern for pattern in RESULTS if any(out.glob(pattern))]
    if earlier:
        print(f"note: this run replaces the results of an earlier one in {out} ({', '.join(earlier)} and their "
              "plots); copy them elsewhere now to keep them, or give another --out")
    test = train_or_reuse(args, out, model, window)
    print("[3/4] sliding-window perplexity on the held-out documents")
    lengths = [window * 2**k for k in range(args.factor.bit_length())]
    runs = run_labels(args.schedule)
    # the demo's results are its own: a run again (reusing its model) replaces them
    common = {"lengths": ",".join(map(str, lengths)), "no_progress": True, "overwrite": True}
    # each run's model, and the schedule it is extended with at load; the original read beyond its window on purpose
    models = {"original": {"model": str(model), "allow_beyond_window": True},
              args.schedule: {"model": str(model), "schedule": args.schedule, "target": str(target)},
              "pose": {"model": str(out / "pose")}}
    results = {}
    for key, extra in models.items():
        scored = perplexity.run(perplexity.PerplexitySettings(**extra, **common, data=str(test), docs=args.test_docs,
                                                              stride=window, output=str(out / f"ppl-{key}.json")))
        results[runs[key]] = {r.length: r.ppl for r in scored}
    print("\nperplexity by evaluation length (lower is better):")
    print(_table(results, lengths))
    print(f"[4/4] passkey retrieval, {counted(args.passkey_trials, 'trial')} per length")
    accuracy = {}
    models["original"] = {"model": str(model), "schedule": "none", "target": str(target)}
    for key, extra in models.items():
        found = passkey.run(passkey.PasskeySettings(**extra, **common, trials=args.passkey_trials,
                                                    output=str(out / f"passkey-{key}.json")))
        accuracy[runs[key]] = {a["length"]: a["accuracy"] for a in found}
    print("\npasskey accuracy by length ('-': the prompt template does not fit):")
    print(_table(accuracy, lengths))
    png = comparison(out / "comparison.png", lengths, results, accuracy, window, args.passkey_trials)
    print(f"\nextended model: {out / 'pose'} (loads with mlx_lm.load or pose_mlx.load); "
          f"more trials: python -m pose_mlx.passkey --model {out / 'pose'} --trials 50")
    print(f"per-run plots: {out}/ppl-*.png, {out}/passkey-*_accuracy.png and _heatmap.png; all runs side by side: "
          f"{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
