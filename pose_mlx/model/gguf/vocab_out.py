"""The ``tokenizer.*`` metadata of a GGUF file, for a model folder's tokenizer (the reverse of `tokenizer`).

Two sources: the GGUF file the folder came from, whose tokenizer keys are copied as they are (what llama.cpp read
before), or the folder's tokenizer.json and tokenizer_config.json:

- byte-level BPE (``gpt2``): the vocabulary and merges; the pre-tokenizer name (``tokenizer.ggml.pre``) is the
  first of llama.cpp's pre-tokenizers the reader knows (`tokenizer.PRE_TOKENIZERS`; the one that splits more first)
  that encodes probe texts as the folder's tokenizer does: fixed ones, and texts made of the vocabulary's own
  tokens with digits, apostrophes or whitespace (llama.cpp's converter identifies it by a hash of an encoding);
- SentencePiece-style BPE with byte fallback (``llama``): the pieces, scores that rank each merged piece by its
  first merge (llama.cpp merges the adjacent pair whose concatenation scores highest), ``<0xXX>`` byte pieces,
  and whether a space is prepended (found by the probes as well).

Special tokens are control tokens, other added tokens user-defined ones; BOS/EOS/UNK/PAD come from
tokenizer_config.json (or config.json's ids), add_bos/add_eos from what the tokenizer's post-processor adds, the
chat template from tokenizer_config.json or chat_template.jinja. The result is checked before it is used: the
reader's tokenizer built from these keys must encode the probe texts as the folder's own tokenizer does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ...errors import UserError
from .header import ARRAY, Header
from .tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, _build_tokenizer, _Vocab

# Imported inside functions, on purpose: tokenizers, where it is used (costly to import).

#: Probe texts: contractions in both cases, digit runs, spaces, tabs and newlines, punctuation, accents, CJK.
PROBES = (
    "Hello world! It's 2024-05-17; we'll pay $1,234.56 (or 99%)... DON'T panic, THEY'RE here.\n",
    "def f(x):\n\treturn x**2  # squared\n\n\n   indented   spaces\r\n",
    "Café naïve façade — Ünïcödé 東京タワー 한국어 Привет мир 🙂🙃 1234567890 3.14159",
    " leading space, trailing space ",
)
#: Pre-tokenizer names tried in this order, the one that splits more first (SmolLM's digits before GPT-2's digit
#: runs, Qwen2's before Llama 3's groups of three): a vocabulary without tokens that tell two apart gets the first.
_PRE_ORDER = ("smollm", "gpt-2", "qwen2", "llama-bpe", "smaug-bpe", "default")
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def tokenizer_metadata(folder: Path, vocab_size: int, source: Header | None = None) -> tuple[dict, str]:
    """({GGUF key: (value, GGUF value type id or None for arrays)}, where it came from) for the folder's
    tokenizer, padded to `vocab_size` tokens; `source` is the GGUF file the folder came from (its keys are
    copied). UserError when the tokenizer cannot be expressed or does not fit the model."""
    if source is not None:
        keys = {k: (v, source.value_types.get(k)) for k, v in source.metadata.items() if k.startswith("tokenizer.")}
        tokens = keys.get("tokenizer.ggml.tokens", ([], None))[0]
        if len(tokens) != vocab_size:
            raise UserError(f"{source.path} has {len(tokens)} tokens but the model {vocab_size} embeddings")
        return keys, str(source.path)
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder}: no tokenizer.json (GGUF export needs it, or the GGUF file the folder came from)")
    try:
        spec = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path} is not valid JSON ({error})") from None
    from tokenizers import Tokenizer

    vocab = _vocab_from_json(path, spec, _tokenizer_config(folder), vocab_size)
    reference = Tokenizer.from_str(json.dumps(spec))
    ids = reference.encode("a", add_special_tokens=True).ids
    vocab.add_bos = "bos" in vocab.special and ids[:1] == [vocab.special["bos"]]
    vocab.add_eos = "eos" in vocab.special and len(ids) > 1 and ids[-1] == vocab.special["eos"]
    _match_splitting(path, vocab, reference)
    return _keys(vocab, _chat_template(folder)), str(path)


def _tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json, with config.json's bos/eos ids as a fallback ("config_ids")."""
    out = {}
    for name in ("tokenizer_config.json", "config.json"):
        path = Path(folder) / name
        try:
            data = json.loads(path.read_text()) if path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = {}
        if name == "config.json":
            out["config_ids"] = {k: data.get(f"{k}_token_id") for k in ("bos", "eos", "pad")}
        elif isinstance(data, dict):
            out.update(data)
    return out


