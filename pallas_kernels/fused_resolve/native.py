"""The fused layer step as one native XLA FFI call on the CPU (``native_cpu.cc``).

Same contract as ``reference.resolve_fetch_reference`` and the Pallas kernels
(``kernel.resolve_fetch``), the cache updated in place: one call per layer where
XLA:CPU would run ~140 small ops (the XLA RESOLVE) or the Pallas kernels'
interpreted loops. The CPU's counterpart of SGLang's fused CUDA RESOLVE.

The C++ source is compiled on first use with the system's C++ compiler (``$CXX``,
else ``c++``) against the XLA FFI headers jaxlib ships, into ``cache_dir()`` keyed
by the source, the flags, the jaxlib version and the architecture; ``available()``
says whether that worked (no compiler: False, and the callers keep the Pallas
kernels).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels import common
from pallas_kernels.fused_resolve.kernel import victim_order
from pallas_kernels.fused_resolve.reference import (CacheArrays, LayerResult,
                                                    check_share, check_victim_inputs)

_SOURCE = pathlib.Path(__file__).with_name("native_cpu.cc")
_TARGET = "kvtier_resolve_fetch"
# -ffp-contract=off: no contraction the source does not write (its one FMA is explicit).
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
_BUILD_TIMEOUT_S = 300
# Libraries of other sources (older checkouts, other jaxlibs) kept in the cache
# beside a new build: the most recently loaded ones.
_KEEP_LIBRARIES = 8
# The call's ``keyed`` attribute: LRU, or a keyed policy whose score EMA rounds
# once (an FMA, as XLA:CPU contracts it on FMA hosts) or twice.
_LRU, _KEYED_ONE_ROUNDING, _KEYED_TWO_ROUNDINGS = 0, 1, 2


def _compiler() -> list[str] | None:
  """``$CXX`` (a command, possibly with arguments: ``ccache g++``), else ``c++``."""
  command = shlex.split(os.environ.get("CXX", "c++"))
  path = shutil.which(command[0]) if command else None
  return None if path is None else [path, *command[1:]]


def library_path() -> pathlib.Path:
  """Where the library built from this source, with these flags, for this jaxlib
  and this machine's architecture lives."""
  key = hashlib.sha256(_SOURCE.read_bytes())
  key.update(" ".join(_FLAGS).encode() + jaxlib.__version__.encode()
             + platform.machine().encode())
  return common.cache_dir() / "native" / f"fused_resolve-{key.hexdigest()[:16]}.so"


def _build(path: pathlib.Path, compiler: list[str]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # pytest workers: one compiles, the rest wait
    if path.exists():
      return
    # A build of this library killed mid-compile left its directory: with the lock
    # held, no one else is building it.
    prefix = f"{path.stem}-build-"
    for orphan in path.parent.glob(f"{prefix}*"):
      shutil.rmtree(orphan, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=path.parent) as tmp:
      out = pathlib.Path(tmp) / path.name
      subprocess.run([*compiler, *_FLAGS, "-isystem", jax.ffi.include_dir(),
                      str(_SOURCE), "-o", str(out)], check=True, capture_output=True,
                     text=True, timeout=_BUILD_TIMEOUT_S)
      os.replace(out, path)
    _prune_other_libraries(path)


def _prune_other_libraries(path: pathlib.Path) -> None:
  """Removes all but the ``_KEEP_LIBRARIES`` most recently loaded libraries of
  other sources (each load touches its file). A process that has one loaded keeps
  it (POSIX unlinks a mapped file lazily); a checkout that loads one again later
  builds it again."""
  def loaded_at(p: pathlib.Path) -> float:
    try:
      return p.stat().st_mtime
    except OSError:  # removed meanwhile (another checkout pruning)
      return float("inf")
  others = sorted((p for p in path.parent.glob("fused_resolve-*.so") if p != path),
                  key=loaded_at, reverse=True)
  for stale in others[_KEEP_LIBRARIES:]:
    try:
      stale.unlink(missing_ok=True)
      stale.with_suffix(".lock").unlink(missing_ok=True)
    except OSError:  # not ours to remove (permissions): the cache just keeps it
      pass


@functools.cache
def _load() -> str | None:
  """Build (once per machine) and register the call; None, or why it failed."""
  if jax.default_backend() != "cpu":
    return f"the call is the CPU's; this backend is {jax.default_backend()}"
  compiler = _compiler()
  if compiler is None:
    return "no C++ compiler ($CXX or c++) on PATH"
  try:
    path = library_path()
    if not path.exists():
      _build(path, compiler)
    try:
      symbol = ctypes.cdll.LoadLibrary(str(path)).KvtierResolveFetch
    except (OSError, AttributeError):  # a truncated or foreign file: build it again
      path.unlink(missing_ok=True)
      _build(path, compiler)
      symbol = ctypes.cdll.LoadLibrary(str(path)).KvtierResolveFetch
    try:
      os.utime(path)  # recently loaded: kept when other builds prune the cache
    except OSError:  # a read-only cache: nothing prunes it either
      pass
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(symbol), platform="cpu")
  except subprocess.CalledProcessError as err:
    return f"compiling {_SOURCE.name} failed:\n{err.stderr}"
  except subprocess.TimeoutExpired:
    return f"compiling {_SOURCE.name} took over {_BUILD_TIMEOUT_S} s"
  except Exception as err:  # noqa: BLE001 (any failure: fall back, and say why)
    return f"building, loading or registering the call failed: {err!r}"
  return None


