"""Fair Cast on PyTorch FSDP2 (fsdp_hooks), in real gloo processes: 1-D FSDP at world sizes 1/2/4,
HSDP 2x2 and FSDP + TP 2x2 (tests/fsdp_worker.py). Four launches in all, shared by every test."""
import pytest
import torch

import fsdp_worker
from faircast_dist import ExportCastConfig, FairCaster, rounding
from helpers import bits

METHODS = ("stochastic", "error_feedback", "dithered")
LAYOUTS = {"fsdp1": (1, {"mesh": (1,)}), "fsdp2": (2, {"mesh": (2,)}), "fsdp4": (4, {"mesh": (4,)}),
           "hsdp": (4, {"mesh": (2, 2)}), "tp": (4, {"mesh": (2, 2), "tp": True}),
           "grouped": (2, {"mesh": (2,), "group": True}),  # fully_shard([block, head]), as accelerate does
           "ac": (2, {"mesh": (2,), "ac": True})}  # activation checkpointing wrappers: the same canonical names
STEPS = 4  # uninterrupted; the resumes save after HALF and train the rest
TELEMETRY = {"fsdp2": 300, "hsdp": 300, "tp": 65536}  # layout: telemetry sample (300: a stride > 1)
HALF = 2
#: FP8 served weights (format "fp8"): one config per method, the scale layouts and options spread over them
FP8 = {"nearest": {"mode": "nearest", "format": "fp8"},
       "nearest_via_bf16_block": {"mode": "nearest", "format": "fp8", "fp8_scales": "block", "fp8_via_bf16": True},
       "stochastic_block": {"mode": "fair", "method": "stochastic", "seed": 7, "format": "fp8", "fp8_scales": "block"},
       "dithered_ue8m0": {"mode": "fair", "method": "dithered", "seed": 7, "format": "fp8", "fp8_ue8m0": True},
       "error_feedback": {"mode": "fair", "method": "error_feedback", "seed": 7, "format": "fp8"}}
FP8_RESUMED = ("dithered_ue8m0", "error_feedback")
FP8_MOE = ("error_feedback", "stochastic_block")


