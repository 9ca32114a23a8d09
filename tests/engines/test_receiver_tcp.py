"""The real receiver process fed over tcp by the real bucket emitter, as the composition root wires it
for `[engine] transport = "tcp"`: the base and two adapter versions arrive byte for byte, every bucket
acked with its checksum, and the engine never opens a shared-memory segment (the trainer made none)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from shm_helpers import mapped_segments

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.kinds import engine_kind
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.compose import engine_endpoint
from titan_lora.config import Engine, WeightSync
from titan_lora.transfer.transports.tcp import TcpBuffer

CPU = torch.device("cpu")
SHIM_DIR = str(Path(__file__).parent)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def receiver(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [SHIM_DIR, os.environ.get("PYTHONPATH")])))
    engine = EmbeddedEngine("receiver_shim", 0, [], str(tmp_path / "engine.log"), start_timeout_s=60,
                            health_timeout_s=2.0)
    engine.start()
    yield engine
    engine.stop()


def _adapter(emitter, version: int) -> AdapterPayload:  # noqa: ANN001
    """Adapter tensors written into the buffer the emitter lends, as the gatherer writes them."""
    shapes = [(16, 576), (576, 16), (16, 576), (192, 16)] * 20
    flat, home = emitter.lend_buffer(sum(a * b for a, b in shapes), torch.float32, CPU)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(version)))
    tensors, at = {}, 0
    for i, (a, b) in enumerate(shapes):
        tensors[f"base_model.model.layers.{i}.lora_{'AB'[i % 2]}.weight"] = flat[at : at + a * b].view(a, b)
        at += a * b
    return AdapterPayload(f"policy-v{version}", version, tensors, {"r": 16, "lora_alpha": 32}, home=home)


def test_the_receiver_gets_base_and_adapters_over_tcp_and_opens_no_shared_memory(receiver) -> None:  # noqa: ANN001
    config = Engine(kind="receiver", transport="tcp")
    endpoint = engine_endpoint(engine_kind("receiver"), config, receiver.url, receiver.api_key)
    emitter = engine_kind("receiver").emitter(WeightSync(bucket_mb=1, timeout_s=30), config, endpoint)
    try:
        g = torch.Generator().manual_seed(0)
        base = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1536, 576, generator=g) for i in range(2)}
        ack = emitter.send_base(base, 1)
        assert (ack.num_tensors, ack.nbytes) == (2, 2 * 1536 * 576 * 4) and ack.phases_ms["buckets"] == 2
        for version in (1, 2):
            payload = _adapter(emitter, version)
            ack = emitter.send_adapter(payload)
            assert (ack.version, ack.num_tensors, ack.nbytes) == (version, payload.num_tensors, payload.nbytes)
            assert ack.phases_ms["pack_ms"] == 0, "the lent tcp buffer went as it is, with no packing copy"
            held = emitter.client.post("/titan/digest", {"name": payload.name})
            assert held == {n: _digest(t) for n, t in payload.tensors.items()}, f"v{version} bytes differ"
        assert emitter.client.post("/titan/digest", {"name": "base"}) == {n: _digest(t) for n, t in base.items()}
        assert emitter._buffers and all(isinstance(b, TcpBuffer) for b in [*emitter._buffers, payload.home])
        assert mapped_segments(receiver.proc.pid) == set(), "the engine mapped a shared-memory segment"
        fds = f"/proc/{receiver.proc.pid}/fd"
        assert not [fd for fd in os.listdir(fds) if os.readlink(f"{fds}/{fd}").startswith("/dev/shm/")]
    finally:
        emitter.close()
