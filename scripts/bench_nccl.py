"""nccl transport benchmark: one adapter version from the trainer's GPU to 1 or 2 receiver processes,
beside the floor (a device-to-device copy of the same bytes, measured in the same run) and the cuda_ipc
path (the receiver maps the trainer's memory) as the baseline. Needs torch only (no vLLM, no torchtitan).

    torchrun --nproc_per_node=1 scripts/bench_nccl.py --receivers 1   # or 2, 3; plain `python` works too
    python scripts/bench_nccl.py --device cpu --receivers 1 --iters 5  # CPU smoke test: gloo, shm baseline

The adapter is the Llama-3-8B shape with LoRA r16 on all 7 linears of 32 layers: 448 bf16 tensors,
41.9M params, 83.9 MB, written where the gather would write it (the emitter's lent buffer, one bucket).
A sync is the bucket emitter's `send_adapter`: the checksum of the bytes, the post, the receiver's
receive (nccl) or mapping (cuda_ipc), its copy-out and checksum on its GPU, and the ack. The
receivers run on GPUs 1, 2, 3 as the host has them (the last GPU takes the rest; GPU 0 when there is one);
with several receivers all get each version at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_timing import alternating, p, timed

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.http import JsonClient
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.vllm import VLLMBucketEmitter, receiver_plan
from titan_lora.transfer.placement import choose_transport

# Llama-3-8B: (in, out) of q, k, v, o, gate, up, down; 32 layers.
LINEARS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
           "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
LAYERS, RANK = 32, 16


def adapter_shapes() -> list[tuple[str, tuple[int, int]]]:
    """PEFT names and shapes of the 448 adapter tensors (lora_A: r x in, lora_B: out x r)."""
    out = []
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in LINEARS.items():
            group = "self_attn" if module[0] in "qkvo" else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{group}.{module}"
            out += [(f"{stem}.lora_A.weight", (RANK, fan_in)), (f"{stem}.lora_B.weight", (fan_out, RANK))]
    return out


def adapter(emitter: VLLMBucketEmitter, device: torch.device, version: int) -> AdapterPayload:
    """The adapter written into the buffer the emitter lends (every tensor size is a multiple of 64
    bytes, so back to back is the bucket layout and nothing is packed)."""
    shapes = adapter_shapes()
    flat, home = emitter.lend_buffer(sum(a * b for _, (a, b) in shapes), torch.bfloat16, device)
    flat.normal_(generator=torch.Generator(device).manual_seed(version))
    tensors, at = {}, 0
    for name, (a, b) in shapes:
        tensors[name] = flat[at : at + a * b].view(a, b)
        at += a * b
    # As `AdapterSource` hands it over every sync: one read-only mapping and its byte count, so the
    # emitter reuses its bucket plan and sums no sizes (a plain dict costs ~1 ms of Python per sync).
    return AdapterPayload(f"bench-v{version}", version, types.MappingProxyType(tensors),
                          {"r": RANK, "lora_alpha": 32}, home=home, known_nbytes=at * flat.element_size())


def main() -> None:
    """Start the receivers, time both transports alternately, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receivers", type=int, choices=[1, 2, 3], default=1)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    fars = [torch.device("cuda", min(1 + i, torch.cuda.device_count() - 1)) if gpu else device
            for i in range(args.receivers)]
    far = fars[0]
    baseline, backend = ("cuda_ipc", "nccl") if gpu else ("shm", "gloo")
    log = os.path.join(tempfile.gettempdir(), "titan_lora_bench_nccl_{}.log")
    engines = [EmbeddedEngine(receiver_plan(fars[i]), 0, log.format(i), start_timeout_s=120)
               for i in range(args.receivers)]
    emitters: dict[str, list[VLLMBucketEmitter]] = {}
    pool = ThreadPoolExecutor(args.receivers)
    try:
        for engine in engines:
            engine.start()
        for name, kind in ((backend, "nccl"), (baseline, baseline)):
            emitters[name] = [VLLMBucketEmitter(JsonClient(e.url, e.key), 256,
                                                choose_transport(kind, e.url, nccl_backend=backend if kind == "nccl" else ""))
                              for e in engines]
        payloads = {name: adapter(ems[0], device, 0) for name, ems in emitters.items()}
        version = iter(range(1, 100_000))
        live: list[tuple[str, str]] = []

        def sync_with(name: str):  # noqa: ANN202
            def run() -> None:
                v, payload = next(version), payloads[name]
                payload = dataclasses.replace(payload, name=f"{name}-v{v}", version=v)
                for ack in pool.map(lambda em: em.send_adapter(payload), emitters[name]):
                    assert (ack.version, ack.num_tensors, ack.nbytes) == (v, 448, payload.nbytes), ack
                live.append((name, payload.name))
            return run

        def retire() -> None:  # off the timed path, as training retires old versions
            while live:
                name, adapter_name = live.pop()
                for em in emitters[name]:
                    em.retire_adapter(adapter_name, timeout_s=30)

        nbytes = payloads[backend].nbytes
        print(f"adapter: {payloads[backend].num_tensors} tensors, {nbytes / 1e6:.1f} MB bf16; trainer {device}, "
              f"{args.receivers} receiver(s) on {', '.join(map(str, fars))}" + (f" ({torch.cuda.get_device_name(device)})" if gpu else ""))
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=far)
        sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
        floor = timed(lambda: dst.copy_(src), 50, sync)
        nccl_ms, base_ms = alternating([sync_with(backend), sync_with(baseline)], args.iters, between=retire)
        floor_p50 = statistics.median(floor)
        print(f"\n{'figure':52s} {'p50 ms':>8s} {'p99 ms':>8s} {'x floor':>8s}")
        for name, t in [(f"floor: {device} -> {far} copy of the adapter bytes", floor),
                        (f"adapter sync over nccl ({backend}) to {args.receivers} receiver(s)", nccl_ms),
                        (f"adapter sync over {baseline} to {args.receivers} receiver(s)", base_ms)]:
            med = statistics.median(t)
            print(f"{name:52s} {med:8.3f} {p(t, 0.99):8.3f} {med / floor_p50:8.1f}")
        print(f"\nfloor bandwidth {nbytes / floor_p50 / 1e6:.1f} GB/s; goal: nccl p50 <= 2 ms to one receiver")
    finally:
        for engine in engines:
            engine.stop()  # receivers unmap our buffers before the emitters free them
        for ems in emitters.values():
            for em in ems:
                em.close()
        pool.shutdown()


if __name__ == "__main__":
    main()
