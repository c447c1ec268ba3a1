"""Numbers that the README and docs/ quote from a committed record, checked against it: each claim is a sentence
template filled from the record, and the filled sentence must appear in the file (line breaks and runs of spaces
count as one space). A result that changes, or prose edited away from its record, fails here."""

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "benchmarks" / "results" / "real_model" / "results.json"


def _real() -> dict:
    return json.loads(REAL.read_text())


def count(run: str, length: int, results: dict | None = None) -> str:
    """A run's passkey as "k/n" at `length` (its confirmation numbers)."""
    r = (results or _real())["runs"][run]
    n = r["passkey_trials"][str(length)]
    return f"{round(r['passkey'][str(length)] * n)}/{n}"


def ppl(run: str, length: int) -> str:
    return f"{_real()['runs'][run]['ppl'][str(length)]:.2f}"


def tau(key: str, ablation: str | None = None) -> str:
    record = _real()["sim_agreement"]["grid"]
    return f"{(record['ablations'][ablation] if ablation else record)[key]:.2f}"


#: The rows of docs/simulator.md's 8x table: its label, the map's method.
MAP_ROWS = (("PoSE + YaRN (`pose-yarn`)", "pose-yarn"), ("YaRN, no training", "yarn"),
            ("full-length + YaRN", "full-yarn"), ("ordinary fine-tune, YaRN at load", "adapt-yarn"),
            ("dynamic NTK, no training", "dynamic"), ("ordinary fine-tune, dynamic NTK at load", "adapt-dynamic"))


