"""Reward for the `tool_use` domain: is the completion the right function call?

The model answers with JSON. Accepted forms (surrounding whitespace is ignored):

    {"name": "get_weather", "arguments": {"city": "Paris"}}          one call
    [{"name": ..., "arguments": {...}}, {...}]                       several calls
    ```json ... ```                                                  either, in a fence
    <tool_call>{...}</tool_call><tool_call>{...}</tool_call>         Hermes/Qwen tags
    {"name": ..., "parameters": {...}}   ("args" too)                other key spellings
    {"type": "function", "function": {"name": ..., "arguments": "<JSON string>"}}
    {"get_weather": {"city": "Paris"}}                               BFCL's decoded form
    {"tool_calls": [...]}

Several JSON values one after the other (JSON lines) read as a list of calls; a leading
`<think>...</think>` block is dropped. Anything else around the call (prose, a second
fence) makes the completion unparseable, and it scores 0.

The calls are then checked the way BFCL's AST checker does it
(bfcl_eval/eval_checker/ast_eval/ast_checker.py, mirrored here function by function,
so the reward does not need bfcl_eval installed): the function name, required
parameters present, no parameter outside the schema or the answer, each value of the
schema's type (an int is accepted for a float) and among the allowed values, with
BFCL's string standardisation (case, spaces and ",./-_*^" ignored), lists compared
element-wise after standardisation, dicts key by key. Answers use BFCL's
`possible_answer` format: a list of `{func_name: {param: [allowed values...]}}`, one per
expected call, where "" among the allowed values marks the parameter as optional.
"parallel" categories compare the calls order-insensitively; other categories expect
exactly one call. Java/JavaScript categories: BFCL receives every value as source text
and converts it with its type converters; here a JSON string value goes through the
same converters (when bfcl_eval is importable), and a JSON-typed value (number, bool,
list, object) is taken as it is, since JSON already carries its type.

The score is BFCL's verdict, 1.0 or 0.0.

Columns (TRL passes them by name):
    functions      JSON string: the function schemas offered (BFCL `function` field)
    ground_truth   JSON string: the possible answers (BFCL `ground_truth` field)
    test_category  optional: BFCL's category ("simple_python", "parallel", ...); it
                   picks the checker (and the language for java/javascript); without
                   it, one expected call means "multiple", several mean "parallel"
    domain         optional: rows of another domain score None
"""
from __future__ import annotations

import json
import re

from core.completions import completion_text

DOMAIN = "tool_use"
MAX_COMPLETION_CHARS = 20_000  # longer completions score 0 without being parsed
MAX_CALLS = 64

# ----------------------------------------------------------------------------- parsing
_THINK = re.compile(r"\A\s*<think>.*?</think>", re.S)
_FENCE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.S)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_DECODER = json.JSONDecoder()
_ARG_KEYS = ("arguments", "parameters", "args")
_CALL_EXTRA_KEYS = {"id", "type"}


def _json_values(text: str) -> list:
    """The JSON values that make up all of `text`, separated by whitespace or commas.
    Raises ValueError when anything else is there."""
    values, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return values
        value, i = _DECODER.raw_decode(text, i)
        values.append(value)


def _as_args(args) -> dict | None:
    if isinstance(args, str):  # OpenAI style: the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return args if isinstance(args, dict) else None


def _as_calls(value) -> list[dict] | None:
    """BFCL's decoded form [{name: {param: value}}] of one parsed JSON value, or None."""
    if isinstance(value, list):
        out: list[dict] = []
        for item in value:
            if not isinstance(item, dict):  # a call list holds calls, not lists or scalars
                return None
            calls = _as_calls(item)
            if calls is None:
                return None
            out.extend(calls)
        return out
    if not isinstance(value, dict):
        return None
    if set(value) == {"tool_calls"}:
        return _as_calls(value["tool_calls"]) if isinstance(value["tool_calls"], list) else None
    if "function" in value and isinstance(value["function"], dict) and set(value) <= {"function"} | _CALL_EXTRA_KEYS:
        return _as_calls(value["function"])
    if "name" in value:
        name = value["name"]
        arg_keys = [k for k in _ARG_KEYS if k in value]
        if not isinstance(name, str) or not name or len(arg_keys) > 1:
            return None
        if set(value) - {"name", *arg_keys} - _CALL_EXTRA_KEYS:
            return None  # unknown keys beside the call: not a call we can read
        args = _as_args(value[arg_keys[0]]) if arg_keys else {}
        return None if args is None else [{name: args}]
    if len(value) == 1:  # BFCL's own decoded form {"func": {args}}
        (name, args), = value.items()
        args = _as_args(args)
        return None if args is None or not name else [{name: args}]
    return None


