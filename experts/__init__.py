"""Domain experts: one folder per domain (`experts/<domain>/data.py`, ...).
The contract every domain follows is in experts/README.md."""
