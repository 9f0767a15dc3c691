"""The selector protocol: how a sparse-attention rule plugs into the caches.

A selector names, per layer and decode step, the positions attention reads
(``i32[R, U, k]``, -1 padding). It may keep *resident state* on the device (Quest
page summaries, DSA indexer keys, NSA compressed keys): that state grows with the
context and is never offloaded (docs/DESIGN.md, "Selectors"), so it is counted in
the capacity tables via ``state_bytes_per_token``.

The same selector object serves the ``sparse`` backend (full KV on device) and the
``tiered`` backend (host tier + hot cache); both then attend over the same positions,
which is what makes the tiered outputs exact.

State layout: a pytree whose leaves carry a leading layer axis ``L`` (the layers
the selector serves), so a model's layer scan can slice and update it like any
other cache.

Update rule (position-idempotent): the state after ``select`` at position p is a
function of the state committed through p - 1 and the token at p alone. A select
writes only entries that belong to position p (set, never accumulate), so running
p again, with the same token or another, overwrites what the first run wrote. A
refused step can then be retried, and the look-ahead's uncommitted draft pass at
the next position needs no copy of the state to restore (docs/DESIGN.md,
"Refusal contract"). Running sums and bounds over a partial page or block are
therefore kept as a ring of its raw keys (``write_recent``), folded by a set.
"""

from __future__ import annotations

import functools
import fractions
import math
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp


class StepInputs(NamedTuple):
  """What a layer offers its selector at one decode step."""

  x: jax.Array  # [R, Dm] the normalised hidden state entering attention
  q: jax.Array  # [R, Hq, D] post-RoPE queries of the token being decoded
  k_new: jax.Array  # [R, Hkv, D] its post-RoPE key
  newest: jax.Array  # i32[R] its position (attention covers 0..newest)
  # i32[] the layer's index in the model, where the caller knows it (the ``state``
  # a selector gets may be a one-layer view; see ``Selector.select``)
  layer: jax.Array | int | None = None


class PrefillInputs(NamedTuple):
  """One layer's prompt, for building resident selector state."""

  x: jax.Array  # [R, P, Dm]
  k: jax.Array  # [R, P, Hkv, D] post-RoPE keys
  lens: jax.Array  # i32[R] valid prompt positions per request


class Selector(Protocol):
  """A sparse-attention selection rule (see the module docstring)."""

  num_units: int  # U: 1 (one selection per request) or Hkv (one per KV head)
  top_k: int  # k: positions per unit per step
  # Optional: True when ``prefill`` reads the layers' hidden inputs (``x``), not only
  # the keys (DSA's indexer); a chunked prefill then stages them.
  reads_hidden: bool

  def init_state(self, num_layers: int, num_requests: int, max_len: int) -> Any:
    """Empty resident state for ``num_layers`` layers."""

  def prefill(self, state: Any, layer, inputs: PrefillInputs, params: Any = None
              ) -> Any:
    """Fill one layer's resident state from its prompt (``layer`` may be traced).

    ``params`` as in ``select``: the DSA indexer needs its weights to turn the
    prompt's hidden states into index keys.
    """

  def select(self, state: Any, layer, inputs: StepInputs, params: Any = None
             ) -> tuple[jax.Array, Any]:
    """Absorb the newest token into the state, then choose positions.

    Returns (positions i32[R, U, k], new state). ``params`` holds learned selector
    weights for this layer where the rule has any (the DSA indexer). ``state`` is
    the whole layer-stacked state and ``layer`` indexes it (the tiered step and
    the sparse backend update it in place); a rule that depends on the layer
    itself reads ``inputs.layer``.
    """

  def state_bytes_per_token(self) -> int | float:
    """Resident bytes per token per layer per request (0 if stateless).

    A float where per-page/per-block state does not divide evenly into tokens.
    """

  # Optional: ``state_bytes_per_request() -> int``, resident bytes per layer per
  # request that do not grow with the context (the rings of ``write_recent``);
  # ``state_bytes`` reads 0 where a selector has none.
  #
  # Optional: ``state_block_tokens() -> int``, the positions one unit of the
  # growing state covers (a Quest page, an NSA stride): a request holds whole
  # units, so ``state_bytes`` rounds its length up to them (1 where absent).
  #
  # Optional: ``state_capacity(state) -> int``, the positions a state holds (its
  # writes past them are dropped inside jit); ``check_state_capacity`` compares it
  # with the cache's max_len.
  #
  # Optional: ``ranks_best_first(top_k) -> bool``, whether the first ``top_k`` of
  # a row are the rule's own selection at budget ``top_k``. The "rank" policy
  # attends them and steers victims by the rest (``check_ranking``); a rule
  # without it cannot rank deeper than it attends.