#: (file, sentence with {} fields, the fields' values from the record)
CLAIMS = [
    ("docs/simulator.md",
     "Without both dynamic methods the other eight agree at {} on passkey and {} on perplexity",
     lambda: [tau("passkey_tau", "without dynamic, adapt-dynamic"), tau("ppl_tau", "without dynamic, adapt-dynamic")]),
    ("docs/simulator.md", "Kendall's tau is {} on perplexity at the target and {} on passkey",
     lambda: [tau("ppl_tau"), tau("passkey_tau")]),
    ("docs/evidence.md",
     "retrieves the passkey in {} trials at 16k (dynamic NTK and the screening's winner {}) and in {} at 32k",
     lambda: [count("adapt-dynamic", 16384), count("dynamic", 16384), count("adapt-dynamic", 32768)]),
    ("docs/evidence.md", "short context kept ({} at 4k, and {} at 8k where the base finds {})",
     lambda: [count("pose-yarn-lr3e-5", 4096), count("pose-yarn-lr3e-5", 8192), count("none", 8192)]),
    ("docs/evidence.md", "a 32k perplexity far below dynamic NTK's ({} against {})",
     lambda: [ppl("pose-yarn-lr3e-5", 32768), ppl("dynamic", 32768)]),
    ("docs/evidence.md", "ordinary fine-tuning with YaRN applied at load reaches {}",
     lambda: [ppl("adapt-yarn", 32768)]),
    ("docs/evidence.md", "(Kendall's tau {} on perplexity, {} on passkey; goal 0.7)",
     lambda: [tau("ppl_tau"), tau("passkey_tau")]),
    ("README.md", "the fine-tuning costs {:.0f} CPU-seconds, the 16k passkey trial {:.0f} and the question about the "
     "manual {:.0f} (wall times {:.0f} s, {:.0f} s and {:.0f} s",
     lambda: [*(_quickstart()[k]["cpu_s"] for k in ("finetune", "passkey", "generate")),
              *(_quickstart()[k]["wall_s"] for k in ("finetune", "passkey", "generate"))]),
    ("README.md", "It had a {:,}-token prompt and an answer of {} tokens: its first sentence named the document "
     "(\"{}\")", lambda: [_quickstart_record()["prompt_tokens"], _quickstart_record()["answer_tokens"],
                         _quickstart_record()["answer"].splitlines()[0]]),
    ("README.md", "The test suite's {:,} tests took {:,.0f} CPU-seconds on a 2-core Linux VM ({:.0f} minutes of wall "
     "time",
     lambda: [_record("test_suite")["tests"]["passed"], _record("test_suite")["cpu_s"],
              _record("test_suite")["wall_s"] / 60]),
    ("docs/testing.md", "its {:,} tests took {:,.0f} CPU-seconds on a 2-core Linux VM ({:.0f} minutes of wall "
     "time",
     lambda: [_record("test_suite")["tests"]["passed"], _record("test_suite")["cpu_s"],
              _record("test_suite")["wall_s"] / 60]),
    ("docs/evaluation.md", "said `{}`, and took {:.0f} s of wall time in all",
     lambda: [_quickstart_record()["passkey_estimate"], _quickstart()["passkey"]["wall_s"]]),
    ("docs/evidence.md", "first of the addendum's runs on both passkey ({:.2f}, against YaRN's {:.2f}) and perplexity "
     "({:.2f}, against {:.2f})",
     lambda: [_map8("pose-yarn", "passkey"), _map8("yarn", "passkey"), _map8("pose-yarn", "ppl"), _map8("yarn", "ppl")]),
    *[("docs/simulator.md", f"| {label} | {{:.2f}} | {{:.2f}} |",
       lambda m=m: [_map8(m, "passkey"), _map8(m, "ppl")]) for label, m in MAP_ROWS],
    ("docs/benchmarks.md", "full fine-tuning **{:.2f}x** (rounds {:.3f}-{:.3f}; CPU time {:.3f}x), LoRA **{:.2f}x** "
     "(rounds {:.3f}-{:.3f}; CPU time {:.3f}x)", lambda: [*_vs("full"), *_vs("lora")]),
    ("docs/benchmarks.md", "training the embedding {:.1f}%, PoSE position ids vs `fast.rope` {:.1f}% (the ids' cos/sin cost "
     "less), gradient clipping {:.1f}%, AdamW vs Adam {:.1f}%",
     lambda: [100 * _vs_share(k) for k in ("training the embedding and final norm (grad all - grad blocks)",
                                           "PoSE position ids vs mx.fast.rope (grad pose - grad contiguous)",
                                           "gradient clipping (apply clip+AdamW - apply AdamW)",
                                           "AdamW with decay 0 vs Adam")]),
    ("docs/benchmarks.md", "at a load average of {:.1f}",
     lambda: [json.loads((ROOT / "benchmarks" / "results" / "vs_mlx_lm.json").read_text())["load_average_1min"]]),
    ("docs/simulator.md", "retrieves as well at 2x ({:.2f} against PoSE + YaRN's {:.2f}) and ties at 4x ({:.2f} each)",
     lambda: [_map(2, "yarn", "passkey"), _map(2, "pose-yarn", "passkey"), _tie(4, "yarn", "pose-yarn")]),
    ("docs/simulator.md", "PoSE + YaRN leads at 8x ({:.2f} against {:.2f}) and at 16x ({:.2f} against {:.2f})",
     lambda: [_map(f, m, "passkey") for f in (8, 16) for m in ("pose-yarn", "yarn")]),
    ("docs/simulator.md", "perplexity rises from {:.2f} to {:.2f}, PoSE + YaRN's from {:.2f} to {:.2f}",
     lambda: [_map(f, m, "ppl") for m in ("yarn", "pose-yarn") for f in (2, 16)]),
    ("docs/simulator.md", "retrieves less than PoSE + YaRN ({:.2f} at 8x, {:.2f} at 16x)",
     lambda: [_map(f, "full-yarn", "passkey") for f in (8, 16)]),
    ("docs/simulator.md", "retrieve in at most {:.2f} of their trials at any factor",
     lambda: [max(_map(f, m, "passkey") for f in (2, 4, 8, 16) for m in ("dynamic", "adapt-dynamic"))]),
    ("docs/simulator.md", "Kendall's tau is {:.2f} on perplexity and {:.2f} on passkey, against a goal of 0.7: at 4x",
     lambda: [_agree4("ppl_tau"), _agree4("passkey_tau")]),
    ("docs/simulator.md", "dynamic NTK finds the passkey in {:.2f} of its trials at 4x, the real model's in {:.2f}",
     lambda: [_agree4("sim", "passkey", "dynamic"), _agree4("real", "passkey", "dynamic")]),
    ("docs/simulator.md", "the ordinary fine-tune with YaRN at load first ({:.2f}), the map {}",
     lambda: [_agree4("real", "ppl", "adapt-yarn"), _rank4("adapt-yarn")]),
    ("docs/evaluation.md", "A SmolLM2-135M-shaped prefill is {:.1f}x and {:.1f}x faster at 2k and 8k tokens",
     lambda: [r["speedup_fast"] for r in _record("cpu_attention")["results"]]),
    ("docs/evaluation.md", "loaded the machine to a load average of {:.0f})",
     lambda: [_record("cpu_attention")["load_average_1min"]]),
    ("docs/evaluation.md", "Alone on the machine, 8k tokens take {:.1f} s against {:.1f} s ({:.1f}x)",
     lambda: [_record("cpu_attention_8k_idle")["results"][0][k]["seconds"] for k in ("fast", "mlx")]
     + [_record("cpu_attention_8k_idle")["results"][0]["speedup_fast"]]),
    ("docs/usage.md", "{:.1f}x-{:.1f}x faster at 2k-8k tokens on a busy machine; alone on it, 8k tokens take {:.0f} s "
     "instead of {:.0f} s", lambda: [r["speedup_fast"] for r in _record("cpu_attention")["results"]]
     + [_record("cpu_attention_8k_idle")["results"][0][k]["seconds"] for k in ("fast", "mlx")]),
    ("docs/demo.md", "The whole demo costs {:.0f} CPU-seconds on two cores ({:.0f} s of wall time, "
     "load average {:.1f} before it;",
     lambda: [_quickstart()["demo_fresh"][k] for k in ("cpu_s", "wall_s", "load_before")]),
    ("docs/demo.md", "it reuses its corpus and model and costs {:.0f} ({:.0f} s)",
     lambda: [_quickstart()["demo_reuse"][k] for k in ("cpu_s", "wall_s")]),
    ("README.md", "prints perplexity and passkey tables in {:.0f} CPU-seconds",
     lambda: [_quickstart()["demo_fresh"]["cpu_s"]]),
    ("docs/evidence.md", "PoSE at a 1k and a 2k window peaked at {:.2f} and {:.2f} GB and took {:.0f} and {:.0f} s per "
     "update", lambda: [_cost("pose", w, "peak_bytes") / 1e9 for w in (1024, 2048)]
     + [_cost("pose", w, "seconds_per_update") for w in (1024, 2048)]),
    ("docs/evidence.md", "full-length fine-tuning at 8k peaked at {:.2f} GB and took {:.0f} s per update ({:.0f}x PoSE's "
     "2k update, {:.1f}x its memory), and at 16k and 32k the planner predicts {:.0f} and {:.0f} GB",
     lambda: [_cost("full", 8192, "peak_bytes") / 1e9, _cost("full", 8192, "seconds_per_update"),
              _cost("full", 8192, "seconds_per_update") / _cost("pose", 2048, "seconds_per_update"),
              _cost("full", 8192, "peak_bytes") / _cost("pose", 2048, "peak_bytes"),
              _cost("full", 16384, "predicted_bytes") / 1e9, _cost("full", 32768, "predicted_bytes") / 1e9]),
    ("docs/evidence.md", "Intel Xeon VM: PoSE at 1k and 2k peaked at {:.2f} and {:.2f} GB and took {:.1f} and {:.1f} s per "
     "update; full-length at 8k "
     "peaked at {:.2f} GB and took {:.0f} s ({:.0f}x faster and {:.1f}x smaller than through "
     "MLX's path, and still {:.1f}x PoSE's 2k update, {:.1f}x its memory), and at 16k {:.2f} GB and {:.0f} s. The "
     "planner of that run's code was {:+.0f}% to {:+.0f}% over all four; refitted since to long rows "
     "through the kernels, it is within {:.0f}%",
     lambda: [_cost("pose", w, "peak_bytes", XEON) / 1e9 for w in (1024, 2048)]
     + [_cost("pose", w, "seconds_per_update", XEON) for w in (1024, 2048)]
     + [_cost("full", 8192, "peak_bytes", XEON) / 1e9, _cost("full", 8192, "seconds_per_update", XEON),
        _cost("full", 8192, "seconds_per_update") / _cost("full", 8192, "seconds_per_update", XEON),
        _cost("full", 8192, "peak_bytes") / _cost("full", 8192, "peak_bytes", XEON),
        _cost("full", 8192, "seconds_per_update", XEON) / _cost("pose", 2048, "seconds_per_update", XEON),
        _cost("full", 8192, "peak_bytes", XEON) / _cost("pose", 2048, "peak_bytes", XEON),
        _cost("full", 16384, "peak_bytes", XEON) / 1e9, _cost("full", 16384, "seconds_per_update", XEON),
        min(_err(m, w, XEON) for m, w in XEON_ROWS), max(_err(m, w, XEON) for m, w in XEON_ROWS),
        math.ceil(max(abs(100 * _long_real(m, w, "intel")["error"]) for m, w in XEON_ROWS))]),
    ("docs/evidence.md", "were {:.0f}% and {:.0f}% high for PoSE but {:.0f}% low for full-length at 8k",
     lambda: [_err("pose", 1024), _err("pose", 2048), -_err("full", 8192)]),
    ("docs/memory.md", "predicted {:+.1f}% and {:+.1f}%, and full-length at 8k, {:+.1f}%.",
     lambda: [_err("pose", 1024), _err("pose", 2048), _err("full", 8192)]),
    ("docs/evidence.md", "refitted on long rows since, it predicts {:.0f}% and {:.0f}% high and {:.0f}% low, and {:.0f} "
     "and {:.0f} GB at 16k and 32k",
     lambda: [100 * _long_real("pose", 1024, "amd")["error"], 100 * _long_real("pose", 2048, "amd")["error"],
              -100 * _long_real("full", 8192, "amd")["error"]]
     + [r["predicted_bytes"] / 1e9 for r in _long_rows()["real_model_unmeasured"]]),
    ("docs/results.md", "(75% of 32 GB) prints the {} peak, \"{}\", and among its changes the 4-bit base at {};",
     lambda: [_llama("cpu", "Llama-2-7B", "PoSE", "fp16"), "fits" if _smallest("cpu", "Llama-2-7B", "fp16") <= 32
              else "does NOT fit", _llama("cpu", "Llama-2-7B", "PoSE", "4-bit")]),
    ("docs/results.md", "predicted at {} for 7B (a {} GB Mac; {} with a 4-bit base, {} GB) and {} for 13B ({} GB; {} "
     "with a 4-bit base, {} GB). Full-length fine-tuning at 32k needs {} even with checkpointing.",
     lambda: [x for m in ("Llama-2-7B", "Llama-2-13B") for b in ("fp16", "4-bit")
              for x in (_llama("metal", m, "PoSE", b), _smallest("metal", m, b))] + [_full_length_tb()]),
    ("docs/memory.md", "PoSE's 4k window with LoRA and checkpointing fits a {} GB Mac for 7B ({} GB with a 4-bit base) "
     "and a {} GB Mac for 13B ({} GB with a 4-bit base); full-length fine-tuning at 32k needs {} even with "
     "checkpointing. On the CPU backend the same runs are predicted lower (7B LoRA with checkpointing: {})",
     lambda: [_smallest("metal", m, b) for m in ("Llama-2-7B", "Llama-2-13B") for b in ("fp16", "4-bit")]
     + [_full_length_tb(), _llama("cpu", "Llama-2-7B", "PoSE", "fp16")]),
    ("docs/evidence.md", "base {:.2f}, dynamic NTK {:.2f} (it scales nothing within the original window), YaRN {:.2f}, "
     "adapt-yarn {:.2f}, adapt-dynamic {:.2f}, PoSE + YaRN {:.2f}. PoSE + YaRN reads short text in a domain it never saw "
     "{:.1f}% worse than the base, where YaRN alone at 8x is {:.1f}% worse.",
     lambda: [_unseen8(n) for n in ("none", "dynamic", "yarn", "adapt-yarn", "adapt-dynamic", "pose-yarn-64k")]
     + [100 * (_unseen8(n) / _unseen8("none") - 1) for n in ("pose-yarn-64k", "yarn")]),
    ("docs/memory.md", "against {} real `--steps 3` runs on other models", lambda: [_plan()["summary"]["runs"]]),
    ("benchmarks/README.md", "the memory planner's predicted peak vs {} real `pose_mlx.finetune --steps 3` runs",
     lambda: [_plan()["summary"]["runs"]]),
    ("benchmarks/README.md", "the planner on long checkpointed LoRA rows: {} full-length `pose_mlx.finetune --steps 3` "
     "runs", lambda: [len(_long_rows()["runs"])]),
    ("docs/memory.md", "{} within 10%, all within {:.1f}%; evaluation (`perplexity`, `passkey` at 2048 and 4096 tokens) "
     "within {:.1f}%.", lambda: [_plan()["summary"]["within_10pct"], 100 * _plan()["summary"]["max_abs_error"],
                                 100 * _plan()["summary"]["eval_max_abs_error"]]),
    ("docs/results.md", "checks the planner against {} real `--steps 3` runs", lambda: [_plan()["summary"]["runs"]]),
    ("docs/results.md", "{} within 10% of the measured peak, all within {:.1f}% ([the table](memory.md)); its evaluations "
     "within {:.1f}%. `benchmarks/bench_plan_long_rows.py` adds {} runs with one full-length row of 2k-16k tokens, "
     "through MLX's own attention and loss and through the CPU kernels: all within {:.1f}%.", lambda: [_plan()["summary"]["within_10pct"], 100 * _plan()["summary"]["max_abs_error"],
                                 100 * _plan()["summary"]["eval_max_abs_error"], len(_long_rows()["runs"]),
                                 100 * max(abs(r["error"]) for r in _long_rows()["runs"])]),
    ("docs/evidence.md", "fine-tuned `pose-yarn-joined` (its adapters are committed) and scored its 32k perplexity, "
     "{},", lambda: [ppl("pose-yarn-joined", 32768)]),
    ("docs/memory.md", "{} finetune runs through MLX's own attention and loss with one full-length row of 2k-8k tokens",
     lambda: [len(_long_runs("mlx"))]),
    ("docs/memory.md", "the planner is within {:.1f}% of every one of these runs, and it predicts the real model's PoSE "
     "1k and 2k records {:+.1f}% and {:+.1f}%, and full-length 8k {:+.1f}%",
     lambda: [100 * max(abs(r["error"]) for r in _long_runs("mlx"))]
     + [100 * _long_real(m, w, "amd")["error"] for m, w in (("pose", 1024), ("pose", 2048), ("full", 8192))]),
    ("docs/memory.md", "`bench_plan_long_rows.py` runs {} of its rows through the kernels", lambda: [len(_long_runs("auto"))]),
    ("docs/memory.md", "With it the planner is within {:.1f}% of every run through the kernels. No count was fitted to "
     "the real model, whose records are the out-of-sample check: the cost curve's rows through the kernels are planned "
     "{:+.1f}% and {:+.1f}% at PoSE 1k and 2k and {:+.1f}% and {:+.1f}% at full-length 8k and 16k, and `bench_cpu_train`'s "
     "full-length 8k and 16k rows {:+.1f}% and {:+.1f}%",
     lambda: [100 * max(abs(r["error"]) for r in _long_runs("auto"))]
     + [100 * _long_real(m, w, "intel")["error"] for m, w in (("pose", 1024), ("pose", 2048), ("full", 8192),
                                                                ("full", 16384))]
     + [100 * _ct(c, "pose_mlx")["plan_error"] for c in ("full-8k", "full-16k")]),
    ("docs/memory.md", "full-length update at 32k rows, which MLX's own path would need about {:.0f} GB for",
     lambda: [_long_rows()["real_model_unmeasured"][1]["predicted_bytes"] / 1e9]),
    ("docs/cpu-training.md", "At 1k rows pose_mlx's update is {:.2f}x `mlx_lm lora`'s, at 2k {:.2f}x.",
     lambda: [_ct("pose-1k")["speedup"], _ct("pose-2k")["speedup"]]),
    ("docs/cpu-training.md", "in this run the matmul peak measured beside the PoSE rows was {:.0f}-{:.0f} GFLOP/s "
     "(`peak_gflops` in the record), and at 1k pose_mlx ran at {:.0f}% of it, mlx-lm at {:.0f}%",
     lambda: [min(_ct(c, t)["peak_gflops"] for c in ("pose-1k", "pose-2k") for t in ("pose_mlx", "mlx_lm")),
              max(_ct(c, t)["peak_gflops"] for c in ("pose-1k", "pose-2k") for t in ("pose_mlx", "mlx_lm")),
              100 * _ct("pose-1k", "pose_mlx")["mfu"], 100 * _ct("pose-1k", "mlx_lm")["mfu"]]),
    ("docs/cpu-training.md", "Full-length at 8k rows, an update takes {:.0f} s and peaks at {:.2f} GiB, against "
     "`mlx_lm lora`'s {:.0f} s and {:.2f} GiB ({:.2f}x); the cost curve measured {:.0f} s and {:.2f} GB on MLX's path",
     lambda: [_ct("full-8k", "pose_mlx")["seconds_per_update"], _ct("full-8k", "pose_mlx")["peak_bytes"] / 2**30,
              _ct("full-8k", "mlx_lm")["seconds_per_update"], _ct("full-8k", "mlx_lm")["peak_bytes"] / 2**30,
              _ct("full-8k")["speedup"], _cost("full", 8192, "seconds_per_update"),
              _cost("full", 8192, "peak_bytes") / 1e9]),
    ("docs/cpu-training.md", "The update ran {:.2f}x faster than MLX's own path in this run. Its matrix products ran at "
     "this BLAS's speed and are {:.0f}% of it: with everything else free, the update would be {:.1f}x MLX's path. "
     "Beside the products, the adapters cost the most ({:.2f} s), then the rest ({:.2f} s), the attention of the 30 "
     "layers ({:.2f} s) and the loss beyond the head's products ({:.2f} s).",
     lambda: _step_parts_claim()),
    ("docs/cpu-training.md", "At 16k rows, which MLX's own path cannot fit in this machine's memory, an update takes "
     "{:.0f} s and peaks at {:.1f} GiB. The planner's peak is beside each row: within {:.0f}% at the PoSE rows, and "
     "{:+.0f}% and {:+.0f}% at the full-length ones",
     lambda: [_ct("full-16k", "pose_mlx")["seconds_per_update"], _ct("full-16k", "pose_mlx")["peak_bytes"] / 2**30,
              math.ceil(100 * max(abs(_ct(c, "pose_mlx")["plan_error"]) for c in ("pose-1k", "pose-2k"))),
              100 * _ct("full-8k", "pose_mlx")["plan_error"], 100 * _ct("full-16k", "pose_mlx")["plan_error"]]),
    ("docs/simulator.md", "PoSE + YaRN took {:.2f} s per update instead of {:.2f} ({:.2f}x) and full-length {:.2f} s instead of "
     "{:.2f} ({:.2f}x), so the map's {} updates take about {:.0f} and {:.0f} s instead of {:.0f} and {:.0f} (the map's "
     "record has {:.0f} and {:.0f} s for these stages",
     lambda: [_cell(c, k) for c in ("pose-yarn-8x", "full-yarn-8x") for k in ("auto", "mlx", "speedup")]
     + [_cell("pose-yarn-8x", "map_updates")]
     + [_cell(c, k, "projected_stage_seconds") for k in ("auto", "mlx") for c in ("pose-yarn-8x", "full-yarn-8x")]
     + [_cell(c, "map_stage_seconds_recorded") for c in ("pose-yarn-8x", "full-yarn-8x")]),
    ("docs/evidence.md", "one full-length update at 16k rows takes {:.0f} s on two CPU cores",
     lambda: [_ct("full-16k", "pose_mlx")["own_seconds_per_update"]]),
    ("README.md", "A PoSE LoRA update of SmolLM2-135M at a 1k window took {:.1f} s there against `mlx_lm lora`'s {:.1f} s "
     "({:.2f}x), and a full-length update at 16k rows peaked at {:.1f} GiB",
     lambda: [_ct("pose-1k", "pose_mlx")["seconds_per_update"], _ct("pose-1k", "mlx_lm")["seconds_per_update"],
              _ct("pose-1k")["speedup"], _ct("full-16k", "pose_mlx")["peak_bytes"] / 2**30]),
    ("docs/evidence.md", "real model's at a Kendall's tau of {:.2f} on perplexity and {:.2f} on passkey (goal 0.7)",
     lambda: [_agree4("ppl_tau"), _agree4("passkey_tau")]),
    ("docs/evidence.md", "(`evidence_full_length.joined_corpus`: {} pieces, {:.2f}M tokens)",
     lambda: [_joined()["pieces"], _joined()["tokens"] / 1e6]),
]


