"""Fair Cast in megatron-core: real gloo processes (2-4 ranks) on a tiny GPT (SwiGLU, tied
embeddings), through the CPU shim in ``tests/megatron_shim.py``.

Layouts are compared by what the export must be (docs/design.md, "Testing the invariants"):

* one fixed master (+ residual) state, placed in each layout by Megatron's own checkpoint
  metadata and DistOpt ranges, must export bitwise the same full bf16 model everywhere;
* after real training steps in any layout, every served element must equal the single-process
  reference cast (FairCaster on the gathered whole param, with the gathered residual).

Every spawn is run once per session (cached) and shared by the tests that read it.
"""
from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

from faircast_dist.config import FP8_EXCLUDE, ExportCastConfig
from helpers import bits
from megatron_worker import run

SR = {"mode": "fair", "method": "stochastic", "seed": 7}
EF = {"mode": "fair", "method": "error-feedback"}
DITHER = {"mode": "fair", "method": "dithered", "seed": 7}
METHODS = {"stochastic": SR, "error_feedback": EF, "dithered": DITHER}
SAVE_AFTER, STEPS = 2, 4  # resume runs: save after 2 steps, compare steps 3 and 4
# FP8 served weights (format "fp8"; Megatron: channel scales)
FP8 = {"error_feedback": {**EF, "format": "fp8"}, "dithered": {**DITHER, "format": "fp8"},
       # 128x128 blocks of the checkpoint's q/k/v and gate/up tensors (the model: 4 heads, 4 query groups)
       "block_dithered": {**DITHER, "format": "fp8", "fp8_scales": "block"},
       # the stacks' quantizers (faircast_dist.fp8.PRESETS): recomputed block scales, codes multiplied (verl's);
       # channel scales of vLLM's online per-channel quantizer
       "verl_dithered": {**DITHER, "format": "fp8", "fp8_rule": "verl"},
       "vllm_channel_stochastic": {**SR, "format": "fp8", "fp8_rule": "vllm-fp8-per-channel"}}

_CKPT = tempfile.TemporaryDirectory(prefix="faircast-megatron-")
CKPT = {name: os.path.join(_CKPT.name, name) for name in ("dp_ef", "dp_sr", "full_ef", "f16_ef", "overlap_ef", "moe_ef",
                                                         "moe_fp8_ef", "vpp_ef", "cp_ef", "stock", "fp8_error_feedback",
                                                         "fp8_block_dithered", "fp8_partial")}

# (TP, PP, DP, DistributedOptimizer)
LAYOUTS = [(1, 1, 1, True), (2, 1, 1, True), (1, 2, 1, False), (1, 1, 2, True), (1, 1, 2, False),
           (2, 1, 2, True), (2, 2, 1, False), (1, 2, 1, True)]
# launches with virtual pipeline stages (--num-layers-per-virtual-pipeline-stage 1: two model chunks per
# PP rank, stage 0 holding layers 0 and 2, the interleaved schedule)
VIRTUAL_PIPELINE = {(1, 2, 1, True): 2}
BIG = {(2, 1, 2, True), (2, 2, 1, False)}  # 4 ranks: marked slow
# Megatron-LM's training-loop set-up (finalize_model_grads, DDP sync funcs) with production flags
# (several buckets, so the overlapped all-gather and reduce-scatter run bucket by bucket)
OVERLAP = {"ddp": dict(bucket_size=2000, overlap_grad_reduce=True, overlap_param_gather=True)}
PRODUCTION = {(1, 1, 2, True): {"overlap": OVERLAP},
              (2, 1, 1, True): {"sp": {"sequence_parallel": True, "ddp": {"grad_reduce_in_fp32": True}}}}  # verl's default
REBUILT = [(1, 1, 2, True), (1, 1, 2, False)]
SERVED = {(1, 1, 2, True): OVERLAP, (1, 2, 1, False): None, (2, 1, 1, True): None}  # layout: production flags  # layouts whose bf16 model is offloaded and rebuilt
TELEMETRY = {(1, 1, 2, True): 300, (2, 2, 1, False): 300, (1, 1, 2, False): 65536}  # layout: sample size
FP8_TELEMETRY = (2, 2, 1, False)  # FP8 drift telemetry: row-parallel channels span the TP ranks
# MoE with expert parallelism: (TP, PP, DP, DistOpt, EP, expert TP); the first is the reference. Each
# shares the launch of its dense layout (TP, PP, DP, DistOpt), which is initialized with this EP and
# expert TP (dense jobs do not see them). 4 experts, top-2 (megatron_worker.MOE); TP > 1 with
# --sequence-parallel, as megatron-core requires for MoE. Expert TP 2 with EP 2 does not train on
# gloo (the dispatcher's uneven all-gather over expert TP, tensor_parallel/mappings.py:150).
MOE_LAYOUTS = [(1, 1, 1, True, 1, 1), (1, 1, 2, True, 2, 1), (2, 1, 1, True, 2, 1), (2, 1, 2, True, 2, 1)]
EXPERT_PARALLEL = {l[:4]: l[4:] for l in MOE_LAYOUTS}  # dense layout -> (EP, expert TP) of its launch
MOE_TELEMETRY = (1, 1, 2, True, 2, 1)  # a Float16-optimizer MoE run with telemetry (EP 2: DP ranks hold other experts)
MOE_SERVED = (2, 1, 2, True, 2, 1)  # served_weights of a MoE model (EP 2, TP 2)
MOE_FP8 = ("error_feedback", "block_dithered")  # FP8 experts, on every MoE layout


def layout_id(layout):
    tp, pp, dp, distopt, *expert = layout
    moe = "-moe-ep{}etp{}".format(*expert) if expert else ""
    vpp = f"vpp{VIRTUAL_PIPELINE[layout]}" if layout in VIRTUAL_PIPELINE else ""
    return f"tp{tp}pp{pp}{vpp}dp{dp}-{'distopt' if distopt else 'float16'}{moe}"


def _moe_jobs(layout):
    tp, _, _, distopt, _, _ = layout
    base = dict(distopt=distopt, moe={}, production={"sequence_parallel": tp > 1})
    jobs = {f"moe_{m}_fixed": dict(base, export_cast=c, set_state=5, exports=2) for m, c in METHODS.items()}
    jobs.update({f"moe_{m}_train": dict(base, export_cast=c, steps=2) for m, c in METHODS.items()})
    if layout == MOE_SAVED_BY:  # a checkpoint of the EP run, resumed in resume_run(1, 1, 2)
        jobs["moe_error_feedback_train"].update(steps=STEPS, save=CKPT["moe_ef"], save_after=SAVE_AFTER,
                                               sharding="dp_reshardable")
        jobs["moe_fp8_ef"] = dict(base, export_cast=FP8["error_feedback"], steps=STEPS, save=CKPT["moe_fp8_ef"],
                                  save_after=SAVE_AFTER, sharding="dp_reshardable")
    if layout == MOE_TELEMETRY:
        jobs["moe_telemetry"] = dict(base, export_cast=SR, distopt=False, steps=3, telemetry=65536)
        jobs["moe_fp8_block_dithered_telemetry"] = dict(base, export_cast=FP8["block_dithered"], distopt=False, steps=3,
                                                        telemetry=300)
    if layout == MOE_SERVED:
        jobs["moe_served_weights"] = dict(base, export_cast=DITHER, steps=2, served_weights=True)
    jobs.update({f"moe_fp8_{m}_fixed": dict(base, export_cast=FP8[m], set_state=5, exports=2) for m in MOE_FP8})
    if layout == MOE_SAVED_BY:  # non-homogeneous layers (a moe_layer_freq list): Megatron numbers them in the key
        jobs["moe_fp8_listed_fixed"] = dict(base, moe={"moe_layer_freq": [1, 1, 1, 1]},
                                            export_cast=FP8["block_dithered"], set_state=5, exports=2)
    return jobs


