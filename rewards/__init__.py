"""Rewards, one module per domain (`rewards/<domain>.py`), each with TRL's signature
`reward(prompts, completions, **columns) -> list[float | None]`: scores in [0, 1],
`None` for rows of another domain. See experts/README.md for the contract."""
