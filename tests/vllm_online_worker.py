"""VllmReceiver on a vLLM engine that quantizes online (``quantization="fp8_per_channel"``): one engine, every case.

    python tests/vllm_online_worker.py OUT_JSON

A tiny random Llama (tests/vllm_arch_worker.py's) saved as a bf16 checkpoint (seed 0) is served by vLLM, which
quantizes every linear layer to FP8 with a scale per output row of the fused layer. Through the receiver (the
engine runs tests/vllm_faults.py's extension): the start (the engine's codes == the preset's quantize of the
checkpoint); a full push of grid-aimed bf16 from a dithered export under ``fp8_rule "vllm-fp8-per-channel"`` (the
engine's codes and scales == the export's, bit for bit); a delta push of some tensors of layer 1 (the same, the rest
unchanged); plain bf16 masters (``nearest``: the engine's codes == the preset's quantize); two pushes that fail in the
engine (after half the layers; inside the reload), each rolled back; what is refused. Each case records its error
instead of stopping the run, so a receiver without online support reports what fails.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")  # the worker imports vllm_faults

from vllm_arch_worker import gap, hf_logprobs, hf_model, vllm_logprobs  # noqa: E402

RULE = "vllm-fp8-per-channel"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


class Export:
    """A one-process Fair Cast export of fp32 ``masters`` under ``config`` (``format "fp8"``): :meth:`step` casts
    them (fresh bits each time) and returns ``{name: served}``: FP8 codes ``[N, K]`` and ``weight_scale`` ``[N, 1]``
    for the linear weights, bf16 for the rest."""

    def __init__(self, config: dict, masters: dict[str, torch.Tensor]):
        from faircast_dist.export import ExportState, Shard
        self.masters = masters
        self.state = ExportState(config, shapes={n: tuple(m.shape) for n, m in masters.items()})
        self.shards = [Shard(n, m.reshape(-1), torch.empty(m.numel(), dtype=torch.bfloat16), [(n, 0, m.numel(), 0)])
                       for n, m in masters.items()]

    def step(self) -> dict[str, torch.Tensor]:
        self.state.export(self.shards)
        full = self.state.full_fp8(self.shards)
        bf16 = ((s.key, s.out.view(self.masters[s.key].shape).clone()) for s in self.shards)
        return dict(self.state.fp8.served(bf16, full))


def on_grid(served: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bf16 checkpoint tensors to push for ``served``: ``ScaleRule.grid(codes, scales)`` of each FP8 weight (the
    grid route), the bf16 ones as they are."""
    from faircast_dist.fp8 import PRESETS
    return {n: PRESETS[RULE].grid(t, served[n.removesuffix("weight") + "weight_scale"])
            if t.dtype == torch.float8_e4m3fn else t for n, t in served.items() if not n.endswith("_scale")}


def codes_of(served: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (t, served[n.removesuffix("weight") + "weight_scale"]) for n, t in served.items()
            if t.dtype == torch.float8_e4m3fn}


def wrong_codes(engine: dict, want: dict) -> list[str]:
    """Names whose engine codes or scales differ from ``want`` (``{name: (codes, scales)}``), bit for bit."""
    bad = sorted(set(want) ^ set(engine))
    return bad + [n for n in sorted(set(want) & set(engine))
                  if not (same(engine[n][0], want[n][0]) and same(engine[n][1], want[n][1]))]


