"""One rank's export, written once for every adapter (docs/design.md, "The adapter protocol").

An adapter (DeepSpeed, Megatron, FSDP2, a fourth one) finds the rank's *shards* — an fp32 master slice, the
bf16 tensor it is served into and the global element offsets of its param runs — and calls:

* :meth:`ExportState.export` once per optimizer step, after the masters changed: the bf16 cast of every shard,
  the FP8 served copy (``format "fp8"``: one MAX all-reduce of the scales' absmax), the export step, the
  telemetry, the served copy error feedback replays from. A framework that steps and casts one group at a time
  (DeepSpeed) calls :meth:`ExportState.begin`, :meth:`ExportState.cast` per group, then
  :meth:`ExportState.finish`;
* :meth:`ExportState.replay` where the framework copies the masters into the model again outside a step;
* :meth:`ExportState.snapshot` when the framework checkpoints and :meth:`ExportState.restore` when it loads:
  the adapter only translates an :class:`ExportSnapshot` to and from its framework's checkpoint (DeepSpeed's
  optimizer state, Megatron's ``sharded_state_dict``, DCP for FSDP2); :meth:`ExportState.restart` after the
  masters were replaced by the served model (a model-only load, a weight reload).

The rules live here, once: which export step draws which bits, what a checkpoint's residuals and FP8 state
become under the method now (:func:`residual_rule`, :class:`Fp8Restore`), and the one warning channel
(:func:`warn`).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Hashable, MutableMapping, NamedTuple, Sequence

import torch

from faircast_dist.caster import FairCaster
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
    rounding = "round-to-nearest via bf16" if state.config.fp8_round_bf16 else str(state.method)
    rule = "" if fp8.rule.name == "faircast" else f"fp8_rule {fp8.rule.name!r}: "
    grid = ("; the bf16 params of those weights hold the served FP8 values (fp8_grid): the trainer computes with "
            "them" if state.config.fp8_grid else "")
    return (f"; FP8 E4M3 served weights for {len(fp8.shapes)} params ({rule}{fp8.rule.granularity} scales"
            f"{', UE8M0' if fp8.rule.ue8m0 else ''}{'' if fp8.rule.sticky else ', recomputed each export'}, {rounding})"
            f"{grid}")


class Residuals(enum.Enum):
    """What a load does with a checkpoint's error-feedback residuals (:func:`residual_rule`)."""

    KEEP = "keep"  #: error feedback now and saved: reused exactly
    ZERO = "zero"  #: error feedback now, none saved: they start at zero (warned)
    DROP = "drop"  #: saved, but the method is no longer error feedback: dropped (warned)
    NONE = "none"  #: neither


class Fp8Restore(enum.Enum):
    """What a load does with a checkpoint's FP8 export state (``format "fp8"``)."""

    KEEP = "keep"  #: scales and served bits as saved (error feedback: its FP8 residuals too)
    RECAST = "recast"  #: scales as saved; the bits cast again from the loaded masters at the export step (exact)
    ZERO = "zero"  #: error feedback without saved FP8 residuals: scales as saved, residuals from zero (warned)
    AFRESH = "afresh"  #: no FP8 state: scales set afresh and the copy cast from the loaded masters (warned)


class Restored(NamedTuple):
    """What :meth:`ExportState.restore` did: ``residuals`` (:class:`Residuals`), ``fp8`` (:class:`Fp8Restore`,
    None without FP8 served weights) and ``served``: the snapshot's served bf16 values were written back."""

    residuals: Residuals
    fp8: Fp8Restore | None
    served: bool


