"""The command line: `localllm`'s parser and its commands."""
