"""Fused casts: one call casts a whole flat fp32 buffer (a ZeRO partition, a bucket range).

The reference casts (:mod:`faircast_dist.rounding`, :mod:`faircast_dist.philox`) stay the
executable spec; the kernels here give the same bits, faster:

* ``"cpu"``: a C++ loop (``csrc/fused_cast.cpp``) built on first use with
  ``torch.utils.cpp_extension`` (ninja, ``-O3 -march=native -fopenmp -ffp-contract=off``, the way DeepSpeed builds
  its CPU ops; never ``-ffast-math``), cached under ``$TORCH_EXTENSIONS_DIR/faircast/<key>`` (:func:`_cpu_module`);
* ``"triton"``: :mod:`faircast_dist.fused_triton`, for GPU tensors (and CPU under
  ``TRITON_INTERPRET=1``, as CI tests it);
* ``"reference"``: the plain-torch casts, one call per segment.

:func:`cast_flat` (one buffer) and :func:`cast_tensors` (a list of buffers, one call: the many
small masters of an optimizer) pick one in one place; :func:`cast_stochastic` and
:func:`cast_error_feedback` (one shard of any shape, the reference's signatures; exported as
``faircast_dist.cast_stochastic`` / ``cast_error_feedback``) go through :func:`cast_flat`. A buffer is described by a
*segment table*: one row per param fragment it holds,
``(start in the buffer, numel, global index of the fragment's first element, k0, k1)``, so every
fragment keeps its own Philox key and global element indices (docs/design.md invariant 1). Keys are
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

import hashlib
import os
import warnings
from typing import Sequence

import torch

from faircast_dist import rounding
from faircast_dist.config import Method
from faircast_dist.shards import index_runs  # noqa: F401  (also fused.index_runs: strided blocks -> segment rows)

#: the bf16 kernels, by the :class:`Method` they run (:attr:`Method.kernel`: dithered rounding is the stochastic one
#: with other keys); a Method is a str, so "stochastic" / "error_feedback" name them too
KERNELS = (Method.STOCHASTIC, Method.ERROR_FEEDBACK)
#: the one table of the kernels' integer codes: ``Fp8Mode`` in ``csrc/fused_cast.cpp`` and ``MODE`` in
#: :mod:`faircast_dist.fused_triton` (the FP8 casts; the bf16 ones have a function per method)
KERNEL_CODES = {Method.NEAREST: 0, Method.STOCHASTIC: 1, Method.ERROR_FEEDBACK: 2}
BACKENDS = ("auto", "cpu", "triton", "reference")
BACKEND_ENV = "FAIRCAST_FUSED_BACKEND"  # overrides "auto" (e.g. "reference" to rule the kernels out)
_CPU = {}  # "module": the built extension, or None after a failed build


def segment_table(rows: Sequence[Sequence[int]] | torch.Tensor, columns: int = 5) -> torch.Tensor:
    """The segment table as a contiguous CPU int64 tensor ``[S, columns]``.

    Args:
        rows: ``(start, numel, index, k0, k1)`` per fragment (ints; ``k0, k1`` uint32 words from
            :func:`faircast_dist.philox.derive_key`, ignored by error feedback), or a tensor;
            with ``columns=6`` (:func:`cast_tensors`), ``(tensor, start, numel, index, k0, k1)``.

    Raises:
        ValueError: wrong shape.
    """
    table = rows if isinstance(rows, torch.Tensor) else torch.tensor(list(rows), dtype=torch.int64, device="cpu")
    if table.numel() == 0:
        table = table.reshape(0, columns)
    table = table.to(device="cpu", dtype=torch.int64).contiguous()
    if table.dim() != 2 or table.shape[1] != columns:
        head = "(start, numel, index, k0, k1)" if columns == 5 else "(tensor, start, numel, index, k0, k1)"
        raise ValueError(f"segment table must be [S, {columns}] {head}, got shape {tuple(table.shape)}")
    return table


def kernel(method, fp8: bool = False) -> Method:
    """The kernel that runs ``method`` (a :class:`Method` or its spelling): :attr:`Method.kernel`.

    Raises:
        ValueError: not a method, or one no kernel here runs (``nearest`` into bf16 is ``Tensor.to``).
    """
    methods = FP8_METHODS if fp8 else KERNELS
    try:
        run = Method(method).kernel
    except ValueError:
        run = None
    if run not in methods:
        raise ValueError(f"method must be one of {tuple(m.value for m in methods)} (or dithered), got {method!r}")
    return run


def _check(method, masters, outs, table, residuals, single, fp8=False) -> Method | None:
    """Validate the buffers and rows of :func:`cast_tensors` (``single``: name them as cast_flat does;
    ``fp8``: of :func:`cast_fp8` / :func:`fp8_absmax`, ``method`` None for the absmax); the kernel's
    :class:`Method` (:func:`kernel`), None for the absmax."""
    method = None if method is None else kernel(method, fp8)
    if residuals is None and method is Method.ERROR_FEEDBACK:
        raise ValueError("error_feedback needs a residual")
    lists = [("master", masters, (torch.float32,))]
    if outs is not None:
        lists.append(("out", outs, (torch.uint8,) if fp8 else (torch.bfloat16,)))
    if residuals is not None:
        lists.append(("residual", residuals, (torch.float32,) if fp8 else (torch.float32, torch.bfloat16)))
    for name, ts, dtypes in lists:
        if len(ts) != len(masters):
            raise ValueError(f"{name}s has {len(ts)} tensors, masters {len(masters)}")
        for i, t in enumerate(ts):
            label = name if single else f"{name}s[{i}]"
            if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous():
                raise TypeError(f"{label} must be a contiguous 1-D tensor of {dtypes}, got {t.dtype} "
                                f"shape {tuple(t.shape)} stride {t.stride()}")
            if t.device != masters[0].device:
                raise ValueError(f"{label} is on {t.device}, {'master' if single else 'masters[0]'} on {masters[0].device}")
    if residuals is not None and len({r.dtype for r in residuals}) > 1:
        raise TypeError(f"residuals must share one dtype, got {sorted({str(r.dtype) for r in residuals})}")
    if table.numel() == 0:
        return method
    tensor, start, numel, index, k0, k1 = table[:, :6].unbind(1)
    sizes = torch.tensor([min(t.numel() for t in ts) for ts in zip(*[x for _, x, _ in lists])] or [0], device="cpu")
    size = sizes[tensor.clamp(0, len(masters) - 1)]
    bad = ((tensor < 0) | (tensor >= len(masters)) | (start < 0) | (numel < 0) | (start > size - numel) | (index < 0)
           | (index > 2**63 - 1 - numel) | (k0 < 0) | (k0 >= 2**32) | (k1 < 0) | (k1 >= 2**32))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        shown = tuple(table[row].tolist()[1:] if single else table[row].tolist())[:5 if single else 6]
        where = "" if single else f"0 <= tensor < {len(masters)}, "
        raise ValueError(f"segment row {row} {shown} is out of range: needs {where}0 <= start, start + numel <= "
                         f"{int(size[row])} (buffer elements), 0 <= index < 2**63 - numel, keys in [0, 2**32)")
    order = torch.argsort(start, stable=True)
    order = order[torch.argsort(tensor[order], stable=True)]  # by tensor, then start
    ends = (start + numel)[order]
    overlap = (ends[:-1] > start[order][1:]) & (tensor[order][:-1] == tensor[order][1:])
    if bool(overlap.any()):
        i = int(overlap.nonzero()[0, 0])
        raise ValueError(f"segment rows {int(order[i])} and {int(order[i + 1])} overlap in the buffer")
    return method


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device`` without blocking the host (CUDA: from pinned memory,
    ``non_blocking``; the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


CPU_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
CPU_LDFLAGS = ("-fopenmp",)
#: replaces ``native`` in ``-march`` (e.g. ``x86-64-v3`` or ``znver3``: AVX2 code, to measure an AVX2 build on an
#: AVX-512 host with ``scripts/bench_export.py``; a build for a CPU the host lacks would stop the process)
MARCH_ENV = "FAIRCAST_CPU_MARCH"


def cpu_cflags() -> tuple[str, ...]:
    """The CPU kernel's compiler flags: :data:`CPU_CFLAGS`, with ``FAIRCAST_CPU_MARCH`` (when set) for ``native``.

    Raises:
        ValueError: ``FAIRCAST_CPU_MARCH`` is not one word of letters, digits and ``._+-`` (it goes into the build
            command; the kernel's build then falls back to the reference casts, with a warning).
    """
    import re
    march = os.environ.get(MARCH_ENV, "").strip()
    if march and not re.fullmatch(r"[A-Za-z0-9._+-]+", march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not a -march value (one word: letters, digits, ._+-)")
    return tuple(f"-march={march}" if flag == "-march=native" and march else flag for flag in CPU_CFLAGS)
#: seconds to wait for another process's build of the CPU kernel before giving up on it
LOCK_WAIT_ENV, LOCK_WAIT_S = "FAIRCAST_BUILD_LOCK_WAIT_S", 600.0


def cpu_build_key(source: bytes) -> str:
    """The CPU kernel's cache key: what makes one build differ from another.

    The C++ source, the compiler flags (:func:`cpu_cflags`), torch's and Python's versions, torch's install folder
    (the build's include paths: ninja rebuilds when they change, so two venvs sharing one build
    would rebuild it over each other) and the host CPU's feature flags (``-march=native``: nodes
    sharing a home directory may differ). Every checkout and branch with the same key shares one
    build; any difference gets a build of its own.
    """
    import platform
    import sys
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    build = (cpu_cflags(), CPU_LDFLAGS, torch.__version__, sys.version, os.path.dirname(torch.__file__), cpu)
    parts = [source, repr(build).encode()]
    return hashlib.sha1(b"\0".join(parts)).hexdigest()[:16]


def _cpu_module():
    """The compiled CPU kernel, built on first use; None (after one warning) if it cannot be built.

    The build lives in ``$TORCH_EXTENSIONS_DIR/faircast/<key>`` (default
    ``~/.cache/torch_extensions``), named by :func:`cpu_build_key` and compiled from a copy of the
    source inside it, so checkouts with the same key never rebuild over each other.

    Builders take turns on an ``flock`` of ``<build>/faircast.lock``, which the kernel releases
    when its holder dies. torch's own ``<build>/lock`` (a plain file, which torch waits on forever)
    is only ever held by the flock's holder, so one found by the next holder was left by a killed
    build: it is removed, with a warning, and the build goes on. A live build is waited on for at
    most ``FAIRCAST_BUILD_LOCK_WAIT_S`` seconds (600), then the reference casts are used, with a
    warning.
    """
    if "module" not in _CPU:
        _CPU["module"] = None
        try:
            from torch.utils.cpp_extension import load
            with open(os.path.join(os.path.dirname(__file__), "csrc", "fused_cast.cpp"), "rb") as f:
                source = f.read()
            key = cpu_build_key(source)
            root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
            build = os.path.join(root, "faircast", key)
            os.makedirs(build, exist_ok=True)
            src = os.path.join(build, "fused_cast.cpp")
            if not os.path.exists(src):  # written once, atomically: the path every checkout compiles
                with open(f"{src}.{os.getpid()}", "wb") as f:
                    f.write(source)
                os.replace(f"{src}.{os.getpid()}", src)
            with open(os.path.join(build, "faircast.lock"), "a") as turn:
                if not _take_turn(turn, build):
                    return None
                _CPU["module"] = load(name=f"faircast_fused_cast_cpu_{key}", sources=[src], build_directory=build,
                                      extra_cflags=list(cpu_cflags()), extra_ldflags=list(CPU_LDFLAGS))
        except Exception as err:  # no compiler, no ninja, or a failed build: the reference still works
            warnings.warn(f"faircast: the fused CPU cast kernel could not be built ({type(err).__name__}: {err}); "
                          "falling back to the plain-torch reference casts (same bits, slower)", RuntimeWarning)
    return _CPU["module"]


def _take_turn(turn, build: str) -> bool:
    """Hold an exclusive ``flock`` on the open file ``turn`` (released when the file is closed or
    the process dies) and clear a torch build lock ``<build>/lock`` that no live build holds.
    False, after a warning, when another process keeps the turn past ``FAIRCAST_BUILD_LOCK_WAIT_S``."""
    import fcntl
    import time
    limit = float(os.environ.get(LOCK_WAIT_ENV, LOCK_WAIT_S))
    deadline = time.monotonic() + limit
    while True:
        try:
            fcntl.flock(turn.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                warnings.warn(f"faircast: another process has been building the fused CPU kernel in {build} "
                              f"for {limit:g} s ({LOCK_WAIT_ENV}); falling back to the plain-torch reference "
                              "casts (same bits, slower)", RuntimeWarning)
                return False
            time.sleep(0.5)
    stale = os.path.join(build, "lock")
    if os.path.exists(stale):
        warnings.warn(f"faircast: removed {stale}, left by a build of the fused CPU kernel that was killed "
                      "mid-way; rebuilding", RuntimeWarning)
        os.remove(stale)
    return True


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
        method: :attr:`Method.STOCHASTIC` or :attr:`Method.ERROR_FEEDBACK` (or their strings).
        master: float32 1-D contiguous buffer.
        out: bfloat16 1-D contiguous buffer (same device), written in place.
        segments: ``[S, 5]`` int64 table or rows (see :func:`segment_table`); rows must not overlap.
        residual: error feedback only: float32 or bfloat16 1-D contiguous buffer indexed like ``master``.
        backend: ``"auto"``, ``"cpu"``, ``"triton"`` or ``"reference"`` (see :func:`resolve_backend`).

    Returns:
        ``out``.

    Raises:
        ValueError / TypeError: a bad method, backend, dtype, layout or segment row (named).
    """
    table = segment_table(segments)
    table = torch.cat([torch.zeros(table.shape[0], 1, dtype=torch.int64, device="cpu"), table], dim=1)
    _cast(method, [master], [out], table, None if residual is None else [residual], backend, single=True)
    return out


