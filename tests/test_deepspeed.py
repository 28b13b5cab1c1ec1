"""DeepSpeed with ``"export_cast"``: real gloo runs (2-4 ranks) of a tiny model on every bf16
optimizer path. The reference for every check is the single-process cast of the gathered state."""
import functools

import pytest
import torch

from ds_worker import PATHS, preset_state, run
from ds_worker import tiny_model as ds_tiny_model
from faircast_dist import FairCaster
from helpers import bits
from faircast_dist.delta import apply_deltas

SR = {"mode": "fair", "method": "stochastic", "seed": 7}
EF = {"mode": "fair", "method": "error_feedback"}
DITHER = {"mode": "fair", "method": "dithered", "seed": 7}
METHODS = {"stochastic": SR, "error_feedback": EF, "dithered": DITHER}
STEPS = 5


@functools.lru_cache(maxsize=None)
def trained(world_size, path, method, steps=STEPS):
    return run(world_size, path=path, export_cast=METHODS[method], steps=steps)


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(bits(a[n]), bits(b[n])), n


def assert_deltas_rebuild(record):
    """served_deltas: the first call's deltas build the starting model on an empty receiver, and
    each step's deltas then turn it into that step's served model, bit for bit; a call with no
    step in between yields nothing."""
    receiver = {n: torch.zeros_like(t) for n, t in record["start"][0].items()}
    apply_deltas(receiver, record["deltas"][0])
    assert_same(receiver, record["start"][0])
    assert len(record["deltas"]) == len(record["bf16"]) + 1
    for served, deltas in zip(record["bf16"], record["deltas"][1:]):
        apply_deltas(receiver, deltas)
        assert_same(receiver, served)
    assert [len(index) for _, index, _ in record["deltas_again"]] == [0] * len(receiver)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", METHODS)
def test_every_master_copy_is_fair(path, method):
    rank0, rank1 = trained(2, path, method)
    assert rank0["method"] == method and rank0["export_step"] == STEPS
    # every served element, at every step, equals the single-process reference cast of the
    # gathered master (and, for error feedback, the gathered residual of the step before)
    assert rank0["mismatch"] == 0 and rank1["mismatch"] == 0, rank0["optimizer"]
    assert rank0["rtn_differs"] > 100  # ... which is not what round-to-nearest gives: the check bites
    if path in ("zero1", "zero2", "bf16_optimizer", "offload2"):  # the cast took the stock copy's place
        assert rank0["master_copies"] == 0 and rank1["master_copies"] == 0
    for a, b in zip(rank0["bf16"], rank1["bf16"]):  # every rank sees the same model (replicas agree)
        assert_same(a, b)
    assert_same(rank0["served_api"], rank0["bf16"][-1])  # the export API yields the served model
    assert_deltas_rebuild(rank0)
    for a, b in zip(rank0["deltas"], rank1["deltas"]):  # every rank yields the same deltas
        assert [n for n, _, _ in a] == [n for n, _, _ in b]
        assert all(torch.equal(i, j) and torch.equal(bits(v), bits(w)) for (_, i, v), (_, j, w) in zip(a, b))


LAYOUTS = [("stage0", 1), ("zero2", 1), ("zero1", 2), ("bf16_optimizer", 2), ("zero3", 2), ("zero2", 4), ("zero3", 4)]


@functools.lru_cache(maxsize=None)
def preset_exports(path, world):
    return run(world, path=path, export_cast=SR, steps=0, lr=0.0, preset=tuple(METHODS.values()))[0]["preset"]


@pytest.mark.parametrize("method", METHODS)
def test_layout_invariance_one_state_many_layouts(method):
    """One training state (masters, residuals, step) loaded into stage 0/1/2/3, BF16_Optimizer and
    DP 1/2/4 exports bitwise the same bf16 model — the single-process reference — twice in a row
    (one launch per layout exports it with every method)."""
    exports = {layout: preset_exports(*layout)[method] for layout in LAYOUTS}
    numel = {n: t.numel() for n, t in exports[LAYOUTS[0]][0].items()}
    master, residual = preset_state(numel)
    ref = FairCaster(METHODS[method])
    ref.step = 1  # the export after the warm-up step
    expected = []
    for _ in range(2):
        expected.append({n: ref.cast(n, master[n], residual=residual[n]) for n in numel})
        ref.advance()
    for layout, served in exports.items():
        for k in range(2):
            assert_same(served[k], expected[k])
    # an unchanged master: dithered rounding serves the same bits again, stochastic rounding redraws
    first, second = (torch.cat(list(e.values())) for e in expected)
    assert torch.equal(bits(first), bits(second)) == (method == "dithered")


