"""The OpenAI formats: answers and SSE events in each API, usage, and Responses ⇄ chat translation."""