def cast_tensors(method: str, masters: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], segments,
                 residuals: Sequence[torch.Tensor] | None = None, backend: str = "auto") -> None:
    """Multi-tensor :func:`cast_flat`: the segments of many flat buffers in one call.

    Like ``multi_tensor_applier`` for the stock copy: the many small master tensors of an
    optimizer are cast by one parallel loop (CPU kernel) instead of one call each. The Triton
    backend launches one kernel per tensor that has rows (each launch covers all of its rows).

    Args:
        method: :attr:`Method.STOCHASTIC` or :attr:`Method.ERROR_FEEDBACK` (or their strings).
        masters: float32 1-D contiguous tensors (one device).
        outs: bfloat16 1-D contiguous tensors, ``outs[i]`` indexed like ``masters[i]``, written in place.
        segments: ``[S, 6]`` int64 rows ``(tensor, start, numel, index, k0, k1)``: ``tensor`` is the
            position in the lists, the rest as in :func:`cast_flat`; rows must not overlap.
        residuals: error feedback only: one float32 or bfloat16 tensor per master (one dtype for all).
        backend: see :func:`resolve_backend`.

    Raises:
        ValueError / TypeError: a bad method, backend, list length, dtype, layout or row (named).
    """
    _cast(method, list(masters), list(outs), segment_table(segments, columns=6),
          None if residuals is None else list(residuals), backend, single=False)


