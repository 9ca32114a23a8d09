"""WeightSyncer in one process, what it publishes and retires: versions outside the keep_versions window
are retired after publishing, an install waits for lagging retirements only past the window; the parity
probe runs every parity_every syncs and reports its figures, the gate holds back (and retires) a version
over the tolerance, a failed probe is counted and never stops or gates, and other ranks probe without a
payload. Runs against the fakes of inprocess_rig.py.
"""

from __future__ import annotations

import logging

import torch
from inprocess_rig import Base, Probe, Source, cfg

from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions

# ---- retention -----------------------------------------------------------------------------------


def test_versions_outside_the_window_are_retired_after_publishing(rig) -> None:
    r = rig(keep_versions=2, retire_timeout_s=4.0)
    for v in (1, 2, 3):
        r.syncer.sync(v)
    assert r.syncer.retirer.wait_idle(5.0)
    assert r.emitter.unloaded == [("policy-v1", 2.0)] and r.syncer.versions.live == [2, 3]


def test_an_install_waits_for_lagging_retirements_only_past_keep_versions(rig) -> None:
    r = rig(keep_versions=2, retire_timeout_s=4.0)
    r.emitter.unload_answer = False  # "not drained yet": version 1 stays live
    waits: list[float] = []
    real_wait = r.syncer.retirer.wait_idle
    r.syncer.retirer.wait_idle = lambda timeout_s: waits.append(timeout_s) or real_wait(timeout_s)
    r.syncer.sync(1)
    r.syncer.sync(2)
    r.syncer.sync(3)  # live [1, 2] when installing: within keep_versions
    assert waits == []
    real_wait(5.0)
    metrics = r.syncer.sync(4)  # live [1, 2, 3] when installing: one past the window
    assert len(waits) == 1 and 3.9 < waits[0] <= 4.0, waits  # what is left of retire_timeout_s
    assert metrics["sync/retire_failed"] >= 1.0 and metrics["sync/retired"] == 0.0


# ---- the parity probe and gate ---------------------------------------------------------------------


def test_the_probe_runs_every_n_syncs_and_reports_its_figures(rig) -> None:
    probe = Probe(worst=0.5)
    r = rig(parity_every=2, probe=probe)
    first = r.syncer.sync(1)
    second = r.syncer.sync(2)
    third = r.syncer.sync(3)
    assert probe.compared == ["policy-v1", "policy-v3"]
    assert first["sync/parity_max_abs"] == 0.5 and first["sync/parity_mean_abs"] == 0.25
    assert "sync/parity_max_abs" not in second and third["sync/parity_max_abs"] == 0.5
    assert first["sync/published"] == 1.0, "without the gate a violation is published"


def test_no_probe_when_parity_every_is_zero(rig) -> None:
    probe = Probe()
    r = rig(parity_every=0, probe=probe)
    r.syncer.sync(1)
    assert probe.compared == []


def test_the_gate_holds_back_a_version_over_the_tolerance(rig, caplog) -> None:
    r = rig(parity_every=1, parity_gate=True, probe=Probe(worst=0.5), retire_timeout_s=4.0)
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        metrics = r.syncer.sync(1)
    assert metrics["sync/published"] == 0.0 and metrics["sync/parity_gated"] == 1.0
    assert metrics["sync/live_versions"] == 0 and r.syncer.versions.active is None
    assert r.syncer.retirer.wait_idle(5.0) and r.emitter.unloaded == [("policy-v1", 2.0)]
    assert ("adapter policy-v1 not published: parity 0.5 > [weight_sync] parity_tolerance 0.1; the engine "
            "keeps serving None") in caplog.messages


def test_the_gate_publishes_a_version_within_the_tolerance(rig) -> None:
    r = rig(parity_every=1, parity_gate=True, probe=Probe(worst=0.1))
    assert r.syncer.sync(1)["sync/published"] == 1.0 and r.syncer.versions.active.version == 1


def test_a_failed_probe_is_counted_and_never_stops_or_gates(rig, caplog) -> None:
    probe = Probe()
    probe.fail = True
    r = rig(parity_every=1, parity_gate=True, probe=probe)
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        metrics = r.syncer.sync(1)
    assert metrics["sync/probe_failures"] == 1.0 and metrics["sync/published"] == 1.0
    assert "sync/parity_max_abs" not in metrics
    assert any(m.startswith("the parity probe failed (") and m.endswith("); training goes on")
               for m in caplog.messages)


def test_every_gated_version_and_failed_probe_is_counted_and_logged(rig, caplog) -> None:
    probe = Probe(worst=0.05)
    r = rig(parity_every=1, parity_gate=True, probe=probe, retire_timeout_s=4.0)
    r.syncer.sync(1)  # within the tolerance: published
    probe.worst = 0.5
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        r.syncer.sync(2)
        r.syncer.sync(3)
    assert r.syncer.counters["parity_gated"] == 2 and r.syncer.versions.active.name == "policy-v1"
    assert ("adapter policy-v2 not published: parity 0.5 > [weight_sync] parity_tolerance 0.1; the engine keeps "
            "serving Lease(name='policy-v1', version=1)") in caplog.messages
    assert r.syncer.retirer.wait_idle(5.0) and r.syncer.retirer.retired == 2
    assert [n for n, _ in r.emitter.unloaded] == ["policy-v2", "policy-v3"]
    probe.fail = True
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        r.syncer.sync(4)
        r.syncer.sync(5)
    assert r.syncer.counters["probe_failures"] == 2
    assert [r.getMessage() for r in caplog.records if r.name == "titan_lora.sync.syncer"][0] == (
        "the parity probe failed (the parity probe: RuntimeError: score request failed); "
                                  "training goes on")


def test_a_gated_version_is_retired_even_with_nothing_active(rig) -> None:
    r = rig(parity_every=1, parity_gate=True, probe=Probe(worst=0.5), retire_timeout_s=4.0)
    r.syncer.sync(1)
    assert r.syncer.retirer.wait_idle(5.0) and r.syncer.retirer.retired == 1


def test_other_ranks_probe_without_a_payload_and_publish_nothing(sleeps) -> None:
    probe = Probe()
    other = WeightSyncer(Source(), Base(), None, cfg(parity_every=1), torch.device("cpu"),
                         versions=AdapterVersions("policy", 2), probe=probe)
    assert other.retirer is None
    assert other._maybe_probe_and_publish(None) == {}
    assert probe.compared == [], "only rank 0 asks the engine"
    other.close()
