"""rewards/frontend_loop.py: the page-revising environment in a real Chromium (the frontend
reward's pool): the render report never states a check's expected value, a page that
hangs the renderer ends its episode with 0 and nothing else, the done marker and the turn
limit, the first-turn score beside the final one, the reward's replay, and the
observation kind refused for a student that cannot take it.

Needs Chromium ($MOPD_CHROMIUM or chromium on PATH), as the frontend reward's tests do."""
from __future__ import annotations

import json
import random
import re

import pytest

from experts.frontend import data as frontend
from experts.frontend_loop.data import make_tasks, oracle_messages
from rewards import frontend_loop as FL
from rewards.browser import PageJob, get_pool
from rewards.frontend import COLORS


def _cfg():
    return FL.harness_config()


def adversarial_pages(task: dict, rng: random.Random) -> list[str]:
    """Pages a student might write to fish the checks out of the report: the reference, each
    corruption and all at once, the right page hidden, with other ids, overflowing, throwing,
    fetching, and an empty one."""
    ref = task["reference"]
    pages = [ref, frontend.corrupt({}, ref, rng), "<p></p>", ""]
    pages += [frontend.corrupt_kind(ref, k, rng) for k in frontend.CORRUPTIONS]
    pages += [f'<body style="display:none">{ref}</body>', re.sub(r'id="(\w)"', r'id="z\1"', ref),
              ref + '<div style="width:2000px;height:10px"></div>', ref + "<script>null.x</script>",
              ref + '<img src="http://example.com/a.png">', f'<div style="opacity:0">{ref}</div>']
    return [p for p in pages if p.strip()]


def expected_values(checks: list[dict]) -> tuple[set[str], list[tuple[str, str, int]]]:
    """(strings a check wants: texts, tags, colors by name and computed value; (id, dim, px)
    of every size check)."""
    names = {v: k for k, v in COLORS.items()}
    words, sizes = set(), []
    for c in checks:
        if c.get("text"):
            words.add(c["text"])
        if c.get("tag"):
            words.add(c["tag"])
        if c.get("value"):
            words |= {c["value"], names.get(c["value"], c["value"])}
        if c["type"] in ("width", "height"):
            sizes.append((c["id"], c["type"][0], int(c["px"])))
    return words, sizes


def _reports(tasks: list[dict]) -> list[tuple[dict, str, str]]:
    rng = random.Random(0)
    jobs, meta = [], []
    for t in tasks:
        for page in adversarial_pages(t, rng):
            jobs.append(PageJob(page, FL.page_script(t["checks"])))
            meta.append((t, page))
    results = get_pool().render(jobs, timeout_s=FL.TIMEOUT_S)
    return [(t, page, FL.render_report(t["checks"], r)) for (t, page), r in zip(meta, results)]


def _assert_no_expected_value(tasks):
    seen_fail = seen_boxes = 0
    for task, page, report in _reports(tasks):
        words, sizes = expected_values(task["checks"])
        for w in words:   # never, whatever the page is (the reference page included)
            assert not re.search(rf"(?<![\w#-]){re.escape(w)}(?![\w-])", report), (w, page, report)
        for cid, dim, px in sizes:
            # a box is the page's own measurement: it may equal the wanted size only when the
            # page itself sets that size
            if f"{'width' if dim == 'w' else 'height'}:{px}px" not in page:
                assert not re.search(rf"#{cid}: [^;\n]*\b{dim}={px}\b", report), (cid, dim, px, page, report)
        seen_fail += "checks fail" in report
        seen_boxes += "Boxes:" in report
    assert seen_fail and seen_boxes   # the reports did say something


# ~1 s a page on two busy cores: the report's guarantees are the second tier's
@pytest.mark.ci
def test_render_report_never_states_an_expected_value():
    tasks = [t for d in (1, 3) for t in make_tasks("test", 3, seed=0, difficulty=d)]
    _assert_no_expected_value(tasks)


@pytest.mark.ci
def test_render_report_never_states_an_expected_value_over_many_tasks():
    tasks = [t for d in (1, 2, 3) for split in ("train", "test") for t in make_tasks(split, 8, seed=1, difficulty=d)]
    assert {t["family"] for t in tasks} == set(frontend.FAMILIES)
    _assert_no_expected_value(tasks)


