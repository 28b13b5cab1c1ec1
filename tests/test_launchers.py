"""The main job (scripts/demo_deepspeed.py, tiny model, DeepSpeed ZeRO-2, DP=2) under three launchers
must export bitwise the same served bf16 model:

  (a) reference: ``torchrun --standalone --nproc_per_node 2`` (one node, two ranks);
  (b) ``mpirun -n 2``: ranks, world size and master address come from DeepSpeed's MPI discovery
      (mpi4py); run inside a network namespace of our own, so the discovered master address
      (``hostname -I``) and the fixed port 29500 are ours alone;
  (c) ``torchrun --nnodes 2 --nproc_per_node 1``: two agents, each in its own network namespace
      ("host") with its own address on a veth pair, c10d rendezvous on the first host's address,
      gloo over the veth.

Every rank runs one thread (OMP_NUM_THREADS=1): CPU reductions depend on the thread count.
Without ``ip netns`` (no iproute2 or no permission) (b) runs in this namespace with the discovered
address pinned to loopback and (c) runs both agents on loopback; a warning says so.
Only loopback and the addresses of the namespaces created here are ever targeted.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "scripts", "demo_deepspeed.py")
CASTS = ["stochastic", "error_feedback"]
STEPS = 3
TIMEOUT_S = 420  # per launch; a first run also JIT-builds DeepSpeed's shm op (~30-90 s)
WROTE = "Wrote the served bf16 model to"

pytestmark = pytest.mark.slow


def job_env(**extra) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.update(extra)
    return env


def demo_args(cast: str, out: str) -> list[str]:
    return [DEMO, "--model", "tiny", "--steps", str(STEPS), "--trainer-cast", cast,
            "--save-served", os.path.join(out, "served.safetensors"), "--out-dir", out]


# ----------------------------------------------------------------------------- bounded processes
def _descendants(pid: int) -> list[int]:
    """pids below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _stop(proc: subprocess.Popen):
    """SIGTERM the launcher (it stops its workers), then SIGKILL whatever it started that is left."""
    if proc.poll() is None:
        tree = _descendants(proc.pid)
        _kill([proc.pid], signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        _kill([proc.pid] + tree, signal.SIGKILL)
        proc.wait()


def run_launches(cmds: list[list[str]], envs: list[dict], timeout: float = TIMEOUT_S) -> list[tuple[int, str]]:
    """Run the commands together; all must finish within ``timeout``. If one fails, the others are
    stopped (a lone torchrun agent would wait for its peer). Returns (returncode, output) each."""
    logs, procs = [], []
    try:
        for cmd, env in zip(cmds, envs):
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            _stop(p)
    out = []
    for p, log in zip(procs, logs):
        log.seek(0)
        out.append((p.returncode, log.read()))
        log.close()
    if any(rc != 0 for rc, _ in out):
        pytest.fail("launch failed or timed out:\n" + "\n".join(
            f"$ {' '.join(c)}\nrc={rc}\n{text[-4000:]}" for c, (rc, text) in zip(cmds, out)))
    return out


# ----------------------------------------------------------------------------- checks
def check_job(outputs: list[str], cast: str):
    text = "\n".join(outputs)
    # exactly one rank 0: one DP=2 job, not two DP=1 jobs that each wrote the file
    assert text.count(WROTE) == 1, text[-4000:]
    assert f"bit-identical to the side-by-side {cast} export at every step: True" in text, text[-4000:]


def assert_same_served(path: str, ref: str):
    with open(path, "rb") as f, open(ref, "rb") as g:
        if f.read() == g.read():
            return
    import torch
    from safetensors.torch import load_file
    a, b = load_file(path), load_file(ref)
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    diff = {}
    for n, x in a.items():
        y = b[n]
        if x.dtype != y.dtype or x.shape != y.shape:
            diff[n] = f"{x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        elif not torch.equal(x.view(torch.int16), y.view(torch.int16)):
            diff[n] = f"{int((x.view(torch.int16) != y.view(torch.int16)).sum())} of {x.numel()} elements"
    pytest.fail(f"served bf16 export differs from the single-node reference; differing: {diff}")


# ----------------------------------------------------------------------------- (a) reference
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """cast -> the served safetensors of the single-node torchrun run (one run per cast)."""
    done: dict[str, str | BaseException] = {}

    def get(cast: str) -> str:
        if cast not in done:
            out = str(tmp_path_factory.mktemp(f"ref_{cast}"))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   *demo_args(cast, out)]
            try:
                (_, text), = run_launches([cmd], [job_env()])
                check_job([text], cast)
                done[cast] = os.path.join(out, "served.safetensors")
            except BaseException as e:  # noqa: BLE001 - remembered, so later cases fail fast
                done[cast] = e
                raise
        if isinstance(done[cast], BaseException):
            pytest.fail(f"the single-node reference run failed: {done[cast]!s:.2000}")
        return done[cast]

    return get


@pytest.mark.parametrize("cast", CASTS)
def test_single_node_reference(cast, reference):
    assert os.path.getsize(reference(cast)) > 0


