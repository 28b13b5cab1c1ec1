"""Everything that differs between the megatron-core versions we support (0.16.1 .. 0.19.2).

The rest of :mod:`megatron_patches` goes through these few names only. Checked against
megatron-core 0.16.1 (CI) and 0.19.2 (``bash tests/megatron_019.sh``). Between the two, the
copy methods, group attribute names and checkpoint entry points used here are the same; 0.19
adds FP4 params and ``_is_distopt_quantized_param`` (both refused by Fair Cast).
"""
from __future__ import annotations

import torch
from megatron.core import package_info
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (ChainedOptimizer, Float16OptimizerWithFloat16Params,
                                               FP32Optimizer)

__all__ = ["VERSION", "ShardedTensor", "ShardedTensorFactory", "DistributedOptimizer",
           "Float16OptimizerWithFloat16Params", "ChainedOptimizer", "FP32Optimizer",
           "is_quantized_param", "uses_precision_aware_optimizer", "sub_optimizers"]

VERSION = (package_info.MAJOR, package_info.MINOR, package_info.PATCH)


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