def _jobs(layout):
    if len(layout) > 4:  # a MoE layout with a launch of its own
        return _moe_jobs(layout)
    distopt = layout[3]
    jobs = {f"{m}_fixed": dict(export_cast=c, distopt=distopt, set_state=5, exports=3) for m, c in METHODS.items()}
    jobs.update({f"{m}_train": dict(export_cast=c, distopt=distopt, steps=2) for m, c in METHODS.items()})
    jobs.update({f"fp8_{m}_fixed": dict(export_cast=FP8[m], distopt=distopt, set_state=5, exports=2)
                 for m in FP8_LAYOUTS})
    if layout == (1, 1, 2, True):  # FP8 checkpoints, resumed in resume_run(2, 1, 1)
        jobs.update({f"fp8_{m}": dict(export_cast=FP8[m], distopt=True, steps=STEPS, save=CKPT[f"fp8_{m}"],
                                      save_after=SAVE_AFTER, sharding="fully_reshardable")
                     for m in ("error_feedback", "block_dithered")})
        jobs["fp8_partial"] = dict(export_cast=FP8_PARTIAL, distopt=True, steps=STEPS, save=CKPT["fp8_partial"],
                                   save_after=SAVE_AFTER, sharding="fully_reshardable")
        jobs["fp8_partial_resumed"] = _resume("fp8_partial", export_cast=FP8_PARTIAL, distopt=True,
                                              sharding="fully_reshardable")
    for moe in MOE_LAYOUTS:  # the MoE layouts that share this launch (before any activate())
        if moe[:4] == layout:
            jobs.update(_moe_jobs(moe))
    for flags, production in PRODUCTION.get(layout, {}).items():
        jobs.update({f"{m}_{flags}": dict(export_cast=c, distopt=distopt, steps=3, production=production)
                     for m, c in METHODS.items()})
    if layout in SERVED:  # the served weights under checkpoint names, whole (PP: from every stage)
        jobs["served_weights"] = dict(export_cast=DITHER, distopt=layout[3], steps=2, served_weights=True,
                                      production=SERVED[layout])
    if layout == (1, 1, 2, True):  # a checkpoint of the overlapped run, resumed in resume_run(1, 1, 2)
        jobs["overlap_ef"] = dict(export_cast=EF, distopt=True, steps=STEPS, production=OVERLAP, save=CKPT["overlap_ef"],
                                  save_after=SAVE_AFTER, sharding="dp_reshardable")
    if layout in REBUILT:  # the same runs, the model rebuilt from the masters before and after each step
        jobs.update({f"{m}_rebuilt": dict(export_cast=c, distopt=distopt, steps=2, rebuild_after=(0, 1, 2))
                     for m, c in METHODS.items()})
    if layout == (1, 1, 1, True):  # (before the activate() jobs: its wrap stays for the launch's later jobs)
        jobs["stock_saved"] = dict(export_cast=None, how="none", distopt=True, steps=SAVE_AFTER, save=CKPT["stock"],
                                   sharding="dp_reshardable")
        jobs["ef_from_stock"] = _resume("stock", export_cast=EF, distopt=True, sharding="dp_reshardable")
        jobs["stock"] = dict(export_cast=None, distopt=True, steps=3, how="none")
        jobs["uninstalled"] = dict(export_cast=SR, distopt=True, steps=3, how="uninstall")
        jobs["nearest"] = dict(export_cast={"mode": "nearest", "method": "error_feedback"}, distopt=True, steps=3)
        jobs["activate_nearest"] = dict(export_cast="nearest", distopt=True, steps=3, how="activate")
        jobs["activate_fair"] = dict(export_cast=SR, distopt=True, steps=3, how="activate")
        jobs["fp16_fair"] = dict(export_cast=SR, distopt=True, fp16=True)
        jobs["frozen_fair"] = dict(export_cast=SR, distopt=True, frozen=True, how="activate")
    if layout == (1, 1, 2, True):  # checkpoints of the resume tests, and the other copy paths
        jobs["dp_ef"] = dict(export_cast=EF, distopt=True, steps=STEPS, save=CKPT["dp_ef"], save_after=SAVE_AFTER,
                             sharding="dp_reshardable", param_buffer=True, reload=True)
        jobs["dp_sr"] = dict(export_cast=SR, distopt=True, steps=STEPS, save=CKPT["dp_sr"], save_after=SAVE_AFTER,
                             sharding="dp_reshardable")
    if layout == (2, 1, 1, True):
        jobs["full_ef"] = dict(export_cast=EF, distopt=True, steps=STEPS, save=CKPT["full_ef"],
                               save_after=SAVE_AFTER, sharding="fully_reshardable")
    if layout in TELEMETRY:
        jobs["telemetry"] = dict(export_cast=SR, distopt=distopt, steps=3, telemetry=TELEMETRY[layout])
    if layout == FP8_TELEMETRY:
        jobs.update({f"fp8_{m}_telemetry": dict(export_cast=FP8[m], distopt=distopt, steps=3, telemetry=300)
                     for m in ("dithered", "block_dithered")})
    if layout == (1, 1, 2, True):  # Megatron-LM's logging path (stand-ins for megatron.training); last:
        lm = ["--bf16", "--export-cast", "fair", "--export-cast-seed", "7", "--log-interval", "3",
              "--tensorboard-log-interval", "2"]  # scalars follow Megatron's: every 2, not every 3
        jobs["lm_tensorboard"] = dict(how="megatron_lm", export_cast=SR, steps=4, megatron_lm=lm + ["--tensorboard-dir", "tb"])
        jobs["lm_wandb"] = dict(how="megatron_lm", export_cast=SR, steps=2, megatron_lm=lm + ["--wandb-project", "p"])
        jobs["lm_no_writer"] = dict(how="megatron_lm", export_cast=SR, steps=2, megatron_lm=lm)  # activate() leaves it wrapped
        jobs["lm_flag_off"] = dict(how="megatron_lm", export_cast=SR, steps=2,
                                   megatron_lm=lm + ["--tensorboard-dir", "tb", "--no-export-cast-telemetry"])
        jobs["lm_model_only_load"] = dict(how="megatron_lm", export_cast=SR, steps=2, first=5, model_only_load=5,
                                          megatron_lm=lm)
        jobs.update(ENV_JOBS)
    if layout in VIRTUAL_PIPELINE:  # a checkpoint of the two-chunk model, resumed by a later job of the launch
        jobs["vpp_ef"] = dict(export_cast=EF, distopt=True, steps=STEPS, save=CKPT["vpp_ef"], save_after=SAVE_AFTER,
                              sharding="dp_reshardable")
        jobs["vpp_ef_resumed"] = _resume("vpp_ef", export_cast=EF, distopt=True, sharding="dp_reshardable")
    if layout == (1, 1, 2, False):
        jobs["f16_ef"] = dict(export_cast=EF, distopt=False, steps=STEPS, save=CKPT["f16_ef"], save_after=SAVE_AFTER,
                              reload=True)
    return jobs


@functools.lru_cache(maxsize=None)
def layout_run(layout):
    tp, pp, dp, distopt, *expert = layout
    ep, etp = expert or EXPERT_PARALLEL.get(layout, (1, None))
    if expert and EXPERT_PARALLEL.get((tp, pp, dp, distopt)) == (ep, etp):
        return layout_run((tp, pp, dp, distopt))  # a MoE layout shares its dense layout's launch
    return run(tp, pp, dp, _jobs(layout), ep=ep, etp=etp, vpp=VIRTUAL_PIPELINE.get(layout))


def _resume(name, **job):
    return dict(steps=STEPS - SAVE_AFTER, first=SAVE_AFTER, load=CKPT[name], **job)


