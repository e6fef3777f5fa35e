"""The model catalog's data: one `NAME.toml` file per known model (read by `localllm.store.catalog`).

Adding a model is adding a file here: name, description, architecture, size, sha256, and its sources in order
of preference (the Hugging Face hub, then mirrors).
"""
