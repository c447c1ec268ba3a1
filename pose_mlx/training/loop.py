"""The training loop: masked next-token loss at explicit position ids, AdamW, resumable, checked.

- How the model reads a batch's position ids is given by the caller: `at_positions(model, ids)`, a context
  manager (`pose_mlx.use_positions` for an extended model); a batch with short-context rows (`Batch.short`)
  calls `at_positions(model, ids, short)`. The loop wraps the whole `value_and_grad` call in
  it, so gradient checkpointing (which re-runs the forward in the backward) sees the same positions.
- Loss: L = sum_t mask_t * CE(logits_t, target_t) / sum_t mask_t (padding has mask 0).
- Loss scaling (`loss_scale` S, static): the backward pass differentiates S * L and the gradients are divided by
  S before anything else sees them. In float32 that changes nothing beyond rounding; in float16 it lifts the
  backward pass's small values (a token's logit gradient is about p / T) out of the subnormal range, where they
  lose their digits (benchmarks/bench_grad_precision.py: SmolLM2-135M, one 1024-token PoSE window, LoRA gradients
  in float16 against float32: cosine 0.97 on average and 0.10 at worst without scaling, 0.99997 and 0.9998 with
  S = 4096). `loss_scale_for(model)` gives the default.
- Update: gradients averaged over `grad_accum` micro-batches, clipped to global norm `max_grad_norm`,
  AdamW (no weight decay) with learning rate 0 -> lr linearly over `warmup` steps, then linearly down to 0 at
  `steps`.
- Checkpoints every `save_every` steps and when SIGINT/SIGTERM arrive (then `Interrupted` is raised). The loss
  and gradient norm are checked every step and the weights before every checkpoint: the first non-finite value
  raises `NonFinite`, naming the step, and the last finite checkpoint is kept. A model whose held-out loss ends
  non-finite or at `collapse_ceiling` of its loss before training (back at the uniform guess for a model that knew
  something; well above its start for one that began at the guess), or whose outputs no longer depend on its
  input, is `Collapsed` (never exported).
- log.jsonl: one JSON object per line (non-finite numbers written as null), each line written whole; a torn
  last line left by a kill is dropped on --resume.
- `compile=True` (default) runs the micro-batch gradients and the clip + AdamW update as two `mx.compile`d
  functions (position ids are an argument, model and optimizer state their implicit inputs and outputs);
  the math is the same as the eager path (`compile=False`), tested to 1e-5.
- Data parallel (`world` from `pose_mlx.training.distributed.init()`): each rank's loss and gradients are combined
  token-weighted over the ranks in one flattened all-reduce per micro-batch (`World.mean_of_sums`); only rank 0
  logs and writes checkpoints. A signal on any rank stops every rank after the same step: the flag rides in the
  next update's all-reduce (no host sync of its own), so the group stops after the update in which a rank sees
  it or the next one; a signal during the last update is caught by one check after the loop.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map
from tqdm import tqdm

from .checkpoint import NonFiniteWeights, load_checkpoint, read_state, save_checkpoint
from .distributed import SINGLE, World
from ..kernels import route
from ..kernels.loss import chunked_cross_entropy
from ..model.head import head_layer
from ..errors import Stopped, UserError
from ..files import write_atomic
from ..words import counted

# mlx-lm is imported inside the function that uses it: its package loads transformers (~1.2 s on a 2-core CPU),
# which a training loop without gradient checkpointing never needs.


class NonFinite(UserError):
    """The loss, the gradient norm or a weight became NaN or infinite at `step` (too high a learning rate)."""

    def __init__(self, what: str, step: int, checkpoint_step: int | None, loss_scale: float = 1.0):
        kept = (f"the last finite checkpoint (step {checkpoint_step}) is kept" if checkpoint_step
                else "no checkpoint was written yet")
        lower = "a lower --lr" if loss_scale == 1 else f"a lower --lr, or a --loss-scale below {loss_scale:g},"
        super().__init__(f"{what} is not finite at step {step}; training stopped, {kept} "
                         f"(start over with {lower} and --overwrite)")
        self.step = step


class Collapsed(UserError):
    """Training destroyed the model (finite weights, but no better than chance or blind to its input)."""


class Interrupted(Stopped):
    """Training stopped by a signal after saving a checkpoint at `step`; raised on every rank of `world`. Rank 0
    (which saved the checkpoint) announces it, with `resume`, the command line that continues the run (default: the
    same command with --resume); every rank waits for the others before exiting."""

    def __init__(self, signum: int, step: int, world: World = SINGLE, resume: str | None = None):
        super().__init__(signum, f"interrupted by {signal.Signals(signum).name}; checkpoint saved at step {step}; to "
                                 f"continue, run {resume or 'the same command with --resume'}")
        self.step = step
        self.world = world
        self.announce = world.is_main

    def settle(self) -> None:
        self.world.barrier()


@dataclass
class TrainConfig:
    """The loop's settings, taken from a run's validated settings (`pose_mlx.settings.validate` refuses bad values
    with a UserError naming the flag) or from the simulator's own; the contract is asserted."""

    steps: int = 1000
    lr: float = 2e-5
    warmup: int = 10
    max_grad_norm: float = 1.0
    grad_accum: int = 1
    grad_checkpoint: bool = False
    compile: bool = True
    kernels: str = "auto"  # "auto": `pose_mlx.kernels.route.training_route`; "mlx": MLX's own attention and loss
    loss_scale: float = 1.0
    save_every: int = 0
    eval_every: int = 0
    progress: bool = True
    resume_command: str | None = None  # what the message of an interruption tells to run (`Interrupted`)

    def __post_init__(self):
        assert self.steps >= 1 and self.grad_accum >= 1, self
        assert min(self.warmup, self.save_every, self.eval_every) >= 0, self
        assert self.lr > 0 and self.loss_scale >= 1 and self.kernels in ("auto", "mlx"), self


