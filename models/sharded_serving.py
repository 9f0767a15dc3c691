"""The serving backend over a (data, model) mesh: requests split over ``data``, KV
heads (attention and the MLP with them) over ``model``.

``MeshServingBackend`` is one ``ServingModel`` of S slots built from D *group*
backends (``ServingBackend``s of S/D slots and NH/D host pages), one per data index,
each on its row of M devices:

* **The decode step** is the one-device step under ``shard_map`` over the whole
  mesh, one jitted call: each device runs its S/D requests and its Hkv/M KV heads
  (``ModelConfig.tp_axis``: the attention output and MLP projections are summed over
  ``model``); RESOLVE, the hot caches and the host tier of a (request, layer, KV
  head) live on the device that owns the head (per-KV-head units). Collectives: the
  per-layer refusal agreement (sharding.py) and, with M > 1, two sums per layer.
* **Per-slot work** (prefill chunks, installing a request, restaging a cached prefix,
  page reads and writes) runs on the owning row alone: on its one device (M = 1), or
  jitted over its M devices with the arrays sharded by head, XLA partitioning it
  (M > 1). No other row's arrays move (``sharding.split`` / ``assemble``).
* **Heads that do not split** (SmolLM2's 3 KV heads over 2 devices) are padded with
  heads that contribute exactly zero (``transformer.pad_kv_heads``).

The engine sees one model with ``num_partitions = D``: global page ids ``d*NH/D + j``
name page j of row d's host tier, and a slot's pages come from its own row.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from kvtier_jax import decode as kv_decode
from kvtier_jax import sharding
from kvtier_jax.driver import StepRefused, check_page_table, describe_status
from kvtier_jax.serving.request import is_int
from models.backends import check_tokens, tier_config, tiled_selector, tiered_step
from models.serving import (ServingBackend, ServingState, _dense_step, _sparse_step,
                            dense_lengths, place_snapshot)
from models.transformer import Transformer, dummy_params, pad_kv_heads

# Leaves without a request or head axis that differ per device: concatenated.
_PER_DEVICE = ("fetched_rows",)
_STEPS = {}  # (backend, configs, selector, mesh) -> the jitted sharded step
# Weights split over ``model`` (Megatron): heads of q/k/v (outputs) and of wo (inputs),
# the MLP hidden units of gate/up (outputs) and down (inputs); the rest replicated.
_TP_WEIGHTS = {"wq": P(None, None, sharding.MODEL), "wk": P(None, None, sharding.MODEL),
               "wv": P(None, None, sharding.MODEL), "wo": P(None, sharding.MODEL),
               "w_gate": P(None, None, sharding.MODEL),
               "w_up": P(None, None, sharding.MODEL), "w_down": P(None, sharding.MODEL)}


@flax.struct.dataclass
class ShardedState:
  cache: object  # the backends' caches as global arrays over the mesh
  staging: tuple  # one prefill staging buffer per data row (Staging)


class MeshServingBackend:
  """S slots over a (data, model) mesh (see the module docstring).

  Args:
    model, backend, num_slots, max_len, selector, selector_params, host_pages,
      **kwargs: as ``ServingBackend``; ``num_slots`` must split over ``data``, each
      row gets ``host_pages // D`` pages (a budget's remainder is not allocated).
    mesh: a mesh with axes ("data", "model") (``sharding.make_mesh``). With model
      M > 1 the selector must select per KV head (units = KV heads) and have no
      parameters.
  """

  def __init__(self, model: Transformer, backend: str, num_slots: int, max_len: int, *,
               mesh, selector=None, selector_params=None, host_pages: int | None = None,
               **kwargs):
    rows, width = mesh.shape[sharding.DATA], mesh.shape[sharding.MODEL]
    if kwargs.get("lookahead", "none") != "none":  # (its decode runs no draft pass)
      raise ValueError("the look-ahead runs on one device's backend, not over a mesh")
    if num_slots % rows:
      raise ValueError(f"num_slots={num_slots} must be a multiple of data={rows}")
    if host_pages is not None and host_pages < rows:
      raise ValueError(f"host_pages={host_pages}: each of {rows} rows needs a page")
    cfg = model.cfg
    selector = tiled_selector(selector, cfg)
    self._real_units = cfg.num_kv_heads  # before padding (units: KV heads at width > 1)
    if width > 1:
      if selector_params is not None or getattr(selector, "reads_hidden", False):
        raise ValueError("tensor parallel (model > 1) needs a selector without "
                         "parameters that reads only q/k (Quest, NSA, oracle)")
      if selector is not None and selector.num_units != selector.num_kv_heads:
        raise ValueError("tensor parallel (model > 1) splits the cache by KV head: "
                         "the selector must select per KV head (e.g. quest_kv)")
      cfg, weights = pad_kv_heads(cfg, model.weights(), width)
      if cfg.ffn_hidden_dim % width:
        raise ValueError(f"the MLP width {cfg.ffn_hidden_dim} must split over "
                         f"model={width}")
      if cfg is not model.cfg:
        model = Transformer.from_params(cfg, weights)
        if selector is not None:
          selector = dataclasses.replace(selector, num_kv_heads=cfg.num_kv_heads)
    self.mesh, self.rows, self.width = mesh, rows, width
    self._overrides = {k: v for k, v in kwargs.items()  # TierConfig fields
                       if k not in ("hot_slots", "chunk_size", "page_size", "index_share")}
    self._per = num_slots // rows
    self._row_meshes = [jax.sharding.Mesh(mesh.devices[r:r + 1], sharding.AXES)
                        for r in range(rows)]
    local_pages = None if host_pages is None else host_pages // rows
    self.groups = [ServingBackend(model, backend, self._per, max_len,
                                  selector=selector, selector_params=selector_params,
                                  host_pages=local_pages,
                                  device=mesh.devices[r, 0] if width == 1 else None,
                                  **kwargs) for r in range(rows)]
    one = self.groups[0]
    self.cfg, self.backend, self.selector = cfg, backend, selector
    self.num_slots, self.max_len, self.chunk_size = num_slots, max_len, one.chunk_size
    self.page_size, self.vocab_size = one.page_size, one.vocab_size
    self.hot_slots, self.host_page_bytes = one.hot_slots, one.host_page_bytes
    self.num_host_pages = one.num_host_pages * rows
    self.num_partitions = rows
    self.supports_prefix_cache = one.supports_prefix_cache
    self._local_pages = one.num_host_pages
    self._w_specs = {n: _TP_WEIGHTS.get(n, P()) if width > 1 else P()
                     for n in one.weights}
    if width > 1:
      for r, group in enumerate(self.groups):
        group.weights = jax.device_put(group.weights, {
            n: NamedSharding(self._row_meshes[r], s) for n, s in self._w_specs.items()})
    # What one device runs in the decode step: its requests and its heads.
    self.device_cfg = dataclasses.replace(
        cfg, num_q_heads=cfg.num_q_heads // width, num_kv_heads=cfg.num_kv_heads // width,
        ffn_hidden_dim=cfg.ffn_hidden_dim // width,
        tp_axis=sharding.MODEL if width > 1 else None)
    self.device_selector = selector if selector is None or width == 1 else (
        dataclasses.replace(selector, num_kv_heads=cfg.num_kv_heads // width))
    self.tier_cfg = None
    if backend == "tiered":
      self.tier_cfg = tier_config(
          self.device_cfg, self.device_selector, self._per, max_len, one.hot_slots,
          page_size=one.page_size, host_pages=one.num_host_pages,
          index_share=one.index_share, mesh_axes=sharding.AXES, **self._overrides)
    self._specs = self._cache_specs()
    per_device = [sharding.split(g.weights, self._row_meshes[r])
                  for r, g in enumerate(self.groups)]
    self.weights = sharding.assemble(mesh, self._w_specs,
                                     [w for row in per_device for w in row])
    self._step = None
    self.reshards = 0  # per-slot outputs XLA placed otherwise (moved back: a copy)

  # Layout --------------------------------------------------------------------

  def _cache_specs(self):
    """Each cache leaf's PartitionSpec: its request axis (the state at 1 vs 2 slots)
    and head axis (1 vs 2 KV heads per device) on a tiny model of the same kind."""
    cfg = self.cfg
    group = cfg.num_q_heads // cfg.num_kv_heads

    def probe(slots, heads):
      tiny = dataclasses.replace(cfg, num_kv_heads=heads, num_q_heads=heads * group,
                                 embed_dim=8, ffn_hidden_dim=8, vocab_size=16,
                                 tp_axis=None)
      model = Transformer.from_params(tiny, dummy_params(tiny, jax.random.key(0)))
      selector = self.selector
      if selector is not None and hasattr(selector, "num_kv_heads"):
        selector = dataclasses.replace(selector, num_kv_heads=heads)
      pages = slots * -(-self.max_len // self.page_size)
      small = ServingBackend(model, self.backend, slots, self.max_len, selector=selector,
                             selector_params=self.groups[0].params,
                             hot_slots=self.hot_slots or None,
                             chunk_size=self.chunk_size, page_size=self.page_size,
                             host_pages=pages, index_share=self.groups[0].index_share,
                             **self._overrides)
      return jax.eval_shape(lambda: small.init().cache)

    base = probe(1, 1)
    data_axes = sharding.request_axes(base, probe(2, 1))
    model_axes = sharding.request_axes(base, probe(1, 2)) if self.width > 1 else None
    return sharding.mesh_specs(data_axes, model_axes,
                               sharding.per_device_leaves(data_axes, _PER_DEVICE))

  def _sharded_step(self, cache):
    """The one-device step under shard_map; outputs placed as ``cache`` is (the host
    tier stays in host memory)."""
    cfg, one = self.device_cfg, self.groups[0]
    selector = self.device_selector
    if self.backend == "dense":
      def local(weights, tokens, active, kv):
        return _dense_step(cfg, weights, tokens, active, kv)
    elif self.backend == "sparse":
      def local(weights, tokens, active, carry):
        return _sparse_step(cfg, selector, one.index_share, weights, tokens, active,
                            carry)
    else:
      tier_cfg = self.tier_cfg
      def local(weights, tokens, active, carry):
        carry = carry.replace(active=active)
        logits, carry = tiered_step(cfg, tier_cfg, selector, weights, tokens, carry)
        append = carry.ok & carry.active
        return logits, carry.replace(tier=kv_decode.append_newest(tier_cfg, carry.tier,
                                                                  append))
    data = P(sharding.DATA)
    step = jax.shard_map(local, mesh=self.mesh,
                         in_specs=(self._w_specs, data, data, self._specs),
                         out_specs=(data, self._specs),
                         check_vma=False)  # Pallas kernels declare no varying axes
    placed = jax.tree.map(lambda x: x.sharding, cache)
    return jax.jit(step, donate_argnums=(3,),
                   out_shardings=(NamedSharding(self.mesh, data), placed))

  def _split(self, slot: int) -> tuple[int, int]:
    if not (is_int(slot) and 0 <= slot < self.num_slots):
      raise ValueError(f"slot={slot!r} must be an int in [0, {self.num_slots})")
    return divmod(slot, self._per)

  def _row_view(self, per_device, row: int):
    """Row ``row``'s cache as arrays over its M devices (sharded by head)."""
    part = per_device[row * self.width:(row + 1) * self.width]
    return sharding.assemble(self._row_meshes[row], self._specs, part)

  def _on_row(self, state: ShardedState, row: int, fn):
    """``fn(group_backend, group_state) -> (group_state, out)`` on row ``row``'s
    arrays; returns (state, out)."""
    per_device = sharding.split(state.cache, self.mesh)
    view = ServingState(self._row_view(per_device, row), state.staging[row])
    view, out = fn(self.groups[row], view)
    mesh = self._row_meshes[row]
    cache = jax.tree.map(lambda x, s: self._placed(x, NamedSharding(
        mesh, s, memory_kind=x.sharding.memory_kind)), view.cache, self._specs,
        is_leaf=lambda x: isinstance(x, jax.Array))
    per_device[row * self.width:(row + 1) * self.width] = sharding.split(cache, mesh)
    staging = state.staging[:row] + (view.staging,) + state.staging[row + 1:]
    return ShardedState(sharding.assemble(self.mesh, self._specs, per_device),
                        staging), out

  def _placed(self, x, want: NamedSharding):
    if x.sharding.is_equivalent_to(want, x.ndim):
      return x
    self.reshards += 1
    return jax.device_put(x, want)

  # Accounting (per request, as on one device) ---------------------------------

  def device_bytes(self, length: int) -> int:
    return self.groups[0].device_bytes(length)

  def staging_bytes(self) -> int:
    """One staging buffer per row."""
    return self.groups[0].staging_bytes() * self.rows

  def host_pages(self, length: int) -> int:
    return self.groups[0].host_pages(length)

  # State -----------------------------------------------------------------------

  def init(self) -> ShardedState:
    per_device, stagings = [], []
    for row, group in enumerate(self.groups):
      state = group.init()
      if self.width > 1:  # built on one device, then split by head over the row
        mesh = self._row_meshes[row]
        # A per-device counter is every device's own [L], concatenated: the row's
        # width devices each get a whole copy (splitting one [L] gave each device
        # L/width entries, and the step's writes past them were dropped).
        own = sharding.per_device_leaves(state.cache, _PER_DEVICE)
        state = state.replace(cache=jax.tree.map(
            lambda x, o: jnp.tile(x, (self.width,) + (1,) * (x.ndim - 1)) if o else x,
            state.cache, own))
        state = jax.device_put(state, ServingState(
            jax.tree.map(lambda x, s: NamedSharding(
                mesh, s, memory_kind=x.sharding.memory_kind), state.cache, self._specs,
                is_leaf=lambda x: isinstance(x, jax.Array)),
            # Staged K/V split by head as a prefill chunk returns them (replicated,
            # the first chunk recompiled and each row held width copies).
            state.staging.replace(
                k=NamedSharding(mesh, P(None, None, "model")),
                v=NamedSharding(mesh, P(None, None, "model")),
                x=None if state.staging.x is None else NamedSharding(mesh, P()))))
      per_device += sharding.split(state.cache, self._row_meshes[row])
      stagings.append(state.staging)
    return ShardedState(sharding.assemble(self.mesh, self._specs, per_device),
                        tuple(stagings))

  def set_pages(self, state: ShardedState, table: np.ndarray) -> ShardedState:
    """Global page ids -> each row's own page ids (a slot's pages are its row's, the
    engine's partitions)."""
    if self.backend != "tiered":
      return state
    table = check_page_table(table, state.cache.tier.page_table.shape,
                             self.rows * self._local_pages)
    owner = np.repeat(np.arange(self.rows), self._per)[:, None]
    held = table >= 0
    if (held & (table // self._local_pages != owner)).any():
      raise ValueError("a slot lists a page of another row's host tier")
    local = np.where(held, table - owner * self._local_pages, table)
    old = state.cache.tier.page_table  # same placement: the step must not recompile
    tier = state.cache.tier.replace(page_table=jax.device_put(local, old.sharding))
    return state.replace(cache=state.cache.replace(tier=tier))

  def prefill(self, state, slot, tokens, start, count):
    row, local = self._split(slot)
    return self._on_row(state, row,
                        lambda b, s: b.prefill(s, local, tokens, start, count))

  def load_prefix(self, state, slot, length):
    row, local = self._split(slot)
    return self._on_row(state, row,
                        lambda b, s: (b.load_prefix(s, local, length), None))[0]

  def start_decoding(self, state, slot, length):
    row, local = self._split(slot)
    return self._on_row(state, row,
                        lambda b, s: (b.start_decoding(s, local, length), None))[0]

  def _by_row(self, pages):
    pages = np.asarray(pages, np.int64).reshape(-1)
    total = self.rows * self._local_pages
    bad = pages[(pages < 0) | (pages >= total)]
    if bad.size:  # no row holds them: they would be dropped (writes) or left empty
      raise ValueError(f"host pages {bad[:5].tolist()} are outside [0, {total})")
    for row in range(self.rows):
      where = np.flatnonzero(pages // self._local_pages == row)
      if where.size:
        yield row, where, (pages[where] % self._local_pages).tolist()

  @property
  def decode_id(self) -> str:
    return self.groups[0].decode_id

  @property
  def model_id(self) -> str:
    """The rows' model identity; tensor parallel sums each layer's partial outputs
    in another order, so its K/V are another model's in the last bits."""
    one = self.groups[0].model_id
    return one if self.width == 1 else f"{one}/tp{self.width}"

  def read_pages(self, state, pages) -> list[np.ndarray]:
    if not len(pages):  # the one-device backend's empty fields, of a whole row
      return self._on_row(state, 0, lambda b, s: (s, b.read_pages(s, [])))[1]
    out = None
    for row, where, local in self._by_row(pages):
      _, fields = self._on_row(state, row, lambda b, s: (s, b.read_pages(s, local)))
      if out is None:
        out = [np.empty((len(pages),) + f.shape[1:], f.dtype) for f in fields]
      for o, f in zip(out, fields):
        o[where] = f
    return out

  def write_pages(self, state, pages, fields) -> ShardedState:
    if any(len(f) != len(pages) for f in fields):
      raise ValueError(f"contents of {[len(f) for f in fields]} pages for {len(pages)}")
    for row, where, local in self._by_row(pages):
      part = [np.asarray(f)[where] for f in fields]
      state, _ = self._on_row(state, row,
                              lambda b, s: (b.write_pages(s, local, part), None))
    return state

  # Decode ------------------------------------------------------------------------

  def decode(self, state: ShardedState, tokens, active):
    # As ServingBackend.decode checks (this step bypasses the groups' decode): a
    # token past the vocabulary would read another's embedding (a clamp), a short
    # mask would be broadcast over every slot.
    if np.shape(tokens) != (self.num_slots,) or np.shape(active) != (self.num_slots,):
      raise ValueError(f"tokens {np.shape(tokens)} and active {np.shape(active)} must "
                       f"be ({self.num_slots},)")
    active = np.asarray(active, bool)
    check_tokens(np.asarray(tokens)[active], self.vocab_size)
    rows = lambda r: slice(r * self._per, (r + 1) * self._per)
    for r, group in enumerate(self.groups):  # this step bypasses the groups' decode
      group.check_room(active[rows(r)])
    if self._step is None:  # one compiled step for every backend of the same shape
      key = (self.backend, self.device_cfg, self.tier_cfg, self.device_selector,
             self.groups[0].index_share, self.mesh)
      if key not in _STEPS:
        _STEPS[key] = self._sharded_step(state.cache)
      self._step = _STEPS[key]
    data = NamedSharding(self.mesh, P(sharding.DATA))
    put = lambda x: jax.device_put(np.asarray(x), data)
    logits, cache = self._step(self.weights, put(np.asarray(tokens, np.int32)),
                               put(active), state.cache)
    state = ShardedState(cache, state.staging)
    if self.backend == "tiered":
      status = int(cache.status)
      if status:
        raise StepRefused("decode step refused, nothing committed (a retry is exact): "
                          f"{describe_status(status)}", state)
    for r, group in enumerate(self.groups):
      group.advance(active[rows(r)])
    return state, logits

  # Snapshot and stats ----------------------------------------------------------

  def snapshot(self, state: ShardedState) -> list[np.ndarray]:
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    if self.backend == "tiered":
      leaves.append(np.concatenate([g.driver.seq_len for g in self.groups]))
    return leaves

  def restore_state(self, leaves: list[np.ndarray]) -> ShardedState:
    state, lens = place_snapshot(self.init(), leaves, self.backend == "tiered")
    if lens is None:
      lens = np.asarray(dense_lengths(state.cache), np.int64)
    for r, group in enumerate(self.groups):
      group.set_lengths(lens[r * self._per:(r + 1) * self._per])
    return state

  stats_modulus = ServingBackend.stats_modulus  # (the same int32 counters)

  def stats(self, state: ShardedState) -> dict:
    """The one-device counters, summed over every device's cache. Hits and misses
    count the model's KV heads only (a padded head's selections are over zero keys,
    not the model's); fetched rows and bytes count what crossed the link, padded
    heads' rows included."""
    return ServingBackend.stats(self, state, self._real_units if self.width > 1 else None)

  compiled_prefills = staticmethod(ServingBackend.compiled_prefills)
