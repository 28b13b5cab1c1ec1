"""A tiny megatron-core GPT in real gloo processes, for the Megatron integration tests.

``run(tp, pp, dp, jobs)`` spawns ``tp * pp * dp`` ranks (CPU shim, one thread each); every rank
runs the jobs in order and rank 0 returns ``{job name: record}``. Jobs are dicts (see
:func:`_run_job`): build a model + optimizer, optionally load a checkpoint or set a fixed master
state, train / export, optionally save. What the jobs record is layout-independent and gathered
with Megatron's own checkpoint metadata (``sharded_state_dict``, by :mod:`megatron_patches.gather`),
not with megatron_patches' mapping (``layout``), so the tests check that mapping rather than repeat it:

* ``served``   — the full bf16 model after each step/export: ``{checkpoint key: int16 bits}``
  (stacked layers, the global shape);
* ``master`` / ``residual`` — the full fp32 masters / error-feedback residuals, same form;
* ``mismatch`` — served elements that differ from the single-process reference cast
  (:class:`FairCaster` on the gathered whole param, canonical name from the checkpoint key);
* ``replica_mismatch`` — elements where a rank's replica (TP-replicated layernorms and biases,
  DP replicas, the last stage's tied embedding) differs from the saved copy.

``moe`` jobs build a mixture-of-experts GPT (``SequentialMLP`` experts, the all-to-all dispatcher);
``run(..., ep=, etp=)`` sets the expert-parallel layout. Their experts' checkpoint keys carry two
stacked axes (layer, global expert).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import tempfile
import traceback
import zlib

import torch

from helpers import launch, logged_warnings, save_record

SEQ, MBS, MICRO, VOCAB = 8, 2, 2, 64


# -- model and optimizer ---------------------------------------------------------------------------
def build(tp, pp, distopt: bool, export_cast, fp16=False, how="install", telemetry: int | None = None,
          frozen: bool = False, production: dict | None = None, moe: dict | None = None):
    """GPT (SwiGLU, tied embeddings, odd sizes) -> Float16Module -> DDP -> optimizer (+ Fair Cast).
    Returns the list of model chunks (one, or one per virtual pipeline stage under ``run(..., vpp=)``),
    the optimizer and the TransformerConfig.
    ``frozen``: every param has requires_grad False (an optimizer over nothing). Every run has
    Megatron-LM's ``finalize_model_grads`` (DP grad all-reduce, tied-embedding all-reduce across PP).
    ``production``: the DDP sync funcs of Megatron-LM's training loop, with its ``ddp`` settings (e.g.
    ``overlap_grad_reduce``, ``overlap_param_gather``, ``bucket_size``) and ``sequence_parallel``. ``moe``: every layer's MLP is a mixture of experts (see :data:`MOE`,
    overridden by the dict's keys), its experts over the expert-parallel ranks that
    ``initialize_model_parallel`` set up (``run(..., ep=, etp=)``); the optimizer is then a
    ChainedOptimizer (a dense and an expert leaf)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    import megatron.core.optimizer as core_optimizer
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    import megatron_patches
    from faircast_dist import ExportCastConfig

    torch.manual_seed(1234)
    tp_random.model_parallel_cuda_manual_seed(1234)
    dtype = torch.float16 if fp16 else torch.bfloat16
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()  # run(..., vpp=): model chunks per rank
    cfg = TransformerConfig(virtual_pipeline_model_parallel_size=vpp,
        num_layers=4, hidden_size=24, num_attention_heads=4, ffn_hidden_size=20,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, use_cpu_initialization=True,
        bf16=not fp16, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, sequence_parallel=bool((production or {}).get("sequence_parallel")),
        **moe_config(moe))
    experts = {} if moe is None else dict(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                        **{"bucket_size": None, **(production or {}).get("ddp", {})})
    model = []  # the model chunks, as Megatron-LM's get_model builds them (one per virtual stage)
    for vp in range(vpp) if vpp else [None]:
        with sequence_parallel_torch_norm(cfg.sequence_parallel):
            spec = get_gpt_layer_local_spec(**experts)  # in here: it picks the norm class
            chunk = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                             pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                             post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                             share_embeddings_and_output_weights=True, vp_stage=vp)
        chunk.cuda()  # a no-op under the CPU shim
        chunk.requires_grad_(not frozen)
        model.append(DDP(cfg, ddp, Float16Module(cfg, chunk), disable_bucketing=bool(vp)))
    # as megatron/training/training.py (core_v0.16.1) train() sets up every run: the DP grad all-reduce
    # and the tied embedding's all-reduce between the first and last PP stage
    from megatron.core.distributed import finalize_model_grads
    cfg.finalize_model_grads_func = finalize_model_grads
    if production is not None:  # and the DDP sync funcs of the overlap flags
        one = (lambda funcs: funcs[0] if len(funcs) == 1 else funcs)
        if ddp.overlap_grad_reduce:  # --align-grad-reduce
            cfg.no_sync_func = one([c.no_sync for c in model])
            cfg.grad_sync_func = one([c.start_grad_sync for c in model])
        if ddp.overlap_param_gather:  # --align-param-gather
            cfg.param_sync_func = one([c.start_param_sync for c in model])
    opt_cfg = OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.01, bf16=not fp16, fp16=fp16,
                              use_distributed_optimizer=distopt, clip_grad=1.0,
                              initial_loss_scale=1.0 if fp16 else None)
    config = ExportCastConfig.from_value(export_cast)
    if how == "activate":  # the one-line activation, then the stock entry point
        megatron_patches.activate(config=config)
        optimizer = core_optimizer.get_megatron_optimizer(opt_cfg, model)
    elif how == "megatron_lm":  # activate() reading the (stand-in) Megatron-LM arguments
        megatron_patches.activate()
        optimizer = core_optimizer.get_megatron_optimizer(opt_cfg, model)
    else:
        optimizer = core_optimizer.get_megatron_optimizer(opt_cfg, model)
        if how in ("install", "uninstall"):
            megatron_patches.install(optimizer, model, config=config, telemetry=telemetry is not None,
                                     sample=telemetry or 1)  # how == "none": stock
        if how == "uninstall":  # installed, then undone: stock from here on
            megatron_patches.uninstall(optimizer)
    return model, optimizer, cfg


