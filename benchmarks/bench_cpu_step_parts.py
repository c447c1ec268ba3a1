"""Where the time of one PoSE LoRA update goes on this CPU: the update beside its parts, one process, interleaved.

    python -m benchmarks.bench_cpu_step_parts [--length 1024] [--reps 5]

SmolLM2-135M (bench_cpu_train's float32 folder), one row of `--length` tokens, rank-8 adapters (scale 20) in
every block, as `benchmarks.bench_cpu_train`'s pose-1k row trains. Each case evaluates its own work; the cases
run A, B, C, A, B, C, ... after one warm-up each (which compiles), and each keeps the median of `--reps`:

  update             the LoRA update as `pose_mlx.finetune` computes it: the training loop's `make_update`
                     (`mx.compile`d value_and_grad of `masked_loss` under `kernels.route.training_route`,
                     clipping, AdamW) at positions 0 .. L-1 (PoSE's positions change only the rotary angles)
  update, no LoRA    the same model without adapters, its first block's input norm trained: the backward still
                     crosses every block, and the difference to `update` is what the adapters cost
  update, MLX's path the LoRA update with `--kernels mlx` (MLX's attention, loss and SiLU: what mlx-lm computes)
  products           the matrix products the update cannot avoid, at its shapes: each projection's x W^T and
                     input gradient dy W in every block, and the head's h E^T and dz E (LoRA trains no frozen
                     weight, so no weight gradient is due)
  attention          `pose_mlx.kernels.attention`, forward + backward, every layer
  loss               `pose_mlx.kernels.loss`, forward + backward over the head (its products included)

Derived (seconds): adapters = update - no LoRA; rest = no LoRA - (products - head products) - attention - loss,
the norms, rotary embedding, SwiGLU, residual sums, copies and allocation; and two ratios against MLX's path,
the update's own and a ceiling: MLX's path over the products alone, what no kernel can pass while the products
run at this BLAS's speed. Writes benchmarks/results/cpu_step_parts.json and a table in docs/cpu-training.md.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np

from pose_mlx import extend, use_positions  # (the fast BLAS before mlx.core)
import mlx.core as mx

from pose_mlx.backend import status as blas_status
from pose_mlx.kernels import attention as blocked
from pose_mlx.kernels import build, loss, route
from pose_mlx.training.lora import LoraSpec, add_lora
from pose_mlx.training.loop import TrainConfig, make_optimizer, make_update

from benchmarks.bench_cpu_kernels import interleaved
from benchmarks.bench_cpu_train import RANK, SCALE, WORK, inputs
from benchmarks.common import ROOT, matmul_gflops, write_between, write_results

MLX_PATH = "update, MLX's path"


def load_model(folder, lora: bool):
    """SmolLM2-135M extended as the pose-1k row extends it (8k -> 32k, YaRN), with adapters or with one norm trained."""
    from mlx_lm import load

    model, _ = load(str(folder))
    extend(model, "yarn", 8192, 32768)
    if lora:
        add_lora(model, LoraSpec(RANK, SCALE, -1), seed=0)
    else:
        model.freeze()
        model.model.layers[0].input_layernorm.unfreeze()
    return model


def update_case(model, row: tuple, kernels: str):
    """One update of `model` on `row` (inputs, targets, mask) as `pose_mlx.finetune` makes it: the training loop's
    own `make_update` (compiled, AdamW, clipped), at positions 0 .. L-1."""
    config = TrainConfig(steps=1_000_000, lr=1e-5, warmup=0, kernels=kernels, progress=False)
    update = make_update(model, make_optimizer(config), config, use_positions)
    inputs, targets, mask = (np.array(a) for a in row)
    batch = SimpleNamespace(inputs=inputs, targets=targets, mask=mask,
                            positions=np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape))
    return lambda: update(iter([batch]))


def head_dim(args) -> int:
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def product_shapes(args) -> list[tuple[int, int]]:
    """(out, in) of each block's projections: q, k, v, o, gate, up, down (a Llama-family block)."""
    hidden, inner = args.hidden_size, args.intermediate_size
    q, kv = args.num_attention_heads * head_dim(args), args.num_key_value_heads * head_dim(args)
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inner, hidden), (inner, hidden), (hidden, inner)]


