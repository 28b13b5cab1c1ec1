"""helpers.launch, which every spawned-rank test runs through: a rank that aborts after its work is
reported, once the others finish, counts as finished (torch's gloo teardown rarely aborts at exit: one
CI run lost all of test_fsdp's 143 cases to it), and one that crashes mid-work fails with its Python
stack."""
from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp

from helpers import launch


def _aborting(rank, world, port, out, before):
    """Rank 1 aborts (SIGABRT) before or after it writes ``out.1``; rank 0 writes ``out.0`` 2 s late (a slow
    rank 0 still saving its record when another rank's teardown aborts)."""
    if rank == 1 and before:
        os.abort()
    if rank == 0:
        time.sleep(2)
    with open(f"{out}.{rank}.tmp", "w") as f:
        f.write(str(port))
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")
    if rank == 1:
        os.abort()


def test_an_abort_after_every_rank_reported_counts_as_finished_and_one_before_names_its_stack(tmp_path):
    out = str(tmp_path / "after")
    launch(_aborting, 2, out, False, reported=[f"{out}.{r}" for r in range(2)])
    assert open(f"{out}.0").read() == open(f"{out}.1").read()  # both ranks were given one port
    out = str(tmp_path / "before")
    with pytest.raises(mp.ProcessExitedException, match=r"(?s)SIGABRT.*rank 1:.*in _aborting"):
        launch(_aborting, 2, out, True, reported=[f"{out}.{r}" for r in range(2)])
    with pytest.raises(ValueError, match="reported"):  # none: every abort would pass for finished
        launch(_aborting, 2, out, False, reported=[])
