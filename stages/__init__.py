"""The four stage actors (render, schedule, execute, detokenize) and the messages they exchange."""
