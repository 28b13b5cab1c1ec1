"""Local shard element -> global element index.

A parameter's *global element index* is its row-major flat index in the full, unsharded
parameter (the tensor a single process would hold). The casts key their random bits on it, so
it must be the same for an element wherever it lives.

* Contiguous runs (ZeRO partitions of a flattened param, DistributedOptimizer ranges) need no
  tensor: pass the int start offset to the cast.
* A dense block of a larger tensor (a TP partition, a PP stage's slice of stacked layers) is
  described by its offsets in the global shape: :func:`block_index`.
"""
from __future__ import annotations

from typing import Sequence

import torch


def block_index(global_shape: Sequence[int], offsets: Sequence[int], local_shape: Sequence[int],
                device: torch.device | str | None = None) -> torch.Tensor:
    """Global flat indices of a dense block ``global[offsets[0]:offsets[0]+local_shape[0], ...]``.

    Args:
        global_shape: shape of the full parameter.
        offsets: the block's starting coordinate in each dimension (same length).
        local_shape: the block's shape (same length), e.g. a TP rank's partition.

    Returns:
        int64 tensor of shape ``local_shape`` holding row-major indices into ``global_shape``.

    Raises:
        ValueError: if the lengths differ or the block does not fit inside the global shape.
    """
    if not len(global_shape) == len(offsets) == len(local_shape):
        raise ValueError(f"rank mismatch: global_shape={tuple(global_shape)} offsets={tuple(offsets)} "
                         f"local_shape={tuple(local_shape)}")
    for d, (g, o, n) in enumerate(zip(global_shape, offsets, local_shape)):
        if o < 0 or n < 0 or o + n > g:
            raise ValueError(f"block does not fit in dim {d}: offset {o} + size {n} > global size {g}")
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(global_shape))):
        coord = torch.arange(offsets[d], offsets[d] + local_shape[d], dtype=torch.int64, device=device)
        index = index + (coord * stride).view(-1, *([1] * (len(global_shape) - 1 - d)))
        stride *= global_shape[d]
    return index.expand(*local_shape).contiguous() if len(local_shape) else index


def partition_range(numel: int, part: int, rank: int) -> tuple[int, int]:
    """The elements of a flattened param that rank ``rank`` holds when the param is cut into
    consecutive parts of ``part`` elements, one per rank (ZeRO-3: ``part = ceil(numel / world)``).

    Returns:
        ``(start, count)``: global indices ``[start, start + count)``; ``count`` is smaller than
        ``part`` (0 past the end) where the last parts are padding.
    """
    start = rank * part
    return start, max(0, min(part, numel - start))
