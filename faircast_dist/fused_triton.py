"""The fused casts as a Triton kernel (GPU; CPU under ``TRITON_INTERPRET=1``, as CI runs it).

Same contract and bits as :func:`faircast_dist.fused.cast_flat` (which dispatches here). One
program casts one *tile*: ``BLOCK`` elements of one segment, aligned to param-global multiples of
``BLOCK``, so it draws ``BLOCK / 8`` Philox blocks, one per 8 elements, even when a segment starts
mid-block. Written for exact bits on any Triton version:

* the 10 Philox4x32 rounds are spelled out on explicit ``tl.uint32`` words with ``tl.umulhi``
  (``tl.randint`` switches to Philox4x64 on 64-bit counters in some versions, and the
  interpreter sign-extends signed int32 operands of ``umulhi``);
* program offsets are int64 (loaded from int64 tables): ``pid * BLOCK`` in int32 overflows past
  2**31 elements;
* rounding is integer ops on the fp32 bit pattern (no libdevice, no flush-to-zero surprises);
* the compile options are pinned (:data:`COMPILE_OPTIONS`): no FP contraction, whatever a Triton
  version's default (3.9 warns that its ``enable_fp_fusion`` default changes in 3.10), so error
  feedback's ``x + e`` and ``y - q`` stay two correctly rounded fp32 operations.

``tests/test_triton_aot.py`` compiles the kernel ahead of time for ``sm_90`` on the CPU (CI runs
it only under the interpreter, which does not see what only the compiler sees).
"""
from __future__ import annotations

import torch

from faircast_dist.config import Method

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU kernel and the reference do not need it
    triton = None

BLOCK = 1024  # elements per program (a multiple of 8)
COMPILE_OPTIONS = {"enable_fp_fusion": False}  # pinned: a Triton upgrade must not change the bits


def available() -> bool:
    """True when a Triton with ``tl.join`` (3.0+, torch 2.4+) imports; a GPU, or
    ``TRITON_INTERPRET=1`` for CPU tensors, is up to the caller."""
    return triton is not None and hasattr(tl, "join")


