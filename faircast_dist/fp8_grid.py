"""``faircast-fp8-grid``: is my FP8 rollout frozen?

An RL run that trains from an FP8 checkpoint dequantized (DeepSeek-V3/R1, Kimi-K2: ``docs/fp8.md``, "Is my FP8
rollout frozen?") starts with its masters *on* the served E4M3 grid, and a stack that re-quantizes them with
round-to-nearest and scales recomputed from the weights serves the same codes until a master moves half an E4M3
spacing (times its scale): small updates are dropped for tens to hundreds of steps. This tool reads the checkpoint
and the masters and says, per tensor and in total, how far from that the run is.

    faircast-fp8-grid CHECKPOINT [--masters MASTERS] [--rule RULE] [--json] [--rows N]
    python -m faircast_dist.fp8_grid ...          (the same)

``CHECKPOINT``: a ``.safetensors`` file or a folder of them (a HF folder; its ``config.json``
``quantization_config.weight_block_size`` gives the block size, default 128x128). Each FP8 weight ``X.weight`` is
float8_e4m3fn ``[N, K]`` beside its scales, which multiply (``served = q * s``):

* ``X.weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]``: one per block (DeepSeek-V3, Qwen3-FP8);
* ``X.weight_scale`` ``[N, 1]`` or ``[N]``: one per output channel (compressed-tensors ``FP8_DYNAMIC``); ``[1]`` or a
  scalar: one per tensor; a block-shaped ``weight_scale`` counts as blocks.

Tensors of other dtypes without scales (embeddings, norms, a bf16 head) are skipped and counted.

``MASTERS`` (optional): a file or folder holding every FP8 weight's name as bf16, fp16 or fp32 ``[N, K]`` (extra
tensors are ignored). Without it the masters are the checkpoint dequantized in fp32 (``q * s``), the RL run's start.

Per tensor and in total (shares are fractions of the elements or scale groups):

* ``on_grid``: ``master == q * s`` in fp32, with the checkpoint's ``q`` and ``s``; ``on_grid_bf16``: ``bf16(master)
  == bf16(q * s)``, the same seen by a stack that quantizes bf16 weights (``bf16(q * s)`` is what such a stack
  gets back as ``q``: :meth:`faircast_dist.fp8.ScaleRule.grid`; ``q * s`` itself is rarely a bf16 value);
* ``groups``, ``groups_below_448`` and ``groups_at_448``: scale groups (blocks, channels, the tensor) of the
  checkpoint, those whose largest ``|q|`` is below 448 (a stack recomputing the scale from the group's absmax puts
  it on another grid) and those at exactly 448;
* under ``RULE`` (a :data:`faircast_dist.fp8.PRESETS` name; default by the checkpoint's layout: ``verl`` for blocks,
  ``vllm-fp8-per-channel`` for channels, ``vllm-fp8-per-tensor`` for a tensor scale), round-to-nearest of the masters
  with fresh scales (:meth:`ScaleRule.quantize`; an ``engine_fused`` rule quantizes vLLM's fused ``qkv_proj`` /
  ``gate_up_proj`` as the engine does; the sticky ``deepseek-ue8m0`` keeps the checkpoint's scales where they fit,
  if they are its layout): ``codes_unchanged`` (the code's value equals the checkpoint's: frozen at this point),
  ``served_unchanged`` (``q' * s'`` equals ``q * s`` in fp32: the scale did not move either), and ``distance``,
  quantiles of each master's distance to the nearest rounding boundary of its code under the rule, in E4M3
  spacings: the distance to the midpoint between its code and the neighbour on that side, over the gap between
  the two. 0.5 on the grid (less up to 1/16 where the rule rounds the master to bf16 first, as every preset does:
  that rounding moves it up to 2**-8 of its value), 0 on a boundary, 0.25 on average for masters spread evenly
  between codes.
  The quantiles come from a histogram of 4096 bins over ``[0, 0.5]``: each is its bin's upper edge (to 1/8192
  spacing, rounded up). Non-finite masters (and masters the rule's bf16 rounding makes infinite) are counted
  (``nonfinite_masters``) and left out of the distance.

The verdict is ``frozen`` when the median distance is at least 0.375 (halfway between evenly spread, 0.25, and on
the grid, 0.5).

Exit status: 0, or 2 with a message naming the file, tensor or key on bad input (:class:`Fp8GridError`).
Memory: about ten fp32 copies of the largest FP8 tensor (of vLLM's fused layer under an ``engine_fused`` rule).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import torch

from faircast_dist.fp8 import BLOCK, PRESETS, engine_part, engine_layer, partial_absmax
from faircast_dist.rounding import E4M3_MAX, e4m3_round

#: the rule a layout gets without ``--rule``: the stacks' recomputing quantizers of that layout
DEFAULT_RULES = {"block": "verl", "channel": "vllm-fp8-per-channel", "tensor": "vllm-fp8-per-tensor"}
BINS = 4096  # distance histogram bins over [0, 0.5] spacings
FROZEN_MEDIAN = 0.375
MASTER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTILES = (0.01, 0.1, 0.5, 0.9)


class Fp8GridError(ValueError):
    """Bad input: the message names the file, tensor or key."""


# ---------------------------------------------------------------------------------------------------- reading


class Tensors:
    """The tensors of a ``.safetensors`` file or of a folder's ``*.safetensors``, read one at a time.

    Args:
        path: the file or folder.
        what: ``"checkpoint"`` or ``"masters"``, for messages.

    Attributes:
        files: ``{key: file}``; ``meta``: ``{key: (dtype str, shape tuple)}`` (safetensors' dtype names, e.g.
            ``"F8_E4M3"``); ``folder``: the folder (for ``config.json``) or None for a file.

    Raises:
        Fp8GridError: no such path, no ``.safetensors`` in the folder, a file safetensors cannot read, a key in two
            files.
    """

    def __init__(self, path: str, what: str):
        try:
            from safetensors import safe_open
        except ImportError as e:  # not in faircast's install_requires
            raise Fp8GridError("faircast-fp8-grid reads safetensors: pip install safetensors") from e
        self._open = safe_open
        self.path, self.what = path, what
        if os.path.isdir(path):
            self.folder = path
            names = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not names:
                raise Fp8GridError(f"{what} {path!r}: the folder holds no *.safetensors file")
        elif os.path.isfile(path):
            self.folder, names = None, [path]
        else:
            raise Fp8GridError(f"{what} {path!r}: no such file or folder")
        self.files, self.meta = {}, {}
        for name in names:
            try:
                with safe_open(name, framework="pt") as f:
                    for key in f.keys():
                        if key in self.files:
                            raise Fp8GridError(f"{what}: tensor {key!r} is in both {self.files[key]!r} and {name!r}")
                        part = f.get_slice(key)
                        self.files[key], self.meta[key] = name, (part.get_dtype(), tuple(part.get_shape()))
            except Fp8GridError:
                raise
            except Exception as e:  # safetensors raises its own errors (header, truncated file)
                raise Fp8GridError(f"{what} {name!r}: not a readable safetensors file ({e})") from e

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (a CPU tensor of the file's dtype and shape)."""
        with self._open(self.files[key], framework="pt") as f:
            return f.get_tensor(key)

    def where(self, key: str) -> str:
        return f"{self.what} {self.files[key]!r}"


