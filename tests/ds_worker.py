"""A tiny DeepSpeed training run in real gloo processes, for the integration tests.

``run(world_size, **options)`` spawns ``world_size`` ranks; rank 0 returns what it recorded.
Every rank gets the same micro-batch and one thread, so stock ZeRO-1/2 is bitwise identical at
DP=1 and DP=2 (docs/design.md), and any difference comes from the export cast.
"""
from __future__ import annotations

import os
import tempfile

import torch

from helpers import launch, logged_warnings, save_record, tiny_moe


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # odd sizes, so ZeRO partitions cut params in the middle and pad the flat buffer
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.LayerNorm(37),
                               torch.nn.Linear(37, 29), torch.nn.GELU(), torch.nn.Linear(29, 5))


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 13, generator=g), torch.randn(4, 5, generator=g)


def moe_loss(engine, step: int) -> torch.Tensor:
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1000 + step)).to(engine.device)
    return engine(input_ids=ids, labels=ids).loss.float()


PATHS = ("stage0", "stage0_fused", "bf16_optimizer", "zero1", "zero2", "zero3", "offload2", "offload3")


def ds_config(world_size: int, path: str, export_cast, lr: float, universal: bool = False) -> dict:
    """DeepSpeed config for one bf16 optimizer path (see PATHS)."""
    stage = {"stage0": 0, "stage0_fused": 0, "bf16_optimizer": 1, "zero1": 1, "zero2": 2, "zero3": 3, "offload2": 2, "offload3": 3}[path]
    zero = {"stage": stage}
    if path.startswith("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every param, however small
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4 * world_size,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW with offload (the cast path is the same)
        "steps_per_print": 10**9,
    }
    if path == "stage0_fused":  # DeepSpeed's FusedAdam (JIT-built for the CPU) -> FP16_Optimizer
        del cfg["optimizer"]["params"]["torch_adam"]
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if path == "bf16_optimizer":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if export_cast is not None:
        cfg["export_cast"] = export_cast
    return cfg


def preset_state(names_numel: dict[str, int]):
    """A training state to load into any layout: off-grid fp32 masters and |residual| <= ulp/2."""
    import zlib
    from faircast_dist.telemetry import bf16_spacing
    master, residual = {}, {}
    for name, numel in names_numel.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        master[name] = torch.randn(numel, generator=g) * 0.1
        residual[name] = (torch.rand(numel, generator=g) - 0.5) * bf16_spacing(master[name])
    return master, residual


class CopyProbe(torch.overrides.TorchFunctionMode):
    """Counts ``copy_`` calls that reach torch with a whole ZeRO-1/2 / BF16_Optimizer fp32
    partition as the source and a bf16 destination (DeepSpeed's stock round-to-nearest copy)."""

    def __init__(self, optimizer):
        super().__init__()
        parts = [t for a in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition")
                 for t in getattr(optimizer, a, None) or ()]
        self.parts, self.count = {(t.data_ptr(), t.numel()) for t in parts}, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.copy_ and args[0].dtype == torch.bfloat16 and args[1].dtype == torch.float32
                and (args[1].data_ptr(), args[1].numel()) in self.parts):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _worker(rank, world_size, port, jobs, out_path):
    """One rank's runs, one job after the other in this process (:func:`_train`: each builds its own engine); a
    record per job, with what Fair Cast warned meanwhile (``record["warnings"]``)."""
    records = []
    for opts in jobs:
        with logged_warnings() as warnings:
            records.append({**_train(rank, world_size, port, opts), "warnings": warnings})
    torch.distributed.destroy_process_group()
    save_record(records, f"{out_path}.{rank}")