def cfg(method):
    return {"mode": "fair", "method": method, "seed": 7}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """{(layout, job id): record}. The world-2 launch saves the checkpoints the others resume."""
    tmp = tmp_path_factory.mktemp("fsdp")
    saves = {m: str(tmp / m) for m in METHODS} | {"stock": str(tmp / "stock")}
    jobs = {w: [] for w in (1, 2, 4)}
    for layout, (world, opts) in LAYOUTS.items():
        for m in METHODS:
            jobs[world] += [{**opts, "id": (layout, "train", m), "fn": "train", "export_cast": cfg(m), "steps": STEPS},
                            {**opts, "id": (layout, "fixed", m), "fn": "fixed", "export_cast": cfg(m)}]
            if m == "stochastic" and layout in TELEMETRY:
                jobs[world].append({**opts, "id": (layout, "telemetry"), "fn": "train", "export_cast": cfg(m),
                                    "steps": STEPS, "telemetry": TELEMETRY[layout]})
            if layout in ("fsdp1", "fsdp4", "grouped"):
                jobs[world].append({**opts, "id": (layout, "resume", m), "fn": "resume", "export_cast": cfg(m),
                                    "dir": saves[m], "steps": STEPS - HALF, "first": HALF})
    for m in METHODS:  # world 2 first: saves, then resumes at the same world size
        jobs[2] = [{"id": ("fsdp2", "save", m), "fn": "save_half", "export_cast": cfg(m), "steps": HALF, "dir": saves[m]},
                   {"id": ("fsdp2", "resume", m), "fn": "resume", "export_cast": cfg(m), "dir": saves[m],
                    "steps": STEPS - HALF, "first": HALF}] + jobs[2]
    jobs[2] += [{"id": ("fsdp2", "stock"), "fn": "train", "export_cast": None, "steps": STEPS},
                {"id": ("fsdp2", "nearest"), "fn": "train", "export_cast": {"mode": "nearest"}, "steps": STEPS},
                {"id": ("fsdp2", "save", "stock"), "fn": "save_half", "export_cast": None, "steps": HALF,
                 "dir": saves["stock"]},
                {"id": ("fsdp2", "stock_resume"), "fn": "resume", "export_cast": cfg("error_feedback"),
                 "dir": saves["stock"], "steps": 1, "first": HALF},
                {"id": ("fsdp2", "uninstalled"), "fn": "train", "export_cast": cfg("stochastic"), "uninstall": True,
                 "steps": STEPS},
                {"id": ("fsdp2", "late"), "fn": "train", "export_cast": cfg("error_feedback"), "late": 1, "steps": 2},
                {"id": ("fsdp2", "save", "drop"), "fn": "save_half", "export_cast": cfg("error_feedback"), "steps": 1,
                 "dir": str(tmp / "drop")},
                {"id": ("fsdp2", "drop"), "fn": "resume", "export_cast": cfg("stochastic"), "dir": str(tmp / "drop"),
                 "steps": 1, "first": 1},
                {"id": ("fsdp2", "opt", "fused"), "fn": "train", "export_cast": cfg("error_feedback"),
                 "optimizer": "fused", "steps": 3},
                {"id": ("fsdp2", "opt", "data_sgd"), "fn": "train", "export_cast": cfg("stochastic"),
                 "optimizer": "data_sgd", "steps": 3},
                {"id": ("fsdp2", "gradless"), "fn": "train", "export_cast": cfg("stochastic"), "gradless": True,
                 "steps": 3},
                {"id": ("fsdp2", "save_refusals"), "fn": "save_refusals", "export_cast": cfg("error_feedback"),
                 "dir": str(tmp / "refusals")},
                {"id": ("fsdp2", "deltas"), "fn": "deltas", "export_cast": cfg("dithered"), "steps": 4}]
    # the adoption rule through DCP: every (saved, loaded) method pair, one step after the load
    jobs[2] += [{"id": ("fsdp2", "adopt", saved, m), "fn": "resume", "export_cast": cfg(m), "dir": saves[saved],
                 "steps": 1, "first": HALF} for saved in ("stock", *METHODS) for m in METHODS]
    jobs[4] += [{"id": ("fsdp4", "refuse", name), "fn": "refuse", **job} for name, job in REFUSALS_JOBS.items()]
    jobs[2] += [{"id": ("fsdp2", "save", "nearest"), "fn": "save_half", "export_cast": {"mode": "nearest"},
                 "steps": HALF, "dir": str(tmp / "nearest")},  # fsdp_hooks.checkpoint.save with Fair Cast off
                {"id": ("fsdp2", "nearest_from_ef"), "fn": "resume", "export_cast": {"mode": "nearest"},
                 "dir": saves["error_feedback"], "steps": 1, "first": HALF},
                {"id": ("fsdp2", "ef_from_nearest"), "fn": "resume", "export_cast": cfg("error_feedback"),
                 "dir": str(tmp / "nearest"), "steps": 1, "first": HALF}]
    jobs[2] += [{"id": ("fsdp2", "activated", v), "fn": "activated", "export_cast": cfg("stochastic"),
                 "explicit": cfg("dithered"), "variant": v, "steps": 3} for v in ("explicit", "split", "state_dict")]
    # FP8 served weights: one master trajectory under every layout; a DCP save on 2 ranks resumed on 1, 2 and 4
    for layout, (world, opts) in LAYOUTS.items():
        jobs[world] += [{**opts, "id": (layout, "fp8", name), "fn": "fixed", "export_cast": c} for name, c in FP8.items()]
    for name in FP8_RESUMED:
        fp8_dir = str(tmp / f"fp8_{name}")
        jobs[2] = [{"id": ("fsdp2", "fp8_save", name), "fn": "save_half", "export_cast": FP8[name], "steps": HALF,
                    "dir": fp8_dir}] + jobs[2]
        jobs[2] += [{"id": ("fsdp2", "fp8_train", name), "fn": "train", "export_cast": FP8[name], "steps": STEPS,
                     "telemetry": 300}]
        for layout in ("fsdp1", "fsdp4"):  # (the same world: tests/test_contract.py)
            jobs[LAYOUTS[layout][0]].append({**LAYOUTS[layout][1], "id": (layout, "fp8_resume", name), "fn": "resume",
                                             "export_cast": FP8[name], "dir": fp8_dir, "steps": STEPS - HALF,
                                             "first": HALF})
    for world in (1, 2, 4):  # transformers 5's fused experts: one master trajectory under FSDP 1/2/4
        jobs[world] += [{"id": (f"fsdp{world}", "fp8_moe", name), "fn": "fixed", "moe": True, "export_cast": FP8[name]}
                        for name in FP8_MOE]
    out = {}
    for world in (2, 4, 1):
        for job, record in zip(jobs[world], fsdp_worker.run(world, jobs[world])):
            out[job["id"]] = record
    return out


