"""Fair Cast for DeepSpeed: the ``"export_cast"`` config key.

Enable it in the DeepSpeed config::

    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2},
    "export_cast": {"mode": "fair", "method": "stochastic", "seed": 1234}

and either call :func:`initialize` instead of ``deepspeed.initialize`` (same arguments, same
return values), or call :func:`patch_deepspeed` once before a launch script's own
``deepspeed.initialize(...)``.
"""
from __future__ import annotations

import functools
import os

import deepspeed
from deepspeed import comm as dist
from deepspeed.utils import logger

from faircast_dist import ExportCastConfig, FairCaster

CONFIG_KEY = "export_cast"


def parse_config(ds_config: dict) -> ExportCastConfig:
    """The ``export_cast`` section of a DeepSpeed config dict (absent = nearest, stock).

    Raises:
        ValueError / TypeError: naming the offending key or value.
    """
    try:
        return ExportCastConfig.from_value(ds_config.get(CONFIG_KEY))
    except (TypeError, ValueError) as err:
        raise type(err)(f"DeepSpeed config: {err}") from None


def install(engine) -> FairCaster | None:
    """Install Fair Cast on an initialized DeepSpeed engine, as its config asks.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` whose config may hold ``"export_cast"``.

    Returns:
        The engine's :class:`FairCaster` (also at ``engine.optimizer.export_caster``), or None
        when the config does not enable Fair Cast (then nothing is changed: stock behaviour).

    Raises:
        ValueError: bad ``export_cast`` section; ``fair`` without bf16 or with fp16.
        NotImplementedError: ``fair`` on an optimizer wrapper this version does not cover
            (names it), or ZeRO-3 with NVMe parameter swapping.
    """
    config = parse_config(engine.config)
    if not config.enabled:
        return None
    if engine.fp16_enabled() or not engine.bfloat16_enabled():
        raise ValueError(f'DeepSpeed config: "{CONFIG_KEY}": mode "fair" needs "bf16": {{"enabled": true}} '
                         f'(fp16 enabled: {engine.fp16_enabled()}, bf16 enabled: {engine.bfloat16_enabled()})')
    caster = FairCaster(config)
    export = _adapter(engine.optimizer).attach(engine.optimizer, caster, engine.param_names)
    _commit_after_all_ranks(engine)
    _load_serves_what_was_served(engine)
    if engine.monitor.enabled:
        _report_drift(engine, export)
    logger.info(f"Fair Cast: master->bf16 export cast uses {caster.method} (seed {config.seed}) "
                f"on {type(engine.optimizer).__name__}")
    return caster


def _adapter(optimizer):
    """The module that handles this optimizer wrapper (one per DeepSpeed bf16 path)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_hooks import stage0, stage3, zero12
    for types, module in [((DeepSpeedZeroOptimizer, BF16_Optimizer), zero12),
                          ((FP16_UnfusedOptimizer, FP16_Optimizer), stage0),
                          ((DeepSpeedZeroOptimizer_Stage3,), stage3)]:
        if isinstance(optimizer, types):
            return module
    raise NotImplementedError(f'"{CONFIG_KEY}" mode "fair" does not support the optimizer wrapper '
                              f"{type(optimizer).__name__}")


def _commit_after_all_ranks(engine) -> None:
    """Make ``save_checkpoint`` point ``latest`` at a tag only once every rank has written it.

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
    from deepspeed_hooks.checkpoint import CLIENT_KEY
    save = engine.save_checkpoint

    @functools.wraps(save)
    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, **kwargs):  # noqa: B006 (DeepSpeed's signature)
        if CLIENT_KEY in client_state:
            raise ValueError(f'save_checkpoint: client_state key "{CLIENT_KEY}" is reserved for Fair Cast\'s state')
        tag = tag if tag is not None else f"global_step{engine.global_steps}"
        client_state = {**client_state, CLIENT_KEY: {"step": engine.optimizer.export_caster.step}}
        result = save(save_dir, tag=tag, client_state=client_state, save_latest=False, **kwargs)
        dist.barrier()
        if save_latest and dist.get_rank() == 0:
            tmp = os.path.join(save_dir, "latest.tmp")
            with open(tmp, "w") as f:
                f.write(str(tag))
            os.replace(tmp, os.path.join(save_dir, "latest"))
        dist.barrier()
        return result

    engine.save_checkpoint = save_checkpoint


def _load_serves_what_was_served(engine) -> None:
    """Make ``load_checkpoint`` give back the served bf16 model, the export step, the residuals and
    the per-group hyperparameters of the checkpoint, whatever the load flags (or refuse).

    Same signature and return value as DeepSpeed's. The tag is resolved once (``latest`` /
    ``latest_universal``), so every file read is of that tag; then
    :func:`deepspeed_hooks.checkpoint.finish_load` repairs what DeepSpeed leaves otherwise (see
    there). ``client_state`` comes back without Fair Cast's ``"export_cast"`` key.

    Raises:
        NotImplementedError: a combination that cannot serve what was served (see
            :func:`deepspeed_hooks.checkpoint.refuse_unsupported_load`).
    """
    from deepspeed_hooks import checkpoint
    load = engine.load_checkpoint

    @functools.wraps(load)
    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        universal = bool(engine.load_universal_checkpoint())
        optimizer_states = load_optimizer_states and not load_module_only  # what DeepSpeed loads the optimizer for
        checkpoint.refuse_unsupported_load(engine, universal, optimizer_states)
        tag = checkpoint.resolve_tag(load_dir, tag, universal)
        with checkpoint.zero3_fp32_reads_tag(tag):
            path, client_state = load(load_dir, tag=tag, load_module_strict=load_module_strict,
                                      load_optimizer_states=load_optimizer_states,
                                      load_lr_scheduler_states=load_lr_scheduler_states,
                                      load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if path is not None:
            meta = client_state.pop(checkpoint.CLIENT_KEY, None)
            checkpoint.finish_load(engine, os.path.join(load_dir, tag), meta, optimizer_states, universal)
            drift = getattr(getattr(engine.optimizer, "fair_export", None), "drift", None)
            if drift is not None:  # the served model was replaced: the next step primes again
                drift.drift.reset()
        return path, client_state

    engine.load_checkpoint = load_checkpoint


def _report_drift(engine, export) -> None:
    """Send per-step drift telemetry to the engine's monitor (see :mod:`deepspeed_hooks.monitor`)."""
    from deepspeed_hooks.monitor import DriftMonitor
    total = sum(getattr(p, "ds_numel", p.numel()) for p in engine.param_names)
    export.drift = DriftMonitor(total)
    step = engine.step

    @functools.wraps(step)
    def step_and_report(*args, **kwargs):
        result = step(*args, **kwargs)
        export.drift.write(engine.monitor, engine.global_samples)  # only after an optimizer step
        return result

    engine.step = step_and_report


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
    ``from deepspeed import initialize`` earlier keeps the unpatched function. Idempotent.
    """
    deepspeed.initialize = initialize


_DEEPSPEED_INITIALIZE = deepspeed.initialize