def state_bytes(selector, length: int) -> int:
  """Resident bytes of one layer's state for a request of ``length`` tokens."""
  fixed = getattr(selector, "state_bytes_per_request", None)
  block = getattr(selector, "state_block_tokens", None)
  block = block() if block else 1
  held = -(-length // block) * block  # whole units of the growing state
  # Bytes per token are a page's or stride's bytes over its tokens, a float when
  # they do not divide: as the exact fraction, so that whole pages round to none.
  per_token = fractions.Fraction(selector.state_bytes_per_token()).limit_denominator(1 << 20)
  return math.ceil(per_token * held) + (fixed() if fixed else 0)


def check_state_capacity(selector, state, max_len: int) -> None:
  """Trace-time: a state too short for ``max_len`` would drop the state writes of
  later positions inside jit and select from stale state, silently."""
  capacity = getattr(selector, "state_capacity", None)
  if state is not None and capacity is not None and capacity(state) < max_len:
    raise ValueError(f"the selector state holds {capacity(state)} positions, the "
                     f"cache max_len={max_len} (build it with init_state(..., max_len))")


def check_state_layout(state: Any, params: Any, num_layers: int,
                       num_requests: int) -> None:
  """Trace-time: the state stacked [L, R, ...] and the params [L, ...] for the
  layers the step runs. The layer index is traced: a shorter stack would be read
  at its last layer and written nowhere (a clamp, a dropped scatter), silently."""
  for leaf in jax.tree.leaves(state):
    if leaf.shape[:2] != (num_layers, num_requests):
      raise ValueError(f"a selector state leaf has shape {leaf.shape}, expected "
                       f"[L={num_layers}, R={num_requests}, ...]")
  for leaf in jax.tree.leaves(params):
    if leaf.shape[:1] != (num_layers,):
      raise ValueError(f"a selector params leaf has shape {leaf.shape}, expected "
                       f"[L={num_layers}, ...]")


def check_ranking(selector, top_k: int, width: int) -> None:
  """Trace-time: the "rank" policy attends the first ``top_k`` of a row of
  ``width``; that prefix must be the selector's own top-``top_k`` selection."""
  if width == top_k:
    return
  best_first = getattr(selector, "ranks_best_first", None)
  if best_first is None or not best_first(top_k):
    raise ValueError(f"{type(selector).__name__} rows of {width} are not ranked best "
                     f"first with its top-{top_k} selection as their prefix: the "
                     f"\"rank\" policy would attend positions the rule does not select")


def layer_slice(state: Any, layer) -> Any:
  """One layer of a layer-stacked state pytree."""
  return jax.tree.map(lambda x: x[layer], state)


def layer_update(state: Any, layer, new_layer_state: Any) -> Any:
  return jax.tree.map(lambda x, y: x.at[layer].set(y), state, new_layer_state)


def write_recent(recent, layer, k_new, newest):
  """The ring of a layer's most recent raw keys with the newest one set.

  Args:
    recent: f32[L, R, S, Hkv, D]; position p lives at slot p % S.
    k_new: [R, Hkv, D] the key at ``newest`` i32[R].

  Returns:
    (the updated ring, its layer f32[R, S, Hkv, D]).
  """
  size = recent.shape[2]
  req = jnp.arange(newest.shape[0])
  recent = recent.at[layer, req, newest % size].set(k_new.astype(recent.dtype))
  return recent, recent[layer]


def recent_from_prompt(keys, lens, size: int):
  """The ring ``write_recent`` leaves after decoding a prompt's keys one by one.

  Slot j holds the latest position p < lens with p % size == j (0 if none).

  Args:
    keys: [R, P, Hkv, D]; lens: i32[R] (<= P).

  Returns:
    f32[R, size, Hkv, D].
  """
  last = lens[:, None] - 1
  pos = last - jnp.mod(last - jnp.arange(size), size)  # [R, size]
  rows = jnp.take_along_axis(keys, jnp.clip(pos, 0, keys.shape[1] - 1)[..., None, None],
                             axis=1)
  return jnp.where((pos >= 0)[..., None, None], rows.astype(jnp.float32), 0.0)


def blocks_to_positions(blocks, block_size: int, newest):
  """Expand selected block ids i32[..., n] into positions i32[..., n * block_size].

  Positions past ``newest`` (the partial last block) and blocks = -1 become -1.
  """
  pos = blocks[..., None] * block_size + jnp.arange(block_size)
  keep = (blocks[..., None] >= 0) & (pos <= newest.reshape(
      newest.shape + (1,) * (pos.ndim - newest.ndim)))
  return jnp.where(keep, pos, -1).reshape(*blocks.shape[:-1], -1).astype(jnp.int32)


def masked_top_k(scores, valid, k: int):
  """Indices i32[..., k] of the ``k`` best valid entries of the last axis, best first.

  Entries past the number of valid ones are -1. Valid scores must be > -inf (an
  invalid entry could otherwise win a tie); ties go to the lower index.
  """
  _, idx = jax.lax.top_k(jnp.where(valid, scores, -jnp.inf), k)
  picked_valid = jnp.take_along_axis(jnp.broadcast_to(valid, scores.shape), idx, -1)
  return jnp.where(picked_valid, idx, -1).astype(jnp.int32)


def per_token(total_bytes: int, tokens: int) -> int | float:
  """``total_bytes / tokens``, as an int when it divides evenly."""
  return total_bytes // tokens if total_bytes % tokens == 0 else total_bytes / tokens


def check_picked(picked) -> None:
  """Trace-time: a selector's positions must be integers; a float row would be
  truncated where it is cast (1.9 attended as 1), silently."""
  if not jnp.issubdtype(picked.dtype, jnp.integer):
    raise ValueError(f"the selector returned {picked.dtype} positions; they must be "
                     "integers")


def check_step_shapes(inputs: StepInputs, num_kv_heads: int, q_per_kv: int,
                      head_dim: int) -> None:
  """Trace-time check of ``q``/``k_new`` against a selector's head configuration."""
  num_req = inputs.newest.shape[0]
  want_q = (num_req, num_kv_heads * q_per_kv, head_dim)
  want_k = (num_req, num_kv_heads, head_dim)
  if inputs.q.shape != want_q:
    raise ValueError(f"q has shape {inputs.q.shape}, expected {want_q} "
                     f"(R, num_kv_heads * q_per_kv, head_dim)")
  if inputs.k_new.shape != want_k:
    raise ValueError(f"k_new has shape {inputs.k_new.shape}, expected {want_k} "
                     f"(R, num_kv_heads, head_dim)")


def check_prefill_shapes(inputs: PrefillInputs, num_kv_heads: int, head_dim: int,
                         max_len: int, num_requests: int) -> None:
  """Trace-time check of a prompt's keys against the state's capacity and
  requests (a prompt batch of another size would rewrite other requests' rows)."""
  num_req, plen = inputs.k.shape[:2]
  if num_req != num_requests:
    raise ValueError(f"prompts for {num_req} requests; the state holds {num_requests}")
  if inputs.k.shape[2:] != (num_kv_heads, head_dim):
    raise ValueError(f"prompt keys have shape {inputs.k.shape}, expected "
                     f"(R, P, {num_kv_heads}, {head_dim})")
  if plen > max_len:
    raise ValueError(f"prompt length {plen} exceeds the state's max_len={max_len}")
  if inputs.lens.shape != (num_req,):
    raise ValueError(f"lens has shape {inputs.lens.shape}, expected ({num_req},)")


@functools.partial(jax.jit, static_argnames=("selector", "num_layers", "max_len"))
def prefill_state(selector, num_layers: int, max_len: int, params, x, k, lens):
  """A selector's resident state after prompts: every layer's ``prefill``.

  Args:
    x: [L, R, P, Dm] each layer's normalised prompt inputs (None for selectors
      that do not read them, ``reads_hidden`` False); k: [L, R, P, Hkv, D]
      post-RoPE keys; lens: i32[R]; params: per-layer selector params or None.
  """
  if k.shape[2] > max_len:  # the state rounds up (pages, blocks): it would take them
    raise ValueError(f"prompt length {k.shape[2]} exceeds max_len={max_len}")
  for name, stacked in (("k", k), ("x", x)):  # [layer] would clamp
    if stacked is not None and stacked.shape[0] != num_layers:
      raise ValueError(f"{name} stacks {stacked.shape[0]} layers, expected {num_layers}")
  state = selector.init_state(num_layers, k.shape[1], max_len)
  check_state_layout(state, params, num_layers, k.shape[1])

  def one_layer(layer, state):
    p = None if params is None else layer_slice(params, layer)
    x_l = None if x is None else x[layer]
    return selector.prefill(state, layer, PrefillInputs(x_l, k[layer], lens), p)

  return jax.lax.fori_loop(0, num_layers, one_layer, state)
