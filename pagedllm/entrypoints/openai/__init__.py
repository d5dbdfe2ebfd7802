"""The OpenAI-compatible HTTP server: its app, request/response schemas and Prometheus metrics."""
