"""FP8 E4M3 served weights: the scale rules (faircast's sticky scales, and the RL stacks' quantizers as
:data:`PRESETS`) and the FP8 export (the casts are in :mod:`.rounding`).

A 2-D linear weight ``[N, K]`` (checkpoint coordinates: the tensor the engine loads) is served as
``weight`` (float8_e4m3fn ``[N, K]``) and fp32 scales, ``served = q * scale``. Faircast's own rule
(:class:`ScaleRule`'s defaults) uses one of the two layouts vLLM loads:

* ``"channel"``: one scale per output row, ``weight_scale`` ``[N, 1]`` (compressed-tensors ``FP8_DYNAMIC``,
  vLLM's ``fp8_per_channel``);
* ``"block"``: one scale per 128x128 block, ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` (the
  DeepSeek-V3 / Qwen3-FP8 checkpoints, vLLM's ``fp8`` with ``weight_block_size [128, 128]``; despite its name
  the scale multiplies).

The stacks' rules (``export_cast.fp8_rule``, :data:`PRESETS`) add tensor scales, other formulas and scales
recomputed at every export, and group a tensor or block scale over vLLM's fused layers (:func:`engine_layer`).
Faircast's scales are **sticky** (as verl's ``fp8_sharded.py``): set from the absolute maximum of what is cast
(the master, or master + residual for error feedback) over the channel or block at the first export, and kept
while everything fits; a scale is set again, from the current absmax, only where some element no longer fits
(``absmax / scale > 448``), and only for its channel or block. So an unchanged master serves unchanged bytes, a
delta stays sparse, and a rescale is a dense update of exactly one channel or block (counted). Optionally scales
are powers of two (UE8M0, as DeepSeek-V3.1's ``scale_fmt: ue8m0``).

Everything is defined on global flat element indices (``g = n * K + k``), so a shard that holds any subset of
the elements (a ZeRO flat partition cutting rows, a TP slice) computes its partial absmax per scale, a MAX
reduction over the ranks completes it, and the bytes and scales equal a single-process export's.

A param **fused** from several checkpoint tensors (Megatron's ``linear_qkv``: q, k and v rows interleaved per
query group; SwiGLU ``linear_fc1``: ``[gate; up]``) has its 128x128 blocks in the checkpoint tensors'
coordinates, not its own (:class:`FusedRows`): it is cast as the **stack** of its checkpoint tensors, each
padded with absent rows to a multiple of 128, so the stack's blocks are the checkpoint tensors' blocks one after
another, and its global indices (the random bits' lanes) are the stack's. Channel scales need no such map (a
row is a row).

transformers 5's **fused MoE experts** (``...mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``...experts.down_proj``
``[E, H, I]``: :func:`fused_experts`) are FP8 too: a 3-D param ``[E, N, K]`` is cast as its 2-D view ``[E*N, K]``, whose
rows are each expert's checkpoint tensors (``experts.e.gate_proj.weight``, ``up_proj``, ``down_proj``) one after the
other, so block scales sit on those tensors through :class:`FusedRows`. It is served under its own name with its
scales shaped ``[E, ., .]`` beside it, as transformers 5 names an FP8 model's experts (``gate_up_proj_scale_inv``
``[E, 2 ceil(I/128), ceil(H/128)]``; channel scales ``gate_up_proj_scale`` ``[E, 2I, 1]``); vLLM's fused-checkpoint
expert map (``routed_experts.py: build_expert_params_mapping``, ``include_fused``) takes these names to
``w13_weight`` / ``w13_weight_scale_inv``.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass

import torch

from faircast_dist import fused
from faircast_dist.rounding import E4M3_MAX

BLOCK = 128
_MIN_SCALE = 2.0 ** -126  # the smallest normal fp32: an all-zero channel's scale (kernels may flush subnormals)


GRANULARITIES = ("tensor", "channel", "block")
FORMULAS = ("tight", "amax/448", "amax/448.0", "448/amax")
CODES = ("divide", "reciprocal")


def _bf16_toward_zero(a: torch.Tensor) -> torch.Tensor:
    """fp32 ``a >= 0`` truncated to bf16 (its low 16 bits cleared): the largest bf16 value <= ``a``."""
    return (a.contiguous().view(torch.int32) & -65536).view(torch.float32)


@dataclass(frozen=True)
class ScaleRule:
    """How an FP8 weight's scales are set and its codes computed: where the scales sit, the scale of a group (a
    tensor, an output channel, a 128x128 block) from its absolute maximum ``a``, what the element is divided by or
    multiplied with, and when a scale is set again. Faircast's own rule is the default; :data:`PRESETS` reproduce
    the RL stacks' quantizers, so the fair methods round under the scales a stack serves, and ``nearest`` under a
    preset serves the stack's bytes.

    Attributes:
        granularity: ``"tensor"`` (one scale, ``weight_scale [1]``), ``"channel"`` (one per output row,
            ``weight_scale [N, 1]``) or ``"block"`` (one per 128x128 block, ``weight_scale_inv [ceil(N/128),
            ceil(K/128)]``).
        ue8m0: scales are powers of two (formula ``"tight"`` only).
        formula: the scale ``s`` from ``a`` (fp32), evaluated as the torch expression the stack writes, so it lowers
            on each device as the stack's does:

            * ``"tight"`` (faircast's): the smallest scale of its kind with ``a / s <= 448`` in fp32, at least
              2**-126 (:meth:`factors`);
            * ``"amax/448"``: ``max(a, amax_floor) / torch.tensor(448.)``, the IEEE division (vLLM's ``_fp8_scale``);
            * ``"amax/448.0"``: ``max(a, amax_floor) / 448.0``, a Python float divisor: the IEEE division on the
              CPU, a multiply by fp32(1/448) on CUDA (torch's lowering; vLLM's ``per_block_cast_to_fp8``);
            * ``"448/amax"`` (verl's): a multiplier ``m = 448.0 / a`` (1 where ``a`` is 0), ``s = reciprocal(m)``,
              codes ``x * m``.

            Then ``s`` is raised to ``scale_floor``; a group whose ``s`` is still below 2**-126 (all zeros, or a
            maximum so small that ``448 / a`` or ``1 / s`` overflows) gets 2**-126 and the multiplier 2**126 (a
            stack's own formula would serve NaN there).
        codes: ``"divide"`` (``q = x / s``, IEEE) or ``"reciprocal"`` (``q = x * (1.0 / s)``); ``"448/amax"``
            multiplies by its ``m``.
        amax_floor: ``a`` is raised to it first (verl's Triton ``eps`` 1e-10, vLLM's block ``clamp(1e-4)``).
        scale_floor: ``s`` is raised to it (vLLM's channel ``clamp_min(1 / (448 * 512))``).
        sticky: a scale is kept while its group fits (``a / s <= 448``) and set again only where it does not
            (faircast's, DeepSeek-style UE8M0); False: recomputed at every export, as the stacks do.
        bf16: the stack quantizes bf16 weights: ``nearest`` rounds ``bf16(master)`` (so it serves the stack's bytes),
            and ``a`` is truncated to bf16 (toward zero) before the formula, so a fair method's largest element codes
            ±448 and a stack recomputing its scale from the bf16 values ``q * s`` finds ``s`` again.
        engine_fused: the groups are those of vLLM's fused layers (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate,
            up): one tensor scale over the parts; blocks of the fused rows (:class:`Fp8Export` refuses parts whose rows
            are not a multiple of 128, where the engine's blocks would straddle two parts).
        name: the preset's name (``"faircast"`` for faircast's own rule).
        source: the function and version it reproduces.
    """
    granularity: str = "channel"
    ue8m0: bool = False
    formula: str = "tight"
    codes: str = "divide"
    amax_floor: float = 0.0
    scale_floor: float = 0.0
    sticky: bool = True
    bf16: bool = False
    engine_fused: bool = False
    name: str = "faircast"
    source: str = "faircast_dist/fp8.py: ScaleRule"

    def __post_init__(self):
        for field, allowed in (("granularity", GRANULARITIES), ("formula", FORMULAS), ("codes", CODES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"ScaleRule.{field} must be one of {allowed}, got {getattr(self, field)!r}")
        if self.ue8m0 and self.formula != "tight":
            raise ValueError(f"ScaleRule: ue8m0 takes formula 'tight', got {self.formula!r}")
        if self.sticky and self.formula == "448/amax":
            raise ValueError("ScaleRule: formula '448/amax' (verl's) is recomputed at every export (sticky False)")

    @property
    def scale_name(self) -> str:
        """The checkpoint name of the scale tensor beside ``weight`` (vLLM's)."""
        return "weight_scale_inv" if self.granularity == "block" else "weight_scale"

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """The scales' shape for a weight of ``shape`` ``[N, K]``: ``(1,)``, ``(N, 1)`` or ``(ceil(N/128), ceil(K/128))``.

        Raises:
            ValueError: ``shape`` is not 2-D.
        """
        if len(shape) != 2:
            raise ValueError(f"FP8 serves 2-D linear weights; got shape {tuple(shape)}")
        n, k = shape
        return {"tensor": (1,), "channel": (n, 1), "block": (-(-n // BLOCK), -(-k // BLOCK))}[self.granularity]

    def segment_columns(self, shape: tuple[int, int]) -> tuple[int, int]:
        """``(K, block columns)`` of a weight's FP8 segment rows (:data:`faircast_dist.fused.FP8_COLUMNS`): a tensor
        scale is a channel scale over one row of ``N * K`` columns."""
        n, k = shape
        return (n * k, 0) if self.granularity == "tensor" else (k, -(-k // BLOCK) if self.granularity == "block" else 0)

    def scale_index(self, shape: tuple[int, int], index: torch.Tensor | int, numel: int | None = None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """The flat scale index of each element.

        Args:
            shape: the weight's full shape ``[N, K]``.
            index: the elements' global flat indices (int64 tensor), or an int start of ``numel`` consecutive ones.
            numel: required with an int ``index``.
            device: of the result, with an int ``index`` (a tensor ``index`` keeps its own).

        Returns:
            int64 tensor shaped like ``index`` (``[numel]`` for an int): indices into ``scales.reshape(-1)``.
        """
        self.scale_shape(shape)
        g = torch.arange(index, index + numel, dtype=torch.int64, device=device) if isinstance(index, int) \
            else index.to(torch.int64)
        row, col = g // shape[1], g % shape[1]
        if self.granularity == "tensor":
            return torch.zeros_like(g)
        if self.granularity == "channel":
            return row
        return (row // BLOCK) * -(-shape[1] // BLOCK) + col // BLOCK

    def factors(self, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fresh scales from the absolute maxima, and the codes' multipliers.

        Args:
            absmax: float32 absolute maxima ``a`` of the groups (finite, >= 0), any shape.

        Returns:
            ``(scales, multipliers)``: float32 shaped like ``absmax``, finite and > 0 (``served = q * scale``), and
            None where codes divide by the scale, else float32 like ``scales`` (codes ``x * multiplier``).
        """
        a = absmax.float()
        if self.bf16:
            a = _bf16_toward_zero(a)
        if self.formula == "448/amax":  # verl's _scaled_fp8_blockwise_pytorch
            m = torch.div(E4M3_MAX, a)
            m = torch.where((a == 0) | (a == float("inf")), torch.ones_like(m), m)
            return self._normal(torch.reciprocal(m), m)
        if self.formula == "tight":
            a = torch.clamp(a, min=E4M3_MAX * _MIN_SCALE)
            if self.ue8m0:  # (at most 2**119: 448 * 2**120 is past fp32 max, a code >= 256 would serve Inf)
                m, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1); 448 = 0.875 * 2**9
                s = torch.ldexp(torch.ones_like(a), torch.clamp(torch.where(m <= 0.875, e - 9, e - 8), max=119))
                s = torch.where(torch.isfinite(a), s, a / E4M3_MAX)  # NaN / Inf stay what they are
            else:
                s = a / E4M3_MAX
                s = torch.where(a / s > E4M3_MAX, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
        else:
            if self.amax_floor:
                a = a.clamp(min=self.amax_floor)
            s = a / torch.tensor(E4M3_MAX, device=a.device) if self.formula == "amax/448" else a / E4M3_MAX
            if self.scale_floor:
                s = s.clamp_min(self.scale_floor)
        return self._normal(s, 1.0 / s if self.codes == "reciprocal" else None)

    @staticmethod
    def _normal(s: torch.Tensor, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(s, m)`` with every scale below 2**-126 (0 for an all-zero group without a floor; subnormal, or 0 from
        an overflowed multiplier, for a group whose maximum is tiny) set to 2**-126, its multiplier to 2**126: a
        stack's own formula would serve NaN there (0 * Inf)."""
        tiny = s < _MIN_SCALE  # (a NaN stays what it is)
        s = torch.where(tiny, torch.full_like(s, _MIN_SCALE), s)
        return s, None if m is None else torch.where(tiny, torch.full_like(m, 1 / _MIN_SCALE), m)

    def scales(self, absmax: torch.Tensor) -> torch.Tensor:
        """Fresh scales (:meth:`factors`' first)."""
        return self.factors(absmax)[0]

    def next_scales(self, previous: torch.Tensor | None, absmax: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This export's scales and multipliers (:meth:`factors`), from the last export's scales.

        Args:
            previous: float32 scales of the last export (any shape), or None at the first export.
            absmax: float32 absmax of what is cast now, shaped like ``previous``.

        Returns:
            ``(scales, multipliers, changed)``: float32 scales, the multipliers (or None), and a bool mask: sticky,
            the scales set again (all of them at the first export); recomputed, the scales whose value changed
            (count either as rescales only after the first export).
        """
        fresh, mult = self.factors(absmax)
        if previous is None:
            return fresh, mult, torch.ones(fresh.shape, dtype=torch.bool, device=fresh.device)
        if not self.sticky:
            return fresh, mult, fresh != previous
        # set again where the maximum no longer fits, and where the kept scale is no scale (NaN, Inf, <= 0: a corrupt
        # checkpoint's), which would otherwise serve NaN for good
        rescaled = ~(absmax / previous <= E4M3_MAX) | ~(previous > 0) | ~torch.isfinite(previous)
        scales = torch.where(rescaled, fresh, previous)
        return scales, (1.0 / scales if mult is not None else None), rescaled

    def element_scales(self, scales: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """Each element's scale: float32 ``shape`` ``[N, K]`` from ``scales`` (:meth:`scale_shape` of ``shape``)."""
        n, k = shape
        return scales.reshape(-1)[self.scale_index((n, k), 0, n * k, device=scales.device)].view(n, k)

    def scaled(self, weight: torch.Tensor, previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What round-to-nearest of a whole weight under this rule rounds: the weight over its scales (times the
        multipliers), saturated at ±448, and the scales (a one-process reference; a shard-aware export is
        :class:`Fp8Export`).

        Args:
            weight: ``[N, K]`` bf16 or fp32 (a :attr:`bf16` rule rounds it to bf16 first, as the stack does); for an
                ``engine_fused`` rule, the engine's fused layer (its parts' rows one after the other).
            previous: None (fresh scales), or float32 :meth:`scale_shape` scales a sticky rule keeps where they fit
                (:meth:`next_scales`).

        Returns:
            ``(y, scales)``: float32 ``[N, K]`` and float32 :meth:`scale_shape`.
        """
        from faircast_dist.rounding import _scaled
        shape = tuple(weight.shape)
        x = weight.float().reshape(-1)
        if self.bf16:  # (a non-finite element as it is, as cast_fp8_nearest(via_bf16=True))
            x = torch.where(torch.isfinite(x), x.bfloat16().float(), x)
        index = self.scale_index(shape, 0, x.numel(), device=x.device)
        absmax = partial_absmax(x, index, math.prod(self.scale_shape(shape))).view(self.scale_shape(shape))
        scales, mult, _ = self.next_scales(None if previous is None else previous.float().view(absmax.shape), absmax)
        y = _scaled(x, scales.reshape(-1)[index], None if mult is None else mult.reshape(-1)[index])
        return y.view(shape), scales

    def quantize(self, weight: torch.Tensor, previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Round-to-nearest of a whole weight under this rule: what the stack serves from it (:meth:`scaled`'s
        arguments).

        Returns:
            ``(codes, scales)``: float8_e4m3fn ``[N, K]`` and float32 :meth:`scale_shape`.
        """
        from faircast_dist.rounding import e4m3_round
        y, scales = self.scaled(weight, previous)
        return e4m3_round(y), scales

    def grid(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The served values ``q * s`` as bf16 (``[N, K]``): what a stack quantizing bf16 weights with this rule gets
        back as ``codes`` and ``scales`` (the grid route), where every group holds a code of ±448, ``s`` is what the
        rule computes from ``bf16(448 s)`` and ``s`` is above the rule's floors (:meth:`quantize` checks it).

        Args:
            codes: float8_e4m3fn ``[N, K]``.
            scales: float32 :meth:`scale_shape` of ``codes.shape``.
        """
        return (codes.float() * self.element_scales(scales.float(), tuple(codes.shape))).bfloat16()


#: the stacks' quantizers as scale rules (``export_cast.fp8_rule``), each citing what it reproduces; ``nearest``
#: under one serves, byte for byte, what the stack serves from the same bf16 weights (tests/test_scale_rules.py)
PRESETS = {r.name: r for r in (
    ScaleRule("block", formula="448/amax", sticky=False, bf16=True, name="verl",
              source="verl 0.9.1 verl/utils/kernel/fp8_kernel.py: _scaled_fp8_blockwise_pytorch (its PyTorch path, "
                     "VERL_DISABLE_TRITON_FP8=1), behind scaled_fp8_blockwise"),
    ScaleRule("block", formula="amax/448", codes="reciprocal", amax_floor=1e-10, sticky=False, bf16=True,
              name="verl-triton", source="verl 0.9.1 verl/utils/kernel/fp8_kernel.py: _blockwise_cast_to_fp8_kernel "
                                         "(Triton; a cited copy, not run here: no GPU)"),
    ScaleRule("channel", formula="amax/448", sticky=False, bf16=True, name="vllm-fp8-per-channel",
              scale_floor=float(torch.tensor(1.0, device="cpu") / (torch.tensor(E4M3_MAX, device="cpu") * 512)),
              source="vLLM 0.32 model_executor/layers/quantization/online/fp8.py: Fp8PtpcOnlineLinearMethod."
                     "process_weights_after_loading (_fp8_channel_scale, _fp8_quant_per_channel)"),
    ScaleRule("block", formula="amax/448.0", codes="reciprocal", amax_floor=1e-4, sticky=False, bf16=True,
              engine_fused=True, name="vllm-fp8-per-block",
              source="vLLM 0.32 vllm/utils/deep_gemm.py: per_block_cast_to_fp8 (use_ue8m0=False), called by online/"
                     "fp8.py: Fp8PerBlockOnlineLinearMethod on the fused layer"),
    ScaleRule("tensor", formula="amax/448", codes="reciprocal", sticky=False, bf16=True, engine_fused=True,
              name="vllm-fp8-per-tensor",
              source="vLLM 0.32 online/fp8.py: Fp8PerTensorOnlineLinearMethod.process_weights_after_loading "
                     "(_fp8_scale, then ops.scaled_fp8_quant's static kernel, which multiplies by the reciprocal: "
                     "a cited copy, the kernel does not run on this CPU wheel)"),
    ScaleRule("block", ue8m0=True, sticky=True, bf16=True, name="deepseek-ue8m0",
              source="DeepSeek-V3.1 scale_fmt ue8m0; verl PR #7676 (open) verl/utils/fp8_sharded.py: "
                     "sticky_ue8m0_descale"),
)}


def partial_absmax(y: torch.Tensor, scale_index: torch.Tensor, num_scales: int) -> torch.Tensor:
    """Per scale, the largest finite ``|y|`` among this shard's elements (0 where it holds none).

    Args:
        y: float32 shard (what is cast, in the master's units), any shape.
        scale_index: int64 tensor shaped like ``y`` (:meth:`ScaleRule.scale_index`).
        num_scales: the number of scales of the whole weight.

    Returns:
        float32 ``[num_scales]``: MAX-reduce it over the ranks that share a weight to get the weight's absmax.
    """
    a = torch.where(torch.isfinite(y), y.abs(), torch.zeros((), dtype=y.dtype, device=y.device)).reshape(-1).float()
    out = torch.zeros(num_scales, dtype=torch.float32, device=y.device)
    return out.scatter_reduce_(0, scale_index.reshape(-1), a, reduce="amax")


@dataclass(frozen=True)
class FusedRows:
    """Where the rows of a param fused from checkpoint tensors sit in those tensors.

    Args:
        pieces: ``(part, part_row, rows)`` in the fused param's row order: its next ``rows`` rows are rows
            ``[part_row, part_row + rows)`` of checkpoint tensor ``part`` (0, 1, ...). Megatron's ``linear_qkv``
            with G query groups of q heads of size d: ``(0, g q d, q d), (1, g d, d), (2, g d, d)`` for each g.

    Raises:
        ValueError: the pieces do not tile each part's rows ``[0, N_part)`` exactly once, or a part is missing.
    """
    pieces: tuple

    def __post_init__(self):
        pieces = tuple((int(p), int(r), int(n)) for p, r, n in self.pieces)
        object.__setattr__(self, "pieces", pieces)
        parts = max((p for p, _, _ in pieces), default=-1) + 1
        for part in range(parts):
            spans = sorted((r, n) for p, r, n in pieces if p == part)
            if not spans or any(n <= 0 for _, n in spans) or spans[0][0] != 0 or any(
                    a + n != b for (a, n), (b, _) in zip(spans, spans[1:])):
                raise ValueError(f"FusedRows: the pieces of part {part} do not tile its rows once: {spans}")

    @functools.cached_property
    def part_rows(self) -> list[int]:
        """``N_part`` of each checkpoint tensor."""
        rows = {}
        for p, r, n in self.pieces:
            rows[p] = max(rows.get(p, 0), r + n)
        return [rows[p] for p in range(len(rows))]

    @property
    def rows(self) -> int:
        """Rows of the fused param (``N``)."""
        return sum(n for _, _, n in self.pieces)

    def stack_rows(self) -> int:
        """Rows of the stack the FP8 copy is cast as: each part's rows rounded up to a multiple of 128."""
        return sum(-(-n // BLOCK) * BLOCK for n in self.part_rows)

    @functools.cached_property
    def chunks(self) -> list[tuple[int, int, int]]:
        """``(fused_row, stack_row, rows)`` runs of rows that stay consecutive in both, in fused row order."""
        base = list(itertools.accumulate([0, *(-(-n // BLOCK) * BLOCK for n in self.part_rows)]))
        out, fused = [], 0
        for p, r, n in self.pieces:
            if out and out[-1][1] + out[-1][2] == base[p] + r:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((fused, base[p] + r, n))
            fused += n
        return out

    def stack_row_of(self) -> torch.Tensor:
        """int64 ``[N]``: the stack row of each fused row."""
        return torch.cat([torch.arange(s, s + n, dtype=torch.int64, device="cpu") for _, s, n in self.chunks])

    def stack_runs(self, k: int, start: int, numel: int, index: int) -> list[tuple[int, int, int]]:
        """A run of the fused param (``numel`` buffer elements from ``start``, global indices from ``index``, ``k``
        columns) as ``(start, numel, stack index)`` runs of consecutive stack indices."""
        out = []
        for fused, stack, rows in self.chunks:
            lo, hi = max(index, fused * k), min(index + numel, (fused + rows) * k)
            if lo < hi:
                out.append((start + lo - index, hi - lo, lo + (stack - fused) * k))
        return out


def experts_rows(shape, parts: int) -> FusedRows:
    """The :class:`FusedRows` of a fused experts param of ``shape`` ``[E, N, K]`` whose rows are, per expert,
    ``parts`` checkpoint tensors of ``N / parts`` rows each (2: ``gate_up_proj``'s gate rows, then its up rows; 1:
    ``down_proj``, ``up_proj``), in expert order (parts ``e * parts + j``).

    Raises:
        ValueError: ``shape`` is not 3-D, or ``N`` is not a multiple of ``parts``.
    """
    if len(shape) != 3 or shape[1] % parts:
        raise ValueError(f"fused experts: shape {tuple(shape)} is not [E, N, K] with N a multiple of {parts}")
    rows = shape[1] // parts
    return FusedRows(tuple((e * parts + j, 0, rows) for e in range(shape[0]) for j in range(parts)))


def fused_experts(model: torch.nn.Module, shapes: dict, rename=None) -> dict[str, FusedRows]:
    """transformers 5's fused MoE experts among ``model``'s params: ``{param name: FusedRows}`` (:func:`experts_rows`),
    for :class:`Fp8Export`'s ``fused``.

    An experts module counts when transformers says how it holds its weights (``integrations/moe.py:
    use_experts_implementation`` sets ``is_transposed``, ``is_concatenated``, ``has_gate``) and they are held as the
    checkpoint's experts stacked: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows; or ``up_proj``
    ``[E, I, H]`` without a gate) and ``down_proj`` ``[E, H, I]``. Transposed experts (GPT-OSS's ``[E, H, 2I]``) and
    interleaved gate/up rows are not, and stay bf16.

    Args:
        model: the root module.
        shapes: ``{name: full shape}`` of the params (a partitioned param's full shape), by the adapter's names.
        rename: the adapter's name of a ``model.named_parameters()`` name (default: the same).
    """
    out = {}
    for prefix, mod in model.named_modules():
        if getattr(mod, "is_transposed", True) is not False or getattr(mod, "is_concatenated", False) is not True:
            continue
        gated = bool(getattr(mod, "has_gate", True))
        for leaf, parts in (("gate_up_proj", 2) if gated else ("up_proj", 1), ("down_proj", 1)):
            name = f"{prefix}.{leaf}" if prefix else leaf
            name = rename(name) if rename else name
            if name in shapes and len(shapes[name]) == 3 and shapes[name][1] % parts == 0:
                out[name] = experts_rows(shapes[name], parts)
    return out


def element_scales(scales: torch.Tensor, scale_index: torch.Tensor) -> torch.Tensor:
    """Each element's scale (float32, shaped like ``scale_index``): what the FP8 casts of :mod:`.rounding`
    take."""
    return scales.reshape(-1)[scale_index]


def fp8_param(config, name: str, shape) -> bool:
    """A param served as FP8 under ``config`` (an :class:`~faircast_dist.ExportCastConfig` with ``format "fp8"``):
    a 2-D ``*weight`` that :func:`fp8_excluded` does not keep bf16 (the 2-D linear weights of attention and MLP;
    embeddings, the LM head, norms and routers stay bf16 by default). Fused experts: :class:`Fp8Export`'s ``fused``."""
    return config.fp8 and len(shape) == 2 and name.endswith("weight") and not fp8_excluded(config, name)


def fp8_excluded(config, name: str) -> bool:
    """``config.fp8_exclude`` (a regex, searched) matches param ``name``: it stays bf16."""
    return bool(config.fp8_exclude and re.search(config.fp8_exclude, name))


#: vLLM's fused layers (its Llama / Qwen / Mistral ``packed_modules_mapping``): HF's q/k/v and gate/up projections
_ENGINE_PARTS = re.compile(r"^(.*\.)(q|k|v|gate|up)_proj\.weight$")


def engine_layer(name: str) -> str:
    """The vLLM layer that serves param ``name``: ``...self_attn.qkv_proj`` for HF's ``q_proj``, ``k_proj``,
    ``v_proj`` weights, ``...mlp.gate_up_proj`` for ``gate_proj`` / ``up_proj``; else ``name`` itself (Megatron's
    ``linear_qkv`` / ``linear_fc1`` are fused already)."""
    m = _ENGINE_PARTS.match(name)
    return name if m is None else m.group(1) + ("qkv_proj" if m.group(2) in "qkv" else "gate_up_proj")


def engine_part(name: str) -> int:
    """A part's place in its vLLM fused layer (q, k, v; gate, up)."""
    m = _ENGINE_PARTS.match(name)
    return 0 if m is None else ("q", "k", "v", "gate", "up").index(m.group(2)) % 3


class Fp8Export:
    """One rank's FP8 served weights: the sticky scales, the cast of each shard's FP8 runs at an export, and the
    gather of whole FP8 tensors to serve. Used by :class:`faircast_dist.export.ExportState` (``format "fp8"``).

    The FP8 copy is separate from the model's bf16 params: it is cast from the fp32 masters with its own state
    (the scales; error feedback: an fp32 residual per element in the master's units), so training computes with
    bf16 as before and only the served copy is FP8.

    Args:
        caster: the :class:`~faircast_dist.FairCaster` (config with ``format "fp8"``; method, seed, keys).
        shapes: ``{param name: full shape}`` of every param of the model, the same on every rank that calls
            :meth:`export` together (the FP8 ones are picked by :func:`fp8_param`).
        fused: ``{param name: FusedRows}`` of params fused from checkpoint tensors; with ``fp8_scales "block"``
            each is cast as the stack of its checkpoint tensors (see the module docstring), and served in its own
            row order with the stack's scales. A 3-D param here (fused experts, :func:`fused_experts`) is FP8 unless
            :func:`fp8_excluded`, with either scales.

    Raises:
        ValueError: a fused param whose rows do not match its checkpoint tensors; under an ``engine_fused`` rule
            (:class:`ScaleRule`), fused experts, a part of a vLLM fused layer kept bf16 while another is FP8, or a
            block rule whose engine blocks would straddle two fused parts (named).

    Attributes:
        rule: the :class:`ScaleRule` (``config.scale_rule``: ``fp8_rule``, or ``fp8_scales`` / ``fp8_ue8m0``).
        groups: ``{name: group}`` of the params whose scales are one (an ``engine_fused`` tensor rule: vLLM's
            ``qkv_proj`` over q, k, v), by :func:`engine_layer`; a param absent has its own.
        slots: ``{name: (offset, numel)}`` of each FP8 param's scales in :meth:`flat_scales` and in the absmax
            buffer, in :attr:`shapes` order; the params of one group share theirs.
        members: ``{first param of a slot: the params sharing it}``, in slot order.
        shapes: ``{name: (N, K)}`` of the FP8 params as cast, in sorted name order (the order of every
            collective); a fused param's ``N`` is its stack's (:meth:`FusedRows.stack_rows`); fused experts
            ``[E, N, K]`` are cast as ``[E*N, K]``.
        experts: ``{name: (E, N, K)}`` of the FP8 fused experts (served 3-D).
        fused: the ``fused`` params this rule casts as stacks (block scales), ``{name: FusedRows}``.
        scales: ``{name: float32 tensor of rule.scale_shape}``: the scales of the last export, the same on every
            rank (export state: checkpoint it, :meth:`load_scales`).
        rescales: scales set again after their first export, counted over all exports of this process (a rescaled
            channel or block is a dense update of its elements).
        last_rescales: the same, at the last export.
    """

    def __init__(self, caster, shapes: dict, fused: dict | None = None):
        self.caster = caster
        config = caster.config
        self.rule = config.scale_rule
        fused = fused or {}
        self.experts = {n: tuple(shapes[n]) for n in sorted(shapes) if len(shapes[n]) == 3 and n in fused
                        and config.fp8 and not fp8_excluded(config, n)}
        self.shapes = {n: (self.experts[n][0] * self.experts[n][1], self.experts[n][2]) if n in self.experts
                       else tuple(shapes[n]) for n in sorted(shapes)
                       if n in self.experts or fp8_param(config, n, tuple(shapes[n]))}
        self.fused = {n: f for n, f in fused.items() if n in self.shapes} if self.rule.granularity == "block" else {}
        for name, f in self.fused.items():
            if f.rows != self.shapes[name][0]:
                raise ValueError(f"export_cast FP8: {name!r} has {self.shapes[name][0]} rows, its fused checkpoint "
                                 f"tensors {f.part_rows} ({f.rows})")
        self.groups = self._engine_groups(shapes) if self.rule.engine_fused else {}
        for name, f in self.fused.items():
            self.shapes[name] = (f.stack_rows(), self.shapes[name][1])
        self.slots, self.members = self._slot_table()
        self.scales: dict[str, torch.Tensor] = {}
        self.rescales = self.last_rescales = 0

    def _engine_groups(self, shapes: dict) -> dict[str, str]:
        """:attr:`groups` of an ``engine_fused`` rule (and its checks, see Raises); ``shapes``: every param's."""
        rule = self.rule
        kept = sorted(n for n in shapes if engine_layer(n) != n and n not in self.shapes
                      and engine_layer(n) in {engine_layer(f) for f in self.shapes})
        if kept:
            raise ValueError(f"export_cast FP8: fp8_rule {rule.name!r} quantizes vLLM's fused layer "
                             f"{engine_layer(kept[0])!r} whole, but {kept[0]!r} is kept bf16 (fp8_exclude): exclude "
                             f"all of its parts, or none")
        if self.experts:
            raise ValueError(f"export_cast FP8: fp8_rule {rule.name!r} does not cover fused MoE experts "
                             f"{sorted(self.experts)[:2]} (vLLM's online FP8 MoE is not reproduced here): keep them "
                             f"bf16 with fp8_exclude (the default + '|experts')")
        members = {}
        for name in self.shapes:
            members.setdefault(engine_layer(name), []).append(name)
        if rule.granularity == "tensor":
            return {n: layer for layer, names in members.items() for n in names}
        for layer, names in members.items():  # blocks: the engine's fused rows [part 0; part 1; ...] unpadded
            rows = [(n, self.shapes[n][0]) for n in sorted(names, key=engine_part)]
            if len(names) == 1 and names[0] in self.fused:
                rows = [(names[0], r) for r in self.fused[names[0]].part_rows]
            straddle = [n for n, r in rows[:-1] if r % BLOCK]
            if straddle:
                raise ValueError(f"export_cast FP8: fp8_rule {rule.name!r}: the engine's 128x128 blocks of {layer!r} "
                                 f"straddle its fused parts ({[r for _, r in rows]} rows: every part but the last must "
                                 f"be a multiple of 128); keep {straddle[0]!r} bf16 with fp8_exclude, or use a "
                                 f"per-channel rule")
        return {}

    def scale_name(self, name: str) -> str:
        """The checkpoint name of FP8 param ``name``'s scales (``...proj.weight`` -> ``...proj.weight_scale``; fused
        experts: ``...experts.gate_up_proj`` -> ``...experts.gate_up_proj_scale``, transformers 5's)."""
        if name.endswith("weight"):
            return name[:-len("weight")] + self.rule.scale_name
        return name + self.rule.scale_name[len("weight"):]

    def _slot_table(self) -> tuple[dict[str, tuple[int, int]], dict[str, list[str]]]:
        """:attr:`slots` and :attr:`members` (fixed once the FP8 params and their groups are known)."""
        slots, members, leader, offset = {}, {}, {}, 0
        for name, shape in self.shapes.items():
            first = leader.setdefault(self.groups.get(name, name), name)
            if first == name:
                slots[name], members[name] = (offset, math.prod(self.rule.scale_shape(shape))), []
                offset += slots[name][1]
            slots[name] = slots[first]
            members[first].append(name)
        return slots, members

    def scale_offsets(self) -> dict[str, int]:
        """``{name: offset}`` of each FP8 param's scales in :meth:`flat_scales` (and in the absmax buffer)."""
        return {name: offset for name, (offset, _) in self.slots.items()}

    def flat_scales(self, device=None) -> torch.Tensor:
        """Every slot's scales (:attr:`slots`), one after the other: float32 1-D on ``device``."""
        if not self.scales:
            return torch.zeros(0, dtype=torch.float32, device=device)
        return torch.cat([self.scales[n].reshape(-1) for n in self.members]).to(device)

    def runs(self, runs) -> list[tuple[str, int, int, int]]:
        """The FP8 params' runs among a shard's ``runs`` (``(name, start, numel, index)``), with global indices as
        cast: a fused param's (block scales) in its stack's."""
        out = []
        for name, start, numel, index in runs:
            if name in self.fused:
                k = self.shapes[name][1]
                out += [(name, *run) for run in self.fused[name].stack_runs(k, start, numel, index)]
            elif name in self.shapes:
                out.append((name, start, numel, index))
        return out

    def _runs(self, shards):
        """``(shard, start, numel, index, name)`` of every FP8 run in ``shards`` (:meth:`runs`)."""
        return [(s, start, numel, index, name) for s in shards for name, start, numel, index in self.runs(s.runs)]

    @torch.no_grad()
    def export(self, shards, reduce_max, step: int | None = None, backend: str = "auto") -> None:
        """Cast the FP8 runs of ``shards`` into their ``fp8`` buffers at export ``step`` (default: the current one).

        Args:
            shards: the rank's :class:`~faircast_dist.export.Shard` s, each with ``fp8`` (uint8 1-D like ``master``,
                holding E4M3 bits) and, for error feedback, ``fp8_residual`` (float32 1-D like ``master``).
            reduce_max: ``reduce_max(t)`` MAX-all-reduces a float32 1-D tensor in place over the ranks that share
                the model's params (every one calls it, with or without FP8 runs: a collective; None: one process).
            step: the export step keying stochastic rounding's bits.
            backend: the fused casts' backend (:func:`faircast_dist.fused.resolve_backend`; all give the same bits).

        The partial absmax of every FP8 param (one value per scale) goes into one buffer, reduced once; each rank
        then keeps the same scales (:meth:`ScaleRule.next_scales`) and casts its elements with them: two fused calls
        over every run (:func:`faircast_dist.fused.fp8_absmax`, :func:`faircast_dist.fused.cast_fp8`).
        """
        config, method, rule, slots = self.caster.config, self.caster.method, self.rule, self.slots
        held = [s for s in shards if any(name in self.shapes for name, *_ in s.runs)]
        device = held[0].master.device if held else shards[0].master.device if shards else torch.device("cpu")
        rows = []
        for t, s in enumerate(held):
            for name, start, numel, index in self.runs(s.runs):
                key = self.caster.key(name, step) if method.keyed else (0, 0)
                rows.append((t, start, numel, index, *key, slots[name][0], *rule.segment_columns(self.shapes[name])))
        table = fused.segment_table(rows, columns=fused.FP8_COLUMNS)
        masters = [s.master for s in held]
        residuals = [s.fp8_residual for s in held] if method.needs_residual else None
        via_bf16 = config.fp8_round_bf16
        absmax = torch.zeros(sum(slots[n][1] for n in self.members), dtype=torch.float32, device=device)
        fused.fp8_absmax(masters, table, absmax, residuals, via_bf16=via_bf16, backend=backend)
        if reduce_max is not None:
            reduce_max(absmax)
        self.last_rescales, multipliers = 0, []
        for name, members in self.members.items():
            (offset, numel), shape = slots[name], self.rule.scale_shape(self.shapes[name])
            previous = self.scales.get(name)
            scales, mult, changed = rule.next_scales(previous, absmax.narrow(0, offset, numel).view(shape))
            for member in members:
                self.scales[member] = scales
            multipliers.append(mult)
            if previous is not None:
                self.last_rescales += int(changed.sum())
        self.rescales += self.last_rescales
        scales = self.flat_scales(device) if self.shapes else absmax
        mult = torch.cat([m.reshape(-1) for m in multipliers]) if multipliers and multipliers[0] is not None else None
        fused.cast_fp8(method.kernel, masters, [s.fp8 for s in held], table, scales, residuals, via_bf16=via_bf16,
                       backend=backend, multipliers=mult)

    @torch.no_grad()
    def grid_into(self, shards) -> None:
        """Write the served FP8 values ``bf16(q * s)`` of the last export into the ``out`` (bf16) of ``shards``' FP8
        runs (``fp8_grid``; :meth:`ScaleRule.grid`), element by element: exact where a shard cuts a row or block.

        Args:
            shards: as for :meth:`export`, after it.
        """
        flat, offsets = None, self.scale_offsets()
        for s, start, numel, index, name in self._runs(shards):
            flat = self.flat_scales(s.master.device) if flat is None else flat
            g = torch.arange(index, index + numel, dtype=torch.int64, device=s.master.device)
            scale = flat[offsets[name] + self.rule.scale_index(self.shapes[name], g)]
            q = s.fp8.narrow(0, start, numel).view(torch.float8_e4m3fn).float()
            s.out.narrow(0, start, numel).copy_((q * scale).to(torch.bfloat16))

    @torch.no_grad()
    def full(self, shards, reduce_max) -> dict[str, torch.Tensor]:
        """The whole FP8 params: ``{name: float8_e4m3fn [N, K]}`` on the CPU, bit for bit what the ranks cast (a
        fused param in its own row order; fused experts ``[E, N, K]``).

        Args:
            shards: as for :meth:`export`.
            reduce_max: ``reduce_max(t)`` MAX-all-reduces a uint8 1-D tensor in place over the ranks (every one
                calls it); None: one process (or every rank holds every element). An element's holders (replicas
                included) have the same bits and the others 0, so the maximum is its bits.
        """
        numels = {n: math.prod(shape) for n, shape in self.shapes.items()}
        offsets = dict(zip(numels, itertools.accumulate([0, *numels.values()])))
        flat = torch.zeros(sum(numels.values()), dtype=torch.uint8, device="cpu")
        for s, start, numel, index, name in self._runs(shards):
            flat.narrow(0, offsets[name] + index, numel).copy_(s.fp8.narrow(0, start, numel))
        if reduce_max is not None:
            reduce_max(flat)
        full = {n: flat.narrow(0, offsets[n], numels[n]).view(torch.float8_e4m3fn).view(shape)
                for n, shape in self.shapes.items()}
        for name, f in self.fused.items():  # (uint8: indexing float8 is not implemented on every device)
            full[name] = full[name].view(torch.uint8)[f.stack_row_of()].view(torch.float8_e4m3fn)
        for name, shape in self.experts.items():
            full[name] = full[name].view(shape)
        return full

    def grid(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The served FP8 values ``bf16(q * s)`` of :meth:`full`'s params, shaped and ordered as served (a fused
        param in its own row order, each element with its stack's scale): what a stack quantizing bf16 weights with
        :attr:`rule` turns back into these codes and scales (:meth:`ScaleRule.grid`, the grid route).

        Raises:
            ValueError: :attr:`rule` keeps sticky scales (a group whose largest code fell below 448 would be
                rescaled by a stack recomputing it).
        """
        if self.rule.sticky:
            raise ValueError(f"export_cast FP8: the grid route needs an fp8_rule whose scales are recomputed at every "
                             f"export; this one ({self.rule.name!r}) keeps sticky scales")
        out = {}
        for name, q in full.items():
            shape = self.shapes[name]  # as cast: a fused param's stack, experts [E*N, K]
            scale = self.rule.element_scales(self.scales[name].cpu(), shape)
            if name in self.fused:
                scale = scale[self.fused[name].stack_row_of()]
            out[name] = (q.float().reshape(scale.shape) * scale).to(torch.bfloat16).view(q.shape)
        return out

    def served(self, weights, full: dict[str, torch.Tensor], grid: bool = False):
        """``weights`` (``(name, bf16 tensor)`` pairs, an adapter's bf16 served weights; the tensor may be a
        callable returning it, called only for bf16 params) with each FP8 param replaced by
        ``(name, float8_e4m3fn [N, K])`` and ``(scale name, float32 scales)`` (:meth:`scale_name`): the tensors
        of a compressed-tensors / DeepSeek FP8 checkpoint. A fused param (block scales) is served in its own row
        order with its stack's scales, ``[sum over parts of ceil(N_part / 128), ceil(K / 128)]``: each checkpoint
        tensor's ``weight_scale_inv``, one after the other. Fused experts ``[E, N, K]`` are served 3-D, their scales
        ``[E, ., .]`` (``[E, N, 1]``; blocks: each expert's checkpoint tensors' ``weight_scale_inv`` in turn).

        ``grid``: each FP8 param as ``(name, bf16 [N, K])`` of its served values instead (:meth:`grid`), for an
        engine or stack that quantizes bf16 weights itself (vLLM's online quantization)."""
        values = self.grid(full) if grid else None
        for name, weight in weights:
            if name in full and grid:
                yield name, values[name]
            elif name in full:
                yield name, full[name]
                scales = self.scales[name].cpu()
                yield self.scale_name(name), scales.view(self.experts[name][0], -1, scales.shape[1]) \
                    if name in self.experts else scales
            else:
                yield name, weight() if callable(weight) else weight

    def load_scales(self, scales: dict[str, torch.Tensor]) -> None:
        """Adopt checkpointed scales (``{name: float32 tensor}``, what :attr:`scales` held).

        Raises:
            ValueError: a scale tensor of the wrong shape for its param's layout (named), missing scales for some
                FP8 params (another ``fp8_exclude`` or model: named), or scales that are not powers of two under
                ``fp8_ue8m0`` (the bits were cast with them; sticky, they would stay).
        """
        missing = sorted(set(self.shapes) - set(scales))
        if missing:
            raise ValueError(f"export_cast FP8: the checkpoint has no scales for {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''} (saved with another fp8_exclude or model, or before "
                             f"these params were FP8: transformers 5's fused experts are since faircast's 2026-12-05 "
                             f"version; to resume such a checkpoint, add an fp8_exclude pattern that keeps them bf16, "
                             f"e.g. the default + '|experts')")
        loaded = {}
        for name in self.shapes:
            if name in scales:
                want = self.rule.scale_shape(self.shapes[name])
                if tuple(scales[name].shape) != want:
                    raise ValueError(f"export_cast FP8: saved scales of {name!r} have shape {tuple(scales[name].shape)}, "
                                     f"{self.rule.granularity!r} scales need {want}")
                loaded[name] = scales[name].float().clone()
                if self.rule.ue8m0:
                    t = loaded[name]
                    mantissa, _ = torch.frexp(t)
                    if bool((torch.isfinite(t) & (t > 0) & (mantissa != 0.5)).any()):
                        raise ValueError(f"export_cast FP8: the checkpoint's scales of {name!r} are not powers of two "
                                         "but fp8_ue8m0 is set: load it with the fp8_ue8m0 it was saved with")
        self.scales = loaded
