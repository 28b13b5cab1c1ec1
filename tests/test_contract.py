"""The export contract, one module for every adapter. DeepSpeed (ZeRO-3, DP 2), Megatron (DistributedOptimizer,
DP 2) and FSDP2 (2 ranks) run the same jobs, and the same checks hold for all three against the single-process
reference of docs/design.md (``helpers.reference_fp8``: the spec functions on whole params):

* the FP8 served weights and scales, at install and after every step, are the reference cast of the gathered
  masters, for every method and scale layout, and under the stacks' scale rules;
* every export draws fresh bits: stochastic rounding of unchanged masters differs between the install-time export
  and each step's (they once shared step 0's key in DeepSpeed and Megatron);
* resume == uninterrupted (error feedback: the FP8 bits, sticky scales and FP8 residuals come back; a stack's
  rule with ``fp8_grid``: the bf16 params too);
* a bf16-only checkpoint sets the FP8 scales afresh from the loaded masters, with its warning;
* switching to error feedback keeps a checkpoint's FP8 scales and starts the FP8 residuals at zero, warned.

The rules are written once (``faircast_dist.export.ExportState``); this module checks that every adapter reaches
them. Each adapter's own geometry (every ZeRO stage, TP / PP / EP, meshes, universal checkpoints) is tested in its
own module. One set of launches per adapter, shared by every check.
"""
import pytest
import torch

import ds_worker
import fsdp_worker
import megatron_worker
from faircast_dist import ExportCastConfig
from helpers import bits, checkpoint_parts, reference_fp8, reference_fp8_fused

EF = {"mode": "fair", "method": "error_feedback"}
CONFIGS = {"error_feedback": {**EF, "format": "fp8"},
           "dithered_block": {"mode": "fair", "method": "dithered", "seed": 7, "format": "fp8", "fp8_scales": "block"},
           "nearest_via_bf16": {"mode": "nearest", "format": "fp8", "fp8_via_bf16": True},
           "stochastic_ue8m0": {"mode": "fair", "method": "stochastic", "seed": 7, "format": "fp8", "fp8_ue8m0": True},
           # the stacks' quantizers (faircast_dist.fp8.PRESETS): recomputed block scales with codes multiplied
           # (verl's), a tensor scale and round-to-nearest of bf16(master) (vLLM's online per-tensor)
           "verl_dithered": {"mode": "fair", "method": "dithered", "seed": 7, "format": "fp8", "fp8_rule": "verl"},
           "vllm_per_tensor_nearest": {"mode": "nearest", "format": "fp8", "fp8_rule": "vllm-fp8-per-tensor"},
           # ... and the grid route: the bf16 params hold the served FP8 values
           "verl_grid": {"mode": "fair", "method": "stochastic", "seed": 7, "format": "fp8", "fp8_rule": "verl",
                         "fp8_grid": True}}
SAVED = ("error_feedback", "stochastic_ue8m0", "verl_grid")  # their runs save a checkpoint after SAVE_AFTER steps
SWITCHED = {**CONFIGS["error_feedback"], "fp8_ue8m0": True}  # loads stochastic_ue8m0's checkpoint
STEPS, SAVE_AFTER = 4, 2
ADAPTERS = ("deepspeed", "megatron", "fsdp2")


def _deepspeed(tmp) -> dict:
    """One launch (ZeRO-3, DP 2): every job in turn, the saves before the loads."""
    jobs = {}
    for name, config in CONFIGS.items():
        save = dict(save_dir=str(tmp / name), save_at=(SAVE_AFTER,), save_final=False) if name in SAVED else {}
        jobs[f"train/{name}"] = dict(export_cast=config, steps=STEPS, **save)
    jobs["bf16"] = dict(export_cast=EF, steps=SAVE_AFTER, save_dir=str(tmp / "bf16"))
    jobs["fresh"] = dict(export_cast=CONFIGS["stochastic_ue8m0"], steps=2, lr=0.0)  # the masters stay as they are
    jobs["resume"] = dict(export_cast=CONFIGS["error_feedback"], steps=STEPS - SAVE_AFTER,
                          load_dir=str(tmp / "error_feedback"))
    jobs["resume/verl_grid"] = dict(export_cast=CONFIGS["verl_grid"], steps=STEPS - SAVE_AFTER,
                                    load_dir=str(tmp / "verl_grid"))
    jobs["from_bf16"] = dict(export_cast=CONFIGS["error_feedback"], steps=1, load_dir=str(tmp / "bf16"))
    jobs["ef_from_sr"] = dict(export_cast=SWITCHED, steps=1, load_dir=str(tmp / "stochastic_ue8m0"))
    records = ds_worker.run_jobs(2, [dict(path="zero3", **j) for j in jobs.values()])
    return {job: {"fp8": r[0].get("fp8", []), "warnings": r[0]["warnings"]} for job, r in zip(jobs, records)}


