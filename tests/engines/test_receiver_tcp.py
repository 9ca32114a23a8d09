"""The real receiver process fed by the real bucket emitter, as the composition root wires it: over tcp
and over nccl's gloo fallback (`[engine] transport = "tcp"` / `"nccl"`), and with `pytest -m gpu` over
CUDA IPC into a receiver on the GPU. The base (two buckets, double-buffered) and three adapter versions
arrive byte for byte (SHA-256 of every tensor the receiver holds against the trainer's), every bucket
acked with its checksum; over tcp and nccl the engine never opens a shared-memory segment (the trainer
made none), over CUDA IPC every trainer buffer is GPU memory (the leak check of CUDA IPC ref-counter
files is the GRPO job's, tests/rl/test_grpo_gpu.py: it needs the trainer to exit). Over nccl: wrong
bytes are refused by the checksum, and an engine that restarts, or dies mid-transfer, gets a new group
for its new incarnation."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from dist_helpers import needs_gpus
from shm_helpers import mapped_segments

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.kinds import LaunchPlan, engine_kind
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.compose import engine_endpoint
from titan_lora.config import Engine, WeightSync
from titan_lora.transfer.buckets import bucket_checksum, bucket_size, layout_id, plan_buckets
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.transports import nccl

CPU = torch.device("cpu")
SHIM_DIR = str(Path(__file__).parent)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _start(tmp_path, monkeypatch, *args: str) -> EmbeddedEngine:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [SHIM_DIR, os.environ.get("PYTHONPATH")])))
    engine = EmbeddedEngine(LaunchPlan("receiver_shim", list(args)), 0, str(tmp_path / "engine.log"),
                            start_timeout_s=60,
                            health_timeout_s=2.0)
    engine.start()
    return engine


@pytest.fixture
def receiver(tmp_path, monkeypatch):
    engine = _start(tmp_path, monkeypatch)
    yield engine
    engine.stop()


def _adapter(emitter, version: int, device: torch.device = CPU) -> AdapterPayload:
    """Adapter tensors written into the buffer the emitter lends, as the gatherer writes them."""
    shapes = [(16, 576), (576, 16), (16, 576), (192, 16)] * 20
    flat, home = emitter.lend_buffer(sum(a * b for a, b in shapes), torch.float32, device)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(version)).to(device))
    tensors, at = {}, 0
    for i, (a, b) in enumerate(shapes):
        tensors[f"base_model.model.layers.{i}.lora_{'AB'[i % 2]}.weight"] = flat[at : at + a * b].view(a, b)
        at += a * b
    return AdapterPayload(f"policy-v{version}", version, tensors, {"r": 16, "lora_alpha": 32}, home=home)


def _emitter(engine: EmbeddedEngine, transport: str):
    """The bucket emitter the composition root builds for `[engine] transport` (nccl: its gloo fallback)."""
    config = Engine(kind="receiver", transport=transport, nccl_backend="gloo")
    endpoint = engine_endpoint(engine_kind("receiver"), config, engine.url, engine.key)  # follows restarts
    return engine_kind("receiver").emitter(WeightSync(bucket_mb=1, timeout_s=30), config, endpoint)


def _send_base_and_adapters(emitter, device: torch.device) -> AdapterPayload:
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


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_the_receiver_gets_base_and_adapters_and_opens_no_shared_memory(receiver, transport: str) -> None:
    emitter = _emitter(receiver, transport)
    try:
        payload = _send_base_and_adapters(emitter, CPU)
        assert emitter._buffers and {b.kind for b in [*emitter._buffers, payload.home]} == {transport}
        assert mapped_segments(receiver.proc.pid) == set(), "the engine mapped a shared-memory segment"
        fds = f"/proc/{receiver.proc.pid}/fd"
        assert not [fd for fd in os.listdir(fds) if os.readlink(f"{fds}/{fd}").startswith("/dev/shm/")]
    finally:
        emitter.close()


@needs_gpus(1)
def test_the_receiver_on_the_gpu_gets_base_and_adapters_over_cuda_ipc_byte_for_byte(
        tmp_path, monkeypatch) -> None:
    device = torch.device("cuda", 0)
    engine = _start(tmp_path, monkeypatch, "--device", str(device))
    emitter = _emitter(engine, "cuda_ipc")
    try:
        payload = _send_base_and_adapters(emitter, device)
        assert {b.kind for b in [*emitter._buffers, payload.home]} == {"cuda_ipc"}
    finally:
        engine.stop()  # the receiver unmaps our buffers before the emitter frees them
        emitter.close()


def _groups(buf: nccl.NcclBuffer) -> list[nccl._Group]:
    """The groups of the trainer's nccl hub that serves `buf`: one per engine incarnation."""
    return list(buf._server._groups.values())