# where each checkpoint is loaded: (TP, PP, DP) -> jobs
RESUMES = {
    (1, 1, 2): {"dp_ef": _resume("dp_ef", export_cast=EF, distopt=True, sharding="dp_reshardable", rebuild_after=(0,)),
                "dp_sr": _resume("dp_sr", export_cast=SR, distopt=True, sharding="dp_reshardable", rebuild_after=(0,)),
                "dp_sr_to_ef": _resume("dp_sr", export_cast=EF, distopt=True, sharding="dp_reshardable"),
                "dp_ef_fresh_metadata": _resume("dp_ef", export_cast=EF, distopt=True, sharding="dp_reshardable",
                                                fresh_metadata=True),
                "full_ef_tp2_to_dp2": _resume("full_ef", export_cast=EF, distopt=True, sharding="fully_reshardable"),
                "f16_ef": _resume("f16_ef", export_cast=EF, distopt=False),
                "overlap_ef": _resume("overlap_ef", export_cast=EF, distopt=True, sharding="dp_reshardable",
                                      production=OVERLAP),
                "moe_ef": _resume("moe_ef", export_cast=EF, distopt=True, sharding="dp_reshardable", moe={},
                                  production={"sequence_parallel": False}),
                "moe_fp8_ef": _resume("moe_fp8_ef", export_cast=FP8["error_feedback"], distopt=True,
                                      sharding="dp_reshardable", moe={}, production={"sequence_parallel": False}),
                # the experts left bf16 (as a checkpoint from before experts were FP8 must be loaded): the expert
                # leaf has no FP8 param
                "moe_fp8_ef_experts_bf16": _resume("moe_fp8_ef", export_cast={**FP8["error_feedback"], "fp8_exclude":
                                                   "experts|embed|output_layer|norm|router"}, distopt=True,
                                                   sharding="dp_reshardable", moe={},
                                                   production={"sequence_parallel": False})},
    (1, 1, 1): {"dp_ef_dp2_to_dp1": _resume("dp_ef", export_cast=EF, distopt=True, sharding="dp_reshardable")},
    (2, 1, 1): {"full_ef": _resume("full_ef", export_cast=EF, distopt=True, sharding="fully_reshardable")},
    (1, 2, 1): {"f16_ef_dp2_to_pp2": _resume("f16_ef", export_cast=EF, distopt=False)},
}
# FP8 on every layout (the other casts, resume at DP 2 and a bf16 checkpoint into FP8: tests/test_contract.py)
FP8_LAYOUTS = ("error_feedback", "dithered", "block_dithered", "verl_dithered", "vllm_channel_stochastic")
FP8_PARTIAL = {**FP8["dithered"], "fp8_exclude": FP8_EXCLUDE + r"|layers\.3\."}  # the last layer kept bf16
RESUMES[(2, 1, 1)]["fp8_error_feedback_tp2"] = _resume("fp8_error_feedback", export_cast=FP8["error_feedback"],
                                                       distopt=True, sharding="fully_reshardable")
RESUMES[(2, 1, 1)]["fp8_block_dithered_tp2"] = _resume("fp8_block_dithered", export_cast=FP8["block_dithered"],
                                                       distopt=True, sharding="fully_reshardable")
MOE_SAVED_BY = (1, 1, 2, True, 2, 1)
SAVED_BY = {"dp_ef": (1, 1, 2, True), "dp_sr": (1, 1, 2, True), "full_ef": (2, 1, 1, True),
            "fp8_error_feedback": (1, 1, 2, True),
            "fp8_block_dithered": (1, 1, 2, True),
            "f16_ef": (1, 1, 2, False), "overlap_ef": (1, 1, 2, True), "moe_ef": MOE_SAVED_BY,
            "moe_fp8_ef": MOE_SAVED_BY}


@functools.lru_cache(maxsize=None)
def resume_run(tp, pp, dp):
    for layout in SAVED_BY.values():  # the checkpoints first
        layout_run(layout)
    ep, etp = EXPERT_PARALLEL.get((tp, pp, dp, True), (1, None))  # as the layout that saved (MoE jobs)
    return run(tp, pp, dp, RESUMES[(tp, pp, dp)], ep=ep, etp=etp)


def assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        differ = int((bits(a[k]) != bits(b[k])).sum())
        assert differ == 0, f"{what}: {k}: {differ} of {a[k].numel()} elements differ"


def params(layout):
    marks = [pytest.mark.slow] if layout[:4] in BIG else []
    return pytest.param(layout, marks=marks, id=layout_id(layout))


# -- layout invariance -----------------------------------------------------------------------------
def assert_same_exports(ref: dict, got: dict, method: str):
    """Two layouts' exports of one master state: masters placed alike, served bf16 (and residuals)
    bitwise equal at every export."""
    for k, (a, b) in enumerate(zip(ref["snaps"], got["snaps"])):
        assert_same(a["master"], b["master"], f"export {k}: master state placed")
        assert_same(a["served"], b["served"], f"export {k}: served bf16")
        if method == "error_feedback":
            assert_same(a["residual"], b["residual"], f"export {k}: residual")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", [params(l) for l in LAYOUTS[1:]])
def test_one_master_state_exports_the_same_model_in_every_layout(layout, method):
    ref = layout_run(LAYOUTS[0])[f"{method}_fixed"]
    got = layout_run(layout)[f"{method}_fixed"]
    assert "error" not in got, got.get("error")
    assert len(got["snaps"]) == len(ref["snaps"]) == 3
    assert_same_exports(ref, got, method)


@pytest.mark.parametrize("layout", [params(l) for l in LAYOUTS])
def test_every_served_element_is_the_reference_cast(layout):
    for name in [f"{m}_{job}" for m in METHODS for job in ("fixed", "train")]:
        record = layout_run(layout)[name]
        assert record["installed"], name
        assert record["mismatch"] == 0, f"{name}: {record['mismatch']} served elements differ from the reference"
        assert record["rtn_differs"] > 200, f"{name}: hardly differs from round to nearest: the check cannot bite"
        assert record["replica_mismatch"] == 0, f"{name}: replicas disagree"


def test_stochastic_rounding_draws_fresh_bits_each_export_dithered_rounding_does_not():
    key = "decoder.layers.mlp.linear_fc1.weight"
    snaps = layout_run(LAYOUTS[0])["stochastic_fixed"]["snaps"]  # same master, three exports
    assert not torch.equal(snaps[0]["served"][key], snaps[1]["served"][key])
    snaps = layout_run(LAYOUTS[0])["dithered_fixed"]["snaps"]  # no flip-flop: the same bits every export
    for snap in snaps[1:]:
        assert_same(snaps[0]["served"], snap["served"], "dithered, unchanged master")


# -- off means off, activation, misuse -------------------------------------------------------------
def test_nearest_and_unset_are_stock_megatron_bit_for_bit():
    records = layout_run(LAYOUTS[0])
    stock = records["stock"]
    for name in ("nearest", "activate_nearest"):
        assert records[name]["installed"] == [], name
        for a, b in zip(stock["snaps"], records[name]["snaps"]):
            assert_same(a["served"], b["served"], name)
            assert_same(a["master"], b["master"], name)
    fair = records["activate_fair"]
    assert fair["installed"] == ["DistributedOptimizer"] and fair["mismatch"] == 0
    assert any(not torch.equal(fair["snaps"][-1]["served"][k], stock["snaps"][-1]["served"][k])
               for k in stock["snaps"][-1]["served"])


def test_activation_prints_one_line_and_an_optimizer_over_nothing_is_left_stock():
    """Rank 0 prints what was done (Megatron-LM's default root logger level, WARNING, would hide
    an INFO line); an optimizer over frozen params gets no caster and says so."""
    records = layout_run(LAYOUTS[0])
    assert records["activate_fair"]["printed"] == (
        "Fair Cast: master->bf16 export cast uses stochastic (seed 7) on DistributedOptimizer, replacing "
        "the round-to-nearest copy in _copy_main_params_to_model_params\n")
    assert records["nearest"]["printed"] == records["stock"]["printed"] == ""
    frozen = records["frozen_fair"]
    assert "error" not in frozen, frozen.get("error")
    assert frozen["installed"] == [] and frozen["printed"] == (
        "Fair Cast: left stock (round-to-nearest): the optimizer holds no trainable param\n")


