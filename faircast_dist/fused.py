"""Fused casts: one call casts a whole flat fp32 buffer (a ZeRO partition, a bucket range).

The reference casts (:mod:`faircast_dist.rounding`, :mod:`faircast_dist.philox`) stay the
executable spec; the kernels here give the same bits, faster:

* ``"cpu"``: a C++ loop (``csrc/fused_cast.cpp``) built on first use with
  ``torch.utils.cpp_extension`` (ninja, ``-O3 -march=native -fopenmp``, the way DeepSpeed builds
  its CPU ops; never ``-ffast-math``) and cached by torch under ``TORCH_EXTENSIONS_DIR``;
* ``"triton"``: :mod:`faircast_dist.fused_triton`, for GPU tensors (and CPU under
  ``TRITON_INTERPRET=1``, as CI tests it);
* ``"reference"``: the plain-torch casts, one call per segment.

:func:`cast_flat` picks one in one place, with one signature. A buffer is described by a
*segment table*: one row per param fragment it holds,
``(start in the buffer, numel, global index of the fragment's first element, k0, k1)``, so every
fragment keeps its own Philox key and global element indices (DESIGN.md invariant 1). Keys are
per row: any key derivation (per step, or without the step) runs on the same kernel. A strided
TP block is several rows, one per contiguous run of global indices. Elements outside every
segment (padding) are left untouched.

Philox runs once per 8 elements: the kernels tile each fragment at param-global multiples of 8
(a fragment starting mid-block still costs one Philox call per 8 elements).

NaN rule: the kernels write a NaN as the quiet NaN ``(bits >> 16) | 0x0040`` (sign kept); the
reference writes whatever ``Tensor.to(torch.bfloat16)`` writes (0x7FC0 or 0xFFFF depending on
torch's code path). Both keep NaN as NaN; every other input gives identical bits.
"""
from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Sequence

import torch

from faircast_dist.rounding import cast_error_feedback, cast_stochastic

METHODS = ("stochastic", "error_feedback")
BACKENDS = ("auto", "cpu", "triton", "reference")
BACKEND_ENV = "FAIRCAST_FUSED_BACKEND"  # overrides "auto" (e.g. "reference" to rule the kernels out)
_CPU = {}  # "module": the built extension, or None after a failed build


def segment_table(rows: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    """The segment table as a contiguous CPU int64 tensor ``[S, 5]`` (host-side: it is read by
    the host to plan the launch, then copied to the kernel's device once per buffer layout).

    Args:
        rows: ``(start, numel, index, k0, k1)`` per fragment (ints; ``k0, k1`` uint32 words from
            :func:`faircast_dist.philox.derive_key`, ignored by error feedback), or a tensor.

    Raises:
        ValueError: wrong shape.
    """
    table = rows if isinstance(rows, torch.Tensor) else \
        torch.tensor(list(rows), dtype=torch.int64, device="cpu").view(-1, 5)
    table = table.to(device="cpu", dtype=torch.int64).contiguous()
    if table.dim() != 2 or table.shape[1] != 5:
        raise ValueError(f"segment table must be [S, 5] (start, numel, index, k0, k1), got shape {tuple(table.shape)}")
    return table


def index_runs(index: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rows ``(start, numel, index)`` of the runs of consecutive global indices in ``index``.

    A strided TP block (e.g. a row-parallel shard, from :func:`faircast_dist.shards.block_index`)
    is one row per contiguous run; append the key columns to get segment rows.

    Args:
        index: global element indices of consecutive buffer elements (any shape, read flat).
        start: buffer position of ``index``'s first element.

    Returns:
        int64 CPU tensor ``[R, 3]`` (host-side: segment rows are planned on the host).
    """
    flat = index.reshape(-1).to(device="cpu", dtype=torch.int64)
    if flat.numel() == 0:
        return torch.zeros(0, 3, dtype=torch.int64, device="cpu")
    first = torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"),
                       (flat[1:] != flat[:-1] + 1).nonzero().view(-1) + 1])
    numel = torch.diff(first, append=torch.tensor([flat.numel()], device="cpu"))
    return torch.stack([first + start, numel, flat[first]], dim=1)


def _check_buffers(method, master, out, residual):
    """Dtypes, layouts and devices (tensor metadata only: no data is read)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for name, t, dtypes in (("master", master, (torch.float32,)), ("out", out, (torch.bfloat16,)),
                            ("residual", residual, (torch.float32, torch.bfloat16))):
        if t is None:
            if name == "residual" and method == "error_feedback":
                raise ValueError("error_feedback needs a residual")
            continue
        if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous 1-D tensor of {dtypes}, got {t.dtype} "
                            f"shape {tuple(t.shape)} stride {t.stride()}")
        if t.device != master.device:
            raise ValueError(f"{name} is on {t.device}, master on {master.device}")


def _size(master, out, residual) -> int:
    """Elements every buffer has (segments must lie below it)."""
    return min(master.numel(), out.numel(), master.numel() if residual is None else residual.numel())


def _check_rows(table: torch.Tensor, size: int) -> None:
    """Every row inside ``[0, size)``, indices and keys in range, no two rows overlapping
    (``table``: the CPU table, so this reads no device memory)."""
    if table.numel() == 0:
        return
    start, numel, index, k0, k1 = table.unbind(1)
    bad = ((start < 0) | (numel < 0) | (start > size - numel) | (index < 0) | (index > 2**63 - 1 - numel)
           | (k0 < 0) | (k0 >= 2**32) | (k1 < 0) | (k1 >= 2**32))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"segment row {row} {tuple(table[row].tolist())} is out of range: needs 0 <= start, "
                         f"start + numel <= {size} (buffer elements), 0 <= index < 2**63 - numel, "
                         f"keys in [0, 2**32)")
    order = torch.argsort(start)
    ends = (start + numel)[order]
    overlap = ends[:-1] > start[order][1:]
    if bool(overlap.any()):
        i = int(overlap.nonzero()[0, 0])
        raise ValueError(f"segment rows {int(order[i])} and {int(order[i + 1])} overlap in the buffer")


