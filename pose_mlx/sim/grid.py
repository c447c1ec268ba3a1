"""The grid: every run is one call of `pose_mlx.finetune.run`, every evaluation one call of
`pose_mlx.eval.perplexity.run` / `pose_mlx.eval.passkey.run` / `pose_mlx.eval.ruler.run`, each with its typed
settings (their JSON outputs are what the report reads).

Runs train on the same number of tokens: `steps` updates of `full_batch` sequences of Lt tokens (full-length)
or `full_batch * Lt / Lc` sequences of Lc tokens (every other method). 'Original' and the schedule-only
baselines ('PI-only', ...) are `--sampler none` runs: the pre-trained model patched and exported, no training
('Original' with the identity schedule `none`). The controls 'adapt-yarn' / 'adapt-dynamic' share one ordinary
fine-tuning (`--sampler plain --schedule none`, folder `adapt`: the PoSE runs' data, updates, lr, window and seed,
positions 0..Lc-1 with the original RoPE) that the evaluators extend at load (`--schedule yarn|dynamic`). Cost
runs time PoSE and full-length at Lt = 2 Lc ... the target with `cost_steps` updates in the paper's setting: the
same number of sequences per update (`full_batch`) for both, Lc tokens each for PoSE, Lt for full-length.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import finetune
from ..eval import passkey, perplexity, ruler
from ..errors import Stopped, UserError
from ..eval.ruler_tasks import PromptBuilder
from ..settings import RUN_FILE, Invocation, RunSettings, parse_param, run_folder

#: RULER's subset run by the simulator (`pose_mlx.ruler`), and the runs it probes.
RULER_TASKS = ("niah_single_1", "niah_multikey_1", "vt")
RULER_RUNS = ("original", "pose-linear", "pose-yarn")


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    sampler: str  # finetune --sampler: none, pose, randpos, full, plain
    schedule: str = "linear"  # finetune --schedule; plain: the one the evaluators apply at load (trained with none)
    chunks: int = 2
    content: str = "uniform"
    factor: int | None = None  # None: the simulator's factor
    cost_only: bool = False
    params: str = ""  # finetune --schedule-param, comma-separated key=value ("": the schedule's defaults)

    @property
    def folder(self) -> str:
        """The run folder it trains and evaluates: the plain runs share one fine-tuning, `adapt`."""
        return "adapt" if self.sampler == "plain" else self.name

    def spec(self) -> dict:
        """results.json's `spec`: the fields, `params` only when set; the schedule under its key `scaling`."""
        return {"scaling" if k == "schedule" else k: v for k, v in asdict(self).items() if k != "params" or v}


def grid_runs(factor: int) -> list[Run]:
    """Original; schedule-only baselines; full-length, PoSE (linear / ntk / yarn); RandPos (Lc positions drawn
    from [0, Lt), sorted: the extreme of the chunk ablation); chunk ablation N in {1, 2, 3}; content ablation
    (uniform / zero / aligned); the real model's other methods (`REAL_NAMES`): dynamic NTK without training,
    the adapt-* controls, PoSE + YaRN with its frequencies only (attention factor 1); cost runs at
    Lt = 2 Lc .. the target."""
    runs = [Run("original", "Original", "none", "none")]
    runs += [Run(f"only-{s}", f"{'PI' if s == 'linear' else s.upper() if s == 'ntk' else 'YaRN'}-only", "none", s)
             for s in ("linear", "ntk", "yarn")]
    for s in ("linear", "ntk", "yarn"):
        runs.append(Run(f"full-{s}", f"Full-length + {s}", "full", s))
        runs.append(Run(f"pose-{s}", f"PoSE + {s}", "pose", s))
    runs.append(Run("randpos-linear", "RandPos + linear", "randpos", "linear"))
    for n in (1, 3):
        runs.append(Run(f"pose-linear-n{n}", f"PoSE N={n}", "pose", "linear", chunks=n))
    for content in ("zero", "aligned"):
        runs.append(Run(f"pose-linear-{content}", f"PoSE v_i {content}", "pose", "linear", content=content))
    runs.append(Run("only-dynamic", "Dynamic-only", "none", "dynamic"))
    runs += [Run(f"adapt-{s}", f"adapt + {s}", "plain", s) for s in ("yarn", "dynamic")]
    runs.append(Run("pose-yarn-notemp", "PoSE + yarn, frequencies only", "pose", "yarn", params="attention_factor=1"))
    f = 2
    while f <= factor:
        for sampler in ("pose", "full"):
            runs.append(Run(f"cost-{sampler}-{f}x-equal-seqs", f"{sampler} @ {f}x", sampler, "linear", factor=f,
                            cost_only=True))
        f *= 2
    return runs


