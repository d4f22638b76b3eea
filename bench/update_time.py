"""CPU seconds of one MOPD update (`train_step`, loss.kl=full) with the completions packed
for the output layer (`loss.pack_completions`, the default) and on the padded logits, the
two alternating in one process on one thread: process CPU time, not wall time, so a
machine shared with other jobs still gives the work each path does.

    python -m bench.update_time --hidden 512 --layers 4 --vocab 32768 --batch 16 --length 64 \\
        --repeats 3 --out runs/bench/update_time.json

A random Qwen2-shaped Llama (bench.chunked_loss's model), `--batch` completions of
`--length` tokens after prompts of 8-24 tokens (so the padded batch has prompt padding),
the teacher's whole random distribution at every position. Writes JSON: per path the CPU
seconds of each repeat and their median, and packed / padded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, d in (("vocab", 32768), ("hidden", 512), ("layers", 4), ("batch", 16), ("length", 64), ("repeats", 3)):
        ap.add_argument(f"--{k}", type=int, default=d)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from core.rollout import Sample
    from mopd.distill.config import LossConfig
    from mopd.distill.step import SingleProcess, train_step

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=1,
                      head_dim=64, max_position_embeddings=a.length + 64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).train()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, a.vocab, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.batch)]
    comps = [torch.randint(0, a.vocab, (a.length,), generator=g).tolist() for _ in range(a.batch)]
    teacher_full = [torch.log_softmax(torch.randn(a.length, a.vocab, generator=g) * 2.0, -1) for _ in range(a.batch)]
    teacher_lp = [r.gather(-1, torch.tensor(c)[:, None]).squeeze(-1).tolist() for r, c in zip(teacher_full, comps)]
    samples = [Sample(prompt_ids=p, completion_ids=c, finished=False, sampler_logprobs=lp)
               for p, c, lp in zip(prompts, comps, teacher_lp)]
    opt = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none=True: model.zero_grad(set_to_none=True))
    cpu: dict[str, list[float]] = {"packed": [], "padded": []}
    for _ in range(a.repeats):
        for name in cpu:
            t0 = time.process_time()
            train_step(SingleProcess(), model, opt, SimpleNamespace(step=lambda: None),
                       loss_cfg=LossConfig(kl="full", pack_completions=name == "packed"), grad_clip=1.0,
                       prompt_ids=prompts, samples=samples, teacher_lp=teacher_lp, teacher_full=teacher_full,
                       off_B=torch.zeros(a.batch, dtype=torch.bool), task_reward_B=torch.zeros(a.batch),
                       domain_ids_B=torch.zeros(a.batch, dtype=torch.long), n_domains=1, pad_id=0, vocab=a.vocab)
            cpu[name].append(time.process_time() - t0)
            print(f"{name}: {cpu[name][-1]:.2f} CPU s", flush=True)
    r = {"settings": vars(a), "load_avg": os.getloadavg(), "cpu_s": cpu,
         "median_cpu_s": {k: statistics.median(v) for k, v in cpu.items()}}
    r["packed_over_padded"] = r["median_cpu_s"]["packed"] / r["median_cpu_s"]["padded"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(r, indent=1))
    print(json.dumps(r["median_cpu_s"]), f"packed / padded {r['packed_over_padded']:.3f}")
    return r


if __name__ == "__main__":
    torch.set_num_threads(1)   # one thread: CPU seconds are then the work, not the spread over cores
    main()
