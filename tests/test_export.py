"""The export core every adapter shares (faircast_dist.export.ExportState), single process: the export, its step,
replay, and the checkpoint rules (snapshot / restore / restart) every adapter applies through it."""
import itertools
import logging

import pytest
import torch

from faircast_dist import FairCaster, Method
from faircast_dist.export import ExportSnapshot, ExportState, Fp8Restore, Residuals, Shard, residual_rule
from helpers import bits

CONFIGS = {m: {"mode": "nearest" if m == "nearest" else "fair", "method": "stochastic" if m == "nearest" else m,
               "seed": 11} for m in (m.value for m in Method)}
FP8 = {m: {**c, "format": "fp8"} for m, c in CONFIGS.items()}
SHAPES = {"w.weight": (6, 5), "b": (9,)}


def shards(masters: dict, outs: dict, start: int = 0):
    """One shard per tensor: a rank's elements [start, start + numel) of each flattened param."""
    return [Shard(n, m.view(-1), outs[n].view(-1), [(n, 0, m.numel(), start)]) for n, m in masters.items()]


def masters_at(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"w.weight": torch.randn(6, 5, generator=g), "b": torch.randn(9, generator=g)}


def outs_like(masters: dict) -> dict:
    return {n: torch.empty(m.shape, dtype=torch.bfloat16) for n, m in masters.items()}


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "faircast"]


@pytest.mark.parametrize("method", list(CONFIGS))
def test_export_k_draws_step_k_and_is_the_callers_reference_cast(method):
    """One fused call over the shards gives FairCaster.cast's bits per param at the export step; the export after
    the k-th step is step k (its key), so no two exports share a key; error feedback's residuals are keyed by shard
    (created at the first export)."""
    state, ref = ExportState(CONFIGS[method]), FairCaster(CONFIGS[method])
    residuals = {n: ref.new_residual(m) for n, m in masters_at(0).items()}
    for k in range(1, 4):
        masters = masters_at(k)
        outs = outs_like(masters)
        state.export(shards(masters, outs, start=3))
        ref.advance()
        assert state.step == ref.step == k
        for n, m in masters.items():
            assert torch.equal(bits(outs[n]), bits(ref.cast(n, m, index=3, residual=residuals[n]))), (k, n)
    assert sorted(state.residuals) == (["b", "w.weight"] if method == "error_feedback" else [])


def test_the_install_time_export_and_the_first_steps_draw_different_bits():
    """The export of the initial masters (no step: FP8 at install) draws step 0's key, the first step's export
    step 1's: unchanged masters get fresh stochastic-rounding bits (the bug: both drew step 0's)."""
    state = ExportState(FP8["stochastic"], shapes=SHAPES)
    masters = {"w.weight": torch.randn(6, 5) * 1.7, "b": torch.randn(9)}
    pieces = shards(masters, outs_like(masters))
    state.export_fp8(pieces)
    install = {n: t.clone() for n, t in state.full_fp8(pieces).items()}
    state.export(pieces)
    assert state.step == 1
    assert not torch.equal(bits(install["w.weight"]), bits(state.full_fp8(pieces)["w.weight"]))


@pytest.mark.parametrize("method", list(CONFIGS))
def test_replay_writes_the_last_export_again_without_advancing(method):
    """What a framework's copy outside a step gets: the last export, bit for bit (error feedback from the served
    copy it keeps); before the first step's export, the export of step 0 (the masters themselves, on the bf16 grid
    as frameworks build them from the model)."""
    state = ExportState(CONFIGS[method])
    masters = {n: m.to(torch.bfloat16).float() for n, m in masters_at(0).items()}
    outs = {n: torch.full(m.shape, 7.0, dtype=torch.bfloat16) for n, m in masters.items()}
    if method == "error_feedback":
        state.keep_served(shards(masters, {n: m.to(torch.bfloat16) for n, m in masters.items()}))
    state.replay(shards(masters, outs))
    assert all(torch.equal(outs[n], masters[n].to(torch.bfloat16)) for n in masters)
    for k in range(2):
        masters = {n: m * (1 + 1e-2 * (k + 1)) for n, m in masters_at(0).items()}
        state.export(shards(masters, outs))
        exported = {n: o.clone() for n, o in outs.items()}
        residuals = {n: r.clone() for n, r in state.residuals.items()}
        for o in outs.values():
            o.fill_(3.0)
        state.replay(shards(masters, outs))
        assert state.step == k + 1
        assert all(torch.equal(bits(outs[n]), bits(exported[n])) for n in outs), k
        assert all(torch.equal(bits(state.residuals[n]), bits(residuals[n])) for n in residuals)


