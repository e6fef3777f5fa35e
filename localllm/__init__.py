"""localllm: a local, single-user LLM runner."""

__version__ = "0.1.0"