def test_install_then_uninstall_is_stock_megatron_bit_for_bit():
    """uninstall() undoes every wrap install() made on the leaf optimizers: training afterwards is
    stock megatron-core, bit for bit."""
    records = layout_run(LAYOUTS[0])
    stock, undone = records["stock"], records["uninstalled"]
    assert undone["installed"] == [] and undone["instance_wraps"] == stock["instance_wraps"] == []
    for a, b in zip(stock["snaps"], undone["snaps"]):
        assert_same(a["served"], b["served"], "uninstalled")
        assert_same(a["master"], b["master"], "uninstalled")


@pytest.mark.parametrize("layout", [params(l) for l in LAYOUTS])
def test_no_stock_master_copy_runs_under_fair_cast(layout):
    """The stock round-to-nearest copies of bf16 masters are replaced (Float16 optimizer) or
    skipped (DistributedOptimizer): none reaches torch; with the stock optimizer the probe sees them."""
    jobs = layout_run(layout)
    for m in METHODS:
        assert jobs[f"{m}_fixed"]["master_copies"] == 0 and jobs[f"{m}_train"]["master_copies"] == 0, m
    if layout == LAYOUTS[0]:
        assert jobs["stock"]["master_copies"] > 0 and jobs["nearest"]["master_copies"] > 0


def test_fair_with_fp16_is_refused():
    error = layout_run(LAYOUTS[0])["fp16_fair"].get("error", "")
    assert error.startswith("ValueError") and "--bf16" in error and "fp16" in error, error


# -- the other copy paths --------------------------------------------------------------------------
def test_param_buffer_copy_path_casts_like_the_model_param_path():
    (differ, owned, advanced), = layout_run((1, 1, 2, True))["dp_ef"]["param_buffer"]
    assert owned > 0 and advanced == 1 and differ == 0


@pytest.mark.parametrize("name,layout", [("dp_ef", (1, 1, 2, True)), ("f16_ef", (1, 1, 2, False))])
def test_reload_model_params_resets_residuals(name, layout):
    record = layout_run(layout)[name]
    after = record["after_reload"]
    assert any(bits(r).any() for r in record["snaps"][-1]["residual"].values())  # nonzero before
    for key, r in after["residual"].items():
        assert not bits(r).any(), key
    for key, served in after["served"].items():  # masters reloaded from the bf16 model
        assert torch.equal(after["master"][key].to(torch.bfloat16).view(torch.int16), served), key


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("layout", [params(l) for l in REBUILT])
def test_a_copy_outside_the_step_serves_the_last_export_again(layout, method):
    """A colocated RL stack rebuilds its offloaded bf16 model with _copy_main_params_to_model_params
    outside the optimizer step (radixark/miles): that copy writes the last export bit for bit and
    advances nothing, and the run goes on as if the model had never left."""
    records = layout_run(layout)
    job, straight = records[f"{method}_rebuilt"], records[f"{method}_train"]
    assert "error" not in job, job.get("error")
    served = [job["start"]] + job["snaps"]  # after 0, 1, 2 steps
    assert len(job["rebuilt"]) == len(served) == 3
    for steps, (before, rebuilt) in enumerate(zip(served, job["rebuilt"])):
        assert rebuilt["steps"] and all(b == a == steps for b, a in rebuilt["steps"]), rebuilt["steps"]
        for what in ("served", "master", "residual"):
            assert_same(before[what], rebuilt[what], f"rebuilt after {steps} steps: {what}")
    assert job["mismatch"] == 0
    for k, (a, b) in enumerate(zip(straight["snaps"], job["snaps"])):
        for what in ("served", "master", "residual"):
            assert_same(a[what], b[what], f"step {k + 1}: {what}")


def test_a_model_only_load_continues_the_export_step_from_megatron_lms_iteration():
    """Megatron-LM's load_checkpoint with --no-load-optim (reload_model_params, iteration 5 from the
    checkpoint) into a fresh optimizer: the exports draw the bits of steps 6 and 7 (the export after the k-th step
    draws step k's), as DeepSpeed's module-only load continues the saved step (--finetune: iteration 0, a fresh
    run)."""
    record = layout_run((1, 1, 2, True))["lm_model_only_load"]
    assert "error" not in record, record.get("error")
    assert record["export_steps"] == [6, 7] and record["mismatch"] == 0


@pytest.mark.parametrize("layout", [params(l) for l in [*SERVED, MOE_SERVED]])
def test_served_weights_are_the_whole_served_model_under_checkpoint_names(layout):
    """megatron_patches.served_weights on every rank: each param once under its canonical name (global
    layer numbers, the tied head as the embedding; MoE experts under Megatron's per-expert keys with their
    global expert numbers, whichever EP rank holds them), the bits the model computes with (checked against
    the gathered model, which the reference cast checked), with --overlap-param-gather's pending
    all-gather finished; served_deltas' first call (an empty tracker) yields every element."""
    from megatron_worker import params_of
    record = layout_run(layout)["moe_served_weights" if layout == MOE_SERVED else "served_weights"]
    assert "error" not in record, record.get("error")
    assert record["mismatch"] == 0
    snap, served = record["snaps"][-1], record["served_weights"]
    want = {name: snap["served"][key][index] for key, name, index in params_of(snap)}
    assert sorted(served) == sorted(want)
    if layout == MOE_SERVED:  # 2 layers of 4 experts
        assert {n for n in served if ".experts.experts." in n} == {
            f"decoder.layers.{layer}.mlp.experts.experts.{e}.{w}.weight"
            for layer in range(4) for e in range(4) for w in ("linear_fc1", "linear_fc2")}
    for name, w in want.items():
        assert torch.equal(served[name].reshape(-1), w.reshape(-1).view(torch.int16)), name
    assert record["served_deltas"] == [(n, served[n].numel()) for n in sorted(served)]


# -- FAIRCAST_EXPORT_CAST under Megatron-LM's arguments (faircast-run): the command line wins ---------
ENV_JOBS = {  # in the (1, 1, 2, True) launch; export_cast: what must run (the reference cast's config)
    "env_and_flags": dict(how="megatron_lm", env='{"mode": "fair", "method": "stochastic", "seed": 1234}',
                          megatron_lm=["--bf16", "--export-cast", "fair", "--export-cast-method", "error-feedback",
                                       "--export-cast-seed", "7"],
                          export_cast={"mode": "fair", "method": "error_feedback", "seed": 7}, steps=2),
    "env_alone": dict(how="megatron_lm", env='{"mode": "fair", "method": "dithered", "seed": 5}',
                      megatron_lm=["--bf16"], export_cast={"mode": "fair", "method": "dithered", "seed": 5}, steps=2),
    "env_nearest_flags_fair": dict(how="megatron_lm", env='{"mode": "nearest"}',
                                   megatron_lm=["--bf16", "--export-cast", "fair"],
                                   export_cast={"mode": "fair", "method": "stochastic", "seed": 1234}, steps=2),
}


