"""The host side of the tiered step: what runs between jitted steps.

``TieredDriver`` wraps any jitted step that returns a ``TieredCarry`` (the model's
step, ``decode_step``, the serving engine's): it checks capacity on a host mirror
of ``seq_len`` before the call (no device sync), runs the separate donated host
append after it, reads the status word once and raises ``StepRefused`` with the
returned (self-consistent, uncommitted) carry. ``TieredDecoder`` is the library's
convenience over it for precomputed per-layer q/k/v.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import decode
from kvtier_jax.config import TierConfig
from kvtier_jax.resolve import (STATUS_CAPACITY, STATUS_DUPLICATE, STATUS_OUT_OF_RANGE,
                                check_selection)
from kvtier_jax.selectors.base import check_ranking
from kvtier_jax.selectors.synthetic import GivenSelector
from kvtier_jax.state import TieredKVState, committed


def describe_status(status: int) -> str:
  reasons = []
  if status & STATUS_OUT_OF_RANGE:
    reasons.append("a selected position is out of range (not -1 and not in 0..newest)")
  if status & STATUS_DUPLICATE:
    reasons.append("a selection repeats a position")
  if status & STATUS_CAPACITY:
    reasons.append("a request's context exceeds max_len, or a position to fetch (or "
                   "the newest, with no hot slot to keep it) has no host page")
  return "; ".join(reasons) or "ok"


def check_page_table(table, shape: tuple[int, int], num_pages: int) -> np.ndarray:
  """``table`` as i32[S, MP] after checking what the step would otherwise read
  through silently: the shape, ids in [-1, num_pages), and no page twice in one
  slot (slots may share pages: a cached prefix)."""
  table = np.asarray(table)
  if table.shape != shape or not np.issubdtype(table.dtype, np.integer):
    raise ValueError(f"a page table is int {shape} (slots, pages per slot); got "
                     f"{table.dtype} {table.shape}")
  if ((table < -1) | (table >= num_pages)).any():
    raise ValueError(f"page ids are -1 (none) or in [0, {num_pages}); got "
                     f"{sorted(set(table[(table < -1) | (table >= num_pages)].tolist()))[:8]}")
  ordered = np.sort(table, axis=1)  # a page twice in a row sits side by side
  twice = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(axis=1)
  if twice.any():
    slot = int(np.argmax(twice))
    raise ValueError(f"slot {slot} lists a page twice: {table[slot].tolist()}")
  # A shared page is a cached prefix's: at the same position in every slot. At
  # another it would hold other positions' K/V for one of them.
  slots, columns = np.nonzero(table >= 0)
  ids = table[slots, columns]
  order = np.argsort(ids, kind="stable")
  ids, columns, slots = ids[order], columns[order], slots[order]
  moved = (ids[1:] == ids[:-1]) & (columns[1:] != columns[:-1])
  if moved.any():
    at = int(np.argmax(moved))
    raise ValueError(f"page {ids[at]} is shared at another position: page index "
                     f"{columns[at]} of slot {slots[at]}, {columns[at + 1]} of slot "
                     f"{slots[at + 1]}")
  return table.astype(np.int32)


def check_prompt_pages(row: np.ndarray, length: int, page_size: int, hot_slots: int,
                       who: str) -> None:
  """Clear errors for a prompt of ``length`` positions over the page table ``row``
  i32[MP]: a prompt row written through without its page goes to the scratch page,
  lost once evicted; a request with no pages at all must fit the hot cache (its
  whole life)."""
  need = -(-length // page_size)
  paged = (row >= 0).any()
  if paged and (row[:need] < 0).any():
    raise ValueError(f"{who}'s prompt of {length} positions needs {need} pages (it "
                     f"would need pages 0..{need - 1}; its page table row is "
                     f"{row[:need].tolist()})")
  if not paged and length > hot_slots:
    raise ValueError(f"{who} has no host pages: its {length} prompt positions exceed "
                     f"B={hot_slots}")


class StepRefused(ValueError):
  """A decode step refused its input; ``state`` is the returned, uncommitted state."""

  def __init__(self, message: str, state):
    super().__init__(message)
    self.state = state


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("carry",))
def _append(cfg: TierConfig, carry: decode.TieredCarry):
  return carry.replace(tier=decode.append_newest(cfg, carry.tier, carry.ok & carry.active))


class TieredDriver:
  """Runs a jitted tiered step: eager capacity check, host append, refusal.

  Args:
    cfg: the cache's configuration.
    step: ``step(carry, *args) -> (out, carry)``, jitted with the carry donated,
      ending in ``decode.commit_step``. The carry in may also be what the step
      builds its carry from (``TieredDecoder``: the state), the carry out is a
      ``decode.TieredCarry``.
  """

  def __init__(self, cfg: TierConfig, step):
    self.cfg = cfg
    self._step = step
    self.seq_len = np.zeros((cfg.num_requests,), np.int64)  # host mirror

  def start(self, lens) -> None:
    """Set the mirror after a prefill to ``lens`` positions per request."""
    self.seq_len = np.asarray(lens, np.int64).copy()

  def set_length(self, request: int, length: int) -> None:
    """One request slot starts over at ``length`` positions (a serving engine)."""
    self.seq_len[request] = length

  def check_room(self, active=None) -> None:
    full = self.seq_len >= self.cfg.max_len
    if (full if active is None else full & active).any():
      raise ValueError(describe_status(STATUS_CAPACITY) +
                       f": seq_len={self.seq_len.tolist()}, max_len={self.cfg.max_len}")

  def step(self, carry: decode.TieredCarry, *args, active=None):
    """One step; returns (out, carry) or raises ``StepRefused`` (carry inside).

    ``active`` bool[R] (numpy): the requests that decode (the others keep their
    state); default all.
    """
    if active is not None:  # a copy: the carry is donated, the caller's array kept
      active = np.asarray(active)
      if active.shape != self.seq_len.shape or active.dtype != bool:
        raise ValueError(f"active must be bool{list(self.seq_len.shape)} (one flag per "
                         f"request); got {active.dtype}{list(active.shape)}")
    self.check_room(active)
    if active is not None:
      carry = carry.replace(active=jnp.array(active))
    elif isinstance(carry, decode.TieredCarry):  # it keeps the last call's mask:
      carry = carry.replace(active=jnp.ones(self.seq_len.shape, bool))  # all rows
    # Committed like the carry the step returns: an argument that is committed in
    # one call and not in the next (logits fed back as tokens) compiles twice.
    out, carry = self._step(carry, *committed(args))
    carry = _append(self.cfg, carry)
    status = int(carry.status)
    if status:
      raise StepRefused("decode step refused, nothing committed (a retry is exact): "
                        f"{describe_status(status)}", carry)
    self.seq_len += 1 if active is None else active.astype(np.int64)
    return out, carry


# A step over a carry (the driver's contract, with an ``active`` mask).
_decode_step = jax.jit(decode.decode_step, static_argnums=(0, 1), donate_argnums=(2,))
_prefill = jax.jit(decode.prefill, static_argnums=(0,), donate_argnums=(1,))


def _step_from_state(cfg: TierConfig, selector, state: TieredKVState, q, k_new, v_new,
                     selections, prefetch):
  """``TieredDecoder``'s step: the carry is built inside the jitted step (eagerly
  it was ~8 small host-side ops, 1.9 ms per step on the CPU; in a jit of its own,
  one more dispatch, ~0.15 ms)."""
  carry = decode.init_carry(cfg, state, selections, None, prefetch)
  return decode.decode_step(cfg, selector, carry, q, k_new, v_new)


# Shared by every TieredDecoder: decoders with equal configs and selectors (both
# hashable) compile once.
_decoder_step = jax.jit(_step_from_state, static_argnums=(0, 1), donate_argnums=(2,))


class TieredDecoder:
  """Prefill and step a tiered cache from precomputed per-layer q/k/v.

  The selector defaults to ``GivenSelector``: each step's positions come as
  ``selections`` i32[L, R, U, select_width]. Stateless selectors (``ChurnSelector``)
  need none. The state is donated at every call.
  """

  def __init__(self, cfg: TierConfig, selector=None):
    self.cfg = cfg
    self.selector = selector or GivenSelector(cfg.select_width, cfg.num_units)
    if not isinstance(self.selector, GivenSelector) and jax.eval_shape(
        lambda: self.selector.init_state(cfg.num_layers, cfg.num_requests,
                                         cfg.max_len)) is not None:
      # The carry's selector state is the step's selections: a stateful rule would
      # never be prefilled. The model backends drive those (models/backends.py).
      raise ValueError(f"TieredDecoder drives given selections or a stateless "
                       f"selector, not {type(self.selector).__name__} (it keeps state)")
    check_ranking(self.selector, cfg.top_k, cfg.select_width)
    self._traced = set()  # input signatures whose step traced without an error
    # The driver's carry in is the state (the step builds the carry), out a carry.
    self._driver = TieredDriver(cfg, functools.partial(_decoder_step, cfg, self.selector))

  @property
  def seq_len(self) -> np.ndarray:
    return self._driver.seq_len

  @seq_len.setter
  def seq_len(self, value) -> None:
    self._driver.start(value)

  def prefill(self, state: TieredKVState, k_prompt, v_prompt, prompt_lens):
    lens = np.asarray(prompt_lens)
    decode.check_prompt(self.cfg, k_prompt, v_prompt, lens)  # before any donation
    cfg = self.cfg
    # A page past the pool (or the scratch page), or at two positions, would take
    # the prompt's rows to where another position's are read (later misses wrong).
    table = check_page_table(state.page_table, (cfg.num_requests, cfg.pages_per_request),
                             cfg.num_host_pages)
    self._check_prompt_pages(table, lens)
    state = _prefill(self.cfg, state, k_prompt, v_prompt, jnp.asarray(lens, jnp.int32))
    self._driver.start(lens)
    return state

  def _check_prompt_pages(self, table, lens) -> None:
    for r, n in enumerate(lens.tolist()):
      check_prompt_pages(table[r], n, self.cfg.page_size, self.cfg.hot_slots,
                         f"request {r}")

  def _check_shared(self, rows: np.ndarray, name: str) -> None:
    """Index sharing: layer l (a multiple of index_share) picks for layers l ..
    l + index_share - 1, whose own rows the step never reads; other rows there
    would be attended (or fetched) as layer l's, silently."""
    share = self.cfg.index_share
    if share == 1 or rows.ndim != 4 or rows.shape[0] % share:
      return  # (a shape the trace refuses)
    groups = rows.reshape((rows.shape[0] // share, share) + rows.shape[1:])
    differ = (groups != groups[:, :1]).any(axis=(2, 3, 4))
    if differ.any():
      group, member = map(int, np.argwhere(differ)[0])
      raise ValueError(f"index_share={share}: layer {group * share + member} takes layer "
                       f"{group * share}'s {name}, so its row must repeat that one's")

  def _check_traces(self, state, q, k_new, v_new, selections, prefetch) -> None:
    """Trace the step abstractly once per input signature before any donation: a
    trace-time error (a shape, a prefetch wider than B, a selector the step cannot
    use) then leaves the caller's state as it was."""
    # Shapes and dtypes as they come (the state's are cfg's): no formatting, as
    # this runs every step.
    key = tuple(None if x is None else (np.shape(x), getattr(x, "dtype", type(x)))
                for x in (q, k_new, v_new, selections, prefetch))
    if key in self._traced:
      return
    cfg, selector = self.cfg, self.selector

    def whole_step(state, q, k_new, v_new, selections, prefetch):
      carry = decode.init_carry(cfg, state, selections, None, prefetch)
      return decode.decode_step(cfg, selector, carry, q, k_new, v_new)

    jax.eval_shape(whole_step, state, q, k_new, v_new, selections, prefetch)
    self._traced.add(key)

  def step(self, state: TieredKVState, q, k_new, v_new, selections=None, prefetch=None):
    """One step; ``prefetch`` i32[L, R, U, kp] optionally names next-step positions.

    Returns (out [L, R, Hq, D], state). Raises ``StepRefused`` (with the returned
    state) when a layer refused, ``ValueError`` before any change on malformed or
    out-of-range ``selections``, inputs of the wrong shape and a full host tier.
    """
    if isinstance(self.selector, GivenSelector):
      sel = np.asarray(selections)
      cfg = self.cfg
      want = (cfg.num_layers, cfg.num_requests, cfg.num_units, cfg.select_width)
      if sel.shape != want:
        raise ValueError(f"selections {sel.shape} must be [L, R, U, {cfg.select_width}]"
                         f" (rows of top_k={cfg.top_k}, rank_depth="
                         f"{cfg.policy.rank_depth}): {want}")
      self._driver.check_room()
      check_selection(sel, np.broadcast_to(self.seq_len[None, :, None], sel.shape[:-1]))
      self._check_shared(sel, "selections")
      selections = jnp.asarray(sel, jnp.int32)
    elif selections is not None:  # it would be ignored
      raise ValueError(f"{type(self.selector).__name__} picks the positions itself: "
                       "selections must be None")
    if prefetch is not None and self.cfg.index_share > 1:  # (no host copy otherwise)
      self._check_shared(np.asarray(prefetch), "prefetch")
    self._check_traces(state, q, k_new, v_new, selections, prefetch)
    try:
      out, carry = self._driver.step(state, q, k_new, v_new, selections, prefetch)
    except StepRefused as err:
      raise StepRefused(str(err), err.state.tier) from None
    return out, carry.tier

  @staticmethod
  def compiled_steps() -> int:
    """Compiled variants of the step, all decoders together (a new value must not
    retrace)."""
    return _decoder_step._cache_size()
