"""Shared test settings: CPU and Pallas interpret mode unless ``--gpu``; bounded
hypothesis runs; a persistent XLA compilation cache in ``.jax_cache/``; XLA:CPU's
elemental fusion emitters (faster to compile); jax's caches dropped when a worker
nears the kernel's memory-map limit.

``pytest --gpu`` (on a machine with a CUDA GPU) runs the device tests
(``tests/test_device.py`` and the kernel tests) compiled, not interpreted, at
device shapes; ``experiments/gpu_check.py`` runs them that way first.
"""

import gc
import importlib.metadata
import os
import sys

import numpy as np
import pytest
from hypothesis import settings

# The suite's XLA:CPU codegen (see pytest_configure).
CPU_CODEGEN_FLAG = "--xla_cpu_use_fusion_emitters=false"

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=False)
settings.load_profile("ci")


def pytest_addoption(parser):
  parser.addoption("--gpu", action="store_true", default=False,
                   help="run the device tests compiled on the GPU at device shapes")
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run the tests marked slow (CI does: .ci/run)")


def pytest_configure(config):
  # The slow tier: long soaks, the runners' and the engine processes' end-to-end runs
  # in subprocesses (their library paths are tested in-process here), and the less
  # central variants of parametrized tests (each keeps its main ones here: the
  # audit's GPU default and fused step, parity on SmolLM2 for Quest, DSA and NSA).
  # Out of the default run to keep it short; CI runs it after the default run
  # (.ci/run) and in its jax 0.11 stage.
  config.addinivalue_line("markers", "slow: the slow tier; skipped unless --runslow")
  if not config.getoption("--gpu"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # XLA's persistent compilation cache: the workers and the runners' subprocesses
    # compile many identical functions (the same engine in two handoff processes,
    # the same SmolLM2 steps in several CLIs). Set before anything imports jax;
    # inherited by subprocesses. In the checkout (ignored by git), so a fresh clone
    # starts cold and the suite's time stays honest.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(root, ".jax_cache"))
    # Every compile, small ones too: the runners' subprocesses repeat dozens of
    # 0.1-0.5 s ones (serve_sweep's smoke: 22 s -> 19 s with a warm cache).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # XLA:CPU's elemental IR emitters for fusions, not its MLIR fusion emitters: the
    # suite is compile-bound (3/4 of a test's time is XLA's backend compile) and this
    # cut it from 910 s to 700 s on the 2-core CI machine, every bit-equality test
    # passing. It changes how a fusion is emitted, not which ops are fused. Inherited
    # by the runners' subprocesses; the parity runner's and the main job's smokes run
    # on the default emitters (tests.util.default_codegen_env). Set the flag yourself
    # to override.
    # XLA >= 0.11 has no such flag (and aborts on an unknown one): the MLIR
    # emitters are all it has there.
    flags = os.environ.get("XLA_FLAGS", "")
    if (CPU_CODEGEN_FLAG.split("=")[0] not in flags
        and _version(importlib.metadata.version("jaxlib")) < (0, 11)):
      os.environ["XLA_FLAGS"] = f"{flags} {CPU_CODEGEN_FLAG}".strip()


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in text.split(".")[:2])


# The heaviest files first (by their seconds on the 2-core CI machine, 2026-12-01),
# so that under ``-n 2 --dist worksteal`` the light tests are what is left to steal
# at the end, not one long test running alone (longest-processing-time-first).
HEAVY_FILES_FIRST = ("test_backends_parity.py", "test_experiments.py",
                     "test_backends.py", "test_serving_model.py", "test_decode.py",
                     "test_draft_head.py", "test_experiments_serving.py",
                     "test_handoff.py", "test_router.py")


def _heaviness(item):
  name = os.path.basename(str(item.fspath))
  return HEAVY_FILES_FIRST.index(name) if name in HEAVY_FILES_FIRST else len(
      HEAVY_FILES_FIRST)


def _max_map_count() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):  # not Linux
    return None


MAX_MAP_COUNT = _max_map_count()


def pytest_runtest_teardown(item, nextitem):
  """Drop jax's compiled executables once a worker holds half the kernel's memory-map
  limit. XLA:CPU maps ~18 regions per executable and jax keeps every one it compiled;
  a worker of the jax 0.11 stage (both tiers in one run) reached the 65,530 maps of
  ``vm.max_map_count`` and segfaulted in XLA's next compile or cache read
  (2026-12-06; WORKSPACE_NOTES, thirty-second session). Between tests only, so a
  test's own compile counts are untouched."""
  if MAX_MAP_COUNT is None or "jax" not in sys.modules:
    return
  with open("/proc/self/maps", "rb") as f:
    maps = f.read().count(b"\n")
  if maps > MAX_MAP_COUNT // 2:
    sys.modules["jax"].clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
  items.sort(key=_heaviness)  # stable: a file's own tests keep their order
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow tier: run with --runslow (CI does)")
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


@pytest.fixture(scope="module")
def model_and_prompt():
  """SmolLM2 (real weights) and 360 tokens of the pydoc text (the backend tests)."""
  from models import text
  from tests.util import smollm2_or_skip
  model, tokenizer = smollm2_or_skip()
  ids = text.tokenize_prompt(tokenizer, text.load_text(), 360, offset=3000)
  return model, np.asarray(ids, np.int32)

