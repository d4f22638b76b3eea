"""The `frontend` domain: procedural page specifications answered with one HTML document
(data.py); reward in rewards/frontend.py (rendered in headless Chromium, rewards/browser.py),
eval in evals/frontend.py (with a screenshot of every scored page)."""
