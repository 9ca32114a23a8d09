"""The embedded engine launcher: only its own engine (nonce), a busy port refused, secrets by
environment, and a dead or hung engine detected in bounded time and restarted."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan_lora.clients.http import JsonClient
from titan_lora.clients.kinds import LaunchPlan
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import API_KEY_ENV

SHIM = "receiver_shim"


@pytest.fixture(autouse=True)
def shim_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine child finds the test shim module (tests/engines/receiver_shim.py)."""
    here = str(Path(__file__).parents[1] / "engines")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


def _engine(tmp_path: Path, port: int = 0, **kwargs) -> EmbeddedEngine:
    return EmbeddedEngine(LaunchPlan(SHIM, []), port, str(tmp_path / "engine.log"), start_timeout_s=60,
                          **kwargs)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[EmbeddedEngine]:
    eng = _engine(tmp_path, health_timeout_s=1.0)
    eng.start()
    yield eng
    if eng.proc is not None and eng.alive():
        os.kill(eng.proc.pid, signal.SIGCONT)
    eng.stop()


def _info(eng: EmbeddedEngine) -> dict:
    return JsonClient(eng.url, eng.api_key, timeout_s=5).post("/titan/info")


def test_a_busy_port_is_a_clear_error_and_the_other_engine_is_left_alone(
        engine: EmbeddedEngine, tmp_path: Path) -> None:
    other_pid, other_nonce = engine.proc.pid, engine.nonce
    busy = rf"port {engine.port} is already in use.*\[engine\] port"
    with pytest.raises(TransferError, match=busy):
        _engine(tmp_path / "second", port=engine.port)
    assert engine.alive() and engine.proc.pid == other_pid
    assert _info(engine)["nonce"] == other_nonce, "the first engine must still serve, untouched"


def test_an_engine_that_does_not_echo_our_nonce_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHIM_FOREIGN_NONCE", "1")
    eng = _engine(tmp_path)
    with pytest.raises(TransferError, match=r"not the one titan_lora started.*\[engine\] port"):
        eng.start()
    assert eng.proc.poll() is not None, "our own child is stopped after the refusal"


def test_the_api_key_is_random_by_default_and_travels_by_environment_only(engine) -> None:
    other = EmbeddedEngine(LaunchPlan(SHIM, []), 0, "unused.log")
    other.stop()
    assert len(engine.api_key) >= 32 and engine.api_key != other.api_key
    assert not any(engine.api_key in arg or engine.nonce in arg for arg in engine.proc.args)
    environ = Path(f"/proc/{engine.proc.pid}/environ").read_bytes().split(b"\0")
    assert f"{API_KEY_ENV}={engine.api_key}".encode() in environ
    assert _info(engine)["nonce"] == engine.nonce


def test_the_plans_environment_is_set_over_ours_in_every_incarnation(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it on every rank
    eng = EmbeddedEngine(LaunchPlan(SHIM, [], {"OMP_NUM_THREADS": "7"}), 0, str(tmp_path / "engine.log"),
                         start_timeout_s=60)
    try:
        for _ in range(2):  # the start, then a restart
            eng.start() if eng.proc is None else eng.restart()
            environ = Path(f"/proc/{eng.proc.pid}/environ").read_bytes().split(b"\0")
            assert b"OMP_NUM_THREADS=7" in environ and b"OMP_NUM_THREADS=1" not in environ
    finally:
        eng.stop()


def test_a_dead_engine_is_detected_and_restarted_on_the_same_port(engine) -> None:
    first_pid, first_nonce = engine.proc.pid, engine.nonce
    os.kill(first_pid, signal.SIGKILL)
    engine.proc.wait(5)
    assert not engine.healthy()
    assert engine.ensure_running() is True
    assert engine.proc.pid != first_pid and engine.nonce != first_nonce
    assert _info(engine)["nonce"] == engine.nonce and engine.starts == 2
    assert engine.ensure_running() is False, "a healthy engine is left alone"


def test_a_hung_engine_is_detected_within_the_health_timeout_and_replaced(engine) -> None:
    hung = engine.proc
    os.kill(hung.pid, signal.SIGSTOP)  # alive, but not serving
    started = time.monotonic()
    assert not engine.healthy(0.5)
    assert time.monotonic() - started < 3.0, "the health check must be bounded by its timeout"
    assert engine.ensure_running() is True
    assert hung.poll() == -signal.SIGKILL, "the hung engine must be killed, not left behind"
    assert engine.healthy() and _info(engine)["nonce"] == engine.nonce


def _gone(pid: int) -> bool:
    """The process no longer runs (gone, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_stopped_engine_core_goes_with_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   how: str) -> None:
    # vLLM's engine core is a child of its API server; SIGSTOPped (or wedged in a kernel), it ignores the
    # SIGTERM its parent's death sends it, and would hold its memory and GPU forever.
    pid_file = tmp_path / "core.pid"
    monkeypatch.setenv("SHIM_CHILD", str(pid_file))
    eng = _engine(tmp_path, health_timeout_s=1.0)
    eng.start()
    core = int(pid_file.read_text())
    try:
        os.kill(core, signal.SIGSTOP)
        getattr(eng, how)()
        deadline = time.monotonic() + 10
        while not _gone(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(core), f"the stopped engine core outlived the engine ({how})"
        assert not eng.alive()
    finally:
        if not _gone(core):
            os.kill(core, signal.SIGKILL)


def test_each_start_gets_a_fresh_key_that_clients_of_the_engine_follow(engine) -> None:
    """A key a dead engine's port took (or any client sent it) opens nothing on the next incarnation; the
    clients built on `engine.key` carry the new one."""
    client = JsonClient(engine.url, engine.key, timeout_s=5)
    first = engine.api_key
    assert client.post("/titan/info")["nonce"] == engine.nonce
    os.kill(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(5)
    assert engine.ensure_running() is True
    assert engine.api_key != first and len(engine.api_key) >= 32
    environ = Path(f"/proc/{engine.proc.pid}/environ").read_bytes().split(b"\0")
    assert f"{API_KEY_ENV}={engine.api_key}".encode() in environ
    assert client.post("/titan/info")["nonce"] == engine.nonce, "the same client follows the new key"
    with pytest.raises(TransferError, match="refused the API key"):
        JsonClient(engine.url, first, timeout_s=5).post("/titan/info")


def test_a_key_the_user_fixed_stays_across_restarts(tmp_path: Path) -> None:
    eng = _engine(tmp_path, api_key="user-fixed-key")
    eng.start()
    try:
        eng.restart()
        assert eng.api_key == "user-fixed-key" and _info(eng)["nonce"] == eng.nonce
    finally:
        eng.stop()
