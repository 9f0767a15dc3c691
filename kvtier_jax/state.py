"""Tiered KV state: host-authoritative KV, device hot cache, metadata, counters.

All fields are arrays (a pytree), passed into the jitted step and returned, donated
at the jit boundary. Shapes follow shapes.py.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax.config import TierConfig
from kvtier_jax.shapes import EMPTY, HostKV, HotKV


@flax.struct.dataclass
class TieredKVState:
  """Per (layer, request, unit) hot cache over a paged host tier.

  The host tier is a pool of ``NH + 1`` pages of ``Pg`` positions; position ``p`` of
  request ``r`` lives in page ``page_table[r, p // Pg]`` at offset ``p % Pg``. Page
  ``NH`` is a scratch page that absorbs writes which must not land (a refused step,
  an inactive request, a position with no page), because ``dynamic_update_slice``
  clamps instead of dropping. It is never read.
  """

  host_k: HostKV  # f[L, NH+1, Pg, U, Hg, D]  memory_kind=pinned_host where supported
  host_v: HostKV  # f[L, NH+1, Pg, U, Hg, D]
  page_table: jax.Array  # i32[R, MP]  physical page of each logical page, -1 none
  hot_k: HotKV  # f[L, R, U, B+1, Hg, D]  slot B: the newest token
  hot_v: HotKV  # f[L, R, U, B+1, Hg, D]
  slot_pos: jax.Array  # i32[L, R, U, B]  position held by each slot, -1 empty
  lru: jax.Array  # i32[L, R, U, B]  slot ids, least recently used first
  slot_score: jax.Array  # f32[L, R, U, B]  selection frequency (policy "freq")
  seq_len: jax.Array  # i32[R]  positions 0..seq_len-1 are in the host tier
  # The counters count every layer that committed its update, a refused step's
  # layers before the refusing one included (docs/DESIGN.md, "Refusal contract").
  hits: jax.Array  # i32[L, R, U]  selected entries served without a fetch
  misses: jax.Array  # i32[L, R, U]  selected entries fetched from the host tier
  prefetched: jax.Array  # i32[L, R, U]  rows fetched ahead for a predicted step
  fetched_rows: jax.Array  # i32[L]  rows moved host->device (incl. any gather
  # padding)


def host_memory_kind(device: jax.Device | None = None) -> str:
  """``pinned_host`` where the device has it, else the default memory."""
  device = device or jax.devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  return "pinned_host" if "pinned_host" in kinds else device.default_memory().kind


def host_sharding(device: jax.Device | None = None):
  device = device or jax.devices()[0]
  return jax.sharding.SingleDeviceSharding(device, memory_kind=host_memory_kind(device))


def is_host_array(x) -> bool:
  """True when ``x`` (array or tracer) lives in host memory space."""
  space = getattr(jax.typeof(x), "memory_space", None)
  return space is not None and space == jax.memory.Space.Host


def host_tier_shape(cfg: TierConfig) -> tuple[int, ...]:
  return (cfg.num_layers, cfg.num_host_pages + 1, cfg.page_size, cfg.num_units,
          cfg.heads_per_unit, cfg.head_dim)


def fixed_page_table(cfg: TierConfig) -> np.ndarray:
  """i32[R, MP]: request r owns pages r*MP .. (r+1)*MP - 1 (a fixed batch), or no
  pages at all when ``cfg.host_pages`` sizes a shared pool (the engine allocates)."""
  shape = (cfg.num_requests, cfg.pages_per_request)
  if cfg.host_pages is not None:
    return np.full(shape, EMPTY, np.int32)
  return np.arange(np.prod(shape), dtype=np.int32).reshape(shape)


def hot_cache_shape(cfg: TierConfig) -> tuple[int, ...]:
  return (cfg.num_layers, cfg.num_requests, cfg.num_units, cfg.hot_slots + 1,
          cfg.heads_per_unit, cfg.head_dim)


def init_state(cfg: TierConfig, *, fill: float = 0.0,
               device: jax.Device | None = None) -> TieredKVState:
  """An empty cache: no positions, every slot empty, LRU = slot order.

  ``fill`` initialises the KV arrays (tests pass NaN so that any read of memory
  the cache never wrote poisons the output).
  """
  device = device or jax.devices()[0]
  dtype = jnp.dtype(cfg.dtype)
  # Built in numpy and placed once: the host tier never passes through HBM.
  host = np.full(host_tier_shape(cfg), fill, dtype)
  hs = host_sharding(device)
  meta_shape = (cfg.num_layers, cfg.num_requests, cfg.num_units, cfg.hot_slots)
  lru = np.broadcast_to(np.arange(cfg.hot_slots, dtype=np.int32), meta_shape)
  put = functools.partial(jax.device_put, device=device)
  counters = (cfg.num_layers, cfg.num_requests, cfg.num_units)
  return TieredKVState(
      host_k=jax.device_put(host, hs),
      host_v=jax.device_put(host, hs),
      page_table=put(fixed_page_table(cfg)),
      hot_k=put(np.full(hot_cache_shape(cfg), fill, dtype)),
      hot_v=put(np.full(hot_cache_shape(cfg), fill, dtype)),
      slot_pos=put(np.full(meta_shape, EMPTY, np.int32)),
      lru=put(np.ascontiguousarray(lru)),
      slot_score=put(np.zeros(meta_shape, np.float32)),
      seq_len=put(np.zeros((cfg.num_requests,), np.int32)),
      hits=put(np.zeros(counters, np.int32)),
      misses=put(np.zeros(counters, np.int32)),
      prefetched=put(np.zeros(counters, np.int32)),
      fetched_rows=put(np.zeros((cfg.num_layers,), np.int32)),
  )


def host_rows(cfg: TierConfig, state: TieredKVState, request: int, length: int):
  """(k, v) numpy [L, length, U, Hg, D]: a request's positions read through its
  page table (tests and snapshots; one device->host read)."""
  table, host_k, host_v = jax.device_get((state.page_table[request], state.host_k,
                                          state.host_v))
  pos = np.arange(length)
  pages, offsets = table[pos // cfg.page_size], pos % cfg.page_size
  if (pages < 0).any():
    raise ValueError(f"request {request} has no page for some of its {length} positions")
  return host_k[:, pages, offsets], host_v[:, pages, offsets]


def cache_stats(cfg: TierConfig, state: TieredKVState) -> dict:
  """Counters as int64 numpy (one device->host read; call at run boundaries)."""
  hits, misses, pref, rows = jax.device_get((state.hits, state.misses, state.prefetched,
                                              state.fetched_rows))
  hits, misses, pref, rows = (np.asarray(x, np.int64) for x in (hits, misses, pref, rows))
  return {
      "hits_per_layer": hits.sum((1, 2)),
      "misses_per_layer": misses.sum((1, 2)),
      "hits": int(hits.sum()),
      "misses": int(misses.sum()),
      "prefetched": int(pref.sum()),
      "fetched_rows": int(rows.sum()),
      # K and V rows both cross the link.
      "host_to_device_bytes": int(rows.sum()) * 2 * cfg.row_bytes,
      "miss_rate": float(misses.sum() / max(1, hits.sum() + misses.sum())),
  }


def committed(tree):
  """``tree`` with every eager, uncommitted array committed where it already lives.

  jit keys its compiled code on whether each argument is committed to a device. A
  carry built eagerly (uncommitted scalars, a jitted prefill's outputs) and the
  carry the step returns (committed) would compile the step twice. Inside a trace
  (tracers) nothing changes.
  """
  def commit(x):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and (
        not x.committed):
      return jax.device_put(x, x.sharding)
    return x

  return jax.tree.map(commit, tree)


def array_bytes_by_memory_kind(tree) -> dict[str, int]:
  """Bytes of every array in ``tree``, grouped by memory kind (measured sizes)."""
  out: dict[str, int] = {}
  for x in jax.tree.leaves(tree):
    kind = getattr(x.sharding, "memory_kind", None) or "device"
    out[kind] = out.get(kind, 0) + x.nbytes
  return out
