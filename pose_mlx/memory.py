"""How much memory a fine-tuning run (or an evaluation) will take, from the model's config.json alone.

PoSE's premise is that training memory depends on the training window, not on the target length; this module
turns that into numbers before a single weight is loaded. Inputs are shapes and dtypes only (a Hugging Face
style config dict and the run's settings); nothing here imports MLX at module level.

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
  logits' gradient) + a working set of T-sized arrays (the first block gradients, already allocated).
- backward = max over k of (k saved + (n - k) kept) + 2 S (the softmax gradient and its temporary) + a working
  set of T-sized arrays; with checkpointing the block being differentiated is recomputed: its saved() returns.
- update (full fine-tuning) = gradients + AdamW's temporaries, 4 arrays for each parameter in flight.

Why working sets: MLX's CPU evaluator allocates the outputs of up to ~50 queued operations before the earlier
ones have run and freed their inputs, so several temporaries are alive at once (a compiled update fuses each
parameter's AdamW step into few operations, hence more parameters in flight). Their counts (`COUNTS`: per
hidden- and intermediate-sized activation, per score matrix, per parameter) were measured on small llamas with
the CPU backend; `benchmarks/bench_plan.py` checks the whole model on other models and settings. Metal fuses
RMSNorm and the loss, so there the prediction errs high. Families other than llama map onto the same terms
(extra norms, q/k norms, fused projections, biases); a family this module does not know is estimated from the
config's shapes as a llama-style block, with a warning.

On a GPU (`TrainSettings.backend` "cuda" or "metal") two things change. The attention: MLX's CUDA backend runs
cuDNN's fused attention for 16-bit models, which keeps no score matrix when the rows' query length is a multiple
of 128 and recomputes it in the backward otherwise (`attention_path`; Metal trains unfused, like the CPU). And the
activations, logits and temporaries are scaled by `GPU_FACTORS`, fitted to measurements on an H200 (docs/memory.md
says which numbers are measured and which modelled). Rows are those really trained: window - 1 inputs padded to
`row_multiple` (finetune's --align-rows). The weights are counted in the dtype they have once loaded
(`loaded_architecture`: a GGUF file is dequantized to float32 on the CPU, kept quantized on a GPU).

`eval_memory` predicts chunked-prefill evaluation (`pose_mlx.perplexity`, `pose_mlx.passkey`); `plan_memory` and
`check_fits` compare a prediction with the memory available (`available_memory`, `parse_size`).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace

from .errors import UserError
from .model.gguf import read_header
from .training.data import row_multiple

# Imported inside functions, on purpose: MLX, each where it is used: they are costly to import or unneeded on the
# paths that import this module (`--help`, `plan`, the NumPy-only parts).

GiB = 2**30
BACKENDS = ("cpu", "metal", "cuda")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
#: Keys every config must have (the planner names the missing ones).
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")


# ------------------------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class Family:
    """How mlx-lm builds one model family's blocks (what differs from llama)."""

    head_dim_from_config: bool = True  # else hidden / heads (qwen2, phi3, starcoder2 ignore head_dim)
    tie_default: bool | None = True  # mlx-lm's default when the config has no tie_word_embeddings; None: required
    always_tied: bool = False  # gemma, gemma2: the output layer is the embedding
    bias_keys: bool = False  # llama/olmo2 read attention_bias / mlp_bias from the config
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused_qkv: bool = False  # phi3: one qkv_proj
    fused_gate_up: bool = False  # phi3: one gate_up_proj
    gated: bool = True  # gate * up MLP (False: starcoder2's c_fc -> gelu -> c_proj)
    block_norms: int = 2  # RMSNorms (or LayerNorms) of hidden size per block
    norm_bias: bool = False  # LayerNorm (starcoder2)
    qk_norm: str = ""  # "head": q_norm/k_norm of head_dim (qwen3); "proj": of q/kv dims (olmo2)
    softcap: bool = False  # gemma2: tanh soft-capping of scores and logits (more score-sized temporaries)


FAMILIES = {
    "llama": Family(bias_keys=True),
    "mistral": Family(bias_keys=True),  # mlx-lm builds it with the llama module
    "qwen2": Family(head_dim_from_config=False, qkv_bias=True),
    "qwen3": Family(tie_default=None, qk_norm="head"),
    "gemma": Family(always_tied=True),
    "gemma2": Family(always_tied=True, block_norms=4, softcap=True),
    "phi3": Family(head_dim_from_config=False, tie_default=False, fused_qkv=True, fused_gate_up=True),
    "starcoder2": Family(head_dim_from_config=False, qkv_bias=True, o_bias=True, mlp_bias=True, gated=False,
                         norm_bias=True),
    "olmo2": Family(bias_keys=True, qk_norm="proj"),
}


