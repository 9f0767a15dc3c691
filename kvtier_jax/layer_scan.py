"""The layer loop's inputs without dynamic slices (CUDA graphs).

XLA:GPU runs a dynamic slice of a loop's input, or of a loop-carried array at an
index the induction variable computes, as an address-only fusion that CUDA graphs
do not capture (jax 0.10) or as an async pair on another stream (jax >= 0.11):
either splits a layer's command buffer. Deviceless, the tiered step's layer then
reads 5 (0.10.2) or 9 (0.11.2) graph launches instead of 2
(experiments/hlo_audit.py). Small per-layer inputs (queries, new rows, the layer
index) are picked by a masked integer sum instead: one fusion inside the graph,
bit for bit ``xs[i]``.

One exception: with the miss gather on its own stream (``ImplConfig.fetch_stream``)
XLA 0.11.2's scheduler, which jax gives no hint there, put the hit attention
outside the gather's start and done once the slices were gone (deviceless, the
audit's 32K shape: 0 ops between them), even with the attention tied to the
gather's operands and result (``fetch.gather_misses_kernel``'s ``during``); that
step keeps the scan's slices (5 ops between them, the attention among them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SAME_WIDTH_INT = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def pick_layer(xs, i):
  """``xs[i]`` bit for bit (NaN payloads and -0.0 included): the masked sum has one
  non-zero term, taken over the values' bits. Reads all of ``xs``: for small
  per-layer inputs, not weights."""
  kind = jnp.iinfo if jnp.issubdtype(xs.dtype, jnp.integer) else jnp.finfo
  width = 8 if xs.dtype == jnp.bool_ else kind(xs.dtype).bits  # int4: 4 in a byte
  if jnp.issubdtype(xs.dtype, jnp.complexfloating) or width != 8 * xs.dtype.itemsize:
    raise TypeError(f"pick_layer takes whole-byte real or bool arrays, not {xs.dtype}")
  mask = (jnp.arange(xs.shape[0]) == i).reshape((-1,) + (1,) * (xs.ndim - 1))
  if xs.dtype == jnp.bool_:
    return jnp.where(mask, xs, False).any(0)
  bits = jax.lax.bitcast_convert_type(xs, _SAME_WIDTH_INT[xs.dtype.itemsize])
  picked = jnp.where(mask, bits, 0).sum(0, dtype=bits.dtype)
  return jax.lax.bitcast_convert_type(picked, xs.dtype)


def scan_layers(body, carry, xs, pick: bool = True):
  """``jax.lax.scan(body, carry, xs)`` with each trip's inputs taken by
  ``pick_layer`` (``pick=False``: by the scan's own slices). The trip counter
  only masks: an index the loop's induction variable computes would turn the
  body's own slices at that index into address-only fusions too."""
  if not pick:
    return jax.lax.scan(body, carry, xs)
  lengths = {a.shape[0] for a in jax.tree.leaves(xs)}
  if len(lengths) != 1:
    raise ValueError(f"the inputs have {sorted(lengths)} layers, not one count")
  num = lengths.pop()

  def trip(carry_i, _):
    carry, i = carry_i
    carry, out = body(carry, jax.tree.map(lambda a: pick_layer(a, i), xs))
    return (carry, i + 1), out

  (carry, _), out = jax.lax.scan(trip, (carry, jnp.int32(0)), None, length=num)
  return carry, out
