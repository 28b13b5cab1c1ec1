"""DeepSpeed with ``"export_cast"``: real gloo runs (1-4 ranks) of a tiny model on every bf16
optimizer path. The reference for every check is the single-process cast of the gathered state.

A DeepSpeed launch costs its start-up (~8 s on 2 cores), a job in it little more than its engine: the jobs the tests
read are declared here (:func:`job`) and run in one launch per world size (:func:`result`), saves before the loads
that read them; a launch of its own is kept for what must fail, kill its process, or be edited between two jobs.
"""
import functools
import os
import tempfile

import pytest
import torch

from ds_worker import PATHS, preset_state, run, run_jobs
from ds_worker import tiny_model as ds_tiny_model
from faircast_dist import ExportCastConfig, FairCaster
from helpers import bits
from faircast_dist.delta import apply_deltas

SR = {"mode": "fair", "method": "stochastic", "seed": 7}
EF = {"mode": "fair", "method": "error_feedback"}
DITHER = {"mode": "fair", "method": "dithered", "seed": 7}
METHODS = {"stochastic": SR, "error_feedback": EF, "dithered": DITHER}
STEPS = 5
FP8 = {"error_feedback": {**EF, "format": "fp8"},
       "dithered_block": {**DITHER, "format": "fp8", "fp8_scales": "block"},
       "nearest_via_bf16": {"mode": "nearest", "format": "fp8", "fp8_via_bf16": True},
       # the stacks' quantizers (faircast_dist.fp8.PRESETS)
       "verl_stochastic": {"mode": "fair", "method": "stochastic", "seed": 7, "format": "fp8", "fp8_rule": "verl"},
       "vllm_channel_ef": {**EF, "format": "fp8", "fp8_rule": "vllm-fp8-per-channel"}}

_CKPT = tempfile.TemporaryDirectory(prefix="faircast-deepspeed-")
JOBS: dict[int, dict] = {1: {}, 2: {}, 4: {}}  # world size -> {key: (phase, job)}


def ckpt(*name) -> str:
    """A checkpoint folder of the module's launches (one per name)."""
    return os.path.join(_CKPT.name, "-".join(map(str, name)))


def job(world: int, key: tuple, phase: int = 1, **options) -> None:
    """Declare a job (:func:`ds_worker.options`) of the world's launch; phases run in order (0: MoE, whose transformers
    import must come before DeepSpeed's; 1: trainings and saves; 2: the loads of those saves)."""
    JOBS[world][key] = (phase, options)


@functools.lru_cache(maxsize=None)
def launched(world: int) -> dict:
    keys = sorted(JOBS[world], key=lambda k: JOBS[world][k][0])
    return dict(zip(keys, run_jobs(world, [JOBS[world][k][1] for k in keys])))


def result(world: int, key: tuple) -> list[dict]:
    """Each rank's record of a declared job."""
    return launched(world)[key]


def trained(world_size, path, method):
    return result(world_size, ("train", path, method))


for _path in PATHS:
    for _method in METHODS:
        job(2, ("train", _path, _method), path=_path, export_cast=METHODS[_method], steps=STEPS)
for _method in METHODS:
    job(1, ("train", "zero2", _method), path="zero2", export_cast=METHODS[_method], steps=STEPS)


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


for _path, _world in LAYOUTS:
    job(_world, ("preset", _path), path=_path, export_cast=SR, steps=0, lr=0.0, preset=tuple(METHODS.values()))


def preset_exports(path, world):
    return result(world, ("preset", path))[0]["preset"]


@pytest.mark.parametrize("method", METHODS)
def test_layout_invariance_one_state_many_layouts(method):
    """One training state (masters, residuals, step) loaded into stage 0/1/2/3, BF16_Optimizer and
    DP 1/2/4 exports bitwise the same bf16 model — the single-process reference — twice in a row
    (one launch per layout exports it with every method)."""
    exports = {layout: preset_exports(*layout)[method] for layout in LAYOUTS}
    numel = {n: t.numel() for n, t in exports[LAYOUTS[0]][0].items()}
    master, residual = preset_state(numel)
    ref = FairCaster(METHODS[method])
    ref.step = 2  # the state is set at export step 1: its two exports are steps 2 and 3
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


