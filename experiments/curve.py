"""Addendum A's curve (the PoSE paper's Fig. 3c): the 32k perplexity of each fine-tuning after every `curve_every`
updates, scored as soon as the weights of that update are saved, on the machine that trains, beside the
fine-tuning (the protocol's amendment 1), so that a fine-tuning cut by a time budget leaves no copy of weights that
has to travel before it can be scored.

- `Snapshots` watches a run's checkpoint folder and keeps, in float16 (as the final adapters are committed), the
  LoRA weights of every checkpoint whose step is a multiple of `every`, then hands the step to `on_saved`;
- `scaffold` is the model folder every point of a run is scored with: `pose_mlx.convert` of the GGUF (as
  `evidence_runs.ensure_trained` rebuilds a trained run), the config.json and pose_mlx.json that `pose_mlx.finetune
  --sampler none` writes for the run's schedule, original and target (the extension the trained run exports), and
  the adapter_config.json of the run's LoRA (mlx-lm's format, as `pose_mlx.training.lora.save_unfused` writes it);
- `curve_point` scores one kept copy (its adapters upcast to float32, as every committed run is evaluated);
- `Scorer` runs `curve_point` for each step handed to it, `jobs` at a time, until the budget ends;
- `curve` reads the points back for the report; `lost` names the points whose copy is gone unscored.
"""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import REAL_MODEL, perplexity_command, run_logged
from experiments.evidence_runs import convert_weights, run_recorded

CURVE = REAL_MODEL / "protocol_full" / "curve"


def to_float16(src: Path, dst: Path) -> None:
    convert_weights(src, dst, "float16")


class Snapshots(threading.Thread):
    """Keeps the trainable weights of every checkpoint whose step is a multiple of `every` from a fine-tuning's
    checkpoint folder (`<out>.partial/checkpoint/weights-<step>.safetensors`, complete once `state.json` names it;
    a checkpoint's files are kept until two later ones exist) as `dest/weights-<step>.safetensors`, written by
    `convert` (float16 by default), and calls `on_saved(step)` for each."""

    def __init__(self, checkpoint: Path, dest: Path, every: int, on_saved=None, convert=to_float16,
                 poll: float = 0.5):
        super().__init__(daemon=True)
        self.checkpoint, self.dest, self.every, self.poll = checkpoint, dest, every, poll
        self.on_saved, self.convert = on_saved or (lambda step: None), convert
        self.done = threading.Event()

    def sweep(self) -> None:
        copied = []
        for state in (self.checkpoint / "state.json", self.checkpoint / "previous.json"):
            try:
                record = json.loads(state.read_text())
            except (OSError, ValueError):
                continue
            step, name = record["step"], record["files"]["weights"]
            target = self.dest / f"weights-{step}.safetensors"
            if step % self.every == 0 and not target.is_file() and step not in (s for s, _ in copied):
                self.dest.mkdir(parents=True, exist_ok=True)
                raw = self.dest / f"weights-{step}.raw.safetensors"  # MLX reads a file's format off its name
                try:  # copy first: the trainer may delete the file before a conversion would have read it
                    shutil.copyfile(self.checkpoint / name, raw)
                    copied.append((step, raw))
                except FileNotFoundError:  # replaced between reading state.json and copying: gone for good
                    pass
        for step, raw in copied:
            target, tmp = (self.dest / f"weights-{step}{s}.safetensors" for s in ("", ".tmp"))
            self.convert(raw, tmp)
            tmp.rename(target)
            raw.unlink()
            self.on_saved(step)

    def run(self) -> None:
        while not self.done.wait(self.poll):
            self.sweep()
        self.sweep()


def curve_steps(protocol: dict) -> list[int]:
    """The updates after which the curve is scored: every `curve_every` up to the last (which is the run's own
    registered 32k perplexity)."""
    every, steps = protocol["perplexity"]["curve_every"], protocol["training"]["steps"]
    return list(range(every, steps, every))


def run_settings(work: Path, name: str) -> dict:
    """The settings of run `name`'s fine-tuning (its run.json, unfinished or finished)."""
    for folder in (work / "trained" / f"{name}.partial", work / "trained" / name):
        if (folder / "run.json").is_file():
            return json.loads((folder / "run.json").read_text())["settings"]
    raise SystemExit(f"{name} has no run.json under {work / 'trained'}: its fine-tuning has not started")


_building = threading.Lock()


