"""The core both the scheduler and speculation build on: requests and sequences,
per-row sampling, the batched per-row cache, and model loading."""
