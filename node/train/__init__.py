"""Training: the model and its stages, data, the stage runtime, averaging, checkpoints and the trainer."""
