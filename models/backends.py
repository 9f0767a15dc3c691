"""Cache backends for ``Transformer.decode``: dense, sparse and tiered.

* ``dense``: every position's K/V on device, full attention (models/cache.py).
* ``sparse``: every position's K/V on device; a selector names the positions each
  layer attends (the sparse-attention reference).
* ``tiered``: the host tier + hot cache of kvtier_jax, with the same selector: the
  library's one per-layer ``tiered_attend`` inside the model's layer scan, driven
  by the library's ``TieredDriver``.

Sparse and tiered run the same selector on the same inputs and attend over the same
rows with the same float operations, so their logits agree (bit for bit with the XLA
kernels): this is the exactness claim ``experiments/parity.py`` checks. Each backend
is an ``attend`` function (static: built once per configuration and cached) plus a
carry pytree threaded through the model's layer scan; ``Runner`` drives prefill and
decode steps with donated state.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import decode as kv_decode
from kvtier_jax import state as kv_state
from kvtier_jax.attention import full_kv_attention
from kvtier_jax.config import TierConfig
from kvtier_jax.draft import PromptLookup
from kvtier_jax.driver import StepRefused, TieredDriver
from kvtier_jax.selectors.base import (StepInputs, check_picked, check_state_capacity,
                                       check_state_layout, layer_slice, prefill_state)
from models import cache as cache_lib
from models.config import ModelConfig
from models.draft_head import draft_tokens
from models.transformer import Transformer, apply_decode, apply_prefill_with_inputs

BACKENDS = ("dense", "sparse", "tiered")


def warn_past_context(cfg: ModelConfig, max_len: int) -> None:
  """RoPE past the trained context extrapolates: allowed (performance runs on
  random weights), but said."""
  if cfg.max_context is not None and max_len > cfg.max_context:
    warnings.warn(f"max_len={max_len} exceeds {cfg.name}'s trained context of "
                  f"{cfg.max_context} tokens: positions past it extrapolate RoPE",
                  stacklevel=3)


def check_tokens(tokens, vocab_size: int) -> None:
  """Token ids outside the vocabulary would be clamped by the embedding gather."""
  tokens = np.asarray(tokens)
  if tokens.dtype.kind not in "iu":
    raise ValueError(f"token ids must be integers, not {tokens.dtype}")
  bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
  if bad.size:
    raise ValueError(f"token ids {bad[:5].tolist()} must be in [0, {vocab_size})")


def check_backend(backend: str, selector, hot_slots: int | None, num_layers: int,
                  index_share: int = 1) -> None:
  """Refuses a backend name, or a backend missing what it needs (Runner,
  ServingModel), before anything is built (an index sharing that does not divide
  the layers failed at the first decode step, after the prefill)."""
  if backend not in BACKENDS:
    raise ValueError(f"{backend=} must be one of {BACKENDS}")
  if index_share < 1 or num_layers % index_share:
    raise ValueError(f"index_share={index_share} must divide num_layers={num_layers}")
  if backend != "dense" and selector is None:
    raise ValueError(f"the {backend} backend needs a selector")
  if backend == "tiered" and hot_slots is None:
    raise ValueError("the tiered backend needs hot_slots (B)")


def tiled_selector(selector, cfg: ModelConfig):
  """``selector`` scoring over the model's ``decode_row_tile`` (a selector that
  scores, built without it, would leave the step's selection batch-dependent)."""
  if selector is None or getattr(selector, "row_tile", cfg.decode_row_tile) == (
      cfg.decode_row_tile):
    return selector
  return dataclasses.replace(selector, row_tile=cfg.decode_row_tile)


@flax.struct.dataclass
class SparseCarry:
  kv: cache_lib.DenseKV
  sel: Any  # selector state, leaves [L, ...]
  params: Any  # selector params per layer (DSA indexer) or None
  shared: jax.Array  # i32[R, U, k] the current anchor's positions (index sharing)
  # i32[R]: where the selector updates, when not at ``kv.lens`` (the serving step's
  # inactive rows write their K/V nowhere, at T, but update their selector at their
  # own next position, which their next step overwrites: selectors.base).
  select_at: jax.Array | None = None


