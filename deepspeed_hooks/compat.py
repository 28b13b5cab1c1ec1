"""Everything Fair Cast reads of DeepSpeed beyond its public API (checked against DeepSpeed 0.19.8).

The rest of :mod:`deepspeed_hooks` reaches DeepSpeed's internals through these names only; a
maintainer upgrading DeepSpeed reads this file and the list of wraps in
:func:`deepspeed_hooks.install`.

Where DeepSpeed offers no seam: ZeRO-1/2 (``DeepSpeedZeroOptimizer.step``) and ``BF16_Optimizer``
(``update_lp_params``) round each fp32 partition to bf16 with an inline
``bit16_partitions[partition_id].data.copy_(fp32_partition.data)`` (ZeRO-Offload: into the host
staging buffer :func:`offload_staging`), in the middle of a method that also steps, offloads and
all-gathers; there is no method of its own to wrap. Fair Cast intercepts exactly that copy while
``step`` runs (:class:`faircast_dist.copy_hook.ReplaceCopies`, matched by storage address and
size) and wraps the module-global ``all_gather_dp_groups`` that follows it (:data:`GATHER`). An
upstream seam — a ``_copy_hp_to_lp(group_index)`` method (or a hook) that ``step`` and
``update_lp_params`` call — would replace both with one instance-method wrap. ZeRO-3 has one:
:data:`ZERO3_REASSIGN`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.runtime import bf16_optimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.utils import DummyOptim
from deepspeed.runtime.zero import stage_1_and_2
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

VERSION = deepspeed.__version__

#: the module-global function ZeRO-1/2 ``step`` and both ``update_lp_params`` call after the copy
GATHER = "all_gather_dp_groups"
#: ZeRO-3: ``step`` calls it per sub-group to copy fp32 -> bf16 and re-point the params
ZERO3_REASSIGN = "_reassign_or_swap_out_partitioned_parameters"


def wrapper_path(optimizer) -> str:
    """``"zero12"`` (ZeRO-1/2, BF16_Optimizer), ``"stage0"`` or ``"zero3"``.

    Raises:
        NotImplementedError: another optimizer wrapper (named).
    """
    for types, path in [((DeepSpeedZeroOptimizer, BF16_Optimizer), "zero12"),
                        ((FP16_UnfusedOptimizer, FP16_Optimizer), "stage0"),
                        ((DeepSpeedZeroOptimizer_Stage3,), "zero3")]:
        if isinstance(optimizer, types):
            return path
    raise NotImplementedError(f'"export_cast" mode "fair" does not support the optimizer wrapper '
                              f"{type(optimizer).__name__}")


def updates_nothing(engine) -> str | None:
    """Why ``engine``'s optimizer updates no param (it is an inference engine: a reference, reward
    or frozen model), or None when it trains.

    DeepSpeed 0.19.8 ``DeepSpeedEngine.__init__`` builds an engine without a client optimizer and
    without an ``"optimizer"`` config section as: ``DeepSpeedZeRoOffload`` (ZeRO-3), a
    ``BF16_Optimizer`` over a ``DummyOptim`` (bf16, stage 0), or no optimizer at all.
    """
    optimizer = engine.optimizer
    if optimizer is None:
        return "no optimizer"
    if isinstance(optimizer, DeepSpeedZeRoOffload):
        return "no optimizer (ZeRO-3 DeepSpeedZeRoOffload)"
    if isinstance(getattr(optimizer, "optimizer", None), DummyOptim):
        return f"no optimizer ({type(optimizer).__name__} over DeepSpeed's DummyOptim)"
    if not any(p.requires_grad for p in engine.module.parameters()):
        return "no trainable param (every requires_grad is False)"
    return None


def bind(fn, *args, **kwargs) -> inspect.BoundArguments:
    """``args``/``kwargs`` bound to DeepSpeed's ``fn`` signature, defaults applied (e.g. to read
    ``load_checkpoint``'s ``load_optimizer_states`` however it was passed)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


# -- ZeRO-1/2 and BF16_Optimizer ------------------------------------------------------------------
def flat_partitions(optimizer) -> tuple[list, list, list]:
    """(bf16 param groups, per-rank bf16 partitions of each group, this rank's fp32 partitions)."""
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        names = ("bit16_groups", "parallel_partitioned_bit16_groups", "single_partition_of_fp32_groups")
    else:
        names = ("bf16_groups", "bf16_partitioned_groups", "fp32_groups_flat_partition")
    return tuple(getattr(optimizer, n) for n in names)


