"""`python -m pose_mlx.sim [--quick] [--out out/sim] [size flags]`: the whole simulator, resumable."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from . import SHIPPED_BASE
from . import corpus as corpus_mod
from . import finetune_data, gates, position_nll
from .agreement import agreement, real_results
from .claims import check_claims, seed_statistics
from .config import SimConfig, parse_config
from .grid import (RULER_RUNS, RULER_TASKS, Run, collect, evaluate_passkey, evaluate_perplexity, evaluate_ruler,
                   finetune_args, grid_runs, load_args, load_schedule, passkey_template_tokens, ruler_lengths,
                   run_finetune)
from .pretrain import made_with, pretrain, reuse_base
from .report import plots, write_report
from .stages import Stages
from ..errors import Stopped, UserError, command
from ..files import replace_dir
from ..training.data import required_length
from ..training.loop import Interrupted

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


def _ruler(stages: Stages, config: SimConfig, folder: Path, stem: Path) -> dict:
    """RULER's subset on one run: {task: {length: score}} at the lengths each task's template fits."""
    outputs = {task: stem.with_name(f"{stem.name}.{task}.json") for task in RULER_TASKS}

    def do_ruler():
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(folder)
        for task, output in outputs.items():
            lengths = ruler_lengths(tokenizer, task, config.lengths, config.ruler_samples, config.seed)
            if lengths:
                evaluate_ruler(folder, task, lengths, config.ruler_samples, config.seed, output)
            else:
                output.write_text(json.dumps({"results": []}) + "\n")

    stages.run(f"ruler {folder.name}", lambda: all(p.is_file() for p in outputs.values()), do_ruler)
    return {task: {str(r["length"]): r["score"] for r in json.loads(p.read_text())["results"]}
            for task, p in outputs.items()}


def _finetune_data(stages: Stages, config: SimConfig, runs: list[Run], out: Path, model: Path,
                   cache: Path) -> dict[int, Path]:
    """{example length: data folder}: the training split plus retrieval documents of that length
    (`pose_mlx.sim.finetune_data`), one folder per example length a grid run needs."""
    from mlx_lm.utils import load_tokenizer

    folders = {}
    for length in sorted({_example_length(config, r) for r in runs if not r.cost_only} - {None}):
        folder = folders[length] = out / "finetune-data" / str(length)
        stages.run(f"finetune data {length}", lambda: (folder / finetune_data.RETRIEVAL_FILE).is_file(),
                   lambda: finetune_data.build(folder, out / "corpus" / "train", load_tokenizer(model), cache,
                                               length, config.finetune_retrieval, config.seed))
    return folders


def _position_curves(stages: Stages, config: SimConfig, runs: list[Run], out: Path, model: Path,
                     cache: Path, prior: dict, take) -> dict:
    """{run: per-position NLL curve at Lt} (`pose_mlx.sim.position_nll`) of every evaluated run; those in `prior`
    (--reuse-results) taken from it."""
    curves, docs = {}, []
    for run in (r for r in runs if not r.cost_only):
        if run.name in prior:
            take(f"nll {run.name}")
            curves[run.name] = prior[run.name]
            continue
        output = out / "eval" / f"{run.name}.nll.json"

        def measure(run=run, output=output):
            if not docs:
                from mlx_lm.utils import load_tokenizer

                docs.extend(gates.test_documents(out / "corpus" / "test", load_tokenizer(model), cache,
                                                 config.window))
            position_nll.measure(out / "runs" / run.folder, docs, config.target, nll_bin(config), output,
                                 *load_schedule(run, config.factor))

        stages.run(f"nll {run.name}", output.is_file, measure)
        curves[run.name] = json.loads(output.read_text())
    return curves


def _use_pretrained(pretrained: str, model: Path, made: dict) -> None:
    """--pretrained: copy the base it names to `model` when it was `made` alike, so the pre-training stage is
    cached; a folder that does not match is the user's error, the shipped base that does not is skipped."""
    source = SHIPPED_BASE if pretrained == "shipped" else Path(pretrained)
    why_not = reuse_base(source, model, made, name="shipped" if pretrained == "shipped" else None)
    if why_not is None:
        print(f"pretrain: the base in {source} was made with these settings on this corpus; using it", flush=True)
    elif pretrained == "shipped":
        print(f"pretrain: not using the shipped base ({why_not})", flush=True)
    else:
        raise UserError(f"--pretrained {source}: {why_not}")


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

    def base(record: dict) -> dict:  # the base model, whichever way each run got it
        return {k: v for k, v in record.items() if k != "reused_from"}

    for key, same in (("corpus", dict), ("pretrain", base), ("gates", dict)):
        if same(prior.get(key, {})) != same(results[key]):
            raise UserError(f"--reuse-results {path}: its {key} differs from this run's")
    (out / "eval").mkdir(exist_ok=True)
    for name in prior["runs"]:
        heatmap, mine_at = path.parent / f"passkey_heatmap_{name}.png", out / "eval" / f"{name}.passkey_heatmap.png"
        if heatmap.is_file() and not mine_at.is_file():
            shutil.copyfile(heatmap, mine_at)
    return prior