def parts_cases(model, length: int) -> dict:
    """The products, the attention and the loss of the update, each over every layer."""
    args, layers = model.args, len(model.layers)
    keys = iter(mx.random.split(mx.random.key(1), 16))
    weights = [mx.random.normal(shape, key=next(keys)) * 0.02 for shape in product_shapes(args)]
    sizes = {n for shape in product_shapes(args) for n in shape} | {args.hidden_size}
    rows = {n: mx.random.normal((length, n), key=next(keys)) for n in sizes}
    embed = model.model.embed_tokens.weight
    dz = mx.random.normal((length, embed.shape[0]), key=next(keys)) * 1e-3
    heads, kv_heads, dim = args.num_attention_heads, args.num_key_value_heads, head_dim(args)
    q, cot = (mx.random.normal((1, heads, length, dim), key=next(keys)) for _ in range(2))
    k, v = (mx.random.normal((1, kv_heads, length, dim), key=next(keys)) for _ in range(2))
    targets = mx.random.randint(0, embed.shape[0], (length,), key=next(keys))
    mx.eval(weights, list(rows.values()), dz, q, cot, k, v, targets)

    def products():
        for _ in range(layers):
            mx.eval([rows[i] @ w.T for w, (_, i) in zip(weights, product_shapes(args))]
                    + [rows[o] @ w for w, (o, _) in zip(weights, product_shapes(args))])
        head_products()

    def head_products():
        mx.eval(rows[args.hidden_size] @ embed.T, dz @ embed)

    def attention():
        for _ in range(layers):
            mx.eval(mx.vjp(lambda a, b, c: blocked.attention(a, b, c, dim ** -0.5, "causal"), [q, k, v],
                           [cot]))

    gradient = mx.grad(lambda h: loss.chunked_cross_entropy(h, embed, targets, mx.ones((length,))))
    return {"products": products, "head products": head_products, "attention": attention,
            "loss": lambda: mx.eval(gradient(rows[args.hidden_size]))}


def derived(seconds: dict) -> dict:
    layers_products = seconds["products"] - seconds["head products"]
    rest = seconds["update, no LoRA"] - layers_products - seconds["attention"] - seconds["loss"]
    return {"adapters": seconds["update"] - seconds["update, no LoRA"], "rest": rest,
            "speedup_over_mlx_path": seconds[MLX_PATH] / seconds["update"],
            "ceiling_over_mlx_path": seconds[MLX_PATH] / seconds["products"],
            "products_share_of_update": seconds["products"] / seconds["update"]}


PARTS = (("products", "the matrix products no path avoids: each projection's forward and input gradient, the "
                      "head's two"),
         ("attention", "attention (one fused kernel each way on this CPU), forward + backward, every layer"),
         ("loss", "the loss, chunked, forward + backward (the head's products included)"),
         ("adapters", "the rank-8 adapters: the update less the update without them"),
         ("rest", "the rest: norms, rotary embedding, SwiGLU, residual sums, copies, allocation"))


def markdown(results: dict) -> str:
    """docs/cpu-training.md's table: the update, MLX's path and the parts, in seconds."""
    seconds, derived_ = results["seconds"], results["derived"]
    lines = [f"| one LoRA update of {results['length']:,} tokens | seconds |", "|---|---|",
             f"| the update (pose_mlx's path) | {seconds['update']:.2f} |",
             f"| the update through MLX's own attention, loss and SiLU | {seconds[MLX_PATH]:.2f} |"]
    lines += [f"| {text} | {seconds.get(name, derived_.get(name)):.2f} |" for name, text in PARTS]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024, help="tokens of the row (default 1024)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per case (median)")
    args = parser.parse_args(argv)
    if args.length < 2 or args.reps < 1:
        parser.error("--length must be at least 2 and --reps at least 1")
    folder, _ = inputs(WORK)
    build.load()
    ids = mx.random.randint(0, 49152, (1, args.length + 1), key=mx.random.key(0))
    row = (ids[:, :-1], ids[:, 1:], mx.ones((1, args.length)))
    lora, plain, mlx_path = load_model(folder, True), load_model(folder, False), load_model(folder, True)
    cases = {"update": update_case(lora, row, "auto"), "update, no LoRA": update_case(plain, row, "auto"),
             MLX_PATH: update_case(mlx_path, row, "mlx"), **parts_cases(plain, args.length)}
    before = matmul_gflops()
    seconds = interleaved(cases, args.reps)
    results = {"length": args.length, "rank": RANK, "scale": SCALE, "reps": args.reps, "seconds": seconds,
               "derived": derived(seconds), "kernels": {k: v for k, v in build.status.items() if k != "path"},
               "blas": blas_status.get("library") and blas_status["library"].rsplit("/", 1)[-1],
               "matmul_gflops": (before + matmul_gflops()) / 2}
    for name, value in {**seconds, **results["derived"]}.items():
        print(f"{name:>28}: {value:.3f}")
    print(write_results("cpu_step_parts", results))
    write_between(ROOT / "docs" / "cpu-training.md", "cpu-step-parts", markdown(results))


if __name__ == "__main__":
    main()
