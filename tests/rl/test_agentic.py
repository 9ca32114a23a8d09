"""The agentic calculator example without an engine: tool-call parsing, the safe evaluator, the reward,
and the 2-turn runner against a scripted chat client (which names the version that served each turn)."""

from __future__ import annotations

import random
import re
import time

import pytest

from titan_lora.clients.openai_rollout import ChatReply
from titan_lora.rl.agentic import SYSTEM, first_messages, final_reward, run_episode, run_tool, version_of
from titan_lora.rl.calculator import MAX_EXPRESSION_CHARS, CalcError, evaluate, format_value, parse_tool_call
from titan_lora.rl.task import Problem


@pytest.mark.parametrize(("text", "expr"), [
    ("CALC: 12 + 7", "12 + 7"),
    ("Let me compute.\ncalc: (3+4)*2\nthen answer", "(3+4)*2"),
    ("CALC: 12 + 7 = 9", "12 + 7"),  # the model's own guess after `=` is dropped
    ("calc(8 * 9)", "8 * 9"),
    ("Calculator: 5 - 11", "5 - 11"),
    ("  `CALC: 6/4`", "6/4"),
    ("**CALC:** 2 ^ 10", "2 ^ 10"),
    ("calculate: 9 + 9\nCALC: 3 + 4", "3 + 4"),
    ('{"tool": "calculator", "expression": "3 * 3"}', "3 * 3"),
    ('Sure! {"name": "calculator", "arguments": "{\\"expression\\": \\"40 + 2\\"}"}', "40 + 2"),
    ('{"name": "calc", "arguments": {"expr": 7}}', "7"),
    ('{"a": 1} then {"tool": "Calculator", "input": "1+1"}', "1+1"),
])
def test_tool_calls_in_the_shapes_a_small_model_writes(text: str, expr: str) -> None:
    assert parse_tool_call(text) == expr


@pytest.mark.parametrize("text", [
    "12 + 7 = 19", "The answer is 19.", "I would calculate: 3 + 4", '{"tool": "search", "expression": "1+1"}',
    "CALC:", '{"tool": "calculator"}', "{not json", "",
])
def test_text_without_a_calculator_call_has_none(text: str) -> None:
    assert parse_tool_call(text) is None


@pytest.mark.parametrize(("expr", "value"), [
    ("12 + 7", 19), ("(3+4)*2", 14), ("2 ^ 10", 1024), ("3 x 4", 12), ("3×(1+1)", 6), ("7 ÷ 2", 3.5),
    ("-5 - -2", -3), ("7 // 2", 3), ("7 % 4", 3), ("1,000 + 1", 1001), ("6/3", 2), ("0.1 + 0.2", 0.1 + 0.2),
])
def test_the_evaluator_computes_arithmetic(expr: str, value: float) -> None:
    assert evaluate(expr) == value
    assert type(evaluate(expr)) is type(value)


@pytest.mark.parametrize(("expr", "why"), [
    ("__import__('os').system('true')", "is not arithmetic"),
    ("abs(-3)", "is not arithmetic"),
    ("x + 1", "is not arithmetic"),
    ("'a' * 3", "is not arithmetic"),
    ("[1][0]", "is not arithmetic"),
    ("True + 1", "is not arithmetic"),
    ("1 / 0", "division by zero"),
    ("2 ** 100000", "exponent 100000 is over the calculator's limit of 64"),
    ("9 ** 60", "out of the calculator's range"),
    # Integer powers too large for a float: they raised OverflowError, not CalcError.
    ("999999999999999999**64", "the value (1152 digits) is out of the calculator's range (|x| <= 1e+18)"),
    ("123456789**40", "the value (324 digits) is out of the calculator's range"),
    ("123456789^64*65*9", "the value (518 digits) is out of the calculator's range"),
    ("1e18 ** 64", "the value of '1e+18 ** 64' is out of the calculator's range"),  # a float past 1.8e308
    ("9**9**9**9", "the exponent 3.8742e+08 is over the calculator's limit of 64"),  # 9**(9**(9**9))
    ("(-8) ** 0.5", "out of the calculator's range"),
    ("3 +", "cannot read '3 +' as arithmetic"),
    ("1+" * 150 + "1", f"over the limit of {MAX_EXPRESSION_CHARS}"),
])
def test_the_evaluator_refuses_anything_else(expr: str, why: str) -> None:
    with pytest.raises(CalcError, match=re.escape(why)):
        evaluate(expr)


def test_any_text_evaluates_to_a_number_or_a_calc_error_quickly() -> None:
    """Seeded random expressions over the operators and edge operands: nothing else escapes, none is slow.
    (Before the int range check, `123456789^64*65*9` escaped as an OverflowError among these.)"""
    rng = random.Random(0)
    atoms = ["0", "1", "-1", "9", "64", "65", "999999999999999999", "1e18", "1e-300", "0.5", "1e308",
             "123456789", "0.0", "1_0", "0x10", "1j", "\x00", "nan", "(", ")", "[", "{", "}"]
    ops = ["+", "-", "*", "/", "//", "%", "**", "^", "x", "÷", "", " ", ","]
    start = time.monotonic()
    for _ in range(20_000):
        pairs = rng.randint(1, 8)
        expr = "".join(rng.choice(atoms) + rng.choice(ops) for _ in range(pairs)) + rng.choice(atoms)
        try:
            format_value(evaluate(expr))
        except CalcError:
            pass
    assert time.monotonic() - start < 30, "20,000 evaluations take about 0.2 s; none may hang"


