"""Runs and evaluations of a pre-registered protocol (benchmarks/protocols/*.yaml), shared by the evidence scripts
(`bench_evidence` for real_model-v1 and its addenda's `evidence_full_length` and `evidence_8x`): a run's model
folder rebuilt from its committed LoRA adapters (fine-tuned first when none are committed), the command line of
each evaluation, its record written under a `.partial` name and then into place with the device that gave it, a
pool that runs several at once, and the per-run numbers read back from a folder of records.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import DOCS, REAL_MODEL, ROOT, finetune_command, resume_command, run_logged
from experiments.protocol import PROTOCOLS
from pose_mlx.analysis.stats import wilson
from pose_mlx.resumable import read_partial


def train_name(name: str, spec: dict) -> str:
    """The folder a run's model is trained into: `adapt` for the plain fine-tuned controls (one fine-tuning serves
    them all), else the run's own name."""
    plain = spec.get("train", {}).get("sampler") == "plain"
    return "adapt" if spec["role"] == "control" and plain else name


@functools.cache
def device() -> str:
    """MLX's default device, its name (the GPU's model on a GPU) and the machine, for each evaluation's record
    (asked once, in a fresh process, before any evaluation runs: asked later, beside evaluations that hold the
    GPU's memory, the answer can fail)."""
    code = "import pose_mlx, mlx.core as mx; print(mx.default_device(), mx.device_info().get('device_name', '?'), sep='|')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    where, name = out.split("|", 1)
    return f"{where} {name} on {platform.machine()} ({platform.node()})"


def adapters_folder(name: str, spec: dict) -> Path:
    """Where a trained run's LoRA adapters are committed (the protocol's `adapters`, else `protocol/adapters/`)."""
    return ROOT / spec["adapters"] if "adapters" in spec else REAL_MODEL / "protocol" / "adapters" / train_name(name, spec)


def ensure_trained(name: str, spec: dict, protocol: dict, gguf: Path, work: Path, train: Path | None,
                   reserve: float = 0.0) -> Path:
    """The model folder of a trained run, evaluated as committed: fine-tuned with the protocol's settings (on the
    texts in `train`; stopped `reserve` s before the budget's end) when no adapters are committed (then its
    adapters are committed in float16), and always rebuilt from the committed adapters (`pose_mlx.convert` of the
    GGUF plus the adapter files, upcast to float32), so anyone who rebuilds it evaluates the same model."""
    folder_name = train_name(name, spec)
    out = work / "runs" / folder_name
    adapters = adapters_folder(name, spec)
    source = adapters if adapters.is_dir() else None
    if source is None:
        trained = work / "trained" / folder_name
        if not (trained / "adapters.safetensors").is_file():
            run_logged(protocol_finetune(spec["train"], protocol, gguf, work, train, trained),
                       work / "logs" / f"{folder_name}.finetune.log", reserve=reserve)
        adapters.mkdir(parents=True, exist_ok=True)
        for f in ("adapter_config.json", "pose_mlx.json", "config.json"):
            shutil.copyfile(trained / f, adapters / f)
        convert_weights(trained / "adapters.safetensors", adapters / "adapters.safetensors", "float16")
        source = adapters
    if not (out / "adapters.safetensors").is_file():
        partial = out.with_name(out.name + ".rebuild")
        shutil.rmtree(partial, ignore_errors=True)
        run_logged(["pose_mlx.convert", str(gguf), str(partial)], work / "logs" / f"{folder_name}.convert.log")
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


def protocol_finetune(t: dict, protocol: dict, gguf: Path, work: Path, train: Path, out: Path) -> list[str]:
    """`pose_mlx.finetune` with the protocol's shared settings and the run's sampler, schedule, window, short share
    and loss scale (the protocol's `loss_scale` when the run names none), resumed when its run folder exists;
    checkpoints every `perplexity.curve_every` updates where the protocol records a curve, else every 10."""
    if (out.with_name(out.name + ".partial") / "run.json").is_file():
        return resume_command(out)
    settings = protocol["training"]
    loss_scale = t.get("loss_scale", protocol.get("loss_scale"))
    save_every = protocol.get("perplexity", {}).get("curve_every", 10)
    return [*finetune_command(gguf, train, work, out, schedule=t["schedule"], window=t.get("window", settings["window"]),
                              steps=settings["steps"], lr=settings["lr"], rank=settings["lora_rank"],
                              warmup=settings["warmup"], sampler=t["sampler"], batch_size=settings["batch_size"],
                              seed=settings["seed"], original=protocol["original"], target=protocol["target"],
                              schedule_params=t.get("schedule_params")),
            *(["--short-share", str(t["short_share"])] if "short_share" in t else []),
            *(["--loss-scale", str(loss_scale)] if loss_scale is not None else []),
            "--save-every", str(save_every), "--eval-every", "40", "--eval-batches", "4"]


