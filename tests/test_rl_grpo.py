"""The GRPO loop (scripts/rl_grpo.py): its pieces on hand-made inputs, and the loop itself under
torchrun (2 ranks, tiny random model, 2 steps per arm)."""
import copy
import csv
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import rl_grpo  # noqa: E402
from rl import engines, stats  # noqa: E402

ARMS = ("nearest", "stochastic", "error_feedback", "fp32")
CASTS = ARMS[:3]  # the arms served in bf16 (fp32: the oracle, served without rounding)
FP8 = ("fp8_nearest", "fp8_error_feedback", "fp8_dithered")  # served as FP8 per channel: vLLM only (an FP8 engine)
# the launches' environment: the vLLM engines' workers run their OpenMP thread (torchrun sets one per rank) unpinned;
# vLLM pins each to core 0 here (it keeps the other core for its scheduler) from its `import torch` on, so the
# engines of a launch, started side by side, would share one core
ENV = dict(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")


def _arms(engine: str) -> tuple[str, ...]:
    """The arms of the shared launch on ``engine``, in the order they run."""
    return (*CASTS, *FP8, "fp32") if engine == "vllm" else ARMS


def test_compare_arms_counts_wins_ties_losses_against_nearest_with_the_tie_band():
    scores = {0: {"nearest": 50.0, "stochastic": 52.0, "error_feedback": 49.5},
              1: {"nearest": 40.0, "stochastic": 40.5, "error_feedback": 38.0},
              2: {"nearest": 60.0, "stochastic": 61.0, "error_feedback": 70.0}}
    t = stats.compare_arms(scores, tie_band=1.0)
    # a gain of exactly the band counts (>= 1.0 wins, <= -1.0 loses)
    assert (t["stochastic"]["wins"], t["stochastic"]["ties"], t["stochastic"]["losses"]) == (2, 1, 0)
    assert (t["error_feedback"]["wins"], t["error_feedback"]["ties"], t["error_feedback"]["losses"]) == (1, 1, 1)
    assert t["stochastic"]["mean_gain"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    assert t["error_feedback"]["mean_gain"] == pytest.approx((-0.5 - 2.0 + 10.0) / 3)
    assert (t["nearest"]["ties"], t["nearest"]["mean_gain"]) == (3, 0.0)
    assert stats.compare_arms(scores, tie_band=0.0)["error_feedback"]["ties"] == 0
    # an equal score ties even with a zero band (held-out accuracy moves in steps of 1/eval_size: equal is common)
    even = stats.compare_arms({0: {"nearest": 50.0, "stochastic": 50.0}, 1: {"nearest": 50.0, "stochastic": 49.0}}, 0.0)
    assert (even["stochastic"]["wins"], even["stochastic"]["ties"], even["stochastic"]["losses"]) == (0, 1, 1)
    with pytest.raises(ValueError, match="pair 3 has no 'nearest'"):
        stats.compare_arms({3: {"stochastic": 1.0}}, tie_band=1.0)
    with pytest.raises(ValueError, match="tie_band"):
        stats.compare_arms(scores, tie_band=-1)


def test_fp8_arms_are_compared_with_fp8_nearest_on_the_pairs_that_ran_them():
    """An FP8 arm's gain is over round-to-nearest into FP8, not into bf16, over the pairs that ran FP8 arms (launches
    merged with and without them); the oracle's gain over each baseline is what recovery divides by."""
    scores = {0: {"nearest": 40.0, "dithered": 42.0, "fp32": 44.0, "fp8_nearest": 30.0, "fp8_dithered": 38.0},
              1: {"nearest": 40.0, "dithered": 41.0, "fp32": 43.0},
              2: {"nearest": 50.0, "dithered": 50.0, "fp32": 50.0, "fp8_nearest": 45.0, "fp8_dithered": 44.5},
              3: {"nearest": 40.0, "fp8_nearest": 30.0, "fp8_dithered": 31.0}}  # a launch without the oracle
    table, oracle = stats.compare_formats(scores, 1.0, "fp32")
    assert (table["fp8_dithered"]["pairs"], table["fp8_dithered"]["mean_gain"]) == (3, (8.0 - 0.5 + 1.0) / 3)
    assert (table["fp8_dithered"]["wins"], table["fp8_dithered"]["ties"]) == (2, 1)
    assert (table["dithered"]["pairs"], table["dithered"]["mean_gain"]) == (3, 1.0)
    assert (table["fp32"]["pairs"], table["fp32"]["mean_gain"]) == (3, 7.0 / 3)  # the oracle's row: vs nearest
    assert oracle == {"nearest": 7.0 / 3, "fp8_nearest": (14.0 + 5.0) / 2}
    # recovery: the arm's gain and the oracle's over the same pairs, those that ran the arm, its baseline, the oracle
    assert table["fp8_dithered"]["oracle_gain"] == 9.5 and table["fp8_dithered"]["recovery"] == (7.5 / 2) / 9.5
    assert table["dithered"]["recovery"] == 1.0 / (7.0 / 3)
    assert table["fp8_nearest"]["oracle_gain"] is None and table["fp32"]["recovery"] is None
    assert table["fp8_nearest"]["mean_gain"] == 0 and stats.baseline_of("fp8_stochastic") == "fp8_nearest"
    with pytest.raises(ValueError, match="pair 4 has no 'fp8_nearest'"):  # an FP8 arm without its baseline
        stats.compare_formats({**scores, 4: {"nearest": 1.0, "fp8_dithered": 2.0}}, 1.0, "fp32")


def test_fp8_ue8m0_gives_the_fp8_arms_power_of_two_scales():
    from faircast_dist import ExportCastConfig
    on, off = rl_grpo.parse_args(["--fp8-ue8m0"]), rl_grpo.parse_args([])
    assert ExportCastConfig.from_value(rl_grpo.arm_export_cast("fp8_dithered", 3, on)).fp8_ue8m0
    assert not ExportCastConfig.from_value(rl_grpo.arm_export_cast("fp8_dithered", 3, off)).fp8_ue8m0
    assert "fp8_ue8m0" not in rl_grpo.arm_export_cast("dithered", 3, on)  # bf16 arms: no FP8 setting


@pytest.mark.parametrize("ue8m0", [True, False])
def test_start_on_fp8_grid_puts_the_fp8_params_where_round_to_nearest_serves_them_unchanged(ue8m0):
    from transformers import LlamaConfig, LlamaForCausalLM
    from faircast_dist import ExportCastConfig
    from faircast_dist.fp8 import ScaleRule, fp8_param
    from faircast_dist.rounding import cast_fp8_nearest
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**rl_grpo.TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = rl_grpo.parse_args(["--start-on-fp8-grid"] + (["--fp8-ue8m0"] if ue8m0 else []))
    export_cast = rl_grpo.arm_export_cast("fp8_nearest", 0, args)
    rl_grpo.start_on_fp8_grid(model, export_cast)
    config, layout = ExportCastConfig.from_value(export_cast), ScaleRule("channel", ue8m0)

    def rtn(w):  # what the FP8 arm's first export serves: fresh scales of w, round-to-nearest
        s = layout.scales(w.abs().amax(dim=1, keepdim=True)).expand_as(w).contiguous()
        return cast_fp8_nearest(w, s).float() * s, s

    fp8 = [n for n, p in model.named_parameters() if fp8_param(config, n, tuple(p.shape))]
    assert len(fp8) == 14  # q, k, v, o, gate, up, down of 2 layers; embeddings and norms stay as they were
    for n, p in model.named_parameters():
        w = p.detach()
        if n not in fp8:
            assert torch.equal(w, before[n]), n
            continue
        served, s = rtn(before[n])
        assert torch.equal(w, served.to(torch.bfloat16).float()), n  # the start's round-to-nearest codes, in bf16
        assert (served != before[n]).float().mean() > 0.9  # (a bf16 start is off the grid)
        q, s = rtn(w)  # what the FP8 arm's first export serves of the start
        if ue8m0:  # exactly on both grids: the start itself
            assert torch.equal(w, served) and torch.equal(q, w), n
        else:  # within half a bf16 ulp of the first export's grid (the bf16 rounding of q * s): <= 1/16 spacing
            spacing = s * 2.0 ** (torch.floor(torch.log2((q / s).abs().clamp_min(2.0 ** -6))) - 3)
            assert ((q - w).abs() <= spacing / 16).all(), n


def test_default_arms_follow_the_engine_and_fp8_arms_need_their_baseline(tmp_path):
    """FP8 arms by default only where vLLM serves them; an FP8 arm without fp8_nearest is refused at launch and
    in a merge (a committed pair folder with fp8_nearest's rows removed)."""
    assert rl_grpo.parse_args(["--engine", "hf"]).arms == ["nearest", "dithered", "fp32"]
    assert rl_grpo.parse_args(["--engine", "vllm"]).arms == list(rl_grpo.DEFAULT_ARMS)
    for argv in (["--engine", "hf", "--arms", "nearest,fp8_nearest"], ["--engine", "vllm", "--arms", "nearest,fp8_dithered"]):
        with pytest.raises(SystemExit):
            rl_grpo.parse_args(argv)
    pair = os.path.join(ROOT, "docs", "rl36", "pair_5")  # nearest, dithered, fp8_nearest, fp8_dithered, fp32
    shutil.copy(os.path.join(pair, "args.json"), tmp_path / "args.json")
    with open(os.path.join(pair, "steps.csv")) as f, open(tmp_path / "steps.csv", "w", newline="") as g:
        rows = [r for r in csv.DictReader(f) if r["arm"] != "fp8_nearest"]
        w = csv.DictWriter(g, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert len(rl_grpo.load_runs([pair])[0]) == 5 * 301  # 5 arms, steps 0-300
    with pytest.raises(SystemExit, match=r"pair seed 5 .* without fp8_nearest"):
        rl_grpo.load_runs([str(tmp_path)])


def test_served_values_dequantize_fp8_weights_with_their_channel_scales(monkeypatch):
    """The lag and gap columns read the served values, an FP8 weight as q * weight_scale; changed weights, the codes."""
    import deepspeed_hooks.served
    q = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(torch.float8_e4m3fn)
    served = [("a.weight", q), ("a.weight_scale", torch.tensor([[0.25], [2.0**-9]])),
              ("norm.weight", torch.tensor([1.5, 3.0], dtype=torch.bfloat16))]
    monkeypatch.setattr(deepspeed_hooks.served, "served_weights", lambda engine: iter(served))
    values, codes = engines.served_values(None, ["norm.weight", "a.weight"])
    assert values.dtype == torch.float32 and values.tolist() == [1.5, 3.0, 0.25, -0.5, 2.0**-10, 448.0 * 2.0**-9]
    # changed weights count codes (bf16 bits, E4M3 codes): a rescaled channel moves values, not codes
    assert codes.tolist() == [*served[2][1].view(torch.int16).tolist(), *q.view(torch.int8).reshape(-1).tolist()]


def test_arm_scores_average_the_last_evals_of_each_arm_and_pair():
    rows = [dict(pair_seed=s, arm=a, step=k, eval_acc=acc) for s, a, k, acc in [
        (0, "nearest", 0, 10.0), (0, "nearest", 5, 20.0), (0, "nearest", 10, 40.0),
        (0, "stochastic", 0, 10.0), (0, "stochastic", 10, 30.0), (1, "nearest", 10, 5.0)]]
    rows.append(dict(pair_seed=0, arm="nearest", step=3, reward=1.0))  # a step without an eval
    assert stats.arm_scores(rows, last=2) == {0: {"nearest": 30.0, "stochastic": 20.0}, 1: {"nearest": 5.0}}
    # the primary score: every eval of the arm (the area under its learning curve), in step order
    assert stats.arm_scores(rows) == {0: {"nearest": 70.0 / 3, "stochastic": 20.0}, 1: {"nearest": 5.0}}
    assert stats.arm_scores(list(reversed(rows)), last=1)[0]["nearest"] == 40.0  # the last step, not the last row


def test_paired_bootstrap_interval_of_the_mean_gain():
    assert stats.paired_bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)  # no spread, no width
    gains = [1.0, -0.5, 2.0, 0.0, 1.5, 0.5, -1.0, 3.0]
    lo, hi = stats.paired_bootstrap_ci(gains)
    assert lo < sum(gains) / len(gains) < hi and (lo, hi) == stats.paired_bootstrap_ci(gains)  # seeded
    # the percentile interval of the resampled means: close to the normal one, mean +- 1.96 s.e. (n = 8)
    se = torch.tensor(gains).std(unbiased=False).item() / len(gains) ** 0.5
    assert lo == pytest.approx(0.8125 - 1.96 * se, abs=0.15) and hi == pytest.approx(0.8125 + 1.96 * se, abs=0.15)
    wide, _ = stats.paired_bootstrap_ci(gains, level=0.99)
    assert wide < lo
    assert stats.compare_arms({0: {"nearest": 1.0, "dithered": 2.0}}, 0.0)["dithered"]["gain_ci"] == (1.0, 1.0)
    with pytest.raises(ValueError, match="at least one"):
        stats.paired_bootstrap_ci([])
    with pytest.raises(ValueError, match="level"):
        stats.paired_bootstrap_ci(gains, level=1.0)


def test_recovery_of_the_oracles_gain_and_its_declared_cut():
    assert stats.recovery(1.5, 2.0, tie_band=1.0) == 0.75  # (arm - nearest) / (fp32 - nearest)
    assert stats.recovery(-1.0, 2.0, tie_band=1.0) == -0.5  # slower than round-to-nearest
    assert stats.recovery(3.0, 2.0, tie_band=1.0) == 1.5
    assert stats.recovery(0.4, 0.5, tie_band=1.0) is None  # the oracle gains less than the band: nothing to recover
    assert stats.recovery(0.4, -2.0, tie_band=0.0) is None and stats.recovery(0.0, 0.0, tie_band=0.0) is None
    scores = {0: {"nearest": 40.0, "fp32": 44.0, "dithered": 43.0}, 1: {"nearest": 50.0, "fp32": 52.0, "dithered": 50.0}}
    t = stats.compare_arms(scores, tie_band=1.0)
    assert stats.recovery(t["dithered"]["mean_gain"], t["fp32"]["mean_gain"], 1.0) == pytest.approx(1.5 / 3.0)


def test_mean_curves_give_the_mean_and_the_interquartile_band_over_pairs():
    rows = [dict(pair_seed=s, arm="nearest", step=k, lag_steps=v) for s, k, v in
            [(0, 1, 0), (1, 1, 4), (2, 1, 8), (3, 1, 12), (0, 2, 1), (1, 2, 1)]]
    rows += [dict(pair_seed=0, arm="fp32", step=1, lag_steps=99), dict(pair_seed=0, arm="nearest", step=0)]
    xs, mid, lo, hi = stats.mean_curves(rows, "nearest", "lag_steps")
    assert xs == [1, 2] and mid == [6.0, 1.0] and lo == [3.0, 1.0] and hi == [9.0, 1.0]  # torch.quantile, linear


def test_lag_peak_is_the_highest_mean_lag_over_pairs():
    rows = [dict(pair_seed=s, arm="nearest", step=k, lag_steps=lag) for s, k, lag in
            [(0, 1, 1), (0, 2, 4), (0, 3, 2), (1, 1, 3), (1, 2, 0), (1, 3, 4)]] + [dict(pair_seed=0, arm="nearest", step=0)]
    assert stats.lag_peak(rows, "nearest") == 3.0  # step 3: (2 + 4) / 2


def test_reward_rise_is_the_share_of_the_room_climbed():
    rows = [dict(pair_seed=s, arm="fp32", step=k, reward=r) for s, k, r in
            [(0, 1, 0.2), (0, 2, 0.4), (0, 3, 0.5), (0, 4, 0.6), (1, 1, 0.4), (1, 2, 0.4), (1, 3, 0.7), (1, 4, 0.8)]]
    rows.append(dict(pair_seed=0, arm="fp32", step=0, eval_acc=50.0))  # the step-0 eval has no reward
    first, last, share = stats.reward_rise(rows, "fp32", window=2)  # steps 1-2: 0.35, steps 3-4: 0.65
    assert (first, last) == pytest.approx((0.35, 0.65)) and share == pytest.approx(0.30 / 0.65)
    assert stats.reward_rise(rows, "fp32", window=30)[:2] == pytest.approx((0.35, 0.65))  # at most half each
    assert all(x != x for x in stats.reward_rise(rows, "nearest"))  # no such arm: NaN


def test_fitted_delay_is_the_shift_that_aligns_an_arms_curve_with_the_oracles():
    rows = []
    for pair in (0, 1):
        for t in range(0, 101, 10):  # the oracle climbs 1 point per step; nearest the same, 30 steps late
            rows += [dict(pair_seed=pair, arm="fp32", step=t, eval_acc=float(t + pair), master_acc=float(t)),
                     dict(pair_seed=pair, arm="nearest", step=t, eval_acc=float(max(0, t - 30) + pair),
                          master_acc=float(max(0, t - 12)))]
    assert stats.fitted_delay(rows, "nearest", "eval_acc", "fp32") == 30
    assert stats.fitted_delay(rows, "nearest", "master_acc", "fp32") == 12
    assert stats.fitted_delay(rows, "fp32", "eval_acc", "fp32") == 0
    flat = [dict(r, eval_acc=5.0) for r in rows]  # no rise: every shift fits alike, the smallest wins
    assert stats.fitted_delay(flat, "nearest", "eval_acc", "fp32") == 0
    assert stats.fitted_delay(rows, "dithered", "eval_acc", "fp32") != stats.fitted_delay(rows, "dithered", "eval_acc", "fp32")
    nan = [dict(r, eval_acc=float("nan")) if r["step"] == 50 else r for r in rows]
    assert stats.fitted_delay(nan, "nearest", "eval_acc", "fp32") != stats.fitted_delay(nan, "nearest", "eval_acc", "fp32")
    assert stats.arm_scores(rows, key="master_acc")[0]["nearest"] == pytest.approx(sum(max(0, t - 12) for t in range(0, 101, 10)) / 11)


def test_state_sha_is_the_starting_policys_fingerprint():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**rl_grpo.TINY))
    sha = rl_grpo.state_sha(model)
    assert len(sha) == 16 and rl_grpo.state_sha(copy.deepcopy(model)) == sha
    with torch.no_grad():  # one bit of one weight
        w = model.model.norm.weight
        w.view(torch.int32)[3] ^= 1
    assert rl_grpo.state_sha(model) != sha