for _path, _method in RESUME:
    job(2, ("save", _path, _method), path=_path, export_cast=METHODS[_method], steps=3, save_dir=ckpt(_path, _method))
    job(2, ("resume", _path, _method), phase=2, path=_path, export_cast=METHODS[_method], steps=2,
        load_dir=ckpt(_path, _method))


@pytest.mark.parametrize("path,method", RESUME)
def test_resume_equals_uninterrupted(path, method):
    from deepspeed_hooks.served import read_checkpoint
    straight = trained(2, path, method)[0]
    first = result(2, ("save", path, method))[0]
    # the CLI's reader gives back exactly the bf16 model served when the checkpoint was written
    assert_same({n: t.reshape(-1) for n, t in read_checkpoint(ckpt(path, method)).items()}, first["bf16"][-1])
    resumed = result(2, ("resume", path, method))[0]
    assert resumed["mismatch"] == 0 and resumed["export_step"] == STEPS
    for k in range(2):
        assert_same(straight["bf16"][3 + k], resumed["bf16"][k])
        assert_same(straight["master"][3 + k], resumed["master"][k])
        assert_same(straight["residual"][3 + k], resumed["residual"][k])


job(2, ("stock", "zero2"), export_cast=None, hook=None)
job(2, ("nearest",), export_cast={"mode": "nearest", "method": "error_feedback"})
job(2, ("no config",), export_cast=None)


def test_off_is_stock_deepspeed():
    stock = result(2, ("stock", "zero2"))[0]
    assert_deltas_rebuild(stock)  # delta export of a stock (round-to-nearest) engine
    assert stock["master_copies"] == 4  # one stock copy per step (one param group): the probe sees it
    for variant in (result(2, ("nearest",))[0], result(2, ("no config",))[0]):
        assert variant["method"] is None
        for step in range(len(stock["bf16"])):
            assert_same(stock["bf16"][step], variant["bf16"][step])
            assert_same(stock["master"][step], variant["master"][step])
    fair = trained(2, "zero2", "stochastic")[0]
    assert any(not torch.equal(bits(fair["bf16"][3][n]), bits(stock["bf16"][3][n])) for n in fair["bf16"][3])


UNINSTALLED = [("zero2", True), ("zero3", False), ("bf16_optimizer", False)]
for _path, _monitor in UNINSTALLED:
    job(2, ("stock", _path), path=_path, export_cast=None, hook=None)
    job(2, ("uninstalled", _path), path=_path, export_cast=SR, uninstall=True,
        monitor_dir=ckpt("uninstalled monitor", _path) if _monitor else None)


@pytest.mark.parametrize("path,monitor", UNINSTALLED)
def test_install_then_uninstall_is_stock_deepspeed(path, monitor):
    """Every wrap install() makes (optimizer, engine, module-global gather) is undone by uninstall():
    training afterwards is stock DeepSpeed, bit for bit."""
    stock = result(2, ("stock", path))[0]
    undone = result(2, ("uninstalled", path))[0]
    assert undone["restored"] is True and undone["method"] is None
    for step in range(len(stock["bf16"])):
        assert_same(stock["bf16"][step], undone["bf16"][step])
        assert_same(stock["master"][step], undone["master"][step])


@pytest.mark.parametrize("path,ref_optimizer", [("zero2", "BF16_Optimizer"), ("zero3", "DeepSpeedZeRoOffload")])
def test_reference_engine_without_optimizer_is_left_stock(path, ref_optimizer, capfd):
    """A frozen reference model built from a copy of the training config (TRL, OpenRLHF) keeps its
    round-to-nearest bf16 params and no caster; the trained engine next to it is cast as alone;
    rank 0 prints one line for each (visible at DeepSpeed's default log level)."""
    together, alone = (r[0] for r in run_jobs(2, [dict(path=path, export_cast=SR, steps=2, reference=True),
                                                    dict(path=path, export_cast=SR, steps=2)]))
    ref = together["reference"]
    assert ref["optimizer"] == ref_optimizer and ref["fair"] is False
    stock = {n: p.detach().reshape(-1).to(torch.bfloat16) for n, p in ds_tiny_model().named_parameters()}
    assert_same(ref["bf16"], stock)
    assert together["mismatch"] == 0 and together["method"] == "stochastic"
    assert_same(together["bf16"][-1], alone["bf16"][-1])
    out = capfd.readouterr().out
    assert out.count("Fair Cast: left stock (round-to-nearest) on this engine: no optimizer") == 1, out
    assert out.count("Fair Cast: master->bf16 export cast uses stochastic (seed 7)") == 2, out  # both runs


