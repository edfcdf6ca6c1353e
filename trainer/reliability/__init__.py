"""What keeps a job safe: checkpoints and resume, non-finite and replica guards, exits, injected faults."""
