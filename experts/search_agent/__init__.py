"""The `search_agent` domain: multi-hop questions over a seeded local corpus, answered with
search (BM25, the bm25s library) and open. Worlds, tasks, oracle episodes (data.py); the
environment and the exact-match reward in rewards/search_agent.py; the expert's SFT/RL
loop (data.py's TRAINER: experts/agent_expert.py on this domain's environment); the eval in
evals/search_agent.py."""
