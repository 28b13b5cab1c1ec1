"""Fair Cast for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): the trainer computes with,
and serves, the Fair Cast of its fp32 masters.

FSDP2 keeps each param's fp32 master sharded as a DTensor and, with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, rounds each rank's shard to nearest when it
builds the bf16 all-gather input. After::

    fully_shard(block, mp_policy=mp) for each block; fully_shard(model, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    fsdp_hooks.install(model, optimizer, {"mode": "fair", "method": "stochastic", "seed": 1234})

that all-gather input is the Fair Cast of the shard instead (FSDP's all-gather extension, see
:mod:`fsdp_hooks.compat`), keyed by (seed, export step, param name, global element index) as in
every other adapter, so forward and backward compute with the bits :func:`served_weights` yields,
the same under any mesh (FSDP, HSDP, FSDP + TP). The export step advances with each
``optimizer.step()``. Checkpoints: :mod:`fsdp_hooks.checkpoint`. :func:`uninstall` puts stock
FSDP2 back.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from faircast_dist import ExportCastConfig, FairCaster
from fsdp_hooks import compat
from fsdp_hooks.export import FsdpExport
from fsdp_hooks.served import served_deltas, served_shards, served_weights

__all__ = ["install", "uninstall", "served_weights", "served_shards", "served_deltas", "FsdpExport"]

_PRE, _POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def install(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config=None) -> FairCaster | None:
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

    Returns:
        The model's :class:`~faircast_dist.FairCaster` (also ``model.fair_export.caster``), or None
        when the config does not enable Fair Cast (nothing is changed: stock FSDP2).

    Raises:
        ValueError / TypeError: a bad config (named key), a model without ``fully_shard``, a param
            whose ``param_dtype`` is not bfloat16 or whose master is not float32 (named), an
            optimizer that is no ``torch.optim.Optimizer`` or holds none of the model's params.
        NotImplementedError: ``reshard_after_forward=<int>``, a param whose local tensor already
            has an all-gather extension (e.g. float8 training), or a second install.
    """
    config = config if isinstance(config, ExportCastConfig) else ExportCastConfig.from_value(config)
    if not config.enabled:
        _log("Fair Cast: off (export_cast mode nearest): FSDP2's round-to-nearest all-gather input is kept")
        return None
    if getattr(model, "fair_export", None) is not None:
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
    export.hook = optimizer.register_step_post_hook(lambda *_: export.stepped())
    export.guard = model.register_forward_pre_hook(lambda *_: _attach(export), prepend=True)
    _attach(export)
    model.fair_export = export
    _log(f"Fair Cast: FSDP2 bf16 all-gather inputs and served weights use {export.caster.method} "
         f"(seed {config.seed}) on {len(export.params)} params, replacing round-to-nearest")
    return export.caster


def uninstall(model: torch.nn.Module) -> None:
    """Undo :func:`install`: FSDP2 builds its round-to-nearest all-gather inputs again from the next
    forward on. No-op when Fair Cast is not installed."""
    export = getattr(model, "fair_export", None)
    if export is None:
        return
    export.hook.remove()
    export.guard.remove()
    for fp in export.params:
        local = fp.sharded_param._local_tensor
        for attr in (_PRE, _POST):
            if attr in vars(local):
                delattr(local, attr)
        compat.refresh_extensions(fp)
    del model.fair_export


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
