"""The run's plumbing: storage, checkpoints, multi-process start-up, preemption, metrics,
fingerprints and the compilation cache."""
