"""`MultiGRPOObjective`'s drawing and data position, with stand-in sample sources (the trainer's math is
tests/rl/test_multi_grpo.py's, the live loops tests/rl/test_multi_grpo_live.py's and _async.py's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from titan_lora.rl.multi_objective import MultiGRPOObjective


class Source:
    """Hands each step's samples once, as the async loop's producer does; fails the first take when told."""

    def __init__(self, name: str, fail_first: bool = False, state: dict | None = None) -> None:
        self.name, self.fail_first, self.state = name, fail_first, state
        self.takes: list[int] = []

    def take(self, step: int) -> list[str]:
        self.takes.append(step)
        if self.fail_first and len(self.takes) == 1:
            raise ConnectionError(f"{self.name}: the engine died mid-rollout")
        return [f"{self.name}@{step}#{len(self.takes)}"]

    def data_state(self) -> dict | None:
        return self.state


def objective(*sources: Source) -> MultiGRPOObjective:
    return MultiGRPOObjective([SimpleNamespace(source=s) for s in sources], [s.name for s in sources], engine=None)


def test_a_retry_after_a_failed_draw_takes_again_only_for_the_adapters_that_failed() -> None:
    a, b, c = Source("a"), Source("b", fail_first=True), Source("c")
    multi = objective(a, b, c)
    with pytest.raises(ConnectionError, match="b: the engine died"):
        multi._draw_all(1)
    assert multi._draw_all(1) == [["a@1#1"], ["b@1#2"], ["c@1#1"]]  # a's and c's first take are the step's
    assert (a.takes, b.takes, c.takes) == ([1], [1, 1], [1])
    assert multi._draw_all(2) == [["a@2#2"], ["b@2#3"], ["c@2#2"]]
    multi._pool.shutdown()


def test_the_data_position_is_kept_per_adapter_and_none_when_the_step_is_it() -> None:
    assert objective(Source("a"), Source("b")).data_state() is None  # the sync loop
    multi = objective(Source("a", state={"next_group": 4}), Source("b", state={"next_group": 6}))
    assert multi.data_state() == {"a": {"next_group": 4}, "b": {"next_group": 6}}
