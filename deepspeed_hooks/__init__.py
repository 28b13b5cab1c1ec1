"""Fair Cast for DeepSpeed: the ``"export_cast"`` config key.

Enable it in the DeepSpeed config::

    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2},
    "export_cast": {"mode": "fair", "method": "stochastic", "seed": 1234}

and either call :func:`initialize` instead of ``deepspeed.initialize`` (same arguments, same
return values), or call :func:`patch_deepspeed` once before a launch script's own
``deepspeed.initialize(...)``. :func:`install` lists every point Fair Cast wraps;
:func:`uninstall` restores them.
"""
from __future__ import annotations

import functools
import os

import deepspeed
from deepspeed import comm as dist
from deepspeed.utils.logging import print_dist

from faircast_dist import ExportCastConfig, FairCaster
from faircast_dist.config import STATE_KEY, ConfigError
from faircast_dist.export import ExportState, fp8_note
from faircast_dist.wraps import Wraps


def parse_config(ds_config: dict) -> ExportCastConfig:
    """The ``export_cast`` section of a DeepSpeed config dict. Absent: the one in the environment
    variable ``FAIRCAST_EXPORT_CAST`` (:mod:`faircast_run`), else nearest (stock).

    Raises:
        ValueError / TypeError: naming the offending key or value (or the environment variable).
    """
    if STATE_KEY not in ds_config:
        from faircast_dist.config import env_config
        from_env = env_config()
        if from_env is not None:
            return from_env
    try:
        return ExportCastConfig.from_value(ds_config.get(STATE_KEY))
    except ConfigError as err:
        raise ConfigError(f"DeepSpeed config: {err}", err.field) from None
    except TypeError as err:
        raise TypeError(f"DeepSpeed config: {err}") from None


def install(engine, *, config=None) -> list[ExportState]:
    """Install Fair Cast on an initialized DeepSpeed engine, as its config asks.

    Every point Fair Cast changes in DeepSpeed is wrapped here, in one list (the private names
    they reach are in :mod:`deepspeed_hooks.compat`); :func:`uninstall` puts the originals back.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` whose config may hold ``"export_cast"``.
        config: an :class:`~faircast_dist.ExportCastConfig` (or what ``ExportCastConfig.from_value``
            takes) to use instead of the engine config's section (:func:`parse_config`).

    Engines whose optimizer updates nothing (a reference, reward or frozen model built from a copy
    of the training config, see :func:`deepspeed_hooks.compat.updates_nothing`) are left stock.
    Either way one line on rank 0 says what was done, printed whatever DeepSpeed's log level
    (``print_dist``, DeepSpeed's way for messages its default WARNING level would hide).

    Returns:
        ``[the engine's ExportState]`` (:class:`~faircast_dist.export.ExportState`; also
        ``engine.optimizer.export_cast.state``), or ``[]`` when the config does not enable Fair Cast
        or the engine trains nothing (then nothing is changed: stock behaviour).

    Raises:
        ValueError: bad ``export_cast`` section; ``fair`` without bf16 or with fp16.
        NotImplementedError: ``fair`` on an optimizer wrapper this version does not cover
            (names it), or ZeRO-3 with NVMe parameter swapping.
    """
    config = parse_config(engine.config) if config is None else ExportCastConfig.from_value(config)
    if not config.enabled:
        return []
    if engine.fp16_enabled() or not engine.bfloat16_enabled():
        raise ValueError(f'DeepSpeed config: "{STATE_KEY}": mode "fair" (or format "fp8") needs "bf16": {{"enabled": true}} '
                         f'(fp16 enabled: {engine.fp16_enabled()}, bf16 enabled: {engine.bfloat16_enabled()})')
    from deepspeed_hooks import compat, stage0, stage3, zero12
    idle = compat.updates_nothing(engine)
    if idle is not None:
        print_dist(f"Fair Cast: left stock (round-to-nearest) on this engine: {idle}", ranks=[0])
        return []
    caster, optimizer = FairCaster(config), engine.optimizer
    path = compat.wrapper_path(optimizer)
    attach = {"zero12": zero12, "stage0": stage0, "zero3": stage3}[path].attach
    export = attach(optimizer, caster, engine.param_names, engine.module)
    wraps = export.wraps = Wraps()
    wraps.wrap(optimizer, "step", export.wrap_step)
    wraps.wrap(optimizer, "state_dict", export.wrap_state_dict)
    wraps.wrap(optimizer, "load_state_dict", export.wrap_load_state_dict)
    if path == "zero12":  # the stock copy has no seam: see compat; its all-gather is module-global
        export.register()
        wraps.on_uninstall(export.unregister)
        wraps.wrap_shared(compat.gather_module(optimizer), compat.GATHER, zero12.wrap_gather)
    if path == "zero3":
        wraps.wrap(optimizer, compat.ZERO3_REASSIGN, export.wrap_reassign)
        wraps.wrap(optimizer, "load_state_dict", export.wrap_load_restores_served)
    wraps.set(optimizer, STATE_KEY, export)
    export.state.export_fp8(export.shards())  # format "fp8": the initial model's FP8 copy (collective), until the first step
    wraps.wrap(engine, "save_checkpoint", functools.partial(_save_commits_after_all_ranks, engine))
    wraps.wrap(engine, "load_checkpoint", functools.partial(_load_serves_what_was_served, engine))
    if engine.monitor.enabled:
        from deepspeed_hooks.monitor import DriftMonitor
        export.state.telemetry = DriftMonitor(sum(compat.full_numel(p) for p in engine.param_names))
        wraps.wrap(engine, "step", functools.partial(_step_reports_drift, engine, export))
    what = (f"master->bf16 export cast uses {caster.method} (seed {config.seed}) on {type(optimizer).__name__}, "
            "replacing its round-to-nearest fp32->bf16 copy" if config.mode == "fair" else
            f"the master->bf16 copy stays round-to-nearest on {type(optimizer).__name__}")  # FP8 only
    print_dist(f"Fair Cast: {what}{fp8_note(export.state)}", ranks=[0])
    return [export.state]


