"""The pre-registered evidence for the real model: runs `benchmarks/protocols/real_model.yaml` as it stands.

    python benchmarks/bench_evidence.py [--stage train|eval|report|all] [--only RUN] [--max-length N]

Every run of the protocol is evaluated with the project's own commands and the SmolLM2 GGUF file:
- trained runs are rebuilt from their committed LoRA adapters (`adapters/<train>/`: `pose_mlx.convert` + the
  adapter files) or fine-tuned with the protocol's settings (`--sampler plain --schedule none` for the `adapt-*`
  controls, one fine-tuning for all of them, extended at load with their schedule);
- evaluations run cheapest first across runs (unseen-domain perplexity at 2k, then passkey at each length in
  increasing order, 32k perplexity, RULER), each cached as one JSON in `results/real_model/protocol/eval/`, so an
  interrupted benchmark goes on where it stopped, in another session or on another machine (each JSON records the
  device that gave it); `--max-length` stops short of the long lengths on a slow machine;
- the report stage writes the protocol's keys into `results/real_model/results.json` (`protocol`, `headline`,
  `tests`, and per run `passkey`, `passkey_trials`, `ppl_unseen`, `ruler` of this confirmation stage, under
  `protocol_runs`), leaving the exploratory stage's runs as they are.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real_model import DOCS, OUT, corpus, model_file, run  # noqa: E402
from common import write_results  # noqa: E402
from protocol import PROTOCOLS, difference_tests, load_protocol  # noqa: E402

EVAL = OUT / "protocol" / "eval"


def train_name(name: str, spec: dict) -> str:
    """The folder a run's model is trained into: `adapt` for the controls (one fine-tuning serves them all),
    else the run's own name."""
    return "adapt" if spec["role"] == "control" else name


def device() -> str:
    """MLX's default device and the machine, for each evaluation's record."""
    out = subprocess.run([sys.executable, "-c", "import pose_mlx, mlx.core as mx; print(mx.default_device())"],
                         capture_output=True, text=True).stdout.strip()
    return f"{out or 'unknown'} on {platform.machine()} ({platform.node()})"


def ensure_trained(name: str, spec: dict, protocol: dict, gguf: Path, work: Path, train: Path) -> Path:
    """The model folder of a trained run, evaluated as committed: fine-tuned with the protocol's settings when no
    adapters are committed (then its adapters are committed in float16), and always rebuilt from the committed
    adapters (`pose_mlx.convert` of the GGUF plus the adapter files, upcast to float32), so anyone who rebuilds it
    evaluates the same model."""
    folder_name = train_name(name, spec)
    out = work / "runs" / folder_name
    adapters = OUT / "protocol" / "adapters" / folder_name
    legacy = OUT.parent / "real_model_lr3e-5" / "adapters" / folder_name  # the earlier run the protocol names
    source = adapters if adapters.is_dir() else legacy if legacy.is_dir() else None
    if source is None:
        trained = work / "trained" / folder_name
        if not (trained / "adapters.safetensors").is_file():
            run(finetune_command(spec["train"], protocol, gguf, work, train, trained),
                work / "logs" / f"{folder_name}.finetune.log")
        adapters.mkdir(parents=True, exist_ok=True)
        for f in ("adapter_config.json", "pose_mlx.json", "config.json"):
            shutil.copyfile(trained / f, adapters / f)
        convert_weights(trained / "adapters.safetensors", adapters / "adapters.safetensors", "float16")
        source = adapters
    if not (out / "adapters.safetensors").is_file():
        partial = out.with_name(out.name + ".rebuild")
        shutil.rmtree(partial, ignore_errors=True)
        run(["pose_mlx.convert", str(gguf), str(partial)], work / "logs" / f"{folder_name}.convert.log")
        for f in source.iterdir():
            if f.name != "adapters.safetensors":
                shutil.copyfile(f, partial / f.name)
        convert_weights(source / "adapters.safetensors", partial / "adapters.safetensors", "float32")
        partial.rename(out)
    return out


def convert_weights(src: Path, dst: Path, dtype: str) -> None:
    """A safetensors file with every array cast to `dtype` (float16 to commit, float32 to evaluate on a CPU)."""
    code = ("import sys, mlx.core as mx; w = mx.load(sys.argv[1]); "
            "mx.save_safetensors(sys.argv[2], {k: v.astype(getattr(mx, sys.argv[3])) for k, v in w.items()})")
    subprocess.run([sys.executable, "-c", code, str(src), str(dst), dtype], check=True)


