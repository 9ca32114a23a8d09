"""The main job on two embedded vLLM replicas: one is SIGKILLed inside an adapter bucket, later the other's
whole process tree is frozen (SIGSTOP) while rollouts run on it. Each is quarantined while training goes
on (the frozen one by the liveness watch within 2 x health_timeout_s, with the shipped 600 s request
timeouts), revived in the background (its own base verified, then the newest version) and rejoins; the job finishes with
one published version per step, and one step's rollouts are split over both replicas.

The job trains a tiny random Qwen3 rewarded by completion length (`job_helpers.on_tiny_model`): a step takes
about a second, so once two steps have run without a replica the test holds the job in its rewards until
the replica has rejoined (a revival takes an engine start, ~25 s), and both rejoins land inside the run.

`long` (`pytest -m long`; 86 s of the CI run: four engine starts, two of them waited for) since 2026-12-06.
In the default run the same quarantine, revival and rejoin logic runs on the recording fakes of
tests/sync/test_replicas.py (a failed replica quarantined, revived with its own base verified or the base
sent, fed the newest version and rejoined; a wedged one quarantined within its health timeout, its rollouts
sent to the others; one version to every live replica; the router's spread and pinning), and a live
engine's kill, wedge and restart inside a job in test_grpo_faults.py and test_grpo_async.py."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from job_helpers import HOLD_ENV, in_flight, kill_tree, launch, on_tiny_model, scalars, short_config, wait_for
from process_helpers import ENGINE_MODULE, engine_servers

STEPS = 14
STEPS_WITHOUT = 2  # steps trained while a replica is out, before the test holds the job for its rejoin
SERVER = ENGINE_MODULE
API_KEY = "replicas-test-key"
HEALTH_TIMEOUT_S = 3


def replicas_config(tmp: Path) -> Path:
    path = short_config(tmp, steps=STEPS)
    text = path.read_text()
    text = re.sub(r"^eval_every = \d+", "eval_every = 0", text, flags=re.M)
    text = re.sub(r"^port = .*$", f'port = 0\nreplicas = 2\nkv_cache_gib = 1\napi_key = "{API_KEY}"', text,
                  count=1, flags=re.M)
    # Requests may wait 600 s (the shipped default): only the liveness watch can quarantine a frozen replica.
    text = re.sub(r"^timeout_s = .*$", f"timeout_s = 600\nrollout_timeout_s = 600\nhealth_timeout_s = {HEALTH_TIMEOUT_S}",
                  text, flags=re.M)
    path.write_text(text)
    return path


def server_ports(job_pid: int) -> dict[int, int]:
    """port -> pid of each replica's API server process under the job."""
    return engine_servers(job_pid)


def server_of(pid: int) -> int:
    """The replica API server that process `pid` (its engine worker) runs under."""
    import psutil

    for proc in [psutil.Process(pid), *psutil.Process(pid).parents()]:
        if SERVER in " ".join(proc.cmdline()):
            return proc.pid
    raise AssertionError(f"process {pid} runs under no {SERVER}")


def stop_tree(pid: int) -> float:
    """SIGSTOP a process and all its descendants; when."""
    import psutil

    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        proc.send_signal(signal.SIGSTOP)
    return time.monotonic()


def port_of(ports: dict[int, int], pid: int) -> int:
    return next(port for port, p in ports.items() if p == pid)


def steps_logged(log: Path) -> int:
    return len(re.findall(r"^step\s+\d+/", log.read_text(), re.M))


def held_until(pattern: str, hold: Path, job, log: Path) -> None:
    """Let `STEPS_WITHOUT` more steps run, then hold the job in its rewards until `pattern` is logged."""
    ran = steps_logged(log) + STEPS_WITHOUT
    wait_for(lambda: steps_logged(log) >= ran or re.search(pattern, log.read_text()), "steps without it", job, log)
    hold.touch()
    try:
        wait_for(lambda: re.search(pattern, log.read_text()), "the rejoin", job, log)
    finally:
        hold.unlink()