def test_the_command_line_wins_over_the_variable_and_the_arguments_say_what_runs():
    """Under ``faircast-run`` (``FAIRCAST_EXPORT_CAST`` set) with Megatron-LM's argument parsing: flags
    given on the command line run and the parsed ``args`` show them; the variable fills what the command
    line leaves unset; a flag that differs from the variable is one warning naming both values."""
    records = layout_run((1, 1, 2, True))
    for name, job in ENV_JOBS.items():
        record, want = records[name], job["export_cast"]
        assert "error" not in record, (name, record.get("error"))
        assert record["installed"] == ["DistributedOptimizer"], name  # the nearest variable's run casts too
        assert record["mismatch"] == 0 and record["rtn_differs"] > 0, name  # every element the config's cast
        args = record["args"]
        assert (args["export_cast"], args["export_cast_method"].replace("-", "_"), args["export_cast_seed"]) == \
            (want["mode"], want["method"], want["seed"]), (name, args)
        assert f"uses {want['method']} (seed {want['seed']})" in record["printed"], name
    overridden = [w for w in records["env_and_flags"]["warnings"] if "command line overrides" in w]
    assert len(overridden) == 1, records["env_and_flags"]["warnings"]
    assert ("--export-cast-method error_feedback (command line) over method stochastic" in overridden[0] and
            "--export-cast-seed 7 (command line) over seed 1234" in overridden[0]), overridden
    assert [w for w in records["env_nearest_flags_fair"]["warnings"] if "command line overrides" in w] != []
    assert not [w for w in records["env_alone"]["warnings"] if "command line" in w]


# -- production flags (Megatron-LM's training-loop set-up) --------------------------------------------
PRODUCTION_RUNS = [(layout, flags) for layout, runs in PRODUCTION.items() for flags in runs]


@pytest.mark.parametrize("layout,flags", [pytest.param(l, f, id=f"{layout_id(l)}-{f}") for l, f in PRODUCTION_RUNS])
def test_production_flags_serve_the_reference_cast(layout, flags):
    """With finalize_model_grads and the DDP sync funcs as Megatron-LM sets them, and
    --overlap-grad-reduce --overlap-param-gather, or --sequence-parallel with fp32 grad reduction
    (--accumulate-allreduce-grads-in-fp32): every served element is the
    reference cast of the gathered master, on every replica, at every step."""
    for method in METHODS:
        record = layout_run(layout)[f"{method}_{flags}"]
        assert "error" not in record, record.get("error")
        assert len(record["snaps"]) == 3 and record["installed"], method
        assert record["mismatch"] == 0, f"{method}: {record['mismatch']} served elements differ from the reference"
        assert record["rtn_differs"] > 200 and record["replica_mismatch"] == 0, method


def test_overlapped_run_resumes_as_uninterrupted():
    """(Not tested: bitwise equality with the synchronous run. Stock megatron-core 0.16.1 on gloo with
    these buckets leaves it too: 2,357 masters differ at step 5 with --overlap-grad-reduce alone.)"""
    _check_resume_is_uninterrupted(layout_run(SAVED_BY["overlap_ef"])["overlap_ef"], resume_run(1, 1, 2)["overlap_ef"])


# -- resume ----------------------------------------------------------------------------------------
def _check_loaded_is_saved(saved_record, resumed):
    assert "error" not in resumed, resumed.get("error")
    assert resumed["loaded_step"] and set(resumed["loaded_step"]) == set(saved_record["saved_step"]) == {SAVE_AFTER}
    for what in ("master", "served", "residual"):
        assert_same(saved_record["saved"][what], resumed["loaded"][what], f"loaded {what}")


def _check_resume_is_uninterrupted(straight, resumed):
    _check_loaded_is_saved(straight, resumed)
    assert resumed["mismatch"] == 0
    for k in range(STEPS - SAVE_AFTER):
        for what in ("master", "served", "residual"):
            assert_same(straight["snaps"][SAVE_AFTER + k][what], resumed["snaps"][k][what],
                        f"step {SAVE_AFTER + k + 1}: {what}")


@pytest.mark.parametrize("name", ["dp_ef", "dp_sr"])
def test_dp_reshardable_resume_equals_uninterrupted(name):
    """Also with the bf16 model rebuilt from the loaded masters before the first step (a colocated
    RL stack's offload right after a load): the loaded model, the saved export, comes back."""
    resumed = resume_run(1, 1, 2)[name]
    _check_resume_is_uninterrupted(layout_run(SAVED_BY[name])[name], resumed)
    (rebuilt,) = resumed["rebuilt"]
    assert rebuilt["steps"] and all(b == a == SAVE_AFTER for b, a in rebuilt["steps"]), rebuilt["steps"]
    for what in ("served", "master", "residual"):
        assert_same(resumed["loaded"][what], rebuilt[what], f"rebuilt after the load: {what}")


def test_dp_reshardable_resume_at_another_dp_size():
    # stock DistOpt trains bitwise alike at DP=1 and DP=2 here (same micro-batch on every rank)
    _check_resume_is_uninterrupted(layout_run(SAVED_BY["dp_ef"])["dp_ef"], resume_run(1, 1, 1)["dp_ef_dp2_to_dp1"])


def test_fully_reshardable_resume_equals_uninterrupted():
    _check_resume_is_uninterrupted(layout_run(SAVED_BY["full_ef"])["full_ef"], resume_run(2, 1, 1)["full_ef"])


def test_fully_reshardable_tp2_checkpoint_resumes_at_tp1_dp2():
    # TP changes the fp32 sums, so the trajectory after the reshard is not TP2's: check that each
    # element's master and residual followed it, and that the exports after it are exact
    resumed = resume_run(1, 1, 2)["full_ef_tp2_to_dp2"]
    _check_loaded_is_saved(layout_run(SAVED_BY["full_ef"])["full_ef"], resumed)
    assert resumed["mismatch"] == 0 and len(resumed["snaps"]) == STEPS - SAVE_AFTER


def test_virtual_pipeline_resume_equals_uninterrupted():
    """Two model chunks per PP rank: the checkpoint's model0/model1 entries and the optimizer's
    shards over both chunks load back to the saved masters, residuals and export step."""
    records = layout_run((1, 2, 1, True))
    _check_resume_is_uninterrupted(records["vpp_ef"], records["vpp_ef_resumed"])


@pytest.mark.parametrize("saved_by", ["stock", "stochastic"])
def test_error_feedback_resumes_a_checkpoint_without_residuals(saved_by):
    """A checkpoint of a stock run, or of a stochastic-rounding run, holds no residuals. Requesting
    them fails dist-checkpointing's load at Megatron-LM's default --dist-ckpt-strictness
    (KeyError: not in the checkpoint); they are requested only when the checkpoint's content
    metadata says they were saved, and start at zero: the masters are the checkpoint's, each export
    after it is the reference cast."""
    if saved_by == "stock":
        saved, resumed = layout_run(LAYOUTS[0])["stock_saved"], layout_run(LAYOUTS[0])["ef_from_stock"]
    else:
        saved, resumed = layout_run(SAVED_BY["dp_sr"])["dp_sr"], resume_run(1, 1, 2)["dp_sr_to_ef"]
    assert "error" not in resumed, resumed.get("error")
    assert_same(saved["saved"]["master"], resumed["loaded"]["master"], "loaded master")
    assert not any(bits(r).any() for r in resumed["loaded"]["residual"].values())
    assert len(resumed["snaps"]) == STEPS - SAVE_AFTER and resumed["mismatch"] == 0
    assert resumed["export_steps"] == ([1, 2] if saved_by == "stock" else [SAVE_AFTER + 1, SAVE_AFTER + 2])
    said = "has no export-cast state" if saved_by == "stock" else "switching from stochastic to error_feedback"
    assert len(resumed["warnings"]) == 1 and said in resumed["warnings"][0], resumed["warnings"]


def test_a_load_without_the_checkpoints_content_metadata_names_why_residuals_start_at_zero():
    """A loop that hands sharded_state_dict a metadata dict of its own, not the checkpoint's, loads no
    residuals of an error-feedback checkpoint: the warning says so and how to fix it."""
    resumed = resume_run(1, 1, 2)["dp_ef_fresh_metadata"]
    assert "error" not in resumed and resumed["loaded_step"] == [SAVE_AFTER]
    assert not any(bits(r).any() for r in resumed["loaded"]["residual"].values())
    assert len(resumed["warnings"]) == 1 and "content metadata lacks 'export_cast_residuals'" in resumed["warnings"][0]


