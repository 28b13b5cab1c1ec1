"""GRPO with TRL's ``GRPOTrainer`` on DeepSpeed or FSDP2, Fair Cast at the fp32 master -> bf16 model cast.

    torchrun --standalone --nproc_per_node 2 scripts/trl_grpo.py --zero-stage 2 --method stochastic \\
        --steps 4 --output-dir runs/trl
    torchrun --standalone --nproc_per_node 2 scripts/trl_grpo.py --fsdp2 --method stochastic \\
        --steps 4 --output-dir runs/trl_fsdp2

A TRL script as its docs write one (a model path, a prompt dataset, a reward function, a
``GRPOConfig`` with ``deepspeed=<config dict>``), plus two Fair Cast lines: the ``"export_cast"``
section of the DeepSpeed config and ``deepspeed_hooks.patch_deepspeed()`` before anything calls
``deepspeed.initialize`` (accelerate calls it for the policy, ``trl/models/utils.py``
``prepare_deepspeed`` for the reference model, which has no optimizer and is left stock).

With ``--fsdp2`` (``GRPOConfig(fsdp="full_shard", fsdp_config={"version": 2, ...})``: accelerate
``fully_shard``-s every decoder layer and the root, bf16 mixed precision) Fair Cast comes from two
pieces instead: :class:`FairCastFSDP2` (a ``TrainerCallback``: :func:`fsdp_hooks.install` at
``on_train_begin``, the export state saved beside each checkpoint and reloaded on resume) and
:func:`fair_fsdp2_params` in place of TRL's ``VLLMGeneration._iter_fsdp2_params``, which sends
each fp32 param's ``full_tensor()`` for vLLM to round to nearest.

The model is a tiny random Llama with a byte-level tokenizer built here (nothing is downloaded),
saved to ``OUTPUT_DIR/model`` so TRL loads the policy and the reference model from that path.
After training every rank writes ``OUTPUT_DIR/record_rank{R}.pt`` (see :func:`record`), what
``tests/test_trl.py`` checks. ``--resume`` continues from the latest ``checkpoint-*`` in
``--output-dir`` (``trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))``).
"""
from __future__ import annotations

import argparse
import os

import deepspeed_hooks

deepspeed_hooks.patch_deepspeed()  # before anything calls deepspeed.initialize

import deepspeed  # noqa: E402
import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
import transformers.training_args  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from faircast_dist import Method  # noqa: E402