@pytest.mark.parametrize("method", ["stochastic", "error_feedback"])
def test_trajectory_dp1_equals_dp2_zero1_zero2(method):
    ref = trained(1, "zero2", method)[0]
    for other in (trained(2, "zero2", method)[0], trained(2, "zero1", method)[0]):
        for a, b in zip(ref["deltas"], other["deltas"]):  # global indices: the same deltas in any layout
            assert [(n, i.tolist(), bits(v).tolist()) for n, i, v in a] == [(n, i.tolist(), bits(v).tolist()) for n, i, v in b]
        for step in range(STEPS):
            assert_same(ref["bf16"][step], other["bf16"][step])
            assert_same(ref["master"][step], other["master"][step])
            assert_same(ref["residual"][step], other["residual"][step])


RESUME = [(p, "error_feedback") for p in PATHS] + [("stage0", "stochastic"), ("zero3", "stochastic"), ("zero3", "dithered")]


@pytest.mark.parametrize("path,method", RESUME)
def test_resume_equals_uninterrupted(path, method, tmp_path):
    from deepspeed_hooks.served import read_checkpoint
    straight = trained(2, path, method)[0]
    first = run(2, path=path, export_cast=METHODS[method], steps=3, save_dir=str(tmp_path))[0]
    # the CLI's reader gives back exactly the bf16 model served when the checkpoint was written
    assert_same({n: t.reshape(-1) for n, t in read_checkpoint(str(tmp_path)).items()}, first["bf16"][-1])
    resumed = run(2, path=path, export_cast=METHODS[method], steps=2, load_dir=str(tmp_path))[0]
    assert resumed["mismatch"] == 0 and resumed["export_step"] == STEPS
    for k in range(2):
        assert_same(straight["bf16"][3 + k], resumed["bf16"][k])
        assert_same(straight["master"][3 + k], resumed["master"][k])
        assert_same(straight["residual"][3 + k], resumed["residual"][k])


def test_off_is_stock_deepspeed():
    stock = run(2, export_cast=None, hook=None)[0]
    assert_deltas_rebuild(stock)  # delta export of a stock (round-to-nearest) engine
    assert stock["master_copies"] == 4  # one stock copy per step (one param group): the probe sees it
    for variant in (run(2, export_cast={"mode": "nearest", "method": "error_feedback"})[0],
                    run(2, export_cast=None)[0]):
        assert variant["method"] is None
        for step in range(len(stock["bf16"])):
            assert_same(stock["bf16"][step], variant["bf16"][step])
            assert_same(stock["master"][step], variant["master"][step])
    fair = trained(2, "zero2", "stochastic")[0]
    assert any(not torch.equal(bits(fair["bf16"][3][n]), bits(stock["bf16"][3][n])) for n in fair["bf16"][3])


@pytest.mark.parametrize("path,monitor", [("zero2", True), ("zero3", False), ("bf16_optimizer", False)])
def test_install_then_uninstall_is_stock_deepspeed(path, monitor, tmp_path):
    """Every wrap install() makes (optimizer, engine, module-global gather) is undone by uninstall():
    training afterwards is stock DeepSpeed, bit for bit."""
    stock = run(2, path=path, export_cast=None, hook=None)[0]
    undone = run(2, path=path, export_cast=SR, uninstall=True, monitor_dir=str(tmp_path) if monitor else None)[0]
    assert undone["restored"] is True and undone["method"] is None
    for step in range(len(stock["bf16"])):
        assert_same(stock["bf16"][step], undone["bf16"][step])
        assert_same(stock["master"][step], undone["master"][step])


