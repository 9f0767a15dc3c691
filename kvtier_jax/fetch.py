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

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on
from jax.experimental.xla_metadata import set_xla_metadata
try:  # jax <= 0.10: the function transform is compute_on2 (compute_on: a context)
  from jax.experimental.compute_on import compute_on2 as host_compute
except ImportError:  # jax >= 0.11: compute_on itself takes (f, compute_type, out_memory_spaces)
  from jax.experimental.compute_on import compute_on as host_compute
STREAM_CONTEXT_FORM = host_compute is not compute_on

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


def host_location(cfg: TierConfig, page_table, positions):
  """(page, offset) i32 of each position i32[R, ...] through the page table
  i32[R, MP]: the scratch page where a position has no page (or is padding)."""
  pos = jnp.clip(positions, 0, cfg.max_len - 1)
  row = jnp.arange(page_table.shape[0]).reshape((-1,) + (1,) * (positions.ndim - 1))
  page = page_table[row, pos // cfg.page_size]
  has_page = (positions >= 0) & (page >= 0)
  return (jnp.where(has_page, page, cfg.num_host_pages),
          jnp.where(has_page, pos % cfg.page_size, 0))


class MissPlan(NamedTuple):
  """One layer's misses compacted to the front of N lanes."""

  src: jax.Array  # i32[N, 4] (layer, page, offset, unit) in the host tier
  dest: jax.Array  # i32[N, 4] (layer, request, unit, slot); request = R: unused lane
  count: jax.Array  # i32[] valid lanes
  lane: jax.Array  # i32[R, U, k] lane of each selected entry (>= count: not a miss)


def plan_misses(cfg: TierConfig, page_table, layer, selected, slot, is_miss,
                lanes_multiple: int = 1) -> MissPlan:
  """Compact the missed (page, offset, unit, slot) of one layer.

  Unused lanes read row (layer, 0, 0, 0), which always exists, and write out of
  range (dropped). N is R*U*k rounded up to ``lanes_multiple``.
  """
  num_req, num_units, num_sel = selected.shape
  page, offset = host_location(cfg, page_table, selected)
  req = jnp.broadcast_to(jnp.arange(num_req, dtype=jnp.int32)[:, None, None],
                         selected.shape)
  unit = jnp.broadcast_to(jnp.arange(num_units, dtype=jnp.int32)[None, :, None],
                          selected.shape)
  lanes = num_req * num_units * num_sel
  padded = common.cdiv(lanes, lanes_multiple) * lanes_multiple
  miss = is_miss.reshape(-1)
  to = jnp.where(miss, jnp.cumsum(miss, dtype=jnp.int32) - 1, padded)
  layer_col = jnp.full_like(req, layer)
  src = jnp.stack([layer_col, page, offset, unit], axis=-1).reshape(lanes, 4)
  dest = jnp.stack([layer_col, req, unit, slot], axis=-1).reshape(lanes, 4)
  src = jnp.zeros((padded, 4), jnp.int32).at[to].set(src, mode="drop")
  src = src.at[:, 0].set(layer)
  dest = jnp.broadcast_to(jnp.array([0, num_req, 0, 0], jnp.int32), (padded, 4)
                          ).at[to].set(dest, mode="drop")
  return MissPlan(src, dest, miss.sum(dtype=jnp.int32), to.reshape(selected.shape))


def gather_misses(cfg: TierConfig, host_k, host_v, page_table, layer, selected, slot,
                  is_miss, first_chunk_always: bool = False) -> MissRows:
  """Gather one layer's missed rows from the host tier (XLA path).

  The compacted plan is gathered in ``ceil(misses / C)`` host gathers of
  C = ``cfg.fetch_rows_per_chunk`` rows: zero misses, zero transfers. The rows land
  in a small device buffer; the caller scatters them into the hot cache right
  before its other writes (in place). When C covers every lane (the default off
  GPU) it is one unconditional gather instead. The overlapped attention reads
  the staged rows; the other callers go through ``fetch_misses``.

  Args:
    host_k, host_v: [L, NH+1, Pg, U, Hg, D] host tier; page_table: i32[R, MP].
    layer: i32[].
    selected, slot: i32[R, U, k] positions and the slots RESOLVE assigned them.
    is_miss: bool[R, U, k] entries to fetch.
    first_chunk_always: gather the first chunk outside the loop, unconditionally,
      so that XLA can schedule it asynchronously around independent work (a
      gather inside the dynamic loop completes before anything after the loop);
      costs one chunk of transfer per layer even without misses.
  """
  chunk = cfg.fetch_rows_per_chunk
  plan = plan_misses(cfg, page_table, layer, selected, slot, is_miss, chunk)
  if chunk == plan.src.shape[0]:
    # One chunk covers every lane (the default off GPU): gather them all at once,
    # no loop, no staging buffer, no branch (each cost more than the padding lanes,
    # which re-read row (layer, 0, 0, 0) and are dropped by the scatter). Counted
    # as moved: the misses.
    rows_k, rows_v = gather_rows(host_k, host_v, plan.src)
    return MissRows(plan.dest, rows_k, rows_v, plan.count, plan.lane)
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


def fetch_misses(cfg: TierConfig, host_k, host_v, page_table, hot_k, hot_v, layer,
                 selected, slot, is_miss, first_chunk_always: bool = False):
  """Fetch one layer's missed rows into their slots (XLA path).

  On a GPU the rows are staged by ``gather_misses`` (its first chunk can run
  asynchronously around independent work) and scattered. Elsewhere each chunk of
  C = ``cfg.direct_fetch_rows_per_chunk`` compacted lanes goes straight from the host
  tier to its slots: ``ceil(misses / C)`` gather + scatter pairs (none without
  misses), no staging buffer. Rows moved count the misses, as the zero-copy
  kernel's do (nothing crosses a link here; the padding lanes' reads are
  dropped). Gathering every lane in one go, as before, re-read a row per hit
  (2048 lanes for ~270 misses in ``bench_decode``) and cost that step ~7% more
  (WORKSPACE_NOTES.md, eighteenth session).

  Returns (hot_k, hot_v, rows moved).
  """
  if common.on_gpu():
    rows = gather_misses(cfg, host_k, host_v, page_table, layer, selected, slot,
                         is_miss, first_chunk_always)
    return (scatter_rows(hot_k, rows.dest, rows.k), scatter_rows(hot_v, rows.dest, rows.v),
            rows.moved)
  chunk = cfg.direct_fetch_rows_per_chunk
  plan = plan_misses(cfg, page_table, layer, selected, slot, is_miss, chunk)

  def one_chunk(i, hot):  # lanes [i * C, (i + 1) * C) of the plan: in range
    src = jax.lax.dynamic_slice_in_dim(plan.src, i * chunk, chunk)
    dest = jax.lax.dynamic_slice_in_dim(plan.dest, i * chunk, chunk)
    rows_k, rows_v = gather_rows(host_k, host_v, src)
    return scatter_rows(hot[0], dest, rows_k), scatter_rows(hot[1], dest, rows_v)

  num_chunks = (plan.count + chunk - 1) // chunk
  hot_k, hot_v = jax.lax.fori_loop(0, num_chunks, one_chunk, (hot_k, hot_v))
  return hot_k, hot_v, plan.count


def fetch_misses_kernel(cfg: TierConfig, host_k, host_v, page_table, hot_k, hot_v,
                        layer, selected, slot, is_miss):
  """Zero-copy path: the Pallas kernel copies exactly the missed rows in place.

  Returns (hot_k, hot_v, rows moved).
  """
  from pallas_kernels.fetch import fetch_rows
  plan = plan_misses(cfg, page_table, layer, selected, slot, is_miss)
  hot_k, hot_v = fetch_rows(plan.src, plan.dest, plan.count, host_k, host_v, hot_k,
                            hot_v, interpret=cfg.use_interpret)
  return hot_k, hot_v, plan.count


def gather_misses_kernel(cfg: TierConfig, host_k, host_v, page_table, layer, selected,
                         slot, is_miss, during=None) -> MissRows | tuple[MissRows, Any]:
  """Zero-copy gather of one layer's missed rows into a staging buffer (Pallas).

  With ``cfg.impl.fetch_stream`` = N (compiled, not interpreted) the kernel runs on
  CUDA stream N (``on_stream``): XLA makes the streamed call an async
  ``call-start`` / ``call-done`` pair. The ``pinned_host`` operands pass into the
  call without a copy (experiments/hlo_audit.py checks both).

  ``during``: ``(fn, x)``, work to run while the rows are in flight (the hit
  attention of query ``x``); returns ``(rows, fn(x))``. ``fn`` waits for the
  gather's operands, and the staged rows are read only after ``fn``'s result
  exists: nothing keeps ``fn`` out of the gather's window. Where XLA puts the
  start and done is still its choice (jax >= 0.11 gives the streamed call no
  scheduler hint; deviceless, both versions: ``fn`` between them,
  WORKSPACE_NOTES.md, seventeenth session).
  """
  from pallas_kernels.fetch import BlockSizes, gather_rows_call
  blocks = BlockSizes()
  plan = plan_misses(cfg, page_table, layer, selected, slot, is_miss, blocks.block_rows)
  interpret = cfg.use_interpret
  gather = functools.partial(gather_rows_call, block_sizes=blocks, interpret=interpret)
  if cfg.impl.fetch_stream is not None and not interpret:
    gather = on_stream(gather, cfg.impl.fetch_stream)
  staged = gather(plan.src, plan.count, host_k, host_v)  # [2, N, Hg, D]: K, V
  result = None
  if during is not None:
    fn, x = during
    x, _ = jax.lax.optimization_barrier((x, (plan.src, plan.count)))
    result, staged = jax.lax.optimization_barrier((fn(x), staged))
  rows = MissRows(plan.dest, staged[0], staged[1], plan.count, plan.lane)
  return rows if during is None else (rows, result)


def on_stream(fn, stream: int):
  """``fn`` (returning one device array) as one async call on CUDA stream ``stream``.

  jax <= 0.10 (compute_on's context form around a jit): XLA's scheduler skips
  the streamed computation unless the call carries the ``force_delay`` hint, and
  the start and done then sit back to back. jax >= 0.11 (the function form, which
  puts its own attributes on the call): the scheduler places it by itself. The
  result must be one array: XLA >= 0.11 wraps each get-tuple-element of a
  streamed tuple in an async pair of its own, and overlaps those instead.
  """
  stream_type = f"gpu_stream:{stream}"
  if not STREAM_CONTEXT_FORM:
    return compute_on(fn, compute_type=stream_type, out_memory_spaces=Device)
  # The kernel must sit directly in the streamed jit: a nested jit (the public
  # gather_rows) loses the stream ("No ExecutionStreamId found").
  streamed = compute_on(stream_type)(jax.jit(fn))

  def hinted(*args):
    with set_xla_metadata(scheduler_hint="force_delay"):
      return streamed(*args)

  return hinted


def scatter_rows(hot, dest, rows):
  """hot[dest[i]] = rows[i]; lanes with an out-of-range request are dropped.

  The kept lanes name distinct slots, so the scatter promises XLA unique indices
  (no atomics on a GPU); ``distinct_drops`` keeps that promise for the dropped
  lanes too, which would otherwise share one out-of-range destination.
  """
  dest = distinct_drops(dest, hot.shape[1])
  return hot.at[dest[:, 0], dest[:, 1], dest[:, 2], dest[:, 3]].set(
      rows.astype(hot.dtype), mode="drop", unique_indices=True)


def distinct_drops(dest, num_requests: int):
  """``dest`` i32[N, 4] (layer, request, unit, slot) with each lane whose request
  is outside [0, num_requests) moved to its own out-of-range request
  (``num_requests + lane``): still dropped, no longer sharing a destination."""
  lane = jnp.arange(dest.shape[0], dtype=dest.dtype)
  req = dest[:, 1]
  kept = (req >= 0) & (req < num_requests)
  return dest.at[:, 1].set(jnp.where(kept, req, num_requests + lane))


def append_rows(host_k, host_v, pages, offsets, rows_k, rows_v):
  """Write one position per request, every layer, into the host tier, in place.

  Args:
    host_k, host_v: [L, NH+1, Pg, U, Hg, D].
    pages, offsets: i32[R] where each request's row goes (the scratch page NH for
      a write that must not land).
    rows_k, rows_v: [L, R, U, Hg, D] the rows (one strided write per request).
  """
  on_host = is_host_array(host_k)

  def one_request(r, carry):
    hk, hv = carry
    upd_k, upd_v = rows_k[:, r][:, None, None], rows_v[:, r][:, None, None]
    if on_host:
      upd_k, upd_v = jax.device_put(upd_k, Host), jax.device_put(upd_v, Host)
    start = (0, pages[r], offsets[r], 0, 0, 0)
    hk = jax.lax.dynamic_update_slice(hk, upd_k.astype(hk.dtype), start)
    hv = jax.lax.dynamic_update_slice(hv, upd_v.astype(hv.dtype), start)
    return hk, hv

  return jax.lax.fori_loop(0, pages.shape[0], one_request, (host_k, host_v))


def write_pages(host_k, host_v, pages, k_pages, v_pages):
  """Write whole pages into the host tier, in place: page ``pages[i]`` <-
  ``k_pages[:, i]`` (i32[N]; the scratch page for pages that must not land).

  k_pages, v_pages: [L, N, Pg, U, Hg, D] on the device; one strided
  ``dynamic_update_slice`` per page (async and copy-free on XLA:GPU).
  """
  on_host = is_host_array(host_k)

  def one_page(i, carry):
    hk, hv = carry
    upd_k = jax.lax.dynamic_slice_in_dim(k_pages, i, 1, axis=1)
    upd_v = jax.lax.dynamic_slice_in_dim(v_pages, i, 1, axis=1)
    if on_host:
      upd_k, upd_v = jax.device_put(upd_k, Host), jax.device_put(upd_v, Host)
    start = (0, pages[i], 0, 0, 0, 0)
    hk = jax.lax.dynamic_update_slice(hk, upd_k.astype(hk.dtype), start)
    hv = jax.lax.dynamic_update_slice(hv, upd_v.astype(hv.dtype), start)
    return hk, hv

  return jax.lax.fori_loop(0, pages.shape[0], one_page, (host_k, host_v))
