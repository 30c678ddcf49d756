"""A real two-node Ray cluster on this machine for the runner's tests (tests/pipelines/test_ray.py): a head and a
second node started as cluster users start them (`ray start --head`, `ray start --address`), each its own process
group, with token authentication on. The second node runs in a mount namespace of its own (unshare(1); as root, or
as root of a user namespace) in which the given folders are empty tmpfs mounts: the runner's repositories, this
checkout's packages and tests, and wherever the installed package points (an editable install) -- so the only copy of
the code it can run is the one the runner ships (py_modules), and it cannot read the repository.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO

PY = sys.executable
RAY = str(Path(PY).parent / "ray")
PACKAGES = ("rlhf", "ablations", "pipelines")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def code_dirs() -> list[Path]:
    """This checkout's packages and tests, and the packages an interpreter started outside it imports."""
    probe = "import json, pathlib, " + ", ".join(PACKAGES)
    probe += "; print(json.dumps([str(pathlib.Path(m.__file__).parent) for m in (" + ", ".join(PACKAGES) + ")]))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([PY, "-c", probe], cwd="/", env=env, capture_output=True, text=True)
    installed = json.loads(out.stdout) if out.returncode == 0 else []  # none: not installed outside this checkout
    found = {Path(p) for p in installed} | {REPO / p for p in (*PACKAGES, "tests")}
    return sorted(p for p in found if p.is_dir())


@dataclass
class Cluster:
    """A running cluster: its address, the environment its users need (the token), its two `ray start` processes."""

    address: str
    env: dict[str, str]
    temp: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, code: str, *args: str, cwd: Path | str = "/", timeout: float = 120) -> dict:
        """A Python script connected to the cluster (``ray.init(ADDRESS)``); its last stdout line, as JSON."""
        script = f"import json, sys, ray\nray.init({self.address!r}, logging_level='ERROR')\n{code}"
        out = subprocess.run(
            [PY, "-c", script, *args], cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def nodes(self) -> dict[str, str]:
        """{"head": its node id, "node": the second node's id}, of the nodes alive."""
        code = (
            "alive = [n for n in ray.nodes() if n['Alive']]\n"
            "print(json.dumps({('head' if 'node:__internal_head__' in n['Resources'] else 'node'): n['NodeID'] "
            "for n in alive}))"
        )
        return self.run(code)

    def task_pids(self, which: str | None = None) -> list[int]:
        """The Ray worker processes of this cluster (of node ``which``, "head" or "node", if given) running a task of
        the runner (titled ``ray::run``)."""
        sessions = {p.pid for w, p in self.procs.items() if which in (None, w)}
        return [pid for pid, title in _processes(sessions) if title.startswith(b"ray::run")]

    def kill(self, which: str) -> None:
        """SIGKILL to every process of one node (a machine that goes down)."""
        proc = self.procs.pop(which)
        for pid, _ in _processes({proc.pid}):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for which in list(self.procs):
            proc = self.procs.pop(which)
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)  # `ray start --block` stops its node
            with suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            for pid, _ in _processes({proc.pid}):  # whatever is left of it
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()


def _processes(sessions: set[int]) -> list[tuple[int, bytes]]:
    """(pid, title) of the processes in these sessions (each node's `ray start` leads one; its workers have process
    groups of their own, not sessions)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            sid = int(stat.read_text().rsplit(")", 1)[1].split()[3])
            title = (stat.parent / "cmdline").read_bytes().split(b"\0")[0]
        except (OSError, IndexError, ValueError):
            continue
        if sid in sessions:
            out.append((int(stat.parent.name), title))
    return out


def start(
    hidden: list[Path], head: tuple[str, ...] = (), node: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Cluster:
    """A head (this machine's view) and a second node that sees ``hidden`` (and ``code_dirs``) as empty folders;
    ``head``/``node``: more `ray start` flags (e.g. --num-cpus, --num-gpus); ``env``: more environment for the nodes
    (their workers inherit it). Waits until both are up."""
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's unix sockets live under it
    port = _free_port()
    env = {
        **os.environ,
        **(env or {}),
        "PATH": f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    env.pop("PYTHONPATH", None)
    cluster = Cluster(f"127.0.0.1:{port}", env, temp)
    common = ("--node-ip-address=127.0.0.1", "--disable-usage-stats", "--block")
    head_cmd = [RAY, "start", "--head", f"--port={port}", f"--temp-dir={temp}/head", "--include-dashboard=false"]
    node_cmd = [RAY, "start", f"--address={cluster.address}", f"--temp-dir={temp}/node"]
    mounts = " && ".join(f"mount -t tmpfs tmpfs {shlex.quote(str(p))}" for p in [*hidden, *code_dirs()])
    unshare = ["unshare", "--mount", *(["--map-root-user"] if os.geteuid() else [])]
    node_sh = f"{mounts} && exec {shlex.join([*node_cmd, *common, *node])}"
    try:
        for which, cmd in (("head", [*head_cmd, *common, *head]), ("node", [*unshare, "sh", "-c", node_sh])):
            log = open(temp / f"{which}.log", "w")  # noqa: SIM115 (the node's, for the life of the process)
            cluster.procs[which] = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/"
            )
            deadline = time.monotonic() + 180
            while "Ray runtime started" not in (temp / f"{which}.log").read_text():
                assert cluster.procs[which].poll() is None, (temp / f"{which}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{which} did not start"
                time.sleep(0.5)
        deadline = time.monotonic() + 120
        while set(cluster.nodes()) != {"head", "node"}:
            assert time.monotonic() < deadline, "the second node did not join"
            time.sleep(1)
    except BaseException:
        cluster.stop()
        raise
    return cluster