# MoE jobs: 4 experts, top-2, SequentialMLP experts (no grouped GEMM), no aux loss; no linear biases
# (megatron-core refuses MoE biases with expert TP > 1, and every MoE layout builds the same model)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
           moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", add_bias_linear=False)


def moe_config(moe: dict | None) -> dict:
    """TransformerConfig keys of a MoE job (``{}`` for a dense one), EP / expert TP from parallel_state."""
    if moe is None:
        return {}
    from megatron.core import parallel_state as ps
    return {**MOE, **moe, "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size()}


@contextlib.contextmanager
def sequence_parallel_torch_norm(on: bool):
    """While building a model with --sequence-parallel: megatron-core's local spec norms. Without
    Apex or TransformerEngine they are torch's (``WrappedTorchNorm``), which refuses sequence
    parallelism; this builds them without it and marks their params ``sequence_parallel`` (as Apex's
    ``FusedLayerNorm`` does), so ``finalize_model_grads`` all-reduces their grads over TP."""
    if not on:
        yield
        return
    from megatron.core.models import backends  # the local spec's norm (LocalSpecProvider.layer_norm)
    from megatron.core.transformer import transformer_block  # the final norm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class norm:  # a class, as Megatron's build_module takes a spec's function as the module itself
        def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
            module = WrappedTorchNorm(dataclasses.replace(config, sequence_parallel=False), hidden_size, eps, **kwargs)
            for p in module.parameters():
                p.sequence_parallel = True
            return module
    saved = backends.LNImpl, transformer_block.LayerNormImpl
    backends.LNImpl = transformer_block.LayerNormImpl = norm
    try:
        yield
    finally:
        backends.LNImpl, transformer_block.LayerNormImpl = saved


def leaves(optimizer):
    from megatron_patches.compat import sub_optimizers
    return sub_optimizers(optimizer)


class CopyProbe(torch.overrides.TorchFunctionMode):
    """Counts ``copy_`` calls that reach torch with a bf16 destination and one of the optimizer's
    fp32 masters of bf16 params as the source (Megatron's stock round-to-nearest copy)."""

    def __init__(self, optimizer):
        super().__init__()
        self.masters, self.count = set(), 0
        for leaf in leaves(optimizer):
            groups = getattr(leaf, "shard_fp32_from_float16_groups", None) or getattr(leaf, "fp32_from_float16_groups", [])
            self.masters |= {m.data_ptr() for group in groups for m in group}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and args[0].dtype == torch.bfloat16 and args[1].data_ptr() in self.masters:
            self.count += 1
        return func(*args, **(kwargs or {}))


def exports(optimizer):
    return [leaf.export_cast for leaf in leaves(optimizer) if hasattr(leaf, "export_cast")]


def train_step(model, optimizer, step: int):
    """One optimizer step on the model chunks ``model`` (Megatron-LM's train_step: a data iterator per chunk)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (MICRO, MBS, SEQ + 1), generator=g)  # same on every rank
    batches = [iter([(tokens[i, :, :-1].cuda(), tokens[i, :, 1:].cuda()) for i in range(MICRO)])  # .cuda(): no-op
               for _ in model]
    position_ids = torch.arange(SEQ).expand(MBS, SEQ).cuda()  # under the CPU shim

    def forward_step(data_iterator, chunk):
        x, y = next(data_iterator)
        out = chunk(x, position_ids, None, labels=y)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    optimizer.zero_grad()
    for chunk in model:
        chunk.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches if len(model) > 1 else batches[0],
                                model=model, num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS,
                                forward_only=False)
    ok, _, _ = optimizer.step()
    assert ok


# -- gathering with Megatron's own metadata (megatron_patches.gather; not megatron_patches.layout) -----
def _bits(t):
    return t.view(torch.int16).to(torch.int32) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def gather(model, local_of):
    """``{checkpoint key: full tensor}`` from each param's TP-local tensor ``local_of(param)``.

    bf16 comes back as int16 bits, fp32 as fp32. Collective over the world. Also returns the
    number of replica elements (replica_id != 0) that differ from the gathered main copy.
    """
    from megatron_patches.gather import gather_full, is_main_replica, shards
    full = gather_full(model, local_of, dst=None, stacked=True)
    replica_mismatch = sum(int((_bits(sh.data).reshape(-1).cpu() != _bits(full[key][index]).reshape(-1)).sum())
                           for key, index, sh in shards(model, local_of, stacked=True)
                           if not is_main_replica(sh.replica_id))
    count = torch.tensor([replica_mismatch], dtype=torch.int64,
                         device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(count)  # every rank's replicas (rank 0 holds few: e.g. none under PP)
    out = {k: v.view(torch.int16) if v.dtype == torch.bfloat16 else v for k, v in full.items()}
    return out, int(count)


def snapshot(model, optimizer, ef: bool):
    for chunk in model:
        if chunk.use_forward_hook:  # --overlap-param-gather: finish the all-gather the next forward would
            chunk.disable_forward_pre_hook(param_sync=True)  # (as Megatron-LM does before eval and saves)
            chunk.enable_forward_pre_hook()
    served, rep = gather(model, lambda p: p.data)
    from megatron_patches.gather import local_masters
    masters = local_masters(optimizer)
    master, _ = gather(model, lambda p: masters[id(p)])
    residual = {}
    if ef:
        res = local_masters(optimizer, residuals=True)
        residual, _ = gather(model, lambda p: res[id(p)])
    from megatron_patches.gather import shards
    axes = {key: sh.prepend_axis_num for key, _, sh in shards(model, lambda p: p.data, stacked=True)}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, axes)  # PP stages hold different keys
    axes = {k: v for d in everyone for k, v in d.items()}
    return {"served": served, "master": master, "residual": residual, "replica_mismatch": rep, "axes": axes}


def canonical(key: str, layer) -> str:
    """The canonical name of one param of a stacked checkpoint key: ``layer`` None (not stacked), the
    global layer number, or the prepended indices (``(layer, expert)`` for MoE experts: the expert after the key's
    last ``experts.``, as Megatron's per-expert checkpoint keys)."""
    index = [] if layer is None else [layer] if isinstance(layer, int) else list(layer)
    if index and re.search(r"(^|\.)layers\.(?!\d)", key):  # stacked layers (else numbered in the key)
        key = re.sub(r"(^|\.)layers\.", rf"\g<1>layers.{index.pop(0)}.", key, count=1)
    if index:
        head, _, tail = key.rpartition("experts.")
        key = f"{head}experts.{index.pop(0)}.{tail}"
    return key


def params_of(snap):
    """``(checkpoint key, canonical name, index)`` of every whole param in a snapshot: it is
    ``snap[what][key][index]`` (the stacked axes are Megatron's prepended ones, ``snap["axes"]``:
    the layer, and for MoE experts the global expert number)."""
    import itertools
    for key, master in snap["master"].items():
        axes = snap["axes"][key]
        for index in itertools.product(*(range(n) for n in master.shape[:axes])):
            yield key, canonical(key, index if axes else None), index


def reference_mismatch(config, step, snap, prev_residual):
    """Served elements != FairCaster on whole gathered params (and RTN-differs count)."""
    from faircast_dist import FairCaster
    caster = FairCaster(config)
    caster.step = step
    mismatch = differs = 0
    for key, name, index in params_of(snap):
        m, s = snap["master"][key][index], snap["served"][key][index]
        r = None
        if caster.method == "error_feedback":
            r = (prev_residual[key] if prev_residual else torch.zeros_like(snap["master"][key]))[index].clone()
        q = caster.cast(name, m.contiguous(), 0, residual=r)
        mismatch += int((q.view(torch.int16) != s).sum())
        differs += int((m.to(torch.bfloat16).view(torch.int16) != s).sum())
    return mismatch, differs


def fp8_snapshot(model, optimizer, step: int) -> dict:
    """FP8 served weights (``format "fp8"``): what ``megatron_patches.served_weights`` yields that is not bf16 (the
    FP8 params and their scales), and every param's gathered master and bf16 param of an FP8 weight (``params``)
    by canonical name (collective)."""
    import megatron_patches
    served = {n: t.clone() for n, t in megatron_patches.served_weights(model) if t.dtype != torch.bfloat16}
    snap = snapshot(model, optimizer, False)
    out = {"step": step, "served": served,
           "masters": {name: snap["master"][key][index].clone() for key, name, index in params_of(snap)},
           "params": {name: snap["served"][key][index].view(torch.bfloat16).clone()
                      for key, name, index in params_of(snap) if name in served}}
    if not exports(optimizer)[0].state.fp8.rule.sticky:  # the grid route's bf16 (served_weights(grid=True))
        out["grid"] = {n: t.clone() for n, t in megatron_patches.served_weights(model, grid=True) if n in out["params"]}
    return out


def set_state(model, optimizer, seed: int):
    """A layout-independent master (+ residual) state, placed by Megatron's metadata and ranges."""
    from megatron_patches.gather import shards
    full_cache = {}

    def full_of(name, sh, what):
        key = (name, what)
        if key not in full_cache:
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
            t = torch.randn(sh.global_shape, generator=g) * 0.05
            if what == "residual":  # a fraction of a bf16 spacing of the master
                t = t * 2.0 ** -10
            full_cache[key] = t
        return full_cache[key]

    local = {"master": {}, "residual": {}}  # what -> {id(param): TP-local fp32}
    for what, placed in local.items():
        for name, index, sh in shards(model, lambda p: placed.setdefault(id(p), torch.empty(p.shape)),
                                      stacked=True):
            sh.data.copy_(full_of(name, sh, what)[index].view(sh.data.shape))
    for leaf in leaves(optimizer):
        distributed = hasattr(leaf, "shard_fp32_from_float16_groups")
        groups = (zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups) if distributed
                  else zip(leaf.float16_groups, leaf.fp32_from_float16_groups))
        for model_group, main_group in groups:
            for p, main in zip(model_group, main_group):
                r = leaf._get_model_param_range_map(p)["param"] if distributed else None
                for what in ("master", "residual"):
                    value = local[what][id(p)].view(-1)[r.start:r.end] if distributed else local[what][id(p)]
                    if what == "master":
                        main.data.copy_(value.view(main.shape))
                    elif hasattr(leaf, "export_cast") and leaf.export_cast.residuals:
                        leaf.export_cast.residuals[id(p)].copy_(value.view(main.shape))


def export_only(model, optimizer):
    """One export without an update (the copy the optimizer step ends with, in the step's scope,
    then the gather)."""
    for leaf in leaves(optimizer):
        with leaf.export_cast.in_step():
            leaf._copy_main_params_to_model_params()
    for chunk in model:
        if chunk.ddp_config.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)


