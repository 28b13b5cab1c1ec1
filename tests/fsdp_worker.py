"""A tiny FSDP2 training run in real gloo processes, for tests/test_fsdp.py.

``run(world_size, jobs)`` spawns ``world_size`` ranks once and runs every job (a dict of options
for :func:`train`) in turn; rank 0 returns one record per job. Every rank gets the same batch and
one thread, so what differs between layouts is the mesh, never the data.
"""
from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist

from helpers import launch, save_record, tiny_moe

DIM = 13


class Block(torch.nn.Module):
    """An MLP block: odd sizes, so FSDP pads the last rank's shard (37 rows on 2 or 4 ranks)."""

    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(DIM, width)
        self.down = torch.nn.Linear(width, DIM)
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(torch.nn.Module):
    """Two blocks and a head; widths cut unevenly by FSDP at 4 ranks and inside a TP=2 shard."""

    def __init__(self, widths=(38, 42)):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(w) for w in widths)
        self.head = torch.nn.Linear(DIM, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, DIM, generator=g), torch.randn(8, 5, generator=g)


def build(mesh_shape: tuple[int, ...], tp: bool = False, group: bool = False, ac: bool = False, moe: bool = False):
    """The model sharded on a mesh: ``(shard,)`` FSDP, ``(replicate, shard)`` HSDP, or with
    ``tp`` a ``(dp, tp)`` mesh: TP (colwise up, rowwise down) then FSDP over dp; ``group``: the last
    block and the head in one ``fully_shard([...])``; ``ac``: activation checkpointing wrappers around
    the blocks (names gain ``_checkpoint_wrapped_module``); ``moe``: a tiny transformers 5 Qwen3-MoE
    (``helpers.tiny_moe``) instead, each decoder layer and the root sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if moe:
        model, mesh = tiny_moe(), init_device_mesh("cpu", mesh_shape)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        return model
    torch.manual_seed(0)
    model = Tiny()
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        model.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    if tp:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    elif len(mesh_shape) == 2:
        dp_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    else:
        dp_mesh = init_device_mesh("cpu", mesh_shape)
    if group:  # one fully_shard over two modules (as accelerate shards the final norm with the head)
        fully_shard(model.blocks[0], mesh=dp_mesh, mp_policy=mp_policy)
        fully_shard([model.blocks[1], model.head], mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    return model


def full_state(model) -> dict[str, torch.Tensor]:
    """``{name: full fp32 master}`` (collective)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def full(t) -> torch.Tensor:
    """A (DTensor) tensor gathered to its full shape, as a new tensor (collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def setup(job: dict):
    """Model, AdamW and install as the job says (``mesh``, ``tp``, ``export_cast``; ``install`` False: none)."""
    import fsdp_hooks
    model = build(tuple(job.get("mesh", (dist.get_world_size(),))), job.get("tp", False), job.get("group", False),
                  job.get("ac", False), job.get("moe", False))
    kind, lr = job.get("optimizer", "adamw"), job.get("lr", 1e-3)
    if kind == "data_sgd":  # updates p.data: bumps no version counter of the params
        optimizer = DataSGD(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=kind == "fused")
    if not job.get("install", True):  # left to fsdp_hooks.activate (faircast-run)
        return model, optimizer, []
    states = fsdp_hooks.install(model, optimizer, config=job.get("export_cast"), telemetry="telemetry" in job,
                                sample=job.get("telemetry", 65536))
    return model, optimizer, states


class DataSGD(torch.optim.Optimizer):
    """Plain SGD written the way many third-party optimizers are: on ``p.data``."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def snapshot(model) -> dict:
    """The served weights, full masters and (error feedback) full residuals now (collective)."""
    import fsdp_hooks
    export = getattr(model, "export_cast", None)
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():  # the root (and reshard_after_forward=False) keep params unsharded after
        if isinstance(module, FSDPModule):  # forward; the backward gathers them again
            module.reshard()
    from fsdp_hooks.export import canonical_name
    record = {"masters": {canonical_name(n): full(p) for n, p in model.named_parameters()}}
    if export is not None:
        served = [(n, w.clone()) for n, w in fsdp_hooks.served_weights(model)]
        record["served"], record["served_names"] = dict(served), [n for n, _ in served]
        if export.state.fp8 is not None and not export.state.fp8.rule.sticky:  # the grid route's bf16 (served_weights(grid=True))
            record["grid"] = {n: w.clone() for n, w in fsdp_hooks.served_weights(model, grid=True)
                              if dict(served)[n].dtype == torch.float8_e4m3fn}
        record["shards_full"] = {n: full(t) for n, t in fsdp_hooks.served_shards(model).items()}
        record["step"] = export.caster.step
        if export.residuals is not None:
            from fsdp_hooks.checkpoint import ExportCastState
            record["residual"] = {n: full(r) for n, r in ExportCastState(model).state_dict()["residual"].items()}
    return record