def test_the_held_out_problems_are_never_drawn_for_training():
    """The eval set (512 distinct problems) shares no expression with any pair's training problems or the warm
    start's: the split is a property of the problem (a hash of its expression), not of the seed that drew it."""
    task = rl_grpo.Task("tiny")
    held = task.problems(512, seed=rl_grpo.EVAL_SEED, split="eval", distinct=True)
    expr = [e["metadata"]["expression"] for e in held]
    assert len(set(expr)) == 512 and all(rl_grpo.held_out(e) for e in held)
    drawn = [e for seed in range(25) for e in task.problems(300 * 8, seed=seed)]  # 25 pairs x 300 steps x 8 prompts
    drawn += task.problems(2000 * 64, seed=7_777_777)  # the warm start of --init-seed 0
    assert not set(expr) & {e["metadata"]["expression"] for e in drawn}
    assert not any(rl_grpo.held_out(e) for e in drawn)
    share = sum(map(rl_grpo.held_out, task.problems(4000, seed=0, split="eval") + drawn[:4000 * 7])) / 32000
    assert share == pytest.approx(1 / 8, abs=0.01)  # the eval split is what it says
    # 2 terms of one digit: 200 problems, ~25 of them held out, too few for a 512-problem eval set
    with pytest.raises(ValueError, match="only .* distinct eval problems"):
        rl_grpo.Task("tiny", terms=2, digits=1).problems(512, seed=rl_grpo.EVAL_SEED, split="eval", distinct=True)
    with pytest.raises(ValueError, match="split must be one of"):
        task.problems(1, seed=0, split="test")
    with pytest.raises(SystemExit, match="--eval-size 512: only"):  # before any start-up (DeepSpeed, warm start)
        rl_grpo.main(["--terms", "2", "--digits", "1"])


