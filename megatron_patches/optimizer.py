"""Fair Cast inside megatron-core's mixed-precision optimizers (the adapter).

Where Megatron rounds: ``MixedPrecisionOptimizer.step_with_ready_grads`` runs the inner optimizer,
then ``_copy_main_params_to_model_params`` writes each fp32 master into the bf16 model
(round to nearest):

* ``DistributedOptimizer``: each DP rank writes the masters of the param ranges it owns
  (``_get_model_param_range_map(param)["param"]``, a run of the flattened TP-local param) into
  the bucket's ``param_data``; the DDP all-gather then gives every rank the whole bf16 model.
  ``_copy_main_params_to_param_buffer`` (MXFP8 grad-buffer reuse) writes the same slices.
* ``Float16OptimizerWithFloat16Params``: every rank writes its whole TP-local params.

:func:`install` wraps those methods on the optimizer instance (the list is :func:`_wrap`;
:func:`uninstall` undoes it): every bf16 target the stock copy
writes gets the Fair Cast of the same master slice (one fused multi-tensor call for all master
shards, see :func:`faircast_dist.fused.cast_tensors`), keyed by the param's canonical name and
global element indices (:mod:`megatron_patches.layout`). The Float16 optimizer's stock copy is
replaced. The DistributedOptimizer's runs (it also copies fp32 params and quantizes FP8 ones in
the same loop) with its bf16 copies skipped (:class:`faircast_dist.copy_hook.ReplaceCopies`,
matched by address and size; a copy it does not recognise runs and is overwritten), then the
bf16 ranges are cast: one pass over each master, not two. So each
rank casts exactly the master elements it owns, and every element's bits are independent of the
layout; TP/DP replicas cast identical masters and get identical bits without communication.

State (the :class:`~faircast_dist.export.ExportState`'s snapshot, carried by the optimizer's
``sharded_state_dict``; :meth:`MegatronExport.sharded_state` and :meth:`MegatronExport.load` translate it):

* ``step`` — the export step (int, keys the random bits) and ``method``, saved as common state;
* ``format "fp8"``: the sticky scales (a ShardedObject per leaf optimizer) and the FP8 bits served (like the
  residuals below, in model space; error feedback also its FP8 residuals);
* error feedback: one residual per owned master shard (``residual_dtype``, shaped like the
  shard), saved in *model space*: a ShardedTensor per param with the model param's own
  checkpoint metadata, key ``optimizer.export_cast.residual.<model key>``. So residuals reshard
  like the model, under any DistributedOptimizer format (``dp_reshardable``,
  ``fully_reshardable``) and the Float16 optimizer alike: each element's residual follows it.
  For the DistributedOptimizer the DP shards are gathered per param (bit-exact int all-reduce)
  when saving, and each rank slices its range out when loading. The checkpoint's content
  metadata (the ``metadata`` dict Megatron-LM hands to ``sharded_state_dict`` and saves with the
  checkpoint) records ``export_cast_residuals: True``; a load whose metadata lacks it (a stock
  checkpoint, one written with stochastic or dithered rounding) requests no residuals, which
  would fail dist-checkpointing's load under Megatron-LM's default ``--dist-ckpt-strictness``,
  and starts them at zero with a warning. A load without metadata requests them.

Only the copy inside ``step_with_ready_grads`` exports; a copy anywhere else serves the last
export again (:meth:`MegatronExport.replay`; error feedback keeps a bf16 copy of its shard for
that, not checkpointed: after a load it is taken from the loaded model).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import replace
from typing import Callable

import torch

from faircast_dist import ExportCastConfig, FairCaster
from faircast_dist.config import RESIDUAL_DTYPES, STATE_KEY, Method
from faircast_dist.copy_hook import ReplaceCopies
from faircast_dist.export import ExportSnapshot, ExportState, Shard, fp8_note, warn
from faircast_dist.fp8 import fp8_param
from faircast_dist.shards import from_bits, to_bits
from faircast_dist.telemetry import DriftObserver, ExportObserver, sample_stride
from faircast_dist.wraps import Wraps
from megatron_patches import compat
from megatron_patches.layout import ParamLayout, describe_model, fused_rows, model_entries

RESIDUALS_METADATA_KEY = "export_cast_residuals"  # in the checkpoint's content metadata
RESIDUAL_PREFIX = f"optimizer.{STATE_KEY}.residual."
FP8_METADATA_KEY = "export_cast_fp8"  # in the content metadata: the checkpoint holds FP8 export state
FP8_BITS_METADATA_KEY = "export_cast_fp8_bits"  # ... and the FP8 bits served, whatever the method
FP8_PREFIX = f"optimizer.{STATE_KEY}.fp8."
FP8_RESIDUAL_PREFIX = f"optimizer.{STATE_KEY}.fp8_residual."


@dataclasses.dataclass
class _Shard:
    model_param: torch.nn.Parameter
    main: torch.Tensor  # fp32 master shard (flat for DistOpt, param-shaped for Float16)
    start: int  # the shard is elements [start, end) of the flattened TP-local param
    end: int
    layout: ParamLayout


class MegatronExport:
    """Fair Cast on one leaf optimizer (``DistributedOptimizer`` or the Float16 optimizer).

    Args:
        optimizer: the leaf Megatron optimizer.
        caster: its :class:`FairCaster` (mode ``fair``).
        layouts: ``{id(model param): ParamLayout}`` from :func:`describe_model`.
        model_chunks: the model chunks (used when a sharded_state_dict call gets no model dict).
        iteration: the trainer's iteration count (an int; None: unknown), read by the first export
            after the masters were reloaded from the model (see :meth:`reloaded`).
        shapes: ``format "fp8"``: ``{canonical name: full shape}`` of this leaf's params on every rank
            (:func:`install` gathers them).
        fused: ``format "fp8"``: ``{canonical name: FusedRows}`` of its fused params
            (:func:`megatron_patches.layout.fused_rows`: block scales sit on the checkpoint's tensors).
        index: the leaf's position among the (non-stub) leaves, the same on every rank.

    Attributes:
        state: the :class:`~faircast_dist.export.ExportState` (step, residuals and the served copy
            keyed by ``id(model param)``, telemetry: a DriftObserver with ``install(telemetry=True)``).
    """

    def __init__(self, optimizer, caster: FairCaster, layouts: dict, model_chunks,
                 iteration: Callable[[], int | None] | None = None, shapes: dict | None = None, index: int = 0,
                 fused: dict | None = None):
        self.optimizer, self.model_chunks = optimizer, list(model_chunks)
        # FP8: a channel spans TP ranks, the DistributedOptimizer's DP shards, and only the ranks of a stage hold a
        # layer: the scales' absmax is reduced over the world, on the params' device
        self.state = ExportState(caster, shapes=shapes, fused=fused, device=self.device())
        self.index = index  # the leaf's position among the ranks' leaves (names its FP8 scales in checkpoints)
        self.iteration = iteration or (lambda: None)
        self.step_from_iteration = False  # set by reloaded(): the next export takes self.iteration()
        self.distributed = isinstance(optimizer, compat.DistributedOptimizer)
        self.layouts = layouts
        self.stepping = False  # inside the leaf's step_with_ready_grads (see in_step)
        self._internal_load = False
        self._runs = {}  # (id(model param), start, end) -> fused-cast segments of that shard
        self._counted = {}  # shard key -> counts(shard)
        if self.state.method.needs_residual:  # residuals from the start (checkpoints hold them), shaped
            for shard in self.shards():  # like the master shard, and the model's bf16 as what is served
                self.state.residual(id(shard.model_param), shard.main)
            self.state.keep_served(self._operands(self.shards(), check=False))

    @property
    def caster(self) -> FairCaster:
        return self.state.caster

    @property
    def residuals(self) -> dict:
        """Error feedback: ``{id(model param): residual}`` shaped like the rank's master shard of that
        param (``caster.config.residual_dtype``); empty otherwise (:attr:`state`'s)."""
        return self.state.residuals

    @property
    def telemetry(self) -> ExportObserver:
        return self.state.telemetry

    # -- where the masters are ------------------------------------------------------------------
    def shards(self):
        """This rank's bf16 master shards, in optimizer order (a fresh list of :class:`_Shard`)."""
        return [_Shard(p, main, start, end, self.layouts[id(p)])
                for p, main, start, end in compat.master_shards(self.optimizer)]

    def _target(self, shard: _Shard) -> torch.Tensor:
        """The bf16 tensor the stock copy wrote for ``shard`` (flat view)."""
        return compat.stock_copy_target(self.optimizer, shard.model_param)

    # -- the export -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def in_step(self):
        """The scope of the leaf's ``step_with_ready_grads``: the masters were just updated, so the
        copy to the model in it is a new export. A copy anywhere else (a colocated RL stack
        rebuilding an offloaded bf16 model from the masters, a post-load sync) is :meth:`replay`."""
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False

    def copy(self) -> None:
        """What Megatron's master -> model copy does under Fair Cast: :meth:`export` inside the
        optimizer step, :meth:`replay` outside it."""
        if self.stepping:
            self.export()
        else:
            self.replay()

    def _operands(self, shards, check: bool = True) -> list[Shard]:
        """The core's :class:`~faircast_dist.export.Shard` of each of ``shards`` (keyed by ``id`` of
        the model param: a rank holds one range of each).

        Raises:
            TypeError: ``check`` and a model param that is not bfloat16 (named).
        """
        out = []
        for shard in shards:
            target = self._target(shard)
            if check and target.dtype != torch.bfloat16:
                raise TypeError(f"Fair Cast: model param {shard.layout.name!r} is {target.dtype}, not bfloat16")
            out.append(Shard(id(shard.model_param), shard.main.detach().view(-1), target, self._shard_runs(shard),
                             counted=self._counts(shard)))
        return out

    def export(self) -> None:
        """Write the Fair Cast of this rank's masters into its bf16 targets (the export of this optimizer step,
        :meth:`faircast_dist.export.ExportState.export`; after a model-only load its step is the trainer's
        iteration's).

        One fused multi-tensor call for all master shards (like ``multi_tensor_applier`` for the
        stock copy): each shard's segments are the runs of consecutive global indices (one for a
        contiguous range, one per row of a TP block split on a later dim). Error feedback also
        keeps a copy of what it wrote (:meth:`replay` needs it).
        """
        step = None
        if self.step_from_iteration:
            self.step_from_iteration = False
            iteration = self.iteration()  # the steps done before this one (Megatron-LM's args.curr_iteration)
            step = None if iteration is None else int(iteration) + 1
        self.state.export(self._operands(self.shards()), step)

    def operands(self) -> list[Shard]:
        """This rank's shards as the core's, unchecked (FP8, checkpoints)."""
        return self._operands(self.shards(), check=False)

    def full_fp8(self) -> dict:
        """``format "fp8"``: ``{canonical name: float8_e4m3fn full tensor}`` of this leaf's FP8 params
        (collective: one uint8 MAX all-reduce of the FP8 params' elements)."""
        return self.state.full_fp8(self.operands())

    def replay(self) -> None:
        """Write the last export into the bf16 targets again, bit for bit (the step does not advance,
        the residuals and the telemetry are untouched: :meth:`faircast_dist.export.ExportState.replay`).
        Before the first export the model holds the masters' round-to-nearest values (Megatron builds
        the masters from the bf16 model); error feedback copies the bf16 shard it keeps: 2 bytes per
        master element of the rank."""
        self.state.replay(self._operands(self.shards()))

    def _counts(self, shard: _Shard) -> bool:
        """:meth:`counts`, decided once per shard (not every step)."""
        key = (id(shard.model_param), shard.start, shard.end)
        if key not in self._counted:
            self._counted[key] = self.counts(shard)
        return self._counted[key]

    def counts(self, shard: _Shard) -> bool:
        """Whether this rank counts ``shard`` in the drift telemetry: each element once over all
        ranks (not a TP duplicate, not the last PP stage's copy of tied embeddings, not a DP
        replica of the Float16 optimizer; the rules of Megatron's own params-norm). An MoE expert
        param (``allreduce`` False: expert-parallel) is replicated over the expert TP and expert DP
        groups, not the dense ones: under EP the dense DP / TP ranks hold different experts."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared
        p = shard.model_param
        if compat.is_expert_param(p):
            tp_duplicate = not getattr(p, "tensor_model_parallel", False) and ps.get_expert_tensor_parallel_rank() != 0
            replica = not self.distributed and ps.get_expert_data_parallel_rank() != 0
            return not tp_duplicate and not replica
        replica = not self.distributed and ps.get_data_parallel_rank(with_context_parallel=True) != 0
        return param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p) and not replica

    def device(self) -> torch.device:
        """The device of this optimizer's model params (where its collectives run)."""
        for chunk in self.model_chunks:
            for p in chunk.parameters():
                return p.device
        return torch.device("cpu")

    def _shard_runs(self, shard: _Shard) -> list:
        """``(name, start in the shard, numel, global index)`` per run of the shard (cached)."""
        key = (id(shard.model_param), shard.start, shard.end)
        if key not in self._runs:
            self._runs[key] = [(shard.layout.name, *r) for r in shard.layout.runs(shard.start, shard.end)]
        return self._runs[key]

    def skip_stock_copies(self) -> ReplaceCopies:
        """A mode that skips the DistributedOptimizer's stock copies of the bf16 shards (each
        matched by target address, master address and size), which :meth:`export` then writes."""
        stock = {(self._target(s).data_ptr(), s.main.data_ptr(), s.main.numel()) for s in self.shards()}
        return ReplaceCopies(lambda dest, src: dest.dtype == torch.bfloat16 and dest.numel() == src.numel()
                             and (dest.data_ptr(), src.data_ptr(), src.numel()) in stock)

    def reloaded(self) -> None:
        """After the masters were reloaded from the model (``reload_model_params``: Megatron-LM's
        ``load_checkpoint`` with ``--no-load-optim`` or ``--finetune``, an RL stack's weight load):
        zero the residuals; the model is what is served; the next export's step is the trainer's
        iteration when known (Megatron-LM: the checkpoint's, 0 after ``--finetune``), so a
        model-only load continues the export step as DeepSpeed's module-only load does.
        ``format "fp8"``: the FP8 copy of the new masters is cast now, scales set afresh (collective)."""
        self.state.restart(self.operands())
        self.step_from_iteration = True

    # -- the wraps (listed by _wrap, each ``original -> replacement``) ----------------------------
    def wrap_copy_skipping_stock(self, copy):
        """DistributedOptimizer's copy: run it without its bf16 copies, then :meth:`export`."""
        @functools.wraps(copy)
        def copy_then_cast(*args, **kwargs):
            with self.skip_stock_copies():
                result = copy(*args, **kwargs)
            self.copy()
            return result
        return copy_then_cast

    def wrap_step_with_ready_grads(self, step):
        """``step_with_ready_grads``: run it :meth:`in_step` (its copy to the model exports)."""
        @functools.wraps(step)
        def fair_step(*args, **kwargs):
            with self.in_step():
                return step(*args, **kwargs)
        return fair_step

    def wrap_sharded_state_dict(self, sharded_state_dict):
        """``sharded_state_dict``: add this optimizer's export-cast entry (:meth:`sharded_state`)."""
        @functools.wraps(sharded_state_dict)
        def fair_sharded_state_dict(model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
            self._internal_load = True  # DistOpt calls load_state_dict(state_dict()) in here
            try:
                if model_sharded_state_dict is None:
                    state = sharded_state_dict(is_loading=is_loading, *args, **kwargs)
                else:
                    state = sharded_state_dict(model_sharded_state_dict, is_loading, *args, **kwargs)
            finally:
                self._internal_load = False
            state[STATE_KEY] = self.sharded_state(model_sharded_state_dict, is_loading, kwargs.get("metadata"))
            return state
        return fair_sharded_state_dict

    def wrap_load_state_dict(self, load_state_dict):
        """``load_state_dict``: take the export-cast entry out, load the rest, then :meth:`load` it."""
        @functools.wraps(load_state_dict)
        def fair_load_state_dict(state_dict):
            saved = None
            if isinstance(state_dict, dict) and STATE_KEY in state_dict:
                saved = state_dict[STATE_KEY]
                state_dict = {k: v for k, v in state_dict.items() if k != STATE_KEY}
            result = load_state_dict(state_dict)
            self.load(saved)
            return result
        return fair_load_state_dict

    # -- checkpoints ----------------------------------------------------------------------------
    def _all_params(self):
        """(model param, layout) for every bf16 param this optimizer handles on any DP rank."""
        if not self.distributed:
            return [(s.model_param, s.layout) for s in self.shards()]
        return [(p, self.layouts[id(p)]) for p in compat.bucket_params(self.optimizer)
                if id(p) in self.layouts and p.dtype == torch.bfloat16]

    def _full(self, param, shards_by_param, store: dict, dtype: torch.dtype) -> torch.Tensor:
        """The TP-local param's whole per-element export state (``store``: a snapshot's, keyed by ``id(param)``, 1-D,
        of ``dtype``; collective over the DP group for the DistributedOptimizer)."""
        if not self.distributed:
            return store[id(param)].view(param.shape)
        shard = shards_by_param.get(id(param))
        # disjoint ranges, zeros elsewhere: an integer sum is an exact gather (the DP group's device)
        wide = torch.uint8 if dtype == torch.uint8 else torch.int32
        full = torch.zeros(param.numel(), dtype=wide, device=param.device)
        if shard is not None:
            full[shard.start:shard.end] = to_bits(store[id(param)].view(-1)).to(param.device) if wide == torch.int32 \
                else store[id(param)].view(-1).to(param.device)
        torch.distributed.all_reduce(full, group=compat.data_parallel_group(self.optimizer))
        return (full if wide == torch.uint8 else from_bits(full, dtype)).view(param.shape)

    def sharded_state(self, model_sharded_state_dict, is_loading: bool, metadata: dict | None = None) -> dict:
        """This optimizer's export-cast entry for its ``sharded_state_dict``: the export state's snapshot in
        Megatron's checkpoint (see module doc).

        ``metadata``: the checkpoint's content metadata (Megatron-LM's ``sharded_sd_metadata``): marked with
        what a save writes (residuals, FP8 scales, FP8 bits); when loading, an entry is requested only if it is None
        or marked (a request for what the checkpoint lacks fails dist-checkpointing's load)."""
        def saved(key):  # the checkpoint holds it (a save: writes it)
            return metadata is None or not is_loading or bool(metadata.get(key))
        snap = None if is_loading else self.state.snapshot(self.operands())
        state = {"step": self.state.step, "method": self.caster.method.value}  # a plain str in the checkpoint
        fp8, ef = self.state.fp8, self.caster.method.needs_residual
        if metadata is not None and not is_loading:
            metadata.update({key: True for key, on in ((RESIDUALS_METADATA_KEY, ef), (FP8_METADATA_KEY, fp8 is not None),
                                                       (FP8_BITS_METADATA_KEY, fp8 is not None)) if on})
        fp8_saved, residuals = fp8 is not None and saved(FP8_METADATA_KEY), ef and saved(RESIDUALS_METADATA_KEY)
        if is_loading and metadata is not None and metadata.get(FP8_METADATA_KEY):
            if fp8 is None:
                warn("the checkpoint has FP8 export state but the format is now bf16: dropping it")
            elif not (metadata.get(FP8_BITS_METADATA_KEY) or metadata.get(RESIDUALS_METADATA_KEY)):
                warn("the checkpoint holds FP8 scales but not the FP8 bits served (written by faircast before "
                     "2026-12-06): the FP8 copy is cast again from the loaded masters with this version's key for "
                     "the step, not the one that was served")
        if fp8_saved:  # every rank holds every scale: global rank 0 writes them, every rank reads them
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            state["fp8_scales"] = compat.ShardedObject(f"optimizer.{STATE_KEY}.fp8_scales.{self.index}",
                                                       {n: t.cpu() for n, t in fp8.scales.items()}, (1,), (0,),
                                                       replica_id=rank)
        # per element: error feedback's residual; FP8: the bits served (written for every method since
        # FP8_BITS_METADATA_KEY; before it, with error feedback's residuals only) and error feedback's FP8 residual
        kinds = [("residual", RESIDUAL_PREFIX, "residuals", RESIDUAL_DTYPES[self.caster.config.residual_dtype])] \
            if residuals else []
        if fp8_saved and (saved(FP8_BITS_METADATA_KEY) or saved(RESIDUALS_METADATA_KEY)):
            kinds.append(("fp8", FP8_PREFIX, "fp8", torch.uint8))
        if fp8_saved and residuals:
            kinds.append(("fp8_residual", FP8_RESIDUAL_PREFIX, "fp8_residuals", torch.float32))
        if not kinds:
            return state  # a load without residuals starts them at zero (load())
        entries = model_entries(self.model_chunks, model_sharded_state_dict or None)
        shards = {id(s.model_param): s for s in self.shards()}
        # FP8 entries: of every param whose checkpoint tensor holds an FP8 param (Megatron stacks a tensor's layers in
        # one entry: fp8_exclude may keep some bf16, whose entries are then zeros)
        fp8_keys = {entries[id(p)].key for p, layout in self._all_params()
                    if fp8 is not None and layout.name in fp8.shapes and id(p) in entries}
        # every rank lists every param (dist-checkpointing checks that main replicas cover each
        # tensor, on load too); a rank keeps only its own range after loading
        for kind, prefix, field, dtype in kinds:
            state[kind] = {}
            for param, layout in self._all_params():
                entry = entries.get(id(param))
                if entry is None:
                    raise ValueError(f"Fair Cast: param {layout.name!r} is missing from the model "
                                     "sharded_state_dict handed to the optimizer")
                if kind != "residual" and entry.key not in fp8_keys:
                    continue
                data = (torch.empty(param.shape, dtype=dtype, device=param.device) if is_loading
                        else self._full(param, shards, getattr(snap, field), dtype))
                kwargs = dict(key=prefix + entry.key, data=data)
                if isinstance(entry, compat.ShardedTensor):
                    kwargs["dtype"] = dtype
                state[kind][layout.name] = replace(entry, **kwargs)
        return state

    def load(self, state: dict | None) -> None:
        """Restore the export state from a loaded :meth:`sharded_state` (the model was loaded first, as
        Megatron-LM's ``load_checkpoint`` does: it is what was served), through
        :meth:`faircast_dist.export.ExportState.restore`. None (a checkpoint written without Fair Cast): warned,
        then as after ``reload_model_params`` (:meth:`reloaded`).

        Raises:
            ValueError: a saved per-element entry missing a param or too small for it (named).
        """
        operands = self.operands()
        if state is None:
            if not self._internal_load:
                self.state.restore(None, operands, step=None)
                self.step_from_iteration = True  # the loaded model is what is served (loaded before the optimizer)
            return
        unrequested = None
        if not state.get("residual") and state.get("method") == Method.ERROR_FEEDBACK and \
                self.caster.method.needs_residual:
            # written with error feedback, yet no residuals: a load that asks for them gets them or fails,
            # so they were not asked for (metadata that is not the checkpoint's)
            unrequested = (f"the checkpoint was written with {state['method']} but its content metadata lacks "
                           f"{RESIDUALS_METADATA_KEY!r}, so its residuals were not loaded (hand sharded_state_dict "
                           "the checkpoint's dist_checkpointing.load_content_metadata(), as Megatron-LM's "
                           "load_checkpoint does): residuals start at zero")
        snap = ExportSnapshot(int(state["step"]), Method(state["method"]) if state.get("method") else None,
                              residuals=self._ranges(state.get("residual"), "residual"),
                              fp8_scales=state.get("fp8_scales") if self.state.fp8 is not None else None,
                              fp8=self._ranges(state.get("fp8"), "FP8 bits", fp8=True),
                              fp8_residuals=self._ranges(state.get("fp8_residual"), "FP8 residual", fp8=True))
        self.state.restore(snap, operands, missing_residuals=unrequested)

    def _ranges(self, saved: dict | None, what: str, fp8: bool = False) -> dict | None:
        """``{id(model param): this rank's range}`` of each saved whole tensor (``saved``: ``{canonical name: tensor}``;
        ``fp8``: of the FP8 params only); None when the checkpoint holds none.

        Raises:
            ValueError: a param missing from ``saved``, or a saved tensor too small for it (named).
        """
        if saved is None:
            return None
        out = {}
        for shard in self.shards():
            name = shard.layout.name
            if fp8 and name not in self.state.fp8.shapes:
                continue
            full = saved.get(name)
            if full is None:
                raise ValueError(f"Fair Cast: checkpoint lacks the {what} of {name!r}")
            full = full.reshape(-1)
            if full.numel() < shard.end:
                raise ValueError(f"Fair Cast: saved {what} of {name!r} has {full.numel()} elements, the param has "
                                 f"{shard.layout.numel}")
            out[id(shard.model_param)] = full[shard.start:shard.end]
        return out


def check_config(config, where: str = "OptimizerConfig") -> None:
    """Refuse optimizer settings that Fair Cast cannot serve.

    Args:
        config: a megatron ``OptimizerConfig`` (or the Megatron-LM args namespace).
        where: how to name the settings in the message.

    Raises:
        ValueError: ``fair`` with fp16, without bf16, or with the precision-aware optimizer
            (``use_precision_aware_optimizer`` / ``store_param_remainders``).
        NotImplementedError: optimizer CPU offload, MXFP8 grad-buffer reuse, the optimizer step
            captured in a CUDA graph.
    """
    if getattr(config, "fp16", False):
        raise ValueError(f"--export-cast fair needs --bf16, but fp16=True (--fp16) in {where}: "
                         "the model params would be fp16, which Fair Cast does not produce")
    if not getattr(config, "bf16", False):
        raise ValueError(f"--export-cast fair needs --bf16 (bf16 model params with fp32 masters; also "
                         f"--export-cast-format fp8, which serves FP8 beside them); bf16=False in {where}")
    if compat.uses_precision_aware_optimizer(config):
        raise ValueError(
            f"--export-cast fair cannot be used with --use-precision-aware-optimizer ({where}."
            "use_precision_aware_optimizer=True): TE FusedAdam writes the bf16 params inside its kernel "
            f"(with store_param_remainders={getattr(config, 'store_param_remainders', None)} the bf16 "
            "param is the high half of the master), so there is no master->bf16 cast to replace")
    if getattr(config, "optimizer_cpu_offload", False):
        raise NotImplementedError(f"--export-cast fair does not support --optimizer-cpu-offload yet ({where})")
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise NotImplementedError(
            f"--export-cast fair does not support --reuse-grad-buf-for-mxfp8-param-ag ({where}."
            "reuse_grad_buf_for_mxfp8_param_ag=True): it serves MXFP8 params, not bf16 ones, and with "
            "--overlap-param-gather Megatron-LM copies the masters outside the optimizer step")
    if getattr(config, "optimizer_cuda_graph", False):  # megatron-core >= 0.20
        raise NotImplementedError(
            f"--export-cast fair does not support --optimizer-cuda-graph ({where}.optimizer_cuda_graph=True): "
            "a replayed graph would not advance Fair Cast's export step, so every step would reuse one key")


def install(optimizer, model_chunks, *, config, telemetry: bool = False,
            sample: int = 65536, max_lag: int = 100,
            iteration: Callable[[], int | None] | None = None) -> list[ExportState]:
    """Put Fair Cast into a Megatron optimizer built by ``get_megatron_optimizer``.

    Args:
        optimizer: the optimizer (a ``ChainedOptimizer`` or a leaf) for ``model_chunks``.
        model_chunks: the list of (DDP-wrapped) model chunks the optimizer was built for.
        config: the export-cast config (an :class:`~faircast_dist.ExportCastConfig` or what
            ``ExportCastConfig.from_value`` takes); with mode ``nearest`` nothing is changed (stock).
        telemetry: measure drift at every export (a :class:`~faircast_dist.telemetry.DriftSample`
            observer per leaf, read with :func:`megatron_patches.telemetry.drift_metrics`); then this call
            is collective over the default process group (one all-reduce of the model size).
        sample: about how many elements of the whole model the telemetry watches.
        max_lag: K, past master samples kept for ``lag_steps``.
        iteration: returns the trainer's iteration count (or None), read at the first export after
            ``reload_model_params`` to continue the export step from it (:meth:`MegatronExport.reloaded`;
            :func:`megatron_patches.activate` passes Megatron-LM's ``args.curr_iteration``). None:
            the step goes on from this optimizer's own count (0 for a fresh one).

    Returns:
        The :class:`~faircast_dist.export.ExportState` of each leaf optimizer (its
        :class:`MegatronExport` at ``leaf.export_cast``); ``[]`` when ``config`` is not ``fair`` or the
        optimizer holds no trainable param.

    Raises:
        ValueError: bad settings (see :func:`check_config`), or a param missing from the model's
            sharded_state_dict.
        NotImplementedError: Megatron FSDP, FP8/FP4 params, optimizer classes not covered.
    """
    config = ExportCastConfig.from_value(config)
    if not config.enabled:
        return []
    leaves = [o for o in compat.sub_optimizers(optimizer) if not compat.is_stub(o)]
    for leaf in leaves:
        check_config(leaf.config)
        if not isinstance(leaf, (compat.DistributedOptimizer, compat.Float16OptimizerWithFloat16Params)):
            raise NotImplementedError(f"--export-cast fair supports DistributedOptimizer and "
                                      f"Float16OptimizerWithFloat16Params, not {type(leaf).__name__}")
        if compat.uses_megatron_fsdp(leaf):
            raise NotImplementedError("--export-cast fair does not support Megatron FSDP (--use-megatron-fsdp)")
    layouts = describe_model(model_chunks)
    shapes = _fp8_shapes(config, leaves, layouts)
    exports = []
    for k, leaf in enumerate(leaves):
        export = MegatronExport(leaf, FairCaster(config), layouts, model_chunks, iteration,
                                shapes=None if shapes is None else shapes[k], index=k,
                                fused=_fused(config, shapes and shapes[k], model_chunks[0].config))
        for shard in export.shards():
            if compat.is_quantized_param(leaf, shard.model_param):
                raise NotImplementedError(f"--export-cast fair: param {shard.layout.name!r} is FP8/FP4 "
                                          "(quantized by Megatron, not cast to bf16)")
        _wrap(leaf, export)
        exports.append(export)
    if telemetry:
        _start_telemetry(exports, sample, max_lag)
    if config.fp8:  # the initial model's FP8 copy, served until the first step (collective, leaf by leaf)
        for export in exports:
            export.state.export_fp8(export.operands())
        if config.fp8_grid:  # each rank wrote the served FP8 values into its shard of the param buffers: gather them
            _param_sync(model_chunks)
        if exports:
            exports[0].wraps.on_uninstall(functools.partial(_set_fp8_exports, model_chunks, None))
            _set_fp8_exports(model_chunks, exports)
    if not leaves:  # after the telemetry's collective, which every rank joins
        _print_rank_0("Fair Cast: left stock (round-to-nearest): the optimizer holds no trainable param")
        return []
    names = ", ".join(type(o).__name__ for o in leaves)
    what = (f"master->bf16 export cast uses {config.effective_method} (seed {config.seed}) on {names}, replacing "
            f"the round-to-nearest copy in {compat.COPY_TO_MODEL}" if config.mode == "fair" else
            f"the master->bf16 copy stays round-to-nearest on {names}")  # FP8 only
    _print_rank_0(f"Fair Cast: {what}{fp8_note(exports[0].state)}")
    return [export.state for export in exports]


#: the model chunk attribute that lists the leaf exports serving FP8 weights (:func:`megatron_patches.served_weights`)
FP8_EXPORTS = "export_cast_fp8"


def _set_fp8_exports(model_chunks, exports) -> None:
    for chunk in model_chunks:
        if exports is None:
            vars(chunk).pop(FP8_EXPORTS, None)
        else:
            setattr(chunk, FP8_EXPORTS, exports)


def _fp8_shapes(config, leaves, layouts) -> list[dict] | None:
    """``format "fp8"``: per leaf, ``{canonical name: full shape}`` of its params on every rank (collective: one
    ``all_gather_object``; PP stages hold other layers). None without FP8.

    Raises:
        NotImplementedError: ranks with different numbers of leaf optimizers.
    """
    if not config.fp8:
        return None
    mine = [{} for _ in leaves]
    for k, leaf in enumerate(leaves):
        for p, _, _, _ in compat.master_shards(leaf):
            layout = layouts[id(p)]
            mine[k][layout.name] = layout.blocks[0].global_shape
    everyone = [None] * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if len({len(e) for e in everyone}) != 1:
        raise NotImplementedError(f"export_cast FP8 on Megatron: the ranks hold different numbers of optimizers "
                                  f"({sorted({len(e) for e in everyone})}); the FP8 scales are reduced per optimizer")
    return [{n: shape for e in everyone for n, shape in e[k].items()} for k in range(len(leaves))]


def _fused(config, shapes: dict | None, model_config) -> dict:
    """``format "fp8"`` with block scales: ``{name: FusedRows}`` of the FP8 params among ``shapes`` that fuse
    checkpoint tensors (:func:`megatron_patches.layout.fused_rows`; an excluded param is not asked). Else empty."""
    if not shapes or config.scale_rule.granularity != "block":
        return {}
    fused = {n: fused_rows(n, shape, model_config) for n, shape in shapes.items() if fp8_param(config, n, tuple(shape))}
    return {n: f for n, f in fused.items() if f is not None}


def _param_sync(model_chunks) -> None:
    """All-gather the bf16 param buffers of a distributed optimizer's model chunks now (what megatron-core's
    ``DistributedDataParallel.start_param_sync(force_sync=True)`` does after a step); nothing without one."""
    for chunk in model_chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and ddp.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)


def _print_rank_0(message: str) -> None:
    """``message`` on global rank 0, whatever the logging level (Megatron-LM announces its own set-up
    with ``print_rank_0``; its default root logger level, WARNING, would hide an INFO line)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def _start_telemetry(exports: list[MegatronExport], sample: int, max_lag: int) -> None:
    """Give every export a DriftObserver with a stride from the whole model's size (collective)."""
    counted = sum(s.end - s.start for e in exports for s in e.shards() if e.counts(s))
    device = exports[0].device() if exports else torch.device("cpu")
    total = torch.tensor([counted], dtype=torch.int64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    stride = sample_stride(int(total.item()), sample)
    for export in exports:
        export.state.telemetry = DriftObserver(stride, max_lag, device=export.device())


def _wrap(leaf, export: MegatronExport) -> None:
    """Every point Fair Cast wraps on a leaf optimizer, in one list (undone by :func:`uninstall`);
    the private names are in :mod:`megatron_patches.compat`."""
    wraps = export.wraps = Wraps()
    if export.distributed:
        # the stock copy also writes the fp32 params' shards (and quantizes FP8 ones) in the same
        # loop: it runs, without its bf16 copies (ReplaceCopies), then Fair Cast writes those
        wraps.wrap(leaf, compat.COPY_TO_MODEL, export.wrap_copy_skipping_stock)
    else:
        # the stock copy writes exactly the bf16 params Fair Cast writes: replaced, not repeated
        wraps.set(leaf, compat.COPY_TO_MODEL, export.copy)
    if hasattr(leaf, compat.COPY_TO_PARAM_BUFFER):
        wraps.wrap(leaf, compat.COPY_TO_PARAM_BUFFER, functools.partial(_then, export.copy))
    # only the copy inside the optimizer step is a new export (MegatronExport.copy)
    wraps.wrap(leaf, compat.STEP, export.wrap_step_with_ready_grads)
    wraps.wrap(leaf, compat.COPY_TO_MAIN, functools.partial(_then, export.reloaded))
    wraps.wrap(leaf, "sharded_state_dict", export.wrap_sharded_state_dict)
    wraps.wrap(leaf, "load_state_dict", export.wrap_load_state_dict)
    wraps.set(leaf, STATE_KEY, export)


def _then(then, original):
    """``original``, then ``then()`` (the result is ``original``'s)."""
    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        then()
        return result
    return wrapped


def uninstall(optimizer) -> None:
    """Undo :func:`install` on every leaf of ``optimizer``: the stock methods again (the bf16 model
    keeps what was served). No-op on a leaf without Fair Cast."""
    for leaf in compat.sub_optimizers(optimizer):
        while STATE_KEY in vars(leaf):  # installed twice (e.g. activate(), then install()): all of them
            getattr(leaf, STATE_KEY).wraps.uninstall()