def offload_and_rebuild(model, optimizer):
    """What a colocated RL stack does between rollouts (radixark/miles' offload/onload): the bf16
    model's memory is released (here: overwritten with NaN) and rebuilt from the masters with each
    leaf's ``_copy_main_params_to_model_params`` and the DistOpt param all-gather, outside any step."""
    for p in (p for chunk in model for p in chunk.parameters()):
        p.data.fill_(float("nan"))
    for leaf in leaves(optimizer):
        leaf._copy_main_params_to_model_params()
    for chunk in model:
        if chunk.ddp_config.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)


# -- checkpoints -----------------------------------------------------------------------------------
def unwrap(model):
    """DDP -> Float16Module -> GPTModel (Megatron-LM's checkpointing unwraps the same way)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_state(model) -> dict:
    """The checkpoint's model entries, as Megatron-LM's generate_state_dict names them: ``model``, or
    ``model0``, ``model1``, ... for several chunks."""
    if len(model) == 1:
        return {"model": unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def save(model, optimizer, ckpt_dir, sharding_type):
    """As Megatron-LM's save_checkpoint (torch_dist): the content metadata handed to the
    optimizer's sharded_state_dict is saved with the checkpoint."""
    from megatron.core import dist_checkpointing
    os.makedirs(ckpt_dir, exist_ok=True)
    metadata = {"distrib_optim_sharding_type": sharding_type}
    sd = model_state(model)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=False, metadata=metadata)
    dist_checkpointing.save(sd, ckpt_dir, _strategy(), content_metadata=metadata)


