"""The `agent` domain: multi-turn tool use over BFCL's stateful simulators. Procedural task
families with a horizon knob, oracle episodes and BFCL's multi-turn tasks (data.py); the
environment and the reward in rewards/agent.py; the expert's SFT/RL loop (data.py's
TRAINER, experts/agent_expert.py); the eval in evals/agent.py."""