def uninstall(engine) -> None:
    """Undo :func:`install` on ``engine``: every wrapped method and function is the original again
    (stock DeepSpeed from the next call on; the bf16 model keeps what was served). No-op when Fair
    Cast is not installed."""
    export = getattr(engine.optimizer, STATE_KEY, None)
    if export is not None:
        export.wraps.uninstall()


def _save_commits_after_all_ranks(engine, save):
    """``engine.save_checkpoint``: point ``latest`` at a tag only once every rank has written it.

    DeepSpeed 0.19 lets rank 0 write ``latest`` as soon as its own files are written, so a rank
    killed mid-save can leave ``latest`` naming a half-written checkpoint. Here every rank saves
    with ``save_latest=False``, all ranks meet at a barrier, and rank 0 then replaces ``latest``
    atomically (write a temporary file, ``os.replace``). A crash before that leaves the previous
    checkpoint as ``latest``.

    The export step is also written into the model-states file (``client_state["export_cast"]``),
    so that loads without optimizer state continue it.

    Raises:
        ValueError: ``client_state`` has the key ``"export_cast"`` (Fair Cast's own).
    """
    from deepspeed_hooks import compat

    @functools.wraps(save)
    def save_checkpoint(*args, **kwargs):
        bound = compat.bind(save, *args, **kwargs)
        save_dir, client_state = bound.arguments["save_dir"], bound.arguments["client_state"]
        if STATE_KEY in client_state:
            raise ValueError(f'save_checkpoint: client_state key "{STATE_KEY}" is reserved for Fair Cast\'s state')
        tag = bound.arguments["tag"]
        tag = bound.arguments["tag"] = tag if tag is not None else f"global_step{engine.global_steps}"
        bound.arguments["client_state"] = {**client_state, STATE_KEY: {"step": engine.optimizer.export_cast.state.step}}
        save_latest, bound.arguments["save_latest"] = bound.arguments["save_latest"], False
        result = save(*bound.args, **bound.kwargs)
        dist.barrier()
        if save_latest and dist.get_rank() == 0:
            tmp = os.path.join(save_dir, "latest.tmp")
            with open(tmp, "w") as f:
                f.write(str(tag))
            os.replace(tmp, os.path.join(save_dir, "latest"))
        dist.barrier()
        return result
    return save_checkpoint


def _load_serves_what_was_served(engine, load):
    """``engine.load_checkpoint``: give back the served bf16 model, the export step, the residuals
    and the per-group hyperparameters of the checkpoint, whatever the load flags (or refuse).

    Same signature and return value as DeepSpeed's. The tag is resolved once (``latest`` /
    ``latest_universal``), so every file read is of that tag; then
    :func:`deepspeed_hooks.checkpoint.finish_load` repairs what DeepSpeed leaves otherwise (see
    there). ``client_state`` comes back without Fair Cast's ``"export_cast"`` key.

    Raises:
        NotImplementedError: a combination that cannot serve what was served (see
            :func:`deepspeed_hooks.checkpoint.refuse_unsupported_load`).
    """
    from deepspeed_hooks import checkpoint, compat

    @functools.wraps(load)
    def load_checkpoint(*args, **kwargs):
        bound = compat.bind(load, *args, **kwargs)
        flags = bound.arguments
        universal = bool(engine.load_universal_checkpoint())
        optimizer_states = flags["load_optimizer_states"] and not flags["load_module_only"]  # what DeepSpeed loads the optimizer for
        checkpoint.refuse_unsupported_load(engine, universal, optimizer_states)
        tag = flags["tag"] = checkpoint.resolve_tag(flags["load_dir"], flags["tag"], universal)
        with compat.zero3_fp32_reads_tag(tag):
            path, client_state = load(*bound.args, **bound.kwargs)
        if path is not None:
            meta = client_state.pop(STATE_KEY, None)
            checkpoint.finish_load(engine, os.path.join(flags["load_dir"], tag), meta, optimizer_states, universal)
        return path, client_state
    return load_checkpoint


def _step_reports_drift(engine, export, step):
    """``engine.step``: send per-step drift telemetry to the engine's monitor (see
    :mod:`deepspeed_hooks.monitor`)."""
    @functools.wraps(step)
    def step_and_report(*args, **kwargs):
        result = step(*args, **kwargs)
        export.telemetry.write(engine.monitor, engine.global_samples)  # only after an optimizer step
        return result
    return step_and_report


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize``: same arguments and return values, plus Fair Cast.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as ``deepspeed.initialize``.
    """
    result = _DEEPSPEED_INITIALIZE(*args, **kwargs)
    install(result[0])
    return result


def patch_deepspeed() -> None:
    """Make ``deepspeed.initialize`` honour ``"export_cast"`` (one line in a launch script).

    Call it before the script's ``deepspeed.initialize(...)``; a script that did
    ``from deepspeed import initialize`` earlier keeps the unpatched function. Idempotent;
    :func:`unpatch_deepspeed` undoes it.
    """
    if deepspeed.initialize is not initialize:
        _PATCH.set(deepspeed, "initialize", initialize)


def unpatch_deepspeed() -> None:
    """Put DeepSpeed's own ``deepspeed.initialize`` back (engines already built keep Fair Cast)."""
    _PATCH.uninstall()


_DEEPSPEED_INITIALIZE = deepspeed.initialize
_PATCH = Wraps()  # patch_deepspeed's one module-global wrap