def _cast(method, masters, outs, table, residuals, backend, single):
    method = _check(method, masters, outs, table, residuals, single)
    if not masters:
        return
    backend = resolve_backend(masters[0].device, backend)
    if backend == "cpu":
        module = _cpu_module()
        if module is None or masters[0].device.type != "cpu":
            raise ValueError(f"the cpu backend needs CPU tensors and a built kernel (device {masters[0].device})")
        if method is Method.STOCHASTIC:
            module.cast_stochastic_multi(masters, outs, table)
        else:
            module.cast_error_feedback_multi(masters, residuals, outs, table)
    elif backend == "triton":
        from faircast_dist import fused_triton
        device = masters[0].device
        for k in torch.unique(table[:, 0]).tolist():
            rows = table[table[:, 0] == k, 1:].contiguous()
            grid = tuple(_to_device(t, device) for t in fused_triton.tiles(rows, torch.device("cpu")))
            fused_triton.cast_flat(method, masters[k], outs[k], _to_device(rows, device),
                                   None if residuals is None else residuals[k], grid=grid)
    else:
        for k, start, numel, index, k0, k1 in table.tolist():
            s = slice(start, start + numel)
            if method is Method.STOCHASTIC:
                rounding.cast_stochastic(masters[k][s], (k0, k1), index, out=outs[k][s])
            else:
                rounding.cast_error_feedback(masters[k][s], residuals[k][s], out=outs[k][s])