def train_steps(model, optimizer, steps, first=0, gradless=False) -> list[dict]:
    """``steps`` optimizer steps on the shared batches; one :func:`snapshot` per step, taken after
    the forward (what it computed with) and before the update, with the drift telemetry of that
    forward's export (None without ``install(telemetry=True)``). ``gradless``: one more ``step()``
    after each, with every grad None (it changes no master, the export step still advances)."""
    import fsdp_hooks
    records = []
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        records.append({**snapshot(model), "loss": loss.item(), "drift": fsdp_hooks.drift_metrics(model)})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if gradless:
            optimizer.step()
    return records


def train(job: dict) -> dict:
    """Train ``steps`` steps (snapshots per step and after the last), then the logits of a forward
    and, unless TP, of a plain bf16 copy of the model loaded with the served weights."""
    import fsdp_hooks
    late = job.get("late", 0)  # stock steps before the install
    model, optimizer, _ = setup({**job, "export_cast": None} if late else job)
    train_steps(model, optimizer, late)
    if late:
        fsdp_hooks.install(model, optimizer, config=job["export_cast"])
    if job.get("uninstall"):
        fsdp_hooks.uninstall(model)
    steps = train_steps(model, optimizer, job.get("steps", 3), late, job.get("gradless", False))
    record = {"steps": steps, "final": snapshot(model)}
    x, _ = batch(99)
    with torch.no_grad():
        record["logits"] = model(x).detach().clone()
        if "served" in record["final"] and not job.get("tp") and not _fp8(job):
            plain = Tiny().to(torch.bfloat16)
            plain.load_state_dict(record["final"]["served"])
            record["plain_logits"] = plain(x.to(torch.bfloat16))
    return record


def _fp8(job: dict) -> bool:
    return isinstance(job.get("export_cast"), dict) and job["export_cast"].get("format") == "fp8"


def activated(job: dict) -> dict:
    """``fsdp_hooks.activate(export_cast)`` (what faircast-run does), then a ``variant``: ``explicit``
    (the script's own install, config ``explicit``), ``split`` (two optimizers over parts of the model,
    the second-built one stepping first), ``state_dict`` (DCP's ``get_state_dict`` before the first
    forward: one optimizer step before any forward); ``steps`` steps, snapshots as :func:`train_steps`."""
    import fsdp_hooks
    from torch.distributed.checkpoint.state_dict import get_state_dict
    fsdp_hooks.activate(job["export_cast"])
    try:
        model = build((dist.get_world_size(),))
        if job["variant"] == "split":
            first = list(model.blocks[0].parameters())
            optimizers = [torch.optim.AdamW([p for p in model.parameters() if all(p is not q for q in first)], lr=1e-3),
                          torch.optim.AdamW(first, lr=1e-3)]
        else:
            optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
        if job["variant"] == "explicit":
            fsdp_hooks.install(model, optimizers[0], config=job["explicit"])
        if job["variant"] == "state_dict":
            get_state_dict(model, optimizers[0])
        records = []
        for step in range(job["steps"]):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            records.append(snapshot(model))
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        export = getattr(model, "export_cast", None)
        return {"steps": records, "method": None if export is None else str(export.caster.method),
                "blocks_installed": [getattr(b, "export_cast", None) is not None for b in model.blocks]}
    finally:
        fsdp_hooks.deactivate()


def fixed(job: dict) -> dict:
    """One master trajectory under any layout: the initial masters scaled elementwise before each of
    3 exports (an ``optimizer.step()`` with lr 0 advances the export step); the served weights of each."""
    model, optimizer, _ = setup({**job, "lr": 0.0})
    exports = []
    for s in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-3 * (s + 1))
        exports.append(snapshot(model))
        optimizer.step()
    return {"exports": exports}