def _vocab_from_json(path: Path, spec: dict, config: dict, vocab_size: int) -> _Vocab:
    """The reader's `_Vocab` for a tokenizer.json (BPE only), with the token list padded to `vocab_size`; what
    only the splitting tells (pre-tokenizer, space prefix, add_bos/add_eos) is set by the caller."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UserError(f"{path}: a {model.get('type', 'unknown')} tokenizer; GGUF export supports byte-level BPE "
                        "and SentencePiece-style BPE tokenizers")
    ids = dict(model["vocab"])
    added = {t["content"]: bool(t.get("special")) for t in spec.get("added_tokens") or ()}
    ids.update({t["content"]: t["id"] for t in spec.get("added_tokens") or ()})
    n = max(ids.values()) + 1
    if n > vocab_size:
        raise UserError(f"{path}: {n} tokens but the model has only {vocab_size} embeddings")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for token, i in ids.items():
        tokens[i] = token
    spm = bool(model.get("byte_fallback"))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or ()]
    types = []
    for i, token in enumerate(tokens):
        if token in added:
            types.append(CONTROL if added[token] else USER_DEFINED)
        elif i >= n or token not in ids:
            types.append(UNUSED)
        elif spm and _BYTE_PIECE.fullmatch(token):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    unk = model.get("unk_token")
    if unk in ids and spm:
        types[ids[unk]] = UNKNOWN
    special = _special_ids(config, ids, unk)
    if spm:
        return _Vocab("llama", tokens, types, _scores(tokens, types, merges), None, None, special, False, False, True)
    return _Vocab("gpt2", tokens, types, None, merges, None, special, False, False, False)


def _special_ids(config: dict, ids: dict, unk: str | None) -> dict:
    """bos/eos/unk/pad -> id from tokenizer_config.json's tokens, else config.json's ids."""
    special = {}
    for role in ("bos", "eos", "unk", "pad"):
        token = config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if role == "unk" and token is None:
            token = unk
        value = ids.get(token) if isinstance(token, str) else None
        if value is None:
            value = (config.get("config_ids") or {}).get(role)
            value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            special[role] = value
    return special


def _scores(tokens: list, types: list, merges: list) -> list[float]:
    """SentencePiece-style scores that rank each merged piece by its first merge (earlier = higher) and every
    other piece below all of them."""
    first = {}
    for rank, (a, b) in enumerate(merges):
        first.setdefault(a + b, rank)
    low = -float(len(merges) + 1)
    return [-float(first[t] + 1) if k == NORMAL and t in first else (low - i if k == NORMAL else 0.0)
            for i, (t, k) in enumerate(zip(tokens, types))]


def _match_splitting(path: Path, vocab: _Vocab, reference) -> None:
    """Set what the folder's tokenizer.json says only by how it splits text: the pre-tokenizer (byte-level BPE:
    the first of `_PRE_ORDER` that encodes the probes as `reference` does) or whether a space is prepended
    (SentencePiece-style); UserError when no choice encodes them alike."""
    if vocab.kind == "gpt2":
        field, choices = "pre", _PRE_ORDER
    else:
        field, choices = "add_space_prefix", (True, False)
    texts = PROBES + _vocabulary_probes(reference, vocab.tokens)
    for choice in choices:
        setattr(vocab, field, choice)
        ours = _build_tokenizer(vocab)
        if all(reference.encode(t).ids == ours.encode(t).ids for t in texts):
            return
    if vocab.kind == "gpt2":
        raise UserError(f"{path}: its pre-tokenizer splits text as none of llama.cpp's pre-tokenizers that pose_mlx "
                        f"knows ({', '.join(_PRE_ORDER)}) does; it cannot be written to GGUF")
    raise UserError(f"{path}: llama.cpp's SentencePiece-style tokenizer with this vocabulary would encode text "
                    "differently from the folder's tokenizer; it cannot be written to GGUF")


def _vocabulary_probes(reference, tokens: list) -> tuple[str, ...]:
    """Texts made of the vocabulary's own tokens that hold a digit, an apostrophe or whitespace next to something
    else, the pieces that pre-tokenizers split differently: a pre-tokenizer that would cut one of them apart
    encodes these texts differently."""
    pieces = [reference.decode([i]) for i, t in enumerate(tokens) if re.search(r"[0-9']", t) or (
        len(t) > 1 and re.search(r"[\sĠĊ▁]", t))]
    pieces = [p for p in pieces if p.strip()][:4000]
    return " ".join(pieces), "".join(pieces), "\n".join(pieces)


def _chat_template(folder: Path) -> str | None:
    config = _tokenizer_config(folder)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = Path(folder) / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text()
    return template if isinstance(template, str) and template else None


def _keys(vocab: _Vocab, template: str | None) -> dict:
    """The ``tokenizer.*`` keys of `vocab` ({key: (value, value type id; None for arrays)})."""
    U32, BOOL, STR = 4, 7, 8
    keys = {"tokenizer.ggml.model": (vocab.kind, STR)}
    if vocab.pre:
        keys["tokenizer.ggml.pre"] = (vocab.pre, STR)
    keys["tokenizer.ggml.tokens"] = (vocab.tokens, ARRAY)
    if vocab.scores is not None:
        keys["tokenizer.ggml.scores"] = (vocab.scores, ARRAY)
    keys["tokenizer.ggml.token_type"] = (vocab.types, ARRAY)
    if vocab.merges is not None:
        keys["tokenizer.ggml.merges"] = ([f"{a} {b}" for a, b in vocab.merges], ARRAY)
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
    for role, i in vocab.special.items():
        keys[f"tokenizer.ggml.{names[role]}"] = (i, U32)
    keys["tokenizer.ggml.add_bos_token"] = (vocab.add_bos, BOOL)
    keys["tokenizer.ggml.add_eos_token"] = (vocab.add_eos, BOOL)
    if vocab.kind == "llama":
        keys["tokenizer.ggml.add_space_prefix"] = (vocab.add_space_prefix, BOOL)
    if template:
        keys["tokenizer.chat_template"] = (template, STR)
    return keys


__all__ = ["PROBES", "tokenizer_metadata"]
