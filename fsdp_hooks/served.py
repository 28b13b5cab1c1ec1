"""The served bf16 weights of an FSDP2 model with Fair Cast: full params for an inference engine's
``load_weights``, sharded DTensors for a sharded transfer, or deltas since the previous sync."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from faircast_dist.delta import DeltaTracker


def served_weights(model: torch.nn.Module, grid: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, bf16 tensor of the param's full shape)`` for every param once, in
    ``model.named_parameters()`` order:
    exactly the bits this step's forward computes with.

    With ``format "fp8"`` each FP8 param is yielded instead as ``(name, float8_e4m3fn [N, K])`` followed by
    ``(scale name, float32 scales)`` (:meth:`faircast_dist.fp8.Fp8Export.served`): all FP8 params are gathered
    first, in one uint8 all-reduce (memory: 1 byte per FP8 element).

    Each param is all-gathered on its own (memory: one full param at a time) and yielded as a new
    tensor. Collective: every rank must run the generator to the end.

    Args:
        model: a ``fully_shard``-ed model with :func:`fsdp_hooks.install` done.
        grid: with ``format "fp8"`` and an ``fp8_rule`` of recomputed scales: each FP8 param as bf16, its served
            FP8 values ``bf16(q * s)``, for an engine that quantizes bf16 itself (vLLM's online quantization): its
            quantizer returns faircast's codes (:meth:`faircast_dist.fp8.Fp8Export.grid`; ValueError otherwise).

    Raises:
        ValueError: Fair Cast is not installed on ``model``.
    """
    if getattr(model, "export_cast", None) is None:
        raise ValueError("fsdp_hooks.served_weights: Fair Cast is not installed on this model (fsdp_hooks.install)")
    shards = served_shards(model)
    export = model.export_cast
    if export.state.fp8 is None:
        for name, shard in shards.items():
            yield name, shard.full_tensor()
        return
    full = export.state.full_fp8(export.shards())
    yield from export.state.fp8.served(((name, shard.full_tensor) for name, shard in shards.items()), full, grid=grid)


def served_shards(model: torch.nn.Module) -> dict[str, DTensor]:
    """``{name: bf16 DTensor}``: every param's served weights, sharded like the param (each rank's
    local block, no communication), for a sharded weight transfer (torchstore, DCP). ``full_tensor()``
    of each is what :func:`served_weights` yields. The DTensors view Fair Cast's buffers: valid until
    the next ``optimizer.step()``.

    Raises:
        ValueError: Fair Cast is not installed on ``model``.
    """
    export = getattr(model, "export_cast", None)
    if export is None:
        raise ValueError("fsdp_hooks.served_shards: Fair Cast is not installed on this model (fsdp_hooks.install)")
    export.ensure()
    return export.dtensors(dict(zip(export.names, export.outs)))


def served_deltas(model: torch.nn.Module, tracker: DeltaTracker) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Yield ``(name, index, values)`` for every param: the served bf16 elements whose bits changed
    since ``tracker`` last saw them (see :mod:`faircast_dist.delta`; the first call yields every
    element). Every rank yields the same deltas and keeps a bf16 copy of the model in ``tracker``.
    Apply them with :func:`faircast_dist.delta.apply_deltas` (or the vLLM receiver). Collective.

    Args:
        model: as for :func:`served_weights`.
        tracker: a :class:`faircast_dist.delta.DeltaTracker` used only with this model.
    """
    yield from tracker.deltas(served_weights(model))
