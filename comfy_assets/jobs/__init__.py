"""Job files: the model, strict parsing, the workflow cache; job states and events."""
