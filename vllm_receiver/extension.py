"""The receiver's side inside the vLLM worker: a worker extension (``worker_extension_cls``, the way TRL and verl
extend vLLM's workers), whose methods ``llm.collective_rpc("faircast_...", args=...)`` calls by name.

Nothing pickled crosses the process boundary: the arguments are names, shapes, offsets and flags, the tensors
travel through the shared buffer (:mod:`vllm_receiver.transport`), and what comes back is a layout, digests or
specs. Start the engine with it::

    llm = vllm.LLM(model=path, dtype="bfloat16", worker_extension_cls=vllm_receiver.WORKER_EXTENSION)

A user with an extension of their own (TRL's, verl's) subclasses both and passes that class's qualified name.
"""
from __future__ import annotations

import hashlib

import torch

from vllm_receiver import compat
from vllm_receiver.transport import SharedBuffer, Spec, dtype_name


def digest(t: torch.Tensor, stored: bool = False) -> str:
    """BLAKE2b (16 bytes, hex) of ``t``'s bits. A 2-D tensor (what is read back through a kernel: a linear's
    weight, a tied head) is first made what any kernel read-back gives: its rows holding a NaN or Inf all NaN
    (0 * NaN, 0 * Inf are NaN in the identity product), and its zeros and subnormals +0 (the identity product
    turns -0 into +0; the AVX512-BF16 kernels flush subnormals). So ±0 and subnormal weights compare as +0 there.
    ``stored``: ``t`` is read back as the engine stores it (FP8 weights and their scales): its bits as they are."""
    t = t.detach().contiguous().cpu()
    if t.dim() == 2 and t.is_floating_point() and not stored:
        t = torch.where(t.abs() < torch.finfo(t.dtype).tiny, torch.zeros((), dtype=t.dtype), t)
        bad = ~torch.isfinite(t).all(1)
        if bad.any():
            t[bad] = float("nan")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return hashlib.blake2b(t.view(bits).numpy().tobytes(), digest_size=16).hexdigest()


def digest_fp8(codes: torch.Tensor, scales: torch.Tensor) -> str:
    """BLAKE2b (16 bytes, hex) of an online FP8 tensor's codes (float8_e4m3fn ``[N, K]``) and scales (fp32 ``[N, 1]``),
    all their bits as they are."""
    h = hashlib.blake2b(digest_size=16)
    for t in (codes, scales):
        t = t.detach().contiguous().cpu()
        h.update(t.view({1: torch.uint8, 4: torch.int32}[t.element_size()]).numpy().tobytes())
    return h.hexdigest()


