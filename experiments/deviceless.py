"""Compile jitted functions for an H200 on a machine without a GPU.

Lowering happens against this machine's CPU devices with
``lowering_platforms=("cuda",)`` (so ``pinned_host`` memory kinds survive in the
avals), then the StableHLO is compiled by a compile-only CUDA client built from
``h200_target_config.txtpb``. Needs the CUDA plugin and PJRT of the same version as
jaxlib: ``jax-cuda12-*`` 0.10.2 (``pip install -e .[audit]``) or ``jax-cuda13-*``
0.11.2 (constraints-jax011.txt, CI's second stage); no GPU, no driver.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import tempfile

import jax
from jax._src.lib import xla_client as xc
from jax.experimental import topologies

from pallas_kernels import common

TARGET_CONFIG = pathlib.Path(__file__).with_name("h200_target_config.txtpb")


def available() -> bool:
  """True when a compile-only CUDA client can be built here."""
  try:
    _h200_devices()
    return True
  except Exception:  # noqa: BLE001 - any failure means "not available"
    return False


@functools.cache
def _h200_devices():
  topo = topologies.get_topology_desc(
      platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x1x1")
  return tuple(topo.devices)


@functools.cache
def h200_node(num_devices: int = 8):
  """The devices of one compile-only node of ``num_devices`` H200s (a mesh built
  on them compiles SPMD-partitioned with ``Lowered.compile``)."""
  topo = topologies.get_topology_desc(
      platform="cuda", target_config=TARGET_CONFIG.read_text(),
      topology=f"1x1x{num_devices}")
  return tuple(topo.devices)


def lower_for_cuda(fn, *args, **kwargs):
  """``jax.jit``-lower ``fn`` for CUDA (no compile). ``fn`` may already be jitted."""
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  # jax >= 0.11 keys the kernels' target on the trace; the library's own
  # backend choices (``common.on_gpu``) must be the GPU's too.
  with h200_lowering(), common.tracing_for_gpu():
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def h200_lowering():
  """A context in which Pallas Triton kernels lower for an H200 (sm_90) without a
  GPU. jax <= 0.10 falls back to sm_90 by itself; jax >= 0.11 reads the target
  off the abstract mesh's device ("please specify an abstract GPU device"), set
  while tracing and lowering."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                       platform="gpu")
  try:
    mesh = jax.sharding.AbstractMesh((1,), ("h200",), (jax.sharding.AxisType.Auto,),
                                     abstract_device=device)
  except TypeError:  # jax <= 0.10: no abstract device (and none needed)
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh)


# XLA:GPU debug options the audit compiles with, as a GPU run should set them
# (XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true): without the
# latency-hiding scheduler an async HostExecute fetch is awaited right away.
GPU_OPTIONS = (("xla_gpu_enable_latency_hiding_scheduler", True),)


def compile_for_h200(lowered, options=GPU_OPTIONS) -> str:
  """Optimized XLA:GPU HLO text of a CUDA-lowered computation, for an H200."""
  return _compile(lowered, options)


def thunk_sequence(lowered, options=GPU_OPTIONS) -> str:
  """The executable's thunk sequence after XLA's thunk passes, as text: what the GPU
  runtime launches, command buffers (CUDA graphs) included, which the optimized HLO
  does not show (they are formed from thunks)."""
  with tempfile.TemporaryDirectory() as dump:
    _compile(lowered, tuple(options) + (("xla_dump_to", dump),))
    # XLA writes the sequence after its thunk passes only when they changed it (no
    # command buffer formed: the sequence as emitted is what runs).
    found = (sorted(pathlib.Path(dump).glob("*thunk_sequence_after_thunk_passes.txt"))
             or sorted(pathlib.Path(dump).glob("*thunk_sequence.txt")))
    if not found:
      raise RuntimeError("XLA wrote no thunk sequence (xla_dump_to)")
    return found[-1].read_text()


def _compile(lowered, options) -> str:
  devices = _h200_devices()
  compile_options = xc.CompileOptions()
  build = compile_options.executable_build_options
  build.num_replicas = 1
  build.num_partitions = 1
  compile_options.env_option_overrides = list(options)
  executable = devices[0].client.compile(
      lowered.compiler_ir("stablehlo"),
      executable_devices=xc.DeviceList(devices), compile_options=compile_options)
  return "\n".join(m.to_string() for m in executable.hlo_modules())