@pytest.mark.parametrize("path,ref_optimizer", [("zero2", "BF16_Optimizer"), ("zero3", "DeepSpeedZeRoOffload")])
def test_reference_engine_without_optimizer_is_left_stock(path, ref_optimizer, capfd):
    """A frozen reference model built from a copy of the training config (TRL, OpenRLHF) keeps its
    round-to-nearest bf16 params and no caster; the trained engine next to it is cast as alone;
    rank 0 prints one line for each (visible at DeepSpeed's default log level)."""
    together = run(2, path=path, export_cast=SR, steps=2, reference=True)[0]
    alone = run(2, path=path, export_cast=SR, steps=2)[0]
    ref = together["reference"]
    assert ref["optimizer"] == ref_optimizer and ref["fair"] is False
    stock = {n: p.detach().reshape(-1).to(torch.bfloat16) for n, p in ds_tiny_model().named_parameters()}
    assert_same(ref["bf16"], stock)
    assert together["mismatch"] == 0 and together["method"] == "stochastic"
    assert_same(together["bf16"][-1], alone["bf16"][-1])
    out = capfd.readouterr().out
    assert out.count("Fair Cast: left stock (round-to-nearest) on this engine: no optimizer") == 1, out
    assert out.count("Fair Cast: master->bf16 export cast uses stochastic (seed 7)") == 2, out  # both runs


@pytest.mark.parametrize("path,method", [("zero2", "stochastic"), ("zero2", "error_feedback"), ("zero3", "error_feedback")])
def test_offload_and_reload_states_change_nothing(path, method):
    """``engine.offload_states()`` / ``reload_states()`` between steps (OpenRLHF's colocated mode,
    around every rollout): served bits, masters, residuals and export step as without them."""
    fused = path == "zero3"  # DeepSpeed 0.19.8 offloads ZeRO-3 states only with its FusedAdam
    straight = run(2, path=path, export_cast=METHODS[method], steps=STEPS, fused_adam=True)[0] if fused else \
        trained(2, path, method)[0]
    moved = run(2, path=path, export_cast=METHODS[method], steps=STEPS, offload_states=True, fused_adam=fused)[0]
    assert moved["mismatch"] == 0 and moved["export_step"] == straight["export_step"]
    for k in range(STEPS):
        assert_same(straight["bf16"][k], moved["bf16"][k])
        assert_same(straight["master"][k], moved["master"][k])
        assert_same(straight["residual"][k], moved["residual"][k])


def test_patch_deepspeed_makes_stock_initialize_honour_the_key():
    patched = run(2, export_cast=SR, hook="patch", steps=STEPS)[0]
    assert patched["method"] == "stochastic" and patched["mismatch"] == 0
    assert_same(patched["bf16"][-1], trained(2, "zero2", "stochastic")[0]["bf16"][-1])


@pytest.mark.parametrize("export_cast,match", [
    ({"mode": "fair", "methd": "stochastic"}, r"unknown key\(s\) in export_cast: \['methd'\]"),
    ({"mode": "fiar"}, "export_cast.mode must be one of"),
    ("fair-ish", "export_cast.mode must be one of"),
    ({"mode": "fair", "seed": "7"}, "export_cast.seed must be an int64"),
    (["fair"], "export_cast must be a mode string or a dict"),
])
def test_bad_config_is_an_error_naming_the_key(export_cast, match):
    with pytest.raises(Exception, match=match):
        run(1, export_cast=export_cast, steps=1)


def test_fair_without_bf16_is_an_error():
    with pytest.raises(Exception, match=r'"export_cast": mode "fair" \(or format "fp8"\) needs "bf16": \{"enabled": true\}'):
        run(1, export_cast=SR, steps=1, bf16=False)


@pytest.mark.parametrize("path,world,new_world", [("zero2", 2, 1), ("zero3", 2, 1), ("zero2", 4, 2), ("zero3", 4, 2)])
def test_universal_checkpoint_keeps_residuals_across_dp_sizes(path, world, new_world, tmp_path):
    import os
    from deepspeed_hooks.checkpoint import to_universal
    saved = run(world, path=path, export_cast=EF, steps=3, save_dir=str(tmp_path))[0]
    (tmp_path / "global_step3" / "notes.txt").write_text("a stray file the converter must ignore")
    to_universal(os.path.join(tmp_path, "global_step3"), os.path.join(tmp_path, "universal"))
    assert (tmp_path / "latest_universal").read_text() == "universal"
    resumed = run(new_world, path=path, export_cast=EF, steps=2, load_dir=str(tmp_path), load_tag="universal")[0]
    loaded_bf16, loaded_master, loaded_residual = resumed["start"]
    # each element's master, residual and served value follow it to the new layout, exactly
    assert_same(loaded_master, saved["master"][-1])
    assert_same(loaded_residual, saved["residual"][-1])
    assert_same(loaded_bf16, saved["bf16"][-1])  # not DeepSpeed's re-rounding to nearest
    assert resumed["mismatch"] == 0 and resumed["export_step"] == 5
    if new_world == 1:  # stock ZeRO is bitwise the same at DP 1 and 2: so must the resumed run be
        straight = trained(world, path, "error_feedback")[0]
        for k in range(2):
            assert_same(straight["bf16"][3 + k], resumed["bf16"][k])
            assert_same(straight["master"][3 + k], resumed["master"][k])