class FairCastWorkerExtension:
    """Methods mixed into vLLM's worker class (``self`` is the worker). Each returns plain data."""

    def faircast_layout(self) -> dict:
        """The engine's checkpoint-name layout.

        Returns:
            ``modules``: ``{vLLM module: [[vLLM param name, [[checkpoint name, rows or None], ...]], ...]}`` (a fused
            layer's checkpoint tensors stacked by rows; an embedding's rows past the vocabulary are padding);
            ``shapes``: ``{checkpoint name: full shape}``; ``dtypes``: ``{checkpoint name: dtype name}`` (the
            engine's, or FP8 and fp32 for an FP8 linear's weight and scales); ``stored``: the checkpoint names read
            back as stored, not through a kernel (FP8 weights, scales: :func:`digest` compares all their bits);
            ``fused``: ``{fused experts checkpoint name: [vLLM param name, shape]}`` (one tensor for all experts'
            gate/up or down, as transformers 5 names them); ``tied``, ``vocab``, ``embedding`` (the tied head's embedding module);
            ``in_place``: every linear computes from its live param (sparse patches land); ``dtype`` (the
            engine's, name), ``tp``, ``pp``; ``online``: the checkpoint weights of the linear layers the engine
            quantizes online (:func:`compat.online_fp8`): each is a bf16 checkpoint tensor here, its layer's
            ``weight_scale`` no checkpoint tensor at all (the engine computes it).

        Raises:
            ValueError: a layer quantized online in a way not served (:func:`compat.online_fp8`), naming it.
        """
        model = compat.model(self)
        packed = compat.packed_modules(model)
        modules, shapes, dtypes, fused, stored, vocab, embedding, in_place = {}, {}, {}, {}, [], None, None, True
        online: list[str] = []
        for name, param in model.named_parameters():
            mod_name, _, leaf = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            short = mod_name.rpartition(".")[2]
            linear, rows = compat.is_linear(mod), compat.vocab_rows(mod)
            quantized_online = compat.online_fp8(mod, mod_name)
            if quantized_online and leaf not in ("weight", "bias"):
                continue  # weight_scale: the engine's own, from the bf16 weight it loads
            if linear and leaf == "weight" and (param.numel() == 0 or compat.is_fp8(param)):
                in_place = False  # repacked, or FP8 held transposed: a sparse patch cannot land
            full = compat.linear_shape(mod, leaf) if linear else tuple(param.shape)
            if compat.is_experts(mod):  # fused experts: every expert's tensors, stacked by rows of the 2-D view
                parts, alias = compat.expert_parts(mod)[leaf]
                if alias:
                    fused[alias] = [name, list(full)]
                full = (full[0] * full[1], full[2])
                in_place = in_place and not compat.experts_packed(mod)
            elif short in packed and linear:  # fused: its checkpoint tensors, stacked by rows
                prefix = mod_name[: len(mod_name) - len(short)]
                parts = [[f"{prefix}{p}.{leaf}", n] for p, n in zip(packed[short], compat.output_sizes(mod))]
            else:
                parts = [[name, rows]]
                if rows is not None and not compat.is_head(mod):
                    vocab, embedding = rows, mod_name
            for hf, rows in parts:
                shapes[hf] = [rows, *full[1:]] if rows is not None else list(full)
                if quantized_online and leaf == "weight":  # checkpoint: bf16; read back as codes and scales
                    dtypes[hf] = dtype_name(compat.dtype(self))
                    online.append(hf)
                    continue
                dtypes[hf] = dtype_name(compat.checkpoint_dtype(leaf, param, compat.dtype(self)))
                if compat.read_as_stored(leaf, param):
                    stored.append(hf)
            modules.setdefault(mod_name, []).append([name, parts])
        tp, pp = compat.parallel_sizes(self)
        tied = bool(getattr(compat.hf_config(self), "tie_word_embeddings", False))
        return dict(modules=modules, shapes=shapes, dtypes=dtypes, fused=fused, stored=stored, tied=tied, vocab=vocab,
                    embedding=embedding, in_place=in_place, dtype=dtype_name(compat.dtype(self)), tp=tp, pp=pp,
                    online=online)

    def faircast_map(self, path: str, size: int, name: str, replaces: str | None) -> int:
        """Map a receiver's shared buffer ``name`` at ``path`` (:meth:`SharedBuffer.open`: only that memory file
        is mapped), known by its ``name`` from now on, dropping the one it ``replaces`` (that receiver's smaller
        one); every receiver of the engine has its own. Returns its size.

        Raises:
            ValueError: ``path`` is not the buffer ``name`` (a file, another memory file), naming it; nothing is
                mapped or dropped. OSError: it cannot be opened."""
        buffer = SharedBuffer.open(path, size, name)
        buffers = self.__dict__.setdefault("_faircast_buffers", {})
        buffers.pop(replaces, None)
        buffers[name] = buffer
        return size

    def _faircast_buffer(self, name: str) -> SharedBuffer:
        buffer = self.__dict__.get("_faircast_buffers", {}).get(name)
        if buffer is None:
            raise KeyError(f"vllm_receiver: no shared buffer named {name!r} is mapped in this worker")
        return buffer

    @torch.no_grad()
    def faircast_read(self, buffer: str, layout: dict, names: list[str] | None, digests: bool) -> dict | list[Spec]:
        """The engine's effective checkpoint tensors ``names`` (None: all; with a tied head also ``lm_head.weight``,
        what the head computes with), read back through their kernels: ``{name: digest}``, or written into the
        shared buffer named ``buffer`` and returned as specs. A weight quantized online (``layout["online"]``) is
        read as its codes and scales: :func:`digest_fp8` of both, or two specs, ``name#codes`` (float8_e4m3fn
        ``[N, K]``) and ``name#scales`` (fp32 ``[N, 1]``)."""
        tensors = self._faircast_effective(layout, None if names is None else set(names))
        if digests:
            return {name: digest_fp8(*t) if isinstance(t, tuple) else digest(t, name in layout["stored"])
                    for name, t in tensors}
        return self._faircast_buffer(buffer).pack(
            item for name, t in tensors
            for item in (((f"{name}#codes", t[0]), (f"{name}#scales", t[1])) if isinstance(t, tuple) else ((name, t),)))

    def _faircast_effective(self, layout: dict, wanted: set | None):
        """``(checkpoint name, what the engine computes with)``: a tensor, or for a weight quantized online its
        ``(codes, scales)`` rows."""
        model = compat.model(self)
        dt, online = getattr(torch, layout["dtype"]), set(layout.get("online", ()))
        for mod_name, params in layout["modules"].items():
            mod = model.get_submodule(mod_name)
            for vname, parts in params:
                if wanted is not None and not any(p in wanted for p, _ in parts):
                    continue
                if parts[0][0] in online:  # the codes [N, K] and scales [N, 1] of the fused layer
                    full = (compat.fp8_weight(mod), compat.online_scales(mod))
                else:
                    full = _effective(mod, vname.rpartition(".")[2], getattr(torch, layout["dtypes"][parts[0][0]]))
                row = 0
                for hf, rows in parts:
                    piece = _rows(full, row, rows)
                    row += rows or 0
                    if wanted is None or hf in wanted:
                        yield hf, piece
        if layout["tied"] and (wanted is None or "lm_head.weight" in wanted):
            yield "lm_head.weight", _effective(model.lm_head, "weight", dt)[: layout["vocab"]]

    def faircast_version(self) -> int:
        """Pushes the engine has taken from any receiver (0 at start): a receiver writes only over the version it
        last saw, so one receiver's push never lands on another's without its copy knowing."""
        return self.__dict__.get("_faircast_version", 0)

    def _faircast_write(self, expect: int | None, write) -> dict:
        """``write()`` if the engine is at version ``expect`` (None: at any), then advance the version; returns
        ``{"version": new}``, or ``{"stale": current}`` with nothing written."""
        current = self.faircast_version()
        if expect is not None and expect != current:
            return {"stale": current}
        write()
        self._faircast_version = current + 1
        return {"version": current + 1}

    def faircast_push(self, buffer: str, specs: list[Spec], repack_head: bool, expect: int | None) -> dict:
        """Rebuild the layers of the tensors ``specs`` name in the shared buffer named ``buffer`` (whole layers,
        checkpoint format) through the in-place reload, and repack the tied head if asked, over version ``expect``
        (:meth:`faircast_version`)."""
        buf = self._faircast_buffer(buffer)

        def write():
            compat.reload(self, [(s[0], buf.view(s)) for s in specs])
            model, names = compat.model(self), {s[0] for s in specs}
            for mod in model.modules():  # the reloaded expert layers, and only those, are prepacked again
                if compat.is_experts(mod) and any(n in names for parts, _ in compat.expert_parts(mod).values()
                                                  for n, _ in parts):
                    compat.prepack_experts(mod)
            compat.drop_gate_caches(model)
            if repack_head:
                compat.repack(model.lm_head)
        return self._faircast_write(expect, write)

    def faircast_patch(self, buffer: str, patches: list[list], dtype: str, repack_head: bool,
                       expect: int | None) -> dict:
        """Write sparse patches ``[name, full shape, index spec, values spec]`` (index and values in the shared
        buffer named ``buffer``) in place, through vLLM's sparse patch path, and repack the tied head if asked, over
        version ``expect`` (as :meth:`faircast_push`)."""
        buf = self._faircast_buffer(buffer)

        def write():
            compat.patch(self, [(n, tuple(shape), buf.view(i), buf.view(v)) for n, shape, i, v in patches],
                         getattr(torch, dtype))
            if repack_head:
                compat.repack(compat.model(self).lm_head)
        return self._faircast_write(expect, write)


