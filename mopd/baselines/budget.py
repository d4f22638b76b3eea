"""What each method of the report costs: tokens and an estimate of FLOPs from the models'
shapes (Kaplan et al., 2020):

    forward over T tokens          2 * N * T
    training update over T tokens  6 * N * T   (forward + backward, the backward twice the forward)

N is the parameters that take part in a matrix product per token: every parameter
except the embedding tables (a lookup costs no multiply-adds), with a table tied to the
output head counted once, as the head. The attention term (2 * layers * context * width
per token) and the prompt tokens are left out: the prompts are the same kind and, per
sample, the same length for every method, and on the short contexts here the attention
term is a few percent of the rest. Each method's terms:

    MOPD     student sampling 2*N_s*T + teacher scoring 2*N_t*T + student update 6*N_s*T
             (T = the student tokens trained on; with teacher correction the re-scored
             rows add more teacher forwards, not counted)
    seq-KD   teacher generation 2*N_t*T_gen + student update 6*N_s*T
             (T_gen = the teacher answer tokens the student trains on)
    Mix-RL   student sampling 2*N_s*T + student update 6*N_s*T
             (+ reference forward 2*N_s*T when beta > 0; the rewards, and the chat reward
             model's forwards, are not counted)
    weight average: no training (parameter additions only): 0
"""
from __future__ import annotations

from pathlib import Path


def matmul_params(model) -> int:
    """N of an instantiated model (weights may be on the meta device): all parameters but
    the embedding tables, a table that is also the output head counted once."""
    import torch

    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = id(head.weight) if head is not None and getattr(head, "weight", None) is not None else None
    return int(total - sum(n for k, n in emb.items() if k != tied))


def checkpoint_params(path: str | Path) -> int:
    """N (see matmul_params) of the HF checkpoint at `path`, from its config.json alone:
    the model is built on the meta device, no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"budget: {path} is not an HF checkpoint folder (no config.json)")
    cfg = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return matmul_params(model)


def forward_flops(n_params: int, tokens: int) -> float:
    return 2.0 * n_params * tokens


def train_flops(n_params: int, tokens: int) -> float:
    return 6.0 * n_params * tokens


def budget(*, n_student: int, student_tokens: int, student_sampled: int = 0, n_teacher: int = 0,
           teacher_generated: int = 0, teacher_scored: int = 0, reference_forward: int = 0,
           samples: int | None = None) -> dict:
    """One method's budget: its token counts and the FLOPs terms of the formula above.
    `student_tokens`: tokens the student trains on; `student_sampled`: tokens it generated
    itself; `teacher_generated` / `teacher_scored`: tokens a teacher generated / scored with
    a forward; `reference_forward`: tokens a frozen copy of the student scored (RL's KL term)."""
    for k, v in (("n_student", n_student), ("student_tokens", student_tokens), ("student_sampled", student_sampled),
                 ("n_teacher", n_teacher), ("teacher_generated", teacher_generated),
                 ("teacher_scored", teacher_scored), ("reference_forward", reference_forward)):
        if v is None or v < 0:
            raise ValueError(f"budget: {k} must be a count >= 0, got {v!r}")
    if (teacher_generated or teacher_scored) and not n_teacher:
        raise ValueError("budget: teacher tokens given without the teacher's parameter count (n_teacher)")
    terms = {"student_sampling": forward_flops(n_student, student_sampled),
             "teacher_generation": forward_flops(n_teacher, teacher_generated),
             "teacher_scoring": forward_flops(n_teacher, teacher_scored),
             "reference_forward": forward_flops(n_student, reference_forward),
             "student_update": train_flops(n_student, student_tokens)}
    return {"student_tokens": int(student_tokens), "student_samples": samples,
            "student_tokens_sampled": int(student_sampled),
            "teacher_tokens_generated": int(teacher_generated), "teacher_tokens_scored": int(teacher_scored),
            "flops": sum(terms.values()), "flops_terms": terms,
            "params": {"student": int(n_student), "teacher": int(n_teacher)}}


def mopd_budget(*, n_student: int, n_teacher: int, tokens: int, on_policy_tokens: int | None = None,
                samples: int | None = None) -> dict:
    """MOPD: the student samples its own tokens (the on-policy ones; teacher-forced rows
    are dataset references, not sampled), a teacher scores every trained token, the
    student trains on all of them; no teacher generates."""
    sampled = tokens if on_policy_tokens is None else on_policy_tokens
    return budget(n_student=n_student, n_teacher=n_teacher, student_tokens=tokens, student_sampled=sampled,
                  teacher_scored=tokens, samples=samples)


def seq_kd_budget(*, n_student: int, n_teacher: int, tokens: int, rows: int | None = None) -> dict:
    """seq-KD: the teachers generate the answers the student is fine-tuned on; no teacher
    forward during training."""
    return budget(n_student=n_student, n_teacher=n_teacher, student_tokens=tokens, teacher_generated=tokens,
                  samples=rows)


def rl_budget(*, n_student: int, tokens: int, samples: int, beta: float = 0.0) -> dict:
    """Mix-RL / cascade RL: the student samples and trains on its own tokens; no teacher."""
    return budget(n_student=n_student, student_tokens=tokens, student_sampled=tokens,
                  reference_forward=tokens if beta > 0 else 0, samples=samples)


def no_training_budget(n_student: int) -> dict:
    """The weight average: no tokens, no training."""
    return budget(n_student=n_student, student_tokens=0)
