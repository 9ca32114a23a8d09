"""Base-send benchmark: the full base weights of a Llama-3 shape streamed in buckets into a colocated
receiver process (CUDA IPC on a GPU, shared memory on CPU), beside its floor (a memory copy of the base
bytes, and that copy plus a checksum on each side), with the emitter's phases and the CUDA graphs the
trainer process captured per send.

    python scripts/bench_base_send.py [--device cuda|cpu] [--iters 3] [--layers 32] [--vocab 128256]
        [--bucket-mb 32]

The default is the 8B shape (dim 4096, 32 layers, 128256 vocab, bf16: 16.1 GB). The trainer side holds one
tensor per distinct shape and sends it under every name that has the shape (the bytes a send moves are
the same); the receiver keeps its own copy of the whole base. `--device cpu --layers 1 --vocab 1024` is a
smoke test of the same code.

Each figure is taken twice, on fresh receivers: with the engine side as it was before base buckets went
un-graphed (`GRAPHED_KINDS` with "base": a CUDA graph captured for every base bucket's copy-out and
checksum, each capture a device sync and an allocator cache flush), and as it is now. `--only now` skips
the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_timing import p, timed

from titan_lora.transfer.buckets import bucket_checksum
from titan_lora.transfer.cuda_graphs import capture_count

GiB = 1 << 30


def llama3_shapes(layers: int, vocab: int, dim: int = 4096, kv: int = 1024, hidden: int = 14336,
                  ) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every base tensor of Llama-3-8B's width, with `layers` layers."""
    rows = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        at = f"model.layers.{i}."
        rows += [(at + "self_attn.q_proj.weight", (dim, dim)), (at + "self_attn.k_proj.weight", (kv, dim)),
                 (at + "self_attn.v_proj.weight", (kv, dim)), (at + "self_attn.o_proj.weight", (dim, dim)),
                 (at + "mlp.gate_proj.weight", (hidden, dim)), (at + "mlp.up_proj.weight", (hidden, dim)),
                 (at + "mlp.down_proj.weight", (dim, hidden)), (at + "input_layernorm.weight", (dim,)),
                 (at + "post_attention_layernorm.weight", (dim,))]
    return rows + [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]