def test_over_nccl_wrong_bytes_are_refused_by_the_checksum(receiver) -> None:
    emitter = _emitter(receiver, "nccl")
    try:
        payload = _adapter(emitter, 1)
        emitter.send_adapter(payload)  # buffers made, layouts known, group joined
        tensors = dict(list(payload.tensors.items())[:2])
        (entries,) = plan_buckets(tensors, 1 << 20)
        buf = payload.home
        other = buf.tensor[: bucket_size(entries)].clone()
        other[100] ^= 1  # the trainer claims other bytes than the engine receives
        claimed = bucket_checksum(other)
        with pytest.raises(TransferError, match="checksum mismatch"):
            emitter.client.post("/titan/bucket", {
                "transfer_id": "wrong-bytes", "kind": "adapter", "layout": layout_id(entries),
                "header": [e.to_json() for e in entries], "segment": buf.describe(0), "checksum": claimed})
        assert len(_groups(buf)) == 1, "a refused bucket leaves the group as it was"
    finally:
        emitter.close()


def test_over_nccl_an_engine_restart_gets_a_new_group_even_mid_transfer(receiver, monkeypatch) -> None:
    emitter = _emitter(receiver, "nccl")
    try:
        hub = _adapter(emitter, 1)
        emitter.send_adapter(hub)
        hub = hub.home
        (first,) = _groups(hub)
        os.kill(receiver.proc.pid, signal.SIGKILL)  # dies between transfers: its connection ends
        receiver.proc.wait(10)
        deadline = time.monotonic() + 10
        while not first.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.failed and not _groups(hub), "the trainer dropped the dead incarnation's group"
        receiver.start()  # the new incarnation: same emitter, same buffers, a new group
        payload = _adapter(emitter, 2)
        ack = emitter.send_adapter(payload)
        assert ack.version == 2 and emitter.client.post("/titan/digest", {"name": payload.name}) == {
            n: _digest(t) for n, t in payload.tensors.items()}
        (second,) = _groups(hub)
        assert second.name != first.name and not second.failed
        # Dies mid-transfer: paused inside its bucket, after joining, before the copy-out.
        marker = f"{receiver.log_path}.marker"
        receiver.stop()
        monkeypatch.setenv("TITAN_LORA_FAULT_BUCKET_PAUSE_S", "30")
        monkeypatch.setenv("TITAN_LORA_FAULT_MARKER", marker)
        receiver.start()
        started = time.monotonic()
        sending = ThreadPoolExecutor(1).submit(emitter.send_adapter, _adapter(emitter, 3))
        while not os.path.exists(marker):
            assert time.monotonic() - started < 30, "the receiver never paused in its bucket"
            time.sleep(0.05)
        os.kill(receiver.proc.pid, signal.SIGKILL)
        with pytest.raises(Exception):  # the HTTP post fails: connection reset or refused
            sending.result(timeout=30)
        assert time.monotonic() - started < 30, "the trainer waited on the dead engine past its bounds"
    finally:
        emitter.close()
