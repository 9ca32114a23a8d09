"""The vLLM bucket emitter's request flow against a scripted engine: buckets in order, the commit on
the last one, and nothing more once a bucket failed."""

from __future__ import annotations

import pytest
import torch

from titan_lora.emitters.base import AdapterPayload, EmitterError
from titan_lora.emitters.vllm import VLLMBucketEmitter


class ScriptedEngine:
    """Answers /titan/bucket like the engine, failing the bucket numbers in `fail`."""

    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.fail = fail
        self.bodies: list[dict] = []

    def post(self, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        assert route == "/titan/bucket"
        self.bodies.append(body)
        if len(self.bodies) - 1 in self.fail:
            raise EmitterError("engine said no")
        header = body["header"]  # every bucket here has its own layout, so each carries its header
        ack = {"tensors": len(header), "bytes": sum(row["nbytes"] for row in header)}
        self.staged = [*getattr(self, "staged", []), ack]
        if "commit" in body:
            ack["commit"] = {"version": body["commit"]["version"], "apply_ms": 1.0,
                             "tensors": sum(a["tensors"] for a in self.staged),
                             "bytes": sum(a["bytes"] for a in self.staged)}
        return ack


def _payload() -> AdapterPayload:
    tensors = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.ones(64, 1024) * i for i in range(4)}
    return AdapterPayload("policy-v3", 3, tensors, {"r": 64, "lora_alpha": 64})


def test_the_commit_rides_on_the_last_of_several_buckets() -> None:
    engine = ScriptedEngine()
    emitter = VLLMBucketEmitter(engine, bucket_mb=1)
    emitter.bucket_bytes = 300 * 1024  # each 256 KiB tensor in its own bucket
    ack = emitter.send_adapter(_payload())
    assert (ack.version, ack.num_tensors, ack.nbytes) == (3, 4, 4 * 256 * 1024)
    assert ack.phases_ms["apply_ms"] == 1.0 and ack.phases_ms["buckets"] == 4
    assert len(engine.bodies) == 4
    assert ["commit" in b for b in engine.bodies] == [False, False, False, True]
    assert engine.bodies[-1]["commit"]["name"] == "policy-v3"
    emitter.close()


def test_after_a_failed_bucket_no_later_bucket_and_no_commit_is_sent() -> None:
    engine = ScriptedEngine(fail={0})
    emitter = VLLMBucketEmitter(engine, bucket_mb=1)
    emitter.bucket_bytes = 300 * 1024
    with pytest.raises(EmitterError, match="engine said no"):
        emitter.send_adapter(_payload())
    assert len(engine.bodies) == 1, "buckets after the failed one were still posted"
    emitter.close()
