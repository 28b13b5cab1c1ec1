"""The vLLM receiver on the architectures RL users train, and its failures (one process, an engine per case).

    python tests/vllm_arch_worker.py OUT_JSON

Per architecture (tiny random models built here, head_dim 32): an engine started from seed-0 weights takes a full
update to seed-1 weights, a sparse delta (where the host's CPU backend computes from live params) and a
whole-layer delta; after each, ``verify()`` and vLLM's prompt log-probs against an fp32 Hugging Face forward of
the weights the receiver holds. Then, on Llama (its engine runs tests/vllm_faults.py's extension): a push that
fails in the worker (after half the layers, and inside vLLM's reload), one whose worker is killed, and one that
hangs, each followed by a check of what the engine and the receiver hold, and another engine of that checkpoint
attached. On the MoE models, the experts' own traps (moe_run). An FP8 per-channel Llama engine (fp8_run). An
untested architecture (Phi-3) must be refused by name.

Every checkpoint is written first; then each engine starts in a thread while the ones before it are checked
(:class:`Engines`: two starts at a time), and stops in a thread: a start or a stop is mostly waiting on the engine's
two processes (each imports vLLM as it starts; a stop waits ~5 s for them to exit).
"""
from __future__ import annotations

import _thread
import json
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import safetensors
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the engines' workers run one OpenMP thread, unpinned: vLLM's default pins each engine's worker to core 0 (on 2 cores
# it reserves the other for the scheduler) from its `import torch` on, so engines starting together would share a core
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")  # the worker imports vllm_faults
COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1)
# architecture -> (config class, model class, config overrides)
ARCHS = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),  # q/k norms, tied head
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM", {}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),  # tied head, sliding + full layers
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # router, 4 experts of which 2 per token
                            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # and a gated shared expert
                            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=128)),
}
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(24)] for i in range(4)]


def hf_model(arch: str, seed: int, extra: dict | None = None):
    import transformers
    config_cls, model_cls, overrides = ARCHS.get(arch, (arch.replace("ForCausalLM", "Config"), arch, {}))
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **(extra or {})})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).float().eval()


def start(path: str, extension: str):
    from vllm import LLM
    # 64 MiB of KV cache: prompts of 24 tokens (VLLM_CPU_KVCACHE_SPACE, where set, overrides it)
    return LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256, seed=0,
               worker_extension_cls=extension, kv_cache_memory_bytes=64 << 20)


class Engines:
    """The engines of ``plan`` (``(checkpoint path, worker extension)`` pairs), handed out in its order by
    :meth:`take`, each started in a thread while the ones before it are checked (at most ``ahead`` starting or
    started and not taken); :meth:`stop` shuts one down in a thread, :meth:`close` the rest, waiting for all."""

    def __init__(self, plan: list[tuple[str, str]], ahead: int = 2):
        from vllm import LLM  # noqa: F401  (imported here first, not by two threads at once)
        self.plan, self.pool, self.stopping = list(plan), ThreadPoolExecutor(ahead), []
        self.started = [self.pool.submit(start, *self.plan.pop(0)) for _ in range(min(ahead, len(self.plan)))]

    def take(self):
        llm = self.started.pop(0).result()
        if self.plan:
            self.started.append(self.pool.submit(start, *self.plan.pop(0)))
        return llm

    def stop(self, llm) -> None:
        thread = threading.Thread(target=llm.llm_engine.engine_core.shutdown, name="stop-engine")
        thread.start()
        self.stopping.append(thread)

    def close(self) -> None:
        self.plan.clear()
        for future in self.started:  # (a start that failed left nothing to stop)
            if not future.cancel() and future.exception() is None:
                self.stop(future.result())
        self.pool.shutdown()
        for thread in self.stopping:
            thread.join()


