"""Shared test settings: CPU and Pallas interpret mode unless ``--gpu``; bounded
hypothesis runs; a persistent XLA compilation cache in ``.jax_cache/``.

``pytest --gpu`` (on a machine with a CUDA GPU) runs the device tests
(``tests/test_device.py`` and the kernel tests) compiled, not interpreted, at
device shapes; ``experiments/gpu_check.py`` runs them that way first.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=False)
settings.load_profile("ci")


def pytest_addoption(parser):
  parser.addoption("--gpu", action="store_true", default=False,
                   help="run the device tests compiled on the GPU at device shapes")
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run the tests marked slow (long soaks)")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long; skipped unless --runslow")
  if not config.getoption("--gpu"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # XLA's persistent compilation cache: the workers and the runners' subprocesses
    # compile many identical functions (the same engine in two handoff processes,
    # the same SmolLM2 steps in several CLIs). Set before anything imports jax;
    # inherited by subprocesses. In the checkout (ignored by git), so a fresh clone
    # starts cold and the suite's time stays honest.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(root, ".jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow: run with --runslow")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def on_gpu(request) -> bool:
  """True under ``--gpu``: kernels compiled (interpret=False), device shapes."""
  if not request.config.getoption("--gpu"):
    return False
  import jax
  if jax.default_backend() != "gpu":
    pytest.exit("--gpu needs a CUDA GPU", returncode=2)
  return True
