"""The body of tests/titan03/test_parallel.py's gloo ranks (spawned; importable by module name)."""

from __future__ import annotations

import json
import os
import traceback


def tiny_shape(family: str):
    from titan_lora.titan03.model import ModelShape

    if family == "llama3":
        return ModelShape(family="llama3", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                          ffn_hidden_dim=128, vocab_size=256, norm_eps=1e-5, rope_theta=5e5, max_seq_len=64)
    return ModelShape(family="qwen3", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                      ffn_hidden_dim=128, vocab_size=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                      tie_embeddings=True, max_seq_len=64)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def run_family(family: str, rank: int, world: int, mode: str, dims, sp: bool,  # noqa: ANN001
               replicate: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from titan_lora.lora.layer import adapter_params, fill_param, freeze_base
    from titan_lora.titan03.lora import LoRASettings, build_lora_model_config
    from titan_lora.titan03.model import build_model_config
    from titan_lora.titan03.parallel import build_parallel_lora_model

    spmd_backend = dims.spmd_backend

    shape = tiny_shape(family)
    lora = LoRASettings(rank=4, alpha=8.0)

    # Reference: the whole model on this rank, seeded base, nonzero adapters.
    torch.manual_seed(0)
    ref = build_lora_model_config(build_model_config(shape), lora).build()
    with torch.no_grad():
        ref.init_weights()
        gen = torch.Generator().manual_seed(1)
        for name, p in ref.named_parameters():
            if name.endswith(("lora_A", "lora_B")) or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    freeze_base(ref)
    full_state = {n: p.detach().clone() for n, p in ref.named_parameters()}

    model = build_parallel_lora_model(
        build_lora_model_config(build_model_config(shape), lora), dims, enable_sequence_parallel=sp,
        replicate_adapters=replicate,
    )
    # The adapters' param_init (seeded full tensors, each rank keeps its shard) equals one rank's init.
    fresh = build_lora_model_config(build_model_config(shape), lora).build()
    with torch.no_grad():
        fresh.init_weights()
    fresh_adapters = dict(adapter_params(fresh))
    init_diff = max((_full(p.detach()) - fresh_adapters[n]).abs().max().item() for n, p in adapter_params(model))
    init_nonzero_A = all(torch.count_nonzero(fresh_adapters[n]) > 0 for n in fresh_adapters if n.endswith("lora_A"))
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(full_state), (sorted(set(names) ^ set(full_state)))
    for n, p in model.named_parameters():
        fill_param(p, full_state[n])

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, shape.vocab_size, (4, 16), generator=gen)
    labels = torch.randint(0, shape.vocab_size, (4, 16), generator=gen)

    ref_logits = ref(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()

    if mode == "fsdp":  # each rank its half of the batch; FSDP sums the gradients over the 2 ranks
        part = slice(rank * 4 // world, (rank + 1) * 4 // world)
        tokens, labels = tokens[part], labels[part]
    if spmd_backend == "full_dtensor":  # the trainer wraps inputs as DTensors on the full mesh (trainer.py:765-767)
        from torchtitan.distributed import full_dtensor

        tokens, _, _ = full_dtensor.parallelize_inputs(dims, tokens, labels, {})
    logits = model(tokens)
    logits_type = type(logits).__name__
    placements = str(getattr(logits, "placements", ""))
    if spmd_backend == "full_dtensor":  # this rank's rows of the batch, whole vocab
        from torch.distributed.tensor import Replicate, Shard

        names = logits.device_mesh.mesh_dim_names
        logits = logits.redistribute(placements=[Shard(0) if n == "dp_shard" else Replicate() for n in names])
        logits = logits.to_local()
    logits = _full(logits)
    # 0.3.0's apply_fsdp_to_decoder turns FSDP's gradient division off (distributed/fsdp.py:27-41, 316):
    # the loss is divided by the global token count, as 0.3.0's trainer and titan_lora's do.
    global_tokens = 4 * 16
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / global_tokens
    loss.backward()
    global_loss = loss.detach().clone()
    if mode == "fsdp":
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)

    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    out = {
        "family": family, "loss": global_loss.item(), "ref_loss": ref_loss.item(),
        "loss_diff": abs(global_loss.item() - ref_loss.item()), "logits_type": logits_type,
        "logits_placements": placements, "grad_diff": 0.0, "grad_max": 0.0, "n_adapters": 0,
        "placements": {}, "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "missing_grads": [], "init_diff": init_diff, "init_nonzero_A": bool(init_nonzero_A),
    }
    for name, p in adapter_params(model):
        out["n_adapters"] += 1
        out["placements"][name] = [str(x) for x in getattr(p, "placements", ())]
        out["mesh_dims"] = list(p.device_mesh.mesh_dim_names) if hasattr(p, "device_mesh") else []
        if p.grad is None:
            out["missing_grads"].append(name)
            continue
        g = _full(p.grad)
        out["grad_diff"] = max(out["grad_diff"], (g - ref_grads[name]).abs().max().item())
        out["grad_max"] = max(out["grad_max"], ref_grads[name].abs().max().item())
        out["placements"][name].append("grad:" + str(getattr(p.grad, "placements", "")))
    # One optimizer step on the adapters (each rank steps its local shards): the same adapters as one
    # rank's step. SGD, not AdamW: Adam's first step is ~lr * sign(g), which turns 1e-8 gradient noise on
    # near-zero gradients into lr-sized differences (seen: up to 9e-5 with lr 1e-2).
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=1.0)
    opt.step()
    ref_opt.step()
    ref_adapters = dict(adapter_params(ref))
    out["step_diff"] = max((_full(p.detach()) - ref_adapters[n].detach()).abs().max().item()
                           for n, p in adapter_params(model))
    return out


def worker(rank: int, world: int, port: int, mode: str, spmd_backend: str, sp: bool, out_dir: str,
           replicate: bool = False) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    results = []
    try:
        from titan_lora.titan03.parallel import make_parallel_dims

        # One ParallelDims a process: a second one's meshes are new objects, and under full_dtensor
        # fully_shard then refuses ("Expected param's DTensor mesh to be the same mesh passed to fully_shard").
        dims = make_parallel_dims(
            world_size=world, dp_shard=world if mode == "fsdp" else 1, tp=world if mode == "tp" else 1,
            spmd_backend=spmd_backend,
        )
        for family in ("llama3", "qwen3"):
            results.append(run_family(family, rank, world, mode, dims, sp, replicate))
    except Exception as err:  # noqa: BLE001 (reported to the test)
        results.append({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()
