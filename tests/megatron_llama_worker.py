"""HF Llama -> megatron-core GPTModel mapping (``scripts/megatron_llama.py``) in real gloo ranks.

``run(tp, model, dtype, tiny)`` spawns ``tp`` ranks (CPU shim); each builds the HF model (the same
on every rank: seeded), a GPTModel from :func:`build_gpt` + :func:`load_hf_state`, and rank 0
returns a record:

* ``hf_logits`` / ``mc_logits``: float32 ``[B, T, V]`` of the HF model (fp32) and of the Megatron
  model (``dtype``), the latter gathered over the TP vocab shards; for bf16 also
  ``hf_bf16_logits``, the HF model itself run in bf16 (its own rounding error);
* ``full_mismatch``: elements where the Megatron model gathered with Megatron's checkpoint metadata
  (:func:`megatron_patches.gather.gather_full`) differs from :func:`hf_to_megatron` cast to ``dtype`` (checks
  :func:`tp_shard` against Megatron's own TP layout); ``back_mismatch``: elements where
  :func:`megatron_to_hf` of that differs from the HF weights cast to ``dtype``;
* ``pad_grad_max`` / ``pad_weight_max``: max |grad| and |weight| on the KV-group padding after a
  backward pass (None without padding).

Also runnable by hand on the real model (prints the max |logit diff|)::

    python tests/megatron_llama_worker.py --model smollm2 --tp 2 --dtype bf16
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _ids(vocab: int, model: str, encode):
    if model == "tiny":
        g = torch.Generator().manual_seed(7)
        return torch.randint(0, vocab, (2, 12), generator=g)
    from fair_demo_common import collate, make_batches
    return collate(make_batches(encode, 4, seed=99))[0]


def _worker(rank, tp, port, model_name, dtype_name, tiny, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1 if tp > 1 else 2)
    import megatron_shim
    megatron_shim.install()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tp, 1)
    from fair_demo_common import load_model
    from megatron_llama import build_gpt, hf_to_megatron, load_hf_state, megatron_to_hf, padding_masks
    from megatron_patches.gather import gather_full
    dtype = DTYPES[dtype_name]
    hf, encode = load_model(model_name, tiny=tiny)
    hf.eval()
    hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    cfg = hf.config
    mc = build_gpt(cfg, tp, dtype)
    load_hf_state(mc, hf_state, cfg)
    ids = _ids(cfg.vocab_size, model_name, encode)
    position_ids = torch.arange(ids.shape[1]).expand_as(ids)
    logits = mc(ids, position_ids, None)  # [B, T, V / tp]
    shards = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(shards, logits.detach().contiguous())
    record = {}
    if rank == 0:
        with torch.no_grad():
            record["hf_logits"] = hf(ids).logits.float()
            if dtype == torch.bfloat16:  # the HF model's own bf16 error: the yardstick for "bf16 tolerance"
                record["hf_bf16_logits"] = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.float()
        record["mc_logits"] = torch.cat(shards, dim=-1).float()
    full = gather_full(mc, lambda p: p.detach())
    if rank == 0:
        want = {k: v.to(dtype) for k, v in hf_to_megatron(hf_state, cfg, tp).items()}
        record["full_names"] = (sorted(full) == sorted(want))
        record["full_mismatch"] = sum(int((full[k] != want[k]).sum()) for k in want)
        back = megatron_to_hf(full, cfg)
        ref = {k: v.to(dtype) for k, v in hf_state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        record["back_names"] = sorted(back) == sorted(ref)
        record["back_mismatch"] = sum(int((back[k] != ref[k]).sum()) for k in ref)
    # the padding gets exactly zero gradient (so it stays zero under AdamW without weight decay)
    logits.float().square().mean().backward()
    grads = gather_full(mc, lambda p: p.grad.detach().to(p.dtype))
    if rank == 0:
        masks = padding_masks(cfg, tp)
        record["pad_grad_max"] = max((float(grads[k][~m].float().abs().max()) for k, m in masks.items()), default=None)
        record["pad_weight_max"] = max((float(full[k][~m].float().abs().max()) for k, m in masks.items()), default=None)
        record["real_grad_nonzero"] = all(bool(g.float().abs().max() > 0) for g in grads.values())
        from helpers import save_record
        save_record(record, out_path)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run(tp: int, model: str = "tiny", dtype: str = "fp32", tiny: dict | None = None) -> dict:
    """Spawn ``tp`` ranks (TP=tp, PP=1, DP=1); rank 0's record (see the module docstring)."""
    from helpers import launch
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.pt")
        launch(_worker, tp, model, dtype, tiny, out, reported=[out])
        return torch.load(out, weights_only=False)


def main():
    p = argparse.ArgumentParser(description="HF vs Megatron logits for the Llama mapping")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = p.parse_args()
    r = run(args.tp, args.model, args.dtype)
    def compare(logits, what):
        diff = (logits - r["hf_logits"]).abs()
        top = (logits.argmax(-1) == r["hf_logits"].argmax(-1)).float().mean()
        print(f"{what} vs HF fp32: max |logit diff| {diff.max():.4g}, mean {diff.mean():.4g}, "
              f"argmax agreement {100 * top:.2f}%")
    print(f"model={args.model} tp={args.tp}, {tuple(r['hf_logits'].shape)} logits, |HF logits| max "
          f"{r['hf_logits'].abs().max():.4g}")
    compare(r["mc_logits"], f"Megatron {args.dtype}")
    if "hf_bf16_logits" in r:
        compare(r["hf_bf16_logits"], "HF bf16 (reference)")
    print(f"weights gathered with Megatron's metadata == mapping: {r['full_mismatch'] == 0}; back to HF "
          f"exact: {r['back_mismatch'] == 0}; KV padding: max |weight| {r['pad_weight_max']}, "
          f"max |grad| {r['pad_grad_max']}")


if __name__ == "__main__":
    main()