def test_universal_conversion_needs_fair_cast_state(tmp_path):
    import os
    from deepspeed_hooks.checkpoint import to_universal
    run(2, export_cast=None, steps=1, save_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not written with Fair Cast"):
        to_universal(os.path.join(tmp_path, "global_step1"), os.path.join(tmp_path, "universal"))


def test_switching_method_on_load(tmp_path, capfd):
    ef_dir, plain_dir, sr_dir = tmp_path / "ef", tmp_path / "plain", tmp_path / "sr"
    saved = run(2, export_cast=EF, steps=3, save_dir=str(ef_dir))[0]
    # error feedback -> stochastic: no state needed, residuals dropped (with a warning)
    sr = run(2, export_cast=SR, steps=2, load_dir=str(ef_dir))[0]
    assert_same(sr["start"][0], saved["bf16"][-1])
    assert all(not r.any() for r in sr["start"][2].values())
    assert sr["mismatch"] == 0 and sr["export_step"] == 5
    # no Fair Cast -> error feedback: the step starts at 0, residuals at zero (with a warning)
    run(2, export_cast=None, steps=3, save_dir=str(plain_dir))
    ef = run(2, export_cast=EF, steps=2, load_dir=str(plain_dir))[0]
    assert all(not r.any() for r in ef["start"][2].values())
    assert ef["mismatch"] == 0 and ef["export_step"] == 2
    # stochastic -> error feedback: the warning names the checkpoint's method
    run(1, export_cast=SR, steps=1, save_dir=str(sr_dir))
    capfd.readouterr()
    run(1, export_cast=EF, steps=1, load_dir=str(sr_dir))
    printed = capfd.readouterr()  # Fair Cast's warning channel (logger "faircast"), shown by a default launch
    assert "Fair Cast: switching from stochastic to error_feedback: residuals start at zero" in printed.out + printed.err


def test_residual_of_another_partitioning_is_an_error_naming_params(tmp_path):
    run(2, export_cast=EF, steps=2, save_dir=str(tmp_path))
    f = tmp_path / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(f, weights_only=False)
    state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["export_cast_residual"] = state["export_cast_residual"][:-3]
    torch.save(sd, f)
    with pytest.raises(Exception, match=r"export_cast_residual has \d+ elements but the partition holding \[.*'5.bias'"):
        run(2, export_cast=EF, steps=1, load_dir=str(tmp_path))


def test_rank_killed_mid_save_leaves_previous_checkpoint_as_latest(tmp_path):
    with pytest.raises(Exception):
        run(2, export_cast=EF, steps=5, save_at=(3,), save_dir=str(tmp_path), crash_on_save=True)
    assert (tmp_path / "latest").read_text() == "global_step3"
    resumed = run(2, export_cast=EF, steps=2, load_dir=str(tmp_path))[0]
    straight = trained(2, "zero2", "error_feedback")[0]
    for k in range(2):
        assert_same(straight["bf16"][3 + k], resumed["bf16"][k])
        assert_same(straight["residual"][3 + k], resumed["residual"][k])


def monitor_series(monitor_dir) -> dict[str, list[float]]:
    """The drift values a run's CSV monitor wrote, by name (``changed_fraction``, ...)."""
    import csv
    series = {}
    for f in (monitor_dir / "fair").glob("*.csv"):
        with open(f) as fh:
            series[f.stem.removeprefix("Train_Samples_export_cast_")] = [float(v) for _, v in list(csv.reader(fh))[1:]]
    return series


def test_drift_telemetry_of_a_resumed_run_is_that_of_the_uninterrupted_run(tmp_path):
    """The first step after a resume counts the change from the served model it loaded."""
    run(2, export_cast=SR, steps=4, save_at=(2,), save_dir=str(tmp_path / "ckpt"), save_final=False,
        monitor_dir=str(tmp_path / "straight"))
    run(2, export_cast=SR, steps=2, load_dir=str(tmp_path / "ckpt"), monitor_dir=str(tmp_path / "resumed"))
    straight, resumed = monitor_series(tmp_path / "straight"), monitor_series(tmp_path / "resumed")
    assert len(straight["changed_fraction"]) == 4 and len(resumed["changed_fraction"]) == 2
    assert all(v > 0 for v in straight["changed_fraction"])  # the first step too: from the initial model
    for name in ("changed_fraction", "gap_ulps"):
        assert resumed[name] == straight[name][2:], name


@pytest.mark.parametrize("path,sample", [("zero2", None), ("zero3", 300), ("stage0", 300)])
def test_drift_telemetry_reaches_deepspeed_csv_monitor(path, sample, tmp_path):
    """The monitor's values equal those of one DriftSample fed the gathered whole model: the
    sample is chosen by global element index, and each element counts once (stage 0: rank 0)."""
    from faircast_dist.telemetry import DriftSample, changed_fraction, reduce_drift, sample_stride
    rank0 = run(2, path=path, export_cast=SR, steps=4, monitor_dir=str(tmp_path), monitor_sample=sample)[0]
    series = monitor_series(tmp_path)
    assert all(len(series[k]) == 4 for k in ("changed_fraction", "lag_steps", "gap_ulps", "export_ms")), series
    assert all(v > 0 for v in series["export_ms"])
    numel = sum(t.numel() for t in rank0["master"][0].values())
    whole = DriftSample(sample_stride(numel, sample or 65536))
    whole.prime([(n, m, rank0["start"][0][n].reshape(-1), [(n, 0, m.numel(), 0)])  # the initial served model
                 for n, m in rank0["master"][0].items()])
    for t in range(4):
        whole.observe([(n, rank0["master"][t][n], rank0["bf16"][t][n].reshape(-1), [(n, 0, m.numel(), 0)])
                       for n, m in rank0["master"][t].items()])
        want = reduce_drift([whole])
        assert series["changed_fraction"][t] == pytest.approx(want["changed_fraction"], rel=1e-9)
        assert series["gap_ulps"][t] == pytest.approx(want["gap_ulps"], rel=1e-9)
        assert series["lag_steps"][t] == want["lag_steps"]
    assert whole.stride > 1 if sample else whole.stride == 1
    if sample is None:  # every element watched: the exact changed fraction
        flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(d)])  # noqa: E731
        served = [rank0["start"][0]] + rank0["bf16"]
        for t in range(4):  # the first from the initial model
            exact = changed_fraction(flat(served[t]), flat(served[t + 1]))
            assert series["changed_fraction"][t] == pytest.approx(exact, rel=1e-6)
    assert all(v == 0 for v in series["lag_steps"])  # SR at lr 1e-3 keeps up


