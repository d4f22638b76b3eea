"""The `chat` domain: helpful on-topic answers and refusals of unsafe requests (data.py),
RL against a reward model trained with TRL's RewardTrainer (train_rm.py); reward in
rewards/chat.py, eval in evals/chat.py."""
