"""Fair Cast for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): the trainer computes with,
and serves, the Fair Cast of its fp32 masters.

FSDP2 keeps each param's fp32 master sharded as a DTensor and, with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, rounds each rank's shard to nearest when it
builds the bf16 all-gather input. After::

    fully_shard(block, mp_policy=mp) for each block; fully_shard(model, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    fsdp_hooks.install(model, optimizer, config={"mode": "fair", "method": "stochastic", "seed": 1234})

that all-gather input is the Fair Cast of the shard instead (FSDP's all-gather extension, see
:mod:`fsdp_hooks.compat`), keyed by (seed, export step, param name, global element index) as in
every other adapter, so forward and backward compute with the bits :func:`served_weights` yields,
the same under any mesh (FSDP, HSDP, FSDP + TP). The export step advances with each
``optimizer.step()``. Checkpoints: :mod:`fsdp_hooks.checkpoint`. :func:`uninstall` puts stock
FSDP2 back. :func:`activate` (what ``faircast-run`` calls) installs it on every ``fully_shard``-ed
model an optimizer steps, with no edit to the training script.
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from faircast_dist import ExportCastConfig, FairCaster
from faircast_dist.config import STATE_KEY, env_config
from faircast_dist.export import ExportState, fp8_note
from faircast_dist.telemetry import DriftObserver, sample_stride
from faircast_dist.wraps import Wraps
from fsdp_hooks import compat
from fsdp_hooks.export import FsdpExport
from fsdp_hooks.served import served_deltas, served_shards, served_weights

__all__ = ["install", "uninstall", "activate", "deactivate", "served_weights", "served_shards", "served_deltas",
           "drift_metrics", "FsdpExport"]

_PRE, _POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def install(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, config=None, telemetry: bool = False,
            sample: int = 65536, max_lag: int = 100) -> list[ExportState]:
    """Make a ``fully_shard``-ed model compute with, and serve, the Fair Cast of its fp32 masters.

    Call it once after ``fully_shard`` and the optimizer's construction (before or after the first
    forward).

    Args:
        model: the root module, ``fully_shard``-ed (its blocks too, as usual), fp32 params, every
            ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``.
        optimizer: the optimizer that steps the model's params; each ``step()`` advances the
            export step (a step post-hook on the torch optimizer; a wrapper holding it as
            ``.optimizer``, e.g. accelerate's ``AcceleratedOptimizer``, is looked through).
        config: an :class:`~faircast_dist.ExportCastConfig` or what ``ExportCastConfig.from_value``
            takes (None, ``"fair"``, ``{"mode": "fair", "method": ..., "seed": ...}``).
        telemetry: measure drift at every export (a :class:`~faircast_dist.telemetry.DriftObserver`;
            read it with :func:`drift_metrics`, collective, when you log); then this call is
            collective over the default process group (one ``all_gather_object`` of the block list).
        sample: about how many elements of the whole model the telemetry watches.
        max_lag: K, past master samples kept for ``lag_steps``.

    Returns:
        ``[the model's ExportState]`` (:class:`~faircast_dist.export.ExportState`; the model's
        ``export_cast.state``), or ``[]`` when the config does not enable Fair Cast (nothing is
        changed: stock FSDP2).

    Raises:
        ValueError / TypeError: a bad config (named key), a model without ``fully_shard``, a param
            whose ``param_dtype`` is not bfloat16 or whose master is not float32 (named), an
            optimizer that is no ``torch.optim.Optimizer`` or holds none of the model's params.
        NotImplementedError: ``reshard_after_forward=<int>``, a param whose local tensor already
            has an all-gather extension (e.g. float8 training), or a second install.
    """
    config = ExportCastConfig.from_value(config)
    if not config.enabled:
        _log("Fair Cast: off (export_cast mode nearest): FSDP2's round-to-nearest all-gather input is kept")
        return []
    if getattr(model, STATE_KEY, None) is not None:
        raise NotImplementedError("fsdp_hooks.install: Fair Cast is already installed on this model")
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # a wrapper's step calls the inner one's, which runs the hooks
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fsdp_hooks.install: optimizer must be a torch.optim.Optimizer (or wrap one as "
                        f".optimizer), got {type(optimizer).__name__}")
    export = FsdpExport(model, FairCaster(config))
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not stepped & {id(fp.sharded_param) for fp in export.params}:
        raise ValueError("fsdp_hooks.install: the optimizer holds none of the model's params: pass the optimizer "
                         "that steps this model (built after fully_shard), whose steps count the exports")
    for name, fp in zip(export.names, export.params):
        if fp.mp_policy.param_dtype != torch.bfloat16:
            raise ValueError(f"fsdp_hooks: param {name!r}: MixedPrecisionPolicy(param_dtype={fp.mp_policy.param_dtype}); "
                             "Fair Cast casts the fp32 master to bf16: use param_dtype=torch.bfloat16")
        if compat.post_forward_resharding(fp):
            raise NotImplementedError(f"fsdp_hooks: param {name!r}: reshard_after_forward=<int> (FSDP2 calls no "
                                      "all-gather extension in that state); use True or False")
        if hasattr(fp.sharded_param._local_tensor, _PRE):
            raise NotImplementedError(f"fsdp_hooks: param {name!r} already has an FSDP all-gather extension "
                                      f"({type(fp.sharded_param._local_tensor).__name__}); Fair Cast cannot share it")
    if telemetry:
        export.counted = _first_holder(export)
        total = sum(fp.sharded_param.numel() for fp in export.params)  # known on every rank
        export.state.telemetry = DriftObserver(sample_stride(total, sample), max_lag,
                                               device=compat.padded_shard(export.params[0]).device)
    wraps = export.wraps = Wraps()  # what install changes, undone by uninstall
    wraps.on_uninstall(optimizer.register_step_post_hook(lambda *_: export.stepped()).remove)
    wraps.on_uninstall(model.register_forward_pre_hook(lambda *_: _attach(export), prepend=True).remove)
    wraps.on_uninstall(functools.partial(_detach, export))
    _attach(export)
    wraps.set(model, STATE_KEY, export)
    what = (f"FSDP2 bf16 all-gather inputs and served weights use {export.caster.method} (seed {config.seed}) on "
            f"{len(export.params)} params, replacing round-to-nearest" if config.mode == "fair" else
            f"FSDP2 bf16 all-gather inputs stay round-to-nearest on {len(export.params)} params")  # FP8 only
    _log(f"Fair Cast: {what}{fp8_note(export.state)}")
    return [export.state]


def uninstall(model: torch.nn.Module) -> None:
    """Undo :func:`install`: FSDP2 builds its round-to-nearest all-gather inputs again from the next
    forward on. No-op when Fair Cast is not installed."""
    export = getattr(model, STATE_KEY, None)
    if export is not None:
        export.wraps.uninstall()


class _Activation:
    """What :func:`activate` set up: its config (None: ``FAIRCAST_EXPORT_CAST``'s at install time), the
    ``FSDPModule`` objects seen in a forward and the optimizers already looked at (weak: a model or an
    optimizer that goes away leaves them), and its two global hooks (in :attr:`wraps`)."""

    def __init__(self, config):
        self.config, self.wraps = config, Wraps()
        self.seen: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self.done: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


_ACTIVE: Optional[_Activation] = None


def activate(config=None) -> None:
    """Install Fair Cast on every ``fully_shard``-ed model that an optimizer steps, with no edit to the
    script (``faircast-run`` calls it when ``torch.distributed.fsdp`` is imported). Idempotent: a second
    call only changes ``config``; :func:`deactivate` removes the hooks.

    FSDP2 has no call like ``deepspeed.initialize`` that names a model together with the optimizer that
    trains it, so the install waits for that moment: right before an optimizer's first ``step()``, every
    outermost ``FSDPModule`` that has run a forward and whose params the optimizer holds gets
    :func:`install` (what an explicit ``install`` after the first forward does): the forward before the
    first step computes with FSDP2's round-to-nearest, every export from the first step on with Fair
    Cast, keyed from export step 0 as an explicit install. A model no optimizer steps (a reference
    model) stays stock, and so does one an explicit :func:`install` (or this activation, through another
    optimizer of the same model) covers already. A step before any forward (DCP's ``get_state_dict``
    initialises the optimizer state with one) waits for the next. Two global hooks: a module forward
    pre-hook (records ``FSDPModule`` objects; an ``isinstance`` per module call) and an optimizer step
    pre-hook (a set lookup per step).

    Args:
        config: the export-cast config (what :func:`install` takes); None: ``FAIRCAST_EXPORT_CAST``'s,
            read at each install (nothing is installed while it is unset or ``nearest``).

    Raises:
        ValueError / TypeError: a bad ``config`` (named key).
    """
    global _ACTIVE
    config = None if config is None else ExportCastConfig.from_value(config)  # a bad one fails here
    if _ACTIVE is not None:
        _ACTIVE.config = config
        return
    active = _ACTIVE = _Activation(config)
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def seen(module, args):
        if isinstance(module, FSDPModule):
            active.seen.add(module)
    active.wraps.on_uninstall(register_module_forward_pre_hook(seen).remove)
    active.wraps.on_uninstall(register_optimizer_step_pre_hook(functools.partial(_install_at_first_step, active)).remove)


def deactivate() -> None:
    """Undo :func:`activate` (models already installed keep Fair Cast until :func:`uninstall`)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.wraps.uninstall()
        _ACTIVE = None


def _install_at_first_step(active: _Activation, optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook of :func:`activate`: :func:`install` on the outermost models seen in a
    forward whose params ``optimizer`` holds and that no install covers yet (an explicit one, or one made
    for another optimizer of the same model: the first optimizer to step counts the export steps). The
    optimizer is looked at again at its next step until every sharded param it holds is covered: a step
    before any forward (DCP's ``get_state_dict`` initialises the optimizer state with one) decides
    nothing, and an install that raised is tried again."""
    if optimizer in active.done:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    config = active.config if active.config is not None else env_config()
    if config is not None and config.enabled:
        seen = list(active.seen)
        covered = {id(sub) for m in seen if getattr(m, STATE_KEY, None) is not None for sub in m.modules()}
        held = {id(p) for p in params}
        models = [m for m in seen if id(m) not in covered and any(id(p) in held for p in m.parameters())]
        inner = {id(sub) for m in models for sub in m.modules() if sub is not m}
        for model in models:
            if id(model) not in inner:
                install(model, optimizer, config=config)
    from torch.distributed.tensor import DTensor
    installed = {id(p) for m in list(active.seen) if getattr(m, STATE_KEY, None) is not None for p in m.parameters()}
    if config is None or not config.enabled or all(id(p) in installed for p in params if isinstance(p, DTensor)):
        active.done.add(optimizer)  # nothing left to install for it


def drift_metrics(model: torch.nn.Module) -> dict[str, float] | None:
    """The drift telemetry of the last export over all ranks (definitions in docs/design.md,
    measured on the elements each rank casts, each element once: an HSDP replica or a TP-replicated
    param counts on its first replica only).

    Collective over the default process group: every rank calls it after the same forward.

    Returns:
        ``{"export_cast/changed_fraction": 0..1, "export_cast/lag_steps": int, "export_cast/gap_ulps":
        ulps, "export_cast/export_ms": ms}`` (with ``format "fp8"`` also ``"export_cast/fp8_rescales"``: FP8
        scales set again at that export); None without ``install(..., telemetry=True)`` or before
        the first export (the same on every rank).
    """
    export = getattr(model, STATE_KEY, None)
    observer = None if export is None else export.state.telemetry
    if not isinstance(observer, DriftObserver) or observer.sample.last is None:
        return None
    return {f"{STATE_KEY}/{k}": v for k, v in observer.reduce().items()}


def _first_holder(export: FsdpExport) -> list[bool]:
    """Per param: no lower rank holds the same block of it (name, offsets, shape), so that counting
    the blocks each rank holds first counts each element once. HSDP replicates blocks over a mesh
    dim; FSDP + TP leaves params TP does not split on a dp submesh, one copy per TP rank. Collective
    (one ``all_gather_object`` of the block list)."""
    blocks = []
    for name, fp in zip(export.names, export.params):
        shape, offsets = compat.global_offset(fp.sharded_param)
        blocks.append((name, tuple(offsets), tuple(shape)))
    if not dist.is_initialized():
        return [True] * len(blocks)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, blocks)
    lower = {b for held in everyone[:dist.get_rank()] for b in held}
    return [b not in lower for b in blocks]


def _detach(export: FsdpExport) -> None:
    """Remove the all-gather extension from every param's current local tensor."""
    for fp in export.params:
        local = fp.sharded_param._local_tensor
        for attr in (_PRE, _POST):
            if attr in vars(local):
                delattr(local, attr)
        compat.refresh_extensions(fp)


def _attach(export: FsdpExport) -> None:
    """Give every param's current local tensor the all-gather extension (again, after a load or
    ``model.to`` replaced it: the model's forward pre-hook checks before each forward)."""
    for k, fp in enumerate(export.params):
        local = fp.sharded_param._local_tensor
        if _PRE in vars(local):
            continue

        setattr(local, _PRE, functools.partial(export.pre_all_gather, k))
        setattr(local, _POST, export.post_all_gather)
        compat.refresh_extensions(fp)


def _log(message: str) -> None:
    """One line on rank 0, whatever the log level (as DeepSpeed's ``print_dist``)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
