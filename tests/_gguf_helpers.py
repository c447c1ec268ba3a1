"""Tiny GGUF files written with the `gguf` PyPI package (llama.cpp's own writer and NumPy quantizers), the
independent side of the GGUF round trips in test_gguf.py."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np


import mlx.core as mx
from mlx.utils import tree_flatten

import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pose_mlx import toy

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types

# mlx-lm / Hugging Face parameter names -> GGUF tensor names (written out here, independently of pose_mlx.model.gguf).
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: within each head, GGUF row 2i = row i and row 2i+1 = row i + d/2."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_config(vocab: int, tied: bool, model_type: str = "llama", **overrides) -> dict:
    config = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": vocab,
              "tie_word_embeddings": tied}
    if model_type == "qwen2":
        config.pop("head_dim")
    config.update(overrides)
    return config


def build(config: dict):
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(config))


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights with O(1) activations (so that a 1e-4 logit tolerance means something): embeddings N(0, 1),
    matrices N(0, 1/fan_in), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in tree_flatten(build(config).parameters()):
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


def model_with(config: dict, weights: dict[str, np.ndarray]):
    model = build(config)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model


def encode(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(data as written to the file, what gguf-py's NumPy dequantizer reads back as float32)."""
    if qtype == Q.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == Q.F16:
        data = w.astype(np.float16)
        return data, data.astype(np.float32)
    data = quantize(w.astype(np.float32), qtype)
    return data, dequantize(data, qtype).reshape(w.shape).astype(np.float32)


