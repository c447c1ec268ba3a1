"""The peak memory of one fine-tuning step, from the model's shapes and the run's settings alone.

One training step (what `pose_mlx.training.loop.train` logs as `peak_memory_gb`, from the second step on, once
the AdamW state exists) peaks at

    weights + LoRA adapters + AdamW state (2 x trainable x their bytes) + max(head, backward, update)

with n trained blocks, T = batch x tokens per row (window - 1 with PoSE, target - 1 with full-length sampling),
c the bytes of the compute dtype and S = batch x heads x L^2 x c, one attention-score matrix (MLX differentiates
attention through the unfused softmax(Q K^T / sqrt(d)) V, on the CPU and on Metal, so the backward keeps it):

- saved(block), what a block keeps for its backward: T c (2 hidden: the residual stream in and after attention;
  2 q_dims: q after RoPE, the attention output; 2 kv_dims: k after RoPE, v; 5 intermediate: gate, up, sigmoid,
  SiLU, product) + 8 T hidden bytes per norm (MLX's RMSNorm keeps a float32 normalized copy and its output)
  + S (the softmax output) + 4 T rank per LoRA adapter (x A). With gradient checkpointing: the block input only.
- kept(block), what a block already differentiated still holds: MLX's evaluator orders the graph so that the
  weight (or LoRA) gradient products come last, at the end of the backward; until then they hold their inputs
  and output gradients, f T c (sum of the linear layers' outputs + 2 hidden + q_dims + intermediate) + extras.
- head = n saved + 4 T vocab x 4 bytes (the float32 logits, the log-sum-exp's and softmax's temporaries, the
  logits' gradient) + a working set of T-sized arrays (the first block gradients, already allocated); with
  checkpointing, the last block's recomputed score matrix too (the evaluator runs it beside the loss's gradient).
- backward = max over k of (k saved + (n - k) kept) + 2 S (the softmax gradient and its temporary) + a working
  set of T-sized arrays; with checkpointing the block being differentiated is recomputed: its saved() returns,
  and one float32 logits-sized array of the loss is still alive.
- update (full fine-tuning) = gradients + AdamW's temporaries, 4 arrays for each parameter in flight.

Why working sets: MLX's CPU evaluator allocates the outputs of up to ~50 queued operations before the earlier
ones have run and freed their inputs, so several temporaries are alive at once (a compiled update fuses each
parameter's AdamW step into few operations, hence more parameters in flight). Their counts (`COUNTS`: per
hidden- and intermediate-sized activation, per score matrix, per parameter) were measured on small llamas with
the CPU backend; `benchmarks/bench_plan.py` checks the whole model on other models and settings. Metal fuses
RMSNorm and the loss, so there the prediction errs high.

On a GPU (`TrainSettings.backend` "cuda" or "metal") two things change. The attention: MLX's CUDA backend runs
cuDNN's fused attention for 16-bit models, which keeps no score matrix when the rows' query length is a multiple
of 128 and recomputes it in the backward otherwise (`attention_path`; Metal trains unfused, like the CPU). And the
activations, logits and temporaries are scaled by `GPU_FACTORS`, fitted to measurements on an H200 (docs/memory.md
says which numbers are measured and which modelled). Rows are those really trained: window - 1 inputs padded to
`row_multiple` (finetune's --align-rows). The weights are counted in the dtype they have once loaded
(`loaded_architecture`: a GGUF file is dequantized to float32 on the CPU, kept quantized on a GPU).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from ..errors import UserError
from ..kernels import sizes
from .architecture import Architecture, Linear, architecture
from .device import BACKENDS


@dataclass(frozen=True)
class TrainSettings:
    """What of a fine-tuning run decides its memory (`python -m pose_mlx.finetune`'s flags)."""

    window: int  # the training window Lc (PoSE trains on this many tokens per row)
    batch_size: int = 1
    lora: bool = True  # False: full fine-tuning
    lora_rank: int = 8
    lora_layers: int = -1  # LoRA in the last N blocks (-1: all)
    lora_keys: tuple | None = None  # None: mlx-lm's default, every linear layer of a block
    grad_checkpoint: bool = False
    compile: bool = True
    grad_accum: int = 1
    sampler: str = "pose"  # how position ids are drawn; "full": full-length sampling, rows of `target` tokens
    target: int | None = None
    backend: str = "cpu"  # where MLX computes: "cpu", "metal" or "cuda" (`compute_backend`)
    row_multiple: int = 1  # rows padded to a multiple of this (finetune's --align-rows; 128 when on)
    cudnn: bool = True  # with CUDA: the GPU runs cuDNN's attention (compute capability 8 or newer, `cudnn_capable`)
    kernels: str = "auto"  # finetune's --kernels: "auto" (pose_mlx.kernels where they apply) or "mlx"

    def __post_init__(self):  # the contract: built from validated settings (`run_settings`), or by tests
        assert min(self.window, self.batch_size, self.lora_rank, self.grad_accum) >= 1, self
        assert self.sampler != "full" or self.target, "full-length sampling needs the target length"
        assert self.backend in BACKENDS, self.backend

    @property
    def row_tokens(self) -> int:
        """Tokens per row the model sees: inputs are a window (or, for --sampler full, the target) minus the
        last token, which is only a label, padded up to a multiple of `row_multiple`."""
        length = self.target if self.sampler == "full" else self.window
        return -(-max(int(length) - 1, 1) // self.row_multiple) * self.row_multiple


@dataclass(frozen=True)
class Counts:
    """Arrays alive at once beyond the structural terms, in units of one activation of the given shape.

    `kept`: per block already differentiated, beyond the inputs and output gradients of its linear layers
    (T*hidden, T*intermediate); `head`: (T*vocab in fp32, T*hidden, T*intermediate); `backward`: one block's
    working set (score matrices S, T*hidden, T*intermediate); `update`: parameters whose AdamW update is in
    flight at once (4 arrays of their size each).
    """

    kept: tuple = (0, 0)
    head: tuple = (4, 8, 6)
    backward: tuple = (2, 20, 6)
    update: int = 5
    gradients: tuple = (0, 0)  # full fine-tuning: (embedding-sized at the head, block-sized in the backward)
    kept_fraction: float = 1.0  # of the linear layers' inputs and output gradients still waiting
    checkpointed: tuple = (0, 0, 0)  # with checkpointing, per block beyond its input (T*hidden, T*inter, S)
    backward16: tuple | None = None  # 16-bit models, when they differ: `backward`'s (T*hidden, T*inter), float32
    head_scores: float = 0  # with checkpointing: score matrices at the head's peak (the last block recomputed)
    backward_logits: float = 0  # float32 logits-sized arrays still alive at the backward's peak


#: Measured on small llamas with MLX's CPU backend (fp32; 1-12 blocks, hidden 32-1024, windows 64-768, batch
#: 1-4, vocabulary 512-32768; 450 runs), (lora, compile, grad_checkpoint) -> counts. Checkpointing under
#: mx.compile keeps little per block (layer sweeps: about two hidden- and one intermediate-sized array). The
#: checkpointed LoRA modes' long-row terms (`head_scores`, `backward_logits`, compiled `backward`) are fitted to
#: benchmarks/bench_plan_long_rows.py's full-length rows of 2k-8k tokens (SmolLM2-135M's block, vocabularies of
#: 512 and 49,152), where score matrices and logits dominate; `backward16` to bench_plan.py's four compiled,
#: checkpointed 16-bit runs.
COUNTS = {
    (True, False, False): Counts(head=(4, 6, 6), backward=(2, 16.5, 6), update=5),
    (True, True, False): Counts(head=(4, 8.5, 8), backward=(2, 25, 6.5), update=41),
    (True, False, True): Counts(kept=(3.5, 2.5), head=(4, 5.5, 6.5), backward=(2, 14.5, 8.5), update=5,
                                kept_fraction=0.6, head_scores=1, backward_logits=1),
    (True, True, True): Counts(kept=(2, 1), head=(4, 15, 12.5), backward=(3, 16, 4), update=41,
                               kept_fraction=0, checkpointed=(1, 0, 0), head_scores=1, backward_logits=1,
                               backward16=(20, 4)),
    (False, False, False): Counts(head=(4, 17.5, 3.5), backward=(2, 39.5, 3.5), update=13.5),
    (False, True, False): Counts(head=(4, 41.5, 3), backward=(2, 49.5, 3.5), update=40),
    (False, False, True): Counts(kept=(6.5, 2.5), head=(4, 42, 10), backward=(2, 35.5, 4.5), update=8.5,
                                 kept_fraction=0.7),
    (False, True, True): Counts(kept=(4.5, 3), head=(4, 48, 0), backward=(2.5, 40.5, 2.5), update=40.5,
                                gradients=(0.5, 0), kept_fraction=0, checkpointed=(4, 0, 0)),
}


#: The same for training through `pose_mlx.kernels` (--kernels auto on the CPU): blocked attention and the chunked
#: loss, evaluated as MLX evaluates (queued ahead, each queued operation's output allocated). Score-sized arrays are
#: one block of queries' float32 scores, logits one chunk's. What a block keeps is `COUNTS`' (checked at scale); the
#: head's and the backward's working sets and the logits alive in the backward are refitted to
#: benchmarks/bench_plan_sweep.py's runs (small llamas, 1-12 blocks, windows 128-4096, every mode).
#: The refitted terms per mode; every other count is the mode's `COUNTS`.
_BLOCKED_REFIT = {
    (True, False, False): dict(head=(4, 11.5, 6), backward=(11, 12, 0), backward_logits=1.75),
    (True, True, False): dict(head=(6, 17.5, 10), backward=(6, 20, 8.5), backward_logits=0.5),
    (True, False, True): dict(backward=(5.5, 11.5, 8.5), backward_logits=0),
    (True, True, True): dict(head=(4, 15, 13), backward=(8, 16.5, 8), backward_logits=1.5),
    (False, False, False): dict(head=(5, 25.5, 10.5), backward=(6, 38, 5.5), gradients=(8, 5), backward_logits=0.25),
    (False, True, False): dict(head=(4, 44, 6), backward=(10, 43, 0), gradients=(5.5, 0), backward_logits=0.75),
    (False, False, True): dict(head=(5.5, 44, 14.5), backward=(6, 36, 6.5), update=19, gradients=(3, 0),
                               backward_logits=0.25),
    (False, True, True): dict(head=(6.5, 52.5, 0), backward=(8, 37.5, 3), gradients=(6.5, 0)),
}
BLOCKED_COUNTS = {mode: replace(COUNTS[mode], **terms) for mode, terms in _BLOCKED_REFIT.items()}

#: The same for the fused C++ attention with the C++ RMSNorm and rotary kernels (a Linux CPU, --kernels auto): the
#: checkpointed LoRA modes refitted to benchmarks/bench_plan_long_rows.py's runs through them (SmolLM2-135M's block,
#: 2-24 blocks compiled, 2-12 eager, rows of 2k-16k, vocabularies 512 and 49,152), whose peaks grow by the same
#: multiple of T x hidden whatever the row and the vocabulary: a block already differentiated keeps one hidden- and
#: one intermediate-sized array compiled (three and a half and two eager), and one block's backward holds fewer
#: (hidden, intermediate) temporaries, (12, 6) compiled and (4, 3) eager. No run peaked at the head (the loss and
#: the forward): the compiled head's counts are the largest that keep it below every run's measured peak, one chunk
#: of logits instead of four and 9 hidden-sized arrays instead of 15. Every other mode is `BLOCKED_COUNTS`'.
_FUSED_CPU_REFIT = {
    (True, True, True): dict(kept=(1, 1), backward=(8, 12, 6), head=(1, 9, 13)),
    (True, False, True): dict(kept=(3.5, 2), backward=(5.5, 4, 3)),
}
FUSED_CPU_COUNTS = {mode: replace(counts, **_FUSED_CPU_REFIT.get(mode, {})) for mode, counts in BLOCKED_COUNTS.items()}


@dataclass
class Estimate:
    """Predicted peak bytes of one training step (or an evaluation), split into what is alive at the peak."""

    peak: int
    phase: str  # where the peak is: "head" (logits), "backward", "update" (full fine-tuning), "eval"
    breakdown: dict  # component -> bytes alive at the peak; they sum to `peak`
    details: dict  # parameter counts, per-block bytes, the other phases' peaks

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak, "phase": self.phase, "breakdown": dict(self.breakdown),
                "details": dict(self.details)}


def _lora_shapes(arch: Architecture, settings: TrainSettings) -> tuple[int, list[Linear]]:
    """(blocks with adapters, the linear layers that get one)."""
    linears = arch.block_linears()
    if settings.lora_keys is not None:
        unknown = sorted(set(settings.lora_keys) - {lin.key for lin in linears})
        if unknown:
            raise UserError(f"LoRA keys {', '.join(unknown)} are not linear layers of a {arch.family} block "
                            f"({', '.join(lin.key for lin in linears)})")
        linears = [lin for lin in linears if lin.key in settings.lora_keys]
    blocks = arch.layers if settings.lora_layers < 0 else settings.lora_layers
    assert 1 <= blocks <= arch.layers, "--lora-layers is checked against the model by pose_mlx.plan"
    return blocks, linears


def _mlp_saved(arch: Architecture, native_swiglu: bool = False) -> int:
    """T x intermediate arrays an MLP keeps for its backward: gate, up, sigmoid, silu, product (SwiGLU), or gate,
    up and product with the C++ SwiGLU of `pose_mlx.kernels` (its backward recomputes the sigmoid); gemma's GELU
    keeps its erf terms too; a plain MLP keeps its input and activation."""
    if not arch.spec.gated:
        return 3
    if arch.family in ("gemma", "gemma2"):
        return 6
    return 3 if native_swiglu else 5


#: The query length MLX's CUDA attention backward needs for cuDNN (mlx/fast.cpp and
#: mlx/backend/cuda/scaled_dot_product_attention.cpp: ScaledDotProductAttentionVJP::use_fallback).
FUSED_BACKWARD_ROWS = 128


def attention_path(arch: Architecture, settings: TrainSettings) -> str:
    """How MLX differentiates a training step's attention on `settings.backend` (see docs/memory.md for the
    sources): "unfused" (softmax(Q K^T / sqrt(d)) V, scores kept for the backward: the CPU, and Metal, which
    trains unfused on purpose), "fused" (CUDA: cuDNN forward and backward, no score matrix at all: a 16-bit
    model, head dims a multiple of 8 up to 128, rows a multiple of 128) or "fused-forward" (the same on CUDA with
    other row lengths: the forward is fused, the backward recomputes the scores through the unfused path) or
    "blocked" (`pose_mlx.kernels.attention` on the CPU and Metal with --kernels auto: queries in blocks, no score
    matrix kept; not for a family that computes attention itself, as gemma2 does for its soft-capping)."""
    if settings.kernels == "auto" and settings.backend in ("cpu", "metal") and not arch.spec.softcap:
        return "blocked"
    if settings.backend != "cuda" or not settings.cudnn or arch.dtype not in ("float16", "bfloat16") \
            or arch.spec.softcap:
        return "unfused"
    if arch.head_dim % 8 or arch.head_dim > 128:
        return "unfused"
    return "fused" if settings.row_tokens % FUSED_BACKWARD_ROWS == 0 else "fused-forward"


def _fused_cpu_attention(settings: TrainSettings) -> bool:
    """Whether the blocked attention is the fused C++ one (`kernels/cpu_attention.cpp`): on a Linux CPU, with
    --kernels auto (the kernels are built on first use there)."""
    return settings.kernels == "auto" and settings.backend == "cpu" and sys.platform.startswith("linux")


#: On a GPU, arrays that the CPU evaluator frees at once are kept until the kernels queued with them have run, so
#: more activations and temporaries are alive: (compile, grad_checkpoint) -> factor on those (not on the weights,
#: the optimizer state or the score matrices). Not derived: fitted, each to the measured peak of one configuration
#: of a random Llama-2-7B-shaped bfloat16 llama (LoRA rank 8 on every block, 4096 window, target 32k) on an
#: NVIDIA H200 (mlx-cuda 0.32.4, 2026-11-26); the factor that reproduces a measurement exactly is the one this
#: table's terms need, rounded up for a margin (docs/memory.md, "GPU factors", has the numbers):
#: - (True, True) 1.8: compiled, checkpointed, 4095-input rows: 31.4 GiB, i.e. 1.74 (2.07 before the long-row
#:   refit of COUNTS, which counts more of the step on the CPU already: score matrices, a logits array, what blocks
#:   already differentiated keep, and a 16-bit model's float32 temporaries). Measured in a session before
#:   benchmarks/bench_gpu.py existed: in no results file (gpu.json's run of it ran out of the shared GPU's memory).
#: - (False, True) 1.08: eager, checkpointed: 55.9 GiB at 4095 inputs (that session), i.e. 1.03, and 53.2 GiB at
#:   4096 (benchmarks/results/gpu/gpu.json, `plan` "eager, checkpointing"), i.e. 1.04 (1.04 and 1.05 before the
#:   long-row refit counted a logits array in the backward).
#: - (True, False) 0.86: gpu.json's "compiled, no checkpointing" (51.7 GiB at 4096 inputs) implies 0.80; 0.86 puts
#:   the prediction 5.4% above it (the eager factor, assumed before, erred 26% high). One measurement: the next
#:   bench_gpu.py run alone on a card checks it.
#: - (False, False) 1.08: assumed as eager; never measured (gpu.json skipped it for time).
#: A bench_gpu.py run alone on a GPU, another model shape, dtype or MLX version would refit them.
GPU_FACTORS = {(True, True): 1.8, (True, False): 0.86, (False, True): 1.08, (False, False): 1.08}
TRANSIENT = ("activations", "logits", "backward_temporaries", "update_temporaries")


@dataclass(frozen=True)
class _Activation:
    """Bytes of one activation of each width for the T = batch x row tokens of a step, in the compute dtype
    (the logits in float32, as the loss reads them), and of one score matrix S = batch x heads x L^2."""

    tokens: int  # T
    hidden: int  # T x hidden
    queries: int  # T x q_dims
    keys: int  # T x kv_dims (keys or values)
    intermediate: int  # T x intermediate
    logits: int  # T x vocabulary, float32
    scores: int  # S
    log_sum_exp: int  # batch x heads x L, float32 (what cuDNN's fused backward keeps instead of S)
    block_scores: int  # the float32 scores of one block of queries of the blocked attention (`kernels.sizes`)
    blocks: int  # blocks of queries per row
    chunk_logits: int  # the float32 logits of one chunk of rows of the chunked loss
    chunks: int  # chunks of rows per step


def _activation(arch: Architecture, settings: TrainSettings) -> _Activation:
    c, batch, length = arch.dtype_bytes, settings.batch_size, settings.row_tokens
    tokens = batch * length
    block, chunk = sizes.block_rows(batch, arch.heads, length, length), sizes.chunk_rows(arch.vocab)
    return _Activation(tokens, tokens * arch.hidden * c, tokens * arch.q_dims * c, tokens * arch.kv_dims * c,
                       tokens * arch.intermediate * c, tokens * arch.vocab * 4,
                       batch * arch.heads * length * length * c, batch * arch.heads * length * 4,
                       4 * batch * arch.heads * block * length, -(-length // block),
                       4 * min(tokens, chunk) * arch.vocab, -(-tokens // chunk))


@dataclass(frozen=True)
class _Trained:
    """What a step trains: n blocks, the linear layers of a block whose weight (or adapter) gradients come last,
    the trainable parameters and their bytes, and the arrays AdamW updates."""

    blocks: int
    linears: list
    parameters: int
    parameter_bytes: int  # per parameter: float32 adapters, else the model's dtype
    adapter_bytes: int  # the LoRA adapters (0: full fine-tuning trains the weights themselves)
    arrays: int
    adapter_activations: int  # bytes per block the adapters keep for their backward: x A (and float32 inputs)


def _trained(arch: Architecture, settings: TrainSettings, act: _Activation) -> _Trained:
    if settings.lora:
        blocks, linears = _lora_shapes(arch, settings)
        adapters = blocks * settings.lora_rank * sum(lin.inputs + lin.outputs for lin in linears)
        kept = len(linears) * act.tokens * settings.lora_rank * 4  # x @ A, kept for B's gradient
        if arch.dtype_bytes < 4:  # float32 adapters promote their input: each keeps a float32 copy for A's gradient
            kept += 4 * act.tokens * sum(lin.inputs for lin in linears)
        return _Trained(blocks, linears, adapters, 4, adapters * 4, 2 * blocks * len(linears), kept)
    linears = arch.block_linears()
    per_block = len(linears) + sum(lin.bias for lin in linears)
    per_block += arch.spec.block_norms * (2 if arch.spec.norm_bias else 1) + (2 if arch.spec.qk_norm else 0)
    arrays = arch.layers * per_block + 2 + (0 if arch.tied else 1) + (1 if arch.spec.norm_bias else 0)
    return _Trained(arch.layers, linears, arch.parameter_counts()["total"], arch.dtype_bytes, 0, arrays, 0)


@dataclass(frozen=True)
class _Block:
    """Bytes of one trained block in the backward pass, each split into score matrices and the rest: what it
    keeps for its backward (`saved`), what is recomputed for the block being differentiated (checkpointing), and
    what a block already differentiated still holds (`kept`, scores none)."""

    saved: float
    saved_scores: float
    recomputed: float
    recomputed_scores: float
    kept: float


def _block(arch: Architecture, settings: TrainSettings, counts: Counts, act: _Activation, trained: _Trained,
           path: str) -> _Block:
    c, norms = arch.dtype_bytes, arch.spec.block_norms
    qk_norms = 8 * (act.queries + act.keys) // c if arch.spec.qk_norm else 0  # normalized input and output
    native = path == "blocked" and settings.backend == "cpu" and c == 4  # the C++ kernels (float32 on a Linux CPU)
    if native and _fused_cpu_attention(settings):
        # RMSNorm keeps its input and output, the rotary embedding nothing (its tables are shared), the fused
        # attention its rotated queries and keys, the values and its output (and its transpose, o_proj's input)
        layers = (2 + norms) * act.hidden + 3 * act.queries + 2 * act.keys
    else:
        layers = 2 * act.hidden + norms * 8 * act.hidden // c + 2 * act.queries + 2 * act.keys
    everything = layers + _mlp_saved(arch, native) * act.intermediate + qk_norms + trained.adapter_activations
    scores = act.scores * (2 if arch.spec.softcap else 1)
    if path == "blocked":  # the blocked attention keeps the float32 log-sum-exp of each query, no scores
        everything += act.log_sum_exp
    if settings.grad_checkpoint:  # the block input stays; the block being differentiated is recomputed
        hidden_arrays, intermediate_arrays, score_arrays = counts.checkpointed
        saved = act.hidden + hidden_arrays * act.hidden + intermediate_arrays * act.intermediate
        saved_scores, recomputed, recomputed_scores = score_arrays * act.scores, everything, scores
    else:
        saved, saved_scores, recomputed, recomputed_scores = everything, scores, 0, 0
    if path != "unfused":  # fused and blocked keep no scores; the fused forward's unfused backward recomputes them
        saved_scores, recomputed_scores = 0, (scores if path == "fused-forward" else 0)
    if path == "fused":  # cuDNN's backward keeps the float32 log-sum-exp of each query instead
        saved += act.log_sum_exp if not settings.grad_checkpoint else 0
        recomputed += act.log_sum_exp
    # the inputs and output gradients of a block's linear layers wait for the (last) weight-gradient products
    # (distinct inputs: the two norm outputs, the attention output and the MLP's product)
    # (LoRA: the adapters' output gradients are float32, and so are their promoted inputs)
    output_bytes = 4 if settings.lora else c
    waiting = act.tokens * (output_bytes * sum(lin.outputs for lin in trained.linears)
                            + c * (2 * arch.hidden + arch.q_dims + arch.intermediate)) \
        + (trained.adapter_activations if c < 4 else 0)
    hidden_arrays, intermediate_arrays = counts.kept
    kept = int(counts.kept_fraction * waiting) + (hidden_arrays * act.hidden + intermediate_arrays * act.intermediate)
    return _Block(saved, saved_scores, recomputed, recomputed_scores, kept)


def _working_sets(arch: Architecture, settings: TrainSettings, counts: Counts, act: _Activation,
                  path: str) -> tuple[float, float, float, float]:
    """(logits at the head, the head's other temporaries, the backward's score-sized and other temporaries): the
    `COUNTS` arrays alive at once, in bytes."""
    c = arch.dtype_bytes
    logit_copies, hidden_arrays, intermediate_arrays = counts.head
    logits = logit_copies * act.logits + (act.tokens * arch.vocab * c if c < 4 else 0) \
        + (2 * act.logits if arch.spec.softcap else 0)
    if path == "blocked":  # the chunked loss: the chunks MLX queued ahead, and the hidden states' gradient
        logits = min(logit_copies, act.chunks) * act.chunk_logits + act.tokens * arch.hidden * (4 + c)
    # in a 16-bit model about half of these temporaries are float32 (RMSNorm, RoPE, loss, LoRA)
    wide = (c + 4) / (2 * c)
    head = wide * (hidden_arrays * act.hidden + intermediate_arrays * act.intermediate)
    score_arrays, hidden_arrays, intermediate_arrays = counts.backward
    if c < 4 and counts.backward16:  # measured apart: a 16-bit model's casts add float32 temporaries
        (hidden_arrays, intermediate_arrays), wide = counts.backward16, 4 / c
    blocked = min(score_arrays, 3 * act.blocks) * act.block_scores  # the blocks queued ahead, three arrays each
    if _fused_cpu_attention(settings):  # one primitive each way: its threads' buffers, nothing queued
        blocked = sizes.tile_scratch_bytes(arch.heads, arch.kv_heads, settings.row_tokens, settings.row_tokens,
                                           arch.head_dim)
    backward_scores = {"fused": 0, "blocked": blocked}.get(path, score_arrays * act.scores)
    backward = wide * (hidden_arrays * act.hidden + intermediate_arrays * act.intermediate)
    if not settings.lora:  # weight gradients already allocated by the evaluator running ahead
        embeddings, blocks = counts.gradients
        params = arch.parameter_counts()
        head += int(embeddings * params["embedding"] * c)
        backward += int(blocks * params["block"] * c)
    return logits, head, backward_scores, backward


def _phases(arch: Architecture, settings: TrainSettings, counts: Counts, act: _Activation, trained: _Trained,
            block: _Block, path: str) -> dict:
    """{phase: {component: bytes alive at its peak}} for the head, the backward and the update (module
    docstring), scaled by `GPU_FACTORS` on a GPU."""
    n = trained.blocks
    gradients = trained.parameters * trained.parameter_bytes
    persistent = {"weights": arch.weight_bytes(), "lora_adapters": trained.adapter_bytes,
                  "optimizer_state": 2 * gradients, "gradients": gradients if settings.grad_accum > 1 else 0}
    logits, head_rest, work_scores, work_rest = _working_sets(arch, settings, counts, act, path)
    saved, saved_scores, kept = block.saved, block.saved_scores, block.kept
    phases = {}
    recomputing = counts.head_scores * act.scores if path == "unfused" else 0  # a fused forward keeps none
    phases["head"] = {**persistent, "activations": n * saved, "attention_scores": n * saved_scores + recomputing,
                      "logits": logits, "backward_temporaries": head_rest, "update_temporaries": 0}
    # the backward's peak: k blocks still to differentiate keep what they saved, the n - k done ones what waits
    last = max(range(1, n + 1), key=lambda k: k * (saved + saved_scores) + (n - k) * kept)
    phases["backward"] = {**persistent, "activations": last * saved + (n - last) * kept,
                          "attention_scores": last * saved_scores + work_scores + block.recomputed_scores,
                          "logits": counts.backward_logits * (act.chunk_logits if path == "blocked" else act.logits),
                          "backward_temporaries": work_rest + block.recomputed, "update_temporaries": 0}
    in_flight = min(trained.arrays, counts.update)
    phases["update"] = {**persistent, "gradients": gradients, "activations": 0, "attention_scores": 0, "logits": 0,
                        "backward_temporaries": 0,
                        "update_temporaries": 4 * in_flight * gradients // max(trained.arrays, 1)}
    if settings.backend != "cpu":
        factor = GPU_FACTORS[(settings.compile, settings.grad_checkpoint)]
        phases = {name: {k: v * factor if k in TRANSIENT else v for k, v in parts.items()}
                  for name, parts in phases.items()}
    return {name: {k: int(v) for k, v in parts.items()} for name, parts in phases.items()}


def training_memory(config: dict | Architecture, settings: TrainSettings) -> Estimate:
    """Peak bytes of one training step of `settings` on the model of `config` (second and later steps,
    when the AdamW state exists): see the module docstring for the terms."""
    arch = config if isinstance(config, Architecture) else architecture(config)
    if not settings.lora and arch.quant_bits:
        raise UserError("full fine-tuning cannot train a quantized model; use LoRA (--lora) or an unquantized base")
    path = attention_path(arch, settings)
    table = COUNTS if path != "blocked" else FUSED_CPU_COUNTS if _fused_cpu_attention(settings) else BLOCKED_COUNTS
    counts = table[(settings.lora, settings.compile, settings.grad_checkpoint)]
    act = _activation(arch, settings)
    trained = _trained(arch, settings, act)
    block = _block(arch, settings, counts, act, trained, path)
    phases = _phases(arch, settings, counts, act, trained, block, path)
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    phase = max(totals, key=totals.get)
    details = {
        "parameters": arch.parameter_counts()["total"], "trainable_parameters": trained.parameters,
        "trained_blocks": trained.blocks, "tokens_per_row": settings.row_tokens,
        "tokens_per_step": act.tokens * settings.grad_accum, "dtype": arch.dtype,
        "activation_bytes_per_block": block.saved + block.saved_scores, "score_matrix_bytes": act.scores,
        "logits_bytes": act.logits, "phase_peaks": totals, "family": arch.family, "known_family": arch.known,
        "warnings": list(arch.warnings), "backend": settings.backend, "attention": path,
    }
    return Estimate(totals[phase], phase, phases[phase], details)
