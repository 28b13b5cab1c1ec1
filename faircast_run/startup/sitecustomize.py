"""Fair Cast's start-up hook, on ``PYTHONPATH`` by ``faircast-run`` (see :mod:`faircast_run`).

With ``FAIRCAST_EXPORT_CAST`` set, the first import of ``deepspeed`` is followed at once by
``deepspeed_hooks.patch_deepspeed()``, and that of ``megatron.core.optimizer`` by
``megatron_patches.activate()`` (whose ``--export-cast*`` flags then default to the variable's
config, so the command line wins), and that of ``torch.distributed.fsdp`` by ``fsdp_hooks.activate()``
(FSDP2 models are installed at their optimizer's first step): before any other module can bind their
functions by name. A script that imports the adapter first (``import megatron_patches``, which
imports the framework) is turned on as soon as the adapter is defined. Without the variable nothing
is installed. It imports nothing heavy itself (no
torch), then runs the ``sitecustomize`` it shadows, if there is one.
"""
import importlib
import importlib.abc
import os
import sys

ENV = "FAIRCAST_EXPORT_CAST"  # faircast_dist.config.ENV (not imported here: it imports torch)


def _turn_on(adapter: str, call: str):
    """A hook that runs ``adapter.call()``. The adapter's own import is hooked too: a script that
    imports the adapter first (``import deepspeed_hooks``) has the framework imported from inside it,
    while the adapter is half-defined; then the adapter's hook, once it is whole, turns it on."""
    def hook(_module):
        half = sys.modules.get(adapter)
        if half is not None and not hasattr(half, call):
            return  # the adapter is importing the framework: its own hook comes when it is defined
        getattr(importlib.import_module(adapter), call)()  # idempotent: both hooks may call it
    return hook


# deepspeed_hooks.patch_deepspeed(); megatron_patches.activate(), whose --export-cast* flags then
# default to the variable's config (a flag on the command line wins); fsdp_hooks.activate(), which
# installs at an optimizer's first step on the fully_shard-ed models it steps
HOOKS = {"deepspeed": _turn_on("deepspeed_hooks", "patch_deepspeed"),
         "deepspeed_hooks": _turn_on("deepspeed_hooks", "patch_deepspeed"),
         "megatron.core.optimizer": _turn_on("megatron_patches", "activate"),
         "megatron_patches": _turn_on("megatron_patches", "activate"),
         "torch.distributed.fsdp": _turn_on("fsdp_hooks", "activate"),
         "fsdp_hooks": _turn_on("fsdp_hooks", "activate")}


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` once, right after module ``name`` has been executed (the other
    finders on ``sys.meta_path`` find it; this one only wraps its loader's ``exec_module``). A spec
    that is only probed (``importlib.util.find_spec``, as transformers and accelerate do for
    DeepSpeed) and never executed leaves the hook in place for the real import."""

    def __init__(self, hooks):
        self.hooks = dict(hooks)

    def find_spec(self, name, path=None, target=None):
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if finder is not self and hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            hook = self.hooks.pop(name, None)
            if hook is not None:
                hook(module)
        spec.loader.exec_module = exec_then_hook
        return spec


def _run_shadowed_sitecustomize():
    """Execute the ``sitecustomize`` later on ``sys.path`` (this one shadows it), as its own module."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    here = os.path.dirname(os.path.abspath(__file__))
    spec = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != here])
    if spec is not None:
        spec.loader.exec_module(module_from_spec(spec))


if os.environ.get(ENV):
    sys.meta_path.insert(0, AfterImport(HOOKS))
_run_shadowed_sitecustomize()
