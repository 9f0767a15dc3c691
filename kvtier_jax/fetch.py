"""Moving rows between the host tier and the hot cache, without whole-tier copies.

* Miss fetch (host -> hot): only missed rows cross the link. The XLA path compacts
  the misses of a layer, then gathers them on the host (``compute_on2``
  'device_host', which XLA:GPU runs as an async HostExecute whose result lands in
  HBM) in ``ceil(misses / chunk)`` chunks of ``chunk`` rows, and scatters them into
  their victim slots. The Pallas path (``ImplConfig(fetch="pallas")``) is one kernel that
  reads the pinned host buffer directly (zero-copy over UVA) and copies exactly the
  missed rows.
* Append (hot slot B -> host): the newest token's rows are written into the host
  tier with per-request ``dynamic_update_slice`` on the host buffer, in place under
  donation (never a compute_on scatter, which copies the whole tier: docs/DESIGN.md,
  "Host memory in XLA").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
try:  # jax <= 0.10: the function transform is compute_on2
  from jax.experimental.compute_on import compute_on2 as host_compute
except ImportError:  # jax >= 0.11: compute_on itself takes (f, compute_type, out_memory_spaces)
  from jax.experimental.compute_on import compute_on as host_compute

from kvtier_jax.config import TierConfig
from kvtier_jax.state import is_host_array
from pallas_kernels import common

Host = jax.memory.Space.Host
Device = jax.memory.Space.Device


def gather_rows(host_k, host_v, index):
  """Rows host[i0, i1, i2, i3] for each row of ``index`` i32[C, 4], on device."""

  def take(hk, hv, index):
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=(1, 2), collapsed_slice_dims=(0, 1, 2, 3),
        start_index_map=(0, 1, 2, 3))
    size = (1, 1, 1, 1) + hk.shape[4:]
    gather = lambda x: jax.lax.gather(x, index, dims, size,
                                      mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return gather(hk), gather(hv)

  if not is_host_array(host_k):
    return take(host_k, host_v, index)
  gather = host_compute(take, compute_type="device_host",
                       out_memory_spaces=(Device, Device))
  return gather(host_k, host_v, jax.device_put(index, Host))


class MissRows(NamedTuple):
  """Missed rows gathered to the device, and where they go in the hot cache."""

  dest: jax.Array  # i32[N, 4]  (layer, request, unit, slot); request = R: unused lane
  k: jax.Array  # [N, Hg, D]
  v: jax.Array  # [N, Hg, D]
  moved: jax.Array  # i32[]  rows that crossed the link (per K or V array)
  lane: jax.Array  # i32[R, U, k] row of each selected entry in k/v (misses only)


class MissPlan(NamedTuple):
  """One layer's misses compacted to the front of N lanes."""

  src: jax.Array  # i32[N, 4] (layer, request, position, unit) in the host tier
  dest: jax.Array  # i32[N, 4] (layer, request, unit, slot); request = R: unused lane
  count: jax.Array  # i32[] valid lanes
  lane: jax.Array  # i32[R, U, k] lane of each selected entry (>= count: not a miss)


def plan_misses(layer, selected, slot, is_miss, lanes_multiple: int = 1) -> MissPlan:
  """Compact the missed (request, unit, position, slot) of one layer.

  Unused lanes read row (layer, 0, 0, 0), which always exists, and write out of
  range (dropped). N is R*U*k rounded up to ``lanes_multiple``.
  """
  num_req, num_units, num_sel = selected.shape
  req = jnp.broadcast_to(jnp.arange(num_req, dtype=jnp.int32)[:, None, None],
                         selected.shape)
  unit = jnp.broadcast_to(jnp.arange(num_units, dtype=jnp.int32)[None, :, None],
                          selected.shape)
  lanes = num_req * num_units * num_sel
  padded = common.cdiv(lanes, lanes_multiple) * lanes_multiple
  miss = is_miss.reshape(-1)
  to = jnp.where(miss, jnp.cumsum(miss, dtype=jnp.int32) - 1, padded)
  layer_col = jnp.full_like(req, layer)
  src = jnp.stack([layer_col, req, selected, unit], axis=-1).reshape(lanes, 4)
  dest = jnp.stack([layer_col, req, unit, slot], axis=-1).reshape(lanes, 4)
  src = jnp.zeros((padded, 4), jnp.int32).at[to].set(src, mode="drop")
  src = src.at[:, 0].set(layer)
  dest = jnp.broadcast_to(jnp.array([0, num_req, 0, 0], jnp.int32), (padded, 4)
                          ).at[to].set(dest, mode="drop")
  return MissPlan(src, dest, miss.sum(dtype=jnp.int32), to.reshape(selected.shape))