class _Plan:
    """A validated segment table of one buffer layout, kept where the kernel reads it.

    ``table``: int64 ``[S, 5]`` on the kernel's device (the CPU for the CPU kernel); ``keys``:
    the ``(k0, k1)`` columns it holds now; ``grid``: Triton's ``(tile segment, tile base)``,
    int64 on the device (computed once on the host, copied once).
    """

    def __init__(self, table: torch.Tensor, keys: tuple, grid=None):
        self.table, self.keys, self.grid = table, keys, grid


_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()
PLAN_CACHE_SIZE = 1 << 16  # buffer layouts kept (LRU); a Megatron rank casts one per param shard


def clear_plans() -> None:
    """Forget every cached segment table (frees their device copies)."""
    _PLANS.clear()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device`` without blocking the host (CUDA: from pinned memory,
    ``non_blocking``; the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _plan(rows, master, out, residual, backend) -> _Plan:
    """The cached plan of ``rows`` for these buffers; built (and validated) on first use, its key
    columns refreshed (validated, copied asynchronously) only when the keys changed.

    The cache key is the static part of the rows (start, numel, index) with the backend, device
    and buffer sizes, so a buffer cast every step plans once; stochastic rounding's keys change
    every step, dithered rounding's and error feedback's never.
    """
    size = _size(master, out, residual)
    static = tuple(r[:3] for r in rows)
    keys = tuple(r[3:] for r in rows)
    cache_key = (backend, master.device, size, static)
    plan = _PLANS.get(cache_key)
    if plan is not None:
        _PLANS.move_to_end(cache_key)
        if plan.keys == keys:
            return plan
    host = segment_table(rows)
    _check_rows(host, size)  # first use: every column; then only the keys can differ
    if plan is None:
        grid = None
        if backend == "triton":
            from faircast_dist import fused_triton
            grid = tuple(_to_device(t, master.device) for t in fused_triton.tiles(host, torch.device("cpu")))
        plan = _PLANS[cache_key] = _Plan(None, None, grid)
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    plan.table = host if backend != "triton" else _to_device(host, master.device)
    plan.keys = keys
    return plan


def _cpu_module():
    """The compiled CPU kernel, built on first use; None (after one warning) if it cannot be built."""
    if "module" not in _CPU:
        _CPU["module"] = None
        try:
            from torch.utils.cpp_extension import load
            src = os.path.join(os.path.dirname(__file__), "csrc", "fused_cast.cpp")
            _CPU["module"] = load(name="faircast_fused_cast_cpu", sources=[src],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
        except Exception as err:  # no compiler, no ninja, or a failed build: the reference still works
            warnings.warn(f"faircast: the fused CPU cast kernel could not be built ({type(err).__name__}: {err}); "
                          "falling back to the plain-torch reference casts (same bits, slower)", RuntimeWarning)
    return _CPU["module"]


def resolve_backend(device: torch.device, backend: str = "auto") -> str:
    """The backend :func:`cast_flat` uses for tensors on ``device``.

    ``"auto"`` (or the ``FAIRCAST_FUSED_BACKEND`` environment variable, when set) means: the CPU
    kernel on CPU tensors, Triton on other devices, the reference where those are unavailable.

    Raises:
        ValueError: an unknown backend name.
    """
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"fused backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device.type == "cpu":
        return "cpu" if _cpu_module() is not None else "reference"
    from faircast_dist import fused_triton
    return "triton" if fused_triton.available() else "reference"


def cast_flat(method: str, master: torch.Tensor, out: torch.Tensor, segments, residual: torch.Tensor | None = None,
              backend: str = "auto") -> torch.Tensor:
    """Cast the segments of a flat fp32 buffer into a flat bf16 buffer, in one call.

    For each row ``(start, numel, index, k0, k1)``, ``out[start:start + numel]`` becomes
    bit for bit (NaN payloads aside, see the module docstring):

    * ``"stochastic"``: ``cast_stochastic(master[start:start + numel], (k0, k1), index)``;
    * ``"error_feedback"``: ``cast_error_feedback(master[s], residual[s])``, ``residual[s]``
      updated in place (the key and index columns are unused).

    Args:
        method: ``"stochastic"`` or ``"error_feedback"``.
        master: float32 1-D contiguous buffer.
        out: bfloat16 1-D contiguous buffer (same device), written in place.
        segments: ``[S, 5]`` int64 table or rows (see :func:`segment_table`; host-side, a
            device tensor is read back); rows must not overlap.
        residual: error feedback only: float32 or bfloat16 1-D contiguous buffer indexed like ``master``.
        backend: ``"auto"``, ``"cpu"``, ``"triton"`` or ``"reference"`` (see :func:`resolve_backend`).

    Returns:
        ``out``.

    Raises:
        ValueError / TypeError: a bad method, backend, dtype, layout or segment row (named).

    Per call on the host: the rows are hashed to find their cached plan (validated, and for
    Triton the table and tile grid already on the device); only changed keys (stochastic
    rounding's, every step) are validated and copied, asynchronously. Nothing waits for the device.
    """
    rows = _rows(segments)
    _check_buffers(method, master, out, residual)
    backend = resolve_backend(master.device, backend)
    if backend == "reference":
        _check_rows(segment_table(rows), _size(master, out, residual))
        for start, numel, index, k0, k1 in rows:
            s = slice(start, start + numel)
            if method == "stochastic":
                cast_stochastic(master[s], (k0, k1), index, out=out[s])
            else:
                cast_error_feedback(master[s], residual[s], out=out[s])
        return out
    plan = _plan(rows, master, out, residual, backend)
    if backend == "cpu":
        module = _cpu_module()
        if module is None or master.device.type != "cpu":
            raise ValueError(f"the cpu backend needs CPU tensors and a built kernel (device {master.device})")
        if method == "stochastic":
            module.cast_stochastic_flat(master, out, plan.table)
        else:
            module.cast_error_feedback_flat(master, residual, out, plan.table)
    else:
        from faircast_dist import fused_triton
        fused_triton.cast_flat(method, master, out, plan.table, residual, grid=plan.grid)
    return out


def _rows(segments) -> tuple:
    """``segments`` as a tuple of 5-tuples of Python ints (a tensor table is read on the host)."""
    if isinstance(segments, torch.Tensor):
        return tuple(map(tuple, segment_table(segments).tolist()))
    rows = tuple(tuple(int(v) for v in r) for r in segments)
    for i, r in enumerate(rows):
        if len(r) != 5:
            raise ValueError(f"segment table must be [S, 5] (start, numel, index, k0, k1): row {i} is {r}")
    return rows
