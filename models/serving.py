"""The Flax decoder behind the serving engine (``kvtier_jax.serving.ServingModel``).

One class serves all three cache backends over ``S`` request slots:

* ``dense``: full KV per slot on the device, full attention;
* ``sparse``: full KV per slot on the device, the selector's positions attended
  (the exactness reference);
* ``tiered``: the paged host tier + per-slot hot caches, the same selector, the
  library's one tiered step (``backends.tiered_step``) driven by ``TieredDriver``.

Prompts run in chunks (``transformer.apply_prefill_chunk``) against a device
staging buffer that holds the prefilling request's K/V and normalised inputs (one
request at a time; its bytes are charged to the device budget). The tiered
backend writes each chunk through to the request's host pages; after the last
chunk ``start_decoding`` warms the slot's hot cache (tiered) or copies the
staged K/V into the slot (dense, sparse) and builds the slot's selector state.
Decode steps run every slot with an active mask: inactive slots write nowhere
that matters and keep their state.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import decode as kv_decode
from kvtier_jax import fetch
from kvtier_jax import state as kv_state
from kvtier_jax.driver import (StepRefused, TieredDriver, check_page_table,
                               check_prompt_pages)
from kvtier_jax.selectors.base import prefill_state, state_bytes
from kvtier_jax.serving.request import is_int
from models import cache as cache_lib
from models.backends import (
  SparseCarry,
  check_backend,
  check_tokens,
  sparse_attend,
  tier_config,
  tiled_selector,
  tiered_draft_pass,
  tiered_step,
  warn_past_context,
)
from models.config import ModelConfig
from models.transformer import (Transformer, apply_decode, apply_prefill_chunk,
                                model_fingerprint)


@flax.struct.dataclass
class Staging:
  """The prefilling request's prompt on the device."""

  k: jax.Array  # [L, Ts, Hkv, D] post-RoPE keys
  v: jax.Array  # [L, Ts, Hkv, D]
  x: Any  # [L, Ts, E] normalised attention inputs, for selectors that read them, or None


@flax.struct.dataclass
class ServingState:
  cache: Any  # DenseKV (dense), SparseCarry (sparse) or TieredCarry (tiered)
  staging: Staging


def _insert_slot(full, one, slot):
  """Selector state leaves [L, S, ...] <- a one-request state [L, 1, ...] at ``slot``."""
  return jax.tree.map(lambda a, b: a.at[:, slot].set(b[:, 0]), full, one)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("staging",))
def _prefill(cfg: ModelConfig, weights, staging: Staging, tokens, start, count):
  logits, k, v, x = apply_prefill_chunk(cfg, weights, staging.k, staging.v, staging.x,
                                        tokens, start, count)
  return logits, Staging(k, v, x)


@functools.partial(jax.jit, static_argnames=("tier_cfg", "size"), donate_argnames=("carry",))
def _write_through(tier_cfg, carry, staging: Staging, slot, start, size: int):
  """Copy the staged chunk ``start .. start + size - 1`` into ``slot``'s host pages."""
  chunk = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)[:, None]
  tier = kv_decode.write_prompt_pages(tier_cfg, carry.tier, jnp.reshape(slot, (1,)),
                                      start, chunk(staging.k), chunk(staging.v))
  return carry.replace(tier=tier)


@functools.partial(jax.jit, static_argnames=("selector", "max_len"),
                   donate_argnames=("sel",))
def _selector_install(selector, max_len: int, sel, params, staging: Staging, slot,
                      length):
  x = None if staging.x is None else staging.x[:, None, :max_len]
  one = prefill_state(selector, staging.k.shape[0], max_len, params, x,
                      staging.k[:, None, :max_len], jnp.reshape(length, (1,)))
  return _insert_slot(sel, one, slot)


@functools.partial(jax.jit, donate_argnames=("kv",))
def _kv_install(kv: cache_lib.DenseKV, staging: Staging, slot, length):
  # Rows past ``length`` hold an earlier request's staging: zeros instead, since
  # attention multiplies masked-out rows' V by probability 0 (0 * NaN is NaN).
  max_len = kv.k.shape[2]
  fresh = (jnp.arange(max_len) < length)[None, :, None, None]
  take = lambda a, like: jnp.where(fresh, a[:, :max_len], 0).astype(like.dtype)
  return kv.replace(k=kv.k.at[:, slot].set(take(staging.k, kv.k)),
                    v=kv.v.at[:, slot].set(take(staging.v, kv.v)),
                    lens=kv.lens.at[slot].set(length))


