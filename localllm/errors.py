"""User-facing errors.

Anything raised as a `LocalLLMError` is a problem with the user's input or environment (a corrupt file, an
unknown model, a prompt that does not fit). Front ends print its message and exit non-zero; they never show a
traceback for it. Everything else is a bug and keeps its traceback.
"""


class LocalLLMError(Exception):
    """An error whose message is meant for the user."""


class ModelFileError(LocalLLMError):
    """A model file is missing, corrupt, truncated or of a kind we cannot run."""


class UnknownModelError(LocalLLMError):
    """A model name that is neither in the catalog nor a path to a file."""


class DownloadError(LocalLLMError):
    """Every source of a model failed, or the download could not be verified."""


class OfflineError(DownloadError):
    """A download was needed but the network is off (--offline, LOCALLLM_OFFLINE or HF_HUB_OFFLINE)."""


class ContextOverflowError(LocalLLMError):
    """A prompt does not fit in the context window."""