def vllm_logprobs(llm) -> torch.Tensor:
    """vLLM's prompt log-probs of PROMPTS' tokens, ``[4, 23]``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    return torch.tensor([[lp[t].logprob for t, lp in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(PROMPTS, outs)])


def hf_state(model, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (checkpoint names: one tensor per expert) as ``model``'s state dict names them (transformers 5
    holds a layer's experts as ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``)."""
    state = {}
    for key, ref in model.state_dict().items():
        base, _, leaf = key.rpartition(".")
        if key in weights:
            state[key] = weights[key]
        elif leaf in ("gate_up_proj", "down_proj") and base.endswith("experts"):
            pieces = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
            state[key] = torch.stack([torch.cat([weights[f"{base}.{e}.{p}.weight"] for p in pieces])
                                      for e in range(ref.shape[0])])
    return state


@torch.no_grad()
def hf_logprobs(model, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """An fp32 forward of ``model`` holding ``weights``: log-probs of PROMPTS' tokens, ``[4, 23]``."""
    state = hf_state(model, weights)
    missing, unexpected = model.load_state_dict({n: t.float() for n, t in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if "lm_head.weight" in missing:
        model.tie_weights()
    ids = torch.tensor(PROMPTS)
    logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def nudge(weights: dict[str, torch.Tensor], seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A delta: 1% of every tensor's elements (at least one) moved by 3 standard deviations of the tensor."""
    g = torch.Generator().manual_seed(seed)
    deltas = []
    for name, t in weights.items():
        flat = t.reshape(-1).float()
        k = max(1, flat.numel() // 100)
        index = torch.randperm(flat.numel(), generator=g)[:k].sort().values
        values = (flat[index] + 3 * (flat.std() if flat.numel() > 1 else 1.0)).to(t.dtype)
        deltas.append((name, index.to(torch.int32), values))
    return deltas


def checkpoint(arch: str, path: str, extra: dict | None = None) -> str:
    """``arch``'s seed-0 weights as a bf16 Hugging Face folder at ``path``; returns ``path``."""
    hf_model(arch, 0, extra).to(torch.bfloat16).save_pretrained(path)
    return path


def architecture_run(arch: str, path: str, llm) -> tuple[dict, object]:
    """Full update, sparse delta, whole-layer delta on ``llm``, an engine of ``arch`` started from the checkpoint
    at ``path``; returns (report, receiver)."""
    from vllm_receiver import VllmReceiver
    receiver = VllmReceiver(llm)
    new = {n: t.to(torch.bfloat16) for n, t in hf_model(arch, 1).state_dict().items()}
    model = hf_model(arch, 0)
    old = hf_logprobs(model, receiver.weights)
    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "pt") as f:  # the checkpoint's names
        names = set(f.keys())
    rep = {"sparse_possible": receiver.sparse_deltas, "names_match": set(receiver.weights) ==
           names - ({"lm_head.weight"} if receiver.layout["tied"] else set()),
           "start_vs_hf": gap(vllm_logprobs(llm), old)}
    receiver.load((n, t) for n, t in new.items() if n in receiver.weights or n in receiver.layout["fused"])
    rep["full_verified"] = receiver.verify()
    now = vllm_logprobs(llm)
    rep["full_new"], rep["full_old"] = gap(now, hf_logprobs(model, receiver.weights)), gap(now, old)
    for way, recv in (("sparse", receiver if receiver.sparse_deltas else None),
                      ("whole", VllmReceiver(llm, sparse_deltas=False))):
        if recv is None:
            continue
        before = recv.totals["engine_bytes"]
        changed = recv.apply(nudge(recv.weights, seed=len(way)))
        rep[f"{way}_changed"], rep[f"{way}_engine_bytes"] = changed, recv.totals["engine_bytes"] - before
        rep[f"{way}_verified"] = recv.verify()
        rep[f"{way}_new"] = gap(vllm_logprobs(llm), hf_logprobs(model, recv.weights))
        receiver = recv
    return rep, receiver


def moe_run(arch: str, llm, receiver) -> dict:
    """The experts' own traps: a reload of identical weights, one expert's tensor alone, deltas given by
    transformers 5's fused names (``experts.gate_up_proj`` ``[E, 2I, H]``)."""
    model = hf_model(arch, 0)
    before = vllm_logprobs(llm)
    receiver.load(list(receiver.weights.items()))
    rep = {"identical_reload_bitwise": torch.equal(vllm_logprobs(llm), before)}
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    layer = [n for n, mod in receiver._layer_of.items() if mod == receiver._layer_of[name]]
    moved = receiver.totals["engine_bytes"]
    receiver.load([(name, (receiver.weights[name].float() + 0.5).to(torch.bfloat16))])
    rep["one_expert"] = {"engine_bytes": receiver.totals["engine_bytes"] - moved, "layer_tensors": len(layer),
                         "layer_bytes": sum(receiver.weights[n].nbytes for n in layer),
                         "verified": receiver.verify(),
                         "new": gap(vllm_logprobs(llm), hf_logprobs(model, receiver.weights))}
    state = hf_state(model, receiver.weights)
    deltas = [(n, i, v) for n, i, v in nudge({n: state[n] for n in state if ".experts." in n}, seed=7)]
    for n, i, v in deltas:
        state[n] = state[n].clone()
        state[n].view(-1)[i.long()] = v
    rep["fused_delta"] = {"changed": receiver.apply(deltas), "sent": sum(i.numel() for _, i, _ in deltas),
                          "verified": receiver.verify(),
                          "copy_as_sent": all(torch.equal(hf_state(model, receiver.weights)[n], state[n])
                                              for n, _, _ in deltas),
                          "new": gap(vllm_logprobs(llm), hf_logprobs(model, receiver.weights))}
    # names as load() takes them work in verify(); bad updates are refused naming what was sent, nothing written
    fused_name = "model.layers.0.mlp.experts.gate_up_proj"
    rep["verify_fused_name"] = receiver.verify([fused_name])
    before = {n: t.clone() for n, t in receiver.weights.items()}
    refused = {}
    for case, call in {
        "unknown": lambda: receiver.verify(["model.layers.0.mlp.experts.nope"]),
        "twice": lambda: receiver.apply([(fused_name, torch.tensor([10, 10], dtype=torch.int32),
                                          torch.ones(2, dtype=torch.bfloat16))]),
        "fused_dtype": lambda: receiver.load([(fused_name, state[fused_name].float())]),
    }.items():
        try:
            call()
            refused[case] = "no error"
        except (KeyError, TypeError, ValueError) as err:
            refused[case] = f"{type(err).__name__}: {err}"
    rep["refused"] = refused
    rep["refused_nothing_written"] = all(torch.equal(before[n], t) for n, t in receiver.weights.items()) and \
        receiver.verify() > 0
    return rep




def fp8_served(master: dict[str, torch.Tensor], previous: dict | None, key=None) -> dict[str, torch.Tensor]:
    """What a trainer serves from fp32 ``master``: FP8 per-channel linear weights and their ``weight_scale``
    (sticky over ``previous``; round-to-nearest, or dithered with ``key(name)``), bf16 for the rest."""
    from faircast_dist.fp8 import ScaleRule, element_scales, partial_absmax
    from faircast_dist.rounding import cast_fp8_nearest, cast_fp8_stochastic
    layout, out = ScaleRule("channel"), {}
    for name, x in master.items():
        if not name.endswith("_proj.weight"):
            out[name] = x.to(torch.bfloat16)
            continue
        index = layout.scale_index(tuple(x.shape), 0, x.numel()).reshape(x.shape)
        scale_name = name.removesuffix("weight") + "weight_scale"
        old = None if previous is None else previous[scale_name].reshape(-1)
        scales, _, _ = layout.next_scales(old, partial_absmax(x, index, x.shape[0]))
        s = element_scales(scales, index)
        out[name] = cast_fp8_nearest(x, s) if key is None else cast_fp8_stochastic(x, s, key(name), 0)
        out[scale_name] = scales.reshape(-1, 1)
    return out


def fp8_trainer():
    """A one-rank FSDP2 trainer (gloo) of a Llama whose fp32 masters are not the engine's, with Fair Cast serving
    dithered FP8 per-channel weights (``format "fp8"``): ``(model, AdamW)``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import fsdp_hooks
    from helpers import free_port
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", rank=0, world_size=1)
    model = hf_model("LlamaForCausalLM", 1).train()
    mesh, policy = init_device_mesh("cpu", (1,)), MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fsdp_hooks.install(model, optimizer, config={"mode": "fair", "method": "dithered", "seed": 0, "format": "fp8"})
    return model, optimizer


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(as_bits(a), as_bits(b))


def dequantized(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``q * weight_scale`` for each FP8 weight (fp32), the rest as it is."""
    return {n: t.float() * weights[n.removesuffix("weight") + "weight_scale"] if t.dtype == torch.float8_e4m3fn
            else t for n, t in weights.items() if not n.endswith("_scale")}


def fp8_checkpoint(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    """A compressed-tensors FP8 per-channel Llama at ``path`` (seed-0 weights, the spec's round-to-nearest):
    ``(the fp32 reference forward, which holds whatever weights it is given; the checkpoint's weights)``."""
    from safetensors.torch import save_file
    from vllm_receiver import FP8_CHANNEL_QUANTIZATION
    model = hf_model("LlamaForCausalLM", 0)
    start_weights = fp8_served({n: t.clone() for n, t in model.state_dict().items()}, None)
    model.to(torch.bfloat16).save_pretrained(path)
    model.float()
    save_file({n: t.contiguous() for n, t in start_weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=FP8_CHANNEL_QUANTIZATION), f)
    return model, start_weights


def fp8_run(llm, model, start_weights: dict[str, torch.Tensor]) -> dict:
    """An FP8 per-channel engine started from :func:`fp8_checkpoint` (``model``, ``start_weights``: what it
    returned): the receiver reads its FP8 bytes and scales exactly, takes a full update and a step's deltas from an
    FSDP2 trainer serving dithered FP8 (:func:`fp8_trainer`), each verified, and vLLM's log-probs follow an fp32
    forward of q * scale."""
    from vllm_receiver import VllmReceiver
    receiver = VllmReceiver(llm)
    w = receiver.weights
    rep = {"names_match": set(w) == set(start_weights),
           "dtypes": sorted({str(t.dtype) for t in w.values()}),
           "start_bytes_exact": all(same_bits(w[n], t) for n, t in start_weights.items()),
           "sparse_possible": receiver.sparse_deltas,
           "start_vs_hf": gap(vllm_logprobs(llm), hf_logprobs(model, dequantized(w)))}
    old = hf_logprobs(model, dequantized(w))
    # the trainer: an FSDP2 model of other fp32 masters with Fair Cast serving dithered FP8 (format "fp8")
    trainer, optimizer = fp8_trainer()
    import fsdp_hooks
    from faircast_dist.delta import DeltaTracker
    tracker = DeltaTracker()
    new = dict(fsdp_hooks.served_weights(trainer))
    for n, t in new.items():  # the tracker's baseline: what the full update sends
        tracker.diff(n, t)
    rep["trainer_fp8"] = sorted(n for n, t in new.items() if t.dtype == torch.float8_e4m3fn) == \
        sorted(n for n, t in w.items() if t.dtype == torch.float8_e4m3fn)
    receiver.load(new.items())
    rep["full_verified"] = receiver.verify()
    now = vllm_logprobs(llm)
    rep["full_new"], rep["full_old"] = gap(now, hf_logprobs(model, dequantized(w))), gap(now, old)
    receiver.load(list(w.items()))
    rep["identical_reload_bitwise"] = torch.equal(vllm_logprobs(llm), now)
    # one training step; the trainer's served deltas (FP8 bytes, fp32 scales, bf16) since the full update
    tokens = torch.tensor(PROMPTS)
    trainer(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    deltas = list(fsdp_hooks.served_deltas(trainer, tracker))
    step = dict(fsdp_hooks.served_weights(trainer))
    rep["delta_changed"] = receiver.apply(deltas)
    rep["delta_fp8_elements"] = sum(len(i) for n, i, v in deltas if v.dtype == torch.float8_e4m3fn)
    rep["delta_scales_changed"] = sum(len(i) for n, i, _ in deltas if n.endswith("_scale"))
    rep["delta_copy_as_sent"] = all(same_bits(w[n], t) for n, t in step.items())
    rep["delta_verified"] = receiver.verify()
    rep["stored"] = sorted({n.rpartition(".")[2] + ":" + str(w[n].dtype) for n in receiver.layout["stored"]})
    rep["delta_new"] = gap(vllm_logprobs(llm), hf_logprobs(model, dequantized(w)))
    name = "model.layers.0.mlp.down_proj.weight"
    try:
        receiver.load([(name, w[name].float().to(torch.bfloat16))])
        rep["bf16_into_fp8"] = "no error"
    except TypeError as err:
        rep["bf16_into_fp8"] = str(err)
    return rep


def faults(llm, receiver, engines: Engines, fault_file: str) -> tuple[dict, object]:
    """Each fault of tests/vllm_faults.py on a full update; after the engine dies or hangs, the next engine of
    ``engines`` (another of the same checkpoint and extension) is attached. Returns (report, the last engine)."""
    from vllm_receiver import EngineUpdateError, WeightMismatch
    rep = {}
    receiver.timeout_s = 5
    g = torch.Generator().manual_seed(5)
    # -0.0 and a subnormal in a linear weight and the tied embedding: the kernel read-back gives +0 for both
    odd = []
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        t = receiver.weights[name].clone()
        t.view(-1)[3], t.view(-1)[4] = -0.0, 1e-40
        odd.append((name, t))
    receiver.load(odd)
    rep["signed_zero_and_subnormal_verified"] = receiver.verify()
    # Ctrl-C is simulated with _thread.interrupt_main, which does nothing while SIGINT is ignored, and a process
    # started in the background by a non-interactive shell (`make test &`) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fault in ("raise", "inside", "slow", "die", "hang"):
        with open(fault_file, "w") as f:
            f.write(fault)
        if fault == "die":
            def kill():
                while not os.path.exists(fault_file + ".pid"):
                    time.sleep(0.05)
                time.sleep(0.5)
                os.kill(int(open(fault_file + ".pid").read()), signal.SIGKILL)
            threading.Thread(target=kill, daemon=True).start()
        before = {n: t.clone() for n, t in receiver.weights.items()}
        update = [(n, (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)) for n, t in before.items()]
        if fault == "slow":  # Ctrl-C while the engine is still taking the push
            threading.Timer(0.5, _thread.interrupt_main).start()
        t0 = time.monotonic()
        try:
            receiver.load(update)
            case = {"error": None}
        except EngineUpdateError as err:
            case = {"error": str(err), "engine_state": err.engine_state}
        except KeyboardInterrupt:
            case = {"error": "KeyboardInterrupt"}
        case["seconds"] = time.monotonic() - t0
        case["copy_unchanged"] = all(torch.equal(before[n], t) for n, t in receiver.weights.items())
        if fault in ("raise", "inside"):  # the engine lives: it must serve the copy (the weights before the push)
            case["verified"] = receiver.verify()
        elif fault == "slow":  # the engine took the interrupted push, the copy did not: verify says so, and the
            time.sleep(4)      # next push rewrites those layers from the copy
            try:
                receiver.verify()
                case["verify_after_interrupt"] = "passed"
            except WeightMismatch as err:
                case["verify_after_interrupt"] = str(err)
            receiver.load(update[:1])
            case["next_push_verified"] = receiver.verify()
        else:  # restart, attach: the new engine serves the copy; then the next push lands
            if fault == "hang":  # the engine whose RPC timed out is not called again
                t0 = time.monotonic()
                try:
                    receiver.attach(llm)
                    case["same_engine_refused"] = "no error"
                except RuntimeError as err:
                    case["same_engine_refused"] = str(err)
                case["refused_in_s"] = time.monotonic() - t0
            engines.stop(llm)
            llm = engines.take()
            case["attached"] = receiver.attach(llm)
            receiver.load(update)
            case["next_push_verified"] = receiver.verify()
        if os.path.exists(fault_file + ".pid"):
            os.unlink(fault_file + ".pid")
        rep[fault] = case
    return rep, llm


def main(out_json: str) -> None:
    from vllm_receiver import WORKER_EXTENSION, VllmReceiver
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="faircast-vllm-arch-")
    os.environ["FAIRCAST_TEST_FAULT"] = os.path.join(tmp, "fault")  # the engines' workers inherit it
    faulty = "vllm_faults.FaultyExtension"
    paths = {arch: checkpoint(arch, os.path.join(tmp, arch)) for arch in ARCHS}
    fp8_path = os.path.join(tmp, "fp8")
    fp8_model, fp8_start = fp8_checkpoint(fp8_path)
    refusals = {case: checkpoint(arch, os.path.join(tmp, case), extra) for case, arch, extra in (
        ("padded_refused", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=48)),  # the kernel pads 48 to 64
        ("untested_refused", "Phi3ForCausalLM", dict(pad_token_id=0)))}  # by name, before any RPC
    # Llama's engine runs the faults, then two more of it are attached (after the worker dies, after it hangs)
    plan = [(paths["LlamaForCausalLM"], faulty)] * 3 + \
        [(paths[arch], WORKER_EXTENSION) for arch in ARCHS if arch != "LlamaForCausalLM"] + \
        [(fp8_path, WORKER_EXTENSION)] + [(path, WORKER_EXTENSION) for path in refusals.values()]
    engines = Engines(plan)
    try:
        report = {"architectures": {}}
        llama_receiver = None
        for arch in ARCHS:
            llama = arch == "LlamaForCausalLM"
            llm = engines.take()
            rep, receiver = architecture_run(arch, paths[arch], llm)
            report["architectures"][arch] = rep
            if "Moe" in arch:
                rep["moe"] = moe_run(arch, llm, receiver)
            if llama:
                report["faults"], llm = faults(llm, receiver, engines, os.environ["FAIRCAST_TEST_FAULT"])
                llama_receiver = receiver
            elif arch == "Qwen2ForCausalLM":  # attach refuses an engine of another model, and stays as it was
                engine = llama_receiver.llm
                try:
                    llama_receiver.attach(llm)
                    report["attach_other_model"] = "no error"
                except ValueError as err:
                    report["attach_other_model"] = str(err)
                report["attach_kept_engine"] = llama_receiver.llm is engine
            engines.stop(llm)
            print(arch, json.dumps(rep), flush=True)
        llm = engines.take()
        report["fp8"] = fp8_run(llm, fp8_model, fp8_start)
        engines.stop(llm)
        print("fp8", json.dumps(report["fp8"]), flush=True)
        for case in refusals:
            llm = engines.take()
            try:
                VllmReceiver(llm)
                report[case] = "no error"
            except ValueError as err:
                report[case] = str(err)
            engines.stop(llm)
    finally:
        engines.close()
    # every buffer is an anonymous memory file whose descriptor the trainer closed once the worker mapped it
    report["open_buffers"] = [fd for fd in os.listdir(f"/proc/{os.getpid()}/fd")
                              if "faircast-buffer" in os.path.realpath(f"/proc/{os.getpid()}/fd/{fd}")]
    with open(out_json, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