def test_fp8_drift_telemetry_reaches_deepspeed_csv_monitor(tmp_path):
    """With ``format "fp8"`` the monitor also gets the FP8 copy's numbers (``fp8_changed_fraction``, ``fp8_lag_steps``,
    ``fp8_gap_ulps``, ``fp8_rescales``): those of one FP8 DriftSample fed the gathered FP8 model, its scales and
    the masters, from the install-time cast on (ZeRO-2, DP 2, block scales)."""
    from faircast_dist import ExportCastConfig, FairCaster
    from faircast_dist.fp8 import Fp8Export
    from faircast_dist.telemetry import DriftSample, reduce_drift, sample_stride
    config = FP8["dithered_block"]
    rank0 = run(2, path="zero2", export_cast=config, steps=3, monitor_dir=str(tmp_path), monitor_sample=300)[0]
    series = monitor_series(tmp_path)
    assert all(len(series[k]) == 3 for k in ("fp8_changed_fraction", "fp8_lag_steps", "fp8_gap_ulps", "fp8_rescales"))
    snaps = rank0["fp8"]  # the install-time export, then one per step
    shapes = {n: m.shape for n, m in snaps[0]["masters"].items()}
    fp8 = Fp8Export(FairCaster(ExportCastConfig.from_value(config)), shapes)
    whole = DriftSample(sample_stride(sum(m.numel() for m in snaps[0]["masters"].values()), 300), fp8=fp8)
    for t, snap in enumerate(snaps):
        fp8.scales = {n: snap["served"][fp8.scale_name(n)] for n in fp8.shapes}
        whole.observe([(n, snap["masters"][n].reshape(-1), snap["served"][n].view(torch.uint8).reshape(-1),
                        [(n, 0, snap["masters"][n].numel(), 0)]) for n in fp8.shapes])
        if t:
            want = reduce_drift([whole])
            for what in ("changed_fraction", "gap_ulps"):
                assert series[f"fp8_{what}"][t - 1] == pytest.approx(want[what], rel=1e-6), (t, what)
            assert series["fp8_lag_steps"][t - 1] == want["lag_steps"], t
    assert series["fp8_changed_fraction"][0] > 0  # the first step's change from the install-time cast