def _megatron(tmp) -> dict:
    """One launch (DistributedOptimizer, DP 2, fully reshardable checkpoints): every job in turn."""
    base = dict(distopt=True, sharding="fully_reshardable")
    jobs = {}
    for name, config in CONFIGS.items():
        save = dict(save=str(tmp / name), save_after=SAVE_AFTER) if name in SAVED else {}
        jobs[f"train/{name}"] = dict(base, export_cast=config, steps=STEPS, **save)
    jobs["bf16"] = dict(base, export_cast=EF, steps=SAVE_AFTER, save=str(tmp / "bf16"))

    def resume(saved, steps, config=CONFIGS["error_feedback"]):
        return dict(base, export_cast=config, steps=steps, first=SAVE_AFTER, load=str(tmp / saved))
    jobs.update({"resume": resume("error_feedback", STEPS - SAVE_AFTER), "from_bf16": resume("bf16", 1),
                 "ef_from_sr": resume("stochastic_ue8m0", 1, SWITCHED),
                 "resume/verl_grid": resume("verl_grid", STEPS - SAVE_AFTER, CONFIGS["verl_grid"])})
    jobs["fresh"] = dict(base, export_cast=CONFIGS["stochastic_ue8m0"], exports=2)  # the masters, exported again
    records = megatron_worker.run(1, 1, 2, jobs)
    for job, record in records.items():
        assert "error" not in record, (job, record.get("error"))
    return {job: {"fp8": records[job]["fp8"], "warnings": records[job]["warnings"]} for job in jobs}


def _fsdp2(tmp) -> dict:
    """One launch (2 ranks): every job in turn. A snapshot is taken after each forward (the export FSDP2 casts at
    its all-gather): the first one is the install-time export (or the load's), then one per step."""
    jobs = {f"train/{name}": {"fn": "train", "export_cast": config, "steps": STEPS} for name, config in CONFIGS.items()}
    jobs.update({f"save/{name}": {"fn": "save_half", "export_cast": CONFIGS[name], "steps": SAVE_AFTER,
                                  "dir": str(tmp / name)} for name in SAVED})
    jobs["bf16"] = {"fn": "save_half", "export_cast": EF, "steps": SAVE_AFTER, "dir": str(tmp / "bf16")}

    def resume(saved, steps, config=CONFIGS["error_feedback"]):
        return {"fn": "resume", "export_cast": config, "dir": str(tmp / saved), "steps": steps, "first": SAVE_AFTER}
    jobs.update({"resume": resume("error_feedback", STEPS - SAVE_AFTER), "from_bf16": resume("bf16", 1),
                 "ef_from_sr": resume("stochastic_ue8m0", 1, SWITCHED),
                 "resume/verl_grid": resume("verl_grid", STEPS - SAVE_AFTER, CONFIGS["verl_grid"])})
    jobs["fresh"] = {"fn": "train", "export_cast": CONFIGS["stochastic_ue8m0"], "steps": 2, "lr": 0.0}
    out = {}
    for job, record in zip(jobs, fsdp_worker.run(2, [{**spec, "id": name} for name, spec in jobs.items()])):
        assert "error" not in record, (job, record.get("traceback"))
        if "steps" in record:
            snaps = record["steps"] + [record["final"]]
            out[job] = {"warnings": record.get("warnings", []), "fp8": [
                {"step": s["step"], "masters": s["masters"], **({"grid": s["grid"]} if "grid" in s else {}),
                 "served": {n: t for n, t in s["served"].items() if t.dtype != torch.bfloat16}} for s in snaps]}
    return out


DRIVERS = {"deepspeed": _deepspeed, "megatron": _megatron, "fsdp2": _fsdp2}


