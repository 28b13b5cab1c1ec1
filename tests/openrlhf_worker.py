"""OpenRLHF 0.11.2, unedited, on the CPU: its ``DeepspeedStrategy`` + ``Actor`` trained one step,
and a reference model built as its Ray actors build them, for ZeRO-2 then ZeRO-3 in one launch.

usage: [FAIRCAST_EXPORT_CAST=... faircast-run] torchrun --standalone --nproc_per_node N \\
           tests/openrlhf_worker.py OUT_DIR [STAGE ...]

Nothing here turns Fair Cast on (no ``patch_deepspeed()``, no ``export_cast`` key in any config):
under ``faircast-run`` the environment does it, and without it everything stays stock. Rank 0
prints one ``RECORD {json}`` line per stage and writes it to ``OUT_DIR/stage<N>.json``.

CPU stand-ins (OpenRLHF is written for CUDA; nothing in site-packages is edited):
* a stub ``flash_attn`` module: ``openrlhf/models/ring_attn_utils.py`` imports
  ``flash_attn.bert_padding`` / ``flash_attn.utils.distributed`` at import time (flash-attn is a
  CUDA build). It goes in after transformers has looked for flash-attn and cached "absent", so
  transformers never takes the stub for the real thing;
* ``torch.cuda.set_device`` a no-op: ``setup_distributed`` calls it when ``LOCAL_RANK`` is set;
* ``init_device_mesh("cuda", ...)`` -> ``"cpu"``, the name ``setup_distributed`` calls;
* DeepSpeed's CPU shm comm op is not JIT-built (as in ``ds_worker``; gloo does the collectives).
And ``deepspeed`` is imported before ``transformers`` (the comment there says why).
"""
from __future__ import annotations

import json
import os
import sys
import types

# transformers first, as OpenRLHF's own modules import it (it probes DeepSpeed with
# importlib.util.find_spec before anything imports it: the start-up hook must survive that)
import transformers.modeling_utils  # noqa: F401  (before the stub: transformers probes flash-attn)
from transformers.utils import import_utils

import deepspeed
import deepspeed.comm.torch  # noqa: F401

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the JIT shm op build

