"""The model side of a run: where a model comes from (`source`), its RoPE layers and their extension (`patch`),
and the exported folder (`export`)."""
