"""Fair Cast for Megatron: ``--export-cast fair`` in megatron-core's mixed-precision optimizers.

Three ways in, from least to most code:

1. A Megatron-LM launch script (``pretrain_gpt.py``), no edits to Megatron's files — one line
   after its imports::

       import megatron_patches; megatron_patches.activate()

   Then ``--export-cast fair [--export-cast-method error_feedback] [--export-cast-seed 7]``
   parse (the group is added to ``add_megatron_arguments``), and every optimizer built by
   ``get_megatron_optimizer`` reads them from ``get_args()``. With ``--tensorboard-dir`` or
   ``--wandb-project``, the drift telemetry (``export-cast/changed-fraction``, ``lag-steps``,
   ``gap-ulps``, ``export-ms``) is written at every ``--tensorboard-log-interval`` next to Megatron's own
   scalars (:mod:`megatron_patches.telemetry`; ``--no-export-cast-telemetry`` turns it off).

2. A script with its own ``extra_args_provider``: chain it,
   ``pretrain(..., extra_args_provider=with_export_cast_args(my_provider))`` (plus
   ``activate()`` for the optimizer), or pass :func:`add_export_cast_args` itself.

3. Code that builds optimizers with ``get_megatron_optimizer`` directly::

       optimizer = get_megatron_optimizer(opt_config, model_chunks)
       install(optimizer, model_chunks, config=ExportCastConfig(mode="fair", method="error_feedback"),
               telemetry=True)  # then megatron_patches.drift_metrics(optimizer) when logging

See :mod:`megatron_patches.optimizer` for where the cast happens and how checkpoints carry it.
:func:`uninstall` (an optimizer) and :func:`deactivate` (what :func:`activate` wrapped) put the
stock functions back.
"""
from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from faircast_dist import ExportCastConfig
from faircast_dist.config import ENV, env_config
from faircast_dist.wraps import Wraps
from megatron_patches.args import add_export_cast_args, config_from_args, disagreements, with_export_cast_args
from faircast_dist.export import warn
from megatron_patches.optimizer import STATE_KEY, MegatronExport, check_config, install, uninstall
from megatron_patches.served import served_deltas, served_weights
from megatron_patches.telemetry import drift_metrics

__all__ = ["activate", "deactivate", "install", "uninstall", "served_weights", "served_deltas", "add_export_cast_args",
           "with_export_cast_args", "config_from_args", "check_config", "drift_metrics", "ExportCastConfig",
           "MegatronExport", "STATE_KEY"]


class _Activation:
    """What :func:`activate` set up: its settings, its wraps, and the optimizer it installed Fair
    Cast on last (the one ``training_log`` reports; a list of one, read at log time)."""

    def __init__(self, config: Optional[ExportCastConfig], telemetry: Optional[bool]):
        self.config, self.telemetry = config, telemetry
        self.wraps = Wraps()
        self.optimizers: list = []


_ACTIVE: Optional[_Activation] = None


def _parsed_args():
    """Megatron-LM's parsed arguments (``megatron.training.get_args()``), or None: no
    ``megatron.training`` (megatron-core < 0.17 ships without it), or its arguments not parsed
    (megatron-core code that builds optimizers itself)."""
    try:
        from megatron.training.global_vars import get_args
        return get_args()
    except (ImportError, AssertionError):  # get_args asserts that parse_args ran
        return None


def _args_config() -> ExportCastConfig:
    """The config that runs when :func:`activate` was given none: Megatron-LM's parsed ``--export-cast*``
    arguments, whose defaults are ``FAIRCAST_EXPORT_CAST``'s config where it is set
    (:func:`faircast_dist.config.env_config`): a flag given on the command line wins, and one that
    differs from the variable is one warning on rank 0 naming both values. Without parsed arguments
    that carry the flags (megatron-core code that builds its optimizers itself), the variable's config.

    Raises:
        RuntimeError: neither parsed arguments nor the variable.
        ValueError: a bad flag value or precision setting (:func:`config_from_args`).
    """
    args, env = _parsed_args(), env_config()
    if args is None or (env is not None and not hasattr(args, "export_cast")):
        if env is not None:
            return env
        raise RuntimeError("megatron_patches.activate() without a config reads Megatron-LM's parsed arguments "
                           "(megatron.training.get_args()), which this process does not have; pass "
                           "activate(config=...) instead")
    config = config_from_args(args)
    differ = disagreements(args, env) if env is not None else []
    if differ and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        warn(f"the command line overrides {ENV} (which fills the rest): {'; '.join(differ)}; the run "
             f"casts {config.effective_method} (seed {config.seed}), as the arguments say")
    return config


