"""Fair Cast state of an FSDP2 model in ``torch.distributed.checkpoint`` (DCP) checkpoints, the way
torchtitan checkpoints: the export step, the served bf16 shards and, for error feedback, the residuals (FP8: the
bits, scales and FP8 residuals), as DTensors sharded like the params, so DCP reshards them to any world size or
mesh; the rules of a load are :meth:`faircast_dist.export.ExportState.restore`'s.

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
from faircast_dist.config import Method
from faircast_dist.export import ExportSnapshot, residual_rule, warn


class ExportCastState(Stateful):
    """DCP ``Stateful`` of a model's Fair Cast state (its :meth:`faircast_dist.export.ExportState.snapshot`):
    ``{"step": int, "method": str, "seed": int, "served": {name: bfloat16 DTensor}}`` (what was served, each
    param's shape) plus, for error feedback, ``"residual"`` (``{name: DTensor}``, the residual dtype), and with
    ``format "fp8"`` ``"fp8"`` (``{name: uint8 DTensor}``, the FP8 bits served),
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
        snap = ex.state.snapshot(ex.shards())
        state = {"step": snap.step, "method": str(snap.method), "seed": snap.seed, "served": ex.dtensors(snap.served)}
        ef = ex.state.method.needs_residual
        if ef:
            state["residual"] = ex.dtensors(snap.residuals)
        if snap.fp8_scales is not None:
            state["fp8"], state["fp8_scales"] = ex.dtensors(snap.fp8), snap.fp8_scales
            if ef:
                state["fp8_residual"] = ex.dtensors(snap.fp8_residuals)
        return state

    def load_state_dict(self, state: dict) -> None:
        _restore(self.export, state, saved_residuals="residual" in state)


def _restore(ex, state: dict | None, saved_residuals: bool, step: int = 0) -> None:
    """Hand a loaded state (``state``: what was requested of the checkpoint; None: it holds none) to
    :meth:`faircast_dist.export.ExportState.restore` (``saved_residuals``: the checkpoint holds residuals, requested
    or not; ``step``: the export step without a state); the loaded served shards are the export until the next
    optimizer step, else the next all-gather casts the loaded masters."""
    snap = None if state is None else ExportSnapshot(
        int(state["step"]), Method(state["method"]) if state.get("method") else None, state.get("seed"),
        # (saved but not requested: the method now is no error feedback, and the rule drops them)
        residuals=ex.locals(state["residual"]) if "residual" in state else {} if saved_residuals else None,
        served=ex.locals(state.get("served")), fp8_scales=state.get("fp8_scales"), fp8=ex.locals(state.get("fp8")),
        fp8_residuals=ex.locals(state.get("fp8_residual")))
    if ex.state.restore(snap, ex.shards(), step=step).served:
        ex.loaded()
    else:
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
    saved_residuals = any(s.startswith(f"{KEY}.residual.") for s in saved)
    state = {"model": model_sd, "optimizer": optim_sd}
    if getattr(model, KEY, None) is None:  # Fair Cast off: model and optimizer only, residuals dropped
        dcp.load(state, checkpoint_id=checkpoint_id)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        _, message = residual_rule(Method.NEAREST, saved_residuals)
        if message:
            warn(message)
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
    prefix = f"{KEY}.fp8_scales."
    if "step" in request and ours.export.state.fp8 is None and any(s.startswith(prefix) for s in saved):
        request["fp8_scales"] = dict.fromkeys(s[len(prefix):] for s in saved if s.startswith(prefix))  # (warned, dropped)
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]  # without Fair Cast state: the optimizer's
    _restore(ours.export, request if "step" in request else None, saved_residuals, step=max(steps, default=0))
