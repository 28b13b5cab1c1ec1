"""The fp32 -> bf16 casts (and, at the end, fp32 -> FP8 E4M3) in plain torch, each on one shard with one call:
the executable spec.

The fast casts of the same names (:func:`faircast_dist.cast_stochastic`,
:func:`faircast_dist.cast_error_feedback`, in :mod:`faircast_dist.fused`) give these bits (NaN
payloads aside) and are what the integrations and ``FairCaster`` call; these stay the definition,
importable as ``faircast_dist.rounding``, and what the kernels are tested against.

Bit layout. bf16 is the high half of fp32::

    fp32  [ s | e7 .. e0 | m22 .. m16 | m15 .. m0 ]
           \\________ bf16 (16 bits) ______/  \\ dropped /

For a finite x, the 31-bit magnitude pattern ``|x|`` (bits & 0x7fffffff) is monotone in |x| and
evenly spaced between consecutive bf16 values (also across the subnormal/normal boundary and at
powers of two, where the carry runs into the exponent). So with ``low = bits & 0xffff``:

* round toward zero  = clear the low 16 bits;
* stochastic rounding = add ``r`` uniform in [0, 2**16) to the magnitude, then clear the low 16
  bits: the magnitude rounds away from zero exactly when ``low + r >= 2**16``, i.e. with
  probability ``low / 2**16`` — the fractional distance to the lower (in magnitude) neighbour.
  Hence E[q] = x exactly (Connolly, Higham, Mary, "Stochastic rounding and its probabilistic
  backward error analysis", SIAM J. Sci. Comput. 2021; the same bit trick as torchao's
  ``_fp32_to_bf16_sr``). int32 is used because torch lacks uint32 arithmetic; working on the
  magnitude (<= 0x7f7fffff for finite x) keeps ``mag + r`` below 2**31, so nothing overflows.
* saturation: a finite x whose magnitude would round to 0x7f80 (Inf) is clamped to bf16 max
  0x7f7f, like PTX ``cvt.rs.satfinite.bf16x2.f32``.

Dithered rounding is :func:`cast_stochastic` with another key: ``r`` comes from
``derive_dither_key(seed, name)`` (no step), so each element keeps one fixed threshold
``1 - r / 2**16`` (in ulps above its lower neighbour) at every export. In signal-processing terms
it is non-subtractive dither with a rectangular-pdf dither one quantization step wide, which makes
the error's first moment zero for every input (Wannamaker, Lipshitz, Vanderkooy, Wright, "A
Theory of Non-Subtractive Dither", IEEE Trans. Signal Processing 48(2), 2000): E[q] = x over the
dither, exactly as for stochastic rounding. The dither is static — a fixed per-element random
threshold, as in random-threshold ("white-noise") halftoning (Ulichney, "Digital Halftoning",
MIT Press 1987) — rather than redrawn per export, so a served value changes only when its master
crosses its own threshold: churn per export is about |update| / spacing (round-to-nearest's
order) instead of stochastic rounding's 2p(1-p), and an unchanged master serves identical bits.
No single established name covers "static uniform non-subtractive dither at a floating-point
cast", so the config calls it ``"dithered"``.

Error feedback (a.k.a. Kahan-style compensation; Zamirai et al., "Revisiting BFloat16 Training",
arXiv 2010.06192): ``y = x + e; q = RTN(y); e = y - q``. ``y - q`` is exact in fp32 (q is y with
its low bits rounded off), so no update is ever lost. NaN/Inf/±0 and saturation as above; a
non-finite master leaves its residual untouched.
"""
from __future__ import annotations

import torch

from faircast_dist.philox import random_bits16

BF16_MAX = torch.finfo(torch.bfloat16).max
_SIGN = -0x80000000  # int32 0x80000000
_MAG = 0x7FFFFFFF
_SAT = 0x7F7F0000  # bf16 max as an fp32 bit pattern
_CHUNK = {"cpu": 1 << 19}  # elements per pass: in cache on CPU; bigger elsewhere (fewer launches)
_CHUNK_OTHER = 1 << 25


def _check_shard(master: torch.Tensor, out: torch.Tensor | None) -> None:
    if master.dtype != torch.float32:
        raise TypeError(f"master shard must be float32, got {master.dtype}")
    if out is not None:
        if out.dtype != torch.bfloat16:
            raise TypeError(f"output shard must be bfloat16, got {out.dtype}")
        if out.shape != master.shape:
            raise ValueError(f"output shard shape {tuple(out.shape)} != master shard shape {tuple(master.shape)}")


