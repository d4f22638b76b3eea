"""The `code` domain: procedural "write a small Python function" tasks and HumanEval
(data.py); reward in rewards/code.py (sandboxed tests, rewards/sandbox.py), eval in
evals/code.py."""
