"""OpenAI-compatible HTTP server, Prometheus metrics and the live KV-cache dashboard."""
