"""`python -m pose_mlx.sim`: reproduce the PoSE paper's experiments at laptop scale.

Stages (each cached on disk under ``--out``; a rerun skips finished stages and resumes interrupted training):
corpus (`corpus`) -> pre-training at Lc (`pretrain`) -> the grid of fine-tuning runs, each one call of
`pose_mlx.finetune.run` with its `RunSettings` (`grid`) -> evaluation through
`pose_mlx.eval.perplexity.run` / `pose_mlx.eval.passkey.run` / `pose_mlx.eval.ruler.run` with theirs (`grid`) ->
claims (`claims`) -> report.md, results.json, PNGs (`report`).
"""

from pathlib import Path

#: The base shipped with the package: the demo's model, and the pre-training stage of a run it matches.
SHIPPED_BASE = Path(__file__).resolve().parent / "pretrained"
