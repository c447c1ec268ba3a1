"""Offline end-to-end demo: extend a tiny model 8x with PoSE on the standard library's source, then measure it.

Steps, all through the real commands (no special cases):
  1. corpus: the running interpreter's standard-library .py files, the longest few held out as test documents;
  2. base model: a tiny random-weight llama with a sentencepiece tokenizer trained on the spot (window Lc);
  3. `pose_mlx.finetune --method pose --target 8x`: PoSE fine-tuning on Lc-token windows with position ids < 8 Lc;
  4. `pose_mlx.perplexity` of the base and the extended model at Lc, 2 Lc, 4 Lc, 8 Lc on the test documents.
The base model is untrained, so this shows the pipeline working end to end, not the paper's claims (that is the job
of the simulator, which pre-trains its base model first).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import finetune, perplexity, toy


def write_corpus(folder: Path, test_docs: int, train_docs: int | None, min_chars: int) -> tuple[Path, Path]:
    """Stdlib sources as .txt files: the `test_docs` longest go to test/, the next `train_docs` to train/."""
    texts = sorted(toy.stdlib_texts(min_chars=min_chars), key=len, reverse=True)
    if len(texts) <= test_docs:
        raise SystemExit(f"demo: only {len(texts)} standard-library files found")
    train, test = folder / "train", folder / "test"
    rest = texts[test_docs:] if train_docs is None else texts[test_docs:test_docs + train_docs]
    for sub, docs in ((test, texts[:test_docs]), (train, rest)):
        sub.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(docs):
            (sub / f"{i:05d}.txt").write_text(text, encoding="utf-8")
    return train, test


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pose_mlx.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/demo", help="working folder (default out/demo)")
    p.add_argument("--window", type=int, default=64, help="original window Lc of the tiny model (default 64)")
    p.add_argument("--factor", type=int, default=8, help="extension factor: target = factor * window (default 8)")
    p.add_argument("--steps", type=int, default=200, help="fine-tuning steps (default 200)")
    p.add_argument("--test-docs", type=int, default=4, help="held-out test documents (default 4)")
    p.add_argument("--train-docs", type=int, default=None, help="training documents (default: all the others)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    target = args.window * args.factor
    print(f"[1/4] corpus: standard-library sources -> {out / 'corpus'}")
    train, test = write_corpus(out / "corpus", args.test_docs, args.train_docs, min_chars=2000)
    print(f"[2/4] tiny base model (window {args.window}) -> {out / 'base'}")
    # RoPE base chosen so that Lc / (2 pi base) matches Llama-2's 4096 / (2 pi 10^4).
    base = toy.make_model_folder(out / "base", hidden_size=64, num_layers=2, num_heads=4, vocab_size=512,
                                 max_position_embeddings=args.window, rope_theta=10000.0 * args.window / 4096)
    print(f"[3/4] PoSE fine-tuning to {target} tokens ({args.factor}x) -> {out / 'pose'}")
    code = finetune.main([
        "--model", str(base), "--target", f"{args.factor}x", "--data", str(train), "--full", "--lr", "1e-3",
        "--steps", str(args.steps), "--warmup", "5", "--batch-size", "4", "--save-every", "0",
        "--cache-dir", str(out / "cache"), "--output", str(out / "pose"), "--overwrite",
    ])
    if code:
        return code
    print("[4/4] sliding-window perplexity on the held-out documents")
    lengths = ",".join(str(args.window * 2**k) for k in range(args.factor.bit_length()))
    results = {}
    for name, extra in (("base (no training)", ["--model", str(base)]), ("PoSE", ["--model", str(out / "pose")])):
        path = out / f"ppl-{name.split()[0].lower()}.json"
        code = perplexity.main(extra + ["--data", str(test), "--lengths", lengths, "--docs", str(args.test_docs),
                                        "--stride", str(args.window), "--output", str(path), "--no-progress"])
        if code:
            return code
        results[name] = {r["length"]: r["ppl"] for r in json.loads(path.read_text())["results"]}
    print("\nperplexity by evaluation length (lower is better):")
    header = list(next(iter(results.values())))
    print(f"{'model':<20}" + "".join(f"{n:>10}" for n in header))
    for name, row in results.items():
        print(f"{name:<20}" + "".join(f"{row[n]:>10.1f}" for n in header))
    print(f"\nextended model: {out / 'pose'} (loads with mlx_lm.load or pose_mlx.load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