def _llama(backend: str, model: str, sampler: str, base: str) -> str:
    """Today's planner on a Llama-2 table row with LoRA and checkpointing (benchmarks/bench_plan.py), as printed."""
    from benchmarks.bench_plan import llama2_table
    from pose_mlx.memory import format_size

    row = next(r for r in llama2_table(backend) if (r["model"], r["sampler"].split()[0], r["base"], r["training"],
                                                    r["grad_checkpoint"]) == (model, sampler, base, "LoRA", True))
    return format_size(row["peak_bytes"])


def _smallest(backend: str, model: str, base: str) -> int:
    """The smallest machine (GB) of the Llama-2 table that its PoSE LoRA checkpointed row fits."""
    from benchmarks.bench_plan import MACHINES_GB, llama2_table

    row = next(r for r in llama2_table(backend) if (r["model"], r["sampler"].split()[0], r["base"], r["training"],
                                                    r["grad_checkpoint"]) == (model, "PoSE", base, "LoRA", True))
    return min(gb for gb in MACHINES_GB if row["fits"][f"{gb}GB"])


def _full_length_tb() -> str:
    """The range of the Metal table's full-length 32k rows with checkpointing, in TB."""
    from benchmarks.bench_plan import llama2_table

    peaks = [r["peak_bytes"] for r in llama2_table() if r["sampler"].startswith("full") and r["grad_checkpoint"]]
    return f"{min(peaks) / 1e12:.2f}-{max(peaks) / 1e12:.2f} TB"