def test_report_names_what_is_wrong_and_the_episode_scores_first_and_final_pages():
    task = make_tasks("test", 1, seed=3, difficulty=2)[0]
    env = FL.make_env(_cfg())
    env.reset(task)
    missing = re.sub(r'<(\w+) id="a"[^>]*>[^<]*</\1>', "", task["reference"], count=1)
    obs, done, info = env.step(missing + "<script>null.x</script>")
    assert not done and "#a missing or not shown" in obs and "Console errors:" in obs and "Cannot read" in obs
    obs, done, _ = env.step(task["reference"])
    assert not done and obs.startswith(FL.ALL_MET)
    obs, done, info = env.step(FL.DONE)
    assert done and obs == "" and info["reward"] == 1.0 and info["first_score"] < 1.0 and info["pages"] == 2


def test_turns_run_out_with_the_last_pages_score():
    task = make_tasks("test", 1, seed=4)[0]
    env = FL.make_env(_cfg(), max_turns=2)
    env.reset(task)
    assert not env.step("<p>draft</p>")[1]
    _obs, done, info = env.step(task["reference"])
    assert done and info["reward"] == 1.0 and info["first_score"] == 0.0


@pytest.mark.parametrize("factory", [FL.make_env, FL.make_screenshot_env], ids=["report", "screenshot"])
def test_a_page_that_hangs_the_renderer_ends_the_episode_with_zero_and_nothing_else(factory):
    task = make_tasks("test", 1, seed=5)[0]
    env = factory(_cfg(), timeout_s=60.0)   # the perfect page first, with time to render on a busy box
    env.reset(task)
    env.step(task["reference"])
    assert env.reports[-1].startswith(FL.ALL_MET)
    env.timeout_s = 2.0
    n_msgs, n_shots = len(env.messages), len(env.shots)
    obs, done, info = env.step(task["reference"] + "<script>while (true) {}</script>")
    assert done and obs == "" and info["reward"] == 0.0 and info["hung"] == "timeout"
    assert len(env.messages) == n_msgs + 1 and len(env.shots) == n_shots   # the turn only: no observation, no image
    env.close()
    if factory is FL.make_screenshot_env:
        return
    # the reward's replay agrees
    msgs = [{"role": "assistant", "content": task["reference"]},
            {"role": "assistant", "content": "<script>while (true) {}</script>"}]
    assert FL.reward(["p"], [msgs], task=[json.dumps(task)], timeout_s=2.0) == [0.0]


@pytest.mark.ci
def test_reward_replays_the_oracle_and_its_corruption():
    task = make_tasks("train", 1, seed=6)[0]
    good = oracle_messages(task, _cfg(), perturb=True, rng=random.Random(0))[1:]
    assert sum(m["role"] == "assistant" for m in good) in (3, 4)   # imperfect page(s), fixed page, DONE
    assert FL.reward(["p"], [good], task=[json.dumps(task)], domain=["frontend_loop"]) == [1.0]
    assert FL.reward(["p"], [good], task=[json.dumps(task)], domain=["math"]) == [None]


def _changed(a: str, b: str) -> tuple[int, int]:
    """The span of `a` that differs from `b` (one region: common prefix and suffix off)."""
    i = len(__import__("os").path.commonprefix([a, b]))
    j = len(__import__("os").path.commonprefix([a[i:][::-1], b[i:][::-1]]))
    return i, len(a) - j


def test_a_slip_changes_one_place_and_a_failed_fix_keeps_the_first_slip():
    from experts.frontend_loop.data import apply_slips, slipped_pages, slips

    two_seen = 0
    for task in make_tasks("train", 40, seed=2):
        ref = task["reference"]
        places = slips(ref, random.Random(task["id"]))
        assert places and all(apply_slips(ref, [s]) != ref for s in places)
        for start, end, new in places:   # a smaller size only: a centered box's width is a minimum
            if ref[start:end].isdigit() and new:
                assert int(new) < int(ref[start:end])
        spans = {(a, b) for a, b, _ in places}
        one = slipped_pages(task, random.Random(1), 1)
        assert len(one) == 1 and one[0] != ref
        a, b = _changed(ref, one[0])   # one place of the reference changed, inside a slip's span
        assert any(s <= a and b <= e for s, e in spans), (ref, one[0])
        two = slipped_pages(task, random.Random(2), 2)
        if two:   # two slips, then the page with the first of them only (a failed fix)
            two_seen += 1
            first, second = two
            assert first != second != ref
            a, b = _changed(ref, second)
            assert any(s <= a and b <= e for s, e in spans)
            assert _changed(second, first) != _changed(second, ref)   # the fix undid the other slip
    assert two_seen > 20


