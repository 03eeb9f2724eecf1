"""Training runs: data, the training engine, run directories and configurations, checkpoints, and the
model a run builds."""
