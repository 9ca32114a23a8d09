"""Start and supervise an embedded engine process (rank 0 only): the vLLM engine or the receiver.

The engine is ours only if it echoes the nonce we gave it: a port can be taken by another job's
engine between our choice of it and our engine's bind, and syncing into (or sampling from) that
engine would be silent corruption. The port stays reserved by a bound, non-listening socket with
SO_REUSEADDR until our engine answers (its server binds with SO_REUSEADDR too, so it can take the
port; nobody else can). Secrets (API key, nonce) travel by environment, never on argv (`ps` shows it).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from titan_lora.clients.http import ApiKey, JsonClient
from titan_lora.clients.kinds import LaunchPlan
from titan_lora.clients.standby import Standby
from titan_lora.transfer import protocol
from titan_lora.transfer.parent_death import die_with_parent
from titan_lora.transfer.errors import EngineDied, EngineHung, EngineUnreachable, TransferError

logger = logging.getLogger(__name__)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
JOB_ENV = "TITAN_LORA_ENGINE_JOB"
"""Set in every engine's environment: '<pid>:<start time>' of the job process that started it, so that a
later job finds an engine that a dead run left on its port (`clear_orphan_on`)."""


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (racy: see `reserve_port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_id(proc: psutil.Process) -> str:
    """A process's id that a later process with its pid does not share: '<pid>:<start time>'."""
    return f"{proc.pid}:{proc.create_time():.2f}"


def _job_alive(job: str) -> bool:
    try:
        return job_id(psutil.Process(int(job.partition(":")[0]))) == job
    except (psutil.Error, ValueError):
        return False


def clear_orphan_on(port: int) -> bool:
    """Kill the titan_lora engine listening on `port` when the job that started it has ended (its process
    group: vLLM's engine core too); True when one was killed. A live job's engine and any other server are
    left alone (and only this user's processes can be seen)."""
    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None or not conn.laddr or conn.laddr.port != port:
            continue
        try:
            proc = psutil.Process(conn.pid)
            job = proc.environ().get(JOB_ENV)
            group = os.getpgid(proc.pid)
        except (psutil.Error, OSError):  # gone meanwhile, or not ours to read
            continue
        if job is None or _job_alive(job):
            continue
        logger.warning("port %d is held by a titan_lora engine (pid %d) that a run which has ended (pid %s) left "
                       "running; killing it and the processes it started", port, proc.pid, job.partition(":")[0])
        if group == proc.pid and group != os.getpgid(0):  # its own group (start_new_session): all of it
            os.killpg(group, signal.SIGKILL)
        else:
            proc.kill()
        psutil.wait_procs([proc], timeout=10)
        return True
    return False