# ----------------------------------------------------------------------------- network namespaces
class Hosts:
    """Two network namespaces joined by a veth pair: host i has namespace ns[i], device dev[i],
    address addr[i]. ``None`` fields when namespaces are unavailable (``why`` says why)."""

    def __init__(self):
        self.ns = self.dev = self.addr = None
        self.why = ""

    def exec(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]] if self.ns else []


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(scope="module")
def hosts():
    h = Hosts()
    tag = uuid.uuid4().hex[:6]
    ns, dev, addr = [f"fc{tag}h{i}" for i in (0, 1)], [f"fc{tag}v{i}" for i in (0, 1)], ["10.213.0.1", "10.213.0.2"]
    created = []
    try:
        if os.environ.get("FAIRCAST_TEST_NO_NETNS"):
            raise RuntimeError("FAIRCAST_TEST_NO_NETNS is set")
        if shutil.which("ip") is None:
            raise RuntimeError("no `ip` command (apt-get install iproute2)")
        for n in ns:
            _ip("netns", "add", n)
            created.append(n)
        _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in (0, 1):
            _ip("link", "set", dev[i], "netns", ns[i])
            _ip("-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", dev[i])
            _ip("-n", ns[i], "link", "set", "lo", "up")
            _ip("-n", ns[i], "link", "set", dev[i], "up")
        _ip("netns", "exec", ns[1], "true")  # entering one needs more than creating it
        h.ns, h.dev, h.addr = ns, dev, addr
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        h.why = f"network namespaces unavailable ({detail.strip()}); falling back to loopback"
        warnings.warn(h.why)
    try:
        yield h
    finally:
        for n in created:  # stop anything still running in our namespaces, then drop them (and the veth)
            pids = _ip("netns", "pids", n, check=False).stdout.split()
            _kill([int(p) for p in pids if p.isdigit()], signal.SIGKILL)
            _ip("netns", "del", n, check=False)
        if dev[0] in _ip("link", "show", check=False).stdout:  # a veth that never moved in
            _ip("link", "del", dev[0], check=False)
        if created:
            leftover = set(created) & set(_ip("netns", "list", check=False).stdout.split())
            assert not leftover, f"network namespaces not removed: {leftover}"


def veth_bytes(h: Hosts, i: int) -> int:
    stats = json.loads(_ip("-n", h.ns[i], "-j", "-s", "link", "show", "dev", h.dev[i]).stdout)[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


# ----------------------------------------------------------------------------- (b) mpirun
@pytest.mark.parametrize("cast", CASTS)
def test_mpirun_mpi_discovery_exports_same_model(cast, reference, hosts, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin libopenmpi-dev; .ci/run does)")
    pytest.importorskip("mpi4py", reason="mpi4py missing (the dev extra installs it)")
    ref = reference(cast)
    env = job_env()
    if hosts.ns is None:
        # DeepSpeed's discovery takes MASTER_ADDR from `hostname -I` (this machine's network
        # address); keep it on loopback instead.
        shim = tmp_path / "bin"
        shim.mkdir()
        (shim / "hostname").write_text(f'#!/bin/sh\nif [ "$1" = "-I" ]; then echo 127.0.0.1; '
                                       f'else exec {shutil.which("hostname") or "/bin/hostname"} "$@"; fi\n')
        (shim / "hostname").chmod(0o755)
        env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    out = str(tmp_path)
    cmd = hosts.exec(0) + [
        "mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2",
        "--mca", "btl_vader_single_copy_mechanism", "none",  # containers often forbid CMA
        *[a for v in ("OMP_NUM_THREADS", "PYTHONPATH", "PATH", "DS_ACCELERATOR", "HF_HUB_OFFLINE")
          for a in ("-x", v)],
        sys.executable, *demo_args(cast, out)]
    (_, text), = run_launches([cmd], [env])
    check_job([text], cast)
    assert_same_served(os.path.join(out, "served.safetensors"), ref)


# ----------------------------------------------------------------------------- (c) torchrun, 2 nodes
@pytest.mark.parametrize("cast", CASTS)
def test_torchrun_two_nodes_exports_same_model(cast, reference, hosts, tmp_path):
    ref = reference(cast)
    out, run_id = str(tmp_path), f"fc-{uuid.uuid4().hex[:8]}"
    if hosts.ns is not None:
        endpoint, local = f"{hosts.addr[0]}:29400", hosts.addr
        envs = [job_env(GLOO_SOCKET_IFNAME=hosts.dev[i]) for i in (0, 1)]  # gloo over the veth
        before = veth_bytes(hosts, 1)
    else:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        endpoint, local = f"127.0.0.1:{port}", ["127.0.0.1", "127.0.0.1"]
        envs = [job_env(GLOO_SOCKET_IFNAME="lo") for _ in (0, 1)]
    cmds = [hosts.exec(i) + [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_id,
        # the first agent hosts the rendezvous store; each agent advertises its own address
        "--rdzv_conf", f"is_host={int(i == 0)},join_timeout=180", "--local_addr", local[i],
        *demo_args(cast, out)] for i in (0, 1)]
    texts = [t for _, t in run_launches(cmds, envs)]
    check_job(texts, cast)
    assert_same_served(os.path.join(out, "served.safetensors"), ref)
    if hosts.ns is not None:  # the two ranks talked over the veth (bf16 all-gathers, gradients)
        assert veth_bytes(hosts, 1) - before > 100_000
    else:
        warnings.warn(f"torchrun --nnodes 2 ran both agents on loopback: {hosts.why}")