def _rows(full, start: int, rows: int | None):
    """Rows ``[start, start + rows)`` of a tensor, or of each tensor of a tuple; all of it where ``rows`` is None."""
    if rows is None:
        return full
    return tuple(t[start: start + rows] for t in full) if isinstance(full, tuple) else full[start: start + rows]


def _effective(mod, leaf: str, dt: torch.dtype) -> torch.Tensor:
    """What ``mod`` computes with for its param ``leaf``, in its checkpoint dtype ``dt``: a linear's or head's weight
    read back through its kernel (``apply(layer, I) = W^T``, exact: one non-zero product per output), an FP8
    weight as stored, an MoE layer's experts un-permuted, else the param (the CPU backend's small-GEMM kernel keeps a
    bf16 linear's bias in fp32, converted exactly from bf16)."""
    param = getattr(mod, leaf)
    if compat.is_experts(mod):  # [E, rows, cols] as the 2-D stack of its checkpoint tensors
        return compat.expert_weight(mod, leaf).flatten(0, 1).to(dt)
    if compat.is_fp8(param):  # FP8: the stored bytes (the kernel dequantizes them with the scales)
        return compat.fp8_weight(mod)
    if leaf == "weight" and (compat.is_linear(mod) or compat.is_head(mod)):
        eye = torch.eye(compat.in_features(mod), dtype=dt, device=param.device)
        return compat.apply_linear(mod, eye).t()
    return param.detach().to(dt)