def model_args(name: str, spec: dict, protocol: dict, gguf: Path, work: Path) -> list[str]:
    """--model (and --schedule/--target for schedules applied at load) of a run; the base is measured beyond its
    window on purpose (--allow-beyond-window)."""
    target = str(protocol["target"])
    if spec["role"] == "base":
        return ["--model", str(gguf), "--allow-beyond-window"]
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


def records(name: str, kind: str, length: int, protocol: dict, screening: bool = False) -> int | None:
    """How many records (passkey trials, RULER samples) an evaluation writes; None for perplexity."""
    if kind == "passkey":
        if screening:
            return protocol["recipe"]["screening"]["passkey_trials"][length]
        role = protocol["runs"][name]["role"]
        return protocol["passkey"]["trials_base" if role == "base" else "trials"][length]
    if kind == "ruler":
        return protocol["ruler"]["samples"] * len(protocol["ruler"]["tasks"])
    return None


def run_recorded(cmd: list[str], path: Path, log: Path) -> Path:
    """Run an evaluation command into `path` (its JSON, with the device added, and its PNGs beside it): written
    under a `.partial` name first, so an interrupted run leaves no finished-looking record (one left by a run
    stopped after the command finished is this function's own scratch file: replaced, `--overwrite`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.json")
    run_logged([*cmd, "--output", str(partial), "--overwrite", "--no-progress"], log)
    record = json.loads(partial.read_text())
    record["device"] = device()
    path.write_text(json.dumps(record, indent=1) + "\n")
    partial.unlink()
    for png in partial.parent.glob(partial.stem + "*.png"):
        png.rename(png.with_name(png.name.replace(".partial", "")))
    return path


def shared_arguments(p: argparse.ArgumentParser) -> None:
    """--protocol, --work and --docs: what the evidence scripts share."""
    p.add_argument("--protocol", type=Path, default=PROTOCOLS / "real_model.yaml", help="the protocol file")
    p.add_argument("--work", type=Path, default=Path("out/real_model"),
                   help="corpus, token cache, model folders and logs (default out/real_model)")
    p.add_argument("--docs", type=Path, default=DOCS, help="the reST sources (default %(default)s)")


def addendum_arguments(description: str, protocol: Path, stages: tuple[str, ...],
                       stage_help: str) -> argparse.ArgumentParser:
    """The parser of an addendum's command line: `shared_arguments`, --stage, --jobs, --only (checked against the
    protocol's runs by `addendum_settings`), --max-length and --budget."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared_arguments(p)
    p.set_defaults(protocol=protocol)
    p.add_argument("--stage", choices=stages, default="all", help=stage_help)
    p.add_argument("--jobs", type=int, default=1, help="evaluations run at once, each its own process (default 1)")
    p.add_argument("--only", action="append", default=None, help="only these runs (repeatable)")
    p.add_argument("--max-length", type=int, default=None, help="evaluate only lengths up to this")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: the running command is stopped (keeping what it finished) when they are spent")
    return p


def addendum_settings(p: argparse.ArgumentParser, argv=None) -> tuple:
    """Parse `p` (`addendum_arguments`): (args, the protocol, the runs named by --only or all of them)."""
    from experiments.protocol import load_protocol

    args = p.parse_args(argv)
    protocol = load_protocol(args.protocol)
    unknown = sorted(set(args.only or ()) - set(protocol["runs"]))
    if unknown:
        p.error(f"--only: no run named {', '.join(unknown)} in {args.protocol}")
    return args, protocol, [n for n in protocol["runs"] if not args.only or n in args.only]


def run_all(tasks: list[tuple], fn, jobs: int, label: int = 3) -> list[tuple]:
    """`fn(*task)` for every task, `jobs` at a time (each evaluation or fine-tuning is its own process, so several
    share one GPU); prints each result, labelled by the task's first `label` items, in the tasks' order. A failed
    task is reported and the rest go on; with `jobs` > 1 the failed ones are tried once more, one at a time, after
    the others (on a GPU, a run beside others can fail for want of memory it has alone). Returns the tasks that
    failed in the end."""
    def attempt(task, call) -> bool:
        name = " ".join(map(str, task[:label]))
        try:
            print(f"{name}: {call()}", flush=True)
            return True
        except BaseException as e:  # noqa: BLE001 - a failed run (its SystemExit) must not stop the rest
            print(f"{name}: FAILED: {e}", flush=True)
            return False

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        failed = [t for t, future in [(t, pool.submit(fn, *t)) for t in tasks] if not attempt(t, future.result)]
    if jobs > 1:
        failed = [t for t in failed if not attempt(t, lambda t=t: fn(*t))]
    return failed