def finetune_settings(run: Run, model: Path, data: Path, cache: Path, output: Path, *, window: int, factor: int,
                      steps: int, cost_steps: int, full_batch: int, lr: float, seed: int) -> Invocation:
    """The `pose_mlx.finetune` run of `run` (full fine-tuning, no progress bar); it resumes an unfinished run
    folder that holds its run.json and starts over in one that does not."""
    f = run.factor or factor
    params = dict(parse_param(p) for p in run.params.split(",")) if run.params else {}
    named = dict(model=str(model), original=window, target=f"{f}x", schedule_params=params, sampler=run.sampler,
                 schedule="none" if run.sampler == "plain" else run.schedule, output=str(output))
    if run.sampler == "none":
        return Invocation(RunSettings(**named))
    batch = full_batch if run.sampler == "full" or run.cost_only else full_batch * f
    settings = RunSettings(**named, full=True, data=str(data), cache_dir=str(cache), chunks=run.chunks,
                           content=run.content, steps=cost_steps if run.cost_only else steps, batch_size=batch,
                           lr=lr, warmup=max(1, steps // 10), seed=seed, save_every=max(1, steps // 5),
                           progress=False)
    partial = run_folder(output)
    resume = (partial / RUN_FILE).is_file()
    return Invocation(settings, resume=resume, overwrite=not resume and partial.exists())


def run_finetune(invocation: Invocation) -> None:
    try:
        finetune.run(invocation)
    except Stopped as stop:  # a checkpoint is saved: finetune_settings resumes it next time
        raise Stopped(stop.signum, f"fine-tuning of {invocation.settings.output} stopped by a signal; rerun the "
                                   "same command to resume") from None


def cost(folder: Path) -> dict | None:
    """Median seconds per update (first update, which compiles, left out), peak memory, tokens per update,
    from the run's train_log.jsonl; None for untrained runs."""
    log_path = Path(folder) / "train_log.jsonl"
    if not log_path.is_file():
        return None
    log = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    timed = log[1:] or log
    return {"seconds_per_step": statistics.median(r["seconds"] for r in timed),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in log), "tokens_per_step": log[-1]["tokens"],
            "final_loss": log[-1]["loss"], "steps": len(log)}


def load_schedule(run: Run, factor: int) -> tuple[str | None, str | None]:
    """(schedule, target) that extend `run`'s folder at load: the plain runs' schedule; (None, None) for the
    others, whose folder's pose_mlx.json says it."""
    return (run.schedule, f"{run.factor or factor}x") if run.sampler == "plain" else (None, None)


def _lengths(lengths: list[int]) -> str:
    return ",".join(map(str, lengths))


def evaluate_perplexity(model: Path, test: Path, lengths: list[int], docs: int, stride: int, output: Path,
                        extend: tuple[str | None, str | None] = (None, None)) -> None:
    """Sliding windows `stride` tokens apart (capped at W-1) over whole test documents, every length; `extend`:
    the (schedule, target) of `load_schedule`. Like the other evaluations of the simulator, every length of the
    grid is measured on every run, beyond a run's window on purpose (the original model's)."""
    schedule, target = extend
    perplexity.run(perplexity.PerplexitySettings(
        model=str(model), data=str(test), lengths=_lengths(lengths), stride=stride, docs=docs,
        min_doc_tokens=max(lengths), no_truncate=True, output=str(output), no_progress=True, schedule=schedule,
        target=target, allow_beyond_window=True))


def evaluate_passkey(model: Path, lengths: list[int], trials: int, seed: int, output: Path,
                     extend: tuple[str | None, str | None] = (None, None)) -> None:
    schedule, target = extend
    passkey.run(passkey.PasskeySettings(model=str(model), lengths=_lengths(lengths), trials=trials, seed=seed,
                                        output=str(output), no_progress=True, schedule=schedule, target=target,
                                        allow_beyond_window=True))


def ruler_lengths(tokenizer, task: str, lengths: list[int], samples: int = 1, seed: int = 0) -> list[int]:
    """The lengths at which every one of `task`'s `samples` prompts (with `seed`, as `pose_mlx.ruler` draws them)
    fits its template and needles (pose_mlx.ruler refuses the others). `tokenizer`: the model's mlx-lm /
    transformers tokenizer."""
    builder = PromptBuilder(tokenizer, samples=samples, seed=seed, chat=False)
    fits = []
    for n in lengths:
        try:
            for index in range(samples):
                builder.sample(task, n, index)
        except UserError:
            continue
        fits.append(n)
    return fits


def evaluate_ruler(model: Path, task: str, lengths: list[int], samples: int, seed: int, output: Path) -> None:
    ruler.run(ruler.RulerSettings(model=str(model), lengths=_lengths(lengths), tasks=task, samples=samples,
                                  seed=seed, no_chat=True, no_progress=True, output=str(output),
                                  allow_beyond_window=True))


def passkey_template_tokens(tokenizer) -> int:
    """Tokens (BOS included) of the passkey prompt with no filler: shorter lengths cannot be tested."""
    return 1 + len(tokenizer.encode(passkey.prompt_text(0, 0.5, 99_999), add_special_tokens=False))


def collect(run: Run, folder: Path, ppl_json: Path | None, passkey_json: Path | None) -> dict:
    """One run's entry of results.json."""
    entry = {"spec": run.spec(), "cost": cost(folder), "ppl": {}, "passkey": {}}
    if ppl_json is not None and ppl_json.is_file():
        entry["ppl"] = {str(r["length"]): r["ppl"] for r in json.loads(ppl_json.read_text())["results"]}
    if passkey_json is not None and passkey_json.is_file():
        entry["passkey"] = {str(a["length"]): a["accuracy"] for a in json.loads(passkey_json.read_text())["accuracy"]}
    return entry
