"""One rank's export state, written once for every adapter (docs/design.md, "The adapter protocol").

An adapter (DeepSpeed, Megatron, FSDP2, a fourth one) finds the rank's *shards* — an fp32 master
slice, the bf16 tensor it is served into and the global element offsets of its param runs — and
wires the framework's hooks to call :meth:`ExportState.export` when the masters have been stepped
and :meth:`ExportState.replay` when the framework copies the masters again outside a step. Everything
else is here, once: the caster and its export step, the error-feedback residuals keyed by shard, the
served copy error feedback replays from, the telemetry observer, the rule for a checkpoint's residuals
(:meth:`ExportState.adopt`) and the one warning channel (:func:`warn`).

Saving and loading stay the adapter's glue (each framework checkpoints its own way: DeepSpeed's
optimizer state, Megatron's ``sharded_state_dict``, DCP for FSDP2); it reads and writes
:attr:`ExportState.residuals` and :attr:`ExportState.step`, and calls :meth:`ExportState.adopt` once per load.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Hashable, MutableMapping, Sequence

import torch

from faircast_dist.caster import FairCaster, adopt_residuals
from faircast_dist.config import ExportCastConfig, Method
from faircast_dist.fp8 import Fp8Export
from faircast_dist.telemetry import ExportObserver

#: Fair Cast's one warning channel, in every adapter: WARNING, which a default launch shows (Python's
#: last-resort handler writes it to stderr when nothing configured logging).
logger = logging.getLogger("faircast")


def warn(message: str) -> None:
    """Log ``message`` on Fair Cast's warning channel (:data:`logger`), prefixed ``"Fair Cast: "``."""
    logger.warning("Fair Cast: %s", message)


def fp8_note(state: "ExportState") -> str:
    """What an adapter's install line adds for FP8 served weights (``""`` without): the params, scales and method."""
    fp8 = state.fp8
    if fp8 is None:
        return ""
    rounding = "round-to-nearest via bf16" if state.config.fp8_via_bf16 else str(state.method)
    return (f"; FP8 E4M3 served weights for {len(fp8.shapes)} params ({fp8.layout.granularity} scales"
            f"{', UE8M0' if fp8.layout.ue8m0 else ''}, {rounding})")


@dataclasses.dataclass
class Shard:
    """One piece of a rank's masters and where it is served.

    Attributes:
        key: names the shard on this rank, the same at every export (e.g. ``id`` of its param, or
            ``(id, start, end)``); residuals and the served copy are kept under it.
        master: float32 1-D contiguous tensor: the fp32 master elements the rank casts.
        out: bfloat16 1-D tensor indexed like ``master``: what the rank serves (written in place).
        runs: ``(param name, start in the shard, numel, global index of its first element)`` per run
            of consecutive global indices (:func:`faircast_dist.shards.index_runs`).
        counted: the drift telemetry counts this shard on this rank (each element once over all ranks).
        residual: error feedback, where the adapter keeps the shard's residual inside a larger one
            (DeepSpeed stage 0: a view of its group's): that view (1-D, like ``master``); None: the
            state's own residual of ``key``.
        fp8: ``format "fp8"``: where the adapter keeps the shard's FP8 served bits, a uint8 1-D view
            indexed like ``master`` (E4M3 bit patterns; only FP8 params' runs are written); None: the
            state's own (:attr:`ExportState.fp8_outs`).
        fp8_residual: ``format "fp8"`` with error feedback: the FP8 cast's float32 residual, 1-D like
            ``master`` (master units; separate from the bf16 one); None: the state's own.
    """

    key: Hashable
    master: torch.Tensor
    out: torch.Tensor
    runs: Sequence[tuple[str, int, int, int]]
    counted: bool = True
    residual: torch.Tensor | None = None
    fp8: torch.Tensor | None = None
    fp8_residual: torch.Tensor | None = None