def _unseen8(run: str) -> float:
    """A run's unseen-domain perplexity at 2k in addendum B (results.json's factor_8x)."""
    return _real()["factor_8x"]["runs"][run]["ppl_unseen"]["2048"]


def _plan() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "plan.json").read_text())


def _long_rows() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "plan_long_rows.json").read_text())


def _long_runs(kernels: str) -> list[dict]:
    return [r for r in _long_rows()["runs"] if r["kernels"] == kernels]


def _long_real(method: str, window: int, device: str) -> dict:
    """The real model's cost-curve record of `method` at `window` on the device whose file name holds `device`."""
    return next(r for r in _long_rows()["real_model"]
                if (r["method"], r["window"]) == (method, window) and device in r["record"])


def _sim_map() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "sim_map" / "results.json").read_text())


def _map(factor: int, method: str, measure: str) -> float:
    return _sim_map()["map"][str(factor)][method][measure]


def _map8(method: str, measure: str) -> float:
    return _map(8, method, measure)


def _tie(factor: int, a: str, b: str) -> float:
    """The two methods' common passkey at a factor (NaN, which no sentence prints, where they differ)."""
    x, y = (round(_map(factor, m, "passkey"), 2) for m in (a, b))
    return x if x == y else float("nan")


def _agree4(*path: str):
    record = _sim_map()["agreement"]["4"]
    for key in path:
        record = record[key]
    return record


