"""An engine titan_lora starts ends with the job that started it, however the job ends: the job's process
group SIGKILLed (the engine runs in its own session, out of the group kill's reach) leaves no process of the
engine within seconds, though the engine, as vLLM's API server does, lingers on SIGTERM. A later job finds an
engine that a dead run left on its port and clears it; a live job's engine on that port is refused, untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from titan_lora.clients.kinds import LaunchPlan
from titan_lora.clients.launch import JOB_ENV, EmbeddedEngine, free_port, job_id
from titan_lora.transfer import protocol
from titan_lora.transfer.errors import TransferError

# An engine as vLLM's is shaped: a front answering INFO with its nonce, an engine core it spawned (which
# arms its own death with the front's), and a SIGTERM handler that takes its time (vLLM's graceful shutdown
# releases buffers behind running steps first).
ENGINE = textwrap.dedent("""
    import json, multiprocessing, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from titan_lora.engines.lifetime import die_with_spawning_parent
    die_with_spawning_parent()

    def core():
        time.sleep(600)

    class Info(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = json.dumps({"nonce": os.environ["%s"]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    if __name__ == "__main__":
        signal.signal(signal.SIGTERM, lambda *_: time.sleep(60))
        multiprocessing.get_context("spawn").Process(target=core, name="EngineCore").start()
        HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Info).serve_forever()
""" % protocol.NONCE_ENV)

JOB = textwrap.dedent("""
    import sys, time
    from titan_lora.clients.kinds import LaunchPlan
    from titan_lora.clients.launch import EmbeddedEngine
    engine = EmbeddedEngine(LaunchPlan("fake_engine", []), int(sys.argv[1]), sys.argv[2], start_timeout_s=60)
    engine.start()
    print(engine.proc.pid, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    (tmp_path / "fake_engine.py").write_text(ENGINE)
    path = os.pathsep.join([str(Path(__file__).parents[2]), str(tmp_path)])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.chdir(tmp_path)
    return {**os.environ, "PYTHONPATH": path}


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _gone_within(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """The processes of `procs` still running (not zombies) after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def test_a_job_killed_with_its_process_group_leaves_no_engine_process(tmp_path: Path, env: dict) -> None:
    job = subprocess.Popen([sys.executable, "-c", JOB, "0", str(tmp_path / "engine.log")], env=env,
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    engine = []
    try:
        engine = _tree(int(job.stdout.readline()))
        assert len(engine) >= 2, "the front and its engine core (and multiprocessing's resource tracker)"
        os.killpg(job.pid, signal.SIGKILL)  # an OOM kill, a lost node: the job's whole group
        job.wait()
        left = _gone_within(engine, 5)
        assert not left, f"engine processes outlived their SIGKILLed job: {[(p.pid, p.name()) for p in left]}"
    finally:
        _kill_all(engine)
        if job.poll() is None:
            job.kill()


def _orphan(port: int, job: str, env: dict) -> subprocess.Popen:
    """The engine on `port` as a run `job` left it (its own session, as EmbeddedEngine starts it)."""
    proc = subprocess.Popen([sys.executable, "-m", "fake_engine", "--port", str(port)], start_new_session=True,
                            env={**env, JOB_ENV: job, protocol.NONCE_ENV: "theirs"})
    deadline = time.monotonic() + 30
    while not any(c.laddr.port == port for c in psutil.Process(proc.pid).net_connections("tcp")):
        assert time.monotonic() < deadline and proc.poll() is None, "the left engine did not start"
        time.sleep(0.1)
    return proc


def test_an_engine_a_dead_run_left_on_the_port_is_cleared_and_a_live_runs_is_refused(
        tmp_path: Path, env: dict, caplog: pytest.LogCaptureFixture) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_job = f"{ended.pid}:{psutil.Process(ended.pid).create_time():.2f}"
    ended.wait()
    port = free_port()
    left = _orphan(port, dead_job, env)
    left_tree = _tree(left.pid)
    ours = None
    try:
        ours = EmbeddedEngine(LaunchPlan("fake_engine", []), port, str(tmp_path / "engine.log"), start_timeout_s=60)
        assert not _gone_within(left_tree, 5), "the left engine (or its engine core) lives on"
        assert f"port {port} is held by a titan_lora engine (pid {left.pid})" in caplog.text
        ours.start()  # the port is ours again
        with pytest.raises(TransferError, match=f"port {ours.port} is already in use .* set \\[engine\\] port"):
            EmbeddedEngine(LaunchPlan("fake_engine", []), ours.port, str(tmp_path / "other.log"))
        assert ours.alive(), "a live run's engine was touched"
        assert psutil.Process(ours.proc.pid).environ()[JOB_ENV] == job_id(psutil.Process())
    finally:
        _kill_all(left_tree)
        if ours is not None:
            ours.kill()
