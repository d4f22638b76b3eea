"""mopd: multi-teacher on-policy distillation."""
__version__ = "0.1.0"
