"""Served weights from a DeepSpeed trainer into a real vLLM engine through VllmReceiver (torchrun, 2 ranks).
docs/deepspeed.md's "Serving the weights" snippets run here as written (ZeRO-2).

    torchrun --standalone --nproc_per_node 2 tests/vllm_worker.py OUT_JSON

One vLLM engine (rank 0) receives, for ZeRO-2 and ZeRO-3 and every method, a full update one tensor per
call, a full update in one call, and 3 steps of deltas (the first one tensor per call, then bucketed);
after every push the engine's weights, read back through its kernels, are compared bit for bit with
``served_weights(engine)``. Then a second receiver on the engine (the first one's pushes must still land, and each
one's push after the other wrote is refused), paths the worker must refuse to map, bad updates (NaN and Inf
among them: each must raise and write nothing) and a planted partial write of a fused layer (``verify()`` must
catch it). Rank 0 writes what it saw to OUT_JSON.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from helpers import bits

METHODS = ("nearest", "stochastic", "error_feedback", "dithered")
# head_dim 32 (vLLM's CPU attention needs >= 32), GQA (fused qkv of unequal parts), tied embeddings
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=128)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def readme_snippets() -> list[str]:
    """The Python blocks of docs/deepspeed.md's "Serving the weights" section, as written there."""
    import re
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "deepspeed.md")) as f:
        text = f.read()
    section = text[text.index("## Serving the weights"):text.index("## Telemetry")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


ENGINE_LINE = 'llm = vllm.LLM(model=hf_dir, dtype="bfloat16", worker_extension_cls=vllm_receiver.WORKER_EXTENSION)'


def planted(t: torch.Tensor, **where: int) -> torch.Tensor:
    """A copy of ``t`` with NaN, +Inf or -Inf (``nan=``, ``inf=``, ``ninf=``) at the given flat indices."""
    t = t.clone()
    for what, i in where.items():
        t.view(-1)[i] = {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf")}[what]
    return t


def second_receiver(receiver) -> tuple[dict, object]:
    """A second receiver on the engine, made after the first one's pushes, then a full update to other weights from
    the first: the engine must compute with the first one's weights (read back, verified, and vLLM's prompt
    log-probs against an fp32 HF forward of them), not the second one's buffer. Returns (report, the second)."""
    from vllm_arch_worker import gap, hf_logprobs, vllm_logprobs
    from vllm_receiver import VllmReceiver, WeightMismatch
    second = VllmReceiver(receiver.llm)
    model = tiny_llama().float().eval()
    old = hf_logprobs(model, receiver.weights)
    g = torch.Generator().manual_seed(11)
    new = {n: (t.float() + 0.1 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in receiver.weights.items()}
    receiver.load(new.items())
    rep = {"read_as_sent": all(torch.equal(bits(t), bits(new[n])) for n, t in receiver.read().items() if n in new)}
    try:
        rep["verified"] = receiver.verify()
    except WeightMismatch as err:
        rep["verified"] = str(err)
    now = vllm_logprobs(receiver.llm)
    rep["new"], rep["old"] = gap(now, hf_logprobs(model, new)), gap(now, old)
    return rep, second


def foreign_buffers(receiver, tmp: str) -> dict:
    """What the worker must refuse to map (read-write) when asked over RPC: a file by its path or through a /proc fd,
    another memory file, a faircast buffer under another buffer's name. Nothing is mapped or written, and the
    receiver's own buffer stays mapped."""
    from vllm_receiver.transport import SharedBuffer
    victim = os.path.join(tmp, "victim.bin")
    with open(victim, "wb") as f:
        f.write(b"\x5a" * 4096)
    pid, name = os.getpid(), "faircast-buffer-" + "ab" * 16
    fds = [os.open(victim, os.O_RDWR), os.memfd_create("not-faircast")]
    os.ftruncate(fds[1], 4096)
    other = SharedBuffer.create(4096)  # held open: the worker could open it
    rep = {}
    try:
        for case, path in {"a file": victim, "a file through /proc": f"/proc/{pid}/fd/{fds[0]}",
                           "another memory file": f"/proc/{pid}/fd/{fds[1]}",
                           "a faircast buffer by another name": other.path}.items():
            try:
                receiver.llm.collective_rpc("faircast_map", args=(path, 4096, name, None))
                rep[case] = "no error"
            except Exception as err:  # noqa: BLE001  (as vLLM reports the worker's error)
                rep[case] = [path, str(err)]
    finally:
        other.close()
        for fd in fds:
            os.close(fd)
    with open(victim, "rb") as f:
        rep["file_unchanged"] = f.read() == b"\x5a" * 4096
    rep["own_buffer_verified"] = receiver.verify()
    return rep


def main(out_json: str) -> None:
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the JIT shm op build
    import torch.distributed as dist

    import deepspeed_hooks
    from deepspeed_hooks.served import served_deltas, served_weights
    from faircast_dist.delta import DeltaTracker
    from vllm_receiver import WORKER_EXTENSION, VllmReceiver

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    tmp = tempfile.mkdtemp(prefix="faircast-vllm-") if rank == 0 else None
    receiver = None
    if rank == 0:
        from vllm import LLM
        tiny_llama().to(torch.bfloat16).save_pretrained(tmp)
        llm = LLM(model=tmp, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
                  seed=0, worker_extension_cls=WORKER_EXTENSION)
        receiver = VllmReceiver(llm)
        report_sparse = receiver.sparse_deltas
    dist.barrier()
    report = {"pushes": [], "errors": {}}
    seen = {"payload_bytes": 0, "engine_bytes": 0}

    def check(where: str, engine, kind: str, recv=None) -> None:
        """Rank 0: the engine's effective weights == served_weights(engine), bit for bit; recv.verify()."""
        served = {n: t.detach().to("cpu", copy=True) for n, t in served_weights(engine, bucket_bytes=4096)}
        if rank:
            return
        recv = recv or receiver
        engine_side = recv.read()
        wrong = [n for n, t in served.items() if not torch.equal(bits(engine_side[n].reshape(-1)), bits(t.reshape(-1)))]
        if not torch.equal(bits(engine_side["lm_head.weight"].reshape(-1)), bits(served["model.embed_tokens.weight"].reshape(-1))):
            wrong.append("lm_head.weight (tied)")
        recv.verify()
        moved = {k: recv.totals[k] - seen[k] for k in seen} if recv is receiver else {}  # since the previous check
        seen.update((k, receiver.totals[k]) for k in seen)
        report["pushes"].append(dict(where=where, kind=kind, wrong=wrong, served_tensors=len(served), **moved))

    for stage in (2, 3):
        if stage == 3 and rank == 0:  # ZeRO-3's deltas go the other way: whole layers through the reload path
            receiver = VllmReceiver(receiver.llm, sparse_deltas=False)
            seen.update(payload_bytes=0, engine_bytes=0)
        for method in METHODS:
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                   "steps_per_print": 10**9,
                   "export_cast": {"mode": "nearest"} if method == "nearest" else
                   {"mode": "fair", "method": method, "seed": 7}}
            if stage == 3:
                with deepspeed.zero.Init(config_dict_or_path=cfg):
                    model = tiny_llama()
            else:
                model = tiny_llama()
            engine, *_ = deepspeed_hooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            where = f"zero{stage}/{method}"
            for name, t in served_weights(engine, bucket_bytes=4096):  # a full update, one tensor per call
                if rank == 0:
                    receiver.load([(name, t)])
            check(where + "/full, one tensor a call", engine, "full")
            full = [(n, t.detach().clone()) for n, t in served_weights(engine, bucket_bytes=4096)]
            if rank == 0:
                receiver.load(full)  # a full update in one call
            check(where + "/full, one call", engine, "full")
            tracker = DeltaTracker()
            list(served_deltas(engine, tracker))  # the baseline: the engine holds it already
            for step in range(1, 4):
                g = torch.Generator().manual_seed(100 * step + dist.get_rank())
                ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=g)
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
                deltas = list(served_deltas(engine, tracker, bucket_bytes=4096))
                if rank == 0:
                    if step == 1:
                        for d in deltas:
                            receiver.apply([d])
                    else:
                        receiver.apply(deltas)
                check(where + f"/deltas step {step}" + (", one tensor a call" if step == 1 else ""), engine, "delta")
            if (stage, method) == (2, "dithered"):  # docs/deepspeed.md's snippets, as written (ZeRO-2: rank 0 alone sends)
                full, delta = readme_snippets()
                assert ENGINE_LINE in full  # the engine is this test's own (test settings: no tokenizer, eager)
                ns = {"llm": receiver.llm if rank == 0 else None, "engine": engine}
                for step, code in enumerate([full.replace(ENGINE_LINE, ""), delta, delta.splitlines()[-1]]):
                    if step == 2:  # one more training step, then the snippet's delta line again
                        ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(9))
                        engine.backward(engine(input_ids=ids, labels=ids).loss)
                        engine.step()
                    if rank == 0:
                        exec(code, ns)
                    check(where + f"/README snippet {step + 1}", engine, "readme", ns.get("receiver"))
            engine.destroy()

    if rank == 0:  # bad updates: each raises before anything is written
        report["sparse_deltas"] = [report_sparse, receiver.sparse_deltas]
        report["second_receiver"], second = second_receiver(receiver)
        report["foreign_buffers"] = foreign_buffers(receiver, tmp)
        w = dict(receiver.weights)
        name = "model.layers.0.self_attn.k_proj.weight"
        good = ("model.layers.0.self_attn.q_proj.weight", torch.zeros_like(w["model.layers.0.self_attn.q_proj.weight"]))
        good_delta = (good[0], torch.tensor([3]), torch.ones(1, dtype=torch.bfloat16))
        cases = {
            "unknown name": lambda: receiver.load([good, ("model.layers.9.mlp.up_proj.weight", w[name])]),
            "tied head name": lambda: receiver.load([("lm_head.weight", w["model.embed_tokens.weight"])]),
            "wrong dtype": lambda: receiver.load([good, (name, w[name].float())]),
            "wrong shape": lambda: receiver.load([good, (name, w[name].reshape(-1))]),
            "given twice": lambda: receiver.load([good, good]),
            "index out of range": lambda: receiver.apply([(name, torch.tensor([0, w[name].numel()], dtype=torch.int32),
                                                           torch.zeros(2, dtype=torch.bfloat16))]),
            "delta values dtype": lambda: receiver.apply([(name, torch.tensor([0]), torch.zeros(1))]),
            "delta lengths": lambda: receiver.apply([(name, torch.tensor([0, 1]), torch.zeros(1, dtype=torch.bfloat16))]),
            "values not a tensor": lambda: receiver.apply([(name, torch.tensor([0]), [1.0])]),
            "meta tensor": lambda: receiver.load([(name, torch.empty(w[name].shape, dtype=torch.bfloat16,
                                                                       device="meta"))]),
            "given twice, first empty": lambda: receiver.apply([
                (name, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bfloat16)),
                (name, torch.tensor([0]), torch.zeros(1, dtype=torch.bfloat16))]),
            # a NaN or Inf served makes every log-prob NaN: refused by default, naming the tensor and the count
            "non-finite load": lambda: receiver.load([good, (name, planted(w[name], nan=2, inf=7, ninf=9))]),
            "non-finite delta": lambda: receiver.apply([good_delta, (name, torch.tensor([0, 1, 2]), torch.tensor(
                [1.0, float("nan"), float("-inf")], dtype=torch.bfloat16))]),
        }
        for what, call in cases.items():
            try:
                call()
                report["errors"][what] = "no error"
            except (KeyError, TypeError, ValueError) as err:
                report["errors"][what] = f"{type(err).__name__}: {err}"
            receiver.verify()  # nothing was written: the engine still serves the copy
        report["copy_unchanged"] = all(torch.equal(bits(receiver.weights[n].reshape(-1)), bits(t.reshape(-1))) for n, t in w.items())
        # a NaN served value (Fair Cast keeps NaN a NaN, with allow_non_finite): vLLM's sparse path reserves NaN, so
        # it goes whole-layer. Each receiver's push after the other wrote is refused (first the second's: the first
        # pushed after it was made; then the first's, once the second attached and wrote)
        from vllm_receiver import EngineUpdateError
        nan_delta = [(name, torch.tensor([5]), torch.tensor([float("nan")], dtype=torch.bfloat16, requires_grad=True))]
        for recv, other in ((second, receiver), (receiver, second)):
            recv.allow_non_finite = True
            try:
                recv.apply(nan_delta)
            except EngineUpdateError as err:  # refused, nothing written
                report.setdefault("stale", []).append([err.engine_state, str(err), other.verify() > 0])
                recv.attach(recv.llm)  # serve its copy again, then the delta lands
                recv.apply(nan_delta)
            recv.verify()
            report.setdefault("nan_delta", []).append(bool(recv.read([name])[name].reshape(-1)[5].isnan())
                                                      and not recv.weights[name].requires_grad)
        # a planted partial write: one shard of a fused layer, straight through the reload receiver.load avoids
        from vllm_receiver import WeightMismatch
        q = "model.layers.1.self_attn.q_proj.weight"
        receiver.llm.collective_rpc("faircast_push", args=(receiver.buffer.name,
                                                           receiver.buffer.pack([(q, receiver.weights[q])]), False, None))
        try:
            receiver.verify()
            report["planted"] = "not caught"
        except WeightMismatch as err:
            report["planted"] = str(err)
        report["copy_bytes"] = receiver.nbytes()
        with open(out_json + ".tmp", "w") as f:  # complete or absent (the test forgives an abort at exit after it)
            json.dump(report, f)
        os.replace(out_json + ".tmp", out_json)
    dist.barrier()
    dist.destroy_process_group()  # not left to interpreter exit, where gloo can abort


if __name__ == "__main__":
    main(sys.argv[1])
