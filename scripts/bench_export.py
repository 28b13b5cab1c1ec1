"""Benchmark the export casts side by side, and check that a device gives the CPU's bits.

    python scripts/bench_export.py                           # CPU, 135M elements (SmolLM2 size)
    python scripts/bench_export.py --device cuda --numel 1.7e9

Prints, for nearest / stochastic / error_feedback on one flat fp32 master of ``--numel``
elements (one "parameter", cast as one shard, as a rank casts its partition), the median wall
time in ms over ``--repeat`` runs and the ratio to nearest. With ``--check-bits`` (default on a
non-CPU device) it first casts ``--check-numel`` random fp32 bit patterns (normals, subnormals,
NaN, Inf, zeros) with contiguous and scattered indices on the device and on the CPU and reports
whether every bit agrees (DESIGN.md: CPU and GPU kernels must produce the same bits).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from faircast_dist import cast_error_feedback, cast_nearest, cast_stochastic, derive_key


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_bits(device: torch.device, numel: int) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**31, 2**31, (numel,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38, -3.4e38])
    scattered = torch.randperm(numel, generator=g) * 3 + 12345
    res = (torch.rand(numel, generator=g) - 0.5) * 1e-3
    ok = True
    for label, fn in [
        ("nearest", lambda t, d: cast_nearest(t)),
        ("stochastic, contiguous index", lambda t, d: cast_stochastic(t, derive_key(7, 3, "w"), 987654321)),
        ("stochastic, scattered index", lambda t, d: cast_stochastic(t, derive_key(7, 3, "w"), scattered.to(d))),
        ("error_feedback", lambda t, d: cast_error_feedback(t, res.clone().to(d))),
    ]:
        on_cpu, on_dev = fn(x, "cpu"), fn(x.to(device), device).cpu()
        differ = on_cpu.view(torch.int16) != on_dev.view(torch.int16)
        nan_payload = differ & torch.isnan(on_cpu) & torch.isnan(on_dev)  # NaN stays NaN; payloads may differ
        same = not bool((differ & ~nan_payload).any())
        print(f"  {label:<30} {device.type} bits == cpu bits: {same} "
              f"({int(differ.sum())} differ, {int(nan_payload.sum())} of them NaN payloads only)")
        ok &= same
    return ok


def bench(device: torch.device, numel: int, repeat: int) -> dict[str, float]:
    master = torch.randn(numel, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    residual = torch.zeros(numel, device=device)
    key = derive_key(1234, 0, "w")
    runs = {"nearest": lambda: cast_nearest(master, out),
            "stochastic": lambda: cast_stochastic(master, key, 0, out),
            "error_feedback": lambda: cast_error_feedback(master, residual, out)}
    times = {}
    for name, fn in runs.items():
        fn()  # warm-up
        sync(device)
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples.append(1e3 * (time.perf_counter() - t0))
        times[name] = statistics.median(samples)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--numel", type=float, default=135e6, help="elements in the master (135e6 = SmolLM2-135M)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--check-bits", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--check-numel", type=int, default=1 << 22)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    ok = True
    if args.check_bits or (args.check_bits is None and device.type != "cpu"):
        print(f"bitwise check, {args.check_numel} elements:")
        ok = check_bits(device, args.check_numel)
    times = bench(device, int(args.numel), args.repeat)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"export of {int(args.numel):,} fp32 elements on {name}, median of {args.repeat}:")
    for method, ms in times.items():
        print(f"  {method:<16}{ms:>10.1f} ms   x{ms / times['nearest']:.1f} of nearest")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