def _rank4(method: str) -> str:
    """The method's place in the map's 4x perplexity order among the methods the agreement compares."""
    scores = _agree4("sim", "ppl")
    return ("first", "second", "third", "fourth", "fifth")[sorted(scores, key=scores.get).index(method)]


def _step_parts_claim() -> list:
    """bench_cpu_step_parts' ratios and the parts beside the products, largest first."""
    seconds, derived = _record("cpu_step_parts")["seconds"], _record("cpu_step_parts")["derived"]
    return [derived["speedup_over_mlx_path"], 100 * derived["products_share_of_update"],
            derived["ceiling_over_mlx_path"], derived["adapters"], derived["rest"], seconds["attention"],
            seconds["loss"] - seconds["head products"]]


def _ct(config: str, tool: str | None = None) -> dict:
    """bench_cpu_train's record of a configuration (or of one tool in it)."""
    entry = _record("cpu_train")["configs"][config]
    return entry[tool] if tool else entry


def _cost(method: str, window: int, key: str, device: str = "cpu-amd-epyc") -> float:
    """A cost-curve record's field, from one CPU's file (benchmarks/results/real_model/cost/<device>.json): the AMD
    EPYC's ran through MLX's own attention and loss, the Intel Xeon's through pose_mlx.kernels."""
    path = ROOT / "benchmarks" / "results" / "real_model" / "cost" / f"{device}.json"
    for r in json.loads(path.read_text())["records"]:
        if (r["method"], r["window"]) == (method, window):
            return r[key]
    raise KeyError((method, window))


