"""Counter-based random bits: Philox4x32-10 and the key derivation.

Philox4x32-10 is the generator of Salmon, Moraes, Dror and Shaw, "Parallel random numbers:
as easy as 1, 2, 3" (SC'11), as implemented by Random123 (and cuRAND, JAX, Triton
``tl.randint``). One call maps a 128-bit counter and a 64-bit key to 128 random bits, with no
state: any element's bits can be computed on any rank, in any order.

How Fair Cast uses it (``random_bits16``):

* key     = ``derive_key(seed, step, name)``: the first 8 bytes of
  BLAKE2b(digest_size=8) over ``b"faircast/philox/v1\\0" || seed (int64 LE) || step (int64 LE) ||
  name (UTF-8)``, read as two little-endian uint32 words ``(k0, k1)``. Stable across Python
  versions and processes (unlike ``hash()``).
* dithered rounding's key = ``derive_dither_key(seed, name)``: the same recipe over
  ``b"faircast/dither/v1\\0" || seed (int64 LE) || name (UTF-8)`` — no step, so an element's
  dither is the same at every export; the distinct domain string means its BLAKE2b input never
  equals that of any ``derive_key(seed, step, name)``, so the dither is not the stochastic-rounding
  bits of some step.
* counter = ``(block & 0xffffffff, block >> 32, 0, 0)`` with ``block = global_index // 8``.
* the 4 output words hold 8 16-bit lanes; element ``i`` takes lane ``i % 8``: lane ``2w`` is the
  low half of word ``w``, lane ``2w + 1`` its high half.

So an element's 16 random bits depend only on (seed, step, name, global element index) — never on
how the tensor is sharded.

Integers: torch has no full uint32/uint64 arithmetic, so words are held in int64 tensors in
[0, 2**32). The 32x32 -> 64-bit product ``a * m`` is formed in int64, which wraps modulo 2**64 on
every torch backend; its bit pattern is the unsigned product, so ``lo = p & 0xffffffff`` and
``hi = (p >> 32) & 0xffffffff`` (the mask drops the arithmetic shift's sign fill). The known-answer
vectors and a pure-Python reference pin this in the tests. On CPU blocks are generated 2**16 at a
time, which keeps the temporaries in cache (about 3x faster than one large pass); on GPUs 2**22
(fewer kernel launches). Chunking never changes the bits.
"""
from __future__ import annotations

import hashlib
import struct

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments (golden ratio, sqrt(3) - 1)
_MASK32 = 0xFFFFFFFF
_LANES = 8  # 16-bit outputs per Philox block
_CHUNK_BLOCKS = {"cpu": 1 << 16}  # blocks per pass: in cache on CPU; bigger elsewhere (fewer launches)
_CHUNK_BLOCKS_OTHER = 1 << 22


def _chunk_blocks(device: torch.device) -> int:
    return _CHUNK_BLOCKS.get(device.type, _CHUNK_BLOCKS_OTHER)


def derive_key(seed: int, step: int, name: str) -> tuple[int, int]:
    """Philox key for one parameter at one step.

    Args:
        seed: the export-cast seed (any int that fits int64).
        step: the export step (number of casts done before this one; int64).
        name: the canonical parameter name, identical on every rank and layout.

    Returns:
        ``(k0, k1)``, two uint32 words (see the module docstring for the exact recipe).

    Raises:
        TypeError: if ``name`` is not a str.
    """
    return _blake2b_key(b"faircast/philox/v1\0" + struct.pack("<qq", seed, step), name)


def derive_dither_key(seed: int, name: str) -> tuple[int, int]:
    """Philox key of one parameter's fixed dither (dithered rounding): the same at every step.

    Args:
        seed: the export-cast seed (any int that fits int64).
        name: the canonical parameter name, identical on every rank and layout.

    Returns:
        ``(k0, k1)``, two uint32 words: the first 8 bytes of BLAKE2b(digest_size=8) over
        ``b"faircast/dither/v1\\0" || seed (int64 LE) || name (UTF-8)``, little-endian.

    Raises:
        TypeError: if ``name`` is not a str.
    """
    return _blake2b_key(b"faircast/dither/v1\0" + struct.pack("<q", seed), name)