def cell(accuracy: float, n: int) -> str:
    low, high = wilson(round(accuracy * n), n)
    return f"{accuracy:.2f} ({n}; {low:.2f}-{high:.2f})"


def plot_passkey(runs: dict, lengths: list[int], original: int, path: Path) -> None:
    """Passkey accuracy by length with 95% Wilson intervals, one line per run that has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(r.get("passkey") for r in runs.values()):
        return
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, r in runs.items():
        xs = [n for n in lengths if str(n) in r.get("passkey", {})]
        if not xs:
            continue
        acc = [r["passkey"][str(n)] for n in xs]
        bounds = [wilson(round(a * r["passkey_trials"][str(n)]), r["passkey_trials"][str(n)]) for a, n in zip(acc, xs)]
        ax.errorbar(xs, acc, yerr=[[a - lo for a, (lo, _) in zip(acc, bounds)], [hi - a for a, (_, hi) in zip(acc, bounds)]],
                    marker="o", capsize=3, label=name)
    ax.axvline(original, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    ax.set_xlabel("prompt length (tokens; dashed: the original 8k window)")
    ax.set_ylabel("passkey accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Passkey, confirmation stage (95% Wilson intervals)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tests(tests: list[dict], path: Path) -> None:
    """The pre-registered tests as a forest plot: PoSE minus control passkey accuracy with its 95% interval, one
    row per (length, control), coloured by verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not tests:
        return
    colours = {"better": "tab:green", "worse": "tab:red", "not distinguishable": "tab:gray"}
    fig, ax = plt.subplots(figsize=(9.5, 1.2 + 0.45 * len(tests)))
    for y, t in enumerate(reversed(tests)):
        lo, hi = t["ci95"]
        ax.errorbar(t["difference"], y, xerr=[[t["difference"] - lo], [hi - t["difference"]]], fmt="o", capsize=4,
                    color=colours.get(t["verdict"], "black"), label=t["verdict"])
    ax.axvline(0, color="black", linewidth=1)
    ax.set_yticks(range(len(tests)), [f"{t['length'] // 1024}k: {t['pose']} vs {t['control']}" for t in reversed(tests)],
                  fontsize=8)
    ax.set_xlim(-1.05, 1.05)
    ax.set_xlabel("passkey accuracy, PoSE minus control (95% Newcombe interval)")
    handles = dict(zip(*ax.get_legend_handles_labels()[::-1]))  # one legend entry per verdict
    ax.legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title("The pre-registered test: does PoSE beat each control?")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def collect(protocol: dict, folder: Path) -> dict:
    """results.json's per-run entries of a protocol's confirmation stage, from its records in `folder`
    (`<run>.<kind>.<length>.json`): passkey accuracy and trials, unseen-domain and target perplexity (with the
    documents or windows scored), RULER scores, and the device of each record."""
    runs = {}
    for name, spec in protocol["runs"].items():
        entry = {"role": spec["role"]}
        for path in sorted(p for p in folder.glob(f"{name}.*.json") if ".partial" not in p.name):
            kind, length = path.name.removeprefix(f"{name}.").removesuffix(".json").rsplit(".", 1)
            if "." in kind:  # another run whose name starts with this one's and a dot
                continue
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
                entry.setdefault("ppl_documents", {})[length] = record["documents"]
            elif kind == "ruler":
                scores = entry.setdefault("ruler", {"scores": {}, "samples": record.get("samples")})
                scores["scores"].update({f"{r['task']}@{r['length']}": r["score"] for r in record["results"]})
        runs[name] = entry
    return runs


def record_state(path: Path, expected: int | None) -> str:
    """Where one evaluation's record stands: "done (<device>)", "k/n in a partial record" (the records an
    interrupted run left in its `.partial.jsonl`, which the next run takes up; n = `expected`) or "waiting"."""
    if path.is_file():
        return f"done ({json.loads(path.read_text()).get('device', 'device not recorded')})"
    partial = path.with_suffix(".partial.json.partial.jsonl")  # run_recorded's --output, then RecordLog's suffix
    if not partial.is_file():
        return "waiting"
    _, finished = read_partial(partial)
    return f"{len(finished)}/{expected or '?'} in a partial record"


def trials(folder: Path, name: str, kind: str, length: int) -> list[dict] | None:
    """A record's per-trial entries in `folder`, or None."""
    path = folder / f"{name}.{kind}.{length}.json"
    return json.loads(path.read_text())["trials"] if path.is_file() else None
