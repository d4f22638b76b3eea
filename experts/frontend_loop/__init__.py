"""The `frontend_loop` agent domain: the frontend domain's page tasks played as episodes
(write, see the render report, revise). Data and the scripted revise episodes here; the
environment and reward in rewards/frontend_loop.py; the eval in evals/frontend_loop.py."""
