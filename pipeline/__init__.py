"""The generic actor runtime: shared-memory rings, actors, supervisor, clocks. Knows nothing of LLMs."""