def gather_module(optimizer):
    """The module whose :data:`GATHER` the wrapper's ``step`` / ``update_lp_params`` calls."""
    return stage_1_and_2 if isinstance(optimizer, DeepSpeedZeroOptimizer) else bf16_optimizer


def dp_groups(optimizer) -> list:
    """The process group of each param group's partitions."""
    return optimizer.real_dp_process_group


def round_robin_gradients(optimizer) -> bool:
    return bool(getattr(optimizer, "round_robin_gradients", False))


def hp_fragment(param) -> tuple[int, int, int] | None:
    """``(start in this rank's fp32 partition, numel, start in the flattened param)`` of the piece of
    ``param`` this rank holds (from its ``_hp_mapping``), or None when another rank holds it."""
    m = param._hp_mapping
    if m is None:
        return None
    return m.hp_fragment_address.start, m.hp_fragment_address.numel, m.lp_fragment_address.start


def offload_staging(optimizer) -> list:
    """ZeRO-Offload's host bf16 staging buffer per group (empty without offload)."""
    return getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None) or []


# -- stage 0 --------------------------------------------------------------------------------------
def stage0_groups(optimizer) -> tuple[list | None, list, list]:
    """(flat fp32 groups (``FP16_Optimizer``) or None (``FP16_UnfusedOptimizer``), per-param fp32
    groups (None for the fused one), bf16 param groups)."""
    flat = getattr(optimizer, "fp32_groups_flat", None)
    return flat, None if flat is not None else optimizer.fp32_groups, optimizer.fp16_groups


# -- ZeRO-3 ---------------------------------------------------------------------------------------
def zero3_groups(optimizer) -> tuple[list, list, list]:
    """(bf16 params of each sub-group, each sub-group's flat bf16 partition buffer (None when NVMe
    swapped), its flat fp32 partition)."""
    return optimizer.fp16_groups, optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat


def is_zero3(param) -> bool:
    """``param`` is partitioned by ZeRO-3 (``deepspeed.zero.Init`` or a stage-3 engine gave it a ``ds_id``)."""
    return hasattr(param, "ds_id")


def full_numel(param) -> int:
    """Elements of the full (unpartitioned) ``param`` (ZeRO-3: ``ds_numel``; its ``numel()`` is 0)."""
    return param.ds_numel if is_zero3(param) else param.numel()


def full_shape(param) -> tuple[int, ...]:
    """Shape of the full (unpartitioned) ``param`` (ZeRO-3: ``ds_shape``)."""
    return tuple(param.ds_shape if is_zero3(param) else param.shape)


def zero3_local(param) -> tuple[torch.Tensor, int, torch.distributed.ProcessGroup]:
    """``(local, start, group)``: this rank's elements of the flattened ZeRO-3 ``param`` (a view
    of its ``ds_tensor`` without the padding), the index of the first, and the partition group."""
    start, numel, _ = zero3_partition(param, zero3_rank(param))
    return param.ds_tensor.data.view(-1).narrow(0, 0, numel), start, param.ds_process_group


def zero3_partition(param, rank: int) -> tuple[int, int, int]:
    """``(start, numel, partition size)``: the elements ``[start, start + numel)`` of the flattened
    ``param`` that DP rank ``rank`` holds (``numel`` is 0 or less than the partition size at the
    end: padding), from DeepSpeed's partition size ``param.ds_tensor.ds_numel``."""
    from faircast_dist.shards import partition_range
    part = param.ds_tensor.ds_numel
    return (*partition_range(param.ds_numel, part, rank), part)


def zero3_rank(param) -> int:
    """This rank's index in ``param``'s ZeRO-3 partition group."""
    return dist.get_rank(group=param.ds_process_group)


def zero3_repoint(optimizer, sub_group: int) -> None:
    """Re-point sub-group ``sub_group``'s params at its flat bf16 buffer (what :data:`ZERO3_REASSIGN`
    does after its copy)."""
    optimizer._unflatten_partitioned_parameters(sub_group)


@contextlib.contextmanager
def zero3_fp32_reads_tag(tag: str | None):
    """Make ZeRO-3's ``load_checkpoint(..., load_optimizer_states=False)`` read ``tag``.

    DeepSpeed 0.19.8 (``engine._load_checkpoint``) rebuilds the module there with the module-global
    ``get_fp32_state_dict_from_zero_checkpoint(load_dir)``, which reads the tag in ``latest``
    whatever tag was asked for; patched for the duration of the load.
    """
    from deepspeed.runtime import engine as ds_engine
    original = ds_engine.get_fp32_state_dict_from_zero_checkpoint
    if tag is not None:
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = functools.partial(original, tag=tag)
    try:
        yield
    finally:
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = original
