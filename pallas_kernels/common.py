"""The one place that knows which Pallas backend runs where.

* CPU (CI): every kernel runs with ``interpret=True``.
* CUDA GPU: the Pallas **Triton** backend. In jax 0.10.2 ``pallas_call`` defaults to
  Mosaic GPU, which cannot yet express the vector gathers/scatters, ``cumsum`` and
  masked loads these kernels need (docs/DESIGN.md, "Kernels"), so we always pass
  ``triton_params``. Triton is deprecated from jax 0.11 on; WORKSPACE_NOTES.md tracks
  the re-check of Mosaic GPU.

``impl`` strings accepted by every dispatching op: ``"xla"`` (the pure-jnp reference,
available everywhere), ``"pallas"`` (the kernel; interpreted on CPU) and ``"auto"``
(on a GPU whichever of the two measured faster there, ``GPU_AUTO``; XLA elsewhere).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import pathlib

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

IMPLS = ("auto", "xla", "pallas")

# Bits of the status word of a decode step (a refused step says why; the fused
# RESOLVE kernel computes them in-kernel).
STATUS_OUT_OF_RANGE = 1
STATUS_DUPLICATE = 2
STATUS_CAPACITY = 4


def check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"{impl=} must be one of {IMPLS}")


_TRACING_FOR_GPU = contextvars.ContextVar("tracing_for_gpu", default=False)


def on_gpu() -> bool:
  """True on a GPU, or while tracing for one without it (``tracing_for_gpu``)."""
  return _TRACING_FOR_GPU.get() or jax.default_backend() == "gpu"


@contextlib.contextmanager
def tracing_for_gpu():
  """Pick the GPU's code paths while tracing on a machine without one: a
  deviceless compile for an H200 must see what a GPU run traces, not the CPU's
  choices. Build fresh ``jax.jit``s inside it: jit caches traces by function and
  arguments, not by this context, so a trace cached outside is reused inside,
  and one made inside is reused outside."""
  token = _TRACING_FOR_GPU.set(True)
  try:
    yield
  finally:
    _TRACING_FOR_GPU.reset(token)


# What "auto" picks on a GPU, per op: the faster of kernel and XLA as measured on an
# H200 by experiments/gpu_check.py (table and date in WORKSPACE_NOTES.md).
GPU_AUTO = {"resolve": "xla", "attention": "pallas", "fetch": "pallas"}


def use_kernel(impl: str, op: str) -> bool:
  """True when ``impl`` selects the Pallas kernel of ``op`` on this backend."""
  check_impl(impl)
  if impl == "auto":
    return on_gpu() and GPU_AUTO[op] == "pallas"
  return impl == "pallas"


def interpret_mode() -> bool:
  """Pallas kernels run interpreted everywhere except on a GPU."""
  return not on_gpu()


def triton_params(num_warps: int = 4, num_stages: int = 1):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_slots(num_slots: int, num_sel: int) -> None:
  """B >= k: with fewer slots two selected positions would share one (the kernels
  would also read scratch lanes they never wrote)."""
  if num_slots < num_sel:
    raise ValueError(f"B={num_slots} hot slots cannot serve k={num_sel} selected "
                     "positions in one step: B must be >= k")


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


cdiv = pl.cdiv


def cache_dir() -> pathlib.Path:
  """Where built artefacts are kept (the model load cache, the native CPU call):
  ``$KVTIER_JAX_CACHE``, else ``$XDG_CACHE_HOME/kvtier-jax``, else ~/.cache/kvtier-jax."""
  if os.environ.get("KVTIER_JAX_CACHE"):
    return pathlib.Path(os.environ["KVTIER_JAX_CACHE"])
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "kvtier-jax"