def test_float16_optimizer_resume_equals_uninterrupted():
    _check_resume_is_uninterrupted(layout_run(SAVED_BY["f16_ef"])["f16_ef"], resume_run(1, 1, 2)["f16_ef"])


@pytest.mark.slow
def test_float16_optimizer_checkpoint_resumes_at_pp2():
    resumed = resume_run(1, 2, 1)["f16_ef_dp2_to_pp2"]
    _check_loaded_is_saved(layout_run(SAVED_BY["f16_ef"])["f16_ef"], resumed)
    assert resumed["mismatch"] == 0 and len(resumed["snaps"]) == STEPS - SAVE_AFTER


# -- context parallelism ----------------------------------------------------------------------------
def _context_jobs():
    jobs = {f"{m}_fixed": dict(export_cast=c, distopt=True, set_state=5, exports=3) for m, c in METHODS.items()}
    jobs.update({f"{m}_train": dict(export_cast=c, distopt=True, steps=2) for m, c in METHODS.items()})
    jobs["float16_stochastic_train"] = dict(export_cast=SR, distopt=False, steps=2)  # CP ranks hold replicas
    jobs["cp_ef"] = dict(export_cast=EF, distopt=True, steps=STEPS, save=CKPT["cp_ef"], save_after=SAVE_AFTER,
                         sharding="dp_reshardable")
    jobs["cp_ef_resumed"] = _resume("cp_ef", export_cast=EF, distopt=True, sharding="dp_reshardable")
    return jobs


@functools.lru_cache(maxsize=None)
def context_run():
    """CP=2 process groups at TP=PP=DP=1 (2 ranks): DDP reduces grads and the DistributedOptimizer
    shards the masters over DP x CP, as under --context-parallel-size 2. The attention is not split
    over CP (megatron-core's local attention refuses CP > 1; TransformerEngine's needs CUDA), so both
    CP ranks compute on the whole sequence: the run trains as the single-process one would."""
    return run(1, 1, 1, _context_jobs(), cp=2)


@pytest.mark.parametrize("method", METHODS)
def test_context_parallel_exports_the_same_model_and_the_reference_cast(method):
    """The DistributedOptimizer's DP x CP shards export one master state as the single-process run
    does, and every served element after training is the reference cast (both CP ranks' copies)."""
    records = context_run()
    assert_same_exports(layout_run(LAYOUTS[0])[f"{method}_fixed"], records[f"{method}_fixed"], method)
    names = [f"{method}_fixed", f"{method}_train"] + (["float16_stochastic_train"] if method == "stochastic" else [])
    for name in names:
        record = records[name]
        assert "error" not in record, record.get("error")
        assert record["mismatch"] == 0 and record["replica_mismatch"] == 0 and record["master_copies"] == 0, name
        assert record["rtn_differs"] > 200 and record["installed"], name


def test_context_parallel_resume_equals_uninterrupted():
    records = context_run()
    _check_resume_is_uninterrupted(records["cp_ef"], records["cp_ef_resumed"])


# -- MoE with expert parallelism (a ChainedOptimizer: dense and expert DistributedOptimizer) -----------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", [params(l) for l in MOE_LAYOUTS[1:]])
def test_moe_one_master_state_exports_the_same_model_at_every_expert_parallel_size(layout, method):
    """Experts are named and indexed by their global expert number (Megatron's expert axis), so the
    export of one master state does not depend on which EP rank holds an expert."""
    ref = layout_run(MOE_LAYOUTS[0])[f"moe_{method}_fixed"]
    got = layout_run(layout)[f"moe_{method}_fixed"]
    assert "error" not in got, got.get("error")
    assert got["installed"] == ["DistributedOptimizer"] * (1 if layout[4] == 1 else 2)  # EP > 1: chained
    assert len(got["snaps"]) == len(ref["snaps"]) == 2
    assert any(".experts." in k for k in ref["snaps"][0]["served"])
    assert_same_exports(ref, got, method)


@pytest.mark.parametrize("layout", [params(l) for l in MOE_LAYOUTS])
def test_moe_every_served_element_is_the_reference_cast(layout):
    """After real steps (the all-to-all token dispatcher, finalize_model_grads): every served element,
    experts included, is the reference cast of the gathered master; replicas agree."""
    for name in [f"moe_{m}_{job}" for m in METHODS for job in ("fixed", "train")]:
        record = layout_run(layout)[name]
        assert "error" not in record, f"{name}: {record.get('error')}"
        assert record["installed"] and record["master_copies"] == 0, name
        assert record["mismatch"] == 0, f"{name}: {record['mismatch']} served elements differ from the reference"
        assert record["rtn_differs"] > 200, f"{name}: hardly differs from round to nearest: the check cannot bite"
        assert record["replica_mismatch"] == 0, f"{name}: replicas disagree"


def test_moe_expert_parallel_resume_equals_uninterrupted():
    _check_resume_is_uninterrupted(layout_run(MOE_SAVED_BY)["moe_error_feedback_train"], resume_run(1, 1, 2)["moe_ef"])


def test_moe_fp8_resume_equals_uninterrupted():
    """FP8 error feedback with experts at EP 2 (a ChainedOptimizer: the experts' FP8 scales, bits and residuals in
    the expert leaf's state): saved after 2 steps and loaded, it serves the uninterrupted run's FP8 bytes and
    scales at the load and after steps 3 and 4. (Loading at another EP size fails in Megatron's own optimizer
    state: its leaves change.)"""
    straight = layout_run(MOE_SAVED_BY)["moe_fp8_ef"]
    resumed = resume_run(1, 1, 2)["moe_fp8_ef"]
    _check_resume_is_uninterrupted(straight, resumed)
    assert any(".experts.experts." in n for n in resumed["fp8"][0]["served"])
    for k, snap in enumerate(resumed["fp8"]):
        assert_same(snap["served"], straight["fp8"][SAVE_AFTER + k]["served"], f"FP8 at step {SAVE_AFTER + k}")
    # loaded with the experts left bf16: the attention weights' FP8 state is the checkpoint's, and the expert leaf,
    # which now holds no FP8 param, does not claim the checkpoint lacks FP8 state: it says it drops the experts'
    bf16_experts = resume_run(1, 1, 2)["moe_fp8_ef_experts_bf16"]
    assert "error" not in bf16_experts, bf16_experts.get("error")
    (said,) = [w for w in bf16_experts["warnings"] if "FP8" in w]
    assert "FP8 export state for 32 params served bf16 now" in said and ".experts.experts." in said, said
    loaded, saved = bf16_experts["fp8"][0]["served"], straight["fp8"][SAVE_AFTER]["served"]
    assert loaded and not any(".experts." in n for n in loaded)
    assert_same(loaded, {n: saved[n] for n in loaded}, "loaded with the experts bf16")


# -- drift telemetry (megatron_patches.telemetry) ----------------------------------------------------
def whole_model_drift(snaps, sample, start):
    """The telemetry of one DriftSample fed the gathered whole model at each step (canonical names),
    primed with the ``start`` snapshot (the served model before the first step)."""
    from faircast_dist.telemetry import DriftSample, reduce_drift, sample_stride
    from megatron_worker import params_of

    def per_param(snap):
        for key, name, index in params_of(snap):
            yield name, snap["master"][key][index].reshape(-1), snap["served"][key][index].reshape(-1).view(torch.bfloat16)
    numel = sum(m.numel() for _, m, _ in per_param(snaps[0]))
    drift, out = DriftSample(sample_stride(numel, sample)), []
    drift.prime([(n, m, s, [(n, 0, m.numel(), 0)]) for n, m, s in per_param(start)])
    for snap in snaps:
        drift.observe([(n, m, s, [(n, 0, m.numel(), 0)]) for n, m, s in per_param(snap)])
        out.append({f"export-cast/{k.replace('_', '-')}": v for k, v in reduce_drift([drift]).items()})
    return out, drift.stride


