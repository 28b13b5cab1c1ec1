"""The rollout engines of the GRPO harness (``scripts/rl_grpo.py``) and the trainer-to-engine sync:
``--engine hf`` (:class:`RolloutEngine`, a bf16 HF copy per rank) and ``--engine vllm``
(:class:`VllmEngine`, one real vLLM engine on rank 0 serving every rank), both fed only through
:func:`sync_weights` and checked against the trainer by :func:`check_synced`.
"""
from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn.functional as F


class RolloutEngine:
    """``--engine hf``: a separate bf16 copy of the policy per rank that samples that rank's rollouts with HF
    ``generate``; it gets weights only via load_weights.

    Args:
        model: the policy (any dtype); deep-copied, its parameters cast to ``dtype`` here (their values
            are replaced by the first :meth:`load_weights` anyway). Buffers keep their dtype, as in
            DeepSpeed's bf16 trainer (RoPE ``inv_freq`` stays fp32: rounded to bf16 it would shift
            every rotary phase and make the served policy a different function of the same weights).
        eos, pad: token ids.
        dtype: the served weights' dtype: ``torch.bfloat16``, or ``torch.float32`` for the oracle arm.
    """

    def __init__(self, model, eos: int, pad: int, dtype: torch.dtype = torch.bfloat16):
        from transformers import GenerationConfig
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.data = p.data.to(dtype)
        # generate() fills every field our GenerationConfig leaves unset from the model's own
        # generation_config (a checkpoint's repetition_penalty, suppress_tokens, min_p, ...), which
        # would reshape the sampling distribution while the recorded log-probs stay the raw softmax
        self.model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
        self.params = dict(self.model.named_parameters())
        self.eos, self.pad = eos, pad

    collective = False  # each rank samples its own rollouts

    def weights(self) -> dict[str, torch.Tensor]:
        """What the engine computes with: ``{name: tensor}`` of its params and buffers."""
        return {**self.params, **dict(self.model.named_buffers())}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the model, as vLLM's ``model.load_weights`` does.

        Raises:
            KeyError: a name the model does not have. ValueError: a shape or dtype that differs.
        """
        for name, tensor in weights:
            if name not in self.params:
                raise KeyError(f"rollout engine has no parameter {name!r}")
            p = self.params[name]
            if p.shape != tensor.shape or p.dtype != tensor.dtype:
                raise ValueError(f"rollout engine parameter {name!r} is {p.dtype} {tuple(p.shape)}; "
                                 f"load_weights got {tensor.dtype} {tuple(tensor.shape)}")
            p.copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, greedy: bool = False,
                 seed: int | None = None) -> dict:
        """Sample (temperature 1, full vocabulary) or greedily complete each prompt once.

        Sampling draws from torch's global RNG, seeded with ``seed`` first when given.

        Returns:
            ``ids`` int64 ``[B, L]`` (left-padded prompt + completion), ``attention_mask`` int64
            ``[B, L]``, ``mask`` bool ``[B, L-1]`` (the completion tokens up to and including EOS,
            aligned with the targets ``ids[:, 1:]``), ``logp`` float32 ``[B, L-1]`` (the engine's
            log-prob of each target while sampling; 0 off the mask), ``completions`` (token lists).
        """
        from transformers import GenerationConfig
        if seed is not None:
            torch.manual_seed(seed)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        attn = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        sampling = {} if greedy else dict(temperature=1.0, top_k=0, top_p=1.0)  # greedy: unused, HF would warn
        cfg = GenerationConfig(do_sample=not greedy, **sampling, max_new_tokens=max_new_tokens, eos_token_id=self.eos,
                               pad_token_id=self.pad, return_dict_in_generate=True, output_logits=True)
        out = self.model.generate(input_ids=ids, attention_mask=attn, generation_config=cfg)
        new = out.sequences[:, width:]
        steps = new.shape[1]
        logits = torch.stack(out.logits, dim=1).float()  # [B, steps, V]
        sampled_logp = F.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        ended = (new == self.eos).long().cumsum(1)
        live = (ended - (new == self.eos).long()) == 0  # up to and including the first EOS
        B, L = out.sequences.shape
        mask = torch.zeros(B, L - 1, dtype=torch.bool)
        logp = torch.zeros(B, L - 1)
        mask[:, width - 1:width - 1 + steps] = live
        logp[:, width - 1:width - 1 + steps] = torch.where(live, sampled_logp, 0.0)
        attention_mask = torch.cat([attn, live.long()], dim=1)
        completions = [row[: int(m.sum())].tolist() for row, m in zip(new, live)]
        return dict(ids=out.sequences, attention_mask=attention_mask, mask=mask, logp=logp, completions=completions)


class VllmEngine:
    """``--engine vllm``: the rollout engine as RL stacks colocate it, a real vLLM engine (on rank 0) that
    samples every rank's rollouts and gets weights only through
    :class:`vllm_receiver.VllmReceiver` (full updates or deltas, checked bit for bit).

    One engine serves both ranks: each rank's prompts go to rank 0 and its completions come back
    (``generate`` is collective); with ``per_rank`` every rank has its own engine instead
    (``scripts/bench_rollout.py`` measures both layouts). Started once per launch from ``model`` written to ``out_dir/engine_model``
    (bf16 safetensors; the first sync of every arm replaces its weights), eager mode, no tokenizer
    (token ids in and out). Sampling: temperature 1, full vocabulary, one seed per request, so a request
    samples the same tokens whatever else shares its batch; log-probs are vLLM's raw log-probs of the
    sampled tokens.

    Args:
        model: the initial policy (fp32 ``LlamaForCausalLM``); eos, pad: token ids; out_dir: where the
            engine's model folder goes (one per engine).
        dtype: the engine's kind: ``"bfloat16"``; ``"float32"`` for the oracle arm (a folder of the same bf16
            weights; every weight is replaced by the first sync); or ``"fp8"`` for the FP8 arms: a bf16 engine whose
            2-D linear weights are FP8 E4M3 with a scale per output channel (a compressed-tensors checkpoint,
            :data:`vllm_receiver.FP8_CHANNEL_QUANTIZATION`; activations cast to FP8 per token), what ``export_cast``
            ``format "fp8"`` serves.
        barrier: end with a barrier (:meth:`start_many` passes False and holds one for all its engines).
    """

    def __init__(self, model, eos: int, pad: int, out_dir: str, per_rank: bool = False, dtype: str = "bfloat16",
                 barrier: bool = True):
        self.eos, self.pad = eos, pad
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.collective = not per_rank
        self.receiver = None
        if per_rank or self.rank == 0:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (the default takes GBs)
            from vllm import LLM
            from vllm_receiver import WORKER_EXTENSION, VllmReceiver
            fp8 = dtype == "fp8"
            folder = {"bfloat16": "engine_model", "float32": "engine_model_fp32", "fp8": "engine_model_fp8"}[dtype]
            path = save_checkpoint(model, os.path.join(out_dir, folder), fp8)
            self.llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True,
                           dtype="bfloat16" if fp8 else dtype,
                           max_model_len=1024, seed=0, worker_extension_cls=WORKER_EXTENSION)
            self.receiver = VllmReceiver(self.llm)
        if barrier:
            dist.barrier()

    @classmethod
    def start_many(cls, model, eos: int, pad: int, out_dir: str, dtypes: list[str]) -> dict[str, VllmEngine]:
        """``{dtype: VllmEngine}``, one engine of each of ``dtypes``, started side by side (threads on rank 0: a
        start is mostly waiting on the engine's two new processes, each importing vLLM), then one barrier."""
        if dist.get_rank() == 0:
            import vllm_receiver  # noqa: F401  (imports vLLM here, not in two threads at once)
        with ThreadPoolExecutor(len(dtypes)) as pool:
            started = {d: pool.submit(cls, model, eos, pad, out_dir, dtype=d, barrier=False) for d in dtypes}
        dist.barrier()
        return {d: f.result() for d, f in started.items()}

    @staticmethod
    def stop_many(engines: Iterable[VllmEngine]) -> None:
        """Shut the engines of this rank down side by side (threads: each waits ~5 s for its processes to exit)."""
        threads = [threading.Thread(target=e.llm.llm_engine.engine_core.shutdown) for e in engines
                   if getattr(e, "llm", None) is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A full update (``(name, bf16 tensor)`` pairs); every rank passes its iterable, rank 0 sends it."""
        if self.receiver is not None:
            self.receiver.load(weights)
        else:
            for _ in weights:  # run the sender to its end (collective under ZeRO-3)
                pass

    def apply_deltas(self, deltas: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """A delta update (``served_deltas`` triples); every rank passes its iterable, rank 0 sends it."""
        if self.receiver is not None:
            self.receiver.apply(deltas)
        else:
            for _ in deltas:
                pass

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The engine's effective weights (None on a rank without an engine): the receiver's copy, once
        ``verify()`` has checked that every weight read back from the engine through its kernels (the tied
        head included) equals it bit for bit (only digests leave the engine)."""
        if self.receiver is None:
            return None
        self.receiver.verify()
        return self.receiver.weights

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, greedy: bool = False,
                 seed: int | None = None) -> dict:
        """As :meth:`RolloutEngine.generate` (same returns); collective: every rank calls it, with its own prompts
        (possibly none). Request i of this rank samples with seed ``seed * 4096 + i``."""
        seeds = [None if greedy or seed is None else seed * 4096 + i for i in range(len(prompts))]
        if not self.collective:
            return pack_rollouts(prompts, self._sample(prompts, seeds, max_new_tokens, greedy), self.pad)
        shares = [None] * self.world
        dist.all_gather_object(shares, (prompts, seeds))
        results = [None] * self.world
        if self.rank == 0:
            done = self._sample([p for ps, _ in shares for p in ps], [s for _, ss in shares for s in ss],
                                max_new_tokens, greedy)
            at = 0
            for r, (ps, _) in enumerate(shares):
                results[r], at = done[at:at + len(ps)], at + len(ps)
        mine = [None]
        dist.scatter_object_list(mine, results, src=0)
        return pack_rollouts(prompts, mine[0], self.pad)

    def _sample(self, prompts, seeds, max_new_tokens: int, greedy: bool) -> list[tuple[list[int], list[float]]]:
        """``(completion ids, their log-probs)`` per prompt, from this rank's engine."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=0.0 if greedy else 1.0, seed=s, logprobs=0,
                                 stop_token_ids=[self.eos], detokenize=False) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                o.outputs[0].logprobs)])
                for o in outs]


def save_checkpoint(model, path: str, fp8: bool = False) -> str:
    """Write ``model`` as a bf16 Hugging Face folder (config.json + model.safetensors) that vLLM loads; returns
    ``path``. (``save_pretrained`` refuses a model loaded from GGUF: it counts as quantized.) With ``fp8``, the
    params ``export_cast`` ``format "fp8"`` serves as FP8 (:func:`faircast_dist.fp8.fp8_param`) are written as
    FP8 E4M3 per output channel, rounded to nearest, with their ``weight_scale`` (a compressed-tensors checkpoint)."""
    from safetensors.torch import save_file

    from faircast_dist import ExportCastConfig
    from faircast_dist.fp8 import ScaleRule, fp8_param
    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.update(architectures=[type(model).__name__], dtype="bfloat16", torch_dtype="bfloat16")
    tensors, config, layout = {}, ExportCastConfig(format="fp8"), ScaleRule("channel")
    for n, p in model.named_parameters():
        w = p.detach().float()
        if fp8 and fp8_param(config, n, tuple(w.shape)):
            tensors[n], tensors[n.removesuffix("weight") + layout.scale_name] = layout.quantize(w)
        else:
            tensors[n] = w.to(torch.bfloat16).contiguous()
    if fp8:
        from vllm_receiver import FP8_CHANNEL_QUANTIZATION
        cfg["quantization_config"] = FP8_CHANNEL_QUANTIZATION
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def pack_rollouts(prompts: list[list[int]], done: list[tuple[list[int], list[float]]], pad: int) -> dict:
    """The :meth:`RolloutEngine.generate` dict from per-prompt ``(completion ids, their log-probs)``: prompts
    left-padded to one width, completions right-padded (each up to and including its EOS)."""
    if not prompts:
        return dict(ids=torch.zeros(0, 1, dtype=torch.long), attention_mask=torch.zeros(0, 1, dtype=torch.long),
                    mask=torch.zeros(0, 0, dtype=torch.bool), logp=torch.zeros(0, 0), completions=[])
    width, steps = max(len(p) for p in prompts), max(len(c) for c, _ in done)
    B, L = len(prompts), width + steps
    ids = torch.full((B, L), pad, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    logp = torch.zeros(B, L - 1)
    for b, (p, (c, lp)) in enumerate(zip(prompts, done)):
        ids[b, width - len(p):width + len(c)] = torch.tensor(p + c)
        attention_mask[b, width - len(p):width + len(c)] = 1
        mask[b, width - 1:width - 1 + len(c)] = True
        logp[b, width - 1:width - 1 + len(c)] = torch.tensor(lp)
    return dict(ids=ids, attention_mask=attention_mask, mask=mask, logp=logp, completions=[c for c, _ in done])


def sync_weights(engine, rollout, tracker=None) -> None:
    """Ship the trainer's served bf16 weights to the rollout engine (the product's API, bucketed): whole
    (``served_weights``) or, with a ``DeltaTracker``, only what changed since the last sync (``served_deltas``)."""
    from deepspeed_hooks.served import served_deltas, served_weights
    if tracker is None:
        rollout.load_weights(served_weights(engine))
    else:
        rollout.apply_deltas(served_deltas(engine, tracker))


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t``, flat, as the signed integer type of its element size."""
    return t.reshape(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_synced(engine, rollout, where: str) -> None:
    """Raise RuntimeError naming the first tensor whose rollout-engine dtype or bits differ from what the trainer
    serves (:func:`deepspeed_hooks.served.served_weights`: the bf16 model's params, or FP8 weights and their scales
    under ``format "fp8"``): what the engine computes with, read back from it (a tied output head included);
    buffers where the engine has them (the HF engine; vLLM builds its own RoPE tables). Collective (the FP8 weights
    are gathered on every rank); the ranks of a collective engine that do not hold it compare nothing."""
    from deepspeed_hooks.served import served_weights
    mine = dict(served_weights(engine))
    theirs_all = rollout.weights()
    if theirs_all is None:
        return
    pairs = [*mine.items(), *((n, b) for n, b in engine.module.named_buffers() if n in theirs_all)]
    if "lm_head.weight" in theirs_all and "lm_head.weight" not in mine:  # tied: the head computes with the embedding
        pairs.append(("lm_head.weight", mine["model.embed_tokens.weight"]))
    for name, t in pairs:
        theirs = theirs_all.get(name)
        if theirs is None or theirs.dtype != t.dtype or theirs.shape != t.shape:
            raise RuntimeError(f"{where}: the rollout engine's {name!r} is "
                               f"{'missing' if theirs is None else f'{theirs.dtype} {tuple(theirs.shape)}'}; the "
                               f"trainer serves {t.dtype} {tuple(t.shape)}")
        a, b = flat_bits(t.detach()), flat_bits(theirs)
        if not torch.equal(a, b):
            diff = int((a != b).sum())
            raise RuntimeError(f"{where}: the rollout engine's {name!r} differs from what the trainer serves in "
                               f"{diff} of {t.numel()} elements (the engine must serve exactly what the trainer serves)")


def served_values(engine, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer serves, flat in ``names`` order (the model's params): ``(values, codes)``. ``values``: float32
    ``[sum numels]``, an FP8 weight as ``q * scale`` (what the engine computes with), the others as served (bf16, or
    fp32 for the oracle); ``codes``: int32 ``[sum numels]``, each element's served bits (an FP8 weight's E4M3 code,
    without its scale). Collective like :func:`deepspeed_hooks.served.served_weights`."""
    from deepspeed_hooks.served import served_weights
    served = dict(served_weights(engine))
    values, codes = [], []
    for n in names:
        t = served[n].detach()
        codes.append(flat_bits(t).int())
        if t.dtype == torch.float8_e4m3fn:  # per channel: weight_scale [N, 1]
            t = t.float() * served[n.removesuffix("weight") + "weight_scale"]
        values.append(t.float().reshape(-1))
    return torch.cat(values), torch.cat(codes)