def scaffold(name: str, gguf: Path, work: Path) -> Path:
    """work/curve/<name>/model: the model folder of run `name` without its adapters (built once, whole or not at
    all): the GGUF converted, the extension that `pose_mlx.finetune --sampler none` exports for the run's schedule,
    original and target, and its LoRA's adapter_config.json."""
    out = work / "curve" / name / "model"
    with _building:
        if (out / "adapter_config.json").is_file():
            return out
        s = run_settings(work, name)
        partial = out.with_name("model.building")
        shutil.rmtree(partial, ignore_errors=True)
        logs = work / "logs"
        run_logged(["pose_mlx.convert", str(gguf), str(partial)], logs / f"curve.{name}.convert.log")
        extension = out.with_name("extension")
        shutil.rmtree(extension, ignore_errors=True)
        given = s.get("schedule_params") or {}
        pairs = [f"{k}={v}" for k, v in given.items()] if isinstance(given, dict) else list(given)
        params = [x for pair in pairs for x in ("--schedule-param", pair)]
        run_logged(["pose_mlx.finetune", "--model", str(gguf), "--sampler", "none", "--schedule", s["schedule"],
                    *params, *(["--original", str(s["original"])] if s.get("original") is not None else []),
                    "--target", str(s["target"]), "--output", str(extension), "--no-progress"],
                   logs / f"curve.{name}.extension.log")
        for f in ("config.json", "pose_mlx.json"):
            shutil.copyfile(extension / f, partial / f)
        layers = s["lora_layers"] if s["lora_layers"] > 0 else \
            json.loads((partial / "config.json").read_text())["num_hidden_layers"]
        (partial / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": layers,
             "lora_parameters": {"rank": s["lora_rank"], "scale": s["lora_scale"], "dropout": 0.0}}, indent=2) + "\n")
        shutil.rmtree(extension)
        partial.rename(out)
        return out


def snapshot_model(base: Path, weights: Path, dest: Path) -> Path:
    """A model folder of `base` (a scaffold) whose LoRA weights are the kept copy `weights`, upcast to float32:
    the other files linked."""
    if (dest / "adapters.safetensors").is_file():
        return dest
    partial = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in base.iterdir():
        (partial / f.name).symlink_to(f.resolve())
    convert_weights(weights, partial / "adapters.safetensors", "float32")
    partial.rename(dest)
    return dest


def curve_point(name: str, step: int, protocol: dict, gguf: Path, work: Path, test: Path) -> Path:
    """The 32k perplexity of run `name` after `step` updates, from its kept copy (recorded in CURVE)."""
    length = protocol["target"]
    path = CURVE / f"{name}@{step}.ppl.{length}.json"
    if path.is_file():
        return path
    weights = work / "snapshots" / name / f"weights-{step}.safetensors"
    if not weights.is_file():
        raise SystemExit(f"{weights} is missing: the point is scored where its copy was kept")
    folder = snapshot_model(scaffold(name, gguf, work), weights, work / "curve" / name / f"at-{step}")
    cmd = perplexity_command(["--model", str(folder)], test, length, length,
                             protocol["perplexity"]["target"]["documents"], length - 1)
    return run_recorded(cmd, path, work / "logs" / f"protocol_full.curve.{name}@{step}.log")


class Scorer:
    """`curve_point` for every (run, step) handed to `submit`, `jobs` at a time, beside the fine-tuning."""

    def __init__(self, protocol: dict, gguf: Path, work: Path, test: Path, jobs: int, point=curve_point):
        self.args, self.point = (protocol, gguf, work, test), point
        self.pool = ThreadPoolExecutor(max(1, jobs))
        self.futures: list[tuple[str, int, Future]] = []

    def submit(self, name: str, step: int) -> None:
        self.futures.append((name, step, self.pool.submit(self.point, name, step, *self.args)))

    def finish(self) -> list[tuple[str, int]]:
        """Wait for every point; the (run, step) of those that failed or ran out of time, each reported."""
        failed = []
        for name, step, future in self.futures:
            try:
                print(f"{name} curve @{step}: {future.result()}", flush=True)
            except BaseException as e:  # noqa: BLE001 - a failed point (its SystemExit) must not stop the rest
                print(f"{name} curve @{step}: FAILED: {e}", flush=True)
                failed.append((name, step))
        self.pool.shutdown()
        return failed


def lost(protocol: dict, name: str, work: Path, trained: bool) -> list[int]:
    """The steps of run `name` whose point can no longer be scored: its fine-tuning is over (`trained`) and neither
    the point's record nor its kept copy exists."""
    if not trained:
        return []
    length = protocol["target"]
    return [s for s in curve_steps(protocol) if not (CURVE / f"{name}@{s}.ppl.{length}.json").is_file()
            and not (work / "snapshots" / name / f"weights-{s}.safetensors").is_file()]


def curve(protocol: dict, runs: dict) -> dict:
    """{run: {step: 32k perplexity}} from the curve's records and, at the last step, the registered record."""
    length, last = str(protocol["target"]), protocol["training"]["steps"]
    out = {}
    for name in protocol["runs"]:
        points = {}
        for step in curve_steps(protocol):
            path = CURVE / f"{name}@{step}.ppl.{length}.json"
            if path.is_file():
                points[step] = json.loads(path.read_text())["results"][0]["ppl"]
        final = runs.get(name, {}).get("ppl", {}).get(length)
        if final is not None:
            points[last] = final
        out[name] = points
    return out


def plot_curve(points: dict, path: Path) -> None:
    """Held-out 32k perplexity by update, one line per run (nothing drawn before any point exists)."""
    if not any(points.values()):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, by_step in points.items():
        steps = sorted(by_step)
        ax.plot(steps, [by_step[s] for s in steps], marker="o", label=name)
    ax.set_xlabel("updates")
    ax.set_ylabel("perplexity at 32k (held-out documents)")
    ax.set_title("PoSE vs full-length fine-tuning during training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["CURVE", "Scorer", "Snapshots", "curve", "curve_point", "curve_steps", "lost", "plot_curve", "scaffold",
           "snapshot_model"]
