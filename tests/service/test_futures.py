"""Futures: a poll is held until the result comes (or answered "pending" at its bound), a result is kept for
late polls for a while and then dropped, and a key counts only its own unfinished calls."""

from __future__ import annotations

import asyncio
import threading

from titan_lora.service.futures import FutureStore, Result


def test_a_held_poll_gets_the_result_set_from_another_thread() -> None:
    store = FutureStore()
    request = store.new("tml-a")

    async def poll() -> tuple[Result | None, Result | None]:
        early = await store.wait(request, 0.05)
        threading.Timer(0.05, store.finish, (request, Result(json={"ok": 1}))).start()
        return early, await store.wait(request, 5.0)

    early, late = asyncio.run(poll())
    assert early is None and late.json == {"ok": 1}
    assert asyncio.run(store.wait(request, 0.0)).json == {"ok": 1}  # a repeated poll is answered again


def test_finished_results_expire_and_pending_counts_per_key() -> None:
    store = FutureStore(ttl_s=0.0)
    first, second, other = store.new("tml-a"), store.new("tml-a"), store.new("tml-b")
    assert (store.pending("tml-a"), store.pending("tml-b")) == (2, 1)
    store.finish(first, Result(json={}))
    assert store.pending("tml-a") == 1
    store.finish(second, Result(json={}))  # expires the ones finished before (ttl 0), itself too
    assert not store.owned(first, "tml-a") and not store.owned(second, "tml-a")
    assert store.owned(other, "tml-b") and not store.owned(other, "tml-a")
