"""Step overhead of Fair Cast: DeepSpeed training steps with each export cast, side by side in one launch.

    python scripts/bench_step.py                                   # SmolLM2-135M, ZeRO-2 and ZeRO-2 + Offload
    python scripts/bench_step.py --model tiny --steps 5            # a quick run on a small random Llama
    torchrun --standalone --nproc_per_node 2 scripts/bench_step.py # 2 DP ranks (each casts half the model)
    python scripts/bench_step.py --threads 1 --clock cpu           # CPU time: steadier on a shared machine

The main job's trainer (``demo_deepspeed.py``: the same model, data and DeepSpeed config, bf16
with fp32 master weights, torch AdamW, ``deepspeed_hooks.initialize``) is built once per
(ZeRO config, arm) from one copy of the model, and trained on the same micro-batches:

* arms: ``nearest`` (stock DeepSpeed: no Fair Cast attached), ``stochastic``, ``error_feedback``,
  ``dithered``, and ``stochastic+monitor`` (stochastic with DeepSpeed's CSV monitor enabled in
  the config, so the drift telemetry of :mod:`deepspeed_hooks.monitor` runs every step);
* configs: ``zero2`` and ``zero2_offload`` (``offload_optimizer: cpu``, torch AdamW on the host), and
  ``fsdp2``: the same model ``fully_shard``-ed per decoder layer and at the root with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, torch AdamW, the arm installed with
  :func:`fsdp_hooks.install` (``nearest``: stock FSDP2; no ``+monitor`` arm). Under FSDP2 the cast runs
  in the first all-gather of the forward after each step, so its cost shows in the whole step, not in
  ``optimizer.step()``.

Arms run one engine at a time (memory: one trainer's worth), ``--rounds`` times with the arm
order reversed every other round so slow drifts of a shared machine fall on every arm alike. Per
arm it reports the median over all timed steps of the whole training step (forward + backward +
``engine.step()``, ms), of ``engine.step()`` alone (where the cast runs), and both as a ratio to
``nearest`` of the same config. Times are the slowest rank's. ``--json`` prints the rows.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fair_demo_common import collate, export_cast_config, load_model, make_batches  # noqa: E402

ARMS = ("nearest", "stochastic", "error_feedback", "dithered", "stochastic+monitor")
CONFIGS = ("zero2", "zero2_offload", "fsdp2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                   help="smollm2: the bundled SmolLM2-135M-Instruct (the main job's); tiny: a small random Llama")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (per arm and round)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the arms (order reversed every other)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: leave as is)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the rank's process CPU time (time.process_time), steadier than wall time on a shared "
                        "machine; meaningful with --threads 1 (it adds up the time of all threads)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    return p.parse_args(argv)


def ds_config(zero: str, arm: str, micro_batch: int, seed: int, monitor_dir: str) -> dict:
    """The main job's DeepSpeed config (demo_deepspeed.py) for one ZeRO config and arm."""
    method = arm.split("+")[0]
    zero_cfg = {"stage": 2}
    if zero == "zero2_offload":
        zero_cfg["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero_cfg,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "weight_decay": 0.0, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW on the host with offload (no JIT-built op)
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "export_cast": export_cast_config(method, seed),
    }
    if arm.endswith("+monitor"):
        cfg["csv_monitor"] = {"enabled": True, "output_path": monitor_dir, "job_name": "bench_step"}
    return cfg


def timed_steps(batches, warmup: int, clock, forward_backward, step) -> tuple[list[float], list[float]]:
    """Run ``forward_backward(ids, labels)`` then ``step()`` per batch; (whole-step ms, step ms) of the
    steps after ``warmup``, the slowest rank's (a MAX all-reduce)."""
    import torch.distributed as tdist
    whole, opt = [], []
    for i, (ids, labels) in enumerate(batches):
        tdist.barrier()
        t0 = clock()
        forward_backward(ids, labels)
        t1 = clock()
        step()
        t2 = clock()
        ms = torch.tensor([1e3 * (t2 - t0), 1e3 * (t2 - t1)], dtype=torch.float64)
        tdist.all_reduce(ms, op=tdist.ReduceOp.MAX)
        if i >= warmup:
            whole.append(float(ms[0]))
            opt.append(float(ms[1]))
    return whole, opt


