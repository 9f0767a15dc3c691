"""Pure-jnp row copies out of the host tier: the references of the fetch kernels."""

from __future__ import annotations

import jax.numpy as jnp


def fetch_rows_reference(src, dest, count, host_k, host_v, hot_k, hot_v):
  """Copy ``count`` planned rows.

  Args:
    src: i32[N, 4] (layer, page, offset, unit) rows of the host tier.
    dest: i32[N, 4] (layer, request, unit, slot) rows of the hot cache.
    count: i32[] lanes 0..count-1 are valid (compacted plan).
    host_k, host_v: [L, NH+1, Pg, U, Hg, D].
    hot_k, hot_v: [L, R, U, S, Hg, D].

  Returns:
    (hot_k, hot_v) with the rows copied.
  """
  lanes = jnp.arange(src.shape[0])
  keep = lanes < count
  s = jnp.where(keep[:, None], src, 0)
  d = dest[:, 1]
  d = jnp.where(keep, d, hot_k.shape[1])  # out of range: dropped
  rows_k = host_k[s[:, 0], s[:, 1], s[:, 2], s[:, 3]]
  rows_v = host_v[s[:, 0], s[:, 1], s[:, 2], s[:, 3]]
  idx = (dest[:, 0], d, dest[:, 2], dest[:, 3])
  return (hot_k.at[idx].set(rows_k.astype(hot_k.dtype), mode="drop"),
          hot_v.at[idx].set(rows_v.astype(hot_v.dtype), mode="drop"))


def gather_rows_reference(src, count, host_k, host_v):
  """The ``count`` planned rows, compacted.

  Args:
    src: i32[N, 4] (layer, page, offset, unit) rows of the host tier.
    count: i32[] lanes 0..count-1 are valid.
    host_k, host_v: [L, NH+1, Pg, U, Hg, D].

  Returns:
    rows [2, N, Hg, D]: K then V; lanes >= count are zero (the kernel leaves them
    unwritten).
  """
  keep = (jnp.arange(src.shape[0]) < count)[:, None, None]
  s = jnp.where(keep[:, :, 0], src, 0)
  take = lambda host: jnp.where(keep, host[s[:, 0], s[:, 1], s[:, 2], s[:, 3]], 0)
  return jnp.stack([take(host_k), take(host_v)])
