"""Running a model: the engine, its KV cache, prompt-cache reuse, speculation, sessions, warm-up."""
