"""Compute kernels, behind one interface (`localllm.kernels.ops`). Knows nothing of models.

Importing this package changes nothing in the process: the CPU kernels' cache location is scoped to their own
files (kernels/cpu/__init__.py), and their thread settings apply on first use (kernels/cpu/process_settings.py).
"""