def _train(rank, world_size, port, opts) -> dict:
    cuda = opts["device"] == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), DS_ACCELERATOR="cuda" if cuda else "cpu")
    torch.set_num_threads(1)
    if cuda:  # one rank per GPU, NCCL
        torch.cuda.set_device(rank)
    import sys
    if opts["moe"]:  # transformers' lazy imports must run before DeepSpeed patches tensor construction
        import transformers
        transformers.Qwen3MoeForCausalLM  # noqa: B018
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the attribute deepspeed.comm.torch is torch itself)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the JIT shm op build
    import deepspeed_hooks
    from deepspeed_hooks.export import RESIDUAL_KEY, load_full
    from deepspeed_hooks.served import served_deltas, served_weights
    from faircast_dist import FairCaster
    from faircast_dist.delta import DeltaTracker

    cfg = ds_config(world_size, opts["path"], opts["export_cast"], opts["lr"], universal=opts["load_tag"] is not None)
    cfg["bf16"]["enabled"] = opts["bf16"]
    cfg["zero_optimization"].update(opts["zero_extra"] or {})
    if opts["fused_adam"]:  # DeepSpeed's FusedAdam (JIT-built for the CPU), e.g. for ZeRO-3 offload_states
        cfg["optimizer"]["params"].pop("torch_adam", None)
    if opts["monitor_dir"]:
        cfg["csv_monitor"] = {"enabled": True, "output_path": opts["monitor_dir"], "job_name": "fair"}
    if opts["hook"] == "patch":  # the one-line way for an existing launch script
        deepspeed_hooks.patch_deepspeed()
    init = deepspeed_hooks.initialize if opts["hook"] == "initialize" else deepspeed.initialize
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if opts["moe"]:  # (not under zero.Init: transformers initialises the experts after construction, in post_init)
        model = tiny_moe()
    elif opts["path"] in ("zero3", "offload3"):
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = tiny_model()
    else:
        model = tiny_model()
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    reference = None
    if opts["reference"]:  # a frozen reference model, as TRL (trl/models/utils.py prepare_deepspeed) builds it:
        # a copy of the training config, stage 0 unless ZeRO-3, no optimizer (OpenRLHF's is alike)
        ref_cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
        ref_cfg["zero_optimization"] = dict(cfg["zero_optimization"])
        if ref_cfg["zero_optimization"]["stage"] != 3:
            ref_cfg["zero_optimization"]["stage"] = 0
        reference, *_ = init(model=tiny_model(), config=ref_cfg)
        reference.eval()
    restored = None
    if opts["uninstall"]:  # Fair Cast installed, then uninstalled: stock DeepSpeed from here on
        from deepspeed.runtime import bf16_optimizer, utils
        from deepspeed.runtime.zero import stage_1_and_2
        deepspeed_hooks.uninstall(engine)
        wrapped = ("step", "state_dict", "load_state_dict", "export_cast",
                   "_reassign_or_swap_out_partitioned_parameters")
        restored = (not any(n in vars(engine.optimizer) for n in wrapped)
                    and not any(n in vars(engine) for n in ("save_checkpoint", "load_checkpoint", "step"))
                    and stage_1_and_2.all_gather_dp_groups is utils.all_gather_dp_groups
                    and bf16_optimizer.all_gather_dp_groups is utils.all_gather_dp_groups)
    export = getattr(engine.optimizer, "export_cast", None)
    if opts["monitor_sample"]:  # watch a smaller sample than the default (the tiny model is smaller)
        from deepspeed_hooks.monitor import DriftMonitor
        export.state.telemetry = DriftMonitor(sum(getattr(p, "ds_numel", p.numel()) for p in engine.param_names),
                                    sample=opts["monitor_sample"])
    first = 0
    if opts["load_dir"]:
        engine.load_checkpoint(opts["load_dir"], tag=opts["load_tag"], load_module_only=opts["module_only"])
        first = engine.global_steps
    record = {"bf16": [], "master": [], "residual": [], "rtn_differs": 0, "mismatch": 0, "master_copies": 0,
              "optimizer": type(engine.optimizer).__name__, "restored": restored}
    device = engine.device

    def gathered(module):  # {name: flat bf16 copy on the host} of every param, gathered under ZeRO-3
        params = list(module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().reshape(-1).to("cpu", copy=True) for n, p in params}

    def snapshot():
        params = list(engine.module.named_parameters())
        bf16 = gathered(engine.module)
        if export is None:
            return bf16, {n: deepspeed.utils.safe_get_full_fp32_param(p).reshape(-1).to("cpu", copy=True) for n, p in params}, {}
        return bf16, export.gather(), export.gather(RESIDUAL_KEY)

    def zero_lr_step():  # exports the master unchanged (lr 0: AdamW leaves it bit for bit)
        x, y = (t.to(device) for t in batch(0))
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
        engine.step()

    if opts["preset"]:
        # one step at lr 0 creates the optimizer state; then, for each method in turn (one launch
        # serves them all: the caster is swapped, the export machinery reads it at every cast),
        # load the preset state at export step 1 and export it twice (steps 2 and 3)
        zero_lr_step()
        numel = {n: p.ds_numel if hasattr(p, "ds_numel") else p.numel() for n, p in engine.module.named_parameters()}
        master, residual = preset_state(numel)
        record["preset"] = {}
        for config in opts["preset"]:
            export.state.caster = FairCaster(config)
            export.caster.step = 1
            load_full(export, master)
            if export.caster.method == "error_feedback":
                load_full(export, residual, RESIDUAL_KEY)
            snaps = record["preset"][export.caster.method] = []
            for _ in range(2):
                zero_lr_step()
                snaps.append(snapshot()[0])
    tracker = DeltaTracker()

    def deltas():  # small buckets so ZeRO-3 gathers several times
        return [(n, i.to("cpu", copy=True), v.to("cpu", copy=True)) for n, i, v in served_deltas(engine, tracker, bucket_bytes=1024)]

    def fp8_snapshot(master, step):  # FP8 served weights: what the export API serves, and the masters cast
        if export is None or export.state.fp8 is None:
            return
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}
        fp8 = {n: t.to("cpu", copy=True) for n, t in served_weights(engine) if t.dtype != torch.bfloat16}
        params = gathered(engine.module)  # the bf16 params of the FP8 weights too
        snap = {"step": step, "served": fp8, "masters": {n: master[n].view(shapes[n]) for n in master},
                "params": {n: params[n].view(shapes[n]) for n in fp8 if n in params}}
        if not export.state.fp8.rule.sticky:  # the grid route's bf16 (served_weights(grid=True))
            snap["grid"] = {n: t.to("cpu", copy=True) for n, t in served_weights(engine, grid=True) if n in snap["params"]}
        record.setdefault("fp8", []).append(snap)

    prev = record["start"] = snapshot()
    fp8_snapshot(prev[1], export.state.step if export else 0)  # install (or the load): the first export
    record["deltas"] = [deltas()]  # the first call: every element
    for step in range(first, first + opts["steps"]):
        if opts["save_dir"] and step in opts["save_at"]:
            engine.save_checkpoint(opts["save_dir"])
        if opts["offload_states"] and step == first + 1:  # OpenRLHF colocated: offload, rollout, reload
            engine.offload_states(pin_memory=False)
            engine.reload_states()
        if opts["moe"]:
            engine.backward(moe_loss(engine, step))
        else:
            x, y = (t.to(device) for t in batch(step))
            engine.backward(torch.nn.functional.mse_loss(engine(x.to(next(engine.parameters()).dtype)).float(), y))
        if reference is not None:
            with torch.no_grad():
                reference(x.to(torch.bfloat16))
        with CopyProbe(engine.optimizer) as probe:
            engine.step()
        record["master_copies"] += probe.count
        bf16, master, residual = snapshot()
        if export is not None:
            # None missed: every served element is the reference (single-process, whole-param)
            # fair cast of the gathered master at this step.
            ref = FairCaster(export.caster.config)
            ref.step = export.state.step
            for n in bf16:
                q = ref.cast(n, master[n].clone(), residual=prev[2].get(n, torch.zeros_like(master[n])).clone())
                record["mismatch"] += int((q.view(torch.int16) != bf16[n].view(torch.int16)).sum())
                record["rtn_differs"] += int((master[n].to(torch.bfloat16) != bf16[n]).sum())
        record["bf16"].append(bf16), record["master"].append(master), record["residual"].append(residual)
        fp8_snapshot(master, export.state.step if export else 0)
        record["deltas"].append(deltas())
        prev = (bf16, master, residual)
    record["deltas_again"] = deltas()  # no step since the last call: nothing changed
    if opts["save_dir"] and opts["save_final"]:
        if opts["crash_on_save"] and rank == 1:  # die half-way through writing this rank's file
            def torn_save(obj, f, *args, **kwargs):
                with open(f, "wb") as fh:
                    fh.write(b"PK\x03\x04 torn")
                os._exit(17)
            torch.save = torn_save
        engine.save_checkpoint(opts["save_dir"])
    # the export API: full bf16 tensors, small buckets so ZeRO-3 gathers several times
    record["served_api"] = {n: t.reshape(-1).to("cpu", copy=True) for n, t in served_weights(engine, bucket_bytes=1024)}
    record["method"] = export.caster.method if export else None
    if reference is not None:
        record["reference"] = {"optimizer": type(reference.optimizer).__name__,
                               "fair": hasattr(reference.optimizer, "export_cast"), "bf16": gathered(reference.module)}
    record["export_step"] = export.caster.step if export else None
    deepspeed_hooks.uninstall(engine)  # (the next job of the launch starts from stock DeepSpeed: no wrap left)
    engine.destroy()
    if opts["hook"] == "patch":
        deepspeed_hooks.unpatch_deepspeed()
    return record