def get(records, *key):
    record = records[key]
    assert "error" not in record, record.get("traceback")
    return record


def assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    diff = {n: int((bits(a[n]) != bits(b[n])).sum()) for n in a}
    assert not any(diff.values()), f"{what}: elements differing per param: {diff}"


def reference_exports(method, snapshots):
    """The single-process reference cast of each snapshot's gathered masters (error feedback: the
    residual carried from the previous export, zero at the first)."""
    caster = FairCaster(ExportCastConfig.from_value(cfg(method)))
    residual, out = {}, []
    for snap in snapshots:
        caster.step = snap["step"]
        served = {}
        for n, m in snap["masters"].items():
            if method == "error_feedback":
                r = residual.setdefault(n, torch.zeros_like(m))
                served[n] = rounding.cast_error_feedback(m, r)
            else:
                served[n] = rounding.cast_stochastic(m, caster.key(n), 0)
        out.append(served)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_every_served_and_computed_weight_is_the_reference_cast(layout, method, records):
    """At every step the served model (what the forward gathered) is the reference cast of the
    gathered fp32 master, on every layout; error feedback's residual too."""
    rec = get(records, layout, "train", method)
    snaps = rec["steps"] + [rec["final"]]
    assert [s["step"] for s in snaps] == list(range(STEPS + 1))
    for k, (snap, ref) in enumerate(zip(snaps, reference_exports(method, snaps))):
        assert_same(snap["served"], ref, f"{layout} {method} step {k}")
    if method == "error_feedback":
        residual = {n: torch.zeros_like(m) for n, m in snaps[0]["masters"].items()}
        for snap in snaps:
            for n, m in snap["masters"].items():
                rounding.cast_error_feedback(m, residual[n])
        assert_same(rec["final"]["residual"], residual, f"{layout} residual")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_served_weights_yields_every_param_once_in_model_order(layout, records):
    rec = get(records, layout, "train", "stochastic")
    assert rec["final"]["served_names"] == list(rec["final"]["masters"])
    assert_same(rec["final"]["shards_full"], rec["final"]["served"], "served_shards gathered")


@pytest.mark.parametrize("layout", [name for name, (_, opts) in LAYOUTS.items() if not opts.get("tp")])
@pytest.mark.parametrize("method", METHODS)
def test_the_forward_computes_with_the_served_bits(layout, method, records):
    """The FSDP2 model's logits are exactly those of a plain bf16 copy loaded with served_weights
    (TP is left out: its row-parallel sum runs in another order)."""
    rec = get(records, layout, "train", method)
    assert torch.equal(rec["logits"], rec["plain_logits"])


