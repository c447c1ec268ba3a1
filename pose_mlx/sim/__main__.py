"""`python -m pose_mlx.sim [--quick] [--out out/sim] [size flags]`: the whole simulator, resumable."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from . import corpus as corpus_mod
from . import gates
from .claims import check_claims
from .config import SimConfig, parse_config
from .grid import (RULER_RUNS, RULER_TASKS, Run, collect, evaluate_passkey, evaluate_perplexity, evaluate_ruler,
                   finetune_args, grid_runs, passkey_template_tokens, ruler_lengths, run_finetune)
from .pretrain import pretrain
from .report import plots, write_report
from .stages import Stages


def _weights(config: SimConfig, runs: list[Run]) -> dict[str, float]:
    """Estimated work of each stage in trained-token units (evaluation ~ a third of training per token)."""
    w = {"corpus": 0.02 * config.pretrain_steps * config.pretrain_batch * config.window + 1,
         "pretrain": config.pretrain_steps * config.pretrain_batch * config.window,
         "gates": config.test_docs * config.test_tokens / 3 + gates.GATE_TRIALS * config.window}
    for run in runs:
        steps = 0 if run.sampler == "none" else config.cost_steps if run.cost_only else config.steps
        factor = run.factor or config.factor
        tokens = config.full_batch * config.window * (1 if run.cost_only and run.sampler == "pose" else factor)
        attention = 2.6 if run.sampler == "full" else 1.0  # attention over Lt tokens (measured: 2.6x at 8x)
        w[f"finetune {run.name}"] = steps * tokens * attention + 1
        if not run.cost_only:
            windows = sum(n / min(config.eval_stride, n - 1) for n in config.lengths)  # tokens per scored token
            w[f"evaluate {run.name}"] = config.test_docs * config.test_tokens * windows / 3 + 1
    for name in RULER_RUNS:  # prompts of every length, answers of up to 128 tokens, each a forward pass
        w[f"ruler {name}"] = len(RULER_TASKS) * config.ruler_samples * sum(n + 128 * n / 4 for n in config.lengths)
    return w


def _ruler(stages: Stages, config: SimConfig, folder: Path, stem: Path) -> dict:
    """RULER's subset on one run: {task: {length: score}} at the lengths each task's template fits."""
    outputs = {task: stem.with_name(f"{stem.name}.{task}.json") for task in RULER_TASKS}

    def do_ruler():
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(folder)
        for task, output in outputs.items():
            lengths = ruler_lengths(tokenizer, task, config.lengths)
            if lengths:
                evaluate_ruler(folder, task, lengths, config.ruler_samples, config.seed, output)
            else:
                output.write_text(json.dumps({"results": []}) + "\n")

    stages.run(f"ruler {folder.name}", lambda: all(p.is_file() for p in outputs.values()), do_ruler)
    return {task: {str(r["length"]): r["score"] for r in json.loads(p.read_text())["results"]}
            for task, p in outputs.items()}


def main(argv=None) -> int:
    t0 = time.perf_counter()
    try:
        config = parse_config(argv)
    except ValueError as error:
        print(f"pose_mlx.sim: error: {error}", file=sys.stderr)
        return 2
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = grid_runs(config.factor)
    stages = Stages(_weights(config, runs))
    data, cache = out / "corpus", out / "cache"

    stages.run("corpus", lambda: (data / "corpus.json").is_file(), lambda: corpus_mod.build_corpus(
        data, config.corpus, config.corpus_chars, config.test_docs, config.test_tokens, config.val_fraction,
        config.vocab, config.seed, corpus_mod.resolve_prose(config.prose, config.corpus)))
    tokenizer = corpus_mod._hf_tokenizer(data / "tokenizer")
    model = out / "pretrained"

    def do_pretrain():
        pretrain(model, data / "tokenizer", data / "train", data / "val", cache,
                 retrieval_fraction=config.retrieval_fraction, window=config.window, base=config.base,
                 hidden=config.hidden, layers=config.layers, heads=config.heads, ffn=config.ffn,
                 steps=config.pretrain_steps, batch=config.pretrain_batch, lr=config.pretrain_lr, seed=config.seed)

    stages.run("pretrain", lambda: (model / "pretrain.json").is_file(), do_pretrain)
    gates_json = out / "gates.json"

    def do_gates():
        record = gates.measure(model, data / "train", data / "test", cache, config.window, config.seed,
                               out / "eval" / "base.passkey-gate.json")
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
    for run in runs:
        folder = out / "runs" / run.name
        args = finetune_args(run, model, data / "train", cache, folder, window=config.window, factor=config.factor,
                             steps=config.steps, cost_steps=config.cost_steps, full_batch=config.full_batch,
                             lr=config.lr, seed=config.seed)
        stages.run(f"finetune {run.name}", lambda: (folder / "config.json").is_file(), lambda: run_finetune(args))
        ppl_json = passkey_json = None
        if not run.cost_only:
            ppl_json, passkey_json = out / "eval" / f"{run.name}.ppl.json", out / "eval" / f"{run.name}.passkey.json"

            def do_eval():
                evaluate_perplexity(folder, data / "test", config.lengths, config.test_docs, config.eval_stride,
                                    ppl_json)
                if passkey_lengths:
                    evaluate_passkey(folder, passkey_lengths, config.passkey_trials, config.seed, passkey_json)

            stages.run(f"evaluate {run.name}", lambda: ppl_json.is_file() and (
                not passkey_lengths or passkey_json.is_file()), do_eval)
        entry = collect(run, folder, ppl_json, passkey_json)
        if not run.cost_only:
            results["runs"][run.name] = entry
        else:
            results["cost_vs_target"][run.sampler][str(run.factor * config.window)] = entry["cost"]

    results["ruler"] = {}
    for name in (n for n in RULER_RUNS if n in results["runs"]):
        results["ruler"][name] = _ruler(stages, config, out / "runs" / name, out / "eval" / f"{name}.ruler")
    results["claims"] = check_claims(results)
    results["wall_seconds"] = time.perf_counter() - t0
    pngs = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = write_report(results, out, pngs)
    held = {True: "held", False: "did not hold", None: "not evaluated"}
    for claim in results["claims"]:
        print(f"claim ({claim['id']}): {held[claim['held']]} — {claim['detail']}")
    print(f"wrote {report}, {out / 'results.json'} and {len(pngs)} PNGs ({results['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
