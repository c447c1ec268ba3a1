"""`python -m pose_mlx.sim [--quick] [--out out/sim] [size flags]`: the whole simulator, resumable."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from . import corpus as corpus_mod
from . import finetune_data, gates, position_nll
from .agreement import agreement, real_results
from .claims import check_claims, seed_statistics
from .config import SimConfig, parse_config
from .grid import (RULER_RUNS, RULER_TASKS, Run, collect, evaluate_passkey, evaluate_perplexity, evaluate_ruler,
                   finetune_settings, grid_runs, load_schedule, passkey_template_tokens, ruler_lengths, run_finetune)
from .report import plots, write_report
from .workspace import Workspace, finetune_folder, start
from ..errors import UserError, command
from ..training.data import required_length


#: Runs trained with every seed of --seeds (claim b compares them); the others use --seed only.
SEEDED = tuple(f"{m}-{s}" for m in ("pose", "full") for s in ("linear", "ntk", "yarn"))


def _example_length(config: SimConfig, run: Run) -> int | None:
    """Document tokens one example of `run` needs (None: no training)."""
    if run.sampler == "none":
        return None
    return required_length(config.window, (run.factor or config.factor) * config.window, run.sampler, run.content)


def _seed_name(name: str, seed: int, config: SimConfig) -> str:
    return name if seed == config.seed else f"{name}.s{seed}"


def nll_bin(config: SimConfig) -> int:
    """Positions per bin of the per-position NLL curves: Lc / 4 (4 bins inside the pre-training window)."""
    return max(1, config.window // 4)


def _weights(config: SimConfig, runs: list[Run]) -> dict[str, float]:
    """Estimated work of each stage in trained-token units, so that ETA = seconds per unit so far x units left.
    Calibrated on the default run's stage times here (`results.json` `stage_seconds`: about 1.7e-4 s per unit for
    training and 2.4e-4 for evaluation, a scored token costing about 1.5 trained ones)."""
    pretrain_tokens = config.pretrain_steps * config.pretrain_batch * config.window
    w = {"corpus": 0.002 * pretrain_tokens + 1,  # tokenizer training and tokenizing: about 5 s at the default size
         "pretrain": pretrain_tokens,
         "gates": 1.5 * config.test_docs * config.test_tokens + gates.GATE_TRIALS * config.window}
    for length in sorted({_example_length(config, r) for r in runs if not r.cost_only} - {None}):
        # writing and tokenizing the retrieval documents of that length
        w[f"finetune data {length}"] = config.finetune_retrieval * config.steps * config.full_batch * length + 1
    # in the order main runs them: every run with --seed, the RULER subset, then the other seeds' runs
    seeded = [(r, config.seed) for r in runs] + [None] + [(r, s) for s in config.seed_list[1:] for r in runs
                                                          if r.name in SEEDED]
    for item in seeded:
        if item is None:
            for name in RULER_RUNS:  # a prompt of each length per task and sample (short answers)
                w[f"ruler {name}"] = len(RULER_TASKS) * config.ruler_samples * sum(config.lengths)
            continue
        run, seed = item
        name = _seed_name(run.name, seed, config)
        steps = 0 if run.sampler == "none" else config.cost_steps if run.cost_only else config.steps
        factor = run.factor or config.factor
        tokens = config.full_batch * config.window * (1 if run.cost_only and run.sampler == "pose" else factor)
        attention = 2.6 if run.sampler == "full" else 1.0  # attention over Lt tokens (measured: 2.6x at 8x)
        w[f"finetune {_seed_name(run.folder, seed, config)}"] = steps * tokens * attention + 1
        if not run.cost_only:
            windows = sum(n / min(config.eval_stride, n - 1) for n in config.lengths)  # tokens per scored token
            w[f"evaluate {name}"] = config.eval_docs * config.test_tokens * windows / 2 + 1
    for run in runs:
        if not run.cost_only:
            w[f"nll {run.name}"] = config.test_docs * config.test_tokens / 2 + 1
    return w


def _evaluate(ws: Workspace, run: Run, folder: Path, ppl_json: Path, passkey_json: Path, keys: list[int]) -> None:
    """Perplexity at every length, and the passkey at `keys` (none: perplexity only), of one trained run."""
    c = ws.config
    extend = load_schedule(run, c.factor)
    evaluate_perplexity(folder, ws.data / "test", c.lengths, c.eval_docs, c.eval_stride, ppl_json, extend)
    if keys:
        evaluate_passkey(folder, keys, c.passkey_trials, c.seed, passkey_json, extend)


def _train_and_evaluate(ws: Workspace, run: Run, seed: int, data_folders: dict[int, Path],
                        passkey_lengths: list[int]) -> dict:
    """`run` with `seed`: fine-tuned, then evaluated (its results.json entry; the cost runs: {"cost": ...}), or
    taken from --reuse-results."""
    c, prior = ws.config, ws.prior
    name = _seed_name(run.name, seed, c)
    folder = ws.out / "runs" / _seed_name(run.folder, seed, c)
    timed = prior.get("cost_vs_target", {}).get(run.sampler, {})
    if run.cost_only and str(run.factor * c.window) in timed:
        ws.take(f"finetune {folder.name}")
        return {"cost": timed[str(run.factor * c.window)]}
    if seed == c.seed and run.name in prior.get("runs", {}):
        ws.take(f"finetune {folder.name}")
        ws.take(f"evaluate {name}")
        return prior["runs"][run.name]
    if seed != c.seed and run.name in prior.get("ppl", {}):
        ws.take(f"finetune {folder.name}")
        ws.take(f"evaluate {name}")
        k = c.seed_list.index(seed)
        return {"ppl": {n: row["values"][k] for n, row in prior["ppl"][run.name].items()}}
    train = ws.data / "train" if run.cost_only else data_folders.get(_example_length(c, run), ws.data / "train")
    settings = finetune_settings(run, ws.model, train, ws.cache, folder, window=c.window, factor=c.factor,
                                 steps=c.steps, cost_steps=c.cost_steps, full_batch=c.full_batch, lr=c.lr, seed=seed)
    ws.stages.run(f"finetune {folder.name}", lambda: (folder / "config.json").is_file(),
                  lambda: run_finetune(settings))
    if run.cost_only:
        return collect(run, folder, None, None)
    ppl_json, passkey_json = ws.out / "eval" / f"{name}.ppl.json", ws.out / "eval" / f"{name}.passkey.json"
    keys = passkey_lengths if seed == c.seed else []  # extra seeds: perplexity only
    ws.stages.run(f"evaluate {name}", lambda: ppl_json.is_file() and (not keys or passkey_json.is_file()),
                  lambda: _evaluate(ws, run, folder, ppl_json, passkey_json, keys))
    return collect(run, folder, ppl_json, passkey_json if keys else None)


def _score_ruler(ws: Workspace, folder: Path, outputs: dict[str, Path]) -> None:
    c = ws.config
    tokenizer = load_tokenizer(folder)
    for task, output in outputs.items():
        lengths = ruler_lengths(tokenizer, task, c.lengths, c.ruler_samples, c.seed)
        if lengths:
            evaluate_ruler(folder, task, lengths, c.ruler_samples, c.seed, output)
        else:
            output.write_text(json.dumps({"results": []}) + "\n")


def _ruler(ws: Workspace, name: str) -> dict:
    """RULER's subset on one run: {task: {length: score}} at the lengths each task's template fits."""
    folder, stem = ws.out / "runs" / name, ws.out / "eval" / f"{name}.ruler"
    outputs = {task: stem.with_name(f"{stem.name}.{task}.json") for task in RULER_TASKS}
    ws.stages.run(f"ruler {folder.name}", lambda: all(p.is_file() for p in outputs.values()),
                  lambda: _score_ruler(ws, folder, outputs))
    return {task: {str(r["length"]): r["score"] for r in json.loads(p.read_text())["results"]}
            for task, p in outputs.items()}


def _finetune_data(ws: Workspace, runs: list[Run]) -> dict[int, Path]:
    """{example length: data folder}: the training split plus retrieval documents of that length
    (`pose_mlx.sim.finetune_data`), one folder per example length a grid run needs."""
    return {length: finetune_folder(ws, length)
            for length in sorted({_example_length(ws.config, r) for r in runs if not r.cost_only} - {None})}


def _measure_nll(ws: Workspace, run: Run, output: Path, docs: list) -> None:
    """One run's per-position NLL curve; `docs`: the test documents, tokenized by the first call."""
    if not docs:
        docs.extend(gates.test_documents(ws.data / "test", load_tokenizer(ws.model), ws.cache, ws.config.window))
    position_nll.measure(ws.out / "runs" / run.folder, docs, ws.config.target, nll_bin(ws.config), output,
                         *load_schedule(run, ws.config.factor))