@pytest.mark.parametrize("layout", list(TELEMETRY))
def test_drift_telemetry_equals_the_gathered_models(layout, records):
    """Every rank measures only the shard it casts, each element once (HSDP replicas and TP-replicated
    params on their first replica): the reduced numbers are those of one DriftSample fed the whole
    gathered model at each step, primed with stock FSDP2's round-to-nearest of the initial masters."""
    from faircast_dist.telemetry import DriftSample, reduce_drift, sample_stride
    steps = get(records, layout, "telemetry")["steps"]

    def pieces(masters, served):
        return [(n, m.reshape(-1), s.reshape(-1), [(n, 0, m.numel(), 0)]) for (n, m), s in zip(masters.items(), served)]
    first = steps[0]["masters"]
    drift = DriftSample(sample_stride(sum(m.numel() for m in first.values()), TELEMETRY[layout]))
    assert (drift.stride > 1) == (TELEMETRY[layout] < 1000)
    drift.prime(pieces(first, [m.to(torch.bfloat16) for m in first.values()]))
    for k, step in enumerate(steps):
        drift.observe(pieces(step["masters"], [step["served"][n] for n in step["masters"]]))
        want, got = reduce_drift([drift]), step["drift"]
        assert got.keys() == {f"export_cast/{name}" for name in want}, got
        for name in ("changed_fraction", "gap_ulps"):
            assert got[f"export_cast/{name}"] == pytest.approx(want[name], rel=1e-9), (k, name)
        assert got["export_cast/lag_steps"] == want["lag_steps"], k
        assert got["export_cast/export_ms"] > 0 and got["export_cast/changed_fraction"] > 0, k
    assert get(records, layout, "train", "stochastic")["steps"][0]["drift"] is None  # telemetry off: nothing


@pytest.mark.parametrize("method", METHODS)
def test_layout_invariance_one_master_trajectory(method, records):
    """One master trajectory exported under FSDP 1/2/4, HSDP 2x2, FSDP + TP 2x2 and a grouped
    fully_shard: the same bits, the reference cast's."""
    exports = {layout: [s["served"] for s in get(records, layout, "fixed", method)["exports"]] for layout in LAYOUTS}
    snaps = get(records, "fsdp1", "fixed", method)["exports"]
    for layout, served in exports.items():
        for k, (got, ref) in enumerate(zip(served, reference_exports(method, snaps))):
            assert_same(got, ref, f"{layout} export {k}")


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2", "fsdp4", "grouped"])
@pytest.mark.parametrize("method", METHODS)
def test_dcp_resume_equals_uninterrupted(method, layout, records):
    """Save at step 2 on 2 ranks (DCP), load on 1, 2 or 4 (or with the last block and the head in
    one fully_shard), train to step 4: masters, served weights and residuals bitwise those of the
    uninterrupted run."""
    straight = get(records, "fsdp2", "train", method)
    resumed = get(records, layout, "resume", method)
    assert resumed["warnings"] == []
    for k, snap in enumerate(resumed["steps"] + [resumed["final"]]):
        want = (straight["steps"] + [straight["final"]])[HALF + k]
        assert snap["step"] == want["step"]
        for what in ("masters", "served") + (("residual",) if method == "error_feedback" else ()):
            assert_same(snap[what], want[what], f"{what} at step {want['step']}")


def test_a_stock_checkpoint_resumes_error_feedback_from_zero_residuals_at_the_optimizer_step(records):
    """A DCP checkpoint without Fair Cast state: the export step is the optimizer's (2), a warning
    says so, and error feedback starts from zero residuals."""
    rec = get(records, "fsdp2", "stock_resume")
    assert [w for w in rec["warnings"] if "has no export-cast state" in w] == [
        "Fair Cast: the checkpoint has no export-cast state (written without Fair Cast, or before the first step?): "
        "the export step is 2, residuals start at zero"], rec["warnings"]
    first = rec["steps"][0]
    assert first["step"] == HALF
    assert_same(first["served"], reference_exports("error_feedback", [first])[0], "first export after the load")