@functools.partial(jax.jit, static_argnames=("tier_cfg",), donate_argnames=("carry",))
def _tier_install(tier_cfg, carry, staging: Staging, slot, length):
  tier = kv_decode.install_request(tier_cfg, carry.tier, slot, staging.k, staging.v,
                                   length)
  return carry.replace(tier=tier)


@functools.partial(jax.jit, static_argnames=("tier_cfg",), donate_argnames=("staging",))
def _load_prefix(tier_cfg, tier, staging: Staging, slot, length):
  """Staged K/V of positions ``0 .. length - 1`` <- ``slot``'s host pages (a cached
  prefix); only those rows cross the host link (``fetch.gather_rows``)."""
  num_layers, stage_len = staging.k.shape[:2]
  units, size = tier_cfg.num_units, tier_cfg.page_size
  pos = jnp.arange(stage_len)
  page = tier.page_table[slot, jnp.minimum(pos // size, tier_cfg.pages_per_request - 1)]
  valid = (pos < length) & (page >= 0)
  page = jnp.where(valid, page, tier_cfg.num_host_pages)  # the scratch page
  grid = jnp.meshgrid(jnp.arange(num_layers), page, jnp.arange(units), indexing="ij")
  offset = jnp.broadcast_to((pos % size)[None, :, None], grid[0].shape)
  index = jnp.stack([grid[0], grid[1], offset, grid[2]], -1).reshape(-1, 4)
  k, v = fetch.gather_rows(tier.host_k, tier.host_v, index.astype(jnp.int32))
  shape = staging.k.shape  # [L, Ts, Hkv, D]
  keep = valid[None, :, None, None]
  return staging.replace(k=jnp.where(keep, k.reshape(shape).astype(staging.k.dtype),
                                     staging.k),
                         v=jnp.where(keep, v.reshape(shape).astype(staging.v.dtype),
                                     staging.v))


@functools.partial(jax.jit, static_argnames=("tier_cfg",))
def _read_pages(tier_cfg, tier, pages):
  """Host pages ``pages`` i32[G] -> K, V [L, G, Pg, U, Hg, D] on the device (only
  those rows cross the host link)."""
  grid = jnp.meshgrid(jnp.arange(tier_cfg.num_layers), pages,
                      jnp.arange(tier_cfg.page_size), jnp.arange(tier_cfg.num_units),
                      indexing="ij")
  index = jnp.stack(grid, -1).reshape(-1, 4).astype(jnp.int32)
  k, v = fetch.gather_rows(tier.host_k, tier.host_v, index)
  shape = grid[0].shape + k.shape[1:]
  return k.reshape(shape), v.reshape(shape)


@functools.partial(jax.jit, static_argnames=("tier_cfg",), donate_argnames=("carry",))
def _write_pages(tier_cfg, carry, pages, k, v):
  """Host pages ``pages`` i32[G] <- K, V [L, G, Pg, U, Hg, D], in place."""
  tier = carry.tier
  host_k, host_v = fetch.write_pages(tier.host_k, tier.host_v, pages, k, v)
  return carry.replace(tier=tier.replace(host_k=host_k, host_v=host_v))


def _masked_positions(lens, active, max_len):
  """Inactive slots decode at position T: their K/V writes are dropped."""
  return jnp.where(active, lens, max_len)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def _dense_step(cfg: ModelConfig, weights, tokens, active, kv: cache_lib.DenseKV):
  positions = _masked_positions(kv.lens, active, kv.max_len)
  logits, out = apply_decode(cfg, weights, tokens, positions, kv.replace(lens=positions),
                             cache_lib.dense_attend)
  return logits, out.replace(lens=kv.lens + active.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "selector", "index_share"),
                   donate_argnames=("carry",))
def _sparse_step(cfg: ModelConfig, selector, index_share: int, weights, tokens, active,
                 carry: SparseCarry):
  lens = carry.kv.lens
  positions = _masked_positions(lens, active, carry.kv.max_len)
  # An inactive row's selector must not move at T: Quest's ring entry T % page
  # belongs to one of its real positions (the tiered step selects at seq_len too).
  carry = carry.replace(kv=carry.kv.replace(lens=positions), select_at=lens)
  logits, carry = apply_decode(cfg, weights, tokens, positions, carry,
                               sparse_attend(selector, index_share, cfg.decode_row_tile))
  return logits, carry.replace(kv=carry.kv.replace(lens=lens + active.astype(jnp.int32)),
                               select_at=None)


class ServingBackend:
  """A ``ServingModel``: the Flax decoder with one cache backend over S slots.

  Args:
    model: the Transformer.
    backend: "dense", "sparse" or "tiered".
    num_slots: S, requests decoded together.
    max_len: T, positions a request may reach.
    selector, selector_params: the sparse-attention rule (sparse, tiered).
    hot_slots: B (tiered).
    chunk_size: C, prompt tokens per prefill call (a multiple of ``page_size``).
    page_size: host page size (tiered).
    host_pages: pages in the host pool (tiered; default: every slot can hold
      ``max_len``).
    index_share: layers per selection (sparse, tiered).
    lookahead: "none" or "draft" (tiered): after each decode step the engine hands
      ``draft_pass`` each decoding slot's prompt-lookup draft of its next token; an
      uncommitted pass of it fetches up to ``lookahead_cap`` (default 64) rows per
      layer and unit that the next step would miss (``Runner``'s look-ahead).
    device: where the weights and the state live (default: JAX's default device);
      the host tier lives in that device's host memory.
    tier_overrides: more ``TierConfig`` fields (impl, policy, warm start...).
  """

  def __init__(self, model: Transformer, backend: str, num_slots: int, max_len: int, *,
               selector=None, selector_params=None, hot_slots: int | None = None,
               chunk_size: int = 128, page_size: int = 64, host_pages: int | None = None,
               index_share: int = 1, lookahead: str = "none",
               device: jax.Device | None = None, **tier_overrides):
    check_backend(backend, selector, hot_slots, model.cfg.num_layers, index_share)
    if lookahead not in ("none", "draft") or (lookahead != "none" and backend != "tiered"):
      raise ValueError(f"lookahead={lookahead!r}: 'none', or 'draft' on the tiered "
                       f"backend (got {backend!r})")
    if lookahead == "draft":
      tier_overrides.setdefault("lookahead_cap", 64)
    warn_past_context(model.cfg, max_len)
    selector = tiled_selector(selector, model.cfg)
    if backend == "tiered" and chunk_size % page_size:
      raise ValueError(f"chunk_size={chunk_size} must be a multiple of page_size="
                       f"{page_size} (a chunk writes whole host pages)")
    cfg = model.cfg
    self.model, self.cfg, self.backend = model, cfg, backend
    self.device = device
    self.weights = model.weights()
    if device is not None:
      self.weights = jax.device_put(self.weights, device)
      selector_params = jax.device_put(selector_params, device)
    self.num_slots, self.max_len, self.chunk_size = num_slots, max_len, chunk_size
    self.page_size, self.vocab_size = page_size, cfg.vocab_size
    self.selector, self.params, self.index_share = selector, selector_params, index_share
    self.lookahead = lookahead
    self.hot_slots = hot_slots if backend == "tiered" else 0
    self.stage_len = -(-max_len // chunk_size) * chunk_size
    self.tier_cfg = None
    self.num_host_pages = 0
    self.host_page_bytes = 0
    if backend == "tiered":
      pages = host_pages if host_pages is not None else (
          num_slots * -(-max_len // page_size))
      self.tier_cfg = tier_config(cfg, selector, num_slots, max_len, hot_slots,
                                  page_size=page_size, host_pages=pages,
                                  index_share=index_share, **tier_overrides)
      self.num_host_pages = pages
      self.host_page_bytes = self.page_bytes(cfg, page_size)
      self.driver = TieredDriver(self.tier_cfg, functools.partial(
          _tiered_run, cfg, self.tier_cfg, selector, self.weights))
    # Host mirror of the slots' lengths (dense, sparse; the tiered driver keeps its
    # own): a step at max_len would drop its K/V write inside jit, silently.
    self._lens = np.zeros((num_slots,), np.int64)
    # (slot, positions) the staging buffer holds: a chunk goes on after them and
    # start_decoding installs them into that slot only (None: unknown, after init
    # or a restore).
    self._staged: tuple[int, int] | None = None

  # Accounting ----------------------------------------------------------------

  @staticmethod
  def page_bytes(cfg: ModelConfig, page_size: int) -> int:
    """Bytes of one host page: K and V of ``page_size`` positions, every layer."""
    return cfg.num_layers * page_size * cfg.kv_bytes_per_token_per_layer

  @classmethod
  def pages_for_bytes(cls, cfg: ModelConfig, page_size: int, host_bytes: float) -> int:
    """Host pages in a budget of ``host_bytes``."""
    return int(host_bytes // cls.page_bytes(cfg, page_size))

  def _selector_bytes(self, length: int) -> int:
    if self.selector is None or self.backend == "dense":  # dense keeps no selector state
      return 0
    return state_bytes(self.selector, length) * self.cfg.num_layers

  def device_bytes(self, length: int) -> int:
    """Full KV of ``length`` positions (dense, sparse; as a paged device pool would
    hold it) or the hot cache and its metadata (tiered), plus selector state."""
    if self.backend == "tiered":
      return self.tier_cfg.device_bytes_per_request() + self._selector_bytes(length)
    kv = self.cfg.num_layers * length * self.cfg.kv_bytes_per_token_per_layer
    return kv + self._selector_bytes(length)

  @property
  def _stages_hidden(self) -> bool:
    return getattr(self.selector, "reads_hidden", False)

  def staging_bytes(self) -> int:
    cfg = self.cfg
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim
    per_token += cfg.embed_dim if self._stages_hidden else 0
    return cfg.num_layers * self.stage_len * per_token * jnp.dtype(cfg.dtype).itemsize

  def host_pages(self, length: int) -> int:
    if self.backend != "tiered" or length <= self.hot_slots:
      return 0
    return -(-length // self.page_size)

  @property
  def supports_prefix_cache(self) -> bool:
    """A cached prefix is restaged from the host pages: the tiered backend, with a
    selector that needs nothing but K/V (DSA's indexer reads hidden states, which
    the host tier does not keep)."""
    return self.backend == "tiered" and not self._stages_hidden

  # State -----------------------------------------------------------------------

  def init(self) -> ServingState:
    # Committed from the start, as every step returns it: else each jitted
    # function the engine calls compiles once more (kv_state.committed).
    self._staged = None
    with jax.default_device(self.device):
      return kv_state.committed(self._init())

  def _init(self) -> ServingState:
    cfg, slots = self.cfg, self.num_slots
    dtype = jnp.dtype(cfg.dtype)
    shape = (cfg.num_layers, self.stage_len)
    staging = Staging(jnp.zeros(shape + (cfg.num_kv_heads, cfg.head_dim), dtype),
                      jnp.zeros(shape + (cfg.num_kv_heads, cfg.head_dim), dtype),
                      jnp.zeros(shape + (cfg.embed_dim,), dtype)
                      if self._stages_hidden else None)
    if self.backend == "dense":
      return ServingState(cache_lib.init_dense(cfg, slots, self.max_len), staging)
    sel = self.selector.init_state(cfg.num_layers, slots, self.max_len)
    params = jax.tree.map(jnp.copy, self.params)  # the state is donated each step
    if self.backend == "sparse":
      kv = cache_lib.init_dense(cfg, slots, self.max_len)
      shared = jnp.full((slots, self.selector.num_units, self.selector.top_k), -1,
                        jnp.int32)
      return ServingState(SparseCarry(kv, sel, params, shared), staging)
    tier = kv_state.init_state(self.tier_cfg, device=self.device)
    return ServingState(kv_decode.init_carry(self.tier_cfg, tier, sel, params), staging)

  def set_pages(self, state: ServingState, table: np.ndarray) -> ServingState:
    if self.backend != "tiered":
      return state
    old = state.cache.tier.page_table  # same placement: the step must not recompile
    table = check_page_table(table, old.shape, self.tier_cfg.num_host_pages)
    tier = state.cache.tier.replace(page_table=jax.device_put(table, old.sharding))
    return state.replace(cache=state.cache.replace(tier=tier))

  # Prefill -----------------------------------------------------------------------

  # Checks: the engine never sends bad input, but a direct caller gets an error
  # before any donated call, not a clamped index writing another slot's rows.

  def _check_slot(self, slot) -> None:
    if not (is_int(slot) and 0 <= slot < self.num_slots):
      raise ValueError(f"slot={slot!r} must be an int in [0, {self.num_slots})")

  def _check_length(self, length, low: int = 0) -> None:
    if not (is_int(length) and low <= length <= self.max_len):
      raise ValueError(f"length={length!r} must be an int in [{low}, {self.max_len}]")

  def check_room(self, active) -> None:
    """Refuses a step in which an active slot is at ``max_len``: its K/V write
    would be dropped and it would attend without its own token."""
    if self.backend == "tiered":
      self.driver.check_room(active)
      return
    full = (self._lens >= self.max_len) & active
    if full.any():
      raise ValueError(f"slots {np.flatnonzero(full).tolist()} reached max_len="
                       f"{self.max_len}: lengths {self._lens.tolist()}")

  def advance(self, active) -> None:
    """The length mirror after a step the caller ran itself (the mesh backend)."""
    mirror = self.driver.seq_len if self.backend == "tiered" else self._lens
    mirror += np.asarray(active, np.int64)

  def set_lengths(self, lengths) -> None:
    """The length mirror of a restored state."""
    lengths = np.asarray(lengths, np.int64).copy()
    if self.backend == "tiered":
      self.driver.seq_len = lengths
    else:
      self._lens = lengths

  def _check_pages(self, pages) -> np.ndarray:
    pages = np.asarray(pages, np.int64).reshape(-1)
    bad = pages[(pages < 0) | (pages >= self.num_host_pages)]
    if bad.size:
      raise ValueError(f"host pages {bad[:5].tolist()} are outside [0, "
                       f"{self.num_host_pages})")
    return pages

  def prefill(self, state: ServingState, slot: int, tokens: np.ndarray, start: int,
              count: int):
    self._check_slot(slot)
    if not (is_int(start) and is_int(count) and start >= 0):
      raise ValueError(f"start={start!r} and count={count!r} must be ints, start >= 0")
    if start + count > self.max_len:
      raise ValueError(f"positions {start}..{start + count - 1} pass max_len={self.max_len}")
    if np.shape(tokens) != (self.chunk_size,):
      raise ValueError(f"tokens {np.shape(tokens)} must be one chunk, zero-padded: "
                       f"({self.chunk_size},)")
    if start % self.chunk_size or not 0 < count <= self.chunk_size:
      # The staging writes and the host write-through are whole chunks: another
      # start would be clamped onto the wrong rows.
      raise ValueError(f"a prefill chunk starts at a multiple of chunk_size="
                       f"{self.chunk_size} and holds 1..{self.chunk_size} tokens: "
                       f"start={start}, count={count}")
    check_tokens(np.asarray(tokens)[:count], self.vocab_size)
    if start and self._staged not in (None, (slot, start)):
      raise ValueError(f"slot {slot}'s chunk at {start} does not follow the staged "
                       f"rows (slot, positions) {self._staged}")
    if self.backend == "tiered":  # (read back: one row of the page table)
      check_prompt_pages(np.asarray(state.cache.tier.page_table[slot]), start + count,
                         self.page_size, self.tier_cfg.hot_slots, f"slot {slot}")
    logits, staging = _prefill(self.cfg, self.weights, state.staging,
                               jnp.asarray(tokens, jnp.int32), jnp.int32(start),
                               jnp.int32(count))
    cache = state.cache
    if self.backend == "tiered":
      cache = _write_through(self.tier_cfg, cache, staging, jnp.int32(slot),
                             jnp.int32(start), self.chunk_size)
    self._staged = (slot, start + count)
    return ServingState(cache, staging), logits

  def load_prefix(self, state: ServingState, slot: int, length: int) -> ServingState:
    if not self.supports_prefix_cache:
      raise ValueError(f"the {self.backend} backend cannot load a cached prefix")
    self._check_slot(slot)
    self._check_length(length)
    pages = np.asarray(state.cache.tier.page_table[slot])
    need = -(-length // self.page_size)
    if (pages[:need] < 0).any():  # its staged rows would keep an earlier request's
      raise ValueError(f"slot {slot} holds pages {pages[:need].tolist()}: a prefix of "
                       f"{length} positions needs {need} pages (set_pages first)")
    staging = _load_prefix(self.tier_cfg, state.cache.tier, state.staging,
                           jnp.int32(slot), jnp.int32(length))
    self._staged = (slot, length)
    return ServingState(state.cache, staging)

  def _page_groups(self, pages):
    """``pages`` in groups of one chunk's pages (static shapes), the last padded
    with the scratch page; yields (group i32[G], how many are real)."""
    size = self.chunk_size // self.page_size
    pages = np.asarray(pages, np.int32)
    for at in range(0, len(pages), size):
      group = np.full((size,), self.tier_cfg.num_host_pages, np.int32)
      real = pages[at:at + size]
      group[:len(real)] = real
      yield jnp.asarray(group), len(real)

  @functools.cached_property
  def model_id(self) -> str:
    """What the K/V of a handed-off request depend on: every weight, and the RoPE
    base, norm epsilon, attention form and dtype, and the decode's row tile (the
    decoded positions' K/V are its matmuls'; computed at the first handoff with
    K/V, ~0.9 s for SmolLM2)."""
    cfg = self.cfg
    tile = "" if cfg.decode_row_tile is None else f"/rows{cfg.decode_row_tile}"
    return (f"{model_fingerprint(self.model.weights())}/{cfg.attention}/{cfg.dtype}/"
            f"{cfg.rope_theta!r}/{cfg.rms_eps!r}{tile}")

  @functools.cached_property
  def decode_id(self) -> str:
    """What a request's tokens depend on beside the weights: the backend, the
    selector (its settings and parameters) and the index sharing; not B, the
    policy or the warm start, which only move data (a snapshot restores onto an
    equal id only)."""
    params = "-" if self.params is None else model_fingerprint(
        {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(self.params))})
    return f"{self.backend}/{self.selector!r}/{params}/share{self.index_share}"

  def read_pages(self, state: ServingState, pages) -> list[np.ndarray]:
    """Host pages' contents (a disk tier stores them): [K, V], each
    [n, L, Pg, U, Hg, D]."""
    if self.backend != "tiered":
      raise ValueError(f"the {self.backend} backend has no host pages")
    pages = self._check_pages(pages)
    tier = state.cache.tier
    # [0, L, Pg, U, Hg, D] each for no pages, as a mesh returns them.
    ks = [np.zeros((0,) + tier.host_k.shape[:1] + tier.host_k.shape[2:], tier.host_k.dtype)]
    vs = [np.zeros((0,) + tier.host_v.shape[:1] + tier.host_v.shape[2:], tier.host_v.dtype)]
    for group, real in self._page_groups(pages):
      k, v = _read_pages(self.tier_cfg, tier, group)
      ks.append(np.moveaxis(np.asarray(k), 1, 0)[:real])
      vs.append(np.moveaxis(np.asarray(v), 1, 0)[:real])
    return [np.concatenate(ks), np.concatenate(vs)]

  def write_pages(self, state: ServingState, pages, fields) -> ServingState:
    """Host pages ``pages`` <- contents ``read_pages`` returned (from the disk tier)."""
    if self.backend != "tiered":
      raise ValueError(f"the {self.backend} backend has no host pages")
    pages = self._check_pages(pages)
    k_all, v_all = fields
    tier = state.cache.tier
    for name, field, host in (("K", k_all, tier.host_k), ("V", v_all, tier.host_v)):
      want = (len(pages),) + host.shape[:1] + host.shape[2:]  # [n, L, Pg, U, Hg, D]
      if field.shape != want or field.dtype != host.dtype:
        raise ValueError(f"{name} contents {field.dtype}{list(field.shape)} for "
                         f"{len(pages)} pages; expected {host.dtype}{list(want)}")
    cache, at = state.cache, 0
    for group, real in self._page_groups(pages):
      k = np.zeros((group.shape[0],) + k_all.shape[1:], k_all.dtype)
      v = np.zeros_like(k)
      k[:real], v[:real] = k_all[at:at + real], v_all[at:at + real]
      cache = _write_pages(self.tier_cfg, cache, group, jnp.asarray(np.moveaxis(k, 0, 1)),
                           jnp.asarray(np.moveaxis(v, 0, 1)))
      at += real
    return ServingState(cache, state.staging)

  def start_decoding(self, state: ServingState, slot: int, length: int) -> ServingState:
    self._check_slot(slot)
    self._check_length(length, low=1)
    if self._staged not in (None, (slot, length)):  # another prompt's rows
      raise ValueError(f"the staging buffer holds (slot, positions) {self._staged}, "
                       f"not slot {slot}'s {length}")
    cache, staging = state.cache, state.staging
    slot_, length_ = jnp.int32(slot), jnp.int32(length)
    self._lens[slot] = length
    if self.backend == "dense":
      return ServingState(_kv_install(cache, staging, slot_, length_), staging)
    sel = _selector_install(self.selector, self.max_len, cache.sel, cache.params, staging,
                            slot_, length_)
    cache = cache.replace(sel=sel)
    if self.backend == "sparse":
      cache = cache.replace(kv=_kv_install(cache.kv, staging, slot_, length_))
    else:
      cache = _tier_install(self.tier_cfg, cache, staging, slot_, length_)
      self.driver.set_length(slot, length)
    return ServingState(cache, staging)

  # Decode --------------------------------------------------------------------------

  def decode(self, state: ServingState, tokens: np.ndarray, active: np.ndarray):
    if np.shape(tokens) != (self.num_slots,) or np.shape(active) != (self.num_slots,):
      raise ValueError(f"tokens {np.shape(tokens)} and active {np.shape(active)} must "
                       f"be ({self.num_slots},)")
    active = np.asarray(active, bool)
    check_tokens(np.asarray(tokens)[active], self.vocab_size)
    tokens = jnp.asarray(tokens, jnp.int32)
    if self.backend != "tiered":  # the driver checks and advances the tiered mirror
      self.check_room(active)
    if self.backend == "dense":
      logits, cache = _dense_step(self.cfg, self.weights, tokens, jnp.asarray(active),
                                  state.cache)
    elif self.backend == "sparse":
      logits, cache = _sparse_step(self.cfg, self.selector, self.index_share,
                                   self.weights, tokens, jnp.asarray(active), state.cache)
    else:
      try:
        logits, cache = self.driver.step(state.cache, tokens, active=np.asarray(active))
      except StepRefused as err:  # hand the returned (uncommitted) state back
        err.state = ServingState(err.state, state.staging)
        raise
    if self.backend != "tiered":
      self.advance(active)
    return ServingState(cache, state.staging), logits

  def draft_pass(self, state: ServingState, drafts: np.ndarray, active: np.ndarray
                 ) -> ServingState:
    """The look-ahead (``lookahead="draft"``): an uncommitted pass of ``drafts``
    i32[S] at each active slot's next position. What it fetches stays in the hot
    cache for the next step; lengths, counters (its rows count as ``prefetched``)
    and outputs are as before. A slot without the page of that position sits it
    out."""
    if self.lookahead != "draft":
      raise ValueError("draft_pass needs a backend built with lookahead='draft'")
    if np.shape(drafts) != (self.num_slots,) or np.shape(active) != (self.num_slots,):
      raise ValueError(f"drafts {np.shape(drafts)} and active {np.shape(active)} must "
                       f"be ({self.num_slots},)")
    active = np.asarray(active, bool) & (self.driver.seq_len < self.max_len)
    check_tokens(np.asarray(drafts)[active], self.vocab_size)
    carry = state.cache.replace(active=jnp.array(active))
    cache = tiered_draft_pass(self.cfg, self.tier_cfg, self.selector, self.weights,
                              jnp.asarray(drafts, jnp.int32), carry)
    return ServingState(cache, state.staging)

  # Snapshot --------------------------------------------------------------------

  def snapshot(self, state: ServingState) -> list[np.ndarray]:
    """Every array of the state, on the host, and the driver's length mirror."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    if self.backend == "tiered":
      leaves.append(self.driver.seq_len.copy())
    return leaves

  def restore_state(self, leaves: list[np.ndarray]) -> ServingState:
    """The state ``snapshot`` returned, placed as ``init`` places it (the host tier
    in host memory): the compiled steps run on it without recompiling."""
    state, lens = place_snapshot(self.init(), leaves, self.backend == "tiered")
    self.set_lengths(dense_lengths(state.cache) if lens is None else lens)
    return state

  @staticmethod
  def compiled_prefills() -> int:
    """Compiled variants of the prefill chunk, every backend together (a state
    whose placement drifts between chunks compiles it again)."""
    return _prefill._cache_size()

  @property
  def stats_modulus(self) -> dict:
    """The counters are int32 per (layer, request, unit) and per layer on the
    device: each wraps (hits after ~1M steps at k = 2048), and their sums are
    exact modulo 2^32, so a step's delta is too (the engine takes it modulo)."""
    if self.backend != "tiered":
      return {}
    rows = 2**32
    return dict(hits=rows, misses=rows, prefetched=rows, fetched_rows=rows,
                host_to_device_bytes=rows * 2 * self.tier_cfg.row_bytes)

  def stats(self, state: ServingState, units: int | None = None) -> dict:
    """``units``: count hits, misses and prefetched rows of the first ``units``
    only (the mesh's padded heads are not the model's); fetched rows and bytes
    count every row. ``misses`` are the steps' own (on the critical path); rows a
    look-ahead fetched ahead count as ``prefetched``."""
    if self.backend != "tiered":
      return {}
    tier = state.cache.tier
    if units is not None:
      tier = tier.replace(hits=tier.hits[:, :, :units], misses=tier.misses[:, :, :units],
                          prefetched=tier.prefetched[:, :, :units])
    stats = kv_state.cache_stats(self.tier_cfg, tier)
    return {k: stats[k] for k in ("hits", "misses", "prefetched", "fetched_rows",
                                  "host_to_device_bytes")}


def dense_lengths(cache) -> jax.Array:
  """i32[S] lengths of a dense or sparse backend's cache."""
  return cache.lens if isinstance(cache, cache_lib.DenseKV) else cache.kv.lens


def place_snapshot(template, leaves: list[np.ndarray], with_lengths: bool):
  """(``template``'s pytree with its arrays replaced by ``leaves``, each placed as the
  template's is, and the trailing length mirror int64 or None); ``ValueError`` if
  the arrays do not fit the template."""
  slots, treedef = jax.tree.flatten(template)
  extra = int(with_lengths)
  if len(leaves) != len(slots) + extra:
    raise ValueError(f"{len(leaves)} arrays for a state of {len(slots) + extra}")
  for i, (leaf, slot) in enumerate(zip(leaves, slots)):
    if leaf.shape != slot.shape or leaf.dtype != slot.dtype:
      raise ValueError(f"array {i}: {leaf.dtype}{list(leaf.shape)} where the state has "
                       f"{slot.dtype}{list(slot.shape)}")
  placed = [jax.device_put(leaf, slot.sharding) for leaf, slot in zip(leaves, slots)]
  del template, slots  # the template's buffers go before the caller keeps the copy
  state = jax.tree.unflatten(treedef, placed)
  if not with_lengths:
    return state, None
  # The driver's host mirror of the lengths must be the state's own.
  mirror, device = leaves[-1], np.asarray(state.cache.tier.seq_len)
  if (mirror.dtype.kind not in "iu" or mirror.shape != device.shape
      or (mirror != device).any()):
    raise ValueError(f"the length mirror {mirror.dtype}{list(mirror.shape)} "
                     f"{mirror.tolist()[:8]} is not the state's seq_len {device.tolist()[:8]}")
  return state, mirror.astype(np.int64)


def _tiered_run(cfg, tier_cfg, selector, weights, carry, tokens):
  return tiered_step(cfg, tier_cfg, selector, weights, tokens, carry)