@pytest.mark.parametrize("layout", [params(l) for l in [*TELEMETRY, MOE_TELEMETRY]])
def test_drift_telemetry_equals_the_gathered_models(layout):
    """Every rank measures only what it casts, each element counted once (TP-duplicated norms,
    the last stage's tied embedding, Float16 DP replicas are left out; MoE experts: replicas over
    the expert DP group, not the dense one): the reduced numbers are those of the whole gathered model."""
    record = layout_run(layout)["moe_telemetry" if len(layout) > 4 else "telemetry"]
    sample = 65536 if len(layout) > 4 else TELEMETRY[layout]
    assert "error" not in record, record.get("error")
    assert record["mismatch"] == 0
    want, stride = whole_model_drift(record["snaps"], sample, record["start"])
    assert (stride > 1) == (sample < 1000)
    assert len(record["drift"]) == 3 and record["drift_on"] and all(record["drift_on"])
    for got, expected in zip(record["drift"], want):
        assert got.keys() == expected.keys()
        for name in ("export-cast/changed-fraction", "export-cast/gap-ulps"):
            assert got[name] == pytest.approx(expected[name], rel=1e-9), name
        assert got["export-cast/lag-steps"] == expected["export-cast/lag-steps"]
        assert got["export-cast/export-ms"] > 0
    assert all(d["export-cast/changed-fraction"] > 0 for d in record["drift"])  # the first from the initial model


def test_megatron_lm_logs_drift_at_tensorboard_log_interval_to_tensorboard_and_wandb():
    records = layout_run((1, 1, 2, True))
    tb = records["lm_tensorboard"]
    want, _ = whole_model_drift(tb["snaps"], 65536, tb["start"])
    names = sorted(want[0])
    assert sorted({(name, step) for _, name, _, step in tb["written"]}) == [(n, s) for n in names for s in (2, 4)]
    assert {w for w, *_ in tb["written"]} == {"tb"}
    for _, name, value, step in tb["written"]:
        if name != "export-cast/export-ms":
            assert value == pytest.approx(want[step - 1][name], rel=1e-9), (name, step)
    assert {(w, name, step) for w, name, _, step in records["lm_wandb"]["written"]} == {("wandb", n, 2) for n in names}
    for off in ("lm_no_writer", "lm_flag_off"):  # nothing measured, nothing written
        assert records[off]["written"] == [] and records[off]["drift_on"] == [False], off
    assert records["lm_flag_off"]["installed"] == ["DistributedOptimizer"]  # Fair Cast itself stays on


@pytest.mark.parametrize("name, layout", [("dithered", FP8_TELEMETRY), ("block_dithered", FP8_TELEMETRY),
                                          ("block_dithered", MOE_TELEMETRY)], ids=["dithered", "block_dithered", "moe"])
def test_fp8_drift_telemetry_equals_the_gathered_model(name, layout):
    """``export-cast/fp8-*`` (TP 2, PP 2, Float16; and MoE at EP 2, DP 2, Float16: DP ranks hold other experts): the
    FP8 copy's changed fraction, lag and gap are those of one FP8 DriftSample fed the gathered FP8 model, its scales
    and the masters from the install-time cast on; the rescales are the reference's. Block scales: measured on the
    stack of the checkpoint's tensors."""
    import types
    from faircast_dist import ExportCastConfig, FairCaster
    from faircast_dist.fp8 import Fp8Export
    from faircast_dist.telemetry import DriftSample, reduce_drift, sample_stride
    from megatron_patches.layout import fused_rows
    record = layout_run(layout)[f"{'moe_' if len(layout) > 4 else ''}fp8_{name}_telemetry"]
    assert "error" not in record, record.get("error")
    snaps = record["fp8"]  # the install-time export, then one per step
    first = snaps[0]["masters"]
    model = types.SimpleNamespace(num_attention_heads=4, num_query_groups=4, kv_channels=6, gated_linear_unit=True)
    fused = {n: f for n, m in first.items() if m.dim() == 2 and (f := fused_rows(n, m.shape, model))}
    fp8 = Fp8Export(FairCaster(ExportCastConfig.from_value(FP8[name])), {n: m.shape for n, m in first.items()}, fused)
    assert bool(fp8.fused) == (name == "block_dithered")
    whole = DriftSample(sample_stride(sum(m.numel() for m in first.values()), 300), fp8=fp8)
    assert len(record["drift"]) == 3 and whole.stride > 1
    for t, snap in enumerate(snaps):
        fp8.scales = {n: snap["served"][fp8.scale_name(n)] for n in fp8.shapes}
        whole.observe([(n, snap["masters"][n].reshape(-1), snap["served"][n].view(torch.uint8).reshape(-1),
                        fp8.runs([(n, 0, snap["masters"][n].numel(), 0)])) for n in fp8.shapes])
        if t:
            want, got = reduce_drift([whole]), record["drift"][t - 1]
            for what in ("changed_fraction", "gap_ulps"):
                assert got[f"export-cast/fp8-{what.replace('_', '-')}"] == pytest.approx(want[what], rel=1e-9), (t, what)
            assert got["export-cast/fp8-lag-steps"] == want["lag_steps"], t
            assert got["export-cast/fp8-rescales"] == sum(int((snap["served"][n] != snaps[t - 1]["served"][n]).sum())
                                                          for n in snap["served"] if "_scale" in n)
    assert record["drift"][0]["export-cast/fp8-changed-fraction"] > 0  # from the install-time cast


# -- FP8 served weights ------------------------------------------------------------------------------
def _fp8_check(record, name):
    from faircast_dist import ExportCastConfig
    from helpers import reference_fp8, reference_fp8_fused
    assert "error" not in record, record.get("error")
    snaps = record["fp8"]
    assert snaps and all(s["served"] for s in snaps)
    config = ExportCastConfig.from_value(FP8[name])
    refs = reference_fp8_fused(config, snaps, groups=4, heads=4) if config.scale_rule.granularity == "block" \
        else reference_fp8(config, snaps)
    for k, (snap, ref) in enumerate(zip(snaps, refs)):
        assert_same(snap["served"], ref, f"FP8 served weights, export {k}")


@pytest.mark.parametrize("layout", [l for l in LAYOUTS if l not in BIG] + [pytest.param(l, marks=pytest.mark.slow)
                                                                          for l in LAYOUTS if l in BIG], ids=layout_id)
@pytest.mark.parametrize("name", FP8_LAYOUTS)
def test_fp8_served_weights_are_the_single_process_reference(name, layout):
    """FP8 served weights under TP (row-parallel ``linear_proj`` / ``fc2``: each channel spans the TP ranks), PP,
    DP, DistributedOptimizer (flat ranges cut rows) and the Float16 optimizer: at install and after each export
    of one preset master state, served_weights' FP8 params and scales are the spec cast of the whole gathered
    masters (sticky scales, the FP8 residual carried); the bf16 params' exports still pass their check. Block
    scales: those of the checkpoint's q/k/v and gate/up tensors (``helpers.reference_fp8_fused``)."""
    record = layout_run(layout)[f"fp8_{name}_fixed"]
    _fp8_check(record, name)
    assert record["mismatch"] == 0
    names = list(record["fp8"][0]["served"])
    scale = ExportCastConfig.from_value(FP8[name]).scale_rule.scale_name
    assert f"decoder.layers.0.self_attention.linear_qkv.{scale}" in names
    assert not any("embedding" in n or "output_layer" in n or "norm" in n for n in names)


