"""Process-group start-up: one process without a launcher needs no free TCP port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

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