@dataclass(frozen=True)
class Linear:
    """One linear layer of a block: mlx-lm's module key, input and output features, bias."""

    key: str
    inputs: int
    outputs: int
    bias: bool = False

    @property
    def parameters(self) -> int:
        return self.inputs * self.outputs + (self.outputs if self.bias else 0)


@dataclass(frozen=True)
class Architecture:
    """The shapes that decide memory, read from a config.json (`architecture(config)`)."""

    family: str
    known: bool
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype: str  # of the unquantized parameters (and of the activations)
    quant_bits: int | None = None
    quant_group: int | None = None
    spec: Family = field(default_factory=Family)
    warnings: tuple = ()
    prequantized: bool = False  # a GGUF file's quantized weights (config["gguf_quantization"]): not advised to quantize
    loaded_bytes: int | None = None  # the weights' bytes as the loader really holds them (`loaded_architecture`)

    @property
    def q_dims(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dims(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def block_linears(self) -> list[Linear]:
        """The linear layers of one block, named as mlx-lm names them (these are LoRA's default keys)."""
        f, d, i = self.spec, self.hidden, self.intermediate
        qkv_bias, o_bias, mlp_bias = f.qkv_bias, f.o_bias, f.mlp_bias
        if f.fused_qkv:
            attn = [Linear("self_attn.qkv_proj", d, self.q_dims + 2 * self.kv_dims, qkv_bias)]
        else:
            attn = [Linear("self_attn.q_proj", d, self.q_dims, qkv_bias),
                    Linear("self_attn.k_proj", d, self.kv_dims, qkv_bias),
                    Linear("self_attn.v_proj", d, self.kv_dims, qkv_bias)]
        attn.append(Linear("self_attn.o_proj", self.q_dims, d, o_bias))
        if not f.gated:
            mlp = [Linear("mlp.c_fc", d, i, mlp_bias), Linear("mlp.c_proj", i, d, mlp_bias)]
        elif f.fused_gate_up:
            mlp = [Linear("mlp.gate_up_proj", d, 2 * i, mlp_bias), Linear("mlp.down_proj", i, d, mlp_bias)]
        else:
            mlp = [Linear("mlp.gate_proj", d, i, mlp_bias), Linear("mlp.up_proj", d, i, mlp_bias),
                   Linear("mlp.down_proj", i, d, mlp_bias)]
        return attn + mlp

    def block_norm_parameters(self) -> int:
        n = self.spec.block_norms * self.hidden * (2 if self.spec.norm_bias else 1)
        if self.spec.qk_norm == "head":
            n += 2 * self.head_dim
        elif self.spec.qk_norm == "proj":
            n += self.q_dims + self.kv_dims
        return n

    def parameter_counts(self) -> dict:
        """Exact parameter counts of the model mlx-lm builds from this config (the unquantized shapes)."""
        block_linear = sum(lin.parameters for lin in self.block_linears())
        block = block_linear + self.block_norm_parameters()
        embedding = self.vocab * self.hidden
        lm_head = 0 if self.tied else self.vocab * self.hidden
        final_norm = self.hidden * (2 if self.spec.norm_bias else 1)
        total = embedding + lm_head + final_norm + self.layers * block
        return {"embedding": embedding, "lm_head": lm_head, "final_norm": final_norm, "block": block,
                "block_linear": block_linear, "blocks": self.layers * block, "total": total}

    def weight_bytes(self) -> int:
        """Bytes of the weights as loaded: the config's dtype, or mlx-lm's quantized layout (packed uint32
        weights of `bits` per value plus one scale and one bias per `group_size` values, in the dtype); or, when
        set, `loaded_bytes`, what the loader of a GGUF file really holds."""
        if self.loaded_bytes is not None:
            return self.loaded_bytes
        counts = self.parameter_counts()
        c = self.dtype_bytes
        if not self.quant_bits:
            return counts["total"] * c
        matrices = [(lin.inputs, lin.outputs) for lin in self.block_linears()] * self.layers
        matrices.append((self.hidden, self.vocab))  # embedding (its rows are quantized like a linear's)
        if not self.tied:
            matrices.append((self.hidden, self.vocab))
        quantized = sum(self._quantized_bytes(n_in, n_out) for n_in, n_out in matrices)
        plain = counts["total"] - sum(n_in * n_out for n_in, n_out in matrices)  # norms and biases
        return quantized + plain * c

    def _quantized_bytes(self, n_in: int, n_out: int) -> int:
        if n_in % self.quant_group:  # mlx-lm leaves layers it cannot group unquantized
            return n_in * n_out * self.dtype_bytes
        return n_out * n_in * self.quant_bits // 8 + 2 * n_out * (n_in // self.quant_group) * self.dtype_bytes

    def describe(self) -> str:
        quant = f", {self.quant_bits}-bit (group {self.quant_group})" if self.quant_bits else ""
        return (f"{self.family}{'' if self.known else ' (unknown family)'}: {self.layers} blocks, hidden "
                f"{self.hidden}, {self.heads} heads ({self.kv_heads} kv) x {self.head_dim}, intermediate "
                f"{self.intermediate}, vocabulary {self.vocab}, {self.dtype}{quant}")


def _dtype(config: dict) -> tuple[str, str | None]:
    """(dtype, warning) from torch_dtype / dtype; 16-bit with a warning when absent."""
    raw = config.get("torch_dtype") or config.get("dtype")
    if raw is None:
        return "float16", "config.json names no torch_dtype; assuming 16-bit weights"
    name = str(raw).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise UserError(f"config.json: torch_dtype {raw!r} is not one of {', '.join(DTYPE_BYTES)}")
    return name, None


def architecture(config: dict) -> Architecture:
    """The memory-relevant shapes of a model config (HF config.json keys, mlx-lm's `quantization`).

    `config` as `pose_mlx.model.source.read_config` gives it: the type of every size was checked there
    (`check_config`). Raises UserError naming the missing keys and the shapes that do not fit together. A model_type
    this module does not know is estimated as a llama-style block, with a warning in `Architecture.warnings`.
    """
    if not isinstance(config, dict):
        raise UserError("config.json must hold a JSON object")
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:  # multimodal wrappers keep the LM here
        config = {**config, **text}
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise UserError(f"config.json lacks {', '.join(missing)} (needed to estimate memory)")
    hidden, layers, inter, heads, vocab = (config[k] for k in REQUIRED_KEYS)
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UserError(f"config.json: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    model_type = str(config.get("model_type") or "unknown")
    known = model_type in FAMILIES
    spec = FAMILIES.get(model_type, FAMILIES["llama"])
    warnings = []
    if not known:
        warnings.append(f"model_type {model_type!r} is not a family the planner knows; its parameters and "
                        "activations are estimated from the config's shapes as a llama-style block")
    if spec.bias_keys:
        spec = replace(spec, qkv_bias=bool(config.get("attention_bias", False)),
                       o_bias=bool(config.get("attention_bias", False)), mlp_bias=bool(config.get("mlp_bias", False)))
    if spec.head_dim_from_config and config.get("head_dim"):
        head_dim = config["head_dim"]
    else:
        if hidden % heads:
            raise UserError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                            "give head_dim")
        head_dim = hidden // heads
    if spec.always_tied:
        tied = True
    elif "tie_word_embeddings" in config:
        tied = bool(config["tie_word_embeddings"])
    elif spec.tie_default is None:
        raise UserError(f"config.json lacks tie_word_embeddings (required for {model_type})")
    else:
        tied = spec.tie_default
    dtype, warning = _dtype(config)
    if warning:
        warnings.append(warning)
    bits = group = None
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("bits"):
        bits, group = int(quant["bits"]), int(quant.get("group_size", 64))
        if bits not in (2, 3, 4, 5, 6, 8) or group <= 0:
            raise UserError(f"config.json: quantization bits={bits}, group_size={group} is not a layout mlx-lm writes")
    return Architecture(model_type, known, hidden, layers, inter, heads, kv_heads, head_dim, vocab, tied, dtype,
                        bits, group, spec, tuple(warnings), bool(config.get("gguf_quantization")))


def gguf_loaded(arch: Architecture, tensors, backend: str) -> Architecture:
    """`arch` as `pose_mlx.model.gguf.load_gguf` really loads a GGUF file of `tensors` ((type name, shape) pairs)
    on `backend`: on the CPU every tensor dequantized to float32; on a GPU in the file's precision (float32 for an
    all-F32 file, bfloat16 when it has BF16 tensors, else float16) with Q8_0/Q4_0/Q4_1 matrices kept as MLX's
    affine quantization (group 32: bits/8 bytes per value, a scale and a bias per group in that precision).
    The activations follow the same dtype; the weights' bytes are summed tensor by tensor (`loaded_bytes`)."""
    quant = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
    tensors = [(str(kind), tuple(int(n) for n in shape)) for kind, shape in tensors]
    kinds = {kind for kind, _ in tensors}
    if backend == "cpu" or kinds == {"F32"}:
        dtype = "float32"
    else:
        dtype = "bfloat16" if "BF16" in kinds else "float16"
    c, total, bits = DTYPE_BYTES[dtype], 0, Counter()
    for kind, shape in tensors:
        n = math.prod(shape)
        if backend != "cpu" and kind in quant and len(shape) == 2:
            total += n * quant[kind] // 8 + 2 * (n // 32) * c
            bits[quant[kind]] += n
        else:
            total += n * c
    kept = bits.most_common(1)[0][0] if bits else None
    warnings = tuple(w for w in arch.warnings if "torch_dtype" not in w)  # the file's tensors say the dtype
    return replace(arch, dtype=dtype, quant_bits=kept, quant_group=32 if kept else None, loaded_bytes=total,
                   warnings=warnings)


def loaded_architecture(config: dict, ref=None, backend: str | None = None) -> Architecture:
    """The shapes of `config` with the dtype and weight bytes the model has once loaded on `backend` (default:
    MLX's, `compute_backend`): a GGUF file (`ref` a `pose_mlx.model.source.ModelRef`) as `gguf_loaded` says; a
    model folder as its config says (mlx-lm keeps the stored dtype and quantization)."""
    arch = architecture(config)
    if ref is None or not getattr(ref, "is_gguf", False):
        return arch
    header = read_header(ref.path)
    return gguf_loaded(arch, [(t.type_name, t.shape) for t in header.tensors.values()],
                       backend or compute_backend())


# ------------------------------------------------------------------------------------------- the run


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


#: Measured on small llamas with MLX's CPU backend (fp32; 1-12 blocks, hidden 32-1024, windows 64-768, batch
#: 1-4, vocabulary 512-32768; 450 runs), (lora, compile, grad_checkpoint) -> counts. Checkpointing under
#: mx.compile keeps little per block (layer sweeps: about one hidden- and one intermediate-sized array).
COUNTS = {
    (True, False, False): Counts(head=(4, 6, 6), backward=(2, 16.5, 6), update=5),
    (True, True, False): Counts(head=(4, 8.5, 8), backward=(2, 25, 6.5), update=41),
    (True, False, True): Counts(kept=(3.5, 2.5), head=(4, 5.5, 6.5), backward=(2, 14.5, 8.5), update=5,
                                kept_fraction=0.6),
    (True, True, True): Counts(kept=(1, 1), head=(4, 15, 12.5), backward=(2.5, 24, 9), update=41,
                               kept_fraction=0, checkpointed=(2, 0, 0)),
    (False, False, False): Counts(head=(4, 17.5, 3.5), backward=(2, 39.5, 3.5), update=13.5),
    (False, True, False): Counts(head=(4, 41.5, 3), backward=(2, 49.5, 3.5), update=40),
    (False, False, True): Counts(kept=(6.5, 2.5), head=(4, 42, 10), backward=(2, 35.5, 4.5), update=8.5,
                                 kept_fraction=0.7),
    (False, True, True): Counts(kept=(4.5, 3), head=(4, 48, 0), backward=(2.5, 40.5, 2.5), update=40.5,
                                gradients=(0.5, 0), kept_fraction=0, checkpointed=(4, 0, 0)),
}


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


def _mlp_saved(arch: Architecture) -> int:
    """T x intermediate arrays an MLP keeps for its backward: gate, up, sigmoid, silu, product (SwiGLU);
    gemma's GELU keeps its erf terms too; a plain MLP keeps its input and activation."""
    if not arch.spec.gated:
        return 3
    return 6 if arch.family in ("gemma", "gemma2") else 5


#: The query length MLX's CUDA attention backward needs for cuDNN (mlx/fast.cpp and
#: mlx/backend/cuda/scaled_dot_product_attention.cpp: ScaledDotProductAttentionVJP::use_fallback).
FUSED_BACKWARD_ROWS = 128


def attention_path(arch: Architecture, settings: TrainSettings) -> str:
    """How MLX differentiates a training step's attention on `settings.backend` (see docs/memory.md for the
    sources): "unfused" (softmax(Q K^T / sqrt(d)) V, scores kept for the backward: the CPU, and Metal, which
    trains unfused on purpose), "fused" (CUDA: cuDNN forward and backward, no score matrix at all: a 16-bit
    model, head dims a multiple of 8 up to 128, rows a multiple of 128) or "fused-forward" (the same on CUDA with
    other row lengths: the forward is fused, the backward recomputes the scores through the unfused path)."""
    if settings.backend != "cuda" or not settings.cudnn or arch.dtype not in ("float16", "bfloat16") \
            or arch.spec.softcap:
        return "unfused"
    if arch.head_dim % 8 or arch.head_dim > 128:
        return "unfused"
    return "fused" if settings.row_tokens % FUSED_BACKWARD_ROWS == 0 else "fused-forward"


#: On a GPU, arrays that the CPU evaluator frees at once are kept until the kernels queued with them have run, so
#: more activations and temporaries are alive: (compile, grad_checkpoint) -> factor on those (not on the weights,
#: the optimizer state or the score matrices). Fitted to one H200 measurement each (Llama-2-7B shape, bfloat16,
#: LoRA, checkpointing, 4k window: compiled 31.4 GiB, eager 55.9 GiB) with a margin; the modes without
#: checkpointing were not measured and take the eager factor.
GPU_FACTORS = {(True, True): 2.15, (True, False): 1.08, (False, True): 1.08, (False, False): 1.08}
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


def _activation(arch: Architecture, settings: TrainSettings) -> _Activation:
    c, batch, length = arch.dtype_bytes, settings.batch_size, settings.row_tokens
    tokens = batch * length
    return _Activation(tokens, tokens * arch.hidden * c, tokens * arch.q_dims * c, tokens * arch.kv_dims * c,
                       tokens * arch.intermediate * c, tokens * arch.vocab * 4,
                       batch * arch.heads * length * length * c, batch * arch.heads * length * 4)


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
    everything = (2 * act.hidden + norms * 8 * act.hidden // c + 2 * act.queries + 2 * act.keys
                  + _mlp_saved(arch) * act.intermediate + qk_norms + trained.adapter_activations)
    scores = act.scores * (2 if arch.spec.softcap else 1)
    if settings.grad_checkpoint:  # the block input stays; the block being differentiated is recomputed
        hidden_arrays, intermediate_arrays, score_arrays = counts.checkpointed
        saved = act.hidden + hidden_arrays * act.hidden + intermediate_arrays * act.intermediate
        saved_scores, recomputed, recomputed_scores = score_arrays * act.scores, everything, scores
    else:
        saved, saved_scores, recomputed, recomputed_scores = everything, scores, 0, 0
    if path != "unfused":  # the fused forward keeps no scores; the unfused backward recomputes them
        saved_scores, recomputed_scores = 0, (0 if path == "fused" else scores)
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
    # in a 16-bit model about half of these temporaries are float32 (RMSNorm, RoPE, loss, LoRA)
    wide = (c + 4) / (2 * c)
    head = wide * (hidden_arrays * act.hidden + intermediate_arrays * act.intermediate)
    score_arrays, hidden_arrays, intermediate_arrays = counts.backward
    backward_scores = 0 if path == "fused" else score_arrays * act.scores
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
    phases["head"] = {**persistent, "activations": n * saved, "attention_scores": n * saved_scores,
                      "logits": logits, "backward_temporaries": head_rest, "update_temporaries": 0}
    # the backward's peak: k blocks still to differentiate keep what they saved, the n - k done ones what waits
    last = max(range(1, n + 1), key=lambda k: k * (saved + saved_scores) + (n - k) * kept)
    phases["backward"] = {**persistent, "activations": last * saved + (n - last) * kept,
                          "attention_scores": last * saved_scores + work_scores + block.recomputed_scores,
                          "logits": 0, "backward_temporaries": work_rest + block.recomputed, "update_temporaries": 0}
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
    counts = COUNTS[(settings.lora, settings.compile, settings.grad_checkpoint)]
    act = _activation(arch, settings)
    trained = _trained(arch, settings, act)
    path = attention_path(arch, settings)
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


# ------------------------------------------------------------------------------------------- the machine


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_size(text) -> int:
    """'64GB' | '64G' | '16GiB' | '512M' | '1.5T' | 123456 (bytes) -> bytes. Units are binary (G = GiB = 2^30),
    as memory is sold and as `mx.get_peak_memory()` is usually read; a bare number is bytes."""
    if isinstance(text, bool):
        raise UserError(f"memory size {text!r} is not a size")
    if isinstance(text, (int, float)):
        if text <= 0 or (isinstance(text, float) and not math.isfinite(text)):
            raise UserError(f"memory size {text!r} must be positive")
        return int(text)
    match = _SIZE.fullmatch(str(text))
    if not match or (match.group(3) and not match.group(2)):
        raise UserError(f"memory size {text!r} is not a size: use e.g. 64GB, 64G, 16GiB, 512M or a number of bytes")
    value = float(match.group(1)) * 1024 ** " kmgtp".index(match.group(2).lower() or " ")
    if value < 1:
        raise UserError(f"memory size {text!r} must be at least one byte")
    return int(value)


def compute_backend() -> str:
    """Where MLX computes by default: "cuda", "metal" or "cpu" (also "cpu" when MLX is not importable)."""
    try:
        import mlx.core as mx
    except ImportError:
        return "cpu"
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "metal"


def cudnn_capable(info: dict | None = None) -> bool:
    """Whether MLX's CUDA backend may run cuDNN's fused attention on this GPU: compute capability 8 (Ampere) or
    newer, from `info` (default `mx.device_info()`); True when the device does not say."""
    if info is None:
        import mlx.core as mx

        info = mx.device_info()
    return int(info.get("compute_capability_major", 8)) >= 8


#: MLX's CUDA allocator caps its pool at this fraction of the GPU's total memory.
CUDA_LIMIT_FRACTION = 0.95


def available_memory(*, backend: str | None = None, info: dict | None = None,
                     meminfo: str = "/proc/meminfo") -> tuple[int, str]:
    """(bytes a run may use, where the number comes from), from the device MLX computes on (`compute_backend`):

    - cuda: the GPU's free memory (`mx.device_info()["free_memory"]`, cudaMemGetInfo), at most MLX's allocator
      limit of 95% of `total_memory`;
    - metal: the recommended working set (`max_recommended_working_set_size`; `memory_size` without it);
    - cpu: Linux's MemAvailable in `meminfo`, else the physical memory (os.sysconf).

    `backend` and `info` (a device_info dict) default to MLX's; tests pass them to check the contract. A GPU
    whose device_info names no memory falls back to the host's numbers."""
    backend = backend or compute_backend()
    if backend != "cpu":
        if info is None:
            import mlx.core as mx

            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        if backend == "cuda":
            total, free = int(info.get("total_memory", 0)), int(info.get("free_memory", 0))
            if total or free:
                limit = int(CUDA_LIMIT_FRACTION * total) if total else free
                return min(free or limit, limit), "the GPU's free memory, at most 95% of its total (mx.device_info)"
        else:
            size = int(info.get("max_recommended_working_set_size", 0))
            if size:
                return size, "the GPU's recommended working set (mx.device_info)"
            if int(info.get("memory_size", 0)):
                return int(info["memory_size"]), "the GPU's memory size (mx.device_info)"
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, f"MemAvailable in {meminfo}"
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory (os.sysconf)"
    except (ValueError, OSError, AttributeError):
        raise UserError("cannot tell how much memory this machine has; pass --max-memory") from None


def format_size(nbytes: int | float) -> str:
    """Bytes in binary units with three significant digits: '12.6 GiB', '340 MiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1000 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def format_count(n: int | float) -> str:
    """A count with three significant digits: '6.74 B', '20 M', '512'."""
    for scale, suffix in ((1e9, " B"), (1e6, " M"), (1e3, " K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


# ------------------------------------------------------------------------------------------- the verdict


@dataclass
class Plan:
    """The prediction for a run against the memory it may use, and what to change when it does not fit."""

    estimate: Estimate
    settings: TrainSettings
    available: int
    largest_batch: int  # 0: not even one row fits
    largest_window: int  # 0: not even a 2-token window fits (PoSE only; full-length sampling trains at the target)
    suggestions: list  # {"change", "peak_bytes", "fits"}

    @property
    def fits(self) -> bool:
        return self.estimate.peak <= self.available

    def advice(self) -> str:
        """One clause: the first change that fits, else the one with the smallest predicted peak (each change is a
        noun phrase: "with gradient checkpointing (--grad-checkpoint) it needs about 5 GiB")."""
        fitting = [s for s in self.suggestions if s["fits"]]
        if fitting:
            return f"with {fitting[0]['change']} it needs about {format_size(fitting[0]['peak_bytes'])}"
        if self.suggestions:
            best = min(self.suggestions, key=lambda s: s["peak_bytes"])
            return f"even with {best['change']} it needs about {format_size(best['peak_bytes'])}"
        return "no change the planner knows of makes it fit"

    def as_dict(self) -> dict:
        return {**self.estimate.as_dict(), "available_bytes": self.available, "fits": self.fits,
                "largest_batch": self.largest_batch, "largest_window": self.largest_window,
                "suggestions": list(self.suggestions)}


def _largest(fits, low: int, high: int) -> int:
    """Largest n in [low, high] with fits(n) (fits is monotone), or low - 1 when none."""
    if not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def plan_memory(config: dict | Architecture, settings: TrainSettings, available: int) -> Plan:
    """Predict `settings` on `config` and search what fits into `available` bytes."""
    arch = config if isinstance(config, Architecture) else architecture(config)
    estimate = training_memory(arch, settings)

    def peak(arch_=arch, **changes) -> int:
        return training_memory(arch_, replace(settings, **changes)).peak

    largest_batch = _largest(lambda b: peak(batch_size=b) <= available, 1, 1 << 16)
    largest_window = 0
    if settings.sampler != "full":
        high = max(settings.target or settings.window, settings.window)
        largest_window = _largest(lambda w: peak(window=w) <= available, 2, high)
    # in order of preference: the cheapest change to the run first
    options = []
    if not settings.grad_checkpoint:
        options.append(("gradient checkpointing (--grad-checkpoint)", arch, {"grad_checkpoint": True}))
    if settings.batch_size > 1 and 1 <= largest_batch < settings.batch_size:
        accum = math.ceil(settings.batch_size * settings.grad_accum / largest_batch)
        options.append((f"--batch-size {largest_batch} --grad-accum {accum} (the same tokens per update)", arch,
                        {"batch_size": largest_batch, "grad_accum": accum}))
    if not settings.lora:
        options.append(("LoRA adapters instead of all weights (--lora)", arch, {"lora": True}))
    quantize = not arch.quant_bits and not arch.prequantized  # never advise quantizing quantized weights
    q4 = replace(arch, quant_bits=4, quant_group=64, loaded_bytes=None) if quantize else arch
    if quantize:
        options.append(("a 4-bit quantized base with LoRA (mlx_lm.convert -q)", q4, {"lora": True}))
    if settings.sampler != "full" and 2 <= largest_window < settings.window:
        options.append((f"a shorter training window (--window {largest_window})", arch, {"window": largest_window}))
    if sum(1 for text, _, _ in options if "window" not in text and "batch" not in text) > 1:
        options.append((("a 4-bit base, " if quantize else "") + "LoRA and gradient checkpointing together", q4,
                        {"lora": True, "grad_checkpoint": True}))
    suggestions = []
    for text, arch_, changes in options:
        value = peak(arch_, **changes)
        suggestions.append({"change": text, "peak_bytes": value, "fits": value <= available})
    return Plan(estimate, settings, available, largest_batch, largest_window, suggestions)


def run_settings(run, window: int, target: int | None, backend: str | None = None) -> TrainSettings:
    """The memory model's view of a fine-tuning run's settings (`pose_mlx.settings.RunSettings`) at the resolved
    training window and target, on `backend` (default: where MLX computes), with the rows it really trains
    (--align-rows)."""
    backend = backend or compute_backend()
    return TrainSettings(window=window, batch_size=run.batch_size, lora=not run.full, lora_rank=run.lora_rank,
                         lora_layers=run.lora_layers, grad_checkpoint=run.grad_checkpoint, compile=run.compile,
                         grad_accum=run.grad_accum, sampler=run.sampler, target=target, backend=backend,
                         row_multiple=row_multiple(run.align_rows, backend),
                         cudnn=backend != "cuda" or cudnn_capable())


def limit(run) -> tuple[int, str]:
    """(bytes, where from) a run may use: its --max-memory, else what this machine offers."""
    return (parse_size(run.max_memory), "--max-memory") if run.max_memory else available_memory()


def check_run(config: dict, run, window: int, target: int | None, ref=None) -> Plan | None:
    """The memory plan of a fine-tuning run (None when it trains nothing); refuses (UserError, one line with the
    change that fits) a run whose predicted peak exceeds its limit, unless it asks to be forced (`run.force`).
    `ref` (a `pose_mlx.model.source.ModelRef`): the model as loaded on this backend (`loaded_architecture`)."""
    if run.sampler == "none":
        return None
    settings, available = run_settings(run, window, target), limit(run)[0]
    arch = loaded_architecture(config, ref, settings.backend)
    return plan_memory(arch, settings, available) if run.force else check_fits(arch, settings, available)


def check_fits(config: dict | Architecture, settings: TrainSettings, max_memory: int) -> Plan:
    """The plan of the run; raises UserError (one line with the best change) when the predicted peak exceeds
    `max_memory` bytes (finetune's --max-memory; --force skips this check)."""
    plan = plan_memory(config, settings, max_memory)
    if not plan.fits:
        raise UserError(f"this run needs about {format_size(plan.estimate.peak)} at its peak, more than "
                        f"{format_size(max_memory)}; {plan.advice()}; or --force to try anyway")
    return plan


# ------------------------------------------------------------------------------------------- evaluation

KV_CACHE_STEP = 256  # mlx-lm's KVCache grows its buffers by this many positions
TILE_BYTES = 32 << 20  # pose_mlx.eval.cpu_attention's score tile per worker


#: On a GPU, MLX's unfused attention held about this many score-sized arrays at the peak of a chunk (one on the CPU):
#: measured once on an H200 (a 3-block float32 toy, 1024 tokens in chunks of 256: 23.1 MB for 11.6 predicted with
#: one): 3.75, rounded up.
GPU_EVAL_SCORES = 4


def eval_memory(config: dict | Architecture, length: int, chunk: int = 512, *, all_logits: bool = True,
                cpu_attention: bool | None = None, backend: str | None = None) -> Estimate:
    """Peak bytes of scoring one `length`-token sequence by chunked prefill (`pose_mlx.eval.longctx.prefill`, what
    `pose_mlx.perplexity`, `pose_mlx.passkey` and `pose_mlx.ruler` run), chunk C = min(chunk, length), hidden h,
    intermediate I, kv_dims = kv_heads x head_dim, c bytes per activation:

        weights + KV cache (2 x layers x kv_dims x L x c, L rounded up to mlx-lm's 256-position steps; the
        prefill allocates it once) + one chunk's logits in fp32 twice (the logits and the log-sum-exp's
        temporary; only the last position's when not `all_logits`: passkey, RULER) + one chunk's activations.

    Activations, what lives at the peak of a layer (measured with `mx.get_peak_memory()` on random small llamas, 2-4
    layers, hidden 32-512, GQA 1-8x, vocabulary 64-8192, chunk 128-512, float32 and bfloat16, each on both attention
    paths; `benchmarks/bench_eval_prediction.py`: every total within 10%): the MLP's gate and up projections (2 x C
    x I x c) and the residual stream with the attention's inputs and output. On the CPU backend's attention path
    (`pose_mlx.eval.cpu_attention`, the default when MLX's default device is the CPU) that is 9 C x h arrays in float32
    and the chunk's keys (C x kv_dims x c); a 16-bit model is attended in float32 there: its attention output is one
    more C x h float32 array, and one layer's keys and values (2 x kv_dims x L) and the chunk's queries are cast
    first, with 4 C x h float32 arrays alive, which is the peak when larger. On MLX's own attention it is 9 C x h
    arrays in float32, 3 in the model's dtype and 5 x C x kv_dims x c, plus the chunk's scores (heads x C x L x c;
    twice with soft-capping) and its boolean mask (C x L bytes). On a GPU (`backend`, default `compute_backend()`)
    the unfused attention holds `GPU_EVAL_SCORES` score matrices; CUDA's fused attention (a 16-bit model, head
    dims a multiple of 8 up to 128) none.

    On the CPU path the scores live in NumPy tiles (at most `TILE_BYTES` per worker) beside NumPy copies of the
    chunk's queries and output, outside MLX's allocator: `peak` (what `mx.get_peak_memory()` measures) leaves
    them out and `details["numpy_bytes"]` holds them; the memory a machine needs is the sum.
    """
    arch = config if isinstance(config, Architecture) else architecture(config)
    if length < 1 or chunk < 1:
        raise UserError(f"length {length} and chunk {chunk} must be positive")
    if cpu_attention is None:
        import mlx.core as mx

        cpu_attention = mx.default_device() == mx.cpu
    backend = backend or compute_backend()
    c = arch.dtype_bytes
    C = min(chunk, length)
    capacity = -(-length // KV_CACHE_STEP) * KV_CACHE_STEP
    scores = arch.heads * C * length * c * (2 if arch.spec.softcap else 1)
    rows = C if all_logits else 1
    logits = 2 * rows * arch.vocab * 4
    stream = arch.hidden * C  # one C x h array, counted in float32 and in the model's dtype below
    if cpu_attention:
        activations = 9 * stream * 4 + (2 * arch.intermediate + arch.kv_dims) * C * c
        if c < 4:  # the attention's float32 output before its cast; the other peak: float32 casts of one
            # layer's keys and values and of the chunk's queries
            activations += stream * 4
            casts = (2 * arch.kv_dims * capacity + arch.q_dims * C) * 4 + 4 * stream * 4
            activations = max(activations, casts - logits)
    else:
        activations = (9 * 4 + 3 * c) * stream + (2 * arch.intermediate + 5 * arch.kv_dims) * C * c
    fused = (backend == "cuda" and arch.dtype in ("float16", "bfloat16") and not arch.spec.softcap
             and arch.head_dim % 8 == 0 and arch.head_dim <= 128 and cudnn_capable())
    if backend != "cpu":
        scores = 0 if fused else int(GPU_EVAL_SCORES * scores)
    breakdown = {
        "weights": arch.weight_bytes(),
        "kv_cache": 2 * arch.layers * arch.kv_dims * capacity * c,
        "attention_scores": 0 if cpu_attention or (backend != "cpu" and fused) else scores + C * length,
        "logits": logits,
        "activations": activations,
    }
    # two workers' score tiles, the scaled queries and the output
    numpy_bytes = min(scores, 2 * TILE_BYTES) + 2 * arch.q_dims * C * 4 if cpu_attention else 0
    details = {"parameters": arch.parameter_counts()["total"], "length": length, "chunk": C,
               "kv_cache_per_token": 2 * arch.layers * arch.kv_dims * c, "family": arch.family,
               "known_family": arch.known, "warnings": list(arch.warnings), "numpy_bytes": numpy_bytes,
               "cpu_attention": cpu_attention, "backend": backend}
    return Estimate(sum(breakdown.values()), "eval", breakdown, details)
