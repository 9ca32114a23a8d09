"""A process spawned or forked from an engine's main module dies with its parent, even by SIGKILL (vLLM's
engine core does not watch its API server); the parent itself is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, multiprocessing, os, signal, sys, time
    from titan_lora.engines.lifetime import children_die_with_this_process
    ARMED = children_die_with_this_process()

    def child(q):
        armed = ctypes.c_int()  # PR_GET_PDEATHSIG (2): the signal armed, 0 for none
        ctypes.CDLL(None).prctl(2, ctypes.byref(armed))
        q.put((armed.value == signal.SIGKILL, os.getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context(sys.argv[1])
        q = ctx.Queue()
        ctx.Process(target=child, args=(q,)).start()
        armed, pid = q.get(timeout=60)
        print(ARMED, armed, pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_a_spawned_or_forked_child_dies_with_its_killed_parent(start: str, tmp_path: Path) -> None:
    (tmp_path / "spawner.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), str(tmp_path)])}
    with open(tmp_path / "out.txt", "w") as out:  # a file: a surviving child would hold a pipe open
        subprocess.run([sys.executable, "-m", "spawner", start], cwd=tmp_path, env=env, stdout=out, timeout=120)
    parent_armed, child_armed, pid = (tmp_path / "out.txt").read_text().split()
    assert (parent_armed, child_armed) == ("False", "True")
    deadline = time.monotonic() + 10
    while psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the {start} child {pid} outlived its SIGKILLed parent"
        time.sleep(0.1)


PORT_SCRIPT = textwrap.dedent("""
    import os, signal, socket, sys, time
    from titan_lora.engines.lifetime import forked_children_close_port
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # bound before the fork, listening after it: as vLLM's API server does
    port = server.getsockname()[1]
    if sys.argv[1] == "armed":
        forked_children_close_port(port)
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    server.listen()
    time.sleep(0.5)  # the child's at-fork handler has run
    server.close()  # the API server is gone: is the port free, or does the child still listen on it?
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", port))
        print("free")
    except OSError:
        print("held")
    os.kill(child, signal.SIGKILL)
""")


@pytest.mark.parametrize(("armed", "port"), [("armed", "free"), ("unarmed", "held")])
def test_a_forked_child_drops_the_servers_listening_port(armed: str, port: str, tmp_path: Path) -> None:
    (tmp_path / "listener.py").write_text(PORT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, str(tmp_path / "listener.py"), armed], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == port, out.stderr


def test_closing_the_bound_port_leaves_no_descriptor_behind() -> None:
    from titan_lora.engines.lifetime import close_bound

    read, write = os.pipe()  # descriptors that are not sockets: each is copied to be looked at
    try:
        before = sorted(os.listdir("/proc/self/fd"))
        close_bound(1)
        assert sorted(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(read)
        os.close(write)
