"""Why YaRN (x4) loses the passkey inside SmolLM2's original window: its two changes taken apart at one length.

YaRN changes two things at once (Peng et al., "YaRN: Efficient Context Window Extension of Large Language
Models", arXiv 2309.00071): it interpolates the low frequencies (wavelength > original / beta_slow) by s and
keeps the high ones, and it scales q and k by sqrt(1/t) = 0.1 ln s + 1 (1.139 for s = 4), so every attention logit
by 1/t = 1.297. This runs the real-model benchmark's passkey (same seed, keys and depths) at `--length` (default
4096, half the original window) for:

  none             the base model
  yarn             both changes (what `--schedule yarn` runs)
  yarn-no-temp     the frequencies only (attention factor 1)
  temp-only        the temperature only (the base frequencies with YaRN's attention factor)
  linear           Position Interpolation (every frequency / s, no temperature)

Writes benchmarks/results/real_model/ablation_yarn_<length>.json (accuracy and trials per variant).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from benchmarks.common import ORIGINAL, REAL_MODEL, TARGET, model_file, write_results

VARIANTS = {
    "none": None,
    "yarn": ("yarn", {}),
    "yarn-no-temp": ("yarn", {"attention_factor": 1.0}),
    "temp-only": ("yarn", {"factor": 1.0, "attention_factor": 0.1 * math.log(TARGET / ORIGINAL) + 1.0}),
    "linear": ("linear", {}),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096, help="prompt length in tokens (default 4096)")
    p.add_argument("--trials", type=int, default=10, help="trials (= depths), as the benchmark (default 10)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    args = p.parse_args()
    import pose_mlx  # noqa: F401  (the fast BLAS first)
    from pose_mlx import extend
    from pose_mlx.model import source
    from pose_mlx.eval.passkey import accuracy_by_length, run_passkey

    gguf = str(model_file())
    out = {}
    for name in args.variants.split(","):
        model, tokenizer = source.load(source.resolve(gguf))
        if VARIANTS[name] is not None:
            schedule, params = VARIANTS[name]
            record = extend(model, schedule, ORIGINAL, TARGET, **params)
        t0 = time.perf_counter()
        trials, _ = run_passkey(model, tokenizer, [args.length], args.trials, args.trials, seed=0, show_progress=False)
        row = accuracy_by_length(trials)[0]
        out[name] = {"accuracy": row["accuracy"], "trials": row["trials"], "seconds": time.perf_counter() - t0,
                     "attention_factor": None if VARIANTS[name] is None else record.layers[0].attention_factor,
                     "answers": [t.answer for t in trials]}
        print(f"{name}: {row['accuracy']:.2f} over {row['trials']} trials "
              f"(attention factor {out[name]['attention_factor']})", flush=True)
    write_results(f"ablation_yarn_{args.length}", {"length": args.length, "variants": out},
                  REAL_MODEL / f"ablation_yarn_{args.length}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