def train(state: ExportState, steps: range, served: list) -> None:
    """Export the masters of ``steps`` (one export each) through ``state``, appending what is served."""
    for k in steps:
        masters = masters_at(100 + k)
        outs = outs_like(masters)
        state.export(shards(masters, outs))
        fp8 = state.full_fp8(shards(masters, outs)) if state.fp8 is not None else {}
        served.append({**{n: o.clone() for n, o in outs.items()}, **{f"{n}.fp8": t.clone() for n, t in fp8.items()}})


def copied(snap: ExportSnapshot) -> ExportSnapshot:
    """What a checkpoint gives back of a snapshot: copies, in another process's memory."""
    clone = lambda d: None if d is None else {k: t.clone() for k, t in d.items()}  # noqa: E731
    return ExportSnapshot(snap.step, snap.method, snap.seed, clone(snap.residuals), clone(snap.served),
                          clone(snap.fp8_scales), clone(snap.fp8), clone(snap.fp8_residuals))


@pytest.mark.parametrize("config", [*CONFIGS.values(), *FP8.values()],
                         ids=[*CONFIGS, *(f"fp8_{m}" for m in FP8)])
def test_snapshot_then_restore_resumes_as_uninterrupted(config, caplog):
    """Three exports, snapshot, restore into a new state with the masters as loaded, two more exports: bit for bit
    the five of one uninterrupted state (bf16, FP8 bits and scales), with no warning."""
    straight = []
    train(ExportState(config, shapes=SHAPES), range(5), straight)
    first, resumed = ExportState(config, shapes=SHAPES), []
    train(first, range(3), resumed)
    masters = masters_at(102)
    snap = copied(first.snapshot(shards(masters, outs_like(masters))))
    second = ExportState(config, shapes=SHAPES)
    with caplog.at_level(logging.WARNING, logger="faircast"):
        restored = second.restore(snap, shards(masters, outs_like(masters)))
    assert warnings(caplog) == []
    ef = config["method"] == "error_feedback" and config["mode"] == "fair"
    assert restored.residuals is (Residuals.KEEP if ef else Residuals.NONE)
    assert restored.fp8 is (Fp8Restore.KEEP if "format" in config else None)
    assert second.step == 3
    train(second, range(3, 5), resumed)
    for k, (a, b) in enumerate(zip(resumed, straight)):
        assert a.keys() == b.keys() and all(torch.equal(bits(a[n]), bits(b[n])) for n in a), k


@pytest.mark.parametrize("method", ["stochastic", "dithered", "nearest"])
def test_fp8_scales_without_bits_recast_what_was_served(method):
    """A checkpoint with the FP8 scales but not the bits (Megatron saves bits for error feedback only): a stateless
    method casts the loaded masters again at the export step, which is what was served."""
    first = ExportState(FP8[method], shapes=SHAPES)
    train(first, range(2), [])
    masters = masters_at(101)
    saved = first.full_fp8(shards(masters, outs_like(masters)))
    snap = copied(first.snapshot(shards(masters, outs_like(masters))))
    snap.fp8 = None
    second = ExportState(FP8[method], shapes=SHAPES)
    pieces = shards(masters, outs_like(masters))
    assert second.restore(snap, pieces).fp8 is Fp8Restore.RECAST
    assert torch.equal(bits(second.full_fp8(pieces)["w.weight"]), bits(saved["w.weight"]))


@pytest.mark.parametrize("now,saved_method,saved", [
    (now, m, has) for now, m, has in itertools.product(CONFIGS, [None, *CONFIGS], (False, True))
    if not (has and m not in ("error_feedback", None))])  # only error feedback writes residuals
