"""One optimizer step of the loop on one minibatch of scored samples.

The student's log-probs of its samples, the dense reward r_t = log p_T(y_t) - log p_S(y_t)
(or, with loss.kl=full, the exact divergence over the vocabulary), an importance
correction for the sampler/trainer gap, backward, clip, step. What the metrics need
comes back in a `StepResult`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mopd.distill import loss as L
from mopd.distill.config import LossConfig
from core.models import collate, completion_hidden, completion_logprobs, output_head


@dataclass
class StepResult:
    loss: torch.Tensor           # this rank's loss (times world: DDP averages over ranks)
    grad_norm: float
    mask_BT: torch.Tensor        # completion tokens the student wrote (observations masked out)
    trainer_lp_BT: torch.Tensor
    sampler_lp_BT: torch.Tensor  # after filling teacher-forced rows and teacher-inserted tokens
    kl_log_BT: torch.Tensor      # the logged reverse KL per token (against the teacher itself)
    isw: object                  # loss.ImportanceWeights
    inserted_BT: torch.Tensor    # tokens the teacher inserted (rollout.correct_below)
    n_tok_global: float          # completion tokens of the minibatch over all ranks


class SingleProcess:
    """What `train_step` needs of an accelerate.Accelerator, for one process without one
    (tests, benches)."""
    num_processes = 1

    def reduce(self, t, reduction="sum"):
        return t

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm_(self, params, c):
        return torch.nn.utils.clip_grad_norm_(params, c)


def pad_full(rows: list[torch.Tensor], T: int, V: int) -> torch.Tensor:
    """Teacher full log-prob rows [len_i, V_i] -> [B, T, V] over the first V token ids, each
    position renormalized over them: a teacher with more rows than V (a padded vocabulary,
    Qwen2.5-7B's 152,064 against 151,936) keeps its distribution over the ids the student
    can produce, never a cut one that sums below 1 (a forward KL below 0). Columns a row
    does not have (V_i < V) and top-k rows' other tokens are -inf (p_T = 0; the divergence
    is -inf-safe). Padding positions are 0 and masked out of the loss."""
    out = torch.zeros((len(rows), T, V))
    for i, r in enumerate(rows):
        if r is None or not len(r):
            continue
        n, v = r.shape
        if v > V:
            r = r[:, :V]
            r = r - torch.logsumexp(r, dim=-1, keepdim=True)
        out[i, :n, :min(v, V)] = r
        if v < V:
            out[i, :n, v:] = float("-inf")
    return out


def over_vocab(trainer_BTV: torch.Tensor, V: int) -> torch.Tensor:
    """The student's log-distribution over the first V ids, renormalized over them (its
    extra rows, ids no tokenizer produces, leave the divergence)."""
    if trainer_BTV.shape[-1] <= V:
        return trainer_BTV
    return torch.log_softmax(trainer_BTV[..., :V], dim=-1)


def restrict_to_support(trainer_BTV: torch.Tensor, teacher_BTV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k teachers (`top_k` > 0) give log-probs on their k most likely tokens and -inf
    elsewhere: the divergence is then taken over those tokens, the student's distribution
    renormalized on the same set (top-k distillation). Rows without -inf are unchanged.
    Outside the support both sides are -inf (probability 0), which the divergence
    (`loss.kl_terms`) counts as 0 with no gradient."""
    out_BTV = torch.isneginf(teacher_BTV)
    if not out_BTV.any():
        return trainer_BTV, teacher_BTV
    s_BTV = torch.log_softmax(trainer_BTV.masked_fill(out_BTV, float("-inf")), dim=-1)
    # a row with no -inf at all is a full distribution: its student log-probs stay as they were
    full_BT = ~out_BTV.any(-1, keepdim=True)
    return torch.where(full_BT, trainer_BTV, s_BTV), teacher_BTV


