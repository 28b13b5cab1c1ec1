"""The served bf16 weights of a megatron-core model with Fair Cast, whole, under Megatron's
checkpoint names: for an inference engine's ``load_weights`` (after the engine adapter's name map,
e.g. ``scripts/megatron_llama.py``), or as deltas since the previous sync."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from faircast_dist.delta import DeltaTracker
from megatron_patches.gather import gather_full
from megatron_patches.optimizer import FP8_EXPORTS


def served_weights(model, grid: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, bf16 tensor of the param's full shape)`` for every param once, in sorted name
    order, on every rank: exactly the bits the model computes with after the optimizer step.

    Names are the model's checkpoint keys with global layer numbers (``decoder.layers.<layer>.<rest>``; a MoE
    expert with its global expert number after the last ``experts.``,
    ``...mlp.experts.experts.<expert>.linear_fc1.weight``;
    the tied output weight is served once, as ``embedding.word_embeddings.weight``; SwiGLU ``fc1`` as
    the full ``[gate; up]`` param), each element from its main copy (:func:`megatron_patches.gather.gather_full`).
    With ``--overlap-param-gather`` the param all-gather the next forward would finish is finished
    first, as Megatron-LM does before an evaluation or a save.

    With ``format "fp8"`` each FP8 param is yielded instead as ``(name, float8_e4m3fn [N, K])`` followed by its
    scales (:meth:`faircast_dist.fp8.Fp8Export.served`), in Megatron's row order (the fused ``linear_qkv``
    interleaves q/k/v rows per query group; SwiGLU ``linear_fc1`` is ``[gate; up]``): channel scales
    ``weight_scale`` ``[N, 1]``, whose rows an engine's name map permutes with the weight's; block scales
    ``weight_scale_inv``, the 128x128 blocks of the checkpoint's tensors (q, k, v; gate, up), each tensor's
    ``[ceil(N_part / 128), ceil(K / 128)]`` one after the other, which the name map splits.

    Collective over the default process group: every rank must run the generator (one reduce of the
    whole model's elements, as int32 bits; host memory about 3x the model's element count; FP8: one more
    uint8 all-reduce of the FP8 params' elements per leaf optimizer).

    Args:
        model: this rank's model chunk or list of chunks (DDP-wrapped, any TP/PP/DP layout).
        grid: with ``format "fp8"`` and an ``fp8_rule`` of recomputed scales: each FP8 param as bf16, its served
            FP8 values ``bf16(q * s)``, for an engine that quantizes bf16 itself (vLLM's online quantization): its
            quantizer returns faircast's codes (:meth:`faircast_dist.fp8.Fp8Export.grid`; ValueError otherwise).
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if getattr(chunk, "use_forward_hook", False):  # megatron-core DDP with --overlap-param-gather
            chunk.disable_forward_pre_hook(param_sync=True)
            chunk.enable_forward_pre_hook()
    exports = getattr(chunks[0], FP8_EXPORTS, None) if chunks else None
    fulls = [export.full_fp8() for export in exports or ()]
    weights = iter(gather_full(list(chunks), lambda p: p.detach(), dst=None).items())
    for export, full in zip(exports or (), fulls):
        weights = export.state.fp8.served(weights, full, grid=grid)
    yield from weights


def served_deltas(model, tracker: DeltaTracker) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Yield ``(name, index, values)`` for every param: the served bf16 elements whose bits changed
    since ``tracker`` last saw them (see :mod:`faircast_dist.delta`; the first call yields every
    element), every rank the same. Collective, as :func:`served_weights`.

    Args:
        model: as for :func:`served_weights`.
        tracker: a :class:`faircast_dist.delta.DeltaTracker` used only with this model (each rank
            keeps a bf16 copy of the whole model in it).
    """
    yield from tracker.deltas(served_weights(model))