def test_restore_applies_the_residual_rule_and_warns_once(now, saved_method, saved, caplog):
    """Every (method now, method saved, residuals saved) case: keep exactly when both are error feedback and the
    residuals are there; zero them (one warning) when error feedback starts from a checkpoint without any; drop them
    (one warning, the store emptied) when the method is no longer error feedback."""
    store = {}
    state = ExportState(CONFIGS[now], residuals=store)
    masters = masters_at(0)
    state.export(shards(masters, outs_like(masters)))
    snap = ExportSnapshot(7, None if saved_method is None else Method(saved_method),
                          residuals={n: torch.full((m.numel(),), 0.25) for n, m in masters.items()} if saved else None)
    with caplog.at_level(logging.WARNING, logger="faircast"):
        restored = state.restore(snap, shards(masters, outs_like(masters)))
    want = ((Residuals.KEEP if saved else Residuals.ZERO) if now == "error_feedback"
            else (Residuals.DROP if saved else Residuals.NONE))
    assert restored.residuals is want and state.step == 7
    assert len(warnings(caplog)) == (want in (Residuals.ZERO, Residuals.DROP)), warnings(caplog)
    assert all(w.startswith("Fair Cast: ") for w in warnings(caplog))
    if want is Residuals.ZERO:
        assert all(not bits(r).any() for r in store.values())
    if want is Residuals.KEEP:
        assert all(torch.equal(r, torch.full_like(r, 0.25)) for r in store.values())
    if want is Residuals.DROP:
        assert store == {}


@pytest.mark.parametrize("saved,saved_method,warning", [
    (True, Method.ERROR_FEEDBACK, None),
    (False, Method.ERROR_FEEDBACK, "the checkpoint was written with error_feedback but its residuals are missing"),
    (False, Method.STOCHASTIC, "switching from stochastic to error_feedback"),
    (False, None, "the checkpoint holds no error-feedback residuals (and records no method)"),
])
def test_missing_residuals_warning_says_what_happened(saved, saved_method, warning):
    rule, message = residual_rule(Method.ERROR_FEEDBACK, saved, saved_method)
    assert rule is (Residuals.KEEP if saved else Residuals.ZERO)
    assert message == (None if warning is None else f"{warning}: residuals start at zero")


def test_an_adapters_own_account_of_missing_residuals_replaces_the_rules(caplog):
    state = ExportState(CONFIGS["error_feedback"])
    masters = masters_at(0)
    with caplog.at_level(logging.WARNING, logger="faircast"):
        state.restore(ExportSnapshot(2, Method.ERROR_FEEDBACK), shards(masters, outs_like(masters)),
                      missing_residuals="residuals were not requested")
    assert warnings(caplog) == ["Fair Cast: residuals were not requested"]


def test_loaded_residuals_take_the_configured_dtype():
    state = ExportState({"mode": "fair", "method": "error_feedback", "residual_dtype": "bfloat16"})
    masters = masters_at(0)
    state.restore(ExportSnapshot(1, Method.ERROR_FEEDBACK, residuals={n: torch.full((m.numel(),), 0.5)
                                                                      for n, m in masters.items()}),
                  shards(masters, outs_like(masters)))
    assert all(r.dtype == torch.bfloat16 and bool((r == 0.5).all()) for r in state.residuals.values())


def test_a_checkpoint_without_export_state_warns_once_and_restarts(caplog):
    """No snapshot (written without Fair Cast): one warning saying all that follows; the export step is the
    adapter's, residuals (FP8 ones too) start at zero, FP8 scales are set afresh from the loaded masters."""
    state = ExportState(FP8["error_feedback"], shapes=SHAPES)
    train(state, range(2), [])
    masters = masters_at(50)
    pieces = shards(masters, outs_like(masters))
    with caplog.at_level(logging.WARNING, logger="faircast"):
        restored = state.restore(None, pieces, step=4)
    assert warnings(caplog) == ["Fair Cast: the checkpoint has no export-cast state (written without Fair Cast, or before "
                                "the first step?): the export step is 4, residuals start at zero, FP8 scales are set "
                                "afresh from the loaded masters"]
    assert restored == (Residuals.ZERO, Fp8Restore.AFRESH, False) and state.step == 4
    assert all(not r.any() for r in state.residuals.values())
    fresh = ExportState(FP8["error_feedback"], shapes=SHAPES)
    fresh.caster.step = 4
    fresh.export_fp8(shards(masters, outs_like(masters)))  # what the scales afresh are: a first export's
    assert torch.equal(state.fp8.scales["w.weight"], fresh.fp8.scales["w.weight"])
    assert torch.equal(bits(state.full_fp8(pieces)["w.weight"]), bits(fresh.full_fp8(shards(masters, outs_like(masters)))["w.weight"]))