def check_stochastic_args(master: torch.Tensor, index, out: torch.Tensor | None) -> None:
    """The argument checks of :func:`cast_stochastic` (shared with the fused cast of that name).

    Raises:
        TypeError / ValueError: as :func:`cast_stochastic` documents.
    """
    _check_shard(master, out)
    if isinstance(index, torch.Tensor):
        if index.shape != master.shape:
            raise ValueError(f"index shape {tuple(index.shape)} != master shard shape {tuple(master.shape)}")
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise TypeError(f"index must be an integer tensor of global element indices, got {index.dtype}")
    elif not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 2**63 - master.numel():
        raise ValueError(f"index must be an int start offset in [0, 2**63 - numel) or an index tensor, got {index!r}")


def check_error_feedback_args(master: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None) -> None:
    """The argument checks of :func:`cast_error_feedback` (shared with the fused cast of that name).

    Raises:
        TypeError / ValueError: as :func:`cast_error_feedback` documents.
    """
    _check_shard(master, out)
    if residual.shape != master.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != master shard shape {tuple(master.shape)}")
    if residual.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"residual must be float32 or bfloat16, got {residual.dtype}")
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous: it is updated in place through a flat view")


def _chunked(master: torch.Tensor, out: torch.Tensor | None, fn) -> torch.Tensor:
    """Apply ``fn(lo, hi) -> bf16 chunk`` over the flat shard, _CHUNK elements at a time.

    Chunking keeps temporaries in cache (several times faster than whole-tensor passes on CPU)
    and bounds the extra memory to a few MB on any device.
    """
    target = out if out is not None and out.is_contiguous() else \
        torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    flat = target.view(-1)
    chunk = _CHUNK.get(flat.device.type, _CHUNK_OTHER)
    for lo in range(0, flat.numel(), chunk):
        hi = min(lo + chunk, flat.numel())
        flat[lo:hi] = fn(lo, hi)
    if out is not None and target is not out:
        out.copy_(target)
        return out
    return target


