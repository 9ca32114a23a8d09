"""A standby engine interpreter: it imports an engine module ahead of need, then becomes that engine when told.

    python -m titan_lora.engines.standby MODULE    (the launcher passes the ready descriptor's number)

Importing vLLM is 14-16 s of a 20-25 s engine start on a 2-core CPU, and of every recovery. The launcher
keeps one standby beside each running engine. It imports the module on a thread with a raised nice value
(the running job keeps the CPU; the engine itself later runs on the main thread at the process's own
priority), writes one byte to the ready descriptor, then waits for one JSON line on stdin,
`{"argv": [...], "env": {...}}`, and runs `MODULE.main()` with that environment (the API key and nonce
travel here, never on a command line) and argv, as `python -m MODULE *argv` would. `ps` shows the engine as
`python -m titan_lora.engines.standby MODULE`: its argv is in its log (vLLM prints its flags). EOF on stdin
(the launcher let it go) ends it quietly.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from types import ModuleType

from titan_lora.transfer import protocol

IMPORT_NICE = 10
"""The importing thread's nice value: about a tenth of a core's share against a busy job's threads."""


def import_quietly(name: str) -> ModuleType:
    """Import `name` on a thread of lowered priority (Linux nice is per thread); its errors are raised here."""
    out: dict[str, object] = {}

    def load() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMPORT_NICE)
        except OSError:
            pass  # not allowed here: import at the usual priority
        try:
            out["module"] = importlib.import_module(name)
        except BaseException as err:  # noqa: BLE001 (re-raised on the main thread)
            out["error"] = err

    thread = threading.Thread(target=load, name="titan-standby-import")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["module"]  # type: ignore[return-value]


def take_environment(env: dict[str, str]) -> None:
    """Make `env` this process's environment, changing only what differs: the variables this process started
    with keep their memory, right after argv's, where setproctitle writes a title (vLLM titles its engine
    core `VLLM::EngineCore` with it); cleared and refilled, it would find none and title nothing."""
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def main() -> None:
    """Import, signal readiness, wait for the start command, become the engine."""
    name = sys.argv[1]
    ready = int(os.environ[protocol.STANDBY_READY_FD_ENV])
    module = import_quietly(name)
    os.write(ready, b"1")
    os.close(ready)
    line = sys.stdin.readline()
    if not line:
        return
    command = json.loads(line)
    take_environment({**command["env"], protocol.STANDBY_READY_FD_ENV: str(ready)})  # closed: a stale number
    sys.argv = [module.__file__ or name, *command["argv"]]
    module.main()


if __name__ == "__main__":
    main()