def test_a_bf16_checkpoint_into_fp8_sets_scales_afresh_with_its_warning(caplog):
    first = ExportState(CONFIGS["dithered"])
    train(first, range(2), [])
    masters = masters_at(101)
    snap = copied(first.snapshot(shards(masters, outs_like(masters))))
    state = ExportState(FP8["dithered"], shapes=SHAPES)
    with caplog.at_level(logging.WARNING, logger="faircast"):
        assert state.restore(snap, shards(masters, outs_like(masters))).fp8 is Fp8Restore.AFRESH
    assert warnings(caplog) == ["Fair Cast: the checkpoint has no FP8 export state: FP8 scales are set afresh from the "
                                "loaded masters"]
    assert state.fp8.scales and state.step == 2


def test_fp8_error_feedback_from_a_stochastic_checkpoint_keeps_scales_and_starts_residuals_at_zero(caplog):
    first = ExportState(FP8["stochastic"], shapes=SHAPES)
    train(first, range(2), [])
    masters = masters_at(101)
    snap = copied(first.snapshot(shards(masters, outs_like(masters))))
    state = ExportState(FP8["error_feedback"], shapes=SHAPES)
    pieces = shards(masters, outs_like(masters))
    with caplog.at_level(logging.WARNING, logger="faircast"):
        restored = state.restore(snap, pieces)
    assert restored == (Residuals.ZERO, Fp8Restore.ZERO, True)
    assert warnings(caplog) == [
        "Fair Cast: switching from stochastic to error_feedback: residuals start at zero",
        "Fair Cast: the checkpoint has no FP8 error-feedback residuals: they start at zero; its FP8 scales are kept"]
    assert all(torch.equal(state.fp8.scales[n], snap.fp8_scales[n]) for n in snap.fp8_scales)
    assert torch.equal(bits(state.full_fp8(pieces)["w.weight"]), bits(first.full_fp8(pieces)["w.weight"]))


def test_a_snapshot_of_another_layout_is_refused_by_name():
    state = ExportState(CONFIGS["error_feedback"])
    masters = masters_at(0)
    with pytest.raises(ValueError, match="residual of shard 'b' has 4 elements, the shard 9"):
        state.restore(ExportSnapshot(1, Method.ERROR_FEEDBACK, residuals={"w.weight": torch.zeros(30),
                                                                          "b": torch.zeros(4)}),
                      shards(masters, outs_like(masters)))


def test_a_residual_store_of_the_framework_backs_the_state():
    """DeepSpeed keeps residuals in its optimizer state: the core reads and creates them there."""
    store = {}
    state = ExportState(CONFIGS["error_feedback"], residuals=store)
    masters = masters_at(1)
    outs = outs_like(masters)
    state.export(shards(masters, outs))
    assert store.keys() == {"w.weight", "b"} and store["w.weight"].shape == (30,)
    store["w.weight"].fill_(0.25)
    state.export(shards(masters, outs))
    want = FairCaster(CONFIGS["error_feedback"]).cast("w.weight", masters["w.weight"].view(-1),
                                                      residual=torch.full((30,), 0.25))
    assert torch.equal(bits(outs["w.weight"].view(-1)), bits(want))  # the second export rounded master + 0.25


def test_a_shard_may_carry_a_view_of_a_larger_residual():
    """DeepSpeed stage 0 serves one fp32 group into several bf16 params: each shard's residual is a view
    of the group's, updated in place (the state creates none of its own)."""
    state = ExportState(CONFIGS["error_feedback"])
    group = torch.randn(12)
    residual = torch.full((12,), 0.125)
    outs = [torch.empty(5, dtype=torch.bfloat16), torch.empty(7, dtype=torch.bfloat16)]
    pieces = [Shard(("g", 0), group[:5], outs[0], [("a", 0, 5, 0)], residual=residual[:5]),
              Shard(("g", 1), group[5:], outs[1], [("b", 0, 7, 0)], residual=residual[5:])]
    state.cast(pieces)
    assert state.residuals == {}
    ref = FairCaster(CONFIGS["error_feedback"])
    want_residual = torch.full((12,), 0.125)
    want = [ref.cast("a", group[:5], residual=want_residual[:5]), ref.cast("b", group[5:], residual=want_residual[5:])]
    assert all(torch.equal(bits(o), bits(w)) for o, w in zip(outs, want))
    assert torch.equal(bits(residual), bits(want_residual))