@pytest.mark.parametrize("saved", ["stock", *METHODS])
@pytest.mark.parametrize("now", METHODS)
def test_every_saved_and_loaded_method_pair_follows_the_one_rule(saved, now, records):
    """faircast_dist.export.ExportState.restore through fsdp_hooks.checkpoint: residuals kept exactly
    (error feedback on both sides), zero with one warning (error feedback from a checkpoint without
    them), dropped with one warning (error feedback's checkpoint, another method now); the step is the
    checkpoint's (a stock one: the optimizer's). The load serves the checkpoint's served shards until the next
    step (a stock checkpoint holds none: the loaded masters are cast at the load); the export after it is the
    reference cast of the method now."""
    rec = get(records, "fsdp2", "adopt", saved, now)
    first, then = rec["steps"][0], rec["final"]
    assert first["step"] == HALF and then["step"] == HALF + 1
    ours = [w for w in rec["warnings"] if "seed" not in w]
    if saved == "stock":
        assert len(ours) == 1 and "has no export-cast state" in ours[0], rec["warnings"]
        assert ("residuals start at zero" in ours[0]) == (now == "error_feedback")
        assert_same(first["served"], reference_exports(now, [first])[0], "cast at the load")
        return
    assert_same(first["served"], get(records, "fsdp2", "train", saved)["steps"][HALF]["served"], "served at the load")
    if now == "error_feedback":
        assert len(ours) == (0 if saved == "error_feedback" else 1), rec["warnings"]
        if saved == "error_feedback":  # kept exactly: the resumed run is the uninterrupted one
            assert_same(first["residual"], get(records, "fsdp2", "train", now)["steps"][HALF]["residual"], "residual")
        else:
            assert "residuals start at zero" in ours[0]
            assert_same(then["served"], reference_exports(now, [then])[0], "the export after the load")
    else:
        assert len(ours) == (1 if saved == "error_feedback" else 0), rec["warnings"]
        if saved == "error_feedback":
            assert "dropping them" in ours[0]
        assert_same(then["served"], reference_exports(now, [then])[0], "the export after the load")


@pytest.mark.parametrize("variant", ["explicit", "split", "state_dict"])
def test_the_activation_installs_once_whatever_the_script_does(variant, records):
    """fsdp_hooks.activate (faircast-run's) with a script that installs itself (its config is kept, no
    block is installed again), with two optimizers over parts of the model (installed once, on the
    model, by the first to step), or that steps the optimizer before any forward (DCP's get_state_dict:
    installed at the first step after a forward, not left off): every later export is the reference."""
    rec = get(records, "fsdp2", "activated", variant)
    method = "dithered" if variant == "explicit" else "stochastic"
    assert rec["method"] == method and rec["blocks_installed"] == [False, False]
    snaps = rec["steps"] if variant == "explicit" else rec["steps"][1:]  # activated: from the first step
    assert [s["step"] for s in snaps] == list(range(3 - len(snaps), 3))
    for snap, ref in zip(snaps, reference_exports(method, snaps)):
        assert_same(snap["served"], ref, f"{variant} step {snap['step']}")


def test_fsdp_hooks_checkpoints_a_model_with_fair_cast_off(records):
    """fsdp_hooks.checkpoint.save / load on a model without Fair Cast (mode nearest): a stock checkpoint,
    and an error-feedback checkpoint loaded with its residuals dropped (one warning), the masters resumed."""
    off = get(records, "fsdp2", "nearest_from_ef")
    assert [w for w in off["warnings"] if "dropping them" in w] and len(off["warnings"]) == 1, off["warnings"]
    assert_same(off["steps"][0]["masters"], get(records, "fsdp2", "train", "error_feedback")["steps"][HALF]["masters"],
                "masters after the load")
    on = get(records, "fsdp2", "ef_from_nearest")
    assert any("has no export-cast state" in w and "residuals start at zero" in w for w in on["warnings"]), on["warnings"]
    first = on["steps"][0]
    assert first["step"] == HALF
    assert_same(first["served"], reference_exports("error_feedback", [first])[0], "first export after the load")


def test_off_is_stock_fsdp2(records):
    """No config or mode nearest: install changes nothing (trajectory bitwise stock)."""
    stock, nearest = get(records, "fsdp2", "stock"), get(records, "fsdp2", "nearest")
    assert_same(stock["final"]["masters"], nearest["final"]["masters"], "masters")
    assert torch.equal(stock["logits"], nearest["logits"])
    fair = get(records, "fsdp2", "train", "stochastic")
    assert not torch.equal(stock["logits"], fair["logits"])  # the comparison can fail


def test_uninstall_is_stock_fsdp2(records):
    stock, uninstalled = get(records, "fsdp2", "stock"), get(records, "fsdp2", "uninstalled")
    assert_same(stock["final"]["masters"], uninstalled["final"]["masters"], "masters")
    assert torch.equal(stock["logits"], uninstalled["logits"])