def parse_args(argv=None):
    """Command-line options (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zero-stage", type=int, choices=(2, 3), default=2)
    p.add_argument("--fsdp2", action="store_true", help="train with FSDP2 (fully_shard) instead of DeepSpeed")
    p.add_argument("--method", choices=[m.value for m in Method], default="stochastic",
                   help="the export cast (nearest: the \"export_cast\" section says mode nearest)")
    p.add_argument("--stock", action="store_true", help="no \"export_cast\" section at all (stock DeepSpeed)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: none)")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output-dir")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True)
    return p.parse_args(argv)


def ds_config(stage: int, method: str, stock: bool) -> dict:
    """The DeepSpeed config dict (``"auto"`` values are filled in from ``GRPOConfig`` by transformers)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
    }
    if not stock:
        cfg["export_cast"] = export_cast(method, stock)
    return cfg


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges (256 byte tokens + an end-of-text token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    # sorted: alphabet() comes in a different order in every process (a Rust HashSet)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def save_tiny_model(path: str) -> None:
    """Write a tiny random Llama (seed 0, fp32) and its tokenizer to ``path``."""
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def reward_num_unique_chars(completions, **kwargs):
    """TRL's README example reward: the number of distinct characters of each completion."""
    return [float(len(set(c))) for c in completions]


class CountSteps(TrainerCallback):
    """Counts the optimizer steps this process runs (a resumed run skips its checkpoint's)."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def export_cast(method: str, stock: bool):
    """The export-cast config of ``--method`` / ``--stock`` (None: no section)."""
    if stock:
        return None
    return {"mode": "nearest"} if method == "nearest" else {"mode": "fair", "method": method, "seed": 1234}


class FairCastFSDP2(TrainerCallback):
    """Fair Cast on an FSDP2 policy under the HF ``Trainer`` (TRL's trainers): installs at
    ``on_train_begin`` (the model is ``fully_shard``-ed and the optimizer built by then), saves the
    export state with DCP into ``checkpoint-N/export_cast`` at every checkpoint, and on a resume
    loads it from the checkpoint being resumed (``args.output_dir/checkpoint-<global_step>``)."""

    def __init__(self, config):
        self.config = config

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import fsdp_hooks
        if not fsdp_hooks.install(model, optimizer, config=self.config) or not state.global_step:
            return
        import torch.distributed.checkpoint as dcp
        from fsdp_hooks.checkpoint import ExportCastState
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "export_cast")
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"FairCastFSDP2: resuming at step {state.global_step} without {folder}")
        dcp.load({"export_cast": ExportCastState(model)}, checkpoint_id=folder)

    def on_save(self, args, state, control, model=None, **kwargs):
        if getattr(model, "export_cast", None) is None:
            return
        import torch.distributed.checkpoint as dcp
        from fsdp_hooks.checkpoint import ExportCastState
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "export_cast")
        dcp.save({"export_cast": ExportCastState(model)}, checkpoint_id=folder)


def fair_fsdp2_params(self, module):
    """TRL's ``VLLMGeneration._iter_fsdp2_params`` (``trl/generation/vllm_generation.py``) with Fair
    Cast: the served bf16 weights, the bits the policy computes with, under vLLM's names, instead of
    each fp32 param's ``full_tensor()``. Collective. PEFT models: TRL's own (not handled here)."""
    import fsdp_hooks
    if getattr(module, "export_cast", None) is None:
        yield from _TRL_ITER_FSDP2(self, module)
        return
    for name, weight in fsdp_hooks.served_weights(module):
        yield self._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."]), weight


def trl_sync_tensors(trainer):
    """What TRL's vLLM weight sync would send, without vLLM: ``VLLMGeneration._iter_named_params``
    (``trl/generation/vllm_generation.py``) on the trainer's model, each tensor copied to the host
    while it is gathered. Collective under ZeRO-3 (every rank runs it)."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration
    gen = VLLMGeneration.__new__(VLLMGeneration)  # its __init__ starts vLLM; _iter_named_params needs only these
    gen.model, gen.accelerator, gen._dist = trainer.model, trainer.accelerator, DistributedBackend(trainer.accelerator)
    return {name: t.to("cpu", copy=True) for name, t in gen._iter_named_params()}


def record(trainer) -> dict:
    """What one rank saves after training (every entry collective under ZeRO-3; tensors on the host):

    ``served`` (the policy's bf16 params, ``served_weights``), ``trl_sync`` (:func:`trl_sync_tensors`),
    ``master`` (fp32, ``deepspeed.utils.safe_get_full_fp32_param``), ``residual`` (error feedback's,
    full fp32; empty otherwise), ``ref`` (the reference model's bf16 params), both engines' optimizer
    class names, the policy's export method (``caster``, None when stock), whether the reference
    engine's optimizer has an ``export_cast``, the export step and the global step.
    """
    from torch.distributed.fsdp import FSDPModule
    if isinstance(trainer.model, FSDPModule):
        return record_fsdp2(trainer)
    from deepspeed_hooks.export import RESIDUAL_KEY
    from deepspeed_hooks.served import served_weights
    engine, ref = trainer.model_wrapped, trainer.ref_model
    params = list(engine.module.named_parameters())
    export = getattr(engine.optimizer, "export_cast", None)
    caster = None if export is None else export.caster
    with deepspeed.zero.GatheredParameters(list(ref.module.parameters())):
        ref_params = {n: p.detach().to("cpu", copy=True) for n, p in ref.module.named_parameters()}
    return {
        "served": {n: t.to("cpu", copy=True) for n, t in served_weights(engine)},
        "trl_sync": trl_sync_tensors(trainer),
        "master": {n: deepspeed.utils.safe_get_full_fp32_param(p).to("cpu", copy=True) for n, p in params},
        "residual": export.gather(RESIDUAL_KEY) if caster is not None and caster.method == "error_feedback" else {},
        "ref": ref_params,
        "optimizer": type(engine.optimizer).__name__,
        "caster": None if caster is None else f"{caster.method}",
        "export_step": None if caster is None else caster.step,
        "ref_optimizer": type(ref.optimizer).__name__,
        "ref_has_caster": hasattr(ref.optimizer, "export_cast"),
        "global_step": trainer.state.global_step,
    }


def record_fsdp2(trainer) -> dict:
    """:func:`record` under FSDP2 (collective): the same keys, from :mod:`fsdp_hooks`."""
    import fsdp_hooks
    from fsdp_hooks.checkpoint import ExportCastState
    model, ref = trainer.model, trainer.ref_model
    export = getattr(model, "export_cast", None)

    def full(named):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", copy=True) for n, p in named}
    model.reshard()
    return {
        "served": {n: t.to("cpu", copy=True) for n, t in fsdp_hooks.served_weights(model)} if export else {},
        "trl_sync": trl_sync_tensors(trainer),
        "master": full(model.named_parameters()),
        "residual": full(ExportCastState(model).state_dict()["residual"].items())
        if export is not None and export.residuals is not None else {},
        "ref": full(ref.named_parameters()) if ref is not None else {},
        "optimizer": type(trainer.optimizer.optimizer).__name__,
        "caster": None if export is None else f"{export.caster.method}",
        "export_step": None if export is None else export.caster.step,
        "ref_optimizer": None,
        "ref_has_caster": ref is not None and hasattr(ref, "export_cast"),
        "global_step": trainer.state.global_step,
    }


def main(argv=None):
    """Train (or resume) the tiny GRPO run and save this rank's :func:`record`."""
    args = parse_args(argv)
    cpu = not torch.cuda.is_available()
    if cpu:  # CPU-only workarounds (a GPU run skips them)
        # transformers refuses bf16 without a bf16 GPU (transformers/training_args.py, _validate_args)
        transformers.training_args.is_torch_bf16_gpu_available = lambda: True
        # accelerate finds no process-group backend without a GPU (accelerate/state.py, _prepare_backend:
        # it then runs as one process), and under DeepSpeed transformers does not hand it ddp_backend:
        # make accelerate's state here with gloo, and have GRPOConfig use it (use_configured_state)
        if args.fsdp2:
            # accelerate applies FSDP only to GPU-like distributed types (accelerate/state.py,
            # AcceleratorState.__init__ leaves MULTI_CPU out): label the gloo CPU state MULTI_GPU
            from accelerate.utils import DistributedType
            PartialState(cpu=True, backend="gloo")
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
            PartialState(backend="gloo")
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
    config = GRPOConfig(
        output_dir=args.output_dir,
        deepspeed=None if args.fsdp2 else ds_config(args.zero_stage, args.method, args.stock),
        fsdp="full_shard" if args.fsdp2 else None,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]} if args.fsdp2 else None,
        accelerator_config={"use_configured_state": cpu},
        bf16=True,
        learning_rate=args.lr,
        beta=0.04,  # > 0: TRL builds a reference model (deepspeed.initialize without an optimizer)
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=args.steps,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        logging_steps=1,
        report_to="none",
        use_vllm=False,
        seed=args.seed,
    )
    model_dir = os.path.join(args.output_dir, "model")
    with config.main_process_first(local=False):
        if config.process_index == 0 and not os.path.isdir(model_dir):
            save_tiny_model(model_dir)
    prompts = [f"{a} + {b} =" for a in range(4) for b in range(4)]  # 16 prompts
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward_num_unique_chars,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left"),
    )
    counter = CountSteps()
    trainer.add_callback(counter)
    if args.fsdp2:
        trainer.add_callback(FairCastFSDP2(export_cast(args.method, args.stock)))
    checkpoint = get_last_checkpoint(args.output_dir) if args.resume else None
    if args.resume and checkpoint is None:
        raise SystemExit(f"--resume: no checkpoint-* in {args.output_dir}")
    trainer.train(resume_from_checkpoint=checkpoint)
    rec = dict(record(trainer), steps_run=counter.steps, resumed_from=checkpoint)
    path = os.path.join(args.output_dir, f"record_rank{config.process_index}.pt")
    torch.save(rec, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)  # complete or absent
    if config.process_index == 0:
        print(f"trl_grpo: {rec['global_step']} steps ({counter.steps} run here, resumed from {checkpoint}), optimizer {rec['optimizer']}, export cast {rec['caster']}, "
              f"reference model optimizer {rec['ref_optimizer']}", flush=True)
    # a gloo group left to interpreter exit can abort the process there ("terminate called without an active
    # exception": its worker threads still hold ZeRO-3's async work; pytorch/pytorch#190489)
    trainer.accelerator.wait_for_everyone()
    PartialState().destroy_process_group()


from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

_TRL_ITER_FSDP2 = VLLMGeneration._iter_fsdp2_params
VLLMGeneration._iter_fsdp2_params = fair_fsdp2_params  # the one edit TRL's FSDP2 weight sync needs

if __name__ == "__main__":
    main()
