"""The edge: the OpenAI-compatible HTTP API in front of the nodes."""
