"""Every DeepSpeed load path in one launch per optimizer path (tests/test_loads.py).

``run(path)`` spawns 2 gloo ranks that train a model with a frozen param, a tied weight and 3
param groups of distinct lr/weight decay under error feedback, save at steps 3 and 5, convert
step 3 to a universal checkpoint, then build a fresh engine (another init seed, other lr/wd) for
each entry of :data:`VARIANTS`, load, record what it serves, and take one step. Variants with an
explicit tag load while ``latest`` is moved away, so no file of another tag can be read. Rank 0 returns
``{"saved": {tag: state at save}, "variants": {name: state after load, or the error}, "cli":
{tag: read_checkpoint}}``.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

from ds_worker import batch, ds_config
from helpers import launch, save_record

EF = {"mode": "fair", "method": "error_feedback"}
SAVED_LR = [(1e-3, 0.0), (2e-3, 0.1), (3e-3, 0.05)]  # (lr, weight decay) of the 3 param groups
LOAD_LR = (5e-4, 0.2)  # every group of a fresh engine: a load that keeps it did not load the groups
TAGS = ("global_step3", "global_step5")  # saves; "global_step5" is `latest`
# name: (load_checkpoint keyword arguments, tag whose state it must serve, universal config)
VARIANTS = {
    "normal": ({}, "global_step5", False),
    "explicit_tag": ({"tag": "global_step3"}, "global_step3", False),
    "no_optimizer_states": ({"tag": "global_step3", "load_optimizer_states": False}, "global_step3", False),
    "module_only": ({"tag": "global_step3", "load_module_only": True}, "global_step3", False),
    "no_lr_scheduler_states": ({"load_lr_scheduler_states": False}, "global_step5", False),
    "universal": ({}, "global_step3", True),
    "universal_module_only": ({"load_module_only": True}, "global_step3", True),
}
#: the variants that load the optimizer state (masters, residuals, per-group hyperparameters)
LOADS_OPTIMIZER = ("normal", "explicit_tag", "no_lr_scheduler_states", "universal")


class TiedModel(torch.nn.Module):
    """``inp`` is frozen; ``mid2.weight`` is ``mid.weight`` (one param, two names)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(13, 37)
        self.mid = torch.nn.Linear(37, 37)
        self.norm = torch.nn.LayerNorm(37)
        self.mid2 = torch.nn.Linear(37, 37)
        self.mid2.weight = self.mid.weight
        self.out = torch.nn.Linear(37, 5)
        self.inp.requires_grad_(False)

    def forward(self, x):
        gelu = torch.nn.functional.gelu
        h = self.norm(gelu(self.mid(gelu(self.inp(x)))))
        return self.out(gelu(self.mid2(h)))


def param_groups(model, hyper):
    """3 groups: the tied weight; the two middle biases; the norm and output layer."""
    names = [["mid.weight"], ["mid.bias", "mid2.bias"], ["norm.weight", "norm.bias", "out.weight", "out.bias"]]
    params = dict(model.named_parameters())
    return [{"params": [params[n] for n in group], "lr": lr, "weight_decay": wd}
            for group, (lr, wd) in zip(names, hyper)]


def _worker(rank, world_size, port, path, folder, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the JIT shm op build
    import deepspeed_hooks
    from deepspeed_hooks.checkpoint import to_universal
    from deepspeed_hooks.export import RESIDUAL_KEY
    from deepspeed_hooks.served import read_checkpoint, served_weights
    from faircast_dist import FairCaster
    deepspeed.init_distributed(dist_backend="gloo")

    def engine_for(seed, hyper, universal=False):
        cfg = ds_config(world_size, path, EF, 1e-3, universal=universal)
        if path in ("zero3", "offload3"):  # biases and norms stay whole on every rank (persistent)
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 40
        torch.manual_seed(seed)
        if cfg["zero_optimization"]["stage"] == 3:
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                model = TiedModel()
        else:
            model = TiedModel()
        return deepspeed_hooks.initialize(model=model, model_parameters=param_groups(model, hyper), config=cfg)[0]

    def train_step(engine, step):
        x, y = batch(step)
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
        engine.step()

    def state(engine):
        export = engine.optimizer.export_cast
        return {"served": {n: t.reshape(-1).clone() for n, t in served_weights(engine, bucket_bytes=1024)},
                "master": export.gather(), "residual": export.gather(RESIDUAL_KEY), "step": export.caster.step,
                "hyper": [(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups]}

    def step_is_fair(engine, before):
        """One step after the load: every trainable element is the reference cast (0 mismatches)."""
        train_step(engine, 100)
        after, ref = state(engine), FairCaster(EF)
        ref.step = before["step"]
        trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
        return after["step"] == before["step"] + 1 and all(
            torch.equal(ref.cast(n, after["master"][n].clone(), residual=before["residual"][n].clone()).view(torch.int16),
                        after["served"][n].view(torch.int16)) for n in trained)

    record = {"saved": {}, "variants": {}, "cli": {}}
    engine = engine_for(0, SAVED_LR)
    for step in range(5):
        train_step(engine, step)
        if step + 1 in (3, 5):
            engine.save_checkpoint(folder)
            record["saved"][f"global_step{step + 1}"] = state(engine)
    try:  # Fair Cast's key in the model-states file is refused before anything is written
        engine.save_checkpoint(folder, tag="reserved", client_state={"export_cast": "mine"})
    except ValueError as err:
        record["reserved_key_error"] = str(err), os.path.exists(os.path.join(folder, "reserved"))
    engine.destroy()
    universal_error = None
    if rank == 0:
        try:
            to_universal(os.path.join(folder, TAGS[0]), os.path.join(folder, "universal"))
        except Exception as err:  # noqa: BLE001  (recorded: stage 0 has no ZeRO files to convert)
            universal_error = f"{type(err).__name__}: {err}"
        record["cli"] = {tag: {n: t.reshape(-1) for n, t in read_checkpoint(folder, tag).items()} for tag in TAGS}
    torch.distributed.barrier()
    latest = os.path.join(folder, "latest")
    for name, (kwargs, _, universal) in VARIANTS.items():
        hide_latest = "tag" in kwargs  # nothing of another tag can be read: there is no `latest`
        if hide_latest and rank == 0:
            os.replace(latest, latest + ".hidden")
        torch.distributed.barrier()
        engine = engine_for(1, [LOAD_LR] * 3, universal)
        try:
            engine.load_checkpoint(folder, **kwargs)
            loaded = state(engine)
            loaded["fair_step"] = step_is_fair(engine, loaded)
        except Exception as err:  # noqa: BLE001  (a refusal: recorded, the test checks its message)
            loaded = {"error": f"{type(err).__name__}: {err}"}
        engine.destroy()
        record["variants"][name] = loaded
        torch.distributed.barrier()
        if hide_latest and rank == 0:
            os.replace(latest + ".hidden", latest)
    record["universal_error"] = universal_error
    save_record(record, f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


def run(path: str, world_size: int = 2) -> dict:
    """One launch for ``path`` (see ``ds_worker.PATHS``); rank 0's record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record")
        launch(_worker, world_size, path, os.path.join(tmp, "ckpt"), out,
               reported=[f"{out}.{r}" for r in range(world_size)])
        return torch.load(f"{out}.0", weights_only=False)
