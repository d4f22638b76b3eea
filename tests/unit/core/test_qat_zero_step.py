"""The zero-step control for INT4 QAT (issue 36, item 1): a QAT checkpoint (which stores
the fake-quantized weights) loaded again with QAT on, then evaluated with no training
step, gives exactly what was evaluated when it was stored: the same logits, the same
greedy answers, the same sampler weights. Before `quantize`'s fixed-point rule the
llm-compressor convention moved ~88% of the entries on that load (Kimi's ~8%), so every
stage that trained on from a QAT checkpoint (an expert's RL after its SFT, warm-up ->
MOPD, the agent benches' warm starts) started from another model than the scored one."""
from __future__ import annotations

import pytest
import torch

from core.export import export_model
from core.models import build_student
from core.quant import CONVENTIONS, QuantConfig, apply_qat, fake_quantize, quantized_state_dict
from core.tiny import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qat_checkpoint(src, dst, quant: QuantConfig):
    """Two QAT steps from the tiny student (masters leave the grid), then the stage's
    checkpoint as every stage writes it (export_model: fake-quantized weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    apply_qat(model, quant)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(4, 200, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    export_model(model, load_tokenizer(src), dst)
    return model.eval()


def _greedy(model, ids):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_qat_checkpoint_reloaded_with_qat_is_the_evaluated_model(tiny_student_dir, tmp_path, convention):
    quant = QuantConfig(enabled=True, group_size=32, convention=convention)
    trained = _qat_checkpoint(tiny_student_dir, tmp_path / "ckpt", quant)
    ids = torch.randint(4, 200, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        scored = trained(input_ids=ids).logits          # what the stage evaluated
    plain = build_student(str(tmp_path / "ckpt")).eval()            # how evals and vLLM load it
    resumed = build_student(str(tmp_path / "ckpt"), quant=quant).eval()   # how the next stage trains on it
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, scored)
        assert torch.equal(resumed(input_ids=ids).logits, scored)
    assert torch.equal(_greedy(resumed, ids), _greedy(plain, ids))
    # the weights the next stage pushes to its sampler are the stored ones, bit for bit
    stored = plain.state_dict()
    for k, v in quantized_state_dict(resumed).items():
        assert torch.equal(v, stored[k]), k
    # and a second reload of a reload stays put (the fixed point, not a one-off)
    w = stored["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(fake_quantize(fake_quantize(w, 32, convention), 32, convention), w)