def divergence_inputs(trainer_full_BTV: torch.Tensor, teacher_full: list, T: int, vocab: int | None,
                      teacher_temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student, teacher target, teacher itself), [B, T, V] log-distributions over the ids
    the tokenizer can produce (`vocab`, len(tokenizer); None: the narrower of the two
    models), each renormalized over them, the student restricted to a top-k teacher's
    support; the target is the teacher sharpened by `teacher_temperature`."""
    widths = [r.shape[-1] for r in teacher_full if r is not None and len(r)]
    V = vocab if vocab is not None else min([trainer_full_BTV.shape[-1], *widths])
    s_BTV = over_vocab(trainer_full_BTV, V)
    teacher_raw_BTV = pad_full(teacher_full, T, V)
    s_BTV, teacher_raw_BTV = restrict_to_support(s_BTV, teacher_raw_BTV)
    return s_BTV, L.sharpen(teacher_raw_BTV, teacher_temperature), teacher_raw_BTV


def teacher_rows(teacher_full: list, pb: torch.Tensor, pt: torch.Tensor, V: int) -> torch.Tensor:
    """The teacher's rows at positions (pb[j], pt[j]), [C, V], each cut to (and renormalized
    over) or padded with -inf to the first V ids: `pad_full`'s rows, without the whole
    [B, T, V] tensor. Positions are sorted by row, so each row is one slice. An hf teacher's
    rows under loss.logits_chunk are `teachers.scoring.HeadRows` (hidden states and head):
    indexing makes just these rows, so the teacher's [len, V] is never whole either."""
    out = []
    for b in torch.unique_consecutive(pb).tolist():
        ts = pt[pb == b]
        out.append(pad_full([teacher_full[b][ts]], len(ts), V)[0])
    return torch.cat(out)


def chunked_terms(h_BTH: torch.Tensor, head, completion_ids_BT: torch.Tensor, mask_BT: torch.Tensor,
                  teacher_full: list, *, V: int, loss_cfg: LossConfig, temp_B: torch.Tensor,
                  top_p_B: torch.Tensor, tempered: bool, chunk: int, recompute: bool = True) -> dict[str, torch.Tensor]:
    """What the loss reads at the completion positions, `chunk` positions at a time, each
    chunk's logits [chunk, V] recomputed in the backward (activation checkpointing) instead
    of kept: the student's sampled-token log-probs `lp` (and `q` under the sampler's
    temperature, with `tempered`), and with loss.kl=full the divergence `div` and the
    logged reverse KL `kl_log`, all [B, T] and 0 outside the mask. Equal to the unchunked
    ones (`completion_logprobs` + `divergence_inputs` + `full_divergence`) up to rounding.
    `recompute=False`: the logits are kept for the backward instead (loss.pack_completions:
    one chunk of every completion position, padding-free, nothing recomputed)."""
    from torch.utils.checkpoint import checkpoint

    full_kl = loss_cfg.kl == "full"
    pos = mask_BT.nonzero()
    B, T = mask_BT.shape
    got: dict[str, list] = {"lp": [], "q": [], "div": [], "kl_log": []}
    for s0 in range(0, len(pos), chunk):
        pb, pt = pos[s0:s0 + chunk].T
        tgt = completion_ids_BT[pb, pt]

        def terms(h_CH, pb=pb, pt=pt, tgt=tgt):
            logsm_CV = torch.log_softmax(head(h_CH).float(), dim=-1)
            out = [logsm_CV.gather(-1, tgt[:, None]).squeeze(-1)]
            if tempered:
                out.append(L.tempered_logprobs(logsm_CV.detach()[:, None], tgt[:, None], temp_B[pb], top_p_B[pb])[:, 0])
            if full_kl:
                one = torch.ones(1, len(pb))
                s_1CV, t_1CV, raw_1CV = divergence_inputs(logsm_CV[None], [teacher_rows(teacher_full, pb, pt, V)],
                                                          len(pb), V, loss_cfg.teacher_temperature)
                div = L.full_divergence(s_1CV, t_1CV, one, loss_cfg.beta)[0]
                same = loss_cfg.beta == 1.0 and t_1CV is raw_1CV
                out += [div, div.detach() if same else L.full_reverse_kl(s_1CV.detach(), raw_1CV, one)[0]]
            return tuple(out)
        h_CH = h_BTH[pb, pt]
        res = list(checkpoint(terms, h_CH, use_reentrant=False) if recompute else terms(h_CH))
        got["lp"].append(res.pop(0))
        if tempered:
            got["q"].append(res.pop(0))
        if full_kl:
            got["div"].append(res.pop(0))
            got["kl_log"].append(res.pop(0).detach())
    # keeps the graph alive for a minibatch without a single loss token
    zero_BT = torch.zeros(B, T) + 0.0 * h_BTH.sum()
    want = ["lp"] + ["q"] * tempered + ["div", "kl_log"] * full_kl
    return {k: zero_BT.index_put((pos[:, 0], pos[:, 1]), torch.cat(got[k])) if got[k] else zero_BT.clone()
            for k in want}


