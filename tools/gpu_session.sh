#!/usr/bin/env bash
# The GPU machine's side of docs/gpu.md: MLX's CUDA wheels, carried in pieces (tools/gpu_wheels.py download),
# installed without internet, then the pending GPU jobs within one budget.
#
#   bash tools/gpu_session.sh --stash                  # a call that carries .gpu/callN while more calls follow
#   bash tools/gpu_session.sh [--budget S] [--out DIR] # the last call: join, install, check the GPU, run the jobs
#
# A lent session is these calls back to back (the machine is fresh again 30 s after a call): every call but the
# last carries one call folder and runs `--stash`; the last carries the last folder and is the session's one
# command, set-up, a slice of the queue and the packing in one call (run it with the call's limit, 600 s: the
# default budget, 580 s, ends 20 s inside it). `python -m experiments.gpu_jobs --plan` says what the slice runs.
#
# Every call first copies the call folders it carried (.gpu/call*) into the stash, a folder outside the checkout
# ($POSE_MLX_GPU_STASH, default /tmp/pose_mlx_gpu) that outlives the call while the machine stays up. The last call
# joins and checks the pieces (a missing one is named with its call), installs every wheel with
# `pip install --no-index --no-deps --target` into $POSE_MLX_GPU_SITE (default /tmp/site), puts that and the
# checkout on PYTHONPATH, checks that MLX's default device is the GPU, uses the SmolLM2 GGUF and puts the
# evidence texts in place when they were carried (--data), puts the state an earlier session left to resume from
# into the checkout when it was carried (--state: checkpoints, partial records), and runs
# `python3 -m experiments.gpu_jobs --budget B --out DIR --returns STASH/returned` with B = --budget (default 580)
# less the seconds the set-up took, DIR = --out (default $OUT, else gpu_out in the checkout): a second last call
# on the same warm machine first takes up what the first one returned. $PYTHON names the interpreter (python3);
# $POSE_MLX_GPU_CARRIED the carried call folders' parent (.gpu); $POSE_MLX_GPU_HOST_ROOT where the texts go (/).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STASH="${POSE_MLX_GPU_STASH:-/tmp/pose_mlx_gpu}"
SITE="${POSE_MLX_GPU_SITE:-/tmp/site}"
CARRIED="${POSE_MLX_GPU_CARRIED:-$REPO/.gpu}"
PYTHON="${PYTHON:-python3}"
BUDGET=580
OUT_DIR="${OUT:-$REPO/gpu_out}"
MODE=run

die() { echo "gpu_session: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --stash) MODE=stash; shift ;;
        --budget) [ $# -ge 2 ] || die "--budget needs seconds"; BUDGET="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT_DIR="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
case "$BUDGET" in ''|*[!0-9]*) die "--budget must be whole seconds, not $BUDGET" ;; esac

# the tools below import only pose_mlx.errors, before MLX is installed: no BLAS to look for yet
wheels() { PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" POSE_MLX_BLAS=off "$PYTHON" "$REPO/tools/gpu_wheels.py" "$@"; }

wheels stash --stash "$STASH" --src "$CARRIED"
[ "$MODE" = stash ] && { echo "gpu_session: stashed in $STASH; carry the next call's folder"; exit 0; }

wheels join --stash "$STASH"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$STASH"/files/*.whl
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
DEVICE="$("$PYTHON" -c 'import mlx.core as mx; print(mx.default_device())')"
case "$DEVICE" in
    *gpu*) echo "gpu_session: MLX $("$PYTHON" -c 'import mlx.core as mx; print(mx.__version__)') on $DEVICE" ;;
    *) echo "gpu_session: error: MLX's default device is $DEVICE, not the GPU (are the CUDA wheels and driver there?)" >&2
       exit 1 ;;
esac
if ls "$STASH"/models/*.gguf >/dev/null 2>&1; then export POSE_MLX_MODELS="$STASH/models"; fi
wheels host --stash "$STASH" --root "${POSE_MLX_GPU_HOST_ROOT:-/}"
wheels state --stash "$STASH" --into "$REPO"

LEFT=$((BUDGET - SECONDS))
[ "$LEFT" -gt 0 ] || die "the set-up took $SECONDS s of the $BUDGET s budget"
echo "gpu_session: set-up took $SECONDS s; running the GPU jobs for $LEFT s into $OUT_DIR"
cd "$REPO"
exec "$PYTHON" -m experiments.gpu_jobs --budget "$LEFT" --out "$OUT_DIR" --returns "$STASH/returned"
