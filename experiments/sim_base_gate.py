"""Does the simulator's base model pass its gates? Pre-train it at one size (the simulator's own corpus,
`pose_mlx.sim.pretrain` with its retrieval documents, BOS per block) and measure `pose_mlx.sim.gates`: passkey
accuracy at Lc over 50 trials (the gate: >= 0.95), unigram and no-context perplexity, attention-sink share; and,
to tell the test's layout from its words, the passkey prompt at Lc with "pass key" replaced by other names
(NAMES, 20 trials each, greedy): a model that retrieves for every name but "pass key" has learned the lookup but
not to override what its corpus says follows "key".

    python -m experiments.sim_base_gate --layers 6 --hidden 160 --heads 5 --ffn 432 --steps 2500

Cached in --work (default out/sim-base): the corpus is built once, a pre-training resumes after an interruption.
Writes benchmarks/results/sim_base/<layers>x<hidden>-<steps>-r<fraction>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_results


NAMES = ("pass key", "secret number", "inverse", "long shortstring")


def renamed_passkey(model_dir: Path, window: int, trials: int = 20, seed: int = 0) -> dict:
    """{name: accuracy} of the passkey prompt (`pose_mlx.eval.passkey.prompt_text`, filler to fill `window` tokens)
    with "pass key" replaced by each name; the answer must start with the key."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from pose_mlx.eval import passkey

    model, tokenizer = load(str(model_dir))
    bos = tokenizer.bos_token_id

    def prompt(n, depth, key, name):
        return [bos] + tokenizer.encode(passkey.prompt_text(n, depth, key).replace("pass key", name),
                                        add_special_tokens=False)

    def answer(ids):
        out = []
        for _ in range(7):
            out.append(int(mx.argmax(model(mx.array([ids + out]))[0, -1])))
        return tokenizer.decode(out)

    rng, scores = np.random.default_rng(seed), {}
    for name in NAMES:
        correct = 0
        for _ in range(trials):
            key, depth = int(rng.integers(10_000, 100_000)), float(rng.uniform())
            n = 0
            while len(prompt(n + 1, depth, key, name)) + 7 <= window:
                n += 1
            correct += answer(prompt(n, depth, key, name)).strip().startswith(str(key))
        scores[name] = correct / trials
    return scores


def main(argv=None) -> int:
    from pose_mlx.sim import corpus, gates
    from pose_mlx.sim.config import SimConfig
    from pose_mlx.sim.pretrain import pretrain

    defaults = SimConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=defaults.layers, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=defaults.hidden, help="model width")
    p.add_argument("--heads", type=int, default=defaults.heads, help="attention heads")
    p.add_argument("--ffn", type=int, default=defaults.ffn, help="feed-forward width")
    p.add_argument("--steps", type=int, default=defaults.pretrain_steps, help="pre-training updates")
    p.add_argument("--retrieval-fraction", type=float, default=defaults.retrieval_fraction,
                   help="share of sequences that are retrieval documents")
    p.add_argument("--prose", default="none", help="the simulator's --prose (default none: the stdlib sources "
                   "only, as the committed results were measured)")
    p.add_argument("--work", default="out/sim-base", help="cache folder: corpus, models")
    args = p.parse_args(argv)
    work, t0 = Path(args.work), time.time()
    data = work / "corpus"
    if not (data / "corpus.json").is_file():
        corpus.build_corpus(data, None, None, defaults.test_docs, defaults.test_tokens, defaults.val_fraction,
                            defaults.vocab, defaults.seed, corpus.resolve_prose(args.prose, None))
    name = f"{args.layers}x{args.hidden}-{args.steps}-r{args.retrieval_fraction:g}"
    model = work / name
    if not (model / "pretrain.json").is_file():
        pretrain(model, data / "tokenizer", data / "train", data / "val", work / "cache",
                 retrieval_fraction=args.retrieval_fraction, window=defaults.window, base=defaults.base,
                 hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, steps=args.steps,
                 batch=defaults.pretrain_batch, lr=defaults.pretrain_lr, seed=defaults.seed)
    record = gates.measure(model, data / "train", data / "test", work / "cache", defaults.window, defaults.target,
                           defaults.seed, work / f"{name}.passkey.json")
    record.update(renamed_passkey=renamed_passkey(model, defaults.window), settings=vars(args), pretrain=json.loads((model / "pretrain.json").read_text()),
                  wall_seconds=time.time() - t0)
    path = write_results(name, record, RESULTS_DIR / "sim_base" / f"{name}.json")
    print(json.dumps({k: record[k] for k in ("passkey_at_lc", "sink_share", "unigram_ppl", "no_context_ppl",
                                             "renamed_passkey")}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