def test_init_weights_start_every_arm_from_a_committed_file(tmp_path):
    """--init-weights: the policy is the file's weights, bit for bit (and so its init_sha)."""
    from safetensors.torch import save_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(5)
    saved = LlamaForCausalLM(LlamaConfig(**rl_grpo.TINY, eos_token_id=10, pad_token_id=0, bos_token_id=None))
    save_model(saved, str(tmp_path / "w.safetensors"))
    args = rl_grpo.parse_args(["--init-weights", str(tmp_path / "w.safetensors"), "--out-dir", str(tmp_path)])
    model = rl_grpo.build_policy(args, rl_grpo.Task("tiny"), rank=0)
    assert rl_grpo.state_sha(model) == rl_grpo.state_sha(saved)
    with pytest.raises(SystemExit):
        rl_grpo.parse_args(["--init-weights", str(tmp_path / "missing.safetensors")])


def test_group_advantages_and_clipped_loss():
    adv = rl_grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), group=3)
    assert torch.allclose(adv.view(2, 3).sum(1), torch.zeros(2), atol=1e-5)  # zero mean per group
    assert adv[0] > 0 > adv[1] and adv[3] < 0 < adv[4]
    assert torch.equal(rl_grpo.group_advantages(torch.ones(4), group=4), torch.zeros(4))  # no signal
    # a token whose ratio left [1 - clip, 1 + clip] in the advantage's direction gets no gradient
    logp = torch.tensor([[0.0, 0.5, -0.5]], requires_grad=True)
    loss, frac = rl_grpo.grpo_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool), 0.2)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] < 0 and logp.grad[0, 2] < 0
    assert frac == pytest.approx(2 / 3)
    assert loss.item() == pytest.approx(-(1.0 + 1.2 + torch.exp(torch.tensor(-0.5)).item()) / 3)
    # under data parallelism: the sum over this rank's tokens / (all ranks' tokens / world)
    mask = torch.tensor([[True, True, False]])
    loss, frac = rl_grpo.grpo_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.2, n_tokens=2.5)
    assert loss.item() == pytest.approx(-(1.0 + 1.2) / 2.5) and frac == pytest.approx(1 / 2)