def available() -> bool:
  """True when the native call is built and registered (compiling it if needed)."""
  return _load() is None


def unavailable_reason() -> str | None:
  """Why the native call is unavailable (None: it is available)."""
  return _load()


def use_native(interpret: bool | None) -> bool:
  """Whether a fused layer step runs natively: on the CPU backend (not while
  tracing for a GPU), unless the Pallas interpreter is asked for
  (``interpret=True``), when the call builds. When it cannot, the Pallas kernels
  run interpreted (slower, the same results), with a warning that says why; with
  ``$KVTIER_REQUIRE_NATIVE=1`` (CI) that is an error instead."""
  if common.on_gpu() or interpret or jax.default_backend() != "cpu":
    return False
  reason = _load()
  if reason is not None:
    if os.environ.get("KVTIER_REQUIRE_NATIVE") == "1":
      raise RuntimeError(f"KVTIER_REQUIRE_NATIVE=1 and the native CPU fused step is "
                         f"unavailable: {reason}")
    _warn_unavailable(reason)
  return reason is None


@functools.cache
def xla_contracts_multiply_add() -> bool:
  """Whether XLA:CPU rounds ``a * b + c`` once (an FMA: hosts with FMA units) or
  twice; the native score EMA rounds as the reference does. Asked once, eagerly
  (a trace that calls it does not stage it)."""
  cpu = jax.devices("cpu")[0]
  one_ulp = np.float32(1 + 2.0**-12)  # squared: 1 + 2**-11 + 2**-24, not an f32
  with jax.ensure_compile_time_eval():
    a, c = (jax.device_put(np.full(8, x, np.float32), cpu)
            for x in (one_ulp, -(1 + 2.0**-11)))
    got = jax.jit(lambda a, b, c: a * b + c)(a, a, c)  # rounded once: 2**-24; twice: 0
    return bool(np.asarray(got)[0] != 0)


@functools.cache
def _warn_unavailable(reason: str) -> None:
  warnings.warn(f"the native CPU fused step is unavailable ({reason}); the fused "
                "Pallas kernels run interpreted instead", RuntimeWarning, stacklevel=3)


@functools.partial(jax.jit, static_argnames=("max_len", "page_size", "share",
                                             "score_decay"))
