"""Transport benchmark: an adapter sync over tcp vs shm into the receiver process, over loopback,
beside the floors (a memory copy and the loopback bandwidth, both measured in the same run), as ratios.

    python scripts/bench_transport.py [--iters 30]

SmolLM2-135M + LoRA r16 on all linears (420 tensors, 18.6 MiB fp32), one trainer process. A sync is
what training does: the gather into the emitter's lent buffer, then the bucket posts, the engine's
copy-out (tcp: its fetch first), checksums and acks. The two emitters alternate, so that drifting
load on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_sync import CPU_TOML, alternating, p, randomize, timed

from titan_lora.clients.http import JsonClient
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.vllm import VLLMBucketEmitter, receiver_plan
from titan_lora.config import WeightSync
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.trainer.build import build_from_toml
from titan_lora.trainer.job_config import job_config_from_toml
from titan_lora.transfer.placement import choose_transport
from titan_lora.transfer.transport import TransportChoice


def loopback_ms(nbytes: int, iters: int) -> list[float]:
    """Wall times of moving `nbytes` over one kept TCP connection on 127.0.0.1 (sendall / recv_into)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    out = memoryview(dst.numpy())
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
        go = threading.Semaphore(0)

        def send() -> None:
            for _ in range(iters + 2):
                go.acquire()
                sender.sendall(memoryview(src.numpy()))

        threading.Thread(target=send, daemon=True).start()

        def one() -> None:
            go.release()
            got = 0
            while got < nbytes:
                got += receiver.recv_into(out[got:])

        times = timed(one, iters)
        sender.close()
        receiver.close()
    return times


def main() -> None:
    """Run both transports against one receiver process and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    iters = ap.parse_args().iters

    built = build_from_toml(CPU_TOML, device=torch.device("cpu"))
    randomize(built.model)
    lora = job_config_from_toml(CPU_TOML).lora
    engine = EmbeddedEngine(receiver_plan(torch.device("cpu")), 0,
                            os.path.join(tempfile.gettempdir(), "titan_lora_bench_transport.log"), start_timeout_s=60)
    engine.start()
    emitters: dict[str, VLLMBucketEmitter] = {}
    try:
        choices = {"shm": TransportChoice(), "tcp": choose_transport("tcp", engine.url)}
        emitters = {name: VLLMBucketEmitter(JsonClient(engine.url, engine.key), WeightSync.bucket_mb, choice)
                    for name, choice in choices.items()}
        sources = {name: AdapterSource(built.model, built.peft_layout, lora, f"bench-{name}", lend=em.lend_buffer)
                   for name, em in emitters.items()}
        version = iter(range(1, 100_000))
        live: list[tuple[str, str]] = []
        phases: dict[str, list[dict[str, float]]] = {name: [] for name in emitters}

        def sync_with(name: str):  # noqa: ANN202
            def run() -> None:
                payload = sources[name].snapshot(next(version))
                phases[name].append(dict(emitters[name].send_adapter(payload).phases_ms))
                live.append((name, payload.name))
            return run

        def retire() -> None:
            while live:
                name, adapter = live.pop()
                emitters[name].retire_adapter(adapter, timeout_s=30)

        payload = sources["shm"].snapshot(0)
        nbytes = payload.nbytes
        print(f"adapter: {payload.num_tensors} tensors, {nbytes / 2**20:.1f} MiB, bucket_mb {WeightSync.bucket_mb}")
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        copy = timed(lambda: dst.copy_(src), 20)
        loop = loopback_ms(nbytes, 20)
        shm_ms, tcp_ms = alternating([sync_with("shm"), sync_with("tcp")], iters, between=retire)
        copy_p50, loop_p50 = statistics.median(copy), statistics.median(loop)
        print(f"\n{'figure':46s} {'p50 ms':>8s} {'p99 ms':>8s} {'x copy':>7s} {'x loopback':>11s}")
        for name, t in [("floor: memory copy of the adapter bytes", copy),
                        ("floor: loopback TCP of the adapter bytes", loop),
                        ("adapter sync over shm (gather..ack)", shm_ms),
                        ("adapter sync over tcp (gather..ack)", tcp_ms)]:
            med = statistics.median(t)
            print(f"{name:46s} {med:8.2f} {p(t, 0.99):8.2f} {med / copy_p50:7.1f} {med / loop_p50:11.1f}")
        print(f"\ntcp / shm per sync, p50: {statistics.median(tcp_ms) / statistics.median(shm_ms):.2f}x; "
              f"loopback bandwidth {nbytes / loop_p50 / 1e6:.2f} GB/s, memory copy {nbytes / copy_p50 / 1e6:.2f} GB/s")
        print("\nphase medians, ms")
        for name, rows in phases.items():
            keys = [k for k in rows[0] if k.endswith("_ms")]
            print(f"  {name}: " + "  ".join(f"{k[:-3]} {statistics.median(r[k] for r in rows):7.2f}" for k in keys))
    finally:
        engine.stop()  # the receiver unmaps our buffers first; then they are freed, also after an error
        for em in emitters.values():
            em.close()


if __name__ == "__main__":
    main()
