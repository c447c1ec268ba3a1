"""What a PoSE training window costs on the real model: SmolLM2-135M (the GGUF of `bench_real_model.py`), PoSE +
YaRN LoRA as that benchmark trains it, a few updates at each --windows size side by side in one run (the machine
is shared and noisy: compare the ratio, not the seconds), seconds per update (the first, which compiles, left out)
and peak memory; and what 200 updates would take at each, the benchmark's setting.

    python -m benchmarks.bench_real_model_window [--windows 1024,2048] [--steps 4]

Writes benchmarks/results/real_model/window_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.common import DOCS, REAL_MODEL, corpus, finetune_command, model_file, run_logged, write_results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", default="1024,2048", help="training windows to time (default 1024,2048)")
    p.add_argument("--steps", type=int, default=4, help="updates per window, the first not timed (default 4)")
    p.add_argument("--work", type=Path, default=Path("out/real_model"), help="corpus and runs (default out/real_model)")
    args = p.parse_args(argv)
    gguf = model_file()
    train, _ = corpus(args.work, 4, DOCS)
    windows = {}
    for window in (int(w) for w in args.windows.split(",")):
        out = args.work / "window_cost" / str(window)
        cmd = finetune_command(gguf, train, args.work, out, schedule="yarn", window=window, steps=args.steps,
                               lr=3e-5, rank=16)
        run_logged([*cmd, "--overwrite"], args.work / "logs" / f"window_cost.{window}.log")
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
        seconds = statistics.median(r["seconds"] for r in log[1:])
        windows[str(window)] = {"seconds_per_update": seconds, "all_seconds": [r["seconds"] for r in log],
                                "peak_memory_gb": max(r["peak_memory_gb"] for r in log),
                                "minutes_for_200_updates": 200 * seconds / 60}
        print(window, windows[str(window)], flush=True)
    first = next(iter(windows.values()))["seconds_per_update"]
    for w in windows.values():
        w["time_vs_first"] = w["seconds_per_update"] / first
    path = write_results("real_model_window_cost", {"model": gguf.name, "schedule": "yarn", "windows": windows,
                                                    "steps": args.steps}, REAL_MODEL / "window_cost.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