def cast_nearest(master: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Round to nearest even: bit for bit ``master.to(torch.bfloat16)``.

    Args:
        master: float32 tensor, any shape.
        out: optional bfloat16 tensor of the same shape, written in place.

    Returns:
        bfloat16 tensor shaped like ``master`` (``out`` when given).

    Raises:
        TypeError / ValueError: on wrong dtypes or mismatched shapes.
    """
    _check_shard(master, out)
    if out is None:
        return master.to(torch.bfloat16)
    return out.copy_(master)


def stochastic_round(master: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of ``master`` with the given random bits (see the module docstring).

    Args:
        master: float32 tensor, any shape.
        bits16: int32 tensor shaped like ``master``, values in [0, 2**16).

    Returns:
        bfloat16 tensor shaped like ``master``: NaN stays NaN, ±Inf stays ±Inf, ±0 stays ±0,
        finite inputs saturate at ±bf16 max instead of becoming Inf.
    """
    bits = master.view(torch.int32)
    finite = torch.isfinite(master)
    mag = torch.where(finite, bits & _MAG, 0)
    mag = torch.clamp_max((mag + bits16) & ~0xFFFF, _SAT)
    sr = ((bits & _SIGN) | mag).view(torch.float32).to(torch.bfloat16)  # exact: low bits are 0
    return torch.where(finite, sr, master.to(torch.bfloat16))


def cast_stochastic(master: torch.Tensor, key: tuple[int, int], index: torch.Tensor | int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Stochastic rounding keyed on global element indices.

    Args:
        master: float32 shard, any shape.
        key: Philox key ``(k0, k1)``: :func:`faircast_dist.philox.derive_key` (seed, step, name)
            for stochastic rounding, :func:`faircast_dist.philox.derive_dither_key` (seed, name)
            for dithered rounding.
        index: global element indices of the shard's elements (int64 tensor shaped like
            ``master``), or an int: the global index of ``master.reshape(-1)[0]`` when the shard
            is a contiguous run.
        out: optional bfloat16 tensor of the same shape, written in place.

    Returns:
        bfloat16 tensor (``out`` when given); element i rounds up in magnitude with probability
        equal to its fractional distance to the lower neighbour, so E[q] = master.

    Raises:
        TypeError / ValueError: on wrong dtypes or shapes, or an index tensor of another shape.
    """
    check_stochastic_args(master, index, out)
    flat = master.reshape(-1)
    flat_index = index if isinstance(index, int) else index.reshape(-1)

    def chunk(lo, hi):
        idx = index + lo if isinstance(index, int) else flat_index[lo:hi]
        return stochastic_round(flat[lo:hi], random_bits16(key, idx, numel=hi - lo, device=master.device))

    return _chunked(master, out, chunk)


def cast_error_feedback(master: torch.Tensor, residual: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Error-feedback cast: ``y = master + residual; q = RTN(y); residual <- y - q`` (in place).

    Args:
        master: float32 shard, any shape.
        residual: float32 or bfloat16 tensor shaped like ``master``; updated in place. Where the
            master is NaN/Inf it is left unchanged (a non-finite master never poisons it).
        out: optional bfloat16 tensor of the same shape, written in place.

    Returns:
        bfloat16 tensor q (``out`` when given). With an fp32 residual, |residual| <= half a bf16
        spacing of y after the call, so |q - master| stays within one spacing.

    Raises:
        TypeError / ValueError: on wrong dtypes or mismatched shapes.
    """
    check_error_feedback_args(master, residual, out)
    flat, res = master.reshape(-1), residual.view(-1)  # residual must be updatable in place

    def chunk(lo, hi):
        x, r = flat[lo:hi], res[lo:hi].float()
        finite = torch.isfinite(x)
        y = torch.where(r == 0, x, x + r)  # -0 + 0 would give +0: keep the master's sign
        y = torch.clamp(y, -BF16_MAX, BF16_MAX)  # saturate, never Inf
        q = y.to(torch.bfloat16)
        res[lo:hi] = torch.where(finite, y - q.float(), r)
        return torch.where(finite, q, x.to(torch.bfloat16))

    return _chunked(master, out, chunk)


# ----------------------------------------------------------------------------------------- fp32 -> FP8 E4M3
# The FP8 casts round y = x / s (x the master, s its channel's or block's fp32 scale, docs/design.md "FP8
# exports") onto the E4M3 grid (torch.float8_e4m3fn: 3 mantissa bits, exponent bias 7, no Inf, NaN 0x7f/0xff).
# The grid's spacing is 2**(max(e, -6) - 3) for |y| in [2**e, 2**(e+1)): 2**-9 across the subnormals, where the
# fp32 pattern trick above does not hold (the spacing stops shrinking with the exponent), so the rounding works
# on t = |y| / spacing, exact in fp32 (a power-of-two scaling): the two neighbours are floor(t) and floor(t) + 1
# spacings. Saturation: |y| is clamped at E4M3_MAX (448) first, like PTX ``cvt.rn.satfinite.e4m3x2.f32``;
# a non-finite y gives NaN with its sign (E4M3 has no Inf).
E4M3_MAX = 448.0


def _e4m3_split(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``|y|`` clamped at 448 as ``(k, f, spacing)``: ``|y| = (k + f) * spacing`` with k an integer in [0, 16),
    f in [0, 1) and spacing the E4M3 grid's spacing at |y| (all fp32, all exact)."""
    a = torch.clamp(y.abs(), max=E4M3_MAX)
    e = torch.clamp((a.view(torch.int32) >> 23) - 127, min=-6)  # fp32 exponent (zero and fp32 subnormals: -6)
    spacing = torch.ldexp(torch.ones_like(a), e - 3)
    t = a / spacing  # exact: a power of two
    k = torch.floor(t)
    return k, t - k, spacing


def e4m3_round(y: torch.Tensor, bits16: torch.Tensor | None = None) -> torch.Tensor:
    """Round fp32 ``y`` onto the E4M3 grid: to nearest even (``bits16`` None), or stochastically with 16
    random bits per element.

    Stochastic rounding: with ``f`` the fraction of a spacing above the lower (in magnitude) neighbour, truncated
    to 16 bits (``f16 = floor(f * 2**16)``), |y| rounds away from zero iff ``f16 + bits16 >= 2**16``, i.e. with
    probability ``f16 / 2**16``: E[q] = y to within 2**-16 of a spacing (the bits below the 16th are dropped
    toward zero; bf16's cast keeps no such bits, FP8's keep 4 to 7 more than the 16 drawn).

    Args:
        y: float32 tensor, any shape (the scaled master).
        bits16: int32 tensor shaped like ``y``, values in [0, 2**16) (``random_bits16``), or None.

    Returns:
        float8_e4m3fn tensor shaped like ``y``: ±0 keep their sign, finite values saturate at ±448, NaN and ±Inf
        give NaN with their sign (``0x7f``, ``0xff``: E4M3 has no Inf, and a diverged master saturated to ±448
        would pass for a weight). Round-to-nearest equals ``y.clamp(-448, 448).to(torch.float8_e4m3fn)`` on finite
        ``y``.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"e4m3_round: y must be float32, got {y.dtype}")
    k, f, spacing = _e4m3_split(y)
    if bits16 is None:  # ties to even
        up = (f > 0.5) | ((f == 0.5) & (torch.remainder(k, 2) == 1))
    else:
        up = torch.floor(f * 65536).to(torch.int32) + bits16 >= 65536
    q = torch.copysign((k + up.float()) * spacing, y)  # exact: at most 5 significant bits
    q = torch.where(torch.isfinite(y), q, torch.copysign(torch.full_like(y, float("nan")), y))
    return q.to(torch.float8_e4m3fn)


_FP32_MAX = torch.finfo(torch.float32).max


def _scaled(y: torch.Tensor, scale: torch.Tensor, multiplier: torch.Tensor | None = None) -> torch.Tensor:
    """``y / scale`` (``y * multiplier`` when given), saturated at ±448 where ``y`` is finite (a finite value whose
    quotient overflows to Inf is served as ±448, never NaN)."""
    q = y / scale if multiplier is None else y * multiplier
    return torch.where(torch.isfinite(y), torch.clamp(q, -E4M3_MAX, E4M3_MAX), q)


def _check_fp8_args(master: torch.Tensor, scale: torch.Tensor, multiplier: torch.Tensor | None = None) -> None:
    if master.dtype != torch.float32:
        raise TypeError(f"master shard must be float32, got {master.dtype}")
    for name, t in (("scale", scale), ("multiplier", multiplier)):
        if t is not None and (t.dtype != torch.float32 or t.shape != master.shape):
            raise ValueError(f"{name} must be float32 shaped like the master shard {tuple(master.shape)} (one per "
                             f"element: faircast_dist.fp8.element_scales), got {t.dtype} {tuple(t.shape)}")


def cast_fp8_nearest(master: torch.Tensor, scale: torch.Tensor, via_bf16: bool = False,
                     multiplier: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest FP8: ``q = RTN(master / scale)``, what RL stacks serve today.

    Args:
        master: float32 shard, any shape.
        scale: float32 per-element scales shaped like ``master`` (``faircast_dist.fp8.element_scales``).
        via_bf16: round the master to bf16 first (``RTN(bf16(master) / scale)``): the stacks' double rounding.
        multiplier: None, or float32 per-element multipliers shaped like ``master``: ``q = RTN(master *
            multiplier)`` (a :class:`faircast_dist.fp8.ScaleRule` whose codes multiply, as verl's quantizer); the
            same for the other FP8 casts.

    Returns:
        float8_e4m3fn tensor shaped like ``master``; ``q.float() * scale`` is the served weight.

    Raises:
        TypeError / ValueError: on wrong dtypes or shapes.
    """
    _check_fp8_args(master, scale, multiplier)
    if via_bf16:  # (a non-finite master as it is: torch's cast may flip a NaN's sign)
        master = torch.where(torch.isfinite(master), master.to(torch.bfloat16).float(), master)
    return e4m3_round(_scaled(master, scale, multiplier))


def cast_fp8_stochastic(master: torch.Tensor, scale: torch.Tensor, key: tuple[int, int],
                        index: torch.Tensor | int, multiplier: torch.Tensor | None = None) -> torch.Tensor:
    """Stochastic (or, with a dither key, dithered) FP8: ``q = SR(master / scale)`` with the element's 16 bits
    from the same Philox stream as the bf16 cast (``key`` and global ``index`` as :func:`cast_stochastic`).

    Returns:
        float8_e4m3fn tensor shaped like ``master``: E[q * scale] = master to within 2**-16 of an FP8 spacing
        times the scale (and the fp32 division's rounding).

    Raises:
        TypeError / ValueError: on wrong dtypes or shapes.
    """
    _check_fp8_args(master, scale, multiplier)
    check_stochastic_args(master, index, None)
    bits = random_bits16(key, index if isinstance(index, int) else index.reshape(-1), numel=master.numel(),
                         device=master.device).reshape(master.shape)
    return e4m3_round(_scaled(master, scale, multiplier), bits)


def cast_fp8_error_feedback(master: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor,
                            multiplier: torch.Tensor | None = None) -> torch.Tensor:
    """Error-feedback FP8: ``y = master + residual; q = RTN(y / scale); residual <- y - q * scale`` (in place;
    the residual is in the master's units, fp32, and ``q * scale`` is rounded before the subtraction: no fused
    multiply-add). For a finite master, ``y`` saturates at ±fp32 max and ``y / scale`` at ±448, so q and the
    residual stay finite. Where the master is not finite the residual is left unchanged and q is NaN.

    Returns:
        float8_e4m3fn tensor shaped like ``master``.

    Raises:
        TypeError / ValueError: on wrong dtypes or shapes, or a residual that is not fp32, contiguous and shaped
        like ``master``.
    """
    _check_fp8_args(master, scale, multiplier)
    if residual.dtype != torch.float32 or residual.shape != master.shape or not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous float32 tensor shaped like the master shard "
                         f"{tuple(master.shape)}, got {residual.dtype} {tuple(residual.shape)}")
    finite = torch.isfinite(master)  # (a non-finite master as it is: its NaN's sign too)
    y = torch.where((residual == 0) | ~finite, master, master + residual)  # -0 + 0 would give +0: keep the sign
    y = torch.where(finite, torch.clamp(y, -_FP32_MAX, _FP32_MAX), y)  # never Inf from finite
    q = e4m3_round(_scaled(y, scale, multiplier))
    residual.copy_(torch.where(torch.isfinite(master), y - q.float() * scale, residual))
    return q
