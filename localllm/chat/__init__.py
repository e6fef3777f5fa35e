"""Turning a conversation into tokens and tokens back into answers: templates, sampling, grammars, tool calls, stop strings."""
