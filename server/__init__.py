"""The Quart front end: OpenAI schemas, routes, SSE streaming, errors, metrics. Never imports torch."""