def learning_rate_schedule(lr: float, warmup: int, steps: int) -> Callable:
    """Learning rate of update k = 0 .. steps-1: lr * (k + 1) / warmup while k < warmup, then
    lr * (steps - k) / (steps - warmup) (linear decay; the last update uses lr / (steps - warmup))."""
    warmup = min(warmup, steps - 1)
    decay = optim.linear_schedule(lr, 0.0, max(steps - warmup, 1))
    if warmup <= 1:
        return optim.join_schedules([lambda k: lr, decay], [1]) if warmup == 1 else decay
    return optim.join_schedules([optim.linear_schedule(lr / warmup, lr, warmup - 1), decay], [warmup])


def make_optimizer(config: TrainConfig) -> optim.Optimizer:
    return optim.AdamW(learning_rate=learning_rate_schedule(config.lr, config.warmup, config.steps),
                       weight_decay=0.0)


def masked_loss(model: nn.Module, inputs: mx.array, targets: mx.array, mask: mx.array, kernels: str = "auto",
                gradient: bool = True) -> mx.array:
    """Mean cross-entropy over the tokens with mask 1 (call inside `use_positions`). With `kernels` "auto", on a
    backend without fused attention (`route.lacks_fused_backward`) a plain-head model's loss runs over the vocabulary
    in row chunks (`pose_mlx.kernels.loss`): the same value without the whole float32 logits; with "mlx" never.
    `gradient` False: a value only (not differentiable), which the chunked loss computes for less."""
    head = head_layer(model) if kernels == "auto" and route.lacks_fused_backward() else None
    if head is not None:
        trained = "weight" in head.trainable_parameters()
        total = chunked_cross_entropy(model.model(inputs), head.weight, targets, mask, gradient, trained)
    else:
        logits = model(inputs).astype(mx.float32)
        total = (nn.losses.cross_entropy(logits, targets) * mask).sum()
    return total / mx.maximum(mask.sum(), 1.0)


def evaluate(model: nn.Module, batches: Iterable, at_positions: Callable, kernels: str = "auto") -> float:
    """Token-weighted mean masked loss over `batches` (each evaluated at its own position ids), through the
    training's route (`kernels`: a training-length row keeps no L x L scores here either)."""
    total, count = 0.0, 0.0
    for batch in batches:
        mask = mx.array(batch.mask)
        with at_positions(model, *position_inputs(batch)), route.training_route(model, kernels):
            loss = masked_loss(model, mx.array(batch.inputs), mx.array(batch.targets), mask, kernels=kernels,
                               gradient=False)
        n = float(mask.sum().item())
        total += float(loss.item()) * n
        count += n
    return total / max(count, 1.0)


