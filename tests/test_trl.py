"""TRL as a tested integration: ``scripts/trl_grpo.py`` (TRL 1.16 ``GRPOTrainer``, DeepSpeed ZeRO-2 /
ZeRO-3, bf16, a reference model (beta > 0), Fair Cast from the ``"export_cast"`` config section and
``deepspeed_hooks.patch_deepspeed()``) under torchrun, 2 real gloo ranks, a few GRPO steps.

Each launch is cached (one launch per configuration for the whole module); the script saves a
record per rank after training (served bf16 params, fp32 masters, residuals, what TRL's vLLM
weight sync would send, the reference model's params; see ``trl_grpo.record``).
"""
import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from helpers import aborted_after_reporting, bits

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # six launches of ~30 s each on 2 cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "trl_grpo.py")
STEPS = 3
TMP = tempfile.mkdtemp(prefix="faircast_trl_")
atexit.register(shutil.rmtree, TMP, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def launch(stage: int | str, method: str, stock: bool = False, steps: int = STEPS, save_steps: int = 0,
           resume_from: str | None = None):
    """Run the script on 2 ranks (``stage``: 2 or 3, ZeRO; ``"fsdp2"``: FSDP2); (output dir,
    [record of rank 0, rank 1], the launch's output)."""
    out = os.path.join(TMP, f"z{stage}_{'stock' if stock else method}_{steps}_{save_steps}_{bool(resume_from)}")
    shutil.rmtree(out, ignore_errors=True)  # a failed launch is not cached: a later test launches it afresh
    os.makedirs(out)
    backend = ["--fsdp2"] if stage == "fsdp2" else ["--zero-stage", str(stage)]
    argv = [*backend, "--method", method, "--steps", str(steps), "--output-dir", out]
    if stock:
        argv.append("--stock")
    if save_steps:
        argv += ["--save-steps", str(save_steps)]
    if resume_from:  # a copy of another run's checkpoint: this run resumes from it (--resume = latest in out)
        shutil.copytree(resume_from, os.path.join(out, os.path.basename(resume_from)))
        argv.append("--resume")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, *argv]
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))  # this checkout's packages
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    paths = [os.path.join(out, f"record_rank{r}.pt") for r in range(2)]
    assert proc.returncode == 0 or aborted_after_reporting(log, paths), log[-6000:]
    records = [torch.load(p, weights_only=False) for p in paths]
    return out, records, log


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for n in a:
        assert torch.equal(bits(a[n]), bits(b[n])), n


def differs_from_rtn(rec) -> int:
    """Elements whose served bf16 value is not the master rounded to nearest."""
    return sum(int((bits(s) != bits(rec["master"][n].to(torch.bfloat16))).sum()) for n, s in rec["served"].items())


def initial_weights(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "model", "model.safetensors"))


@pytest.mark.parametrize("stage", [2, 3])
def test_stochastic_serves_other_than_round_to_nearest_and_trl_sync_sends_the_served_weights(stage):
    out, (rec, rec1), log = launch(stage, "stochastic")
    assert differs_from_rtn(rec) > 0.02 * sum(t.numel() for t in rec["served"].values())
    assert rec["caster"] == "stochastic"  # the policy engine's optimizer has export_cast
    assert rec["global_step"] == rec["export_step"] == STEPS
    assert f"export cast uses stochastic (seed 1234) on {rec['optimizer']}" in log
    # what TRL's own vLLM sync (VLLMGeneration._iter_named_params) sends == served_weights(engine)
    assert_same(rec["trl_sync"], rec["served"])
    assert_same(rec1["served"], rec["served"])  # both ranks see the same full model
    assert_same(rec1["master"], rec["master"])


@pytest.mark.parametrize("stage", [2, 3])
def test_reference_model_is_left_stock(stage):
    """TRL's reference model (trl/models/utils.py prepare_deepspeed: the training config, no optimizer,
    stage 0 unless ZeRO-3) is not cast: no export_cast, and its bf16 params are the initial fp32
    weights rounded to nearest, untouched by training."""
    out, (rec, _), log = launch(stage, "stochastic")
    assert not rec["ref_has_caster"]
    assert "Fair Cast: left stock (round-to-nearest) on this engine: no optimizer" in log
    init = initial_weights(out)
    assert_same(rec["ref"], {n: t.to(torch.bfloat16) for n, t in init.items()})


def test_mode_nearest_is_stock_deepspeed_bit_for_bit():
    _, (nearest, _), _ = launch(2, "nearest")
    _, (stock, _), _ = launch(2, "nearest", stock=True)
    assert nearest["caster"] is None and stock["caster"] is None
    assert differs_from_rtn(nearest) == 0
    assert_same(nearest["served"], stock["served"])
    assert_same(nearest["master"], stock["master"])
    assert_same(nearest["trl_sync"], nearest["served"])


