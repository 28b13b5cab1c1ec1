"""Take the place of a framework's stock master -> bf16 copy, without editing the framework.

DeepSpeed (ZeRO-1/2, BF16_Optimizer) and Megatron (DistributedOptimizer) round the fp32 masters to
nearest with a plain ``bf16_tensor.copy_(fp32_tensor)`` inside a larger method that does other work
too. Fair Cast writes those same bf16 elements, so that copy is a wasted pass over the model.
While a :class:`ReplaceCopies` is active (a ``TorchFunctionMode``, entered around that method),
every ``Tensor.copy_(dest, src)`` is offered to a callback that recognises the stock copies (by
storage address and size) and returns True when it has taken care of ``dest`` itself (or when the
caller casts into it right after); that copy then does not run. Every other torch call passes
through untouched, and a copy the callback does not recognise runs as before — so a framework
version that copies differently still gets the right bits, from the overwrite that follows.
"""
from __future__ import annotations

from typing import Callable

import torch


class ReplaceCopies(torch.overrides.TorchFunctionMode):
    """Skip the ``dest.copy_(src)`` calls that ``replace(dest, src)`` claims (returns True for).

    Args:
        replace: called with (destination, source) tensors of each plain ``copy_`` (no
            ``non_blocking``) while the mode is active, with the mode off (its own torch calls
            run normally); returns True if it wrote ``dest`` (or will) so the copy must not run.
    """

    def __init__(self, replace: Callable[[torch.Tensor, torch.Tensor], bool]):
        super().__init__()
        self.replace = replace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and len(args) == 2 and not kwargs and self.replace(*args):
            return args[0]
        return func(*args, **(kwargs or {}))
