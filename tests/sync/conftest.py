"""Fixtures of the in-process WeightSyncer tests: `sleeps` records back-off and polling delays instead of
sleeping, and `rig` builds a WeightSyncer on one rank (no process group) around the fakes of
inprocess_rig.py, closing each syncer's retirer after the test.
"""

from __future__ import annotations

import pytest
import torch
from inprocess_rig import Base, Emitter, Engine, Probe, Rig, Source, cfg

from titan_lora.sync import syncer as syncer_mod
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Back-off and polling delays, recorded instead of slept."""
    delays: list[float] = []
    monkeypatch.setattr(syncer_mod.time, "sleep", delays.append)
    return delays


@pytest.fixture
def rig(sleeps):
    """make(**cfg overrides, engine=False, probe=None) -> Rig; every syncer made is closed after the test."""
    made: list[WeightSyncer] = []

    def make(engine: bool = False, probe: Probe | None = None, **overrides) -> Rig:
        em, src, base = Emitter(), Source(), Base()
        eng = Engine() if engine else None
        section = cfg(**overrides)
        versions = AdapterVersions(section.lora_name, section.keep_versions)
        s = WeightSyncer(src, base, em, section, torch.device("cpu"), versions=versions, engine=eng, probe=probe)
        made.append(s)
        return Rig(s, em, src, base, eng, probe)

    yield make
    for s in made:
        s.retirer.close()
