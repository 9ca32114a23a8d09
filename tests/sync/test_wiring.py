"""The embedded engine as wiring builds it: a random API key by default, secrets never on argv."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from syncer_helpers import sync_cfg

from titan_lora.sync.wiring import embedded_engine


def _run(tmp_path: Path) -> types.SimpleNamespace:
    cfg = types.SimpleNamespace(job=types.SimpleNamespace(dump_folder=str(tmp_path)),
                                lora=types.SimpleNamespace(rank=8))
    return types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"),
                                 built=types.SimpleNamespace(hf_dir=str(tmp_path / "hf")))


@pytest.mark.parametrize("engine_kind", ["vllm", "receiver"])
def test_the_embedded_engine_gets_a_random_key_by_environment_only(tmp_path: Path, engine_kind: str) -> None:
    cfg = sync_cfg(engine=engine_kind, engine_start_timeout_s=123.0, health_timeout_s=4.0)
    engines = [embedded_engine(_run(tmp_path), cfg) for _ in range(2)]
    try:
        keys = [e.api_key for e in engines]
        assert all(len(k) >= 32 for k in keys) and keys[0] != keys[1], "an empty api_key must become random"
        assert not any("--api-key" in e.args or e.api_key in e.args for e in engines)
        assert (engines[0].start_timeout_s, engines[0].health_timeout_s) == (123.0, 4.0)
        assert engines[0].port != engines[1].port, "each engine holds its own reserved port"
    finally:
        for e in engines:
            e.stop()


def test_a_configured_key_is_kept_and_stays_off_argv(tmp_path: Path) -> None:
    engine = embedded_engine(_run(tmp_path), sync_cfg(api_key="s3cret-key"))
    try:
        assert engine.api_key == "s3cret-key" and not any("s3cret-key" in a for a in engine.args)
    finally:
        engine.stop()


# ---- the engine's command line, the base stream, the probe batch and wire_syncer, in one process -----


def test_the_receiver_engine_logs_to_the_dump_folder_and_takes_no_device_on_cpu(tmp_path: Path) -> None:
    engine = embedded_engine(_run(tmp_path), sync_cfg(engine="receiver", engine_port=0))
    try:
        assert engine.module == "titan_lora.engines.receiver" and engine.args == []
        assert engine.log_path == tmp_path / "engine.log"
    finally:
        engine.stop()


def test_the_receiver_engine_gets_the_trainers_cuda_device(tmp_path: Path) -> None:
    run = _run(tmp_path)
    run.device = torch.device("cuda", 1)  # only its name is used: no GPU needed
    engine = embedded_engine(run, sync_cfg(engine="receiver"))
    try:
        assert engine.args == ["--device", "cuda:1"]
    finally:
        engine.stop()


def test_the_vllm_engine_command_line_holds_the_model_rank_and_slots(tmp_path: Path) -> None:
    run = _run(tmp_path)
    run.cfg.lora.rank = 12  # vLLM takes 8, 16, 32, ...: the engine gets 16
    cfg = sync_cfg(engine="vllm", keep_versions=3, engine_max_model_len=640, engine_kv_cache_gib=5)
    engine = embedded_engine(run, cfg)
    try:
        assert engine.module == "titan_lora.engines.vllm_server"
        assert engine.args == ["--model", str(tmp_path / "hf"), "--max-lora-rank", "16", "--max-loras", "4",
                               "--max-cpu-loras", "5", "--max-model-len", "640", "--kv-cache-gib", "5"]
        assert engine.log_path == tmp_path / "engine.log"
    finally:
        engine.stop()


class _SdAdapter:
    """A state-dict adapter stand-in: renames by a table (None: no HF weight) and doubles the values."""

    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight", "freqs_cis": None}

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.device, tuple[int, ...]]] = []

    def to_hf(self, state: dict) -> dict:
        out = {}
        for name, t in state.items():
            self.seen.append((name, t.device, tuple(t.shape)))
            if self.names[name] is not None:
                out[self.names[name]] = t * 2
        return out


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Module()
        self.a.lora_B = torch.nn.Parameter(torch.ones(2, 1))  # an adapter param first: skipped, not the end
        self.tok_embeddings = torch.nn.Embedding(4, 2)
        self.norm = torch.nn.LayerNorm(2, bias=False)
        self.output = torch.nn.Linear(2, 4, bias=False)
        self.freqs_cis = torch.nn.Parameter(torch.ones(3))
        self.q = torch.nn.Module()
        self.q.lora_A = torch.nn.Parameter(torch.ones(1, 2))  # an adapter param: never part of the base


@pytest.mark.parametrize("tied", [False, True])
def test_the_base_stream_yields_each_hf_weight_converted_and_skips_adapters_and_unmapped(tied: bool) -> None:
    from titan_lora.sync.wiring import base_weights_source

    model, sd = _Model(), _SdAdapter()
    got = list(base_weights_source(model, sd, tied_embeddings=tied)())
    want = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    assert [n for n, _ in got] == want
    params = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
              "lm_head.weight": model.output.weight}
    for name, t in got:
        assert torch.equal(t, params[name].detach() * 2), "the converted tensor, not the param"
    # names are found on meta tensors of the param's shape, then each kept tensor is converted alone
    assert ("tok_embeddings.weight", torch.device("meta"), (4, 2)) in sd.seen
    assert ("freqs_cis", torch.device("meta"), (3,)) in sd.seen
    assert ("tok_embeddings.weight", torch.device("cpu"), (4, 2)) in sd.seen
    assert not any("lora" in name for name, _, _ in sd.seen)


class _Tokenizer:
    """Characters as token ids; a visible chat template."""

    eos_token = "</s>"

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:  # noqa: ANN001
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize("n", [None, 2])
def test_the_probe_batch_is_chat_prompts_with_their_answers(n: int | None) -> None:
    from titan_lora.rl.tasks import INSTRUCTION, make_problems
    from titan_lora.sync.wiring import probe_sequences

    seqs = probe_sequences(_Tokenizer()) if n is None else probe_sequences(_Tokenizer(), n)
    problems = make_problems(4 if n is None else n, seed=4242)
    assert ["".join(map(chr, s)) for s in seqs] == [
        f"<user>{p.question} {INSTRUCTION}<assistant>{p.answer}</s>" for p in problems]


class _FakeSyncer:
    """Stands in for WeightSyncer in wire_syncer: records how it was built and checked."""

    made: list[_FakeSyncer] = []

    def __init__(self, source, base, emitter, cfg, device, engine=None, rollouts=None, probe=None) -> None:  # noqa: ANN001
        self.source, self.base, self.emitter, self.cfg, self.device = source, base, emitter, cfg, device
        self.engine, self.rollouts, self.probe = engine, rollouts, probe
        self.checked = False
        _FakeSyncer.made.append(self)

    def check_engine(self) -> None:
        self.checked = True


class _FakeEngine:
    url, api_key = "http://127.0.0.1:4321", "engine-key"

    def __init__(self) -> None:
        self.started = False

    def start(self) -> None:
        self.started = True


def _wire(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int = 0, tied: bool | None = True, **ws):  # noqa: ANN003, ANN202
    import json

    import transformers

    from titan_lora.config import WeightSync
    from titan_lora.sync import wiring

    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({} if tied is None else {"tie_word_embeddings": tied}))
    loaded: list[str] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path: (loaded.append(path), _Tokenizer())[1])
    monkeypatch.setattr(wiring.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(wiring, "WeightSyncer", _FakeSyncer)
    engines: list[_FakeEngine] = []

    def embedded(run, cfg) -> _FakeEngine:  # noqa: ANN001
        engines.append(_FakeEngine())
        engines[-1].made_from = (run, cfg)
        return engines[-1]

    monkeypatch.setattr(wiring, "embedded_engine", embedded)
    run = _run(tmp_path)
    run.cfg.weight_sync = WeightSync(**{"enabled": True, "parity_every": 0, **ws})
    run.model, run.adapter = _Model(), object()
    run.built.sd_adapter = _SdAdapter()
    _FakeSyncer.made.clear()
    syncer = wiring.wire_syncer(run)
    assert syncer is _FakeSyncer.made[-1] and syncer.checked and loaded == [str(tmp_path / "hf")]
    assert syncer.source is run.adapter and syncer.device == run.device
    return syncer, engines, run


def test_wiring_an_attached_vllm_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_lora.emitters.vllm import VLLMBucketEmitter

    syncer, engines, run = _wire(monkeypatch, tmp_path, engine_url="http://10.0.0.5:8000", api_key="k1",
                                 timeout_s=33.0, rollout_timeout_s=44.0, bucket_mb=3)
    assert engines == [] and syncer.engine is None and syncer.cfg is run.cfg.weight_sync
    assert isinstance(syncer.emitter, VLLMBucketEmitter) and syncer.emitter.bucket_bytes == 3 << 20
    assert (syncer.emitter.client.base_url, syncer.emitter.client.api_key) == ("http://10.0.0.5:8000", "k1")
    assert syncer.rollouts.timeout_s == 44.0 and syncer.rollouts.client.timeout_s == 33.0
    assert (syncer.rollouts.client.base_url, syncer.rollouts.client.api_key) == ("http://10.0.0.5:8000", "k1")
    assert syncer.probe is None
    # tied embeddings: the stream leaves lm_head out
    assert [n for n, _ in syncer.base()] == ["model.embed_tokens.weight", "model.norm.weight"]


def test_wiring_an_embedded_engine_uses_its_address_and_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, engines, run = _wire(monkeypatch, tmp_path, tied=False, engine_url="", api_key="")
    assert len(engines) == 1 and engines[0].started and syncer.engine is engines[0]
    assert engines[0].made_from == (run, run.cfg.weight_sync), "the engine is built from the run and its config"
    assert syncer.cfg.engine_url == _FakeEngine.url and syncer.cfg.api_key == "engine-key"
    assert syncer.emitter.client.base_url == _FakeEngine.url and syncer.rollouts.client.api_key == "engine-key"
    assert run.cfg.weight_sync.engine_url == "", "the run's own config is not changed"
    assert [n for n, _ in syncer.base()][-1] == "lm_head.weight"


def test_wiring_an_embedded_receiver_has_no_rollouts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, engines, _ = _wire(monkeypatch, tmp_path, engine_url="", engine="receiver")
    assert engines[0].started and syncer.rollouts is None


def test_wiring_sglang_has_no_vllm_rollouts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_lora.emitters.sglang import SGLangEmitter

    syncer, _, _ = _wire(monkeypatch, tmp_path, emitter="sglang", engine_url="http://sglang:30000")
    assert isinstance(syncer.emitter, SGLangEmitter) and syncer.rollouts is None


def test_wiring_on_other_ranks_builds_no_emitter_or_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, engines, _ = _wire(monkeypatch, tmp_path, rank=1, engine_url="")
    assert engines == [] and (syncer.emitter, syncer.engine, syncer.rollouts) == (None, None, None)


def test_wiring_the_parity_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_lora.rl.tasks import INSTRUCTION, make_problems

    syncer, _, run = _wire(monkeypatch, tmp_path, engine_url="http://10.0.0.5:8000", parity_every=3,
                           parity_tolerance=0.02)
    probe = syncer.probe
    assert probe.model is run.model and probe.device == run.device and probe.tolerance == 0.02
    assert probe.score == syncer.rollouts.score
    first = make_problems(4, seed=4242)[0]
    assert "".join(map(chr, probe.sequences[0])) == f"<user>{first.question} {INSTRUCTION}<assistant>{first.answer}</s>"
    assert len(probe.sequences) == 4


def test_wiring_a_probe_without_rollouts_has_no_score(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, _, _ = _wire(monkeypatch, tmp_path, engine_url="", engine="receiver", parity_every=2)
    assert syncer.probe is not None and syncer.probe.score is None


def test_without_a_tie_setting_the_base_stream_keeps_lm_head(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, _, _ = _wire(monkeypatch, tmp_path, tied=None, engine_url="http://10.0.0.5:8000")
    assert [n for n, _ in syncer.base()][-1] == "lm_head.weight"


@pytest.mark.parametrize("rank", [0, 1])
def test_under_a_process_group_only_rank_0_gets_the_base(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    from titan_lora.sync import wiring

    monkeypatch.setattr(wiring.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(wiring.dist, "get_rank", lambda: rank)
    sd = _SdAdapter()
    got = list(wiring.base_weights_source(_Model(), sd, tied_embeddings=False)())
    assert [n for n, _ in got] == (["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
                                   if rank == 0 else [])
    assert sum(device == torch.device("meta") for _, device, _ in sd.seen) == 4, "every rank maps every name"


def test_build_syncer_wires_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_lora.sync import syncer, wiring

    run = object()
    monkeypatch.setattr(wiring, "wire_syncer", lambda r: ("wired", r))
    assert syncer.build_syncer(run) == ("wired", run)
