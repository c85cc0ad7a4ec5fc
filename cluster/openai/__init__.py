"""The OpenAI-compatible HTTP wing: routes, the adapter, wire helpers, protocol models."""
