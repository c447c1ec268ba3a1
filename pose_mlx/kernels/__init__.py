"""Training kernels: exact attention in blocks of queries, the loss in row chunks, and vectorized CPU row kernels.

`route.training_route(model)` is what the training loop runs under; `build.status` says whether the vectorized
CPU kernels (`cpu_kernels.cpp`, built on first use) are in use.
"""