def test_rollout_engine_load_weights_names_the_bad_param():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    engine = engines.RolloutEngine(LlamaForCausalLM(cfg), eos=1, pad=0)
    w = engine.params["model.norm.weight"]
    with pytest.raises(KeyError, match="no parameter 'bogus'"):
        engine.load_weights([("bogus", w)])
    with pytest.raises(ValueError, match="'model.norm.weight' is torch.bfloat16 .* got torch.float32"):
        engine.load_weights([("model.norm.weight", w.float())])
    engine.load_weights([("model.norm.weight", torch.full_like(w, 2.0))])
    assert torch.equal(engine.params["model.norm.weight"], torch.full_like(w, 2.0))


def _tiny_llama(vocab=16, **gen):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, eos_token_id=10, pad_token_id=0, bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked next-token distributions, as after training
    for k, v in gen.items():
        setattr(model.generation_config, k, v)
    return model


def _trainer_copy(model):
    """What DeepSpeed's bf16 engine trains and serves: bf16 parameters, buffers (RoPE inv_freq) kept fp32."""
    import copy
    trainer = copy.deepcopy(model)
    for p in trainer.parameters():
        p.data = p.data.to(torch.bfloat16)
    return trainer


def test_behaviour_logprobs_are_the_trainers_token_logprobs_of_the_same_bf16_weights():
    """ratio p_trainer / p_behaviour == 1 on every completion token, with and without left padding."""
    model = _tiny_llama()
    engine, trainer = engines.RolloutEngine(model, eos=10, pad=0), _trainer_copy(model)
    for name, buf in model.named_buffers():  # RoPE inv_freq stays fp32, as in the DeepSpeed trainer
        mine = dict(engine.model.named_buffers())[name]
        assert mine.dtype == buf.dtype and torch.equal(mine, buf), name
    engines.check_synced(_stock(trainer), engine, "start")  # same params and buffers
    for prompts in ([[5, 6, 7] * 4] * 4, [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7] * 3] * 2):
        torch.manual_seed(1)
        roll = engine.generate(prompts, max_new_tokens=24)
        attn = roll["attention_mask"]
        with torch.no_grad():
            logits = trainer(roll["ids"], attention_mask=attn, position_ids=rl_grpo.position_ids(attn)).logits
        logp = rl_grpo.token_logp(logits, roll["ids"])
        assert roll["mask"].sum() > 20 and (roll["logp"][roll["mask"]] < -0.01).any()  # real samples
        # bf16 kernel noise only (cached decoding vs one forward: other GEMM shapes); an off-by-one
        # position, ignored left padding or a bf16-rounded RoPE inv_freq gives 0.05-10
        assert (logp - roll["logp"])[roll["mask"]].abs().max() < 0.02
        assert (roll["logp"][~roll["mask"]] == 0).all()


