"""Data-parallel training over `mx.distributed` (processes started by `mlx.launch`).

Every rank holds the whole model and takes its own rows of each global batch (see
`pose_mlx.training.data.ExampleStream`'s `rank`/`world`). Gradients are combined token-weighted:

    g = sum_r n_r * g_r / sum_r n_r,   loss = sum_r n_r * loss_r / sum_r n_r

where g_r, loss_r are rank r's mean over its n_r unmasked target tokens, so W ranks with b rows each compute
exactly what one process computes on the W*b rows. Only rank 0 writes files and prints progress.
Without `mlx.launch` the world has one rank and nothing is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_map


@dataclass(frozen=True)
class World:
    """The group of ranks this process belongs to (`group` is None for a single process)."""

    rank: int = 0
    size: int = 1
    group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, tree):
        """Element-wise sum of `tree` (an array or a tree of arrays) over all ranks."""
        if self.size == 1:
            return tree
        return tree_map(lambda x: mx.distributed.all_sum(x, group=self.group), tree)

    def weighted_mean(self, tree, weight: mx.array):
        """sum_r weight_r * tree_r / sum_r weight_r over the ranks (tree unchanged for one rank)."""
        if self.size == 1:
            return tree
        total = self.all_sum(weight)
        return tree_map(lambda x: mx.distributed.all_sum(x * weight, group=self.group) / total, tree)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on at least one (e.g. a signal reached one rank)."""
        if self.size == 1:
            return flag
        return bool(self.all_sum(mx.array(1.0 if flag else 0.0)).item() > 0)

    def barrier(self) -> None:
        """Wait until every rank has arrived here."""
        if self.size > 1:
            mx.eval(self.all_sum(mx.array(0.0)))


SINGLE = World()


def init() -> World:
    """The world of this process: the `mlx.launch` group when there is one (size > 1), else `SINGLE`."""
    if not mx.distributed.is_available():
        return SINGLE
    group = mx.distributed.init()
    if group.size() == 1:
        return SINGLE
    return World(group.rank(), group.size(), group)
