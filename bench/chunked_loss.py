"""Peak memory of the loss with and without chunked logits (`loss.logits_chunk`), and of the
layers with and without gradient checkpointing (`model.gradient_checkpointing`).

    python -m bench.chunked_loss --out runs/bench_chunked.json [--vocab 151936] [--batch 8] [--length 1024]
                                 [--chunk 512] [--variants unchunked chunked]
    python -m bench.chunked_loss --out runs/bench_recompute.json --vocab 2048 --hidden 256 --layers 8 \
                                 --length 512 --variants chunked recomputed

`recomputed` is `chunked` with the decoder layers recomputed in backward: its saving grows
with the layers, not with the vocabulary. Every variant is compared with the first listed.

`--teacher model`: the teacher is a one-layer Llama of the same vocabulary (an hf teacher,
`teachers.scoring.HFTeacher`) scored through the loop's router inside the measured step,
so the peak includes the teacher's side: its whole [length, V] rows unchunked, its hidden
states and head (`HeadRows`, made into rows a chunk at a time) chunked. `--teacher rows`
(default): fixed random rows given to the step, held before it (not in the peak).

One `train_step` with loss.kl=full (reverse KL) on a one-layer Llama whose vocabulary is
`--vocab` (Qwen's 151,936 by default), on `--batch` completions of `--length` tokens, the
teacher's whole distribution given at every position (as an hf teacher returns it). Each
variant runs in its own process; its peak is the growth of the process's resident memory
(VmHWM, reset just before the step) over what it held before the step: the model, the
batch and the teacher's rows, which both variants hold alike. Both variants write their
loss and gradients, and the parent compares them. Writes JSON: per variant peak_mb and
loss, max_loss_diff, max_grad_diff, peak_ratio (chunked / unchunked).

At the default size the unchunked step needs several [8, 1024, 151936] float32 tensors
(5.0 GB each); on a machine without that memory run the unchunked variant at a shorter
--length: its peak grows linearly with batch x length, the chunked one's does not.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class _Keep:
    """An optimizer that keeps the gradients (no update)."""

    def __init__(self, params):
        self.params = list(params)
        self.grads = None

    def step(self):
        self.grads = [p.grad.detach().clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _teacher_router(cfg, chunk: int, batch: int):
    """An hf teacher (a random model of the student's shape, its own seed) behind the loop's
    router, giving HeadRows when `chunk` > 0."""
    from transformers import AutoModelForCausalLM

    from teachers.routing import TeacherRouter
    from teachers.scoring import HFTeacher

    torch.manual_seed(7)
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        return TeacherRouter({"t": HFTeacher(folder, device="cpu", batch_size=batch)}, logits_chunk=chunk)


def run_variant(vocab: int, batch: int, length: int, chunk: int, out: Path, *, hidden: int = 64, layers: int = 1,
                recompute: bool = False, teacher: str = "rows", packed: bool = False) -> dict:
    """One step in this process; its loss and gradients go to `out` (torch.save)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mopd.distill.config import LossConfig
    from mopd.distill.step import SingleProcess, _sampled_logprobs, train_step
    from core.models import collate
    from core.rollout import Sample

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=length + 64,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()   # HF recomputes layers only in train mode (the trainer's, as in `build_student`)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(batch)]
    comps = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]
    router = _teacher_router(cfg, chunk, batch) if teacher == "model" else None
    if router is None:   # the teacher's rows, [length, vocab] each: a fixed random distribution per position
        teacher_full = [torch.log_softmax(torch.randn(length, vocab, generator=g) * 2.0, -1) for _ in range(batch)]
        teacher_lp = [r.gather(-1, torch.tensor(c)[:, None]).squeeze(-1).tolist() for r, c in zip(teacher_full, comps)]
    with torch.no_grad():   # the sampler's log-probs = the trainer's (importance weight 1), computed chunked
        b = collate(prompts, comps, 0, {})
        own = _sampled_logprobs(model, b, LossConfig(logits_chunk=512))
    samples = [Sample(prompt_ids=p, completion_ids=c, finished=False, sampler_logprobs=own[i].tolist())
               for i, (p, c) in enumerate(zip(prompts, comps))]
    del b, own
    opt = _Keep(model.parameters())
    before = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    if router is not None:   # the teacher's side, inside the measured step
        teacher_lp, teacher_full = [None] * batch, [None] * batch
        router.score([SimpleNamespace(ids=p, teacher_key="t") for p in prompts], samples, range(batch), True,
                     teacher_lp, teacher_full)
    t0 = time.perf_counter()
    res = train_step(SingleProcess(), model, opt, SimpleNamespace(step=lambda: None),
                     loss_cfg=LossConfig(kl="full", logits_chunk=chunk, pack_completions=packed), grad_clip=0.0,
                     prompt_ids=prompts,
                     samples=samples, teacher_lp=teacher_lp, teacher_full=teacher_full,
                     off_B=torch.zeros(batch, dtype=torch.bool), task_reward_B=torch.zeros(batch),
                     domain_ids_B=torch.zeros(batch, dtype=torch.long), n_domains=1, pad_id=0, vocab=vocab)
    step_s = time.perf_counter() - t0
    peak = _rss_kb("VmHWM")
    torch.save({"loss": float(res.loss), "grads": opt.grads}, out)
    return {"peak_mb": (peak - before) / 1024, "held_before_mb": before / 1024, "loss": float(res.loss),
            "step_s": step_s}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512, help="loss.logits_chunk of the chunked variant")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["unchunked", "chunked"],
                    choices=["unchunked", "packed", "chunked", "recomputed"],
                    help="unchunked: the padded [B, L, V] logits (loss.pack_completions=false); packed: the "
                         "completion tokens' logits only, all at once (the default since issue 37)")
    ap.add_argument("--teacher", choices=["rows", "model"], default="rows",
                    help="model: an hf teacher scored inside the measured step (its side in the peak)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--_child", nargs=3, metavar=("CHUNK", "RECOMPUTE", "FILE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        r = run_variant(a.vocab, a.batch, a.length, int(a._child[0]), Path(a._child[2]), hidden=a.hidden,
                        layers=a.layers, recompute=a._child[1] == "1", teacher=a.teacher, packed=a._child[1] == "p")
        Path(a.out).write_text(json.dumps(r))
        return r
    result: dict = {"vocab": a.vocab, "batch": a.batch, "length": a.length, "chunk": a.chunk, "hidden": a.hidden,
                    "layers": a.layers, "teacher": a.teacher}
    with tempfile.TemporaryDirectory() as tmp:
        for v in a.variants:
            f, j = Path(tmp) / f"{v}.pt", Path(tmp) / f"{v}.json"
            cmd = [sys.executable, "-m", "bench.chunked_loss", "--vocab", str(a.vocab), "--batch", str(a.batch),
                   "--length", str(a.length), "--hidden", str(a.hidden), "--layers", str(a.layers), "--out", str(j),
                   "--teacher", a.teacher,
                   "--_child", str(0 if v in ("unchunked", "packed") else a.chunk),
                   {"recomputed": "1", "packed": "p"}.get(v, "0"), str(f)]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if p.returncode != 0:
                raise SystemExit(f"{v} variant failed ({p.returncode}):\n{p.stderr[-3000:]}")
            result[v] = json.loads(j.read_text())
            print(f"{v:>10}: peak {result[v]['peak_mb']:9.1f} MB above {result[v]['held_before_mb']:8.1f} MB held, "
                  f"loss {result[v]['loss']:.6f}, step {result[v]['step_s']:.2f} s", flush=True)
        first = a.variants[0]
        for v in a.variants[1:]:   # each against the first: the same loss and gradients, its share of the peak
            u, c = torch.load(Path(tmp) / f"{first}.pt"), torch.load(Path(tmp) / f"{v}.pt")
            result["max_loss_diff"] = max(result.get("max_loss_diff", 0.0), abs(u["loss"] - c["loss"]))
            result["max_grad_diff"] = max(result.get("max_grad_diff", 0.0), max(
                (x - y).abs().max().item() for x, y in zip(u["grads"], c["grads"])))
            result[f"peak_ratio/{v}"] = result[v]["peak_mb"] / max(result[first]["peak_mb"], 1e-9)
            print(f"{v} against {first}: loss diff {result['max_loss_diff']:.2e}, grad diff "
                  f"{result['max_grad_diff']:.2e}, peak ratio {result[f'peak_ratio/{v}']:.3f}")
        if a.variants[:2] == ["unchunked", "chunked"]:
            result["peak_ratio"] = result["peak_ratio/chunked"]   # the key earlier results pages quote
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
