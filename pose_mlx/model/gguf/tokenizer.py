"""The tokenizer of a GGUF file (its metadata) as a `tokenizers.Tokenizer`, tokenizer.json +
tokenizer_config.json, or an mlx-lm `TokenizerWrapper`."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import config_from_gguf
from .header import Header, _header, _short

# Imported inside functions, on purpose: mlx-lm, tokenizers, each where it is used: they are costly to import or
# unneeded on the paths that import this module (`--help`, `plan`, the NumPy-only parts).

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes of llama.cpp's byte-level BPE (`tokenizer.ggml.pre`), applied one after the other,
# each isolating its matches ("isolated" splits), then the byte-to-unicode mapping of GPT-2.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
#: pre-tokenizer name -> (regexes, ignore_merges, add_bos default), as llama.cpp reads them.
PRE_TOKENIZERS = {
    "default": (_DEFAULT_RES, False, False),
    "gpt-2": ((_GPT2_RE,), False, False),
    "phi-2": ((_GPT2_RE,), False, False),
    "mpt": ((_GPT2_RE,), False, False),
    "olmo": ((_GPT2_RE,), False, False),
    "llama3": ((_LLAMA3_RE,), True, True),
    "llama-v3": ((_LLAMA3_RE,), True, True),
    "llama-bpe": ((_LLAMA3_RE,), True, True),
    "falcon3": ((_LLAMA3_RE,), True, True),
    "smaug-bpe": ((_LLAMA3_RE,), False, False),
    "dbrx": ((_LLAMA3_RE,), False, False),
    "smollm": ((r"\p{N}", _GPT2_RE), False, False),
    "starcoder": ((r"\p{N}", _GPT2_RE), False, False),
    "refact": ((r"\p{N}", _GPT2_RE), False, False),
    "qwen2": ((_QWEN2_RE,), False, False),
    "stablelm2": ((_QWEN2_RE,), False, False),
    "deepseek-r1-qwen": ((_QWEN2_RE,), False, False),
}


@dataclass
class _Vocab:
    kind: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style BPE with byte fallback)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[tuple[str, str]] | None
    pre: str | None
    special: dict[str, int]  # bos/eos/unk/pad -> id
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


def _read_vocab(h: Header) -> _Vocab:
    kind = h.get("tokenizer.ggml.model", None, str)
    if kind is None:
        raise h.fail("missing metadata key tokenizer.ggml.model (the file has no tokenizer)")
    if kind not in ("gpt2", "llama"):
        raise h.fail(f"unsupported tokenizer model {_short(kind)} (supported: gpt2 byte-level BPE, llama SentencePiece)")
    tokens = h.require("tokenizer.ggml.tokens", list)
    n = len(tokens)
    if not n or not all(isinstance(t, str) for t in tokens):
        raise h.fail("tokenizer.ggml.tokens must be a non-empty array of strings")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for empty tokens
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if seen.setdefault(t, i) != i:
            raise h.fail(f"token {_short(t)} appears twice in tokenizer.ggml.tokens (ids {seen[t]} and {i})")

    def per_token(key, kinds, default):
        values = h.get(key, None, list)
        if values is None:
            return default
        if len(values) != n or not all(isinstance(v, kinds) and not isinstance(v, bool) for v in values):
            raise h.fail(f"{key} must have one number per token ({n}), got {len(values)} values")
        return values

    types = per_token("tokenizer.ggml.token_type", int, [NORMAL] * n)
    scores = per_token("tokenizer.ggml.scores", (int, float), None)
    merges = None
    pre = None
    if kind == "gpt2":
        raw = h.require("tokenizer.ggml.merges", list)
        merges = []
        for m in raw:
            parts = m.split(" ") if isinstance(m, str) else []
            if len(parts) != 2 or not (parts[0] in seen and parts[1] in seen and parts[0] + parts[1] in seen):
                raise h.fail(f"tokenizer.ggml.merges has a merge {_short(m)} of or into tokens not in the vocabulary")
            merges.append((parts[0], parts[1]))
        pre = h.get("tokenizer.ggml.pre", "default", str)
        if pre not in PRE_TOKENIZERS:
            raise h.fail(f"unsupported pre-tokenizer {_short(pre)} (tokenizer.ggml.pre); supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    elif scores is None:
        raise h.fail("missing metadata key tokenizer.ggml.scores (needed by a llama tokenizer)")
    special = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        value = h.get(f"tokenizer.ggml.{key}", None, int)
        if value is not None:
            if not 0 <= value < n:
                raise h.fail(f"tokenizer.ggml.{key}={value} is not a token id (vocabulary of {n})")
            special[role] = value
    if kind == "llama":  # llama.cpp's defaults for SentencePiece vocabularies
        add_bos_default, space_default = True, True
    else:
        add_bos_default, space_default = PRE_TOKENIZERS[pre][2], False
    add_bos = bool(h.get("tokenizer.ggml.add_bos_token", add_bos_default, bool)) and "bos" in special
    add_eos = bool(h.get("tokenizer.ggml.add_eos_token", False, bool)) and "eos" in special
    add_space_prefix = bool(h.get("tokenizer.ggml.add_space_prefix", space_default, bool))
    return _Vocab(kind, tokens, types, scores, merges, pre, special, add_bos, add_eos, add_space_prefix)


def _spm_merges(vocab: _Vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece/llama.cpp's rule "merge the adjacent pair whose concatenation is
    the highest-scoring normal piece, leftmost first": every split a + b of a normal piece p into two normal
    pieces, ranked by p's score (descending), then p's id."""
    normal = {t: i for i, (t, k) in enumerate(zip(vocab.tokens, vocab.types)) if k == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in normal and b in normal:
                ranked.append((-vocab.scores[i], i, normal[a], (a, b)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def build_tokenizer(path_or_header):
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for the file's vocabulary.

    gpt2: byte-level BPE over the file's merges, after llama.cpp's regex splits for ``tokenizer.ggml.pre``
    (Llama 3's pre-tokenizers also take a whole pre-token that is in the vocabulary as one token,
    "ignore_merges"). llama: spaces become U+2581 (with one prepended unless ``add_space_prefix`` is false),
    BPE over merges derived from the scores (`_spm_merges`), unknown characters as <0xXX> byte tokens.
    Control and unknown tokens are special added tokens, user-defined tokens plain added tokens. BOS/EOS are
    added by the post-processor when ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say so (llama.cpp's
    defaults otherwise: BOS for SentencePiece vocabularies and Llama 3 pre-tokenizers).
    """
    return _build_tokenizer(_read_vocab(_header(path_or_header)))


def _build_tokenizer(vocab: _Vocab):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.kind == "gpt2":
        regexes, ignore_merges, _ = PRE_TOKENIZERS[vocab.pre]
        tok = Tokenizer(models.BPE(ids, vocab.merges, ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        unk = vocab.tokens[vocab.special["unk"]] if "unk" in vocab.special else None
        tok = Tokenizer(models.BPE(ids, _spm_merges(vocab), unk_token=unk, byte_fallback=True, fuse_unk=True))
        steps = [normalizers.Prepend("\u2581")] if vocab.add_space_prefix else []
        tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(vocab.tokens, vocab.types) if k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(vocab.tokens, vocab.types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos = vocab.tokens[vocab.special["bos"]] if vocab.add_bos else None
    eos = vocab.tokens[vocab.special["eos"]] if vocab.add_eos else None
    if bos or eos:
        single = " ".join(([bos] if bos else []) + ["$A"] + ([eos] if eos else []))
        pair = single + " " + " ".join(([bos + ":1"] if bos else []) + ["$B:1"] + ([eos + ":1"] if eos else []))
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, ids[t]) for t in (bos, eos) if t])
    return tok


def tokenizer_config(path_or_header) -> dict:
    """tokenizer_config.json for `build_tokenizer`'s tokenizer: special tokens, add_bos/add_eos and the chat
    template (``tokenizer.chat_template``). No model_max_length: evaluating beyond the trained window is
    what context extension is about, and transformers would warn on every longer text."""
    h = _header(path_or_header)
    return _tokenizer_config(h, _read_vocab(h))


def _tokenizer_config(h: Header, vocab: _Vocab) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos}
    for role, i in vocab.special.items():
        config[f"{role}_token"] = vocab.tokens[i]
    template = h.get("tokenizer.chat_template", None, str)
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer(path_or_header, folder: str | os.PathLike) -> Path:
    """Write tokenizer.json and tokenizer_config.json for the file's tokenizer into `folder`; returns it."""
    h = _header(path_or_header)
    vocab = _read_vocab(h)  # checked before anything is written
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(h, vocab), indent=2) + "\n")
    return folder


def _eos_ids(config: dict) -> list[int] | None:
    eos = config.get("eos_token_id")
    return None if eos is None else (list(eos) if isinstance(eos, list) else [eos])


def load_tokenizer(path_or_header, config: dict | None = None):
    """The file's tokenizer as an mlx-lm `TokenizerWrapper` (what `mlx_lm.load` returns)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    h = _header(path_or_header)
    config = config if config is not None else config_from_gguf(h)
    with tempfile.TemporaryDirectory(prefix="pose_mlx_gguf_") as tmp:
        write_tokenizer(h, tmp)
        return mlx_load_tokenizer(Path(tmp), eos_token_ids=_eos_ids(config))


__all__ = ["PRE_TOKENIZERS", "build_tokenizer", "load_tokenizer", "tokenizer_config", "write_tokenizer"]
