"""The fused Triton kernels compiled ahead of time for an H100/H200 (``GPUTarget("cuda", 90, 32)``)
on this CPU machine: bf16 for both methods and both residual dtypes, FP8 for every cast and the absmax.

CI runs the kernel only under ``TRITON_INTERPRET=1``, which does not see what only the compiler
sees (types, ``tl.umulhi`` lowering, int64 offsets). The compile runs in a child process without
``TRITON_INTERPRET`` (``tests/conftest.py`` sets it for this one, where ``@triton.jit`` then gives
interpreted functions that cannot be compiled): ``tests/triton_aot_worker.py``.
"""
import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ["stochastic", "error_feedback/float32", "error_feedback/bfloat16", "fp8/nearest", "fp8/nearest_via_bf16",
            "fp8/stochastic", "fp8/error_feedback", "fp8/absmax", "fp8/nearest_via_bf16_multiply",
            "fp8/stochastic_multiply", "fp8/error_feedback_multiply"]


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(HERE, "triton_aot_worker.py"), "90", "32"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the kernel does not compile for sm_90:\n{run.stderr[-6000:]}"
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["variant"]: r for r in rows}


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_lowers_to_ptx_for_sm90(compiled, variant):
    row = compiled[variant]
    assert row["ptx_bytes"] > 0 and row["sm"]
    assert not row["fma"]  # enable_fp_fusion pinned off: EF's x + e, y - q and y - q * s are never contracted
    assert not row["approx_div"]  # FP8's y / s is the IEEE division (tl.math.div_rn), as on the CPU


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_assembles_to_cubin_for_sm90(compiled, variant):
    row = compiled[variant]
    if "cubin_skipped" in row:
        pytest.skip(f"ptxas is missing ({row['cubin_skipped']}): the kernel was lowered to PTX for sm_90, "
                    "only the assembler step (PTX -> cubin) was skipped")
    assert row["cubin_bytes"] > 0


def test_fp_fusion_is_pinned():
    from faircast_dist import fused_triton
    assert fused_triton.COMPILE_OPTIONS == {"enable_fp_fusion": False}