def finetune_command(t: dict, protocol: dict, gguf: Path, work: Path, train: Path, out: Path) -> list[str]:
    """`pose_mlx.finetune` with the protocol's shared settings and the run's sampler and schedule (resumed when
    its run folder exists)."""
    if (out.with_name(out.name + ".partial") / "run.json").is_file():
        return ["pose_mlx.finetune", "--resume", "--output", str(out), "--no-progress"]
    settings = protocol["training"]
    params = [x for k, v in t.get("schedule_params", {}).items() for x in ("--schedule-param", f"{k}={v}")]
    return ["pose_mlx.finetune", "--model", str(gguf), "--original", str(protocol["original"]),
            "--target", str(protocol["target"]), "--sampler", t["sampler"], "--schedule", t["schedule"], *params,
            "--window", str(settings["window"]), "--data", str(train), "--cache-dir", str(work / "cache"),
            "--lora-rank", str(settings["lora_rank"]), "--lr", str(settings["lr"]), "--steps", str(settings["steps"]),
            "--warmup", str(settings["warmup"]), "--batch-size", str(settings["batch_size"]),
            "--seed", str(settings["seed"]), "--no-fuse", "--no-progress", "--output", str(out),
            "--save-every", "10", "--eval-every", "40", "--eval-batches", "4"]


def model_args(name: str, spec: dict, protocol: dict, gguf: Path, work: Path) -> list[str]:
    """--model (and --schedule/--target for schedules applied at load) of a run."""
    target = str(protocol["target"])
    if spec["role"] == "base":
        return ["--model", str(gguf)]
    if spec["role"] == "training-free":
        return ["--model", str(gguf), "--schedule", spec["schedule"], "--target", target]
    folder = str(work / "runs" / train_name(name, spec))
    return ["--model", folder] + (["--schedule", spec["schedule"], "--target", target] if "schedule" in spec else [])


def unseen_corpus(protocol: dict, work: Path) -> Path:
    """The unseen-domain texts as a folder of .txt files (the protocol's list, in its order)."""
    spec = protocol["perplexity"]["unseen"]
    folder = work / "unseen"
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(spec["files"]):
        target = folder / f"{i:02d}-{name}.txt"
        if not target.is_file():
            target.write_text((Path(spec["folder"]) / name).read_text())
    return folder


def evaluations(protocol: dict, max_length: int | None) -> list[tuple[str, str, int]]:
    """(run, kind, length) of every evaluation, cheapest first: unseen 2k perplexity, passkey by length, 32k
    perplexity, RULER."""
    runs, target = protocol["runs"], protocol["target"]
    order = [(n, "ppl_unseen", protocol["perplexity"]["unseen"]["length"]) for n in runs]
    trials = protocol["passkey"]["trials"]
    for length in sorted(trials):
        order += [(n, "passkey", length) for n in runs]
    order += [(n, "ppl", target) for n in runs]
    order += [(n, "ruler", length) for length in protocol["ruler"]["lengths"] for n in runs]
    return [item for item in order if max_length is None or item[2] <= max_length]


def evaluate(name: str, kind: str, length: int, protocol: dict, gguf: Path, work: Path, test: Path) -> Path:
    """One cached evaluation's JSON (run when missing)."""
    path = EVAL / f"{name}.{kind}.{length}.json"
    if path.is_file():
        return path
    spec = protocol["runs"][name]
    args = model_args(name, spec, protocol, gguf, work)
    log = work / "logs" / f"protocol.{name}.{kind}.{length}.log"
    if kind == "passkey":
        table = protocol["passkey"]["trials_base" if spec["role"] == "base" else "trials"]
        n = table[length]
        cmd = ["pose_mlx.passkey", *args, "--lengths", str(length), "--trials", str(n), "--depths", str(n),
               "--seed", str(protocol["passkey"]["seed"])]
    elif kind == "ppl_unseen":
        u = protocol["perplexity"]["unseen"]
        cmd = ["pose_mlx.perplexity", *args, "--data", str(unseen_corpus(protocol, work)), "--lengths",
               str(length), "--stride", str(u["stride"]), "--docs", str(len(u["files"])), "--min-doc-tokens",
               str(u["span"]), "--truncate", str(u["span"])]
    elif kind == "ppl":
        docs = protocol["perplexity"]["target"]["documents"]
        cmd = ["pose_mlx.perplexity", *args, "--data", str(test), "--lengths", str(length), "--stride",
               str(length), "--docs", str(docs), "--min-doc-tokens", str(length - 1), "--truncate", str(length - 1)]
    else:
        r = protocol["ruler"]
        cmd = ["pose_mlx.ruler", *args, "--lengths", str(length), "--tasks", ",".join(r["tasks"]), "--samples",
               str(r["samples"]), "--seed", str(r["seed"]), *(["--force"] if spec["role"] == "base" else [])]
    partial = path.with_suffix(".partial.json")
    run([*cmd, "--output", str(partial), "--no-progress"], log)
    record = json.loads(partial.read_text())
    record["device"] = device()
    EVAL.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    partial.unlink()
    for png in partial.parent.glob(partial.stem + "*.png"):
        png.rename(png.with_name(png.name.replace(".partial", "")))
    return path


