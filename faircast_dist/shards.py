"""Local shard element -> global element index.

A parameter's *global element index* is its row-major flat index in the full, unsharded
parameter (the tensor a single process would hold). The casts key their random bits on it, so
it must be the same for an element wherever it lives.

* Contiguous runs (ZeRO partitions of a flattened param, DistributedOptimizer ranges) need no
  tensor: pass the int start offset to the cast.
* A dense block of a larger tensor (a TP partition, a PP stage's slice of stacked layers) is
  described by its offsets in the global shape: :func:`block_index`; :func:`index_runs` cuts
  indices into the runs of consecutive ones the fused kernels take as segments.
* A ZeRO-3-style even partition of a flattened param: :func:`partition_range`.
* The exact gather both integrations use (an integer all-reduce of bit patterns where every
  element has one non-zero contribution): :func:`to_bits` / :func:`from_bits`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def block_index(global_shape: Sequence[int], offsets: Sequence[int], local_shape: Sequence[int],
                device: torch.device | str | None = None, elements: tuple[int, int] | None = None) -> torch.Tensor:
    """Global flat indices of a dense block ``global[offsets[0]:offsets[0]+local_shape[0], ...]``.

    Args:
        global_shape: shape of the full parameter.
        offsets: the block's starting coordinate in each dimension (same length).
        local_shape: the block's shape (same length), e.g. a TP rank's partition.
        elements: only the block's (row-major flattened) elements ``[lo, hi)``: a run of a large
            block, without building the whole block's indices.

    Returns:
        int64 tensor of shape ``local_shape`` holding row-major indices into ``global_shape``
        (``[hi - lo]`` with ``elements``).

    Raises:
        ValueError: if the lengths differ or the block does not fit inside the global shape.
    """
    if not len(global_shape) == len(offsets) == len(local_shape):
        raise ValueError(f"rank mismatch: global_shape={tuple(global_shape)} offsets={tuple(offsets)} "
                         f"local_shape={tuple(local_shape)}")
    for d, (g, o, n) in enumerate(zip(global_shape, offsets, local_shape)):
        if o < 0 or n < 0 or o + n > g:
            raise ValueError(f"block does not fit in dim {d}: offset {o} + size {n} > global size {g}")
    lo, hi = (0, math.prod(local_shape)) if elements is None else elements
    local = torch.arange(lo, hi, dtype=torch.int64, device=device)
    index = torch.zeros_like(local)
    if local.numel():
        stride = 1
        for g, o, n in zip(reversed(global_shape), reversed(offsets), reversed(local_shape)):
            index += (local % n + o) * stride
            local = local // n
            stride *= g
    return index if elements is not None else index.view(tuple(local_shape))


def index_runs(index: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rows ``(start, numel, index)`` of the runs of consecutive global indices in ``index``.

    A strided TP block (e.g. a row-parallel shard, from :func:`block_index`) is one row per
    contiguous run; append the key columns to get the fused casts' segment rows.

    Args:
        index: global element indices of consecutive buffer elements (any shape, read flat).
        start: buffer position of ``index``'s first element.

    Returns:
        int64 CPU tensor ``[R, 3]``.
    """
    flat = index.reshape(-1).to(device="cpu", dtype=torch.int64)
    if flat.numel() == 0:
        return torch.zeros(0, 3, dtype=torch.int64, device="cpu")
    first = torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), (flat[1:] != flat[:-1] + 1).nonzero().view(-1) + 1])
    numel = torch.diff(first, append=torch.tensor([flat.numel()], device="cpu"))
    return torch.stack([first + start, numel, flat[first]], dim=1)


def to_bits(t: torch.Tensor) -> torch.Tensor:
    """int32 holding ``t``'s bit pattern (float32 viewed; 16-bit floats sign-extended from int16):
    summing tensors where every element has one non-zero contribution is then an exact gather
    (NaN payloads and -0.0 kept)."""
    return t.view(torch.int16).to(torch.int32) if t.element_size() == 2 else t.view(torch.int32)


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`to_bits`: int32 bits back to ``dtype`` (float32, bfloat16 or float16)."""
    return bits.view(dtype) if dtype == torch.float32 else bits.to(torch.int16).view(dtype)


def partition_range(numel: int, part: int, rank: int) -> tuple[int, int]:
    """The elements of a flattened param that rank ``rank`` holds when the param is cut into
    consecutive parts of ``part`` elements, one per rank (ZeRO-3: ``part = ceil(numel / world)``).

    Returns:
        ``(start, count)``: global indices ``[start, start + count)``; ``count`` is smaller than
        ``part`` (0 past the end) where the last parts are padding.
    """
    start = rank * part
    return start, max(0, min(part, numel - start))