def test_pack_rollouts_aligns_vllm_completions_with_the_trainers_targets():
    """vLLM returns (completion ids, log-probs) per prompt; the packed batch has the HF engine's layout: left-padded
    prompts, each completion token's log-prob at the position that predicts it (target ids[:, 1:])."""
    out = engines.pack_rollouts([[5, 6, 7], [8]], [([1, 10], [-0.5, -0.25]), ([2, 3, 10], [-1.0, -2.0, -3.0])], pad=0)
    assert out["ids"].tolist() == [[5, 6, 7, 1, 10, 0], [0, 0, 8, 2, 3, 10]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert out["mask"].tolist() == [[False, False, True, True, False], [False, False, True, True, True]]
    assert out["logp"].tolist() == [[0, 0, -0.5, -0.25, 0], [0, 0, -1.0, -2.0, -3.0]]
    assert out["completions"] == [[1, 10], [2, 3, 10]]
    assert out["ids"][out["mask"].nonzero()[:, 0], out["mask"].nonzero()[:, 1] + 1].tolist() == [1, 10, 2, 3, 10]
    empty = engines.pack_rollouts([], [], pad=0)  # a rank with no held-out share
    assert empty["completions"] == [] and empty["mask"].numel() == 0


def _stock(module):
    """A stand-in for a DeepSpeed engine without Fair Cast: what served_weights reads (``module``, ``optimizer``)."""
    return type("E", (), {"module": module, "optimizer": None})()


def test_check_synced_compares_buffers_too():
    model = _tiny_llama()
    engine, trainer = engines.RolloutEngine(model, eos=10, pad=0), _trainer_copy(model)
    trainer.model.rotary_emb.inv_freq.mul_(1 + 2**-20)
    with pytest.raises(RuntimeError, match="'model.rotary_emb.inv_freq' differs .* in 8 of 8 elements"):
        engines.check_synced(_stock(trainer), engine, "here")


def test_rollout_engine_samples_the_full_softmax_whatever_the_models_generation_config_says():
    """A checkpoint's generation_config (suppress_tokens, repetition_penalty, min_p, ...) must not reshape
    the sampling distribution behind the recorded (raw softmax) log-probs."""
    model = _tiny_llama(suppress_tokens=[t for t in range(16) if t != 10], repetition_penalty=3.0, min_p=0.5)
    engine = engines.RolloutEngine(model, eos=10, pad=0)
    torch.manual_seed(0)
    roll = engine.generate([[5, 6, 7]] * 64, max_new_tokens=3)
    assert (roll["ids"][:, 3:][roll["mask"][:, 2:]] != 10).any()  # not only the unsuppressed EOS


def test_count_correct_on_an_empty_share_of_the_held_out_set():
    """A rank's share of a held-out set smaller than the world is empty: it scores 0, no generate([])."""
    task = rl_grpo.Task("tiny")
    engine = engines.RolloutEngine(_tiny_llama(vocab=256), eos=task.eos, pad=task.pad)
    data = task.problems(1, seed=0)
    assert rl_grpo.count_correct(engine, task, data, range(1, 1, 2), 4) == (0, [])
    right, completions = rl_grpo.count_correct(engine, task, data, range(0, 1, 2), 4)
    assert 0 <= right <= 1 and len(completions) == 1


@pytest.mark.parametrize("argv", [["--max-new-tokens", "0"], ["--tie-band", "-1"], ["--clip", "0"],
                                  ["--warm-steps", "-1"], ["--lr", "0"], ["--arms", "stochastic"],
                                  ["--minibatches", "3"], ["--digits", "10"],
                                  ["--terms", "2", "--digits", "3"]])  # "1998\n" needs 5 new tokens
def test_parse_args_rejects_bad_values_before_running(argv, capsys):
    with pytest.raises(SystemExit):
        rl_grpo.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def _launch(script, tmp_path, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
           "--model", "tiny", "--warm-steps", "0", "--pairs", "1", "--steps", "2", "--arms", ",".join(ARMS),
           # a random model earns no reward (zero advantages, zero gradients): weight decay alone moves
           # the masters (by ~1% = 1-3 bf16 ulps per step), so every cast serves new values each step; on pair
           # seed 0's shifted stream it earns none (on its independent stream one completion scores at step 1,
           # and the lr-1e-2 step then changes 98% of the FP8 codes, not the ~28% weight decay gives)
           "--streams", "shifted", "--lr", "1e-2", "--weight-decay", "1.0", "--eval-size", "8", "--eval-every", "1", "--save-masters",
           "--out-dir", str(tmp_path), *extra]
    env = dict(os.environ, **ENV)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


_RUNS: dict = {}


def _run(engine: str, tmp_path_factory):
    """One launch of every arm on ``engine`` per test session: (out dir, process, steps.csv rows)."""
    if engine not in _RUNS:
        out = tmp_path_factory.mktemp(f"rl_{engine}")
        proc = _launch(os.path.join(ROOT, "scripts", "rl_grpo.py"), out, "--engine", engine, "--arms",
                       ",".join(_arms(engine)))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out / "steps.csv") as f:
            _RUNS[engine] = (out, proc, list(csv.DictReader(f)))
    return _RUNS[engine]