def collect(protocol: dict) -> dict:
    """results.json's per-run entries of the confirmation stage, from the cached evaluations."""
    runs = {}
    for name, spec in protocol["runs"].items():
        entry = {"role": spec["role"]}
        for path in sorted(EVAL.glob(f"{name}.*.json")):
            kind, length = path.name.removeprefix(f"{name}.").removesuffix(".json").rsplit(".", 1)
            record = json.loads(path.read_text())
            entry.setdefault("devices", {})[f"{kind}.{length}"] = record.get("device")
            if kind == "passkey":
                trials = record["trials"]
                entry.setdefault("passkey", {})[length] = sum(t["correct"] for t in trials) / len(trials)
                entry.setdefault("passkey_trials", {})[length] = len(trials)
            elif kind == "ppl_unseen":
                entry.setdefault("ppl_unseen", {})[length] = record["results"][0]["ppl"]
            elif kind == "ppl":
                entry.setdefault("ppl", {})[length] = record["results"][0]["ppl"]
            else:
                scores = entry.setdefault("ruler", {"scores": {}, "samples": record.get("samples")})
                scores["scores"].update({f"{r['task']}@{r['length']}": r["score"] for r in record["results"]})
        runs[name] = entry
    return runs


def headline(protocol: dict, runs: dict) -> str:
    """The recommended PoSE run: the only one of role pose, else the one with the highest passkey at the target
    (the protocol's selection rule for recipes)."""
    pose = [n for n, r in protocol["runs"].items() if r["role"] == "pose"]
    target = str(protocol["target"])
    return max(pose, key=lambda n: runs.get(n, {}).get("passkey", {}).get(target, -1.0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", type=Path, default=PROTOCOLS / "real_model.yaml", help="the protocol file")
    p.add_argument("--work", type=Path, default=Path("out/real_model"),
                   help="corpus, token cache, model folders and logs (default out/real_model)")
    p.add_argument("--docs", type=Path, default=DOCS, help="the reST sources (default %(default)s)")
    p.add_argument("--stage", choices=("train", "eval", "report", "all"), default="all", help="what to run")
    p.add_argument("--only", action="append", default=None, help="only these runs (repeatable)")
    p.add_argument("--max-length", type=int, default=None,
                   help="evaluate only lengths up to this (the rest waits for a faster machine)")
    args = p.parse_args(argv)
    protocol = load_protocol(args.protocol)
    gguf = model_file()
    train, test = corpus(args.work, 4, args.docs)
    names = [n for n in protocol["runs"] if not args.only or n in args.only]
    if args.stage in ("train", "eval", "all"):
        for name in names:
            if protocol["runs"][name]["role"] in ("control", "pose"):
                ensure_trained(name, protocol["runs"][name], protocol, gguf, args.work, train)
    if args.stage in ("eval", "all"):
        for name, kind, length in evaluations(protocol, args.max_length):
            if name in names:
                print(f"{name} {kind} {length}: {evaluate(name, kind, length, protocol, gguf, args.work, test)}",
                      flush=True)
    results_path = OUT / "results.json"
    results = json.loads(results_path.read_text())
    runs = collect(protocol)
    results.update(protocol=str(args.protocol.resolve().relative_to(Path(__file__).resolve().parents[1])),
                   protocol_runs=runs, tests=difference_tests(protocol, runs), headline=headline(protocol, runs))
    write_results("real_model", {k: v for k, v in results.items() if k != "benchmark"}, results_path)
    print(f"wrote {results_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