def dequantized(receiver, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the engine computes with for ``weights``, fp32: ``codes * scales`` of the linear weights (the engine's,
    read back), the rest as held."""
    fp8 = receiver.read_fp8()
    return {n: fp8[n][0].float() * fp8[n][1] if n in fp8 else t.float() for n, t in weights.items()}


def run_case(report: dict, name: str, fn) -> None:
    t0 = time.monotonic()
    try:
        report[name] = fn()
    except Exception as err:  # noqa: BLE001  (recorded: the test names it)
        report[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
    report.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 2)
    print(name, json.dumps(report[name], default=str)[:2000], flush=True)


def main(out_json: str) -> None:
    from vllm import LLM

    from faircast_dist.fp8 import PRESETS
    from vllm_receiver import EngineUpdateError, VllmReceiver, WeightMismatch
    torch.set_num_threads(1)
    rule = PRESETS[RULE]
    tmp = tempfile.mkdtemp(prefix="faircast-vllm-online-")
    fault = os.path.join(tmp, "fault")
    os.environ["FAIRCAST_TEST_FAULT"] = fault  # the engine's worker inherits it
    model = hf_model("LlamaForCausalLM", 0)
    checkpoint = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    model.to(torch.bfloat16).save_pretrained(tmp)
    model.float()
    t0 = time.monotonic()
    llm = LLM(model=tmp, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256, seed=0,
              worker_extension_cls="vllm_faults.FaultyExtension", kv_cache_memory_bytes=64 << 20,
              quantization="fp8_per_channel")
    report: dict = {"seconds": {"engine start": round(time.monotonic() - t0, 2)}}
    state: dict = {}

    def construct():
        receiver = state["receiver"] = VllmReceiver(llm)
        engine = receiver.read_fp8()
        linear = sorted(n for n in checkpoint if n.endswith("_proj.weight"))
        want = {n: rule.quantize(checkpoint[n]) for n in linear}
        return {"online": sorted(engine) == linear,
                "start_codes_wrong": wrong_codes(engine, want),  # the engine's own quantizer of the checkpoint
                "copy_dtypes": sorted({str(t.dtype) for t in receiver.weights.values()}),
                "copy_names_are_checkpoint": sorted(receiver.weights) == sorted(checkpoint),  # no weight_scale
                "sparse_deltas": receiver.sparse_deltas,
                "verified": receiver.verify()}
    run_case(report, "construct", construct)
    receiver = state.get("receiver")
    if receiver is None:
        with open(out_json, "w") as f:
            json.dump(report, f)
        return
    before = vllm_logprobs(llm)
    masters = {n: t.clone() for n, t in hf_model("LlamaForCausalLM", 1).state_dict().items()}
    dithered = Export({"mode": "fair", "method": "dithered", "format": "fp8", "fp8_rule": RULE, "seed": 3}, masters)

    def full_push():  # (a) a full push of grid-aimed bf16 from a dithered export
        served = state["served"] = dithered.step()
        sent = on_grid(served)
        totals = dict(receiver.totals)
        receiver.load(sent.items())
        engine = receiver.read_fp8()
        now = vllm_logprobs(llm)
        return {"fp8_names": len(codes_of(served)),
                "codes_wrong": wrong_codes(engine, codes_of(served)),
                "not_nearest": sum(not same(engine[n][0], rule.quantize(masters[n])[0]) for n in engine),
                "copy_is_sent": all(same(receiver.weights[n], t) for n, t in sent.items()),
                "bf16_read_as_sent": all(same(t, sent[n]) for n, t in receiver.read().items() if n in sent
                                         and n not in engine),
                "engine_bytes": receiver.totals["engine_bytes"] - totals["engine_bytes"],
                "verified": receiver.verify(),
                "logprobs_vs_hf": gap(now, hf_logprobs(model, dequantized(receiver, sent))),
                "logprobs_vs_before": gap(now, before)}
    run_case(report, "full_push", full_push)

    def delta_push():  # (b) the next export; deltas of layer 1's q_proj and down_proj only
        old = state["served"]
        g = torch.Generator().manual_seed(8)
        for n in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            masters[n].add_(0.05 * torch.randn(masters[n].shape, generator=g))
        new = dithered.step()
        changed = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
        old_grid, new_grid = on_grid(old), on_grid(new)
        deltas = []
        for n in changed:
            index = (bits(old_grid[n]) != bits(new_grid[n])).reshape(-1).nonzero()[:, 0].to(torch.int32)
            deltas.append((n, index, new_grid[n].reshape(-1)[index]))
        totals = dict(receiver.totals)
        count = receiver.apply(deltas)
        want = codes_of(old)
        want.update((n, v) for n, v in codes_of(new).items() if n in changed)
        engine = receiver.read_fp8()
        state["served"] = {**old, **{k: v for k, v in new.items() if k.removesuffix("_scale") in changed}}
        return {"changed": count,
                "codes_wrong": wrong_codes(engine, want),
                "moved": [n for n in changed if not same(engine[n][0], codes_of(old)[n][0])],
                # q alone goes with k and v (the copy's), down alone: whole fused layers, bf16
                "engine_bytes": receiver.totals["engine_bytes"] - totals["engine_bytes"],
                "layer_bytes": 2 * sum(old_grid[n].numel() for n in (
                    "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                    "model.layers.1.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight")),
                "verified": receiver.verify()}
    run_case(report, "delta_push", delta_push)

    def nearest_push():  # (c) plain bf16 masters: the engine rounds to nearest; == the preset's quantize, == nearest
        plain = {n: t.to(torch.bfloat16) for n, t in hf_model("LlamaForCausalLM", 2).state_dict().items()
                 if n in receiver.weights}
        receiver.load(plain.items())
        engine = receiver.read_fp8()
        nearest = Export({"mode": "nearest", "format": "fp8", "fp8_rule": RULE},
                         {n: t.float() for n, t in plain.items()}).step()
        return {"codes_wrong_vs_quantize": wrong_codes(engine, {n: rule.quantize(plain[n]) for n in engine}),
                "codes_wrong_vs_nearest_export": wrong_codes(engine, codes_of(nearest)),
                "verified": receiver.verify()}
    run_case(report, "nearest_push", nearest_push)

    def failed_push(kind: str):  # (d) a push failing in the engine: rolled back, the previous codes served
        def case():
            previous, copy = receiver.read_fp8(), {n: t.clone() for n, t in receiver.weights.items()}
            update = on_grid(dithered.step())
            with open(fault, "w") as f:
                f.write(kind)
            out = {}
            try:
                receiver.load(update.items())
                out["error"] = None
            except EngineUpdateError as err:
                out.update(error=str(err), engine_state=err.engine_state)
            out["copy_unchanged"] = all(same(copy[n], t) for n, t in receiver.weights.items())
            out["codes_wrong_vs_previous"] = wrong_codes(receiver.read_fp8(), previous)
            out["verified"] = receiver.verify()
            receiver.load(update.items())  # the engine takes the next push
            out["next_codes_wrong"] = wrong_codes(receiver.read_fp8(), {n: rule.quantize(t) for n, t in update.items()
                                                                       if n in previous})
            out["next_verified"] = receiver.verify()
            for path in (fault, fault + ".pid"):
                if os.path.exists(path):
                    os.unlink(path)
            return out
        return case
    run_case(report, "fault_after_half", failed_push("raise"))
    run_case(report, "fault_inside_reload", failed_push("inside"))

    def refused():  # (e) what an online engine cannot take, each refused before anything is written, naming it
        w, out = dict(receiver.weights), {}
        q = "model.layers.0.self_attn.q_proj.weight"
        codes, scales = receiver.read_fp8([q])[q]
        cases = {
            "fp8 codes": lambda: receiver.load([(q, codes)]),
            "a scale": lambda: receiver.load([(q.removesuffix("weight") + "weight_scale", scales)]),
            "non-finite, allowed": lambda: _allowing(receiver, lambda: receiver.load(
                [(q, torch.full_like(w[q], float("nan")))])),
            "read_fp8 of a bf16 tensor": lambda: receiver.read_fp8(["model.embed_tokens.weight"]),
        }
        for case, call in cases.items():
            try:
                call()
                out[case] = "no error"
            except (KeyError, TypeError, ValueError) as err:
                out[case] = f"{type(err).__name__}: {err}"
        out["copy_unchanged"] = all(same(w[n], t) for n, t in receiver.weights.items())
        out["verified"] = receiver.verify()
        try:
            VllmReceiver(llm, sparse_deltas=True)
            out["sparse"] = "no error"
        except ValueError as err:
            out["sparse"] = str(err)
        return out
    run_case(report, "refused", refused)

    def planted():  # verify() catches an engine whose codes differ from what the copy quantizes to
        q = "model.layers.1.self_attn.q_proj.weight"
        wrong = receiver.weights[q].clone()
        wrong.view(-1)[5] = -wrong.view(-1)[5] * 2 - 0.25
        fused = [(n, wrong if n == q else receiver.weights[n]) for n in receiver.weights if ".layers.1.self_attn." in n
                 and n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
        receiver.llm.collective_rpc("faircast_push", args=(receiver.buffer.name, receiver.buffer.pack(fused), False,
                                                           None))
        try:
            receiver.verify()
            return "not caught"
        except WeightMismatch as err:
            return str(err)
    run_case(report, "planted", planted)
    report["seconds"]["total"] = round(time.monotonic() - t0, 2)
    with open(out_json + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(out_json + ".tmp", out_json)
    llm.llm_engine.engine_core.shutdown()


def _allowing(receiver, call):
    receiver.allow_non_finite = True
    try:
        return call()
    finally:
        receiver.allow_non_finite = False


if __name__ == "__main__":
    main(sys.argv[1])