@command("pose_mlx.sim")
def main(argv=None) -> int:
    t0 = time.perf_counter()
    config = parse_config(argv)  # every setting checked before anything is created
    out = Path(config.out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    runs = grid_runs(config.factor)
    stages = Stages(_weights(config, runs), record=out / "stage_seconds.json")
    data, cache = out / "corpus", out / "cache"

    def do_corpus():  # built aside and moved into place: a refused corpus leaves nothing behind
        building = out / ".corpus.tmp"
        shutil.rmtree(building, ignore_errors=True)
        try:
            corpus_mod.build_corpus(building, config.corpus, config.corpus_chars, config.test_docs,
                                    config.test_tokens, config.val_fraction, config.vocab, config.seed,
                                    corpus_mod.resolve_prose(config.prose, config.corpus))
        except BaseException as error:
            shutil.rmtree(building, ignore_errors=True)
            if created:  # this run made --out, and nothing is in it yet
                shutil.rmtree(out, ignore_errors=True)
            if isinstance(error, ValueError):  # --corpus empty, too few or too short documents
                raise UserError(error) from None
            raise
        replace_dir(building, data)  # over a corpus without corpus.json: left by a killed run

    stages.run("corpus", lambda: (data / "corpus.json").is_file(), do_corpus)
    tokenizer = corpus_mod._hf_tokenizer(data / "tokenizer")
    model = out / "pretrained"

    made = made_with(config.to_dict(), data)
    if not (model / "pretrain.json").is_file() and config.pretrained != "none":
        _use_pretrained(config.pretrained, model, made)

    def do_pretrain():
        try:
            pretrain(model, data / "tokenizer", data / "train", data / "val", cache,
                     retrieval_fraction=config.retrieval_fraction, window=config.window, base=config.base,
                     hidden=config.hidden, layers=config.layers, heads=config.heads, ffn=config.ffn,
                     steps=config.pretrain_steps, batch=config.pretrain_batch, lr=config.pretrain_lr,
                     seed=config.seed, made=made)
        except Interrupted as stop:
            raise Stopped(stop.signum, f"pre-training stopped by {signal.Signals(stop.signum).name}; checkpoint "
                                       f"saved at step {stop.step}; rerun the same command to resume") from None

    stages.run("pretrain", lambda: (model / "pretrain.json").is_file(), do_pretrain)
    gates_json = out / "gates.json"

    def do_gates():
        record = gates.measure(model, data / "train", data / "test", cache, config.window, config.target,
                               config.seed, out / "eval" / "base.passkey-gate.json")
        gates_json.write_text(json.dumps(record, indent=1) + "\n")

    stages.run("gates", gates_json.is_file, do_gates)
    base_gates = json.loads(gates_json.read_text())

    template = passkey_template_tokens(tokenizer)
    passkey_lengths = [n for n in config.lengths if n >= template]
    results = {"config": config.to_dict(), "argv": shlex.join(sys.argv[1:] if argv is None else argv),
               "corpus": json.loads((data / "corpus.json").read_text()),
               "pretrain": json.loads((model / "pretrain.json").read_text()), "passkey_template_tokens": template,
               "gates": base_gates, "unigram_ppl": base_gates["unigram_ppl"],
               "no_context_ppl": base_gates["no_context_ppl"],
               "runs": {}, "cost_vs_target": {"pose": {}, "full": {}}}
    prior = _prior(config, results, out) if config.reuse_results else {}
    source = config.reuse_results

    def take(stage: str) -> None:
        stages.reuse(stage, prior.get("stage_seconds", {}).get(stage), source)

    data_folders = _finetune_data(stages, config, runs, out, model, cache)
    results["finetune_data"] = {str(n): {"retrieval_documents": sum(1 for line in (
        f / finetune_data.RETRIEVAL_FILE).read_text().splitlines() if line.strip()), "share": config.finetune_retrieval}
        for n, f in data_folders.items()}

    def train_and_evaluate(run: Run, seed: int) -> dict:
        name = _seed_name(run.name, seed, config)
        folder = out / "runs" / _seed_name(run.folder, seed, config)
        timed = prior.get("cost_vs_target", {}).get(run.sampler, {})
        if run.cost_only and str(run.factor * config.window) in timed:
            take(f"finetune {folder.name}")
            return {"cost": timed[str(run.factor * config.window)]}
        if seed == config.seed and run.name in prior.get("runs", {}):
            take(f"finetune {folder.name}")
            take(f"evaluate {name}")
            return prior["runs"][run.name]
        if seed != config.seed and run.name in prior.get("ppl", {}):
            take(f"finetune {folder.name}")
            take(f"evaluate {name}")
            k = config.seed_list.index(seed)
            return {"ppl": {n: row["values"][k] for n, row in prior["ppl"][run.name].items()}}
        train = data / "train" if run.cost_only else data_folders.get(_example_length(config, run), data / "train")
        args = finetune_args(run, model, train, cache, folder, window=config.window, factor=config.factor,
                             steps=config.steps, cost_steps=config.cost_steps, full_batch=config.full_batch,
                             lr=config.lr, seed=seed)
        stages.run(f"finetune {folder.name}", lambda: (folder / "config.json").is_file(), lambda: run_finetune(args))
        if run.cost_only:
            return collect(run, folder, None, None)
        ppl_json, passkey_json = out / "eval" / f"{name}.ppl.json", out / "eval" / f"{name}.passkey.json"
        keys = passkey_lengths if seed == config.seed else []  # extra seeds: perplexity only

        def do_eval():
            extend = load_args(run, config.factor)
            evaluate_perplexity(folder, data / "test", config.lengths, config.eval_docs, config.eval_stride,
                                ppl_json, extend)
            if keys:
                evaluate_passkey(folder, keys, config.passkey_trials, config.seed, passkey_json, extend)

        stages.run(f"evaluate {name}", lambda: ppl_json.is_file() and (not keys or passkey_json.is_file()), do_eval)
        return collect(run, folder, ppl_json, passkey_json if keys else None)

    for run in runs:
        entry = train_and_evaluate(run, config.seed)
        if not run.cost_only:
            results["runs"][run.name] = entry
        else:
            results["cost_vs_target"][run.sampler][str(run.factor * config.window)] = entry["cost"]

    results["ruler"] = {}
    for name in (n for n in RULER_RUNS if n in results["runs"]):
        if name in prior.get("ruler", {}):
            take(f"ruler {name}")
            results["ruler"][name] = prior["ruler"][name]
            continue
        results["ruler"][name] = _ruler(stages, config, out / "runs" / name, out / "eval" / f"{name}.ruler")
    seeded = {run.name: {config.seed: results["runs"][run.name]["ppl"]} for run in runs if run.name in SEEDED}
    for seed in config.seed_list[1:]:
        for run in (r for r in runs if r.name in SEEDED):
            seeded[run.name][seed] = train_and_evaluate(run, seed)["ppl"]
    results["ppl"] = seed_statistics(results["runs"], seeded)
    results["passkey"] = {name: entry["passkey"] for name, entry in results["runs"].items() if entry["passkey"]}
    results["nll_by_position"] = _position_curves(stages, config, runs, out, model, cache,
                                                  prior.get("nll_by_position", {}), take)
    results["claims"] = check_claims(results)
    real = real_results()
    if real is not None:  # the simulator's job: rank the methods as the real model does
        results["sim_agreement"] = agreement(results, real)
    this_process = time.perf_counter() - t0
    # --reuse-results: a stage the earlier run timed (the corpus, the gates, ... re-run here to check them) keeps
    # that time, so the whole run's cost is the earlier run's plus what it lacked
    stages.times.update({n: t for n, t in prior.get("stage_seconds", {}).items() if n in stages.weights})
    staged, unrecorded = stages.recorded()
    results["wall_seconds"] = staged + this_process - stages.seconds  # every stage once, plus this run's own rest
    results["wall_seconds_this_process"] = this_process
    results["stage_seconds"] = {n: stages.times[n] for n in stages.weights if n in stages.times}
    reused = "reused_from" in results["pretrain"]  # a base copied in: its pre-training is no stage of this run
    results["stages_without_time"] = [n for n in unrecorded if not (reused and n == "pretrain")]
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