def _shard_buffers(master: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(contiguous flat master, bf16 tensor shaped like it to cast into: ``out`` when contiguous)."""
    target = out if out is not None and out.is_contiguous() else \
        torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    return master.contiguous().view(-1), target


def _written(target: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, filled from ``target`` when the cast could not write it directly; else ``target``."""
    return out.copy_(target) if out is not None and target is not out else target


def cast_stochastic(master: torch.Tensor, key: tuple[int, int], index: torch.Tensor | int,
                    out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Stochastic (or dithered) rounding of one shard, fused: the bits of
    :func:`faircast_dist.rounding.cast_stochastic` (NaN payloads aside, see the module docstring).

    Args:
        master: float32 shard, any shape (a non-contiguous one is cast from a contiguous copy).
        key: Philox key ``(k0, k1)`` (:func:`~faircast_dist.philox.derive_key` for stochastic
            rounding, :func:`~faircast_dist.philox.derive_dither_key` for dithered rounding).
        index: the int global index of ``master.reshape(-1)[0]`` (a contiguous run), or an int64
            tensor shaped like ``master`` of each element's global index (a strided TP block: one
            segment per run of consecutive indices; read on the host).
        out: optional bfloat16 tensor shaped like ``master``, written in place.
        backend: see :func:`resolve_backend`; ``"reference"`` calls the plain-torch cast.

    Returns:
        bfloat16 tensor shaped like ``master`` (``out`` when given).

    Raises:
        TypeError / ValueError: as the reference (dtypes, shapes, index), or a negative index.
    """
    rounding.check_stochastic_args(master, index, out)
    if resolve_backend(master.device, backend) == "reference":
        return rounding.cast_stochastic(master, key, index, out)
    flat, target = _shard_buffers(master, out)
    if isinstance(index, int):
        rows = torch.tensor([[0, flat.numel(), index]], dtype=torch.int64, device="cpu")
    else:
        rows = index_runs(index)
    keys = torch.tensor([key], dtype=torch.int64, device="cpu").expand(rows.shape[0], 2)
    cast_flat(Method.STOCHASTIC, flat, target.view(-1), torch.cat([rows, keys], dim=1), backend=backend)
    return _written(target, out)


def cast_error_feedback(master: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None,
                        backend: str = "auto") -> torch.Tensor:
    """Error-feedback cast of one shard, fused: the bits of
    :func:`faircast_dist.rounding.cast_error_feedback` (NaN payloads aside), ``residual`` updated
    in place the same way.

    Args:
        master: float32 shard, any shape (a non-contiguous one is cast from a contiguous copy).
        residual: float32 or bfloat16 contiguous tensor shaped like ``master`` (same device).
        out: optional bfloat16 tensor shaped like ``master``, written in place.
        backend: see :func:`resolve_backend`; ``"reference"`` calls the plain-torch cast.

    Returns:
        bfloat16 tensor shaped like ``master`` (``out`` when given).

    Raises:
        TypeError / ValueError: as the reference (dtypes, shapes, a non-contiguous residual).
    """
    rounding.check_error_feedback_args(master, residual, out)
    if resolve_backend(master.device, backend) == "reference":
        return rounding.cast_error_feedback(master, residual, out)
    flat, target = _shard_buffers(master, out)
    rows = torch.tensor([[0, flat.numel(), 0, 0, 0]], dtype=torch.int64, device="cpu")
    cast_flat(Method.ERROR_FEEDBACK, flat, target.view(-1), rows, residual.view(-1), backend=backend)
    return _written(target, out)


# ----------------------------------------------------------------------------------------- fp32 -> FP8 E4M3
#: :func:`cast_fp8`'s kernels (dithered rounding is the stochastic one with the dither key)
FP8_METHODS = (Method.NEAREST, Method.STOCHASTIC, Method.ERROR_FEEDBACK)
#: columns of an FP8 segment row: the six of :func:`cast_tensors`, then the offset of the param's scales in the
#: flat scales buffer, the weight's columns K and its block columns (0: channel scales; ceil(K / 128): blocks)
FP8_COLUMNS = 9


def _check_fp8_rows(table: torch.Tensor, num_scales: int) -> None:
    """Name the first FP8 row whose scale columns are out of range (a bad one would read past the scales)."""
    if table.numel() == 0:
        return
    numel, index, offset, k, nbk = table[:, 2], table[:, 3], table[:, 6], table[:, 7], table[:, 8]
    kk = k.clamp(min=1)
    last_row = torch.div(index + (numel - 1).clamp(min=0), kk, rounding_mode="floor")
    last = torch.where(nbk == 0, last_row, torch.div(last_row, 128, rounding_mode="floor") * nbk + (kk - 1) // 128)
    bad = (k < 1) | (offset < 0) | ((nbk != 0) & (nbk != (kk + 127) // 128)) | ((numel > 0) & (last >= num_scales - offset))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"FP8 segment row {row} {tuple(table[row].tolist())} has bad scale columns: needs K >= 1, "
                         f"block columns 0 or ceil(K / 128), and every scale index < {num_scales} (the scales' size)")


def _fp8_rows_reference(table: torch.Tensor):
    """``(tensor, start, numel, index, k0, k1, scale index of each element)`` per FP8 row (the reference backend;
    the layout of :class:`faircast_dist.fp8.ScaleRule`: channel ``g // K``, block ``(g // K // 128, g % K // 128)``)."""
    for tensor, start, numel, index, k0, k1, offset, k, nbk in table.tolist():
        g = torch.arange(index, index + numel, dtype=torch.int64, device="cpu")
        row = g // k
        yield tensor, start, numel, index, k0, k1, offset + (row if nbk == 0 else (row // 128) * nbk + g % k // 128)


def fp8_absmax(masters: Sequence[torch.Tensor], segments, absmax: torch.Tensor,
               residuals: Sequence[torch.Tensor] | None = None, via_bf16: bool = False, backend: str = "auto") -> None:
    """Per scale, the largest finite ``|y|`` over the FP8 rows of many flat buffers, maxed into ``absmax`` in place
    (:func:`faircast_dist.fp8.partial_absmax` of every row, in one call): ``y`` is the master, ``bf16(master)``
    with ``via_bf16``, ``master + residual`` with ``residuals`` (error feedback; saturated at fp32 max where the
    master is finite, as the cast saturates it).

    Args:
        masters: float32 1-D contiguous tensors (one device).
        segments: ``[S, 9]`` int64 rows ``(tensor, start, numel, index, k0, k1, scale offset, K, block columns)``
            (:data:`FP8_COLUMNS`; ``index`` is the flat index ``n * K + k`` of the row's first element in its
            ``[N, K]`` weight, whose scales start at ``scale offset`` in ``absmax``; keys unused).
        absmax: float32 1-D contiguous, every param's scales one after the other (zeros before the first call).
        residuals: float32 tensors indexed like ``masters``, or None.
        via_bf16: the master rounded to bf16 first (``nearest`` with ``fp8_via_bf16``).
        backend: see :func:`resolve_backend`.

    Raises:
        ValueError / TypeError: a bad dtype, layout or row (named), or an ``absmax`` holding a negative value,
            -0 or NaN.
    """
    table = segment_table(segments, columns=FP8_COLUMNS)
    _check(None, list(masters), None, table, None if residuals is None else list(residuals), False, fp8=True)
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32 or absmax.dim() != 1 \
            or not absmax.is_contiguous():
        raise TypeError(f"absmax must be a contiguous 1-D float32 tensor, got {getattr(absmax, 'dtype', type(absmax))} "
                        f"{tuple(getattr(absmax, 'shape', ()))}")
    _check_fp8_rows(table, absmax.numel())
    if bool((absmax.view(torch.int32) < 0).any() | torch.isnan(absmax).any()):  # -0.0 too: its sign bit is set
        raise ValueError("absmax must hold values >= +0 (zeros before the first call), not negative values, -0 or NaN")
    if not masters:
        return
    backend = _fp8_backend(masters[0].device, backend)
    if backend == "cpu":
        _cpu_module().fp8_absmax_multi(list(masters), [] if residuals is None else list(residuals), table, absmax,
                                       via_bf16)
    elif backend == "triton":
        from faircast_dist import fused_triton
        fused_triton.fp8_absmax(list(masters), table, absmax, residuals, via_bf16)
    else:
        for tensor, start, numel, _, _, _, sidx in _fp8_rows_reference(table):
            y = masters[tensor].narrow(0, start, numel)
            if residuals is not None:
                y = torch.where(torch.isfinite(y), torch.clamp(y + residuals[tensor].narrow(0, start, numel),
                                                               -rounding._FP32_MAX, rounding._FP32_MAX), y)  # (as the cast)
            elif via_bf16:
                y = y.to(torch.bfloat16).float()
            a = torch.where(torch.isfinite(y), y.abs(), torch.zeros((), dtype=y.dtype, device=y.device))
            absmax.scatter_reduce_(0, sidx.to(absmax.device), a.to(absmax.device), reduce="amax")


def cast_fp8(method: str, masters: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], segments,
             scales: torch.Tensor, residuals: Sequence[torch.Tensor] | None = None, via_bf16: bool = False,
             backend: str = "auto", multipliers: torch.Tensor | None = None) -> None:
    """FP8 E4M3 casts of the FP8 rows of many flat buffers, in one call: for each row, ``outs[t][start:start +
    numel]`` gets the E4M3 bits of :func:`faircast_dist.rounding.cast_fp8_nearest` (``via_bf16`` as there),
    ``cast_fp8_stochastic`` (key ``(k0, k1)``, the row's global ``index``) or ``cast_fp8_error_feedback``
    (``residuals`` updated in place) of ``masters[t][start:start + numel]`` with each element's scale (and
    multiplier), bit for bit.

    Args:
        method: a :class:`Method` (or its spelling): one of :data:`FP8_METHODS`, or dithered (the stochastic kernel).
        masters: float32 1-D contiguous tensors (one device).
        outs: uint8 1-D contiguous tensors indexed like ``masters`` (E4M3 bit patterns), written in place.
        segments: ``[S, 9]`` int64 rows, as :func:`fp8_absmax`; rows must not overlap.
        scales: float32 1-D contiguous: every param's scales one after the other (same device as ``masters``),
            finite and > 0.
        residuals: error feedback only: float32 tensors indexed like ``masters``.
        via_bf16: ``nearest`` only: round the master to bf16 first (the stacks' double rounding).
        backend: see :func:`resolve_backend`.
        multipliers: None (codes ``y / scale``) or float32 shaped like ``scales``, finite and > 0: codes
            ``y * multiplier`` (a :class:`faircast_dist.fp8.ScaleRule` whose codes multiply, as verl's and vLLM's
            block quantizers do); error feedback's residual still subtracts ``q * scale``.

    Raises:
        ValueError / TypeError: a bad method, backend, dtype, layout, row, scale or multiplier (named).
    """
    method = kernel(method, fp8=True)
    table = segment_table(segments, columns=FP8_COLUMNS)
    _check(method, list(masters), list(outs), table, None if residuals is None else list(residuals), False, fp8=True)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 1 \
            or not scales.is_contiguous():
        raise TypeError(f"scales must be a contiguous 1-D float32 tensor, got {getattr(scales, 'dtype', type(scales))} "
                        f"{tuple(getattr(scales, 'shape', ()))}")
    _check_fp8_rows(table, scales.numel())
    if via_bf16 and method is not Method.NEAREST:
        raise ValueError(f"via_bf16 is for method 'nearest' only, got {str(method)!r}")
    for name, t in (("scales", scales), ("multipliers", multipliers)):
        if t is None:
            continue
        if t is multipliers and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != scales.shape
                                 or not t.is_contiguous() or t.device != scales.device):
            raise TypeError(f"multipliers must be a contiguous float32 tensor like scales {tuple(scales.shape)}, got "
                            f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{name}[{i}] is {float(t[i])}: the FP8 casts need finite {name} > 0 "
                             "(faircast_dist.fp8.ScaleRule.next_scales sets any other one afresh)")
    if not masters:
        return
    backend = _fp8_backend(masters[0].device, backend)
    if backend == "cpu":
        _cpu_module().cast_fp8_multi(KERNEL_CODES[method], list(masters),
                                     [] if residuals is None else list(residuals), list(outs), table, scales, via_bf16,
                                     scales.new_empty(0) if multipliers is None else multipliers)
    elif backend == "triton":
        from faircast_dist import fused_triton
        fused_triton.cast_fp8(KERNEL_CODES[method], list(masters), list(outs), table, scales, residuals, via_bf16,
                              multipliers)
    else:
        for tensor, start, numel, index, k0, k1, sidx in _fp8_rows_reference(table):
            x = masters[tensor].narrow(0, start, numel)
            scale = scales.reshape(-1)[sidx.to(scales.device)].to(x.device)
            mult = None if multipliers is None else multipliers[sidx.to(scales.device)].to(x.device)
            if method is Method.STOCHASTIC:
                q = rounding.cast_fp8_stochastic(x, scale, (k0, k1), index, multiplier=mult)
            elif method is Method.ERROR_FEEDBACK:
                q = rounding.cast_fp8_error_feedback(x, scale, residuals[tensor].narrow(0, start, numel),
                                                     multiplier=mult)
            else:
                q = rounding.cast_fp8_nearest(x, scale, via_bf16=via_bf16, multiplier=mult)
            outs[tensor].narrow(0, start, numel).copy_(q.view(torch.uint8))


def _fp8_backend(device: torch.device, backend: str) -> str:
    """:func:`resolve_backend` for the FP8 casts: the CPU kernel needs CPU tensors."""
    backend = resolve_backend(device, backend)
    if backend == "cpu" and (device.type != "cpu" or _cpu_module() is None):
        raise ValueError(f"the cpu backend needs CPU tensors and a built kernel (device {device})")
    return backend
