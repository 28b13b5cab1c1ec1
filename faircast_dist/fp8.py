"""FP8 E4M3 served weights: the scale layouts and the sticky scales (the casts are in :mod:`.rounding`).

A 2-D linear weight ``[N, K]`` (checkpoint coordinates: the tensor the engine loads) is served as
``weight`` (float8_e4m3fn ``[N, K]``) and fp32 scales, ``served = q * scale``, in one of the two layouts vLLM
loads:

* ``"channel"``: one scale per output row, ``weight_scale`` ``[N, 1]`` (compressed-tensors ``FP8_DYNAMIC``,
  vLLM's ``fp8_per_channel``);
* ``"block"``: one scale per 128x128 block, ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` (the
  DeepSeek-V3 / Qwen3-FP8 checkpoints, vLLM's ``fp8`` with ``weight_block_size [128, 128]``; despite its name
  the scale multiplies).

Scales are **sticky** (as verl's ``fp8_sharded.py``): set from the absolute maximum of what is cast (the
master, or master + residual for error feedback) over the channel or block at the first export, and kept
while everything fits; a scale is set again, from the current absmax, only where some element no longer fits
(``absmax / scale > 448``), and only for its channel or block. So an unchanged master serves unchanged bytes,
a delta stays sparse, and a rescale is a dense update of exactly one channel or block (counted). Optionally
scales are powers of two (UE8M0, as DeepSeek-V3.1's ``scale_fmt: ue8m0``).

Everything is defined on global flat element indices (``g = n * K + k``), so a shard that holds any subset of
the elements (a ZeRO flat partition cutting rows, a TP slice) computes its partial absmax per scale, a MAX
reduction over the ranks completes it, and the bytes and scales equal a single-process export's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from faircast_dist.rounding import E4M3_MAX

BLOCK = 128
_MIN_SCALE = 2.0 ** -126  # the smallest normal fp32: an all-zero channel's scale (kernels may flush subnormals)


@dataclass(frozen=True)
class Fp8Layout:
    """Where an FP8 weight's scales sit.

    Attributes:
        granularity: ``"channel"`` (one scale per output row) or ``"block"`` (one per 128x128 block).
        ue8m0: scales are powers of two.
    """
    granularity: str = "channel"
    ue8m0: bool = False

    def __post_init__(self):
        if self.granularity not in ("channel", "block"):
            raise ValueError(f"Fp8Layout.granularity must be 'channel' or 'block', got {self.granularity!r}")

    @property
    def scale_name(self) -> str:
        """The checkpoint name of the scale tensor beside ``weight`` (vLLM's)."""
        return "weight_scale" if self.granularity == "channel" else "weight_scale_inv"

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The scales' shape for a weight of ``shape`` ``[N, K]``.

        Raises:
            ValueError: ``shape`` is not 2-D.
        """
        if len(shape) != 2:
            raise ValueError(f"FP8 serves 2-D linear weights; got shape {tuple(shape)}")
        n, k = shape
        return (n, 1) if self.granularity == "channel" else (-(-n // BLOCK), -(-k // BLOCK))

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
        if self.granularity == "channel":
            return row
        return (row // BLOCK) * -(-shape[1] // BLOCK) + col // BLOCK

    def scales(self, absmax: torch.Tensor) -> torch.Tensor:
        """Fresh scales from the absolute maxima (fp32, any shape): the smallest scale (of its kind) with
        ``absmax / scale <= 448`` in fp32, at least 2**-126.

        Plain: ``absmax / 448``, one fp32 ulp larger where the division's rounding would leave the maximum at
        ``448 + ulp``. UE8M0: ``2**p``, the smallest with ``448 * 2**p >= absmax`` (exact, from the exponent).
        """
        a = torch.clamp(absmax.float(), min=E4M3_MAX * _MIN_SCALE)
        if self.ue8m0:
            m, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1); 448 = 0.875 * 2**9
            s = torch.ldexp(torch.ones_like(a), torch.where(m <= 0.875, e - 9, e - 8))
            return torch.where(torch.isfinite(a), s, a / E4M3_MAX)  # NaN / Inf stay what they are
        s = a / E4M3_MAX
        return torch.where(a / s > E4M3_MAX, torch.nextafter(s, torch.full_like(s, float("inf"))), s)


def partial_absmax(y: torch.Tensor, scale_index: torch.Tensor, num_scales: int) -> torch.Tensor:
    """Per scale, the largest finite ``|y|`` among this shard's elements (0 where it holds none).

    Args:
        y: float32 shard (what is cast, in the master's units), any shape.
        scale_index: int64 tensor shaped like ``y`` (:meth:`Fp8Layout.scale_index`).
        num_scales: the number of scales of the whole weight.

    Returns:
        float32 ``[num_scales]``: MAX-reduce it over the ranks that share a weight to get the weight's absmax.
    """
    a = torch.where(torch.isfinite(y), y.abs(), torch.zeros((), dtype=y.dtype, device=y.device)).reshape(-1).float()
    out = torch.zeros(num_scales, dtype=torch.float32, device=y.device)
    return out.scatter_reduce_(0, scale_index.reshape(-1), a, reduce="amax")


def sticky_scales(layout: Fp8Layout, previous: torch.Tensor | None,
                  absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This export's scales: the previous ones where everything still fits, fresh ones elsewhere.

    Args:
        layout: the scales' layout.
        previous: float32 scales of the last export (any shape), or None at the first export.
        absmax: float32 absmax of what is cast now, shaped like ``previous``.

    Returns:
        ``(scales, rescaled)``: float32 scales and a bool mask of the scales set again (all of them at the first
        export; count them as rescales only after it).
    """
    fresh = layout.scales(absmax)
    if previous is None:
        return fresh, torch.ones(fresh.shape, dtype=torch.bool, device=fresh.device)
    # set again where the maximum no longer fits, and where the kept scale is no scale (NaN, Inf, <= 0: a corrupt
    # checkpoint's), which would otherwise serve NaN for good
    rescaled = ~(absmax / previous <= E4M3_MAX) | ~(previous > 0) | ~torch.isfinite(previous)
    return torch.where(rescaled, fresh, previous), rescaled


def element_scales(scales: torch.Tensor, scale_index: torch.Tensor) -> torch.Tensor:
    """Each element's scale (float32, shaped like ``scale_index``): what the FP8 casts of :mod:`.rounding`
    take."""
    return scales.reshape(-1)[scale_index]
