"""What every DeepSpeed optimizer path shares: the cast of a rank's fp32 shards and its state.

An optimizer path (ZeRO-1/2, BF16_Optimizer, stage 0, ZeRO-3) is described by its *groups*: each
group is one fp32 tensor that the base optimizer steps (a flat partition, or a whole param) plus
its *fragments* — the pieces of named params it holds, each with where it starts in the group,
its global element index (in the flattened full param) and the bf16 tensor it is served into.
The adapters in this package only build that description; this module does the rest.

State, kept in the base optimizer's ``state[group fp32 tensor]`` so DeepSpeed's own
``save_checkpoint``/``load_checkpoint`` carry it with each rank's optimizer state:

* ``"export_cast_step"`` — int: exports done so far (keys the random bits).
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
from faircast_dist.export import ExportState, Shard, warn
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
    """Fair Cast on one DeepSpeed optimizer wrapper. Subclasses define :meth:`groups`.

    Args:
        optimizer: the DeepSpeed optimizer wrapper (``engine.optimizer``).
        caster: the :class:`FairCaster` built from the ``export_cast`` config.
        param_names: ``{param: name}`` (``engine.param_names``).
        model: the engine's module (``format "fp8"``: its transformers 5 fused experts are FP8 too,
            :func:`faircast_dist.fp8.fused_experts`).

    Attributes:
        state: the :class:`~faircast_dist.export.ExportState` (step, telemetry: a DriftMonitor when
            DeepSpeed's monitor is enabled), its residuals in the base optimizer's state
            (:class:`StateResiduals`).
    """

    #: every rank holds full copies (stage 0): gathering needs no reduction
    replicated = False

    def __init__(self, optimizer, caster: FairCaster, param_names: dict, model: torch.nn.Module):
        self.optimizer, self.param_names = optimizer, param_names
        shapes = {name: compat.full_shape(p) for p, name in param_names.items()}
        fused = fused_experts(model, shapes) if caster.config.fp8 else None
        self.state = ExportState(caster, residuals=StateResiduals(optimizer.optimizer), shapes=shapes, fused=fused)
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
            self.telemetry.begin(self.pieces)  # before the step writes anything served
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
        """``optimizer.state_dict``: put the served bf16 values into the state first."""
        @functools.wraps(state_dict)
        def fair_state_dict(*args, **kwargs):
            self.snapshot_served()
            return state_dict(*args, **kwargs)
        return fair_state_dict

    def wrap_load_state_dict(self, load_state_dict):
        """``optimizer.load_state_dict``: then adopt the loaded cast state (:meth:`after_load`)."""
        @functools.wraps(load_state_dict)
        def fair_load_state_dict(*args, **kwargs):
            result = load_state_dict(*args, **kwargs)
            self.after_load(kwargs.get("checkpoint_folder"))
            return result
        return fair_load_state_dict

    # ---- shared machinery
    def group_state(self, hp: torch.Tensor) -> dict:
        """The base optimizer's state of group fp32 tensor ``hp`` (where Fair Cast's entries live)."""
        return self.optimizer.optimizer.state[hp]

    def group(self, i: int) -> tuple[torch.Tensor, list[Fragment]]:
        """Group ``i`` of :meth:`groups` (adapters that cast one group at a time build only it)."""
        return self.groups()[i]

    def export_group(self, i: int) -> None:
        """Cast group ``i``'s fp32 tensor into its bf16 destinations (this rank's shard only)."""
        self._cast(*self.group(i))

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

    def pieces(self) -> list[tuple]:
        """The served buffers this rank counts in the drift telemetry (every rank's own partitions;
        stage 0, where every rank casts the whole model, on rank 0 only), as
        :meth:`faircast_dist.telemetry.DriftSample.observe` takes them."""
        if self.replicated and dist.get_rank() != 0:
            return []
        return [(key, master, served, rows) for i, (hp, fragments) in enumerate(self.groups())
                for key, _, master, served, rows in self.buffers(i, hp, fragments)]

    @torch.no_grad()
    def _cast(self, hp: torch.Tensor, fragments: list[Fragment], out: torch.Tensor | None = None) -> None:
        """Cast one group; ``out``: a bf16 1-D buffer laid out like ``hp`` to write instead of the
        fragments' own targets (ZeRO-1/2: the buffer DeepSpeed's copy was about to fill)."""
        with self.telemetry.span(hp.device):  # one span per group (ZeRO steps each group just before its cast)
            self.group_state(hp).pop(SERVED_KEY, None)
            residual = self.state.residual(hp, hp.view(-1))  # the group's, in DeepSpeed's optimizer state
            self.state.cast([Shard(key, master, served, rows, residual=None if residual is None else
                                   residual.view(-1).narrow(0, start, master.numel()))
                             for key, start, master, served, rows in self.buffers(None, hp, fragments, out)])
        self._cast_now.add(id(hp))

    @torch.no_grad()
    def fp8_shards(self, groups: list | None = None) -> list[Shard]:
        """``format "fp8"``: this rank's shards with their FP8 buffers: views of one buffer per group, shaped like
        its fp32 tensor (``groups``: :meth:`groups`, when the caller has them), in :attr:`ExportState.fp8_outs` /
        ``fp8_residuals`` keyed by group position (not in the
        optimizer state, which the base optimizer's first step must find empty; :meth:`snapshot_served` puts
        them there for a checkpoint)."""
        shards, ef = [], self.caster.method.needs_residual
        for i, (hp, fragments) in enumerate(self.groups() if groups is None else groups):
            bits = self.state.fp8_outs.get(i)
            if bits is None:
                bits = self.state.fp8_outs[i] = torch.zeros(hp.numel(), dtype=torch.uint8, device=hp.device)
            res = self.state.fp8_residuals.get(i) if ef else None
            if ef and res is None:
                res = self.state.fp8_residuals[i] = torch.zeros(hp.numel(), dtype=torch.float32, device=hp.device)
            shards += [Shard(key, master, served, rows, fp8=bits.narrow(0, start, master.numel()),
                             fp8_residual=None if res is None else res.narrow(0, start, master.numel()))
                       for key, start, master, served, rows in self.buffers(i, hp, fragments)]
        return shards

    def reduce_max(self, t: torch.Tensor) -> None:
        """MAX all-reduce of ``t`` in place over group 0's DP group, on the communication device (nothing where
        every rank holds the whole model: stage 0)."""
        if self.replicated:
            return
        from deepspeed.accelerator import get_accelerator
        on = t.to(get_accelerator().current_device_name())
        dist.all_reduce(on, op=dist.ReduceOp.MAX, group=self.dp_group(0))
        t.copy_(on)

    def export_fp8(self, step: int | None = None) -> None:
        """``format "fp8"``: cast the FP8 served copy (collective); a checkpoint's copy in the state is stale then."""
        if self.state.fp8 is None:
            return
        groups = self.groups()
        shards = self.fp8_shards(groups)
        with self.telemetry.span(shards[0].master.device if shards else "cpu"):
            self.state.export_fp8(shards, self.reduce_max, step)
        for hp, _ in groups:
            for key in (FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY):
                self.optimizer.optimizer.state.get(hp, {}).pop(key, None)

    def finish(self) -> None:
        """After a step's exports: the FP8 served copy (``format "fp8"``), advance the step and record it in
        every group's state."""
        if not self._cast_now:
            return
        self._cast_now.clear()
        self.export_fp8()
        self.caster.advance()
        for hp, _ in self.groups():
            self.group_state(hp)[STEP_KEY] = self.caster.step
        self.telemetry.end(self.pieces)

    def export(self) -> None:
        """Export every group not cast yet in this step, then :meth:`finish`."""
        for hp, fragments in self.groups():
            if id(hp) not in self._cast_now:
                self._cast(hp, fragments)
        self.finish()

    @torch.no_grad()
    def snapshot_served(self) -> None:
        """Put the bf16 values served now into each group's state (before a checkpoint save); nothing before the
        base optimizer's first step (entries in its empty state would stop torch's optimizers from creating
        theirs: such a checkpoint is loaded as one without Fair Cast state, at export step 0)."""
        if not any(self.optimizer.optimizer.state.get(hp) for hp, _ in self.groups()):
            return
        for hp, fragments in self.groups():
            served = torch.zeros(hp.numel(), dtype=torch.bfloat16, device=hp.device)
            for f in fragments:
                served.narrow(0, f.start, f.numel).copy_(f.out)
            state = self.group_state(hp)
            state[SERVED_KEY] = served
            state[STEP_KEY] = self.caster.step
            state[METHOD_KEY] = list(Method).index(self.caster.method)
        if self.state.fp8 is not None:
            self.fp8_shards()  # buffers exist
            for i, (hp, _) in enumerate(self.groups()):
                state = self.group_state(hp)
                state[FP8_KEY], state[FP8_SCALES_KEY] = self.state.fp8_outs[i], dict(self.state.fp8.scales)
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
        """Adopt the cast state just loaded into the base optimizer's state.

        Args:
            universal_folder: the universal checkpoint just loaded, if any: its Fair Cast files
                (written by :mod:`deepspeed_hooks.checkpoint`) are read into this rank's groups,
                each element's residual and served value following the element.

        Rules: the export step continues from the checkpoint (0 when it has none); residuals follow
        :func:`faircast_dist.caster.adopt_residuals` (kept exactly with error feedback, zero when
        switching to it, dropped when switching away; a warning for the last two).

        Raises:
            ValueError: groups disagree on the step, or a residual does not match its group's
                shape (the message names the params of that group).
        """
        groups = self.groups()
        if universal_folder is not None:
            self._load_universal(universal_folder)
        steps = {self.group_state(hp).get(STEP_KEY) for hp, _ in groups}
        if len(steps) != 1:
            raise ValueError(f"export cast: param groups disagree on {STEP_KEY}: {sorted(map(str, steps))}")
        (step,) = steps
        if step is None:
            warn("the checkpoint has no export-cast state (written without Fair Cast, or before the first step?): export "
                 "step starts at 0"
                 + (", residuals at zero" if self.caster.method.needs_residual else ""))
        self.caster.step = int(step or 0)
        dtype = RESIDUAL_DTYPES[self.caster.config.residual_dtype]
        saved, codes = False, set()
        for hp, fragments in groups:
            state = self.group_state(hp)
            residual = state.get(RESIDUAL_KEY)
            if residual is not None and residual.numel() != hp.numel():
                names = sorted({f.name for f in fragments})
                raise ValueError(f"export cast: saved {RESIDUAL_KEY} has {residual.numel()} elements but the "
                                 f"partition holding {names} has {hp.numel()} (saved under another layout?)")
            saved |= residual is not None
            codes.add(state.get(METHOD_KEY))
            if state.get(SERVED_KEY) is not None:
                state[SERVED_KEY] = state[SERVED_KEY].to(torch.bfloat16)
        code = next(iter(codes)) if len(codes) == 1 else None
        # without any Fair Cast state: warned above
        action = self.state.adopt(saved, None if code is None else list(Method)[code],
                                  warning="" if step is None else None)
        for hp, _ in groups:
            state = self.group_state(hp)
            if action == "keep" and RESIDUAL_KEY in state:  # torch's Optimizer.load_state_dict casts float
                state[RESIDUAL_KEY] = state[RESIDUAL_KEY].to(dtype).view(hp.shape)  # state to the param dtype: undo it
            elif action == "drop":
                state.pop(RESIDUAL_KEY, None)
        self._adopt_fp8(groups)

    def _adopt_fp8(self, groups) -> None:
        """``format "fp8"``: take the loaded FP8 state (bits, scales; error feedback: residuals), or, in a
        checkpoint without it, set the scales afresh and cast the FP8 copy of the loaded masters now (the last
        export's step; a warning says so). Other formats: drop FP8 state entries.

        Raises:
            ValueError: FP8 bits or residuals saved under another layout (the params of the group named).
        """
        ef = self.caster.method.needs_residual
        keys = (FP8_KEY, FP8_RESIDUAL_KEY) if ef else (FP8_KEY,)
        for hp, fragments in groups:
            state = self.group_state(hp)
            if self.state.fp8 is None or not ef:
                for key in ((FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY) if self.state.fp8 is None else (FP8_RESIDUAL_KEY,)):
                    state.pop(key, None)
            for key in keys:
                if state.get(key) is not None and state[key].numel() != hp.numel():
                    names = sorted({f.name for f in fragments})
                    raise ValueError(f"export cast: saved {key} has {state[key].numel()} elements but the partition "
                                     f"holding {names} has {hp.numel()} (saved under another layout?)")
        if self.state.fp8 is None:
            return
        saved = [self.group_state(hp) for hp, _ in groups]
        scales = next((st[FP8_SCALES_KEY] for st in saved if st.get(FP8_SCALES_KEY) is not None), None)
        if scales is None or any(st.get(FP8_KEY) is None for st in saved):
            warn("the checkpoint has no FP8 export state: FP8 scales are set afresh and the FP8 served copy cast "
                 "from the loaded masters" + (", FP8 residuals start at zero" if ef else ""))
            self.fp8_afresh()
            return
        self.state.fp8.load_scales(scales)
        self.state.fp8_residuals.clear()
        zeroed = False
        for i, st in enumerate(saved):
            self.state.fp8_outs[i] = st.pop(FP8_KEY).to(torch.uint8).reshape(-1)
            residual = st.pop(FP8_RESIDUAL_KEY, None)
            if ef and residual is not None:
                self.state.fp8_residuals[i] = residual.float().reshape(-1)
            zeroed |= ef and residual is None  # created as zeros by fp8_shards
            st.pop(FP8_SCALES_KEY, None)
        if zeroed:
            warn("the checkpoint has no FP8 error-feedback residuals (written with another method): they start at "
                 "zero; its FP8 scales are kept")

    def fp8_afresh(self) -> None:
        """``format "fp8"``: forget the FP8 state (scales, bits, residuals) and cast the FP8 copy of the masters now,
        at the last export's step, with fresh scales (collective): after a load that brought no FP8 state."""
        if self.state.fp8 is None:
            return
        for hp, _ in self.groups():
            for key in (FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY):
                self.optimizer.optimizer.state.get(hp, {}).pop(key, None)
        self.state.fp8.scales = {}
        self.state.fp8_outs.clear(), self.state.fp8_residuals.clear()
        self.export_fp8(step=max(self.caster.step - 1, 0))

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
