"""Start and supervise an embedded engine process (rank 0 only): the vLLM engine or the receiver."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from titan_lora.emitters.base import EmitterError
from titan_lora.engines.http import EngineUnreachable, JsonClient

logger = logging.getLogger(__name__)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"[lora] rank = {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def _die_with_parent() -> None:
    # Linux: a trainer killed with SIGKILL (OOM, lost node) must not leave its engine running.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedEngine:
    """An engine child process (`python -m <module> --port N ...`); restarted if it dies."""

    def __init__(self, module: str, port: int, args: list[str], log_path: str, start_timeout_s: float = 600,
                 api_key: str = "") -> None:
        self.module = module
        self.api_key = api_key
        self.port = port
        self.args = args
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        """Spawn the engine and wait until it answers (the vLLM engine takes ~25 s on CPU)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", self.module, "--port", str(self.port), *self.args]
        logger.info("starting %s (log: %s)", self.module, self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ},
                                         preexec_fn=_die_with_parent)
        self.starts += 1
        self._wait_ready()

    def _wait_ready(self) -> None:
        client = JsonClient(self.url, self.api_key, timeout_s=5)
        deadline = time.monotonic() + self.start_timeout_s
        started = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EmitterError(f"{self.module} exited with code {self.proc.returncode} during start-up; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                client.post("/titan/info")
                logger.info("%s ready at %s after %.0f s", self.module, self.url, time.monotonic() - started)
                return
            except EngineUnreachable:
                time.sleep(1.0)
        raise EmitterError(f"{self.module} did not become ready in {self.start_timeout_s:.0f} s; see {self.log_path}")

    def log_tail(self, lines: int = 20) -> str:
        """The end of the engine's log."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def ensure_running(self) -> None:
        """Restart the engine if its process has died."""
        if self.proc is None or self.proc.poll() is not None:
            logger.warning("%s is not running (exit code %s); restarting it", self.module,
                           None if self.proc is None else self.proc.returncode)
            self.start()

    def stop(self) -> None:
        """Terminate the engine process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
