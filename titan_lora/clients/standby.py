"""The launcher's side of a standby engine interpreter (`titan_lora.engines.standby`): one process that has
imported the engine module already, kept beside a running engine so that a restart skips the import (vLLM's
is 14-16 s of a 20-25 s start on a 2-core CPU).

A start's argv and whole environment (its secrets too) reach the standby on stdin; only what the module
reads as it is imported saw the environment of the standby's own start, after the engine's previous start
(the same plan, the same trainer). A standby that died is discarded and the engine starts cold, as it would
without one.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from titan_lora.transfer import protocol


class Standby:
    """One pre-imported interpreter of `module`, its stdin and its readiness pipe."""

    def __init__(self, proc: subprocess.Popen, ready_fd: int) -> None:
        self.proc, self._ready_fd = proc, ready_fd
        self._ready = False

    @classmethod
    def spawn(cls, popen: Callable[..., subprocess.Popen], prefix: tuple[str, ...], module: str,
              env: Mapping[str, str], log_path: Path) -> Standby:
        """Start one with `popen` (the launcher's: its parent-death signal and process group) logging to
        `log_path`: `python -m STANDBY_MODULE module` under `prefix`, importing `module` with `env`."""
        read_fd, write_fd = os.pipe()
        standby_env = {**env, protocol.STANDBY_READY_FD_ENV: str(write_fd)}
        try:
            with open(log_path, "ab") as log:
                proc = popen([*prefix, sys.executable, "-m", protocol.STANDBY_MODULE, module], stdin=subprocess.PIPE,
                             stdout=log, stderr=subprocess.STDOUT, env=standby_env, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return cls(proc, read_fd)

    def ready(self, wait_s: float = 0.0) -> bool:
        """True once it has imported its module and waits; waits up to `wait_s` for that (an import under
        way is most of a cold start already done)."""
        if not self._ready and self._ready_fd >= 0 and self.proc.poll() is None:
            readable, _, _ = select.select([self._ready_fd], [], [], wait_s)
            self._ready = bool(readable) and os.read(self._ready_fd, 1) == b"1"
        return self._ready and self.proc.poll() is None

    def _close_ready(self) -> None:
        if self._ready_fd >= 0:
            os.close(self._ready_fd)
            self._ready_fd = -1

    def become(self, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
        """Make it the engine `python -m module *argv` under `env`; its process."""
        self._close_ready()
        self.proc.stdin.write(json.dumps({"argv": argv, "env": dict(env)}).encode() + b"\n")
        self.proc.stdin.close()  # the engine reads nothing more
        return self.proc

    def discard(self) -> None:
        """End it (SIGKILL: it holds nothing but its imports) and reap it."""
        self._close_ready()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
