"""Process-group start-up: one process without a launcher needs no free TCP port; a rank under torchrun ends
with its agent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
START = """
import torch, torch.distributed as dist
from titan_lora.trainer.distributed import init_distributed
init_distributed(torch.device("cpu"))
t = torch.ones(2)
dist.all_reduce(t)
print(dist.get_rank(), dist.get_world_size(), t.tolist())
dist.destroy_process_group()  # a gloo group left to interpreter exit can abort it (seen once in CI, rc -6)
"""


def test_a_single_process_starts_while_the_old_default_port_is_taken() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    _start_two(env)
    # WORLD_SIZE=1 and RANK=0 left in the environment (a 1-rank test process sets them) mean no launcher.
    _start_two({**env, "WORLD_SIZE": "1", "RANK": "0"})


def _start_two(env: dict[str, str]) -> None:
    """Start two 1-rank groups at once, with the old fixed port taken, and check each all-reduces."""
    with socket.socket() as busy:  # another job holding the port a fixed default would have used
        try:
            busy.bind(("127.0.0.1", 29571))
            busy.listen()
        except OSError:  # someone already holds it: taken either way
            pass
        runs = [subprocess.Popen([sys.executable, "-c", START], cwd=REPO, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        outs = [r.communicate(timeout=120) for r in runs]
    for run, (out, err) in zip(runs, outs):
        assert run.returncode == 0, err[-2000:]
        assert out.strip() == "0 1 [1.0, 1.0]"


RANK = """
import os, sys, time
from titan_lora.trainer.distributed import end_with_launcher
armed = end_with_launcher() if sys.argv[1] == "armed" else False
with open(sys.argv[2], "w") as f:
    f.write(f"{os.getpid()} {armed}")
time.sleep(600)
"""


@pytest.mark.parametrize("arm", ["armed", "plain"])
def test_a_rank_ends_within_seconds_when_its_torchrun_agent_is_killed(tmp_path, arm: str) -> None:
    """The job's process group SIGKILLed (torchrun's launcher and agent): its ranks, each in a session of its
    own, end with the agent once armed (`end_with_launcher`, which `titan_lora.train` calls first); unarmed,
    they run on, orphaned (which is what the job did before)."""
    script, pid_file = tmp_path / "rank.py", tmp_path / "rank.pid"
    script.write_text(RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    agent = subprocess.Popen([*torchrun, str(script), arm, str(pid_file)], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rank = None
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and agent.poll() is None, "the rank did not start"
            time.sleep(0.2)
        pid, armed = pid_file.read_text().split()
        rank = psutil.Process(int(pid))
        assert os.getpgid(rank.pid) != os.getpgid(agent.pid), "torchrun no longer starts ranks in their own session"
        assert armed == str(arm == "armed")
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        try:
            rank.wait(timeout=5)
            gone = True
        except psutil.TimeoutExpired:
            gone = False
        assert gone == (arm == "armed"), f"{arm} rank {'ended' if gone else 'outlived its agent by 5 s'}"
    finally:
        if rank is not None and rank.is_running():
            rank.kill()
        if agent.poll() is None:
            agent.kill()