def _blake2b_key(prefix: bytes, name: str) -> tuple[int, int]:
    if not isinstance(name, str):
        raise TypeError(f"parameter name must be a str, got {type(name).__name__}: {name!r}")
    k0, k1 = struct.unpack("<II", hashlib.blake2b(prefix + name.encode("utf-8"), digest_size=8).digest())
    return k0, k1


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * m`` for int64 ``a`` in [0, 2**32) and constant ``m``."""
    p = a * m  # wraps modulo 2**64: the bits of the unsigned 64-bit product
    return (p >> 32) & _MASK32, p & _MASK32


def philox4x32_10(counter: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """Philox4x32-10 on a batch of counters.

    Args:
        counter: int64 tensor of shape ``[N, 4]``, each entry a uint32 word in [0, 2**32).
        key: ``(k0, k1)``, uint32 words.

    Returns:
        int64 tensor ``[N, 4]`` of output words in [0, 2**32), on ``counter.device``.
        Matches Random123's ``philox4x32(ctr, key)`` with 10 rounds (pinned by its kat_vectors).
    """
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def _bits16_of_blocks(key: tuple[int, int], blocks: torch.Tensor) -> torch.Tensor:
    """All 8 lanes of the given blocks: int32 ``[len(blocks), 8]`` in [0, 2**16)."""
    counter = torch.zeros(blocks.numel(), 4, dtype=torch.int64, device=blocks.device)
    counter[:, 0] = blocks & _MASK32
    counter[:, 1] = blocks >> 32
    words = philox4x32_10(counter, key)
    lanes = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # [N, 4, 2]: lane 2w, 2w+1
    return lanes.reshape(-1, _LANES).to(torch.int32)


def random_bits16(key: tuple[int, int], index: torch.Tensor | int, numel: int | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """16 random bits per element, keyed on the element's global index.

    Args:
        key: Philox key from :func:`derive_key`.
        index: global element indices, an int64 tensor of any shape (e.g. a strided TP shard),
            or an int ``start`` meaning the contiguous run ``start, start + 1, ..., start + numel - 1``.
        numel: required when ``index`` is an int; ignored otherwise.
        device: device of the result when ``index`` is an int (default CPU).

    Returns:
        int32 tensor of values in [0, 2**16), shaped like ``index`` (``[numel]`` for an int).
        Equal indices give equal bits whatever the rest of ``index``, so a tensor cast whole and
        the same tensor cast as shards draw the same bits.

    Raises:
        ValueError: on a negative index, or an int ``index`` without ``numel``.
    """
    if isinstance(index, int):
        if numel is None:
            raise ValueError("random_bits16: numel is required when index is an int start offset")
        if index < 0:
            raise ValueError(f"random_bits16: negative global start index {index}")
        out = torch.empty(numel, dtype=torch.int32, device=device)
        step = _chunk_blocks(out.device) * _LANES
        for lo in range(0, numel, step):
            hi = min(lo + step, numel)
            first, last = (index + lo) // _LANES, (index + hi - 1) // _LANES
            blocks = torch.arange(first, last + 1, dtype=torch.int64, device=out.device)
            flat = _bits16_of_blocks(key, blocks).reshape(-1)
            off = index + lo - first * _LANES
            out[lo:hi] = flat[off:off + hi - lo]
        return out
    flat_index = index.reshape(-1).to(torch.int64)
    if flat_index.numel() and int(flat_index.min()) < 0:
        raise ValueError(f"random_bits16: negative global index {int(flat_index.min())}")
    out = torch.empty(flat_index.shape, dtype=torch.int32, device=flat_index.device)
    step = _chunk_blocks(out.device)
    for lo in range(0, flat_index.numel(), step):
        idx = flat_index[lo:lo + step]
        bits = _bits16_of_blocks(key, idx >> 3)
        out[lo:lo + step] = bits.gather(1, (idx & 7).unsqueeze(1)).squeeze(1)
    return out.reshape(index.shape)