def load(model, optimizer, ckpt_dir, sharding_type, fresh_metadata: bool = False):
    """As Megatron-LM's load_checkpoint: the optimizer's sharded_state_dict gets the checkpoint's
    content metadata (``fresh_metadata``: a new dict, as a custom loop might pass);
    dist-checkpointing's default strictness (``assume_ok_unexpected``)."""
    from megatron.core import dist_checkpointing
    for leaf in leaves(optimizer):  # allocate the lazy optimizer state
        if hasattr(leaf, "_init_optimizer_states_with_dummy_values") and not leaf.optimizer.state:
            leaf._init_optimizer_states_with_dummy_values()
    metadata = dist_checkpointing.load_content_metadata(ckpt_dir)
    assert metadata["distrib_optim_sharding_type"] == sharding_type, metadata
    if fresh_metadata:
        metadata = {"distrib_optim_sharding_type": sharding_type}
    sd = model_state(model)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    for name, chunk in zip([k for k in sd if k != "optimizer"], model):
        unwrap(chunk).load_state_dict(loaded[name])
    optimizer.load_state_dict(loaded["optimizer"])


def _strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


# -- jobs ------------------------------------------------------------------------------------------
def _run_job(tp, pp, job: dict) -> dict:
    """Keys: export_cast, distopt, steps, first (step number of the first step), how,
    load/save (dir) + sharding (+ fresh_metadata), set_state (seed) + exports (export-only count), fp16,
    reload (call reload_model_params at the end), param_buffer (compare the two copy paths),
    rebuild_after (step numbers after which the bf16 model is offloaded and rebuilt from the masters),
    moe (a MoE GPT: :data:`MOE` overrides; EP / expert TP as the launch's ``run(..., ep=, etp=)``),
    served_weights (record megatron_patches.served_weights and served_deltas after the steps),
    megatron_lm (the argv of the stand-in Megatron-LM's ``parse_args``; ``args`` records the parsed
    ``export_cast*``), env (``FAIRCAST_EXPORT_CAST`` during the job). ``export_cast`` is what the
    reference cast uses: the config the job must run."""
    from faircast_dist import ExportCastConfig
    config = ExportCastConfig.from_value(job.get("export_cast"))
    ef = config.effective_method == "error_feedback"
    record = {"snaps": [], "mismatch": 0, "rtn_differs": 0, "master_copies": 0}
    if "megatron_lm" in job:
        lm = megatron_lm_standin(job["megatron_lm"])
    printed = io.StringIO()  # what the build printed (the activation line), also passed on
    try:
        with contextlib.redirect_stdout(printed):
            model, optimizer, _ = build(tp, pp, job.get("distopt", True), job.get("export_cast"),
                                        fp16=job.get("fp16", False), how=job.get("how", "install"),
                                        telemetry=job.get("telemetry"), frozen=job.get("frozen", False),
                                        production=job.get("production"), moe=job.get("moe"))
    except Exception as err:  # misuse cases record the error
        record["error"] = f"{type(err).__name__}: {err}"
        return record
    finally:
        print(printed.getvalue(), end="")
        record["printed"] = printed.getvalue()
    if job.get("frozen"):
        record["installed"] = [type(e.optimizer).__name__ for e in exports(optimizer)]
        return record
    record["installed"] = [type(e.optimizer).__name__ for e in exports(optimizer)]
    record["instance_wraps"] = sorted({n for leaf in leaves(optimizer) for n in vars(leaf) if n in (
        "_copy_main_params_to_model_params", "_copy_main_params_to_param_buffer", "_copy_model_params_to_main_params",
        "step_with_ready_grads", "sharded_state_dict", "load_state_dict", "export_cast")})
    fp8 = [] if config.fp8 else None  # FP8 served weights at install (or the load), then after every export
    if job.get("load"):
        load(model, optimizer, job["load"], job.get("sharding", "dp_reshardable"), job.get("fresh_metadata", False))
        record["loaded"] = snapshot(model, optimizer, ef)
        record["loaded_step"] = [e.caster.step for e in exports(optimizer)]
    if fp8 is not None:
        fp8.append(fp8_snapshot(model, optimizer, exports(optimizer)[0].caster.step))
    if "set_state" in job or "exports" in job:  # exports of a set state (or of the model's own masters)
        if "set_state" in job:
            set_state(model, optimizer, job["set_state"])
        prev = snapshot(model, optimizer, ef)
        for _ in range(job.get("exports", 1)):
            with CopyProbe(optimizer) as probe:
                export_only(model, optimizer)
            record["master_copies"] += probe.count
            step = exports(optimizer)[0].caster.step  # the step this export drew its bits with
            if fp8 is not None:
                fp8.append(fp8_snapshot(model, optimizer, step))
            snap = snapshot(model, optimizer, ef)
            mm, dif = reference_mismatch(config, step, snap, prev["residual"])
            record["mismatch"] += mm
            record["rtn_differs"] += dif
            record["snaps"].append(snap)
            prev = snap
    prev = record["start"] = record.get("loaded") or snapshot(model, optimizer, ef)
    first = job.get("first", 0)
    record["drift"] = []
    from faircast_dist.telemetry import DriftObserver
    record["drift_on"] = [isinstance(e.telemetry, DriftObserver) for e in exports(optimizer)]
    if 0 in job.get("rebuild_after", ()):
        rebuild(model, optimizer, record, ef)
    if "model_only_load" in job:  # Megatron-LM's load_checkpoint with --no-load-optim (the model as it is)
        optimizer.reload_model_params()
        lm.global_vars.get_args().iteration = job["model_only_load"]  # then set by setup_model_and_optimizer
    record["export_steps"] = []
    for k in range(job.get("steps", 0)):
        step = exports(optimizer)[0].caster.step if exports(optimizer) else None
        if "megatron_lm" in job:
            lm.global_vars.get_args().curr_iteration = first + k  # as Megatron-LM's train() before each step
        with CopyProbe(optimizer) as probe:
            train_step(model, optimizer, first + k)
        record["master_copies"] += probe.count
        if exports(optimizer):
            step = exports(optimizer)[0].caster.step  # the step this export drew its bits with
            record["export_steps"].append(step)
        if fp8 is not None:
            fp8.append(fp8_snapshot(model, optimizer, step))
        if "megatron_lm" in job:  # as Megatron-LM's train() does after every iteration
            lm.training.training_log({}, {}, 1e-3, first + k + 1, 1.0, False, 0, 1.0, None, None, None,
                                     pg_collection=None, is_first_iteration=k == 0)
        elif job.get("telemetry"):
            from megatron_patches import drift_metrics
            record["drift"].append(drift_metrics(optimizer))
        snap = snapshot(model, optimizer, ef)
        if step is not None:
            mm, dif = reference_mismatch(config, step, snap, prev["residual"])
            record["mismatch"] += mm
            record["rtn_differs"] += dif
        record["snaps"].append(snap)
        prev = snap
        if k + 1 in job.get("rebuild_after", ()):
            rebuild(model, optimizer, record, ef)
        if job.get("save") and k + 1 == job.get("save_after", job["steps"]):
            save(model, optimizer, job["save"], job.get("sharding", "dp_reshardable"))
            record["saved"] = snap
            record["saved_step"] = [e.caster.step for e in exports(optimizer)]
    if "megatron_lm" in job:
        record["written"] = list(lm.written)
        record["args"] = {k: v for k, v in vars(lm.global_vars.get_args()).items() if k.startswith("export_cast")}
    if job.get("param_buffer"):
        record["param_buffer"] = _compare_copy_paths(model, optimizer)
    if job.get("served_weights"):  # megatron_patches.served_weights / served_deltas after the last step
        import megatron_patches
        from faircast_dist.delta import DeltaTracker
        record["served_weights"] = {n: w.view(torch.int16).clone() for n, w in megatron_patches.served_weights(model)}
        record["served_deltas"] = [(n, len(i)) for n, i, _ in megatron_patches.served_deltas(model, DeltaTracker())]
    if job.get("reload"):
        optimizer.reload_model_params()
        record["after_reload"] = snapshot(model, optimizer, ef)
    record["fp8"] = fp8
    record["replica_mismatch"] = sum(s["replica_mismatch"] for s in record["snaps"])
    return record