@pytest.mark.timeout(1800)  # may run the shared launch (two vLLM engines)
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_rl_loop_serves_the_trainers_bf16_model_and_shares_rollouts_within_a_pair(tmp_path_factory, engine):
    tmp_path, proc, rows = _run(engine, tmp_path_factory)
    assert "Rollout engine == trainer bf16 model, bit for bit, after every sync: True" in proc.stdout
    arms = _arms(engine)
    assert [(r["arm"], r["step"]) for r in rows] == [(a, str(s)) for a in arms for s in (0, 1, 2)]
    first = {r["arm"]: r["rollout_sha"] for r in rows if r["step"] == "1" and r["arm"] in ARMS}
    assert len(first) == len(ARMS) and len(set(first.values())) == 1, first  # same first rollouts, the oracle's too
    assert ("Step-1 rollouts (every rank's) identical across all bf16 arms within every pair, the fp32 oracle "
            "included: True") in proc.stdout
    oracle = [r for r in rows if r["arm"] == "fp32" and r["step"] != "0"]  # served = the master, unrounded
    assert all(float(r["gap_ulps"]) == 0 and float(r["logp_gap"]) == 0 and r["lag_steps"] == "0" for r in oracle)
    for r in rows:
        if r["step"] != "0":
            assert 0 <= float(r["reward"]) <= 1 and float(r["kl"]) >= 0 and 0 <= float(r["changed_pct"]) <= 100
    assert all(float(r["changed_pct"]) > 0 for r in rows if r["step"] == "1")
    # every arm's masters start from the same (bf16-exact) weights: DeepSpeed's bf16 arms round them, so the oracle's too
    assert len({r["master_sha"] for r in rows if r["step"] == "0"}) == 1
    # the engine's sampling log-probs are the trainer's forward of the same bf16 weights up to kernel noise
    # (vLLM: ~1e-3; FP8 arms, FP8 weights and activations against the trainer's bf16: ~6e-3 here; an off-by-one
    # position or a stale tied head gives 0.1-10)
    assert all(0 <= float(r["engine_dlogp"]) < 0.02 for r in rows if r["step"] != "0")
    if engine == "vllm":  # a full sync sends every element once and rewrites each into the engine once
        # bytes: bf16 2, fp32 4 per element; FP8: 73,728 linear-weight elements of 1 byte, 1,024 fp32 channel scales,
        # the other 16,704 elements (embedding, norms) bf16
        for arm, size in [*((a, 2 * 90432) for a in CASTS), ("fp32", 4 * 90432),
                          *((a, 73728 + 4 * 1024 + 2 * 16704) for a in FP8)]:
            sent = [r for r in rows if r["step"] != "0" and r["arm"] == arm]
            assert {r["payload_bytes"] for r in sent} == {r["engine_bytes"] for r in sent} == {str(size)}
        # E4M3 keeps 3 mantissa bits to bf16's 7: the same masters change fewer served weights (here ~28% vs ~100%)
        for a, b in zip((r for r in rows if r["arm"] == "fp8_nearest"), (r for r in rows if r["arm"] == "nearest")):
            assert a["step"] == "0" or 0 < float(a["changed_pct"]) < float(b["changed_pct"]) / 2, (a, b)
        assert "Into FP8, round-to-nearest changes" in proc.stdout
    for name in ("summary.csv", "summary.md", "curves.png"):
        assert os.path.getsize(tmp_path / name) > 100
    with open(tmp_path / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [r["arm"] for r in summary] == list(arms)
    assert {"score", "gain_lo", "gain_hi", "final_score", "final_gain", "lag_peak"} <= set(summary[0])
    # the regime the run was in, printed: round-to-nearest's churn and its peak lag
    nearest = [r for r in rows if r["arm"] == "nearest" and r["step"] != "0"]
    churn = sum(float(r["changed_pct"]) for r in nearest) / len(nearest)
    assert (f"Regime: round-to-nearest changes {churn:.2f}% of the served weights per step and its lag peaks at "
            f"{max(float(r['lag_steps']) for r in nearest):.1f} steps") in proc.stdout
    assert (f"Round-to-nearest's lag curve (steps behind the master, mean over pairs) at step 1: "
            f"{float(nearest[0]['lag_steps']):.1f}, 2: {float(nearest[1]['lag_steps']):.1f}.") in proc.stdout
    assert "recovery" in summary[0] and "the fp32 oracle's gain is" in proc.stdout


@pytest.mark.timeout(1800)  # may run the shared launch (two vLLM engines)
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_the_masters_are_scored_as_a_separate_fp32_forward_scores_them(tmp_path_factory, engine):
    """Each arm's last-step master_acc / master_eval_sha equal a plain greedy loop of full fp32 forwards (no
    generate(), no padding) over the held-out set on the final masters, which --save-masters wrote (the masters
    of that step: master_sha)."""
    from safetensors.torch import load_model
    from transformers import LlamaConfig, LlamaForCausalLM
    out, _, rows = _run(engine, tmp_path_factory)
    task = rl_grpo.Task("tiny")
    held = task.problems(8, seed=rl_grpo.EVAL_SEED, split="eval", distinct=True)
    for arm in _arms(engine):
        model = LlamaForCausalLM(LlamaConfig(**rl_grpo.TINY, eos_token_id=task.eos, pad_token_id=task.pad,
                                             bos_token_id=None)).eval()
        load_model(model, str(out / "pair_0" / f"masters_{arm}.safetensors"))
        last = [r for r in rows if r["arm"] == arm][-1]
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert rl_grpo.hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16] == last["master_sha"]
        completions = []
        with torch.no_grad():
            for e in held:
                ids = task.prompt(e)
                new = []
                while len(new) < 4 and (not new or new[-1] != task.eos):
                    new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
                completions.append(new)
        right = sum(task.reward(e, task.decode(c)) for e, c in zip(held, completions))
        assert float(last["master_acc"]) == 100.0 * right / len(held)
        digests = [rl_grpo.hashlib.sha256(json.dumps(completions[r::2]).encode()).hexdigest() for r in range(2)]
        assert last["master_eval_sha"] == rl_grpo.hashlib.sha256("".join(digests).encode()).hexdigest()[:16], arm


