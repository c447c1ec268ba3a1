"""Data-parallel fine-tuning on one machine: per-update time of 1 rank vs 2 ranks (ring backend) at the same global
batch, and what the gradient all-reduce costs.

Runs, interleaved (1 rank, 2 ranks, 1 rank, ...) for `--repeats` rounds, the product's update
(`pose_mlx.training.loop.make_update`, compiled, PoSE batches from `pose_mlx.training.data.ExampleStream`) of a
random-weight llama in worker processes:

  1 rank    one process, global batch B, world of one rank (nothing communicated);
  2 ranks   each rank B / 2 rows of the same global batches, over the ring backend, started two ways:
            direct      this script starts both ranks with the environment `mlx.launch` gives them (a hostfile
                        in MLX_HOSTFILE, MLX_RANK), nothing else running;
            mlx.launch  `mlx.launch -n 2 --backend ring`. Its relay threads poll the ranks' pipes in a loop that
                        never blocks (the rank's stdin is always writable), about one core (half of a 2-core CPU)
                        while the ranks run: the CPU seconds of the launcher (all CPU seconds of the command
                        minus the ranks' own) are recorded.

Every worker gets OPENBLAS_NUM_THREADS=`--threads` (default 1): the 2 ranks share this machine's cores, so each
rank computes with one thread, and the 1-rank run too, which makes 1 rank vs 2 ranks a question of scaling over
processes, not of BLAS threads. Inside each 2-rank worker, two updates alternate on two model copies with the same
seeds: the group update (gradients all-reduced over the ranks) and a local update of the same rank's rows with
nothing communicated (`World` of one rank). The ranks meet at a barrier (untimed) before every update, so a group
update does not also time the wait for the other rank's local update (which is not synchronized). The difference
of the two is the communication overhead of an update:

    overhead = t_group - t_local,   overhead share = overhead / t_group.

Linux shares the CPU between sessions (autogroups) before it shares it between processes: two ranks in one
session get together what one process gets, however many cores are idle elsewhere. So every worker process starts
its own session (`--shared-session` keeps them in this script's), as ranks on their own cores would be. CPU
seconds per update (user + system, all threads) are recorded next to the wall clock: the load of a shared machine
moves them little.

Each worker also times the collective alone on a gradient-sized tree: one `all_sum` of the flattened tree (what
the update does) and one `all_sum` per parameter (what it did before), medians over `--collective-reps`.
The 2-rank losses must equal the 1-rank ones to `--loss-tol` (the same global batches), else nothing is written.
Writes benchmarks/results/distributed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, blas_threads, child_env, synthetic_corpus, write_results

RESULT = "RESULT "


def _median(values):
    return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------------ worker


def worker(args) -> None:
    """One rank: timed group and local updates, then the collective alone; prints one RESULT line."""
    if not args.shared_session:
        os.setsid()  # its own scheduling group (see --shared-session)
    import pose_mlx  # noqa: F401  (the fast BLAS, before mlx.core)
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    from pose_mlx import extend, use_positions
    from pose_mlx.backend import status as blas_status
    from pose_mlx.model.source import build_model
    from pose_mlx.toy import model_config
    from pose_mlx.training.data import ExampleStream
    from pose_mlx.training.distributed import SINGLE, init
    from pose_mlx.training.loop import TrainConfig, make_optimizer, make_update

    world = init()
    if args.batch % world.size:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world.size} ranks")
    rows = args.batch // world.size
    corpus = synthetic_corpus(args.vocab, docs=16, length=args.window * args.factor)
    total = args.warmup + args.steps
    config = TrainConfig(steps=total, lr=1e-5, warmup=1, progress=False)

    def variant(w):
        model = build_model(model_config(args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                                         num_heads=args.heads, max_position_embeddings=args.window), seed=0)
        extend(model, "linear", args.window, args.window * args.factor)
        model.unfreeze()
        update = make_update(model, make_optimizer(config), config, use_positions, w)
        batches = iter(ExampleStream(corpus, args.window, args.window * args.factor, batch_size=rows, seed=0,
                                     rank=world.rank, world=world.size))
        return model, lambda: update(batches)

    variants = {"group": variant(world)}
    if world.size > 1:
        variants["local"] = variant(SINGLE)
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    losses = []
    for i in range(total):
        for name, (_, step) in variants.items():
            world.barrier()  # untimed: a group update must not time the peer's unsynchronized local update
            t0, c0 = time.perf_counter(), time.process_time()
            loss, _norm, tokens, _stop = step()
            if i >= args.warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            if name == "group":
                losses.append(loss)

    model = variants["group"][0]
    grads = tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(world.rank)).astype(p.dtype),
                     model.trainable_parameters())
    leaves = [g for _, g in tree_flatten(grads)]
    mx.eval(leaves)
    collective = {}
    if world.size > 1:
        def flat():
            mx.eval(mx.distributed.all_sum(mx.concatenate([g.reshape(-1) for g in leaves]), group=world.group))

        def per_parameter():
            mx.eval([mx.distributed.all_sum(g, group=world.group) for g in leaves])

        for name, fn in (("flat", flat), ("per_parameter", per_parameter)):
            fn()
            times = []
            for _ in range(args.collective_reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            collective[name] = _median(times)
    print(RESULT + json.dumps({
        "rank": world.rank, "ranks": world.size, "rows": rows, "tokens": tokens,
        "wall": wall, "cpu": cpu, "losses": losses, "collective_s": collective,
        "parameters": sum(g.size for g in leaves), "bytes": sum(g.nbytes for g in leaves),
        "blas": blas_status.get("library"), "threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "process_cpu_s": time.process_time(),
    }), flush=True)


# ------------------------------------------------------------------------------------------------ parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(ranks: int, how: str, args, worker_args: list[str]) -> tuple[list[dict], float]:
    """The workers' results (sorted by rank) and the CPU seconds of everything `how` started (ranks included).

    `how`: "single" (one process), "direct" (ranks started here with a ring hostfile) or "mlx.launch"."""
    env = child_env(**blas_threads(args.threads))
    me = [sys.executable, "-m", "benchmarks.bench_distributed", "--worker", *worker_args]
    cpu = _children_cpu()
    if how == "direct":
        with tempfile.TemporaryDirectory() as tmp:
            hostfile = Path(tmp) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(ranks)]))
            procs = [subprocess.Popen(me, env=dict(env, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank)),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for rank in range(ranks)]
            outputs = [p.communicate(timeout=args.timeout) for p in procs]
        returncode = max(p.returncode for p in procs)
        stdout, stderr = "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
    else:
        command = me
        if how == "mlx.launch":
            launch = shutil.which("mlx.launch", path=os.path.dirname(sys.executable)) or shutil.which("mlx.launch")
            if launch is None:
                raise SystemExit("mlx.launch is not installed")
            # two consecutive free ports are likely when the first is: the ring backend listens on port, port + 1
            command = [launch, "-n", str(ranks), "--backend", "ring", "-p", str(_free_port()), "--", *me]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    cpu = _children_cpu() - cpu
    results = [json.loads(line[len(RESULT):]) for line in stdout.splitlines() if line.startswith(RESULT)]
    if returncode != 0 or len(results) != ranks:
        raise SystemExit(f"{ranks}-rank worker ({how}) failed (exit {returncode}):\n{stdout[-3000:]}\n"
                         f"{stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"]), cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--window", type=int, default=256, help="training window (tokens; default 256)")
    parser.add_argument("--factor", type=int, default=4, help="target / window for PoSE (default 4)")
    parser.add_argument("--batch", type=int, default=4, help="global batch: rows per update over all ranks "
                                                              "(default 4)")
    parser.add_argument("--steps", type=int, default=8, help="timed updates per worker (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first (compilation; default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of (1 rank, 2 ranks) (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="OPENBLAS_NUM_THREADS of every worker (default 1)")
    parser.add_argument("--shared-session", action="store_true",
                        help="leave every rank in this script's session: where the kernel shares the CPU between "
                             "sessions (autogroups), the ranks then share one session's share (default: each worker "
                             "process starts its own session)")
    parser.add_argument("--collective-reps", type=int, default=10,
                        help="timed all-reduces of a gradient-sized tree per variant (default 10)")
    parser.add_argument("--loss-tol", type=float, default=1e-4,
                        help="largest allowed |loss 2 ranks - loss 1 rank| per update (default 1e-4)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per worker run")
    parser.add_argument("--changes", action="append", default=[],
                        help="what changed in the code for this run, recorded in the JSON (repeatable)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "distributed.json"), help="JSON path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if min(args.steps, args.repeats, args.threads, args.batch) < 1 or args.batch % 2:
        parser.error("--steps, --repeats, --threads must be >= 1 and --batch even")

    worker_args = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
                   if k in ("vocab", "hidden", "layers", "heads", "window", "factor", "batch", "steps", "warmup",
                            "collective_reps", "shared_session") and v is not False]
    launchers = ("direct", "mlx.launch")
    runs = {"single": [], **{how: [] for how in launchers}}
    launcher_cpu = []
    for r in range(args.repeats):
        for how in runs:
            ranks = 1 if how == "single" else 2
            results, cpu = _run(ranks, how, args, worker_args)
            runs[how].append(results)
            group = _median([_median(x["wall"]["group"]) for x in results])
            line = f"round {r + 1}/{args.repeats}, {ranks} rank(s) ({how}): update {group:.4f} s"
            if ranks > 1:
                local = _median([_median(x["wall"]["local"]) for x in results])
                line += (f", local share {local:.4f} s, all-reduce {results[0]['collective_s']['flat']:.4f} s "
                         f"(per parameter {results[0]['collective_s']['per_parameter']:.4f} s)")
            if how == "mlx.launch":
                launcher_cpu.append(cpu - sum(x["process_cpu_s"] for x in results))
                line += f", launcher {launcher_cpu[-1]:.1f} CPU s"
            print(line, flush=True)

    diffs = [abs(a - b) for how in launchers for one, two in zip(runs["single"], runs[how])
             for a, b in zip(one[0]["losses"], two[0]["losses"])]
    if max(diffs) > args.loss_tol:
        sys.exit(f"2 ranks and 1 rank disagree: max |loss difference| {max(diffs):.2e} > {args.loss_tol}; "
                 "nothing written")

    def per_round(how, key, variant, what=_median):
        """For each round: the mean over ranks of that rank's median per-update `key` time of `variant`."""
        return [statistics.fmean(what(x[key][variant]) for x in results) for results in runs[how]]

    one = per_round("single", "wall", "group")

    def two_ranks(how):
        two = per_round(how, "wall", "group")
        local = per_round(how, "wall", "local")
        overhead = [g - l for g, l in zip(two, local)]
        flat = [statistics.fmean(x["collective_s"]["flat"] for x in results) for results in runs[how]]
        per_parameter = [statistics.fmean(x["collective_s"]["per_parameter"] for x in results)
                         for results in runs[how]]
        return {
            "update_s": _median(two),
            "speedup": _median([o / t for o, t in zip(one, two)]),
            "local_share_s": _median(local),
            "overhead_s": _median(overhead),
            "overhead_share": _median([o / t for o, t in zip(overhead, two)]),
            "allreduce_flat_s": _median(flat),
            "allreduce_per_parameter_s": _median(per_parameter),
            "allreduce_share": _median([f / t for f, t in zip(flat, two)]),
            "tokens_per_s": tokens / _median(two),
            "cpu_s_per_update_per_rank": _median(per_round(how, "cpu", "group")),
            "cpu_s_local_share_per_rank": _median(per_round(how, "cpu", "local")),
            "per_round": {"update_s": two, "local_share_s": local, "allreduce_flat_s": flat,
                          "allreduce_per_parameter_s": per_parameter},
        }

    tokens = runs["single"][0][0]["tokens"]
    results = {
        "one_rank_update_s": _median(one),
        "one_rank_cpu_s_per_update": _median(per_round("single", "cpu", "group")),
        "one_rank_tokens_per_s": tokens / _median(one),
        "two_ranks": {how: two_ranks(how) for how in launchers},
        "mlx_launch_launcher_cpu_s": _median(launcher_cpu),
        "target_overhead_share": 0.10,
        "tokens_per_update": tokens,
        "per_round_one_rank_update_s": one,
        "max_abs_loss_diff": max(diffs),
        "parameters": runs["single"][0][0]["parameters"],
        "gradient_bytes": runs["single"][0][0]["bytes"],
        "blas": runs["single"][0][0]["blas"],
        "threads_per_process": args.threads,
        "method": ("every worker OPENBLAS_NUM_THREADS=threads; 1 rank: global batch in one process; 2 ranks: "
                   "ring backend, batch/2 rows each, started directly (hostfile + MLX_RANK, as mlx.launch does) "
                   "and by mlx.launch -n 2 --backend ring; overhead = group update - local update of the same "
                   "rows on a second model copy in the same worker (interleaved); medians per worker, mean over "
                   "ranks, median over rounds; launcher CPU = CPU seconds of the mlx.launch command minus its "
                   "ranks' own"),
        "changes": args.changes,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "changes", "worker", "timeout")},
    }
    path = write_results("distributed", results, args.out)
    print(f"\n1 rank {results['one_rank_update_s']:.4f} s/update")
    for how, r in results["two_ranks"].items():
        print(f"2 ranks ({how}) {r['update_s']:.4f} s (speed-up {r['speedup']:.2f}x); local share "
              f"{r['local_share_s']:.4f} s, overhead {r['overhead_s']:.4f} s = {r['overhead_share']:.1%} of the "
              f"update (target <= 10%); all-reduce alone {r['allreduce_flat_s']:.4f} s flat vs "
              f"{r['allreduce_per_parameter_s']:.4f} s per parameter")
    print(f"mlx.launch's own CPU: {results['mlx_launch_launcher_cpu_s']:.1f} s per run")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
