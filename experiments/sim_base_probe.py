"""How does the simulator's base model change over its pre-training? Probe a pre-training checkpoint (or the
finished base) of a `python -m pose_mlx.sim` output folder: its gates (`pose_mlx.sim.gates.measure`: passkey at
Lc over 50 trials, unigram and no-context perplexity, attention-sink share, where the attention of the last
Lc / 2 queries of an 8 Lc window goes, `far_attention`) and Original's sliding-window perplexity at Lc ... 8 Lc
(`pose_mlx.perplexity`, the grid's stride and documents), whose largest ratio to the perplexity at Lc is claim
(a)'s measure (it needs >= 10x, or above the unigram perplexity).

    python -m experiments.sim_base_probe --sim out/sim-v2            # the latest checkpoint (or the finished base)

Each probe is added to benchmarks/results/sim_base/probe-<name of --sim>.json under its step, so probes taken
while a pre-training runs (it keeps only its latest checkpoint) build one curve.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_results


def checkpoint_folder(sim: Path, work: Path) -> tuple[int, Path]:
    """(step, model folder) of the finished base, else of the pre-training's latest checkpoint (its weights with
    the initial model folder's config and tokenizer, written under `work`)."""
    from mlx_lm import load

    from pose_mlx import toy

    done = sim / "pretrained"
    if (done / "pretrain.json").is_file():
        return json.loads((done / "pretrain.json").read_text())["steps"], done
    state_file = sim / "pretrained.partial" / "checkpoint" / "state.json"
    if not state_file.is_file():
        raise SystemExit(f"{sim}: no finished base and no pre-training checkpoint")
    state = json.loads(state_file.read_text())
    init = sim / "pretrained.partial" / "init"
    model, _ = load(str(init))
    model.load_weights(str(state_file.parent / state["files"]["weights"]))
    config = json.loads((init / "config.json").read_text())
    return state["step"], toy.save_model_folder(model, config, init, work / f"step-{state['step']}")


def main(argv=None) -> int:
    import pose_mlx  # noqa: F401  (loads the BLAS before mlx)
    from pose_mlx.sim import gates
    from pose_mlx.sim.config import SimConfig
    from pose_mlx.sim.grid import evaluate_perplexity

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sim", type=Path, required=True, help="a `python -m pose_mlx.sim --out` folder")
    parser.add_argument("--window", type=int, default=SimConfig.window, help="Lc (default %(default)s)")
    parser.add_argument("--factor", type=int, default=SimConfig.factor, help="longest length / Lc")
    parser.add_argument("--docs", type=int, default=SimConfig.eval_docs, help="test documents for perplexity")
    args = parser.parse_args(argv)
    data, cache = args.sim / "corpus", args.sim / "cache"
    lengths = [args.window * 2 ** k for k in range(args.factor.bit_length()) if 2 ** k <= args.factor]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        step, model = checkpoint_folder(args.sim, work)
        print(f"probing step {step} ({model})", flush=True)
        record = gates.measure(model, data / "train", data / "test", cache, args.window, lengths[-1], 0,
                               work / "passkey.json")
        evaluate_perplexity(model, data / "test", lengths, args.docs, args.window // 2, work / "ppl.json")
        ppl = {str(r["length"]): r["ppl"] for r in json.loads((work / "ppl.json").read_text())["results"]}
    at_lc = ppl[str(args.window)]
    record.update(ppl=ppl, largest_ratio=max(ppl.values()) / at_lc, seconds=time.perf_counter() - started)
    path = RESULTS_DIR / "sim_base" / f"probe-{args.sim.resolve().name}.json"
    probes = json.loads(path.read_text())["probes"] if path.is_file() else {}
    probes[str(step)] = record
    probes = dict(sorted(probes.items(), key=lambda kv: int(kv[0])))
    write_results("sim_base_probe", {"sim": str(args.sim), "window": args.window, "probes": probes}, path)
    print(json.dumps({step: record}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
