"""The ground layer: config loading, tracking, models, quantization, export, rollouts,
agent episodes and the harness. It imports nothing else of the project."""
