"""Compile the fused Triton cast kernels (bf16 and FP8) ahead of time for a GPU target, on a machine without one.

Run as a script (``tests/test_triton_aot.py`` does, in a process without ``TRITON_INTERPRET``:
under the interpreter ``@triton.jit`` gives functions that cannot be compiled)::

    python tests/triton_aot_worker.py ARCH WARP_SIZE

    python tests/triton_aot_worker.py 90 32 --without-ptxas   # the PTX-only path, as without ptxas

Prints one JSON line per kernel variant (:data:`VARIANTS`: bf16 stochastic; error feedback with an
fp32 and a bf16 residual; FP8 nearest, nearest via bf16, stochastic, error feedback and the absmax):
``{"variant", "ptx_bytes", "sm" (the PTX targets sm_ARCH), "fma" (an FMA in the PTX), "approx_div"
(an approximate fp32 division: FP8's y / s must be ``div.rn``), "cubin_bytes"}``, or
``"cubin_skipped": reason`` instead of ``cubin_bytes`` when no ``ptxas`` is found (the PTX is then
lowered without it; only the assembler step is skipped). A kernel that does not compile raises (a non-zero exit with Triton's ``CompilationError``). The argument types
are those :mod:`faircast_dist.fused_triton` launches with (master as int32, served bf16 as int16,
E4M3 as uint8, the residual as fp32 / int16, tables int64); the options are the kernel's pinned ones.
"""
import json
import os
import re
import sys

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET (the interpreter cannot compile)"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from faircast_dist import fused_triton  # noqa: E402

_BF16 = {"master_ptr": "*i32", "out_ptr": "*i16", "seg_ptr": "*i64", "tile_seg_ptr": "*i64", "tile_base_ptr": "*i64",
         "EF": "constexpr", "RES_BF16": "constexpr", "BLOCK": "constexpr"}
_FP8 = {"master_ptr": "*i32", "out_ptr": "*u8", "res_ptr": "*fp32", "scale_ptr": "*fp32", "mult_ptr": "*fp32",
        "seg_ptr": "*i64", "tile_seg_ptr": "*i64", "tile_base_ptr": "*i64", "MODE": "constexpr", "VIA_BF16": "constexpr",
        "MUL": "constexpr", "BLOCK": "constexpr"}
_ABSMAX = {"master_ptr": "*i32", "res_ptr": "*fp32", "amax_ptr": "*i32", "seg_ptr": "*i64", "tile_seg_ptr": "*i64",
           "tile_base_ptr": "*i64", "Y": "constexpr", "BLOCK": "constexpr"}
# variant: (kernel name, signature, constexprs) as fused_triton launches them (FP8: master as int32, E4M3 as uint8)
VARIANTS = {
    "stochastic": ("_cast_kernel", {**_BF16, "res_ptr": "*i32"}, {"EF": False, "RES_BF16": False}),
    "error_feedback/float32": ("_cast_kernel", {**_BF16, "res_ptr": "*fp32"}, {"EF": True, "RES_BF16": False}),
    "error_feedback/bfloat16": ("_cast_kernel", {**_BF16, "res_ptr": "*i16"}, {"EF": True, "RES_BF16": True}),
    "fp8/nearest": ("_fp8_cast_kernel", _FP8, {"MODE": 0, "VIA_BF16": False, "MUL": False}),
    "fp8/nearest_via_bf16": ("_fp8_cast_kernel", _FP8, {"MODE": 0, "VIA_BF16": True, "MUL": False}),
    "fp8/stochastic": ("_fp8_cast_kernel", _FP8, {"MODE": 1, "VIA_BF16": False, "MUL": False}),
    "fp8/error_feedback": ("_fp8_cast_kernel", _FP8, {"MODE": 2, "VIA_BF16": False, "MUL": False}),
    # scale rules whose codes multiply (faircast_dist.fp8.ScaleRule: verl's, vLLM's block quantizer)
    "fp8/nearest_via_bf16_multiply": ("_fp8_cast_kernel", _FP8, {"MODE": 0, "VIA_BF16": True, "MUL": True}),
    "fp8/stochastic_multiply": ("_fp8_cast_kernel", _FP8, {"MODE": 1, "VIA_BF16": False, "MUL": True}),
    "fp8/error_feedback_multiply": ("_fp8_cast_kernel", _FP8, {"MODE": 2, "VIA_BF16": False, "MUL": True}),
    "fp8/absmax": ("_fp8_absmax_kernel", _ABSMAX, {"Y": 2}),
}


def ptxas_missing(arch: int) -> str | None:
    """Why Triton cannot assemble PTX for ``arch`` here (no ``ptxas``), or None when it can."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        get_ptxas(arch).path
    except RuntimeError as err:  # "Cannot find ptxas-blackwell": neither TRITON_*_PATH nor the wheel's bin/
        return str(err)
    return None


def compile_ptx_only(src, target: GPUTarget, options: dict) -> str:
    """The stages of ``triton.compile`` up to PTX (the LLVM NVPTX backend; no ``ptxas``)."""
    from triton._C.libtriton import ir
    backend = triton.compiler.make_backend(target)
    opts = backend.parse_options({**options, "ptx_version": 84})  # PTX 8.4 (CUDA 12.4), which sm_90 takes
    stages = {}
    backend.add_stages(stages, opts, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    metadata = {"target": target, **opts.__dict__}
    for ext, stage in stages.items():
        if ext == "cubin":
            break
        module = stage(module, metadata)
    return module


def main(arch: int, warp_size: int, without_ptxas: bool = False) -> None:
    target = GPUTarget("cuda", arch, warp_size)
    missing = "forced by --without-ptxas" if without_ptxas else ptxas_missing(arch)
    for variant, (kernel, signature, constexprs) in VARIANTS.items():
        src = ASTSource(fn=getattr(fused_triton, kernel), signature=signature,
                        constexprs={**constexprs, "BLOCK": fused_triton.BLOCK})
        options = dict(fused_triton.COMPILE_OPTIONS)
        if missing is None:
            kernel = triton.compile(src, target=target, options=options)
            ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
        else:
            ptx, cubin = compile_ptx_only(src, target, options), None
        row = {"variant": variant, "ptx_bytes": len(ptx), "sm": f"sm_{arch}" in ptx,
               "fma": bool(re.search(r"\bfma\.", ptx)),
               "approx_div": bool(re.search(r"\b(div\.(full|approx)|rcp\.approx)\.f32", ptx))}
        row.update({"cubin_bytes": len(cubin)} if cubin is not None else {"cubin_skipped": missing})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), "--without-ptxas" in sys.argv[3:])
