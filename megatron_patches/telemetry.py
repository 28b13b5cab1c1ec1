"""Drift telemetry of ``--export-cast fair`` in Megatron's own logs (TensorBoard / W&B).

The numbers are those of the DeepSpeed monitor (definitions in :mod:`faircast_dist.telemetry`),
measured by each leaf optimizer's export on the elements its rank casts (a fixed sample of about
65536 elements of the whole model, chosen by global element index; each element counted once
over the TP/PP/DP ranks) and reduced over all ranks:

==============================  ===================================================
``export-cast/changed-fraction``  sampled served bf16 elements whose bits changed
``export-cast/lag-steps``         argmin over k of ||served_t - master_{t-k}||^2
``export-cast/gap-ulps``          mean |served - master| in bf16 ulps
``export-cast/export-ms``         wall time of the export on the slowest rank (ms)
``export-cast/fp8-*``             with ``--export-cast-format fp8``: the FP8 served copy's changed
                                  fraction, lag steps, gap (E4M3 spacings x scale) and rescales
==============================  ===================================================

With ``megatron_patches.activate()`` in a Megatron-LM launch script they are written at every
``--tensorboard-log-interval`` (default 1), as Megatron's own ``training_log`` writes its scalars,
to the TensorBoard writer (``--tensorboard-dir``) and to W&B (``--wandb-project``); ``--no-export-cast-telemetry`` turns them
off, and without a writer nothing is measured. Code that drives the optimizer itself calls
``install(..., telemetry=True)`` and then :func:`drift_metrics` (collective) when it logs.
"""
from __future__ import annotations

import functools
import inspect
import warnings

from faircast_dist.wraps import Wraps
from megatron_patches import compat

NAMES = {"changed_fraction": "export-cast/changed-fraction", "lag_steps": "export-cast/lag-steps",
         "gap_ulps": "export-cast/gap-ulps", "export_ms": "export-cast/export-ms",
         "fp8_changed_fraction": "export-cast/fp8-changed-fraction", "fp8_lag_steps": "export-cast/fp8-lag-steps",
         "fp8_gap_ulps": "export-cast/fp8-gap-ulps", "fp8_rescales": "export-cast/fp8-rescales"}


def drift_metrics(optimizer) -> dict[str, float] | None:
    """The drift of the last export over all ranks, under Megatron-style names (see module doc).

    Collective over the default process group: every rank must call it after the same step.

    Args:
        optimizer: the optimizer given to ``install(..., telemetry=True)`` (chained or a leaf).

    Returns:
        ``{"export-cast/changed-fraction": 0..1, "export-cast/lag-steps": int,
        "export-cast/gap-ulps": ulps, "export-cast/export-ms": ms}`` (FP8: also ``export-cast/fp8-*``); None when telemetry is off
        or nothing was exported yet (the same on every rank).
    """
    from faircast_dist.telemetry import DriftObserver, reduce_drift, reduce_fp8
    observers = [o for o in (getattr(getattr(leaf, "export_cast", None), "telemetry", None)
                             for leaf in compat.sub_optimizers(optimizer)) if isinstance(o, DriftObserver)]
    if not observers or observers[0].sample.last is None:
        return None
    values = reduce_drift([o.sample for o in observers], sum(o.timer.ms() for o in observers))
    values.update(reduce_fp8(observers))
    return {NAMES[k]: v for k, v in values.items()}


def write_drift(metrics: dict[str, float], iteration: int, writer=None, wandb_writer=None) -> None:
    """Write :func:`drift_metrics` to a TensorBoard ``SummaryWriter`` and/or a W&B run (either may be None)."""
    for name, value in metrics.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(dict(metrics), iteration)


def logging_on(args) -> bool:
    """Whether a Megatron-LM run logs drift telemetry: ``--export-cast-telemetry`` (default on)
    and a place to log to (``--tensorboard-dir`` or ``--wandb-project``)."""
    return bool(getattr(args, "export_cast_telemetry", True)
                and (getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", None)))


def wrap_training_log(training, optimizers: list, wraps=None) -> None:
    """Make Megatron-LM's ``training.training_log`` also write the drift of ``optimizers[-1]``.

    ``train()`` calls ``training_log`` on every rank after every iteration; at iterations that are
    multiples of ``--tensorboard-log-interval`` (where Megatron writes its own scalars) the wrapper reduces the telemetry (collective) and writes it
    with Megatron's ``get_tensorboard_writer()`` / ``get_wandb_writer()`` (set on the last rank).
    Idempotent. Warns (``RuntimeWarning``) when ``training_log``'s signature has no ``iteration``.

    Args:
        training: the module ``megatron.training.training``.
        optimizers: a list holding the optimizer to report (read at log time; empty: nothing).
        wraps: the :class:`~faircast_dist.wraps.Wraps` that records the wrap (to undo it), if any.
    """
    original = training.training_log
    if getattr(original, "_faircast", False):
        return
    signature = inspect.signature(original)
    if "iteration" not in signature.parameters:  # e.g. a (*args, **kwargs) wrapper without __wrapped__
        warnings.warn(f"Fair Cast: training_log{signature} has no 'iteration' parameter; the drift "
                      "telemetry is written only when train() passes iteration= by keyword", RuntimeWarning)

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        from megatron.training import global_vars
        iteration = signature.bind_partial(*args, **kwargs).arguments.get("iteration")
        interval = getattr(global_vars.get_args(), "tensorboard_log_interval", 1) or 1
        if optimizers and iteration is not None and iteration % interval == 0:
            metrics = drift_metrics(optimizers[-1])
            if metrics is not None:
                write_drift(metrics, iteration, global_vars.get_tensorboard_writer(), global_vars.get_wandb_writer())
        return result
    training_log._faircast = True
    (wraps or Wraps()).set(training, "training_log", training_log)
