"""Multi-turn agents: the harness (tools, call syntax, prompt, context, memory; data chosen in
YAML), the environment protocol and `ToolEnv` over a domain's tool backend, and the episode
runner that continues the exact sampled token sequence turn after turn.

Import the submodules (`core.agent.harness`, `core.agent.env`, ...); this package imports
nothing heavy.
"""
