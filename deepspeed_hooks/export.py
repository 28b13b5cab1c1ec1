"""What every DeepSpeed optimizer path shares: its shards, and its export state in DeepSpeed's checkpoints.

An optimizer path (ZeRO-1/2, BF16_Optimizer, stage 0, ZeRO-3) is described by its *groups*: each
group is one fp32 tensor that the base optimizer steps (a flat partition, or a whole param) plus
its *fragments* — the pieces of named params it holds, each with where it starts in the group,
its global element index (in the flattened full param) and the bf16 tensor it is served into.
The adapters in this package only build that description; this module turns it into the core's shards
(:class:`faircast_dist.export.Shard`) and hands them to the :class:`~faircast_dist.export.ExportState`, which
does the export, one group at a time as DeepSpeed steps them, and the rules of a load.

The export state's snapshot is kept in the base optimizer's ``state[group fp32 tensor]`` so DeepSpeed's own
``save_checkpoint``/``load_checkpoint`` carry it with each rank's optimizer state:

* ``"export_cast_step"`` — int: the export step (keys the random bits; :class:`~faircast_dist.export.ExportState`).
* ``"export_cast_residual"`` — error feedback: float32/bfloat16 tensor shaped like the group.
* ``"export_cast_served"`` — bfloat16 tensor shaped like the group, written at checkpoint time
  (and dropped at the next export): the bf16 values served at that step, so that paths that
  re-round bf16 from fp32 on load (ZeRO-3, universal checkpoints) restore exactly them.
* ``format "fp8"``, written at checkpoint time (kept by the export between checkpoints, and dropped
  from the state at the next export): ``"export_cast_fp8"`` — uint8 tensor shaped like the group: the
  E4M3 bits served (FP8 params' elements); ``"export_cast_fp8_residual"`` — error feedback: the FP8
  cast's float32 residual; ``"export_cast_fp8_scales"`` — ``{param name: float32 scales}`` of every FP8
  param (the same in every group and on every rank).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import MutableMapping

import torch
from deepspeed import comm as dist

from deepspeed_hooks import compat
from faircast_dist import FairCaster
from faircast_dist.config import RESIDUAL_DTYPES, Method
from faircast_dist.export import ExportSnapshot, ExportState, Shard
from faircast_dist.fp8 import fused_experts
from faircast_dist.telemetry import ExportObserver

STEP_KEY = "export_cast_step"
RESIDUAL_KEY = "export_cast_residual"
SERVED_KEY = "export_cast_served"
# the method that served them, for the load's messages: its position in ``list(Method)``, an int,
# which torch's ``Optimizer.load_state_dict`` keeps (it would turn a str into a generator's repr)
METHOD_KEY = "export_cast_method"
FP8_KEY = "export_cast_fp8"
FP8_RESIDUAL_KEY = "export_cast_fp8_residual"
FP8_SCALES_KEY = "export_cast_fp8_scales"
STATE_KEYS = (STEP_KEY, RESIDUAL_KEY, SERVED_KEY, METHOD_KEY, FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY)
#: a universal checkpoint's Fair Cast metadata, ``zero/export_cast.pt`` (written by :mod:`deepspeed_hooks.checkpoint`)
UNIVERSAL_STATE_FILE = "export_cast.pt"


@dataclasses.dataclass
class Fragment:
    """A piece of one param inside a group's fp32 tensor.

    Attributes:
        name: canonical param name (``engine.param_names``; the same on every rank and layout).
        start: offset of the piece in the group's flattened fp32 tensor (elements).
        numel: number of elements.
        index: global element index of its first element in the flattened full param.
        out: bfloat16 1-D tensor of ``numel`` elements the piece is served into.
    """

    name: str
    start: int
    numel: int
    index: int
    out: torch.Tensor


class StateResiduals(MutableMapping):
    """The residual store of a DeepSpeed export (:attr:`ExportState.residuals`), kept where DeepSpeed
    checkpoints it: ``base optimizer.state[group fp32 tensor]["export_cast_residual"]``, keyed by
    that tensor (read through ``.state`` each time: torch's ``load_state_dict`` replaces it)."""

    def __init__(self, base_optimizer):
        self.base = base_optimizer

    def __getitem__(self, hp):
        state = self.base.state.get(hp)
        if state is None or RESIDUAL_KEY not in state:
            raise KeyError(hp)
        return state[RESIDUAL_KEY]

    def __setitem__(self, hp, residual):
        self.base.state[hp][RESIDUAL_KEY] = residual

    def __delitem__(self, hp):
        del self.base.state[hp][RESIDUAL_KEY]

    def __iter__(self):
        return iter([hp for hp, state in self.base.state.items() if RESIDUAL_KEY in state])

    def __len__(self):
        return len(list(iter(self)))


class OptimizerExport:
    """Fair Cast on one DeepSpeed optimizer wrapper: its shard geometry and the translation of the
    :class:`~faircast_dist.export.ExportState`'s checkpoints to and from DeepSpeed's optimizer state. Subclasses
    define :meth:`groups`.

    Args:
        optimizer: the DeepSpeed optimizer wrapper (``engine.optimizer``).
        caster: the :class:`FairCaster` built from the ``export_cast`` config.
        param_names: ``{param: name}`` (``engine.param_names``).
        model: the engine's module (``format "fp8"``: its transformers 5 fused experts are FP8 too,
            :func:`faircast_dist.fp8.fused_experts`).

    Attributes:
        state: the :class:`~faircast_dist.export.ExportState` (step, telemetry: a DriftMonitor when
            DeepSpeed's monitor is enabled), its residuals in the base optimizer's state
            (:class:`StateResiduals`), its FP8 buffers one per group (keyed by the group's position).
    """

    #: every rank holds full copies (stage 0): gathering needs no reduction
    replicated = False

    def __init__(self, optimizer, caster: FairCaster, param_names: dict, model: torch.nn.Module):
        from deepspeed.accelerator import get_accelerator
        self.optimizer, self.param_names = optimizer, param_names
        shapes = {name: compat.full_shape(p) for p, name in param_names.items()}
        fused = fused_experts(model, shapes) if caster.config.fp8 else None
        self.state = ExportState(caster, residuals=StateResiduals(optimizer.optimizer), replays=False, shapes=shapes,
                                 fused=fused, group=None if self.replicated else self.dp_group(0),
                                 device=get_accelerator().current_device_name(), replicated=self.replicated)
        self.in_step = False
        self._cast_now: set[int] = set()  # id of each group fp32 tensor cast since the last finish() (empty: no export)

    @property
    def caster(self) -> FairCaster:
        return self.state.caster

    @property
    def telemetry(self) -> ExportObserver:
        return self.state.telemetry

    # ---- what an adapter provides
    def groups(self) -> list[tuple[torch.Tensor, list[Fragment]]]:
        """``[(fp32 group tensor, [Fragment, ...]), ...]`` for this rank."""
        raise NotImplementedError

    def dp_group(self, i: int):
        """The process group over which group ``i``'s partitions are spread (None = world)."""
        return None

    def step_context(self):
        """A context manager entered around the wrapped ``step`` (none by default)."""
        return contextlib.nullcontext()

    # ---- the wraps (listed by deepspeed_hooks.install, each ``original -> replacement``)
    #: True when the export runs after ``step`` returns (stage 0); False when it runs inside
    #: ``step`` (a copy, gather or reassign hook), which then only marks it
    step_exports = False

    def wrap_step(self, step):
        """``optimizer.step``: export (or let the hooks inside export), then :meth:`finish`."""
        @functools.wraps(step)
        def fair_step(*args, **kwargs):
            if self.step_exports:  # the stock copy writes the served params inside step: the telemetry sees them first
                self.telemetry.begin(lambda: self.state.pieces(self.shards()))
            self.in_step = True
            try:
                with self.step_context():
                    result = step(*args, **kwargs)
            finally:
                self.in_step = False
            if self.step_exports and not getattr(self.optimizer, "overflow", False):
                self.export()
            self.finish()
            return result
        return fair_step

    def wrap_state_dict(self, state_dict):
        """``optimizer.state_dict``: put the export state into the optimizer state first (:meth:`save_state`)."""
        @functools.wraps(state_dict)
        def fair_state_dict(*args, **kwargs):
            self.save_state()
            return state_dict(*args, **kwargs)
        return fair_state_dict

    def wrap_load_state_dict(self, load_state_dict):
        """``optimizer.load_state_dict``: then restore the loaded export state (:meth:`after_load`)."""
        @functools.wraps(load_state_dict)
        def fair_load_state_dict(*args, **kwargs):
            result = load_state_dict(*args, **kwargs)
            self.after_load(kwargs.get("checkpoint_folder"))
            return result
        return fair_load_state_dict

    # ---- the shards
    def group_state(self, hp: torch.Tensor) -> dict:
        """The base optimizer's state of group fp32 tensor ``hp`` (where Fair Cast's entries live)."""
        return self.optimizer.optimizer.state[hp]

    def group(self, i: int) -> tuple[torch.Tensor, list[Fragment]]:
        """Group ``i`` of :meth:`groups` (adapters that cast one group at a time build only it)."""
        return self.groups()[i]

    @staticmethod
    def buffers(key, hp: torch.Tensor, fragments: list[Fragment], out: torch.Tensor | None = None) -> list[tuple]:
        """How a group is cast: ``(key, start, fp32 1-D master, bf16 1-D served, rows)`` per call,
        ``start`` being the master's offset in ``hp`` and ``rows`` ``(name, start in the master,
        numel, index)`` per fragment. One call for the whole group when its bf16 targets lie in one buffer laid out
        like ``hp`` (ZeRO partitions, ZeRO-3 sub-groups; ``out``: such a buffer to write instead),
        else one per fragment (stage 0: bf16 params in separate tensors), keyed ``(key, j)``."""
        flat = hp.view(-1)
        out = _flat_out(fragments) if out is None else out
        if out is not None:
            return [(key, 0, flat, out, [(f.name, f.start, f.numel, f.index) for f in fragments])]
        return [((key, j), f.start, flat.narrow(0, f.start, f.numel), f.out.view(-1), [(f.name, 0, f.numel, f.index)])
                for j, f in enumerate(fragments)]

    def group_shards(self, i: int, hp: torch.Tensor, fragments: list[Fragment],
                     out: torch.Tensor | None = None) -> list[Shard]:
        """Group ``i`` as the core's shards (:meth:`buffers`), each with views of the group's residual (error feedback,
        once the base optimizer holds state for the group: an entry in its empty state would stop torch's optimizers
        from creating theirs), FP8 bits and FP8 residual. Stage 0, where every rank casts the whole model, counts in
        the telemetry on rank 0 only."""
        residual = self.state.residual(hp, hp.view(-1)) if self.optimizer.optimizer.state.get(hp) else None
        fp8, fp8_residual = None, None
        if self.state.fp8 is not None:
            fp8 = _own(self.state.fp8_outs, i, hp, torch.uint8)
            if self.caster.method.needs_residual:
                fp8_residual = _own(self.state.fp8_residuals, i, hp, torch.float32)
        counted = not self.replicated or dist.get_rank() == 0
        part = lambda t, start, n: None if t is None else t.view(-1).narrow(0, start, n)  # noqa: E731
        return [Shard(key, master, served, rows, counted, part(residual, start, master.numel()),
                      part(fp8, start, master.numel()), part(fp8_residual, start, master.numel()))
                for key, start, master, served, rows in self.buffers(i, hp, fragments, out)]

    def shards(self, groups: list | None = None) -> list[Shard]:
        """This rank's shards, every group's (``groups``: :meth:`groups`, when the caller has them)."""
        return [s for i, (hp, fragments) in enumerate(self.groups() if groups is None else groups)
                for s in self.group_shards(i, hp, fragments)]

    # ---- the export, one group at a time
    @torch.no_grad()
    def _cast(self, i: int, hp: torch.Tensor, fragments: list[Fragment], out: torch.Tensor | None = None) -> None:
        """Cast group ``i``; the step's first cast begins the export. ``out``: a bf16 1-D buffer laid out like ``hp``
        to write instead of the fragments' own targets (ZeRO-1/2: the buffer DeepSpeed's copy was about to fill)."""
        if not self._cast_now:
            self.state.begin(self.shards())
        with self.telemetry.span(hp.device):  # one span per group (ZeRO steps each group just before its cast)
            self.group_state(hp).pop(SERVED_KEY, None)
            self.state.cast(self.group_shards(i, hp, fragments, out))
        self._cast_now.add(id(hp))

    def export_group(self, i: int) -> None:
        """Cast group ``i``'s fp32 tensor into its bf16 destinations (this rank's shard only)."""
        self._cast(i, *self.group(i))

    def finish(self) -> None:
        """After a step's casts: the rest of the export (the FP8 served copy, collective; the telemetry); a
        checkpoint's FP8 copy in the optimizer state is stale then."""
        if not self._cast_now:
            return
        self._cast_now.clear()
        groups = self.groups()
        self.state.finish(self.shards(groups))
        for hp, _ in groups:
            for key in (FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY):
                self.optimizer.optimizer.state.get(hp, {}).pop(key, None)

    def export(self) -> None:
        """Export every group not cast yet in this step, then :meth:`finish`."""
        for i, (hp, fragments) in enumerate(self.groups()):
            if id(hp) not in self._cast_now:
                self._cast(i, hp, fragments)
        self.finish()

    # ---- checkpoints: the snapshot in DeepSpeed's optimizer state
    @torch.no_grad()
    def save_state(self) -> None:
        """Put the export state's snapshot into each group's optimizer state (before a checkpoint save): the step,
        the method, the bf16 values served (the residual is there already) and, with FP8, the bits, scales and
        residuals. Nothing before the base optimizer's first step (entries in its empty state would stop torch's
        optimizers from creating theirs: such a checkpoint is loaded as one without Fair Cast state)."""
        groups = self.groups()
        if not any(self.optimizer.optimizer.state.get(hp) for hp, _ in groups):
            return
        snap = self.state.snapshot(self.shards(groups))
        for i, (hp, fragments) in enumerate(groups):
            served = torch.zeros(hp.numel(), dtype=torch.bfloat16, device=hp.device)
            for key, start, _, out, _ in self.buffers(i, hp, fragments):  # (out may end before a padded hp)
                served.narrow(0, start, out.numel()).copy_(snap.served[key])
            state = self.group_state(hp)
            state[SERVED_KEY], state[STEP_KEY], state[METHOD_KEY] = served, snap.step, list(Method).index(snap.method)
            if snap.fp8_scales is not None:
                state[FP8_KEY], state[FP8_SCALES_KEY] = self.state.fp8_outs[i], snap.fp8_scales
                if self.caster.method.needs_residual:
                    state[FP8_RESIDUAL_KEY] = self.state.fp8_residuals[i]

    @torch.no_grad()
    def restore_served(self) -> bool:
        """Write the served bf16 values found in the state back (after a load that re-rounded).

        Returns:
            True if any group had them.
        """
        found = False
        for hp, fragments in self.groups():
            served = self.group_state(hp).get(SERVED_KEY)
            if served is None:
                continue
            found = True
            for f in fragments:
                f.out.copy_(served.view(-1).narrow(0, f.start, f.numel))
        return found

    def after_load(self, universal_folder: str | None = None) -> None:
        """Restore the export state just loaded into the base optimizer's state: read its snapshot out of the
        groups' state and hand it to :meth:`faircast_dist.export.ExportState.restore` (the rules are there).

        Args:
            universal_folder: the universal checkpoint just loaded, if any: its Fair Cast files
                (written by :mod:`deepspeed_hooks.checkpoint`) are read into this rank's groups,
                each element's residual and served value following the element.

        Raises:
            ValueError: groups disagree on the step, or a saved per-element entry does not match its group's
                size (the message names the params of that group).
        """
        if universal_folder is not None:
            self._load_universal(universal_folder)
        groups = self.groups()
        steps = {self.group_state(hp).get(STEP_KEY) for hp, _ in groups}
        if len(steps) != 1:
            raise ValueError(f"export cast: param groups disagree on {STEP_KEY}: {sorted(map(str, steps))}")
        (step,) = steps
        for hp, fragments in groups:
            state = self.group_state(hp)
            for key in (RESIDUAL_KEY, FP8_KEY, FP8_RESIDUAL_KEY):
                if state.get(key) is not None and state[key].numel() != hp.numel():
                    names = sorted({f.name for f in fragments})
                    raise ValueError(f"export cast: saved {key} has {state[key].numel()} elements but the partition "
                                     f"holding {names} has {hp.numel()} (saved under another layout?)")
            if state.get(RESIDUAL_KEY) is not None:  # torch's Optimizer.load_state_dict casts float state to the
                state[RESIDUAL_KEY] = state[RESIDUAL_KEY].to(RESIDUAL_DTYPES[self.caster.config.residual_dtype]
                                                             ).view(hp.shape)  # param dtype: undo it
        snap = None if step is None else self._snapshot(groups, int(step))
        self.state.restore(snap, self.shards(groups))
        for hp, _ in groups:  # copied into the export state (or not wanted)
            for key in (FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY):
                self.group_state(hp).pop(key, None)

    def _snapshot(self, groups, step: int) -> ExportSnapshot:
        """The :class:`~faircast_dist.export.ExportSnapshot` of the groups' loaded state (views of it)."""
        states = [self.group_state(hp) for hp, _ in groups]
        codes = {state.get(METHOD_KEY) for state in states}
        code = next(iter(codes)) if len(codes) == 1 else None
        scales = next((st[FP8_SCALES_KEY] for st in states if st.get(FP8_SCALES_KEY) is not None), None)
        entries = {}  # snapshot field -> {shard key: view}, for the state keys some group holds (every group: saved alike)
        for field, key, dtype in (("residuals", RESIDUAL_KEY, None), ("served", SERVED_KEY, torch.bfloat16),
                                  ("fp8", FP8_KEY, torch.uint8), ("fp8_residuals", FP8_RESIDUAL_KEY, torch.float32)):
            for i, ((hp, fragments), state) in enumerate(zip(groups, states)):
                value = state.get(key)
                if value is None:
                    continue
                value = value.view(-1) if dtype is None else value.to(dtype).view(-1)
                for shard, start, master, out, _ in self.buffers(i, hp, fragments):
                    entries.setdefault(field, {})[shard] = value.narrow(0, start, (out if key == SERVED_KEY else master).numel())
        return ExportSnapshot(step, None if code is None else list(Method)[code], fp8_scales=scales, **entries)

    def _load_universal(self, folder: str) -> None:
        if not os.path.exists(os.path.join(folder, "zero", UNIVERSAL_STATE_FILE)):
            return  # converted without Fair Cast state: after_load's rules for a plain checkpoint apply
        names = sorted({f.name for _, fragments in self.groups() for f in fragments})
        meta, values = read_universal(folder, names)
        for hp, _ in self.groups():
            state = self.group_state(hp)
            state[STEP_KEY] = meta["step"]
            for key in (RESIDUAL_KEY, SERVED_KEY, FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY):
                state.pop(key, None)  # DeepSpeed's own loader may have put an fp32 copy there
            if meta.get("fp8_scales") is not None:
                state[FP8_SCALES_KEY] = meta["fp8_scales"]
        for key, dtype in ((RESIDUAL_KEY, None), (SERVED_KEY, torch.bfloat16), (FP8_KEY, torch.uint8),
                           (FP8_RESIDUAL_KEY, torch.float32)):
            if key in values:
                load_full(self, values[key], key, dtype=dtype)

    @torch.no_grad()
    def gather(self, key: str | None = None) -> dict[str, torch.Tensor]:
        """Full fp32 tensors of every param from all ranks' groups (collective unless replicated).

        Args:
            key: a state key of the groups (e.g. ``"export_cast_residual"``), or None for the
                fp32 master weights.

        Returns:
            ``{param name: float32 CPU tensor, flattened, of the param's full numel}``, bit for
            bit, for every param (zeros for a param no group holds, e.g. a frozen one).

        Collectives: one int32 ``all_reduce`` over group 0's DP group of a buffer of the whole
        model's elements, on the communication device (DeepSpeed's accelerator: CUDA under NCCL,
        also for ZeRO-Offload's host partitions); every element has one non-zero contribution,
        so the integer sum is that element's bits (-0.0 and NaN payloads kept).
        """
        from deepspeed.accelerator import get_accelerator
        pieces: dict[str, list] = {}
        for hp, fragments in self.groups():
            source = hp if key is None else self.group_state(hp).get(key)
            if source is None:
                continue
            for f in fragments:
                pieces.setdefault(f.name, []).append((f, source.view(-1)))
        numel = {self.param_names[p]: compat.full_numel(p) for p in self.param_names}
        names = sorted(numel)  # the same order on every rank
        offset = dict(zip(names, [0] + list(itertools.accumulate(numel[n] for n in names))))
        device = "cpu" if self.replicated else get_accelerator().current_device_name()
        flat = torch.zeros(sum(numel.values()), dtype=torch.float32, device=device)
        for name in names:
            for f, src in pieces.get(name, []):
                flat.narrow(0, offset[name] + f.index, f.numel).copy_(src.narrow(0, f.start, f.numel))
        if not self.replicated:
            dist.all_reduce(flat.view(torch.int32), group=self.dp_group(0))
        flat = flat.cpu()
        return {name: flat.narrow(0, offset[name], numel[name]).clone() for name in names}


def _own(store: dict, i: int, hp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``store[i]``, a zero 1-D tensor of ``dtype`` the size of group ``i``'s ``hp`` created at first use."""
    t = store.get(i)
    if t is None:
        t = store[i] = torch.zeros(hp.numel(), dtype=dtype, device=hp.device)
    return t


def _flat_out(fragments: list[Fragment]) -> torch.Tensor | None:
    """A bf16 1-D view ``v`` with ``v[f.start:f.start + f.numel]`` being ``f.out`` for every
    fragment (their bf16 targets lie in one buffer laid out like the fp32 group), else None."""
    if not fragments:
        return None
    f0 = fragments[0]
    base, storage = f0.out.storage_offset() - f0.start, f0.out.untyped_storage()
    end = max(f.start + f.numel for f in fragments)
    if base < 0 or (base + end) * f0.out.element_size() > storage.nbytes():
        return None
    for f in fragments:
        if (f.out.dim() != 1 or not f.out.is_contiguous() or f.out.untyped_storage().data_ptr() != storage.data_ptr()
                or f.out.storage_offset() - f.start != base or f.out.dtype != f0.out.dtype):
            return None
    return f0.out.as_strided((end,), (1,), base)


def read_universal(folder: str, names: list[str]) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """The Fair Cast state of a universal checkpoint: ``(meta, {key: {name: full tensor}})`` (FP8: its bits and
    residuals by param, its scales in ``meta["fp8_scales"]``)."""
    zero = os.path.join(folder, "zero")
    meta = torch.load(os.path.join(zero, UNIVERSAL_STATE_FILE), weights_only=False)
    values = {}
    for key in (RESIDUAL_KEY, SERVED_KEY, FP8_KEY, FP8_RESIDUAL_KEY):
        files = {n: os.path.join(zero, n, f"{key}.pt") for n in names}
        if all(os.path.exists(f) for f in files.values()):
            values[key] = {n: torch.load(f, weights_only=False)["param"] for n, f in files.items()}
    return meta, values


@torch.no_grad()
def load_full(export: OptimizerExport, values: dict[str, torch.Tensor], key: str | None = None,
              dtype: torch.dtype | None = None) -> None:
    """Write full per-param tensors into this rank's groups (the inverse of ``gather``).

    Args:
        export: the optimizer's :class:`OptimizerExport`.
        values: ``{param name: tensor with the param's full numel}`` (any float dtype).
        key: None to set the fp32 master weights, or a state key (created when missing, with
            ``dtype``, default the residual dtype).

    Raises:
        KeyError: a param this rank holds is missing from ``values`` (names it).
    """
    for hp, fragments in export.groups():
        if key is None:
            target = hp.view(-1)
        else:
            state = export.group_state(hp)
            if state.get(key) is None:
                state[key] = (export.caster.new_residual(hp.view(-1)) if dtype is None
                              else torch.zeros(hp.numel(), dtype=dtype, device=hp.device))
            target = state[key].view(-1)
        for f in fragments:
            if f.name not in values:
                raise KeyError(f"load_full: no value for param {f.name!r}")
            target.narrow(0, f.start, f.numel).copy_(values[f.name].reshape(-1).narrow(0, f.index, f.numel))
