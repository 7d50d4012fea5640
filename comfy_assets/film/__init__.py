"""Films: the gate, shots from the store, media probing, concat, slates, contact sheets."""