@dataclass
class _Micro:
    """One micro-batch's share of a step: its loss (backward already run) and what the
    metrics read."""
    loss: torch.Tensor
    mask_BT: torch.Tensor
    trainer_lp_BT: torch.Tensor
    sampler_lp_BT: torch.Tensor
    kl_log_BT: torch.Tensor
    isw: L.ISWeights
    inserted_BT: torch.Tensor


def _sampling_B(sampling: list | None, off_B: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    temp_B = torch.tensor([1.0 if s is None else float(s.temperature) for s in (sampling or [None] * n)])
    top_p_B = torch.tensor([1.0 if s is None else float(s.top_p) for s in (sampling or [None] * n)])
    temp_B[off_B] = 1.0    # teacher-forced rows were not sampled
    top_p_B[off_B] = 1.0
    return temp_B, top_p_B


def _advantages(loss_cfg: LossConfig, batch: dict, trainer_lp: torch.Tensor | None, task_reward_B: torch.Tensor):
    """The advantages before the baseline, and the reward r_t; with loss.kl=full the KL
    term is exact and the advantages carry only the task reward."""
    mask = batch["mask"]
    rew = L.token_rewards(batch["teacher_lp"], trainer_lp, mask) if trainer_lp is not None else None
    adv = L.discounted_returns(rew, mask, loss_cfg.discount) if loss_cfg.kl != "full" else torch.zeros_like(mask)
    if loss_cfg.task_reward_alpha > 0:
        adv = adv + loss_cfg.task_reward_alpha * task_reward_B.unsqueeze(1) * mask
    return adv, rew


def _baseline_B(loss_cfg: LossConfig, own_2B: torch.Tensor, domain_ids_B: torch.Tensor, n_domains: int,
                reduce, dom_2D: torch.Tensor | None = None) -> torch.Tensor | None:
    """Each row's baseline from its own (advantage sum, token count) `own_2B` and the
    domains' sums over the global minibatch (`dom_2D`, else `own_2B` reduced over ranks)."""
    if loss_cfg.baseline == "none":
        return None
    onehot_BD = torch.nn.functional.one_hot(domain_ids_B, n_domains).float()
    if dom_2D is None:
        dom_2D = reduce(own_2B @ onehot_BD)
    if loss_cfg.baseline == "domain_mean":
        return onehot_BD @ (dom_2D[0] / dom_2D[1].clamp(min=1))
    return L.leave_one_out_baseline_from_sums(own_2B, dom_2D, onehot_BD)


@dataclass
class _Forward:
    lp_BT: torch.Tensor              # the student's log-probs of the sampled tokens (with gradient)
    temp_w_BT: torch.Tensor          # p / q per sampled token when the sampler was tempered, else 1
    tempered: bool
    div_BT: torch.Tensor | None      # kl=full: the divergence term per position (with gradient)
    kl_log_BT: torch.Tensor | None   # kl=full: the logged reverse KL to the unsharpened teacher


def _head_chunk(model, loss_cfg: LossConfig, mask_BT: torch.Tensor) -> int:
    """Completion positions per application of the student's output layer: loss.logits_chunk;
    else, with loss.pack_completions, all of them in one block (padding-free: no prompt or
    padding position goes through the [*, V] head, log-softmax and divergence); 0: the padded
    [B, L, V] logits, for models whose head alone does not give their logits (`output_head`)."""
    if loss_cfg.logits_chunk > 0:
        return loss_cfg.logits_chunk
    if not loss_cfg.pack_completions:
        return 0
    try:
        output_head(model)
    except ValueError:
        return 0
    return max(1, mask_BT.numel())


def _forward(model, loss_cfg: LossConfig, batch: dict, teacher_full: list, vocab, temp_B, top_p_B) -> _Forward:
    """The student's forward on one micro-batch: its sampled-token log-probs and, with
    kl=full, the divergence over the vocabulary (whole, or a chunk of positions at a time)."""
    full_kl = loss_cfg.kl == "full"
    mask = batch["mask"]
    # with kl=full the policy-gradient term carries the task reward only: nothing to correct without one
    tempered = bool(((temp_B > 0) & ((temp_B != 1.0) | (top_p_B < 1.0))).any()) and (
        not full_kl or loss_cfg.task_reward_alpha > 0)
    chunk = _head_chunk(model, loss_cfg, mask)
    div_BT = kl_log_BT = q_BT = None
    if chunk > 0:
        h_BTH, head = completion_hidden(model, batch)
        widths = [r.shape[-1] for r in teacher_full if r is not None and len(r)]
        V = vocab if vocab is not None else min([head.weight.shape[0], *widths])
        terms = chunked_terms(h_BTH, head, batch["completion_ids"], mask, teacher_full, V=V, loss_cfg=loss_cfg,
                              temp_B=temp_B, top_p_B=top_p_B, tempered=tempered, chunk=chunk,
                              recompute=loss_cfg.logits_chunk > 0)
        lp_BT = terms["lp"]
        q_BT = terms["q"] if tempered else None
        if full_kl:
            div_BT, kl_log_BT = terms["div"], terms["kl_log"]
    else:
        if full_kl or tempered:
            lp_BT, trainer_full = completion_logprobs(model, batch, full=True)
        else:
            lp_BT = completion_logprobs(model, batch)
        if tempered:
            q_BT = L.tempered_logprobs(trainer_full.detach(), batch["completion_ids"], temp_B, top_p_B)
        if full_kl:
            student_BTV, teacher_full_BTV, teacher_raw_BTV = divergence_inputs(
                trainer_full, teacher_full, mask.shape[1], vocab, loss_cfg.teacher_temperature)
            div_BT = L.full_divergence(student_BTV, teacher_full_BTV, mask, loss_cfg.beta)
            # the loss term is already that KL when it is the reverse KL to the unsharpened teacher
            kl_log_BT = (div_BT.detach() if loss_cfg.beta == 1.0 and teacher_full_BTV is teacher_raw_BTV
                         else L.full_reverse_kl(student_BTV.detach(), teacher_raw_BTV, mask))
    # p / q for each sampled token: the change of measure to the temperature-1 student
    temp_w_BT = L.temperature_weights(lp_BT, q_BT, mask) if tempered else torch.ones_like(lp_BT)
    return _Forward(lp_BT, temp_w_BT, tempered, div_BT, kl_log_BT)


def _micro_step(accelerator, model, loss_cfg: LossConfig, batch: dict, teacher_full: list, off_B, task_reward_B,
                domain_ids_B, n_domains: int, n_tok_global: float, vocab, temp_B, top_p_B,
                baseline_B: torch.Tensor | None) -> _Micro:
    """Forward, loss and backward of one micro-batch (`batch`: its collated rows).
    `baseline_B`: the rows' baselines when computed over the whole minibatch first (several
    micro-batches); None: from this batch's own advantages, reduced over ranks."""
    world = accelerator.num_processes
    mask = batch["mask"]
    f = _forward(model, loss_cfg, batch, teacher_full, vocab, temp_B, top_p_B)
    trainer_lp = f.lp_BT
    if off_B.any():  # teacher-forced rows: no sampler, no importance correction
        batch["sampler_lp"][off_B] = trainer_lp.detach()[off_B]
    ins_BT = torch.isnan(batch["sampler_lp"])   # tokens the teacher inserted (correct_below)
    if ins_BT.any():
        batch["sampler_lp"] = torch.where(ins_BT, trainer_lp.detach(), batch["sampler_lp"])
    adv, rew = _advantages(loss_cfg, batch, trainer_lp, task_reward_B)
    if baseline_B is None:
        # per-domain sums over the global minibatch, so ranks agree
        baseline_B = _baseline_B(loss_cfg, torch.stack([(adv * mask).sum(1), mask.sum(1)]), domain_ids_B, n_domains,
                                 lambda t: accelerator.reduce(t, reduction="sum"))
    if baseline_B is not None:
        adv = L.subtract_baseline(adv, mask, baseline_B)
    isw = L.importance_weights(trainer_lp, batch["sampler_lp"], mask, loss_cfg.is_truncation,
                               loss_cfg.is_mask_low, loss_cfg.is_mask_high)
    pg_w_BT = isw.weights_BT * f.temp_w_BT if f.tempered else isw.weights_BT
    loss = L.policy_gradient_loss(trainer_lp, adv, pg_w_BT, n_tok_global) * world
    # The logged reverse KL per token: exact over the vocabulary when the teacher's whole
    # distribution is at hand (the one-sample estimate -rew is biased once samples are
    # drawn below temperature 1 or corrected), against the teacher itself.
    kl_log_BT = -rew.detach()
    if f.div_BT is not None:
        kl_log_BT = f.kl_log_BT
        # weight 1 per position, never the sampled token's ratio (loss.full_kl_loss says why)
        loss = loss + L.full_kl_loss(f.div_BT, mask, n_tok_global) * world
    accelerator.backward(loss)
    return _Micro(loss.detach(), mask, trainer_lp.detach(), batch["sampler_lp"], kl_log_BT, isw, ins_BT)


def _sampled_logprobs(model, batch: dict, loss_cfg: LossConfig) -> torch.Tensor:
    """The student's log-probs of the completion tokens, [B, T] (chunked as the loss is)."""
    chunk = _head_chunk(model, loss_cfg, batch["mask"])
    if chunk <= 0:
        return completion_logprobs(model, batch)
    h_BTH, head = completion_hidden(model, batch)
    ones = torch.ones(len(batch["mask"]))
    return chunked_terms(h_BTH, head, batch["completion_ids"], batch["mask"], [], V=0, loss_cfg=loss_cfg,
                         temp_B=ones, top_p_B=ones, tempered=False, chunk=chunk,
                         recompute=loss_cfg.logits_chunk > 0)["lp"]


def _collate(prompt_ids, samples, teacher_lp, pad_id, rows) -> dict:
    # Agent transcripts: only the tokens the student wrote carry loss (observations are masked).
    return collate([prompt_ids[i] for i in rows], [samples[i].completion_ids for i in rows], pad_id,
                   {"sampler_lp": [samples[i].sampler_logprobs for i in rows],
                    "teacher_lp": [teacher_lp[i] for i in rows]},
                   token_mask=[samples[i].loss_mask for i in rows],
                   vision=[getattr(samples[i], "vision", None) for i in rows])


def _cat_BT(parts: list[torch.Tensor]) -> torch.Tensor:
    """Micro-batches' [b, T_k] tensors as one [B, max T_k] (right-padded with 0)."""
    T = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts])


