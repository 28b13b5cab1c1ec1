"""The Megatron main job end to end under torchrun (2 ranks, TP=2) on the tiny model (3 KV groups,
padded to 4 for TP): same code path as the SmolLM2 run."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "demo_megatron.py")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("method, trainer_cast", [("stochastic", "stochastic"), ("error-feedback", "error_feedback")])
def test_megatron_demo_runs_and_trainer_matches_its_side_by_side_export(method, trainer_cast, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
           "--model", "tiny", "--steps", "2", "--tensor-model-parallel-size", "2", "--export-cast", "fair",
           "--export-cast-method", method, "--export-cast-seed", "77", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "Megatron: TP=2 PP=1 DP=1, DistributedOptimizer" in out
    assert f"The trainer's own bf16 weights used: {trainer_cast}" in out
    # the TP-sharded Megatron trainer served exactly what the single-process exporter computes
    assert f"bit-identical to the side-by-side {trainer_cast} export at every step: True" in out
    assert "KV-group padding for TP still exactly zero in the master at every step: True" in out
    assert "Trainer's own telemetry (megatron_patches.drift_metrics" in out
    with open(tmp_path / "telemetry.csv") as f:
        rows = list(csv.DictReader(f))
    arms = ["nearest", "stochastic", "error_feedback", "dithered", "fp8_nearest", "fp8_dithered"]
    assert [(r["step"], r["method"]) for r in rows] == [(str(s), m) for s in (1, 2) for m in arms]
    assert all(float(r["gap_ulps"]) >= 0 and 0 <= float(r["changed_pct"]) <= 100 for r in rows)
    assert any(float(r["changed_pct"]) > 0 for r in rows) and all(float(r["loss"]) > 0 for r in rows)
    assert os.path.getsize(tmp_path / "telemetry.png") > 10_000
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method") and "changed %" in line)
    assert [line.split()[0] for line in lines[header + 2:header + 8]] == arms
    assert "delta % full" in lines[header]


def test_megatron_demo_refuses_fair_without_bf16_naming_the_flag():
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--no-bf16", "--export-cast", "fair"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--export-cast fair needs --bf16" in proc.stderr


def test_megatron_demo_device_cuda_without_a_gpu_is_a_clear_error():
    env = dict(ENV, CUDA_VISIBLE_DEVICES="", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--device", "cuda"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--device cuda: no CUDA device is visible" in proc.stderr
