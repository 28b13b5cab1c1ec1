"""The import direction docs/design.md promises ("Code layout"): the core imports no adapter, framework, engine or
the launcher; the vLLM receiver imports none of ours but the core's FP8 scale rules (what an online FP8 engine
computes, written once), and reads vLLM only in its compat module, inside functions."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAPTERS = {"deepspeed_hooks", "megatron_patches", "fsdp_hooks", "faircast_run", "vllm_receiver"}
FRAMEWORKS = {"deepspeed", "megatron", "vllm", "transformers", "trl"}


def imports(package: str):
    """``(file, top-level module imported, at module level?)`` for every import under ``package``."""
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read())
            top = set(map(id, tree.body))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    if package == "vllm_receiver" and mod == "faircast_dist.fp8" and id(node) not in top:
                        continue  # (the scale rules, imported where an online FP8 engine is checked)
                    yield os.path.relpath(path, ROOT), mod.split(".")[0], id(node) in top


def test_the_core_imports_no_adapter_framework_or_engine():
    bad = [(f, m) for f, m, _ in imports("faircast_dist") if m in ADAPTERS | FRAMEWORKS]
    assert not bad, bad


def test_the_receiver_imports_none_of_ours_but_the_scale_rules_and_vllm_only_inside_compat_functions():
    found = list(imports("vllm_receiver"))
    assert not [(f, m) for f, m, _ in found if m in {"faircast_dist"} | ADAPTERS - {"vllm_receiver"}]
    vllm = [(f, top) for f, m, top in found if m == "vllm"]
    assert vllm and all(f == os.path.join("vllm_receiver", "compat.py") and not top for f, top in vllm), vllm
