"""Request slots over a ``jax.sharding.Mesh``: the one-device program, per device.

Data parallelism over requests is the one-device step run on every device of mesh
axis ``data`` (``shard_map``): device d holds slots ``d*S/D .. (d+1)*S/D - 1`` (hot
caches, metadata, selector state) and its own host tier of ``NH/D`` pages (plus its
scratch page) in its own host memory; its page table names its own pages. A
*global* array is the devices' local arrays side by side along the leaf's request
(or host page) axis, so every device-local computation is the unchanged one-device
code, and a per-slot operation (a prefill chunk, installing a request) runs on the
owning device's shards alone (``split`` / ``assemble``, no copy).

The only collective of the sharded decode step is the per-layer agreement on the
refusal status (``agree_status``: one ``pmax`` of the status bits), which keeps a
refusal all-or-nothing across devices as it is on one device. Per-device counters
that have no request axis (``fetched_rows``) are concatenated, not reduced.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.common import STATUS_CAPACITY, STATUS_DUPLICATE, STATUS_OUT_OF_RANGE

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
# The status word's bits (STATUS_OUT_OF_RANGE | STATUS_DUPLICATE | STATUS_CAPACITY).
_STATUS_BITS = max(STATUS_OUT_OF_RANGE, STATUS_DUPLICATE, STATUS_CAPACITY).bit_length()


def parse_mesh(text: str | None) -> dict[str, int]:
  """``"data:2,model:2"`` -> {"data": 2, "model": 2} (missing axes are 1)."""
  shape = {axis: 1 for axis in AXES}
  for part in filter(None, (text or "").split(",")):
    name, _, size = part.partition(":")
    if name not in AXES or not size.isdigit() or int(size) < 1:
      raise ValueError(f"mesh {text!r}: each part is <axis>:<size> with axis in {AXES}"
                       " and size >= 1")
    shape[name] = int(size)
  return shape


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh over the first ``data * model`` devices."""
  unknown = set(shape) - set(AXES)
  sizes = [shape.get(axis, 1) for axis in AXES]
  if unknown or not all(isinstance(n, (int, np.integer)) and n >= 1 for n in sizes):
    raise ValueError(f"mesh {shape}: axes are {AXES} (missing ones are 1), sizes >= 1")
  devices = list(jax.devices() if devices is None else devices)
  need = shape.get(DATA, 1) * shape.get(MODEL, 1)
  if need > len(devices):
    raise ValueError(f"a mesh of {shape} needs {need} devices, {len(devices)} are "
                     "visible (on a CPU, set XLA_FLAGS=--xla_force_host_platform_"
                     f"device_count={need} before jax starts)")
  grid = np.array(devices[:need]).reshape(shape.get(DATA, 1), shape.get(MODEL, 1))
  return Mesh(grid, AXES)


