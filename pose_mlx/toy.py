"""Tiny Hugging-Face-layout model folders, built fully offline (tests, demo, simulator).

- `stdlib_texts`: the running interpreter's standard-library sources, a free, local, deterministic code corpus.
- `train_tokenizer`: a sentencepiece BPE tokenizer (identity normalisation, split digits, byte fallback,
  newline as a user-defined piece; ids <unk>=0, <s>=1, </s>=2) converted to `tokenizer.json` with
  transformers' sentencepiece extractor, so `mlx_lm.load` reads it and encodes exactly like sentencepiece.
  Nothing is added automatically on encode (no BOS): callers prepend `bos_token_id` where they want it.
  A literal "<s>" inside the text stays text (``split_special_tokens``), as in sentencepiece.
- `make_model_folder`: config.json + random weights of mlx-lm's own model class + tokenizer files.
- `save_model_folder`: the same layout for an in-memory (e.g. pre-trained) mlx-lm model.

A folder holds config.json, model.safetensors, tokenizer.json, tokenizer_config.json and, when trained
here, tokenizer.model; `mlx_lm.load(str(folder))` loads it and `mlx_lm.generate` runs on it.
"""

from __future__ import annotations

import io
import os
import json
import sysconfig
from pathlib import Path
from typing import Iterable

import mlx.core as mx
from mlx.utils import tree_flatten

# Imported inside functions, on purpose: sentencepiece, tokenizers and transformers (costly, only to train or convert
# a tokenizer) and `model.source.build_model` (kept out of this module's namespace: toy does not offer it).

#: Tokenizer files a toy folder needs (copied with the others by `pose_mlx.model.export.copy_tokenizer_files`).
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: Directory names treated as test suites by `stdlib_texts(include_tests=False)`.
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
#: Characters of standard-library text used when `make_model_folder` trains a tokenizer itself.
DEFAULT_TOKENIZER_CHARS = 300_000
_SPECIAL = {"unk": (0, "<unk>"), "bos": (1, "<s>"), "eos": (2, "</s>")}
_NEWLINE = "\n"


def _stdlib_files(include_tests: bool) -> list[Path]:
    """Sorted ``.py`` paths under the stdlib directory, pruning site-packages (and test dirs if asked)."""
    skip = {"site-packages", "dist-packages", "__pycache__"} | (set() if include_tests else set(TEST_DIRS))
    paths = []
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = [d for d in dirnames if d not in skip]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(paths)


def stdlib_texts(max_files: int | None = None, min_chars: int = 0, *, include_tests: bool = True,
                 max_chars: int | None = None) -> list[str]:
    """Source texts of the interpreter's standard-library ``.py`` files (site-packages excluded).

    Files are taken in sorted path order; files that are not valid UTF-8 or shorter than `min_chars` are
    skipped. `include_tests=False` also skips files under ``test``/``tests``/``idle_test`` directories.
    Stops after `max_files` texts, or once the texts total at least `max_chars` characters (the file that
    crosses the limit is kept). Newlines are read in universal mode (``\\r\\n`` -> ``\\n``). The corpus is
    whatever the running interpreter ships (CPython 3.11.7 here: 1,786 files, 31.5 M characters).
    """
    if max_files is not None and max_files < 0:
        raise ValueError(f"max_files must be >= 0, got {max_files}")
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    texts: list[str] = []
    total = 0
    for path in _stdlib_files(include_tests):
        if (max_files is not None and len(texts) >= max_files) or (max_chars is not None and total >= max_chars):
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < min_chars:
            continue
        texts.append(text)
        total += len(text)
    return texts


def _train_sentencepiece(texts: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        split_digits=True, byte_fallback=True, user_defined_symbols=[_NEWLINE], character_coverage=0.9995,
        unk_id=_SPECIAL["unk"][0], bos_id=_SPECIAL["bos"][0], eos_id=_SPECIAL["eos"][0], pad_id=-1,
        unk_piece=_SPECIAL["unk"][1], bos_piece=_SPECIAL["bos"][1], eos_piece=_SPECIAL["eos"][1],
        max_sentence_length=max(len(t.encode("utf-8")) for t in texts) + 1, input_sentence_size=0,
        num_threads=1, minloglevel=2,
    )
    return model.getvalue()


def _spm_to_tokenizer_json(model_file: Path):
    """A `tokenizers.Tokenizer` equivalent to the sentencepiece BPE model in `model_file`.

    Vocabulary and merges come from transformers' `SentencePieceExtractor`; the pipeline is the plain
    sentencepiece one (spaces -> U+2581, BPE with byte fallback; the decoder reverses both). Control and
    unknown pieces become special added tokens, user-defined pieces (the newline) ordinary added tokens.
    """
    from tokenizers import AddedToken
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    extractor = SentencePieceExtractor(str(model_file))
    extracted = extractor.extract(BPE)
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, extracted["vocab"], extracted["merges"])
    specials = [p.piece for p in extractor.proto.pieces if p.type in (2, 3)]  # UNKNOWN, CONTROL
    user = [p.piece for p in extractor.proto.pieces if p.type == 4]  # USER_DEFINED
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tokenizer


