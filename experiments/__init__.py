"""The registered evidence: the real model's protocols and their addenda, the simulator's studies, and the queue
that runs their GPU share. Each script writes its records under benchmarks/results/ through `benchmarks.common`.

Run one from the repository root as a module: ``python -m experiments.<script> [--help]``;
`experiments/README.md` lists them. `protocol` reads the pre-registered protocols (benchmarks/protocols/).
"""
