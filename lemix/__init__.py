"""LeMix: co-located LLM serving and continuous retraining under one scheduler."""

__version__ = "0.1.0"