@pytest.mark.timeout(1800)  # may run the shared launch (two vLLM engines)
def test_the_oracle_arm_is_bitwise_deterministic_across_launches(tmp_path, tmp_path_factory):
    """The fp32 arm (fp32 DeepSpeed trainer, fp32 vLLM engine) run again in another launch, beside other
    arms: the same rollouts, rewards, held-out scores and master weights at every step."""
    _, _, rows = _run("vllm", tmp_path_factory)
    proc = _launch(os.path.join(ROOT, "scripts", "rl_grpo.py"), tmp_path, "--engine", "vllm", "--arms", "nearest,fp32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "steps.csv") as f:
        again = list(csv.DictReader(f))
    keys = ("step", "rollout_sha", "master_sha", "reward", "eval_acc")
    first = [tuple(r[k] for k in keys) for r in rows if r["arm"] == "fp32"]
    assert len(first) == 3 and all(r[2] for r in first[1:])
    assert first == [tuple(r[k] for k in keys) for r in again if r["arm"] == "fp32"]


@pytest.mark.slow
def test_rl_loop_stops_when_the_rollout_engine_is_not_sent_the_served_weights(tmp_path):
    """A planted bug (the engine gets RTN of the fp32 master, not what stochastic rounding served)."""
    proc = _launch(os.path.join(ROOT, "tests", "rl_planted_worker.py"), tmp_path)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "arm stochastic" in out and "differs from what the trainer serves" in out, out[-3000:]


@pytest.mark.slow
def test_rl_loop_smoke_on_the_real_model(tmp_path):
    """SmolLM2-135M-Instruct (make test installs the model package), one GRPO step per arm: the real model through
    the start (eval, full sync, read-back), one step (vLLM rollouts, rewards, the update, sync, read-back) and a
    held-out eval of the engine holding the trained weights; the tiny launches above run the loop's later steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "scripts", "rl_grpo.py"), "--model", "smollm2", "--pairs", "1", "--steps", "1",
           "--arms", "nearest,stochastic", "--prompts", "1", "--group", "2", "--max-new-tokens", "8",
           "--eval-size", "2", "--eval-every", "1", "--out-dir", str(tmp_path),
           # two completions of one prompt often earn equal rewards (no gradient): weight decay moves the masters
           # anyway (1e-6 of each weight per step, far below half a bf16 ulp: stochastic rounding serves some)
           "--weight-decay", "1.0"]
    env = dict(os.environ, **ENV)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Rollout engine == trainer bf16 model, bit for bit, after every sync: True" in proc.stdout
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["arm"], r["step"]) for r in rows] == [(a, str(s)) for a in ("nearest", "stochastic") for s in (0, 1)]
    trained = [r for r in rows if r["step"] != "0"]
    # lr 1e-6 on the real model: round-to-nearest changes well under 5% of the served weights per step
    # (0 in a step whose groups all got equal rewards: no gradient)
    assert all(0 <= float(r["changed_pct"]) < 5 for r in trained if r["arm"] == "nearest")
    assert any(float(r["changed_pct"]) > 0 for r in trained)
    assert all(float(r["kl"]) >= 0 and float(r["logp_gap"]) >= 0 for r in trained)


@pytest.mark.timeout(1800)  # may run the shared launch (two vLLM engines)
def test_merge_summarizes_launches_as_one_run_and_refuses_mixed_settings(tmp_path, tmp_path_factory):
    """--merge: a finished run's folder summarized again gives its summary exactly (steps.csv read back
    losslessly); folders run with other settings, or the same pair twice, are refused by name."""
    hf, _, _ = _run("hf", tmp_path_factory)
    vllm, _, _ = _run("vllm", tmp_path_factory)
    rl_grpo.main(["--merge", str(hf), "--out-dir", str(tmp_path)])
    assert (tmp_path / "summary.md").read_text() == (hf / "summary.md").read_text()
    assert (tmp_path / "steps.csv").read_text() == (hf / "steps.csv").read_text()
    rl_grpo.main(["--merge", str(hf / "pair_0"), "--out-dir", str(tmp_path / "pairs")])  # landed as the pair ended
    assert (tmp_path / "pairs" / "summary.md").read_text() == (hf / "summary.md").read_text()
    with pytest.raises(SystemExit, match=r"ran with engine='vllm', .* with 'hf'"):
        rl_grpo.load_runs([str(hf), str(vllm)])
    with pytest.raises(SystemExit, match="pair seed 0 was run in both"):
        rl_grpo.load_runs([str(hf), str(hf)])
    other = tmp_path / "other_start"  # the same settings, another starting policy (other versions or kernels)
    shutil.copytree(hf, other)
    saved = json.loads((other / "args.json").read_text())
    (other / "args.json").write_text(json.dumps({**saved, "init_sha": "0" * 16}))
    with pytest.raises(SystemExit, match=f"ran with init_sha='{'0' * 16}', .* with '{saved['init_sha']}'"):
        rl_grpo.load_runs([str(hf), str(other)])
    with pytest.raises(SystemExit, match="not a finished run's folder"):
        rl_grpo.load_runs([str(tmp_path / "nothing")])
    other = tmp_path / "world3"  # one step is world x prompts x group rollouts: another world is another run
    shutil.copytree(hf, other)
    (other / "args.json").write_text(json.dumps({**saved, "world": 3}))
    with pytest.raises(SystemExit, match="ran with world=3, .* with 2"):
        rl_grpo.load_runs([str(hf), str(other)])
    # a folder from before a setting existed (no fp8_ue8m0 in its args.json) ran with its default
    assert saved["fp8_ue8m0"] is False
    header = (hf / "steps.csv").read_text().splitlines()[0] + "\n"  # (no pairs: none run twice)
    for name, value in (("before_ue8m0", None), ("ue8m0", True)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "steps.csv").write_text(header)
        (tmp_path / name / "args.json").write_text(json.dumps(
            {k: v for k, v in {**saved, "fp8_ue8m0": value}.items() if v is not None}))
    rl_grpo.load_runs([str(hf), str(tmp_path / "before_ue8m0")])
    with pytest.raises(SystemExit, match="ran with fp8_ue8m0=True, .* with False"):
        rl_grpo.load_runs([str(hf), str(tmp_path / "ue8m0")])
    with pytest.raises(SystemExit, match="is one of the folders merged"):
        rl_grpo.main(["--merge", str(hf / "pair_0"), "--out-dir", str(hf / "pair_0")])
    old = tmp_path / "before_master_scoring"  # a run from before masters were scored: no master columns
    old.mkdir()
    shutil.copy(hf / "args.json", old / "args.json")
    with open(hf / "steps.csv") as f, open(old / "steps.csv", "w", newline="") as g:
        rows = list(csv.DictReader(f))
        fields = [k for k in rows[0] if k not in ("master_acc", "master_eval_sha")]
        w = csv.DictWriter(g, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    rl_grpo.main(["--merge", str(old), "--out-dir", str(tmp_path / "old_merged")])
    assert "| nearest | " in (tmp_path / "old_merged" / "summary.md").read_text()
    assert " | n/a | " in (tmp_path / "old_merged" / "summary.md").read_text()
    with pytest.raises(SystemExit, match="not a finished run's folder"):  # `--merge runs/x/*` over a merged x
        rl_grpo.load_runs([str(tmp_path / "steps.csv")])
    fewer = tmp_path / "fewer_arms"  # another launch, pair 1, without error_feedback: each arm on the pairs it ran
    fewer.mkdir()
    (fewer / "args.json").write_text(json.dumps({**saved, "seed": 1, "arms": [a for a in ARMS if a != "error_feedback"]}))
    with open(hf / "steps.csv") as f, open(fewer / "steps.csv", "w", newline="") as g:
        rows = [{**r, "pair_seed": "1"} for r in csv.DictReader(f) if r["arm"] != "error_feedback"]
        w = csv.DictWriter(g, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    rl_grpo.main(["--merge", str(fewer), str(hf), "--out-dir", str(tmp_path / "mixed")])
    with open(tmp_path / "mixed" / "summary.csv") as f:
        pairs = {r["arm"]: r["pairs"] for r in csv.DictReader(f)}
    assert pairs == {"nearest": "2", "stochastic": "2", "error_feedback": "1", "fp32": "2"}


def test_nearby_seeds_draw_independent_problem_streams():
    """Pairs s and s + 1 train on streams that share no more problems than two random draws from the problem space
    do (chain_sum, 4 terms of one digit: 80,000 expressions, about n**2 / 80,000 shared); the old ``shifted``
    streams are reasoning-gym's seeds themselves, one problem apart (2,399 of 2,400 shared: the bug)."""
    task = rl_grpo.Task("tiny")
    n = 2400

    def drawn(seed, streams):
        return {e["metadata"]["expression"] for e in task.problems(n, seed=rl_grpo.stream_seed(seed, streams))}
    chance = n * n / 80_000  # ~72
    for s in (0, 600):
        shared = len(drawn(s, "independent") & drawn(s + 1, "independent"))
        assert shared < 3 * chance, f"seeds {s}, {s + 1}: {shared} shared problems (chance ~{chance:.0f})"
    a, b = drawn(600, "shifted"), drawn(601, "shifted")
    assert len(a & b) > 0.98 * min(len(a), len(b))
    assert rl_grpo.stream_seed(600, "shifted") == 600 and rl_grpo.stream_seed(600) != rl_grpo.stream_seed(601)


