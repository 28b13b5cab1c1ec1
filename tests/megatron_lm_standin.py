"""Stand-ins for the parts of Megatron-LM's ``megatron.training`` that ``megatron_patches.activate()``
uses (the package is not in the megatron-core wheel), shared by the single-process tests and the
multi-rank worker:

* ``arguments.add_megatron_arguments`` (the Megatron-LM flags we read: ``--bf16``,
  ``--tensorboard-dir``, ``--wandb-project``, ``--log-interval``, ``--tensorboard-log-interval``) and
  ``parse_args(extra_args_provider=None, ignore_unknown_args=False)`` with Megatron-LM's signature,
  order of calls (``add_megatron_arguments``, then the script's ``extra_args_provider``) and input
  (``sys.argv[1:]``; :func:`parse` sets it for one call);
* ``global_vars``: ``get_args`` (set by the test) and the TensorBoard / W&B writers, which exist
  where Megatron-LM makes them (with ``--tensorboard-dir`` / ``--wandb-project``; here on rank 0)
  and record what they are given in ``written`` as ``("tb" | "wandb", name, value, step)``;
* ``training``: ``get_megatron_optimizer`` imported by name and ``training_log`` with Megatron-LM's
  signature (``megatron/training/training.py`` at ``core_v0.16.1``: ``iteration`` 4th, then
  ``max_attention_logit``, ``pg_collection``, ``is_first_iteration``), which ``train()`` calls on every
  rank after every iteration.
"""
from __future__ import annotations

import argparse
import sys
import types


def parse(fake: types.SimpleNamespace, argv: list[str], extra_args_provider=None):
    """``fake.arguments.parse_args(extra_args_provider)`` with ``sys.argv[1:]`` = ``argv`` for the call
    (Megatron-LM parses the command line)."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt.py", *argv]
    try:
        return fake.arguments.parse_args(extra_args_provider)
    finally:
        sys.argv = saved


def modules(register: bool = False) -> types.SimpleNamespace:
    """Fresh stand-in modules; ``.sys_modules`` maps their import names to them (put them in
    ``sys.modules`` and set ``megatron.training``); ``.written`` is the writers' record.
    ``register``: do that here, before ``megatron.core.optimizer`` is first imported (the order of a
    Megatron-LM launch script, which ``faircast-run``'s import hook sees)."""
    import torch

    package = types.ModuleType("megatron.training")
    package.__path__ = []
    arguments = types.ModuleType("megatron.training.arguments")
    global_vars = types.ModuleType("megatron.training.global_vars")
    training = types.ModuleType("megatron.training.training")
    written = []

    def add_megatron_arguments(parser):
        parser.add_argument("--bf16", action="store_true")
        parser.add_argument("--tensorboard-dir")
        parser.add_argument("--wandb-project")
        parser.add_argument("--log-interval", type=int, default=100)
        parser.add_argument("--tensorboard-log-interval", type=int, default=1)
        return parser

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
        parser = arguments.add_megatron_arguments(parser)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()

    class Writer:
        def add_scalar(self, name, value, step):
            written.append(("tb", name, value, step))

    class Wandb:
        def log(self, values, step):
            written.extend(("wandb", name, value, step) for name, value in values.items())

    def first():
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit,
                     pg_collection=None, is_first_iteration=False):
        return report_memory_flag  # Megatron-LM writes its own scalars here

    arguments.add_megatron_arguments, arguments.parse_args = add_megatron_arguments, parse_args
    global_vars.get_args = None
    global_vars.get_tensorboard_writer = lambda: Writer() if first() and global_vars.get_args().tensorboard_dir else None
    global_vars.get_wandb_writer = lambda: Wandb() if first() and global_vars.get_args().wandb_project else None
    training.training_log = training_log
    package.arguments, package.global_vars, package.training = arguments, global_vars, training
    fake = types.SimpleNamespace(
        package=package, arguments=arguments, global_vars=global_vars, training=training, written=written,
        sys_modules={"megatron.training": package, "megatron.training.arguments": arguments,
                     "megatron.training.global_vars": global_vars, "megatron.training.training": training})
    if register:
        import megatron
        sys.modules.update(fake.sys_modules)
        megatron.training = package
    import megatron.core.optimizer as core_optimizer
    training.get_megatron_optimizer = core_optimizer.get_megatron_optimizer  # imported by name, as Megatron-LM's
    return fake
