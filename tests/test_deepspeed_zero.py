"""DeepSpeed ZeRO-1/2 with ``"export_cast"``: real 2-rank gloo runs of a tiny model."""
import functools

import pytest
import torch

from ds_worker import run

SR = {"mode": "fair", "method": "stochastic", "seed": 7}
EF = {"mode": "fair", "method": "error_feedback"}
METHODS = {"stochastic": SR, "error_feedback": EF}


@functools.lru_cache(maxsize=None)
def trained(world_size, path, method, steps=4):
    return run(world_size, path=path, export_cast=METHODS[method], steps=steps)


def bits(t):
    return t.view(torch.int16)


def assert_same_models(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(bits(a[n]) if a[n].dtype == torch.bfloat16 else a[n], 
                           bits(b[n]) if b[n].dtype == torch.bfloat16 else b[n]), n


@pytest.mark.parametrize("path", ["zero1", "zero2"])
@pytest.mark.parametrize("method", ["stochastic", "error_feedback"])
def test_every_master_copy_is_fair(path, method):
    rank0, rank1 = trained(2, path, method)
    assert rank0["method"] == method
    # every served element equals the single-process reference cast of the gathered master
    assert rank0["mismatch"] == 0 and rank1["mismatch"] == 0
    assert rank0["rtn_differs"] > 100  # ... and that differs from round-to-nearest: the check bites
    for a, b in zip(rank0["bf16"], rank1["bf16"]):  # both ranks hold the same gathered model
        assert_same_models(a, b)


@pytest.mark.parametrize("method", ["stochastic", "error_feedback"])
def test_layout_invariance_dp1_dp2_stage1_stage2(method):
    ref = trained(1, "zero2", method)[0]
    for other in (trained(2, "zero2", method)[0], trained(2, "zero1", method)[0]):
        for step in range(len(ref["bf16"])):
            assert_same_models(ref["bf16"][step], other["bf16"][step])
            assert_same_models(ref["master"][step], other["master"][step])
            assert_same_models(ref["residual"][step], other["residual"][step])


@pytest.mark.parametrize("method", ["stochastic", "error_feedback"])
def test_resume_equals_uninterrupted(method, tmp_path):
    straight = trained(2, "zero2", method, steps=5)[0]
    run(2, export_cast=METHODS[method], steps=3, save_dir=str(tmp_path))
    resumed = run(2, export_cast=METHODS[method], steps=2, load_dir=str(tmp_path))[0]
    assert resumed["mismatch"] == 0
    for k in range(2):
        assert_same_models(straight["bf16"][3 + k], resumed["bf16"][k])
        assert_same_models(straight["master"][3 + k], resumed["master"][k])
        assert_same_models(straight["residual"][3 + k], resumed["residual"][k])


def test_off_is_stock_deepspeed():
    stock = run(2, export_cast=None, hook=None)[0]
    for variant in (run(2, export_cast={"mode": "nearest", "method": "error_feedback"})[0],
                    run(2, export_cast=None)[0]):
        assert variant["method"] is None
        for step in range(len(stock["bf16"])):
            assert_same_models(stock["bf16"][step], variant["bf16"][step])
            assert_same_models(stock["master"][step], variant["master"][step])
    fair = trained(2, "zero2", "stochastic")[0]
    assert any(not torch.equal(bits(fair["bf16"][-1][n]), bits(stock["bf16"][-1][n])) for n in fair["bf16"][-1])


def test_patch_deepspeed_makes_stock_initialize_honour_the_key():
    patched = run(2, export_cast=SR, hook="patch")[0]
    assert patched["method"] == "stochastic" and patched["mismatch"] == 0
    assert_same_models(patched["bf16"][-1], trained(2, "zero2", "stochastic")[0]["bf16"][-1])


@pytest.mark.parametrize("export_cast,match", [
    ({"mode": "fair", "methd": "stochastic"}, r"unknown key\(s\) in export_cast: \['methd'\]"),
    ({"mode": "fiar"}, "export_cast.mode must be one of"),
    ("fair-ish", "export_cast.mode must be one of"),
    ({"mode": "fair", "seed": "7"}, "export_cast.seed must be an int64"),
])
def test_bad_config_is_an_error_naming_the_key(export_cast, match):
    with pytest.raises(Exception, match=match):
        run(1, export_cast=export_cast, steps=1)
