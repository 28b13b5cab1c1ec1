"""faircast-run / FAIRCAST_EXPORT_CAST: Fair Cast on from the environment, in real subprocesses
(the start-up hook runs at interpreter start, so only a fresh process shows it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import faircast_run
from faircast_dist import ExportCastConfig
from faircast_dist.config import ENV, ConfigError, env_config

TESTS = os.path.dirname(os.path.abspath(__file__))
FAIRCAST_RUN = os.path.join(os.path.dirname(sys.executable), "faircast-run")
SR7 = '{"mode": "fair", "method": "stochastic", "seed": 7}'


def launch(code: str, export_cast: str | None, extra_path: str | None = None, timeout: int = 600,
           stderr: bool = False):
    """``faircast-run python -c code`` (``export_cast`` None: the start-up hook on the path, no variable);
    its stdout (and stderr, with ``stderr``)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, TESTS) if p)
    if export_cast is None:
        env["PYTHONPATH"] = os.pathsep.join([faircast_run.STARTUP_DIR, env["PYTHONPATH"]])
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [FAIRCAST_RUN, "--export-cast", export_cast, sys.executable, "-c", code]
    out = subprocess.run(cmd, env=env, cwd=TESTS, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Error in sitecustomize" not in out.stderr, out.stderr[-3000:]
    return (out.stdout, out.stderr) if stderr else out.stdout


def test_env_config_takes_json_or_a_mode_and_names_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert env_config() is None
    monkeypatch.setenv(ENV, SR7)
    assert env_config() == ExportCastConfig(mode="fair", method="stochastic", seed=7)
    monkeypatch.setenv(ENV, "fair")
    assert env_config() == ExportCastConfig(mode="fair")
    monkeypatch.setenv(ENV, '{"mode": "fair", "methd": "stochastic"}')
    with pytest.raises(ConfigError, match=r"environment variable FAIRCAST_EXPORT_CAST=.*unknown key\(s\).*methd"):
        env_config()


def test_the_variable_fills_only_a_missing_deepspeed_section(monkeypatch):
    from deepspeed_hooks import parse_config
    monkeypatch.setenv(ENV, SR7)
    assert parse_config({}).method == "stochastic"
    assert parse_config({"export_cast": "nearest"}).enabled is False  # the config's own section wins


def test_faircast_run_turns_deepspeed_on_in_an_unedited_script():
    """A script calling stock ``deepspeed.initialize`` (no patch, no config key), two spawned ranks:
    every served element is the stochastic cast, and rank 0 prints the activation line once."""
    code = ("import ds_worker; r = ds_worker.run(2, export_cast=None, hook=None, steps=2)[0]; "
            "print('RESULT', r['method'], r['mismatch'], r['rtn_differs'] > 0)")
    out = launch(code, SR7)
    assert "RESULT stochastic 0 True" in out, out
    assert out.count("Fair Cast: master->bf16 export cast uses stochastic (seed 7)") == 1, out


def test_a_find_spec_probe_before_the_import_does_not_use_up_the_hook():
    """transformers and accelerate probe ``importlib.util.find_spec("deepspeed")`` before anything
    imports it (OpenRLHF's actors reach that first): the real import must still be patched."""
    code = ("import importlib.util; importlib.util.find_spec('deepspeed'); import deepspeed, deepspeed_hooks; "
            "print('RESULT', deepspeed.initialize is deepspeed_hooks.initialize)")
    assert "RESULT True" in launch(code, SR7)


def test_faircast_run_activates_megatron_before_its_function_is_bound_by_name():
    """verl binds ``get_megatron_optimizer`` under another name at import: it gets the wrapper."""
    code = ("from megatron.core.optimizer import get_megatron_optimizer as native; "
            "import megatron_patches; print('RESULT', getattr(native, '_faircast', False), "
            "megatron_patches._args_config().method)")
    assert "RESULT True stochastic" in launch(code, SR7)


def test_faircast_run_under_megatron_lms_arguments_runs_what_the_command_line_says():
    """faircast-run's own hook, Megatron-LM's order (``megatron.training`` importable before
    ``megatron.core.optimizer`` is first imported) and its ``parse_args`` reading ``sys.argv``:
    the flags given win over the variable, the parsed arguments show what runs, and rank 0 warns once."""
    code = ("import sys, megatron_lm_standin; fake = megatron_lm_standin.modules(register=True); import megatron_patches; "
            "sys.argv = ['pretrain_gpt.py', '--bf16', '--export-cast', 'fair', '--export-cast-method', 'error-feedback']; "
            "args = fake.arguments.parse_args(); fake.global_vars.get_args = lambda: args; "
            "print('ARGS', args.export_cast, args.export_cast_method, args.export_cast_seed); "
            "c = megatron_patches._args_config(); print('RUNS', c.mode, c.method, c.seed)")
    out, err = launch(code, SR7, stderr=True)
    assert "ARGS fair error_feedback 7" in out and "RUNS fair error_feedback 7" in out, out
    assert err.count("command line overrides FAIRCAST_EXPORT_CAST (which fills the rest)") == 1, err
    assert "--export-cast-method error_feedback (command line) over method stochastic" in err, err


def test_a_script_that_imports_the_adapters_first_is_turned_on():
    """``import deepspeed_hooks`` / ``import megatron_patches`` before the framework (the one-line
    activation's scripts, under faircast-run): the framework is first imported from inside the
    half-defined adapter, which is turned on once it is whole (it was an AttributeError at start-up)."""
    code = ("import deepspeed_hooks, megatron_patches, deepspeed; "
            "print('RESULT', deepspeed.initialize is deepspeed_hooks.initialize, megatron_patches._ACTIVE is not None)")
    assert "RESULT True True" in launch(code, SR7)


def test_faircast_run_turns_fsdp2_on_at_the_first_optimizer_step(monkeypatch):
    """Two spawned FSDP2 ranks whose script never calls fsdp_hooks (the start-up hook of faircast-run in
    each): the forward before the first step is stock round-to-nearest, every later one computes with
    and serves the reference cast at export steps 1, 2, ..., as with an explicit install."""
    import fsdp_worker
    from test_fsdp import assert_same, reference_exports
    for name, value in faircast_run.launch_env(SR7).items():
        monkeypatch.setenv(name, value)
    (rec,) = fsdp_worker.run(2, [{"fn": "train", "install": False, "export_cast": None, "steps": 3}])
    assert "error" not in rec, rec.get("traceback")
    snaps = rec["steps"] + [rec["final"]]
    assert "served" not in snaps[0]  # nothing installed before the first step
    assert [s["step"] for s in snaps[1:]] == [1, 2, 3]
    for k, (snap, ref) in enumerate(zip(snaps[1:], reference_exports("stochastic", snaps[1:]))):
        assert_same(snap["served"], ref, f"step {k + 1}")


def test_without_the_variable_nothing_is_installed_and_a_shadowed_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins; builtins.SHADOWED_RAN = True\n")
    code = ("import sys, builtins, deepspeed, deepspeed_hooks; "
            "print('RESULT', deepspeed.initialize is deepspeed_hooks.initialize, "
            "any(type(f).__name__ == 'AfterImport' for f in sys.meta_path), getattr(builtins, 'SHADOWED_RAN', False))")
    assert "RESULT False False True" in launch(code, None, extra_path=str(tmp_path))


def test_print_env_gives_what_a_ray_runtime_env_needs(capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv(ENV, raising=False)
    faircast_run.main(["--export-cast", SR7, "--print-env"])
    env = json.loads(capsys.readouterr().out)
    assert env == {"PYTHONPATH": os.pathsep.join([faircast_run.STARTUP_DIR, "/somewhere"]), ENV: SR7}
    with pytest.raises(SystemExit):
        faircast_run.main(["--export-cast", '{"mode": "fiar"}', "--print-env"])
    assert ENV not in os.environ  # printing changes nothing here (later tests spawn workers)
    assert "FAIRCAST_EXPORT_CAST='{\"mode\": \"fiar\"}': export_cast.mode must be one of" in capsys.readouterr().err
