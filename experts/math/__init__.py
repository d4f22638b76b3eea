"""The `math` domain: procedural word problems in two reasoning efforts (data.py);
reward in rewards/math.py, eval in evals/math.py."""
