"""What the stage tasks share: cache keys, retry policy, crash points, progress, tracing, reporting,
result storage, the run's process-local resources."""
