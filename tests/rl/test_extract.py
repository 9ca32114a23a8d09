"""Answer extraction (`[task] extract`): each mode on right, wrong, nested and malformed completions."""

from __future__ import annotations

import pytest

from titan_lora.rl.extract import (
    answer_error,
    boxed,
    check_mode,
    is_correct,
    last_number,
    same_value,
    whole_text,
)


@pytest.mark.parametrize(("text", "number"), [
    ("12 + 7 = 19.", "19"), ("minus -3", "-3"), ("about 1,234.50 dollars", "1234.50"), ("3.5 then 4", "4"),
    ("8, or 9", "9"), ("x2y", "2"), ("none", None), ("", None),
])
def test_last_number(text: str, number: str | None) -> None:
    assert last_number(text) == number


@pytest.mark.parametrize(("text", "inside"), [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"first \boxed{1}, then \boxed{ 2 }", "2"),
    (r"\boxed{a{b{c}}d} and more", "a{b{c}}d"),
    (r"\boxed{7} then \boxed{8", "7"),  # the last one is cut off: the complete one before it counts
    (r"\boxed{\boxed{5}}", r"\boxed{5}"),  # top level only
    (r"\boxed 5", None), ("42", None), (r"\boxed{", None),
])
def test_boxed_takes_the_last_complete_top_level_box(text: str, inside: str | None) -> None:
    assert boxed(text) == inside


def test_values_compare_as_numbers_when_both_are_numbers_else_as_text() -> None:
    assert same_value("7.0", "7") and same_value("1,000", "1000") and not same_value("7.01", "7")
    assert same_value(r"\frac{1}{2}", r"\frac{1}{2}") and same_value("a  b", "a b") and not same_value("A", "a")
    assert whole_text("  Paris \n") == "Paris"


@pytest.mark.parametrize(("mode", "completion", "answer", "right"), [
    ("last_number", "12 + 7 = 19", "19", True),
    ("last_number", "19, no wait, 18", "19", False),
    ("last_number", "It is 7.0", "7", True),
    ("last_number", "no digits", "7", False),
    ("boxed", r"The sum is \boxed{19}.", "19", True),
    ("boxed", r"\boxed{\frac{1}{2}}", r" \frac{1}{2} ", True),
    ("boxed", "19", "19", False),  # no box: no answer
    ("exact", " Paris\n", "Paris", True),
    ("exact", "Paris.", "Paris", False),
    ("exact", "7.0", "7", False),  # exact is a string match
])
def test_is_correct_per_mode(mode: str, completion: str, answer: str, right: bool) -> None:
    assert is_correct(mode, completion, answer) is right


def test_an_unknown_mode_names_the_modes_and_the_closest() -> None:
    check_mode("boxed", "[task] extract")
    with pytest.raises(ValueError) as err:
        check_mode("boxd", "[task] extract")
    assert str(err.value) == ("[task] extract = 'boxd' is not an extraction mode; use one of last_number, "
                              "boxed, exact; did you mean 'boxed'?")


@pytest.mark.parametrize("reply", ["sNaN", "-sNaN", "NaN", "nan", "Infinity", "-inf", "1e" + "9" * 20])
def test_a_reply_that_is_no_finite_number_scores_wrong_and_never_raises(reply: str) -> None:
    # Decimal("sNaN") parses, and `==` on it raised InvalidOperation: one such reply ended the GRPO run.
    assert is_correct("boxed", rf"so \boxed{{{reply}}}", "7") is False
    assert same_value(reply, "7") is False and same_value("7", reply) is False
    assert same_value(reply, reply), "equal text is still equal text"


@pytest.mark.parametrize(("mode", "answer", "why"), [
    ("last_number", "12", None), ("last_number", "-1,234.5", None), ("boxed", "7", None),
    ("boxed", r"\frac{1}{2}", None), ("exact", "Paris", None), ("exact", "NaN", None),
    ("boxed", "sNaN", "the answer 'sNaN' is not a finite number (NaN and Infinity equal no completion's "
                      'number); write the answer as a finite number such as "4"'),
    ("last_number", "NaN", "the answer 'NaN' is not a finite number"),
    ("boxed", "-Infinity", "the answer '-Infinity' is not a finite number"),
    ("last_number", "Paris", "the answer 'Paris' is not a number, and [task] extract = 'last_number' "
                             "reads the completion's last number, so no completion can match it; write the "
                             'answer as a number such as "4", or use extract = "boxed" or "exact" for text '
                             "answers"),
])
def test_an_answer_no_completion_can_match_is_named(mode: str, answer: str, why: str | None) -> None:
    found = answer_error(mode, answer)
    assert found is None if why is None else found.startswith(why)