def _whole_baseline(accelerator, model, loss_cfg: LossConfig, parts: list, batches: list, task_reward_B,
                    domain_ids_B, n_domains: int) -> torch.Tensor:
    """The rows' baselines over the whole minibatch when it is split into micro-batches:
    the baseline reads the advantages of every row, so a forward without gradient of each
    micro-batch gives them (the same numbers the update computes)."""
    reduce = lambda t: accelerator.reduce(t, reduction="sum")   # noqa: E731
    own_2B = torch.zeros((2, len(domain_ids_B)))
    for p, b in zip(parts, batches):
        with torch.no_grad():
            lp = _sampled_logprobs(model, b, loss_cfg) if loss_cfg.kl != "full" else None
        adv, _ = _advantages(loss_cfg, b, lp, task_reward_B[p])
        own_2B[:, p] = torch.stack([(adv * b["mask"]).sum(1), b["mask"].sum(1)])
    onehot_BD = torch.nn.functional.one_hot(domain_ids_B, n_domains).float()
    return _baseline_B(loss_cfg, own_2B, domain_ids_B, n_domains, reduce, reduce(own_2B @ onehot_BD))


def _result(micro: list, grad_norm: float, n_tok_global: float, rows: list[int]) -> StepResult:
    """One StepResult from the micro-batches' parts, whose rows are `rows` (the micro-batches'
    row lists one after the other), put back in row order."""
    if len(micro) == 1 and rows == sorted(rows):
        m = micro[0]
        return StepResult(loss=m.loss, grad_norm=grad_norm, mask_BT=m.mask_BT, trainer_lp_BT=m.trainer_lp_BT,
                          sampler_lp_BT=m.sampler_lp_BT, kl_log_BT=m.kl_log_BT, isw=m.isw,
                          inserted_BT=m.inserted_BT, n_tok_global=n_tok_global)
    back = torch.argsort(torch.tensor(rows))

    def cat(parts):
        return _cat_BT(parts)[back]
    isw = L.ISWeights(*(cat([getattr(m.isw, f) for m in micro]) for f in ("weights_BT", "keep_BT", "ratio_BT")))
    return StepResult(loss=sum(m.loss for m in micro), grad_norm=grad_norm,
                      mask_BT=cat([m.mask_BT for m in micro]), trainer_lp_BT=cat([m.trainer_lp_BT for m in micro]),
                      sampler_lp_BT=cat([m.sampler_lp_BT for m in micro]),
                      kl_log_BT=cat([m.kl_log_BT for m in micro]), isw=isw,
                      inserted_BT=cat([m.inserted_BT.to(torch.float32) for m in micro]).bool(),
                      n_tok_global=n_tok_global)


