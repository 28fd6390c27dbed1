"""Workloads and metrics behind ``expeditor bench`` (pure Python: no torch, no transformers)."""