XEON = "cpu-intel-r-xeon-r-processor"
XEON_ROWS = (("pose", 1024), ("pose", 2048), ("full", 8192), ("full", 16384))


def _err(method: str, window: int, device: str = "cpu-amd-epyc") -> float:
    """The planner's error on a measured peak, in percent (negative: it predicted less than was used)."""
    return 100 * (_cost(method, window, "predicted_bytes", device) / _cost(method, window, "peak_bytes", device) - 1)


def _cell(cell: str, key: str, field: str = "seconds_per_step"):
    """A simulator map cell's cost before and after the CPU kernels (benchmarks/results/sim_cell_cost.json)."""
    entry = _record("sim_cell_cost")["cells"][cell][key]
    return entry[field] if isinstance(entry, dict) else entry


def _quickstart_record() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "quickstart.json").read_text())


def _quickstart() -> dict:
    return _quickstart_record()["steps"]


def _record(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


def _vs(variant: str) -> list:
    """bench_vs_mlx_lm's ratio (tokens/s), its rounds' extremes and its CPU-time ratio for a variant."""
    record = json.loads((ROOT / "benchmarks" / "results" / "vs_mlx_lm.json").read_text())["variants"][variant]
    rounds = [r["mlx_lm"]["s_per_update"] / r["pose_mlx"]["s_per_update"] for r in record["rounds"]]
    return [record["ratio"], min(rounds), max(rounds), record["ratio_cpu"]]


def _vs_share(part: str) -> float:
    """A part's share of a full update's CPU time in bench_vs_mlx_lm's profile."""
    record = json.loads((ROOT / "benchmarks" / "results" / "vs_mlx_lm.json").read_text())
    return record["profile"]["share_of_update_cpu"][part]


def _joined() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "real_model" / "protocol_full" / "data.json").read_text())


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("path,template,values", CLAIMS, ids=[f"{c[0]}:{c[1][:40]}" for c in CLAIMS])
def test_quoted_numbers_equal_their_record(path, template, values):
    expected = template.format(*values())
    assert expected in _flat((ROOT / path).read_text()), f"{path} should say: {expected}"