@pytest.mark.ci
def test_every_scripted_imperfect_page_fails_and_only_the_fix_and_done_are_learnt():
    """The perturbed episodes (corruption kind, one slip, two slips and a failed fix): every
    page before the reference gets a failing report, the reference gets "All checks pass.",
    and only the reference and DONE are targets."""
    shapes = set()
    rng = random.Random(0)
    for task in make_tasks("train", 9, seed=3):
        msgs = oracle_messages(task, _cfg(), perturb=True, rng=rng)
        said = [m for m in msgs if m["role"] == "assistant"]
        reports = [m["content"] for m in msgs[2::2]]
        shapes.add(len(said))
        assert said[-2]["content"] == task["reference"] and said[-1]["content"] == FL.DONE
        assert reports[-1].startswith(FL.ALL_MET) and not any(FL.ALL_MET in r for r in reports[:-1])
        assert [m.get("loss", True) for m in said] == [False] * (len(said) - 2) + [True, True]
    assert shapes == {3, 4}


class _TextTok:
    name_or_path = "tiny-text"


class _Proc:
    image_token = "<|image_pad|>"

    def __init__(self, max_pixels):
        self.image_processor = type("IP", (), {"max_pixels": max_pixels, "size": {}})()


def test_observation_kind_must_suit_the_student():
    FL.check_observation("report", _TextTok())
    with pytest.raises(ValueError, match="text-only.*observation 'report'"):
        FL.check_observation("screenshot", _TextTok())
    with pytest.raises(ValueError, match="over the student's image budget of 1000 pixels"):
        FL.check_observation("screenshot", _TextTok(), _Proc(1000))
    FL.check_observation("screenshot", _TextTok(), _Proc(10_000_000))
    with pytest.raises(ValueError, match="unknown observation"):
        FL.check_observation("video")
    # the MOPD loop calls the factory's preflight before any episode (mopd/distill/agents.py)
    with pytest.raises(ValueError, match="text-only"):
        FL.make_screenshot_env.preflight(tokenizer=_TextTok(), model_path=None)


def test_screenshot_observation_is_an_image_message(tmp_path):
    task = make_tasks("test", 1, seed=7)[0]
    env = FL.make_screenshot_env(_cfg())
    env.reset(task)
    obs, done, _ = env.step("<p>draft</p>")
    assert not done and obs[0]["type"] == "image"
    with open(obs[0]["image"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    env.close()


def test_the_mopd_loop_refuses_screenshots_for_a_text_student_before_any_episode(tiny_tokenizer, no_model_loads):
    from core.config import ConfigError, load_config
    from mopd.distill.agents import load_agents
    from mopd.distill.config import DistillConfig

    recipe = "recipes/opt_in/frontend_loop/mopd.yaml"
    assert load_agents(load_config(DistillConfig, recipe), tiny_tokenizer)["frontend_loop"].factory is FL.make_env
    cfg = load_config(DistillConfig, recipe, ["agents.frontend_loop.env=rewards.frontend_loop:make_screenshot_env"])
    with pytest.raises(ConfigError, match="agents.frontend_loop: .*text-only.*observation 'report'"):
        load_agents(cfg, tiny_tokenizer)


def test_loop_stats_counts_the_episodes_that_said_done():
    from types import SimpleNamespace as NS

    from evals.frontend_loop import loop_stats

    said = NS(reward=1.0, turns=2, cut=None, messages=[{"role": "assistant", "content": "<p>x</p>"},
                                                       {"role": "user", "content": FL.ALL_MET},
                                                       {"role": "assistant", "content": FL.DONE}])
    ran_out = NS(reward=0.5, turns=4, cut="max_turns", messages=[{"role": "assistant", "content": "<p>y</p>"}])
    st = loop_stats([said, ran_out], [NS(scores=[1.0], hung=None), NS(scores=[0.25, 0.5], hung=None)])
    assert st["done"] == 0.5 and st["per_episode"]["done"] == [True, False]
    assert st["first_score"] == 0.625 and st["score"] == 0.75
