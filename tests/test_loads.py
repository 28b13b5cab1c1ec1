"""Every DeepSpeed load path serves what Fair Cast served, and nothing silently changes on resume
(issue 10): {stage 0, BF16_Optimizer, ZeRO-1, 2, 3, Offload 2/3} x {normal load,
``load_optimizer_states=False``, ``load_module_only=True``, ``load_lr_scheduler_states=False``,
explicit tag, universal, universal + ``load_module_only=True``}, on one model with a frozen param, a tied weight and 3 param groups of
distinct lr/weight decay (tests/loads_worker.py: one 2-rank launch per path, all loads in it).

Each load either gives back the bf16 model served at save (every param, frozen ones included),
the export step of the save, the residuals (saved ones with the optimizer state; zero without it,
when the masters are the served values) and the saved per-group hyperparameters — and the next
step is the reference fair cast — or is refused with an error naming the combination.
"""
import functools
import re

import pytest
import torch

from loads_worker import LOAD_LR, LOADS_OPTIMIZER, TAGS, VARIANTS, run

PATHS = ["stage0", "bf16_optimizer", "zero1", "zero2", "zero3", "offload2", "offload3"]
SLOW = {"zero3", "offload3", "offload2"}
#: (path, variant) -> the error it must raise
REFUSED = {("stage0", "universal"): r'"load_universal": true\} with ZeRO stage 0 \(FP16_UnfusedOptimizer\) is not supported',
           ("stage0", "universal_module_only"): "with ZeRO stage 0",
           **{(p, "universal_module_only"): r'"load_universal": true\} with load_module_only=True or load_optimizer_states'
              rf"=False on {wrapper} is not supported: DeepSpeed's ZeRO-1/2 and BF16_Optimizer universal loader ignores"
              for p, wrapper in [("bf16_optimizer", "BF16_Optimizer"), ("zero1", "DeepSpeedZeroOptimizer"),
                                 ("zero2", "DeepSpeedZeroOptimizer"), ("offload2", "DeepSpeedZeroOptimizer")]}}


@functools.lru_cache(maxsize=None)
def launched(path):
    return run(path)


def paths():
    return [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in PATHS]


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for n in a:
        x, y = a[n], b[n]
        assert x.dtype == y.dtype and torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                                                  y.view(torch.int16) if y.dtype == torch.bfloat16 else y), n


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", paths())
def test_load_serves_what_was_served(path, variant):
    got = launched(path)["variants"][variant]
    if (path, variant) in REFUSED:
        assert re.search(REFUSED[(path, variant)], got.get("error", "")), got.get("error")
        return
    assert "error" not in got, got["error"]
    saved = launched(path)["saved"][VARIANTS[variant][1]]
    assert_same(got["served"], saved["served"])  # every param, frozen and tied ones too, bit for bit
    assert got["step"] == saved["step"]  # the export step continues (random bits are not redrawn)
    trained = sorted(n for n in saved["residual"] if not n.startswith("inp."))  # inp is frozen
    if variant in LOADS_OPTIMIZER:
        assert_same({n: got["master"][n] for n in trained}, {n: saved["master"][n] for n in trained})
        assert_same({n: got["residual"][n] for n in trained}, {n: saved["residual"][n] for n in trained})
        assert got["hyper"] == saved["hyper"]  # each group's own lr and weight decay
    else:  # no optimizer state: masters are the served values, so zero residuals are exact
        assert_same({n: got["master"][n] for n in trained}, {n: saved["served"][n].float() for n in trained})
        assert all(not got["residual"][n].any() for n in trained)
        assert got["hyper"] == [LOAD_LR] * 3  # the new optimizer's own groups (the flag's meaning)
    assert got["fair_step"]  # the next step is the reference fair cast of master and residual


@pytest.mark.parametrize("path", paths())
def test_served_cli_writes_what_served_weights_yielded(path):
    record = launched(path)
    for tag in TAGS:
        assert_same({n: t.reshape(-1) for n, t in record["cli"][tag].items()}, record["saved"][tag]["served"])
    assert {"inp.weight", "inp.bias"} <= set(record["cli"][TAGS[0]])  # the frozen ones too


def test_fair_casts_client_state_key_is_reserved():
    record = launched("zero1")
    message, written = record["reserved_key_error"]
    assert 'client_state key "export_cast" is reserved' in message and not written