OFFLOADED = [("zero2", "stochastic"), ("zero2", "error_feedback"), ("zero3", "error_feedback")]
for _path, _method in OFFLOADED:
    _fused = _path == "zero3"  # DeepSpeed 0.19.8 offloads ZeRO-3 states only with its FusedAdam
    if _fused:
        job(2, ("fused", _path, _method), path=_path, export_cast=METHODS[_method], steps=STEPS, fused_adam=True)
    job(2, ("offloaded", _path, _method), path=_path, export_cast=METHODS[_method], steps=STEPS, offload_states=True,
        fused_adam=_fused)


@pytest.mark.parametrize("path,method", OFFLOADED)
def test_offload_and_reload_states_change_nothing(path, method):
    """``engine.offload_states()`` / ``reload_states()`` between steps (OpenRLHF's colocated mode,
    around every rollout): served bits, masters, residuals and export step as without them."""
    straight = result(2, ("fused", path, method) if path == "zero3" else ("train", path, method))[0]
    moved = result(2, ("offloaded", path, method))[0]
    assert moved["mismatch"] == 0 and moved["export_step"] == straight["export_step"]
    for k in range(STEPS):
        assert_same(straight["bf16"][k], moved["bf16"][k])
        assert_same(straight["master"][k], moved["master"][k])
        assert_same(straight["residual"][k], moved["residual"][k])


job(2, ("patched",), export_cast=SR, hook="patch", steps=STEPS)


def test_patch_deepspeed_makes_stock_initialize_honour_the_key():
    patched = result(2, ("patched",))[0]
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


UNIVERSAL = [("zero2", 2, 1, "bf16"), ("zero3", 2, 1, "bf16"), ("zero2", 4, 2, "bf16"), ("zero3", 4, 2, "bf16"),
             ("zero2", 2, 1, "fp8"), ("zero3", 2, 1, "fp8")]  # path, saved at DP, loaded at DP, format
for _path, _world, _, _format in UNIVERSAL:
    job(_world, ("universal", _path, _format), path=_path, export_cast=EF if _format == "bf16" else FP8["error_feedback"],
        steps=3, save_dir=ckpt("universal", _path, _world, _format))


@functools.lru_cache(maxsize=None)
def universal(new_world: int) -> dict:
    """Every save of :data:`UNIVERSAL` loaded at DP ``new_world`` as a universal checkpoint (converted with
    ``python -m deepspeed_hooks.checkpoint``'s function, a stray file beside the rank files), in one launch:
    ``{(path, format): each rank's record}``."""
    from deepspeed_hooks.checkpoint import to_universal
    cases = [(path, world, fmt) for path, world, new, fmt in UNIVERSAL if new == new_world]
    for path, world, fmt in cases:
        result(world, ("universal", path, fmt))
        folder = ckpt("universal", path, world, fmt)
        with open(os.path.join(folder, "global_step3", "notes.txt"), "w") as f:
            f.write("a stray file the converter must ignore")
        to_universal(os.path.join(folder, "global_step3"), os.path.join(folder, "universal"))
        with open(os.path.join(folder, "latest_universal")) as f:
            assert f.read() == "universal"
    loads = [dict(path=path, export_cast=EF if fmt == "bf16" else FP8["error_feedback"], steps=2,
                  load_dir=ckpt("universal", path, world, fmt), load_tag="universal") for path, world, fmt in cases]
    return {(path, fmt): records for (path, _, fmt), records in zip(cases, run_jobs(new_world, loads))}