def test_install_after_stock_steps_computes_with_the_served_bits(records):
    """Installed after one stock step (the first forward done): the export step counts from the
    install, and the forward computes with the reference cast of the masters."""
    rec = get(records, "fsdp2", "late")
    snaps = rec["steps"] + [rec["final"]]
    assert [s["step"] for s in snaps] == [0, 1, 2]
    for k, (snap, ref) in enumerate(zip(snaps, reference_exports("error_feedback", snaps))):
        assert_same(snap["served"], ref, f"step {k}")
    assert torch.equal(rec["logits"], rec["plain_logits"])


def test_a_checkpoint_with_residuals_loaded_without_error_feedback_says_they_are_dropped(records):
    rec = get(records, "fsdp2", "drop")
    assert any("dropping them" in w for w in rec["warnings"]), rec["warnings"]
    first, then = rec["steps"][0], rec["final"]
    assert first["step"] == 1
    assert_same(first["served"], get(records, "fsdp2", "train", "error_feedback")["steps"][1]["served"], "at the load")
    assert_same(then["served"], reference_exports("stochastic", [then])[0], "the export after the load")


@pytest.mark.parametrize("key", [("opt", "fused"), ("opt", "data_sgd"), ("gradless",)])
def test_optimizers_that_bump_no_version_counter_and_steps_that_change_nothing(key, records):
    """AdamW(fused=True) and an optimizer on p.data change the masters without moving the params'
    version counters; a step with every grad None changes none but advances the export step. Each
    export is still the reference cast at its step."""
    rec = get(records, "fsdp2", *key)
    method = "error_feedback" if key == ("opt", "fused") else "stochastic"
    snaps = rec["steps"] + [rec["final"]]
    assert [s["step"] for s in snaps] == ([0, 2, 4, 6] if key == ("gradless",) else [0, 1, 2, 3])
    assert any(not torch.equal(m, snaps[-1]["masters"][n]) for n, m in snaps[0]["masters"].items())  # it trains
    for k, (snap, ref) in enumerate(zip(snaps, reference_exports(method, snaps))):
        assert_same(snap["served"], ref, f"{key} export {k}")
    assert torch.equal(rec["logits"], rec["plain_logits"])


def test_a_save_never_overwrites_and_a_save_that_dies_leaves_no_checkpoint(records):
    rec = get(records, "fsdp2", "save_refusals")
    assert "exists; save each step to a new folder" in rec["exists"]
    assert rec["died"] == "killed after writing" and rec["second_after_death"] is False
    assert rec["second"] and not rec["partial_left"]


def test_served_deltas_rebuild_every_served_model(records):
    rec = get(records, "fsdp2", "deltas")
    assert rec["rebuilt"] == [True] * 4
    assert 0 < sum(rec["changed"]) < 2000  # dithered: a fraction of the ~2k weights changes per step


REFUSALS = {
    "no_mixed_precision": ({"kwargs": {}}, "ValueError", "param_dtype=None"),
    "fp16": ({"kwargs": {"param_dtype": torch.float16}}, "ValueError", "param_dtype=torch.float16"),
    "bf16_masters": ({"kwargs": {"param_dtype": torch.bfloat16}, "dtype": torch.bfloat16}, "TypeError", "float32 master"),
    "reshard_to_2": ({"kwargs": {"param_dtype": torch.bfloat16, "reshard_after_forward": 2}}, "NotImplementedError",
                     "reshard_after_forward=<int>"),
    "foreign_optimizer": ({"kwargs": {"param_dtype": torch.bfloat16}, "foreign": True}, "ValueError",
                          "holds none of the model's params"),
}
REFUSALS_JOBS = {name: job for name, (job, _, _) in REFUSALS.items()}


@pytest.mark.parametrize("name", REFUSALS)
def test_what_it_cannot_cover_is_an_error_naming_it(name, records):
    _, raised, match = REFUSALS[name]
    rec = get(records, "fsdp4", "refuse", name)
    assert rec["raised"] == raised and match in rec["message"], rec


