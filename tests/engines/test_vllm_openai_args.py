"""`python -m titan_lora.engines.vllm_openai` takes `vllm serve`'s flags, adds titan_lora's defaults,
and takes its key from the environment only."""

from __future__ import annotations

import pytest

from titan_lora.engines import base_record, vllm_openai


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # vLLM's parser sets it; restored after
    monkeypatch.delenv("TITAN_LORA_API_KEY", raising=False)


def test_vllm_serve_flags_pass_through_and_titan_defaults_are_added(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TITAN_LORA_API_KEY", "k3y")
    args = vllm_openai.parse_args(["/models/m", "--port", "8123", "--max-loras", "5", "--served-model-name",
                                   "base", "--middleware", "my.mw.Class"])
    assert (args.model, args.port, args.max_loras, args.served_model_name) == ("/models/m", 8123, 5, ["base"])
    assert args.enable_lora and args.worker_extension_cls == vllm_openai.EXTENSION
    assert args.middleware == ["my.mw.Class", vllm_openai.MIDDLEWARE]
    assert args.api_key == ["k3y"] and args.api_server_count == 1
    # vLLM 0.32 on CPU kills the engine when a seeded request's prefill is chunked.
    assert args.enable_chunked_prefill is False
    assert vllm_openai.parse_args(["/m", "--enable-chunked-prefill"]).enable_chunked_prefill is True


def test_on_cpu_one_worker_runs_in_the_engine_core_unless_the_environment_says() -> None:
    env: dict[str, str] = {}
    vllm_openai.keep_cpu_worker_in_engine_core(vllm_openai.parse_args(["/m"]), env)
    assert env == {vllm_openai.IN_CORE_WORKER_ENV: "0"}
    env = {vllm_openai.IN_CORE_WORKER_ENV: "1"}  # the user asked for vLLM's own CPU layout
    vllm_openai.keep_cpu_worker_in_engine_core(vllm_openai.parse_args(["/m"]), env)
    assert env == {vllm_openai.IN_CORE_WORKER_ENV: "1"}
    env = {}  # several workers need vLLM's multiprocess executor
    vllm_openai.keep_cpu_worker_in_engine_core(vllm_openai.parse_args(["/m", "--tensor-parallel-size", "2"]), env)
    assert env == {}


def test_the_skip_flag_tells_the_workers_to_record_no_base_digests(monkeypatch) -> None:
    monkeypatch.setattr(base_record, "RECORDING", True)
    env: dict[str, str] = {}
    vllm_openai.skip_base_digests(vllm_openai.parse_args(["/m"]), env)
    assert env == {} and base_record.RECORDING, "by default the workers record what they load"
    vllm_openai.skip_base_digests(vllm_openai.parse_args(["/m", "--titan-skip-base-digests"]), env)
    assert env == {base_record.SKIP_ENV: "1"}
    assert not base_record.recording(env) and base_record.recording({})
    assert not base_record.RECORDING, "a forked worker inherits this process's reading, not the variable's"


@pytest.mark.parametrize(("env", "forked"), [({}, True), ({vllm_openai.SPAWN_CORE_ENV: "1"}, False)])
def test_a_cpu_engine_core_is_forked_unless_the_variable_says_spawn(env, forked, monkeypatch) -> None:
    called = []
    monkeypatch.setattr(vllm_openai.compat, "fork_engine_cores", lambda: called.append(True))
    assert vllm_openai.fork_cpu_engine_cores(env) is forked and called == ([True] if forked else [])


def test_several_api_servers_and_no_lora_are_refused() -> None:
    with pytest.raises(SystemExit, match="adapter table and leases live in one API server process"):
        vllm_openai.parse_args(["/m", "--api-server-count", "2"])
    with pytest.raises(SystemExit, match="drop --no-enable-lora"):
        vllm_openai.parse_args(["/m", "--no-enable-lora"])


def test_internal_data_parallelism_is_taken() -> None:
    args = vllm_openai.parse_args(["/m", "--data-parallel-size", "2"])
    assert args.data_parallel_size == 2 and vllm_openai.data_parallel_refusal(args) is None


@pytest.mark.parametrize("flags", [
    ["--data-parallel-external-lb", "--data-parallel-rank", "0"],
    ["--data-parallel-rank", "1"],
    ["--data-parallel-hybrid-lb"],
    ["--data-parallel-start-rank", "2"],
    ["--data-parallel-multi-port-external-lb"],
])
def test_load_balancers_that_split_the_ranks_between_servers_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as err:
        vllm_openai.parse_args(["/m", "--data-parallel-size", "4", *flags])
    message = str(err.value)
    assert message.startswith(flags[0] + (", " if len(flags) > 2 else ":"))
    assert "would leave the others on their old adapter" in message and "--data-parallel-size N alone" in message


def test_the_servers_keep_alive_outlasts_clients_unless_the_user_set_it() -> None:
    env: dict[str, str] = {}
    vllm_openai.keep_idle_connections_longer_than_clients(env)
    assert env == {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30"}
    env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "7"}
    vllm_openai.keep_idle_connections_longer_than_clients(env)
    assert env == {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "7"}, "a value the user set is theirs"