def train_tokenizer(texts: Iterable[str], folder, vocab_size: int = 512) -> Path:
    """Train a sentencepiece BPE tokenizer of exactly `vocab_size` pieces on `texts`; write it to `folder`.

    Writes tokenizer.model (sentencepiece), tokenizer.json and tokenizer_config.json. 256 ids are byte
    pieces and 4 are <unk>, <s>, </s>, newline; characters covering 99.95% of the text get a piece each (rarer
    ones fall back to bytes); merges fill the rest. So `vocab_size` must exceed 260 plus the character
    count, and the texts must offer enough merges (else ValueError). Returns the folder.
    """
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("texts must contain at least one non-empty string")
    if vocab_size <= 260:
        raise ValueError(f"vocab_size must exceed 260 (256 byte pieces + 4 specials), got {vocab_size}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_file = folder / "tokenizer.model"
    try:
        model_file.write_bytes(_train_sentencepiece(texts, vocab_size))
    except RuntimeError as error:
        if "Vocabulary size" not in str(error):
            raise
        raise ValueError(f"vocab_size={vocab_size} does not fit these texts: {error}") from error
    _spm_to_tokenizer_json(model_file).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": _SPECIAL["unk"][1],
        "bos_token": _SPECIAL["bos"][1],
        "eos_token": _SPECIAL["eos"][1],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,  # "<s>" inside text is text (as in sentencepiece), not BOS
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def tokenizer_info(folder) -> dict:
    """``{"vocab_size", "bos_token_id", "eos_token_id"}`` of the tokenizer files in `folder`."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    missing = [name for name in REQUIRED_TOKENIZER_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"tokenizer folder {folder} lacks {', '.join(missing)}")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())

    def token_id(key):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return None if token is None else tokenizer.token_to_id(token)

    return {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
            "bos_token_id": token_id("bos_token"), "eos_token_id": token_id("eos_token")}


def copy_tokenizer(src, dst) -> Path:
    """Copy the tokenizer files of folder `src` (validated first) into folder `dst`."""
    from .model.export import copy_tokenizer_files

    src, dst = Path(src), Path(dst)
    tokenizer_info(src)  # validates
    dst.mkdir(parents=True, exist_ok=True)
    if src.resolve() != dst.resolve():
        copy_tokenizer_files(src, dst)
    return dst


def model_config(vocab_size: int, model_type: str = "llama", hidden_size: int = 64, num_layers: int = 2,
                 num_heads: int = 4, num_kv_heads: int | None = None, intermediate_size: int | None = None,
                 max_position_embeddings: int = 128, rope_theta: float = 10000.0, rope_traditional: bool = False,
                 tie_word_embeddings: bool = True, bos_token_id: int | None = 1, eos_token_id: int | None = 2,
                 extra_config: dict | None = None) -> dict:
    """An HF-style config dict with the keys mlx-lm's llama reads (plus `extra_config`, which wins).

    `num_kv_heads` defaults to `num_heads` (no GQA); `intermediate_size` to 8/3 * hidden_size rounded up
    to a multiple of 8 (the SwiGLU convention). ``rope_traditional`` is an mlx-lm key (interleaved pairs).
    """
    for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("num_layers", num_layers),
                        ("num_heads", num_heads), ("max_position_embeddings", max_position_embeddings)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must be positive and divide num_heads ({num_heads})")
    if (hidden_size // num_heads) % 2:
        raise ValueError(f"head dim hidden_size/num_heads = {hidden_size // num_heads} must be even for RoPE")
    if intermediate_size is None:
        intermediate_size = -(-8 * hidden_size // 3 // 8) * 8
    if intermediate_size <= 0:
        raise ValueError(f"intermediate_size must be positive, got {intermediate_size}")
    if rope_theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")
    config = {
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": float(rope_theta),
        "rope_traditional": bool(rope_traditional),
        "tie_word_embeddings": bool(tie_word_embeddings),
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    config.update(extra_config or {})
    return config


def save_model_folder(model, config: dict, tokenizer_folder, folder) -> Path:
    """Write `model`'s parameters (model.safetensors), `config` (config.json) and the tokenizer files of
    `tokenizer_folder` into `folder`, a layout `mlx_lm.load` reads. Returns the folder."""
    if "model_type" not in config:
        raise ValueError("config must have a 'model_type'")
    folder = Path(folder)
    copy_tokenizer(tokenizer_folder, folder)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    return folder


def make_model_folder(folder, tokenizer_from=None, texts: Iterable[str] | None = None, vocab_size: int = 512,
                      model_type: str = "llama", hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int | None = None, intermediate_size: int | None = None,
                      max_position_embeddings: int = 128, rope_theta: float = 10000.0,
                      rope_traditional: bool = False, tie_word_embeddings: bool = True, seed: int = 0,
                      extra_config: dict | None = None) -> Path:
    """A random-weight model folder that `mlx_lm.load` accepts offline. Returns the folder.

    Tokenizer: copied from `tokenizer_from`, else trained on `texts` (default: the first
    `DEFAULT_TOKENIZER_CHARS` characters of `stdlib_texts()`) with `vocab_size` pieces. With `tokenizer_from`
    the model's vocabulary is the copied tokenizer's size and `vocab_size` is ignored. BOS/EOS ids in
    config.json come from the tokenizer. Weights: `pose_mlx.model.source.build_model(config, seed)`, saved as float32.
    """
    if tokenizer_from is not None and texts is not None:
        raise ValueError("pass tokenizer_from or texts, not both")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, folder)
    else:
        if texts is None:
            texts = stdlib_texts(max_chars=DEFAULT_TOKENIZER_CHARS)
        train_tokenizer(texts, folder, vocab_size)
    info = tokenizer_info(folder)
    config = model_config(
        info["vocab_size"], model_type=model_type, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, rope_traditional=rope_traditional,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=info["bos_token_id"],
        eos_token_id=info["eos_token_id"], extra_config=extra_config)
    from .model.source import build_model

    return save_model_folder(build_model(config, seed), config, folder, folder)


__all__ = ["DEFAULT_TOKENIZER_CHARS", "REQUIRED_TOKENIZER_FILES", "copy_tokenizer", "make_model_folder",
           "model_config", "save_model_folder", "stdlib_texts", "tokenizer_info", "train_tokenizer"]
