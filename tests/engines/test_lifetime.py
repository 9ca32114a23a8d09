"""A process spawned from an engine's main module dies with its parent, even by SIGKILL (vLLM's engine
core does not watch its API server); the parent itself is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, signal, time
    from titan_lora.engines.lifetime import die_with_spawning_parent
    ARMED = die_with_spawning_parent()

    def child(q):
        q.put((ARMED, os.getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        ctx.Process(target=child, args=(q,)).start()
        armed, pid = q.get(timeout=60)
        print(ARMED, armed, pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_spawned_child_dies_with_its_killed_parent(tmp_path: Path) -> None:
    (tmp_path / "spawner.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), str(tmp_path)])}
    with open(tmp_path / "out.txt", "w") as out:  # a file: a surviving child would hold a pipe open
        subprocess.run([sys.executable, "-m", "spawner"], cwd=tmp_path, env=env, stdout=out, timeout=120)
    parent_armed, child_armed, pid = (tmp_path / "out.txt").read_text().split()
    assert (parent_armed, child_armed) == ("False", "True")
    deadline = time.monotonic() + 10
    while psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the spawned child {pid} outlived its SIGKILLed parent"
        time.sleep(0.1)
