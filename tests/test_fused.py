"""Fused casts (faircast_dist.fused): every backend gives the reference's bits on every input class.

The reference (faircast_dist.rounding + philox) is the spec. The CPU kernel is tested on full-size
inputs; Triton runs under TRITON_INTERPRET=1 (numpy on the CPU), so it gets small ones.
"""
import itertools
import math
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # (conftest sets it first; kept for running this file alone)

import pytest
import torch

from faircast_dist import block_index, derive_key, fused
from faircast_dist.rounding import cast_stochastic  # the reference: the kernels are tested against it
from faircast_dist.rounding import BF16_MAX
from helpers import bits
from test_philox import KAT, python_philox
from test_rounding import TINY_SUB, random_fp32_patterns


def _triton_ok():
    from faircast_dist import fused_triton
    return fused_triton.available()


BACKENDS = [pytest.param("cpu"),
            pytest.param("triton", marks=pytest.mark.skipif(not _triton_ok(), reason="triton is not installed"))]
SIZE = {"cpu": 1 << 17, "triton": 1 << 11}  # elements per random test (the interpreter is slow)


def assert_same_bits(got, want):
    """Identical bits, except that NaN may be any NaN on both sides (fused.py's NaN rule)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    differ = (bits(got) != bits(want)) & ~nan
    assert not differ.any(), f"{int(differ.sum())} elements differ, first at {int(differ.nonzero()[0, 0])}"


def special_values():
    """Edge classes: ±0, ±Inf, NaNs (with sign and payload), subnormals, saturation at bf16 max."""
    sub = [TINY_SUB * k for k in (0.25, 0.5, 1, 1.5, 7.25, 255.9)] + [1e-45, 1e-39, 1.17e-38]
    near_max = [float(BF16_MAX), 3.39e38, 3.4e38, 3.4028235e38, 3.3e38]
    pos = [0.0, math.inf, 1.0, 1.0 + 2**-8, 1.0 - 2**-20, 65504.0] + sub + near_max
    x = torch.tensor(pos + [-v for v in pos], dtype=torch.float32)
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -0x00400000, -0x007FFFFF, 0x7F80FFFF], dtype=torch.int32)
    return torch.cat([x, nans.view(torch.float32)])


def inputs(n, seed):
    """n fp32 values: random bit patterns (every class), then normals, then the special values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([random_fp32_patterns(n // 2, seed), torch.randn(n // 2, generator=g) * 10.0 ** torch.randint(
        -30, 30, (n // 2,), generator=g), special_values()])
    return x


def reference(method, master, segments, residual=None):
    out = torch.zeros(master.shape, dtype=torch.bfloat16)
    res = None if residual is None else residual.clone()
    fused.cast_flat(method, master, out, segments, res, backend="reference")
    return out, res


def random_segments(n, g, mid_block=True, high_index=False):
    """Random cut of [0, n) into segments with gaps (padding), keys and global indices."""
    cuts = sorted(set(torch.randint(0, n, (6,), generator=g).tolist()) | {0, n})
    rows = []
    for a, b in zip(cuts, cuts[1:]):
        if torch.rand(1, generator=g).item() < 0.2:
            continue  # a gap: padding that no segment covers
        index = int(torch.randint(0, 1 << 20, (1,), generator=g)) * (1 if mid_block else 8)
        if high_index:
            index += (1 << 32) - 7 if torch.rand(1, generator=g).item() < 0.5 else 3 << 40
        k0, k1 = torch.randint(0, 1 << 32, (2,), generator=g, dtype=torch.int64).tolist()
        rows.append((a, b - a, index, k0, k1))
    return rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("high_index", [False, True])
def test_stochastic_equals_reference_on_random_splits(backend, high_index):
    n = SIZE[backend]
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = inputs(n, seed)
        rows = random_segments(x.numel(), g, high_index=high_index)
        out = torch.zeros(x.shape, dtype=torch.bfloat16)
        fused.cast_flat("stochastic", x, out, rows, backend=backend)
        want, _ = reference("stochastic", x, rows)
        assert_same_bits(out, want)  # gaps stay zero on both sides


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_segment_equals_whole_param_cast(backend):
    """Segments starting mid Philox block, at the 2**32 counter boundary and far above it."""
    n = SIZE[backend] // 4
    x = inputs(n, 7)
    key = derive_key(5, 9, "layers.0.w")
    for index in (0, 1, 7, 8, 13, 2**32 - 3, 2**32, 2**45 + 5, 2**63 - x.numel() - 1):
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        fused.cast_flat("stochastic", x, out, [(0, x.numel(), index, *key)], backend=backend)
        assert_same_bits(out, cast_stochastic(x, key, index))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_tp_block_as_runs(backend):
    """A row-parallel (dim 1) TP shard: one segment per run of consecutive global indices."""
    shape, tp = (24, 40) if backend == "triton" else (96, 200), 4
    x = inputs(shape[0] * shape[1], 11)[:shape[0] * shape[1]].view(shape)
    key = derive_key(1, 2, "linear_proj.weight")
    for r, xs in enumerate(x.chunk(tp, dim=1)):
        xs = xs.contiguous()
        index = block_index(shape, (0, r * xs.shape[1]), xs.shape)
        runs = fused.index_runs(index)
        assert runs.shape[0] == shape[0]  # one run per row
        table = torch.cat([runs, torch.tensor(key).expand(runs.shape[0], 2)], dim=1)
        out = torch.empty(xs.numel(), dtype=torch.bfloat16)
        fused.cast_flat("stochastic", xs.view(-1), out, table, backend=backend)
        assert_same_bits(out, cast_stochastic(xs, key, index).view(-1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_equals_reference_over_steps(backend, residual_dtype):
    n = SIZE[backend]
    g = torch.Generator().manual_seed(1)
    x = inputs(n, 1)
    fin = torch.isfinite(x)
    rows = random_segments(x.numel(), g)
    # residuals: zeros, -0, half-ulp sized values, subnormals
    res = torch.where(fin, (torch.rand(x.shape, generator=g) - 0.5) * x.abs() * 2**-8, 0.0)
    res[::5] = 0.0
    res[1::7] = -0.0
    res[2::11] = TINY_SUB * 3
    res = res.to(residual_dtype)
    ref_res = res.clone()
    for step in range(3):
        out = torch.zeros(x.shape, dtype=torch.bfloat16)
        fused.cast_flat("error_feedback", x, out, rows, res, backend=backend)
        want, ref_res = reference("error_feedback", x, rows, ref_res)
        assert_same_bits(out, want)
        assert torch.equal(bits(res), bits(ref_res)), f"residual bits differ at step {step}"
        x = torch.where(fin, x + 1e-6 * x.abs(), x)  # a small update between steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stays_nan_with_sign_and_inf_saturation(backend):
    """The kernels' own rules where the reference leaves torch free: NaN -> quiet NaN, sign kept."""
    x = special_values()
    key = derive_key(0, 0, "edge")
    out, res = torch.empty(x.shape, dtype=torch.bfloat16), torch.zeros(x.shape)
    for method in fused.KERNELS:
        fused.cast_flat(method, x, out, [(0, x.numel(), 3, *key)], res, backend=backend)
        nan = torch.isnan(x)
        assert torch.isnan(out[nan]).all() and torch.isfinite(out[torch.isfinite(x)]).all()
        assert torch.equal(torch.signbit(out), torch.signbit(x))
        assert torch.equal(bits(out)[nan], (bits(x)[nan] >> 16).to(torch.int16) | 0x40)
        assert out[~nan].float().abs().max() == math.inf and out[torch.isfinite(x)].float().abs().max() == BF16_MAX


@pytest.mark.parametrize("backend", BACKENDS)
def test_untouched_outside_segments_and_empty_table(backend):
    x = torch.randn(100)
    out = torch.full((100,), 7.0, dtype=torch.bfloat16)
    res = torch.full((100,), 0.5)
    fused.cast_flat("error_feedback", x, out, [(10, 20, 0, 0, 0)], res, backend=backend)
    assert (out[:10] == 7).all() and (out[30:] == 7).all() and (res[:10] == 0.5).all() and (res[30:] == 0.5).all()
    fused.cast_flat("stochastic", x, out, torch.zeros(0, 5, dtype=torch.int64), backend=backend)
    assert (out[:10] == 7).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method,residual_dtype", [("stochastic", None), ("error_feedback", torch.float32),
                                                   ("error_feedback", torch.bfloat16)])
def test_cast_tensors_equals_cast_flat_per_tensor(backend, method, residual_dtype):
    """Many small tensors (sizes 0..~300, rows in random order, some tensors without rows) in one
    call == cast_flat on each tensor: outputs and residuals, bit for bit."""
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(0, 300 if backend == "cpu" else 60, (40 if backend == "cpu" else 8,), generator=g).tolist()
    masters = [inputs(n, k)[:n] for k, n in enumerate(sizes)]
    residuals = None if residual_dtype is None else [
        ((torch.rand(n, generator=g) - 0.5) * 1e-3).to(residual_dtype) for n in sizes]
    per_tensor = [random_segments(n, g, high_index=k % 3 == 0) if n > 1 else [] for k, n in enumerate(sizes)]
    rows = [(k, *r) for k, rs in enumerate(per_tensor) for r in rs]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    outs = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    res = None if residuals is None else [r.clone() for r in residuals]
    fused.cast_tensors(method, masters, outs, rows, res, backend=backend)
    for k, n in enumerate(sizes):
        want, want_res = reference(method, masters[k], per_tensor[k], None if residuals is None else residuals[k])
        assert_same_bits(outs[k], want)
        if res is not None:
            assert torch.equal(bits(res[k]), bits(want_res))


def test_cast_tensors_bad_rows_are_named():
    masters, outs = [torch.zeros(4), torch.zeros(6)], [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(6, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"0 <= tensor < 2"):
        fused.cast_tensors("stochastic", masters, outs, [(2, 0, 1, 0, 0, 0)])
    with pytest.raises(ValueError, match=r"start \+ numel <= 4"):
        fused.cast_tensors("stochastic", masters, outs, [(0, 0, 5, 0, 0, 0)])
    with pytest.raises(ValueError, match="overlap"):
        fused.cast_tensors("stochastic", masters, outs, [(1, 0, 3, 0, 0, 0), (0, 1, 2, 0, 0, 0), (1, 2, 2, 0, 0, 0)])
    fused.cast_tensors("stochastic", masters, outs, [(1, 0, 3, 0, 0, 0), (0, 1, 2, 0, 0, 0), (1, 3, 2, 0, 0, 0)])
    with pytest.raises(TypeError, match=r"outs\[1\] must be a contiguous 1-D"):
        fused.cast_tensors("stochastic", masters, [outs[0], masters[1]], [])
    with pytest.raises(ValueError, match="outs has 1 tensors"):
        fused.cast_tensors("stochastic", masters, outs[:1], [])
    with pytest.raises(TypeError, match="residuals must share one dtype"):
        fused.cast_tensors("error_feedback", masters, outs, [], [torch.zeros(4), torch.zeros(6, dtype=torch.bfloat16)])


def test_cpu_kernel_thread_count_does_not_change_bits():
    x = inputs(1 << 18, 3)
    rows = random_segments(x.numel(), torch.Generator().manual_seed(3))
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(fused.cast_flat("stochastic", x, torch.zeros(x.shape, dtype=torch.bfloat16), rows,
                                        backend="cpu"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(outs[0]), bits(outs[1])) and torch.equal(bits(outs[0]), bits(outs[2]))


@pytest.mark.parametrize("rows,match", [
    ([(0, 11, 0, 0, 0)], "out of range"),
    ([(-1, 2, 0, 0, 0)], "out of range"),
    ([(0, 2, -5, 0, 0)], "out of range"),
    ([(0, 2, 0, 2**32, 0)], "out of range"),
    ([(0, 5, 0, 0, 0), (4, 3, 0, 0, 0)], "overlap"),
])
def test_bad_segments_are_named(rows, match):
    with pytest.raises(ValueError, match=match):
        fused.cast_flat("stochastic", torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16), rows)


def test_bad_arguments_are_named():
    x, out = torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="method must be one of"):
        fused.cast_flat("nearest", x, out, [])
    with pytest.raises(ValueError, match="needs a residual"):
        fused.cast_flat("error_feedback", x, out, [])
    with pytest.raises(TypeError, match="out must be a contiguous 1-D"):
        fused.cast_flat("stochastic", x, out.float(), [])
    with pytest.raises(TypeError, match="master must be a contiguous 1-D"):
        fused.cast_flat("stochastic", torch.zeros(20)[::2], out, [])
    with pytest.raises(ValueError, match="fused backend must be one of"):
        fused.cast_flat("stochastic", x, out, [], backend="cuda")
    with pytest.raises(ValueError, match=r"must be \[S, 5\]"):
        fused.segment_table(torch.zeros(3, 4, dtype=torch.int64))


def test_rows_of_the_other_width_are_refused():
    """Six 5-column rows are 30 numbers, five 6-column rows too: neither is re-read in the other width."""
    masters = [torch.zeros(10), torch.zeros(10)]
    outs = [torch.zeros(10, dtype=torch.bfloat16) for _ in masters]
    with pytest.raises(ValueError, match=r"must be \[S, 6\]"):
        fused.cast_tensors("stochastic", masters, outs, [(0, 0, 0, 0, 0)] * 6)
    with pytest.raises(ValueError, match=r"must be \[S, 5\]"):
        fused.cast_flat("stochastic", masters[0], outs[0], [(0, 0, 0, 0, 0, 0)] * 5)
    with pytest.raises(ValueError, match=r"must be \[S, 5\]"):
        fused.segment_table([0, 10, 0, 1, 2])  # one row, not nested
    assert fused.segment_table([]).shape == (0, 5) and fused.segment_table([], columns=6).shape == (0, 6)


@pytest.mark.skipif(not _triton_ok(), reason="triton is not installed")
def test_triton_philox_known_answers():
    """Random123 kat_vectors through the kernel's own Philox (uint32 words, tl.umulhi)."""
    from faircast_dist import fused_triton
    for counter, key, expected in KAT:
        ctr = torch.tensor([counter] * 2, dtype=torch.int64)
        assert tuple(fused_triton.philox4x32_10(ctr, key)[0].tolist()) == expected
    g = torch.Generator().manual_seed(0)
    ctr = torch.randint(0, 2**32, (64, 4), generator=g, dtype=torch.int64)
    key = (0xDEADBEEF, 0x01234567)
    assert [tuple(r) for r in fused_triton.philox4x32_10(ctr, key).tolist()] == \
        [python_philox(r, key) for r in ctr.tolist()]


def test_index_runs():
    index = torch.tensor([5, 6, 7, 100, 101, 3, 9, 10])
    assert fused.index_runs(index, start=2).tolist() == [[2, 3, 5], [5, 2, 100], [7, 1, 3], [8, 2, 9]]


@pytest.mark.parametrize("method", ["nearest", "stochastic", "error_feedback", "dithered"])
def test_caster_cast_flat_equals_cast_per_fragment(method):
    """FairCaster.cast_flat (one fused call) == FairCaster.cast on each fragment, at two steps."""
    from faircast_dist import FairCaster
    config = {"mode": "fair" if method != "nearest" else "nearest",
              "method": method if method != "nearest" else "stochastic", "seed": 3}
    flat_caster, ref_caster = FairCaster(config), FairCaster(config)
    x = inputs(1 << 12, 5)
    frags = [("a.weight", 0, 1000, 17), ("b.weight", 1000, 2000, 2**33 + 3), ("a.weight", 3100, 900, 1017)]
    res = torch.full(x.shape, 1e-3)
    ref_res = res.clone()
    for _ in range(2):
        out = torch.zeros(x.shape, dtype=torch.bfloat16)
        flat_caster.cast_flat(x, out, frags, res)
        want = torch.zeros(x.shape, dtype=torch.bfloat16)
        for name, start, numel, index in frags:
            s = slice(start, start + numel)
            ref_caster.cast(name, x[s], index, out=want[s], residual=ref_res[s], backend="reference")
        assert_same_bits(out, want)
        assert torch.equal(res, ref_res)
        flat_caster.advance()
        ref_caster.advance()
    if method == "error_feedback":
        with pytest.raises(ValueError, match="needs a residual"):
            flat_caster.cast_flat(x, out, frags)


def test_without_a_compiler_the_reference_runs_after_one_warning(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no c++ compiler")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(fused, "_CPU", {})
    monkeypatch.delenv(fused.BACKEND_ENV, raising=False)
    x, key = inputs(1 << 10, 2), derive_key(1, 1, "w")
    with pytest.warns(RuntimeWarning, match="falling back to the plain-torch reference"):
        assert fused.resolve_backend(torch.device("cpu")) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only one warning
        out = fused.cast_flat("stochastic", x, torch.empty(x.shape, dtype=torch.bfloat16), [(0, x.numel(), 5, *key)])
    assert_same_bits(out, cast_stochastic(x, key, 5))


def test_cpu_build_key_covers_source_flags_and_versions(monkeypatch):
    key = fused.cpu_build_key(b"src")
    assert fused.cpu_build_key(b"src") == key and fused.cpu_build_key(b"src2") != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert fused.cpu_build_key(b"src") != key
    monkeypatch.undo()
    monkeypatch.setattr(fused, "CPU_CFLAGS", ("-O2",))
    assert fused.cpu_build_key(b"src") != key
    monkeypatch.undo()
    monkeypatch.setenv(fused.MARCH_ENV, "x86-64-v3")  # an AVX2 build of the same source
    assert "-march=x86-64-v3" in fused.cpu_cflags() and fused.cpu_build_key(b"src") != key
    for bad in ("x; touch /tmp/pwned", "x86-64-v3 -DX=1"):  # it goes into the build's shell command
        monkeypatch.setenv(fused.MARCH_ENV, bad)
        with pytest.raises(ValueError, match="FAIRCAST_CPU_MARCH=.* is not a -march value"):
            fused.cpu_cflags()
    monkeypatch.setenv(fused.MARCH_ENV, " ")
    assert "-march=native" in fused.cpu_cflags()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/another/venv/torch/__init__.py")  # another venv's torch
    assert fused.cpu_build_key(b"src") != key


def _empty_build_dir(monkeypatch, tmp_path):
    """An empty kernel build folder under ``tmp_path``, with the fallback wait at 0.5 s."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv(fused.LOCK_WAIT_ENV, "0.5")
    monkeypatch.delenv(fused.BACKEND_ENV, raising=False)
    monkeypatch.setattr(fused, "_CPU", {})
    with open(os.path.join(os.path.dirname(fused.__file__), "csrc", "fused_cast.cpp"), "rb") as f:
        build = tmp_path / "faircast" / fused.cpu_build_key(f.read())
    build.mkdir(parents=True)
    return build


def test_a_build_lock_left_by_a_killed_build_is_removed_and_the_build_goes_on(monkeypatch, tmp_path):
    """torch's ``lock`` left behind by a killed build (torch waits on it forever; every rank of
    every later run did): removed with a warning naming it, then the kernel is built."""
    import torch.utils.cpp_extension
    build = _empty_build_dir(monkeypatch, tmp_path)
    (build / "lock").write_text("")
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda **kw: seen.append((build / "lock").exists()) or "kernel")
    with pytest.warns(RuntimeWarning, match=f"removed {build / 'lock'}, left by a build .* killed"):
        assert fused.resolve_backend(torch.device("cpu")) == "cpu"
    assert seen == [False]


def test_a_live_build_elsewhere_is_a_bounded_wait_then_the_reference(monkeypatch, tmp_path):
    """Another process building (it holds the turn): waited on, then the reference, not a hang."""
    import fcntl
    build = _empty_build_dir(monkeypatch, tmp_path)
    (build / "lock").write_text("")  # the live build's own torch lock: left alone
    with open(build / "faircast.lock", "a") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        with pytest.warns(RuntimeWarning, match=f"another process has been building .* in {build} for 0.5 s"):
            assert fused.resolve_backend(torch.device("cpu")) == "reference"
    assert (build / "lock").exists()


@pytest.mark.slow
def test_two_checkouts_share_one_cpu_kernel_build(tmp_path):
    """Two copies of the package (checkouts, venvs, nodes sharing a home) build the kernel once:
    the second finds the first's build and does not recompile it."""
    import shutil
    import subprocess
    import sys
    ext = tmp_path / "ext"
    probe = "import torch, faircast_dist.fused as f; print(f.__file__, f.resolve_backend(torch.device('cpu')))"
    built = []
    for copy in ("a", "b"):
        shutil.copytree(os.path.dirname(fused.__file__), tmp_path / copy / "faircast_dist")
        env = dict(os.environ, PYTHONPATH=str(tmp_path / copy), TORCH_EXTENSIONS_DIR=str(ext))
        env.pop(fused.BACKEND_ENV, None)
        out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0 and out.stdout.split() == [str(tmp_path / copy / "faircast_dist" / "fused.py"),
                                                              "cpu"], out.stderr
        (so,) = (ext / "faircast").glob("*/*.so")
        built.append(so.stat().st_mtime_ns)
    assert built[0] == built[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_casts_are_fused_and_equal_the_reference(backend):
    """faircast_dist.cast_stochastic / cast_error_feedback (the fast casts, any shape) give the
    reference's bits: int and tensor (strided TP block) indices, non-contiguous master and out."""
    import faircast_dist
    from faircast_dist import rounding
    assert faircast_dist.cast_stochastic is fused.cast_stochastic
    assert faircast_dist.cast_error_feedback is fused.cast_error_feedback
    shape = (24, 40) if backend == "triton" else (96, 200)
    x = inputs(shape[0] * shape[1], 11)[:shape[0] * shape[1]].view(shape)
    key = derive_key(5, 2, "w")
    cols = shape[1] // 4
    block = block_index((shape[0], shape[1] * 3), (0, cols), shape)  # a row-parallel TP shard: runs per row
    for master, index in [(x, 0), (x, 2**33 + 5), (x.t(), 7), (x, block)]:
        out = torch.zeros(master.shape[::-1], dtype=torch.bfloat16).t()  # non-contiguous out
        got = faircast_dist.cast_stochastic(master, key, index, out=out, backend=backend)
        assert got is out
        assert_same_bits(got, rounding.cast_stochastic(master, key, index))
    for dtype in (torch.float32, torch.bfloat16):
        res = (torch.randn(shape) * 1e-3).to(dtype)
        ref_res = res.clone()
        for _ in range(2):
            got = faircast_dist.cast_error_feedback(x, res, backend=backend)
            assert_same_bits(got, rounding.cast_error_feedback(x, ref_res))
            assert torch.equal(bits(res), bits(ref_res))


# ----------------------------------------------------------------------------------------- fp32 -> FP8 E4M3
FP8_BACKENDS = BACKENDS


def fp8_inputs(n, seed):
    """n fp32 values for the FP8 casts (with scales 2**-8 .. 2**4): :func:`inputs`, then E4M3 ties, the
    subnormal grid's ties and values around 448 * scale (saturation), each at scale 1."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints: ties to even in nearest
    near = torch.cat([ties, grid, 448 + torch.tensor([1e-3, 15.99, 16.0, 16.01, 1e3]), (torch.rand(64, generator=g) * 2**-6)])
    near = torch.cat([near, -near])
    return torch.cat([inputs(n, seed)[:n], near])


def fp8_rows(sizes, g, granularity):
    """Random FP8 rows over flat buffers of ``sizes``: params ``[N, K]`` (K not a multiple of 128, one a single
    column) cut into runs at random points (mid-row, mid-block), spread over the buffers with gaps; returns
    ``(rows, number of scales)``."""
    rows, offset = [], 0
    for t, size in enumerate(sizes):
        pos = 0
        while pos < size:
            k = int(torch.randint(1, 300, (1,), generator=g)) if t % 2 == 0 else 1
            n = int(torch.randint(1, 300, (1,), generator=g))
            nbk = -(-k // 128) if granularity == "block" else 0
            first = int(torch.randint(0, n * k, (1,), generator=g))
            numel = min(int(torch.randint(1, n * k - first + 1, (1,), generator=g)), size - pos)
            k0, k1 = torch.randint(0, 1 << 32, (2,), generator=g, dtype=torch.int64).tolist()
            rows.append((t, pos, numel, first, k0, k1, offset, k, nbk))
            offset += n if granularity == "channel" else -(-n // 128) * nbk
            pos += numel + int(torch.randint(0, 3, (1,), generator=g))
    return rows, offset


@pytest.mark.parametrize("backend", FP8_BACKENDS)
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_fp8_kernels_equal_the_spec(backend, granularity):
    """fp8_absmax and cast_fp8 (nearest, nearest via bf16, stochastic, error feedback over 3 exports; codes
    dividing by the scales, and multiplying by separate multipliers) on random rows over several buffers == the
    reference backend (rounding.cast_fp8_*, fp8.partial_absmax): the E4M3 bytes exactly, the absmax and the
    residuals bit for bit (NaN residuals: NaN on both sides)."""
    g = torch.Generator().manual_seed(21)
    sizes = [SIZE[backend] // 2, 3000, SIZE[backend] // 4]
    masters = [fp8_inputs(n, k) for k, n in enumerate(sizes)]
    rows, num_scales = fp8_rows([m.numel() for m in masters], g, granularity)
    scales = 2.0 ** torch.randint(-8, 5, (num_scales,), generator=g).float() * (1 + torch.rand(num_scales, generator=g))
    scales[::7] = 2.0 ** torch.randint(-8, 5, (len(scales[::7]),), generator=g).float()  # ties stay ties
    # multipliers near 1 / scale but not it (a kernel dividing instead, or using the scale, gives other codes)
    multipliers = (1.0 / scales) * (1 + torch.rand(num_scales, generator=g) * 2 ** -6)
    residuals = [(torch.rand(m.numel(), generator=g) - 0.5) * 1e-2 for m in masters]
    for r in residuals:
        r[::5] = 0.0  # the master itself (a -0 master stays -0)
    for y_of, res, via in [("master", None, False), ("bf16", None, True), ("master + residual", residuals, False)]:
        got, want = (torch.zeros(num_scales) for _ in range(2))
        fused.fp8_absmax(masters, rows, got, res, via_bf16=via, backend=backend)
        fused.fp8_absmax(masters, rows, want, res, via_bf16=via, backend="reference")
        assert torch.equal(bits(got), bits(want)), f"absmax of {y_of}"
    for (method, via), mult in itertools.product(
            [("nearest", False), ("nearest", True), ("stochastic", False), ("error_feedback", False)],
            [None, multipliers]):
        res = {b: [r.clone() for r in residuals] if method == "error_feedback" else None for b in (backend, "reference")}
        for export in range(3 if method == "error_feedback" else 1):
            out = {b: [torch.full(m.shape, 0x55, dtype=torch.uint8) for m in masters] for b in res}
            for b in res:
                fused.cast_fp8(method, masters, out[b], rows, scales, res[b], via_bf16=via, backend=b,
                               multipliers=mult)
            for k in range(len(masters)):
                differ = out[backend][k] != out["reference"][k]
                assert not differ.any(), (f"{method} via_bf16={via} multipliers={mult is not None} export {export}: "
                                          f"{int(differ.sum())} bytes differ in buffer {k}, first at "
                                          f"{int(differ.nonzero()[0, 0])}")
                if method == "error_feedback":
                    assert_same_bits(res[backend][k], res["reference"][k])


def test_fp8_cpu_kernel_thread_count_does_not_change_bits():
    g = torch.Generator().manual_seed(5)
    masters = [fp8_inputs(1 << 18, 5)]
    rows, num_scales = fp8_rows([masters[0].numel()], g, "channel")
    results = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            absmax, out = torch.zeros(num_scales), [torch.zeros(masters[0].shape, dtype=torch.uint8)]
            fused.fp8_absmax(masters, rows, absmax, backend="cpu")
            fused.cast_fp8("stochastic", masters, out, rows, absmax / 448 + 1e-30, backend="cpu")
            results.append((bits(absmax), out[0]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, results[0][0]) and torch.equal(o, results[0][1]) for a, o in results)


def test_fp8_bad_rows_and_arguments_are_named():
    x, out, scales = [torch.zeros(10)], [torch.zeros(10, dtype=torch.uint8)], torch.ones(4)
    with pytest.raises(ValueError, match="bad scale columns"):
        fused.cast_fp8("nearest", x, out, [(0, 0, 10, 0, 0, 0, 0, 0, 0)], scales)  # K = 0
    with pytest.raises(ValueError, match="bad scale columns"):
        fused.cast_fp8("nearest", x, out, [(0, 0, 10, 0, 0, 0, 0, 2, 0)], scales)  # 5 rows of 2: 5 scales > 4
    with pytest.raises(ValueError, match="bad scale columns"):
        fused.cast_fp8("nearest", x, out, [(0, 0, 10, 0, 0, 0, 0, 5, 2)], scales)  # block columns != ceil(5/128)
    with pytest.raises(ValueError, match="bad scale columns"):
        fused.fp8_absmax(x, [(0, 0, 10, 0, 0, 0, 4, 10, 1)], scales)  # the one block's scale at 4: past 4 scales
    with pytest.raises(ValueError, match="bad scale columns"):  # offset + last scale wraps past 2**63
        fused.fp8_absmax([torch.ones(2)], [(0, 0, 2, 2**62 - 1, 0, 0, 2**62, 1, 0)], torch.zeros(4))
    for start in (-0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="absmax must hold values >="):
            fused.fp8_absmax(x, [], torch.tensor([0.0, start]))
    with pytest.raises(ValueError, match=r"out of range"):
        fused.cast_fp8("nearest", x, out, [(0, 5, 10, 0, 0, 0, 0, 10, 0)], scales)
    with pytest.raises(ValueError, match="method must be one of"):
        fused.cast_fp8(None, x, out, [], scales)
    with pytest.raises(TypeError, match="scales must be a contiguous 1-D float32 tensor"):
        fused.cast_fp8("nearest", x, out, [], [1.0, 1.0])
    with pytest.raises(ValueError, match="method must be one of"):
        fused.cast_fp8("round_up", x, out, [], scales)
    with pytest.raises(ValueError, match="via_bf16 is for method 'nearest'"):
        fused.cast_fp8("stochastic", x, out, [], scales, via_bf16=True)
    with pytest.raises(TypeError, match=r"out must be|outs\[0\] must be"):
        fused.cast_fp8("nearest", x, [torch.zeros(10, dtype=torch.bfloat16)], [], scales)
    with pytest.raises(ValueError, match="error_feedback needs a residual"):
        fused.cast_fp8("error_feedback", x, out, [], scales)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"scales\[2\] is .*finite scales > 0"):
            fused.cast_fp8("nearest", x, out, [], torch.tensor([1.0, 1.0, bad]))
    with pytest.raises(ValueError, match=r"segment table must be \[S, 9\]"):
        fused.cast_fp8("nearest", x, out, [(0, 0, 10, 0, 0)], scales)


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_fp8_absmax_counts_an_overflowed_master_plus_residual_as_fp32_max(backend):
    """Error feedback's master + residual overflowing for a finite master counts as ±fp32 max in the absmax, where
    the cast saturates it (it once counted as 0: a recomputed scale then left the master out, serving ~0 for it);
    a non-finite master stays out."""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, 1.0, float("nan"), 2.0])
    res = torch.tensor([big, -big, 0.0, 1.0, float("inf")])
    absmax = torch.zeros(1)
    fused.fp8_absmax([x], [(0, 0, 5, 0, 0, 0, 0, 5, 0)], absmax, [res], backend=backend)
    assert float(absmax[0]) == big
    absmax = torch.zeros(1)
    fused.fp8_absmax([x[2:]], [(0, 0, 3, 0, 0, 0, 0, 3, 0)], absmax, [res[2:]], backend=backend)
    assert float(absmax[0]) == big  # 2 + Inf: the finite master's y overflowed (an Inf residual: saturated too)
