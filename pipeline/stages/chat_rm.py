"""Stage `chat_rm` (only with chat among the domains): the reward model the chat expert
is trained and scored with (experts/chat/train_rm.py) -> DIR/chat_rm. It starts from the
chat SFT checkpoint (`experts.chat_rm.init: sft`, the default), the base, or random."""
from __future__ import annotations

from dataclasses import asdict
from functools import partial

from experts.chat.train_rm import INFO_FILE, train_reward_model
from pipeline.runner import Stage, StageContext
from pipeline.stages.common import Scope, Tracking, log_artifact, log_metrics, log_params

NAME = "chat_rm"


def stage(scope: Scope) -> Stage:
    rm = scope.cfg.experts.chat_rm
    s = {**asdict(rm), "steps": min(rm.steps, scope.cap)}
    chat_sft = scope.layout.expert_model("chat", "sft")
    init, deps = {"sft": (str(chat_sft), ["expert/chat/sft"]),
                  "base": (str(scope.base_model), ["base"]), "random": (None, [])}[rm.init]
    # concurrent: it trains in this process, but on one thread, beside expert subprocesses
    return Stage(NAME, scope.layout.hashed(s), partial(run, settings=s, init=init, tracking=scope.tracking),
                 deps=deps, out=scope.layout.chat_rm, concurrent=True,
                 cost=s["steps"] * rm.batch_size * 2 * 150.0)  # pairs of ~150-char rows


def run(ctx: StageContext, settings: dict, init: str | None, tracking: Tracking) -> dict:
    s = settings
    with tracking.stage_run(ctx, "chat_rm", domain="chat"):
        log_params(s)
        acc = train_reward_model(str(ctx.out), base=init, n_pairs=s["n_pairs"], steps=s["steps"], lr=s["lr"],
                                 seed=s["seed"], batch_size=s["batch_size"], n_heldout=s["n_heldout"])
        log_metrics({"pairwise_accuracy": acc})
        log_artifact(ctx.out / INFO_FILE)
    return {"checkpoint": str(ctx.out), "pairwise_accuracy": acc}
