"""Several `[[adapters]]` synced as one family of versions each, on 2 gloo ranks (FSDP) against the real receiver
process, whose digests of the bytes it holds are the oracle: every sync is one gather and one bucket for all
three adapters; each adapter's bytes in the engine equal its own params (PEFT names, RoPE rows permuted) as a
one-adapter export has them; each family is published and retired on its own window; and when one family's
version is unloaded, the others' bytes in the slab they share are not overwritten by the next sync. An engine
SIGKILLed while the bucket of three adapters is on its way is brought back (base, then the whole set again):
each family ends with exactly that version published once, with the right bytes."""

from __future__ import annotations

import torch
from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, build_from, full_adapter, job_config_from
from syncer_helpers import CPU, engine_adapters, engine_digest, kill, shim_on_path, start_receiver, sync_cfg
from test_syncer import digests

from titan_lora.clients.http import JsonClient
from titan_lora.clients.vllm import VLLMBucketEmitter
from titan_lora.config_adapters import adapter_lora, job_adapters
from titan_lora.export.peft import to_peft_names
from titan_lora.lora.layer import adapter_params
from titan_lora.lora.multi import adapter_of, one_adapter_name
from titan_lora.sync.adapter_set import AdapterSetSource
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.titan.lora_linear import fill_param
from titan_lora.transfer.transport import plain_buffer

NAMES = ["wide", "attn", "mlp"]
TOML = DEBUG_LORA + (
    '[[adapters]]\nname = "wide"\nrank = 4\nalpha = 8\ntarget_modules = "all-linear"\n'
    '[[adapters]]\nname = "attn"\nrank = 8\nalpha = 4\ntarget_modules = ["wq", "wv"]\n'
    '[[adapters]]\nname = "mlp"\nrank = 2\nalpha = 16\ntarget_modules = ["w2", "wo"]\n')
KEEP = 2


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every adapter's A and B seeded and non-zero, the same on any sharding."""
    for i, (_, param) in enumerate(adapter_params(model)):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        fill_param(param, torch.randn(param.shape, generator=g) * 0.05)


def expected(built) -> list[dict[str, str]]:
    """Collective: each adapter's digests in PEFT naming, through the export's renaming (not the gatherer's)."""
    named = adapter_params(built.model)
    return [digests(to_peft_names(full_adapter([(one_adapter_name(n), p) for n, p in named if adapter_of(n) == k]),
                                  built.peft_layout)) for k in range(len(NAMES))]


def three_adapter_syncer(rank: int, tmp: str):
    """(engine, built model, syncer): the debug model with the three adapters seeded, a syncer of one family each
    into the receiver process (rank 0's engine; None elsewhere)."""
    shim_on_path()
    engine = start_receiver(tmp, max_loras=len(NAMES) * (KEEP + 1)) if rank == 0 else None
    built, job = build_from(TOML), job_config_from(TOML)
    randomize(built.model, seed=1)
    cfg = sync_cfg(keep_versions=KEEP)
    emitter = VLLMBucketEmitter(JsonClient(engine.url, engine.key, cfg.timeout_s), cfg.bucket_mb) if rank == 0 else None
    source = AdapterSetSource(built.model, built.peft_layout,
                              [(a.name, adapter_lora(a, job.lora)) for a in job_adapters(job)],
                              lend=emitter.lend_buffer if emitter else plain_buffer)
    assert (source.names, source.ranks, source.rank) == (NAMES, [4, 8, 2], 8)
    syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, tied_embeddings=True), emitter,
                          cfg, CPU, versions=[AdapterVersions(n, KEEP) for n in NAMES], engine=engine)
    return engine, built, syncer


def _sync_three(rank: int, world: int, tmp: str) -> None:
    engine, built, syncer = three_adapter_syncer(rank, tmp)
    emitter = syncer.emitter
    try:
        syncer.check_engine()
        held = {}
        for version in (1, 2, 3):
            randomize(built.model, seed=version)
            metrics = syncer.sync(version)
            want = expected(built)
            if rank == 0:
                assert metrics["sync/buckets"] == 1, "three adapters go in one bucket"
                assert metrics["sync/published"] == 3 and metrics["sync/tensors"] == sum(len(w) for w in want)
                for name, own in zip(NAMES, want):
                    assert engine_digest(syncer, f"{name}-v{version}") == own, f"{name}-v{version}'s bytes"
                held[version] = want
        if rank == 0:
            assert all(r.wait_idle(10) for r in syncer.retirers)
            assert sorted(engine_adapters(syncer)) == sorted(f"{n}-v{v}" for n in NAMES for v in (2, 3)), \
                "each family keeps its own window of keep_versions"
            assert [f.live for f in syncer.families] == [[2, 3]] * 3
            assert emitter.retire_adapter("wide-v3", 5.0)  # one family's version goes; the others share its slab
        randomize(built.model, seed=4)
        syncer.sync(4)
        want = expected(built)
        if rank == 0:
            for k, name in enumerate(NAMES[1:], start=1):
                assert engine_digest(syncer, f"{name}-v3") == held[3][k], f"{name}-v3 overwritten under it"
                assert engine_digest(syncer, f"{name}-v4") == want[k]
            assert [f.active.name for f in syncer.families] == [f"{n}-v4" for n in NAMES]
    finally:
        syncer.close()


def test_three_adapters_sync_in_one_bucket_each_its_own_family_with_exact_bytes(tmp_path) -> None:
    run_ranks(2, _sync_three, str(tmp_path))


def _kill_mid_set_stream(rank: int, world: int, tmp: str) -> None:
    engine, built, syncer = three_adapter_syncer(rank, tmp)
    try:
        syncer.sync(1)
        if rank == 0:  # SIGKILL the engine as the bucket of the three adapters (with their commit) goes out
            real = syncer.emitter.client.post

            def post(path, body=None, timeout_s=None):
                if path == "/titan/bucket" and "adapters" in body.get("commit", {}) and engine.starts == 1:
                    kill(engine)
                return real(path, body, timeout_s)

            syncer.emitter.client.post = post
        randomize(built.model, seed=2)
        metrics = syncer.sync(2)
        want = expected(built)
        if rank == 0:
            assert engine.starts == 2 and syncer.counters["engine_recoveries"] == 1
            assert metrics["sync/published"] == 3 and syncer.counters["base_sends"] == 2
            assert sorted(engine_adapters(syncer)) == sorted(f"{n}-v2" for n in NAMES), "each version once"
            assert [f.live for f in syncer.families] == [[2]] * 3, "the restart took version 1 of every family"
            for name, own in zip(NAMES, want):
                assert engine_digest(syncer, f"{name}-v2") == own, f"{name}-v2's bytes after the recovery"
    finally:
        syncer.close()


def test_an_engine_killed_mid_set_stream_gets_the_base_and_every_adapter_again(tmp_path) -> None:
    run_ranks(2, _kill_mid_set_stream, str(tmp_path))