def write_gguf(path: Path, config: dict, weights: dict[str, np.ndarray], tokenizer: dict, types=lambda name: Q.F32,
               arch: str | None = None, skip: tuple = (), metadata: dict | None = None, alignment: int | None = None,
               drop_tensors: tuple = ()) -> dict[str, np.ndarray]:
    """Write a llama.cpp-style GGUF of `weights` (HF layout; Q/K permuted here for the llama architecture)
    and return the weights as the file holds them after gguf-py dequantization, in HF layout.

    `types(gguf_name)` picks each 2-D tensor's type (1-D tensors are F32, as llama.cpp writes norms); `skip`
    leaves metadata keys out; `metadata` adds or replaces keys ({key: (value, GGUFValueType)})."""
    arch = arch or config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    if alignment:
        writer.add_custom_alignment(alignment)
    V = gguf.GGUFValueType
    keys = {
        f"{arch}.context_length": (config["max_position_embeddings"], V.UINT32),
        f"{arch}.embedding_length": (config["hidden_size"], V.UINT32),
        f"{arch}.block_count": (config["num_hidden_layers"], V.UINT32),
        f"{arch}.feed_forward_length": (config["intermediate_size"], V.UINT32),
        f"{arch}.attention.head_count": (config["num_attention_heads"], V.UINT32),
        f"{arch}.attention.head_count_kv": (config["num_key_value_heads"], V.UINT32),
        f"{arch}.rope.freq_base": (config["rope_theta"], V.FLOAT32),
        f"{arch}.rope.dimension_count": (config["hidden_size"] // config["num_attention_heads"], V.UINT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (config["rms_norm_eps"], V.FLOAT32),
        **tokenizer,
        **(metadata or {}),
    }
    for key, (value, vtype) in keys.items():
        if key in skip or key == "general.architecture":
            continue
        if vtype == V.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    readback = {}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, w in weights.items():
        target = gguf_name(name)
        if target in drop_tensors:
            continue
        part = target.split(".")[-2]
        stored = permute(w, heads[part]) if arch == "llama" and part in heads else w
        qtype = types(target) if w.ndim == 2 else Q.F32
        data, back = encode(stored, qtype)
        writer.add_tensor(target, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        readback[name] = encode(w, qtype)[1]  # quantization is per row: permuting commutes with it
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return readback


# ------------------------------------------------------------------------------------------ tokenizers

TEXTS = [
    "The quick brown fox jumps over the lazy dog. I'm sure you'll see WE'RE fine; they've gone.",
    "def main(argv=None):\n    return 0  # done\n\n\n\tindented\ttabs   and   spaces  ",
    "Numbers 1234567, 3.14159 and 2024-01-31; version 10.0.19045.",
    "naïve café — Tōkyō 東京 🙂 Ünïcödé   ",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "a <tool> call <tool>x",
    " leading space and trailing\n",
]

# The source tokenizers' pre-tokenizers, as the models' own tokenizer.json files define them (Llama 3 and
# Qwen2 use the case-insensitive (?i:...) form that llama.cpp rewrites without (?i:)).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")


def _source_pre(pre: str):
    from tokenizers import Regex, pre_tokenizers as P

    byte_level = P.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt-2":
        return byte_level
    if pre == "smollm":
        return P.Sequence([P.Digits(individual_digits=True), byte_level])
    pattern = {"llama-bpe": _LLAMA3, "qwen2": _QWEN2}[pre]
    return P.Sequence([P.Split(Regex(pattern), behavior="isolated"),
                       P.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_bpe(vocab_size: int = 600):
    """A GPT-2 style byte-level BPE trained on standard-library text (so its merges cross digits, contractions
    and punctuation), with three control tokens and one user-defined token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _source_pre("gpt-2")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    numbers = " ".join(str(i * 7) for i in range(3000))  # merges of digit runs tell the pre-tokenizers apart
    tok.train_from_iterator(toy.stdlib_texts(max_chars=60_000) + TEXTS + [numbers], trainer)
    tok.add_tokens([AddedToken("<tool>", normalized=False, special=False)])
    return tok


def source_tokenizer(base, pre: str):
    """`base`'s vocabulary and merges behind the pre-tokenizer that models with `pre` define in their own
    tokenizer.json (Llama 3's also takes whole pre-tokens found in the vocabulary: ignore_merges)."""
    from tokenizers import Tokenizer

    spec = json.loads(base.to_str())
    spec["model"]["ignore_merges"] = pre == "llama-bpe"
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.pre_tokenizer = _source_pre(pre)
    return tok


def bpe_metadata(tok, pre: str, add_bos: bool | None = None, template: str | None = None) -> dict:
    V = gguf.GGUFValueType
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    types = [CONTROL if added.get(t) else USER_DEFINED if t in added else NORMAL for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    meta = {"tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.pre": (pre, V.STRING),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY), "tokenizer.ggml.token_type": (types, V.ARRAY),
            "tokenizer.ggml.merges": (merges, V.ARRAY),
            "tokenizer.ggml.bos_token_id": (vocab["<|im_start|>"], V.UINT32),
            "tokenizer.ggml.eos_token_id": (vocab["<|im_end|>"], V.UINT32),
            "tokenizer.ggml.padding_token_id": (vocab["<|endoftext|>"], V.UINT32)}
    if add_bos is not None:
        meta["tokenizer.ggml.add_bos_token"] = (add_bos, V.BOOL)
    if template is not None:
        meta["tokenizer.chat_template"] = (template, V.STRING)
    return meta


def train_spm(folder: Path, dummy_prefix: bool, vocab_size: int = 500):
    """A SentencePiece BPE model with byte fallback (Llama 2's kind); without the dummy prefix it also has
    a user-defined newline piece. Returns the SentencePieceProcessor."""
    import io

    import sentencepiece as spm

    texts = toy.stdlib_texts(max_chars=80_000) + TEXTS
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix,
        split_digits=True, byte_fallback=True, user_defined_symbols=[] if dummy_prefix else ["\n"],
        character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=max(len(t.encode()) for t in texts) + 1, input_sentence_size=0, num_threads=1,
        minloglevel=2)
    path = folder / f"spm_{int(dummy_prefix)}.model"
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


def spm_metadata(sp, dummy_prefix: bool) -> dict:
    from sentencepiece import sentencepiece_model_pb2

    V = gguf.GGUFValueType
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    return {"tokenizer.ggml.model": ("llama", V.STRING),
            "tokenizer.ggml.tokens": ([p.piece for p in proto.pieces], V.ARRAY),
            "tokenizer.ggml.scores": ([p.score for p in proto.pieces], V.ARRAY),
            "tokenizer.ggml.token_type": ([int(p.type) for p in proto.pieces], V.ARRAY),
            "tokenizer.ggml.bos_token_id": (sp.bos_id(), V.UINT32),
            "tokenizer.ggml.eos_token_id": (sp.eos_id(), V.UINT32),
            "tokenizer.ggml.unknown_token_id": (sp.unk_id(), V.UINT32),
            "tokenizer.ggml.add_space_prefix": (dummy_prefix, V.BOOL)}


def rewrite(path: Path, replace: dict | None = None, add: dict | None = None) -> None:
    """Rewrite the GGUF at `path` with gguf-py: same metadata and tensors, except `replace`d tensors and
    `add`ed ones ({name: (data, raw ggml type or None)})."""
    replace, add = replace or {}, add or {}
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(path) + ".new", reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        data, raw = replace.get(t.name, (np.array(t.data), t.tensor_type))
        writer.add_tensor(t.name, data, raw_dtype=raw)
    for name, (data, raw) in add.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".new").replace(path)
