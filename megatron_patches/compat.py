"""Everything that differs between the megatron-core versions we support (0.16.1 .. 0.19.2).

The rest of :mod:`megatron_patches` reaches megatron-core's internals (private methods and
attributes, the optimizers' group lists) through these names only; a maintainer upgrading Megatron
reads this file and the list of wraps in :func:`megatron_patches.optimizer.install` /
:func:`megatron_patches.activate`. Checked against megatron-core 0.16.1 (CI) and 0.19.2
(``bash tests/megatron_019.sh``). Between the two, the copy methods, group attribute names and
checkpoint entry points used here are the same; 0.19 adds FP4 params and
``_is_distopt_quantized_param`` (both refused by Fair Cast). megatron-core 0.20.0 (Megatron-LM main,
read, not run): every name below is still there with the same meaning; it adds
``--optimizer-cuda-graph`` (refused: a replayed step would not advance Fair Cast's export step) and
``prepare_model_params_for_param_sync``, which calls :data:`COPY_TO_PARAM_BUFFER` outside the
optimizer step for MXFP8 grad-buffer reuse (``--reuse-grad-buf-for-mxfp8-param-ag``, refused: MXFP8
params are not bf16 casts); Megatron FSDP's ``FullyShardedOptimizer`` has its own copy methods
(refused).

Seams: the master -> bf16 copy is its own method on every optimizer (:data:`COPY_TO_MODEL`, and
:data:`COPY_TO_PARAM_BUFFER`, :data:`COPY_TO_MAIN`), wrapped per instance. The DistributedOptimizer's
copy also writes fp32 params and quantizes FP8 ones in the same loop, so it runs with its bf16
copies skipped (:class:`faircast_dist.copy_hook.ReplaceCopies`).
"""
from __future__ import annotations

import torch
from megatron.core import package_info
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (ChainedOptimizer, Float16OptimizerWithFloat16Params,
                                               FP32Optimizer)

__all__ = ["VERSION", "ShardedTensor", "ShardedTensorFactory", "DistributedOptimizer",
           "Float16OptimizerWithFloat16Params", "ChainedOptimizer", "FP32Optimizer",
           "is_quantized_param", "uses_precision_aware_optimizer", "sub_optimizers", "COPY_TO_MODEL",
           "COPY_TO_PARAM_BUFFER", "COPY_TO_MAIN", "STEP", "master_shards", "stock_copy_target", "bucket_params",
           "data_parallel_group", "is_expert_param", "is_stub", "uses_megatron_fsdp"]

VERSION = (package_info.MAJOR, package_info.MINOR, package_info.PATCH)

#: the leaf optimizer's master -> model copy (``step_with_ready_grads`` calls it)
COPY_TO_MODEL = "_copy_main_params_to_model_params"
#: the DistributedOptimizer's copy into the param buffer (MXFP8 grad-buffer reuse), when present
COPY_TO_PARAM_BUFFER = "_copy_main_params_to_param_buffer"
#: model -> master (``reload_model_params``)
COPY_TO_MAIN = "_copy_model_params_to_main_params"
#: the leaf's inner optimizer step, then :data:`COPY_TO_MODEL` (public; megatron-core's
#: ``MixedPrecisionOptimizer.step`` and ``ChainedOptimizer`` call it on each leaf)
STEP = "step_with_ready_grads"


def master_shards(leaf) -> list[tuple[torch.nn.Parameter, torch.Tensor, int, int]]:
    """``(model param, fp32 master shard, start, end)`` for each bf16 param this rank owns a master
    of, in optimizer order: the shard is elements ``[start, end)`` of the flattened TP-local param
    (DistributedOptimizer: the range this DP rank owns, a flat master; Float16 optimizer: the whole
    param, a param-shaped master)."""
    out = []
    if isinstance(leaf, DistributedOptimizer):
        for model_group, main_group in zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                r = leaf._get_model_param_range_map(p)["param"]
                out.append((p, main, r.start, r.end))
    else:
        for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            out += [(p, main, 0, p.numel()) for p, main in zip(model_group, main_group)]
    return out


def stock_copy_target(leaf, param: torch.nn.Parameter) -> torch.Tensor:
    """The flat bf16 tensor :data:`COPY_TO_MODEL` writes ``param``'s master shard into
    (DistributedOptimizer: the owned range of the bucket's ``param_data``; else the param itself)."""
    if not isinstance(leaf, DistributedOptimizer):
        return param.data.view(-1)
    world = leaf._get_model_param_range_map(param)["gbuf_world_in_bucket"]
    gbuf_index, _, bucket_id = leaf.model_param_gbuf_map[param]
    return leaf.buffers[gbuf_index].buckets[bucket_id].param_data.view(-1)[world.start:world.end]


def bucket_params(leaf) -> list[torch.nn.Parameter]:
    """Every param in a DistributedOptimizer's grad buffers (all DP ranks' ranges)."""
    return [p for buffer in leaf.buffers for p in buffer.param_index_map]


def data_parallel_group(leaf):
    """The process group a DistributedOptimizer shards its masters over."""
    return leaf.data_parallel_group


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """An MoE expert param (expert-parallel): Megatron marks it ``allreduce=False``, which its
    optimizer builder reads to put it in the expert optimizer."""
    return not getattr(param, "allreduce", True)


def is_stub(leaf) -> bool:
    """A leaf with no params to optimize (e.g. frozen chunks)."""
    return bool(getattr(leaf, "is_stub_optimizer", False))


def uses_megatron_fsdp(leaf) -> bool:
    return bool(getattr(getattr(leaf, "ddp_config", None), "use_megatron_fsdp", False))


def is_quantized_param(optimizer, param: torch.Tensor) -> bool:
    """True for an FP8 / FP4 model param (quantized by Megatron itself, not a bf16 cast)."""
    check = getattr(optimizer, "_is_distopt_quantized_param", None)  # 0.19: FP8 and grouped
    if check is not None and check(param):
        return True
    from megatron.core import fp8_utils
    if getattr(fp8_utils, "is_float8tensor", None) and fp8_utils.is_float8tensor(param):
        return True
    try:  # 0.19: NVFP4 params
        from megatron.core.fp4_utils import is_nvfp4tensor
    except ImportError:
        return False
    return bool(is_nvfp4tensor(param))


def uses_precision_aware_optimizer(config) -> bool:
    """True when TE FusedAdam owns the masters (``--use-precision-aware-optimizer``).

    Then the optimizer writes the bf16 params inside its own kernel (with
    ``store_param_remainders`` the bf16 param *is* the high half of the master), so there is no
    master -> bf16 cast left for Fair Cast to replace.
    """
    return bool(getattr(config, "use_precision_aware_optimizer", False))


def sub_optimizers(optimizer) -> list:
    """The leaf optimizers of a (possibly chained) Megatron optimizer."""
    if isinstance(optimizer, ChainedOptimizer):
        return [o for sub in optimizer.chained_optimizers for o in sub_optimizers(sub)]
    return [optimizer]
