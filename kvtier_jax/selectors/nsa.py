"""NSA's block selection (Native Sparse Attention, arXiv 2502.11089).

NSA attends three branches and gates them:

* **cmp**: attention over compressed keys/values, one per compression block of
  ``cmp_block`` (l) positions taken every ``cmp_stride`` (d) positions. The paper
  learns the compression ``phi`` (an MLP with intra-block positions); we use mean
  pooling, fla's simplification, with the paper's overlapping l = 32, d = 16.
* **slc**: attention over ``num_blocks`` (n) selection blocks of ``block_size``
  (l') positions, chosen per KV group from the cmp branch's probabilities.
* **win**: attention over the last ``window`` (w) positions.

Selection, per query head then per KV group (the paper's eq. for p_slc): ``p_cmp`` is the
softmax of ``q . K_cmp / sqrt(D)`` over the compression blocks complete at
``newest``; a selection block's importance is

  p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + off(m, n)]

(out-of-range indices ignored), summed over the group's G query heads. The paper
(and the spec) write ``off = -m - n``: with 0-based blocks whose compression block
i covers ``[i d, i d + l)`` that scores selection block j mostly by the content of
block j - 1 (for l=32, d=16, l'=64 it sums cmp blocks 4j-4..4j). ``importance=
"overlap"`` uses ``off = m - n`` instead, which sums exactly the compression blocks
overlapping block j, each weighted by how many stride chunks it has inside. Both
reduce to ``p_slc = p_cmp`` when l = l' = d (fla's setting). The default is
``"overlap"`` (the paper's evident intent; its literal index shift is a known
confusion, lucidrains/native-sparse-attention-pytorch#3); ``"paper"`` reproduces
the spec's formula for comparison.

Block choice: the first ``num_initial`` blocks and the ``num_local`` most recent
ones (the current partial block included) are forced; the remaining
``num_blocks`` slots go to the other blocks up to the current one by importance.

Cache positions: the tiered cache must hold every position a layer attends. The
slc and win branches read raw KV, so a unit's row is the selected blocks'
positions (``blocks_to_positions``) followed by the window ``newest-w+1..newest``,
with block positions inside the window dropped to -1 (deduplication in a static
row of ``k = n * l' + w``). The cmp branch reads only compressed keys, which are
the resident selector state here (compressed values, which its output also needs,
are attention state outside this selector).

Extra shape letters: ``NC`` compression blocks per request (``ceil(T / d)``: every
block that starts inside T; those running past T never complete), ``NB``
selection blocks (``ceil(T / l')``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax.batch_invariance import in_row_tiles
from kvtier_jax.selectors.base import (PrefillInputs, StepInputs, blocks_to_positions,
                                       check_prefill_shapes, check_step_shapes,
                                       masked_top_k, per_token, recent_from_prompt,
                                       write_recent)

IMPORTANCES = ("paper", "overlap")
_PRECISION = jax.lax.Precision.HIGHEST


class NSAState(NamedTuple):
  """Each complete compression block's key sum (its compressed key is the sum /
  ``cmp_block``, mean pooling; 0 until complete), and the last ``cmp_block`` raw
  keys, summed into a block by a set when its last position arrives: a step run
  twice at one position leaves what one run leaves."""

  cmp_key_sum: jax.Array  # f32[L, R, NC, Hkv, D]
  recent: jax.Array  # f32[L, R, S = l, Hkv, D] position p at p % l (write_recent)


def importance_offsets(block_size: int, cmp_block: int, cmp_stride: int,
                       importance: str) -> np.ndarray:
  """The ``(l'/d) * (l/d)`` offsets ``off(m, n)`` of the p_slc sum (with repeats)."""
  m = np.arange(block_size // cmp_stride)[:, None]
  n = np.arange(cmp_block // cmp_stride)[None, :]
  return (-m - n if importance == "paper" else m - n).reshape(-1)


def _masked_softmax(logits, mask):
  """Softmax over the last axis restricted to ``mask``; all zeros where nothing is
  unmasked (no complete compression block yet)."""
  probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
  return jnp.where(mask.any(-1, keepdims=True), probs, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NSASelector:
  """NSA block selection plus sliding window, one selection per KV head (U = Hkv).

  Attributes:
    num_kv_heads / q_per_kv / head_dim: Hkv, G, D.
    block_size: l', positions per selection block (paper 64).
    num_blocks: n, selection blocks per unit, forced ones included (paper 16).
    num_initial / num_local: forced first blocks / most recent blocks (1 / 2).
    window: w, sliding-window length (512); 0 disables the branch.
    cmp_block / cmp_stride: l / d of the mean-pooled compression (32 / 16).
    importance: "paper" (the spec's p_slc formula) or "overlap" (see module).
    row_tile: score over tiles of this many requests (``batch_invariance``: a
      request's selection the same bits whatever the batch; the model's
      ``decode_row_tile``). None: over the whole batch.
  """

  num_kv_heads: int
  q_per_kv: int
  head_dim: int
  block_size: int = 64
  num_blocks: int = 16
  num_initial: int = 1
  num_local: int = 2
  window: int = 512
  cmp_block: int = 32
  cmp_stride: int = 16
  importance: str = "overlap"
  row_tile: int | None = None

  def __post_init__(self):
    for name in ("num_kv_heads", "q_per_kv", "head_dim", "block_size", "num_blocks",
                 "cmp_block", "cmp_stride"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    for name in ("num_initial", "num_local", "window"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
    if self.num_initial + self.num_local > self.num_blocks:
      raise ValueError(f"num_initial + num_local = {self.num_initial + self.num_local} "
                       f"forced blocks exceed num_blocks={self.num_blocks}")
    if self.cmp_block % self.cmp_stride or self.block_size % self.cmp_stride:
      raise ValueError(f"cmp_block={self.cmp_block} and block_size={self.block_size} "
                       f"must be multiples of cmp_stride={self.cmp_stride} (the p_slc "
                       "sum counts stride chunks)")
    if self.importance not in IMPORTANCES:
      raise ValueError(f"importance={self.importance!r} must be one of {IMPORTANCES}")

  @property
  def num_units(self) -> int:  # U
    return self.num_kv_heads

  @property
  def top_k(self) -> int:  # k
    return self.num_blocks * self.block_size + self.window

  def init_state(self, num_layers: int, num_requests: int, max_len: int) -> NSAState:
    if self.top_k > max_len:
      raise ValueError(f"num_blocks * block_size + window = {self.top_k} exceeds "
                       f"max_len={max_len}")
    shape = (num_layers, num_requests, -(-max_len // self.cmp_stride),
             self.num_kv_heads, self.head_dim)
    ring = (num_layers, num_requests, self.cmp_block, self.num_kv_heads, self.head_dim)
    return NSAState(jnp.zeros(shape, jnp.float32), jnp.zeros(ring, jnp.float32))

  def prefill(self, state: NSAState, layer, inputs: PrefillInputs,
              params=None) -> NSAState:
    """Rebuilds the layer's compression-block sums from the prompt (positions >=
    lens ignored); blocks not complete inside it are reset to zero."""
    del params
    stride, ratio = self.cmp_stride, self.cmp_block // self.cmp_stride
    num_cmp = state.cmp_key_sum.shape[2]
    check_prefill_shapes(inputs, self.num_kv_heads, self.head_dim, num_cmp * stride,
                         state.cmp_key_sum.shape[1])
    num_req, plen = inputs.k.shape[:2]
    num_chunks = -(-plen // stride)
    keys = jnp.pad(inputs.k.astype(jnp.float32),
                   ((0, 0), (0, num_chunks * stride - plen), (0, 0), (0, 0)))
    valid = jnp.arange(num_chunks * stride) < inputs.lens[:, None]  # [R, P']
    keys = jnp.where(valid[..., None, None], keys, 0.0)
    chunk_sum = keys.reshape(num_req, num_chunks, stride, self.num_kv_heads,
                             self.head_dim).sum(2)  # [R, NCh, Hkv, D]
    # Block i covers chunks i..i+ratio-1 (a static loop over the ratio, l/d).
    padded = jnp.pad(chunk_sum, ((0, 0), (0, ratio - 1), (0, 0), (0, 0)))
    block_sum = sum(padded[:, m:m + num_chunks] for m in range(ratio))
    complete = (jnp.arange(num_chunks) * stride + self.cmp_block
                <= inputs.lens[:, None])  # [R, NCh]
    block_sum = jnp.where(complete[..., None, None], block_sum, 0.0)
    row = jax.lax.dynamic_update_slice(
        jnp.zeros(state.cmp_key_sum.shape[1:], jnp.float32), block_sum, (0,) * 4)
    recent = recent_from_prompt(inputs.k, inputs.lens, self.cmp_block)
    return NSAState(state.cmp_key_sum.at[layer].set(row),
                    state.recent.at[layer].set(recent))

  def absorb(self, state: NSAState, layer, k_new, newest) -> NSAState:
    """Puts the newest key in the ring; the block that ends at ``newest`` (if
    one does) gets the ring's sum, the keys of its ``cmp_block`` positions."""
    num_cmp = state.cmp_key_sum.shape[2]
    recent, rows = write_recent(state.recent, layer, k_new, newest)
    stride, ratio = self.cmp_stride, self.cmp_block // self.cmp_stride
    num_req = newest.shape[0]
    start = newest + 1 - self.cmp_block  # [R] of the block ending at newest
    ends = (start >= 0) & (start % stride == 0)
    block = jnp.where(ends, start // stride, num_cmp)  # num_cmp: dropped
    # Summed as prefill sums (stride chunks, then the chunks in position order), so
    # a state built step by step is the prefilled one bit for bit. The ring's
    # chunks are contiguous; the block's first sits at ring chunk start/d mod l/d.
    chunks = rows.reshape(num_req, ratio, stride, *rows.shape[2:]).sum(2)
    first = (jnp.maximum(start, 0) // stride) % ratio  # [R]
    at = lambda m: jnp.take_along_axis(
        chunks, ((first + m) % ratio)[:, None, None, None], 1)[:, 0]
    cmp_key_sum = state.cmp_key_sum.at[layer, jnp.arange(num_req), block].set(
        sum(at(m) for m in range(ratio)), mode="drop")
    return NSAState(cmp_key_sum, recent)

  def block_importance(self, state: NSAState, layer, q, newest):
    """Per-KV-group importance f32[R, Hkv, NB] of every selection block."""
    return in_row_tiles(self.row_tile, self._importance, q, state.cmp_key_sum[layer],
                        newest)

  def _importance(self, q, cmp_key_sum, newest):
    """``block_importance`` from one layer's key sums [R, NC, Hkv, D]."""
    num_req = q.shape[0]
    num_cmp = cmp_key_sum.shape[1]
    num_sel_blocks = -(-(num_cmp * self.cmp_stride) // self.block_size)
    cmp_keys = cmp_key_sum / self.cmp_block  # [R, NC, Hkv, D]
    qg = q.astype(jnp.float32).reshape(num_req, self.num_kv_heads, self.q_per_kv,
                                       self.head_dim)
    logits = jnp.einsum("rhgd,rchd->rhgc", qg, cmp_keys,
                        precision=_PRECISION) / math.sqrt(self.head_dim)
    complete = (jnp.arange(num_cmp) * self.cmp_stride + self.cmp_block - 1
                <= newest[:, None])  # [R, NC]
    p_cmp = _masked_softmax(logits, complete[:, None, None])  # [R, Hkv, G, NC]
    offsets = importance_offsets(self.block_size, self.cmp_block, self.cmp_stride,
                                 self.importance)
    per_block = self.block_size // self.cmp_stride  # l'/d
    idx = per_block * np.arange(num_sel_blocks)[:, None] + offsets  # [NB, n_off]
    in_range = (idx >= 0) & (idx < num_cmp)  # [NB, n_off] static
    terms = jnp.where(in_range, p_cmp[..., np.clip(idx, 0, num_cmp - 1)], 0.0)
    return terms.sum(-1).sum(2)  # [R, Hkv, NB]

  def select_blocks(self, state: NSAState, layer, inputs: StepInputs):
    """Absorbs ``k_new``, then chooses blocks: (i32[R, Hkv, n] best first with
    forced blocks leading, -1 padded; state)."""
    check_step_shapes(inputs, self.num_kv_heads, self.q_per_kv, self.head_dim)
    newest = inputs.newest.astype(jnp.int32)
    state = self.absorb(state, layer, inputs.k_new, newest)
    importance = self.block_importance(state, layer, inputs.q, newest)
    block = jnp.arange(importance.shape[-1])
    current = (newest // self.block_size)[:, None]  # [R, 1]
    valid = block <= current  # [R, NB]
    forced = (block < self.num_initial) | (block > current - self.num_local)
    key = jnp.where(forced[:, None], jnp.inf, importance)
    return masked_top_k(key, valid[:, None], self.num_blocks), state

  def select(self, state: NSAState, layer, inputs: StepInputs, params=None):
    """Returns (positions i32[R, Hkv, n * l' + w], state): the selected blocks'
    positions outside the window, then the window in order; -1 elsewhere."""
    del params
    blocks, state = self.select_blocks(state, layer, inputs)
    newest = inputs.newest.astype(jnp.int32)
    return window_union(blocks, self.block_size, self.window, newest), state

  def state_capacity(self, state: NSAState) -> int:
    # Rows are [chosen blocks..., window]: not ranked (no ``ranks_best_first``).
    return state.cmp_key_sum.shape[2] * self.cmp_stride

  def state_bytes_per_token(self) -> int | float:
    """One f32 key sum per KV head per compression block, a block every d tokens."""
    return per_token(self.num_kv_heads * self.head_dim * 4, self.cmp_stride)

  def state_block_tokens(self) -> int:
    """One key sum per ``cmp_stride`` positions, for every started stride."""
    return self.cmp_stride

  def state_bytes_per_request(self) -> int:
    """The last ``cmp_block`` raw f32 keys."""
    return self.cmp_block * self.num_kv_heads * self.head_dim * 4


def window_union(blocks, block_size: int, window: int, newest):
  """Positions of ``blocks`` i32[R, U, n] outside the window, then the window.

  Returns i32[R, U, n * block_size + window], distinct, -1 padded.
  """
  block_pos = blocks_to_positions(blocks, block_size, newest)
  block_pos = jnp.where(block_pos > (newest - window)[:, None, None], -1, block_pos)
  win = newest[:, None] - window + 1 + jnp.arange(window)  # [R, w]
  win = jnp.broadcast_to(jnp.where(win >= 0, win, -1)[:, None],
                         blocks.shape[:2] + (window,))
  return jnp.concatenate([block_pos, win], axis=-1).astype(jnp.int32)


def _attend(q, keys, values, mask, scale):
  """q [R, Hkv, G, D] over keys/values [R, N, Hkv, D] where mask [R, Hkv, G|1, N];
  zero output for a head with nothing to attend."""
  logits = jnp.einsum("rhgd,rnhd->rhgn", q, keys, precision=_PRECISION) * scale
  probs = _masked_softmax(logits, mask)
  return jnp.einsum("rhgn,rnhd->rhgd", probs, values, precision=_PRECISION)


def nsa_attention_reference(q, k_full, v_full, newest, sel_blocks, gates, *,
                            block_size: int = 64, window: int = 512,
                            cmp_block: int = 32, cmp_stride: int = 16):
  """NSA's gated three-branch decode output, as a plain functional reference.

  ``o = g_cmp * Attn(q, K_cmp, V_cmp) + g_slc * Attn(q, K_slc, V_slc)
  + g_win * Attn(q, K_win, V_win)`` with mean-pooled compression over the blocks
  complete at ``newest``, the selected blocks' positions <= newest, and the last
  ``window`` positions; logits scaled by ``1/sqrt(D)``. All branches share one K/V
  (the paper gives each branch its own projections). A branch with nothing to
  attend (no complete compression block yet, window 0) contributes zero.

  Args:
    q: [R, Hq, D] the newest token's queries.
    k_full, v_full: [R, T, Hkv, D] one layer's keys/values; positions > newest
      are never read (they may hold garbage).
    newest: i32[R].
    sel_blocks: i32[R, Hkv, n] selection blocks per KV group, -1 padding.
    gates: [R, Hq, 3] per-head gates for (cmp, slc, win).

  Returns:
    f32[R, Hq, D].
  """
  num_req, num_q_heads, head_dim = q.shape
  max_len, num_kv_heads = k_full.shape[1:3]
  q_per_kv = num_q_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim)
  qg = q.astype(jnp.float32).reshape(num_req, num_kv_heads, q_per_kv, head_dim)
  pos = jnp.arange(max_len)
  seen = (pos <= newest[:, None])[..., None, None]  # [R, T, 1, 1]
  k_full = jnp.where(seen, k_full.astype(jnp.float32), 0.0)
  v_full = jnp.where(seen, v_full.astype(jnp.float32), 0.0)

  num_cmp = (max_len - cmp_block) // cmp_stride + 1 if max_len >= cmp_block else 0
  if num_cmp:
    gather = np.arange(num_cmp)[:, None] * cmp_stride + np.arange(cmp_block)  # [NC, l]
    k_cmp = k_full[:, gather].mean(2)  # [R, NC, Hkv, D]
    v_cmp = v_full[:, gather].mean(2)
    complete = np.arange(num_cmp) * cmp_stride + cmp_block - 1 <= newest[:, None]
    out_cmp = _attend(qg, k_cmp, v_cmp, complete[:, None, None], scale)
  else:
    out_cmp = jnp.zeros_like(qg)

  in_sel = ((pos // block_size)[None, None, :, None] == sel_blocks[:, :, None, :]
            ).any(-1)  # [R, Hkv, T]
  in_sel &= pos <= newest[:, None, None]
  out_slc = _attend(qg, k_full, v_full, in_sel[:, :, None], scale)

  in_win = (pos <= newest[:, None]) & (pos > newest[:, None] - window)  # [R, T]
  out_win = _attend(qg, k_full, v_full, in_win[:, None, None], scale)

  gates = gates.astype(jnp.float32).reshape(num_req, num_kv_heads, q_per_kv, 3, 1)
  out = (gates[..., 0, :] * out_cmp + gates[..., 1, :] * out_slc
         + gates[..., 2, :] * out_win)
  return out.reshape(num_req, num_q_heads, head_dim)
