"""Shared test settings: CPU, Pallas in interpret mode, bounded hypothesis runs."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=False)
settings.load_profile("ci")
