"""The reference backend: every op of the table (interface.py `OPS`) run by the base class's fallback, the numpy
reference of kernels/reference.py on host arrays. Slow (float64 products over weights dequantized once) and
obviously right: the oracle a new backend's ops, or a new op, are checked against, and proof that the fallback
covers the whole forward (tests/test_backend_reference.py). Not a `--device`: no user runs a model on it."""

from __future__ import annotations

from localllm.backends.interface import Backend


class ReferenceBackend(Backend):
    name = "reference"
    device_label = "numpy reference"