@pytest.mark.slow
@pytest.mark.long
def test_grpo_job_goes_on_while_one_replica_is_killed_and_another_frozen(tmp_path, smollm2_dir):
    marker, hold = tmp_path / "bucket-pause", tmp_path / "hold"
    marker.touch()  # disarmed until the test removes it
    config = replicas_config(tmp_path)
    env = {**on_tiny_model(config, smollm2_dir), HOLD_ENV: str(hold),
           "TITAN_LORA_FAULT_BUCKET_PAUSE_S": "30", "TITAN_LORA_FAULT_MARKER": str(marker)}
    log = tmp_path / "replicas.log"
    job = launch(config, log, env=env)
    text = lambda: log.read_text()  # noqa: E731
    try:
        wait_for(lambda: steps_logged(log) >= 1, "step 1", job, log)
        # 1. SIGKILL inside an adapter bucket: of the two replicas, the one whose worker paused in it.
        marker.unlink()
        wait_for(lambda: marker.exists() and marker.read_text(), "a paused bucket", job, log, timeout_s=300)
        ports = server_ports(job.pid)
        killed = server_of(int(marker.read_text()))
        killed_port = port_of(ports, killed)
        os.kill(killed, signal.SIGKILL)
        rejoined = r"replica \d \(http://127.0.0.1:{}\) rejoined with the base and adapter version (\d+)"
        held_until(rejoined.format(killed_port), hold, job, log)
        # 2. SIGSTOP the other one's whole process tree while rollouts run on it: its liveness check fails,
        # it is quarantined, its rollouts go to the other, it is restarted and rejoins.
        frozen_port = next(p for p in ports if p != killed_port)
        wait_for(lambda: in_flight(frozen_port, API_KEY) > 0, "rollouts on the other replica", job, log,
                 poll_s=0.005)
        frozen_at = stop_tree(ports[frozen_port])
        quarantined = rf"replica \d \(http://127.0.0.1:{frozen_port}\) quarantined: (.*)"
        wait_for(lambda: re.search(quarantined, text()), "the frozen replica's quarantine", job, log, poll_s=0.05)
        to_quarantine = time.monotonic() - frozen_at
        held_until(rejoined.format(frozen_port), hold, job, log)
        assert job.wait(timeout=900) == 0, text()[-4000:]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
    out = text()
    kill_line = re.search(rf"replica (\d) \(http://127.0.0.1:{killed_port}\) quarantined: (.*)", out)
    # The kill landed while the replica's worker sat inside an adapter bucket (the marker holds its pid). Which
    # sees the dead server first is a race: the transfer's own reply, or the liveness watch, which checks the
    # replicas with work in flight (the transfer is that work) every health_timeout_s / 2.
    assert kill_line, "the killed replica was quarantined"
    assert ("sending adapter policy-v" in kill_line[2]
            or "failed its liveness check with work in flight" in kill_line[2]), kill_line[2]
    frozen_line = re.search(quarantined, out)
    print(f"\nfrozen replica quarantined {to_quarantine:.1f} s after its SIGSTOP: {frozen_line[1][:160]}")
    assert "failed its liveness check" in frozen_line[1]
    assert to_quarantine < 2 * HEALTH_TIMEOUT_S + 1, "quarantined within 2 x health_timeout_s (+1 s of log)"
    assert out.count(f"starting {SERVER}") == 4, "two starts, two restarts"
    tags = scalars(tmp_path / "run/tb")
    for step in range(1, STEPS + 1):
        assert tags["sync/version"][step] == step, f"step {step}: one published adapter version per step"
        assert tags["sync/parity_max_abs"][step] < 1e-3, f"step {step}: engine and trainer disagree"
        assert tags["rl/logprob_gap_max"][step] < 1e-3, f"step {step}: rollouts not from the claimed version"
    assert min(tags["sync/live_replicas"].values()) == 1 and tags["sync/live_replicas"][STEPS] == 2
    for i in (0, 1):
        assert tags[f"replica{i}/quarantines"][STEPS] == 1 and tags[f"replica{i}/rejoins"][STEPS] == 1
    split = {i: tags[f"replica{i}/samples"][1] for i in (0, 1)}
    print(f"\nstep 1 rollouts per replica: {split}")
    assert sum(split.values()) == 8 and min(split.values()) > 0, "one step's groups go to both replicas"
    # Both replicas load the checkpoint themselves: the syncer verified the set's base once, each revival its own.
    assert tags["sync/base_verified"][STEPS] == 1 and tags["sync/base_sends"][STEPS] == 0
