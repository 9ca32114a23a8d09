"""The composition root: the embedded engine (a random API key by default, secrets never on argv), the probe
batch, and what build_sync hands the syncer and the objective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import StubBaseModel, StubSdAdapter

from titan_lora.clients.http import ApiKey
from titan_lora.clients.kinds import engine_kind
from titan_lora.compose import embedded_engine
from titan_lora.config import GRPO, Engine, WeightSync


def _engine(tmp_path: Path, engine: Engine, ws: WeightSync | None = None, device: str = "cpu",
            lora_rank: int = 8):
    return embedded_engine(engine_kind(engine.kind), engine, ws or WeightSync(enabled=True), str(tmp_path / "hf"),
                           torch.device(device), str(tmp_path), lora_rank)


@pytest.mark.parametrize("kind", ["vllm", "receiver"])
def test_the_embedded_engine_gets_a_random_key_by_environment_only(tmp_path: Path, kind: str) -> None:
    ws = WeightSync(enabled=True, engine_start_timeout_s=123.0, health_timeout_s=4.0)
    engines = [_engine(tmp_path, Engine(kind=kind), ws) for _ in range(2)]
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
    engine = _engine(tmp_path, Engine(api_key="s3cret-key"))
    try:
        assert engine.api_key == "s3cret-key" and not any("s3cret-key" in a for a in engine.args)
    finally:
        engine.stop()


# ---- the engine's command line, the probe batch and build_sync, in one process ------------------


def test_the_engine_digests_its_base_only_when_the_trainer_verifies_it(tmp_path: Path) -> None:
    flags = {}
    for base in ("verify", "push"):
        engine = _engine(tmp_path, Engine(), WeightSync(enabled=True, base=base))
        try:
            flags[base] = "--titan-skip-base-digests" in engine.args
        finally:
            engine.stop()
    assert flags == {"verify": False, "push": True}, "a push job's engine would digest a base nobody asks about"


def test_the_receiver_engine_logs_to_the_dump_folder_and_takes_no_device_on_cpu(tmp_path: Path) -> None:
    engine = _engine(tmp_path, Engine(kind="receiver", port=0))
    try:
        assert engine.module == "titan_lora.engines.receiver" and engine.args == ["--max-loras", "8"]
        assert engine.log_path == tmp_path / "engine.log"
    finally:
        engine.stop()


def test_the_receiver_engine_gets_the_trainers_cuda_device(tmp_path: Path) -> None:
    # only the device's name is used: no GPU needed
    engine = _engine(tmp_path, Engine(kind="receiver"), device="cuda:1")
    try:
        assert engine.args == ["--device", "cuda:1", "--max-loras", "8"]
    finally:
        engine.stop()


def test_the_vllm_engine_command_line_holds_the_model_rank_and_slots(tmp_path: Path) -> None:
    engine_cfg = Engine(kind="vllm", max_model_len=640, kv_cache_gib=5)
    # vLLM takes ranks 8, 16, 32, ...: rank 12 gets 16
    engine = _engine(tmp_path, engine_cfg, WeightSync(enabled=True, keep_versions=3), lora_rank=12)
    try:
        assert engine.module == "titan_lora.engines.vllm_openai"
        assert engine.args == [str(tmp_path / "hf"), "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
                               "--seed", "0", "--max-lora-rank", "16", "--max-loras", "4", "--max-cpu-loras", "5",
                               "--max-model-len", "640", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
                               "--kv-cache-memory-bytes", str(5 * 2**30), "--disable-uvicorn-access-log"]
        assert engine.log_path == tmp_path / "engine.log"
    finally:
        engine.stop()


class _Tokenizer:
    """Characters as token ids; a visible chat template."""

    eos_token = "</s>"

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize("n", [None, 2])
def test_the_probe_batch_is_chat_prompts_with_their_answers(n: int | None) -> None:
    from titan_lora.compose import probe_sequences
    from titan_lora.rl.tasks import INSTRUCTION, make_problems

    seqs = probe_sequences(_Tokenizer()) if n is None else probe_sequences(_Tokenizer(), n)
    problems = make_problems(4 if n is None else n, seed=4242)
    assert ["".join(map(chr, s)) for s in seqs] == [
        f"<user>{p.question} {INSTRUCTION}<assistant>{p.answer}</s>" for p in problems]


class _FakeSyncer:
    """Stands in for WeightSyncer in build_sync: records how it was built and checked."""

    made: list[_FakeSyncer] = []

    def __init__(self, source, base, emitter, cfg, device, *, versions, engine=None, probe=None,
                 report=None, watchdog=None, base_digests=None) -> None:
        self.source, self.base, self.emitter, self.cfg, self.device = source, base, emitter, cfg, device
        self.engine, self.probe, self.versions, self.report = engine, probe, versions, report
        self.families = [versions]
        self.watchdog, self.base_digests = watchdog, base_digests
        self.checked = False
        _FakeSyncer.made.append(self)

    def check_engine(self) -> None:
        self.checked = True

    def with_engine(self, fn, what: str):
        return fn()


class _FakeEngine:
    url, api_key = "http://127.0.0.1:4321", "engine-key"
    key = ApiKey(api_key)  # what clients read (an embedded engine's changes at each start)

    def __init__(self) -> None:
        self.started = False

    def start(self) -> None:
        self.started = True


def _wire(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int = 0, tied: bool | None = True,
          engine: Engine | None = None, **ws):
    """build_sync on a stand-in model with the syncer and engine faked: (syncer, EngineRollouts, engines,
    job config, built)."""
    import json
    import types

    import transformers

    from titan_lora import compose

    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({} if tied is None else {"tie_word_embeddings": tied}))
    loaded: list[str] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path: (loaded.append(path), _Tokenizer())[1])
    monkeypatch.setattr(compose.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(compose, "WeightSyncer", _FakeSyncer)
    engines: list[_FakeEngine] = []

    def embedded(*args, **kwargs) -> _FakeEngine:
        engines.append(_FakeEngine())
        engines[-1].made_from, engines[-1].made_with = args, kwargs
        return engines[-1]

    monkeypatch.setattr(compose, "embedded_engine", embedded)
    job_config = types.SimpleNamespace(weight_sync=WeightSync(**{"enabled": True, "parity_every": 0, **ws}),
                                       engine=engine or Engine(),
                                       job=types.SimpleNamespace(dump_folder=str(tmp_path)),
                                       lora=types.SimpleNamespace(rank=8), grpo=GRPO(), task={}, adapters=[])
    built = types.SimpleNamespace(hf_dir=str(tmp_path / "hf"), model=StubBaseModel(),
                                  sd_adapter=StubSdAdapter(), tied=bool(tied), peft_layout=None)
    adapter, device = object(), torch.device("cpu")
    _FakeSyncer.made.clear()
    side = compose.engine_side(job_config, built, device)
    task = compose.check_plugins(job_config)
    syncer, rollouts = compose.build_sync(job_config, adapter, built, device, side, task)
    assert syncer is _FakeSyncer.made[-1] and syncer.checked
    assert loaded == ([str(tmp_path / "hf")] if ws.get("parity_every") else [])
    assert syncer.source is adapter and syncer.device == device
    assert rollouts.versions is syncer.versions and rollouts.call("x".upper, "what") == "X"
    return syncer, rollouts, engines, job_config, built


def test_wiring_an_attached_vllm_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_lora.clients.vllm import VLLMBucketEmitter

    attached = Engine(url="http://10.0.0.5:8000", api_key="k1")
    syncer, rollouts, engines, job_config, _ = _wire(monkeypatch, tmp_path, engine=attached, timeout_s=33.0,
                                                     rollout_timeout_s=44.0, bucket_mb=3, lora_name="pol",
                                                     keep_versions=3)
    assert (syncer.versions.lora_name, syncer.versions.keep_versions) == ("pol", 3), "built by the root"
    assert engines == [] and syncer.engine is None and syncer.cfg is job_config.weight_sync
    assert isinstance(syncer.emitter, VLLMBucketEmitter) and syncer.emitter.bucket_bytes == 3 << 20
    assert (syncer.emitter.client.base_url, syncer.emitter.client.api_key) == ("http://10.0.0.5:8000", "k1")
    # the default kind samples over the OpenAI API: every request bounded by rollout_timeout_s
    assert rollouts.client.timeout_s == 44.0 and rollouts.client.client.timeout == 44.0
    assert (str(rollouts.client.client.base_url), rollouts.client.client.api_key) == ("http://10.0.0.5:8000/v1/", "k1")
    assert syncer.probe is None
    # one engine is watched while rank 0 waits on it, at health_timeout_s, through the emitter's LIVE check
    dog = syncer.watchdog
    assert dog.timeout_s == job_config.weight_sync.health_timeout_s and dog._check_live == syncer.emitter.check_live
    # tied embeddings: the stream leaves lm_head out
    assert [n for n, _ in syncer.base()] == ["model.embed_tokens.weight", "model.norm.weight"]


def test_wiring_an_embedded_engine_uses_its_address_and_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, rollouts, engines, job_config, built = _wire(monkeypatch, tmp_path, tied=False)
    assert len(engines) == 1 and engines[0].started and syncer.engine is engines[0]
    assert engines[0].made_from == (engine_kind("vllm"), job_config.engine, job_config.weight_sync, built.hf_dir,
                                    torch.device("cpu"), str(tmp_path), 8)
    assert engines[0].made_with == {"adapters": 1}
    assert syncer.emitter.client.base_url == _FakeEngine.url and syncer.emitter.client.api_key == "engine-key"
    assert str(rollouts.client.client.base_url) == _FakeEngine.url + "/v1/"
    assert rollouts.client.client.api_key == "engine-key"
    assert syncer.cfg is job_config.weight_sync and job_config.engine.url == "", \
        "the config is never rewritten: the engine's address travels as an Endpoint"
    assert [n for n, _ in syncer.base()][-1] == "lm_head.weight"


def test_wiring_two_embedded_replicas_fans_out_and_routes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_lora.clients.fanout import FanoutEmitter
    from titan_lora.clients.router import RolloutRouter

    syncer, rollouts, engines, _, _ = _wire(monkeypatch, tmp_path, engine=Engine(replicas=2, port=9100))
    assert len(engines) == 2 and all(e.started for e in engines) and syncer.engine is None
    assert [e.made_from[1].port for e in engines] == [9100, 9101], "replica i takes port + i"
    assert [e.made_with for e in engines] == [{"log_name": "engine0.log", "adapters": 1},
                                              {"log_name": "engine1.log", "adapters": 1}]
    assert isinstance(syncer.emitter, FanoutEmitter) and isinstance(rollouts.client, RolloutRouter)
    assert [r.engine for r in syncer.emitter.replicas.replicas] == engines
    assert syncer.report()["sync/live_replicas"] == 2.0
    assert syncer.watchdog is None, "replicas are watched one by one by their replica set"


def test_wiring_attached_urls_keeps_one_emitter_per_replica(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    urls = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    syncer, _, engines, _, _ = _wire(monkeypatch, tmp_path, engine=Engine(urls=urls, api_key="k"))
    replicas = syncer.emitter.replicas.replicas
    assert engines == [] and [r.emitter.client.base_url for r in replicas] == urls
    assert all(r.emitter.client.api_key == "k" and r.engine is None for r in replicas)
    one = _wire(monkeypatch, tmp_path, engine=Engine(urls=urls[:1]))[0]
    assert one.emitter.client.base_url == urls[0] and one.report is None, "one url is one engine, as url is"


def test_wiring_an_embedded_receiver_has_no_rollouts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, rollouts, engines, _, _ = _wire(monkeypatch, tmp_path, engine=Engine(kind="receiver"))
    assert engines[0].started and rollouts.client is None


def test_wiring_picks_the_bucket_transport_from_where_the_engine_is(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    from titan_lora.transfer.transport import TransportChoice

    def wired(engine: Engine) -> TransportChoice:
        return _wire(monkeypatch, tmp_path, engine=engine)[0].emitter.transport

    assert wired(Engine()) == TransportChoice(), "an embedded engine: the device's default (shm, cuda_ipc)"
    assert wired(Engine(transport="tcp")) == TransportChoice("tcp", (("host", "127.0.0.1"), ("port", 0)))
    remote = Engine(url="http://192.0.2.7:8000", tcp_host="10.9.8.7", tcp_port=7100)
    assert wired(remote) == TransportChoice("tcp", (("host", "10.9.8.7"), ("port", 7100))), "auto: remote is tcp"
    assert wired(Engine(url="http://192.0.2.7:8000", transport="shm")) == TransportChoice("shm")
    syncer = _wire(monkeypatch, tmp_path, engine=Engine(kind="sglang", url="http://sglang:30000"))[0]
    assert not hasattr(syncer.emitter, "transport"), "SGLang moves tensors its own way"


def test_wiring_sglang_rolls_out_through_its_own_generate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_lora.clients.sglang import SGLangEmitter
    from titan_lora.clients.sglang_rollout import SGLangRolloutClient

    engine = Engine(kind="sglang", url="http://sglang:30000", api_key="user", admin_api_key="admin")
    syncer, rollouts, _, _, _ = _wire(monkeypatch, tmp_path, engine=engine)
    assert isinstance(syncer.emitter, SGLangEmitter) and isinstance(rollouts.client, SGLangRolloutClient)
    assert rollouts.client.client.url == "http://sglang:30000" and rollouts.client.client._key("/generate") == "user"


def test_wiring_on_other_ranks_builds_no_emitter_or_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, rollouts, engines, _, _ = _wire(monkeypatch, tmp_path, rank=1)
    assert engines == [] and (syncer.emitter, syncer.engine, rollouts.client) == (None, None, None)


def test_wiring_the_parity_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_lora.rl.tasks import INSTRUCTION, make_problems

    syncer, rollouts, _, _, built = _wire(monkeypatch, tmp_path, engine=Engine(url="http://10.0.0.5:8000"),
                                          parity_every=3, parity_tolerance=0.02)
    probe = syncer.probe
    assert probe.model is built.model and probe.device == torch.device("cpu") and probe.tolerance == 0.02
    assert probe.score == rollouts.client.score
    first = make_problems(4, seed=4242)[0]
    assert "".join(map(chr, probe.sequences[0])) == f"<user>{first.question} {INSTRUCTION}<assistant>{first.answer}</s>"
    assert len(probe.sequences) == 4


def test_wiring_a_probe_without_rollouts_has_no_score(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, _, _, _, _ = _wire(monkeypatch, tmp_path, engine=Engine(kind="receiver"), parity_every=2)
    assert syncer.probe is not None and syncer.probe.score is None


def test_without_a_tie_setting_the_base_stream_keeps_lm_head(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    syncer, _, _, _, _ = _wire(monkeypatch, tmp_path, tied=None, engine=Engine(url="http://10.0.0.5:8000"))
    assert [n for n, _ in syncer.base()][-1] == "lm_head.weight"




def test_the_task_and_reward_are_resolved_before_anything_is_built() -> None:
    import types

    from titan_lora.compose import check_plugins
    from titan_lora.config import GRPO

    def job(**grpo) -> types.SimpleNamespace:
        return types.SimpleNamespace(grpo=GRPO(**grpo), task={}, weight_sync=WeightSync(), adapters=[])

    check_plugins(job(enabled=True, task="reverse", reward="exact_match"))
    check_plugins(job(enabled=False, task="nope"))  # no GRPO: nothing to resolve
    with pytest.raises(ValueError,
                       match=r"^\[grpo\] task = 'nope' is not registered; known: arith, calculator_agent, jsonl, reverse, word_problems"):
        check_plugins(job(enabled=True, task="nope"))
    with pytest.raises(ValueError, match=r"^\[grpo\] reward = 'exact' is not registered; known: .*exact_match"):
        check_plugins(job(enabled=True, reward="exact"))


def test_an_sft_job_with_the_parity_probe_checks_the_task_it_scores() -> None:
    import types

    from titan_lora.compose import check_plugins
    from titan_lora.rl.word import WordProblemsTask

    def job(ws: WeightSync, **task) -> types.SimpleNamespace:
        return types.SimpleNamespace(grpo=GRPO(task="word_problems"), task=task, weight_sync=ws, adapters=[])

    probing = WeightSync(enabled=True, parity_every=2)
    with pytest.raises(ValueError, match=r"^\[task\] max_number = 1: use an integer >= 2"):
        check_plugins(job(probing, max_number=1))
    with pytest.raises(ValueError, match=r"^\[task\] has an unknown key 'stepz'"):
        check_plugins(job(probing, stepz=3))
    assert check_plugins(job(probing, max_number=3)) == WordProblemsTask(2, 3), "the task the probe scores"
    for ws in (WeightSync(enabled=True, parity_every=0), WeightSync(enabled=False, parity_every=2)):
        assert check_plugins(job(ws, max_number=1)) is None, "no probe and no GRPO: no task is used"


def test_the_emitter_lends_the_gather_buffer(tmp_path: Path) -> None:
    from titan_lora.clients.disk import DiskEmitter
    from titan_lora.clients.http import JsonClient
    from titan_lora.clients.vllm import VLLMBucketEmitter
    from titan_lora.compose import EngineSide
    from titan_lora.transfer.transport import offset_in

    client = JsonClient("http://127.0.0.1:1", "")
    tensor, home = EngineSide(emitter=VLLMBucketEmitter(client, 1)).lend(10, torch.float32, torch.device("cpu"))
    assert home is not None and offset_in(home, tensor) == 0, "the bucket emitter lends memory the engine maps"
    assert tensor.dtype == torch.float32 and tensor.numel() == 10 and not tensor.any()
    for side in (EngineSide(), EngineSide(emitter=DiskEmitter(client, 1, str(tmp_path)))):
        tensor, home = side.lend(10, torch.float32, torch.device("cpu"))
        assert home is None and tensor.numel() == 10 and not tensor.any(), "plain memory: no segment to share"


def test_compose_builds_the_adapter_source_on_the_engines_lent_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter gathers into the buffer the engine side's emitter lends (no packing copy per sync), and
    a job without the lora converter (full fine-tuning) or with several adapters (no sync yet) has none."""
    import types

    from titan_lora import compose

    made: list[tuple] = []
    monkeypatch.setattr(compose, "AdapterSource",
                        lambda *args, **kwargs: made.append((args, kwargs)) or "source")
    emitter = types.SimpleNamespace(lend_buffer=lambda *args: None)
    side = compose.EngineSide(None, emitter)
    built = types.SimpleNamespace(model="model", peft_layout="layout", hf_dir="/hf")
    lora = types.SimpleNamespace(rank=8)
    job_config = types.SimpleNamespace(model=types.SimpleNamespace(converters=["lora"]), lora=lora,
                                       weight_sync=WeightSync(lora_name="pol"), adapters=[])
    assert compose.adapter_source(job_config, built, side) == "source"
    assert made == [(("model", "layout", lora, "pol", "/hf"), {"lend": emitter.lend_buffer})]
    job_config.adapters, job_config.model.converters = [], []
    assert compose.adapter_source(job_config, built, side) is None and len(made) == 1


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_the_objective_gets_the_loop_grpo_loop_names_and_a_sync_run_refuses_an_async_runs_position(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, loop: str) -> None:
    import types

    import transformers

    from titan_lora import compose
    from titan_lora.rl.producer import BusyClock
    from titan_lora.rl.sample_source import LOOPS, Draws
    from titan_lora.sync.versions import AdapterVersions

    built: list = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    monkeypatch.setattr(compose, "GRPOObjective", lambda *args: built.append(args[7]))
    job = types.SimpleNamespace(grpo=GRPO(enabled=True, loop=loop), job=types.SimpleNamespace(dump_folder=str(tmp_path)),
                                adapters=[])
    dims = types.SimpleNamespace(get_optional_mesh=lambda name: None)
    saved = {"next_group": 6, "trained_ahead": [7, 9], "per_step": 8}  # what an async run's checkpoint keeps

    def build(data_state: dict | None) -> None:
        compose.build_objective(job, str(tmp_path), dims, torch.device("cpu"), None, None, None, data_state)

    if loop == "sync":
        with pytest.raises(ValueError, match=r'^\[grpo\] loop = "sync" cannot resume this checkpoint: an async-loop '
                                             r'run wrote it.*resume with \[grpo\] loop = "async", or start a new run'):
            build(saved)
        assert built == [], "refused before the objective is built"
    build(None)
    assert isinstance(built[-1](None), LOOPS[loop])
    if loop == "async":
        build(saved)
        resumed = built[-1](Draws(lambda step: [], None, AdapterVersions("policy", 3), BusyClock()))
        resumed.start(8)
        try:
            assert resumed.data_state() == saved, "the producer starts at the saved position, not the step's"
        finally:
            resumed.close()
