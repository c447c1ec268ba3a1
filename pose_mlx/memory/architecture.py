"""The shapes that decide memory, read from a model's config.json (`architecture`), and the dtype and weight bytes
the model has once loaded (`loaded_architecture`: a GGUF file is dequantized to float32 on the CPU, kept quantized
on a GPU).

Families other than llama map onto the same terms (extra norms, q/k norms, fused projections, biases); a family
this module does not know is estimated from the config's shapes as a llama-style block, with a warning.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from ..errors import UserError
from ..model.gguf import read_header
from ..model.stored import stored_dtype
from .device import compute_backend

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
#: Keys every config must have (the planner names the missing ones).
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")


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
        return "float16", "config.json names no torch_dtype (or dtype); assuming 16-bit weights"
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
    model folder as stored (mlx-lm keeps the stored dtype and quantization): its config's torch_dtype (or dtype),
    else the dtype its safetensors headers give (`pose_mlx.model.stored.stored_dtype`)."""
    arch = architecture(config)
    if ref is None:
        return arch
    if getattr(ref, "is_gguf", False):
        header = read_header(ref.path)
        return gguf_loaded(arch, [(t.type_name, t.shape) for t in header.tensors.values()],
                           backend or compute_backend())
    if config.get("torch_dtype") or config.get("dtype") or ref.config_file is not None or not ref.path.is_dir():
        return arch
    dtype = stored_dtype(ref.path)
    if dtype is None:
        return arch
    return replace(arch, dtype=dtype, warnings=tuple(w for w in arch.warnings if "torch_dtype" not in w))