def _unit_view(x, num_units: int):
  """[L, R, T, Hkv, D] -> [L, R, T, U, Hg, D] (a reshape, no copy)."""
  return x.reshape(*x.shape[:3], num_units, x.shape[3] // num_units, x.shape[4])


@functools.cache
def sparse_attend(selector, index_share: int = 1, row_tile: int | None = None):
  """The sparse backend's ``attend`` (cached: a static argument). With
  ``index_share`` N > 1 only anchor layers select; the next N - 1 reuse them;
  ``row_tile``: the attention over tiles of that many requests (the model's
  ``decode_row_tile``)."""

  def attend(layer, q, k_new, v_new, carry: SparseCarry, x, member: int = 0):
    kv = carry.kv
    check_state_capacity(selector, carry.sel, kv.max_len)
    check_state_layout(carry.sel, carry.params, *kv.k.shape[:2])
    k, v = cache_lib.write_newest(kv, layer, k_new, v_new)
    if member == 0:
      params = None if carry.params is None else layer_slice(carry.params, layer)
      newest = kv.lens if carry.select_at is None else carry.select_at
      positions, sel = selector.select(carry.sel, layer,
                                       StepInputs(x, q, k_new, newest, layer), params)
      check_picked(positions)
      carry = carry.replace(sel=sel, shared=positions)
    units = selector.num_units
    out, _ = full_kv_attention(q, _unit_view(k, units), _unit_view(v, units), layer,
                               carry.shared, row_tile)
    return out, carry.replace(kv=kv.replace(k=k, v=v))

  attend.index_share = index_share
  return attend


def lookup_or_head(match: tuple[int, int], head_token: int, min_match: int = 2) -> int:
  """The prompt-lookup draft (``match``: ``ngram_match``'s (token, n)) where an
  n-gram of at least ``min_match`` tokens matched, else ``head_token`` (a trained
  draft head's): on held-out text it beats either alone, where a shorter match is
  mostly a guess from the last token (WORKSPACE_NOTES.md, twenty-first session)."""
  token, n = match
  return token if n >= min_match else int(head_token)


# Jitted steps (configs and selector static; the carry donated). --------------


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def _dense_step(cfg: ModelConfig, weights, tokens, kv):
  logits, kv = apply_decode(cfg, weights, tokens, kv.lens, kv, cache_lib.dense_attend)
  return logits, cache_lib.advance(kv)


@functools.partial(jax.jit, static_argnames=("cfg", "selector", "index_share"),
                   donate_argnames=("carry",))
def _sparse_step(cfg: ModelConfig, selector, index_share: int, weights, tokens,
                 carry: SparseCarry):
  logits, carry = apply_decode(cfg, weights, tokens, carry.kv.lens, carry,
                               sparse_attend(selector, index_share, cfg.decode_row_tile))
  return logits, carry.replace(kv=cache_lib.advance(carry.kv))


@functools.partial(jax.jit, static_argnames=("cfg", "tier_cfg", "selector", "features"),
                   donate_argnames=("carry",))
def tiered_step(cfg: ModelConfig, tier_cfg: TierConfig, selector, weights, tokens,
                carry: kv_decode.TieredCarry, features: bool = False):
  """One model decode step through the tiered cache: (logits f32[R, V], carry);
  ``features``: ((logits, the last layer's hidden state [R, E]), carry)."""
  carry = kv_decode.begin_step(tier_cfg, carry)
  logits, carry, *hidden = apply_decode(cfg, weights, tokens, carry.tier.seq_len, carry,
                                        kv_decode.tiered_attend(tier_cfg, selector),
                                        return_features=features)
  return (logits, *hidden) if features else logits, kv_decode.commit_step(carry)


@functools.partial(jax.jit, static_argnames=("cfg", "tier_cfg", "selector"),
                   donate_argnames=("carry",))
def tiered_draft_pass(cfg: ModelConfig, tier_cfg: TierConfig, selector, weights,
                      tokens, carry: kv_decode.TieredCarry):
  """Look-ahead (OasisKV): run a draft token at each active request's next
  position without committing it; its capped misses are the prefetch
  (``decode.finish_draft``). A request without the page of that position sits
  the pass out (its step would refuse the whole batch's)."""
  carry = carry.replace(active=carry.active & ~kv_decode.rows_without_room(tier_cfg,
                                                                             carry.tier))
  before = kv_decode.begin_step(tier_cfg, carry)
  _, after = apply_decode(cfg, weights, tokens, carry.tier.seq_len, before,
                          kv_decode.tiered_attend(tier_cfg, selector, draft=True))
  return kv_decode.finish_draft(before, after)


@functools.partial(jax.jit, static_argnames=("tier_cfg",), donate_argnames=("tier",))
def _tier_prefill(tier_cfg: TierConfig, tier, k, v, lens):
  return kv_decode.prefill(tier_cfg, tier, k, v, lens)


def tier_config(cfg: ModelConfig, selector, num_requests: int, max_len: int,
                hot_slots: int, **overrides) -> TierConfig:
  """The TierConfig that serves ``selector`` on ``cfg`` (every layer tiered).

  Under the "rank" policy the selector is built at ``top_k = rank_depth`` (its
  best-first ranking) and ``overrides`` name the attended ``top_k``; otherwise
  ``top_k`` is the selector's.
  """
  per_kv_head = selector.num_units == cfg.num_kv_heads and cfg.num_kv_heads > 1
  overrides = dict(overrides)
  top_k = overrides.pop("top_k", selector.top_k)
  tier_cfg = TierConfig(num_layers=cfg.num_layers, num_requests=num_requests,
                        max_len=max_len, num_q_heads=cfg.num_q_heads,
                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                        hot_slots=hot_slots, top_k=top_k, per_kv_head=per_kv_head,
                        dtype=jnp.dtype(cfg.dtype), row_tile=cfg.decode_row_tile,
                        **overrides)
  if tier_cfg.policy.name == "rank" and tier_cfg.policy.rank_depth <= top_k:
    # An evictable slot is never in the selection: a ranking no deeper than it
    # leaves the EMA term alone, and the victims would be "freq"'s.
    raise ValueError(f"policy 'rank' needs a ranking deeper than the selection: "
                     f"rank_depth={tier_cfg.policy.rank_depth} <= top_k={top_k} (the "
                     "policy tables rank 1024 at k=256; or use policy 'freq')")
  if tier_cfg.select_width != selector.top_k:
    raise ValueError(f"the selector returns {selector.top_k} positions per row; "
                     f"top_k={tier_cfg.top_k}, policy={tier_cfg.policy.name!r} and "
                     f"rank_depth={tier_cfg.policy.rank_depth} need "
                     f"{tier_cfg.select_width}")
  return tier_cfg


class Runner:
  """Prefill and step one backend over a batch of requests (state donated).

  Args:
    model: the Transformer.
    backend: "dense", "sparse" or "tiered".
    max_len: positions per request the cache holds.
    selector, selector_params: the sparse-attention rule (sparse / tiered).
    hot_slots: B (tiered).
    index_share: N > 1 selects on anchor layers only; the next N - 1 layers reuse
      the selection (sparse and tiered; the tiered anchor also fetches the shared
      layers' misses ahead of their attention).
    lookahead: "none" or "draft" (tiered): after each step, an uncommitted pass of
      a draft token prefetches up to ``lookahead_cap`` (default 64; None: no cap)
      rows per layer and unit for the next step. The draft is prompt lookup's
      (``kvtier_jax.draft``), or with ``draft_head`` ``lookup_or_head``'s: the head
      reads the previous step's features and the token being decoded, both known
      when the step starts (models/draft_head.py).
    tier_overrides: extra TierConfig fields (impl, warm start, lookahead_cap,
      policy...). For the "rank" policy build the selector at ``top_k = m`` and
      pass ``top_k=k, policy=PolicyConfig("rank", rank_depth=m)``.
  """

  def __init__(self, model: Transformer, backend: str, max_len: int, *, selector=None,
               selector_params=None, hot_slots: int | None = None,
               index_share: int = 1, lookahead: str = "none", draft_head=None,
               **tier_overrides):
    check_backend(backend, selector, hot_slots, model.cfg.num_layers, index_share)
    warn_past_context(model.cfg, max_len)
    selector = tiled_selector(selector, model.cfg)
    if lookahead not in ("none", "draft") or (lookahead != "none" and backend != "tiered"):
      raise ValueError(f"lookahead={lookahead!r} needs the tiered backend")
    if draft_head is not None and lookahead != "draft":
      raise ValueError("a draft_head drafts for lookahead='draft'")
    self.draft_head = draft_head
    self.features = None  # f_{p-1} [R, E] for the draft head
    self.last_draft = None  # the draft tokens of the last look-ahead pass
    self.model, self.backend, self.max_len = model, backend, max_len
    self.selector, self.params = selector, selector_params
    self.hot_slots, self.index_share, self.lookahead = hot_slots, index_share, lookahead
    self.tier_overrides = dict(tier_overrides, index_share=index_share)
    if lookahead == "draft":
      self.tier_overrides.setdefault("lookahead_cap", 64)
    self.lookups: list[PromptLookup] = []  # each row's tokens, for the drafts
    self.weights = model.weights()
    self.tier_cfg = None
    self.driver = None
    self.carry = None
    self.seq_len = None  # host mirror of the lengths (no device sync needed)

  def prefill(self, tokens, lens):
    """Runs the prompts; returns logits f32[R, V] at ``lens - 1``."""
    cfg = self.model.cfg
    check_tokens(tokens, cfg.vocab_size)
    tokens = jnp.asarray(tokens, jnp.int32)
    lens_np = np.asarray(lens)
    if (tokens.ndim != 2 or lens_np.shape != tokens.shape[:1]
        or lens_np.dtype.kind not in "iu"):
      raise ValueError(f"tokens {tokens.shape} and lens {lens_np.dtype}{list(lens_np.shape)}"
                       " must be [R, P] and R integers")
    lens_np = lens_np.astype(np.int64)
    if (lens_np > self.max_len).any():
      raise ValueError(f"prompt lengths {lens_np} exceed max_len={self.max_len}")
    if ((lens_np < 1) | (lens_np > tokens.shape[1])).any():
      # 0 reads the logits of a padding position; past P the cache would claim
      # positions whose keys are zeros.
      raise ValueError(f"prompt lengths {lens_np.tolist()} must be in [1, "
                       f"{tokens.shape[1]}] (the tokens given)")
    lens = jnp.asarray(lens_np, jnp.int32)
    logits, k, v, h, self.features = apply_prefill_with_inputs(
        cfg, self.weights, tokens, lens, return_features=True)
    if self.backend == "dense":
      self.carry = cache_lib.dense_from_prefill(k, v, lens, self.max_len)
    else:
      sel = prefill_state(self.selector, cfg.num_layers, self.max_len, self.params,
                          h, k, lens)
      params = jax.tree.map(jnp.copy, self.params)  # the carry is donated each step
      if self.backend == "sparse":
        kv = cache_lib.dense_from_prefill(k, v, lens, self.max_len)
        shape = (tokens.shape[0], self.selector.num_units, self.selector.top_k)
        self.carry = SparseCarry(kv, sel, params, jnp.full(shape, -1, jnp.int32))
      else:
        self.tier_cfg = tier_config(cfg, self.selector, tokens.shape[0], self.max_len,
                                    self.hot_slots, **self.tier_overrides)
        tier = _tier_prefill(self.tier_cfg, kv_state.init_state(self.tier_cfg), k, v,
                             lens)
        self.carry = kv_decode.init_carry(self.tier_cfg, tier, sel, params)
        self.driver = TieredDriver(self.tier_cfg, functools.partial(
            _run_tiered, cfg, self.tier_cfg, self.selector, self.weights,
            features=self.draft_head is not None))
        self.driver.start(lens_np)
    self.seq_len = lens_np.copy()
    if self.lookahead == "draft":
      self.lookups = [PromptLookup() for _ in lens_np]
      for lookup, row, n in zip(self.lookups, np.asarray(tokens), lens_np):
        lookup.extend(row[:n].tolist())
    return logits

  def step(self, tokens):
    """Decodes tokens i32[R] at the next position; returns logits f32[R, V]."""
    if self.carry is None:
      raise ValueError("prefill first")
    if (self.seq_len >= self.max_len).any():
      raise ValueError(f"context {self.seq_len.tolist()} reached max_len={self.max_len}")
    cfg = self.model.cfg
    if np.shape(tokens) != (len(self.seq_len),):
      raise ValueError(f"tokens {np.shape(tokens)} must be ({len(self.seq_len)},)")
    check_tokens(tokens, cfg.vocab_size)
    tokens = jnp.asarray(tokens, jnp.int32)
    if self.backend == "dense":
      logits, self.carry = _dense_step(cfg, self.weights, tokens, self.carry)
    elif self.backend == "sparse":
      logits, self.carry = _sparse_step(cfg, self.selector, self.index_share,
                                        self.weights, tokens, self.carry)
    else:
      feats_before = self.features
      try:
        out, self.carry = self.driver.step(self.carry, tokens)
      except StepRefused as err:
        self.carry = err.state
        raise
      logits, *feats = out if self.draft_head is not None else (out,)
    self.seq_len += 1
    for lookup, token in zip(self.lookups, np.asarray(tokens).tolist()):
      lookup.extend((token,))
    if self.lookahead == "draft" and (self.seq_len < self.max_len).all():
      if self.draft_head is None:
        drafts = [lookup.match()[0] for lookup in self.lookups]
      else:  # what the head knew as this step began: f_{p-1} and x_p
        heads = np.asarray(draft_tokens(cfg, self.weights, self.draft_head, feats_before,
                                        tokens)).tolist()
        drafts = [lookup_or_head(lookup.match(), t)
                  for lookup, t in zip(self.lookups, heads)]
      self.last_draft = drafts
      self.carry = tiered_draft_pass(cfg, self.tier_cfg, self.selector, self.weights,
                                     jnp.asarray(drafts, jnp.int32), self.carry)
    if self.draft_head is not None:
      self.features = feats[0]  # f_p: the next step's f_{p-1}
    return logits

  def cache_stats(self) -> dict:
    """Hit/miss/transfer counters (tiered) and the measured device bytes per
    request of the KV the backend keeps on the accelerator."""
    num_req = len(self.seq_len)
    if self.backend == "tiered":
      stats = kv_state.cache_stats(self.tier_cfg, self.carry.tier)
      by_kind = kv_state.array_bytes_by_memory_kind(self.carry.tier)
      host = kv_state.host_memory_kind()
      stats["device_kv_bytes_per_request"] = sum(
          b for k, b in by_kind.items() if k != host) / num_req
      stats["host_kv_bytes_per_request"] = by_kind.get(host, 0) / num_req
    else:
      kv = self.carry if self.backend == "dense" else self.carry.kv
      stats = {"device_kv_bytes_per_request": (kv.k.nbytes + kv.v.nbytes) / num_req}
    if self.backend != "dense":
      stats["selector_state_bytes_per_request"] = sum(
          x.nbytes for x in jax.tree.leaves(self.carry.sel)) / num_req
    return stats


def _run_tiered(cfg, tier_cfg, selector, weights, carry, tokens, *, features=False):
  return tiered_step(cfg, tier_cfg, selector, weights, tokens, carry, features)