def test_a_reply_nested_a_thousand_deep_is_no_tool_call_and_the_episode_goes_on() -> None:
    deep = '{"tool": "calculator", "expression": ' + "[" * 1000  # the JSON decoder raised RecursionError
    assert parse_tool_call(deep) is None
    assert parse_tool_call("CALC: " + "[" * 1000) == "[" * 1000
    assert run_tool("[" * 1000).startswith("error: the expression has 1000 characters, over the limit of")
    chat = ScriptedChat([deep], alias_serves=["policy-v2"])
    episode = run_episode(chat, "policy", Problem("What is 1 + 1?", 2))
    assert (episode.tool_call, episode.reward, episode.version) == (None, 0.0, 2)


def test_a_value_out_of_range_reaches_the_model_as_an_error() -> None:
    chat = ScriptedChat(["CALC: 999999999999999999**64", "I cannot"], alias_serves=["policy-v1"])
    episode = run_episode(chat, "policy", Problem("What is 999999999999999999**64?", 0))
    assert episode.tool_result == ("error: the value (1152 digits) is out of the calculator's range "
                                   "(|x| <= 1e+18)")
    assert chat.calls[1][1][-1]["content"] == f"Calculator result: {episode.tool_result}"


def test_values_read_back_as_the_model_sees_them() -> None:
    assert [format_value(v) for v in (19, 3.5, 2 / 3, -0.25)] == ["19", "3.5", "0.666667", "-0.25"]
    assert run_tool("12 + 7") == "19"
    assert run_tool("1 / 0") == "error: division by zero"


def test_the_reward_is_on_the_final_answer_only() -> None:
    problem = Problem("What is 12 + 7?", 19)
    assert final_reward("19", problem) == 1.0
    assert final_reward("The answer is 19.", problem) == 1.0
    assert final_reward("12 + 7 = 9", problem) == 0.0
    assert final_reward("CALC: 19", problem) == 0.0, "a second tool call is no answer"
    assert final_reward("", problem) == 0.0


def test_versions_are_read_from_served_names() -> None:
    assert [version_of(m) for m in ("policy-v7", "my-lora-v12", "policy", "/ckpt/smollm2", "policy-v")] == [
        7, 12, None, None, None]


class ScriptedChat:
    """Replies in order; the served model is the pinned name asked for, or `alias_serves` for the alias."""

    def __init__(self, replies: list[str], alias_serves: list[str]) -> None:
        self.replies, self.alias_serves = list(replies), list(alias_serves)
        self.calls: list[tuple[str, list[dict], int | None]] = []

    def chat(self, model: str, messages: list[dict], max_tokens: int, temperature: float,
             seed: int | None = None) -> ChatReply:
        self.calls.append((model, [dict(m) for m in messages], seed))
        served = self.alias_serves.pop(0) if model == "policy" else model
        return ChatReply(served, self.replies.pop(0))


def test_a_tool_call_then_an_answer_runs_both_turns_on_the_first_version() -> None:
    chat = ScriptedChat(["CALC: 12 + 7", "19"], alias_serves=["policy-v3"])
    synced = []
    episode = run_episode(chat, "policy", Problem("What is 12 + 7?", 19), seed=5,
                          between_turns=lambda: synced.append(len(chat.calls)))
    assert synced == [1], "the hook runs after turn 1, before turn 2"
    assert [c[0] for c in chat.calls] == ["policy", "policy-v3"], "turn 2 pins the version turn 1 got"
    assert [c[2] for c in chat.calls] == [5, 6]
    assert chat.calls[0][1] == first_messages(Problem("What is 12 + 7?", 19))
    assert chat.calls[0][1][0] == {"role": "system", "content": SYSTEM}
    assert chat.calls[1][1][-2:] == [{"role": "assistant", "content": "CALC: 12 + 7"},
                                     {"role": "user", "content": "Calculator result: 19"}]
    assert (episode.tool_call, episode.tool_result, episode.reward) == ("12 + 7", "19", 1.0)
    assert (episode.model, episode.version, episode.replies) == ("policy-v3", 3, ["CALC: 12 + 7", "19"])


def test_a_reply_without_a_tool_call_is_the_final_answer() -> None:
    chat = ScriptedChat(["12 + 7 = 9"], alias_serves=["policy-v4"])
    episode = run_episode(chat, "policy", Problem("What is 12 + 7?", 19), between_turns=pytest.fail)
    assert len(chat.calls) == 1 and episode.tool_call is None and episode.tool_result is None
    assert (episode.reward, episode.version) == (0.0, 4)


def test_a_bad_expression_reaches_the_model_as_an_error_and_the_episode_goes_on() -> None:
    chat = ScriptedChat(["CALC: 5 / 0", "I cannot"], alias_serves=["policy-v1"])
    episode = run_episode(chat, "policy", Problem("What is 5 / 0?", 0))
    assert chat.calls[1][1][-1]["content"] == "Calculator result: error: division by zero"
    assert episode.reward == 0.0 and episode.version == 1


def test_an_engine_that_moves_a_pinned_name_is_an_error() -> None:
    class Unpinned(ScriptedChat):
        def chat(self, model, messages, max_tokens, temperature, seed=None):
            return ChatReply("policy-v2" if self.calls else "policy-v1", super().chat(model, messages, 0, 0).text)

    with pytest.raises(RuntimeError, match="turn 2 asked for 'policy-v1' and was served by 'policy-v2'"):
        run_episode(Unpinned(["CALC: 1+1", "2"], ["policy-v1"]), "policy", Problem("What is 1 + 1?", 2))