@pytest.fixture(scope="module", params=ADAPTERS)
def adapter(request, tmp_path_factory):
    """``(adapter name, {job: {"fp8": [{"step", "served", "masters"}, ...], "warnings": [...]}})``."""
    return request.param, DRIVERS[request.param](tmp_path_factory.mktemp(request.param))


def reference(name: str, config: dict, snaps: list, scales: dict | None = None) -> list:
    """The single-process reference of ``snaps`` (Megatron's fused q/k/v and gate/up with block scales: on the
    stack of the checkpoint's tensors; its tiny GPT has 4 heads in 4 query groups)."""
    if name == "megatron" and ExportCastConfig.from_value(config).scale_rule.granularity == "block":
        return reference_fp8_fused(config, snaps, groups=4, heads=4)
    return reference_fp8(config, snaps, scales)


def assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for n in a:
        differ = int((bits(a[n]) != bits(b[n])).sum())
        assert differ == 0, f"{what}: {n}: {differ} of {a[n].numel()} differ"


@pytest.mark.parametrize("config", CONFIGS)
def test_fp8_served_weights_are_the_reference_cast_of_the_gathered_masters(adapter, config):
    """At install and after every step the FP8 weights and scales served_weights yields are the spec cast of the
    whole gathered masters (sticky scales; error feedback's FP8 residual carried from export to export); the linear
    weights are FP8, the embeddings and norms are not."""
    name, runs = adapter
    snaps = runs[f"train/{config}"]["fp8"]
    assert [s["step"] for s in snaps] == list(range(STEPS + 1))
    scale = ExportCastConfig.from_value(CONFIGS[config]).scale_rule.scale_name
    assert any(n.endswith(scale) for n in snaps[0]["served"])
    assert not any("embed" in n or "norm" in n for n in snaps[0]["served"]), sorted(snaps[0]["served"])
    for k, (snap, want) in enumerate(zip(snaps, reference(name, CONFIGS[config], snaps))):
        assert_same(snap["served"], want, f"{name} {config} export {k}")


@pytest.mark.parametrize("job", ["verl_grid", "verl_dithered"])
def test_verls_quantizer_returns_the_served_codes_from_the_grid_routes_bf16(adapter, job):
    """The grid route under verl's rule: at install and after every step, verl's own quantizer, given the bf16
    that ``served_weights(grid=True)`` yields (every adapter) and, with ``fp8_grid``, the gathered bf16 params
    (DeepSpeed, Megatron: the same values; FSDP2's exist only inside its forward), returns the FP8 codes and scales
    faircast serves (the reference cast, above). A Megatron param fused from checkpoint tensors is quantized per
    tensor, as a stack converting it to HF does."""
    name, runs = adapter
    from test_scale_rules import verl_quantizer
    quantizer = verl_quantizer()
    snaps = runs[f"train/{job}"]["fp8"]
    for k, snap in enumerate(snaps):
        weights = [n for n, t in snap["served"].items() if t.dtype == torch.float8_e4m3fn]
        sources = {"grid": snap["grid"]}
        if job == "verl_grid" and name != "fsdp2":
            sources["params"] = snap["params"]
            assert_same(snap["params"], snap["grid"], f"{name} export {k}: params and grid")
        for source, tensors in sources.items():
            assert weights and sorted(tensors) == sorted(weights), source
            for n in weights:
                value, served = tensors[n].reshape(snap["served"][n].shape), snap["served"][n]
                parts = (checkpoint_parts(n, value, 4, 4) if name == "megatron" else None) or [value]
                got = [quantizer(p, [128, 128]) for p in parts]
                want = (checkpoint_parts(n, served, 4, 4) if name == "megatron" else None) or [served]
                scales = snap["served"][n[:-len("weight")] + "weight_scale_inv"]
                assert all(torch.equal(bits(q), bits(w)) for (q, _), w in zip(got, want)), f"{name} {source} {k}: {n}"
                assert torch.equal(bits(torch.cat([s.reshape(-1, scales.shape[1]) for _, s in got])), bits(scales)), \
                    f"{name} {source} export {k}: {n} scales"