class _SignalFlag:
    """Records SIGINT/SIGTERM instead of dying, so the loop can finish its step and save first; a second Ctrl-C
    kills the process at once (the default action: the last checkpoint is intact, the step under way is lost, the
    lock is taken over by the next run). Restores the handlers on exit."""

    def __init__(self, announce: bool = True):
        self.signum = None
        self.announce = announce
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if self.announce:
            print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint (Ctrl-C again "
                  "to stop at once, losing the step)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _memory(gb: float) -> str:
    return f"{gb:.2f}G" if gb >= 1 else f"{gb * 1024:.0f}M"


class _Progress:
    """tqdm bar (step, loss, tok/s, peak memory, ETA) or nothing."""

    def __init__(self, enabled: bool, total: int, initial: int, compiling: bool = False):
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            if compiling:  # mx.compile traces the update on its first call: seconds on a CPU, ~90 s on a fresh GPU
                self.bar.set_description_str("compiling the training step (first update only; --no-compile skips it)")

    def update(self, record: dict, eval_loss: float | None):
        if self.bar is not None:
            if self.bar.desc:
                self.bar.set_description_str("", refresh=False)
            shown = {"loss": f"{record['loss']:.4f}"}
            if eval_loss is not None:
                shown["eval"] = f"{eval_loss:.4f}"
            shown.update(tok_s=f"{record['tokens_per_s']:.0f}", peak=_memory(record["peak_memory_gb"]))
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def train(model: nn.Module, stream, config: TrainConfig, run_dir, at_positions: Callable,
          eval_batches: Callable | None = None, resume: bool = False, world: World = SINGLE) -> dict:
    """Train `model` (its trainable parameters) on batches from `stream` for `config.steps` updates, the model
    reading each batch's position ids within `at_positions(model, ids)`.

    `stream` is a `pose_mlx.training.data.ExampleStream` (iterable of batches, with state_dict/load_state_dict);
    `run_dir` receives `checkpoint/` and `log.jsonl` (one JSON record per step: step, loss, lr,
    grad_norm, tokens, tokens_per_s, peak_memory_gb, seconds, and eval_loss when evaluated).
    `eval_batches()` returns a fresh iterable of held-out batches. Returns the last step's record.
    With several ranks (`world`), `stream` yields this rank's rows and `tokens` counts all ranks' tokens.
    """
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoint"
    log_path = run_dir / "log.jsonl"
    optimizer = make_optimizer(config)
    start, last = 0, {}
    if resume and read_state(ckpt_dir) is not None:
        record = load_checkpoint(ckpt_dir, model, optimizer)
        stream.load_state_dict(record["data"])
        start, last = record["step"], record["metrics"]
        if start >= config.steps:
            raise UserError(f"--resume: --steps {config.steps} is not more than the {counted(start, 'step')} "
                            "already trained")
        if world.is_main:
            truncate_log(log_path, start)
    elif log_path.exists() and world.is_main:
        log_path.unlink()
    saved_step = start if start else None
    eval_loss = last.get("eval_loss")

    restore_call = _enable_grad_checkpoint(model) if config.grad_checkpoint else None
    update = make_update(model, optimizer, config, at_positions, world)
    batches = iter(stream)
    bar = _Progress(config.progress and world.is_main, config.steps, start, compiling=config.compile)
    mx.reset_peak_memory()
    try:
        log_file = open(log_path, "a") if world.is_main else contextlib.nullcontext()
        with _SignalFlag(announce=world.is_main) as flag, log_file as log:
            for step in range(start + 1, config.steps + 1):
                t0 = time.perf_counter()
                loss, grad_norm, tokens, stop = update(batches, stop=flag.signum is not None)
                seconds = time.perf_counter() - t0
                last = {"step": step, "loss": loss, "lr": float(optimizer.learning_rate.item()),
                        "grad_norm": grad_norm, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
                        "peak_memory_gb": mx.get_peak_memory() / 2**30, "seconds": seconds}
                for what, value in (("the loss", loss), ("the gradient norm", grad_norm)):
                    if not math.isfinite(value):
                        if world.is_main:
                            append_log(log, last)
                        raise NonFinite(what, step, saved_step, config.loss_scale)
                if world.is_main:
                    if eval_batches is not None and config.eval_every and (step % config.eval_every == 0
                                                                            or step == config.steps):
                        eval_loss = last["eval_loss"] = evaluate(model, eval_batches(), at_positions,
                                                                 config.kernels)
                    append_log(log, last)
                bar.update(last, eval_loss)
                # one rank: the signal is seen at once; several: it travels with the next update's all-reduce
                stop = stop or (world.size == 1 and flag.signum is not None)
                if stop or step == config.steps or (config.save_every and step % config.save_every == 0):
                    if world.is_main:
                        try:
                            save_checkpoint(ckpt_dir, step, model, optimizer, stream.state_dict(), metrics=last)
                        except NonFiniteWeights:
                            raise NonFinite("a trainable weight", step, saved_step, config.loss_scale) from None
                    saved_step = step
                if stop:
                    raise Interrupted(flag.signum or signal.SIGTERM, step, world, config.resume_command)
            if world.any(flag.signum is not None):  # a signal during the last update (saved above) still stops
                raise Interrupted(flag.signum or signal.SIGTERM, config.steps, world, config.resume_command)
    finally:
        bar.close()
        if restore_call is not None:
            restore_call()
    return last


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def append_log(log, record: dict) -> None:
    """One JSON line (non-finite numbers as null), written with a single write so a kill tears at most it."""
    log.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False) + "\n")
    log.flush()


