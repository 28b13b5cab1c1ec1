"""Fair Cast state of an FSDP2 model in ``torch.distributed.checkpoint`` (DCP) checkpoints, the way
torchtitan checkpoints: the export step and, for error feedback, the residuals and the served bf16
shards, as DTensors sharded like the params, so DCP reshards them to any world size or mesh.

* :func:`save` / :func:`load`: model, optimizer (``get_state_dict`` / ``set_state_dict``) and Fair
  Cast state in one DCP checkpoint; :func:`load` also takes a checkpoint without Fair Cast state
  (a stock one, or one of another method) as the other adapters do: the export step follows the
  optimizer's step count, residuals start at zero (warned).
* :class:`ExportCastState`: the same state as a DCP ``Stateful``, for a checkpointer of your own
  (put it under the key :data:`KEY`; the checkpoint must then hold it).
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from faircast_dist.config import STATE_KEY as KEY
from faircast_dist.export import ExportState, warn


class ExportCastState(Stateful):
    """DCP ``Stateful`` of a model's Fair Cast state: ``{"step": int, "method": str, "seed": int}`` plus, for
    error feedback, ``"residual"`` and ``"served"`` (``{name: DTensor}`` of each param's shape,
    float32 / bfloat16), and with ``format "fp8"`` ``"fp8"`` (``{name: uint8 DTensor}``, the FP8 bits served),
    ``"fp8_scales"`` (``{name: float32 tensor}``, replicated) and, for error feedback, ``"fp8_residual"``
    (``{name: float32 DTensor}``): all resharded by DCP like the params.

    A load takes effect whatever order the checkpointer restores the model in: the loaded served
    shards are what the model computes with until the next ``optimizer.step()``.

    Args:
        model: a model with :func:`fsdp_hooks.install` done.

    Raises:
        ValueError: Fair Cast is not installed on ``model``.
    """

    def __init__(self, model: torch.nn.Module):
        self.export = getattr(model, "export_cast", None)
        if self.export is None:
            raise ValueError("fsdp_hooks.checkpoint: Fair Cast is not installed on this model (fsdp_hooks.install)")

    def state_dict(self) -> dict:
        ex = self.export
        ex.ensure()
        state = {"step": ex.caster.step, "method": str(ex.caster.method), "seed": ex.caster.config.seed}
        if ex.residuals is not None:
            state["residual"], state["served"] = ex.dtensors(ex.residuals), ex.dtensors(ex.outs)
        fp8 = ex.state.fp8
        if fp8 is not None:
            state["fp8"], state["fp8_scales"] = ex.dtensors(ex.buffers(ex.state.fp8_outs)), dict(fp8.scales)
            if ex.residuals is not None:
                state["fp8_residual"] = ex.dtensors(ex.buffers(ex.state.fp8_residuals))
        return state

    def load_state_dict(self, state: dict) -> None:
        _adopt(self.export, state, saved_residuals="residual" in state)


def _adopt(ex, state: dict, saved_residuals: bool) -> None:
    """Take a loaded state (``state``: what was requested of the checkpoint) into ``ex``: its step, and
    its residuals and served shards as :meth:`faircast_dist.export.ExportState.adopt` rules
    (``saved_residuals``: the checkpoint holds residuals, requested or not)."""
    ex.caster.step = int(state["step"])
    if state.get("seed", ex.caster.config.seed) != ex.caster.config.seed and ex.caster.method.keyed:
        warn(f"fsdp_hooks.checkpoint: the checkpoint was written with seed {state['seed']}, the "
             f"config now says {ex.caster.config.seed}: the random bits change from here")
    fp8 = ex.state.fp8
    saved_fp8 = fp8 is not None and "fp8_scales" in state
    if saved_fp8:
        fp8.load_scales(state["fp8_scales"])
    elif fp8 is not None:
        warn("fsdp_hooks.checkpoint: the checkpoint holds no FP8 export state: FP8 scales are set afresh at "
             "the next export" + (", FP8 residuals start at zero" if ex.residuals is not None else ""))
        fp8.scales = {}  # nothing of the model this process held before the load carries over
        for residual in ex.state.fp8_residuals.values():
            residual.zero_()
    if ex.state.adopt(saved_residuals, state.get("method")) == "keep":
        pairs = [("residual", ex.residuals), ("served", ex.outs)]
        if saved_fp8:
            pairs += [("fp8", ex.buffers(ex.state.fp8_outs)), ("fp8_residual", ex.buffers(ex.state.fp8_residuals))]
        with torch.no_grad():
            for key, buffers in pairs:
                for target, loaded in zip(ex.dtensors(buffers).values(), state[key].values()):
                    if loaded.to_local().data_ptr() != target.to_local().data_ptr():
                        target.to_local().copy_(loaded.to_local())
        if fp8 is not None and not saved_fp8:  # the bf16 export is the checkpoint's; the FP8 one is cast now
            ex.state.export_fp8(ex.shards(), ex.reduce_max)
        ex.loaded()
    else:
        for residual in ex.state.fp8_residuals.values():  # error feedback now, none saved: from zero
            residual.zero_()
        ex.invalidate()


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: str) -> None:
    """``dcp.save`` of ``{"model", "optimizer"}`` (``get_state_dict``) and the Fair Cast state under
    :data:`KEY` (none for a model without Fair Cast: a stock checkpoint), into a new folder (one per
    step, as torchtitan's ``step-N``). Collective.

    Written to ``checkpoint_id + ".partial"`` and renamed to ``checkpoint_id`` by rank 0 once every
    rank has written (DCP overwrites data files in place): a save killed midway leaves no folder
    under the final name, and earlier checkpoints untouched.

    Raises:
        FileExistsError: ``checkpoint_id`` exists (nothing is overwritten).
    """
    if os.path.exists(checkpoint_id):
        raise FileExistsError(f"fsdp_hooks.checkpoint.save: {checkpoint_id} exists; save each step to a new folder")
    partial = f"{checkpoint_id}.partial"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and os.path.exists(partial):  # left by a killed save
        shutil.rmtree(partial)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    if getattr(model, KEY, None) is not None:  # a stock model (Fair Cast off) saves a stock checkpoint
        state[KEY] = ExportCastState(model)
    dcp.save(state, checkpoint_id=partial)
    _barrier()
    if rank0:
        os.rename(partial, checkpoint_id)
    _barrier()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: str) -> None:
    """Load what :func:`save` wrote (any world size or mesh), or a DCP checkpoint of the same
    ``{"model", "optimizer"}`` layout without Fair Cast state. Collective.

    Without Fair Cast state, the export step becomes the optimizer's step count (AdamW's
    ``state["step"]``) and error feedback starts from zero residuals (a warning says so); a
    checkpoint of another method keeps its step, and error-feedback residuals are dropped or
    started at zero as :meth:`faircast_dist.export.ExportState.adopt` rules. Into a model without
    Fair Cast (mode ``nearest``, no install) only the model and the optimizer are loaded (residuals
    in the checkpoint are dropped, with the warning).
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = set(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
    state = {"model": model_sd, "optimizer": optim_sd}
    if getattr(model, KEY, None) is None:  # Fair Cast off: model and optimizer only, residuals dropped
        dcp.load(state, checkpoint_id=checkpoint_id)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        ExportState().adopt(any(s.startswith(f"{KEY}.residual.") for s in saved))
        return
    ours = ExportCastState(model)
    request = {k: v for k, v in ours.state_dict().items()
               if any(s == f"{KEY}.{k}" or s.startswith(f"{KEY}.{k}.") for s in saved)}
    for k, v in request.items():  # per-param entries: only those saved (FP8 with another fp8_exclude: named by
        if isinstance(v, dict):   # load_scales rather than by DCP's missing key)
            request[k] = {n: t for n, t in v.items() if f"{KEY}.{k}.{n}" in saved}
    if request:
        state[KEY] = request
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if "step" not in request:
        steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        warn(f"fsdp_hooks.checkpoint: {checkpoint_id} holds no Fair Cast state: the export step follows "
             f"the optimizer ({max(steps, default=0)})")
        request["step"] = max(steps, default=0)
    _adopt(ours.export, request, saved_residuals=any(s.startswith(f"{KEY}.residual.") for s in saved))
