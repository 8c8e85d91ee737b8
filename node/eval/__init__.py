"""Evaluation: inference with stages omitted and single-process path training."""
