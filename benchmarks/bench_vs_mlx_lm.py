"""Fine-tuning throughput of `python -m pose_mlx.finetune` vs mlx-lm's own trainer (`mlx_lm lora`), side by side.

Both tools run as their real command lines, in child processes, on the same model folder (a random-weight llama
from `pose_mlx.toy.make_model_folder`) and the same mlx-lm data folder (train.jsonl / valid.jsonl of `{"text"}`
records, every document longer than the window), with the same batch (`--batch` rows) and window (`--window`
tokens: `window - 1` targets per row, no padding in either tool), for each variant:

  full         all weights: `pose_mlx --full` (gradient clipping at its default norm 1.0) vs
               `mlx_lm lora --fine-tune-type full --num-layers -1`;
  full-noclip  the same with `pose_mlx --max-grad-norm 1e30`: the clip never acts, so both take mlx-lm's
               unclipped update (the norm is still computed, for the log);
  lora         LoRA rank `--lora-rank`, scale 20, no dropout, in every block of both (mlx-lm's default
               projections, which pose_mlx uses too).

pose_mlx trains with PoSE position ids (`--sampler pose`, target = `--factor` x window), mlx-lm with 0 .. window-1.
AdamW with weight decay 0 (pose_mlx) and Adam (mlx-lm's default) are the same update. mlx-lm's "full" freezes the
embedding and the final norm; pose_mlx's trains them too: the JSON records each tool's trainable parameters.

Timing: every round runs each tool once for `--steps` updates, the tools interleaved (pose_mlx, mlx-lm; the next
round starts with mlx-lm). This script reads each child's output as it comes and stamps the moment each update is
reported (pose_mlx's progress bar, mlx-lm's per-update report line with `--steps-per-report 1`; both print at
the end of every update longer than a tenth of a second, and nothing polls), reading the child's
CPU time (user + system, all its threads, /proc/<pid>/stat) and its threads' voluntary context switches (how often
they went to sleep) at the same moments. An update's time is the time
between the reports of updates n-1 and n, for n = 2 .. steps-1 (the first holds compilation, the last mlx-lm's
final validation): the whole loop's period, measured by one clock outside both tools. Per run the median over those
updates; tokens/s = batch * (window - 1) / that median; the ratio pose_mlx / mlx-lm is taken round by round and its
median reported, for the wall clock and for CPU time (which moves less on a shared machine). Each tool's own
per-update figure (pose_mlx's log.jsonl, mlx-lm's tok/s column) is recorded too. Every child gets
OPENBLAS_NUM_THREADS and MKL_NUM_THREADS = `--threads` (default 1: on a small shared machine a single BLAS thread
gives CPU times that are pure work; 0 leaves the variables alone). One untimed run of each tool first fills the caches.

The BLAS: both children import `pose_mlx` before anything else (it loads OpenBLAS or MKL before `mlx.core`; the
mlx-lm child then calls `mlx_lm.lora.main()`), and each measures an fp32 1024^2 matmul first: its GFLOP/s and the
library loaded are recorded per run (MLX's reference BLAS manages ~7 GFLOP/s here, OpenBLAS ~150+).
Writes benchmarks/results/vs_mlx_lm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (RESULTS_DIR, blas_threads, check_lengths, child_env, make_inputs, own_seconds,
                               periods, run_tool, tool_command, write_results)

VARIANTS = ("full", "full-noclip", "lora")
_TRAINABLE = re.compile(r"Trainable parameters:\s*[\d.]+%\s*\(([\d.]+)M/([\d.]+)M\)")

# ------------------------------------------------------------------------------------------ the profile

PROFILE = "PROFILE "


def profile_worker(args) -> None:
    """Where a full fine-tuning update of pose_mlx spends its CPU time next to mlx-lm's, one part at a time on the
    benchmark's model (loaded from its folder, PoSE-extended as pose_mlx does) and PoSE batches; prints a PROFILE
    line. Parts compared are timed interleaved; CPU seconds (this process, all threads) and wall seconds, medians."""
    import pose_mlx  # noqa: F401
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from pose_mlx import extend, use_positions
    from pose_mlx.model.source import load
    from pose_mlx.training.data import ExampleStream
    from pose_mlx.training.loop import TrainConfig, make_optimizer, make_update, masked_loss
    from benchmarks.common import synthetic_corpus

    config = TrainConfig(steps=1000, lr=1e-5, warmup=1, progress=False)
    vocab = json.loads((Path(args.profile_worker) / "config.json").read_text())["vocab_size"]
    corpus = synthetic_corpus(vocab, docs=16, length=args.window * args.factor)
    stream = ExampleStream(corpus, args.window, args.window * args.factor, batch_size=args.batch, seed=0)
    batches = [stream.next_batch() for _ in range(2)]
    arrays = [tuple(mx.array(a) for a in (b.inputs, b.targets, b.mask, b.positions)) for b in batches]

    def model(trainable="all", positions=True):
        net, _ = load(args.profile_worker)
        extend(net, "linear", args.window, args.window * args.factor)
        if trainable == "all":
            net.unfreeze()
        else:  # what mlx-lm's full fine-tuning trains: the blocks, not the embedding or the final norm
            net.freeze()
            for layer in net.layers:
                layer.unfreeze()
        mx.eval(net.parameters())
        return net

    def gradient_step(trainable, positions):
        net = model(trainable)
        value_and_grad = nn.value_and_grad(net, masked_loss)

        def grads(inputs, targets, mask, ids):
            if not positions:  # contiguous positions through mx.fast.rope, as mlx-lm's model reads them
                return value_and_grad(net, inputs, targets, mask)
            with use_positions(net, ids):
                return value_and_grad(net, inputs, targets, mask)

        grads = mx.compile(grads, inputs=net.state, outputs=net.state)
        return lambda i: mx.eval(grads(*arrays[i % 2]))

    def update_step(fused):
        net = model()
        optimizer = make_optimizer(config)
        if not fused:  # the product's update: two compiled functions
            update = make_update(net, optimizer, config, use_positions)
            it = iter(batches * 10**6)
            return lambda i: update(it)
        value_and_grad = nn.value_and_grad(net, masked_loss)
        optimizer.init(net.trainable_parameters())
        state = [net.state, optimizer.state]

        def whole(inputs, targets, mask, ids):
            with use_positions(net, ids):
                loss, g = value_and_grad(net, inputs, targets, mask)
            g, norm = optim.clip_grad_norm(g, config.max_grad_norm)
            optimizer.update(net, g)
            return loss, norm

        whole = mx.compile(whole, inputs=state, outputs=state)

        def step(i):
            loss, norm = whole(*arrays[i % 2])
            mx.eval(net.parameters(), optimizer.state, loss, norm)
            return [loss.item(), norm.item()]

        return step

    def apply_step(clip, name):
        net = model()
        optimizer = (optim.Adam(learning_rate=1e-5) if name == "adam" else make_optimizer(config))
        grads = dict(tree_flatten(net.trainable_parameters()))
        grads = {k: mx.random.normal(v.shape, key=mx.random.key(0)) * 1e-3 for k, v in grads.items()}
        from mlx.utils import tree_unflatten
        grads = tree_unflatten(list(grads.items()))
        mx.eval(grads)
        optimizer.init(net.trainable_parameters())
        state = [net.state, optimizer.state]

        def apply(g):
            norm = mx.array(0.0)
            if clip:
                g, norm = optim.clip_grad_norm(g, config.max_grad_norm)
            optimizer.update(net, g)
            return norm

        apply = mx.compile(apply, inputs=state, outputs=state)
        return lambda i: mx.eval(apply(grads), net.parameters(), optimizer.state)

    def timed(parts: dict, reps: int) -> dict:
        for fn in parts.values():  # compile, warm the allocator
            fn(0)
            fn(1)
        cpu, wall = {k: [] for k in parts}, {k: [] for k in parts}
        for i in range(reps):
            for name, fn in parts.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn(i)
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - t0)
        return {name: {"cpu_s": statistics.median(cpu[name]), "wall_s": statistics.median(wall[name])}
                for name in parts}

    out = {}
    out.update(timed({"grad_pose_all": gradient_step("all", True), "grad_pose_blocks": gradient_step("blocks", True),
                      "grad_contiguous_all": gradient_step("all", False)}, args.profile_reps))
    out.update(timed({"apply_clip_adamw": apply_step(True, "adamw"), "apply_adamw": apply_step(False, "adamw"),
                      "apply_adam": apply_step(False, "adam")}, 4 * args.profile_reps))
    out.update(timed({"update_two_compiled": update_step(False), "update_one_compiled": update_step(True)},
                     args.profile_reps))
    print(PROFILE + json.dumps(out), flush=True)


def profile(args, model: Path) -> dict:
    """Run `profile_worker` in a child (with the benchmark's BLAS threads); its parts and the differences that
    answer where time goes."""
    env = child_env(**(blas_threads(args.threads) if args.threads else {}))
    cmd = [sys.executable, "-m", "benchmarks.bench_vs_mlx_lm", "--profile-worker", str(model),
           *[f"--{k}={getattr(args, k)}" for k in ("window", "batch", "factor", "profile_reps")]]
    proc = subprocess.run([c.replace("profile_reps", "profile-reps") for c in cmd], env=env, capture_output=True,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PROFILE)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"profile failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    parts = json.loads(lines[0][len(PROFILE):])
    cpu = {k: v["cpu_s"] for k, v in parts.items()}
    update = cpu["update_two_compiled"]
    return {
        "parts": parts,
        "share_of_update_cpu": {
            "training the embedding and final norm (grad all - grad blocks)":
                (cpu["grad_pose_all"] - cpu["grad_pose_blocks"]) / update,
            "PoSE position ids vs mx.fast.rope (grad pose - grad contiguous)":
                (cpu["grad_pose_all"] - cpu["grad_contiguous_all"]) / update,
            "gradient clipping (apply clip+AdamW - apply AdamW)":
                (cpu["apply_clip_adamw"] - cpu["apply_adamw"]) / update,
            "AdamW with decay 0 vs Adam": (cpu["apply_adamw"] - cpu["apply_adam"]) / update,
            "two compiled functions vs one": (update - cpu["update_one_compiled"]) / update,
            "outside the gradient and the optimizer (update - grad - apply)":
                (update - cpu["grad_pose_all"] - cpu["apply_clip_adamw"]) / update,
        },
    }



def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--vocab", type=int, default=512, help="tokenizer pieces (default 512)")
    parser.add_argument("--window", type=int, default=512, help="tokens per row (default 512)")
    parser.add_argument("--batch", type=int, default=4, help="rows per update (default 4)")
    parser.add_argument("--factor", type=int, default=4, help="pose_mlx's target / window (default 4)")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank of both tools (default 8)")
    parser.add_argument("--steps", type=int, default=8,
                        help="updates per run; updates 2 .. steps-1 are timed (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per variant (default 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OPENBLAS_NUM_THREADS of both tools (default 1; 0: leave the environment alone)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--docs", type=int, default=64, help="training documents (default 64)")
    parser.add_argument("--doc-chars", type=int, default=6000, help="characters per document (default 6000)")
    parser.add_argument("--workdir", help="folder for the model, data and outputs (kept; default: a temporary one)")
    parser.add_argument("--profile-reps", type=int, default=6,
                        help="timed repetitions of each part of the in-process profile (default 6; 0: no profile)")
    parser.add_argument("--profile-worker", help=argparse.SUPPRESS)
    parser.add_argument("--changes", action="append", default=[],
                        help="what changed in the code for this run, recorded in the JSON (repeatable)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "vs_mlx_lm.json"), help="JSON path")
    args = parser.parse_args()
    if args.profile_worker:
        return profile_worker(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants must name some of {VARIANTS}")
    if args.steps < 3 or args.repeats < 1 or args.threads < 0:
        parser.error("need --steps >= 3, --repeats >= 1 and --threads >= 0")

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vs_mlx_lm-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = compare(args, variants, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    path = write_results("vs_mlx_lm", results, args.out)
    print(f"wrote {path}")


def compare(args, variants: list[str], work: Path) -> dict:
    import pose_mlx  # noqa: F401  (the fast BLAS, before mlx.core, for the tokenizer check)

    model, data = make_inputs(args, work)
    shortest = check_lengths(args, model, data)
    parts = profile(args, model) if args.profile_reps else None
    if parts:
        print("profile (share of the update's CPU time): " + json.dumps(parts["share_of_update_cpu"], indent=1),
              flush=True)
    tokens = args.batch * (args.window - 1)
    tools = ("pose_mlx", "mlx_lm")
    probes, trainable, out = [], {}, {}
    for variant in variants:
        for tool in tools:  # untimed: fills the token cache and the page cache
            run_tool(tool_command(tool, variant, 3, args, model, data, work), tool, args)
        rounds = []
        for r in range(args.repeats):
            row = {}
            for tool in tools if r % 2 == 0 else tools[::-1]:
                result = run_tool(tool_command(tool, variant, args.steps, args, model, data, work), tool, args)
                probes.append({"tool": tool, "variant": variant, **result["probe"]})
                clocks = periods(result["marks"], args.steps)
                row[tool] = {"s_per_update": statistics.median(clocks["wall"]),
                             "cpu_s_per_update": statistics.median(clocks["cpu"]) if clocks["cpu"] else None,
                             "switches_per_update": statistics.median(clocks["switches"]) if clocks["switches"]
                             else None,
                             "own_s_per_update": statistics.median(own_seconds(tool, result, args, work)),
                             "wall_s": clocks["wall"], "cpu_s": clocks["cpu"]}
                found = _TRAINABLE.search(result["stdout"])
                if tool == "mlx_lm" and found:
                    trainable[f"mlx_lm {variant}"] = round(float(found.group(1)) * 1e6)
            rounds.append(row)
            print(f"{variant} round {r + 1}/{args.repeats}: " + ", ".join(
                f"{tool} {row[tool]['s_per_update']:.3f} s/update (cpu {row[tool]['cpu_s_per_update'] or 0:.3f}, "
                f"own {row[tool]['own_s_per_update']:.3f}, sleeps {row[tool]['switches_per_update']})" for tool in tools)
                + f"; pose_mlx / mlx-lm tokens/s {row['mlx_lm']['s_per_update'] / row['pose_mlx']['s_per_update']:.3f}",
                flush=True)
        out[variant] = summarize(rounds, tokens)
    trainable.update(_pose_trainable(args, model, variants))
    blas = {tool: sorted({p["library"] for p in probes if p["tool"] == tool}, key=str) for tool in tools}
    return {
        "ratio_tokens_per_s": {v: out[v]["ratio"] for v in variants},
        "ratio_tokens_per_cpu_s": {v: out[v]["ratio_cpu"] for v in variants},
        "variants": out,
        "trainable_parameters": trainable,
        "blas_library": blas,
        "blas_probe_gflops": {tool: statistics.median(p["gflops"] for p in probes if p["tool"] == tool)
                              for tool in tools},
        "blas_probes": probes,
        "same_blas": blas["pose_mlx"] == blas["mlx_lm"] and None not in blas["pose_mlx"],
        "profile": parts,
        "tokens_per_update": tokens,
        "shortest_document_tokens": shortest,
        "threads": args.threads or os.environ.get("OPENBLAS_NUM_THREADS"),
        "method": ("per update = time between the reports of updates n-1 and n (n = 2 .. steps-1) stamped by this "
                   "script from each child's output, median per run; tools interleaved; ratio = pose_mlx tokens/s / "
                   "mlx-lm tokens/s per round, median over rounds"),
        "changes": args.changes,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "changes", "workdir")},
    }


def summarize(rounds: list[dict], tokens: int) -> dict:
    """Medians over the rounds; ratios pose_mlx / mlx-lm of tokens/s (= mlx-lm seconds / pose_mlx seconds)."""
    def med(tool, key):
        values = [r[tool][key] for r in rounds]
        return statistics.median(values) if None not in values else None

    def ratio(key):
        pairs = [(r["mlx_lm"][key], r["pose_mlx"][key]) for r in rounds]
        return statistics.median(m / p for m, p in pairs) if all(m and p for m, p in pairs) else None

    return {
        "ratio": ratio("s_per_update"),
        "ratio_cpu": ratio("cpu_s_per_update"),
        "ratio_own": ratio("own_s_per_update"),
        **{tool: {"tokens_per_s": tokens / med(tool, "s_per_update"), "s_per_update": med(tool, "s_per_update"),
                  "cpu_s_per_update": med(tool, "cpu_s_per_update"),
                  "voluntary_switches_per_update": med(tool, "switches_per_update"),
                  "tokens_per_cpu_s": tokens / med(tool, "cpu_s_per_update") if med(tool, "cpu_s_per_update") else None,
                  "own_tokens_per_s": tokens / med(tool, "own_s_per_update")} for tool in ("pose_mlx", "mlx_lm")},
        "rounds": rounds,
    }


def _pose_trainable(args, model: Path, variants: list[str]) -> dict:
    """pose_mlx's trainable parameters: every weight (full), or the LoRA adapters of every block."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from pose_mlx.model.source import load
    from pose_mlx.training.lora import LoraSpec, add_lora

    counts = {}
    for variant in variants:
        net, _ = load(str(model))
        if variant == "lora":
            add_lora(net, LoraSpec(rank=args.lora_rank, scale=20.0, num_layers=args.layers), seed=0)
        counts[f"pose_mlx {variant}"] = sum(v.size for _, v in tree_flatten(net.trainable_parameters()))
        del net
        mx.clear_cache()
    return counts


if __name__ == "__main__":
    main()
