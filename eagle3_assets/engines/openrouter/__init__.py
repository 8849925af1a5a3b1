"""The ``openrouter`` engine: OpenRouter's OpenAI-compatible chat completions (text, no ids), when the local box is too slow."""
