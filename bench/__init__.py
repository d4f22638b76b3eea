"""Benchmarks: speed, memory and numerics targets, each a script that writes JSON
(`python -m bench.<name> --out DIR`). Tests never assert on them."""
