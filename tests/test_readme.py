"""The README and docs/ as a user reads them: the snippets run or bind to the real functions, and every
link lands on a page and a heading that exist. (docs/deepspeed.md's "Serving the weights" snippets run
against a real vLLM engine in tests/vllm_worker.py.)"""
import ast
import importlib
import inspect
import json
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md"))


def read(page: str) -> str:
    return open(os.path.join(ROOT, page), encoding="utf-8").read()


def blocks(page: str, lang: str, heading: str | None = None) -> list[str]:
    """The ```lang blocks of ``page`` (after ``heading`` up to the next heading of its level, if given)."""
    text = read(page)
    if heading is not None:
        level = heading.split(" ")[0]
        start = text.index(heading + "\n")
        end = re.search(rf"^{level} ", text[start + len(heading):], re.M)
        text = text[start:start + len(heading) + (end.start() if end else len(text))]
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(page: str) -> set[str]:
    text = re.sub(r"```.*?```", "", read(page), flags=re.S)  # a '#' in a code block is no heading
    return {slug(t) for t in re.findall(r"^#+ (.*)$", text, re.M)}


def test_use_the_casts_in_your_own_code():
    from faircast_dist import derive_key
    from faircast_dist.rounding import cast_stochastic
    scope = {}
    code = blocks("docs/methods.md", "python", "## Use the casts in your own code")[0]
    exec(compile(code, "docs/methods.md", "exec"), scope)  # its asserts run
    assert scope["caster"].step == 1
    for name, master in scope["state"].items():
        assert torch.equal(scope["served"][name], cast_stochastic(master, derive_key(1234, 0, name), 0))


@pytest.mark.parametrize("page", PAGES)
def test_every_link_lands_on_a_page_and_a_heading(page):
    base = os.path.dirname(page)
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", read(page), flags=re.S)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(base, path)) if path else page
        assert os.path.exists(os.path.join(ROOT, path)), (page, target)
        if anchor:
            assert anchor in anchors(path), (page, target)


def test_the_readme_is_a_front_door():
    """Short, the first code on its first screen, and every docs page linked from it."""
    text = read("README.md")
    assert len(text.splitlines()) <= 150
    assert text.index("```") < 2500  # about the first screen
    for page in PAGES[1:]:
        assert f"({page})" in text, page


OURS = ("faircast_dist", "deepspeed_hooks", "megatron_patches", "fsdp_hooks", "faircast_run", "vllm_receiver")


@pytest.mark.parametrize("page", PAGES)
def test_the_snippets_calls_bind_to_the_real_signatures(page):
    """Each ``package.function(...)`` of ours in a page's Python snippets exists and accepts those
    arguments (a renamed function or keyword fails here, not in a user's hands)."""
    calls = 0
    for code in blocks(page, "python"):
        for node in ast.walk(ast.parse(code)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in OURS):
                function = getattr(importlib.import_module(node.func.value.id), node.func.attr)
                args = [object()] * len(node.args)
                inspect.signature(function).bind(*args, **{k.arg: object() for k in node.keywords})
                calls += 1
    assert calls >= 4 or page != "README.md"


def test_the_readmes_config_and_flags_parse():
    """The DeepSpeed section is a valid ``export_cast`` config; the Megatron flags parse into the
    same config."""
    from faircast_dist import ExportCastConfig
    from megatron_patches import add_export_cast_args, config_from_args
    section = json.loads("{" + blocks("README.md", "json")[0] + "}")
    config = ExportCastConfig.from_value(section["export_cast"])
    flags = next(b for b in blocks("README.md", "bash") if "--export-cast" in b)
    argv = [a for a in flags.replace("\\\n", " ").split() if a.startswith("--export-cast") or a.lstrip("-").isalnum()]
    argv = argv[argv.index("--export-cast"):]
    import argparse
    parser = add_export_cast_args(argparse.ArgumentParser())
    parser.add_argument("--bf16", action="store_true")
    assert config_from_args(parser.parse_args(["--bf16", *argv])) == config