def _position_curves(ws: Workspace, runs: list[Run]) -> dict:
    """{run: per-position NLL curve at Lt} (`pose_mlx.sim.position_nll`) of every evaluated run; those of the
    earlier run (--reuse-results) taken from it."""
    prior = ws.prior.get("nll_by_position", {})
    curves, docs = {}, []
    for run in (r for r in runs if not r.cost_only):
        if run.name in prior:
            ws.take(f"nll {run.name}")
            curves[run.name] = prior[run.name]
            continue
        output = ws.out / "eval" / f"{run.name}.nll.json"
        ws.stages.run(f"nll {run.name}", output.is_file, lambda: _measure_nll(ws, run, output, docs))
        curves[run.name] = json.loads(output.read_text())
    return curves


def _base_record(record: dict) -> dict:
    """The base model's record, whichever way the run got it (pre-trained or copied in)."""
    return {k: v for k, v in record.items() if k != "reused_from"}


def _prior(config: SimConfig, results: dict, out: Path) -> dict:
    """--reuse-results: the earlier run's results.json, checked to have been made with this run's settings on the
    same corpus, base and gates; the passkey heatmaps next to it are copied where this run's evaluations put
    theirs."""
    path = Path(config.reuse_results)
    prior = json.loads(path.read_text())
    theirs, mine = prior.get("config", {}), config.to_dict()
    differ = sorted(k for k in set(theirs) | set(mine)  # where the base came from: compared as the base itself
                    if k not in ("out", "pretrained") and theirs.get(k) != mine.get(k))
    if differ:
        raise UserError(f"--reuse-results {path}: made with other settings ({', '.join(differ)})")
    for key, same in (("corpus", dict), ("pretrain", _base_record), ("gates", dict)):
        if same(prior.get(key, {})) != same(results[key]):
            raise UserError(f"--reuse-results {path}: its {key} differs from this run's")
    (out / "eval").mkdir(exist_ok=True)
    for name in prior["runs"]:
        heatmap, mine_at = path.parent / f"passkey_heatmap_{name}.png", out / "eval" / f"{name}.passkey_heatmap.png"
        if heatmap.is_file() and not mine_at.is_file():
            shutil.copyfile(heatmap, mine_at)
    return prior


