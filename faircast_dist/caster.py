"""The caster: one export-cast config, the export step, and the casts of fp32 master shards.

Class face (:class:`FairCaster`) for integrations and scripts; the functional casts are
``faircast_dist.cast_stochastic`` / ``cast_error_feedback`` (fused, :mod:`faircast_dist.fused`),
with the plain-torch spec in :mod:`faircast_dist.rounding`. The bf16 bits of an element depend only on
(seed, step, canonical parameter name, global element index, master value, residual) — never on
the layout that holds it (docs/design.md invariant 1).
"""
from __future__ import annotations

import torch

from faircast_dist import fused
from faircast_dist.config import RESIDUAL_DTYPES, ExportCastConfig, Method
from faircast_dist.philox import derive_dither_key, derive_key
from faircast_dist.rounding import cast_nearest


class FairCaster:
    """Casts fp32 master shards to bf16 with the configured method.

    Args:
        config: an :class:`ExportCastConfig` (or anything ``ExportCastConfig.from_value`` takes).

    Attributes:
        step: the export step (int): keys the random bits of stochastic rounding (dithered rounding's bits do
            not depend on it). :class:`~faircast_dist.export.ExportState` sets it for the adapters (the optimizer
            steps the served copy is of); a script of its own calls :meth:`advance` between exports.
    """

    def __init__(self, config=None):
        self.config = ExportCastConfig.from_value(config)
        self.step = 0

    @property
    def method(self) -> Method:
        """What the cast does (a :class:`~faircast_dist.config.Method`, equal to its config string)."""
        return self.config.effective_method

    def key(self, name: str, step: int | None = None) -> tuple[int, int]:
        """Philox key ``(k0, k1)`` of param ``name``'s random bits at export ``step`` (default: the
        current step, :attr:`step`).

        Stochastic rounding: :func:`~faircast_dist.philox.derive_key` (seed, step, name), fresh
        bits at every export. Dithered rounding: :func:`~faircast_dist.philox.derive_dither_key`
        (seed, name), the same bits at every export. Both cast with
        :func:`~faircast_dist.rounding.cast_stochastic` (counter = global element index).

        Raises:
            ValueError: when the method draws no random bits (nearest, error feedback).
        """
        if self.method is Method.STOCHASTIC:
            return derive_key(self.config.seed, self.step if step is None else step, name)
        if self.method is Method.DITHERED:
            return derive_dither_key(self.config.seed, name)
        raise ValueError(f"export cast method {self.method.value!r} draws no random bits: it has no Philox key")

    def new_residual(self, master: torch.Tensor) -> torch.Tensor:
        """A zero residual for ``master`` (same shape and device, the configured dtype)."""
        return torch.zeros(master.shape, dtype=RESIDUAL_DTYPES[self.config.residual_dtype], device=master.device)

    def cast(self, name: str, master: torch.Tensor, index: torch.Tensor | int = 0,
             out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
             backend: str = "auto") -> torch.Tensor:
        """Cast one shard of parameter ``name`` at the current step (the fused kernels; bitwise the
        reference casts of :mod:`faircast_dist.rounding`, NaN payloads aside).

        Args:
            name: canonical parameter name (the same on every rank and layout).
            master: float32 shard, any shape.
            index: global element indices (int64 tensor shaped like ``master``) or the int
                global index of the first element of a contiguous shard (default 0: a whole param).
            out: optional bfloat16 tensor shaped like ``master``, written in place.
            residual: error feedback only (required then): the shard's residual, updated in place
                (:meth:`new_residual` makes a zero one).
            backend: see :func:`faircast_dist.fused.resolve_backend` (``"reference"``: plain torch).

        Returns:
            bfloat16 tensor shaped like ``master`` (``out`` when given).

        Raises:
            TypeError / ValueError: on wrong dtypes or shapes (see :mod:`faircast_dist.rounding`), or error
                feedback without ``residual``.
        """
        method = self.method
        if method is Method.NEAREST:
            return cast_nearest(master, out)
        if method.keyed:
            return fused.cast_stochastic(master, self.key(name), index, out, backend)
        if residual is None:
            raise ValueError(f"FairCaster.cast of {name!r}: error feedback needs the shard's residual "
                             "(residual=caster.new_residual(master) to start from zero)")
        return fused.cast_error_feedback(master, residual, out, backend)

    def cast_flat(self, master: torch.Tensor, out: torch.Tensor, fragments, residual: torch.Tensor | None = None,
                  backend: str = "auto") -> torch.Tensor:
        """Cast the param fragments of one flat fp32 buffer at the current step, in one fused call.

        Bitwise the same as :meth:`cast` on each fragment (see :func:`faircast_dist.fused.cast_flat`).

        Args:
            master: float32 1-D contiguous buffer (e.g. a ZeRO partition).
            out: bfloat16 1-D contiguous buffer indexed like ``master``; only the fragments are
                written. On another device than ``master`` (ZeRO-Offload: fp32 on the host), the
                cast runs on ``master``'s device and each fragment is then copied over.
            fragments: ``(name, start, numel, index)`` per fragment: canonical param name, offset
                in the buffers, element count, global index of its first element in the param.
            residual: error feedback only (required then): float32/bfloat16 1-D buffer indexed
                like ``master``, updated in place.
            backend: see :func:`faircast_dist.fused.resolve_backend`.

        Returns:
            ``out``.

        Raises:
            ValueError / TypeError: a missing residual, bad buffers or fragments (named).
        """
        return self.cast_tensors([master], [out], [(0, *f) for f in fragments],
                                 None if residual is None else [residual], backend)[0]

    def cast_tensors(self, masters: list[torch.Tensor], outs: list[torch.Tensor], fragments,
                     residuals: list[torch.Tensor] | None = None, backend: str = "auto",
                     step: int | None = None) -> list[torch.Tensor]:
        """Multi-tensor :meth:`cast_flat`: the param fragments of many flat buffers in one fused call
        (:func:`faircast_dist.fused.cast_tensors`; e.g. every master shard of a Megatron optimizer).

        Args:
            masters: float32 1-D contiguous buffers.
            outs: bfloat16 1-D contiguous buffers, ``outs[i]`` indexed like ``masters[i]``; only the
                fragments are written (another device than the master: as in :meth:`cast_flat`).
            fragments: ``(tensor, name, start, numel, index)`` per fragment: position in the lists,
                then as in :meth:`cast_flat`.
            residuals: error feedback only (required then): one buffer per master, updated in place.
            backend: see :func:`faircast_dist.fused.resolve_backend`.
            step: the export step whose random bits to draw (default: the current one; an earlier
                step recasts that export's bits from the same masters, e.g. to serve it again).

        Returns:
            ``outs``.

        Raises:
            ValueError / TypeError: a missing residual (error feedback), bad buffers or fragments
                (named; checked once, by :func:`faircast_dist.fused.cast_tensors`).
        """
        rows = list(fragments)
        method = self.method
        if method is Method.NEAREST:
            for k, _, start, numel, _ in rows:
                cast_nearest(masters[k].narrow(0, start, numel), outs[k].narrow(0, start, numel))
            return outs
        keyed = method.keyed
        keys = {name: self.key(name, step) if keyed else (0, 0) for _, name, _, _, _ in rows}
        table = [(k, start, numel, index, *keys[name]) for k, name, start, numel, index in rows]
        targets = [o if o.device == m.device else torch.empty(m.shape, dtype=torch.bfloat16, device=m.device)
                   for m, o in zip(masters, outs)]
        fused.cast_tensors(method.kernel, masters, targets, table, residuals, backend)
        for k, _, start, numel, _ in rows:
            if targets[k] is not outs[k]:
                outs[k].narrow(0, start, numel).copy_(targets[k].narrow(0, start, numel))
        return outs

    def advance(self) -> None:
        """The next export draws the next step's bits (stochastic rounding: fresh bits)."""
        self.step += 1
