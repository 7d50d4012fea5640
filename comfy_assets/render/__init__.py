"""Rendering jobs: one attempt, the batch, backoff, the results table, costs."""
