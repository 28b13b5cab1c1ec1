"""Benchmark the export casts side by side, and check that a device gives the CPU's bits.

    python scripts/bench_export.py                                   # CPU: 1e6, 1e7, 5e7 elements, 1 and 2 threads
    python scripts/bench_export.py --sizes 1e6 135e6 --json          # machine-readable rows
    python scripts/bench_export.py --device cuda --sizes 1.7e9 --threads 0
    python scripts/bench_export.py --threads 1 --clock cpu            # CPU time: steadier on a shared machine

On one flat fp32 master of each size (one "parameter", cast as one segment, as a rank casts its
partition) it times, in one run on the same buffers: ``.to(bfloat16)``, ``copy_`` into a bf16
buffer (the stock round to nearest), the plain-torch reference stochastic rounding / error
feedback (faircast_dist.rounding), the fused kernels (faircast_dist.fused: SR, EF with an fp32
and a bf16 residual; SR of the same elements cut into ``--tensors`` tensors, in one multi-tensor
call and in one call per tensor), and torchao's ``_fp32_to_bf16_sr`` when torchao imports (bench only; it is
in no extra). FP8 E4M3 (``"format": "fp8"``): the plain-torch spec casts (faircast_dist.rounding: nearest, SR,
EF, given per-element scales), the fused FP8 kernels (absmax; nearest, SR, EF) and a whole FP8 export of one
``[numel / 1024, 1024]`` weight with channel scales (absmax, sticky scales, dithered cast: ``ExportState.export_fp8``).
Each row: median ms over ``--repeat`` runs, GB/s of the bytes the cast must move
(SR/nearest: read 4 + write 2 B per element, FP8 write 1 B; EF: + read and write the residual, 4 or 2 B
each; the FP8 absmax reads 4 B, an FP8 export reads 4 B twice and writes 1 B), and the ratio to ``copy_``. On a shared machine timings are noisy: compare ratios within one run.

With ``--check-bits`` (default on a non-CPU device) it first casts ``--check-numel`` random fp32
bit patterns with contiguous and scattered indices on the device and on the CPU (reference) and
reports whether every bit agrees (NaN payloads aside).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from faircast_dist import derive_key, fused
from faircast_dist.rounding import (cast_error_feedback, cast_fp8_error_feedback, cast_fp8_nearest,  # the plain-
                                    cast_fp8_stochastic, cast_nearest, cast_stochastic)  # torch reference


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_bits(device: torch.device, numel: int) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**31, 2**31, (numel,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38, -3.4e38])
    scattered = torch.randperm(numel, generator=g) * 3 + 12345
    res = (torch.rand(numel, generator=g) - 0.5) * 1e-3
    key = derive_key(7, 3, "w")

    ok = True
    for label, ref, dev in [
        ("nearest", lambda: cast_nearest(x), lambda d: cast_nearest(x.to(d))),
        ("stochastic, contiguous index", lambda: cast_stochastic(x, key, 2**32 - 5),
         lambda d: cast_stochastic(x.to(d), key, 2**32 - 5)),
        ("stochastic, scattered index", lambda: cast_stochastic(x, key, scattered),
         lambda d: cast_stochastic(x.to(d), key, scattered.to(d))),
        ("fused stochastic", lambda: cast_stochastic(x, key, 2**32 - 5),
         lambda d: fused.cast_flat("stochastic", x.to(d), torch.empty(numel, dtype=torch.bfloat16, device=d),
                                   [(0, numel, 2**32 - 5, *key)])),
        ("error_feedback", lambda: cast_error_feedback(x, res.clone()), lambda d: cast_error_feedback(x.to(d), res.to(d))),
        ("fused error_feedback", lambda: cast_error_feedback(x, res.clone()),
         lambda d: fused.cast_flat("error_feedback", x.to(d), torch.empty(numel, dtype=torch.bfloat16, device=d),
                                   [(0, numel, 0, 0, 0)], res.to(d))),
    ] + fp8_checks(x, key, res):
        on_cpu, on_dev = ref(), dev(device).cpu()
        width = torch.int16 if on_cpu.element_size() == 2 else torch.uint8
        differ = on_cpu.view(width) != on_dev.view(width)
        if on_cpu.dtype == torch.float8_e4m3fn:
            on_cpu, on_dev = on_cpu.float(), on_dev.float()
        nan_payload = differ & torch.isnan(on_cpu) & torch.isnan(on_dev)  # NaN stays NaN; payloads may differ
        same = not bool((differ & ~nan_payload).any())
        print(f"  {label:<30} {device.type} bits == cpu reference bits: {same} "
              f"({int(differ.sum())} differ, {int(nan_payload.sum())} of them NaN payloads only)")
        ok &= same
    return ok


def fp8_checks(x: torch.Tensor, key, res: torch.Tensor) -> list:
    """``(label, cpu reference, device cast)`` of the fused FP8 casts: ``x`` as ``[numel / 96, 96]`` weights with
    scales 2**-8 .. 2**4, channel and block rows cut mid-row (E4M3 bytes compared; EF: its bytes)."""
    n = x.numel() // 96 * 96
    g = torch.Generator().manual_seed(1)
    scales = 2.0 ** torch.randint(-8, 5, (n // 96,), generator=g).float() * (1 + torch.rand(n // 96, generator=g))
    checks = []
    for gran, nbk in (("channel", 0), ("block", 1)):
        rows = fused.segment_table([(0, 0, n // 2, 0, *key, 0, 96, nbk), (0, n // 2, n - n // 2, n // 2, *key, 0, 96, nbk)],
                                   columns=fused.FP8_COLUMNS)
        for method in ("nearest", "stochastic", "error_feedback"):
            def cast(device, backend, method=method, rows=rows):
                out = torch.zeros(n, dtype=torch.uint8, device=device)
                r = [res[:n].to(device, copy=True)] if method == "error_feedback" else None
                fused.cast_fp8(method, [x[:n].to(device)], [out], rows, scales.to(device), r, backend=backend)
                return out.view(torch.float8_e4m3fn)
            checks.append((f"fused FP8 {method}, {gran}", lambda cast=cast: cast("cpu", "reference"),
                           lambda d, cast=cast: cast(d, "auto")))
    return checks


def torchao_sr():
    """torchao's stochastic rounding (torch.randint bits), or None when torchao does not import."""
    try:
        from torchao.optim.quant_utils import _fp32_to_bf16_sr
    except Exception:
        return None
    return _fp32_to_bf16_sr