def time_arm(model, batches, cfg, warmup: int, steps: int, clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """(whole-step ms, ``engine.step()`` ms) of each timed step, the slowest rank's."""
    import deepspeed_hooks
    from deepspeed import comm as dist
    model = copy.deepcopy(model)
    engine, *_ = deepspeed_hooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    whole, opt = timed_steps(batches[:warmup + steps], warmup, clock,
                             lambda ids, labels: engine.backward(engine(input_ids=ids, labels=labels).loss),
                             engine.step)
    engine.destroy()
    del engine
    gc.collect()
    return whole, opt


def time_fsdp2_arm(model, batches, arm: str, seed: int, warmup: int, steps: int,
                   clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """(whole-step ms, ``optimizer.step()`` ms) of each timed step under FSDP2, the slowest rank's."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fsdp_hooks
    model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    fsdp_hooks.install(model, optimizer, config=export_cast_config(arm, seed))
    def forward_backward(ids, labels):
        model(input_ids=ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the DeepSpeed config's gradient_clipping

    def step():
        optimizer.step()
        optimizer.zero_grad()
    whole, opt = timed_steps(batches[:warmup + steps], warmup, clock, forward_backward, step)
    del model, optimizer
    gc.collect()
    return whole, opt


def main(argv=None):
    args = parse_args(argv)
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)  # a plain `python` run is one rank
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import logger
    logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, encode = load_model(args.model)
    n = args.warmup + args.steps
    data = make_batches(encode, n * args.micro_batch * world, seed=args.seed)
    batches = [collate(data[(s * world + rank) * args.micro_batch:(s * world + rank + 1) * args.micro_batch])
               for s in range(n)]
    numel = sum(p.numel() for p in model.parameters())
    arms = {z: [a for a in args.arms if not (z == "fsdp2" and a.endswith("+monitor"))] for z in args.configs}
    samples = {(z, a): ([], []) for z in args.configs for a in arms[z]}
    with tempfile.TemporaryDirectory() as monitor_dir:
        for r in range(args.rounds):
            for zero in args.configs:
                for arm in (arms[zero] if r % 2 == 0 else arms[zero][::-1]):
                    if zero == "fsdp2":
                        whole, opt = time_fsdp2_arm(model, batches, arm, args.seed, args.warmup, args.steps, clock)
                    else:
                        whole, opt = time_arm(model, batches, ds_config(zero, arm, args.micro_batch, args.seed,
                                                                        monitor_dir), args.warmup, args.steps, clock)
                    samples[zero, arm][0].extend(whole)
                    samples[zero, arm][1].extend(opt)
                    if rank == 0 and not args.json:
                        print(f"  round {r + 1}/{args.rounds} {zero:<14}{arm:<20} step ms "
                              + " ".join(f"{x:.0f}" for x in whole), flush=True)
    rows = []
    for zero in args.configs:
        base = {k: statistics.median(samples[zero, "nearest"][i]) for i, k in enumerate(("step_ms", "opt_ms"))} \
            if "nearest" in args.arms else None
        for arm in arms[zero]:
            whole, opt = samples[zero, arm]
            row = {"config": zero, "arm": arm, "model": args.model, "params": numel, "ranks": world, "clock": args.clock,
                   "threads": torch.get_num_threads(), "steps": len(whole),
                   "step_ms": statistics.median(whole), "opt_ms": statistics.median(opt)}
            if base:
                row["step_x_nearest"] = row["step_ms"] / base["step_ms"]
                row["opt_x_nearest"] = row["opt_ms"] / base["opt_ms"]
            rows.append(row)
    if rank == 0:
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"\n{args.model} ({numel / 1e6:.1f}M params), {world} rank(s) x {torch.get_num_threads()} threads, "
                  f"micro-batch {args.micro_batch}, median of {args.rounds} x {args.steps} steps per arm"
                  f"{' (process CPU time)' if args.clock == 'cpu' else ''}:")
            print(f"  {'config':<15}{'arm':<21}{'step ms':>9}{'x nearest':>11}{'engine.step ms':>16}{'x nearest':>11}")
            for row in rows:
                print(f"  {row['config']:<15}{row['arm']:<21}{row['step_ms']:>9.0f}{row.get('step_x_nearest', 0):>11.3f}"
                      f"{row['opt_ms']:>16.1f}{row.get('opt_x_nearest', 0):>11.3f}")
    dist.barrier()
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
