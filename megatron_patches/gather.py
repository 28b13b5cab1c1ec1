"""Whole (unsharded) tensors of a megatron-core model, e.g. to serve its weights to an inference engine.

Placement uses only Megatron's own checkpoint metadata — the model's ``sharded_state_dict()``
(``global_shape``, ``global_offset``, ``replica_id``; SwiGLU ``linear_fc1`` halves via its
``ShardedTensorFactory``), the same metadata dist-checkpointing reshards with. It deliberately
does not use :mod:`megatron_patches.layout` (Fair Cast's own mapping), so the tests can check that
mapping against this rather than repeat it.

* :func:`gather_full` — ``{name: full tensor}`` from each rank's TP-local tensors (the params, their
  fp32 masters, grads, ...), on one rank or on all.
* :func:`local_masters` — each param's TP-local fp32 master (or Fair Cast error-feedback residual)
  with the DistributedOptimizer's DP shards put back together, to feed :func:`gather_full`.
* :func:`shards` — where each rank's pieces sit in the full tensors, for placing or checking.

Bit-exact: the collectives sum int32 bit patterns into buffers where every element has exactly
one non-zero contribution (its main copy, ``replica_id`` all 0, or its one DP owner), so the sum
is that copy, bitwise (no float arithmetic, NaN/-0 kept).
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values

from faircast_dist.shards import from_bits, to_bits
from megatron_patches import compat
from megatron_patches.compat import ShardedTensor, ShardedTensorFactory

__all__ = ["gather_full", "local_masters", "shards", "is_main_replica"]

_MODULE = re.compile(r"^(module\.)+")
_LAYERS = re.compile(r"(^|\.)layers\.(?!\d+\.)")  # stacked layers (non-homogeneous ones are numbered in the key)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_main_replica(replica_id) -> bool:
    """True for the copy a checkpoint saves (every component of ``replica_id`` 0)."""
    return all(r == 0 for r in (replica_id if isinstance(replica_id, tuple) else (replica_id,)))


def _on(entry, data: torch.Tensor) -> list:
    """The ShardedTensors of a model ``sharded_state_dict`` entry, rebuilt on ``data`` (param-shaped)."""
    if isinstance(entry, ShardedTensorFactory):
        built = replace(entry, data=data).build()
        return built if isinstance(built, list) else [built]
    return [replace(entry, data=data, dtype=data.dtype)]


def shards(model, local_of: Callable[[torch.nn.Parameter], torch.Tensor],
           stacked: bool = False) -> Iterator[tuple]:
    """``(name, index, sh)`` for every piece of every param of ``model`` (this rank; no collective).

    ``sh`` is the param's ShardedTensor (two per SwiGLU ``fc1``) rebuilt on ``local_of(param)``,
    so ``sh.data`` is a view of that tensor; ``full[name][index]`` (shape ``(1,) * prepended axes +
    sh.data.shape`` when ``stacked``, else ``sh.data.shape``) is where it sits in the full tensor.

    Names: the checkpoint key without leading ``module.``. ``stacked``: one tensor per key, of
    Megatron's ``global_shape`` (layers stacked on a leading axis, as in a checkpoint); else the
    layer axis is dropped and its global number put back after ``layers.``
    (``decoder.layers.3.mlp.linear_fc1.weight``, Fair Cast's canonical names), and a MoE expert's
    global number after the key's last ``experts.``
    (``decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight``, the key Megatron gives one
    expert with ``singleton_local_shards``).

    Args:
        model: a model chunk, any wrapping (DDP, Float16Module), or this rank's list of chunks
            (virtual pipeline: each chunk's layers carry their global numbers).
        local_of: ``param -> tensor shaped like the param``.

    Raises:
        ValueError: a param missing from the model's sharded_state_dict, ``local_of`` giving the
            wrong shape, or (not stacked) an entry with more prepended axes than the layer (and, in
            a key with ``experts.``, the expert).
    """
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        yield from _chunk_shards(chunk, local_of, stacked)


def _chunk_shards(module, local_of, stacked: bool) -> Iterator[tuple]:
    while hasattr(module, "module"):
        module = module.module
    entries = {id(v.data): v for v in nested_values(module.sharded_state_dict())
               if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and isinstance(v.data, torch.Tensor)}
    for param_name, param in module.named_parameters():
        if id(param) not in entries:
            raise ValueError(f"param {param_name!r} is not in the model's sharded_state_dict()")
        local = local_of(param)
        if local.shape != param.shape:
            raise ValueError(f"{param_name}: local_of gave shape {tuple(local.shape)}, the param has "
                             f"{tuple(param.shape)}")
        for sh in _on(entries[id(param)], local):
            key, p = _MODULE.sub("", sh.key), sh.prepend_axis_num
            if stacked:
                name, offset, shape = key, sh.global_offset, (1,) * p + tuple(sh.data.shape)
            else:
                name, axes = key, list(sh.global_offset[:p])  # the layer's axis, then a MoE expert's
                if axes and _LAYERS.search(name):
                    name = _LAYERS.sub(rf"\g<1>layers.{axes.pop(0)}.", name, count=1)
                if axes and ".experts." in name:  # the expert number after the last "experts."
                    at = name.rindex(".experts.") + len(".experts.")
                    name = f"{name[:at]}{axes.pop(0)}.{name[at:]}"
                if axes:
                    raise ValueError(f"{key}: {p} prepended axes (expected the layer's, where the key's "
                                     "'layers.' has no number, and a MoE expert's)")
                offset, shape = sh.global_offset[p:], tuple(sh.data.shape)
            yield name, tuple(slice(o, o + n) for o, n in zip(offset, shape)), sh


def gather_full(model, local_of: Callable[[torch.nn.Parameter], torch.Tensor], dst: Optional[int] = 0,
                group=None, stacked: bool = False) -> Optional[dict]:
    """Full tensors ``{name: tensor}`` from each rank's TP-local tensors (collective).

    Each element is taken from its main copy (``replica_id`` 0: TP-replicated norms, DP replicas
    and the last PP stage's tied embedding are not read). Names and shapes as in :func:`shards`.

    Args:
        model: this rank's model chunk or list of chunks (any wrapping; any TP/PP/DP layout,
            virtual pipeline included).
        local_of: ``param -> TP-local tensor shaped like the param``, bf16, fp16 or fp32 — the
            param itself, its master from :func:`local_masters`, ``p.grad``, ...
        dst: the (global) rank that gets the result, the others get None; None: every rank.
        group: the process group, default the world; it must hold every rank of the model.
        stacked: see :func:`shards`.

    Returns:
        ``{name: tensor}`` (sorted names) on the CPU, in the dtype ``local_of`` gave, bitwise.

    Collectives: one ``all_gather_object`` (names, shapes, dtypes: PP stages hold different
    params), then one ``reduce`` (``all_reduce`` when ``dst`` is None) of an int32 buffer of
    the whole model's elements, on the device of the local tensors (NCCL: CUDA). Host memory:
    about 3x the model's element count in int32.

    Raises:
        ValueError: a dtype other than bf16/fp16/fp32 (and see :func:`shards`).
    """
    fulls, meta, device = {}, {}, None
    for name, index, sh in shards(model, local_of, stacked):
        if sh.data.dtype not in _DTYPES:
            raise ValueError(f"{name}: local_of gave {sh.data.dtype}; expected bf16, fp16 or fp32")
        p = 0 if stacked else sh.prepend_axis_num
        full = fulls.setdefault(name, torch.zeros(sh.global_shape[p:], dtype=torch.int32, device="cpu"))
        meta[name] = (tuple(full.shape), sh.data.dtype)
        device = sh.data.device if device is None else device
        if is_main_replica(sh.replica_id):
            full[index] = to_bits(sh.data).view(full[index].shape).cpu()
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, meta, group=group)
    known = {k: v for d in everyone for k, v in d.items()}
    names = sorted(known)
    flat = torch.cat([fulls.pop(n).reshape(-1) if n in fulls else
                      torch.zeros(math.prod(known[n][0]), dtype=torch.int32, device="cpu") for n in names])
    if torch.distributed.get_backend(group) == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flat = flat.to(device or "cpu")  # the backend's device
    if dst is None:
        torch.distributed.all_reduce(flat, group=group)  # one main copy per element: the sum is it
    else:
        torch.distributed.reduce(flat, dst=dst, group=group)
        if torch.distributed.get_rank() != dst:
            return None
    flat = flat.cpu()
    out, start = {}, 0
    for name in names:
        shape, dtype = known[name]
        part = flat[start:start + math.prod(shape)].view(shape)
        out[name] = from_bits(part, dtype)
        start += part.numel()
    return out


def local_masters(optimizer, residuals: bool = False) -> dict:
    """``{id(model param): TP-local fp32 tensor shaped like the param}`` (collective).

    The fp32 masters, or with ``residuals`` Fair Cast's error-feedback residuals, of every param
    of ``optimizer`` (a Megatron optimizer, possibly chained). DistributedOptimizer: each DP rank
    owns a range of each param; the ranges are put together with one int32 ``all_reduce`` per
    param over the leaf's ``data_parallel_group`` (disjoint ranges, zeros elsewhere: the sum is
    exact), on the param's device. Float16Optimizer: the rank's own masters, no collective
    (not copies: they change with the next step).

    Raises:
        TypeError: a leaf optimizer without fp32 masters (e.g. FP32Optimizer).
        ValueError: ``residuals`` for a leaf without error-feedback residuals.
    """
    result = {}
    for leaf in compat.sub_optimizers(optimizer):
        distributed = isinstance(leaf, compat.DistributedOptimizer)
        if not distributed and not isinstance(leaf, compat.Float16OptimizerWithFloat16Params):
            raise TypeError(f"{type(leaf).__name__} has no fp32 masters of 16-bit params")
        if residuals and not getattr(getattr(leaf, "export_cast", None), "residuals", None):
            raise ValueError(f"{type(leaf).__name__} has no Fair Cast error-feedback residuals")
        owned = {}
        for p, main, start, end in compat.master_shards(leaf):
            value = leaf.export_cast.residuals[id(p)] if residuals else main
            owned[id(p)] = (value.detach().float(), start, end)
        if not distributed:
            result.update({k: v for k, (v, _, _) in owned.items()})
            continue
        for p in compat.bucket_params(leaf):
            bits = torch.zeros(p.numel(), dtype=torch.int32, device=p.device)
            if id(p) in owned:
                value, start, end = owned[id(p)]
                bits[start:end] = value.view(torch.int32)
            torch.distributed.all_reduce(bits, group=compat.data_parallel_group(leaf))
            result[id(p)] = bits.view(torch.float32).view(p.shape)
    return result
