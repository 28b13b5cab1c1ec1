"""The README's "Use the casts in your own code" snippet runs as written, and casts what the
reference casts would."""
import os
import re

import torch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def snippet(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    text = open(README, encoding="utf-8").read()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_use_the_casts_in_your_own_code():
    from faircast_dist import derive_key
    from faircast_dist.rounding import cast_stochastic
    scope = {}
    exec(compile(snippet("## Use the casts in your own code"), "README.md", "exec"), scope)  # its asserts run
    assert scope["caster"].step == 1
    for name, master in scope["state"].items():
        assert torch.equal(scope["served"][name], cast_stochastic(master, derive_key(1234, 0, name), 0))
