"""Base verification benchmark: the digests that prove an engine's base is the trainer's, against what
reading the base once costs (the floor) and what pushing it costs (the baseline), in one run.

    python scripts/bench_digest.py --device cuda              # Llama-3-8B shapes, bf16, on the GPU
    python scripts/bench_digest.py --device cuda --layers 80 --shape 70b
    python scripts/bench_digest.py --device cpu --layers 2    # a smoke run

The base is made on the device one layer at a time (random bf16 of the real shapes; nothing is written to
disk). Per tensor it times:
- digest: `transfer.digest.tensor_digest`, what the engine computes as a tensor loads and what each trainer
  rank computes over its shard (one rank here: the whole tensor);
- floor: one read of the tensor's bytes (`sum` in fp32), the least any check of every byte costs;
- baseline: one copy of the tensor (`clone`), the least a push costs before any transport: every
  framework we compared with pushes the base, or loads it and checks nothing.
Verification moves no weight byte between trainer and engine; only 16 hex digits per tensor cross.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan_lora.transfer.digest import tensor_digest

SHAPES = {  # hidden, intermediate, heads, kv heads, vocab, layers
    "8b": (4096, 14336, 32, 8, 128256, 32),
    "70b": (8192, 28672, 64, 8, 128256, 80),
}


def layer_tensors(hidden: int, inter: int, heads: int, kv: int) -> dict[str, tuple[int, ...]]:
    """One decoder layer's weights (HF names without the layer prefix) and shapes."""
    head_dim = hidden // heads
    return {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv * head_dim, hidden),
            "self_attn.v_proj.weight": (kv * head_dim, hidden), "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,)}


def timed(fn, device: torch.device) -> float:  # noqa: ANN001
    """Seconds `fn` takes, the device synchronised."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    """Digest a model's worth of bf16 tensors; print digest, floor and baseline times and their ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    args = parser.parse_args()
    device = torch.device(args.device)
    hidden, inter, heads, kv, vocab, layers = SHAPES[args.shape]
    layers = args.layers or layers
    names = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
             "model.norm.weight": (hidden,)}
    gen = torch.Generator(device=device).manual_seed(0)
    totals = {"digest": 0.0, "floor": 0.0, "baseline": 0.0}
    nbytes = count = 0

    def run(name: str, shape: tuple[int, ...]) -> None:
        nonlocal nbytes, count
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
        if count == 0:  # warm-up: kernels and allocator
            tensor_digest(name, t), t.float().sum(), t.clone()
        totals["digest"] += timed(lambda: tensor_digest(name, t), device)
        totals["floor"] += timed(lambda: t.sum(dtype=torch.float32).item(), device)
        totals["baseline"] += timed(lambda: t.clone(), device)
        nbytes += t.numel() * t.element_size()
        count += 1

    for name, shape in names.items():
        run(name, shape)
    for layer in range(layers):
        for name, shape in layer_tensors(hidden, inter, heads, kv).items():
            run(f"model.layers.{layer}.{name}", shape)
    gib = nbytes / 2**30
    print(f"{args.shape} shape, {layers} layers, {count} tensors, {gib:.1f} GiB bf16 on {device}")
    print(f"  digest    {totals['digest']:8.2f} s  {gib / totals['digest']:7.1f} GiB/s")
    print(f"  floor     {totals['floor']:8.2f} s  {gib / totals['floor']:7.1f} GiB/s  (one read of every byte)")
    print(f"  baseline  {totals['baseline']:8.2f} s  {gib / totals['baseline']:7.1f} GiB/s  (one copy, before "
          "any transport)")
    print(f"  digest / floor {totals['digest'] / totals['floor']:.1f}x; digest / baseline "
          f"{totals['digest'] / totals['baseline']:.1f}x; bytes moved to verify: 0 (16 hex digits a tensor)")


if __name__ == "__main__":
    main()