def agree_status(status: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """The OR of every device's status word over mesh ``axes`` (inside shard_map): one
  all-reduce of a few bits per layer, the sharded step's only collective."""
  if not axes:
    return status
  bits = jnp.arange(_STATUS_BITS, dtype=jnp.int32)
  seen = jax.lax.pmax((status[..., None] >> bits) & 1, axes)
  return jnp.sum(seen << bits, axis=-1, dtype=jnp.int32)


def request_axes(small: Any, large: Any) -> Any:
  """Per leaf, the axis that grows with the request slots (or the heads), or -1.

  ``small`` and ``large`` are the same local state built for two slot (and host
  page) counts, or two head counts (``jax.eval_shape`` results or arrays); a leaf whose shapes differ
  in more than one axis is an error (it would not split cleanly).
  """
  def axis(a, b):
    if a.shape == b.shape:
      return -1
    differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if len(differ) != 1 or a.ndim != b.ndim:
      raise ValueError(f"a state leaf {a.shape} vs {b.shape} grows in more than one axis")
    return differ[0]
  return jax.tree.map(axis, small, large)


def mesh_specs(data_axes: Any, model_axes: Any = None, per_device: Any = None) -> Any:
  """PartitionSpecs from ``request_axes`` results: a leaf's request axis over
  ``data``, its head (unit) axis over ``model``; a leaf with neither (-1) is
  replicated unless ``per_device`` (a matching tree of bools) marks it a per-device
  value, whose axis 0 then concatenates every device's value."""
  no = jax.tree.map(lambda _: -1, data_axes)
  model_axes = no if model_axes is None else model_axes
  per_device = jax.tree.map(lambda _: False, data_axes) if per_device is None else per_device
  def spec(data, model, own):
    if data < 0 and model < 0:
      return P((DATA, MODEL)) if own else P()
    dims = [None] * (max(data, model) + 1)
    if data >= 0:
      dims[data] = DATA
    if model >= 0:
      dims[model] = MODEL
    return P(*dims)
  return jax.tree.map(spec, data_axes, model_axes, per_device)


def assemble(mesh: Mesh, specs: Any, per_device: list[Any]) -> Any:
  """Global arrays from the devices' local trees (``per_device[i]`` on
  ``mesh.devices.flat[i]``); the local buffers are reused, not copied."""
  devices = list(mesh.devices.flat)
  flat_specs, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
  columns = [treedef.flatten_up_to(tree) for tree in per_device]
  out = []
  for j, spec in enumerate(flat_specs):
    shards = [columns[i][j] for i in range(len(devices))]
    out.append(_global(mesh, spec, shards))
  return treedef.unflatten(out)


def _global(mesh: Mesh, spec: P, shards: list[jax.Array]) -> jax.Array:
  shape = list(shards[0].shape)
  for dim, names in enumerate(spec):
    for name in (names,) if isinstance(names, str) else (names or ()):
      shape[dim] *= mesh.shape[name]
  kind = getattr(shards[0].sharding, "memory_kind", None)
  sharding = NamedSharding(mesh, spec, memory_kind=kind)
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards)


def split(tree: Any, mesh: Mesh) -> list[Any]:
  """The devices' local trees of global ``tree`` (``mesh.devices.flat`` order), each
  leaf a one-device array on its buffer (no copy); ``assemble`` joins them back.

  A local tree may be donated to a one-device computation: that deletes the global
  array it came from, so take every device's view first.
  """
  devices = list(mesh.devices.flat)
  def leaves(x):
    by_device = {s.device: s.data for s in x.addressable_shards}
    kind = getattr(x.sharding, "memory_kind", None)
    # Not ``Shard.data`` itself: in jax 0.10 its type drops the memory space (a
    # pinned_host shard would compile as device memory).
    return [jax.make_array_from_single_device_arrays(
        by_device[d].shape, NamedSharding(_one_device_mesh(d), P(), memory_kind=kind),
        [by_device[d]]) for d in devices]
  flat, treedef = jax.tree.flatten(tree)
  columns = [leaves(x) for x in flat]
  return [treedef.unflatten([c[i] for c in columns]) for i in range(len(devices))]


@functools.cache
def _one_device_mesh(device: jax.Device) -> Mesh:
  return Mesh(np.array([device]), ("device",))


def per_device_leaves(axes: Any, names: tuple[str, ...]) -> Any:
  """A bool tree marking the leaves whose last path key is in ``names``."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: jax.tree_util.keystr(path).split(".")[-1] in names, axes)


def global_abstract(local: Any, specs: Any, mesh: Mesh, memory_kind=lambda path: None):
  """ShapeDtypeStructs of the global arrays whose per-device parts are ``local``
  (abstract inputs for compiling a sharded step without the devices);
  ``memory_kind(path)`` places each leaf."""
  flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  with_path, treedef = jax.tree_util.tree_flatten_with_path(local)
  out = []
  for (path, x), spec in zip(with_path, flat_specs):
    shape = list(x.shape)
    for dim, names in enumerate(spec):
      for name in (names,) if isinstance(names, str) else (names or ()):
        shape[dim] *= mesh.shape[name]
    out.append(jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=NamedSharding(
        mesh, spec, memory_kind=memory_kind(jax.tree_util.keystr(path)))))
  return treedef.unflatten(out)
