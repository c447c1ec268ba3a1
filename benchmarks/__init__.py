"""Timed runs of pose_mlx, each writing a JSON record to benchmarks/results/ (`common.write_results`).

Run one from the repository root as a module: ``python -m benchmarks.<script> [--help]``; `benchmarks/README.md`
lists them. `common` holds what they share (the experiments, a package beside this one, use it too).
"""