def test_every_export_draws_fresh_bits(adapter):
    """Stochastic rounding of unchanged masters: the install-time export and each step's draw their own step's key
    (steps 0, 1, 2), so their FP8 codes differ; each is the reference cast at its step. (DeepSpeed and Megatron
    once drew step 0's key twice, at install and at the first step.)"""
    name, runs = adapter
    snaps = runs["fresh"]["fp8"]
    assert [s["step"] for s in snaps] == [0, 1, 2]
    for a in snaps[1:]:  # the premise: nothing moved the masters
        assert_same(a["masters"], snaps[0]["masters"], f"{name}: masters")
    weights = [n for n, t in snaps[0]["served"].items() if t.dtype == torch.float8_e4m3fn]
    for i in range(3):
        for j in range(i):
            changed = sum(int((bits(snaps[i]["served"][n]) != bits(snaps[j]["served"][n])).sum()) for n in weights)
            total = sum(snaps[i]["served"][n].numel() for n in weights)
            assert changed > total / 10, f"{name}: exports {j} and {i} share {total - changed} of {total} codes"
    for k, (snap, want) in enumerate(zip(snaps, reference(name, CONFIGS["stochastic_ue8m0"], snaps))):
        assert_same(snap["served"], want, f"{name} export {k}")


@pytest.mark.parametrize("saved", ["error_feedback", "verl_grid"])
def test_resume_equals_uninterrupted(adapter, saved):
    """Error feedback (and verl's rule with ``fp8_grid``) saved after 2 steps and loaded into a new run: what is
    served at the load and after each later step is the uninterrupted run's (FP8 bits, scales, FP8 residuals; the
    bf16 params holding the served values), without a warning."""
    name, runs = adapter
    straight, resumed = runs[f"train/{saved}"]["fp8"], runs["resume" if saved == "error_feedback" else f"resume/{saved}"]
    assert resumed["warnings"] == []
    assert [s["step"] for s in resumed["fp8"]] == list(range(SAVE_AFTER, STEPS + 1))
    for k, snap in enumerate(resumed["fp8"]):
        assert_same(snap["masters"], straight[SAVE_AFTER + k]["masters"], f"{name} masters at step {SAVE_AFTER + k}")
        assert_same(snap["served"], straight[SAVE_AFTER + k]["served"], f"{name} FP8 at step {SAVE_AFTER + k}")
        if "params" in snap:  # (fp8_grid: the bf16 params hold the served values)
            assert_same(snap["params"], straight[SAVE_AFTER + k]["params"], f"{name} params at step {SAVE_AFTER + k}")


def test_a_bf16_checkpoint_sets_the_fp8_scales_afresh_with_its_warning(adapter):
    """An error-feedback run without FP8 loads a checkpoint of one with it: one warning says the FP8 scales are set
    afresh, and from the load on the FP8 copy is the reference cast of the loaded masters from fresh scales and
    zero FP8 residuals (the bf16 residuals come back)."""
    name, runs = adapter
    run = runs["from_bf16"]
    said = [w for w in run["warnings"] if "no FP8 export state" in w]
    assert len(said) == 1 and "FP8 scales are set afresh from the loaded masters" in said[0], run["warnings"]
    assert len(run["warnings"]) == 1, run["warnings"]
    for k, (snap, want) in enumerate(zip(run["fp8"], reference(name, CONFIGS["error_feedback"], run["fp8"]))):
        assert_same(snap["served"], want, f"{name} export {k} after the load")


def test_switching_to_error_feedback_keeps_the_fp8_scales_and_starts_fp8_residuals_at_zero(adapter):
    """A stochastic-rounding FP8 checkpoint loaded with error feedback: both residuals start at zero (one warning
    each); the checkpoint's bits are served until the next step and its sticky scales are kept; the error-feedback
    export after it is the reference cast from those scales with zero FP8 residuals."""
    name, runs = adapter
    saved, run = runs["train/stochastic_ue8m0"]["fp8"][SAVE_AFTER], runs["ef_from_sr"]
    assert run["warnings"] == [
        "Fair Cast: switching from stochastic to error_feedback: residuals start at zero",
        "Fair Cast: the checkpoint has no FP8 error-feedback residuals: they start at zero; its FP8 scales are kept"]
    assert_same(run["fp8"][0]["served"], saved["served"], f"{name}: served at the load")
    scales = {n[:-len("_scale")]: t for n, t in saved["served"].items() if n.endswith("_scale")}  # {param: scales}
    (want,) = reference(name, SWITCHED, run["fp8"][1:], scales)
    assert_same(run["fp8"][1]["served"], want, f"{name}: the first error-feedback export")
