"""No observation token of a frontend_loop episode is ever in the loss mask, through the
code users run: the expert SFT's transcripts (experts/frontend_loop/data.py's TRAINER, as
`mopd expert` builds them) and the MOPD loop's path (the episode runner, then
mopd.distill.agents.segment_rows, then the batch's token mask from core.models.collate).

The observations are the browser's render reports (text). Image observations (the
screenshot) have no vision-language student to run with yet: the MOPD loop refuses them
for a text student before any episode (tests/unit/rewards/test_frontend_loop.py).
Needs Chromium, as the frontend reward's tests do."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from core.agent.episode import run_episodes
from core.agent.transcript import observation_ids
from core.config import load_config
from core.models import collate
from core.rollout import HFRollout, eos_ids
from experts.frontend_loop.data import TRAINER, make_dataset, make_tasks, oracle_messages
from experts.procedural import episode_dataset
from rewards import frontend_loop as FL

@dataclass
class P:   # what segment_rows reads of a batch row (mopd.distill.data.Prompt)
    ids: list
    domain: str = FL.DOMAIN


RECIPE = "recipes/opt_in/frontend_loop/sft.yaml"
REPORT_MARKS = ("Boxes:", "checks fail", FL.ALL_MET, "No page found", "did not render")


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _split(tok, ids, mask):
    return (_decode(tok, [t for t, k in zip(ids, mask) if k]), _decode(tok, [t for t, k in zip(ids, mask) if not k]))


@pytest.mark.ci
def test_expert_sft_transcripts_put_no_report_token_in_the_loss(tiny_tokenizer, tmp_path):
    from experts.run import ExpertConfig

    cfg = load_config(ExpertConfig, RECIPE, ["agent.perturb=1.0", "data.n_train=3", f"model.path={tmp_path}"])
    ds = make_dataset("train", 3, seed=0)
    rows = TRAINER.sft_transcripts(cfg, tiny_tokenizer, ds)
    assert len(rows) >= 3
    # an episode through a last_k harness is several rows (segments): the checks are over all of them
    learnt, reports = "", 0
    for _p, ids, mask in rows:
        assert len(ids) == len(mask) and sum(mask) > 0   # a last segment can be DONE alone
        student, observed = _split(tiny_tokenizer, ids, mask)
        assert not any(m in student for m in REPORT_MARKS), student
        learnt, reports = learnt + student, reports + observed.count("Boxes:")
    assert reports >= 2 * len(ds)   # each episode's imperfect page's report (and a failed fix's) and the fix's
    assert all(json.loads(task)["reference"] in learnt for task in ds["task"])
    # the scripted imperfect pages and failed fixes are context, not targets: two turns learnt an
    # episode (the fix, DONE)
    assert learnt.count(FL.DONE) == len(ds) and learnt.count(tiny_tokenizer.eos_token) == 2 * len(ds)


@pytest.mark.ci
def test_mopd_episode_rows_put_no_observation_token_in_the_loss(tiny_student_dir, tiny_tokenizer, student_hf):
    from mopd.distill.agents import segment_rows

    tok = tiny_tokenizer
    tasks = make_tasks("test", 3, seed=0)
    envs = [FL.make_env(FL.harness_config(), max_turns=3) for _ in tasks]
    torch.manual_seed(0)
    eps = run_episodes(HFRollout(student_hf, tok, batch_size=4), tok, envs, tasks, seeds=[1, 2, 3],
                       temperature=1.0, top_p=1.0, max_turns=3, max_context_tokens=480, max_new_tokens=24,
                       eos_ids=eos_ids(tok))
    observations = [m["content"] for e in eps for m in e.messages[2:] if m["role"] != "assistant"]
    assert observations, "the random student's turns got no observation"

    rows, _seeds, _off, samples, ep_of = segment_rows([P([0]) for _ in eps], [0] * len(eps), [False] * len(eps),
                                                      [None] * len(eps), list(range(len(eps))), eps)
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], tok.pad_token_id or 0, {},
                    token_mask=[s.loss_mask for s in samples])
    seen = 0
    for j, s in enumerate(samples):
        n = len(s.completion_ids)
        assert [int(k) for k in batch["mask"][j, :n].tolist()] == list(s.loss_mask)   # what the loss weighs
        student, observed = _split(tok, s.completion_ids, s.loss_mask)
        assert sum(s.loss_mask) == sum(1 for t in s.turn_ids if t >= 0)
        ep = eps[ep_of[j]]
        for m in ep.messages[2:]:
            if m["role"] == "assistant":
                continue
            obs = observation_ids(tok, m["role"], m["content"])
            # the observation's tokens are in the sequence, each at a masked position
            at = [k for k in range(n - len(obs) + 1) if s.completion_ids[k:k + len(obs)] == obs]
            assert at and all(s.loss_mask[k] == 0 for k in range(at[0], at[0] + len(obs)))
            seen += 1
        assert not any(mk in student for mk in REPORT_MARKS)
    assert seen == len(observations)


@pytest.mark.ci
def test_prerendered_sft_transcripts_are_the_one_at_a_time_ones(tiny_tokenizer, tmp_path):
    from experts.agent_expert import AgentExpert
    from experts.run import ExpertConfig

    cfg = load_config(ExpertConfig, RECIPE, ["agent.perturb=0.5", "data.n_train=4", f"model.path={tmp_path}"])
    ds = make_dataset("train", 4, seed=1)
    assert TRAINER.sft_transcripts(cfg, tiny_tokenizer, ds) == AgentExpert.sft_transcripts(TRAINER, cfg, tiny_tokenizer, ds)
    # the dataset's oracle episodes too (make_dataset prerenders them)
    one_at_a_time = episode_dataset(FL.DOMAIN, make_tasks("train", 4, seed=1), [FL.harness_config()] * 4, oracle_messages)
    assert ds.to_list() == one_at_a_time.to_list()
