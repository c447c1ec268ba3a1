"""llama.cpp against the GGUF files pose_mlx writes.

- Always: docs/gguf.md quotes benchmarks/results/llama_cpp.json (`python -m benchmarks.bench_llama_cpp`: SmolLM2
  extended 8k -> 32k with YaRN, 16k tokens in llama.cpp and in MLX) as the record says, and the record's pass/fail
  follows from its numbers and goals.
- Opt-in (skipped unless llama-cpp-python imports: the `llamacpp` extra): tiny llama and qwen2 folders, extended
  4x, exported to GGUF and run by llama.cpp itself give the MLX folder's logits beyond the original window.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "llama_cpp.json"
DOC = ROOT / "docs" / "gguf.md"


def _record() -> dict:
    return json.loads(RECORD.read_text())


def _percent(x: float) -> str:
    return f"{100 * x:.2f}%"


def quoted_sentences(r: dict) -> list[str]:
    """The sentences of docs/gguf.md that quote the record, filled from it."""
    f32, f16 = r["logits"]["f32"], r["logits"]["f16"]
    runs = r["passkey"]["runs"]
    answer = {side: (re.search(r"\d+", run["answer"]) or [None])[0] for side, run in runs.items()}
    return [
        f"On {r['tokens']:,} tokens of the Python tutorial, llama.cpp's most likely next token is MLX's at "
        f"{_percent(f32['top1_agreement'])} of the {f32['positions_compared']:,} positions with the f32 file and "
        f"{_percent(f16['top1_agreement'])} with the f16 file (goal {_percent(r['goals']['top1_agreement_min'])})",
        f"perplexity {f32['ppl_mlx']:.3f} in MLX, {f32['ppl_llama_cpp']:.3f} in llama.cpp with the f32 file and "
        f"{f16['ppl_llama_cpp']:.3f} with the f16 file (goal: within 1%)",
        f"the largest logit difference on every 128th position is {f32['max_abs_logit_difference']:.3f} (f32) and "
        f"{f16['max_abs_logit_difference']:.3f} (f16), the mean KL divergence {f32['mean_kl']:.1e} and "
        f"{f16['mean_kl']:.1e}",
        f"The passkey trial at {r['passkey']['prompt_tokens']:,} tokens (key {r['passkey']['key']}): MLX answers "
        f"{answer['mlx']}, llama.cpp {answer['llama.cpp f32']} (f32) and {answer['llama.cpp f16']} (f16)",
        f"llama-cpp-python {r['llama_cpp']['llama_cpp_python']}",
        "llama.cpp's own tokenizer gives pose_mlx's ids for the whole document" if r["llama_cpp_tokenizer_same_ids"]
        else "llama.cpp's own tokenizer does not give pose_mlx's ids for the whole document",
    ]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_gguf_doc_quotes_the_llama_cpp_record():
    doc = _flat(DOC.read_text())
    for sentence in quoted_sentences(_record()):
        assert _flat(sentence) in doc, sentence


def test_the_records_verdict_follows_from_its_numbers():
    r = _record()
    for outtype, run in r["logits"].items():
        meets = (run["top1_agreement"] >= r["goals"]["top1_agreement_min"]
                 and abs(run["ppl_llama_cpp"] / run["ppl_mlx"] - 1) <= r["goals"]["ppl_relative_difference_max"])
        assert run["passes"] == meets, outtype
    assert r["passes"] == all(run["passes"] for run in r["logits"].values())
    assert r["gguf_rope_keys"]["llama.rope.scaling.type"] == "yarn" and r["gguf_rope_keys"]["llama.context_length"] \
        == 32768


@pytest.mark.parametrize("arch, schedule, params", [("llama", "yarn", {"mscale": 1.5}), ("llama", "linear", {}),
                                                    ("qwen2", "yarn", {}), ("llama", "ntk", {})])
def test_llama_cpp_runs_the_exported_file_as_mlx_does(tmp_path, arch, schedule, params):
    llama_cpp = pytest.importorskip("llama_cpp")
    import mlx.core as mx

    import _gguf_helpers as H
    from pose_mlx.model import gguf as pg
    from pose_mlx.model.export import export_model
    from pose_mlx.model.gguf.write import export_gguf
    from pose_mlx.model.patch import extend
    from pose_mlx.model.source import load

    tok = H.train_bpe()
    config = H.model_config(tok.get_vocab_size(), tied=arch == "qwen2", model_type=arch,
                            max_position_embeddings=64)
    H.write_gguf(tmp_path / "src.gguf", config, H.random_weights(config), H.bpe_metadata(tok, "gpt-2"))
    folder = pg.convert(tmp_path / "src.gguf", tmp_path / "folder")
    model, _, config = load(str(folder), return_config=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extend(model, schedule, 64, 256, **params)
    export_model(model, config, folder, tmp_path / "ext", record={"steps": 0})
    export_gguf(tmp_path / "ext", tmp_path / "x.gguf", "f32")
    ids = list(range(3, 3 + 200))  # 200 tokens: 3x the original window
    expected = np.array(load(str(tmp_path / "ext"))[0](mx.array([ids]))[0].astype(mx.float32))
    llm = llama_cpp.Llama(str(tmp_path / "x.gguf"), n_ctx=256, logits_all=True, n_threads=2, verbose=False,
                          type_k=0, type_v=0)  # float32 KV cache (GGML_TYPE_F32): llama.cpp's own rounding only
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    assert np.max(np.abs(got - expected)) <= 1e-3 * np.max(np.abs(expected))
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.99
