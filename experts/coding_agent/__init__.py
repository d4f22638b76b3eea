"""The `coding_agent` domain: fix bugs in a small workspace with file tools and a test
runner, hidden tests decide. Procedural tasks and HumanEval with injected bugs (data.py,
humaneval.py); the environment and the reward in rewards/coding_agent.py, the per-episode
sandbox in rewards/workspace.py; the expert's SFT/RL loop (data.py's TRAINER,
experts/agent_expert.py); the eval in evals/coding_agent.py."""