def test_round_robin_gradients_is_refused():
    with pytest.raises(Exception, match="round_robin_gradients"):
        run(2, export_cast=SR, steps=1, zero_extra={"round_robin_gradients": True})


def test_served_cli_writes_params_once_without_buffers(tmp_path):
    """Tied weights share storage in the saved module; buffers are saved too: the CLI writes
    each trained param once (as served_weights does), in its own storage."""
    from collections import OrderedDict

    from safetensors.torch import load_file

    from deepspeed_hooks.served import main
    emb = torch.randn(7, 3).to(torch.bfloat16)
    module = {"emb.weight": emb, "head.weight": emb, "norm.running_mean": torch.zeros(3),
              "norm.num_batches_tracked": torch.tensor(1001)}
    folder = tmp_path / "ckpt"
    (folder / "global_step1").mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    torch.save({"module": module, "param_shapes": [OrderedDict([("emb.weight", emb.shape)])],
                "buffer_names": ["norm.running_mean", "norm.num_batches_tracked"]},
               folder / "global_step1" / "mp_rank_00_model_states.pt")
    main([str(folder), str(tmp_path / "served.safetensors")])
    written = load_file(tmp_path / "served.safetensors")
    assert list(written) == ["emb.weight"] and torch.equal(written["emb.weight"].view(torch.int16), emb.view(torch.int16))
    # stage 0 saves no param_shapes: the same result from the module and its buffer names
    torch.save({"module": module, "param_shapes": None, "buffer_names": ["norm.running_mean", "norm.num_batches_tracked"]},
               folder / "global_step1" / "mp_rank_00_model_states.pt")
    main([str(folder), str(tmp_path / "served0.safetensors")])
    assert list(load_file(tmp_path / "served0.safetensors")) == ["emb.weight"]


# ---- FP8 served weights (format "fp8") -------------------------------------------------------------------------
FP8 = {"error_feedback": {**EF, "format": "fp8"},
       "dithered_block": {**DITHER, "format": "fp8", "fp8_scales": "block"},
       "nearest_via_bf16": {"mode": "nearest", "format": "fp8", "fp8_via_bf16": True},
       "stochastic_ue8m0": {**SR, "format": "fp8", "fp8_ue8m0": True}}
FP8_LAYOUTS = [("stage0", 1), ("zero2", 1), ("zero1", 2), ("bf16_optimizer", 2), ("zero3", 2), ("offload2", 2),
               ("zero2", 4), ("zero3", 4)]


@functools.lru_cache(maxsize=None)
def fp8_trained(world_size, path, name):
    return run(world_size, path=path, export_cast=FP8[name], steps=STEPS)


@pytest.mark.parametrize("path,world", FP8_LAYOUTS)
@pytest.mark.parametrize("name", ["error_feedback", "dithered_block"])
def test_fp8_served_weights_are_the_single_process_reference(path, world, name):
    """At install and after every step, on every path and DP size: the FP8 weights and scales served_weights
    yields are the spec cast of the gathered masters on whole params (sticky scales; error feedback's FP8
    residual carried), the same on every rank; the bf16 model is still the bf16 Fair Cast of the masters."""
    from helpers import reference_fp8
    records = fp8_trained(world, path, name)
    snaps = records[0]["fp8"]
    scale = "weight_scale_inv" if name == "dithered_block" else "weight_scale"
    assert len(snaps) == STEPS + 1  # the Linear weights: FP8; the LayerNorm and biases: bf16
    assert list(snaps[0]["served"]) == [n for i in (0, 3, 5) for n in (f"{i}.weight", f"{i}.{scale}")]
    for k, (snap, ref) in enumerate(zip(snaps, reference_fp8(FP8[name], snaps))):
        assert_same(snap["served"], ref)
        for other in records[1:]:
            assert_same(other["fp8"][k]["served"], ref)
    assert all(r["mismatch"] == 0 for r in records)


