"""A restart runs in the standby interpreter kept beside the engine (`clients.standby`): the module imported
before the start was asked for, the start's argv, environment, secrets and title; the standby gone with the
engine; a cold start when the standby died."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from titan_lora.clients.http import JsonClient
from titan_lora.clients.kinds import LaunchPlan
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.transfer import protocol

TARGET = "standby_target"


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The engine child finds the target module (next to this file) and records into the returned file."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv("STANDBY_TARGET_RECORD", str(path))
    return path


@pytest.fixture
def engine(tmp_path: Path, record: Path) -> Iterator[EmbeddedEngine]:
    eng = EmbeddedEngine(LaunchPlan(TARGET, [], standby=True), 0, str(tmp_path / "engine.log"),
                         start_timeout_s=60)
    eng.start()
    yield eng
    eng.stop()


def standbys(engine: EmbeddedEngine) -> list[psutil.Process]:
    """This process's standby children still waiting (the engine may run in one that was)."""
    return [p for p in psutil.Process().children() if protocol.STANDBY_MODULE in " ".join(p.cmdline())
            and p.pid != engine.proc.pid and p.status() != psutil.STATUS_ZOMBIE]


def wait_for_standby(engine: EmbeddedEngine) -> psutil.Process:
    """The standby beside `engine`, once it has imported the module."""
    assert engine.standby is not None and engine.standby.ready(wait_s=60), "no standby beside the running engine"
    assert [p.pid for p in standbys(engine)] == [engine.standby.proc.pid]
    return psutil.Process(engine.standby.proc.pid)


def starts(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_a_restart_runs_in_the_standby_that_imported_the_module_before(engine, record, caplog) -> None:
    standby = wait_for_standby(engine)
    os.kill(engine.proc.pid, signal.SIGKILL)
    asked = time.time()
    with caplog.at_level("INFO", logger="titan_lora.clients.launch"):
        engine.restart()
    assert engine.proc.pid == standby.pid, "the standby became the engine"
    assert any("from its standby" in r.getMessage() for r in caplog.records)
    second = starts(record)[-1]
    assert second["pid"] == standby.pid and second["imported_at"] < asked < second["main_at"]
    assert second["argv"] == ["--port", str(engine.port)]
    assert JsonClient(engine.url, engine.api_key, timeout_s=5).post("/titan/info")["nonce"] == engine.nonce
    shown = " ".join(psutil.Process(engine.proc.pid).cmdline())
    assert shown.endswith(f"-m {protocol.STANDBY_MODULE} {TARGET}"), shown
    environ = Path(f"/proc/{engine.proc.pid}/environ").read_bytes().split(b"\0")
    assert not any(protocol.API_KEY_ENV.encode() in e or protocol.NONCE_ENV.encode() in e for e in environ), \
        "the secrets travel on stdin: neither on the command line nor in the environment others can list"
    assert any(e.startswith(b"TITAN_LORA_ENGINE_JOB=") for e in environ), "a later job finds a dead run's engine"
    assert wait_for_standby(engine).pid != standby.pid, "a new standby waits for the start after this one"


def test_the_standby_goes_with_the_engine(engine) -> None:
    standby = wait_for_standby(engine)
    engine.stop()
    assert not standby.is_running() or standby.status() == psutil.STATUS_ZOMBIE
    assert standbys(engine) == []


def test_the_starts_environment_reaches_the_standby_and_a_dead_standby_means_a_cold_start(engine, record,
                                                                                            monkeypatch) -> None:
    standby = wait_for_standby(engine)
    monkeypatch.setenv("STANDBY_TEST_CHANGED", "1")  # set after the standby was made
    os.kill(engine.proc.pid, signal.SIGKILL)
    engine.restart()
    assert engine.proc.pid == standby.pid and starts(record)[-1]["changed"] == "1"

    dead = wait_for_standby(engine)
    dead.kill()
    dead.wait(5)
    os.kill(engine.proc.pid, signal.SIGKILL)
    engine.restart()
    assert engine.proc.pid not in (standby.pid, dead.pid)
    assert starts(record)[-1]["pid"] == engine.proc.pid
    assert JsonClient(engine.url, engine.api_key, timeout_s=5).post("/titan/info")["nonce"] == engine.nonce
