"""Everything Fair Cast reads of PyTorch FSDP2 beyond its public API (checked against torch 2.13).

FSDP2's documented extension point is a pair of methods on the sharded local tensor of a param,
``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` and
``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``
(``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``FSDPParam.all_gather_inputs`` and
``init_unsharded_param``): when the local tensor has them, FSDP all-gathers what the first returns
instead of ``shard.to(param_dtype)``, its round-to-nearest. FSDP looks them up with ``hasattr`` on
the tensor, and its ``lazy_init`` re-reads them (``_init_extensions``, "allow monkey patch after
init"), so Fair Cast sets them as attributes of the existing local tensors — no tensor subclass,
nothing the optimizer sees changes. Reaching the ``FSDPParam`` objects and their padded shards
needs the private names below; a maintainer upgrading torch reads this file.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

VERSION = torch.__version__


def fsdp_params(model: torch.nn.Module) -> list:
    """Every ``FSDPParam`` of the ``fully_shard``-ed modules in ``model``, in module order, once each
    (modules sharded together by one ``fully_shard([...])`` call share one state).

    Raises:
        ValueError: no module of ``model`` is ``fully_shard``-ed.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("fsdp_hooks: the model has no fully_shard-ed module: call fully_shard(...) first")
    states = list({id(s): s for s in (m._get_fsdp_state() for m in modules)}.values())  # fully_shard([a, b]): one state
    return [fp for state in states for group in state._fsdp_param_groups for fp in group.fsdp_params]


def padded_shard(fp) -> torch.Tensor:
    """The flat fp32 buffer FSDP keeps the local shard in, padding included (1-D, contiguous);
    the local shard is its first elements (``fp.sharded_param._local_tensor`` views it)."""
    return fp._sharded_param_data


def refresh_extensions(fp) -> None:
    """Make FSDP read a param's (new) all-gather extensions, as its ``lazy_init`` does."""
    fp._init_extensions()


def global_offset(param) -> tuple[list[int], list[int]]:
    """``(local_shape, global_offsets)`` of this rank's block of a sharded DTensor param (FSDP
    ``Shard(0)``, HSDP's replicate dim and TP's dims included)."""
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return list(shape), list(offset)


def post_forward_resharding(fp) -> bool:
    """``reshard_after_forward=<int>``: FSDP keeps a smaller-world copy after forward, a state in
    which it calls no all-gather extension (``NotImplementedError``)."""
    return fp.post_forward_mesh_info is not None and fp.post_forward_mesh_info != fp.mesh_info


def offloaded(fp) -> bool:
    """The param's shard lives on the host (``CPUOffloadPolicy``)."""
    return fp.offload_to_cpu
