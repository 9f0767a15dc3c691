"""Thin absl runners, one per table (see the README's experiment list).

Without an NVIDIA driver the runners use the CPU quietly: the CUDA plugin (the
``audit`` extra) otherwise prints an initialisation traceback on every start.
"""

import os

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/proc/driver/nvidia"):
  os.environ["JAX_PLATFORMS"] = "cpu"