def test_no_placeholder_is_left_in_the_docs():
    """Upper-case words joined by hyphens (a draft's placeholder, such as COST-SENTENCE for a sentence to be
    written once its record exists) never ship."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        left = re.findall(r"\b[A-Z]{4,}(?:-[A-Z]{4,})+\b", path.read_text())
        assert not left, f"{path.name}: {left}"


def test_a_stale_number_is_caught():
    """The check itself: a sentence filled from another record does not match."""
    results = _real()
    results["runs"]["adapt-dynamic"]["passkey"]["16384"] = 0.5
    assert count("adapt-dynamic", 16384, results) == "15/30" != count("adapt-dynamic", 16384)


def test_the_quickstart_record_ran_the_readmes_block_as_it_stands():
    """The quick start's timings were of other commands (another document, --max-tokens 64) than the README showed:
    benchmarks/bench_quickstart.py runs the README's block itself, and its record keeps the lines it ran, which
    must be the block of today (edit the block, run the benchmark again)."""
    from benchmarks.bench_quickstart import readme_block

    block = readme_block((ROOT / "README.md").read_text())
    assert _quickstart_record()["block"] == block, "run python -m benchmarks.bench_quickstart"
    assert [line.split()[2] for line in block if line.startswith("python -m pose_mlx.")] == [
        "pose_mlx.finetune", "pose_mlx.passkey", "pose_mlx.generate"] == [
        f"pose_mlx.{name}" for name in _quickstart() if not name.startswith("demo")]


def test_the_readme_results_table_is_generated_from_the_record():
    from experiments.evidence_summary import BEGIN, END, readme_block

    text = (ROOT / "README.md").read_text()
    start, end = text.index(BEGIN.split(" (")[0]), text.index(END) + len(END)
    assert text[start:end] == readme_block(_real()), "run python -m experiments.evidence_summary"


@pytest.mark.parametrize("doc,backend", [("docs/memory.md", "metal"), ("docs/results.md", "cpu")])
def test_the_llama2_tables_are_todays_planner(doc, backend):
    """The Llama-2 what-fits tables are what the planner predicts now (benchmarks/bench_plan.py writes them)."""
    from benchmarks.bench_plan import llama2_table, markdown_llama

    assert markdown_llama(llama2_table(backend)) in (ROOT / doc).read_text(), "run python -m benchmarks.bench_plan"


def test_the_memory_doc_quotes_the_plan_benchmark_table():
    from benchmarks.bench_plan import markdown_training

    rows = json.loads((ROOT / "benchmarks" / "results" / "plan.json").read_text())["training"]
    assert markdown_training(rows) in (ROOT / "docs" / "memory.md").read_text()


def test_the_cpu_training_tables_are_their_records():
    """docs/cpu-training.md's tables are what bench_cpu_kernels, bench_cpu_train and bench_cpu_step_parts write from
    their records."""
    from benchmarks import bench_cpu_kernels, bench_cpu_step_parts, bench_cpu_train

    doc = (ROOT / "docs" / "cpu-training.md").read_text()
    assert bench_cpu_kernels.markdown(_record("cpu_kernels")) in doc
    assert bench_cpu_train.markdown(_record("cpu_train")["configs"]) in doc
    assert bench_cpu_step_parts.markdown(_record("cpu_step_parts")) in doc


LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    """Every relative link of the README and docs/ names a file that exists, and a heading that exists in it."""
    path = ROOT / doc
    broken = []
    for target, anchor in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        linked = (path.parent / target).resolve()
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor[1:] not in _anchors(linked):
            broken.append(target + anchor)
    assert not broken, f"{doc}: {broken}"