if available():
    @triton.jit
    def _philox4x32_10(c0, c1, c2, c3, k0, k1):
        """Philox4x32-10 (Salmon et al., SC'11; Random123's word order) on uint32 tensors."""
        m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
        m1 = tl.full(c0.shape, 0xCD9E8D57, tl.uint32)
        w0 = tl.full(c0.shape, 0x9E3779B9, tl.uint32)
        w1 = tl.full(c0.shape, 0xBB67AE85, tl.uint32)
        for r in tl.static_range(10):
            if r > 0:
                k0 = k0 + w0
                k1 = k1 + w1
            h0 = tl.umulhi(c0, m0)
            l0 = c0 * m0
            h1 = tl.umulhi(c2, m1)
            l1 = c2 * m1
            c0 = h1 ^ c1 ^ k0
            c2 = h0 ^ c3 ^ k1
            c1 = l1
            c3 = l0
        return c0, c1, c2, c3

    @triton.jit
    def _philox_kat_kernel(ctr_ptr, key_ptr, out_ptr, N: tl.constexpr):
        """Test hook: Philox of N arbitrary counters (uint32 words in int64 tensors)."""
        i = tl.arange(0, N)
        c = [tl.load(ctr_ptr + 4 * i + w).to(tl.uint32) for w in tl.static_range(4)]
        k0 = tl.full([N], 0, tl.uint32) + tl.load(key_ptr).to(tl.uint32)
        k1 = tl.full([N], 0, tl.uint32) + tl.load(key_ptr + 1).to(tl.uint32)
        o0, o1, o2, o3 = _philox4x32_10(c[0], c[1], c[2], c[3], k0, k1)
        tl.store(out_ptr + 4 * i, o0.to(tl.int64))
        tl.store(out_ptr + 4 * i + 1, o1.to(tl.int64))
        tl.store(out_ptr + 4 * i + 2, o2.to(tl.int64))
        tl.store(out_ptr + 4 * i + 3, o3.to(tl.int64))

    @triton.jit
    def _nonfinite16(b):
        """bf16 bits (uint32) of a non-finite fp32 pattern: Inf as is; NaN a quiet NaN, sign kept."""
        return tl.where((b & 0x007FFFFF) != 0, (b >> 16) | 0x0040, b >> 16)

    @triton.jit
    def _to_bf16_bits(b):
        """Round to nearest even (uint32 pattern -> uint32 holding 16 bits); NaN by _nonfinite16."""
        return tl.where((b & 0x7FFFFFFF) > 0x7F800000, _nonfinite16(b), (b + 0x7FFF + ((b >> 16) & 1)) >> 16)

    @triton.jit
    def _bits16(base, key0, key1, BLOCK: tl.constexpr):
        """The 16 random bits (uint32) of elements ``base .. base + BLOCK - 1`` (``base`` a multiple of 8):
        Philox of block ``g // 8``, element ``g`` taking lane ``g % 8``."""
        NB: tl.constexpr = BLOCK // 8
        blk = base // 8 + tl.arange(0, NB)
        zero = tl.zeros([NB], tl.uint32)
        k0 = zero + key0.to(tl.uint32)
        k1 = zero + key1.to(tl.uint32)
        w0, w1, w2, w3 = _philox4x32_10((blk & 0xFFFFFFFF).to(tl.uint32), (blk >> 32).to(tl.uint32),
                                        zero, zero, k0, k1)
        # element i of a block takes lane i % 8: lane 2w = low half of word w, 2w + 1 its high half
        lanes = tl.join(tl.join(tl.join(w0 & 0xFFFF, w2 & 0xFFFF), tl.join(w1 & 0xFFFF, w3 & 0xFFFF)),
                        tl.join(tl.join(w0 >> 16, w2 >> 16), tl.join(w1 >> 16, w3 >> 16)))
        return tl.reshape(lanes, [BLOCK])

    @triton.jit
    def _tile(master_ptr, seg_ptr, tile_seg_ptr, tile_base_ptr, COLS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's tile of a table with ``COLS`` columns (start, numel, index first): its row ``s``, first
        slot ``base`` (a param-global index), global indices ``g``, mask, buffer positions and master bits
        (uint32). All int64: offsets past 2**31 elements stay exact."""
        pid = tl.program_id(0)
        s = tl.load(tile_seg_ptr + pid)
        base = tl.load(tile_base_ptr + pid)
        start = tl.load(seg_ptr + COLS * s)
        numel = tl.load(seg_ptr + COLS * s + 1)
        g0 = tl.load(seg_ptr + COLS * s + 2)
        g = base + tl.arange(0, BLOCK)
        mask = (g >= g0) & (g < g0 + numel)
        pos = start + (g - g0)
        return s, base, g, mask, pos, tl.load(master_ptr + pos, mask=mask, other=0).to(tl.uint32, bitcast=True)

    @triton.jit
    def _cast_kernel(master_ptr, out_ptr, res_ptr, seg_ptr, tile_seg_ptr, tile_base_ptr,
                     EF: tl.constexpr, RES_BF16: tl.constexpr, BLOCK: tl.constexpr):
        s, base, g, mask, pos, b = _tile(master_ptr, seg_ptr, tile_seg_ptr, tile_base_ptr, 5, BLOCK)
        finite = (b & 0x7FFFFFFF) < 0x7F800000
        if EF:
            x = b.to(tl.float32, bitcast=True)
            if RES_BF16:
                eb = tl.load(res_ptr + pos, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
                e = (eb << 16).to(tl.float32, bitcast=True)
            else:
                e = tl.load(res_ptr + pos, mask=mask, other=0.0)
            y = tl.where(e == 0.0, x, x + e)  # -0 + 0 would give +0: keep the master's sign
            y = tl.where(y > 3.3895313892515355e38, 3.3895313892515355e38, y)  # saturate; NaN passes
            y = tl.where(y < -3.3895313892515355e38, -3.3895313892515355e38, y)
            q = _to_bf16_bits(y.to(tl.uint32, bitcast=True))
            d = y - (q << 16).to(tl.float32, bitcast=True)  # exact
            q = tl.where(finite, q, _nonfinite16(b))
            if RES_BF16:
                d16 = _to_bf16_bits(d.to(tl.uint32, bitcast=True))
                tl.store(res_ptr + pos, tl.where(finite, d16, eb).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
            else:
                tl.store(res_ptr + pos, tl.where(finite, d, e), mask=mask)
        else:
            r = _bits16(base, tl.load(seg_ptr + 5 * s + 3), tl.load(seg_ptr + 5 * s + 4), BLOCK)
            mag = b & 0x7FFFFFFF
            m = tl.minimum((mag + r) & 0xFFFF0000, 0x7F7F0000)  # round, saturate at bf16 max
            q = tl.where(finite, ((b & 0x80000000) | m) >> 16, _nonfinite16(b))
        tl.store(out_ptr + pos, q.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)

    # ------------------------------------------------------------------------------------- fp32 -> FP8 E4M3
    # The bits of csrc/fused_cast.cpp's FP8 section (and so of rounding.py's cast_fp8_*): see the comments there.
    # FP8 rows here: (start, numel, index, k0, k1, scale offset, K, block columns), one tensor per launch.

    @triton.jit
    def _fp8_scale_index(g, s, seg_ptr):
        """Each element's index into the flat scales: channel ``g // K``, or block ``(g // K // 128, g % K // 128)``."""
        off = tl.load(seg_ptr + 8 * s + 5)
        k = tl.load(seg_ptr + 8 * s + 6)
        nbk = tl.load(seg_ptr + 8 * s + 7)
        row = g // k
        return off + tl.where(nbk == 0, row, (row // 128) * nbk + (g % k) // 128)

    @triton.jit
    def _bf16_value(b):
        """``.to(bfloat16).float()`` of fp32 patterns ``b`` (uint32), as fp32: RTN; non-finite as is."""
        finite = (b & 0x7FFFFFFF) < 0x7F800000
        return tl.where(finite, _to_bf16_bits(b) << 16, b).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_code(y, s, r, STOCHASTIC: tl.constexpr, MUL: tl.constexpr):
        """E4M3 code (uint32: sign 0x80 | magnitude) of ``y / s`` (IEEE division; ``s`` finite > 0; with MUL
        ``y * s``), saturated at 448; NaN (0x7F with ``y``'s sign) where ``y`` is not finite."""
        if MUL:
            q = y * s
        else:
            q = tl.math.div_rn(y, s)
        qb = q.to(tl.uint32, bitcast=True)
        ab = tl.minimum(qb & 0x7FFFFFFF, 0x43E00000)
        if STOCHASTIC:
            normal = ((ab + (r << 4)) >> 20) - 960
            a25 = tl.minimum(ab, 0x3C7FFFFF).to(tl.float32, bitcast=True) * 33554432.0  # |q| * 2**25: exact
            sub = (a25.to(tl.int32).to(tl.uint32) + r) >> 16
        else:
            normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - 960
            sub = (ab.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
        code = tl.where(ab >= 0x3C800000, normal, sub)
        yb = y.to(tl.uint32, bitcast=True)  # (y's sign: s > 0; a GPU's division may drop a NaN's)
        return ((yb & 0x80000000) >> 24) | tl.where((yb & 0x7FFFFFFF) < 0x7F800000, code, 0x7F)

    @triton.jit
    def _e4m3_value(code):
        """fp32 of E4M3 codes (uint32); NaN for 0x7F / 0xFF."""
        m = code & 0x7F
        sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
        v = tl.where(m >= 8, (m + 960) << 20, sub) | ((code & 0x80) << 24)
        return tl.where(m == 0x7F, 0x7FC00000, v).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_cast_kernel(master_ptr, out_ptr, res_ptr, scale_ptr, mult_ptr, seg_ptr, tile_seg_ptr, tile_base_ptr,
                         MODE: tl.constexpr, VIA_BF16: tl.constexpr, MUL: tl.constexpr, BLOCK: tl.constexpr):
        """MODE 0: nearest (VIA_BF16: of bf16(master)); 1: stochastic; 2: error feedback. MUL: codes multiply by
        ``mult_ptr``'s factors (else divide by the scales)."""
        s, base, g, mask, pos, b = _tile(master_ptr, seg_ptr, tile_seg_ptr, tile_base_ptr, 8, BLOCK)
        sidx = _fp8_scale_index(g, s, seg_ptr)
        scale = tl.load(scale_ptr + sidx, mask=mask, other=1.0)
        if MUL:
            f = tl.load(mult_ptr + sidx, mask=mask, other=1.0)
        else:
            f = scale
        if MODE == 1:
            r = _bits16(base, tl.load(seg_ptr + 8 * s + 3), tl.load(seg_ptr + 8 * s + 4), BLOCK)
            code = _e4m3_code(b.to(tl.float32, bitcast=True), f, r, True, MUL)
        elif MODE == 2:
            x = b.to(tl.float32, bitcast=True)
            e = tl.load(res_ptr + pos, mask=mask, other=0.0)
            finite = (b & 0x7FFFFFFF) < 0x7F800000
            y = tl.where((e == 0.0) | ~finite, x, x + e)  # -0 + 0 gives +0, a GPU NaN + e any NaN: the master
            yb = y.to(tl.uint32, bitcast=True)
            y = tl.where(finite & ((yb & 0x7FFFFFFF) == 0x7F800000), (yb & 0x80000000) | 0x7F7FFFFF,
                         yb).to(tl.float32, bitcast=True)  # saturate at fp32 max
            code = _e4m3_code(y, f, 0, False, MUL)
            tl.store(res_ptr + pos, tl.where(finite, y - _e4m3_value(code) * scale, e), mask=mask)
        else:
            x = _bf16_value(b) if VIA_BF16 else b.to(tl.float32, bitcast=True)
            code = _e4m3_code(x, f, 0, False, MUL)
        tl.store(out_ptr + pos, code.to(tl.uint8), mask=mask)

    @triton.jit
    def _fp8_absmax_kernel(master_ptr, res_ptr, amax_ptr, seg_ptr, tile_seg_ptr, tile_base_ptr,
                           Y: tl.constexpr, BLOCK: tl.constexpr):
        """Y 0: |master|; 1: |bf16(master)|; 2: |master + residual|; finite ones only, maxed per scale (the
        magnitude bits as int32: non-negative floats order as their patterns)."""
        s, base, g, mask, pos, b = _tile(master_ptr, seg_ptr, tile_seg_ptr, tile_base_ptr, 8, BLOCK)
        if Y == 2:
            y = b.to(tl.float32, bitcast=True) + tl.load(res_ptr + pos, mask=mask, other=0.0)
        elif Y == 1:
            y = _bf16_value(b)
        else:
            y = b.to(tl.float32, bitcast=True)
        a = y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
        if Y == 2:  # a finite master whose master + residual overflows: fp32 max, where the cast saturates it
            a = tl.where(((b & 0x7FFFFFFF) < 0x7F800000) & (a == 0x7F800000), 0x7F7FFFFF, a)
        a = tl.where(a < 0x7F800000, a, 0).to(tl.int32)
        tl.atomic_max(amax_ptr + _fp8_scale_index(g, s, seg_ptr), a, mask=mask)



def tiles(table: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment of each tile, param-global index of its first slot): int64 tensors on ``device``."""
    t = table.to(device)
    numel, g0 = t[:, 1], t[:, 2]
    live = numel > 0
    first = torch.div(g0, BLOCK, rounding_mode="floor")
    count = torch.where(live, torch.div(g0 + numel - 1, BLOCK, rounding_mode="floor") - first + 1, 0)
    seg = torch.repeat_interleave(torch.arange(t.shape[0], device=device), count)
    offset = torch.arange(seg.numel(), device=device) - (torch.cumsum(count, 0) - count)[seg]
    return seg, (first[seg] + offset) * BLOCK


def cast_flat(method: Method, master: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
              residual: torch.Tensor | None = None, grid: tuple | None = None) -> None:
    """The Triton backend of :func:`faircast_dist.fused.cast_flat` (arguments checked there).

    ``grid``: ``tiles(table, ...)`` already on ``master``'s device (``fused`` caches it per buffer
    layout, with ``table`` on the device too, so a step copies and syncs nothing); None computes
    it here, which waits for the device (``repeat_interleave`` needs its output size).
    """
    if not available():
        raise ValueError("the triton backend needs triton >= 3.0 (`pip install triton`)")
    seg, base = tiles(table, master.device) if grid is None else grid
    if seg.numel() == 0:
        return
    ef = method is Method.ERROR_FEEDBACK
    res = master if not ef else residual.view(torch.int16) if residual.dtype == torch.bfloat16 else residual
    _cast_kernel[(seg.numel(),)](master.view(torch.int32), out.view(torch.int16), res, table.to(master.device),
                                 seg, base, EF=ef, RES_BF16=ef and residual.dtype == torch.bfloat16, BLOCK=BLOCK,
                                 **COMPILE_OPTIONS)


def philox4x32_10(counter: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """The kernel's Philox on arbitrary counters (for the known-answer tests).

    Args:
        counter: int64 ``[N, 4]`` of uint32 words, N a power of two.
        key: ``(k0, k1)`` uint32 words.

    Returns:
        int64 ``[N, 4]`` output words.
    """
    out = torch.empty_like(counter)
    _philox_kat_kernel[(1,)](counter.contiguous(), torch.tensor(key, dtype=torch.int64, device=counter.device),
                             out, N=counter.shape[0])
    return out


def _fp8_launches(table: torch.Tensor, device: torch.device):
    """Per tensor with rows: ``(tensor, its rows [R, 8] on device, tile segments, tile bases)``."""
    for k in torch.unique(table[:, 0]).tolist():
        rows = table[table[:, 0] == k, 1:].contiguous()
        seg, base = tiles(rows, device)
        if seg.numel():
            yield k, rows.to(device), seg, base


def fp8_absmax(masters, table: torch.Tensor, absmax: torch.Tensor, residuals=None, via_bf16: bool = False) -> None:
    """The Triton backend of :func:`faircast_dist.fused.fp8_absmax` (arguments checked there)."""
    if not available():
        raise ValueError("the triton backend needs triton >= 3.0 (`pip install triton`)")
    y = 2 if residuals is not None else 1 if via_bf16 else 0
    amax = absmax.view(torch.int32)
    for k, rows, seg, base in _fp8_launches(table, masters[0].device):
        res = residuals[k] if residuals is not None else masters[k]
        _fp8_absmax_kernel[(seg.numel(),)](masters[k].view(torch.int32), res, amax, rows, seg, base, Y=y,
                                           BLOCK=BLOCK, **COMPILE_OPTIONS)


def cast_fp8(mode: int, masters, outs, table: torch.Tensor, scales: torch.Tensor, residuals=None,
             via_bf16: bool = False, multipliers: torch.Tensor | None = None) -> None:
    """The Triton backend of :func:`faircast_dist.fused.cast_fp8` (arguments checked there; ``mode``: the method's
    :data:`faircast_dist.fused.KERNEL_CODES` entry)."""
    if not available():
        raise ValueError("the triton backend needs triton >= 3.0 (`pip install triton`)")
    for k, rows, seg, base in _fp8_launches(table, masters[0].device):
        res = residuals[k] if residuals is not None else masters[k]
        _fp8_cast_kernel[(seg.numel(),)](masters[k].view(torch.int32), outs[k], res, scales,
                                         scales if multipliers is None else multipliers, rows, seg, base, MODE=mode,
                                         VIA_BF16=via_bf16, MUL=multipliers is not None, BLOCK=BLOCK, **COMPILE_OPTIONS)
