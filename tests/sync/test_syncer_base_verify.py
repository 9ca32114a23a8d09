"""The syncer verifies the base an engine loaded itself (`[weight_sync] base = "verify"`), on the in-process
fakes: equal digests send nothing and record the base as ours; differing ones send only those tensors (the
engine completes the rest from its disk); an engine that loaded nothing, one that cannot verify, and
`base = "push"` get the whole base. The trainer's digests are computed once per dtype."""

from __future__ import annotations

import torch
from inprocess_rig import BASE, Base, Emitter, Source, VerifyingEmitter, cfg

from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions

OURS = {"model.embed_tokens.weight": "d-embed", "model.norm.weight": "d-norm"}


def _syncer(emitter: Emitter, digests: bool = True) -> tuple[WeightSyncer, Base, list]:
    asked: list = []

    def ours(dtype):
        asked.append(dtype)
        return dict(OURS)

    base = Base()
    syncer = WeightSyncer(Source(), base, emitter, cfg(), torch.device("cpu"), versions=AdapterVersions("policy", 2),
                          base_digests=ours if digests else None)
    return syncer, base, asked


def test_an_engine_whose_base_equals_ours_is_verified_and_nothing_is_sent() -> None:
    emitter = VerifyingEmitter({"dtype": "bfloat16", "digests": {**OURS, "model.rotary.inv_freq": "x"}})
    syncer, base, asked = _syncer(emitter)
    metrics = syncer.sync(1)
    assert emitter.calls == ["incarnation", "digests", "adopt v1", "incarnation", "adapter policy-v1"]
    assert base.starts == 0, "no base tensor was gathered or sent"
    assert asked == [torch.bfloat16], "our digests are taken in the engine's dtype"
    assert metrics["sync/base_verified"] == 1.0 and metrics["sync/base_sends"] == 0.0 and "sync/base_ms" in metrics
    assert syncer.versions.active.name == "policy-v1"
    syncer.retirer.close()


def test_only_the_tensors_whose_digests_differ_are_sent() -> None:
    emitter = VerifyingEmitter({"dtype": "float32", "digests": {**OURS, "model.norm.weight": "corrupted"}})
    syncer, base, _ = _syncer(emitter)
    metrics = syncer.sync(1)
    assert emitter.calls == ["incarnation", "digests", "base part v1: ['model.norm.weight']", "incarnation",
                             "adapter policy-v1"]
    assert (base.starts, base.drawn) == (1, 1)
    assert metrics["sync/base_sends"] == 1.0 and metrics["sync/base_verified"] == 0.0
    syncer.retirer.close()


def test_the_whole_base_goes_to_an_engine_that_loaded_none_cannot_verify_or_is_told_to_take_it() -> None:
    for emitter, digests in [(VerifyingEmitter({"dtype": None, "digests": {}}), True),  # --load-format dummy
                             (VerifyingEmitter({"dtype": "float32", "digests": {n: "other" for n in OURS}}), True),
                             (Emitter(), True),  # SGLang, the receiver: no digests
                             (VerifyingEmitter({"dtype": "float32", "digests": OURS}), False)]:  # base = "push"
        syncer, base, _ = _syncer(emitter, digests)
        syncer.sync(1)
        assert "base v1" in emitter.calls and (base.starts, base.drawn) == (1, len(BASE)), emitter.calls
        assert not any(c.startswith(("adopt", "base part")) for c in emitter.calls)
        syncer.retirer.close()


def test_our_digests_are_computed_once_per_dtype_across_engine_incarnations() -> None:
    emitter = VerifyingEmitter({"dtype": "bfloat16", "digests": dict(OURS)})
    syncer, _, asked = _syncer(emitter)
    syncer.sync(1)
    emitter.incarnation = "inc-2"  # the engine restarted (it loaded its checkpoint again)
    syncer.sync(2)
    assert emitter.calls.count("digests") == 2 and emitter.calls.count("adopt v2") == 1
    assert asked == [torch.bfloat16], "the trainer's base does not change: one digest pass"
    syncer.retirer.close()