def gather_misses(cfg: TierConfig, host_k, host_v, layer, selected, slot,
                  is_miss, first_chunk_always: bool = False) -> MissRows:
  """Gather one layer's missed rows from the host tier (XLA path).

  The compacted plan is gathered in ``ceil(misses / C)`` host gathers of
  C = ``cfg.fetch_rows_per_chunk`` rows: zero misses, zero transfers. The rows land
  in a small device buffer; the caller scatters them into the hot cache together
  with its other writes (one in-place update of the hot cache per layer).

  Args:
    host_k, host_v: [L, R, T+1, U, Hg, D] host tier.
    layer: i32[].
    selected, slot: i32[R, U, k] positions and the slots RESOLVE assigned them.
    is_miss: bool[R, U, k] entries to fetch.
    first_chunk_always: gather the first chunk outside the loop, unconditionally,
      so that XLA can schedule it asynchronously around independent work (a
      gather inside the dynamic loop completes before anything after the loop);
      costs one chunk of transfer per layer even without misses.
  """
  chunk = cfg.fetch_rows_per_chunk
  plan = plan_misses(layer, selected, slot, is_miss, chunk)
  num_chunks = (plan.count + chunk - 1) // chunk
  empty = jnp.zeros(plan.src.shape[:1] + host_k.shape[4:], host_k.dtype)

  def one_chunk(i, rows):
    rows_k, rows_v = rows
    part = jax.lax.dynamic_slice_in_dim(plan.src, i * chunk, chunk)
    got_k, got_v = gather_rows(host_k, host_v, part)
    rows_k = jax.lax.dynamic_update_slice_in_dim(rows_k, got_k, i * chunk, 0)
    rows_v = jax.lax.dynamic_update_slice_in_dim(rows_v, got_v, i * chunk, 0)
    return rows_k, rows_v

  first = 0
  rows = (empty, empty)
  if first_chunk_always:
    first = 1
    rows = one_chunk(0, rows)
    num_chunks = jnp.maximum(num_chunks, 1)
  rows_k, rows_v = jax.lax.fori_loop(first, num_chunks, one_chunk, rows)
  return MissRows(plan.dest, rows_k, rows_v, num_chunks * chunk, plan.lane)


def fetch_misses_kernel(cfg: TierConfig, host_k, host_v, hot_k, hot_v, layer,
                        selected, slot, is_miss):
  """Zero-copy path: the Pallas kernel copies exactly the missed rows in place.

  Returns (hot_k, hot_v, rows moved).
  """
  from pallas_kernels.fetch import fetch_rows
  plan = plan_misses(layer, selected, slot, is_miss)
  hot_k, hot_v = fetch_rows(plan.src, plan.dest, plan.count, host_k, host_v, hot_k,
                            hot_v, interpret=cfg.use_interpret)
  return hot_k, hot_v, plan.count


def scatter_rows(hot, dest, rows):
  """hot[dest[i]] = rows[i]; lanes with an out-of-range request are dropped."""
  return hot.at[dest[:, 0], dest[:, 1], dest[:, 2], dest[:, 3]].set(
      rows.astype(hot.dtype), mode="drop", unique_indices=True)


def append_rows(host_k, host_v, positions, rows_k, rows_v):
  """Write one position per request, every layer, into the host tier, in place.

  Args:
    host_k, host_v: [L, R, T+1, U, Hg, D].
    positions: i32[R] target position per request (T = the scratch row).
    rows_k, rows_v: [L, R, U, Hg, D] the rows (one strided write per request).
  """
  on_host = is_host_array(host_k)

  def one_request(r, carry):
    hk, hv = carry
    upd_k, upd_v = rows_k[:, r][:, None, None], rows_v[:, r][:, None, None]
    if on_host:
      upd_k, upd_v = jax.device_put(upd_k, Host), jax.device_put(upd_v, Host)
    start = (0, r, positions[r], 0, 0, 0)
    hk = jax.lax.dynamic_update_slice(hk, upd_k.astype(hk.dtype), start)
    hv = jax.lax.dynamic_update_slice(hv, upd_v.astype(hv.dtype), start)
    return hk, hv

  return jax.lax.fori_loop(0, positions.shape[0], one_request, (host_k, host_v))