def rebuild(model, optimizer, record, ef: bool):
    """:func:`offload_and_rebuild`, recording the rebuilt model and each leaf's (step before, after)."""
    before = [e.caster.step for e in exports(optimizer)]
    offload_and_rebuild(model, optimizer)
    record.setdefault("rebuilt", []).append(dict(snapshot(model, optimizer, ef), steps=[
        (b, e.caster.step) for b, e in zip(before, exports(optimizer))]))


_STANDIN = []  # one set of Megatron-LM stand-ins per process, as Megatron-LM has one megatron.training


def megatron_lm_standin(argv: list[str]):
    """The Megatron-LM stand-ins (``megatron_lm_standin.py``), with ``get_args()`` parsing ``argv``
    and an empty writers' record."""

    from megatron_lm_standin import modules, parse
    if not _STANDIN:
        _STANDIN.append(modules(register=True))
    fake = _STANDIN[0]
    parsed = []

    def get_args():  # parsed at the first call, after activate() added --export-cast*, then kept (as Megatron-LM's)
        if not parsed:
            parsed.append(parse(fake, argv))
        return parsed[0]
    fake.global_vars.get_args = get_args
    fake.written.clear()
    return fake


def _compare_copy_paths(model, optimizer):
    """Bits written by _copy_main_params_to_param_buffer vs _copy_main_params_to_model_params.

    Returns one ``(differing elements, owned elements, steps advanced)`` per DistOpt leaf;
    leaves the buffers, step and residuals as they were.
    """
    results = []
    for leaf in leaves(optimizer):
        if not hasattr(leaf, "_copy_main_params_to_param_buffer"):
            continue
        export = leaf.export_cast
        step, residuals = export.caster.step, {k: v.clone() for k, v in export.residuals.items()}
        buffers = [bucket.param_data for b in leaf.buffers for bucket in b.buckets]
        saved = [t.clone() for t in buffers]

        def written(copy):
            export.caster.step = step
            for k, v in residuals.items():
                export.residuals[k].copy_(v)
            for t in buffers:
                t.fill_(float("nan"))
            with export.in_step():  # as the optimizer step calls it
                copy()
            return [_bits(export._target(s)).clone() for s in export.shards()], export.caster.step - step

        a, _ = written(leaf._copy_main_params_to_model_params)
        b, advanced = written(leaf._copy_main_params_to_param_buffer)
        results.append((sum(int((x != y).sum()) for x, y in zip(a, b)), sum(x.numel() for x in a), advanced))
        for t, v in zip(buffers, saved):
            t.copy_(v)
        export.caster.step = step
        for k, v in residuals.items():
            export.residuals[k].copy_(v)
    return results


