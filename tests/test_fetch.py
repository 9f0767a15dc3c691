"""The hot-cache row scatter every unfused step ends with (kvtier_jax/fetch.py)."""

import jax.numpy as jnp
import numpy as np

from kvtier_jax import fetch


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
