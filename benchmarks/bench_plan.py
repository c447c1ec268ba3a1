"""The memory planner (`pose_mlx.memory`, `python -m pose_mlx.plan`) against real runs, and what fits for Llama-2.

1. Training: each configuration is a real `python -m pose_mlx.finetune ... --steps 3` in its own process (peaks do
   not mix) on toy llamas of ~2M, ~10M and ~30M parameters (`pose_mlx.toy.make_model_folder`) and Python's
   reST documentation as text; measured = the largest `peak_memory_gb` in the exported train_log.jsonl,
   predicted = the planner given the same flags (`pose_mlx.plan.planned_run`). Target: error <= 10% on
   all but one configuration and <= 25% on all.
2. Evaluation: `python -m pose_mlx.perplexity` and `python -m pose_mlx.passkey` on the ~10M model, measured as
   `mx.get_peak_memory()` when the command returns, against `pose_mlx.memory.eval_memory` at the longest length.
3. A table computed by the planner alone: Llama-2-7B and -13B (their config.json values, below) extended from 4k
   to 32k, PoSE (a 4k window) and full-length fine-tuning, LoRA or full, checkpointing on/off, fp16 or 4-bit base,
   on Metal (a Mac: the planner's GPU terms) against machines of 16/32/64/128 GB (usable: 75% of it, about
   Metal's default recommended working set), and the same on MLX's CPU backend (docs/results.md quotes it).

Besides the float32 toys, the runs cover 16-bit bases (the 2M toy's weights stored as bfloat16 and as float16)
and a real GGUF file (SmolLM2-135M-Instruct, Q4_1, which the loader dequantizes to float32 on the CPU), when it
is in ~/.cache/pose_mlx/models. `--merge` runs only `--runs` and merges them into the existing results (the
other rows, still valid, are kept; the Llama-2 table is recomputed).

Writes benchmarks/results/plan.json (with both tables as Markdown) and benchmarks/results/plan.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, ROOT, write_between, write_results
from pose_mlx import memory
from pose_mlx import plan as planner
from pose_mlx.eval.passkey import MAX_NEW_TOKENS

DATA = "/usr/share/doc/python3.11/html/_sources"
MODELS = {  # name -> make_model_folder arguments
    "2M": dict(hidden_size=192, num_layers=4, num_heads=4, intermediate_size=512, vocab_size=512),
    "10M": dict(hidden_size=320, num_layers=8, num_heads=5, intermediate_size=864, vocab_size=2048),
    "30M": dict(hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=4, intermediate_size=1376, vocab_size=512),
}
CAST = {"2M-bf16": ("2M", "bfloat16"), "2M-fp16": ("2M", "float16")}  # the 2M toy's weights stored 16-bit
GGUF = {"SmolLM2-Q4_1": Path("~/.cache/pose_mlx/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()}
# (model, window, target, method, batch, full fine-tuning, gradient checkpointing, compiled, extra flags)
RUNS = [
    ("2M", 256, 1024, "pose", 1, False, False, False, []),
    ("2M", 512, 2048, "pose", 4, True, False, True, []),
    ("2M", 1024, 4096, "pose", 2, False, True, True, []),
    ("2M", 256, 1024, "full", 2, False, False, False, []),
    ("10M", 256, 1024, "pose", 8, False, False, True, []),
    ("10M", 512, 2048, "pose", 2, True, True, False, []),
    ("10M", 1024, 4096, "pose", 1, False, True, False, []),
    ("10M", 256, 1024, "full", 1, True, False, True, []),
    ("10M", 512, 2048, "pose", 4, False, False, False, ["--lora-layers", "4"]),
    ("30M", 256, 1024, "pose", 1, True, False, True, []),
    ("30M", 512, 2048, "pose", 4, False, False, True, []),
    ("30M", 1024, 4096, "pose", 2, False, True, True, []),
    ("30M", 512, 2048, "pose", 2, True, False, False, []),
    ("30M", 512, 2048, "full", 1, False, True, True, []),
    ("2M-bf16", 256, 1024, "pose", 1, False, False, False, []),
    ("2M-bf16", 256, 1024, "pose", 2, True, False, True, []),
    ("2M-fp16", 512, 2048, "pose", 1, False, True, True, []),
    ("SmolLM2-Q4_1", 1024, 16384, "pose", 1, False, False, True, ["--schedule", "yarn", "--lora-rank", "16"]),
    ("2M-bf16", 1024, 4096, "pose", 2, False, True, True, []),  # 16-bit checkpointed LoRA, compiled and eager
    ("2M-fp16", 256, 1024, "pose", 4, False, True, True, []),
    ("2M-bf16", 512, 2048, "full", 1, False, True, True, []),
    ("2M-fp16", 512, 2048, "pose", 1, False, True, False, []),
]

LLAMA2 = {  # the config.json values of meta-llama/Llama-2-7b-hf and Llama-2-13b-hf that decide memory
    "Llama-2-7B": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float16"},
    "Llama-2-13B": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
                    "num_hidden_layers": 40, "num_key_value_heads": 40, "vocab_size": 32000,
                    "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float16"},
}
MACHINES_GB = (16, 32, 64, 128)
USABLE = 0.75


def build_models(workdir: Path, needed: set) -> dict:
    """The model folders (or GGUF files) of the names in `needed`, built in `workdir` unless already there."""
    from pose_mlx import toy

    folders = {}
    texts = None
    needed = set(needed) | {CAST[n][0] for n in needed if n in CAST}
    for name, kwargs in MODELS.items():
        if name not in needed:
            continue
        folder = workdir / f"toy-{name}"
        if not (folder / "config.json").is_file():
            if kwargs["vocab_size"] > 512 and texts is None:
                texts = toy.stdlib_texts(max_chars=3_000_000)
            small = workdir / "toy-2M"
            if kwargs["vocab_size"] == 512 and name != "2M" and small.is_dir():
                toy.make_model_folder(folder, tokenizer_from=small, max_position_embeddings=4096,
                                      **{k: v for k, v in kwargs.items() if k != "vocab_size"})
            else:
                toy.make_model_folder(folder, texts=texts if kwargs["vocab_size"] > 512 else None,
                                      max_position_embeddings=4096, **kwargs)
        folders[name] = folder
    for name, (base, dtype) in CAST.items():
        if name not in needed:
            continue
        folder = workdir / f"toy-{name}"
        if not (folder / "config.json").is_file():
            cast_folder(folders[base], folder, dtype)
        folders[name] = folder
    folders.update({name: path for name, path in GGUF.items() if path.is_file()})
    return folders


def cast_folder(source: Path, folder: Path, dtype: str) -> None:
    """A copy of the model folder `source` with its weights stored as `dtype` (and said so in config.json)."""
    import shutil

    import mlx.core as mx

    shutil.copytree(source, folder)
    for path in folder.glob("*.safetensors"):
        weights = mx.load(str(path))
        mx.save_safetensors(str(path), {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()},
                            metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=1))


def finetune_flags(folder: Path, run, workdir: Path, index: int) -> list[str]:
    name, window, target, method, batch, full, checkpoint, compiled, extra = run
    flags = ["--model", str(folder), "--original", str(window), "--window", str(window), "--target", str(target),
             "--sampler", method, "--batch-size", str(batch), "--steps", "3", "--warmup", "1", "--save-every", "0",
             "--data", DATA, "--cache-dir", str(workdir / "tokens"), "--output", str(workdir / f"run-{index}"),
             "--overwrite", "--no-progress", "--full" if full else "--lora"]
    if checkpoint:
        flags.append("--grad-checkpoint")
    if not compiled:
        flags.append("--no-compile")
    return flags + list(extra)


def predict(flags: list[str]) -> memory.Estimate:
    _s, ref, config, settings = planner.planned_run(flags)
    return memory.training_memory(memory.loaded_architecture(config, ref, settings.backend), settings)


def measure_training(flags: list[str], workdir: Path, index: int) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pose_mlx.finetune", *flags], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"finetune failed ({proc.returncode}): {proc.stderr[-2000:]}")
    log = workdir / f"run-{index}" / "train_log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {"measured_bytes": int(max(r["peak_memory_gb"] for r in records) * 2**30),
            "step_peaks_gb": [round(r["peak_memory_gb"], 4) for r in records],
            "seconds": round(time.perf_counter() - start, 1)}


_PEAK_WRAPPER = ("import sys, runpy, mlx.core as mx\n"
                 "sys.argv = sys.argv[1:]\n"
                 "try:\n    runpy.run_module(sys.argv[0], run_name='__main__')\n"
                 "except SystemExit as e:\n    assert not e.code, e.code\n"
                 "print('PEAK', mx.get_peak_memory(), file=sys.stderr)\n")


def measure_eval(command: str, folder: Path, length: int, chunk: int, workdir: Path) -> dict:
    flags = ["--model", str(folder), "--lengths", str(length), "--chunk", str(chunk), "--no-progress"]
    if command == "perplexity":
        flags += ["--data", DATA, "--docs", "2", "--stride", str(length)]
    else:
        flags += ["--trials", "2"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", "import pose_mlx\n" + _PEAK_WRAPPER, f"pose_mlx.{command}", *flags],
                          capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode:
        raise RuntimeError(f"{command} failed: {proc.stderr[-2000:]}")
    peak = int(proc.stderr.rsplit("PEAK", 1)[1].split()[0])
    config = json.loads((folder / "config.json").read_text())
    if command == "perplexity":
        predicted = memory.eval_memory(config, length, chunk).peak
    else:  # what passkey holds: the prompt and its answer in the cache, the last position's logits
        predicted = memory.eval_memory(config, length + MAX_NEW_TOKENS, chunk, all_logits=False).peak
    return {"command": command, "length": length, "chunk": chunk, "measured_bytes": peak, "predicted_bytes": predicted,
            "error": predicted / peak - 1}


def evaluation_check(folders: dict) -> list[dict]:
    """perplexity and passkey on the 10M model at 2048 (chunk 512) and 4096 tokens (chunk 256)."""
    evals = []
    for command in ("perplexity", "passkey"):
        for length, chunk in ((2048, 512), (4096, 256)):
            evals.append(measure_eval(command, folders["10M"], length, chunk, folders["10M"].parent))
            print(evals[-1], flush=True)
    return evals


def training_row(run, estimate: memory.Estimate, measured: dict, params: int) -> dict:
    name, window, target, method, batch, full, checkpoint, compiled, extra = run
    return {"model": name, "parameters": params, "window": window, "target": target, "sampler": method,
            "batch": batch, "training": "full" if full else "lora", "grad_checkpoint": checkpoint,
            "compiled": compiled, "extra_flags": extra, "predicted_bytes": estimate.peak, "phase": estimate.phase,
            "breakdown": estimate.breakdown, **measured, "error": estimate.peak / measured["measured_bytes"] - 1}


def llama2_table(backend: str = "metal") -> list[dict]:
    """Predicted peaks of extending Llama-2 from 4k to 32k on `backend` ("metal": a Mac; "cpu": MLX's CPU
    backend): PoSE trains on a 4096 window, full-length on 32k."""
    rows = []
    for model, config in LLAMA2.items():
        for sampler, window in (("PoSE (4k window)", 4096), ("full-length 32k", 32768)):
            for quant in ("fp16", "4-bit"):
                for training in ("LoRA", "full"):
                    if quant == "4-bit" and training == "full":
                        continue
                    for checkpoint in (False, True):
                        cfg = dict(config)
                        if quant == "4-bit":
                            cfg["quantization"] = {"group_size": 64, "bits": 4}
                        settings = memory.TrainSettings(window=window, target=32768, lora=training == "LoRA",
                                                        grad_checkpoint=checkpoint, sampler="pose", backend=backend)
                        est = memory.training_memory(cfg, settings)
                        rows.append({"model": model, "sampler": sampler, "base": quant, "training": training,
                                     "grad_checkpoint": checkpoint, "peak_bytes": est.peak, "phase": est.phase,
                                     "fits": {f"{gb}GB": est.peak <= USABLE * gb * 2**30 for gb in MACHINES_GB}})
    return rows


def markdown_training(rows: list[dict]) -> str:
    lines = ["| model | sampler (window -> target) | batch | training | checkpointing | compiled | predicted | "
             "measured | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sampler = (f"PoSE {r['window']} -> {r['target']}" if r["sampler"] == "pose"
                   else f"full-length {r['target']}")
        training = r["training"] + (" (" + " ".join(r["extra_flags"]) + ")" if r["extra_flags"] else "")
        lines.append(f"| {r['model']} | {sampler} | {r['batch']} | {training} | {'on' if r['grad_checkpoint'] else 'off'}"
                     f" | {'yes' if r['compiled'] else 'no'} | {memory.format_size(r['predicted_bytes'])} | "
                     f"{memory.format_size(r['measured_bytes'])} | {r['error'] * 100:+.1f}% |")
    return "\n".join(lines)


def markdown_llama(rows: list[dict]) -> str:
    head = " | ".join(f"{gb} GB" for gb in MACHINES_GB)
    lines = [f"| model | sampler | base | training | checkpointing | predicted peak | {head} |",
             "|---|---|---|---|---|---|" + "---|" * len(MACHINES_GB)]
    for r in rows:
        fits = " | ".join("yes" if r["fits"][f"{gb}GB"] else "no" for gb in MACHINES_GB)
        lines.append(f"| {r['model']} | {r['sampler']} | {r['base']} | {r['training']} | "
                     f"{'on' if r['grad_checkpoint'] else 'off'} | {memory.format_size(r['peak_bytes'])} | {fits} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=None, help="where model folders, token caches and runs go "
                                                        "(default: a temporary folder)")
    parser.add_argument("--runs", default=None, help="comma-separated indices of RUNS to run (default: all)")
    parser.add_argument("--skip-eval", action="store_true", help="skip the evaluation check")
    parser.add_argument("--eval-only", action="store_true",
                        help="run only the evaluation check and update it in the existing results JSON")
    parser.add_argument("--merge", action="store_true",
                        help="merge the --runs into the existing results JSON instead of replacing it")
    parser.add_argument("--tables-only", action="store_true",
                        help="measure nothing: the Llama-2 tables again from today's planner, in the results JSON "
                             "and the docs")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.tables_only:
        return write_tables(Path(args.output) if args.output else RESULTS_DIR / "plan.json")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-plan-"))
    workdir.mkdir(parents=True, exist_ok=True)
    indices = [int(i) for i in args.runs.split(",")] if args.runs else range(len(RUNS))
    needed = {RUNS[i][0] for i in indices} | (set() if args.skip_eval or args.merge else {"10M"})
    folders = build_models(workdir, {"10M"} if args.eval_only else needed)
    if args.eval_only:
        path = Path(args.output) if args.output else RESULTS_DIR / "plan.json"
        results = json.loads(path.read_text())
        results["evaluation"] = evaluation_check(folders)
        results["summary"]["eval_max_abs_error"] = max(abs(e["error"]) for e in results["evaluation"])
        write_results("plan", results, path)
        print(json.dumps(results["summary"]), f"\nupdated the evaluation check in {path}")
        return
    params = {name: memory.architecture(planner.source.read_config(planner.source.resolve(str(f))))
              .parameter_counts()["total"] for name, f in folders.items()}
    print("models:", {k: f"{v / 1e6:.1f}M" for k, v in params.items()}, flush=True)
    indices = [i for i in indices if RUNS[i][0] in folders]  # a GGUF file that is not here is left out
    rows = []
    for i in indices:
        run = RUNS[i]
        flags = finetune_flags(folders[run[0]], run, workdir, i)
        estimate = predict(flags)  # the prediction comes first, from the flags and config.json alone
        row = training_row(run, estimate, measure_training(flags, workdir, i), params[run[0]])
        rows.append(row)
        print(f"[{i}] {run[0]} {row['sampler']} W{row['window']} B{row['batch']} {row['training']} "
              f"gc={row['grad_checkpoint']} compiled={row['compiled']}: predicted "
              f"{memory.format_size(row['predicted_bytes'])} ({row['phase']}), measured "
              f"{memory.format_size(row['measured_bytes'])}, error {row['error'] * 100:+.1f}% ({row['seconds']} s)",
              flush=True)
    path = Path(args.output) if args.output else RESULTS_DIR / "plan.json"
    previous = json.loads(path.read_text()) if args.merge else {}
    if args.merge:
        key = lambda r: (r["model"], r["window"], r["target"], r["sampler"], r["batch"], r["training"],  # noqa: E731
                         r["grad_checkpoint"], r["compiled"], tuple(r["extra_flags"]))
        new = {key(r) for r in rows}
        rows = [r for r in previous["training"] if key(r) not in new] + rows
    evals = previous.get("evaluation", []) if args.merge or args.skip_eval else evaluation_check(folders)
    errors = [abs(r["error"]) for r in rows]
    llama, llama_cpu = llama2_table(), llama2_table("cpu")
    summary = {
        "runs": len(rows), "within_10pct": sum(e <= 0.10 for e in errors), "within_25pct": sum(e <= 0.25 for e in errors),
        "max_abs_error": max(errors) if errors else None,
        "target_met": bool(errors) and sum(e > 0.10 for e in errors) <= 1 and max(errors) <= 0.25,
        "eval_max_abs_error": max((abs(e["error"]) for e in evals), default=None),
    }
    results = {
        "description": __doc__.split("\n")[0], "data": DATA,
        "models": {**previous.get("models", {}), **{k: {**MODELS.get(k, {}), **({"cast_from": CAST[k][0], "dtype": CAST[k][1]} if k in CAST else {}),
                       **({"gguf": GGUF[k].name} if k in GGUF else {}), "parameters": params[k]} for k in params}},
        "training": rows, "evaluation": evals, "summary": summary, "llama2": llama, "llama2_cpu": llama_cpu, "llama2_configs": LLAMA2,
        "usable_fraction": USABLE,
    }
    path = write_results("plan", results, args.output)
    print(json.dumps(summary))
    write_tables(path)


def write_tables(path: Path) -> None:
    """The Llama-2 tables from today's planner: into the record at `path`, its .md beside it, and (for the
    repository's own record) docs/memory.md (Metal) and docs/results.md (CPU) between their markers."""
    results = json.loads(path.read_text())
    results["llama2"], results["llama2_cpu"] = llama2_table(), llama2_table("cpu")
    metal, cpu = markdown_llama(results["llama2"]), markdown_llama(results["llama2_cpu"])
    results["markdown"] = ("## Predicted vs measured peak memory of `python -m pose_mlx.finetune --steps 3`\n\n"
                           + markdown_training(results["training"]) + "\n\n## What fits on a Mac: Llama-2 extended "
                           f"from 4k to 32k (Metal; usable memory = {USABLE:.0%} of the machine's)\n\n" + metal
                           + "\n\n## The same on MLX's CPU backend\n\n" + cpu + "\n")
    write_results("plan", results, path)
    path.with_suffix(".md").write_text(results["markdown"])
    if path.resolve() == (RESULTS_DIR / "plan.json").resolve():
        write_between(ROOT / "docs" / "memory.md", "llama2-metal", metal)
        write_between(ROOT / "docs" / "results.md", "llama2-cpu", cpu)
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
