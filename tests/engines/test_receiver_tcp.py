"""The real receiver process fed by the real bucket emitter, as the composition root wires it: over tcp
(`[engine] transport = "tcp"`), and with `pytest -m gpu` over CUDA IPC into a receiver on the GPU. The
base (two buckets, double-buffered) and three adapter versions arrive byte for byte (SHA-256 of every
tensor the receiver holds against the trainer's), every bucket acked with its checksum; over tcp the engine
never opens a shared-memory segment, over CUDA IPC every trainer buffer is GPU memory (the leak check of
CUDA IPC ref-counter files is the GRPO job's, tests/rl/test_grpo_gpu.py: it needs the trainer to exit)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from dist_helpers import needs_gpus
from shm_helpers import mapped_segments

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.kinds import engine_kind
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.compose import engine_endpoint
from titan_lora.config import Engine, WeightSync
from titan_lora.transfer.transports.cuda_ipc import CudaIpcBuffer
from titan_lora.transfer.transports.tcp import TcpBuffer

CPU = torch.device("cpu")
SHIM_DIR = str(Path(__file__).parent)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _start(tmp_path, monkeypatch, *args: str) -> EmbeddedEngine:  # noqa: ANN001
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [SHIM_DIR, os.environ.get("PYTHONPATH")])))
    engine = EmbeddedEngine("receiver_shim", 0, list(args), str(tmp_path / "engine.log"), start_timeout_s=60,
                            health_timeout_s=2.0)
    engine.start()
    return engine


@pytest.fixture
def receiver(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    engine = _start(tmp_path, monkeypatch)
    yield engine
    engine.stop()


def _adapter(emitter, version: int, device: torch.device = CPU) -> AdapterPayload:  # noqa: ANN001
    """Adapter tensors written into the buffer the emitter lends, as the gatherer writes them."""
    shapes = [(16, 576), (576, 16), (16, 576), (192, 16)] * 20
    flat, home = emitter.lend_buffer(sum(a * b for a, b in shapes), torch.float32, device)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(version)).to(device))
    tensors, at = {}, 0
    for i, (a, b) in enumerate(shapes):
        tensors[f"base_model.model.layers.{i}.lora_{'AB'[i % 2]}.weight"] = flat[at : at + a * b].view(a, b)
        at += a * b
    return AdapterPayload(f"policy-v{version}", version, tensors, {"r": 16, "lora_alpha": 32}, home=home)


def _emitter(engine: EmbeddedEngine, transport: str):  # noqa: ANN202
    config = Engine(kind="receiver", transport=transport)
    endpoint = engine_endpoint(engine_kind("receiver"), config, engine.url, engine.api_key)
    return engine_kind("receiver").emitter(WeightSync(bucket_mb=1, timeout_s=30), config, endpoint)


def _send_base_and_adapters(emitter, device: torch.device) -> AdapterPayload:  # noqa: ANN001
    """Base, then adapter versions 1-3 (v1 retired before v3: its slab takes v3), each checked byte for
    byte in the engine; returns the last payload."""
    g = torch.Generator().manual_seed(0)
    base = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1536, 576, generator=g).to(device) for i in range(2)}
    ack = emitter.send_base(base, 1)
    assert (ack.num_tensors, ack.nbytes) == (2, 2 * 1536 * 576 * 4) and ack.phases_ms["buckets"] == 2
    for version in (1, 2, 3):
        if version == 3:
            assert emitter.retire_adapter("policy-v1", timeout_s=10)
        payload = _adapter(emitter, version, device)
        ack = emitter.send_adapter(payload)
        assert (ack.version, ack.num_tensors, ack.nbytes) == (version, payload.num_tensors, payload.nbytes)
        assert ack.phases_ms["pack_ms"] == 0, "the lent buffer went as it is, with no packing copy"
        held = emitter.client.post("/titan/digest", {"name": payload.name})
        assert held == {n: _digest(t) for n, t in payload.tensors.items()}, f"v{version} bytes differ"
    held = emitter.client.post("/titan/digest", {"name": "policy-v2"})  # v3 took v1's slab, not v2's
    assert held == {n: _digest(t) for n, t in _adapter(emitter, 2, device).tensors.items()}, "v2 was overwritten"
    assert emitter.client.post("/titan/digest", {"name": "base"}) == {n: _digest(t) for n, t in base.items()}
    return payload


def test_the_receiver_gets_base_and_adapters_over_tcp_and_opens_no_shared_memory(receiver) -> None:  # noqa: ANN001
    emitter = _emitter(receiver, "tcp")
    try:
        payload = _send_base_and_adapters(emitter, CPU)
        assert emitter._buffers and all(isinstance(b, TcpBuffer) for b in [*emitter._buffers, payload.home])
        assert mapped_segments(receiver.proc.pid) == set(), "the engine mapped a shared-memory segment"
        fds = f"/proc/{receiver.proc.pid}/fd"
        assert not [fd for fd in os.listdir(fds) if os.readlink(f"{fds}/{fd}").startswith("/dev/shm/")]
    finally:
        emitter.close()


@needs_gpus(1)
def test_the_receiver_on_the_gpu_gets_base_and_adapters_over_cuda_ipc_byte_for_byte(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    device = torch.device("cuda", 0)
    engine = _start(tmp_path, monkeypatch, "--device", str(device))
    emitter = _emitter(engine, "cuda_ipc")
    try:
        payload = _send_base_and_adapters(emitter, device)
        assert all(isinstance(b, CudaIpcBuffer) for b in [*emitter._buffers, payload.home])
    finally:
        engine.stop()  # the receiver unmaps our buffers before the emitter frees them
        emitter.close()