def cases(device: torch.device, numel: int, tensors: int):
    """``{name: (fn, bytes moved)}`` on shared buffers."""
    master = torch.randn(numel, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    res32 = torch.zeros(numel, device=device)
    res16 = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    key = derive_key(1234, 0, "w")
    table = fused.segment_table([(0, numel, 0, *key)])
    run = {
        ".to(bfloat16)": (lambda: master.to(torch.bfloat16), 6),
        "copy_": (lambda: out.copy_(master), 6),
        "reference SR": (lambda: cast_stochastic(master, key, 0, out), 6),
        "reference EF": (lambda: cast_error_feedback(master, res32, out), 14),
        "fused SR": (lambda: fused.cast_flat("stochastic", master, out, table), 6),
        "fused EF": (lambda: fused.cast_flat("error_feedback", master, out, table, res32), 14),
        "fused EF bf16 residual": (lambda: fused.cast_flat("error_feedback", master, out, table, res16), 10),
    }
    if tensors > 1:  # the same elements as many small params (a Megatron Float16 optimizer's masters)
        masters, outs = list(master.chunk(tensors)), list(out.chunk(tensors))
        rows = [(k, 0, t.numel(), 0, *key) for k, t in enumerate(masters)]
        run[f"fused SR, {len(masters)} tensors, 1 call"] = (
            lambda: fused.cast_tensors("stochastic", masters, outs, rows), 6)
        run[f"fused SR, {len(masters)} tensors, 1 call each"] = (
            lambda: [fused.cast_flat("stochastic", m, o, [(0, m.numel(), 0, *key)]) for m, o in zip(masters, outs)], 6)
    ao = torchao_sr()
    if ao is not None:
        run["torchao SR"] = (lambda: ao(master), 6)
    run.update(fp8_cases(master, key, res32))
    return run


def fp8_cases(master: torch.Tensor, key, residual: torch.Tensor) -> dict:
    """The FP8 rows on one ``[numel / 1024, 1024]`` weight with channel scales: the plain-torch spec casts (given
    per-element scales), the fused casts and absmax (faircast_dist.fused: one segment row), and a whole dithered
    FP8 export (absmax, sticky scales, cast: ``ExportState.export_fp8``, fused)."""
    from faircast_dist.export import ExportState, Shard
    from faircast_dist.fp8 import ScaleRule, element_scales, partial_absmax
    numel = master.numel() // 1024 * 1024
    x, shape = master[:numel], (numel // 1024, 1024)
    layout = ScaleRule("channel")
    index = layout.scale_index(shape, 0, numel, device=x.device)
    scales = layout.scales(partial_absmax(x, index, shape[0]))
    scale = element_scales(scales, index)
    out8 = torch.empty(numel, dtype=torch.uint8, device=x.device)
    absmax = torch.zeros(shape[0], device=x.device)
    rows = fused.segment_table([(0, 0, numel, 0, *key, 0, shape[1], 0)], columns=fused.FP8_COLUMNS)
    res = residual[:numel]
    state = ExportState({"mode": "fair", "method": "dithered", "format": "fp8"}, shapes={"w.weight": shape})
    shard = Shard("w.weight", x, torch.empty(numel, dtype=torch.bfloat16, device=x.device),
                  [("w.weight", 0, numel, 0)])
    return {"FP8 nearest (spec)": (lambda: cast_fp8_nearest(x, scale), 5),
            "FP8 SR (spec)": (lambda: cast_fp8_stochastic(x, scale, key, 0), 5),
            "FP8 EF (spec)": (lambda: cast_fp8_error_feedback(x, scale, res), 13),
            "fused FP8 absmax": (lambda: fused.fp8_absmax([x], rows, absmax), 4),
            "fused FP8 nearest": (lambda: fused.cast_fp8("nearest", [x], [out8], rows, scales), 5),
            "fused FP8 SR": (lambda: fused.cast_fp8("stochastic", [x], [out8], rows, scales), 5),
            "fused FP8 EF": (lambda: fused.cast_fp8("error_feedback", [x], [out8], rows, scales, [res]), 13),
            "FP8 export, dithered, channel scales": (lambda: state.export_fp8([shard]), 9)}


def bench(device: torch.device, numel: int, repeat: int, tensors: int = 0, clock=time.perf_counter) -> list[dict]:
    rows = []
    for name, (fn, nbytes) in cases(device, numel, tensors).items():
        fn()  # warm-up (and the CPU kernel's build on first use)
        sync(device)
        samples = []
        for _ in range(repeat):
            t0 = clock()
            fn()
            sync(device)
            samples.append(1e3 * (clock() - t0))
        ms = statistics.median(samples)
        rows.append({"case": name, "numel": numel, "ms": ms, "GB/s": nbytes * numel / ms / 1e6})
    copy_ms = next(r["ms"] for r in rows if r["case"] == "copy_")
    for r in rows:
        r["x copy_"] = r["ms"] / copy_ms
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 5e7],
                   help="elements per master (135e6 = SmolLM2-135M, 1.7e9 = Qwen3-1.7B)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads (CPU); 0 = leave as is")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    p.add_argument("--check-bits", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--check-numel", type=int, default=1 << 22)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this thread's CPU time (time.thread_time), steadier than wall time on a shared "
                        "machine; CPU device with --threads 1 only (the work must run on the calling thread)")
    p.add_argument("--tensors", type=int, default=272,
                   help="also cast the master as this many tensors, in one multi-tensor call and in one call "
                        "each (272 = SmolLM2's param count); 0 = skip")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.clock == "cpu" and (device.type != "cpu" or args.threads != [1]):
        p.error(f"--clock cpu needs --device cpu --threads 1 (got {args.device}, {args.threads})")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    ok = True
    if args.check_bits or (args.check_bits is None and device.type != "cpu"):
        print(f"bitwise check, {args.check_numel} elements:")
        ok = check_bits(device, args.check_numel)
    backend = fused.resolve_backend(device)
    rows = []
    for threads in args.threads:
        if threads:
            torch.set_num_threads(threads)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
        for numel in map(int, args.sizes):
            part = bench(device, numel, args.repeat, args.tensors, clock)
            for r in part:
                r.update(device=where, threads=torch.get_num_threads(), fused_backend=backend, clock=args.clock)
            rows += part
            if not args.json:
                print(f"\n{numel:,} fp32 elements on {where} (fused backend: {backend}), median of {args.repeat}"
                      f"{' (thread CPU time)' if args.clock == 'cpu' else ''}:")
                print(f"  {'case':<38}{'ms':>10}{'GB/s':>9}{'x copy_':>9}")
                for r in part:
                    print(f"  {r['case']:<38}{r['ms']:>10.2f}{r['GB/s']:>9.1f}{r['x copy_']:>9.2f}")
    if args.json:
        print(json.dumps(rows, indent=1))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
