"""Shared fixtures for the fine-tuning tests: a tiny random llama folder and a folder of local text."""


import json
from pathlib import Path

import pytest

from pose_mlx import toy

ORIGINAL = 32  # max_position_embeddings of the tiny model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer, hidden-32 llama (head dim 8) with a 512-piece tokenizer, original window 32."""
    folder = tmp_path_factory.mktemp("tiny_model")
    return toy.make_model_folder(folder, hidden_size=32, num_layers=2, num_heads=4,
                                 max_position_embeddings=ORIGINAL, rope_theta=500.0, seed=1)


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """Twelve CPython stdlib sources (>= 6,000 characters each) as .txt files."""
    folder = tmp_path_factory.mktemp("texts")
    for i, text in enumerate(toy.stdlib_texts(max_files=12, min_chars=6000)):
        (folder / f"doc{i}.txt").write_text(text)
    return folder


def with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of the model folder `src` at `dst` with config.json keys changed (None deletes a key)."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
