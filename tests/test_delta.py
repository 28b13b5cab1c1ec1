"""Delta export core (faircast_dist.delta): diff, DeltaTracker, apply_deltas, payload."""
import pytest
import torch

from faircast_dist import FairCaster
from helpers import bits
from faircast_dist.delta import DeltaTracker, apply_deltas, diff, index_dtype, payload_bytes


@pytest.mark.parametrize("method", ["nearest", "stochastic", "error_feedback", "dithered"])
def test_tracked_deltas_rebuild_every_export_bit_for_bit(method):
    """A receiver that got the first (full) delta and then every step's delta holds, after each
    step, exactly the served model; unchanged exports give empty deltas."""
    g = torch.Generator().manual_seed(0)
    master = {"a.weight": torch.randn(37, 13, generator=g), "b.bias": torch.randn(29, generator=g)}
    caster = FairCaster(None if method == "nearest" else {"mode": "fair", "method": method})
    tracker = DeltaTracker()
    receiver = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in master.items()}
    residuals = {n: caster.new_residual(t) for n, t in master.items()}
    for step in range(6):
        served = {n: caster.cast(n, t, residual=residuals[n]) for n, t in master.items()}
        caster.advance()
        deltas = [(n, *tracker.diff(n, t)) for n, t in served.items()]
        if step == 0:  # no baseline: every element
            assert [len(i) for _, i, _ in deltas] == [t.numel() for t in master.values()]
        assert apply_deltas(receiver, deltas) == sum(len(i) for _, i, _ in deltas)
        for n in master:
            assert torch.equal(bits(receiver[n]), bits(served[n])), (step, n)
        master = {n: t + 1e-4 * torch.randn(t.shape, generator=g) for n, t in master.items()}
    # nothing changed since the last diff: empty deltas (stochastic rounding would redraw, so
    # compare the same served tensors again)
    assert all(len(tracker.diff(n, t)[0]) == 0 for n, t in served.items())
    assert tracker.nbytes() == 2 * sum(t.numel() for t in master.values())


def test_diff_of_shards_gives_global_indices_that_any_layout_applies():
    g = torch.Generator().manual_seed(1)
    before = torch.randn(1000, generator=g).to(torch.bfloat16)
    after = before.clone()
    changed = torch.tensor([0, 3, 499, 500, 777, 999])
    after[changed] = after[changed] * 2
    whole = diff(before, after)
    assert torch.equal(whole[0], changed.to(torch.int32)) and whole[0].dtype == torch.int32
    # two uneven ZeRO-style partitions of the flat param, diffed on their own ranks
    parts = [diff(before[a:b], after[a:b], start=a, full_numel=1000) for a, b in ((0, 500), (500, 1000))]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(bits(torch.cat([p[1] for p in parts])), bits(whole[1]))
    target = {"w": before.clone().reshape(40, 25)}  # the receiver holds the param 2-D
    apply_deltas(target, [("w", *p) for p in parts])
    assert torch.equal(bits(target["w"].reshape(-1)), bits(after))
    z = torch.zeros(3, dtype=torch.bfloat16)
    assert len(diff(z, -z)[0]) == 3  # +0 -> -0 is a change of served bits


def test_apply_deltas_to_a_module_and_payload_bytes():
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    new = model.weight.detach().clone()
    new[1, 2] = 7.0
    deltas = [("weight", *diff(model.weight.detach(), new)), ("bias", *diff(model.bias.detach(), model.bias.detach()))]
    assert apply_deltas(model, deltas) == 1 and model.weight[1, 2].item() == 7.0
    assert payload_bytes(deltas) == 4 + 2  # one int32 index and one bf16 value
    assert index_dtype(2**31) == torch.int32 and index_dtype(2**31 + 1) == torch.int64


def test_bad_input_names_the_problem():
    t = {"w": torch.zeros(5, dtype=torch.bfloat16)}
    with pytest.raises(KeyError, match="no tensor named 'v'"):
        apply_deltas(t, [("v", torch.tensor([0]), torch.zeros(1, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match=r"'w': index out of range \[0, 5\)"):
        apply_deltas(t, [("w", torch.tensor([5]), torch.zeros(1, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="1-D of one length"):
        apply_deltas(t, [("w", torch.tensor([0, 1]), torch.zeros(1, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="not contiguous"):
        apply_deltas({"w": torch.zeros(4, 4).t()}, [("w", torch.tensor([0]), torch.zeros(1))])
    with pytest.raises(TypeError, match="after must be bfloat16"):
        diff(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16))
    with pytest.raises(TypeError, match="before is torch.bfloat16, after torch.float32"):
        diff(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2))
    with pytest.raises(ValueError, match="before shape"):
        diff(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))
    tracker = DeltaTracker()
    tracker.diff("w", torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="before shape"):
        tracker.diff("w", torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        DeltaTracker().diff("w", torch.zeros(3, dtype=torch.float64))


def test_fp8_weights_and_scales_diff_by_their_bits():
    """FP8 served weights (format "fp8"): an E4M3 weight and its fp32 scales diff bit for bit like bf16 (a sign
    flip of zero counts), and the deltas rebuild them."""
    before = torch.tensor([0.0, 1.0, -2.0, 448.0]).to(torch.float8_e4m3fn)
    after = torch.tensor([-0.0, 1.0, -2.5, 448.0]).to(torch.float8_e4m3fn)
    index, values = diff(before, after)
    assert index.tolist() == [0, 2] and values.dtype == torch.float8_e4m3fn
    assert values.view(torch.uint8).tolist() == after.view(torch.uint8)[[0, 2]].tolist()
    tracker, scales = DeltaTracker(), torch.tensor([[0.5], [0.25]])
    tracker.diff("w_scale", scales)
    index, values = tracker.diff("w_scale", torch.tensor([[0.5], [0.3]]))
    assert index.tolist() == [1] and values.tolist() == [pytest.approx(0.3)]
    target = {"w": before.clone()}
    apply_deltas(target, [("w", *diff(before, after))])
    assert torch.equal(target["w"].view(torch.uint8), after.view(torch.uint8))