@pytest.mark.parametrize("name", ["nearest_via_bf16", "stochastic_ue8m0"])
def test_fp8_other_casts_dp1_equals_dp2_and_the_reference(name):
    from helpers import reference_fp8
    one, two = fp8_trained(1, "zero2", name)[0], fp8_trained(2, "zero1", name)[0]
    for a, b, ref in zip(one["fp8"], two["fp8"], reference_fp8(FP8[name], one["fp8"])):
        assert_same(a["served"], ref)
        assert_same(b["served"], ref)


MOE_LAYOUTS = [("zero2", 1), ("zero1", 2), ("zero3", 2)]


@pytest.mark.parametrize("name", ["error_feedback", "dithered_block"])
def test_fp8_fused_experts_are_the_per_expert_reference_at_every_layout(name):
    """A real transformers 5 Qwen3-MoE (fused experts ``gate_up_proj`` [4, 80, 48], ``down_proj`` [4, 48, 40]) with
    ``format "fp8"`` at ZeRO-2 DP 1, ZeRO-1 DP 2 and ZeRO-3 DP 2: the experts are served FP8 with scales beside them
    (``gate_up_proj_scale``; blocks: ``_scale_inv``), at install and after each step the single-process export of
    the gathered masters; their scales (and error feedback's bytes) are those of each expert's checkpoint tensors
    (``experts.e.gate_proj.weight``, ...) cast on their own, as are the attention weights'. The router, embeddings
    and norms stay bf16. Before: the experts were served bf16."""
    from helpers import expert_checkpoint, reference_fp8, single_process_fp8, tiny_moe
    suffix = "_scale_inv" if name == "dithered_block" else "_scale"
    for path, world in MOE_LAYOUTS:
        snaps = run(world, path=path, export_cast=FP8[name], steps=2, moe=True)[0]["fp8"]
        served = snaps[-1]["served"]
        assert {n for n in served if "experts" in n} == {f"model.layers.0.mlp.experts.{p}{s}" for p in (
            "gate_up_proj", "down_proj") for s in ("", suffix)}, path
        assert not any("gate.weight" in n or "embed" in n or "norm" in n for n in served), sorted(served)
        for snap, want in zip(snaps, single_process_fp8(FP8[name], tiny_moe(), snaps)):
            assert_same(snap["served"], want)
        per_expert = [{**snap, "masters": expert_checkpoint(snap["masters"])} for snap in snaps]
        for snap, ref in zip(snaps, reference_fp8(FP8[name], per_expert)):
            got = expert_checkpoint(snap["served"])
            assert got.keys() == ref.keys()
            for t in got:
                if name == "error_feedback" or "scale" in t:  # dithered bits: keyed on the fused param's indices
                    assert torch.equal(bits(got[t]), bits(ref[t])), (path, t, snap["step"])


def test_fp8_deltas_rebuild_the_served_model():
    """served_deltas with FP8: FP8 bits, scales and bf16 params, each step's deltas turning the previous served
    model into this step's, bit for bit."""
    rec = fp8_trained(2, "zero2", "error_feedback")[0]
    receiver = {n: torch.zeros_like(t) for n, t in rec["served_api"].items()}
    apply_deltas(receiver, rec["deltas"][0])
    for k, deltas in enumerate(rec["deltas"][1:]):
        apply_deltas(receiver, deltas)
        want = {**rec["bf16"][k], **{n: t.reshape(-1) for n, t in rec["fp8"][k + 1]["served"].items()}}
        assert_same({n: receiver[n] for n in want}, want)
    assert sum(len(i) for _, i, _ in rec["deltas"][-1]) < sum(t.numel() for t in receiver.values())