def test_a_model_without_fully_shard_and_a_bad_config_are_errors_naming_them():
    import fsdp_hooks
    model = fsdp_worker.Tiny()
    with pytest.raises(ValueError, match="no fully_shard-ed module"):
        fsdp_hooks.install(model, torch.optim.AdamW(model.parameters()), config="fair")
    with pytest.raises(ValueError, match="unknown key"):
        fsdp_hooks.install(model, torch.optim.AdamW(model.parameters()), config={"mode": "fair", "metod": "stochastic"})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FP8)
def test_fp8_served_weights_are_the_single_process_reference_under_every_layout(name, layout, records):
    """FP8 served weights (format "fp8"): one master trajectory exported under FSDP 1/2/4, HSDP 2x2, FSDP + TP 2x2
    (rowwise ``down``: each channel spans the TP ranks), a grouped fully_shard and AC wrappers gives the bits and
    scales of the spec cast on the whole params (sticky scales, rescaled as the masters grow); the other params
    are served as bf16 with the method's bf16 cast."""
    from helpers import reference_fp8
    exports = get(records, layout, "fp8", name)["exports"]
    config = ExportCastConfig.from_value(FP8[name])
    for k, (snap, ref) in enumerate(zip(exports, reference_fp8(config, exports))):
        fp8 = {n: t for n, t in snap["served"].items() if n in ref}
        assert_same(fp8, ref, f"{layout} {name} export {k}")
        bf16 = {n: t for n, t in snap["served"].items() if n not in ref}
        assert {n: t.dtype for n, t in bf16.items()} == {n: torch.bfloat16 for n in bf16}
        assert sorted(bf16) == sorted(n for n in snap["masters"] if n not in ref), "every other param, as bf16"
    if layout == "fsdp1" and not config.fp8_ue8m0:  # the masters grow 0.1-0.3% per export: maxima outgrow their
        scales = [{n: t for n, t in r.items() if "scale" in n} for r in reference_fp8(config, exports)]  # scales
        assert sum(int((a[n] != b[n]).sum()) for a, b in zip(scales, scales[1:]) for n in a) > 0


@pytest.mark.parametrize("name", FP8_MOE)
def test_fp8_fused_experts_are_the_per_expert_reference_under_every_mesh(name, records):
    """A real transformers 5 Qwen3-MoE (fused experts ``gate_up_proj`` [4, 80, 48], ``down_proj`` [4, 48, 40]; FSDP
    shards the experts' dim) under FSDP 1, 2 and 4: one master trajectory's FP8 served weights are the
    single-process export's, experts included (served 3-D, ``gate_up_proj_scale`` / ``_scale_inv`` beside them);
    the scales (and error feedback's bytes) are those of each expert's checkpoint tensors cast on their own."""
    from helpers import expert_checkpoint, reference_fp8, single_process_fp8, tiny_moe
    for world in (1, 2, 4):
        exports = get(records, f"fsdp{world}", "fp8_moe", name)["exports"]
        for k, (snap, want) in enumerate(zip(exports, single_process_fp8(FP8[name], tiny_moe(), exports))):
            assert {n for n in want if "experts" in n} == {f"model.layers.0.mlp.experts.{p}{s}" for p in (
                "gate_up_proj", "down_proj") for s in ("", "_scale_inv" if "block" in name else "_scale")}
            assert_same({n: t for n, t in snap["served"].items() if n in want}, want, f"fsdp{world} {name} {k}")
        per_expert = [{**snap, "masters": expert_checkpoint(snap["masters"])} for snap in exports]
        for snap, ref in zip(exports, reference_fp8(FP8[name], per_expert)):
            got = {n: t for n, t in expert_checkpoint(snap["served"]).items() if n in ref}
            if name != "error_feedback":  # stochastic bits: keyed on the fused param's own indices
                got, ref = ({n: t for n, t in d.items() if "scale" in n} for d in (got, ref))
            assert_same(got, ref, f"fsdp{world} {name} per expert")


