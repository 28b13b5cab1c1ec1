"""``faircast-run``, Fair Cast from the environment (the launcher: it sits outside the framework-free
core, since its start-up hook imports the adapters): the export cast on in every process a launch starts, with no
edit to the launch script or the framework config (as ``ddtrace-run`` / ``opentelemetry-instrument``
do for tracing)::

    FAIRCAST_EXPORT_CAST='{"mode": "fair", "method": "stochastic", "seed": 1234}' \\
        faircast-run torchrun --nproc_per_node 8 train.py ...
    faircast-run --export-cast '{"mode": "fair"}' accelerate launch train.py ...   # the same

``faircast-run`` puts ``faircast_run/startup`` first on ``PYTHONPATH`` and runs the command; its
``sitecustomize.py`` then runs at the start of every Python process below it (torchrun, accelerate
and mpirun workers inherit the environment). With ``FAIRCAST_EXPORT_CAST`` set:

* DeepSpeed: ``deepspeed.initialize`` is patched as by ``deepspeed_hooks.patch_deepspeed()`` the
  moment DeepSpeed is imported, and a DeepSpeed config without an ``"export_cast"`` section gets
  the variable's (a config that has one keeps its own). Engines without an optimizer (reference,
  reward models) stay stock either way.
* Megatron: ``megatron_patches.activate()`` the moment ``megatron.core.optimizer`` is imported
  (every optimizer ``get_megatron_optimizer`` builds). Its ``--export-cast*`` flags default to the
  variable's config: a flag given on the command line wins, the parsed arguments Megatron-LM prints
  are what runs, and a flag that differs from the variable is warned about. Without Megatron-LM's
  parsed arguments (megatron-core code building its own optimizers) the variable is the config.

One rule for every adapter: what the run's own configuration says explicitly (a DeepSpeed config's
section, a Megatron flag on the command line) wins over the variable, which fills the rest.

The value is the ``export_cast`` section as JSON, or a bare mode (``fair``). Unset, nothing is
installed and start-up costs one environment lookup. Ray actors do not inherit the driver's
environment: pass both variables in the runtime environment (``faircast-run --print-env`` prints
them), e.g. ``ray job submit --runtime-env-json '{"env_vars": {...}}'`` (OpenRLHF) or
``+ray_kwargs.ray_init.runtime_env.env_vars.NAME=value`` (verl); the path must exist on every node.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from faircast_dist.config import ENV, ConfigError, env_config

STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")


def launch_env(export_cast: str | None = None, environ=os.environ) -> dict[str, str]:
    """The two variables a process needs for :mod:`faircast_run`: ``PYTHONPATH`` with the
    start-up directory first, and ``FAIRCAST_EXPORT_CAST`` (``export_cast``, else ``environ``'s)."""
    path = [STARTUP_DIR] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != STARTUP_DIR]
    env = {"PYTHONPATH": os.pathsep.join(path)}
    value = export_cast if export_cast is not None else environ.get(ENV)
    if value:
        env[ENV] = value
    return env


def main(argv=None) -> None:
    """``faircast-run``: run a command with Fair Cast on in every Python process it starts."""
    p = argparse.ArgumentParser(prog="faircast-run", description=__doc__.split("::")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export-cast", metavar="JSON", help=f"the export_cast section (default: ${ENV})")
    p.add_argument("--print-env", action="store_true",
                   help="print the variables as JSON (for a Ray runtime_env's env_vars) and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launch command, e.g. torchrun ... train.py")
    args = p.parse_args(argv)
    env = launch_env(args.export_cast)
    if ENV not in env:
        p.error(f"set {ENV} or pass --export-cast")
    try:
        env_config(env)  # a bad value fails here, before anything is launched
    except (ConfigError, TypeError) as err:
        p.error(str(err))
    if args.print_env:
        print(json.dumps(env))
        return
    if not args.command:
        p.error("no command to run")
    os.environ.update(env)
    os.execvp(args.command[0], args.command)


if __name__ == "__main__":
    main(sys.argv[1:])
