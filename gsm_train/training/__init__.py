"""Training: trainer, session, stages, backends, checkpoints, guards, the run folder and log, batches."""