def test_merge_reads_old_folders_as_shifted_streams_and_reports_the_hosts(tmp_path, capsys):
    """A folder without ``streams`` in its args.json ran shifted streams: merging it with an independent one is
    refused by name; folders from two hosts merge, and the merge says which ISAs it joined."""
    import json
    fields = ["pair_seed", "arm", "step", "eval_acc"]

    def folder(name, seed, **saved):
        d = tmp_path / name
        d.mkdir()
        (d / "args.json").write_text(json.dumps({**vars(rl_grpo.parse_args([])), "seed": seed, **saved}))
        (d / "steps.csv").write_text(",".join(fields) + "\n" + f"{seed},nearest,0,40.0\n")
        return str(d)
    old = folder("old", 1)
    args = json.loads((tmp_path / "old" / "args.json").read_text())
    del args["streams"]
    (tmp_path / "old" / "args.json").write_text(json.dumps(args))
    host = lambda flags: {"model": "cpu", "flags": flags, "torch_cpu_capability": "AVX512"}  # noqa: E731
    new = [folder("a", 2, host_isa=host(["avx512_bf16"])), folder("b", 3, host_isa=host(["amx_bf16"]))]
    with pytest.raises(SystemExit, match="old ran with streams='shifted', .* with 'independent'"):
        rl_grpo.load_runs([new[0], old])
    _, settings = rl_grpo.load_runs(new)
    assert len(settings["hosts"]) == 2 and settings["hosts_unknown"] == 0
