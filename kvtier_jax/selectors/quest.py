"""Quest: query-aware page selection from per-page key bounds (docs/DESIGN.md, "Selectors").

Each page of ``page_size`` positions keeps the elementwise max and min of its
post-RoPE keys per KV head. For a query ``q`` the page's upper bound on ``q . k``
is ``sum_d max(q_d * M_d, q_d * m_d)``; the pages with the largest bounds are read
in full. The current (partial) page is always read: it holds the token being
decoded.

Aggregation across heads (the feasibility study's choice): each query head's
bounds, scaled by ``1/sqrt(D)`` like attention logits, become a softmax over the
valid pages (pages holding any position <= newest); these per-head page
probabilities are summed over the ``G`` query heads of a KV head
(``granularity="kv_head"``: one selection per KV head, original Quest's grouping
at GQA granularity) or over all ``Hq`` heads (``granularity="layer"``: one
selection per request and layer, as SGLang's Quest and a per-(request, layer)
cache need). The softmax makes heads comparable: raw bounds of a head with large
query norm would otherwise decide the whole selection. (SGLang instead averages
queries within a group and sums raw bounds; original Quest selects per query
head, which a cache unit of one KV head cannot represent.)

Not modelled here: Quest's ``max(3, budget // page_size)`` page floor and its
dense first two layers (a model-level choice: give those layers no selector).

Extra shape letters: ``NP`` pages per request, ``ceil(T / page_size)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvtier_jax.batch_invariance import in_row_tiles
from kvtier_jax.selectors.base import (PrefillInputs, StepInputs, blocks_to_positions,
                                       check_prefill_shapes, check_step_shapes,
                                       masked_top_k, per_token, recent_from_prompt,
                                       write_recent)

GRANULARITIES = ("layer", "kv_head")
_PRECISION = jax.lax.Precision.HIGHEST  # f32 bounds on GPU too (no TF32)


class QuestState(NamedTuple):
  """Per-page key bounds (a page with no key holds -inf / +inf), and the raw keys
  of each request's current page: each step sets that page's bounds from them,
  so a step run twice at one position leaves what one run leaves."""

  page_max: jax.Array  # f32[L, R, NP, Hkv, D]
  page_min: jax.Array  # f32[L, R, NP, Hkv, D]
  recent: jax.Array  # f32[L, R, S, Hkv, D] position p at p % S (write_recent)


def page_bounds(q, page_max, page_min, q_per_kv: int):
  """Quest's per-query-head upper bounds ``U_h[p] / sqrt(D)``.

  ``max(q * M, q * m)`` equals ``relu(q) * M + min(q, 0) * m`` whenever
  ``M >= m``, which turns the bound into two matmuls. Pages without keys come out
  as NaN or -inf; callers mask them.

  Args:
    q: [R, Hq, D] post-RoPE queries.
    page_max, page_min: [R, NP, Hkv, D].

  Returns:
    f32[R, Hkv, G, NP].
  """
  num_req, _, head_dim = q.shape
  num_kv_heads = page_max.shape[2]
  q = q.astype(jnp.float32).reshape(num_req, num_kv_heads, q_per_kv, head_dim)
  bound = (jnp.einsum("rhgd,rphd->rhgp", jnp.maximum(q, 0.0), page_max,
                      precision=_PRECISION)
           + jnp.einsum("rhgd,rphd->rhgp", jnp.minimum(q, 0.0), page_min,
                        precision=_PRECISION))
  return bound / math.sqrt(head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuestSelector:
  """Quest page selection with a fixed token budget (see the module docstring).

  Attributes:
    token_budget: k, positions read per unit and step; a multiple of page_size.
    num_kv_heads / q_per_kv / head_dim: Hkv, G, D.
    page_size: positions per page (Quest's default 16).
    granularity: "layer" (U = 1) or "kv_head" (U = Hkv; the cache needs
      ``TierConfig(per_kv_head=True)``).
    row_tile: score over tiles of this many requests (``batch_invariance``: a
      request's selection the same bits whatever the batch; the model's
      ``decode_row_tile``). None: over the whole batch.
  """

  token_budget: int
  num_kv_heads: int
  q_per_kv: int
  head_dim: int
  page_size: int = 16
  granularity: str = "layer"
  row_tile: int | None = None

  def __post_init__(self):
    for name in ("token_budget", "num_kv_heads", "q_per_kv", "head_dim", "page_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.token_budget % self.page_size:
      raise ValueError(f"token_budget={self.token_budget} must be a multiple of "
                       f"page_size={self.page_size} (whole pages are read)")
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"granularity={self.granularity!r} must be one of {GRANULARITIES}")

  @property
  def num_units(self) -> int:  # U
    return self.num_kv_heads if self.granularity == "kv_head" else 1

  @property
  def top_k(self) -> int:  # k
    return self.token_budget

  @property
  def num_pages(self) -> int:
    """Pages read per unit and step, the current one included."""
    return self.token_budget // self.page_size

  def init_state(self, num_layers: int, num_requests: int, max_len: int) -> QuestState:
    if self.token_budget > max_len:
      raise ValueError(f"token_budget={self.token_budget} exceeds max_len={max_len}")
    shape = (num_layers, num_requests, -(-max_len // self.page_size),
             self.num_kv_heads, self.head_dim)
    ring = (num_layers, num_requests, self.page_size, self.num_kv_heads, self.head_dim)
    return QuestState(page_max=jnp.full(shape, -jnp.inf, jnp.float32),
                      page_min=jnp.full(shape, jnp.inf, jnp.float32),
                      recent=jnp.zeros(ring, jnp.float32))

  def prefill(self, state: QuestState, layer, inputs: PrefillInputs,
              params=None) -> QuestState:
    """Rebuilds the layer's page bounds from the prompt keys (positions >= lens
    ignored); pages past the prompt are reset to empty."""
    del params
    size = self.page_size
    num_pages_all = state.page_max.shape[2]
    check_prefill_shapes(inputs, self.num_kv_heads, self.head_dim,
                         num_pages_all * size, state.page_max.shape[1])
    num_req, plen = inputs.k.shape[:2]
    prompt_pages = -(-plen // size)
    keys = jnp.pad(inputs.k.astype(jnp.float32),
                   ((0, 0), (0, prompt_pages * size - plen), (0, 0), (0, 0)))
    keys = keys.reshape(num_req, prompt_pages, size, self.num_kv_heads, self.head_dim)
    valid = jnp.arange(prompt_pages * size) < inputs.lens[:, None]  # [R, NPp*S]
    valid = valid.reshape(num_req, prompt_pages, size, 1, 1)
    pmax = jnp.where(valid, keys, -jnp.inf).max(2)  # [R, NPp, Hkv, D]
    pmin = jnp.where(valid, keys, jnp.inf).min(2)
    empty = lambda fill: jnp.full(state.page_max.shape[1:], fill, jnp.float32)
    pmax = jax.lax.dynamic_update_slice(empty(-jnp.inf), pmax, (0,) * 4)
    pmin = jax.lax.dynamic_update_slice(empty(jnp.inf), pmin, (0,) * 4)
    recent = recent_from_prompt(inputs.k, inputs.lens, size)
    return QuestState(page_max=state.page_max.at[layer].set(pmax),
                      page_min=state.page_min.at[layer].set(pmin),
                      recent=state.recent.at[layer].set(recent))

  def page_scores(self, state: QuestState, layer, q, newest):
    """Per-unit page scores f32[R, U, NP] and page validity bool[R, NP]."""
    num_pages_all = state.page_max.shape[2]

    def scores_of(q, page_max, page_min, newest):
      bound = page_bounds(q, page_max, page_min, self.q_per_kv)  # [R, Hkv, G, NP]
      valid = jnp.arange(num_pages_all) <= (newest // self.page_size)[:, None]  # [R, NP]
      probs = jax.nn.softmax(jnp.where(valid[:, None, None], bound, -jnp.inf), axis=-1)
      scores = probs.sum(2)  # [R, Hkv, NP]
      if self.granularity == "layer":
        scores = scores.sum(1, keepdims=True)  # [R, 1, NP]
      return scores, valid

    return in_row_tiles(self.row_tile, scores_of, q, state.page_max[layer],
                        state.page_min[layer], newest)

  def select(self, state: QuestState, layer, inputs: StepInputs, params=None):
    """Sets the current page's bounds from its keys (``k_new`` the newest), then
    reads the current page and the ``num_pages - 1`` best other valid pages.

    Returns (positions i32[R, U, token_budget], state): the current page first,
    then the chosen pages best first; missing pages and positions past newest -1.
    """
    del params
    check_step_shapes(inputs, self.num_kv_heads, self.q_per_kv, self.head_dim)
    newest = inputs.newest.astype(jnp.int32)
    num_req = newest.shape[0]
    req = jnp.arange(num_req)
    current = newest // self.page_size  # [R]
    recent, rows = write_recent(state.recent, layer, inputs.k_new, newest)
    in_page = (jnp.arange(self.page_size) <= (newest % self.page_size)[:, None]
               )[..., None, None]  # [R, S, 1, 1] positions current * S .. newest
    state = QuestState(
        page_max=state.page_max.at[layer, req, current].set(
            jnp.where(in_page, rows, -jnp.inf).max(1)),
        page_min=state.page_min.at[layer, req, current].set(
            jnp.where(in_page, rows, jnp.inf).min(1)),
        recent=recent)

    scores, valid = self.page_scores(state, layer, inputs.q, newest)
    blocks = jnp.broadcast_to(current[:, None, None], (num_req, self.num_units, 1))
    if self.num_pages > 1:
      num_pages_all = valid.shape[1]
      others = valid & (jnp.arange(num_pages_all) != current[:, None])  # [R, NP]
      rest = masked_top_k(scores, others[:, None], self.num_pages - 1)
      blocks = jnp.concatenate([blocks, rest], axis=-1)  # [R, U, num_pages]
    return blocks_to_positions(blocks, self.page_size, newest), state

  def state_capacity(self, state: QuestState) -> int:
    return state.page_max.shape[2] * self.page_size

  def ranks_best_first(self, top_k: int) -> bool:
    """The current page, then pages best first: whole pages of a deeper row are
    the selection at their budget."""
    return top_k % self.page_size == 0

  def state_bytes_per_token(self) -> int | float:
    """Max and min f32 keys per KV head, once per page."""
    return per_token(2 * self.num_kv_heads * self.head_dim * 4, self.page_size)

  def state_block_tokens(self) -> int:
    """Bounds are kept per whole page."""
    return self.page_size

  def state_bytes_per_request(self) -> int:
    """The current page's raw f32 keys."""
    return self.page_size * self.num_kv_heads * self.head_dim * 4
