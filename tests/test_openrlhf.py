"""OpenRLHF 0.11.2, unedited, under ``faircast-run``: its ``DeepspeedStrategy`` + ``Actor`` (as
``PolicyModelActor`` builds them) train one step on ZeRO-2 and ZeRO-3 in two torchrun ranks, and
the reference model (as ``ReferenceModelActor`` builds it) stays stock. Fair Cast comes only from
``FAIRCAST_EXPORT_CAST``: no ``patch_deepspeed()``, no ``export_cast`` key (tests/openrlhf_worker.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
BIN = os.path.dirname(sys.executable)
FAIRCAST_RUN = os.path.join(BIN, "faircast-run")
SR7 = '{"mode": "fair", "method": "stochastic", "seed": 7}'
ACTIVATED = "Fair Cast: master->bf16 export cast uses stochastic (seed 7) on {}, replacing its round-to-nearest"
LEFT_STOCK = "Fair Cast: left stock (round-to-nearest) on this engine: "

pytestmark = pytest.mark.skipif(importlib.util.find_spec("openrlhf") is None,
                                reason="openrlhf not installed (make .venv/.openrlhf: openrlhf==0.11.2 --no-deps)")


def _env(export_cast: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FAIRCAST_EXPORT_CAST"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, TESTS]), DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", HF_HUB_OFFLINE="1")
    if export_cast is not None:
        env["FAIRCAST_EXPORT_CAST"] = export_cast
    return env


def launch(out_dir: str, export_cast: str | None = SR7, ranks: int = 2) -> str:
    """The worker under torchrun (under ``faircast-run`` when ``export_cast`` is given); its stdout."""
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", str(ranks),
           os.path.join(TESTS, "openrlhf_worker.py"), out_dir, "2", "3"]
    if export_cast is not None:
        cmd = [FAIRCAST_RUN] + cmd
    out = subprocess.run(cmd, env=_env(export_cast), cwd=out_dir, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def check_fair(stdout: str) -> dict[int, dict]:
    """What the run must show with Fair Cast on (also used on a stock run, to see it fail)."""
    records = {r["stage"]: r for r in (json.loads(line[len("RECORD "):]) for line in stdout.splitlines()
                                       if line.startswith("RECORD "))}
    assert sorted(records) == [2, 3], stdout
    for stage, optimizer, ref_optimizer in ((2, "DeepSpeedZeroOptimizer", "BF16_Optimizer"),
                                            (3, "DeepSpeedZeroOptimizer_Stage3", "DeepSpeedZeRoOffload")):
        r = records[stage]
        assert (r["zero_stage"], r["optimizer"]) == (stage, optimizer), r
        assert (r["export_caster"], r["method"], r["seed"]) == ("FairCaster", "stochastic", 7), r
        assert r["mismatch"] == 0, r  # every served element is faircast's reference cast of its master
        assert r["rtn_differs"] > 0, r  # ... and not DeepSpeed's round-to-nearest of it
        # what broadcast_to_vllm sends (param.data, gathered under ZeRO-3) is served_weights(engine)
        assert r["broadcast_names_equal"] and r["broadcast_equal_served_weights"] and r["served_equal_broadcast"], r
        # the reference model: no optimizer, left stock, the initial weights in bf16
        assert (r["ref_zero_stage"], r["ref_optimizer"]) == ((3 if stage == 3 else 0), ref_optimizer), r
        assert not r["ref_export_cast"] and r["ref_equal_initial_bf16"], r
        assert stdout.count(ACTIVATED.format(optimizer)) == 1, stdout  # the activation line, rank 0 only
    assert stdout.count(LEFT_STOCK) == 2, stdout  # once per stage: the reference engine
    assert stdout.count(LEFT_STOCK + "no optimizer (BF16_Optimizer over DeepSpeed's DummyOptim)") == 1, stdout
    assert stdout.count(LEFT_STOCK + "no optimizer (ZeRO-3 DeepSpeedZeRoOffload)") == 1, stdout
    return records


def test_openrlhf_strategy_and_actor_unedited_under_faircast_run(tmp_path):
    check_fair(launch(str(tmp_path)))


def test_the_hook_survives_openrlhf_import_order(tmp_path):
    """``openrlhf/trainer/ray/ppo_actor.py`` (what a Ray actor imports) reaches ``openrlhf.utils``
    (via ``trainer/ray/vllm_engine.py`` -> ``openrlhf.utils.agent``) before its ``import deepspeed``."""
    code = ("import openrlhf.utils, deepspeed, deepspeed_hooks; "
            "print('PATCHED', deepspeed.initialize is deepspeed_hooks.initialize)")
    out = subprocess.run([FAIRCAST_RUN, sys.executable, "-c", code], env=_env(SR7), cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PATCHED True" in out.stdout, out.stdout + out.stderr[-2000:]
