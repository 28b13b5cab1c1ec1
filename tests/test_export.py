"""The export core every adapter shares (faircast_dist.export.ExportState), single process."""
import itertools
import logging

import pytest
import torch

from faircast_dist import FairCaster, Method
from faircast_dist.export import ExportState, Shard
from helpers import bits

CONFIGS = {m: {"mode": "nearest" if m == "nearest" else "fair", "method": "stochastic" if m == "nearest" else m,
               "seed": 11} for m in (m.value for m in Method)}


def shards(masters: dict, outs: dict, start: int = 0):
    """One shard per tensor: a rank's elements [start, start + numel) of each flattened param."""
    return [Shard(n, m.view(-1), outs[n].view(-1), [(n, 0, m.numel(), start)]) for n, m in masters.items()]


def masters_at(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(9, generator=g)}


@pytest.mark.parametrize("method", list(CONFIGS))
def test_export_is_the_callers_reference_cast_and_advances_the_step(method):
    """One fused call over the shards gives FairCaster.cast's bits per param, the step advances once
    per export, and error feedback's residuals are keyed by shard (created at the first export)."""
    state, ref = ExportState(CONFIGS[method]), FairCaster(CONFIGS[method])
    for k in range(3):
        masters = masters_at(k)
        outs = {n: torch.empty(m.shape, dtype=torch.bfloat16) for n, m in masters.items()}
        state.export(shards(masters, outs, start=3))
        for n, m in masters.items():
            assert torch.equal(bits(outs[n]), bits(ref.cast(n, m, index=3))), (k, n)
        ref.advance()
        assert state.step == k + 1
    assert sorted(state.residuals) == (["b", "w"] if method == "error_feedback" else [])


@pytest.mark.parametrize("method", list(CONFIGS))
def test_replay_writes_the_last_export_again_without_advancing(method):
    """What a framework's copy outside a step gets: the last export, bit for bit (error feedback from
    the served copy it keeps); before the first export, round-to-nearest of the masters."""
    state = ExportState(CONFIGS[method])
    masters = masters_at(0)
    outs = {n: torch.full(m.shape, 7.0, dtype=torch.bfloat16) for n, m in masters.items()}
    if method == "error_feedback":
        state.keep_served(shards(masters, outs))  # the served model before the first export
    else:
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


SAVED = [None, *CONFIGS]  # None: a checkpoint that records no method (written without Fair Cast)


@pytest.mark.parametrize("now,saved_method,saved", [
    (now, m, has) for now, m, has in itertools.product(CONFIGS, SAVED, (False, True))
    if not (has and m not in ("error_feedback", None))])  # only error feedback writes residuals
def test_adopt_applies_the_one_rule_and_warns_once_on_the_channel(now, saved_method, saved, caplog):
    """Every (method now, method saved, residuals saved) case: keep exactly when both are error
    feedback and the residuals are there; zero them (one warning) when error feedback starts from a
    checkpoint without any; drop them (one warning) when the method is no longer error feedback."""
    state = ExportState(CONFIGS[now])
    masters = masters_at(0)
    outs = {n: torch.empty(m.shape, dtype=torch.bfloat16) for n, m in masters.items()}
    state.export(shards(masters, outs))
    with caplog.at_level(logging.WARNING, logger="faircast"):
        action = state.adopt(saved, saved_method)
    want = ("keep" if saved else "zero") if now == "error_feedback" else ("drop" if saved else "none")
    assert action == want
    warned = [r.getMessage() for r in caplog.records if r.name == "faircast"]
    assert len(warned) == (want in ("zero", "drop")), warned
    assert all(w.startswith("Fair Cast: ") for w in warned)
    if want == "zero":
        assert all(not bits(r).any() for r in state.residuals.values())
    if want == "keep":
        assert any(bits(r).any() for r in state.residuals.values())  # left for the adapter to overwrite


def test_an_adapters_own_account_replaces_the_rules_warning(caplog):
    state = ExportState(CONFIGS["error_feedback"])
    with caplog.at_level(logging.WARNING, logger="faircast"):
        state.adopt(False, "error_feedback", warning="residuals were not requested")
        state.adopt(False, None, warning="")  # the adapter has said it already
    assert [r.getMessage() for r in caplog.records] == ["Fair Cast: residuals were not requested"]


def test_a_residual_store_of_the_framework_backs_the_state():
    """DeepSpeed keeps residuals in its optimizer state: the core reads and creates them there."""
    store = {}
    state = ExportState(CONFIGS["error_feedback"], residuals=store)
    masters = masters_at(1)
    outs = {n: torch.empty(m.shape, dtype=torch.bfloat16) for n, m in masters.items()}
    state.export(shards(masters, outs))
    assert store.keys() == {"w", "b"} and store["w"].shape == (30,)
    store["w"].fill_(0.25)
    state.export(shards(masters, outs))
    want = FairCaster(CONFIGS["error_feedback"]).cast("w", masters["w"].view(-1), residual=torch.full((30,), 0.25))
    assert torch.equal(bits(outs["w"].view(-1)), bits(want))  # the second export rounded master + 0.25


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
