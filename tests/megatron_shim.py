"""Test-only: run megatron-core's CUDA-only code paths on CPU (gloo), so CI needs no GPU.

megatron-core 0.16/0.19 hard-codes CUDA in places the tests go through: ``device='cuda'`` /
``torch.cuda.current_device()`` buffers (DDP param/grad buffers, the optimizers), type checks on
``'torch.cuda.BFloat16Tensor'`` (the mixed-precision optimizers), CUDA streams and events (DDP
bucket groups, pipeline schedules), and the CUDA RNG tracker (dropout, weight init forks).
:func:`install` maps all of that onto the CPU:

* a ``TorchFunctionMode`` rewrites any cuda (or int) ``device=`` argument, and ``.cuda()`` /
  ``.to('cuda')``, to the CPU; ``torch.cuda.current_device()`` is the CPU device (autograd
  Functions' backward runs without the mode);
* ``Tensor.type()`` (no argument) reports ``torch.cuda.<T>`` names, which is what Megatron
  compares against;
* ``torch.cuda`` stream / event / synchronize / RNG-state calls become no-ops or use the CPU
  generator, and ``model_parallel_cuda_manual_seed`` seeds a tracker on the CPU generator;
* without Apex/TE, Megatron falls back to torch AdamW, whose per-param ``step`` tensor the
  DistributedOptimizer's checkpoint loaders mishandle (``dp_reshardable`` copies back the stale
  ``step`` of the load template, so a resumed run is not bitwise the uninterrupted one, and
  ``fully_reshardable`` raises ``KeyError: 'step'``). GPU runs use TE/Apex FusedAdam, which keeps
  ``step`` in the param groups, so the shim makes the loaders leave ``step`` to
  ``load_state_dict`` (which restores it from the saved param groups), as FusedAdam would;
  and ``DistributedOptimizer.load_state_dict`` gives every param the *same* ``step`` tensor,
  which torch AdamW then increments once per param per step: the shim un-shares it;
* without TransformerEngine, megatron-core 0.16.1's MoE router gating
  (``transformer/moe/moe_utils.py:1192``, ``RouterGatingLinearFunction``) reads ``te_general_gemm``,
  which that module defines only when TE imports (line 34): the shim defines it as None (the torch
  ``mm`` path the function falls back to);
* the MoE all-to-all token dispatcher moves its split sizes to the host with
  ``moe_utils.maybe_move_tensor_to_cpu`` (``moe_utils.py:1093``), which converts only CUDA tensors
  (to numpy): on the CPU the splits stay tensors and ``all_to_all_single`` refuses them
  (``tensor_parallel/mappings.py:444``); the shim converts CPU tensors as it would CUDA ones.

Never import this from the library: it changes global torch behaviour for the whole process.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_TYPE = torch.Tensor.type
_installed = False


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
            isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def _type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None:
        name = _TYPE(self)
        return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
    if isinstance(dtype, str):
        dtype = dtype.replace("torch.cuda.", "torch.")
    return _TYPE(self, dtype, non_blocking, **kwargs)


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()

    def synchronize(self):
        pass


class _Event(_Stream):
    def record(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, *args):
        return 0.0


class _CpuRngTracker:
    """The CUDA RNG tracker's interface on the CPU generator (states forked by name)."""

    def __init__(self):
        self.states = {}

    def reset(self):
        self.states = {}

    def get_states(self):
        return dict(self.states)

    def set_states(self, states):
        self.states = dict(states)

    def add(self, name, seed):
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    def is_initialized(self):
        return bool(self.states)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        saved = torch.get_rng_state()
        if name in self.states:
            torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            if name in self.states:
                self.states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def install() -> None:
    """Make this process run megatron-core's CUDA code paths on the CPU. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    torch.Tensor.type = _type
    torch.Tensor.cuda = lambda self, *a, **k: self
    cuda = torch.cuda
    # the CPU itself, not index 0: megatron-core also allocates with device=torch.cuda.current_device()
    # inside autograd Functions' backward (sequence parallelism), where no TorchFunctionMode is active
    cuda.current_device = lambda: torch.device("cpu")
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    torch.Tensor.record_stream = lambda self, *a, **k: None

    from megatron.core.tensor_parallel import random as tp_random
    tracker = _CpuRngTracker()
    tp_random.get_cuda_rng_tracker = lambda *a, **k: tracker
    tp_random._CUDA_RNG_STATE_TRACKER = tracker

    def manual_seed(seed, *args, **kwargs):
        from megatron.core import parallel_state
        torch.manual_seed(seed)
        tracker.reset()
        tracker.add("model-parallel-rng", seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
        tracker.add("expert-parallel-rng", seed + 100 * 2718)
    tp_random.model_parallel_cuda_manual_seed = manual_seed
    import megatron.core.tensor_parallel as tp
    tp.model_parallel_cuda_manual_seed = manual_seed
    tp.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    original_set = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, dst in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key != "step":
                dst.copy_(tensors[key])
    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
    DistributedOptimizer.load_state_dict = load_state_dict

    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            return tensor.numpy() if as_numpy else tensor
        return tensor
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    _CudaToCpu().__enter__()  # for the rest of the process