def test_error_feedback_checkpoint_resume_equals_uninterrupted_zero3():
    """HF Trainer checkpoints (save_steps=2, DeepSpeed save_checkpoint underneath) and
    resume_from_checkpoint (load_checkpoint) give the uninterrupted run's final served params,
    masters and residuals bit for bit (ZeRO-3: DeepSpeed alone re-rounds a load to nearest)."""
    out, (full, _), _ = launch(3, "error_feedback", steps=4, save_steps=2)
    _, (resumed, _), log = launch(3, "error_feedback", steps=4, save_steps=2,
                                  resume_from=os.path.join(out, "checkpoint-2"))
    assert os.path.basename(resumed["resumed_from"]) == "checkpoint-2" and full["resumed_from"] is None
    assert (full["steps_run"], resumed["steps_run"]) == (4, 2)  # the resumed run did not redo steps 1-2
    assert full["caster"] == resumed["caster"] == "error_feedback"
    assert full["export_step"] == resumed["export_step"] == 4
    assert sum(int((r != 0).sum()) for r in full["residual"].values()) > 0  # residuals carry something
    for key in ("served", "master", "residual", "trl_sync"):
        assert_same(resumed[key], full[key])
    assert_same(full["trl_sync"], full["served"])


def reference_served(rec) -> dict:
    """faircast's reference stochastic cast of each final master at the final export step."""
    from faircast_dist import derive_key
    from faircast_dist.rounding import cast_stochastic
    return {n: cast_stochastic(m, derive_key(1234, rec["export_step"], n), 0) for n, m in rec["master"].items()}


def test_fsdp2_policy_computes_and_serves_the_reference_cast_and_trl_sync_sends_it():
    """TRL on FSDP2 (accelerate's fully_shard of every decoder layer, the tail group and the root):
    the served model is the reference cast of the masters at the export step (= the global step),
    TRL's vLLM sync (with fair_fsdp2_params) sends exactly it, on both ranks."""
    out, (rec, rec1), log = launch("fsdp2", "stochastic")
    assert rec["caster"] == "stochastic" and rec["global_step"] == rec["export_step"] == STEPS
    assert "Fair Cast: FSDP2 bf16 all-gather inputs and served weights use stochastic (seed 1234)" in log
    assert list(rec["served"]) == list(rec["master"])  # every param once (accelerate groups norm + head)
    assert_same(rec["served"], reference_served(rec))
    assert differs_from_rtn(rec) > 0.02 * sum(t.numel() for t in rec["served"].values())
    assert_same(rec["trl_sync"], rec["served"])
    assert_same(rec1["served"], rec["served"])
    assert not rec["ref_has_caster"]
    init = initial_weights(out)
    assert_same(rec["ref"], init)  # the reference model's fp32 weights, untouched


def test_fsdp2_stock_trl_sync_sends_fp32_masters():
    """Without Fair Cast TRL's FSDP2 sync sends each fp32 master (vLLM then rounds it to nearest)."""
    _, (rec, _), _ = launch("fsdp2", "nearest", stock=True)
    assert rec["caster"] is None and rec["served"] == {}
    assert_same(rec["trl_sync"], rec["master"])


def test_fsdp2_error_feedback_checkpoint_resume_equals_uninterrupted():
    """HF Trainer checkpoints under FSDP2 with FairCastFSDP2 (export state in checkpoint-N/export_cast,
    DCP) resume bit for bit: served, masters, residuals and what TRL's sync sends."""
    out, (full, _), _ = launch("fsdp2", "error_feedback", steps=4, save_steps=2)
    _, (resumed, _), _ = launch("fsdp2", "error_feedback", steps=4, save_steps=2,
                                resume_from=os.path.join(out, "checkpoint-2"))
    assert (full["steps_run"], resumed["steps_run"]) == (4, 2)
    assert full["export_step"] == resumed["export_step"] == 4
    assert sum(int((r != 0).sum()) for r in full["residual"].values()) > 0
    for key in ("served", "master", "residual", "trl_sync"):
        assert_same(resumed[key], full[key])


def test_a_failed_launch_is_relaunched_into_a_clean_directory():
    """A failed launch is not cached: the next test that needs it launches again (CI once lost a second test to
    ``os.makedirs`` on the first's directory, hiding what failed)."""
    for _ in range(2):  # --zero-stage 4: refused by the script's argparse, on every launch
        with pytest.raises(AssertionError, match="--zero-stage"):
            launch(4, "stochastic")
