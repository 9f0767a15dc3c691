"""The serving backend over a mesh axis ``data``: requests split across devices.

``DataParallelBackend`` is a ``ServingModel`` of S slots over D devices built from
D one-device ``ServingBackend``s (S/D slots and NH/D host pages each, the weights
and that host tier on their device). Per-slot work (prefill chunks, installing a
request, restaging a cached prefix, page reads and writes) runs on the owning
device's shards alone (``sharding.device_view``); the decode step is the one-device
step under ``shard_map`` over all D devices, one jitted call, whose only collective
is the per-layer refusal agreement (kvtier_jax/sharding.py). The engine sees one
model with ``num_partitions = D``: global page ids ``d*NH/D + j`` name page j of
device d's host tier, and a slot's pages come from its own device.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from kvtier_jax import decode as kv_decode
from kvtier_jax import sharding
from kvtier_jax import state as kv_state
from kvtier_jax.driver import StepRefused, describe_status
from models.backends import tiered_step
from models.serving import ServingBackend, ServingState, _dense_step, _sparse_step

# Leaves without a request axis that differ per device: concatenated, not replicated.
_PER_DEVICE = ("fetched_rows",)
_STEPS = {}  # (backend, configs, selector, mesh) -> the jitted sharded step


@flax.struct.dataclass
class ShardedState:
  cache: object  # the backends' caches as global arrays over the mesh
  staging: tuple  # one prefill staging buffer per device (Staging)


class DataParallelBackend:
  """S slots over mesh axis ``data`` (see the module docstring).

  Args:
    model, backend, num_slots, max_len, host_pages, **kwargs: as ``ServingBackend``;
      ``num_slots`` must split evenly over the devices; each gets
      ``host_pages // D`` pages (a budget's remainder is not allocated).
    mesh: a (data, model) mesh with model = 1.
  """

  def __init__(self, model, backend: str, num_slots: int, max_len: int, *, mesh,
               host_pages: int | None = None, **kwargs):
    num_dev = mesh.shape[sharding.DATA]
    if mesh.shape[sharding.MODEL] != 1:
      raise ValueError("DataParallelBackend shards requests only (model=1)")
    if num_slots % num_dev:
      raise ValueError(f"num_slots={num_slots} must be a multiple of data={num_dev}")
    if host_pages is not None and host_pages < num_dev:
      raise ValueError(f"host_pages={host_pages}: each of {num_dev} devices needs a page")
    if backend == "tiered":
      kwargs["mesh_axes"] = (sharding.DATA,)
    self.mesh, self.devices = mesh, list(mesh.devices.flat)
    self._per = num_slots // num_dev
    local_pages = None if host_pages is None else host_pages // num_dev  # floor
    self.locals = [ServingBackend(model, backend, self._per, max_len,
                                  host_pages=local_pages, device=d, **kwargs)
                   for d in self.devices]
    one = self.locals[0]
    self.cfg, self.backend, self.tier_cfg = one.cfg, backend, one.tier_cfg
    self.num_slots, self.max_len, self.chunk_size = num_slots, max_len, one.chunk_size
    self.page_size, self.vocab_size = one.page_size, one.vocab_size
    self.hot_slots, self.host_page_bytes = one.hot_slots, one.host_page_bytes
    self.num_host_pages = one.num_host_pages * num_dev
    self.num_partitions = num_dev
    self.supports_prefix_cache = one.supports_prefix_cache
    self._local_pages = one.num_host_pages
    self._specs = self._cache_specs(model, backend, max_len, kwargs)
    self.weights = sharding.assemble(mesh, jax.tree.map(lambda _: P(), one.weights),
                                     [b.weights for b in self.locals])
    self._step = None  # compiled at the first decode, for the state's placement

  # Layout --------------------------------------------------------------------

  def _cache_specs(self, model, backend, max_len, kwargs):
    """Each cache leaf's PartitionSpec, from the local state at 1 and 2 slots."""
    def probe(slots):
      pages = None if backend != "tiered" else slots * -(-max_len // self.page_size)
      small = ServingBackend(model, backend, slots, max_len, host_pages=pages, **kwargs)
      return jax.eval_shape(lambda: small.init().cache)
    axes = sharding.request_axes(probe(1), probe(2))
    return sharding.data_specs(axes, sharding.per_device_leaves(axes, _PER_DEVICE))

  def _sharded_step(self, cache):
    """The one-device step under shard_map; outputs placed as ``cache`` is (the host
    tier stays in host memory)."""
    cfg, one = self.cfg, self.locals[0]
    if self.backend == "dense":
      def local(weights, tokens, active, kv):
        return _dense_step(cfg, weights, tokens, active, kv)
    elif self.backend == "sparse":
      def local(weights, tokens, active, carry):
        return _sparse_step(cfg, one.selector, one.index_share, weights, tokens, active,
                            carry)
    else:
      tier_cfg = self.tier_cfg
      def local(weights, tokens, active, carry):
        carry = carry.replace(active=active)
        logits, carry = tiered_step(cfg, tier_cfg, one.selector, weights, tokens, carry)
        append = carry.ok & carry.active
        return logits, carry.replace(tier=kv_decode.append_newest(tier_cfg, carry.tier,
                                                                  append))
    w_specs = jax.tree.map(lambda _: P(), self.weights)
    data = P(sharding.DATA)
    step = jax.shard_map(local, mesh=self.mesh,
                         in_specs=(w_specs, data, data, self._specs),
                         out_specs=(data, self._specs),
                         check_vma=False)  # Pallas kernels declare no varying axes
    placed = jax.tree.map(lambda x: x.sharding, cache)
    logits = jax.sharding.NamedSharding(self.mesh, data)
    return jax.jit(step, donate_argnums=(3,), out_shardings=(logits, placed))

  def _split(self, slot: int) -> tuple[int, int]:
    if not 0 <= slot < self.num_slots:
      raise ValueError(f"slot {slot} is not in 0..{self.num_slots - 1}")
    return divmod(slot, self._per)

  def _on_device(self, state: ShardedState, index: int, fn):
    """``fn(local_backend, local_state) -> (local_state, out)`` on device ``index``'s
    shards; returns (state, out)."""
    views = sharding.split(state.cache, self.mesh)
    view, out = fn(self.locals[index], ServingState(views[index], state.staging[index]))
    views[index] = view.cache
    staging = state.staging[:index] + (view.staging,) + state.staging[index + 1:]
    return ShardedState(sharding.assemble(self.mesh, self._specs, views), staging), out

  # Accounting (per request, as on one device) ---------------------------------

  def device_bytes(self, length: int) -> int:
    return self.locals[0].device_bytes(length)

  def staging_bytes(self) -> int:
    """One staging buffer per device."""
    return self.locals[0].staging_bytes() * len(self.devices)

  def host_pages(self, length: int) -> int:
    return self.locals[0].host_pages(length)

  # State -----------------------------------------------------------------------

  def init(self) -> ShardedState:
    states = [b.init() for b in self.locals]
    cache = sharding.assemble(self.mesh, self._specs, [s.cache for s in states])
    return ShardedState(cache, tuple(s.staging for s in states))

  def set_pages(self, state: ShardedState, table: np.ndarray) -> ShardedState:
    """Global page ids -> each device's own page ids (a slot's pages are its
    device's, the engine's partitions)."""
    if self.backend != "tiered":
      return state
    table = np.array(table, np.int32)
    owner = np.repeat(np.arange(len(self.devices)), self._per)[:, None]
    held = table >= 0
    if (held & (table // self._local_pages != owner)).any():
      raise ValueError("a slot lists a page of another device's host tier")
    local = np.where(held, table - owner * self._local_pages, table)
    old = state.cache.tier.page_table  # same placement: the step must not recompile
    tier = state.cache.tier.replace(page_table=jax.device_put(local, old.sharding))
    return state.replace(cache=state.cache.replace(tier=tier))

  def prefill(self, state, slot, tokens, start, count):
    index, local = self._split(slot)
    return self._on_device(state, index,
                           lambda b, s: b.prefill(s, local, tokens, start, count))

  def load_prefix(self, state, slot, length):
    index, local = self._split(slot)
    return self._on_device(state, index,
                           lambda b, s: (b.load_prefix(s, local, length), None))[0]

  def start_decoding(self, state, slot, length):
    index, local = self._split(slot)
    return self._on_device(state, index,
                           lambda b, s: (b.start_decoding(s, local, length), None))[0]

  def _by_device(self, pages):
    pages = np.asarray(pages, np.int64)
    for index in range(len(self.devices)):
      where = np.flatnonzero(pages // self._local_pages == index)
      if where.size:
        yield index, where, (pages[where] % self._local_pages).tolist()

  def read_pages(self, state, pages) -> list[np.ndarray]:
    out = None
    for index, where, local in self._by_device(pages):
      _, fields = self._on_device(state, index, lambda b, s: (s, b.read_pages(s, local)))
      if out is None:
        out = [np.empty((len(pages),) + f.shape[1:], f.dtype) for f in fields]
      for o, f in zip(out, fields):
        o[where] = f
    return out

  def write_pages(self, state, pages, fields) -> ShardedState:
    for index, where, local in self._by_device(pages):
      part = [np.asarray(f)[where] for f in fields]
      state, _ = self._on_device(state, index,
                                 lambda b, s: (b.write_pages(s, local, part), None))
    return state

  # Decode ------------------------------------------------------------------------

  def decode(self, state: ShardedState, tokens, active):
    active = np.asarray(active, bool)
    rows = lambda i: slice(i * self._per, (i + 1) * self._per)
    if self.backend == "tiered":
      for i, b in enumerate(self.locals):
        b.driver.check_room(active[rows(i)])
    data = jax.sharding.NamedSharding(self.mesh, P(sharding.DATA))
    put = lambda x: jax.device_put(np.asarray(x), data)
    if self._step is None:  # one compiled step for every backend of the same shape
      key = (self.backend, self.cfg, self.tier_cfg, self.locals[0].selector,
             self.locals[0].index_share, self.mesh)
      if key not in _STEPS:
        _STEPS[key] = self._sharded_step(state.cache)
      self._step = _STEPS[key]
    logits, cache = self._step(self.weights, put(np.asarray(tokens, np.int32)),
                               put(active), state.cache)
    state = ShardedState(cache, state.staging)
    if self.backend == "tiered":
      status = int(cache.status)
      if status:
        raise StepRefused(f"decode step refused, cache unchanged: "
                          f"{describe_status(status)}", state)
      for i, b in enumerate(self.locals):
        b.driver.seq_len += active[rows(i)]
    return state, logits

  # Snapshot and stats ----------------------------------------------------------

  def snapshot(self, state: ShardedState) -> list[np.ndarray]:
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    if self.backend == "tiered":
      leaves.append(np.concatenate([b.driver.seq_len for b in self.locals]))
    return leaves

  def restore_state(self, leaves: list[np.ndarray]) -> ShardedState:
    template = self.init()
    slots, treedef = jax.tree.flatten(template)
    extra = 1 if self.backend == "tiered" else 0
    if len(leaves) != len(slots) + extra:
      raise ValueError(f"{len(leaves)} arrays for a state of {len(slots) + extra}")
    for i, (leaf, slot) in enumerate(zip(leaves, slots)):
      if leaf.shape != slot.shape or leaf.dtype != slot.dtype:
        raise ValueError(f"array {i}: {leaf.dtype}{list(leaf.shape)} where the state has "
                         f"{slot.dtype}{list(slot.shape)}")
    placed = [jax.device_put(leaf, slot.sharding) for leaf, slot in zip(leaves, slots)]
    del template, slots
    if extra:
      lens = np.asarray(leaves[-1], np.int64)
      for i, b in enumerate(self.locals):
        b.driver.seq_len = lens[i * self._per:(i + 1) * self._per].copy()
    return jax.tree.unflatten(treedef, placed)

  def stats(self, state: ShardedState) -> dict:
    if self.backend != "tiered":
      return {}
    stats = kv_state.cache_stats(self.tier_cfg, state.cache.tier)
    return {k: stats[k] for k in ("hits", "misses", "fetched_rows",
                                  "host_to_device_bytes")}