@pytest.mark.parametrize("layout", [params(l) for l in MOE_LAYOUTS])
@pytest.mark.parametrize("name", MOE_FP8)
def test_moe_experts_are_served_as_fp8_at_every_expert_parallel_size(name, layout):
    """MoE experts are linear weights of the MLP, so they are served as FP8 (the router stays bf16): under their
    per-expert checkpoint names, each expert's FP8 bytes and scales (block scales: those of its gate and up
    tensors) are the spec cast of its gathered master, whichever EP / TP rank holds it."""
    record = layout_run(layout)[f"moe_fp8_{name}_fixed"]
    _fp8_check(record, name)
    assert record["mismatch"] == 0
    scale = ExportCastConfig.from_value(FP8[name]).scale_rule.scale_name
    names = set(record["fp8"][0]["served"])
    assert {f"decoder.layers.{layer}.mlp.experts.experts.{e}.{w}.{s}" for layer in range(4) for e in range(4)
            for w in ("linear_fc1", "linear_fc2") for s in ("weight", scale)} <= names
    assert not any("router" in n for n in names)
    if layout == MOE_SAVED_BY and name == "block_dithered":  # the same names when Megatron numbers the layers
        listed = layout_run(layout)["moe_fp8_listed_fixed"]    # in its keys (its set_state masters differ)
        _fp8_check(listed, name)
        assert listed["mismatch"] == 0
        assert [sorted(s["served"]) for s in listed["fp8"]] == [sorted(s["served"]) for s in record["fp8"]]
        assert torch.equal(listed["fp8"][0]["served"][f"decoder.layers.3.mlp.experts.experts.2.linear_fc1.{scale}"],
                           record["fp8"][0]["served"][f"decoder.layers.3.mlp.experts.experts.2.linear_fc1.{scale}"])


def test_fused_rows_are_the_checkpoints_tensors_for_grouped_query_attention():
    """``fused_rows`` of a GQA ``linear_qkv`` (8 heads in 2 query groups of 40) and a SwiGLU ``fc1``: the stack rows
    it gives each fused row are where the tests' reshape (``helpers.checkpoint_parts``) puts them; a layout it does
    not know (gated attention, another row count) is refused by name."""
    import types
    from helpers import block_stack, checkpoint_parts
    from megatron_patches.layout import fused_rows
    config = types.SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=40, gated_linear_unit=True)
    for name, rows in (("decoder.layers.1.self_attention.linear_qkv.weight", 2 * 6 * 40),
                       ("decoder.layers.1.mlp.linear_fc1.weight", 2 * 300),
                       ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", 2 * 100)):
        w = torch.arange(rows, dtype=torch.float64)[:, None] + 1
        stack = block_stack(checkpoint_parts(name, w, groups=2, heads=8))
        f = fused_rows(name, (rows, 7), config)
        assert f.stack_rows() == stack.shape[0]
        assert torch.equal(stack[f.stack_row_of(), 0], w[:, 0]), name
    assert fused_rows("decoder.layers.1.self_attention.linear_proj.weight", (320, 320), config) is None
    assert fused_rows("decoder.layers.1.mlp.linear_fc1.weight", (600, 320),
                      types.SimpleNamespace(**{**vars(config), "gated_linear_unit": False})) is None
    with pytest.raises(NotImplementedError, match="'decoder.layers.1.self_attention.linear_qkv.weight' has 400 rows"):
        fused_rows("decoder.layers.1.self_attention.linear_qkv.weight", (400, 320), config)
    # cross-attention linear_kv: per head its key rows, then its value rows (8 heads of 40)
    kv = torch.arange(2 * 8 * 40, dtype=torch.float64)[:, None] + 1
    per_head = kv.reshape(8, 2, 40, 1)
    f = fused_rows("decoder.layers.1.cross_attention.linear_kv.weight", (640, 7), config)
    stack = block_stack([per_head[:, 0].reshape(-1, 1), per_head[:, 1].reshape(-1, 1)])
    assert f.stack_rows() == stack.shape[0] == 2 * 384 and torch.equal(stack[f.stack_row_of(), 0], kv[:, 0])
    with pytest.raises(NotImplementedError, match="'decoder.layers.1.cross_attention.linear_kv.weight' has 600 rows"):
        fused_rows("decoder.layers.1.cross_attention.linear_kv.weight", (600, 7), config)
    gated = types.SimpleNamespace(**vars(config), attention_output_gate=True)
    with pytest.raises(NotImplementedError, match="attention_output_gate"):
        fused_rows("decoder.layers.1.self_attention.linear_qkv.weight", (480, 320), gated)
    # install asks only the params served as FP8: a linear_qkv left bf16 by fp8_exclude is no obstacle
    from faircast_dist import ExportCastConfig
    from megatron_patches.optimizer import _fused
    shapes = {"decoder.layers.1.self_attention.linear_qkv.weight": (480, 320),
              "decoder.layers.1.mlp.linear_fc1.weight": (600, 320)}
    block = {"mode": "fair", "format": "fp8", "fp8_scales": "block"}
    excluded = ExportCastConfig.from_value({**block, "fp8_exclude": "linear_qkv|norm"})
    assert list(_fused(excluded, shapes, gated)) == ["decoder.layers.1.mlp.linear_fc1.weight"]
    with pytest.raises(NotImplementedError, match="attention_output_gate"):
        _fused(ExportCastConfig.from_value(block), shapes, gated)
    assert _fused(ExportCastConfig.from_value({**block, "fp8_scales": "channel"}), shapes, gated) == {}


def test_fp8_block_scales_resume_at_tp2():
    """Block scales (on the checkpoint's q/k/v and gate/up tensors) saved at DP 2 and loaded at TP 2: the FP8 bits
    and the kept scales served after the load are the uninterrupted run's."""
    straight = layout_run(SAVED_BY["fp8_block_dithered"])["fp8_block_dithered"]
    tp2 = resume_run(2, 1, 1)["fp8_block_dithered_tp2"]
    assert "error" not in tp2, tp2.get("error")
    assert_same(tp2["fp8"][0]["served"], straight["fp8"][SAVE_AFTER]["served"], "loaded at TP 2")
    from helpers import reference_fp8_fused
    saved = straight["fp8"][SAVE_AFTER]  # scales set afresh from the loaded masters would differ: they are kept
    fresh = reference_fp8_fused(FP8["block_dithered"], [saved], groups=4, heads=4)[0]
    assert any(not torch.equal(fresh[n], saved["served"][n]) for n in fresh if n.endswith("weight_scale_inv"))


def test_fp8_with_a_layer_kept_bf16_saves_and_resumes():
    """fp8_exclude keeping the last layer bf16 (a common FP8 recipe): Megatron stacks a tensor's layers in one
    checkpoint entry, so the FP8 bits are saved for that layer too (zeros; dist-checkpointing refused the save of an
    entry missing a layer: "Invalid access pattern"); the load and the steps after it serve the uninterrupted run's."""
    records = layout_run((1, 1, 2, True))
    straight, resumed = records["fp8_partial"], records["fp8_partial_resumed"]
    assert "error" not in straight and "error" not in resumed, (straight.get("error"), resumed.get("error"))
    served = straight["fp8"][0]["served"]
    assert any(".layers.2." in n for n in served) and not any(".layers.3." in n for n in served)
    assert resumed["warnings"] == []
    for k, snap in enumerate(resumed["fp8"]):
        assert_same(snap["served"], straight["fp8"][SAVE_AFTER + k]["served"], f"FP8 at step {SAVE_AFTER + k}")


def test_fp8_checkpoint_resumes_at_tp2():
    """An error-feedback FP8 checkpoint saved at DP 2 and loaded at TP 2: the FP8 bits, scales (and residuals) served
    after the load are the uninterrupted run's (TP changes the fp32 sums: the steps after the reshard are not the
    TP 1 run's)."""
    straight = layout_run(SAVED_BY["fp8_error_feedback"])["fp8_error_feedback"]
    tp2 = resume_run(2, 1, 1)["fp8_error_feedback_tp2"]
    assert "error" not in tp2, tp2.get("error")
    assert_same(tp2["fp8"][0]["served"], straight["fp8"][SAVE_AFTER]["served"], "loaded at TP 2")
