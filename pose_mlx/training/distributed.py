"""Data-parallel training over `mx.distributed` (processes started by `mlx.launch`).

Every rank holds the whole model and takes its own rows of each global batch (see
`pose_mlx.training.data.ExampleStream`'s `rank`/`world`). Gradients are combined token-weighted:

    g = sum_r n_r * g_r / sum_r n_r,   loss = sum_r n_r * loss_r / sum_r n_r

where g_r, loss_r are rank r's mean over its n_r unmasked target tokens, so W ranks with b rows each compute
exactly what one process computes on the W*b rows. An update communicates once (`World.mean_of_sums`): the
per-rank sums n_r g_r and n_r loss_r, the count n_r and a stop flag travel in one flattened buffer per dtype
(split in buckets of at most `BUCKET_ELEMENTS`), summed by a single `mx.distributed.all_sum`, split back and
divided by sum_r n_r. Only rank 0 writes files and prints progress. Without `mlx.launch` the world has one rank
and nothing is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_map

#: The most elements one all-reduce carries (256 MiB of float32): bounds the extra memory of the flat copy.
BUCKET_ELEMENTS = 1 << 26


def _wire_dtype(dtype):
    """The dtype an array is summed in: floats in float32 (float64 stays float64), other dtypes as they are."""
    if dtype == mx.float64 or not mx.issubdtype(dtype, mx.floating):
        return dtype
    return mx.float32


def _buckets(arrays: list, limit: int) -> list[list[int]]:
    """Indices of `arrays` grouped by wire dtype, in order, each group cut into runs of at most `limit` elements
    (an array larger than `limit` travels alone)."""
    by_dtype: dict = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(_wire_dtype(a.dtype), []).append(i)
    buckets = []
    for indices in by_dtype.values():
        current, size = [], 0
        for i in indices:
            if current and size + arrays[i].size > limit:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += arrays[i].size
        buckets.append(current)
    return buckets


def flat_all_sum(arrays: list, group, limit: int = BUCKET_ELEMENTS) -> list:
    """[sum over the ranks of a for a in arrays], in each array's wire dtype (floats as float32): the arrays are
    raveled and concatenated, one `all_sum` per bucket, and the sum split back into their shapes."""
    out = [None] * len(arrays)
    for bucket in _buckets(arrays, limit):
        wire = _wire_dtype(arrays[bucket[0]].dtype)
        parts = [arrays[i].reshape(-1).astype(wire) for i in bucket]
        flat = mx.distributed.all_sum(parts[0] if len(parts) == 1 else mx.concatenate(parts), group=group)
        offsets, total = [], 0
        for i in bucket[:-1]:
            total += arrays[i].size
            offsets.append(total)
        for i, part in zip(bucket, mx.split(flat, offsets) if offsets else [flat]):
            out[i] = part.reshape(arrays[i].shape)
    return out


def _leaves(tree) -> list:
    leaves = []
    tree_map(leaves.append, tree)
    return leaves


def _rebuild(tree, values: list):
    it = iter(values)
    return tree_map(lambda _: next(it), tree)


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
        """Element-wise sum of `tree` (an array or a tree of arrays) over all ranks, in one flattened all-reduce
        (per dtype and bucket); each leaf keeps its dtype (floats are summed in float32)."""
        if self.size == 1:
            return tree
        leaves = _leaves(tree)
        summed = flat_all_sum(leaves, self.group)
        return _rebuild(tree, [s.astype(x.dtype) for s, x in zip(summed, leaves)])

    def mean_of_sums(self, sums, count: mx.array, stop: mx.array | None = None):
        """(sum_r sums_r / sum_r count_r, sum_r count_r, sum_r stop_r) in one all-reduce.

        `sums` is a tree of this rank's sums over its `count` tokens (n_r * loss_r and the gradients of that
        sum), `stop` a 0/1 scalar (a signal reached this rank; None: no flag, and None is returned for it).
        The quotient keeps each leaf's dtype (computed in float32); a total count of 0 gives zeros, as
        `masked_loss` does for a batch without targets. With one rank: (sums / count, count, stop)."""
        leaves = _leaves(sums)
        extra = [count] if stop is None else [count, stop]
        if self.size == 1:
            summed = [x.astype(_wire_dtype(x.dtype)) for x in leaves] + extra
        else:
            summed = flat_all_sum(leaves + [c.astype(mx.float32) for c in extra], self.group)
        total = summed[len(leaves)]
        scale = mx.where(total > 0, 1.0 / total, 0.0)
        mean = _rebuild(sums, [(s * scale).astype(x.dtype) for s, x in zip(summed, leaves)])
        return mean, total, (None if stop is None else summed[-1])

    def weighted_mean(self, tree, weight: mx.array):
        """sum_r weight_r * tree_r / sum_r weight_r over the ranks (tree unchanged for one rank); one all-reduce."""
        if self.size == 1:
            return tree
        return self.mean_of_sums(tree_map(lambda x: x * weight, tree), weight)[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on at least one (e.g. a signal reached one rank). A host sync:
        the training loop sends its flag with the update's all-reduce instead, and calls this once at the end."""
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