@pytest.mark.parametrize("path", ["zero2", "zero3", "stage0"])
def test_fp8_resume_equals_uninterrupted(path, tmp_path):
    """Save after step 3, load into a new run: the FP8 bits, scales and residuals come back, and steps 4-5 serve
    what the uninterrupted run served."""
    straight = fp8_trained(2, path, "error_feedback")[0]
    run(2, path=path, export_cast=FP8["error_feedback"], steps=3, save_dir=str(tmp_path))
    resumed = run(2, path=path, export_cast=FP8["error_feedback"], steps=2, load_dir=str(tmp_path))[0]
    for k in range(3):
        assert_same(resumed["fp8"][k]["served"], straight["fp8"][3 + k]["served"])


@pytest.mark.parametrize("path", ["zero2", "zero3"])
def test_fp8_universal_checkpoint_keeps_bits_scales_and_residuals(path, tmp_path, capfd):
    """FP8 error feedback saved at DP 2 after step 3, converted with ``deepspeed_hooks.checkpoint`` and loaded at DP 1:
    the FP8 bits, sticky scales and FP8 residuals come back (not set afresh, no warning), so the load and steps 4-5
    serve what the uninterrupted DP 2 run served (stock ZeRO is bitwise the same at DP 1 and 2)."""
    import os
    from deepspeed_hooks.checkpoint import to_universal
    straight = fp8_trained(2, path, "error_feedback")[0]
    run(2, path=path, export_cast=FP8["error_feedback"], steps=3, save_dir=str(tmp_path))
    to_universal(os.path.join(tmp_path, "global_step3"), os.path.join(tmp_path, "universal"))
    capfd.readouterr()
    resumed = run(1, path=path, export_cast=FP8["error_feedback"], steps=2, load_dir=str(tmp_path),
                  load_tag="universal")[0]
    printed = capfd.readouterr()
    assert "no FP8 export state" not in printed.out + printed.err
    for k in range(3):
        assert_same(resumed["fp8"][k]["served"], straight["fp8"][3 + k]["served"])


def test_fp8_from_a_bf16_checkpoint_warns_and_casts_fresh(tmp_path, capfd):
    from helpers import reference_fp8
    run(2, export_cast=EF, steps=3, save_dir=str(tmp_path))
    capfd.readouterr()
    rec = run(2, export_cast=FP8["error_feedback"], steps=1, load_dir=str(tmp_path))[0]
    printed = capfd.readouterr()
    assert "the checkpoint has no FP8 export state: FP8 scales are set afresh" in printed.out + printed.err
    for snap, ref in zip(rec["fp8"], reference_fp8(FP8["error_feedback"], rec["fp8"])):
        assert_same(snap["served"], ref)


def test_fp8_module_only_load_casts_the_loaded_masters_afresh(tmp_path):
    """load_module_only: the masters become the loaded bf16 model; the FP8 copy is cast from them with scales set
    afresh (not left serving the untrained model's FP8)."""
    from helpers import reference_fp8
    run(2, export_cast=FP8["nearest_via_bf16"], steps=3, save_dir=str(tmp_path))
    rec = run(2, export_cast=FP8["nearest_via_bf16"], steps=1, load_dir=str(tmp_path), module_only=True)[0]
    for snap, ref in zip(rec["fp8"], reference_fp8(FP8["nearest_via_bf16"], rec["fp8"])):
        assert_same(snap["served"], ref)


@pytest.mark.parametrize("export_cast", [FP8["error_feedback"], EF], ids=["fp8", "bf16"])
def test_a_checkpoint_saved_before_the_first_step_trains_and_resumes(export_cast, tmp_path):
    """Saving before the first step wrote Fair Cast entries into the base optimizer's empty state, so AdamW never
    created its own (KeyError 'exp_avg' at the next step, 'step' after a load): nothing is written then."""
    saved = run(2, export_cast=export_cast, steps=2, save_dir=str(tmp_path), save_at=(0,), save_final=False)[0]
    assert saved["mismatch"] == 0
    resumed = run(2, export_cast=export_cast, steps=2, load_dir=str(tmp_path))[0]
    assert resumed["mismatch"] == 0
    for k in range(2):
        assert_same(resumed["bf16"][k], saved["bf16"][k])
        if "fp8" in saved:
            assert_same(resumed["fp8"][k + 1]["served"], saved["fp8"][k + 1]["served"])
