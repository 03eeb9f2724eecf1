"""Training runs: data, the training engine, run directories and configurations, and the model a run
builds (checkpoint files are ``amod.checkpoint``)."""