def reserve_port(port: int = 0, clear_orphan: bool = True) -> socket.socket:
    """A bound, non-listening socket holding `port` (0: any free one) until it is closed; an engine that a
    dead titan_lora run left on `port` is killed first (`clear_orphan_on`)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE and port and clear_orphan and clear_orphan_on(port):
            return reserve_port(port, clear_orphan=False)
        if err.errno == errno.EADDRINUSE:
            raise TransferError(
                f"port {port} is already in use (another titan_lora engine or another server listens "
                "on it); set [engine] port to a free port, or to 0 to pick one"
            ) from None
        raise
    return sock


def engine_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"[lora] rank = {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; "
                     f"lower [lora] rank to at most {VLLM_LORA_RANKS[-1]}")


# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: an engine spawned
# from a short-lived thread (a replica's revival, a parallel start) would get SIGTERM as that thread
# returns. Every engine is therefore forked from this one thread, which lives as long as the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-engine-spawner")


def _die_with_parent(parent: int) -> None:
    # Linux: a trainer killed with SIGKILL (OOM, lost node) must not leave its engine running. SIGKILL, not
    # SIGTERM: vLLM's API server answers SIGTERM with a graceful shutdown that first releases the trainer's
    # buffers behind the engine's running steps (bounded at 25 s), then stops its engine core: a busy engine
    # outlives its dead trainer by tens of seconds, holding its memory and port, while a dead trainer has
    # nothing left to release. Its engine core dies with it (`engines.lifetime`).
    die_with_parent(parent)


class EmbeddedEngine:
    """An engine child process (`python -m <plan.module> --port N *plan.args`, with `plan.env` set over our
    environment); restarted if it dies or hangs. It takes the plan whole: a caller that passed module and
    args alone would lose the environment the plan needs (a CPU engine's thread count). With
    `plan.standby`, a pre-imported interpreter of the module waits beside the running engine and the next
    start runs in it (`clients.standby`).

    `prefix` is a command the engine runs under (e.g. `ip netns exec NS`: the tests' engine in its own
    network namespace), `host` the address it is reached at (its `--host` in the plan's args must serve
    it). The port is reserved on this host's loopback: an engine under a prefix that changes its network
    stack relies on the nonce alone to prove it is ours."""

    def __init__(self, plan: LaunchPlan, port: int, log_path: str, start_timeout_s: float = 600.0,
                 api_key: str = "", health_timeout_s: float = 10.0, prefix: tuple[str, ...] = (),
                 host: str = "127.0.0.1") -> None:
        self.module = plan.module
        self.args = list(plan.args)
        self.env = dict(plan.env)
        self.keeps_standby = plan.standby
        self._standby: Standby | None = None
        self.prefix = prefix
        # An open engine API is anyone's to rewrite. Clients read `key`: a fresh one at every start.
        self._fixed_key = api_key
        self.key = ApiKey(api_key or secrets.token_urlsafe(32))
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.health_timeout_s = health_timeout_s
        self._reservation: socket.socket | None = reserve_port(port)
        self.port = self._reservation.getsockname()[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        self.nonce = ""
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        """Spawn the engine and wait until it answers with our nonce (the vLLM engine takes ~25 s on CPU)."""
        if self._reservation is None:  # a restart: take the port back from the dead process
            self._reservation = reserve_port(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.nonce = secrets.token_hex(16)
        # A fresh key per incarnation ([engine] api_key fixes one): a process that took a dead engine's port
        # and read the key a client sent it cannot use it on the next engine.
        self.key.value = self._fixed_key or secrets.token_urlsafe(32)
        argv = ["--port", str(self.port), *self.args]
        env = {**self._base_env(), protocol.API_KEY_ENV: self.api_key, protocol.NONCE_ENV: self.nonce}
        self.proc = self._from_standby(argv, env)
        if self.proc is None:
            logger.info("starting %s (log: %s)", self.module, self.log_path)
            with open(self.log_path, "ab") as log:
                self.proc = _SPAWNER.submit(self._popen, [*self.prefix, sys.executable, "-m", self.module, *argv],
                                            stdout=log, stderr=subprocess.STDOUT, env=env).result()
        self.starts += 1
        try:
            self._wait_ready()
        except BaseException:
            self.kill()  # our own child only: a foreign engine on the port is never touched
            raise
        finally:
            self._reservation.close()
            self._reservation = None
        if self.keeps_standby:
            try:
                self._standby = _SPAWNER.submit(Standby.spawn, self._popen, self.prefix, self.module,
                                                self._base_env(), self.log_path).result()
            except OSError as err:  # the engine runs; only its next start will be cold
                logger.warning("%s: no standby for the next start: %s", self.module, err)

    def _from_standby(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        """The engine started in the standby, or None (none, or it died): then the start is cold."""
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        if standby.ready(wait_s=self.start_timeout_s / 2):
            logger.info("starting %s from its standby, imported already (log: %s)", self.module, self.log_path)
            try:
                return standby.become(argv, env)
            except OSError as err:  # it died after saying it was ready: its stdin is a broken pipe
                logger.warning("%s: its standby is gone (%s); starting it cold", self.module, err)
        standby.discard()
        return None

    def _base_env(self) -> dict[str, str]:
        """The engine's environment but for the per-start secrets (which never reach a standby's argv or
        its /proc environ)."""
        return {**os.environ, **self.env, JOB_ENV: job_id(psutil.Process())}

    @staticmethod
    def _popen(cmd: list[str], **kwargs: object) -> subprocess.Popen:
        # Its own process group: a kill reaches vLLM's engine core and workers too, which a SIGTERM from
        # their dying parent does not while they are stopped (SIGSTOP) or wedged. Called on `_SPAWNER`.
        return subprocess.Popen(cmd, preexec_fn=functools.partial(_die_with_parent, os.getpid()),
                                start_new_session=True, **kwargs)

    @property
    def standby(self) -> Standby | None:
        """The interpreter waiting for the next start, if one does."""
        return self._standby

    @property
    def api_key(self) -> str:
        """The key of the current incarnation."""
        return self.key.value

    def _client(self, timeout_s: float) -> JsonClient:
        return JsonClient(self.url, self.api_key, timeout_s=timeout_s)

    def _check_identity(self, info: dict) -> None:
        if info.get("nonce") != self.nonce:
            raise TransferError(
                f"the engine answering on port {self.port} is not the one titan_lora started (its nonce "
                f"differs): another engine serves that port; it is left untouched. Set [engine] "
                "port to a free port, or to 0 to pick one"
            )

    def _wait_ready(self) -> None:
        client = self._client(min(5.0, self.start_timeout_s))
        started = time.monotonic()
        deadline = started + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                self.kill()  # what it started goes too; reaps it, which gives its exit code
                raise TransferError(f"{self.module} exited with code {self.proc.returncode} during start-up; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                info = client.post(protocol.path(protocol.INFO))
            except EngineUnreachable:
                time.sleep(0.2)
                continue
            except TransferError as err:  # e.g. 401: a server that does not know our key
                raise TransferError(f"port {self.port} is served by another server ({err}); set "
                                   "[engine] port to a free port, or to 0 to pick one") from None
            self._check_identity(info)
            logger.info("%s ready at %s after %.0f s", self.module, self.url, time.monotonic() - started)
            return
        raise TransferError(f"{self.module} did not become ready in {self.start_timeout_s:.0f} s "
                           f"([weight_sync] engine_start_timeout_s); see {self.log_path}")

    def log_tail(self, lines: int = 20) -> str:
        """The end of the engine's log."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        """True while the engine process exists (it may still be hung). It is not reaped here: until `kill`
        reaps it, its pid (the id of its process group) cannot be reused by another process."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def check(self, timeout_s: float | None = None) -> None:
        """Raise EngineDied unless the process runs, answers /titan/info with our nonce and /titan/live (a
        no-op through its engine core and workers) in time; EngineHung when only its front answers."""
        timeout_s = timeout_s or self.health_timeout_s
        if not self.alive():
            code = None if self.proc is None else self.proc.returncode
            raise EngineDied(f"{self.module} is not running (exit code {code}); see {self.log_path}")
        client = self._client(timeout_s)
        try:
            info = client.post(protocol.path(protocol.INFO))
        except TransferError as err:
            raise EngineDied(f"{self.module} did not answer its health check within {timeout_s:.1f} s "
                             f"([weight_sync] health_timeout_s): {err}") from None
        self._check_identity(info)
        try:
            client.check_live(timeout_s)
        except EngineHung as err:
            raise EngineHung(f"{self.module} is wedged ([weight_sync] health_timeout_s = {timeout_s:g}): "
                             f"{err}") from None
        except TransferError as err:
            raise EngineDied(f"{self.module} failed its health check: {err}") from None

    def healthy(self, timeout_s: float | None = None) -> bool:
        """True when the engine runs and answers within `timeout_s` (default: the health timeout)."""
        try:
            self.check(timeout_s)
        except TransferError:  # dead, hung, or another engine answering on our port
            return False
        return True

    def ensure_running(self) -> bool:
        """Restart the engine if it died or hangs; True when it was restarted."""
        if self.healthy():
            return False
        self.restart()
        return True

    def restart(self) -> None:
        """Kill the engine (a hung one too: SIGKILL works on a stopped process) and start it again."""
        logger.warning("%s is dead or hung; restarting it (log: %s)", self.module, self.log_path)
        self.kill()
        self.start()

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (vLLM's engine core and workers), wedged or
        stopped ones too: every request in flight on it fails at once."""
        if self.proc is None or self.proc.returncode is not None:  # reaped by an earlier kill
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        try:  # its own group (start_new_session): the unreaped leader keeps the group id ours
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)  # reaped at once after SIGKILL; bounded all the same
        # Its children (an engine core still tearing down its model, KV cache and our mapped buffers) are gone
        # before a restart starts the next one beside them.
        _, left = psutil.wait_procs(children, timeout=30)
        if left:
            logger.warning("%s: processes %s outlived SIGKILL by 30 s", self.module, [p.pid for p in left])

    def stop(self) -> None:
        """Terminate the engine process (SIGKILL if it does not exit within 30 s), then SIGKILL whatever
        of its process group is left; its standby goes too."""
        if self._standby is not None:
            self._standby.discard()
            self._standby = None
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None
        if self.alive():
            self.proc.terminate()
            deadline = time.monotonic() + 30
            while self.alive() and time.monotonic() < deadline:  # not reaped: see `alive`
                time.sleep(0.05)
        self.kill()  # what the graceful exit left: a stopped engine core ignores its parent's SIGTERM


def start_engines(engines: list[EmbeddedEngine]) -> None:
    """Start `engines` at once (each waits for its own readiness); if any fails, stop them all and raise."""
    errors: list[BaseException] = []

    def start(engine: EmbeddedEngine) -> None:
        try:
            engine.start()
        except BaseException as err:  # noqa: BLE001 (re-raised below, after the others are stopped)
            errors.append(err)

    threads = [threading.Thread(target=start, args=(e,), name="titan-engine-start") for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # each start is bounded by its start_timeout_s
    if errors:
        for engine in engines:
            engine.stop()
        raise errors[0]