@pytest.mark.parametrize("path,world,new_world", [u[:3] for u in UNIVERSAL if u[3] == "bf16"])
def test_universal_checkpoint_keeps_residuals_across_dp_sizes(path, world, new_world):
    saved = result(world, ("universal", path, "bf16"))[0]
    resumed = universal(new_world)[(path, "bf16")][0]
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


job(2, ("stock save",), export_cast=None, steps=1, save_dir=ckpt("stock"))


def test_universal_conversion_needs_fair_cast_state(tmp_path):
    from deepspeed_hooks.checkpoint import to_universal
    result(2, ("stock save",))
    with pytest.raises(ValueError, match="not written with Fair Cast"):
        to_universal(os.path.join(ckpt("stock"), "global_step1"), os.path.join(tmp_path, "universal"))


job(2, ("switch", "ef save"), export_cast=EF, steps=3, save_dir=ckpt("switch", "ef"))
job(2, ("switch", "sr load"), phase=2, export_cast=SR, steps=2, load_dir=ckpt("switch", "ef"))
job(2, ("switch", "stock save"), export_cast=None, steps=3, save_dir=ckpt("switch", "stock"))
job(2, ("switch", "ef load"), phase=2, export_cast=EF, steps=2, load_dir=ckpt("switch", "stock"))
job(1, ("switch", "sr save"), export_cast=SR, steps=1, save_dir=ckpt("switch", "sr"))
job(1, ("switch", "ef load"), phase=2, export_cast=EF, steps=1, load_dir=ckpt("switch", "sr"))


def test_switching_method_on_load():
    saved = result(2, ("switch", "ef save"))[0]
    # error feedback -> stochastic: no state needed, residuals dropped (with a warning)
    sr = result(2, ("switch", "sr load"))[0]
    assert_same(sr["start"][0], saved["bf16"][-1])
    assert all(not r.any() for r in sr["start"][2].values())
    assert sr["mismatch"] == 0 and sr["export_step"] == 5
    assert sr["warnings"] == ["Fair Cast: the checkpoint has error-feedback residuals but the method is now "
                              "stochastic: dropping them"]
    # no Fair Cast -> error feedback: the step starts at 0, residuals at zero (with a warning)
    ef = result(2, ("switch", "ef load"))[0]
    assert all(not r.any() for r in ef["start"][2].values())
    assert ef["mismatch"] == 0 and ef["export_step"] == 2
    # stochastic -> error feedback: the warning names the checkpoint's method
    warned = result(1, ("switch", "ef load"))[0]["warnings"]  # Fair Cast's channel, "faircast"
    assert warned == ["Fair Cast: switching from stochastic to error_feedback: residuals start at zero"]


job(2, ("to damage",), export_cast=EF, steps=2, save_dir=ckpt("damaged"))


def test_residual_of_another_partitioning_is_an_error_naming_params():
    import pathlib
    result(2, ("to damage",))
    f = pathlib.Path(ckpt("damaged")) / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(f, weights_only=False)
    state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["export_cast_residual"] = state["export_cast_residual"][:-3]
    torch.save(sd, f)
    with pytest.raises(Exception, match=r"export_cast_residual has \d+ elements but the partition holding \[.*'5.bias'"):
        run(2, export_cast=EF, steps=1, load_dir=ckpt("damaged"))


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


job(2, ("monitored", "straight"), export_cast=SR, steps=4, save_at=(2,), save_dir=ckpt("monitored"), save_final=False,
    monitor_dir=ckpt("monitor", "straight"))
job(2, ("monitored", "resumed"), phase=2, export_cast=SR, steps=2, load_dir=ckpt("monitored"),
    monitor_dir=ckpt("monitor", "resumed"))


def test_drift_telemetry_of_a_resumed_run_is_that_of_the_uninterrupted_run():
    """The first step after a resume counts the change from the served model it loaded."""
    import pathlib
    result(2, ("monitored", "resumed"))
    straight, resumed = (monitor_series(pathlib.Path(ckpt("monitor", w))) for w in ("straight", "resumed"))
    assert len(straight["changed_fraction"]) == 4 and len(resumed["changed_fraction"]) == 2
    assert all(v > 0 for v in straight["changed_fraction"])  # the first step too: from the initial model
    for name in ("changed_fraction", "gap_ulps"):
        assert resumed[name] == straight[name][2:], name


