"""Fair Cast state in DeepSpeed checkpoint files, and universal checkpoints that keep it.

DeepSpeed's ``ds_to_universal`` extracts only ``fp32``, ``exp_avg``, ``exp_avg_sq`` (and
``step``) per param, so a residual would be lost (upstream issue #8608). Convert with

    python -m deepspeed_hooks.checkpoint CHECKPOINT_DIR/global_step100 UNIVERSAL_DIR

which runs DeepSpeed's converter, then adds for every param
``zero/<name>/export_cast_residual.pt`` and ``zero/<name>/export_cast_served.pt`` (``{"param":
full tensor}``, the layout of DeepSpeed's own files) and ``zero/export_cast.pt`` (``{"step": int,
"config": dict}``); frozen params (which DeepSpeed's converter drops) get their served value too.
With ``format "fp8"`` also ``zero/<name>/export_cast_fp8.pt`` (the E4M3 bits served, uint8),
``export_cast_fp8_residual.pt`` (error feedback) and the sticky scales in ``zero/export_cast.pt``
(``"fp8_scales": {name: float32 scales}``).
Loading it with ``"checkpoint": {"load_universal": true}`` at any DP size (ZeRO-1/2,
BF16_Optimizer, ZeRO-3) gives each element its own residual and served value back.

:func:`finish_load` runs after every ``engine.load_checkpoint`` (wrapped by
:func:`deepspeed_hooks.install`) and makes each load flag serve what was served at save:

* optimizer state loaded (the default, ``load_lr_scheduler_states=False``, an explicit tag,
  universal): masters, residuals, export step and per-group hyperparameters come from the optimizer
  state (:meth:`OptimizerExport.after_load`); frozen params of a universal checkpoint and the
  per-group hyperparameters of a ZeRO-3 universal load (DeepSpeed gives every group group 0's)
  are put back here.
* no optimizer state (``load_optimizer_states=False``, ``load_module_only=True``): the bf16 model
  gets the served values (ZeRO-3 would re-round the fp32 master to nearest), the fp32 masters
  are set to them (DeepSpeed's rule on ZeRO-1/2: masters from the bf16 weights), residuals start
  at zero (exact: the master is its served value) and the export step continues from the one
  saved in the model-states file (``client_state["export_cast"]``, written by the save wrapper).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

import torch
from deepspeed.utils import logger

from deepspeed_hooks.export import (FP8_KEY, FP8_RESIDUAL_KEY, FP8_SCALES_KEY, RESIDUAL_KEY, SERVED_KEY, STATE_KEYS,
                                    STEP_KEY, UNIVERSAL_STATE_FILE)
from faircast_dist.shards import partition_range


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _rank_files(tag_dir: str, pattern: str) -> list[str]:
    found = sorted((int(m.group(1)), f) for f in os.listdir(tag_dir) if (m := re.fullmatch(pattern, f)))
    return [os.path.join(tag_dir, f) for _, f in found]


def read_state(tag_dir: str, keys: Sequence[str]) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Full per-param tensors of some per-element optimizer-state keys, assembled from every rank's file (each
    file read once).

    Args:
        tag_dir: one checkpoint tag folder (e.g. ``ckpt/global_step100``) of ZeRO-1/2,
            BF16_Optimizer or ZeRO-3.
        keys: per-element state keys (``"export_cast_residual"``, ``"export_cast_served"``...).

    Returns:
        ``({key: {param name: tensor of the param's full shape}}, {"step": int | None, "fp8_scales": dict | None})``;
        a key's dict is empty when no rank has it.

    Raises:
        FileNotFoundError: no ZeRO optimizer files in ``tag_dir``.
    """
    files = _rank_files(tag_dir, r"bf16_zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt") or \
        _rank_files(tag_dir, r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
    if not files:
        raise FileNotFoundError(f"no ZeRO optimizer-state files in {tag_dir}")
    sds = [_load(f)["optimizer_state_dict"] for f in files]
    meta = {"step": None, "fp8_scales": None}
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in keys}
    if "param_slice_mappings" in sds[0]:  # ZeRO-1/2, BF16_Optimizer: fragments per rank, in rank order
        model = _load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
        shapes = {n: s for group in model["param_shapes"] for n, s in group.items()}
        pieces: dict[str, dict[str, list]] = {key: {} for key in keys}
        for sd in sds:
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                state = sd["base_optimizer_state"]["state"][g]
                meta["step"] = state.get(STEP_KEY, meta["step"])
                meta["fp8_scales"] = state.get(FP8_SCALES_KEY, meta["fp8_scales"])
                for key in keys:
                    if key in state:
                        for name, frag in mapping.items():
                            pieces[key].setdefault(name, []).append(state[key].narrow(0, frag.start, frag.numel))
        for key in keys:
            for name, parts in pieces[key].items():
                out[key][name] = torch.cat(parts).view(shapes[name]).clone()
        return out, meta
    # ZeRO-3: each param cut into ceil(numel / world) per rank (shards.partition_range), params back
    # to back per sub-group
    shapes = _load(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"))["param_shapes"]
    states = [sd["optimizer_state_dict"]["state"] for sd in sds]
    meta["step"], meta["fp8_scales"] = states[0][0].get(STEP_KEY), states[0][0].get(FP8_SCALES_KEY)
    for key in keys:
        if any(key not in st[g] for st in states for g in range(len(shapes))):
            continue
        for g, group in enumerate(shapes):
            offset = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                pn = math.ceil(numel / len(states))
                parts = [st[g][key].view(-1).narrow(0, offset, partition_range(numel, pn, r)[1])
                         for r, st in enumerate(states)]
                out[key][name] = torch.cat(parts).view(shape).clone()
                offset += pn
    return out, meta


def read_served(tag_dir: str, trained: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The served bf16 model saved in one checkpoint tag: ``{name: bf16 tensor of the param's shape}``.

    The names :func:`deepspeed_hooks.served.served_weights` yields: every param of the module,
    frozen ones included, tied weights once, no buffers. ``trained``: ZeRO-3, the trained params' served
    tensors already read (:func:`read_state` of ``"export_cast_served"``), else they are read here.

    Raises:
        FileNotFoundError: no model-states file in ``tag_dir``.
        ValueError: a ZeRO-3 checkpoint written without Fair Cast (it stores no bf16 weights).
    """
    dense = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if os.path.exists(dense):  # stage 0/1/2: the saved module's params are the served bf16 model
        sd = _load(dense)
        # the module minus its buffers, shared storages (tied weights) once, in module order
        buffers, seen, names = set(sd.get("buffer_names") or ()), set(), []
        for n, t in sd["module"].items():
            if n not in buffers and (t.untyped_storage().data_ptr(), t.storage_offset()) not in seen:
                seen.add((t.untyped_storage().data_ptr(), t.storage_offset()))
                names.append(n)
        return {n: sd["module"][n].to(torch.bfloat16).clone() for n in names}
    # ZeRO-3: rebuild from the per-rank served partitions
    served = dict(trained) if trained is not None else read_state(tag_dir, [SERVED_KEY])[0][SERVED_KEY]
    if not served:
        raise ValueError(f"{tag_dir} has no '{SERVED_KEY}' in its optimizer state: a ZeRO-3 checkpoint stores no "
                         f"bf16 weights unless it was written with Fair Cast")
    # frozen params: no optimizer state; each rank's model-states file holds its partition of them
    models = [_load(f) for f in _rank_files(tag_dir, r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")]
    for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
        full = torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in models])
        served[name] = full[:math.prod(shape)].view(shape).to(torch.bfloat16).clone()
    return served


def to_universal(tag_dir: str, out_dir: str) -> None:
    """Convert a checkpoint tag to DeepSpeed's universal format, keeping the Fair Cast state.

    The conversion is written to ``out_dir + ".partial"`` and renamed when complete.

    Raises:
        ValueError: ``tag_dir`` has no export-cast state (written without Fair Cast), or is a
            stage-0 checkpoint (DeepSpeed converts only ZeRO optimizer files).
        FileExistsError: ``out_dir`` exists.
        subprocess.CalledProcessError: DeepSpeed's converter failed.
    """
    if not _rank_files(tag_dir, r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt"):
        raise ValueError(f"{tag_dir} has no ZeRO optimizer-state files (a ZeRO stage 0 checkpoint?): DeepSpeed's "
                         f"universal format is converted from ZeRO-1/2/3 or BF16_Optimizer checkpoints only")
    state, meta = read_state(tag_dir, [SERVED_KEY, RESIDUAL_KEY, FP8_KEY, FP8_RESIDUAL_KEY])
    if not state[SERVED_KEY]:
        raise ValueError(f"{tag_dir} has no '{SERVED_KEY}': it was not written with Fair Cast")
    served = read_served(tag_dir, state[SERVED_KEY])  # the trained params and the frozen ones
    residual, fp8, fp8_residual = state[RESIDUAL_KEY], state[FP8_KEY], state[FP8_RESIDUAL_KEY]
    dense = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    stage3 = not os.path.exists(dense)
    config = _load(dense if not stage3 else os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
                   ).get("ds_config", {}).get("export_cast")
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} exists: not overwriting a checkpoint")
    tmp = out_dir.rstrip(os.sep) + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a previous conversion that died half-way
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
           "--output_folder", tmp, "--num_extract_workers", "1", "--num_merge_workers", "1"]
    subprocess.run(cmd + ([] if stage3 else ["--inject_missing_state"]), check=True)
    zero = os.path.join(tmp, "zero")
    for key, values in ((SERVED_KEY, served), (RESIDUAL_KEY, residual), (FP8_KEY, fp8),
                        (FP8_RESIDUAL_KEY, fp8_residual)):
        for name, tensor in values.items():
            os.makedirs(os.path.join(zero, name), exist_ok=True)  # a frozen param has no folder yet
            torch.save({"param": tensor}, os.path.join(zero, name, f"{key}.pt"))
    torch.save({"step": meta["step"], "config": config, "fp8_scales": meta["fp8_scales"] if fp8 else None},
               os.path.join(zero, UNIVERSAL_STATE_FILE))
    os.replace(tmp, out_dir)  # only a complete conversion appears under the final name
    root, name = os.path.split(out_dir.rstrip(os.sep))
    with open(os.path.join(root, "latest_universal"), "w") as f:  # DeepSpeed's converter named the .partial
        f.write(name)


def resolve_tag(load_dir: str, tag: str | None, universal: bool) -> str | None:
    """The tag ``engine.load_checkpoint(load_dir, tag)`` loads: ``tag``, else the one named in
    ``latest`` (``latest_universal`` for a universal load); None when that file is absent."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest_universal" if universal else "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def refuse_unsupported_load(engine, universal: bool, optimizer_states: bool) -> None:
    """Raise before loading anything when a load cannot give back what Fair Cast served.

    Args:
        universal: a universal-checkpoint load.
        optimizer_states: ``load_optimizer_states and not load_module_only``.

    Raises:
        NotImplementedError: ``"checkpoint": {"load_universal": true}`` on ZeRO stage 0
            (FP16_Optimizer / FP16_UnfusedOptimizer): DeepSpeed converts and loads universal
            checkpoints only for ZeRO-1/2/3 and BF16_Optimizer (stage 0 has no loader for them);
            or a universal load with ``load_module_only=True`` / ``load_optimizer_states=False``
            on ZeRO-1/2 or BF16_Optimizer, whose universal loader ignores both flags and loads
            the optimizer state anyway (DeepSpeed 0.19.8).
    """
    if universal and not engine.zero_optimization():
        raise NotImplementedError(
            f'"checkpoint": {{"load_universal": true}} with ZeRO stage 0 ({type(engine.optimizer).__name__}) is not '
            f"supported: DeepSpeed has universal checkpoints only for ZeRO-1/2/3 and BF16_Optimizer (its converter "
            f"and loaders need ZeRO optimizer files); load the stage-0 checkpoint as saved")
    if universal and not optimizer_states and not engine.zero_optimization_partition_weights():
        raise NotImplementedError(
            f'"checkpoint": {{"load_universal": true}} with load_module_only=True or load_optimizer_states=False on '
            f"{type(engine.optimizer).__name__} is not supported: DeepSpeed's ZeRO-1/2 and BF16_Optimizer universal "
            f"loader ignores both flags and loads the optimizer state anyway; load the universal checkpoint whole, "
            f"or the original checkpoint with the flag")


def _universal_served(folder: str, names: list[str]) -> dict[str, torch.Tensor]:
    files = {n: os.path.join(folder, "zero", n, f"{SERVED_KEY}.pt") for n in names}
    missing = sorted(n for n, f in files.items() if not os.path.exists(f))
    if missing:
        raise ValueError(f"universal checkpoint {folder} has no served value for params {missing}: DeepSpeed's "
                         f"ds_to_universal keeps only the params the optimizer steps (frozen params are lost); "
                         f"convert with python -m deepspeed_hooks.checkpoint")
    return {n: torch.load(f, weights_only=False)["param"] for n, f in files.items()}


@torch.no_grad()
def write_served(engine, served: dict[str, torch.Tensor]) -> None:
    """Set every bf16 param of ``engine.module`` to ``served[name]`` (full shapes, as
    :func:`read_served` gives). No communication: under ZeRO-3 each rank writes its own partition
    (``ds_tensor``, a view into the optimizer's flat bf16 buffer) and persistent params are
    gathered again afterwards.

    Raises:
        KeyError: a param the optimizer trains has no value in ``served`` (names it).
    """
    from deepspeed_hooks import compat
    params = list(engine.module.named_parameters())
    missing = sorted(n for n, p in params if p.requires_grad and n not in served)
    if missing:
        raise KeyError(f"export cast: the checkpoint has no served value for params {missing}")
    zero3 = any(compat.is_zero3(p) for _, p in params)
    if zero3:
        engine.optimizer.checkpoint_event_prologue()  # every param partitioned, persistent ones too
    for name, p in params:
        if name not in served:
            continue  # a frozen param saved with exclude_frozen_parameters: DeepSpeed's own value stays
        value = served[name].reshape(-1)
        if zero3:
            local, start, _ = compat.zero3_local(p)
            local.copy_(value.narrow(0, start, local.numel()))
        else:
            p.data.view(-1).copy_(value)
    if zero3:
        engine.optimizer.checkpoint_event_epilogue()  # gathers the persistent params from their partitions


def finish_load(engine, tag_dir: str, meta: dict | None, optimizer_loaded: bool, universal: bool) -> None:
    """After DeepSpeed's ``load_checkpoint`` of ``tag_dir``: serve what was served at save (see
    the module docstring for what each load flag gets).

    Args:
        engine: the engine, with Fair Cast installed.
        tag_dir: the checkpoint tag folder (or universal folder) just loaded.
        meta: ``client_state["export_cast"]`` of the loaded model-states file (None if absent).
        optimizer_loaded: DeepSpeed loaded the optimizer state (``load_optimizer_states`` and not
            ``load_module_only``).
        universal: it was a universal-checkpoint load.

    Raises:
        ValueError: a universal checkpoint without served values for some params (names them), or
            whose param groups do not match the optimizer's.
        KeyError: a trained param has no served value in the checkpoint.
    """
    export = engine.optimizer.export_cast
    names = [n for n, _ in engine.module.named_parameters()]
    if universal:
        if optimizer_loaded:  # ZeRO-3's universal loader gives every group group 0's hyperparameters
            saved = torch.load(os.path.join(tag_dir, "zero", "optimizer_state.pt"), weights_only=False)["param_groups"]
            groups = engine.optimizer.param_groups
            if len(saved) != len(groups):
                raise ValueError(f"universal checkpoint {tag_dir} has {len(saved)} param groups, the optimizer "
                                 f"{len(groups)}: cannot restore per-group hyperparameters")
            for group, saved_group in zip(groups, saved):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
        state_file = os.path.join(tag_dir, "zero", UNIVERSAL_STATE_FILE)
        fair = os.path.exists(state_file)  # converted by to_universal (else: served was nearest, except frozen)
        wanted = names if fair else [n for n, p in engine.module.named_parameters() if not p.requires_grad]
        served = _universal_served(tag_dir, wanted) if wanted else None
        step = torch.load(state_file, weights_only=False)["step"] if fair else None
    else:
        served, step = None, (meta or {}).get("step")
        try:
            served = None if optimizer_loaded else read_served(tag_dir)
        except ValueError:  # ZeRO-3 without Fair Cast state: it served DeepSpeed's nearest, as loaded
            if meta is not None:
                raise
    if served is not None:
        write_served(engine, served)
    if optimizer_loaded:
        return  # masters, residuals and the export step came with the optimizer state
    engine.optimizer.refresh_fp32_params()  # masters := the served bf16 values (each rank its partition)
    for hp, _ in export.groups():  # what a universal loader put there; an empty state lets Adam start afresh
        for key in STATE_KEYS:
            export.group_state(hp).pop(key, None)
    if step is None:  # (warned; FP8: the copy of the loaded masters, scales set afresh)
        export.state.restore(None, export.shards(), step=0)
    else:
        export.state.restart(export.shards(), step=step)
    logger.info(f"export cast: loaded without optimizer state: masters set to the served bf16 values, residuals "
                f"at zero, export step {export.state.step}")


def main(argv=None) -> None:
    """CLI: convert a Fair Cast checkpoint tag to a universal checkpoint (keeps residuals)."""
    p = argparse.ArgumentParser(description="DeepSpeed ds_to_universal that keeps the Fair Cast state.")
    p.add_argument("input_folder", help="a checkpoint tag folder, e.g. ckpt/global_step100")
    p.add_argument("output_folder", help="the universal checkpoint folder to create")
    args = p.parse_args(argv)
    to_universal(args.input_folder, args.output_folder)
    print(f"wrote universal checkpoint with Fair Cast state to {args.output_folder}")


if __name__ == "__main__":
    main()