@contextlib.contextmanager
def environment(export_cast: str | None):
    """``FAIRCAST_EXPORT_CAST`` = ``export_cast`` meanwhile, as ``faircast-run`` sets it (None: unset)."""
    from faircast_dist.config import ENV
    saved = os.environ.pop(ENV, None)
    if export_cast is not None:
        os.environ[ENV] = export_cast
    try:
        yield
    finally:
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved


def _worker(rank, world, port, tp, pp, jobs, out_path, device="cpu", ep=1, etp=None, vpp=None, cp=1):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device == "cuda":  # one rank per GPU, NCCL, no shim
        torch.cuda.set_device(rank)
    else:
        import megatron_shim
        megatron_shim.install()
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    records = {}
    try:
        for name, job in jobs.items():
            with logged_warnings() as warnings, environment(job.get("env")):
                records[name] = _run_job(tp, pp, job)
            records[name]["warnings"] = warnings
            torch.distributed.barrier()
    except Exception:
        records["__error__"] = traceback.format_exc()
        raise
    finally:
        if rank == 0:
            save_record(records, out_path)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run(tp: int, pp: int, dp: int, jobs: dict, device: str = "cpu", ep: int = 1, etp: int | None = None,
        vpp: int | None = None, cp: int = 1) -> dict:
    """Run ``jobs`` ({name: job}) on ``tp * pp * dp * cp`` spawned ranks; rank 0's records.

    ``device``: "cpu" (gloo and the CPU shim) or "cuda" (NCCL, rank r on GPU r, no shim).
    ``ep`` / ``etp``: expert-parallel and expert tensor-parallel sizes (``etp`` None: TP), for
    ``moe`` jobs; the expert data-parallel size is what is left of the world. ``vpp``: virtual
    pipeline stages (model chunks) per PP rank (``--num-layers-per-virtual-pipeline-stage``).
    ``cp``: context-parallel process groups (the DDP grad reduction and the DistributedOptimizer's
    shards span DP x CP); the model itself is not split over CP (megatron-core's local attention
    refuses CP > 1, TransformerEngine's needs CUDA): every CP rank computes on the whole sequence.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.pt")
        world = tp * pp * dp * cp
        launch(_worker, world, tp, pp, jobs, out, device, ep, etp, vpp, cp, reported=[out])
        return torch.load(out, weights_only=False)