def read_log(path: Path) -> list[dict]:
    """The records of a log.jsonl; a torn last line (a run killed while writing it) is dropped."""
    records = []
    lines = Path(path).read_text().split("\n") if Path(path).exists() else []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # the unterminated last line
                break
            raise UserError(f"--resume: {path}:{number} is damaged; start over with --overwrite") from None
    return records


def truncate_log(path: Path, step: int) -> None:
    """Keep the records up to `step` (later ones were written after the last checkpoint by a killed run), via a
    temporary file renamed into place."""
    if not path.exists():
        return
    kept = [r for r in read_log(path) if isinstance(r, dict) and r.get("step", 0) <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


class UpdateResult(NamedTuple):
    """What one optimizer update reports (the same numbers on every rank)."""

    loss: float  # mean loss over the update's micro-batches (each token-weighted over the ranks)
    grad_norm: float  # global gradient norm before clipping
    tokens: int  # target tokens of the update, all ranks together
    stop: bool  # some rank called the update with stop=True


def position_inputs(batch) -> tuple:
    """The arguments after the model of `at_positions` for `batch`: (position ids,), plus the short-context row
    marks when the batch has them (`Batch.short`)."""
    short = getattr(batch, "short", None)
    ids = mx.array(batch.positions)
    return (ids,) if short is None else (ids, mx.array(short))


#: `loss_scale_for`'s scale for a float16 model: 2^12 brings the LoRA gradients of SmolLM2-135M within 2.5% of
#: float32's (bench_grad_precision) and leaves a logit's gradient, S * p / T <= 4 for T >= 1024 tokens, far from
#: float16's largest value (65504).
FLOAT16_LOSS_SCALE = 4096.0


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype holding most of the model's floating-point parameters (a quantized model's scales and
    biases count): the precision its activations are computed in."""
    sizes: dict = {}
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.size
    return max(sizes, key=sizes.get) if sizes else mx.float32


def loss_scale_for(model: nn.Module, requested: float | None = None) -> float:
    """`requested`, or by default FLOAT16_LOSS_SCALE for a model computing in float16 and 1 otherwise (float32,
    and bfloat16, whose exponent range is float32's)."""
    if requested is not None:
        return float(requested)
    return FLOAT16_LOSS_SCALE if compute_dtype(model) == mx.float16 else 1.0


def token_sum_loss(model: nn.Module, inputs: mx.array, targets: mx.array, mask: mx.array, kernels: str = "auto",
                   gradient: bool = True) -> mx.array:
    """n * `masked_loss` with n = sum_t mask_t: the summed cross-entropy whose gradient is n times the mean's."""
    return masked_loss(model, inputs, targets, mask, kernels, gradient) * mask.sum()


def scaled_value_and_grad(model: nn.Module, loss_fn: Callable, scale: float = 1.0) -> Callable:
    """`nn.value_and_grad(model, loss_fn)` with static loss scaling: differentiates `scale` * loss and returns
    (loss, gradients) divided back by `scale` (exact for a power of two, barring overflow)."""
    if scale == 1:
        return nn.value_and_grad(model, loss_fn)
    value_and_grad = nn.value_and_grad(model, lambda *a: loss_fn(*a) * scale)

    def unscaled(*args):
        loss, grads = value_and_grad(*args)
        return loss / scale, tree_map(lambda g: g / scale, grads)
    return unscaled


def make_update(model: nn.Module, optimizer: optim.Optimizer, config: TrainConfig, at_positions: Callable,
                world: World = SINGLE):
    """`update(batches, stop=False) -> UpdateResult`: one optimizer update over `config.grad_accum` micro-batches
    drawn from the iterator `batches`.

    Gradients of each micro-batch are combined over the ranks token-weighted, averaged over the micro-batches,
    clipped to `config.max_grad_norm` and applied by `optimizer`. With several ranks each micro-batch costs one
    all-reduce (`World.mean_of_sums`: the gradients of the summed loss, the summed loss, the token count and
    `stop`, flattened), so a stop request travels with the gradients and needs no sync of its own; with one rank
    `stop` is returned as given. Build it after any checkpoint was loaded: the compiled functions hold on to the
    model's and the optimizer's state.
    """
    distributed = world.size > 1
    loss_fn = functools.partial(token_sum_loss if distributed else masked_loss, kernels=config.kernels)
    value_and_grad = scaled_value_and_grad(model, loss_fn, config.loss_scale)

    def gradients(inputs, targets, mask, positions, stop):
        with at_positions(model, *positions), route.training_route(model, config.kernels):
            loss, grads = value_and_grad(model, inputs, targets, mask)
        if not distributed:
            return loss, grads, mask.sum(), stop
        (loss, grads), count, stop = world.mean_of_sums((loss, grads), mask.sum(), stop)
        return loss, grads, count, stop

    def apply(grads):
        grads, norm = optim.clip_grad_norm(grads, config.max_grad_norm)
        optimizer.update(model, grads)
        return norm

    optimizer.init(model.trainable_parameters())  # keeps loaded state; the compiled update needs it to exist
    if config.compile:
        gradients = mx.compile(gradients, inputs=model.state, outputs=model.state)
        state = [model.state, optimizer.state]
        apply = mx.compile(apply, inputs=state, outputs=state)

    def update(batches, stop: bool = False) -> UpdateResult:
        grads, losses, tokens, stops = None, [], 0, 0
        flag = mx.array(1.0 if stop else 0.0)
        for _ in range(config.grad_accum):
            batch = next(batches)
            loss, g, count, asked = gradients(mx.array(batch.inputs), mx.array(batch.targets),
                                              mx.array(batch.mask), position_inputs(batch), flag)
            if config.grad_accum > 1:
                mx.eval(loss, g, count, asked)  # one micro-batch's graph at a time
            grads = g if grads is None else tree_map(mx.add, grads, g)
            losses.append(loss)
            tokens, stops = tokens + count, stops + asked
        if config.grad_accum > 1:
            grads = tree_map(lambda x: x / config.grad_accum, grads)
        norm = apply(grads)
        mean_loss = losses[0] if len(losses) == 1 else mx.mean(mx.stack(losses))
        report = mx.stack([mean_loss.astype(mx.float32), norm.astype(mx.float32), tokens, stops])
        mx.eval(model.parameters(), optimizer.state, report)
        loss, norm, tokens, stops = report.tolist()
        return UpdateResult(loss, norm, int(tokens), stops > 0 if distributed else stop)

    return update


def _enable_grad_checkpoint(model) -> Callable:
    """Checkpoint every transformer block (mlx-lm patches the block class); returns an undo function."""
    from mlx_lm.tuner.trainer import grad_checkpoint

    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError("grad_checkpoint: the model has no .layers to checkpoint")
    cls = type(layers[0])
    original = cls.__call__
    grad_checkpoint(layers[0])

    def restore():
        cls.__call__ = original

    return restore


def probe_loss(model: nn.Module, batch, at_positions: Callable, kernels: str = "auto") -> float:
    """The model's mean loss on `batch` (at its position ids), through the training's route (`evaluate`)."""
    return evaluate(model, [batch], at_positions, kernels)


#: How far (a fraction of the uniform guess's loss ln V) a loss may end above where it started, for a model that
#: began no better than guessing, before training counts as having destroyed it (noise of a short run on a random
#: model, and float32 matmuls run as TF32 on a GPU, move its loss by hundredths of a nat).
COLLAPSE_MARGIN = 0.1


def collapse_ceiling(before: float, vocab: int) -> float:
    """The highest probe loss a trained model may have and not count as collapsed, from its own loss `before`
    training and the uniform guess u = ln(vocab), with margin m = COLLAPSE_MARGIN * u:

        u                 if before < u - m   (the model knew something: back at the guess, it has lost it all)
        max(before, u) + m  otherwise          (it began no better than guessing: only a loss well above where it
                                                began, or above the guess, means training broke it)

    A non-finite `before` leaves no reference: the ceiling is then u."""
    uniform = math.log(vocab)
    margin = COLLAPSE_MARGIN * uniform
    if not math.isfinite(before) or before < uniform - margin:
        return uniform
    return max(before, uniform) + margin


def check_not_collapsed(model: nn.Module, batch, at_positions: Callable, before: float, step: int,
                        kernels: str = "auto") -> None:
    """Collapsed when training left the model's loss on `batch` (text it should predict) non-finite or at least
    `collapse_ceiling(before, vocabulary)` (decided from the model's own loss `before` training, so a tiny random
    model that starts at the uniform guess and moves by noise is not flagged, while a pre-trained one that falls
    back to the guess is); or when its logits no longer depend on the input (every position of every row gives the
    same distribution, to 1e-4 of the logits' scale). The model runs through the training's route (`evaluate`)."""
    with at_positions(model, *position_inputs(batch)), route.training_route(model, kernels):
        logits = model(mx.array(batch.inputs)).astype(mx.float32)
    mask = mx.array(batch.mask)
    ce = nn.losses.cross_entropy(logits, mx.array(batch.targets)) * mask
    loss = float((ce.sum() / mx.maximum(mask.sum(), 1.0)).item())
    flat = logits.reshape(-1, logits.shape[-1])
    spread = float(mx.max(mx.abs(flat - flat[:1])).item())
    scale = float(mx.max(mx.abs(flat)).item())
    uniform = math.log(logits.shape[-1])
    ceiling = collapse_ceiling(before, logits.shape[-1])
    if not math.isfinite(loss) or loss >= ceiling:
        judged = (f"no better than a uniform guess ({uniform:.3f})" if ceiling == uniform else
                  f"far above where it started (the limit is {ceiling:.3f}: the uniform guess {uniform:.3f} or the "
                  f"start, whichever is higher, plus {COLLAPSE_MARGIN:.0%} of the guess)")
        raise Collapsed(f"training collapsed by step {step}: the loss on real text went from {before:.3f} to "
                        f"{loss:.3f}, {judged}; nothing was exported (start over with a lower --lr and --overwrite)")
    if spread <= 1e-4 * max(scale, 1.0):
        raise Collapsed(f"training collapsed by step {step}: the model gives the same output whatever its input; "
                        "nothing was exported (start over with a lower --lr and --overwrite)")


__all__ = ["COLLAPSE_MARGIN", "Collapsed", "FLOAT16_LOSS_SCALE", "Interrupted", "NonFinite", "TrainConfig",
           "UpdateResult", "append_log", "check_not_collapsed", "collapse_ceiling", "compute_dtype", "evaluate",
           "learning_rate_schedule", "loss_scale_for", "make_optimizer", "make_update", "masked_loss", "probe_loss",
           "read_log", "scaled_value_and_grad", "token_sum_loss", "train", "truncate_log"]
