"""Device discipline (issue 11), checked on a CPU-only CI.

* Every torch tensor factory call in the library (faircast_dist, deepspeed_hooks,
  megatron_patches) names its device: the device of the data it belongs to, or ``device="cpu"``
  where a host tensor is the point. A factory without ``device=`` makes a host tensor, which on a
  GPU is a device mismatch or a collective NCCL cannot run — a bug a CPU run never shows. The
  few exceptions are listed in ALLOWED, each with its reason; an entry that matches nothing fails
  the test too, so the list cannot go stale.
"""
from __future__ import annotations

import ast
import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("faircast_dist", "deepspeed_hooks", "megatron_patches")
# torch functions that create a tensor (or generator) on a device of their own choosing: the CPU
# unless told. ``*_like`` and ``Tensor.new_*`` inherit their input's device and are fine.
FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "arange", "range", "tensor", "as_tensor", "asarray", "randint",
    "rand", "randn", "randperm", "normal", "linspace", "logspace", "eye", "empty_strided", "tril_indices",
    "triu_indices", "sparse_coo_tensor", "Generator", "scalar_tensor", "bartlett_window", "hann_window",
})

# (file, enclosing function, factory) -> why it may run without device=. Keep it short.
ALLOWED: dict[tuple[str, str, str], str] = {}


def factory_calls_without_device(source: str, path: str = "<snippet>") -> list[tuple[str, int, str, str]]:
    """``(path, line, enclosing function, factory)`` of each torch factory call in ``source``
    that passes no ``device=`` (a ``**kwargs`` call counts as passing one: it cannot be told).

    Knows ``import torch [as t]`` and ``from torch import zeros [as z]``.
    """
    tree = ast.parse(source)
    modules, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names.update({a.asname or a.name: a.name for a in node.names if a.name in FACTORIES})
    found = []

    def visit(node, scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        if isinstance(node, ast.Call):
            f = node.func
            factory = (f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                       and f.value.id in modules and f.attr in FACTORIES else
                       names.get(f.id) if isinstance(f, ast.Name) else None)
            if factory and not any(k.arg in ("device", None) for k in node.keywords):
                found.append((path, node.lineno, scope or "<module>", factory))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "")
    return found


def library_files():
    for package in LIBRARY:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def test_every_library_tensor_factory_names_its_device():
    allowed = ALLOWED
    flagged, used = [], set()
    for rel, path in library_files():
        with open(path) as f:
            for _, line, scope, factory in factory_calls_without_device(f.read(), rel):
                if (rel, scope, factory) in allowed:
                    used.add((rel, scope, factory))
                else:
                    flagged.append(f"{rel}:{line} in {scope}: torch.{factory}(...) without device=")
    assert not flagged, ("tensor factories without device= (pass the device of the data, or device=\"cpu\" "
                         "where a host tensor is the point):\n" + "\n".join(flagged))
    stale = sorted(set(allowed) - used)
    assert not stale, f"allow-list entries that match no call any more (delete them): {stale}"


@pytest.mark.parametrize("snippet,expected", [
    ("import torch\nx = torch.zeros(3)", [("<module>", "zeros")]),
    ("import torch\ndef f(t):\n    return torch.arange(3, dtype=torch.int64)", [("f", "arange")]),
    ("import torch as th\nclass A:\n    def g(self):\n        return th.Generator()", [("A.g", "Generator")]),
    ("from torch import empty as e\ne(5)", [("<module>", "empty")]),
    ("import torch\ntorch.tensor([1], device=x.device); torch.zeros(2, device='cpu')", []),
    ("import torch\ntorch.zeros_like(x); x.new_zeros(3); torch.full(s, 0, **kw)", []),
    ("import numpy as torch2\ntorch2.zeros(3)", []),
])
def test_the_scanner_flags_factories_without_device(snippet, expected):
    assert [(scope, f) for _, _, scope, f in factory_calls_without_device(textwrap.dedent(snippet))] == expected