def parse_calls(text: str) -> list[dict] | None:
    """The function calls in a completion as BFCL's decoded form, a list of
    {func_name: {param: value}}; None when the completion is not in an accepted form."""
    if not isinstance(text, str) or len(text) > MAX_COMPLETION_CHARS:
        return None
    try:
        t = text.strip()
        m = _THINK.match(t)
        if m:
            t = t[m.end():].strip()
        blocks = _TOOL_CALL.findall(t)
        if blocks:
            if _TOOL_CALL.sub("", t).strip():
                return None  # prose outside the tags
            pieces = [b.strip() for b in blocks]
        else:
            pieces = [t]
        calls: list[dict] = []
        for piece in pieces:
            m = _FENCE.match(piece)
            if m:
                piece = m.group(1).strip()
            values = _json_values(piece)
            if not values:
                return None
            for v in values:
                c = _as_calls(v)
                if c is None:
                    return None
                calls.extend(c)
        if not calls or len(calls) > MAX_CALLS:
            return None
        return calls
    except (ValueError, RecursionError, TypeError):
        return None


def format_call(name: str, arguments: dict) -> str:
    """The canonical text of one call, as references are written."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def format_calls(calls: list[tuple[str, dict]], as_list: bool = False) -> str:
    """One call as an object (unless `as_list`), several as a JSON list."""
    if len(calls) == 1 and not as_list:
        return format_call(*calls[0])
    return json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


# ----------------------------------------------------------------------------- checking
# A port of bfcl_eval's ast_checker: same structure, same order of checks, same quirks
# (e.g. the one-level-deep nested type check), minus the model-specific name mangling.

PYTHON_TYPES = {
    "string": str, "integer": int, "float": float, "boolean": bool, "array": list,
    "tuple": list, "dict": dict, "any": str,
    # JSON-schema spellings, for schemas written outside BFCL (BFCL itself never uses them)
    "number": float, "object": dict, "str": str, "int": int, "bool": bool, "list": list,
}
PYTHON_NESTED = {"array", "tuple", "list"}
JAVA_TYPES = {
    "byte": int, "short": int, "integer": int, "float": float, "double": float, "long": int,
    "boolean": bool, "char": str, "Array": list, "ArrayList": list, "Set": set, "HashMap": dict,
    "Hashtable": dict, "Queue": list, "Stack": list, "String": str, "any": str,
}
JS_TYPES = {
    "String": str, "integer": int, "float": float, "Bigint": int, "Boolean": bool,
    "dict": dict, "array": list, "any": str,
}
JAVA_JS_NESTED = {"Array", "ArrayList", "array"}


def language_of(category: str) -> str:
    """BFCL's rule: "javascript" in the category is JS, else "java" is Java, else Python."""
    c = (category or "").lower()
    if "javascript" in c:
        return "javascript"
    if "java" in c:
        return "java"
    return "python"


def _convert_source_value(value: str, type_name: str, nested: str | None, language: str):
    """A Java/JS value written as source text, converted as BFCL does; unchanged when the
    converters are unavailable or fail."""
    try:  # bfcl-eval is optional (installed with --no-deps): imported only for Java/JS values
        if language == "java":
            from bfcl_eval.eval_checker.ast_eval.type_convertor.java_type_converter import (
                java_type_converter as convert,
            )
        else:
            from bfcl_eval.eval_checker.ast_eval.type_convertor.js_type_converter import (
                js_type_converter as convert,
            )
    except Exception:
        return value
    try:
        return convert(value, type_name, nested) if nested else convert(value, type_name)
    except Exception:
        return value


def standardize_string(s: str) -> str:
    """BFCL: drop spaces and ",./-_*^", lowercase, single quotes to double quotes."""
    return re.sub(r"[ \,\.\/\-\_\*\^]", "", s).lower().replace("'", '"')


def _possible_answer_type(possible: list):
    for answer in possible:
        if answer != "":
            return type(answer)
    return None


