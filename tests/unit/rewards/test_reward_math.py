"""rewards/math.py: a table of completions, including adversarial ones."""
from __future__ import annotations

import pytest

from rewards.math import extract_answer, reward, score

# (completion, gold answer, expected score, why)
CASES = [
    # formats of a right answer
    ("7", "7", 1.0, "bare number"),
    ("Answer: 7", "7", 1.0, "low-effort reference"),
    ("3 * 4 = 12. 12 - 5 = 7. Answer: 7", "7", 1.0, "high-effort reference"),
    ("answer: 7.", "7", 1.0, "lower case, trailing period"),
    ("The answer is 7", "7", 1.0, "'the answer is'"),
    ("Answer: $1,234", "1234", 1.0, "dollar and thousands separator"),
    ("1,234.00", "1234", 1.0, "decimal zeros"),
    ("12.0", "12", 1.0, "12.0 == 12"),
    ("= 12", "12", 1.0, "after an equals sign"),
    ("so 3 * 4 = 12", "12", 1.0, "last number"),
    ("\\boxed{12}", "12", 1.0, "boxed"),
    ("We get \\boxed{12}. Then 5 more things.", "12", 1.0, "boxed wins over later numbers"),
    ("Answer: 12 pens.", "12", 1.0, "unit after the number"),
    ("Answer: 7 (7 pens)", "7", 1.0, "the same value twice after the marker"),
    ("Answer: -3", "-3", 1.0, "negative"),
    ("Answer: \u22123", "-3", 1.0, "unicode minus sign"),
    ("Answer: 3/4", "0.75", 1.0, "fraction by value"),
    ("Answer: 0.75", "3/4", 1.0, "decimal vs fraction gold"),
    ("Answer:7", "7", 1.0, "no space"),
    ("  Answer: 7  \n", "7", 1.0, "whitespace"),
    ("12-5=7", "7", 1.0, "'-' after a digit is an operator"),
    ("Answer: 12%", "12", 1.0, "percent sign"),
    # wrong answers
    ("Answer: 8", "7", 0.0, "off by one"),
    ("Answer: 7.5", "7", 0.0, "not an integer"),
    ("Answer: -7", "7", 0.0, "wrong sign"),
    ("3 * 4 = 12. 12 - 5 = 7. Answer: 8", "7", 0.0, "right steps, wrong answer"),
    ("Answer: 8. Actually 7", "7", 0.0, "the marker decides, not the last number"),
    ("7 apples, then 8", "7", 0.0, "no marker: last number"),
    ("x-7", "-7", 0.0, "'-' after a letter is not a sign"),
    ("Answer: 1,23", "123", 0.0, "'1,23' is the list 1, 23: ambiguous"),
    # hedging and ambiguity
    ("Answer: 7 or 8", "7", 0.0, "two different values after the marker"),
    ("Answer: 8 or 7", "7", 0.0, "two different values after the marker"),
    ("Answer: 3,4", "3", 0.0, "a list is not an answer"),
    ("\\boxed{7, 8}", "7", 0.0, "two values in the box"),
    # adversarial / malformed
    ("", "7", 0.0, "empty"),
    ("Answer:", "7", 0.0, "marker without a number"),
    ("Answer: seven", "7", 0.0, "number words are not parsed"),
    ("7 Answer: none", "7", 0.0, "a number before the marker does not count"),
    ("Answer: nan", "7", 0.0, "nan"),
    ("Answer: inf", "7", 0.0, "inf"),
    ("Answer: NaN 7", "7", 1.0, "nan is text, 7 is the only number"),
    ("Answer: \u0667", "7", 0.0, "Arabic-Indic digit: not ASCII"),
    ("Answer: \uff17", "7", 0.0, "fullwidth digit: not ASCII"),
    ("Answer: 1e3", "1000", 0.0, "no exponents (reads as 1)"),
    ("Answer: 7/0", "7", 0.0, "division by zero"),
    ("Answer: " + "9" * 5000, "7", 0.0, "a 5000-digit number"),
    ("7 " * 4000 + "Answer: 7", "7", 1.0, "long but under the limit"),
    ("Answer: 7 " + "x" * 20_000, "7", 0.0, "over MAX_COMPLETION_CHARS"),
    (" ".join(str(i) for i in range(1000)) + " 7", "7", 1.0, "many numbers: the last one"),
    ("Answer: " + " ".join(["7"] * 300), "7", 1.0, "the same value repeated"),
    ("\x00\x01Answer:\t7\x00", "7", 1.0, "control characters"),
    ("{\"answer\": 7}", "7", 1.0, "JSON-ish 'answer\": 7' has no ':' right after 'answer'"),
    ("<|im_end|>Answer: 7", "7", 1.0, "special-token text"),
    ("Answer: 7", "not a number", 0.0, "unparseable gold"),
    ("Answer: 7", 7, 1.0, "int gold"),
    ("Answer: 7", 7.0, 1.0, "float gold"),
    ("Answer: 7", float("nan"), 0.0, "nan gold"),
]


@pytest.mark.parametrize("completion,gold,expected,why", CASES, ids=[c[3] for c in CASES])
def test_score_table(completion, gold, expected, why):
    assert score(completion, gold) == expected


def test_extract_answer_values():
    assert extract_answer("Answer: 3/4") == pytest.approx(0.75)
    assert extract_answer("nothing here") is None
    assert extract_answer(None) is None


def test_reward_chat_messages_strings_and_routing():
    completions = [
        [{"role": "assistant", "content": "Answer: 7"}],
        "Answer: 7",
        [{"role": "assistant", "content": "Answer: 6"}],
        "Answer: 7",
        [{"role": "user", "content": "Answer: 7"}],   # no assistant message: empty
        [{"role": "assistant", "content": None}],      # malformed content
        12345,                                         # not text at all
    ]
    out = reward(prompts=[None] * 7, completions=completions, answer=["7"] * 7,
                 domain=["math", "math", "math", "code", "math", "math", "math"],
                 effort=["low", "high", "low", "low", "low", "high", "low"])
    assert out == [1.0, 1.0, 0.0, None, 0.0, 0.0, 0.0]
    # without a domain column every row is scored
    assert reward([None], ["Answer: 7"], answer=["7"]) == [1.0]


def test_reward_needs_answer_column():
    with pytest.raises(ValueError, match="answer"):
        reward([None], ["7"])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        reward([None, None], ["7", "7"], answer=["7"])
