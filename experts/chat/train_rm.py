"""Train the `chat` reward model with TRL's RewardTrainer.

A Qwen2ForSequenceClassification with one output (the score, read at the last token of
the chat-rendered prompt + answer) learns from `make_preferences` pairs: a helpful
on-topic answer or a refusal of an unsafe request (chosen) against an off-topic,
unhelpful, repetitive or unsafe answer, or a refusal of a benign question (rejected).
It is a random-init tiny model by default, or starts from a causal-LM checkpoint given
as `base` (a new score head on its body); either way it uses the project tokenizer, so
it reads exactly the tokens the policy writes.

The folder it writes holds the model, the tokenizer and `rm_info.json`: held-out
pairwise accuracy (overall and per rejection kind), the mean held-out scores of chosen
and rejected answers, and the calibration rewards/chat.py applies,
reward = sigmoid((score - mid) / scale), fitted on the held-out chosen and rejected
scores by logistic regression (Platt scaling).

    python -m experts.chat.train_rm --out runs/chat_rm [--steps 300] [--base CKPT]

Which body to start from matters (measured; 4000 pairs, 300 steps of 32, lr 1e-3, 400
held-out pairs, 2 x 128 Qwen2):
  random init                                  accuracy 0.91, off-topic pairs 0.67
  tiny base pretrained on pretrain_rows        accuracy 0.92, off-topic pairs 0.80
  the chat SFT expert (300 SFT steps on it)    accuracy 0.99, off-topic pairs 0.97
Every other rejection kind is at 0.97-1.0 from any start. Telling an on-topic fact from
an off-topic one means comparing the answer with the prompt, which a random-init model
does not pick up in a few hundred steps (600 steps or 4 layers did no better), while an
LM that has learned to answer on topic already carries the features. So train the
reward model from the chat SFT checkpoint (`--base`), as InstructGPT does; the
random-init default is for tests and quick runs.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, Qwen2ForSequenceClassification
from transformers.utils import logging as hf_logging
from trl import RewardConfig, RewardTrainer

from experts.chat.data import make_preferences
from core.tiny import load_tokenizer, tiny_config
from rewards.chat import score_batch

INFO_FILE = "rm_info.json"


def build_reward_model(base: str | None = None, *, seed: int = 0, hidden_size: int = 128,
                       num_layers: int = 2, num_heads: int = 2):
    """(model, tokenizer): a one-output sequence classifier, random init from the tiny
    config, or with the body of the checkpoint at `base`."""
    torch.manual_seed(seed)
    if base is not None:
        tok = load_tokenizer(base)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the new score head and the unused lm_head are expected
        try:
            model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1,
                                                                       dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
    else:
        tok = load_tokenizer()
        vocab = ((len(tok) + 63) // 64) * 64
        cfg = tiny_config(vocab, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        cfg.num_labels = 1
        model = Qwen2ForSequenceClassification(cfg)
    model.config.pad_token_id = tok.pad_token_id  # the score is read at the last non-pad token
    return model, tok


def calibration(chosen: list[float], rejected: list[float], l2: float = 1e-2) -> dict:
    """mid/scale of reward = sigmoid((s - mid) / scale), fitted by logistic regression
    of "is a chosen answer" on the held-out scores (Platt scaling, a little L2 on the
    slope so that fully separated scores give a steep but finite sigmoid). The
    boundary lands where chosen and rejected scores overlap, so good answers score
    near 1 and bad ones near 0. When the fit finds no positive slope (the model does
    not rank chosen above rejected), plain sigmoid(s)."""
    xs = torch.tensor(list(chosen) + list(rejected), dtype=torch.float64)
    ys = torch.tensor([1.0] * len(chosen) + [0.0] * len(rejected), dtype=torch.float64)
    mu, sd = xs.mean(), xs.std().clamp(min=1e-6)
    zs = (xs - mu) / sd
    X = torch.stack([zs, torch.ones_like(zs)], dim=1)  # slope a, intercept b on standardized scores
    w = torch.zeros(2, dtype=torch.float64)
    reg = torch.tensor([l2, 0.0], dtype=torch.float64) * len(zs)
    for _ in range(100):  # Newton steps on the penalized log-loss
        p = torch.sigmoid(X @ w)
        grad = X.T @ (p - ys) + reg * w
        hess = X.T @ (X * (p * (1 - p))[:, None]) + torch.diag(reg + 1e-9)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if step.abs().max() < 1e-10:
            break
    a, b = float(w[0]), float(w[1])
    if not a > 1e-6:
        return {"mid": 0.0, "scale": 1.0, "calibrated": False}
    return {"mid": float(mu - b * sd / a), "scale": float(sd / a), "calibrated": True}


def heldout_report(model, tokenizer, pairs, *, batch_size: int = 64) -> dict:
    """Pairwise accuracy (chosen scores above rejected), overall and per kind, and the
    score means, on preference `pairs`."""
    prompts = list(pairs["prompt"])
    chosen = score_batch(model, tokenizer, prompts, [c[-1]["content"] for c in pairs["chosen"]],
                         batch_size=batch_size)
    rejected = score_batch(model, tokenizer, prompts, [r[-1]["content"] for r in pairs["rejected"]],
                           batch_size=batch_size)
    wins = [c > r for c, r in zip(chosen, rejected)]
    by_kind: dict[str, list[bool]] = {}
    for kind, w in zip(pairs["kind"], wins):
        by_kind.setdefault(kind, []).append(w)
    return {
        "pairwise_accuracy": sum(wins) / len(wins),
        "accuracy_by_kind": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_kind.items())},
        "mean_chosen_score": sum(chosen) / len(chosen),
        "mean_rejected_score": sum(rejected) / len(rejected),
        "n_heldout_pairs": len(wins),
        **calibration(chosen, rejected),
    }


def train_reward_model(out_dir: str, *, base: str | None = None, n_pairs: int = 4000, steps: int = 300,
                       lr: float = 1e-3, seed: int = 0, batch_size: int = 32, n_heldout: int = 400,
                       difficulty: int = 1, progress: bool = True, num_threads: int | None = 1,
                       model_sizes: dict | None = None) -> float:
    """Train on `n_pairs` train-split preference pairs for `steps` steps of
    `batch_size` pairs, save model + tokenizer + rm_info.json to `out_dir`, and return
    the pairwise accuracy on `n_heldout` test-split pairs."""
    if steps < 1 or n_pairs < 1 or n_heldout < 1:
        raise ValueError(f"train_reward_model: steps, n_pairs and n_heldout must be >= 1 "
                         f"(got {steps}, {n_pairs}, {n_heldout})")
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    try:
        out = Path(out_dir)
        model, tok = build_reward_model(base, seed=seed, **(model_sizes or {}))
        train = make_preferences("train", n_pairs, seed=seed, difficulty=difficulty)
        heldout = make_preferences("test", n_heldout, seed=seed, difficulty=difficulty)
        args = RewardConfig(
            output_dir=str(out / "trainer"), max_steps=steps, learning_rate=lr,
            per_device_train_batch_size=batch_size, lr_scheduler_type="cosine", warmup_steps=min(20, steps // 10),
            weight_decay=0.0, logging_steps=max(1, steps // 10), save_strategy="no", report_to="none",
            seed=seed, data_seed=seed, max_length=int(model.config.max_position_embeddings),
            disable_tqdm=not progress, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
            bf16=False, fp16=False,
        )
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # no "no label_names" chatter
        try:
            trainer = RewardTrainer(model=model, args=args, train_dataset=train.remove_columns("kind"),
                                    processing_class=tok)
            trainer.train()
        finally:
            hf_logging.set_verbosity(verbosity)
        model = trainer.model.eval()
        report = heldout_report(model, tok, heldout)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
        report.update({
            "base": base, "n_pairs": n_pairs, "steps": steps, "lr": lr, "seed": seed,
            "batch_size": batch_size, "difficulty": difficulty,
            "train_loss": [round(h["loss"], 5) for h in trainer.state.log_history if "loss" in h],
            "seconds": round(time.perf_counter() - t0, 2),
        })
        (out / INFO_FILE).write_text(json.dumps(report, indent=1))
        return float(report["pairwise_accuracy"])
    finally:
        torch.set_num_threads(old_threads)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experts.chat.train_rm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the reward model")
    ap.add_argument("--base", default=None, help="causal-LM checkpoint to start from (default: random-init tiny)")
    ap.add_argument("--n-pairs", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-heldout", type=int, default=400, help="test-split pairs for accuracy and calibration")
    ap.add_argument("--difficulty", type=int, default=1)
    args = ap.parse_args(argv)
    acc = train_reward_model(args.out, base=args.base, n_pairs=args.n_pairs, steps=args.steps, lr=args.lr,
                             seed=args.seed, batch_size=args.batch_size, n_heldout=args.n_heldout,
                             difficulty=args.difficulty)
    info = json.loads((Path(args.out) / INFO_FILE).read_text())
    rows = [("held-out pairwise accuracy", f"{acc:.3f}")]
    rows += [(f"  rejected = {k}", f"{v:.3f}") for k, v in info["accuracy_by_kind"].items()]
    rows += [("mean chosen / rejected score", f"{info['mean_chosen_score']:.3f} / {info['mean_rejected_score']:.3f}"),
             ("calibration mid / scale", f"{info['mid']:.3f} / {info['scale']:.3f}"),
             ("seconds", f"{info['seconds']:.1f}"), ("saved to", args.out)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