def test_fp8_served_weights_yield_each_weight_then_its_scales_in_model_order(records):
    snap = get(records, "fsdp2", "fp8", "error_feedback")["exports"][0]
    names = list(snap["served"])
    assert names[names.index("blocks.0.up.weight") + 1] == "blocks.0.up.weight_scale"
    assert snap["served"]["blocks.0.up.weight"].dtype == torch.float8_e4m3fn
    assert snap["served"]["blocks.0.up.weight_scale"].shape == (38, 1)
    assert snap["served"]["blocks.0.norm.weight"].dtype == torch.bfloat16  # norms stay bf16
    block = get(records, "fsdp2", "fp8", "stochastic_block")["exports"][0]["served"]
    assert block["blocks.0.up.weight_scale_inv"].shape == (1, 1)


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp4"])
@pytest.mark.parametrize("name", FP8_RESUMED)
def test_fp8_dcp_resume_equals_uninterrupted(name, layout, records):
    """Save at step 2 on 2 ranks, load on 1 or 4 (on 2: tests/test_contract.py): the FP8 bits, sticky scales, bf16
    weights, masters and
    residuals follow the uninterrupted run bit for bit (the scales and, for error feedback, the FP8 residual are
    checkpointed; a scale set afresh after the load would differ)."""
    straight = get(records, "fsdp2", "fp8_train", name)
    resumed = get(records, layout, "fp8_resume", name)
    assert resumed["warnings"] == []
    for k, snap in enumerate(resumed["steps"] + [resumed["final"]]):
        want = (straight["steps"] + [straight["final"]])[HALF + k]
        assert snap["step"] == want["step"]
        for what in ("masters", "served") + (("residual",) if name == "error_feedback" else ()):
            assert_same(snap[what], want[what], f"{what} at step {want['step']}")


@pytest.mark.parametrize("name", FP8_RESUMED)
def test_fp8_telemetry_counts_the_rescales(name, records):
    """``export_cast/fp8_rescales`` at each step is the number of scales the reference set again at that export."""
    from helpers import reference_fp8
    steps = get(records, "fsdp2", "fp8_train", name)["steps"]
    ref = reference_fp8(ExportCastConfig.from_value(FP8[name]), steps)
    counts = [sum(int((a[n] != b[n]).sum()) for n in a if "scale" in n) for a, b in zip(ref, ref[1:])]
    assert [s["drift"]["export_cast/fp8_rescales"] for s in steps[1:]] == counts
    assert steps[0]["drift"]["export_cast/fp8_rescales"] == 0  # the first export sets every scale: no rescale


@pytest.mark.parametrize("name", FP8_RESUMED)
def test_fp8_drift_telemetry_equals_the_gathered_model(name, records):
    """``export_cast/fp8_changed_fraction``, ``fp8_lag_steps`` and ``fp8_gap_ulps`` at each step are those of one
    FP8 DriftSample fed the whole gathered FP8 model, its scales and the masters (each rank measured its own
    shards), and differ from the bf16 copy's."""
    from faircast_dist import FairCaster
    from faircast_dist.fp8 import Fp8Export
    from faircast_dist.telemetry import DriftSample, reduce_drift, sample_stride
    steps = get(records, "fsdp2", "fp8_train", name)["steps"]
    first = steps[0]["masters"]
    fp8 = Fp8Export(FairCaster(ExportCastConfig.from_value(FP8[name])), {n: m.shape for n, m in first.items()})
    sample = DriftSample(sample_stride(sum(m.numel() for m in first.values()), 300), fp8=fp8)  # the job's sample
    assert sample.stride > 1
    for k, step in enumerate(steps):
        fp8.scales = {n: step["served"][fp8.scale_name(n)] for n in fp8.shapes}
        sample.observe([(n, step["masters"][n].reshape(-1), step["served"][n].view(torch.uint8).reshape(-1),
                         [(n, 0, step["masters"][n].numel(), 0)]) for n in fp8.shapes])
        want, got = reduce_drift([sample]), step["drift"]
        for what in ("changed_fraction", "gap_ulps"):
            assert got[f"export_cast/fp8_{what}"] == pytest.approx(want[what], rel=1e-9), (k, what)
        assert got["export_cast/fp8_lag_steps"] == want["lag_steps"], k
    assert steps[-1]["drift"]["export_cast/fp8_changed_fraction"] != steps[-1]["drift"]["export_cast/changed_fraction"]
