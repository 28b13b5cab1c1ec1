"""Delta export: only the served bf16 elements whose bits changed, as (global index, new value).

RL stacks push the served weights to the rollout engine after every step; a delta sync sends, per
param, the flat indices and new bf16 values of the elements that changed since the previous sync.
Its payload is ``k * (index bytes + 2)`` bytes for ``k`` changed elements against ``2 * numel``
for a full sync: with int32 indices it pays off while fewer than a third of the elements change
(round-to-nearest and dithered rounding change well under 1% per step at lr 1e-6; stochastic
rounding redraws its bits every export and approaches 1/3).

A delta is ``(name, index, values)``:

* ``index`` — int32 (int64 for a param of 2**31 elements or more; see :func:`index_dtype`)
  tensor ``[k]``, ascending flat indices into the *full* param (row-major, as
  ``param.reshape(-1)``): global, so a receiver with another layout applies it unchanged;
* ``values`` — bfloat16 tensor ``[k]``, the new served values (FP8 served weights, ``format "fp8"``: float8_e4m3fn
  for an FP8 weight, float32 for its scales; a rescaled channel or block is sent whole).

"Changed" compares bits (integer views), so a sign flip of zero or a new NaN payload is sent too.

Where the previous model is remembered: a :class:`DeltaTracker`, created and kept by the caller,
holds a bf16 copy of what it has seen (2 bytes per tracked element: on a DP rank, what that
rank tracks). Nothing else keeps state.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


#: the served dtypes a delta carries, and the integer view their bits are compared in
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float32: torch.int32}


def index_dtype(numel: int) -> torch.dtype:
    """int32 when every flat index of a param of ``numel`` elements fits in it, else int64."""
    return torch.int32 if numel <= 2**31 else torch.int64


def diff(before: torch.Tensor, after: torch.Tensor, start: int = 0,
         full_numel: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of ``after`` whose bits differ from ``before``.

    Args:
        before, after: bfloat16 (or float8_e4m3fn, float32: FP8 weights and their scales) tensors of one
            shape and dtype (a whole param, or a contiguous shard of its flattened form; read as ``reshape(-1)``).
        start: global flat index of the shard's first element in the full param (0: whole param).
        full_numel: the full param's numel, which picks the index dtype (default: ``start +
            after.numel()``).

    Returns:
        ``(index, values)``: ascending global flat indices ``[k]`` (:func:`index_dtype`) and the
        new values ``[k]`` (``after``'s dtype).

    Raises:
        TypeError: a tensor that is not bfloat16, float8_e4m3fn or float32, or dtypes that differ.
        ValueError: shapes differ.
    """
    for what, t in (("before", before), ("after", after)):
        if t.dtype not in _BITS:
            raise TypeError(f"diff: {what} must be bfloat16 (float8_e4m3fn, float32: FP8 weights, scales), got {t.dtype}")
    if before.dtype != after.dtype:
        raise TypeError(f"diff: before is {before.dtype}, after {after.dtype}")
    if before.shape != after.shape:
        raise ValueError(f"diff: before shape {tuple(before.shape)} != after shape {tuple(after.shape)}")
    new = after.reshape(-1)
    ints = _BITS[new.dtype]
    local = (before.reshape(-1).view(ints) != new.view(ints)).nonzero().squeeze(1)
    dtype = index_dtype(full_numel if full_numel is not None else start + new.numel())
    return (local + start).to(dtype), new[local]


def payload_bytes(deltas: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
    """Bytes a delta sync sends: index and value bytes of every delta (names not counted)."""
    return sum(index.numel() * index.element_size() + values.numel() * values.element_size()
               for _, index, values in deltas)


@torch.no_grad()
def apply_deltas(target, deltas: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
    """Write deltas into a model or a state dict, in place (the receiving side).

    Args:
        target: a ``torch.nn.Module`` (its ``named_parameters()`` and ``named_buffers()``) or a
            ``{name: tensor}`` dict. Each named tensor must be contiguous (written through a flat
            view); any dtype (values are converted, exactly for bf16/fp32 targets).
        deltas: ``(name, index, values)`` triples (see the module docstring).

    Returns:
        The number of elements written.

    Raises:
        KeyError: a delta names a tensor ``target`` does not have.
        ValueError: index and values differ in length, an index is outside the tensor, or the
            tensor is not contiguous.
    """
    tensors = dict(target.named_parameters()) | dict(target.named_buffers()) \
        if isinstance(target, torch.nn.Module) else target
    written = 0
    for name, index, values in deltas:
        if name not in tensors:
            raise KeyError(f"apply_deltas: the target has no tensor named {name!r}")
        t = tensors[name]
        if index.shape != values.shape or index.dim() != 1:
            raise ValueError(f"apply_deltas: {name!r}: index {tuple(index.shape)} and values "
                             f"{tuple(values.shape)} must be 1-D of one length")
        if not t.is_contiguous():
            raise ValueError(f"apply_deltas: {name!r} is not contiguous (written through a flat view)")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= t.numel()):
            raise ValueError(f"apply_deltas: {name!r}: index out of range [0, {t.numel()}): "
                             f"[{int(index.min())}, {int(index.max())}]")
        t.data.view(-1)[index.to(torch.int64).to(t.device)] = values.to(device=t.device, dtype=t.dtype)
        written += index.numel()
    return written


class DeltaTracker:
    """The previously served values (bf16; FP8 weights and their scales), per name, that :meth:`diff` compares
    against.

    Memory: one copy of every tracked tensor (2 bytes per bf16 element, 1 per FP8 one), kept until
    :meth:`clear`. A name seen for the first time has no baseline: all its elements count as
    changed (the first delta is a full sync, correct on any receiver).
    """

    def __init__(self):
        self.baseline: dict[str, torch.Tensor] = {}

    def diff(self, name: str, served: torch.Tensor, start: int = 0,
             full_numel: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Delta of ``served`` against the baseline of ``name``, then make ``served`` the baseline.

        Args:
            name: the key (a param name, or a name plus shard for a rank's piece).
            served: bfloat16 (float8_e4m3fn, float32) tensor; copied into the baseline.
            start, full_numel: as for :func:`diff`.

        Returns:
            ``(index, values)`` as :func:`diff`.

        Raises:
            TypeError / ValueError: as :func:`diff`, also when ``served`` changes shape or dtype.
        """
        old = self.baseline.get(name)
        if old is None:
            diff(served, served)  # the same checks
            self.baseline[name] = served.detach().clone()
            numel = full_numel if full_numel is not None else start + served.numel()
            index = torch.arange(start, start + served.numel(), dtype=index_dtype(numel), device=served.device)
            return index, served.detach().reshape(-1).clone()
        index, values = diff(old, served, start, full_numel)
        old.copy_(served)
        return index, values

    def deltas(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, index, values)`` for each full ``(name, bf16 tensor)`` of ``weights`` (an adapter's
        ``served_weights``), diffed by :meth:`diff`: what every adapter's ``served_deltas`` yields."""
        for name, weight in weights:
            yield (name, *self.diff(name, weight))

    def nbytes(self) -> int:
        """Bytes held by the baselines."""
        return sum(t.numel() * t.element_size() for t in self.baseline.values())

    def clear(self) -> None:
        """Forget every baseline (the next :meth:`diff` of each name is a full sync)."""
        self.baseline.clear()
