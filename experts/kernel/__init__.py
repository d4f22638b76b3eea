"""The `kernel` domain: "make this PyTorch op fast" tasks with naive references and
one-line expert kernels (data.py); reward in rewards/kernel.py (correctness on fresh
inputs, speed against the reference and the expert, cheats caught), eval in evals/kernel.py."""