def _start_results(ws: Workspace, argv, base_gates: dict, template: int) -> dict:
    """results.json's settings, corpus, base and gates, and the empty tables the grid fills."""
    data = ws.data
    return {"config": ws.config.to_dict(), "argv": shlex.join(sys.argv[1:] if argv is None else argv),
            "corpus": json.loads((data / "corpus.json").read_text()),
            "pretrain": json.loads((ws.model / "pretrain.json").read_text()), "passkey_template_tokens": template,
            "gates": base_gates, "unigram_ppl": base_gates["unigram_ppl"],
            "no_context_ppl": base_gates["no_context_ppl"],
            "runs": {}, "cost_vs_target": {"pose": {}, "full": {}}}


def _grid(ws: Workspace, runs: list[Run], results: dict, passkey_lengths: list[int]) -> None:
    """The fine-tuning data, then every run with --seed, the RULER subset, then the other seeds' runs (SEEDED),
    into `results`."""
    c = ws.config
    data_folders = _finetune_data(ws, runs)
    results["finetune_data"] = {str(n): {"retrieval_documents": sum(1 for line in (
        f / finetune_data.RETRIEVAL_FILE).read_text().splitlines() if line.strip()), "share": c.finetune_retrieval}
        for n, f in data_folders.items()}
    for run in runs:
        entry = _train_and_evaluate(ws, run, c.seed, data_folders, passkey_lengths)
        if not run.cost_only:
            results["runs"][run.name] = entry
        else:
            results["cost_vs_target"][run.sampler][str(run.factor * c.window)] = entry["cost"]
    results["ruler"] = {}
    for name in (n for n in RULER_RUNS if n in results["runs"]):
        if name in ws.prior.get("ruler", {}):
            ws.take(f"ruler {name}")
            results["ruler"][name] = ws.prior["ruler"][name]
            continue
        results["ruler"][name] = _ruler(ws, name)
    seeded = {run.name: {c.seed: results["runs"][run.name]["ppl"]} for run in runs if run.name in SEEDED}
    for seed in c.seed_list[1:]:
        for run in (r for r in runs if r.name in SEEDED):
            seeded[run.name][seed] = _train_and_evaluate(ws, run, seed, data_folders, passkey_lengths)["ppl"]
    results["ppl"] = seed_statistics(results["runs"], seeded)
    results["passkey"] = {name: entry["passkey"] for name, entry in results["runs"].items() if entry["passkey"]}


