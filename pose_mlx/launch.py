"""Data-parallel ranks on this machine: `python -m pose_mlx.launch -n N -- COMMAND ...`.

    python -m pose_mlx.launch -n 2 -- python -m pose_mlx.finetune --model tiny --target 8x --data d --output o

Starts N processes of COMMAND with the environment `mlx.launch -n N --backend ring` gives local ranks: a hostfile
of one loopback address per rank in MLX_HOSTFILE and the rank in MLX_RANK. What it leaves out is mlx.launch's
output relay, whose per-rank threads wait on an always-writable pipe to the rank's stdin and so never block:
where the ranks use every core (e.g. 2 ranks on a 2-core CPU) that loop takes CPU from them: on a 2-core Linux
CPU, 2 ranks ran at 0.63x one process under mlx.launch but 1.92x started directly
(benchmarks/results/distributed_window1024.json).

The ranks inherit this terminal (stdin from /dev/null): pose_mlx commands print from rank 0 only. They share the
launcher's process group, so Ctrl-C reaches every rank at once, as it reaches one process; SIGTERM and SIGHUP sent
to the launcher are passed on to every rank. When a rank fails, the others get `--grace` seconds to finish
(a training group reports an interruption from rank 0), then SIGTERM, then SIGKILL. The exit code is the first
failing rank's (0 when all succeed). For ranks on several machines use mlx.launch with a hostfile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import ArgumentParser, UserError, command

#: Exit code of a rank killed by signal s (as a shell reports it).
SIGNAL_EXIT = 128
#: Most ranks started on one machine (each holds a loopback port and a process; a larger -n is a typo).
MAX_RANKS = 256


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m pose_mlx.launch", description=__doc__.split("\n")[0],
                            usage="python -m pose_mlx.launch -n N [--grace S] -- COMMAND ...")
    parser.add_argument("-n", "--ranks", type=int, required=True, help=f"processes to start (1 to {MAX_RANKS})")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds (finite, >= 0) the other ranks get to finish after one failed, before SIGTERM "
                             "(and as much again before SIGKILL; default 30)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs (after --, which may be "
                                                                  "left out)")
    return parser


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago (held open together while chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_ranks(cmd: list[str], ranks: int, folder: Path, env: dict | None = None) -> list[subprocess.Popen]:
    """The ranks of `cmd` started with a ring hostfile written to `folder` (one loopback address each); a single
    rank gets no hostfile (a world of one: the ring backend cannot form a ring of one)."""
    base = dict(os.environ if env is None else env)
    if ranks > 1:
        hostfile = folder / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks)]))
        base["MLX_HOSTFILE"] = str(hostfile)
    procs = []
    try:
        for rank in range(ranks):
            procs.append(subprocess.Popen(cmd, env=dict(base, MLX_RANK=str(rank)), stdin=subprocess.DEVNULL))
    except OSError as error:
        stop(procs, 0)
        raise UserError(f"cannot start {cmd[0]!r}: {error.strerror or error}") from None
    return procs


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every rank still running, and SIGKILL those still running `grace` seconds later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.send_signal(sig)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.05)


def supervise(procs: list[subprocess.Popen], grace: float) -> int:
    """Wait for every rank; once one fails, the others get `grace` seconds, then `stop`. The first failing
    rank's exit code (a signal s as 128 + s), else 0."""
    failed_at, code = None, 0
    while True:
        codes = [p.poll() for p in procs]
        for c in codes:
            if c not in (None, 0) and not code:
                code, failed_at = (c if c > 0 else SIGNAL_EXIT - c), time.monotonic()
        if all(c is not None for c in codes):
            return code
        if failed_at is not None and time.monotonic() - failed_at > grace:
            stop(procs, grace)
        time.sleep(0.05)


@command("pose_mlx.launch")
def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not 1 <= args.ranks <= MAX_RANKS:
        raise UserError(f"-n {args.ranks}: the number of ranks must be at least 1 and at most {MAX_RANKS} on one "
                        "machine (more: mlx.launch with a hostfile)")
    if not (math.isfinite(args.grace) and args.grace >= 0):
        raise UserError(f"--grace {args.grace}: must be a finite number of seconds >= 0")
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise UserError("no command to run: python -m pose_mlx.launch -n N -- COMMAND ...")
    with tempfile.TemporaryDirectory(prefix="pose_mlx_launch_") as tmp:
        procs = start_ranks(cmd, args.ranks, Path(tmp))

        def pass_on(signum, _frame):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)

        previous = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGHUP)}
        # Ctrl-C reaches the ranks from the terminal directly; the launcher waits for them to finish
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return supervise(procs, args.grace)
        finally:
            stop(procs, args.grace)
            for s, handler in previous.items():
                signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
