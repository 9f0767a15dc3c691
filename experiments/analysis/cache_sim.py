"""Trace replay of hot-cache replacement policies (pure numpy).

Questions like "how many fetches would a bigger hot cache, or another policy, save
on this selection trace?" need many replays of long traces, so ``replay`` runs on
the host in numpy rather than stepping the jitted ``resolve``. It is vectorised
across independent streams (layers, requests, units): each step is a handful of
``[S, B]`` array ops, with one Python iteration per step.

``"lru"`` reproduces ``kvtier_jax.resolve.resolve`` miss for miss (the newest-token
slot aside), so replayed counts are what the decode loop would fetch. ``"belady"``
is the offline optimum over the whole trace, a lower bound for every policy (not for
misses counted after a warm-up: a policy can move a few into it). The other policies are the
usual online candidates, adapted to set requests (see ``replay``);
``compare_policies`` tabulates them against both ends.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from kvtier_jax import policies

__all__ = ["POLICIES", "OFFLINE_POLICIES", "RANKED_POLICIES", "LEARNED",
           "LEARNED_FEATURES", "replay", "compare_policies", "synthetic_trace"]

POLICIES = ("lru", "fifo", "random", "belady", "clock", "sieve", "2q", "arc", "lru2",
            "freq", "score", "rank", "foresight")
OFFLINE_POLICIES = ("belady", "foresight")  # these read the future of the trace
RANKED_POLICIES = ("rank", "foresight")  # these read the selector's ranking
# A policy whose retention key is a function of LEARNED_FEATURES given to replay
# (``key_fn``), e.g. a model trained on another trace (learned_policy.py).
LEARNED = "learned"
LEARNED_FEATURES = (
    "rank_now",  # r / m: the selector's rank of the position this step (1: unranked)
    "rank_prev",  # the same one step earlier
    "freq",  # EMA (alpha) of the position's requests, kept after eviction
    "since_request",  # log1p(steps since the position's last request)
    "requests",  # log1p(requests of the position so far)
    "since_fetch",  # log1p(steps since the slot fetched it)
    "hits",  # log1p(requests of it since that fetch)
    "rel_pos",  # position / (largest position requested so far + 1)
    "rank_ema",  # EMA (1/2 per step) of rank_now, over every step since the start
    "ranked_freq",  # EMA (alpha) of [in the top-m ranking], every step
    "churn",  # the stream's misses per entry: EMA (CHURN_DECAY) over earlier steps
    # 1 where a draft token's selection for the next step names the position
    # (replay's ``drafted``: a two-token step computes it beside this one's); 0
    # without drafts.
    "drafted",
)
# Per step weight of the past in the "churn" feature (how fast a layer's selection
# moves tells how soon an evicted entry may be asked for again).
CHURN_DECAY = 0.8

_PAD = -1
_NEVER = np.iinfo(np.int64).max  # a key above every stamp


@dataclasses.dataclass(frozen=True)
class _Replay:
  """What a policy object knows about the whole replay (fixed for its duration)."""

  policy: str
  S: int  # streams
  B: int  # slots per stream
  T: int  # steps
  k: int  # selected entries per step
  num_pos: int  # dense position ids; num_pos is the padding id
  sel: np.ndarray  # i64[T, S, k]
  ranks: np.ndarray | None  # i64[T, S, m] ("rank", "foresight", "learned")
  rank_freq: float
  foresight: int  # "foresight": steps of the future it knows
  seed: int
  slot_ids: np.ndarray  # i64[B]
  alpha: float
  score_alpha: float
  twoq_in: float
  twoq_out: float
  key_fn: Any = None  # "learned": f[S, B, F] features -> f[S, B] retention keys
  collect: Any = None  # "learned": collect(t, features, candidates, reuse_in)
  history: int | None = None  # "learned": evicted positions whose history is kept
  drafted: np.ndarray | None = None  # i64[T, S, d] "learned": the draft's next picks


@dataclasses.dataclass
class _Step:
  """One step's view, handed to ``pick`` and then (completed) to ``commit``."""

  t: int
  rows: np.ndarray  # i64[S, 1]
  slot_ids: np.ndarray  # i64[B]
  scratch: int  # B: a column past the slots
  cur: np.ndarray  # i64[S, k] this step's dense ids
  hit: np.ndarray  # bool[S, k]
  miss: np.ndarray  # bool[S, k]
  num_miss: np.ndarray  # i64[S]
  pinned: np.ndarray  # bool[S, B] slots this step hits
  empty: np.ndarray  # bool[S, B]
  held_pos: np.ndarray  # i64[S, B] position held by each slot
  score: Any  # f[S, k] ("score") or None
  # Set after the victims are picked:
  slot_in: Any = None  # i64[S, k] slot serving each entry (B: padding)
  taken: Any = None  # bool[S, B] victims
  old_pos: Any = None  # i64[S, B] slot positions before the step
  evicted: Any = None  # bool[S, B] victims that held a position
  slot_pos: Any = None  # i64[S, B] after the step


def _validate(selections, capacity, policy) -> np.ndarray:
  """Checks every documented precondition; returns the selections as an array."""
  if policy not in POLICIES and policy != LEARNED:
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES} or "
                     f"{LEARNED!r}")
  sel = np.asarray(selections)
  if not np.issubdtype(sel.dtype, np.integer):
    raise ValueError(f"selections must be an integer array, got dtype {sel.dtype}")
  if sel.ndim < 2:
    raise ValueError(f"selections must have shape [..., T, k], got {sel.shape}")
  if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
    raise ValueError(f"capacity must be an int, got {capacity!r}")
  k = sel.shape[-1]
  if capacity < max(k, 1):
    raise ValueError(f"capacity={capacity} slots cannot hold the k={k} positions "
                     "one step requests at once: need capacity >= k (and >= 1)")
  if (sel < _PAD).any():
    where = tuple(int(i) for i in np.argwhere(sel < _PAD)[0])
    raise ValueError(f"selections{list(where)} = {int(sel[where])}: entries must "
                     "be positions >= 0 or -1 (padding)")
  srt = np.sort(sel, axis=-1)
  dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
  if dup.any():
    where = tuple(int(i) for i in np.argwhere(dup)[0])
    raise ValueError(f"position {int(srt[where])} appears twice in selections row "
                     f"{list(where[:-1])}; a step's positions must be distinct")
  return sel


def _validate_params(params) -> None:
  """Decays lie in [0, 1]; 2Q's list sizes in (0, 1] of the capacity."""
  for name, value in params.items():
    closed = name.endswith("alpha")
    if not 0.0 <= value <= 1.0 or (value == 0.0 and not closed):
      raise ValueError(f"{name}={value} must lie in "
                       f"{'[0, 1]' if closed else '(0, 1]'}")