MONITORED = [("zero2", None), ("zero3", 300), ("stage0", 300)]
for _path, _sample in MONITORED:
    job(2, ("monitor", _path), path=_path, export_cast=SR, steps=4, monitor_dir=ckpt("monitor", _path),
        monitor_sample=_sample)


@pytest.mark.parametrize("path,sample", MONITORED)
def test_drift_telemetry_reaches_deepspeed_csv_monitor(path, sample):
    """The monitor's values equal those of one DriftSample fed the gathered whole model: the
    sample is chosen by global element index, and each element counts once (stage 0: rank 0)."""
    import pathlib
    from faircast_dist.telemetry import DriftSample, changed_fraction, reduce_drift, sample_stride
    rank0 = result(2, ("monitor", path))[0]
    series = monitor_series(pathlib.Path(ckpt("monitor", path)))
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


job(2, ("fp8 monitor",), path="zero2", export_cast=FP8["dithered_block"], steps=3, monitor_dir=ckpt("fp8 monitor"),
    monitor_sample=300)


def test_fp8_drift_telemetry_reaches_deepspeed_csv_monitor():
    """With ``format "fp8"`` the monitor also gets the FP8 copy's numbers (``fp8_changed_fraction``, ``fp8_lag_steps``,
    ``fp8_gap_ulps``, ``fp8_rescales``): those of one FP8 DriftSample fed the gathered FP8 model, its scales and
    the masters, from the install-time cast on (ZeRO-2, DP 2, block scales)."""
    from faircast_dist import FairCaster
    from faircast_dist.fp8 import Fp8Export
    from faircast_dist.telemetry import DriftSample, reduce_drift, sample_stride
    import pathlib
    config = FP8["dithered_block"]
    rank0 = result(2, ("fp8 monitor",))[0]
    series = monitor_series(pathlib.Path(ckpt("fp8 monitor")))
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


# ---- FP8 served weights (format "fp8"): the contract every adapter keeps is tests/test_contract.py's (ZeRO-3, DP 2);
# here, every other DeepSpeed path and DP size
FP8_LAYOUTS = [("stage0", 1, "error_feedback"), ("zero2", 1, "dithered_block"), ("zero1", 2, "error_feedback"),
               ("bf16_optimizer", 2, "dithered_block"), ("offload2", 2, "error_feedback"),
               ("zero2", 4, "dithered_block"), ("zero3", 4, "error_feedback"), ("zero2", 2, "error_feedback"),
               ("stage0", 2, "error_feedback"), ("zero3", 2, "error_feedback"), ("zero1", 2, "verl_stochastic"),
               ("zero2", 2, "vllm_channel_ef")]
for _path, _world, _name in FP8_LAYOUTS:
    job(_world, ("fp8", _path, _name), path=_path, export_cast=FP8[_name], steps=STEPS)


def fp8_trained(world_size, path, name):
    return result(world_size, ("fp8", path, name))


@pytest.mark.parametrize("path,world,name", FP8_LAYOUTS)
def test_fp8_served_weights_are_the_single_process_reference(path, world, name):
    """At install and after every step, on every path and DP size (channel or block scales): the FP8 weights and
    scales served_weights yields are the spec cast of the gathered masters on whole params (sticky scales; error
    feedback's FP8 residual carried), the same on every rank; the bf16 model is still the bf16 Fair Cast of the
    masters."""
    from helpers import reference_fp8
    records = fp8_trained(world, path, name)
    snaps = records[0]["fp8"]
    scale = ExportCastConfig.from_value(FP8[name]).scale_rule.scale_name
    assert len(snaps) == STEPS + 1  # the Linear weights: FP8; the LayerNorm and biases: bf16
    assert list(snaps[0]["served"]) == [n for i in (0, 3, 5) for n in (f"{i}.weight", f"{i}.{scale}")]
    for k, (snap, ref) in enumerate(zip(snaps, reference_fp8(FP8[name], snaps))):
        assert_same(snap["served"], ref)
        for other in records[1:]:
            assert_same(other["fp8"][k]["served"], ref)
    assert all(r["mismatch"] == 0 for r in records)