def _type_checker(param, value, possible: list, expected_desc, expected_type, nested_type) -> tuple[bool, bool]:
    """(valid, is_variable), as bfcl's type_checker."""
    is_variable = False
    possible_type = _possible_answer_type(possible)
    if possible_type is not None and possible_type != expected_type:
        is_variable = True
    if type(value) == expected_type:
        if nested_type is None:
            return True, is_variable
        for item in possible:
            ok = True
            if type(item) == list:
                for v in value:
                    sub_ok, _ = _type_checker(param, v, item, str(nested_type), nested_type, None)
                    if not sub_ok:
                        ok = False
                        break
            if ok:
                return True, is_variable
    if possible_type is not None and type(value) == possible_type:
        return True, True
    return False, False


def _string_ok(value: str, possible: list) -> bool:
    return standardize_string(value) in [standardize_string(p) for p in possible if type(p) == str]


def _list_ok(value: list, possible: list) -> bool:
    std_value = [standardize_string(v) if type(v) == str else v for v in value]
    std_possible = []
    for p in possible:
        if isinstance(p, list):
            std_possible.append([standardize_string(x) if type(x) == str else x for x in p])
    return std_value in std_possible


def _dict_ok(value: dict, possible: list) -> bool:
    for answer in possible:
        if answer == "" or not isinstance(answer, dict):
            continue
        ok = True
        for key, v in value.items():
            if key not in answer:
                ok = False
                break
            allowed = answer[key] if isinstance(answer[key], list) else [answer[key]]
            std_v = standardize_string(v) if type(v) == str else v
            std_allowed = [standardize_string(a) if type(a) == str else a for a in allowed]
            if std_v not in std_allowed:
                ok = False
                break
        if ok:
            for key, allowed in answer.items():
                if key not in value and "" not in (allowed if isinstance(allowed, list) else [allowed]):
                    ok = False
                    break
        if ok:
            return True
    return False


def _list_dict_ok(value: list, possible: list) -> bool:
    for answer in possible:
        if not isinstance(answer, list) or len(value) != len(answer):
            continue
        if all(isinstance(v, dict) and _dict_ok(v, [a]) for v, a in zip(value, answer)):
            return True
    return False


def _find_description(functions: list, name: str) -> dict | None:
    for f in functions:
        if isinstance(f, dict) and f.get("name") == name:
            return f
    return None


def check_call(description: dict, call: dict, answer: dict, language: str = "python") -> tuple[bool, str]:
    """BFCL's simple_function_checker: one decoded call {name: args} against one
    possible answer {name: {param: [allowed...]}} and the function's schema.
    Returns (valid, reason)."""
    (func_name, possible), = answer.items()
    if not isinstance(call, dict) or len(call) != 1:
        return False, "not a single call"
    (called, args), = call.items()
    if called != func_name:
        return False, f"wrong function name {called!r}, expected {func_name!r}"
    if not isinstance(args, dict):
        return False, "arguments are not an object"
    params = description.get("parameters", {}) or {}
    details = params.get("properties", {}) or {}
    required = params.get("required", []) or []
    for p in required:
        if p not in args:
            return False, f"missing required parameter {p!r}"
    for p, value in args.items():
        if p not in details or p not in possible:
            return False, f"unexpected parameter {p!r}"
        allowed = possible[p]
        if not isinstance(allowed, list):
            allowed = [allowed]
        desc = details[p].get("type", "any") if isinstance(details[p], dict) else "any"
        items = details[p].get("items") if isinstance(details[p], dict) else None
        item_desc = items.get("type") if isinstance(items, dict) else None
        nested_type = None
        if language == "python":
            expected_type = PYTHON_TYPES.get(desc, str)
            if desc in PYTHON_NESTED and item_desc is not None:
                nested_type = PYTHON_TYPES.get(item_desc, str)
        else:
            table = JAVA_TYPES if language == "java" else JS_TYPES
            expected_type = table.get(desc, str)
            if desc in JAVA_JS_NESTED and item_desc is not None:
                nested_type = table.get(item_desc, str)
            if isinstance(value, str):
                value = _convert_source_value(value, desc, item_desc if nested_type else None, language)
        if isinstance(value, tuple):
            value = list(value)
        if expected_type is float and type(value) == int:  # BFCL: int is fine for a float
            value = float(value)
        type_ok, is_variable = _type_checker(p, value, allowed, desc, expected_type, nested_type)
        if not type_ok:
            return False, f"wrong type for {p!r}: {type(value).__name__}, expected {desc}"
        if not is_variable:
            if expected_type is dict:
                if not _dict_ok(value, allowed):
                    return False, f"wrong value for {p!r}"
                continue
            if expected_type is list and nested_type is dict:
                if not _list_dict_ok(value, allowed):
                    return False, f"wrong value for {p!r}"
                continue
            if expected_type is str:
                if not _string_ok(value, allowed):
                    return False, f"wrong value for {p!r}: {value!r}"
                continue
            if expected_type is list:
                if not _list_ok(value, allowed):
                    return False, f"wrong value for {p!r}: {value!r}"
                continue
        if value not in allowed:
            return False, f"wrong value for {p!r}: {value!r}"
    for p, allowed in possible.items():
        if p not in args and "" not in (allowed if isinstance(allowed, list) else [allowed]):
            return False, f"missing parameter {p!r}"
    return True, ""