def resolve_fetch_native(layer, prior_status, active, seq_len, selected,
                         cache: CacheArrays, page_table, host_k, host_v, k_new, v_new,
                         key=None, *, order=None, max_len: int, page_size: int,
                         share: int = 1,
                         score_decay: float | None = None) -> LayerResult:
  """``resolve_fetch`` (kernel.py) as one CPU call; ``cache`` is updated in place.

  ``key`` / ``order`` and ``score_decay`` as there: a keyed policy's victims come
  in the order of one XLA sort per row (``victim_order``), or the given ``order``.
  """
  reason = _load()
  if reason is not None:
    raise RuntimeError(f"the native fused step is unavailable: {reason}")
  num_layers, num_req, num_units, num_slots = cache.slot_pos.shape
  heads, head_dim = cache.hot_k.shape[-2:]
  num_sel = selected.shape[-1]
  common.check_slots(num_slots, num_sel)
  check_victim_inputs(key, order, score_decay, (num_req, num_units, num_slots))
  if len({host_k.dtype, host_v.dtype, cache.hot_k.dtype, cache.hot_v.dtype}) != 1:
    raise ValueError(f"the host tier ({host_k.dtype}, {host_v.dtype}) and the hot cache "
                     f"({cache.hot_k.dtype}, {cache.hot_v.dtype}) must share one dtype: "
                     "rows are copied as bytes")
  for name in ("slot_pos", "lru", "hits", "misses", "fetched_rows", "slot_score"):
    want = jnp.float32 if name == "slot_score" else jnp.int32
    if getattr(cache, name).dtype != want:
      raise ValueError(f"cache.{name} must be {jnp.dtype(want)}, got "
                       f"{getattr(cache, name).dtype}")
  check_share(share, num_layers)
  # The call indexes raw buffers: every operand's shape is checked here, at trace
  # time (the call checks sizes again, and refuses, before any access).
  if max_len < 1 or page_size < 1:
    raise ValueError(f"{max_len=} and {page_size=} must be >= 1")
  pages_needed = -(-max_len // page_size)
  hot_shape = (num_layers, num_req, num_units, num_slots + 1, heads, head_dim)
  actual = dict(
      cache=(cache.lru.shape, cache.slot_score.shape, cache.hits.shape,
             cache.misses.shape, cache.fetched_rows.shape, cache.hot_k.shape,
             cache.hot_v.shape),
      seq_len=np.shape(seq_len), selected=selected.shape,
      page_table=(np.shape(page_table)[0], np.shape(page_table)[1] >= pages_needed)
      if np.ndim(page_table) == 2 else np.shape(page_table),
      host_k=host_k.shape[:1] + host_k.shape[2:],
      host_v=host_v.shape, k_new=np.shape(k_new), v_new=np.shape(v_new))
  expected = dict(
      cache=(cache.slot_pos.shape, cache.slot_pos.shape, (num_layers, num_req, num_units),
             (num_layers, num_req, num_units), (num_layers,), hot_shape, hot_shape),
      seq_len=(num_req,), selected=(num_req, num_units, num_sel),
      page_table=(num_req, True),  # [R, MP], a column for every page of max_len
      host_k=(num_layers, page_size, num_units, heads, head_dim), host_v=host_k.shape,
      k_new=(num_req, num_units * heads, head_dim),
      v_new=(num_req, num_units * heads, head_dim))
  for name, shapes in actual.items():
    if shapes != expected[name]:
      raise ValueError(f"{name}: shapes {shapes} do not fit the cache's [L, R, U, B] = "
                       f"{cache.slot_pos.shape} (expected {expected[name]})")
  layer = jnp.asarray(layer, jnp.int32).reshape(())
  if key is not None:
    order = victim_order(cache.slot_pos[layer], cache.lru[layer], key, seq_len)
  if order is None:
    order = jnp.zeros((num_req, num_units, num_slots), jnp.int32)  # unread under LRU
  rows_new = lambda x: x.reshape(num_req, num_units * heads, head_dim).astype(
      cache.hot_k.dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  sel_shape = (num_req, num_units, num_sel)
  call = jax.ffi.ffi_call(
      _TARGET,
      [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in cache]
      + [i32(*sel_shape), jax.ShapeDtypeStruct(sel_shape, jnp.bool_), i32(),
         i32(num_req, num_units)],
      input_output_aliases={11 + i: i for i in range(len(cache))})
  *updated, slot, is_miss, status, target = call(
      layer, jnp.asarray(prior_status, jnp.int32).reshape(()),
      jnp.asarray(active, bool).reshape(num_req), jnp.asarray(seq_len, jnp.int32),
      jnp.asarray(selected, jnp.int32), order.astype(jnp.int32),
      jnp.asarray(page_table, jnp.int32), host_k, host_v, rows_new(k_new),
      rows_new(v_new), *cache,
      max_len=np.int64(max_len), page_size=np.int64(page_size), share=np.int64(share),
      keyed=np.int64(_LRU if score_decay is None else _KEYED_ONE_ROUNDING
                     if xla_contracts_multiply_add() else _KEYED_TWO_ROUNDINGS),
      score_decay=np.float32(0.0 if score_decay is None else score_decay))
  return LayerResult(CacheArrays(*updated), slot, is_miss, status, target)