class ExportState:
    """The export state of one rank of one adapter instance (an optimizer, a model).

    Args:
        config: an :class:`~faircast_dist.ExportCastConfig` (or what ``ExportCastConfig.from_value``
            takes), or a :class:`~faircast_dist.FairCaster` to use as is.

        residuals: where the residuals live (default: a dict of their own); an adapter whose
            framework checkpoints a state of its own may back them with it (a mutable mapping:
            DeepSpeed keeps them in the optimizer state, so DeepSpeed's checkpoints carry them).
        replays: the framework writes the served tensors again outside a step (Megatron copies the
            masters into its bf16 params on a load or a rebuild): error feedback keeps what each export
            served for :meth:`replay`. False where the served buffers are the adapter's own (FSDP2).
        shapes: ``format "fp8"`` (required then): ``{param name: full shape}`` of every param of the model,
            the same on every rank (:class:`~faircast_dist.fp8.Fp8Export` picks the FP8 ones).
        fused: ``format "fp8"``: ``{param name: FusedRows}`` of params fused from checkpoint tensors
            (:class:`~faircast_dist.fp8.Fp8Export`'s).

    Attributes:
        caster: the :class:`~faircast_dist.FairCaster`: config, method and export step.
        residuals: error feedback: ``{shard key: residual}`` shaped like the shard's master (the
            config's residual dtype), created as zeros at a shard's first cast; empty otherwise.
        served: error feedback with ``replays``: ``{shard key: bfloat16 copy of what the last export served}``, for
            :meth:`replay` (the last export cannot be recomputed once the update overwrote the
            residual it rounded); 2 bytes per master element, not checkpointed. Empty otherwise.
        telemetry: the :class:`~faircast_dist.telemetry.ExportObserver` every export calls (the
            default measures nothing; an adapter with telemetry on puts a ``DriftObserver`` here).
        fp8: ``format "fp8"``: the :class:`~faircast_dist.fp8.Fp8Export` (FP8 params, sticky scales); else None.
        fp8_outs, fp8_residuals: ``format "fp8"``: ``{shard key: uint8 FP8 bits}`` and (error feedback)
            ``{shard key: float32 residual}``, 1-D like the shard's master, for shards that bring none of their own.

    Raises:
        ValueError: ``format "fp8"`` without ``shapes``.
    """

    def __init__(self, config=None, residuals: MutableMapping | None = None, replays: bool = True,
                 shapes: dict | None = None, fused: dict | None = None):
        self.caster = config if isinstance(config, FairCaster) else FairCaster(config)
        self.replays = replays
        self.residuals: MutableMapping[Hashable, torch.Tensor] = {} if residuals is None else residuals
        self.served: dict[Hashable, torch.Tensor] = {}
        self.telemetry: ExportObserver = ExportObserver()
        if self.config.fp8 and shapes is None:
            raise ValueError("ExportState: format \"fp8\" needs the params' full shapes (shapes=)")
        self.fp8 = Fp8Export(self.caster, shapes, fused) if self.config.fp8 else None
        self.fp8_outs: dict[Hashable, torch.Tensor] = {}
        self.fp8_residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def config(self) -> ExportCastConfig:
        return self.caster.config

    @property
    def method(self) -> Method:
        return self.caster.method

    @property
    def step(self) -> int:
        """Exports done (keys stochastic rounding's bits)."""
        return self.caster.step

    @step.setter
    def step(self, value: int) -> None:
        self.caster.step = int(value)

    # -- the cast ---------------------------------------------------------------------------------------
    def residual(self, key: Hashable, master: torch.Tensor) -> torch.Tensor | None:
        """Error feedback: the residual of shard ``key`` (created as zeros shaped like ``master`` at
        first use); else None."""
        if not self.method.needs_residual:
            return None
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = self.caster.new_residual(master)
        return residual

    @torch.no_grad()
    def cast(self, shards: Sequence[Shard], step: int | None = None) -> None:
        """Cast ``shards`` into their ``out`` at export ``step`` (default: the current one) in one fused
        multi-tensor call (:meth:`FairCaster.cast_tensors`); error feedback updates their residuals.
        Advances nothing."""
        if not shards:
            return
        fragments = [(k, *run) for k, s in enumerate(shards) for run in s.runs]
        residuals = ([(s.residual if s.residual is not None else self.residual(s.key, s.master)).view(-1) for s in shards]
                     if self.method.needs_residual else None)
        self.caster.cast_tensors([s.master for s in shards], [s.out for s in shards], fragments, residuals,
                                 step=step)

    def fp8_shards(self, shards: Sequence[Shard]) -> list[Shard]:
        """``shards`` with their FP8 buffers: the state's own (zeros at first use, keyed by shard) where a
        shard brings none."""
        def own(store, key, master, dtype):
            t = store.get(key)
            if t is None:
                t = store[key] = torch.zeros(master.numel(), dtype=dtype, device=master.device)
            return t
        ef = self.method.needs_residual
        return [dataclasses.replace(
            s, fp8=s.fp8 if s.fp8 is not None else own(self.fp8_outs, s.key, s.master, torch.uint8),
            fp8_residual=s.fp8_residual if s.fp8_residual is not None or not ef
            else own(self.fp8_residuals, s.key, s.master, torch.float32)) for s in shards]

    def export_fp8(self, shards: Sequence[Shard], reduce_max, step: int | None = None) -> None:
        """``format "fp8"``: cast the FP8 params' elements of ``shards`` into their FP8 bits at export ``step``
        (default: the current one) with the sticky scales (:meth:`faircast_dist.fp8.Fp8Export.export`;
        ``reduce_max``: the MAX all-reduce over the ranks sharing the model, every rank calls this). Reports the
        rescales and the FP8 copy's pieces to the telemetry. Nothing without FP8."""
        if self.fp8 is None:
            return
        shards = self.fp8_shards(shards)
        pieces = lambda: self.fp8_pieces(shards)  # noqa: E731  (called only by an observer that measures)
        self.telemetry.fp8_begin(self.fp8, pieces)
        self.fp8.export(shards, reduce_max, step)
        self.telemetry.fp8(self.fp8, pieces)

    def full_fp8(self, shards: Sequence[Shard], reduce_max) -> dict[str, torch.Tensor]:
        """``format "fp8"``: ``{name: float8_e4m3fn full tensor}`` of the FP8 params, what the last export cast
        (:meth:`faircast_dist.fp8.Fp8Export.full`; collective through ``reduce_max``, uint8)."""
        return self.fp8.full(self.fp8_shards(shards), reduce_max)

    def fp8_pieces(self, shards: Sequence[Shard]) -> list[tuple]:
        """What the telemetry measures of the FP8 copy of ``shards`` (with their FP8 buffers, :meth:`fp8_shards`):
        ``(key, master, uint8 E4M3 bits, FP8 runs)`` of the counted shards that hold FP8 runs."""
        pieces = []
        for s in shards:
            runs = self.fp8.runs(s.runs)
            if s.counted and runs:
                pieces.append((s.key, s.master, s.fp8, runs))
        return pieces

    def pieces(self, shards: Sequence[Shard]) -> list[tuple]:
        """What the telemetry measures of ``shards`` (:meth:`DriftSample.observe`'s pieces)."""
        return [(s.key, s.master, s.out, s.runs) for s in shards if s.counted]

    def export(self, shards: Sequence[Shard], advance: bool = True, reduce_max=None) -> None:
        """One export of the rank's masters: cast every shard (telemetry around it), the FP8 served copy
        too (:meth:`export_fp8`), advance the export step, and (error feedback) keep what is served for
        :meth:`replay`.

        ``advance``: False where the adapter counts the export step itself (FSDP2 advances it at each
        optimizer step and casts lazily, at the first all-gather after it). ``reduce_max``: as for
        :meth:`export_fp8` (FP8 only)."""
        pieces = lambda: self.pieces(shards)  # noqa: E731  (called only by an observer that measures)
        self.telemetry.begin(pieces)
        if shards:
            with self.telemetry.span(shards[0].master.device):
                self.cast(shards)
        if self.fp8 is not None:
            with self.telemetry.span(shards[0].master.device if shards else "cpu"):
                self.export_fp8(shards, reduce_max)
        if advance:
            self.caster.advance()
        self.telemetry.end(pieces)
        self.keep_served(shards)

    @torch.no_grad()
    def keep_served(self, shards: Sequence[Shard]) -> None:
        """Error feedback (with :attr:`replays`): copy each shard's ``out`` (what is served now) into
        :attr:`served`."""
        if not (self.replays and self.method.needs_residual):
            return
        for s in shards:
            kept = self.served.get(s.key)
            if kept is None:
                self.served[s.key] = s.out.detach().clone()
            else:
                kept.copy_(s.out)

    @torch.no_grad()
    def replay(self, shards: Sequence[Shard]) -> None:
        """Write the last export into the shards' ``out`` again, bit for bit: the step does not
        advance, the residuals and the telemetry are untouched (the served model has not changed).

        Stochastic and dithered rounding recast the unchanged masters with the last export's keys;
        before the first export the shards get the masters' round-to-nearest values (frameworks
        build the masters from the bf16 model). Error feedback copies :attr:`served`.

        Raises:
            KeyError: error feedback, a shard with no served copy (never exported nor kept).
        """
        if self.method.needs_residual:
            for s in shards:
                s.out.copy_(self.served[s.key])
        elif self.step == 0:
            for s in shards:
                s.out.copy_(s.master)
        else:
            self.cast(shards, step=self.step - 1)

    # -- checkpoints ------------------------------------------------------------------------------------
    def restart(self, shards: Sequence[Shard]) -> None:
        """The masters were replaced and match what is served (a model-only load, a weight reload):
        zero the residuals (FP8 ones too) and keep what is served."""
        for residual in [*self.residuals.values(), *self.fp8_residuals.values()]:
            residual.zero_()
        self.keep_served(shards)

    def adopt(self, saved: bool, saved_method: str | Method | None = None, warning: str | None = None) -> str:
        """Apply the one rule for a loaded checkpoint's residuals
        (:func:`faircast_dist.caster.adopt_residuals`) and warn once when they are not kept.

        Args:
            saved: the checkpoint holds error-feedback residuals (for this rank).
            saved_method: the method the checkpoint was written with, when it records one.
            warning: the adapter's own account, logged instead of the rule's when residuals are not
                kept (e.g. Megatron: residuals written but not requested; ``""``: nothing, the
                adapter has said it).

        Returns:
            ``"keep"`` (the adapter copies the saved residuals into :attr:`residuals`), ``"zero"``
            (residuals zeroed here), ``"drop"`` (the saved ones are ignored) or ``"none"``.
        """
        action, message = adopt_residuals(self.method, saved,
                                          None if saved_method is None else str(saved_method))
        if action == "zero":
            for residual in self.residuals.values():
                residual.zero_()
        if warning is not None and action in ("zero", "drop"):
            message = warning
        if message:
            warn(message)
        self.telemetry.reset()  # the served model is replaced: the next export primes again
        return action