def residual_rule(method: Method, saved: bool, saved_method: Method | str | None = None) -> tuple[Residuals, str | None]:
    """The one rule for a checkpoint's error-feedback residuals.

    Args:
        method: the method now.
        saved: the checkpoint holds residuals.
        saved_method: the method the checkpoint was written with, when it records one (the warning then says what
            happened).

    Returns:
        ``(rule, warning)``: the :class:`Residuals` case and, for ``ZERO`` and ``DROP``, the message to log.
    """
    if method.needs_residual:
        if saved:
            return Residuals.KEEP, None
        if saved_method is None:
            why = "the checkpoint holds no error-feedback residuals (and records no method)"
        elif Method(saved_method).needs_residual:
            why = "the checkpoint was written with error_feedback but its residuals are missing"
        else:
            why = f"switching from {Method(saved_method)} to error_feedback"
        return Residuals.ZERO, f"{why}: residuals start at zero"
    if saved:
        return Residuals.DROP, f"the checkpoint has error-feedback residuals but the method is now {method}: dropping them"
    return Residuals.NONE, None


@dataclasses.dataclass
class Shard:
    """One piece of a rank's masters and where it is served.

    Attributes:
        key: names the shard on this rank, the same at every export (e.g. ``id`` of its param, or
            ``(id, start, end)``); residuals, FP8 buffers, the served copy and snapshots are kept under it.
        master: float32 1-D contiguous tensor: the fp32 master elements the rank casts.
        out: bfloat16 1-D tensor indexed like ``master``: what the rank serves (written in place).
        runs: ``(param name, start in the shard, numel, global index of its first element)`` per run
            of consecutive global indices (:func:`faircast_dist.shards.index_runs`).
        counted: the drift telemetry counts this shard on this rank (each element once over all ranks).
        residual: error feedback, where the adapter keeps the shard's residual inside a larger one
            (DeepSpeed: a view of its group's, in the optimizer state): that view (1-D, like ``master``); None: the
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


@dataclasses.dataclass
class ExportSnapshot:
    """A rank's export state as a checkpoint holds it (:meth:`ExportState.snapshot`, :meth:`ExportState.restore`).

    Per-element entries are keyed by shard key, each a 1-D tensor indexed like the shard's master (the snapshot of
    a live state holds views: write it out before the next export). An adapter translates it to and from its
    framework's checkpoint. An entry is None where the checkpoint holds none of it, and then on every rank alike (the
    rules of :meth:`ExportState.restore` follow from it, and some of them cast, collectively); a dict holds the
    entry of each of the rank's shards (none for a rank that holds no such shard).

    Attributes:
        step: the export step (the optimizer steps the served copy is of).
        method: the method that served (None: the checkpoint records none).
        seed: the seed of the random bits (None: not recorded).
        residuals: error feedback: ``{key: residual}`` (any float dtype). Where the method now is not error feedback
            an adapter that did not read them gives ``{}``: the rule only drops them.
        served: ``{key: bfloat16}``: what was served (restored into the shards' ``out`` on load).
        fp8_scales: ``format "fp8"``: ``{param name: float32 scales}``.
        fp8: ``{key: uint8}``: the E4M3 bits served (float8_e4m3fn is taken bit for bit too).
        fp8_residuals: ``{key: float32}``: error feedback's FP8 residuals.
    """

    step: int
    method: Method | None = None
    seed: int | None = None
    residuals: dict | None = None
    served: dict | None = None
    fp8_scales: dict | None = None
    fp8: dict | None = None
    fp8_residuals: dict | None = None


class ExportState:
    """The export state of one rank of one adapter instance (an optimizer, a model).

    The export step is the number of optimizer steps the served copy is of: the export after the k-th step draws
    stochastic rounding's key ``k``, an export of the masters without a step in between (the install-time one, a
    recast after a load) the key of the step it stands at, so every step's export draws fresh bits and a resumed
    run draws what the uninterrupted one did.

    Args:
        config: an :class:`~faircast_dist.ExportCastConfig` (or what ``ExportCastConfig.from_value``
            takes), or a :class:`~faircast_dist.FairCaster` to use as is.
        residuals: where the residuals live (default: a dict of their own); an adapter whose framework moves its
            state around may back them with it (a mutable mapping: DeepSpeed keeps them in the optimizer state,
            which ``offload_states`` moves).
        replays: the framework writes the served tensors again outside a step (Megatron copies the
            masters into its bf16 params on a load or a rebuild): error feedback keeps what each export
            served for :meth:`replay`. False where nothing overwrites them (DeepSpeed, FSDP2).
        shapes: ``format "fp8"`` (required then): ``{param name: full shape}`` of every param of the model,
            the same on every rank (:class:`~faircast_dist.fp8.Fp8Export` picks the FP8 ones).
        fused: ``format "fp8"``: ``{param name: FusedRows}`` of params fused from checkpoint tensors
            (:class:`~faircast_dist.fp8.Fp8Export`'s).
        group: ``format "fp8"``: the process group over which ranks share the model's params, which MAX-reduces
            the FP8 scales' absmax and gathers the FP8 copy (None: the default group; nothing without
            ``torch.distributed``).
        device: where that reduction runs (NCCL: the rank's CUDA device; default: the tensor's own).
        replicated: this state's shards hold every element of their params (DeepSpeed stage 0, where every rank
            does; an export of whole params in one process of a distributed job): nothing to reduce.

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
                 shapes: dict | None = None, fused: dict | None = None, group=None, device=None,
                 replicated: bool = False):
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
        self.group, self.device, self.replicated = group, device, replicated

    @property
    def config(self) -> ExportCastConfig:
        return self.caster.config

    @property
    def method(self) -> Method:
        return self.caster.method

    @property
    def step(self) -> int:
        """The export step: the optimizer steps the served copy is of (keys stochastic rounding's bits)."""
        return self.caster.step

    # -- the export -------------------------------------------------------------------------------------
    def export(self, shards: Sequence[Shard], step: int | None = None) -> None:
        """One export of the rank's masters: :meth:`begin`, :meth:`cast` of every shard, :meth:`finish`.

        ``step``: as for :meth:`begin`."""
        self.begin(shards, step)
        if shards:
            with self.telemetry.span(shards[0].master.device):
                self.cast(shards)
        self.finish(shards)

    def begin(self, shards: Sequence[Shard], step: int | None = None) -> None:
        """Start an export, before anything served is written: set the export step and let the telemetry see
        what is served now.

        Args:
            shards: every shard the export will cast (the telemetry's pieces).
            step: the export step this export draws: the optimizer steps the masters have taken (default: one
                more than the last export's; an adapter that knows better passes it: the step it stands at for a
                recast without a step, the trainer's iteration after a model-only load).
        """
        self.caster.step = self.step + 1 if step is None else int(step)
        self.telemetry.begin(lambda: self.pieces(shards))

    def finish(self, shards: Sequence[Shard]) -> None:
        """Complete the export begun by :meth:`begin` after its :meth:`cast` calls: the FP8 served copy of
        ``shards`` (``format "fp8"``: collective, every rank calls it), the telemetry, and (error feedback) the
        served copy kept for :meth:`replay`."""
        if self.fp8 is not None:
            with self.telemetry.span(shards[0].master.device if shards else "cpu"):
                self.export_fp8(shards)
        self.telemetry.end(lambda: self.pieces(shards))
        self.keep_served(shards)

    def residual(self, key: Hashable, master: torch.Tensor) -> torch.Tensor | None:
        """Error feedback: the residual of shard ``key`` (created as zeros shaped like ``master`` at
        first use); else None."""
        if not self.method.needs_residual:
            return None
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = self.caster.new_residual(master)
        return residual

    def _residual(self, s: Shard, create: bool = True) -> torch.Tensor | None:
        """Shard ``s``'s residual, 1-D (its own view, else the state's; ``create``: made at first use, else None
        where there is none yet)."""
        if s.residual is not None:
            residual = s.residual
        elif create:
            residual = self.residual(s.key, s.master)
        else:
            residual = self.residuals.get(s.key) if self.method.needs_residual else None
        return None if residual is None else residual.view(-1)

    @torch.no_grad()
    def cast(self, shards: Sequence[Shard]) -> None:
        """Cast ``shards`` into their ``out`` at the export step in one fused multi-tensor call
        (:meth:`FairCaster.cast_tensors`); error feedback updates their residuals. Advances nothing."""
        if not shards:
            return
        fragments = [(k, *run) for k, s in enumerate(shards) for run in s.runs]
        residuals = [self._residual(s) for s in shards] if self.method.needs_residual else None
        self.caster.cast_tensors([s.master for s in shards], [s.out for s in shards], fragments, residuals)

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

    def reduce_max(self, t: torch.Tensor) -> None:
        """MAX all-reduce of ``t`` in place over :attr:`group` on :attr:`device` (nothing without
        ``torch.distributed``, or where every rank holds every element)."""
        if self.replicated or not torch.distributed.is_initialized():
            return
        on = t if self.device is None else t.to(self.device)
        torch.distributed.all_reduce(on, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if on is not t:
            t.copy_(on)

    def export_fp8(self, shards: Sequence[Shard]) -> None:
        """``format "fp8"``: cast the FP8 params' elements of ``shards`` into their FP8 bits at the export step with
        the sticky scales (:meth:`faircast_dist.fp8.Fp8Export.export`; collective: every rank calls it). Reports
        the rescales and the FP8 copy's pieces to the telemetry. Nothing without FP8."""
        if self.fp8 is None:
            return
        shards = self.fp8_shards(shards)
        pieces = lambda: self.fp8_pieces(shards)  # noqa: E731  (called only by an observer that measures)
        self.telemetry.fp8_begin(self.fp8, pieces)
        self._cast_fp8(shards)
        self.telemetry.fp8(self.fp8, pieces)

    def _cast_fp8(self, shards: Sequence[Shard], cast: bool = True) -> None:
        """The FP8 cast of ``shards`` (with their FP8 buffers; collective), and with ``fp8_grid`` the served values
        into their bf16 ``out`` (``cast`` False: only that, for bits taken from a checkpoint)."""
        if cast:
            self.fp8.export(shards, self.reduce_max)
        if self.config.fp8_grid:
            self.fp8.grid_into(shards)

    def full_fp8(self, shards: Sequence[Shard]) -> dict[str, torch.Tensor]:
        """``format "fp8"``: ``{name: float8_e4m3fn full tensor}`` of the FP8 params, what the last export cast
        (:meth:`faircast_dist.fp8.Fp8Export.full`; collective: one uint8 MAX all-reduce)."""
        return self.fp8.full(self.fp8_shards(shards), self.reduce_max)

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
        """Write the last export into the shards' ``out`` again, bit for bit: the step does not advance, the
        residuals and the telemetry are untouched (the served model has not changed). Stochastic and dithered
        rounding recast the unchanged masters at the export step; error feedback copies :attr:`served`.

        Raises:
            KeyError: error feedback, a shard with no served copy (never exported nor kept).
        """
        if self.method.needs_residual:
            for s in shards:
                s.out.copy_(self.served[s.key])
        else:
            self.cast(shards)

    # -- checkpoints ------------------------------------------------------------------------------------
    def snapshot(self, shards: Sequence[Shard]) -> ExportSnapshot:
        """The export state of ``shards`` as a checkpoint holds it: the step, the method, the seed, what is
        served, error feedback's residuals and, with ``format "fp8"``, the scales, bits and FP8 residuals (views
        of the live state, not copies)."""
        ef = self.method.needs_residual
        snap = ExportSnapshot(self.step, self.method, self.config.seed,
                              residuals={s.key: self._residual(s) for s in shards} if ef else None,
                              served={s.key: s.out for s in shards})
        if self.fp8 is not None:
            shards = self.fp8_shards(shards)
            snap.fp8_scales = dict(self.fp8.scales)
            snap.fp8 = {s.key: s.fp8 for s in shards}
            snap.fp8_residuals = {s.key: s.fp8_residual for s in shards} if ef else None
        return snap

    @torch.no_grad()
    def restore(self, snapshot: ExportSnapshot | None, shards: Sequence[Shard], *, step: int | None = 0,
                missing_residuals: str | None = None) -> Restored:
        """Take a loaded checkpoint's export state, after the framework loaded the masters (and the model): the
        one rule for every adapter, each case with one warning.

        * No snapshot (a checkpoint written without Fair Cast, or before the first step): warned, then
          :meth:`restart` at ``step``.
        * The export step is the snapshot's; a keyed method with another seed is warned.
        * Residuals (:func:`residual_rule`): kept exactly, zeroed or dropped (:attr:`residuals` emptied, the
          framework's store too).
        * Served values in the snapshot are written into the shards' ``out``; error feedback keeps them for
          :meth:`replay`.
        * ``format "fp8"`` (:class:`Fp8Restore`): the saved scales and bits (error feedback: with its FP8 residuals;
          without them: residuals from zero, warned); saved scales without bits: the copy cast again at the export
          step from the loaded masters, which is what was served for a stateless method; no FP8 state: scales set
          afresh and the copy cast (warned). FP8 state the config no longer serves (format bf16 now, params
          ``fp8_exclude`` keeps bf16 now) is dropped, warned. A cast here is collective: the decisions follow
          from which entries the snapshot holds, the same on every rank.

        Args:
            snapshot: what the adapter read from the checkpoint, or None.
            shards: the rank's shards (their masters as loaded).
            step: without a snapshot: the export step to continue from (None: left as it is: the adapter sets it
                at the next export, Megatron from the trainer's iteration).
            missing_residuals: the adapter's account of why error feedback's residuals were not loaded, said
                instead of the rule's (Megatron: the checkpoint's content metadata did not ask for them).

        Returns:
            :class:`Restored`.

        Raises:
            ValueError: a negative step; a per-element entry missing for a shard, or whose size is not its shard's
                (saved under another layout); or FP8 scales that do not fit
                (:meth:`faircast_dist.fp8.Fp8Export.load_scales`).
        """
        ef = self.method.needs_residual
        self.telemetry.reset()  # the served model is replaced: the next export primes again
        if snapshot is None:
            said = ["the export step " + ("follows the trainer's iteration" if step is None else f"is {step}")]
            said += ["residuals start at zero"] * ef + ["FP8 scales are set afresh from the loaded masters"] * bool(self.fp8)
            warn(f"the checkpoint has no export-cast state (written without Fair Cast, or before the first step?): "
                 f"{', '.join(said)}")
            self.restart(shards, step)
            return Restored(Residuals.ZERO if ef else Residuals.NONE, Fp8Restore.AFRESH if self.fp8 else None, False)
        if int(snapshot.step) < 0:
            raise ValueError(f"export cast: the checkpoint's export step is {snapshot.step}, not a step count")
        self.caster.step = int(snapshot.step)
        if self.method.keyed and snapshot.seed is not None and snapshot.seed != self.config.seed:
            warn(f"the checkpoint was written with seed {snapshot.seed}, the config now says {self.config.seed}: the "
                 "random bits change from here")
        rule, message = residual_rule(self.method, snapshot.residuals is not None, snapshot.method)
        if rule is Residuals.ZERO and missing_residuals is not None:
            message = missing_residuals
        if message:
            warn(message)
        if rule is Residuals.KEEP:
            for s in shards:
                _take(self._residual(s), snapshot.residuals, s.key, "error-feedback residual")
        elif rule is Residuals.ZERO:  # (zeros where there are residuals already; the others start so)
            for s in shards:
                residual = self._residual(s, create=False)
                if residual is not None:
                    residual.zero_()
        elif rule is Residuals.DROP:
            self.residuals.clear()
        if snapshot.served is not None:
            for s in shards:
                _take(s.out, snapshot.served, s.key, "served value")
        fp8 = self._restore_fp8(snapshot, shards)  # (fp8_grid: into what is served, before it is kept)
        self.keep_served(shards)
        return Restored(rule, fp8, snapshot.served is not None)

    def _restore_fp8(self, snapshot: ExportSnapshot, shards: Sequence[Shard]) -> Fp8Restore | None:
        """:meth:`restore`'s FP8 part (see there)."""
        saved = snapshot.fp8_scales
        dropped = sorted(set(saved or ()) - set(self.fp8.shapes if self.fp8 is not None else ()))
        if dropped:
            warn(f"the checkpoint has FP8 export state for {len(dropped)} params served bf16 now ({dropped[:3]}"
                 f"{' ...' if len(dropped) > 3 else ''}: format or fp8_exclude changed): dropping it")
        if self.fp8 is None or not self.fp8.shapes:  # (e.g. Megatron's expert optimizer with the experts bf16)
            return None
        ef = self.method.needs_residual
        shards = self.fp8_shards(shards)
        held = [s for s in shards if self.fp8.runs(s.runs)]
        if saved is None:
            warn("the checkpoint has no FP8 export state: FP8 scales are set afresh from the loaded masters"
                 + (", FP8 residuals start at zero" if ef else ""))
            self._fp8_afresh(shards)
            return Fp8Restore.AFRESH
        self.fp8.load_scales(saved)
        bits = snapshot.fp8 is not None
        if ef and not (bits and snapshot.fp8_residuals is not None):
            warn("the checkpoint has no FP8 error-feedback residuals: they start at zero; its FP8 scales are kept")
            for s in shards:
                s.fp8_residual.zero_()
            fp8 = Fp8Restore.ZERO
        else:
            for s in held if ef else ():
                _take(s.fp8_residual, snapshot.fp8_residuals, s.key, "FP8 residual")
            fp8 = Fp8Restore.KEEP if bits else Fp8Restore.RECAST
        if bits:
            for s in held:
                _take(s.fp8, snapshot.fp8, s.key, "FP8 bits")
        self._cast_fp8(shards, cast=not bits)
        return fp8

    def _fp8_afresh(self, shards: Sequence[Shard]) -> None:
        """Forget the FP8 scales and residuals and cast the FP8 copy of the masters at the export step (collective)."""
        self.fp8.scales = {}
        shards = self.fp8_shards(shards)
        for s in shards:
            if s.fp8_residual is not None:
                s.fp8_residual.zero_()
        self._cast_fp8(shards)

    @torch.no_grad()
    def restart(self, shards: Sequence[Shard], step: int | None = None) -> None:
        """The masters were replaced by what is served (a model-only load, a weight reload): zero the residuals,
        keep what is served and, with ``format "fp8"``, set the scales afresh and cast the FP8 copy of the new
        masters (collective). ``step``: the export step to continue from (None: unchanged)."""
        if step is not None:
            self.caster.step = int(step)
        for s in shards:
            residual = self._residual(s, create=False)  # (none yet: it starts at zero)
            if residual is not None:
                residual.zero_()
        if self.fp8 is not None:
            self._fp8_afresh(shards)  # (fp8_grid: into what is served, before it is kept)
        self.keep_served(shards)
        self.telemetry.reset()


def _take(target: torch.Tensor, saved: dict, key: Hashable, what: str) -> None:
    """Copy ``saved[key]`` into ``target`` (nothing where it is the same memory: a framework that loads in place).

    Raises:
        ValueError: ``key`` missing from ``saved``, or of another size than ``target`` (named).
    """
    if saved.get(key) is None:
        raise ValueError(f"export cast: the checkpoint has no {what} for shard {key!r}")
    value = saved[key].reshape(-1)
    if value.dtype == torch.float8_e4m3fn and target.dtype == torch.uint8:  # FP8 bits: bit for bit, not by value
        value = value.view(torch.uint8)
    if value.numel() != target.numel():
        raise ValueError(f"export cast: the checkpoint's {what} of shard {key!r} has {value.numel()} elements, the "
                         f"shard {target.numel()} (saved under another layout?)")
    if value.data_ptr() != target.data_ptr() or value.device != target.device:
        target.view(-1).copy_(value)