def options(*, path: str = "zero2", export_cast=None, steps: int = 4, lr: float = 1e-3,
        hook: str | None = "initialize", save_dir: str | None = None, load_dir: str | None = None,
        load_tag: str | None = None, preset: tuple = (), save_at: tuple = (),
        crash_on_save: bool = False, bf16: bool = True, monitor_dir: str | None = None,
        monitor_sample: int | None = None, zero_extra: dict | None = None, save_final: bool = True,
        device: str = "cpu", uninstall: bool = False, reference: bool = False,
        offload_states: bool = False, fused_adam: bool = False, module_only: bool = False,
        moe: bool = False) -> dict:
    """One job of :func:`run` / :func:`run_jobs`: train ``steps`` steps (the options below, checked by name).

    ``preset``: export_cast configs: before training, each exports (twice, at lr 0) the same
    preset master (and residual) state from export step 1, into ``record["preset"][method]``.

    ``hook``: "initialize" (deepspeed_hooks.initialize), "patch" (patch_deepspeed, then
    deepspeed.initialize) or None (stock deepspeed.initialize).

    ``save_at``: steps before which to save into ``save_dir``; ``save_final``: also save after the
    last step. ``device``: "cpu" (gloo) or "cuda" (NCCL, rank r on GPU r). ``uninstall``: call
    ``deepspeed_hooks.uninstall`` right after initialize (``record["restored"]``: every wrap is gone).
    ``reference``: also build a frozen reference engine without optimizer from a copy of the
    config, as TRL does, and run it forward every step (``record["reference"]``).
    ``offload_states``: ``engine.offload_states()`` then ``reload_states()`` before the second step
    (ZeRO-3 supports it with ``fused_adam``: DeepSpeed's FusedAdam instead of torch's AdamW).
    ``module_only``: load ``load_dir`` with ``load_module_only=True`` (the model, no optimizer state).
    ``moe``: train a tiny transformers 5 Qwen3-MoE (``helpers.tiny_moe``) on token ids instead.
    """
    return dict(path=path, export_cast=export_cast, steps=steps, lr=lr, hook=hook,
                save_dir=save_dir, load_dir=load_dir, load_tag=load_tag, preset=preset,
                save_at=save_at, crash_on_save=crash_on_save, bf16=bf16, monitor_dir=monitor_dir,
                monitor_sample=monitor_sample, zero_extra=zero_extra, save_final=save_final, device=device,
                uninstall=uninstall, reference=reference, offload_states=offload_states,
                fused_adam=fused_adam, module_only=module_only, moe=moe)


def run_jobs(world_size: int, jobs: list[dict]) -> list[list[dict]]:
    """Run ``jobs`` (each :func:`options`' keywords) one after the other in one launch of ``world_size`` spawned
    ranks (one process group; each job builds and destroys its own engine), sharing the launch's start-up. Per job,
    each rank's record (with ``"warnings"``: what Fair Cast warned during it). A job that kills its process
    (``crash_on_save``) goes last."""
    opts = [options(**job) for job in jobs]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record")
        launch(_worker, world_size, opts, out, reported=[f"{out}.{r}" for r in range(world_size)])
        ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world_size)]
    return [[ranks[r][j] for r in range(world_size)] for j in range(len(jobs))]


def run(world_size: int, **job) -> list[dict]:
    """One job (:func:`options`) in its own launch of ``world_size`` ranks; each rank's record."""
    return run_jobs(world_size, [job])[0]