MOE_LAYOUTS = [("zero2", 1), ("zero1", 2), ("zero3", 2)]
for _path, _world in MOE_LAYOUTS:
    for _name in ("error_feedback", "dithered_block"):
        job(_world, ("moe", _path, _name), phase=0, path=_path, export_cast=FP8[_name], steps=2, moe=True)


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
        snaps = result(world, ("moe", path, name))[0]["fp8"]
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


for _path in ("zero2", "stage0"):
    job(2, ("fp8 save", _path), path=_path, export_cast=FP8["error_feedback"], steps=3, save_dir=ckpt("fp8", _path))
    job(2, ("fp8 resume", _path), phase=2, path=_path, export_cast=FP8["error_feedback"], steps=2,
        load_dir=ckpt("fp8", _path))


@pytest.mark.parametrize("path", ["zero2", "stage0"])
def test_fp8_resume_equals_uninterrupted(path):
    """Save after step 3, load into a new run: the FP8 bits, scales and residuals come back, and steps 4-5 serve
    what the uninterrupted run served."""
    straight = fp8_trained(2, path, "error_feedback")[0]
    resumed = result(2, ("fp8 resume", path))[0]
    for k in range(3):
        assert_same(resumed["fp8"][k]["served"], straight["fp8"][3 + k]["served"])


@pytest.mark.parametrize("path", ["zero2", "zero3"])
def test_fp8_universal_checkpoint_keeps_bits_scales_and_residuals(path):
    """FP8 error feedback saved at DP 2 after step 3, converted with ``deepspeed_hooks.checkpoint`` and loaded at DP 1:
    the FP8 bits, sticky scales and FP8 residuals come back (not set afresh, no warning), so the load and steps 4-5
    serve what the uninterrupted DP 2 run served (stock ZeRO is bitwise the same at DP 1 and 2)."""
    straight = fp8_trained(2, path, "error_feedback")[0]
    resumed = universal(1)[(path, "fp8")][0]
    assert resumed["warnings"] == []
    for k in range(3):
        assert_same(resumed["fp8"][k]["served"], straight["fp8"][3 + k]["served"])


job(2, ("module save",), export_cast=FP8["nearest_via_bf16"], steps=3, save_dir=ckpt("module"))
job(2, ("module only",), phase=2, export_cast=FP8["nearest_via_bf16"], steps=1, load_dir=ckpt("module"),
    module_only=True)


def test_fp8_module_only_load_casts_the_loaded_masters_afresh():
    """load_module_only: the masters become the loaded bf16 model; the FP8 copy is cast from them with scales set
    afresh (not left serving the untrained model's FP8)."""
    from helpers import reference_fp8
    rec = result(2, ("module only",))[0]
    for snap, ref in zip(rec["fp8"], reference_fp8(FP8["nearest_via_bf16"], rec["fp8"])):
        assert_same(snap["served"], ref)


EARLY = {"fp8": FP8["error_feedback"], "bf16": EF}
for _name, _config in EARLY.items():
    job(2, ("early save", _name), export_cast=_config, steps=2, save_dir=ckpt("early", _name), save_at=(0,),
        save_final=False)
    job(2, ("early resume", _name), phase=2, export_cast=_config, steps=2, load_dir=ckpt("early", _name))


@pytest.mark.parametrize("name", EARLY)
def test_a_checkpoint_saved_before_the_first_step_trains_and_resumes(name):
    """Saving before the first step wrote Fair Cast entries into the base optimizer's empty state, so AdamW never
    created its own (KeyError 'exp_avg' at the next step, 'step' after a load): nothing is written then."""
    saved = result(2, ("early save", name))[0]
    assert saved["mismatch"] == 0
    resumed = result(2, ("early resume", name))[0]
    assert resumed["mismatch"] == 0
    for k in range(2):
        assert_same(resumed["bf16"][k], saved["bf16"][k])
        if "fp8" in saved:
            assert_same(resumed["fp8"][k + 1]["served"], saved["fp8"][k + 1]["served"])