def _micro_parts(prompt_ids: list, samples: list, micro_batches: int) -> list[list[int]]:
    """The rows of each micro-batch: sorted by length (prompt + completion) and cut into
    `micro_batches` runs, so each micro-batch is padded to its own longest row, not the
    minibatch's (the gradient is a sum over rows: their grouping changes it by rounding
    only); one micro-batch: the rows in order."""
    B = len(samples)
    order = sorted(range(B), key=lambda i: len(prompt_ids[i]) + len(samples[i].completion_ids)) \
        if micro_batches > 1 else list(range(B))
    parts = [order[k * B // micro_batches:(k + 1) * B // micro_batches] for k in range(micro_batches)]
    return [p for p in parts if p] or [[]]


def train_step(accelerator, model, optimizer, scheduler, *, loss_cfg: LossConfig, grad_clip: float,
               prompt_ids: list[list[int]], samples: list, teacher_lp: list, teacher_full: list,
               off_B: torch.Tensor, task_reward_B: torch.Tensor, domain_ids_B: torch.Tensor, n_domains: int,
               pad_id: int | None, vocab: int | None = None, sampling: list | None = None,
               micro_batches: int = 1) -> StepResult:
    """One update on a minibatch: `samples[i]` answers `prompt_ids[i]`; rows with off_B
    set are teacher-forced references (no sampler, importance weight 1). `pad_id` may be
    None (a tokenizer without a pad token): masks come from lengths. `vocab`: the ids the
    tokenizer can produce (len(tokenizer)), over which kl=full takes its divergence.
    `sampling[i]`: row i's sampling settings (`.temperature`, `.top_p`; None: 1 and 1):
    the policy-gradient term is corrected from them to the temperature-1 student
    (`loss.tempered_logprobs`, the module docstring of `mopd.distill.loss`).

    `micro_batches` > 1: the rows, sorted by length, are split into that many micro-batches, each
    forward and backward alone, gradients accumulated, then one optimizer step: the same
    update as one batch (the loss is normalized by the whole minibatch's tokens, and a
    baseline that needs the whole minibatch's advantages gets them from a gradient-free
    forward of every micro-batch first)."""
    B = len(samples)
    temp_B, top_p_B = _sampling_B(sampling, off_B, B)
    parts = _micro_parts(prompt_ids, samples, micro_batches)
    batches = [_collate(prompt_ids, samples, teacher_lp, pad_id, p) for p in parts]
    # one host read for the token count (the loss's normalizer), not one per micro-batch
    n_tok = torch.stack([b["mask"].sum() for b in batches]).sum().reshape(1).float()
    n_tok_global = accelerator.reduce(n_tok, reduction="sum").item()
    baseline_B = _whole_baseline(accelerator, model, loss_cfg, parts, batches, task_reward_B, domain_ids_B,
                                 n_domains) if len(parts) > 1 and loss_cfg.baseline != "none" else None
    micro = []
    for k, (p, b) in enumerate(zip(parts, batches)):
        # DDP: gradients are all-reduced once, with the last micro-batch's backward
        sync = contextlib.nullcontext() if k == len(parts) - 1 or not hasattr(accelerator, "no_sync") \
            else accelerator.no_sync(model)
        with sync:
            micro.append(_micro_step(accelerator, model, loss_cfg, b, [teacher_full[i] for i in p], off_B[p],
                                     task_reward_B[p], domain_ids_B[p], n_domains, n_tok_global, vocab, temp_B[p],
                                     top_p_B[p], baseline_B[p] if baseline_B is not None else None))
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip) \
        if grad_clip > 0 else torch.tensor(0.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return _result(micro, float(grad_norm), n_tok_global, [i for p in parts for i in p])