def base_stream(shapes: list[tuple[str, tuple[int, ...]]], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each name with a bf16 tensor of its shape: one random tensor per distinct shape, made once."""
    made: dict[tuple[int, ...], torch.Tensor] = {}
    for name, shape in shapes:
        if shape not in made:
            g = torch.Generator().manual_seed(len(made))
            made[shape] = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16).to(device)
        yield name, made[shape]


def floors(device: torch.device, nbytes: int, sync) -> tuple[float, float]:  # noqa: ANN001
    """(device copy of `nbytes`, one checksum pass over them) in ms, each timed on 1 GiB and scaled."""
    size = min(GiB, nbytes)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = statistics.median(timed(lambda: dst.copy_(src), 10, sync))
    checksum = statistics.median(timed(lambda: bucket_checksum(src, graphed=False), 10, sync))
    return copy * nbytes / size, checksum * nbytes / size


GRAPH_BASE_RECEIVER = """
import runpy
from titan_lora.engines import transfers
transfers.GRAPHED_KINDS = frozenset({"adapter", "base"})  # as before: every bucket's copy-out captured
runpy.run_module("titan_lora.engines.receiver", run_name="__main__")
"""


def send_base(shapes: list[tuple[str, tuple[int, ...]]], made: dict[str, torch.Tensor], device: torch.device,
              iters: int, bucket_mb: int, graph_base: bool, sync) -> tuple[list[float], list[dict], list[int]]:  # noqa: ANN001
    """(send times ms, the emitter's phases, trainer-side graph captures) of `iters` base sends (after one
    untimed) into a fresh receiver; `graph_base`: one that captures a graph per base bucket, as before."""
    from titan_lora.clients.http import JsonClient
    from titan_lora.clients.launch import EmbeddedEngine
    from titan_lora.clients.vllm import VLLMBucketEmitter, receiver_plan

    saved = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory() as wrapper_dir:
        plan = receiver_plan(device)
        if graph_base:  # the receiver process runs a wrapper module that the environment makes importable
            Path(wrapper_dir, "bench_graph_base_receiver.py").write_text(GRAPH_BASE_RECEIVER)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [saved, wrapper_dir]))
            plan = dataclasses.replace(plan, module="bench_graph_base_receiver")
        engine = EmbeddedEngine(plan, 0,
                                os.path.join(tempfile.gettempdir(), "titan_lora_bench_base_receiver.log"),
                                start_timeout_s=120.0)
        engine.start()
        emitter = VLLMBucketEmitter(JsonClient(engine.url, engine.key), bucket_mb=bucket_mb)
        phases: list[dict] = []
        graphs: list[int] = []
        version = iter(range(1_000_000))

        def send() -> None:
            before = capture_count()
            ack = emitter.send_base(((name, made[name]) for name, _ in shapes), next(version))
            phases.append(dict(ack.phases_ms))
            graphs.append(capture_count() - before)

        try:
            times = timed(send, iters, sync, warmup=1)
        finally:
            engine.stop()  # the receiver unmaps our buffers before the emitter frees them
            emitter.close()
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
    return times, phases[1:], graphs[1:]


def main() -> None:
    """Send the base `--iters` times into each receiver (after one untimed send), print figures and floors."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--bucket-mb", type=int, default=32, help="the emitter's bucket size ([weight_sync] bucket_mb)")
    ap.add_argument("--only", choices=["now"], default=None, help="skip the as-before receiver")
    args = ap.parse_args()

    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    shapes = llama3_shapes(args.layers, args.vocab)
    nbytes = sum(2 * torch.Size(s).numel() for _, s in shapes)
    made = dict(base_stream(shapes, device))  # each distinct tensor once, made before any timing
    copy_ms, checksum_ms = floors(device, nbytes, sync)
    runs = {}
    for label, graph_base in [("before: a graph per base bucket", True), ("now: base buckets un-graphed", False)]:
        if graph_base and args.only == "now":
            continue
        runs[label] = send_base(shapes, made, device, args.iters, args.bucket_mb, graph_base, sync)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    buckets = int(next(iter(runs.values()))[1][-1].get("buckets", 0))
    print(f"\n{name}; base: {len(shapes)} tensors, {nbytes / 1e9:.2f} GB bf16 ({args.layers} layers, vocab "
          f"{args.vocab}); buckets of {args.bucket_mb} MiB: {buckets} per send; {args.iters} timed sends each")
    floor_all = copy_ms + 2 * checksum_ms
    print(f"{'figure':60s} {'p50 ms':>10s} {'p99 ms':>10s} {'x floor':>8s}")
    print(f"{'floor: device copy of the base bytes':60s} {copy_ms:10.1f} {'':10s} {1.0:8.1f}")
    print(f"{'floor: that copy + a checksum pass on each side':60s} {floor_all:10.1f} {'':10s} "
          f"{floor_all / copy_ms:8.1f}")
    for label, (times, _, _) in runs.items():
        med = statistics.median(times)
        print(f"{'base send, ' + label:60s} {med:10.1f} {p(times, 0.99):10.1f} {med / copy_ms:8.1f}")
    print("\nphase medians, ms (checksum: the trainer's; engine_copy: the receiver's copy-out + checksum, summed "
          "over buckets); CUDA graphs the trainer process captured per send")
    for label, (_, phases, graphs) in runs.items():
        keys = [k for k in phases[0] if k.endswith("_ms")]
        medians = "  ".join(f"{k[:-3]} {statistics.median(r[k] for r in phases):9.1f}" for k in keys)
        print(f"  {label:34s} {medians}  graphs {graphs}")


if __name__ == "__main__":
    main()