def block_size(checkpoint: Tensors) -> tuple[int, int]:
    """``(bn, bk)`` from the folder's ``config.json`` ``quantization_config.weight_block_size``, else ``(128, 128)``.

    Raises:
        Fp8GridError: a ``config.json`` that is not JSON, or a ``weight_block_size`` that is not two positive ints.
    """
    if checkpoint.folder is None or not os.path.isfile(os.path.join(checkpoint.folder, "config.json")):
        return BLOCK, BLOCK
    path = os.path.join(checkpoint.folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise Fp8GridError(f"{path!r}: not readable JSON ({e})") from e
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(quant, (dict, type(None))):
        raise Fp8GridError(f"{path!r}: config.json must be an object whose quantization_config is an object, got "
                           f"{type(config).__name__ if not isinstance(config, dict) else repr(quant)}")
    size = (quant or {}).get("weight_block_size")
    if size is None:
        return BLOCK, BLOCK
    if not (isinstance(size, list) and len(size) == 2 and
            all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in size)):
        raise Fp8GridError(f"{path!r}: quantization_config.weight_block_size must be two positive ints, got {size!r}")
    return size[0], size[1]


def fp8_weights(checkpoint: Tensors, blocks: tuple[int, int]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The FP8 weights of the checkpoint and their layouts, checked, without reading any tensor.

    Returns:
        ``({weight key: (scale key, layout)}, skipped keys)``: layout ``"block"``, ``"channel"`` or ``"tensor"``;
        skipped: tensors that are neither FP8 weights nor their scales (bf16 embeddings, norms, ``input_scale``).

    Raises:
        Fp8GridError (each naming the key and file): no FP8 weight at all; a float8_e4m3fn ``...weight`` without
        scales, or with both scale names; scales beside a weight that is not float8_e4m3fn (bf16, float8_e5m2); a
        weight that is not 2-D; scales that are not a float dtype or whose shape fits no layout of the weight.
    """
    out, skipped = {}, []
    for key, (dtype, shape) in sorted(checkpoint.meta.items()):
        if key.endswith(("_scale", "_scale_inv")):
            continue
        scale_keys = [key + suffix for suffix in ("_scale_inv", "_scale") if key + suffix in checkpoint]
        if dtype != "F8_E4M3":
            if scale_keys:
                raise Fp8GridError(f"{checkpoint.where(key)}: {key!r} has scales {scale_keys[0]!r} but its dtype is "
                                   f"{dtype}, not float8_e4m3fn (F8_E4M3): an FP8 checkpoint stores E4M3 codes")
            skipped.append(key)
            continue
        if not scale_keys:
            raise Fp8GridError(f"{checkpoint.where(key)}: missing scales: {key!r} is float8_e4m3fn but the checkpoint "
                               f"has neither {key + '_scale_inv'!r} nor {key + '_scale'!r}")
        if len(scale_keys) == 2:
            raise Fp8GridError(f"{checkpoint.where(key)}: {key!r} has both {scale_keys[0]!r} and {scale_keys[1]!r}: "
                               "which one multiplies its codes?")
        if len(shape) != 2:
            raise Fp8GridError(f"{checkpoint.where(key)}: {key!r} has shape {list(shape)}; only 2-D [N, K] linear "
                               "weights are read (fused 3-D experts are not)")
        scale_key = scale_keys[0]
        scale_dtype, scale_shape = checkpoint.meta[scale_key]
        if scale_dtype not in ("F32", "BF16", "F16", "F64", "F8_E8M0"):
            raise Fp8GridError(f"{checkpoint.where(scale_key)}: scales {scale_key!r} have dtype {scale_dtype}; "
                               "expected a float dtype (F32, BF16, F16, F8_E8M0)")
        n, k = shape
        block_shape = (-(-n // blocks[0]), -(-k // blocks[1]))
        if scale_key.endswith("_scale_inv"):
            layout = "block" if scale_shape == block_shape else None
        elif math.prod(scale_shape) == 1 and len(scale_shape) <= 2:
            layout = "tensor"
        elif scale_shape in ((n, 1), (n,)):
            layout = "channel"
        else:
            layout = "block" if scale_shape == block_shape else None
        if layout is None:
            raise Fp8GridError(
                f"{checkpoint.where(scale_key)}: scales {scale_key!r} have shape {list(scale_shape)}, which fits no "
                f"layout of {key!r} {list(shape)}: blocks of {blocks[0]}x{blocks[1]} need {list(block_shape)} (the "
                f"block size is config.json's quantization_config.weight_block_size, default 128x128), channels "
                f"[{n}, 1], a tensor [1]")
        out[key] = (scale_key, layout)
    if not out:
        raise Fp8GridError(f"checkpoint {checkpoint.path!r}: no float8_e4m3fn weight with scales (is it the bf16 "
                           "model? pass that as --masters)")
    return out, skipped


def element_scales(scales: torch.Tensor, layout: str, shape: tuple[int, int], blocks: tuple[int, int]) -> torch.Tensor:
    """float32 ``shape`` ``[N, K]``: each element's scale from the checkpoint's ``scales`` of ``layout``."""
    n, k = shape
    s = scales.float()
    if layout == "tensor":
        return s.reshape(1, 1).expand(n, k)
    if layout == "channel":
        return s.reshape(n, 1).expand(n, k)
    return s.repeat_interleave(blocks[0], 0).repeat_interleave(blocks[1], 1)[:n, :k]


def group_index(layout: str, shape: tuple[int, int], blocks: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """``(int64 [N, K] group of each element, number of groups)`` of the checkpoint's layout."""
    n, k = shape
    if layout == "tensor":
        return torch.zeros(n, k, dtype=torch.int64, device="cpu"), 1
    if layout == "channel":
        return torch.arange(n, dtype=torch.int64, device="cpu").view(n, 1).expand(n, k), n
    cols = -(-k // blocks[1])
    row = torch.arange(n, dtype=torch.int64, device="cpu").view(n, 1) // blocks[0]
    col = torch.arange(k, dtype=torch.int64, device="cpu").view(1, k) // blocks[1]
    return row * cols + col, -(-n // blocks[0]) * cols


# ---------------------------------------------------------------------------------------------------- measuring


_E4M3 = torch.arange(127, dtype=torch.uint8, device="cpu").view(torch.float8_e4m3fn).float()  # 0 .. 448
E4M3_VALUES = torch.cat([-_E4M3[1:].flip(0), _E4M3])  #: the 253 finite E4M3 values, ascending (one zero)


def boundary_distance(y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """How far each scaled master must move before round-to-nearest changes its code, in E4M3 spacings.

    Args:
        y: float32, the master over its scale (times the rule's multiplier: what is rounded), finite, any shape.
        q: float32 like ``y``: its round-to-nearest E4M3 value (``|q| <= 448``).

    Returns:
        float32 like ``y``, in ``[0, 0.5]``: the smaller, over the two sides, of the distance from ``y`` to the
        midpoint between ``q`` and its neighbour on that side, over the gap between the two (its spacing there).
        0.5 where ``y == q``, even at a power of two where the spacing halves below; ±448 have no neighbour
        outward (a larger master rescales instead).
    """
    table = E4M3_VALUES.to(y.device)
    i = torch.searchsorted(table, q.contiguous())
    last = table.numel() - 1
    lo = table[(i - 1).clamp(min=0)]
    hi = table[(i + 1).clamp(max=last)]
    inf = torch.full_like(y, float("inf"))
    d_lo = torch.where(i > 0, (y - (lo + q) / 2) / (q - lo), inf)
    d_hi = torch.where(i < last, ((q + hi) / 2 - y) / (hi - q), inf)
    return torch.minimum(d_lo, d_hi).clamp(0.0, 0.5)


def rule_cast(rule_name: str, weight: torch.Tensor, previous: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of ``weight`` under a preset, as :meth:`ScaleRule.quantize` computes it with fresh scales
    (tests/test_fp8_grid.py checks the codes are its codes), with what was rounded. A sticky rule
    (``deepseek-ue8m0``) given the checkpoint's scales keeps each where its group fits (:meth:`ScaleRule.next_scales`),
    as a stack that starts from them does.

    Args:
        rule_name: a :data:`PRESETS` name.
        weight: float32 ``[N, K]`` (an ``engine_fused`` rule: the engine's fused layer, parts' rows in order).
        previous: None, or the checkpoint's float32 scales in the rule's :meth:`ScaleRule.scale_shape` (used by a
            sticky rule only).

    Returns:
        ``(y, q, s)``: float32 ``[N, K]`` scaled values (``bf16(w) / s`` or ``bf16(w) * m``, saturated), the codes'
        values, float32 ``[N, K]`` element scales.
    """
    rule = PRESETS[rule_name]
    y, scales = rule.scaled(weight, previous if rule.sticky else None)
    return y, e4m3_round(y).float(), rule.element_scales(scales, tuple(weight.shape))


def _quantiles(hist: torch.Tensor) -> dict[str, float | None]:
    total = int(hist.sum())
    if total == 0:
        return {f"p{round(p * 100)}": None for p in QUANTILES}
    cum = hist.cumsum(0)
    return {f"p{round(p * 100)}": (int(torch.searchsorted(cum, math.ceil(p * total))) + 1) * 0.5 / BINS
            for p in QUANTILES}


def _summary(counts: dict, hist: torch.Tensor) -> dict:
    """Shares from counts: fractions of ``elements`` / of ``groups``."""
    e, g = counts["elements"], counts["groups"]
    finite = e - counts["nonfinite_masters"]
    return {
        "elements": e, "groups": g, "groups_below_448": counts["groups_below_448"],
        "on_grid": counts["on_grid"] / e, "on_grid_bf16": counts["on_grid_bf16"] / e,
        "groups_at_448": counts["groups_at_448"] / g if g else None,
        "codes_unchanged": counts["codes_unchanged"] / e, "served_unchanged": counts["served_unchanged"] / e,
        "nonfinite_masters": counts["nonfinite_masters"],
        "distance": {**_quantiles(hist), "mean": counts["distance_sum"] / finite if finite else None},
    }


def _load_master(masters: Tensors, key: str, shape: tuple[int, int]) -> torch.Tensor:
    t = masters.get(key)
    if t.dtype not in MASTER_DTYPES:
        raise Fp8GridError(f"{masters.where(key)}: master {key!r} has dtype {t.dtype}; masters are bf16, fp16 or "
                           "fp32 (an FP8 file is the checkpoint, not the masters)")
    if tuple(t.shape) != shape:
        raise Fp8GridError(f"{masters.where(key)}: master {key!r} has shape {list(t.shape)}, the checkpoint's "
                           f"weight {list(shape)}")
    return t.float()


def report(checkpoint: str, masters: str | None = None, rule: str | None = None) -> dict:
    """Measure how close the masters sit to the checkpoint's served grid (see the module docstring).

    Args:
        checkpoint: a ``.safetensors`` file or folder (FP8 weights and scales).
        masters: a file or folder of the masters by the same names, or None (the checkpoint dequantized, fp32).
        rule: a :data:`PRESETS` name, or None (:data:`DEFAULT_RULES` by each tensor's layout).

    Returns:
        A JSON-able dict: ``checkpoint``, ``masters`` (None: dequantized), ``block_size`` ``[bn, bk]``, ``rules``
        (those used), ``skipped`` (the number of other tensors), ``tensors`` (``{weight key: {layout, shape, rule,``
        and :func:`_summary`'s fields``}}``), ``total`` (the same over all FP8 weights) and ``verdict`` ``{frozen:
        bool, text: str}``.

    Raises:
        Fp8GridError: bad input (:class:`Tensors`, :func:`block_size`, :func:`fp8_weights`), a ``rule`` not in
            :data:`PRESETS`, masters missing FP8 weights (named), or of the wrong dtype or shape.
    """
    if rule is not None and rule not in PRESETS:
        raise Fp8GridError(f"--rule must be one of {sorted(PRESETS)}, got {rule!r}")
    ckpt = Tensors(checkpoint, "checkpoint")
    blocks = block_size(ckpt)
    weights, skipped = fp8_weights(ckpt, blocks)
    mast = None
    if masters is not None:
        mast = Tensors(masters, "masters")
        missing = [k for k in weights if k not in mast]
        if missing:
            raise Fp8GridError(f"masters {masters!r} lack {len(missing)} of the checkpoint's {len(weights)} FP8 "
                               f"weights: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    rules = {key: rule or DEFAULT_RULES[layout] for key, (_, layout) in weights.items()}
    # the units quantized together: vLLM's fused layers under an engine_fused rule, else each weight alone
    units: dict[tuple[str, str], list[str]] = {}
    for key in weights:
        fused = PRESETS[rules[key]].engine_fused
        units.setdefault((engine_layer(key) if fused else key, rules[key]), []).append(key)
    fields = ("elements", "groups", "groups_below_448", "groups_at_448", "on_grid", "on_grid_bf16", "codes_unchanged",
              "served_unchanged", "nonfinite_masters", "distance_sum")
    total, total_hist = dict.fromkeys(fields, 0), torch.zeros(BINS, dtype=torch.int64, device="cpu")
    tensors = {}
    for (_, rule_name), keys in sorted(units.items()):
        keys = sorted(keys, key=engine_part)
        parts = []
        for key in keys:
            scale_key, layout = weights[key]
            q = ckpt.get(key).float()
            shape = tuple(q.shape)
            s = element_scales(ckpt.get(scale_key), layout, shape, blocks)
            grid = q * s
            m = grid if mast is None else _load_master(mast, key, shape)
            parts.append((key, layout, shape, q, s, grid, m))
        previous = None  # a sticky rule starts from the checkpoint's scales where they are its layout
        if len(parts) == 1 and PRESETS[rule_name].sticky and PRESETS[rule_name].granularity == parts[0][1] and \
                (parts[0][1] != "block" or blocks == (BLOCK, BLOCK)):
            previous = ckpt.get(weights[keys[0]][0])
        y, q_new, s_new = rule_cast(rule_name, torch.cat([p[6] for p in parts]), previous)
        row = 0
        for key, layout, shape, q, s, grid, m in parts:
            rows = slice(row, row + shape[0])
            row += shape[0]
            group, count = group_index(layout, shape, blocks)
            amax = partial_absmax(q, group, count)  # NaN codes left out
            finite = torch.isfinite(m) & torch.isfinite(y[rows])  # (a master bf16 rounds to Inf: left out too)
            d = boundary_distance(torch.where(finite, y[rows], 0.0), torch.where(finite, q_new[rows], 0.0))[finite]
            hist = torch.bincount((d * (2 * BINS)).long().clamp(max=BINS - 1), minlength=BINS)
            counts = {
                "elements": q.numel(), "groups": count, "groups_below_448": int((amax < E4M3_MAX).sum()),
                "groups_at_448": int((amax == E4M3_MAX).sum()),
                "on_grid": int((m == grid).sum()),
                "on_grid_bf16": int((m.bfloat16() == grid.bfloat16()).sum()),
                "codes_unchanged": int((q_new[rows] == q).sum()),
                "served_unchanged": int((q_new[rows] * s_new[rows] == grid).sum()),
                "nonfinite_masters": int((~finite).sum()), "distance_sum": float(d.double().sum()),
            }
            for f in fields:
                total[f] += counts[f]
            total_hist += hist
            tensors[key] = {"layout": layout, "shape": list(shape), "rule": rule_name, **_summary(counts, hist)}
    summary = _summary(total, total_hist)
    used = sorted(set(rules.values()))
    return {"checkpoint": checkpoint, "masters": masters, "block_size": list(blocks), "rules": used,
            "skipped": len(skipped), "tensors": dict(sorted(tensors.items())), "total": summary,
            "verdict": verdict(summary, used)}


def verdict(total: dict, rules: list[str]) -> dict:
    """``{frozen: bool, text: str}`` from the totals: frozen when the median distance is >= :data:`FROZEN_MEDIAN`."""
    dist, rule = total["distance"], ", ".join(rules)
    if dist["p50"] is None:
        return {"frozen": False, "text": "no finite master: nothing to say"}
    changed = 1.0 - total["codes_unchanged"]
    first = (f" {_pct(changed)} of the codes change at the next sync under {rule} (its scales are not the "
             "checkpoint's: groups below 448, another layout);") if changed > 0.01 else ""
    if dist["p50"] >= FROZEN_MEDIAN:
        return {"frozen": True, "text":
                f"frozen:{first} round-to-nearest ({rule}) will serve these codes until a master moves "
                f"~{dist['p50']:.2f} E4M3 spacings times its scale (median; {dist['p10']:.2f} for the nearest 10%); "
                f"dithered/stochastic rounding (export_cast fp8_rule {rules[0]} + mode fair) changes codes in "
                "proportion to the move"}
    return {"frozen": False, "text":
            f"not frozen:{first} the masters sit off the served grid (median {dist['p50']:.2f} E4M3 spacings from a "
            "rounding boundary; evenly spread masters: 0.25), so round-to-nearest already changes codes in "
            "proportion to the move (keep mode nearest)"}


# ---------------------------------------------------------------------------------------------------- output


def _pct(x: float | None) -> str:
    """A share as a percentage that never reads 0% or 100% unless it is exactly that."""
    if x is None:
        return "-"
    if x in (0.0, 1.0):
        return f"{x:.0%}"
    return f"{min(max(x * 100, 0.01), 99.99):.2f}%"


def format_table(rep: dict, rows: int = 20) -> str:
    """The report as plain text: a header, one line per FP8 weight (the first ``rows`` by name; 0: all), the total
    and the verdict."""
    head = ("tensor", "layout", "elements", "on grid", "bf16 on", "grp<448", "grp@448", "codes same", "served same",
            "dist p1/p10/p50")
    lines = []

    def row(name, r, layout):
        d = r["distance"]
        dist = "/".join("-" if d[p] is None else f"{d[p]:.3f}" for p in ("p1", "p10", "p50"))
        return (name, layout, str(r["elements"]), _pct(r["on_grid"]), _pct(r["on_grid_bf16"]),
                f"{r['groups_below_448']}/{r['groups']}", _pct(r["groups_at_448"]), _pct(r["codes_unchanged"]),
                _pct(r["served_unchanged"]), dist)

    items = list(rep["tensors"].items())
    shown = items if rows <= 0 else items[:rows]
    body = [row(k[:-len(".weight")] if k.endswith(".weight") else k, r, r["layout"]) for k, r in shown]
    total = row(f"total ({len(items)} FP8 weights)", rep["total"], "")
    widths = [max(len(c[i]) for c in [head, *body, total]) for i in range(len(head))]

    def fmt(cells):
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(cells, widths)))

    masters = rep["masters"] or "the checkpoint dequantized (fp32 q * s)"
    lines += [f"checkpoint: {rep['checkpoint']}", f"masters:    {masters}",
              f"rule:       {', '.join(rep['rules'])} (round-to-nearest, scales recomputed from bf16(master))"
              f"; block {rep['block_size'][0]}x{rep['block_size'][1]}; {rep['skipped']} other tensors skipped", "",
              fmt(head)]
    lines += [fmt(c) for c in body]
    if len(shown) < len(items):
        lines.append(f"... {len(items) - len(shown)} more (--rows 0 shows all)")
    lines += [fmt(total), "", "dist: distance from each master to its code's rounding boundary, in E4M3 spacings "
              "(0.5: on the grid)", f"verdict: {rep['verdict']['text']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    """The console script ``faircast-fp8-grid``: prints the table (or ``--json``); returns 0, or exits 2 with the
    message on bad input."""
    parser = argparse.ArgumentParser(prog="faircast-fp8-grid", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="FP8 checkpoint: a .safetensors file or a folder of them")
    parser.add_argument("--masters", help="the masters (bf16/fp32) by the same names: a file or folder; default: "
                                          "the checkpoint dequantized (the RL run's start)")
    parser.add_argument("--rule", choices=sorted(PRESETS), help="the stack's quantizer (faircast_dist.fp8.PRESETS); "
                        "default by layout: " + ", ".join(f"{k} -> {v}" for k, v in DEFAULT_RULES.items()))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--rows", type=int, default=20, help="tensors shown in the table (0: all; default 20)")
    args = parser.parse_args(argv)
    try:
        rep = report(args.checkpoint, args.masters, args.rule)
    except Fp8GridError as e:
        parser.exit(2, f"faircast-fp8-grid: error: {e}\n")
    print(json.dumps(rep, indent=1) if args.json else format_table(rep, args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
