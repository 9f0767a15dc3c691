"""Row tiles: a request's numbers whatever the batch it is decoded in.

XLA picks a matmul's blocking (so the order of its sums), and how it vectorises a
reduction, by the op's shape, so a request's logits differ in the last bits between
engines of other slot counts (docs/DESIGN.md, "Moving a request between engines").
Row-wise work run over fixed tiles of rows has one shape whatever the batch.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def in_row_tiles(tile: int | None, fn: Callable, *rows: jax.Array):
  """``fn(*rows)`` computed over tiles of ``tile`` rows (the last padded with zeros),
  so each of its ops has ``tile`` rows whatever R is. At one tile the ops rounded
  otherwise than at two (likely: XLA inlines a one-trip loop, or simplifies a slice
  along an axis of one, and fuses the ops with their neighbours), so the trip count
  is hidden (an optimisation barrier) and the tiles have a spare, never computed.
  ``fn`` must be row-wise (row i of each output from row i of the inputs) and
  finite on zero rows. ``rows``: arrays [R, ...]; ``tile=None``: ``fn(*rows)``."""
  if tile is None:
    return fn(*rows)
  if tile <= 0:
    raise ValueError(f"a row tile of {tile} rows: it must be positive (or None)")
  num_rows = rows[0].shape[0]
  num_tiles = -(-num_rows // tile)
  # One spare tile, never computed: XLA drops a dynamic slice along an axis of
  # one, and the tiles' ops would fuse (and round) otherwise at one tile.
  slots = num_tiles + 1
  tiles = [jnp.pad(x, [(0, slots * tile - num_rows)] + [(0, 0)] * (x.ndim - 1))
           .reshape((slots, tile) + x.shape[1:]) for x in rows]
  shapes = jax.eval_shape(fn, *(t[0] for t in tiles))
  outs = jax.tree.map(lambda y: jnp.zeros((slots,) + y.shape, y.dtype), shapes)

  def one_tile(i, outs):
    ys = fn(*(t[i] for t in tiles))
    return jax.tree.map(lambda o, y: o.at[i].set(y), outs, ys)

  trips = jax.lax.optimization_barrier(jnp.int32(num_tiles))
  outs = jax.lax.fori_loop(0, trips, one_tile, outs)
  return jax.tree.map(lambda y: y.reshape((slots * tile,) + y.shape[2:])[:num_rows],
                      outs)