def _record_time(ws: Workspace, results: dict, this_process: float) -> None:
    """The whole run's cost into `results`: every stage once (as recorded by whichever invocation ran it), plus
    this invocation's own rest. With --reuse-results, a stage the earlier run timed (the corpus, the gates, ...
    re-run here to check them) keeps that time, so the whole run's cost is the earlier run's plus what it lacked."""
    stages = ws.stages
    stages.times.update({n: t for n, t in ws.prior.get("stage_seconds", {}).items() if n in stages.weights})
    staged, unrecorded = stages.recorded()
    results["wall_seconds"] = staged + this_process - stages.seconds
    results["wall_seconds_this_process"] = this_process
    results["stage_seconds"] = {n: stages.times[n] for n in stages.weights if n in stages.times}
    reused = "reused_from" in results["pretrain"]  # a base copied in: its pre-training is no stage of this run
    results["stages_without_time"] = [n for n in unrecorded if not (reused and n == "pretrain")]


@command("pose_mlx.sim")
def main(argv=None) -> int:
    t0 = time.perf_counter()
    config = parse_config(argv)  # every setting checked before anything is created
    runs = grid_runs(config.factor)
    ws, base_gates = start(config, _weights(config, runs))
    out = ws.out
    tokenizer = corpus_mod.hf_tokenizer(ws.data / "tokenizer")
    template = passkey_template_tokens(tokenizer)
    results = _start_results(ws, argv, base_gates, template)
    if config.reuse_results:
        ws.prior = _prior(config, results, out)
    _grid(ws, runs, results, [n for n in config.lengths if n >= template])
    results["nll_by_position"] = _position_curves(ws, runs)
    results["claims"] = check_claims(results)
    real = real_results()
    if real is not None:  # the simulator's job: rank the methods as the real model does
        results["sim_agreement"] = agreement(results, real)
    this_process = time.perf_counter() - t0
    _record_time(ws, results, this_process)
    pngs = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = write_report(results, out, pngs)
    held = {True: "held", False: "did not hold", None: "not evaluated"}
    for claim in results["claims"]:
        print(f"claim ({claim['id']}): {held[claim['held']]} — {claim['detail']}")
    print(f"wrote {report}, {out / 'results.json'} and {len(pngs)} PNGs (the whole run: {results['wall_seconds']:.0f} s; "
          f"this invocation: {this_process:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