import_utils.is_flash_attn_2_available()  # cached False before the stub goes in
_stub = {name: types.ModuleType(name) for name in
         ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")}
for _fn in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
    setattr(_stub["flash_attn.bert_padding"], _fn, None)
_stub["flash_attn.utils.distributed"].all_gather = None
_stub["flash_attn"].bert_padding, _stub["flash_attn"].utils = _stub["flash_attn.bert_padding"], _stub["flash_attn.utils"]
_stub["flash_attn.utils"].distributed = _stub["flash_attn.utils.distributed"]
sys.modules.update(_stub)

import torch  # noqa: E402

torch.set_num_threads(1)
torch.cuda.set_device = lambda *a, **k: None

import openrlhf.utils.deepspeed.deepspeed as orl_ds  # noqa: E402
from openrlhf.models import Actor  # noqa: E402
from openrlhf.utils.deepspeed import DeepspeedStrategy  # noqa: E402

_init_device_mesh = orl_ds.init_device_mesh
orl_ds.init_device_mesh = lambda device, *a, **k: _init_device_mesh("cpu" if device == "cuda" else device, *a, **k)

from deepspeed_hooks.served import served_weights  # noqa: E402  (no patching: only the export API)
from faircast_dist import FairCaster  # noqa: E402

NS = types.SimpleNamespace
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


def tiny_llama(path: str) -> dict[str, torch.Tensor]:
    """Save a random tiny Llama (fp32) at ``path`` (rank 0; the others wait); its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                                         max_position_embeddings=128))
    if RANK == 0 and not os.path.exists(os.path.join(path, "config.json")):
        model.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def strategy_for(stage: int) -> DeepspeedStrategy:
    """What ``train_ppo_ray`` builds from its CLI (the fields ``DeepspeedStrategy`` reads)."""
    args = NS(local_rank=-1,
              ds=NS(param_dtype="bf16", zero_stage=stage, adam_offload=False, zpg=1, use_universal_ckpt=False,
                    grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1,
                    ring_attn_size=1, attn_implementation="eager", experts_implementation=None,
                    load_in_4bit=False, packing_samples=False, use_liger_kernel=False),
              train=NS(dynamic_batch_enable=False, seed=42, micro_batch_size=1, batch_size=WORLD))
    return DeepspeedStrategy(seed=42, max_norm=1.0, micro_train_batch_size=1, train_batch_size=WORLD,
                             zero_stage=stage, args=args)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def run_stage(stage: int, model_path: str, initial: dict[str, torch.Tensor]) -> dict:
    strategy = strategy_for(stage)
    strategy.setup_distributed()
    torch.distributed.barrier()  # rank 0 has saved the model
    ds = strategy.args.ds
    # PolicyModelActor.init_model_from_pretrained (openrlhf/trainer/ray/ppo_actor.py)
    actor = Actor(model_path, attn_implementation=ds.attn_implementation,
                  experts_implementation=ds.experts_implementation, param_dtype=ds.param_dtype,
                  load_in_4bit=ds.load_in_4bit, ds_config=strategy.get_ds_train_config(),
                  packing_samples=ds.packing_samples, temperature=1.0, use_liger_kernel=ds.use_liger_kernel)
    actor_cfg = dict(optim="adam", muon=dict(lr=0.02, momentum=0.95),
                     adam=dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
                     lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1.0, scheduler_steps=10)
    actor, actor_optim, actor_scheduler = strategy.prepare((actor, actor_cfg))
    # ReferenceModelActor.init_model_from_pretrained (openrlhf/trainer/ray/launcher.py)
    ref = Actor(model_path, attn_implementation=ds.attn_implementation,
                experts_implementation=ds.experts_implementation, param_dtype=ds.param_dtype,
                load_in_4bit=ds.load_in_4bit, ds_config=strategy.get_ds_eval_config(offload=False),
                packing_samples=ds.packing_samples, temperature=1.0, use_liger_kernel=ds.use_liger_kernel)
    ref = strategy.prepare(ref)
    ref.eval()

    # one training step through the strategy (as PolicyModelActor's training_step)
    g = torch.Generator().manual_seed(7 + RANK)
    seq = torch.randint(0, 256, (1, 24), generator=g)
    attention_mask = torch.ones_like(seq)
    action_mask = torch.ones(1, 12, dtype=torch.bool)
    with torch.no_grad():
        ref_logprobs = ref(seq, action_mask, attention_mask)
    logprobs = actor(seq, action_mask, attention_mask)
    loss = (-(logprobs - ref_logprobs).mean() - logprobs.mean())
    strategy.backward(loss, actor, actor_optim)
    strategy.optimizer_step(actor_optim, actor, actor_scheduler, name="actor")

    engine = actor.model
    opt = engine.optimizer
    export = getattr(opt, "export_cast", None)
    caster = None if export is None else export.caster
    rec = {"stage": stage, "world": WORLD, "zero_stage": engine.zero_optimization_stage(),
           "optimizer": type(opt).__name__, "loss": float(loss.detach()),
           "export_caster": type(caster).__name__ if caster is not None else None,
           "method": caster.method.value if caster is not None else None,
           "seed": caster.config.seed if caster is not None else None}

    # served bf16 vs round-to-nearest of the fp32 masters (DeepSpeed's own accessor)
    params = list(engine.module.named_parameters())
    rtn_differs = total = 0
    served = {}
    for name, p in params:
        with deepspeed.zero.GatheredParameters([p]):
            served[name] = p.detach().clone()
        master = deepspeed.utils.safe_get_full_fp32_param(p)
        rtn_differs += int((master.to(torch.bfloat16).view(torch.int16) != served[name].view(torch.int16)).sum())
        total += master.numel()
    rec.update(rtn_differs=rtn_differs, elements=total)

    # every served element is faircast's reference cast of the gathered master at that export step
    if export is not None:
        masters = export.gather()
        reference = FairCaster(export.caster.config)
        reference.step = export.caster.step  # the export after the k-th step draws step k's bits
        mismatch = 0
        for name, _ in params:
            m = masters[name]
            q = reference.cast(name, m.clone(), residual=torch.zeros_like(m))
            mismatch += int((q.view(torch.int16) != served[name].reshape(-1).view(torch.int16)).sum())
        rec.update(mismatch=mismatch, export_step=export.caster.step)
    else:
        rec.update(mismatch=None, export_step=None)

    # what broadcast_to_vllm (openrlhf/trainer/ray/ppo_actor.py) sends, without Ray/vLLM
    model = actor.model.module
    sent = {}
    to_sync = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not getattr(actor, "is_vlm", False)]
    for name, param in to_sync:
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
            shape = param.shape if stage != 3 else param.ds_shape
            sent[name] = param.data.clone()
            assert tuple(sent[name].shape) == tuple(shape), (name, sent[name].shape, shape)
    api = {n: t.clone() for n, t in served_weights(engine, bucket_bytes=4096)}
    rec["broadcast_names_equal"] = list(sent) == list(api)
    rec["broadcast_equal_served_weights"] = rec["broadcast_names_equal"] and all(bits_equal(sent[n], api[n]) for n in sent)
    rec["served_equal_broadcast"] = all(bits_equal(sent[n], served[n]) for n in sent)

    # the reference model: left stock, its weights the initial ones in bf16
    ref_engine = ref.model
    ref_params = list(ref_engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in ref_params]):
        ref_equal = all(bits_equal(p.detach(), initial[n].to(torch.bfloat16)) for n, p in ref_params)
    rec.update(ref_optimizer=type(ref_engine.optimizer).__name__ if ref_engine.optimizer is not None else None,
               ref_zero_stage=ref_engine.zero_optimization_stage(),
               ref_export_cast=hasattr(ref_engine.optimizer, "export_cast"),
               ref_equal_initial_bf16=ref_equal and [n for n, _ in ref_params] == list(initial))
    engine.destroy()
    ref_engine.destroy()
    return rec


def main(out_dir: str, stages: list[int]) -> None:
    model_path = os.path.join(out_dir, "tiny_llama")
    initial = tiny_llama(model_path)
    for stage in stages:
        rec = run_stage(stage, model_path, initial)
        if RANK == 0:
            print("RECORD " + json.dumps(rec), flush=True)
            with open(os.path.join(out_dir, f"stage{stage}.json"), "w") as f:
                json.dump(rec, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], [int(s) for s in sys.argv[2:]] or [2, 3])
