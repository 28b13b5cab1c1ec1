"""Rollout throughput side by side, in one launch: HF ``generate`` (a bf16 copy per rank), one vLLM engine on
rank 0 serving both ranks, and one vLLM engine per rank (each worker bound to its own core).

    torchrun --standalone --nproc_per_node 2 scripts/bench_rollout.py [--model tiny|smollm2] [--batches 5]

Each batch is every rank's ``--prompts x --group`` requests of the RL loop (``scripts/rl_grpo.py``: chain-sum
prompts, temperature 1, up to ``--max-new-tokens``, stop at EOS). Prints completion tokens/s over all ranks
(median over batches, the first batch of each layout left out as warm-up) and the weight-sync time of a full
update into each engine, and the ratios to HF. Engines start one layout at a time (start-up printed apart).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rl_grpo  # noqa: E402
from rl.engines import RolloutEngine, VllmEngine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rank per batch")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="[default: 4 tiny, 24 smollm2]")
    p.add_argument("--batches", type=int, default=6, help="batches per layout (the first is warm-up)")
    p.add_argument("--out-dir", default="runs/bench_rollout")
    args = p.parse_args()
    new_tokens = args.max_new_tokens or (4 if args.model == "tiny" else 24)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    task = rl_grpo.Task(args.model)
    policy_args = rl_grpo.parse_args(["--model", args.model, "--warm-steps", "0", "--out-dir", args.out_dir])
    model = rl_grpo.build_policy(policy_args, task, rank)
    data = task.problems(args.batches * args.prompts * world, seed=5)
    served = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]

    def run(name, engine):
        t0 = time.perf_counter()
        engine.load_weights(iter(served))
        sync_ms = 1e3 * (time.perf_counter() - t0)
        rates = []
        for b in range(args.batches):
            entries = [data[(b * world + rank) * args.prompts + i] for i in range(args.prompts)]
            dist.barrier()
            t0 = time.perf_counter()
            out = engine.generate([task.prompt(e) for e in entries for _ in range(args.group)], new_tokens,
                                  seed=1000 * b + rank)
            took = torch.tensor([float(out["mask"].sum()), time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took[:1])
            dist.all_reduce(took[1:], op=dist.ReduceOp.MAX)  # the batch is done when the slowest rank is
            rates.append(took[0].item() / took[1].item())
        sync = torch.tensor([sync_ms])
        dist.all_reduce(sync, op=dist.ReduceOp.MAX)
        return dict(layout=name, tok_s=statistics.median(rates[1:]), sync_ms=sync.item())

    rows = [run("HF generate, a bf16 copy per rank", RolloutEngine(model, task.eos, task.pad))]
    t0 = time.perf_counter()
    shared = VllmEngine(model, task.eos, task.pad, args.out_dir)
    start_shared = time.perf_counter() - t0
    rows.append(run("vLLM, one engine on rank 0 for both ranks", shared))
    if rank == 0:
        shared.llm.llm_engine.engine_core.shutdown()
    del shared
    dist.barrier()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(rank)  # each rank's engine worker on its own core
    t0 = time.perf_counter()
    own = VllmEngine(model, task.eos, task.pad, os.path.join(args.out_dir, f"rank{rank}"), per_rank=True)
    start_own = time.perf_counter() - t0
    rows.append(run("vLLM, one engine per rank", own))
    if rank == 0:
        base = rows[0]["tok_s"]
        print(f"\nmodel {args.model}, {world} ranks x {args.prompts} prompts x {args.group} completions, "
              f"<= {new_tokens} new tokens; median over {args.batches - 1} batches")
        print("| layout | completion tok/s (all ranks) | x HF | full sync ms |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['layout']} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f} | {r['sync_ms']:.0f} |")
        print(f"vLLM start-up: one engine {start_shared:.0f} s; one per rank {start_own:.0f} s (both at once)")
    dist.barrier()
    dist.destroy_process_group()  # not left to interpreter exit, where gloo can abort


if __name__ == "__main__":
    main()