def _validate_scores(scores, sel) -> np.ndarray:
  """f64[..., T, k] selector scores (derived from row order when None)."""
  k = sel.shape[-1]
  if scores is None:  # top-k selectors emit rows best first
    return np.broadcast_to(1.0 - np.arange(k) / max(k, 1), sel.shape)
  scores = np.asarray(scores, np.float64)
  if scores.shape != sel.shape:
    raise ValueError(f"scores {scores.shape} must have the shape of selections "
                     f"{sel.shape}")
  used = scores[sel >= 0]
  if not (np.isfinite(used).all() and (used >= 0).all()):
    raise ValueError("scores of valid entries must be finite and >= 0 (e.g. "
                     "attention probabilities); higher = more important")
  return scores


def _validate_ranks(ranks, sel, name: str = "ranks") -> np.ndarray:
  """i64[..., T, m]: the selector's preference order at each step (m may exceed k),
  or another row of positions per step (``name``)."""
  ranks = np.asarray(ranks)
  if not np.issubdtype(ranks.dtype, np.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {ranks.dtype}")
  if ranks.ndim != sel.ndim or ranks.shape[:-1] != sel.shape[:-1]:
    raise ValueError(f"{name} {ranks.shape} must be [..., T, m] with the leading "
                     f"dims of selections {sel.shape}")
  if (ranks < _PAD).any():
    raise ValueError(f"{name} entries must be positions >= 0 or -1 (padding)")
  srt = np.sort(ranks, axis=-1)
  if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
    raise ValueError(f"a position appears twice in a {name} row")
  return ranks


def _dense_ids(sel: np.ndarray) -> tuple[np.ndarray, int]:
  """Relabels positions per stream so the position->slot tables stay small.

  Every policy only compares positions for equality, so any injective relabeling
  leaves the miss counts unchanged. Sparse position spaces (say offsets of 2**40)
  would otherwise need a huge table; dense ones are kept as they are.

  Args:
    sel: i64[T, S, k] positions, -1 padding.

  Returns:
    (ids, num_pos): i64[T, S, k] with ids in [0, num_pos) and padding mapped to
    ``num_pos``, a column of the tables that never holds a slot.
  """
  num_steps, num_streams, k = sel.shape
  top = int(sel.max(initial=_PAD)) + 1
  if top <= 4 * num_steps * k + 1024:
    return np.where(sel >= 0, sel, top), top
  flat = np.moveaxis(sel, 1, 0).reshape(num_streams, -1)  # i64[S, T*k]
  order = np.argsort(flat, axis=1)
  srt = np.take_along_axis(flat, order, axis=1)
  new = np.zeros(srt.shape, np.int64)
  new[:, 1:] = np.cumsum(srt[:, 1:] != srt[:, :-1], axis=1)
  ids = np.empty_like(new)
  np.put_along_axis(ids, order, new, axis=1)
  ids = np.moveaxis(ids.reshape(num_streams, num_steps, k), 0, 1)
  num_pos = int(new[:, -1].max()) + 1
  return np.where(sel >= 0, ids, num_pos), num_pos


def _next_use(sel: np.ndarray, num_pos: int) -> np.ndarray:
  """i32[T, S, k]: the next step that requests each entry again, T for never.

  One reverse scan with a per-stream "last seen" table; padding entries share the
  padding column and get meaningless values that are never read.
  """
  num_steps, num_streams, _ = sel.shape
  rows = np.arange(num_streams)[:, None]
  last = np.full((num_streams, num_pos + 1), num_steps, np.int32)
  nxt = np.empty(sel.shape, np.int32)
  for t in range(num_steps - 1, -1, -1):
    nxt[t] = last[rows, sel[t]]
    last[rows, sel[t]] = t
  return nxt


def _queue_step(order, hit_slot, num_miss, lru: bool):
  """Advances an LRU/FIFO queue by one step; returns (new order, victims' start).

  ``order[s]`` is a permutation of slot ids, front evicted first (initially slot
  order, all empty). Evictable slots are the non-hits; the j-th miss takes the
  j-th evictable in queue order. Both policies are a *stable* partition of the old
  queue, so keying a stable sort by group reproduces the resolve rule exactly:

  * lru:  [evictables not taken] ++ [victims] ++ [hits]
  * fifo: [everything not taken, hits staying in place] ++ [victims]

  Victims keep their old relative order, which is miss order (the j-th miss took
  the j-th), so the fetched positions sit in selection order, and the j-th miss's
  slot is ``new_order[start + j]``.
  """
  hit_q = np.take_along_axis(hit_slot, order, axis=1)  # bool[S, B] in queue order
  ev_rank = np.cumsum(~hit_q, axis=1) - 1  # rank among evictables
  victim_q = ~hit_q & (ev_rank < num_miss[:, None])
  group = victim_q.astype(np.int8)
  if lru:
    group += 2 * hit_q
  new_order = np.take_along_axis(
      order, np.argsort(group, axis=1, kind="stable"), axis=1)
  num_slots = order.shape[1]
  start = num_slots - num_miss
  if lru:
    start -= hit_q.sum(axis=1)
  return new_order, start


# ------------------------------------------------------------ shared helpers --
# Per-slot state arrays have B + 1 columns: column B is a scratch sink that the
# step's padding entries write to, so updates need no masking.


def _smallest(keys, n) -> np.ndarray:
  """bool[S, W]: the n[s] smallest keys per row; candidates' keys are distinct
  stamps, others ``_NEVER``, n[s] <= #candidates (so a threshold suffices)."""
  srt = np.sort(keys, axis=1)
  thr = srt[np.arange(keys.shape[0]), np.maximum(n - 1, 0)]
  return (keys <= thr[:, None]) & (n > 0)[:, None]


def _lex_pick(st, *keys):
  """Eviction order: empty slots by id, then unpinned ones by ``keys`` (most
  significant first, then slot id), pinned last; the j-th miss takes pick[j]."""
  group = np.where(st.empty, 0, np.where(st.pinned, 2, 1))
  cols = [np.where(st.empty, 0, key) for key in reversed(keys)]
  ids = np.broadcast_to(st.slot_ids, group.shape)
  return np.lexsort([ids, *cols, group], axis=-1), 0


def _touch(rec, st, moved=None) -> None:
  """Restamps requested entries (``rec``: i64[S, B+1]) in resolve's LRU order
  (docs/DESIGN.md, "RESOLVE"): misses in selection order, then the (``moved``) hits in
  their old relative order. Stamps stay below ``(t + 1) * 2k``."""
  k = st.cur.shape[1]
  hit = st.hit if moved is None else st.hit & moved
  old = np.where(hit, rec[st.rows, st.slot_in], _NEVER)
  hit_rank = np.argsort(np.argsort(old, axis=1, kind="stable"), axis=1)
  stamp = st.t * 2 * k + np.where(st.miss, np.cumsum(st.miss, axis=1) - 1,
                                  k + hit_rank)
  rec[st.rows, np.where(st.miss | hit, st.slot_in, st.scratch)] = stamp


def _born(st):
  """i64[S, k] insertion stamps of the step's misses, in selection order."""
  return st.t * st.cur.shape[1] + np.cumsum(st.miss, axis=1) - 1


def _split(need, n_a, cand_a, key_a, cand_b, key_b):
  """bool[S, B] ``need`` victims: the n_a oldest candidates of list a, the rest
  from list b, and more from a where b runs out."""
  n_a = np.where(need - n_a > cand_b.sum(axis=1), need - cand_b.sum(axis=1), n_a)
  return (_smallest(np.where(cand_a, key_a, _NEVER), n_a)
          | _smallest(np.where(cand_b, key_b, _NEVER), need - n_a))


def _sweep(seq, pinned, ref, n):
  """A CLOCK/SIEVE hand over one step's ``n`` victims, all sweeps at once.

  The hand visits slots by increasing ``seq`` (cyclically), skips pinned ones
  without touching them, clears set ``ref`` bits (second chance) and takes the
  first unreferenced slot. Unreferenced slots are therefore taken in hand order;
  once a full turn has cleared every bit, the formerly referenced ones follow in
  hand order.

  Returns:
    (pick, clear, last): i64[S, B] eviction order, the bits the hand cleared, and
    i64[S] the slot of the n-th victim (meaningless where n == 0).
  """
  group = np.where(pinned, 2, ref.astype(np.int64))
  pick = np.lexsort([seq, group], axis=-1)
  rows = np.arange(seq.shape[0])
  last = pick[rows, np.maximum(n - 1, 0)]
  wrapped = n > (group == 0).sum(axis=1)
  reach = np.where(wrapped, _NEVER, seq[rows, last])  # hand passed seq < reach
  clear = (group == 1) & (seq < reach[:, None]) & (n > 0)[:, None]
  return pick, clear, last


class _Ghosts:
  """Evicted positions kept without data (2Q's A1out, ARC's B1/B2): at most
  ``size`` per stream, each with a list id and an age key (smaller = older)."""

  def __init__(self, num_streams, size, num_pos):
    self.pos = np.full((num_streams, size), _PAD, np.int64)
    self.key = np.zeros((num_streams, size), np.int64)
    self.lst = np.zeros((num_streams, size), np.int8)
    self.of = np.full((num_streams, num_pos + 1), _PAD, np.int64)

  def count(self, lst):
    return ((self.pos >= 0) & (self.lst == lst)).sum(axis=1)

  def drop(self, rr, gg):
    self.of[rr, self.pos[rr, gg]] = _PAD
    self.pos[rr, gg] = _PAD

  def push(self, pos, mask, key, lst):
    """Adds ``pos[mask]`` (i64[S, W]) with their keys and list ids to free slots."""
    free = np.argsort(self.pos >= 0, axis=1, kind="stable")
    rr, cc = np.nonzero(mask)
    gg = free[rr, (np.cumsum(mask, axis=1) - 1)[rr, cc]]
    self.pos[rr, gg], self.key[rr, gg] = pos[rr, cc], key[rr, cc]
    self.lst[rr, gg] = lst[rr, cc]
    self.of[rr, pos[rr, cc]] = gg

  def trim(self, lst, keep):
    """Forgets the oldest ghosts of list ``lst`` beyond ``keep`` (i64[S])."""
    member = (self.pos >= 0) & (self.lst == lst)
    over = np.maximum(member.sum(axis=1) - np.maximum(keep, 0), 0)
    self.drop(*np.nonzero(_smallest(np.where(member, self.key, _NEVER), over)))


# ------------------------------------------------------------------ policies --


class _Policy:
  """pick(st) -> (pick, start): the j-th miss of step st takes slot pick[start + j];
  commit(st) then updates the policy's state (the slot tables are already done)."""

  def commit(self, st):
    pass


class _Queue(_Policy):  # lru / fifo

  def __init__(self, c, lru):
    self.order, self.lru = np.broadcast_to(c.slot_ids, (c.S, c.B)).copy(), lru

  def pick(self, st):
    self.order, start = _queue_step(self.order, st.pinned, st.num_miss, self.lru)
    return self.order, start


class _Random(_Policy):

  def __init__(self, c):
    self.rng, self.shape = np.random.default_rng(c.seed), (c.S, c.B)

  def pick(self, st):
    draws = self.rng.random(self.shape)  # every step: draws depend on shape only
    keys = np.where(st.empty, st.slot_ids - self.shape[1], draws)
    keys[st.pinned] = 2.0
    return np.argsort(keys, axis=1), 0


class _Belady(_Policy):

  def __init__(self, c):
    self.nxt = _next_use(c.sel, c.num_pos)  # i32[T, S, k]
    self.slot_next = np.zeros((c.S, c.B + 1), np.int64)  # next use of each entry

  def pick(self, st):
    # Furthest next use first. Ties (entries wanted together at the same later
    # step, or never again) do not change the count, see the tests.
    return _lex_pick(st, -self.slot_next[:, :-1])

  def commit(self, st):
    self.slot_next[st.rows, st.slot_in] = self.nxt[st.t]


class _Clock(_Policy):

  def __init__(self, c):
    self.ref = np.zeros((c.S, c.B + 1), bool)
    self.hand = np.zeros(c.S, np.int64)

  def pick(self, st):
    num_slots = st.slot_ids.size
    seq = (st.slot_ids - self.hand[:, None]) % num_slots
    pick, self.clear, last = _sweep(seq, st.pinned, self.ref[:, :-1], st.num_miss)
    self.hand = np.where(st.num_miss > 0, (last + 1) % num_slots, self.hand)
    return pick, 0

  def commit(self, st):
    self.ref[:, :-1] &= ~self.clear
    self.ref[st.rows, st.slot_in] = st.hit  # hits referenced, new entries not


class _Sieve(_Policy):

  def __init__(self, c):
    self.born = np.zeros((c.S, c.B + 1), np.int64)  # insertion stamp: queue order
    self.vis = np.zeros((c.S, c.B + 1), bool)
    self.hand = np.zeros(c.S, np.int64)  # examine the oldest born >= hand first
    self.wrap = (c.T + 1) * c.k  # above every stamp

  def pick(self, st):
    born = self.born[:, :-1]
    seq = np.where(st.empty, st.slot_ids - self.wrap,
                   np.where(born >= self.hand[:, None], born, born + self.wrap))
    pick, self.clear, self.last = _sweep(seq, st.pinned, self.vis[:, :-1],
                                         st.num_miss)
    return pick, 0

  def commit(self, st):
    # The hand rests on the last victim's newer neighbour among the old entries,
    # or on the tail (hand 0) if none is left.
    born = self.born[:, :-1]
    last_born = born[st.rows[:, 0], self.last]
    newer = ~st.empty & ~st.taken & (born > last_born[:, None])
    self.hand = np.where(st.num_miss > st.empty.sum(axis=1),
                         np.where(newer.any(axis=1), last_born + 1, 0), self.hand)
    self.vis[:, :-1] &= ~self.clear
    self.vis[st.rows, st.slot_in] = st.hit
    self.born[st.rows, np.where(st.miss, st.slot_in, st.scratch)] = _born(st)


class _TwoQ(_Policy):

  def __init__(self, c):
    self.am = np.zeros((c.S, c.B + 1), bool)  # False: A1in (FIFO), True: Am (LRU)
    self.born = np.zeros((c.S, c.B + 1), np.int64)
    self.rec = np.zeros((c.S, c.B + 1), np.int64)
    self.kin = max(1, round(c.twoq_in * c.B))
    self.kout = max(1, round(c.twoq_out * c.B))
    self.ghosts = _Ghosts(c.S, self.kout + c.k, c.num_pos)
    self.age = (c.T + 1) * 2 * c.k  # ghost key = step * age + stamp

  def pick(self, st):
    self.g = self.ghosts.of[st.rows, st.cur]  # i64[S, k]
    self.ghit = st.miss & (self.g >= 0)
    am, filled = self.am[:, :-1], ~st.empty
    a1 = filled & ~am
    cand_in, cand_m = a1 & ~st.pinned, filled & am & ~st.pinned
    need = np.maximum(st.num_miss - st.empty.sum(axis=1), 0)
    n_new = (st.miss & ~self.ghit).sum(axis=1)
    # 2Q's reclaim, one admission at a time (A1out ghosts first, then new entries):
    # each takes from A1in while |A1in| > Kin, and a new entry that did not grows it.
    over = a1.sum(1) + n_new - (n_new > 0) - self.kin
    n_in = np.minimum(np.minimum(need, np.maximum(over, 0)), cand_in.sum(axis=1))
    return _lex_pick(st, ~_split(need, n_in, cand_in, self.born[:, :-1], cand_m,
                                 self.rec[:, :-1]))

  def commit(self, st):
    am = self.am[:, :-1].copy()
    rr, cc = np.nonzero(self.ghit)
    self.ghosts.drop(rr, self.g[rr, cc])
    out = st.evicted & ~am
    self.ghosts.push(st.old_pos, out, st.t * self.age + self.born[:, :-1],
                     np.ones(am.shape, np.int8))
    self.ghosts.trim(1, np.full(am.shape[0], self.kout))
    _touch(self.rec, st, moved=self.am[st.rows, st.slot_in])  # Am hits only
    miss_slot = np.where(st.miss, st.slot_in, st.scratch)
    self.am[st.rows, miss_slot] = self.ghit
    self.born[st.rows, miss_slot] = _born(st)


class _Arc(_Policy):

  def __init__(self, c):
    self.t2 = np.zeros((c.S, c.B + 1), bool)  # False: T1, True: T2
    self.rec = np.zeros((c.S, c.B + 1), np.int64)
    self.p = np.zeros(c.S)  # target size of T1
    self.ghosts = _Ghosts(c.S, 2 * c.B, c.num_pos)
    self.age, self.size = (c.T + 1) * 2 * c.k, c.B

  def pick(self, st):
    gh = self.ghosts
    self.g = gh.of[st.rows, st.cur]
    glst = gh.lst[st.rows, np.maximum(self.g, 0)]
    self.ghit = st.miss & (self.g >= 0)
    n1 = (self.ghit & (glst == 1)).sum(axis=1)
    n2 = (self.ghit & (glst == 2)).sum(axis=1)
    b1, b2 = gh.count(1).astype(np.float64), gh.count(2).astype(np.float64)
    r1 = np.maximum(b2 / np.maximum(b1, 1.0), 1.0)
    r2 = np.maximum(b1 / np.maximum(b2, 1.0), 1.0)
    self.p = np.minimum(self.size, np.maximum(0.0, self.p + (n1 * r1 - n2 * r2)))
    t2, filled = self.t2[:, :-1], ~st.empty
    cand1, cand2 = filled & ~t2 & ~st.pinned, filled & t2 & ~st.pinned
    need = np.maximum(st.num_miss - st.empty.sum(axis=1), 0)
    j = np.arange(st.cur.shape[1])
    # REPLACE takes T1's LRU while |T1| > p (T1 shrinks as it gives), else T2's;
    # a step whose one miss is a B2 ghost also takes T1's at |T1| == p (FAST'03).
    left1 = cand1.sum(1)[:, None] - j
    one_b2 = ((st.num_miss == 1) & (n2 == 1))[:, None]
    take1 = ((left1 > self.p[:, None]) | (one_b2 & (left1 > 0) & (left1 == self.p[:, None]))
             ) & (j < need[:, None])
    rec = self.rec[:, :-1]
    return _lex_pick(st, ~_split(need, take1.sum(axis=1), cand1, rec, cand2, rec))

  def commit(self, st):
    gh, t2 = self.ghosts, self.t2[:, :-1].copy()
    rr, cc = np.nonzero(self.ghit)
    gh.drop(rr, self.g[rr, cc])
    gh.push(st.old_pos, st.evicted, st.t * self.age + self.rec[:, :-1],
            np.where(t2, 2, 1).astype(np.int8))
    _touch(self.rec, st)
    self.t2[st.rows, st.slot_in] = ~st.miss | self.ghit  # only new entries in T1
    filled = st.slot_pos >= 0
    n_t1 = (filled & ~self.t2[:, :-1]).sum(axis=1)
    gh.trim(1, self.size - n_t1)  # |T1| + |B1| <= c
    gh.trim(2, 2 * self.size - filled.sum(axis=1) - gh.count(1))  # directory <= 2c


class _Ranked(_Policy):  # lru2 / freq / score: evict the smallest (key, LRU stamp)

  def __init__(self, c, kind):
    self.kind, self.c = kind, c
    self.rec = np.zeros((c.S, c.B + 1), np.int64)
    self.key = np.zeros((c.S, c.B + 1), np.float64 if kind != "lru2" else np.int64)
    self.last = np.zeros((c.S, c.B + 1), np.int64)  # lru2: last request step

  def pick(self, st):
    return _lex_pick(st, self.key[:, :-1], self.rec[:, :-1])

  def commit(self, st):
    _touch(self.rec, st)
    at = (st.rows, st.slot_in)
    if self.kind == "lru2":  # key = second most recent request step, -1 if none
      self.key[at] = np.where(st.hit, self.last[at], -1)
      self.last[at] = st.t
      return
    if self.kind == "freq":  # the library's EMA (kvtier_jax/policies.py)
      touched = np.zeros(self.key.shape, bool)
      touched[at] = True
      hit = np.zeros(self.key.shape, bool)
      hit[at] = st.hit
      self.key = policies.filled(policies.decayed(self.key, hit, self.c.alpha),
                                 touched & ~hit)
      return
    self.key *= self.c.score_alpha
    self.key[at] = np.where(st.hit, self.key[at] + st.score, st.score)


def _rank_of(c, st):
  """(i64[S, num_pos + 1] each position's index in this step's ranking, m where
  absent or padding; m): the selector's ranking as a position table."""
  ranked = c.ranks[st.t]  # i64[S, m] dense ids, padding = num_pos
  num_ranked = ranked.shape[1]
  rank_of = np.full((c.S, c.num_pos + 1), num_ranked, np.int64)
  rank_of[st.rows, ranked] = np.arange(num_ranked)
  rank_of[:, c.num_pos] = num_ranked  # padding ranks nothing
  return rank_of, num_ranked


class _Rank(_Ranked):
  """Evict the lowest ``(1 - rank / m) + rank_freq * f``: the selector's current rank
  of the entry (absent = m, the worst) plus ``rank_freq`` times its "freq" EMA f
  (kept by ``_Ranked``); ties by LRU."""

  def __init__(self, c):
    super().__init__(c, "freq")

  def pick(self, st):
    c = self.c
    rank_of, num_ranked = _rank_of(c, st)
    rank = rank_of[st.rows, np.where(st.empty, c.num_pos, st.held_pos)]
    key = policies.rank_key(rank, num_ranked, self.key[:, :-1], c.rank_freq)
    return _lex_pick(st, key, self.rec[:, :-1])


class _Foresight(_Rank):
  """``"rank"`` that also knows the next ``foresight`` steps exactly: entries
  requested again within them are kept over all others, the sooner the longer
  (Belady inside the horizon); the rest go by the rank key. How far ahead an
  eviction must see to close a given share of the gap: an offline reference."""

  def __init__(self, c):
    super().__init__(c)
    self.nxt = _next_use(c.sel, c.num_pos)  # i32[T, S, k], T: never
    self.slot_next = np.full((c.S, c.B + 1), c.T, np.int64)

  def pick(self, st):
    c = self.c
    rank_of, num_ranked = _rank_of(c, st)
    rank = rank_of[st.rows, np.where(st.empty, c.num_pos, st.held_pos)]
    key = policies.rank_key(rank, num_ranked, self.key[:, :-1], c.rank_freq)
    until = self.slot_next[:, :-1] - st.t
    foreseen = (self.slot_next[:, :-1] < c.T) & (until <= c.foresight)
    return _lex_pick(st, foreseen, np.where(foreseen, -until, 0), key,
                     self.rec[:, :-1])

  def commit(self, st):
    super().commit(st)
    self.slot_next[st.rows, st.slot_in] = self.nxt[st.t]


class _Learned(_Policy):
  """Evict the smallest ``key_fn(features)`` (LEARNED_FEATURES, per slot), ties by
  LRU. The per-position history (last request, count, EMA, previous rank) outlives
  evictions: a fixed table of one entry per position, like the position map."""

  def __init__(self, c):
    num_cols = c.num_pos + 1  # the padding column never holds a slot
    self.c = c
    self.rec = np.zeros((c.S, c.B + 1), np.int64)  # LRU stamps (ties)
    self.last_req = np.zeros((c.S, num_cols), np.int64)
    self.count = np.zeros((c.S, num_cols), np.int64)
    self.ema = np.zeros((c.S, num_cols))  # as of the step last_req
    self.prev_rank = np.ones((c.S, num_cols))
    self.rank_ema = np.ones((c.S, num_cols))
    self.ranked_freq = np.zeros((c.S, num_cols))
    self.fetched = np.zeros((c.S, c.B + 1), np.int64)
    self.hits = np.zeros((c.S, c.B + 1), np.int64)
    self.top = np.zeros((c.S, 1))
    self.churn = np.zeros((c.S, 1))
    if c.history is not None:  # eviction number of each position's last eviction
      self.evicted_as = np.full((c.S, num_cols), _PAD, np.int64)
      self.evictions = np.zeros((c.S, 1), np.int64)
    if c.collect is not None:
      self.nxt = _next_use(c.sel, c.num_pos)
      self.slot_next = np.zeros((c.S, c.B + 1), np.int64)

  def pick(self, st):
    c = self.c
    rank_of, num_ranked = _rank_of(c, st)
    self.rank_now = rank_of / num_ranked
    self.rank_ema = 0.5 * self.rank_ema + 0.5 * self.rank_now
    self.ranked_freq = c.alpha * self.ranked_freq + (rank_of < num_ranked)
    valid = st.cur < c.num_pos
    self.top = np.maximum(self.top, np.where(valid, st.cur, -1).max(1, keepdims=True))
    pos = np.where(st.empty, c.num_pos, st.held_pos)  # i64[S, B]
    since = st.t - self.last_req[st.rows, pos]
    feats = np.stack([
        self.rank_now[st.rows, pos], self.prev_rank[st.rows, pos],
        self.ema[st.rows, pos] * c.alpha ** since, np.log1p(since),
        np.log1p(self.count[st.rows, pos]), np.log1p(st.t - self.fetched[:, :-1]),
        np.log1p(self.hits[:, :-1]), pos / (self.top + 1.0),
        self.rank_ema[st.rows, pos], self.ranked_freq[st.rows, pos],
        np.broadcast_to(self.churn, pos.shape), self._drafted(st, pos)],
        axis=-1)  # f64[S, B, F]
    if c.collect is not None:  # candidates: filled slots this step does not request
      c.collect(st.t, feats, ~st.empty & ~st.pinned, self.slot_next[:, :-1] - st.t)
    key = np.asarray(c.key_fn(feats), np.float64)
    if key.shape != st.empty.shape or not np.isfinite(key).all():
      raise ValueError(f"key_fn must return finite keys of shape {st.empty.shape}, "
                       f"got {key.shape}")
    return _lex_pick(st, key, self.rec[:, :-1])

  def _drafted(self, st, pos):
    """f64[S, B]: 1 where the draft's selection for step t + 1 names ``pos``."""
    c = self.c
    if c.drafted is None:
      return np.zeros(pos.shape)
    named = np.zeros((c.S, c.num_pos + 1), bool)
    named[st.rows, c.drafted[st.t]] = True
    named[:, c.num_pos] = False  # padding names nothing
    return named[st.rows, pos].astype(np.float64)

  def commit(self, st):
    c, rows = self.c, st.rows
    cur = st.cur  # padding entries write the padding column
    if c.history is not None:
      self._forget_untracked(st)
    since = st.t - self.last_req[rows, cur]
    self.ema[rows, cur] = np.where(self.count[rows, cur] > 0,
                                   self.ema[rows, cur] * c.alpha ** since, 0.0) + 1.0
    self.count[rows, cur] += 1
    self.last_req[rows, cur] = st.t
    self.prev_rank = self.rank_now
    miss_slot = np.where(st.miss, st.slot_in, st.scratch)
    hit_slot = np.where(st.hit, st.slot_in, st.scratch)
    self.fetched[rows, miss_slot] = st.t
    self.hits[rows, miss_slot] = 0
    self.hits[rows, hit_slot] += 1
    self.churn = (CHURN_DECAY * self.churn
                  + (1 - CHURN_DECAY) * st.num_miss[:, None] / cur.shape[1])
    _touch(self.rec, st)
    if c.collect is not None:
      self.slot_next[rows, st.slot_in] = self.nxt[st.t]
    if c.history is not None:
      self._count_evictions(st)

  def _forget_untracked(self, st):
    """``history`` bounded: a missed position that is not among its stream's last
    ``history`` evictions enters with no history, as if never seen: its ranking
    EMAs hold only this step's ranking (``pick`` folded it in already)."""
    rows = np.broadcast_to(st.rows, st.cur.shape)
    stamp = self.evicted_as[rows, st.cur]  # numbers from 0: the last G read 1..G back
    kept = (stamp != _PAD) & (self.evictions - stamp <= self.c.history)
    r, p = rows[st.miss & ~kept], st.cur[st.miss & ~kept]
    self.last_req[r, p], self.count[r, p], self.ema[r, p] = 0, 0, 0.0
    self.rank_ema[r, p] = 0.5 + 0.5 * self.rank_now[r, p]
    self.ranked_freq[r, p] = self.rank_now[r, p] < 1

  def _count_evictions(self, st):
    """Numbers this step's evictions per stream, in the order the misses took
    their victims (the key order)."""
    rows = np.broadcast_to(st.rows, st.cur.shape)
    old = st.old_pos[rows, np.where(st.miss, st.slot_in, 0)]
    evicts = st.miss & (old >= 0)  # i64[S, k]: a miss that displaced a position
    number = self.evictions + np.cumsum(evicts, axis=1) - 1
    self.evicted_as[rows[evicts], old[evicts]] = number[evicts]
    self.evictions += evicts.sum(axis=1, keepdims=True)


def _make_policy(c):
  if c.policy in ("lru", "fifo"):
    return _Queue(c, c.policy == "lru")
  if c.policy in ("lru2", "freq", "score"):
    return _Ranked(c, c.policy)
  return {"random": _Random, "belady": _Belady, "clock": _Clock, "sieve": _Sieve,
          "2q": _TwoQ, "arc": _Arc, "rank": _Rank, "foresight": _Foresight,
          LEARNED: _Learned}[c.policy](c)


def replay(selections, capacity: int, policy: str, *, seed: int = 0, scores=None,
           ranks=None, alpha: float = 0.9, score_alpha: float = 0.8,
           twoq_in: float = 0.25, twoq_out: float = 0.5,
           rank_freq: float = 0.3, foresight: int = 4, key_fn=None,
           collect=None, history: int | None = None, drafted=None) -> np.ndarray:
  """Misses per step of a hot cache of ``capacity`` slots replaying a trace.

  Demand paging: all of a step's positions must be resident together, so nothing
  the step requests (hit or just fetched) is evicted; the cache starts empty and
  empty slots are filled first, in slot order. A step is a *set* request, so the
  one-request-at-a-time classics are applied per step as: hits, then all of the
  step's evictions chosen on the old contents, then insertion of the misses in
  selection order. "LRU order" is resolve's: misses become most recent in
  selection order, the step's hits above them in their old relative order.

  Policies (``POLICIES``; ties by LRU unless said otherwise):

  * ``"lru"``: exactly ``resolve``'s order (see ``_queue_step``).
  * ``"fifo"``: evict the earliest inserted; hits do not reorder.
  * ``"random"``: evict uniformly at random: each step draws
    ``rng.random((S, capacity))`` from ``np.random.default_rng(seed)`` (S = batch
    dims flattened in C order) and a miss takes the evictable filled slot with the
    smallest draw; deterministic per seed, and causal.
  * ``"belady"`` (offline, ``OFFLINE_POLICIES``): evict the entry requested again
    furthest in the future (never = infinitely far).
  * ``"clock"``: a ring of slots, a hand (from slot 0) and a reference bit set by
    hits, clear for new entries. Per miss the hand skips pinned slots untouched,
    clears set bits and takes the first clear slot, stopping just past it; the
    empty slots are the ones ahead of it during warm-up.
  * ``"sieve"`` (NSDI'24): a FIFO queue with a visited bit (set by hits, clear for
    new entries, which enter at the head); the hand walks from the tail towards
    the head, wrapping, skips pinned entries, clears visited bits, evicts the first
    unvisited entry and rests on its newer neighbour (the tail if none is left).
  * ``"2q"`` (full 2Q, VLDB'94): new entries enter the FIFO A1in; its evictions go
    to the ghost FIFO A1out (``twoq_out * B`` ids); a miss found in A1out enters
    the LRU list Am; Am hits become most recent, A1in hits change nothing. An
    eviction takes A1in's oldest unrequested entry while |A1in| plus the step's new
    admissions to A1in but one exceeds Kin = ``twoq_in * B`` (|A1in| falls as it
    gives), else Am's LRU unrequested entry; if that list has none, the other's.
    That is the paper's "reclaim from A1in when |A1in| > Kin", one admission at a
    time, with a step's A1out ghosts admitted before its new entries (tested against
    the paper's algorithm at one request a step).
  * ``"arc"`` (FAST'03): T1/T2 with ghosts B1/B2. Hits move to T2; p moves by
    ``+max(|B2|/|B1|, 1)`` per B1-ghost miss and ``-max(|B1|/|B2|, 1)`` per B2 one
    (start-of-step sizes, summed, clipped to [0, B]); each eviction takes T1's LRU
    (to B1) while |T1| > p (unrequested T1; it falls as it gives), else T2's LRU
    unrequested (to B2), else T1's; at |T1| == p too when the step's one miss is a
    B2 ghost (the paper's rule for its current miss; a step of several misses has
    none, so there the rule is dropped). Ghost misses enter T2, new ones T1; then B1
    keeps its newest B - |T1| ghosts and B2 its newest 2B - |T1| - |T2| - |B1|.
    At k > 1 this is a batched approximation, not the paper's rule one request at a
    time: |T1| leaves out the step's own T1 admissions (2Q's rule counts them) and
    p moves once per step. Against a one-at-a-time ARC (a review, 2026-12-05) the
    gap closed moved by -0.03..-0.04 at B = 1.25k and within 0.01 at 2k.
  * ``"lru2"`` (LRU-K, K=2): evict the entry whose second most recent request step
    is oldest; entries requested once since their fetch rank below all others.
    History is kept for resident entries only (a refetch starts afresh).
  * ``"freq"``: ``f <- alpha * f + [requested]`` per resident entry and step (new
    entries start at 1; no ghost history, so one float per slot); evict min f.
  * ``"score"``: ``e <- score_alpha * e + score`` (0 when not requested; new entries
    start at their score); evict min e.
  * ``"rank"``: evict the entry the selector ranks worst *now*, softened by how often
    it was requested: the smallest ``(1 - r / m) + rank_freq * f``, r = its
    position's index in this step's ``ranks`` row (m, the row length, if absent)
    and f the ``"freq"`` EMA (``alpha``); ties by LRU. The selector scored every
    position to pick its top k, so the ranking of the resident ones is known at
    selection time (causal). ``rank_freq=0``: the rank alone.
  * ``"foresight"`` (offline, ``OFFLINE_POLICIES``): ``"rank"`` plus exact
    knowledge of the next ``foresight`` steps: entries requested again within
    them are kept over all others, sooner reuse kept longer; the others, and ties,
    as ``"rank"``. ``foresight=0`` is ``"rank"``; ``foresight >= T`` has
    Belady's misses. It measures how far ahead an eviction must see (a draft's
    lookahead sees one step) to close a share of the gap.
  * ``"learned"`` (``LEARNED``, not in ``POLICIES``): evict the smallest
    ``key_fn(features)``, ties by LRU; ``features`` f64[S, B, F] are
    ``LEARNED_FEATURES`` of each slot at eviction time (all causal; the
    position history is kept after eviction; ``rel_pos`` assumes the ids are
    positions, true whenever they are dense), ``ranks`` as for ``"rank"``.

  Args:
    selections: int[..., T, k] positions requested at each step, distinct within a
      row, -1 = padding. Leading dims are independent streams (e.g. layers).
    capacity: hot slots per stream, >= k.
    policy: one of ``POLICIES``.
    seed: seeds the ``"random"`` policy; ignored otherwise.
    ranks: ``"rank"`` and ``"foresight"`` only: int[..., T, m] the selector's
      preference order at each step, best first, -1 padding; m may exceed k (e.g.
      a top-4k ranking whose first k entries are the selection). None: the
      selections' own row order.
    scores: ``"score"`` only: f[..., T, k] selector scores aligned with
      ``selections``, finite and >= 0 for valid entries (e.g. attention
      probabilities), higher = more important. None: rank r in the row -> 1 - r/k,
      since top-k selectors emit rows best first.
    alpha: ``"freq"`` decay per step in [0, 1] (memory ~1 / (1 - alpha) steps).
    score_alpha: ``"score"`` decay per step in [0, 1].
    twoq_in, twoq_out: ``"2q"`` Kin and Kout as fractions of capacity, in (0, 1]
      (the paper's 25% and 50%).
    rank_freq: ``"rank"`` (and ``"foresight"``) weight of the frequency EMA, >= 0.
    foresight: ``"foresight"`` steps of the future known, an int >= 0.
    key_fn: ``"learned"`` only: f64[S, B, F] -> f[S, B] retention keys (higher
      keeps longer); S = streams, B = capacity.
    collect: ``"learned"`` only, for training: called at every step before the
      eviction as ``collect(t, features, candidates, reuse_in)``, candidates
      bool[S, B] the filled slots the step does not request (the ones it may
      evict), reuse_in i64[S, B] the steps until their next request (T - t: never).
      It reads the future: for building training labels, never in a key.
    history: ``"learned"`` only: None keeps every position's history (a table the
      size of the context); an int G keeps it only while the position is
      resident or among its stream's last G evictions (a ghost table of G
      entries): a miss on any other position starts it afresh (request time,
      count and EMA, rank EMA and ranked frequency as for a first request).
    drafted: ``"learned"`` only: int[..., T, d] positions a draft token's
      selection names for step t + 1, known at step t (the trace's
      ``<name>_drafted``: the prompt-lookup draft fed beside step t's token, as a
      two-token step would), -1 padding: the ``"drafted"`` feature. None: 0.
      A ``key_fn`` whose ``uses`` name it needs it.
  Defaults were tuned at B = 2k on ``synthetic_trace`` (better decays grow with
  B / k; see ``compare_policies``).

  Returns:
    i64[..., T] misses (fetches) per stream and step.

  Raises:
    ValueError: on a non-integer dtype, rank < 2, entries < -1, a position twice in
      a row, ``capacity < k``, an unknown policy, or bad scores or parameters.
  """
  sel = _validate(selections, capacity, policy)
  params = dict(alpha=alpha, score_alpha=score_alpha, twoq_in=twoq_in,
                twoq_out=twoq_out)
  _validate_params(params)
  if not (np.isfinite(rank_freq) and rank_freq >= 0):
    raise ValueError(f"rank_freq={rank_freq} must be finite and >= 0")
  if (isinstance(foresight, bool) or not isinstance(foresight, (int, np.integer))
      or foresight < 0):
    raise ValueError(f"foresight={foresight!r} must be an int >= 0 (steps)")
  if policy == LEARNED and not callable(key_fn):
    raise ValueError(f"policy {LEARNED!r} needs key_fn, got {key_fn!r}")
  if drafted is not None and policy != LEARNED:
    raise ValueError(f"drafted needs policy {LEARNED!r}, got {policy!r}")
  if drafted is None and "drafted" in getattr(key_fn, "uses", ()):
    raise ValueError("key_fn reads the 'drafted' feature: pass drafted (the draft's "
                     "next-step picks)")
  if history is not None and (isinstance(history, bool) or policy != LEARNED
                              or not isinstance(history, (int, np.integer))
                              or history < 0):
    raise ValueError(f"history={history!r} needs policy {LEARNED!r} and an int >= 0")
  score = _validate_scores(scores, sel) if policy == "score" else None
  batch, (num_steps, k) = sel.shape[:-2], sel.shape[-2:]
  num_streams, num_slots = int(np.prod(batch, dtype=np.int64)), int(capacity)
  out = np.zeros((num_steps, num_streams), np.int64)  # i64[T, S]
  if num_steps == 0 or k == 0 or num_streams == 0:
    return np.moveaxis(out, 0, -1).reshape(batch + (num_steps,))
  sel = np.moveaxis(sel.reshape(num_streams, num_steps, k).astype(np.int64), 1, 0)
  ranked = None
  if policy in (*RANKED_POLICIES, LEARNED):
    ranked = sel if ranks is None else np.moveaxis(
        _validate_ranks(ranks, np.asarray(selections)).reshape(
            num_streams, num_steps, -1).astype(np.int64), 1, 0)
    parts = [sel, ranked]
    if drafted is not None:
      parts.append(np.moveaxis(_validate_ranks(drafted, np.asarray(selections), "drafted")
                               .reshape(num_streams, num_steps, -1).astype(np.int64), 1, 0))
    both, num_pos = _dense_ids(np.concatenate(parts, axis=-1))  # one labeling
    sel, ranked = both[..., :k], both[..., k:k + ranked.shape[-1]]
    if drafted is not None:
      drafted = both[..., k + ranked.shape[-1]:]
  else:
    sel, num_pos = _dense_ids(sel)  # i64[T, S, k], padding = num_pos
  if score is not None:
    score = np.moveaxis(score.reshape(num_streams, num_steps, k), 1, 0)  # [T, S, k]

  rows = np.arange(num_streams)[:, None]
  slot_ids = np.arange(num_slots)
  slot_pos = np.full((num_streams, num_slots), _PAD, np.int64)  # slot -> position
  slot_of = np.full((num_streams, num_pos + 1), _PAD, np.int64)  # position -> slot
  pol = _make_policy(_Replay(
      policy=policy, S=num_streams, B=num_slots, T=num_steps, k=k, num_pos=num_pos,
      sel=sel, ranks=ranked, rank_freq=rank_freq, foresight=int(foresight), seed=seed,
      slot_ids=slot_ids,
      key_fn=key_fn, collect=collect, history=None if history is None else int(history),
      drafted=drafted, **params))

  for t in range(num_steps):
    cur = sel[t]  # i64[S, k]
    valid = cur < num_pos
    held = slot_of[rows, cur]  # i64[S, k] slot of each entry, -1 if not resident
    miss = valid & (held < 0)
    hit = valid & ~miss
    num_miss = miss.sum(axis=1)  # i64[S]
    out[t] = num_miss
    pinned = np.zeros((num_streams, num_slots + 1), bool)
    pinned[rows, np.where(hit, held, num_slots)] = True
    st = _Step(t=t, rows=rows, slot_ids=slot_ids, scratch=num_slots,
                         cur=cur, hit=hit, miss=miss, num_miss=num_miss,
                         pinned=pinned[:, :num_slots], empty=slot_pos < 0,
                         held_pos=slot_pos,
                         score=None if score is None else score[t])
    pick, start = pol.pick(st)  # the j-th miss takes pick[start + j]
    rank = np.cumsum(miss, axis=1) - 1 + np.reshape(start, (-1, 1))  # i64[S, k]
    victim = np.take_along_axis(pick, np.where(miss, rank, 0), axis=1)
    st.slot_in = np.where(miss, victim, np.where(hit, held, num_slots))  # [S, k]
    taken = np.zeros((num_streams, num_slots + 1), bool)
    taken[rows, np.where(miss, victim, num_slots)] = True
    st.taken = taken[:, :num_slots]
    st.old_pos = slot_pos.copy()
    st.evicted = st.taken & ~st.empty

    rr, cc = np.nonzero(miss)
    slot = victim[rr, cc]
    old = slot_pos[rr, slot]  # a victim never holds a requested position
    slot_of[rr, np.where(old >= 0, old, num_pos)] = _PAD
    slot_of[rr, cur[rr, cc]] = slot
    slot_pos[rr, slot] = cur[rr, cc]
    st.slot_pos = slot_pos
    pol.commit(st)

  return np.moveaxis(out, 0, -1).reshape(batch + (num_steps,))


def compare_policies(traces, capacities, policies=POLICIES, **kw) -> list[dict]:
  """Pooled miss rate of each (policy, capacity) and its share of the LRU gap.

  Args:
    traces: sequence of int[..., T, k] selections, or (selections, scores) or
      (selections, scores, ranks) tuples (scores feed ``"score"``, ranks
      ``"rank"`` and ``"foresight"``; None for the defaults; see ``replay``).
    capacities: slots per stream; an int is a slot count, a float a multiple of
      each trace's k (rounded).
    policies: names from ``POLICIES``; ``"lru"`` and ``"belady"`` are replayed too.
    **kw: policy parameters passed to ``replay``.

  Returns:
    One dict per (policy, capacity): ``miss_rate`` = misses / valid entries over
    all traces, streams and steps (cold start included), ``gap_closed`` =
    ``(lru - rate) / (lru - belady)`` (nan when LRU is already optimal), and the
    replay ``seconds``.
  """
  traces = [(tuple(t) if isinstance(t, tuple) else (t,)) + (None, None) for t in traces]
  traces = [t[:3] for t in traces]
  valid = sum(int((np.asarray(s) >= 0).sum()) for s, _, _ in traces)
  rows = []
  for cap in capacities:
    rates, secs = {}, {}
    for policy in dict.fromkeys(("lru", "belady", *policies)):
      start, misses = time.perf_counter(), 0
      for sel, score, ranks in traces:
        size = round(cap * np.shape(sel)[-1]) if isinstance(cap, float) else cap
        args = dict(kw, scores=score) if policy == "score" else (
            dict(kw, ranks=ranks) if policy in (*RANKED_POLICIES, LEARNED) else kw)
        if policy in ("lru", "belady") and policy not in policies:
          args = {}  # the gap's ends take no policy parameters (e.g. history)
        misses += int(replay(sel, size, policy, **args).sum())
      rates[policy], secs[policy] = misses / max(valid, 1), time.perf_counter() - start
    gap = rates["lru"] - rates["belady"]
    for policy in policies:
      rows.append(dict(policy=policy, capacity=cap, miss_rate=rates[policy],
                       gap_closed=(rates["lru"] - rates[policy]) / gap if gap > 0
                       else float("nan"), seconds=secs[policy]))
  return rows


def synthetic_trace(seed=0, streams=30, steps=512, k=256, context=8192, *,
                    sinks=4, facts=1024):
  """(selections i64[streams, steps, k], scores f64[same]) mimicking top-k attention.

  For tuning policies before real traces exist. Each stream (a layer, say) decodes
  the last ``steps`` tokens of ``context``; a row holds ``sinks`` always-selected
  first positions, a local window drifting with the newest token (width k/16 to
  3k/8, each position kept w.p. 0.8, never selected again once it falls behind),
  ``facts`` recurrent key facts (Zipf popularity times a log-normal AR(1) drift
  with a ~50-step memory, top ones by a Gumbel-perturbed key), and 2-15% one-shot
  noise drawn from the other positions. Window width, noise share and Zipf
  exponent vary per stream, as layers do. Rows are sorted best first by the
  latent key (sinks, window, facts, noise) and ``scores`` = softmax(key / 4).
  """
  rng = np.random.default_rng(seed)
  sel = np.empty((streams, steps, k), np.int64)
  out = np.empty((streams, steps, k))
  first = context - steps
  newest = first + np.arange(steps)  # the reserved slot serves it: not selected
  # Facts and noise, below the widest window (the window lies above).
  pool = np.arange(sinks, first - max(128, 3 * k // 8))
  for s in range(streams):
    width = int(rng.integers(max(k // 16, 1), max(3 * k // 8, 2)))
    noise = int(rng.uniform(0.02, 0.15) * k)
    zipf = rng.uniform(0.7, 1.3)
    pos_f = rng.choice(pool, facts, replace=False)
    drift = np.empty((steps, facts))
    drift[0] = rng.normal(0, 1.5, facts)  # stationary: 0.3 / sqrt(1 - 0.98**2)
    for t in range(1, steps):
      drift[t] = 0.98 * drift[t - 1] + 0.3 * rng.normal(0, 1, facts)
    fact_key = (-zipf * np.log1p(rng.permutation(facts)) + drift
                + 0.5 * rng.gumbel(size=(steps, facts)))  # [T, F]
    win = newest[:, None] - np.arange(1, width + 1)  # [T, W]
    win_on = rng.random(win.shape) < 0.8
    room = k - sinks - noise - win_on.sum(1)  # facts per step
    fact_on = np.argsort(np.argsort(-fact_key, 1), 1) < room[:, None]
    rest = np.setdiff1d(pool, pos_f)
    noise_pos = np.stack([rng.choice(rest, noise, replace=False) for _ in range(steps)])
    cand = np.concatenate([np.broadcast_to(np.arange(sinks), (steps, sinks)), win,
                           np.broadcast_to(pos_f, (steps, facts)), noise_pos], 1)
    key = np.concatenate([
        np.full((steps, sinks), 20.0),
        np.where(win_on, 10.0 - np.arange(width) / width, -np.inf),
        np.where(fact_on, fact_key, -np.inf),
        -30.0 - rng.random((steps, noise))], 1)  # [T, candidates]
    order = np.argsort(-key, 1, kind="stable")[:, :k]
    sel[s] = np.take_along_axis(cand, order, 1)
    top = np.take_along_axis(key, order, 1)
    prob = np.exp((top - top[:, :1]) / 4.0)
    out[s] = prob / prob.sum(1, keepdims=True)
  return sel, out
