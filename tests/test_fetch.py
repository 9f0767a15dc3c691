"""The miss fetch and the hot-cache row scatter of the unfused step
(kvtier_jax/fetch.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import fetch, state as kv_state
from kvtier_jax.config import ImplConfig
from pallas_kernels import common
from tests.util import tier_cfg


def _draw(rng, L=2, R=3, U=2, S=5, N=24, dropped=10):
  """dest i32[N, 4] (layer, request, unit, slot): N - dropped distinct cells and
  ``dropped`` lanes whose request is out of range (R, or -1), shuffled."""
  cells = np.array([(l, r, u, s) for l in range(L) for r in range(R)
                    for u in range(U) for s in range(S)], np.int32)
  kept = cells[rng.permutation(len(cells))[:N - dropped]]
  drop = np.stack([rng.integers(0, L, dropped), rng.choice([R, -1], dropped),
                   rng.integers(0, U, dropped), rng.integers(0, S, dropped)], -1)
  dest = np.concatenate([kept, drop.astype(np.int32)])[rng.permutation(N)]
  return dest, (L, R, U, S)


def _rng():
  """A fresh draw, its seed in every failure message."""
  seed = int(np.random.SeedSequence().entropy % 2**32)
  return np.random.default_rng(seed), f"seed={seed}"


def test_dropped_lanes_get_distinct_out_of_range_requests():
  rng, seed = _rng()
  dest, (_, R, _, _) = _draw(rng)
  got = np.asarray(fetch.distinct_drops(jnp.asarray(dest), R))
  kept = (dest[:, 1] >= 0) & (dest[:, 1] < R)
  np.testing.assert_array_equal(got[kept], dest[kept], seed)  # kept lanes untouched
  np.testing.assert_array_equal(got[~kept][:, [0, 2, 3]], dest[~kept][:, [0, 2, 3]],
                                seed)
  assert (got[~kept, 1] >= R).all(), seed  # still out of range: dropped
  assert len({tuple(row) for row in got}) == len(got), seed  # unique_indices holds


def test_scatter_rows_writes_kept_lanes_and_drops_the_rest():
  """Against numpy: kept lanes land on their cells, nothing else changes; a
  request of -1 is dropped too (a plain ``.at[]`` would wrap it to R - 1)."""
  rng, seed = _rng()
  dest, (L, R, U, S) = _draw(rng)
  hot = rng.standard_normal((L, R, U, S, 2, 4)).astype(np.float32)
  rows = rng.standard_normal((len(dest), 2, 4)).astype(np.float32)
  want = hot.copy()
  for lane, (l, r, u, s) in enumerate(dest):
    if 0 <= r < R:
      want[l, r, u, s] = rows[lane]
  got = fetch.scatter_rows(jnp.asarray(hot), jnp.asarray(dest), jnp.asarray(rows))
  np.testing.assert_array_equal(np.asarray(got), want, seed)


@pytest.mark.parametrize("fetch_chunk", [None, 5, 64])  # default, many chunks, one
def test_fetch_misses_writes_exactly_the_missed_rows(fetch_chunk):
  """Against numpy: each miss's host row (through the page table) lands in its
  slot, in as many chunks as it takes (zero misses and every lane a miss
  included); every other hot row, NaN-poisoned, is untouched."""
  rng, seed = _rng()
  cfg = tier_cfg(impl=ImplConfig(fetch="xla", fetch_chunk=fetch_chunk), page_size=8)
  R, U, k, B = cfg.num_requests, cfg.num_units, cfg.top_k, cfg.hot_slots
  state = kv_state.init_state(cfg)
  host_k, host_v = (rng.standard_normal(state.host_k.shape).astype(np.float32)
                    for _ in range(2))
  hot_k, hot_v = (np.full(state.hot_k.shape, np.nan, np.float32) for _ in range(2))
  table = np.asarray(state.page_table)
  layer = int(rng.integers(cfg.num_layers))
  selected = np.stack([np.stack([rng.choice(cfg.max_len, k, replace=False)
                                 for _ in range(U)]) for _ in range(R)]).astype(np.int32)
  selected[rng.random(selected.shape) < 0.1] = -1  # padding
  slot = np.stack([np.stack([rng.permutation(B)[:k] for _ in range(U)])
                   for _ in range(R)]).astype(np.int32)
  for rate in (0.0, float(rng.uniform(0.05, 0.9)), 1.0):
    is_miss = (rng.random(selected.shape) < rate) & (selected >= 0)
    got_k, got_v, moved = jax.jit(fetch.fetch_misses, static_argnums=0)(
        cfg, jnp.asarray(host_k), jnp.asarray(host_v), jnp.asarray(table),
        jnp.asarray(hot_k), jnp.asarray(hot_v), jnp.int32(layer),
        jnp.asarray(selected), jnp.asarray(slot), jnp.asarray(is_miss))
    want_k, want_v = hot_k.copy(), hot_v.copy()
    for r, u, j in zip(*np.nonzero(is_miss)):
      pos = selected[r, u, j]
      page, off = table[r, pos // cfg.page_size], pos % cfg.page_size
      want_k[layer, r, u, slot[r, u, j]] = host_k[layer, page, off, u]
      want_v[layer, r, u, slot[r, u, j]] = host_v[layer, page, off, u]
    msg = f"{seed} rate={rate}"
    np.testing.assert_array_equal(np.asarray(got_k), want_k, msg)
    np.testing.assert_array_equal(np.asarray(got_v), want_v, msg)
    misses = int(is_miss.sum())
    chunk, lanes = cfg.fetch_rows_per_chunk, selected.size
    if common.on_gpu() and chunk < lanes:  # staged chunks: padding crosses the link
      assert int(moved) == -(-misses // chunk) * chunk, msg
    else:
      assert int(moved) == misses, msg