def check_calls(functions: list, calls: list[dict], answers: list[dict], category: str | None = None) -> tuple[bool, str]:
    """BFCL's ast_checker: decoded `calls` against the possible `answers`. "parallel"
    categories match calls to answers order-insensitively (each answer, in order, takes
    the first unmatched call that passes); every other category expects one call."""
    language = language_of(category or "")
    if category is None:
        category = "parallel" if len(answers) > 1 else "multiple"
    if len(calls) != len(answers):
        return False, f"wrong number of calls: {len(calls)}, expected {len(answers)}"
    if "parallel" not in category:
        name = next(iter(answers[0]))
        desc = _find_description(functions, name)
        if desc is None and functions:
            desc = functions[0]
        return check_call(desc or {}, calls[0], answers[0], language)
    matched: set[int] = set()
    for i, answer in enumerate(answers):
        desc = _find_description(functions, next(iter(answer))) or {}
        reason = "no call left"
        for j, call in enumerate(calls):
            if j in matched:
                continue
            ok, reason = check_call(desc, call, answer, language)
            if ok:
                matched.add(j)
                break
        else:
            return False, f"no call matches expected call {i}: {reason}"
    return True, ""


def score_completion(completion, functions: list, answers: list[dict], category: str | None = None) -> float:
    """1.0 when the completion's calls pass BFCL's check, else 0.0; never raises on
    model output."""
    try:
        calls = parse_calls(completion_text(completion))
        if calls is None:
            return 0.0
        ok, _ = check_calls(functions, calls, answers, category)
        return 1.0 if ok else 0.0
    except Exception:  # model output that trips the checker is a wrong answer
        return 0.0


# ----------------------------------------------------------------------------- reward


def _column_json(value, column: str, row: int):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"reward_tool_use: row {row}: column {column!r} is not valid JSON ({e})") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"reward_tool_use: row {row}: column {column!r} must be a non-empty JSON list, "
                         f"got {type(value).__name__}")
    return value


def reward(prompts, completions, functions=None, ground_truth=None, test_category=None, domain=None,
           **kwargs) -> list[float | None]:
    """TRL-style reward: 1.0 when the completion's function call(s) pass BFCL's AST
    check against `ground_truth` (see the module docstring), else 0.0; None for rows
    of another domain."""
    completions = list(completions)
    n = len(completions)
    domains = list(domain) if domain is not None else [None] * n
    mine = [d is None or d == DOMAIN for d in domains]
    if any(mine) and (functions is None or ground_truth is None):
        missing = [c for c, v in (("functions", functions), ("ground_truth", ground_truth)) if v is None]
        raise ValueError(f"reward_tool_use needs the column(s) {missing} (function schemas and BFCL-style "
                         "possible answers, as JSON strings)")
    functions = list(functions) if functions is not None else [None] * n
    ground_truth = list(ground_truth) if ground_truth is not None else [None] * n
    cats = list(test_category) if test_category is not None else [None] * n
    for name, col in (("functions", functions), ("ground_truth", ground_truth), ("test_category", cats),
                      ("domain", domains)):
        if len(col) != n:
            raise ValueError(f"reward_tool_use: {n} completions but {len(col)} values of {name!r}")
    out: list[float | None] = []
    for i in range(n):
        if not mine[i]:
            out.append(None)
            continue
        fns = _column_json(functions[i], "functions", i)
        answers = _column_json(ground_truth[i], "ground_truth", i)
        out.append(score_completion(completions[i], fns, answers, cats[i] or None))
    return out


reward.__name__ = "reward_tool_use"
