"""Fair Cast state in DeepSpeed checkpoint files, and universal checkpoints that keep it.

DeepSpeed's ``ds_to_universal`` extracts only ``fp32``, ``exp_avg``, ``exp_avg_sq`` (and
``step``) per param, so a residual would be lost (upstream issue #8608). Convert with

    python -m deepspeed_hooks.checkpoint CHECKPOINT_DIR/global_step100 UNIVERSAL_DIR

which runs DeepSpeed's converter, then adds for every param
``zero/<name>/export_cast_residual.pt`` and ``zero/<name>/export_cast_served.pt`` (``{"param":
full tensor}``, the layout of DeepSpeed's own files) and ``zero/export_cast.pt`` (``{"step": int,
"config": dict}``). Loading it with ``"checkpoint": {"load_universal": true}`` at any DP size
(ZeRO-1/2, BF16_Optimizer, ZeRO-3) gives each element its own residual and served value back.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys

import torch

from deepspeed_hooks.export import RESIDUAL_KEY, SERVED_KEY, STEP_KEY

UNIVERSAL_STATE_FILE = "export_cast.pt"


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _rank_files(tag_dir: str, pattern: str) -> list[str]:
    found = sorted((int(m.group(1)), f) for f in os.listdir(tag_dir) if (m := re.fullmatch(pattern, f)))
    return [os.path.join(tag_dir, f) for _, f in found]


def read_state(tag_dir: str, key: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Full per-param tensors of one optimizer-state key, assembled from every rank's file.

    Args:
        tag_dir: one checkpoint tag folder (e.g. ``ckpt/global_step100``) of ZeRO-1/2,
            BF16_Optimizer or ZeRO-3.
        key: a per-element state key (``"export_cast_residual"``, ``"export_cast_served"``...).

    Returns:
        ``({param name: tensor of the param's full shape}, {"step": int | None, "config": dict|None})``;
        the dict is empty when no rank has the key.

    Raises:
        FileNotFoundError: no ZeRO optimizer files in ``tag_dir``.
    """
    files = _rank_files(tag_dir, r"bf16_zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt") or \
        _rank_files(tag_dir, r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
    if not files:
        raise FileNotFoundError(f"no ZeRO optimizer-state files in {tag_dir}")
    sds = [_load(f)["optimizer_state_dict"] for f in files]
    meta = {"step": None, "config": None}
    out: dict[str, torch.Tensor] = {}
    if "param_slice_mappings" in sds[0]:  # ZeRO-1/2, BF16_Optimizer: fragments per rank, in rank order
        model = _load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
        shapes = {n: s for group in model["param_shapes"] for n, s in group.items()}
        pieces: dict[str, list] = {}
        for sd in sds:
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                state = sd["base_optimizer_state"]["state"][g]
                meta["step"] = state.get(STEP_KEY, meta["step"])
                if key in state:
                    for name, frag in mapping.items():
                        pieces.setdefault(name, []).append(state[key].narrow(0, frag.start, frag.numel))
        for name, parts in pieces.items():
            out[name] = torch.cat(parts).view(shapes[name]).clone()
        return out, meta
    # ZeRO-3: each param cut into ceil(numel / world) per rank, params back to back per sub-group
    shapes = _load(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"))["param_shapes"]
    states = [sd["optimizer_state_dict"]["state"] for sd in sds]
    meta["step"] = states[0][0].get(STEP_KEY)
    if any(key not in st[g] for st in states for g in range(len(shapes))):
        return {}, meta
    for g, group in enumerate(shapes):
        offset = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            pn = math.ceil(numel / len(states))
            out[name] = torch.cat([st[g][key].view(-1)[offset:offset + pn] for st in states])[:numel].view(shape).clone()
            offset += pn
    return out, meta


def to_universal(tag_dir: str, out_dir: str) -> None:
    """Convert a checkpoint tag to DeepSpeed's universal format, keeping the Fair Cast state.

    The conversion is written to ``out_dir + ".partial"`` and renamed when complete.

    Raises:
        ValueError: ``tag_dir`` has no export-cast state (written without Fair Cast).
        FileExistsError: ``out_dir`` exists.
        subprocess.CalledProcessError: DeepSpeed's converter failed.
    """
    served, meta = read_state(tag_dir, SERVED_KEY)
    if not served:
        raise ValueError(f"{tag_dir} has no '{SERVED_KEY}': it was not written with Fair Cast")
    residual, _ = read_state(tag_dir, RESIDUAL_KEY)
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
    for key, values in ((SERVED_KEY, served), (RESIDUAL_KEY, residual)):
        for name, tensor in values.items():
            torch.save({"param": tensor}, os.path.join(zero, name, f"{key}.pt"))
    torch.save({"step": meta["step"], "config": config}, os.path.join(zero, UNIVERSAL_STATE_FILE))
    os.replace(tmp, out_dir)  # only a complete conversion appears under the final name
    root, name = os.path.split(out_dir.rstrip(os.sep))
    with open(os.path.join(root, "latest_universal"), "w") as f:  # DeepSpeed's converter named the .partial
        f.write(name)


def read_universal(folder: str, names: list[str]) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """The Fair Cast state of a universal checkpoint: ``(meta, {key: {name: full tensor}})``."""
    zero = os.path.join(folder, "zero")
    meta = torch.load(os.path.join(zero, UNIVERSAL_STATE_FILE), weights_only=False)
    values = {}
    for key in (RESIDUAL_KEY, SERVED_KEY):
        files = {n: os.path.join(zero, n, f"{key}.pt") for n in names}
        if all(os.path.exists(f) for f in files.values()):
            values[key] = {n: torch.load(f, weights_only=False)["param"] for n, f in files.items()}
    return meta, values


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