def save_half(job: dict) -> dict:
    """Train ``steps`` steps and save a DCP checkpoint to ``dir`` (a stock one without ``export_cast``)."""
    from fsdp_hooks import checkpoint
    model, optimizer, _ = setup(job)
    train_steps(model, optimizer, job["steps"])
    if job.get("export_cast"):
        checkpoint.save(model, optimizer, job["dir"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=job["dir"])
    return {}


def resume(job: dict) -> dict:
    """Load ``dir`` into a new model of this layout and train ``steps`` more from step ``first``."""
    from fsdp_hooks import checkpoint
    from helpers import logged_warnings
    model, optimizer, _ = setup(job)
    with logged_warnings() as caught:
        checkpoint.load(model, optimizer, job["dir"])
    steps = train_steps(model, optimizer, job["steps"], job["first"])
    return {"steps": steps, "final": snapshot(model), "warnings": caught}


def deltas(job: dict) -> dict:
    """Per training step: do the served deltas applied to the previous copy rebuild the served model?"""
    import fsdp_hooks
    from faircast_dist.delta import DeltaTracker, apply_deltas
    model, optimizer, _ = setup(job)
    tracker, copy, rebuilt = DeltaTracker(), None, []
    for step in range(job.get("steps", 3)):
        changes = list(fsdp_hooks.served_deltas(model, tracker))
        served = dict(fsdp_hooks.served_weights(model))
        if copy is None:
            copy = {n: torch.zeros_like(w) for n, w in served.items()}
        apply_deltas(copy, changes)
        rebuilt.append(all(torch.equal(copy[n].view(torch.int16), w.view(torch.int16)) for n, w in served.items()))
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"rebuilt": rebuilt, "changed": [int(i.numel()) for _, i, _ in changes]}


def refuse(job: dict) -> dict:
    """What :func:`fsdp_hooks.install` raises on a model built with ``fully_shard(**kwargs)``."""
    import fsdp_hooks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = Tiny()
    if job.get("dtype"):
        model = model.to(job["dtype"])
    kwargs = dict(job["kwargs"])
    if "param_dtype" in kwargs:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=kwargs.pop("param_dtype"))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), **kwargs)
    params = [torch.nn.Parameter(torch.zeros(3))] if job.get("foreign") else model.parameters()
    try:
        fsdp_hooks.install(model, torch.optim.AdamW(params), config={"mode": "fair"})
    except Exception as err:
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None}


def save_refusals(job: dict) -> dict:
    """checkpoint.save into an existing folder, and a save that dies midway (DCP's save raising):
    what is left under each name."""
    from fsdp_hooks import checkpoint
    model, optimizer, _ = setup(job)
    train_steps(model, optimizer, 1)
    first, second = os.path.join(job["dir"], "step-1"), os.path.join(job["dir"], "step-2")
    checkpoint.save(model, optimizer, first)
    out = {}
    try:
        checkpoint.save(model, optimizer, first)
    except FileExistsError as err:
        out["exists"] = str(err)
    save = checkpoint.dcp.save

    def dies(state, checkpoint_id):
        save(state, checkpoint_id=checkpoint_id)
        raise RuntimeError("killed after writing")
    checkpoint.dcp.save = dies
    try:
        checkpoint.save(model, optimizer, second)
    except RuntimeError as err:
        out["died"] = str(err)
    finally:
        checkpoint.dcp.save = save
    out["second_after_death"] = os.path.exists(second)
    checkpoint.save(model, optimizer, second)
    out["second"], out["partial_left"] = os.path.exists(second), os.path.exists(second + ".partial")
    checkpoint.load(model, optimizer, first)
    return out


def _worker(rank, world, port, jobs, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        records = []
        for job in jobs:
            try:
                records.append(globals()[job.get("fn", "train")](job))
            except Exception as err:  # recorded, so one job's failure names itself
                records.append({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
            dist.barrier()
        if rank == 0:
            save_record(records, out)
    finally:
        dist.destroy_process_group()


def run(world: int, jobs: list[dict]) -> list[dict]:
    """Run ``jobs`` in one launch of ``world`` gloo ranks; rank 0's records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.pt")
        launch(_worker, world, jobs, out, reported=[out])
        return torch.load(out, weights_only=False)
