"""The main job, end to end under torchrun (2 ranks), on the tiny model: same code path as make demo."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("trainer_cast", ["stochastic", "error_feedback"])
def test_demo_runs_and_trainer_matches_its_side_by_side_export(trainer_cast, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "scripts", "demo_deepspeed.py"), "--model", "tiny", "--steps", "3",
           "--trainer-cast", trainer_cast, "--out-dir", str(tmp_path)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"The trainer's own bf16 weights used: {trainer_cast}" in out
    # the DeepSpeed-sharded trainer served exactly what the single-process exporter computes
    assert f"bit-identical to the side-by-side {trainer_cast} export at every step: True" in out
    with open(tmp_path / "telemetry.csv") as f:
        rows = list(csv.DictReader(f))
    arms = ("nearest", "stochastic", "error_feedback", "dithered", "fp8_nearest", "fp8_dithered")
    assert [(r["step"], r["method"]) for r in rows] == [(str(s), m) for s in (1, 2, 3) for m in arms]
    assert all(float(r["gap_ulps"]) >= 0 and 0 <= float(r["changed_pct"]) <= 100 for r in rows)
    # delta payload: an int32 index and a bf16 value (6 bytes) per changed element vs 2 bytes per element
    assert all(float(r["delta_pct"]) == pytest.approx(3 * float(r["changed_pct"]), rel=1e-9)
               for r in rows if not r["method"].startswith("fp8"))
    # FP8: an int32 index and an E4M3 byte (5 bytes) per changed element vs 1 byte per element, plus 8 bytes per
    # changed scale against 4 per scale (so at most 1 + 4 / K times 5x changed: K >= 64 here)
    fp8 = [r for r in rows if r["method"].startswith("fp8")]
    assert all(5 * float(r["changed_pct"]) <= float(r["delta_pct"]) * 1.1 for r in fp8)
    assert all(0 < float(r["gap_ulps"]) and float(r["logp_gap"]) > 0 for r in fp8)
    assert [int(r["lag_steps"]) for r in fp8 if r["method"] == "fp8_dithered"][-1] == 0  # dithered FP8 keeps up
    assert os.path.getsize(tmp_path / "telemetry.png") > 10_000
    for m in arms:
        assert any(line.startswith(m) for line in out.splitlines())
    assert "fp8_* rows: the FP8 E4M3 copy" in out


def test_a_model_without_fp8_params_has_no_fp8_rows():
    """The side-by-side exports of a model whose params all stay bf16 (an embedding and a head): the bf16 rows only."""
    import types

    import torch
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from fair_demo_common import METHODS, Exports

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.lm_head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False)

        def forward(self, ids):
            return types.SimpleNamespace(logits=self.lm_head(self.embed_tokens(ids)))
    model = Model()
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(32, (2, 9), generator=torch.Generator().manual_seed(0))
    exports = Exports(list(master), master, 7, 3, 64, model, (ids, ids))
    assert exports.fp8_arms == {}
    assert list(exports.step({n: t + 1e-3 for n, t in master.items()})) == list(METHODS)


def test_device_cuda_without_a_gpu_is_a_clear_error():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo_deepspeed.py"), "--device", "cuda",
                           "--model", "tiny"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--device cuda: no CUDA device is visible" in proc.stderr
