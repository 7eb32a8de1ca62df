"""The LLM engine as stages: the request vocabulary (api), the rings and their codecs (rings),
the four actors (actors), scheduling and KV blocks, the torch-free text side (text), and the
engine client the server process owns (engine)."""