def _args_iteration():
    """Megatron-LM's iteration: ``args.curr_iteration`` (set by ``train`` before every step), else
    ``args.iteration`` (set from the checkpoint by ``load_checkpoint``); None without them."""
    args = _parsed_args()
    return getattr(args, "curr_iteration", getattr(args, "iteration", None))


def _args_telemetry() -> bool:
    from megatron_patches.telemetry import logging_on
    args = _parsed_args()
    return args is not None and logging_on(args)


def activate(config: Optional[ExportCastConfig] = None, telemetry: Optional[bool] = None) -> None:
    """Turn on ``--export-cast`` for everything built after this call (idempotent: a second call
    only changes the settings). What it wraps, in this order (undone by :func:`deactivate`):

    * Megatron-LM's ``add_megatron_arguments`` gets the argument group, when ``megatron.training``
      is importable (so ``parse_args`` knows the flags whatever ``extra_args_provider`` the
      script passes);
    * ``get_megatron_optimizer``, in ``megatron.core.optimizer`` and in every loaded module that
      imported it by name (e.g. ``megatron.training.training``): the optimizer it returns gets
      :func:`install` with ``config``, or with the parsed arguments when ``config`` is None;
    * ``megatron.training.training.training_log`` (when importable), so that the drift telemetry
      is written with Megatron's scalars (:func:`megatron_patches.telemetry.wrap_training_log`).

    After a model-only load (``--no-load-optim``, ``--finetune``: ``reload_model_params``) the
    export step continues from Megatron-LM's iteration (``install(iteration=...)``).

    Args:
        config: the export-cast config to use; None reads ``megatron.training.get_args()`` at
            optimizer build time, whose ``--export-cast*`` flags default to ``FAIRCAST_EXPORT_CAST``
            where it is set (what the command line gives wins; see :func:`_args_config`).
        telemetry: measure drift telemetry; None decides from the parsed arguments at optimizer
            build time (:func:`megatron_patches.telemetry.logging_on`; False without
            ``megatron.training``).
    """
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.config, _ACTIVE.telemetry = config, telemetry
        return
    active = _ACTIVE = _Activation(config, telemetry)
    wraps = active.wraps
    try:
        from megatron.training import arguments
    except ImportError:
        arguments = None
    if hasattr(arguments, "add_megatron_arguments"):  # (an activation during Megatron-LM's own import may
        wraps.wrap(arguments, "add_megatron_arguments", _adds_export_cast_args)  # find it half-defined)

    import megatron.core.optimizer as core_optimizer
    original = core_optimizer.get_megatron_optimizer
    wrapper = _installs_fair_cast(active, original)
    for module in list(sys.modules.values()):  # the modules that imported it by name (no lazy imports)
        if getattr(module, "__dict__", {}).get("get_megatron_optimizer") is original:
            wraps.set(module, "get_megatron_optimizer", wrapper)

    try:
        from megatron.training import training  # noqa: F401  (loads it, when Megatron-LM is there)
    except ImportError:
        pass
    _wrap_training_log(active)


def _wrap_training_log(active: _Activation) -> None:
    """Wrap ``megatron.training.training.training_log`` once it is loaded and defined (idempotent:
    :func:`activate` tries, and so does every optimizer build, for an activation that ran while
    Megatron-LM's modules were still being imported, e.g. from ``faircast-run``)."""
    training = sys.modules.get("megatron.training.training")
    if hasattr(training, "training_log"):
        from megatron_patches.telemetry import wrap_training_log
        wrap_training_log(training, active.optimizers, active.wraps)


def deactivate() -> None:
    """Undo :func:`activate`: Megatron's own functions again (optimizers already built keep Fair
    Cast until :func:`uninstall`). No-op when not active."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.wraps.uninstall()
        _ACTIVE = None


def _adds_export_cast_args(original_add):
    """``add_megatron_arguments``: then :func:`add_export_cast_args`, the flags defaulting to
    ``FAIRCAST_EXPORT_CAST``'s config where it is set."""
    @functools.wraps(original_add)
    def add_megatron_arguments(parser, *args, **kwargs):
        return add_export_cast_args(original_add(parser, *args, **kwargs))
    return add_megatron_arguments


def _installs_fair_cast(active: _Activation, original):
    """``get_megatron_optimizer``: then :func:`install` on what it returns, with ``active``'s settings."""
    @functools.wraps(original)
    def get_megatron_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        _wrap_training_log(active)
        model_chunks = kwargs["model_chunks"] if "model_chunks" in kwargs else args[1]
        chosen = active.config if active.config is not None else _args_config()
        want = active.telemetry if active.telemetry is not None else _args_telemetry()
        if install(optimizer, model_chunks, config=chosen, telemetry=want, iteration=_args_iteration):
            active.optimizers[:] = [optimizer]  # the one training_log reports
        return optimizer
    get_megatron_optimizer._faircast = True
    return get_megatron_optimizer