def test_fp8_decisions_follow_the_snapshot_not_the_ranks_shards():
    """A rank holding no FP8 param casts with the others when the checkpoint lacks the FP8 bits (a recast is a
    collective: the decision follows from the snapshot's entries, the same on every rank); counted here by the MAX
    reduces the rank joins."""
    state = ExportState(FP8["stochastic"], shapes=SHAPES)
    reduces = []
    state.reduce_max = lambda t: reduces.append(t.numel())
    only_bias = {"b": masters_at(0)["b"]}  # this rank holds no FP8 element
    snap = ExportSnapshot(3, Method.STOCHASTIC, 11, served={"b": torch.zeros(9, dtype=torch.bfloat16)},
                          fp8_scales={"w.weight": torch.ones(6, 1)}, fp8=None)
    assert state.restore(snap, shards(only_bias, outs_like(only_bias))).fp8 is Fp8Restore.RECAST
    assert reduces == [6]  # the one all-reduce of the recast, joined


def test_fp8_state_the_config_no_longer_serves_is_dropped_with_a_warning(caplog):
    """Scales of a param served bf16 now (another fp8_exclude), or an FP8 checkpoint into a bf16 state: dropped,
    warned (nothing lost silently); FP8 bits given as float8 are taken bit for bit."""
    masters = masters_at(0)
    snap = ExportSnapshot(1, Method.STOCHASTIC, 11, fp8_scales={"w.weight": torch.ones(6, 1), "old.weight": torch.ones(2, 1)},
                          fp8={"w.weight": torch.arange(30, dtype=torch.uint8).view(torch.float8_e4m3fn), "b": torch.zeros(9, dtype=torch.uint8)})
    state = ExportState(FP8["stochastic"], shapes=SHAPES)
    with caplog.at_level(logging.WARNING, logger="faircast"):
        state.restore(snap, shards(masters, outs_like(masters)))
        ExportState(CONFIGS["stochastic"]).restore(snap, shards(masters, outs_like(masters)))
    assert [w for w in warnings(caplog)] == [
        "Fair Cast: the checkpoint has FP8 export state for 1 params served bf16 now (['old.weight']: format or "
        "fp8_exclude changed): dropping it",
        "Fair Cast: the checkpoint has FP8 export state for 2 params served bf16 now (['old.weight', 'w.weight']: "
        "format or fp8_exclude changed): dropping it"]
    assert torch.equal(state.fp8_outs["w.weight"], torch.arange(30, dtype=torch.uint8))


def test_a_rank_holding_no_shard_of_a_saved_entry_keeps_the_rule_of_the_others(caplog):
    """An empty dict is "saved, none of it on this rank": error feedback keeps (no warning), as on the ranks that hold
    residuals; None is "not saved": zero, warned."""
    state = ExportState(CONFIGS["error_feedback"])
    with caplog.at_level(logging.WARNING, logger="faircast"):
        assert state.restore(ExportSnapshot(2, Method.ERROR_FEEDBACK, residuals={}), []).residuals is Residuals.KEEP
    assert warnings(caplog) == []


def test_error_feedback_fp8_without_the_bits_starts_its_residuals_at_zero(caplog):
    """FP8 residuals without the bits they belong to cannot be resumed exactly: zeros, warned (not a recast that
    moves them silently)."""
    first = ExportState(FP8["error_feedback"], shapes=SHAPES)
    train(first, range(2), [])
    masters = masters_at(101)
    snap = copied(first.snapshot(shards(masters, outs_like(masters))))
    snap.fp8 = None
    state = ExportState(FP8["error_feedback"], shapes=SHAPES)
    with caplog.at_level(logging.WARNING, logger="faircast"):
        assert state.restore(snap, shards(masters, outs_like(masters))).fp8 is Fp8Restore.ZERO
    assert warnings(caplog) == ["Fair Cast: the checkpoint has no FP8 error-feedback residuals: they start at zero; its "
                                "FP8 scales are kept"]


@pytest.mark.parametrize("field,value,match", [
    ("served", {"b": torch.zeros(9, dtype=torch.bfloat16)}, "no served value for shard 'w.weight'"),
    ("residuals", {"w.weight": None, "b": torch.zeros(9)}, "no error-feedback residual for shard 'w.weight'"),
    ("fp8_scales", {}, r"no scales for \['w.weight'\]")])
def test_a_snapshot_missing_an_entry_of_a_shard_is_refused_by_name(field, value, match):
    masters = masters_at(0)
    state = ExportState(FP8["error_feedback"], shapes=SHAPES)
    snap = ExportSnapshot(1, Method.ERROR_FEEDBACK, residuals={n: torch.zeros(m.numel()) for n, m in masters.items()})
    setattr(snap, field, value)
    with pytest.raises(ValueError, match=match):
        state.restore(snap, shards(masters, outs_like(masters)))
