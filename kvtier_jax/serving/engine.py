"""The serving engine: continuous batching over a fixed set of request slots.

Each ``step()``:

1. **Admit** waiting requests in arrival order (``schedule="fcfs"``, no
   overtaking; or ``"lpm"``: the longest cached prefix first, see
   ``EngineConfig``) while a slot is free, the prefill staging buffer is free
   (one prompt is prefilled at a time), the device budget covers the request's
   state for its whole life (``ServingModel.device_bytes`` of prompt +
   max_new_tokens positions, plus the staging buffer once) and the host pool has
   pages for its prompt.
2. **Decode first**: every decoding request advances one token in one batched,
   statically shaped step (inactive slots are masked, so requests joining and
   leaving never recompile). A request whose next position needs a host page gets
   one; when the pool is empty the newest running request is preempted (slot and
   pages freed, re-queued first) and later resumes exactly: its prompt is
   prefilled again and its earlier outputs are fed back through decode steps, not
   re-sampled, so it yields the same tokens. A model with a look-ahead
   (``lookahead == "draft"``) then gets each still-decoding request's
   prompt-lookup draft of its next token (``ServingModel.draft_pass``), so the
   rows the next step selects are fetched ahead of it.
3. **Chunked prefill** with the step's leftover token budget (at least one chunk
   per step): the prompt runs in chunks of C tokens at fixed boundaries, so a
   prompt's numbers do not depend on the schedule; after the last chunk the
   request samples its first token and joins the decode batch. With
   ``prefill_policy="blocking"`` a step with a prompt to prefill runs all of it
   and no decode (the baseline an engine without chunked prefill is).

With ``prefix_cache`` (radix.py) admission shares the longest cached prefix of
whole chunks (its pages, by reference count) and the prefill starts after it, the
model restaging it from the host pages; a finished prefill caches the prompt's
whole chunks; cached prefixes nobody runs are evicted (LRU leaves first) when the
page pool runs short, before anyone is preempted. With a disk tier
(``disk_pages``, disk.py) those prefixes move to disk instead of being forgotten;
a request that matches a prefix on disk either loads it back into host pages or
recomputes it (``disk_policy``; "auto" compares the measured load and prefill
costs), and both give the same bytes.

A request can move to another engine (``export`` / ``accept``, handoff.py): its
token ids, sampling parameters and optionally the K/V pages the receiver lacks; the
receiver continues it with the same tokens (PDD's relay and main decode).

Requests are validated at ``submit`` (clear ``ValueError``s; the engine is not
touched). A request whose logits turn non-finite fails with the reason; the others
continue. Nothing here assumes one device: per-slot state lives in the model's
arrays, and the scheduler only counts slots, bytes and pages. A data-parallel model
(``num_partitions`` P > 1: one host tier per device) splits the slots and pages into
P ranges; a request is placed on the device holding its cached prefix when it has a
free slot, else on the least loaded one, and shares only the prefix pages in its own
device's host tier.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import shutil
import tempfile
import time
import weakref
from typing import Callable, Iterable

import jax
import numpy as np

from kvtier_jax.draft import PromptLookup
from kvtier_jax.driver import StepRefused
from kvtier_jax.serving import sampling
from kvtier_jax.serving import handoff as handoff_lib
from kvtier_jax.serving.disk import DiskTier
from kvtier_jax.serving.model import ServingModel
from kvtier_jax.serving.pages import PagePool
from kvtier_jax.serving.radix import RadixCache
from kvtier_jax.serving.request import (MAX_LOGPROBS, Metrics, Request, SamplingParams,
                                        State, check_prompt, is_int)


PREFILL_POLICIES = ("decode_first", "blocking")
DISK_POLICIES = ("auto", "load", "recompute")
SCHEDULES = ("fcfs", "lpm")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Scheduling limits.

  Attributes:
    max_step_tokens: tokens per step: one per decoding request, the rest for
      prefill chunks (at least one chunk runs whenever a prompt is waiting for it).
    kv_budget_bytes: device bytes for per-request state (KV or hot cache and
      metadata, selector state) and the prefill staging buffer; None: no limit
      beyond the slots.
    eos_ids: token ids that end every request (added to each request's stop ids).
    prefill_policy: ``"decode_first"`` (the decode batch advances every step and
      prompt chunks fill the rest of the token budget: in-place P/D multiplexing)
      or ``"blocking"`` (a step with a prompt to prefill runs the whole prompt and
      no decode: what an engine without chunked prefill does).
    prefix_cache: reuse cached prompt prefixes in the host tier (``radix.py``):
      a request's longest cached prefix of whole chunks is shared, not recomputed,
      and its own prompt chunks are cached when its prefill ends. Needs a model
      with ``load_prefix`` (the tiered backend).
    disk_pages: pages of a disk tier below the host pool for cached prefixes
      (0: none; needs ``prefix_cache`` and a model with ``read_pages`` /
      ``write_pages``).
    disk_dir: where the disk tier lives (None: a fresh temporary directory, removed
      with the engine).
    disk_policy: for a prefix found on disk: ``"load"`` it back, ``"recompute"``
      it, or ``"auto"``: load when the measured load time of its pages is below
      the measured prefill time of its tokens.
    schedule: which waiting request is admitted next: ``"fcfs"`` (arrival order)
      or ``"lpm"`` (SGLang's longest prefix match: the one with the most prompt
      tokens in the prefix cache, host or disk; ties in arrival order). Under
      both, preempted requests resume first and admission stops at the first
      request that does not fit (no backfill). ``"lpm"`` needs ``prefix_cache``.
      It admits cheap prefills first and prompts while their shared prefix is
      still cached; tokens never depend on the schedule.
    max_overtakes: ``"lpm"``'s bound on waiting: a request that this many later
      arrivals overtook is admitted next, the oldest such first (0: FCFS).
    lpm_window: ``"lpm"`` ranks the first this many waiting requests (preempted
      ones first, then arrival order), so a pick costs O(window x prompt chunks) on
      any queue. SGLang instead turns LPM off (FCFS) past 128 waiting, which is
      when prefix order pays most; 1 is FCFS.
  """

  max_step_tokens: int = 512
  kv_budget_bytes: int | None = None
  eos_ids: tuple[int, ...] = ()
  prefill_policy: str = "decode_first"
  prefix_cache: bool = False
  disk_pages: int = 0
  disk_dir: str | None = None
  disk_policy: str = "auto"
  schedule: str = "fcfs"
  max_overtakes: int = 16
  lpm_window: int = 128

  def __post_init__(self):
    if self.prefill_policy not in PREFILL_POLICIES:
      raise ValueError(f"prefill_policy={self.prefill_policy!r} must be one of "
                       f"{PREFILL_POLICIES}")
    if self.disk_policy not in DISK_POLICIES:
      raise ValueError(f"disk_policy={self.disk_policy!r} must be one of {DISK_POLICIES}")
    if self.disk_pages < 0 or (self.disk_pages and not self.prefix_cache):
      raise ValueError(f"disk_pages={self.disk_pages}: a disk tier holds cached prefixes "
                       "and needs prefix_cache=True")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
    if self.schedule == "lpm" and not self.prefix_cache:
      raise ValueError("schedule='lpm' orders requests by their cached prefix: it "
                       "needs prefix_cache=True")
    if self.max_overtakes < 0:
      raise ValueError(f"max_overtakes={self.max_overtakes} must be >= 0")
    if self.lpm_window < 1:
      raise ValueError(f"lpm_window={self.lpm_window} must be >= 1")
    if self.max_step_tokens <= 0:
      raise ValueError(f"max_step_tokens={self.max_step_tokens} must be positive")
    if not all(map(is_int, self.eos_ids)):
      raise ValueError(f"eos_ids={self.eos_ids!r} must be integer ids")


class Engine:
  """Serves requests through a ``ServingModel`` (see the module docstring)."""

  def __init__(self, model: ServingModel, config: EngineConfig = EngineConfig(), *,
               clock: Callable[[], float] = time.perf_counter,
               on_step: Callable[[dict], None] | None = None):
    if config.kv_budget_bytes is not None and config.kv_budget_bytes < model.staging_bytes():
      raise ValueError(f"kv_budget_bytes={config.kv_budget_bytes} is below the prefill "
                       f"staging buffer ({model.staging_bytes()} bytes)")
    bad = [t for t in config.eos_ids if not 0 <= t < model.vocab_size]
    if bad:  # (every submit would be refused, blaming its stop ids)
      raise ValueError(f"eos_ids {bad} are outside the model's vocabulary of "
                       f"{model.vocab_size}")
    self.model, self.config = model, config
    self._clock, self._t0 = clock, clock()
    self._on_step = on_step
    # A model serves the newest engine built on it: it keeps bookkeeping beside the
    # engine's state (the tiered backend's per-slot length mirror), which two engines
    # stepping in turn would share (room checks on another engine's lengths). The
    # lease tells an older engine to stop.
    self._lease = object()
    try:
      model._kvtier_engine_lease = self._lease
    except AttributeError:  # (a model that takes no attributes: not checked)
      pass
    self.state = model.init()
    pages_per_slot = -(-model.max_len // model.page_size)
    self.pool = PagePool(model.num_host_pages, model.num_slots, pages_per_slot,
                         getattr(model, "num_partitions", 1))
    self.radix, self.disk = None, None
    if config.prefix_cache:
      if not getattr(model, "supports_prefix_cache", False):
        raise ValueError("prefix_cache needs a model that stages a cached prefix from "
                         "its host pages (the tiered backend; not a selector that reads "
                         "hidden states)")
      if config.disk_pages:
        if not hasattr(model, "read_pages"):
          raise ValueError("a disk tier needs a model with read_pages / write_pages")
        disk_dir = config.disk_dir
        if disk_dir is None:  # the engine's own: removed when the engine is collected
          disk_dir = tempfile.mkdtemp(prefix="kvtier-disk-")
          weakref.finalize(self, shutil.rmtree, disk_dir, ignore_errors=True)
        self.disk = DiskTier(disk_dir, config.disk_pages)
      self.radix = RadixCache(model.chunk_size, model.page_size, self.disk)
    self.prompt_tokens = 0  # prompt tokens of every admission
    self.cached_tokens = 0  # of those, served from the prefix cache (host or disk)
    self.disk_loaded_tokens = 0  # of those, read back from the disk tier
    self.disk_recomputed_tokens = 0  # found on disk but recomputed (disk_policy)
    # Positions whose K/V came with a handoff, at every admission (a resume after a
    # preemption imports them again), as prompt_tokens and cached_tokens count.
    self.imported_tokens = 0
    self._prefill_seconds = self._prefill_timed_tokens = 0.0
    self._prefill_shapes: set[int] = set()  # chunk lengths prefilled (compiled) once
    self._load_sizes: set[int] = set()  # page counts loaded from disk so far
    self.slots: list[Request | None] = [None] * model.num_slots
    self.waiting: collections.deque[Request] = collections.deque()
    self.requests: dict[str, Request] = {}
    self._admitted = 0
    self._device_in_use = 0
    self._last_stats = model.stats(self.state)
    self._peak, self._new_tokens = dict(running=0, device=0, host=0), 0  # per step
    self._step_errors: list[Exception] = []  # raised this step, re-raised at its end
    self._lookups: dict[str, PromptLookup] = {}  # the look-ahead's, by running request
    self.steps = 0

  # Submission and abort --------------------------------------------------------

  def now(self) -> float:
    return self._clock() - self._t0

  def submit(self, prompt: Iterable[int], max_new_tokens: int,
             sampling_params: SamplingParams = SamplingParams(), *,
             stop_ids: Iterable[int] = (), request_id: str | None = None,
             on_token: Callable[[Request, int], None] | None = None,
             arrival: float | None = None) -> Request:
    """Queue a request; raises ``ValueError`` (engine untouched) on bad input.

    ``on_token(request, token)`` runs as each token is sampled; it may abort or
    export requests. If it raises (a streaming client gone), its request fails
    (``State.FAILED``, released), the step finishes every other request's
    bookkeeping, and ``step`` then raises the first such exception: the engine
    stays consistent and can go on stepping."""
    return self._new_request(prompt, max_new_tokens, sampling_params, stop_ids,
                             request_id, on_token, arrival)

  def _new_request(self, prompt, max_new_tokens, sampling_params, stop_ids, request_id,
                   on_token, arrival, *, returning: bool = False) -> Request:
    """``submit``'s checks and queueing. ``returning``: a request this engine
    handed off may come back under its id (its old record goes)."""
    model = self.model
    ids = check_prompt(prompt, model.vocab_size)
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    max_new_tokens = int(max_new_tokens)  # a numpy int would not go into a snapshot
    sampling_params.check()
    total = len(ids) + max_new_tokens
    if total > model.max_len:
      raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) = "
                       f"{total} exceeds the context of {model.max_len} positions")
    if self._host_pages(total) > self.pool.num_pages // self.pool.partitions:
      raise ValueError(f"{total} positions need {self._host_pages(total)} host pages; "
                       f"the host tier has {self.pool.num_pages // self.pool.partitions}"
                       + (" per device" if self.pool.partitions > 1 else ""))
    budget = self.config.kv_budget_bytes
    if budget is not None and model.device_bytes(total) + model.staging_bytes() > budget:
      raise ValueError(f"{total} positions need {model.device_bytes(total)} device bytes;"
                       f" the KV budget is {budget} (staging {model.staging_bytes()})")
    stop_ids = list(stop_ids)
    if not all(map(is_int, stop_ids)):  # int() would truncate 2.7 into a stop id
      raise ValueError(f"stop ids {stop_ids} must be integer ids")
    stops = frozenset(int(t) for t in stop_ids) | frozenset(self.config.eos_ids)
    if any(not 0 <= t < model.vocab_size for t in stops):
      raise ValueError(f"stop ids {sorted(stops)} must be in the vocabulary")
    if request_id is None:  # a free "req-N", N from the count of requests on (callers
      # and handoffs name theirs; scanning from 0 would cost O(requests) per submit)
      request_id = next(f"req-{n}" for n in itertools.count(len(self.requests))
                        if f"req-{n}" not in self.requests)
    if not isinstance(request_id, str):  # (a handoff, a snapshot and a seed need a str)
      raise ValueError(f"request_id={request_id!r} must be a str")
    old = self.requests.get(request_id)
    if old is not None and not (returning and old.state is State.HANDED_OFF):
      raise ValueError(f"request id {request_id!r} already exists"
                       + ("; accept(..., request_id=) takes it under another id"
                          if returning else ""))
    self.requests.pop(request_id, None)
    req = Request(request_id, ids, max_new_tokens, sampling_params.resolved(request_id),
                  stops, Metrics(self.now() if arrival is None else arrival), on_token)
    self.requests[request_id] = req
    self.waiting.append(req)
    return req

  def abort(self, request_id: str) -> None:
    """End a request now; its slot, pages and device bytes are free at once."""
    req = self.requests[request_id]
    if req.state.done:
      return
    if req.state is State.WAITING:
      self.waiting.remove(req)
    else:
      self._release(req)
    self._end(req, State.ABORTED, "aborted")

  def export(self, request_id: str, *, kv: str = "all",
             start: int = 0) -> handoff_lib.Handoff:
    """Hand a request to another engine and let it go here (``State.HANDED_OFF``).

    ``kv``: ``"all"`` sends the pages of every computed position from ``start``
    (the receiver's cached prefix, page-aligned) on; ``"prompt"`` only the prompt's
    whole chunks from ``start`` (the receiver replays the outputs); ``"none"`` token
    ids only. Raises ``ValueError`` (nothing changed) if the request cannot go.
    """
    req = self.requests[request_id]
    if kv not in handoff_lib.KV_MODES:
      raise ValueError(f"kv={kv!r} must be one of {handoff_lib.KV_MODES}")
    if req.state.done or req.state is State.PREFILLING:
      raise ValueError(f"request {request_id!r} is {req.state.value}: only waiting or "
                       "decoding requests move")
    if len(req.output) >= req.max_new_tokens:
      raise ValueError(f"request {request_id!r} has all its tokens")
    if req.output and req.output[-1] in req.stop_ids:  # sampled, not yet ended (on_token)
      raise ValueError(f"request {request_id!r} produced its stop id {req.output[-1]}")
    out = handoff_lib.Handoff(request_id, list(req.prompt), list(req.output),
                              req.max_new_tokens, req.sampling, sorted(req.stop_ids),
                              chunk_size=self.model.chunk_size,
                              page_size=self.model.page_size)
    if req.sampling.logprobs is not None:
      out.logprobs = list(req.logprobs)
      out.top_logprobs = [list(top) for top in req.top_logprobs]
    if kv != "none":
      size = self.model.page_size
      # The K/V of every position but the newest output's: that one the receiver
      # feeds (inside another request's on_token, this step may have computed it).
      computed = min(req.cached, len(req.prompt) + len(req.output) - 1)
      end = (computed if kv == "all" else
             min(req.cached, len(req.prompt)) // self.model.chunk_size * self.model.chunk_size)
      if req.state is not State.DECODING or not self._host_pages(req.total_length):
        raise ValueError(f"request {request_id!r} has no host pages to send "
                         f"({req.state.value}); export with kv='none'")
      if end == 0:
        raise ValueError(f"request {request_id!r} has no whole prompt chunk of "
                         f"{self.model.chunk_size} positions to send; export with "
                         "kv='all' or kv='none'")
      if start % size or not 0 <= start < end:
        raise ValueError(f"start={start} must be page-aligned and below {end}")
      pages = self.pool.table[req.slot, start // size:-(-end // size)].tolist()
      out.kv_start, out.kv_end = start, end
      out.model_id = getattr(self.model, "model_id", None)
      out.kv = [np.array(f) for f in self.model.read_pages(self.state, pages)]
    if req.state is State.WAITING:
      self.waiting.remove(req)
    else:
      self._release(req)
    self._end(req, State.HANDED_OFF, f"handed off ({kv})")
    return out

  def accept(self, handoff: handoff_lib.Handoff, *,
             on_token: Callable[[Request, int], None] | None = None,
             arrival: float | None = None, request_id: str | None = None) -> Request:
    """Queue a request another engine exported; it continues with the tokens an
    uninterrupted run yields (see handoff.py). ``request_id``: its id here (None:
    the handoff's; a request this engine handed off may come back). ``ValueError``
    (engine untouched) on bad input."""
    handoff_lib.check(handoff, self.model.page_size, self.model.vocab_size,
                      stop_ids=self.config.eos_ids)
    # Here the request may keep every position on the device (no host pages), or
    # the model may not restage positions from host pages (DSA's selector state
    # comes from hidden states pages do not hold): then the KV has nowhere to go
    # and the prompt and outputs are replayed instead.
    has_host = bool(self._host_pages(len(handoff.prompt) + handoff.max_new_tokens))
    can_load = has_host and getattr(self.model, "supports_prefix_cache", False)
    # K/V prefilled on other chunk boundaries differ from this engine's in the last
    # bits: the request replays, and the prefix cache keeps only numbers computed here.
    # Pages of another size would need splitting or merging: the request replays.
    keeps_kv = (bool(handoff.kv_end) and can_load
                and handoff.chunk_size == self.model.chunk_size
                and handoff.page_size in (None, self.model.page_size)
                and handoff.model_id == getattr(self.model, "model_id", None))
    if keeps_kv:  # pages of another layout (a mesh's padded heads) are replayed unread
      handoff_lib.check_pages(handoff, self.model.read_pages(self.state, [0]))
    kv_end = handoff.kv_end
    if keeps_kv and kv_end < len(handoff.prompt):
      # The rest of the prompt is prefilled here, in whole chunks: K/V past the last
      # chunk boundary (a frame that does not end on one) is recomputed.
      kv_end = kv_end // self.model.chunk_size * self.model.chunk_size
      keeps_kv = kv_end > handoff.kv_start
    logprobs = [float(x) for x in handoff.logprobs or []]  # (checked: they convert)
    top_logprobs = [[(int(i), float(x)) for i, x in top]
                    for top in handoff.top_logprobs or []]
    req = self._new_request(handoff.prompt, handoff.max_new_tokens, handoff.sampling,
                            handoff.stop_ids, request_id or handoff.request_id, on_token,
                            arrival, returning=True)
    req.output = [int(t) for t in handoff.output]
    req.relayed = len(handoff.output)
    req.logprobs, req.top_logprobs = logprobs, top_logprobs
    if keeps_kv:
      size = self.model.page_size
      pages = -(-kv_end // size) - handoff.kv_start // size
      req.imported = (handoff.kv_start, kv_end, [f[:pages] for f in handoff.kv])
    return req

  @property
  def prefill_seconds_per_token(self) -> float | None:
    """Measured prefill cost (timed only with a disk tier on ``"auto"``)."""
    if not self._prefill_timed_tokens:
      return None
    return self._prefill_seconds / self._prefill_timed_tokens

  @property
  def has_work(self) -> bool:
    return bool(self.waiting) or any(self.slots)

  # The step ------------------------------------------------------------------

  def step(self) -> dict:
    """Admit, decode, prefill; returns this step's metrics."""
    if getattr(self.model, "_kvtier_engine_lease", self._lease) is not self._lease:
      raise RuntimeError("another Engine was built on this model since this one: a "
                         "model serves one engine at a time (build a model per engine)")
    start = self.now()
    self._peak = dict(running=0, device=0, host=0)
    self._new_tokens = 0
    self._step_errors = []
    self._admit()
    self._note_peak()
    if self.config.prefill_policy == "blocking" and self._prefilling() is not None:
      decoded, prefilled = 0, self._prefill(math.inf)
    else:
      decoded = self._decode()
      prefilled = self._prefill(self.config.max_step_tokens - decoded)
    self._note_peak()
    # The step's seconds are its device time too (a prefill chunk's state is not
    # read back otherwise: its time went to the next step).
    self.state = jax.block_until_ready(self.state)
    stats = self.model.stats(self.state)
    modulus = getattr(self.model, "stats_modulus", {})
    delta = {k: stats[k] - self._last_stats.get(k, 0) for k in stats}
    delta = {k: v % modulus[k] if k in modulus else v for k, v in delta.items()}
    self._last_stats = stats
    self.steps += 1
    # ``running`` and the bytes in use are at the step's end, after finished
    # requests let go; the peaks are the most the step held (after admission, once
    # the decoding requests got their next pages). ``new_tokens``: tokens sampled (a
    # resumed request's replayed outputs are decoded, counted in decode_batch, but
    # not new).
    row = dict(step=self.steps, t=start, seconds=self.now() - start, decode_batch=decoded,
               new_tokens=self._new_tokens, prefill_tokens=prefilled,
               waiting=len(self.waiting), running=sum(r is not None for r in self.slots),
               peak_running=self._peak["running"], peak_device_bytes=self._peak["device"],
               peak_host_pages=self._peak["host"], host_pages_in_use=self.pool.in_use,
               cached_pages=0 if self.radix is None else self.radix.num_pages,
               disk_pages=0 if self.disk is None else self.radix.num_disk_pages,
               host_bytes_in_use=self.pool.in_use * self.model.host_page_bytes,
               device_bytes_in_use=self._device_in_use, **delta)
    if self._on_step:
      self._on_step(row)
    if self._step_errors:
      raise self._step_errors[0]
    return row

  def _note_peak(self) -> None:
    peak = self._peak
    peak["running"] = max(peak["running"], sum(r is not None for r in self.slots))
    peak["device"] = max(peak["device"], self._device_in_use)
    peak["host"] = max(peak["host"], self.pool.in_use)

  def run(self, until: Callable[[], bool] | None = None) -> None:
    """Step until nothing is left (or ``until()``)."""
    while self.has_work and not (until and until()):
      self.step()

  # Admission -----------------------------------------------------------------

  def _host_pages(self, length: int) -> int:
    """Pages a request of ``length`` positions holds at most (0: device-resident)."""
    if self.model.num_host_pages == 0 or length <= getattr(self.model, "hot_slots", 0):
      return 0
    return -(-length // self.model.page_size)

  def _prefilling(self) -> Request | None:
    return next((r for r in self.slots if r is not None and r.state is State.PREFILLING),
                None)

  def _admit(self) -> None:
    budget = self.config.kv_budget_bytes
    while self.waiting:
      if self._prefilling() is not None:
        return  # one prompt at a time uses the staging buffer
      free = [i for i, r in enumerate(self.slots) if r is None]
      req = self._next_waiting()
      charge = self.model.device_bytes(req.total_length)
      staging = self.model.staging_bytes()
      if not free or (budget is not None and
                      self._device_in_use + charge + staging > budget):
        return
      matched, on_disk, load = 0, [], False
      host = self._host_pages(req.total_length)
      shared, node = self._match(req) if host else ([], None)
      upto = max(len(req.prompt), req.imported[1] if req.imported else 0)
      # The device is picked before the match is locked: its room counts the
      # matched nodes on other devices, which this request will not share.
      slot = self._pick_slot(free, shared, -(-upto // self.model.page_size) if host else 0)
      # Data parallel: only the prefix's pages in the slot's own host tier are shared.
      part = self.pool.slot_partition(slot)
      local = next((i for i, p in enumerate(shared) if self.pool.page_partition(p) != part),
                   len(shared))
      whole = local == len(shared)
      shared = shared[:local]
      if not whole:  # lock only what the slot shares, not the other device's pages
        node = self._holder(node, shared)
      if node is not None:
        self.radix.lock(node)
      if self._host_pages(req.total_length):
        on_disk = [] if node is None or not whole else self.radix.disk_path(node)
        load = bool(on_disk) and self._load_from_disk(on_disk)
        if not self._take_pages(slot, -(-upto // self.model.page_size), shared):
          if node is not None:
            self.radix.unlock(node)
          return
        req.radix_node, matched = node, len(shared) * self.model.page_size
        if load:
          matched = self._load(slot, req.prompt, len(shared), on_disk)
        elif on_disk:  # positions [matched, disk_end) are recomputed, unless imported
          disk_end = matched + sum(len(n.key) for n in on_disk)
      cached = matched
      if req.imported is not None and req.imported[0] <= matched < req.imported[1]:
        matched = self._import_pages(req, slot, matched)
        self.imported_tokens += matched - cached
      if on_disk and not load:
        self.disk_recomputed_tokens += max(0, disk_end - matched)
      self._dequeue(req)
      req.slot, req.device_bytes, req.cached, req.staged = slot, charge, matched, 0
      self.prompt_tokens += len(req.prompt)
      self.cached_tokens += cached
      if req.metrics.cached_tokens is None:
        req.metrics.cached_tokens = cached
      req.state, req.admit_order = State.PREFILLING, self._admitted
      self._admitted += 1
      self._device_in_use += charge
      if req.metrics.admitted is None:
        req.metrics.admitted = self.now()
      self.slots[slot] = req

  def _next_waiting(self) -> Request:
    """The request ``schedule`` admits next (EngineConfig). The queue is in arrival
    order, preempted requests re-queued at its front."""
    if self.config.schedule == "fcfs":
      return self.waiting[0]
    def cached_prefix(req):  # re-walked only once the tree changed
      if req.prefix_seen[0] != self.radix.version:
        req.prefix_seen = (self.radix.version,
                           self.radix.prefix_length(self._shareable(req)))
      return req.prefix_seen[1]

    def priority(item):  # the smallest goes first
      index, req = item
      starving = req.overtaken >= self.config.max_overtakes
      # A request kept on the device (no host pages) cannot use the cache.
      usable = not starving and self._host_pages(req.total_length)
      return (req.metrics.admitted is None,  # resume preempted requests first
              not starving,  # then the long-waiting, in arrival order
              -cached_prefix(req) if usable else 0, index)

    window = itertools.islice(self.waiting, self.config.lpm_window)
    return min(enumerate(window), key=priority)[1]

  def _dequeue(self, req: Request) -> None:
    """Takes ``req`` off the queue; every request that arrived before it waits on
    and counts one overtake."""
    for earlier in self.waiting:
      if earlier is req:
        break
      earlier.overtaken += 1
    self.waiting.remove(req)

  def _pick_slot(self, free: list[int], shared: list[int], num_pages: int) -> int:
    """A free slot for a request whose prompt takes ``num_pages`` host pages.

    One device: the lowest. Data parallel (partitions): the device holding the
    cached prefix ``shared`` if it has a free slot, even when it must wait there
    for pages (sending it elsewhere recomputes the prefix: a FakeModel simulation
    measured 2-9% fewer cached tokens and no shorter queue, WORKSPACE_NOTES.md).
    Else the device with room for the prompt's pages (free, or held only by
    unlocked cached prefixes, which admission may evict) running the fewest
    requests, most free pages breaking ties; when none has room, the least
    loaded, where admission waits."""
    pool = self.pool
    if pool.partitions == 1:
      return free[0]
    open_parts = sorted({pool.slot_partition(s) for s in free})
    if shared and pool.page_partition(shared[0]) in open_parts:
      part = pool.page_partition(shared[0])
      return next(s for s in free if pool.slot_partition(s) == part)
    freeable = None
    def room(part):  # counts no shared page (the prefix's device had no free slot)
      nonlocal freeable
      need = num_pages - pool.free_in(part)
      if need <= 0 or self.radix is None:
        return need <= 0
      if freeable is None:
        freeable = self._freeable()
      return need <= freeable.get(part, 0)
    running = collections.Counter(pool.slot_partition(r.slot) for r in self.slots
                                  if r is not None)
    least_loaded = lambda parts: min(parts, key=lambda p: (running[p], -pool.free_in(p), p))
    fitting = [p for p in open_parts if room(p)]
    part = least_loaded(fitting or open_parts)
    return next(s for s in free if pool.slot_partition(s) == part)

  def _freeable(self) -> dict[int, int]:
    """{device: the pages evicting its unlocked cached prefixes would free}: those
    only the cache holds (data parallel, a running request placed away from its
    prefix's device may hold pages of an unlocked node below another device's)."""
    return {part: sum(self.pool.refs[p] == 1 for p in pages) for part, pages in
            self.radix.evictable_pages(lambda pages: self.pool.page_partition(pages[0]))
            .items()}

  def _shareable(self, req: Request) -> list[int]:
    """The prompt's whole chunks that may come from the cache: at least one token
    is left to prefill (its logits give the first output)."""
    chunk = self.model.chunk_size
    return req.prompt[:(len(req.prompt) - 1) // chunk * chunk]

  def _match(self, req: Request) -> tuple[list[int], object]:
    """(pages, node, not locked) of the request's longest cached prefix; at least
    one prompt token is left to prefill (its logits give the first output)."""
    if self.radix is None:
      return [], None
    return self.radix.match_prefix(self._shareable(req))

  def _load_from_disk(self, on_disk) -> bool:
    """Load (True) or recompute the matched prefix nodes ``on_disk``."""
    policy = self.config.disk_policy
    if policy != "auto":
      return policy == "load"
    per_page, per_token = self.disk.seconds_per_page, self.prefill_seconds_per_token
    if per_page is None or per_token is None:
      return True  # nothing measured yet: loading measures it
    return per_page / self.model.page_size <= per_token

  def _load(self, slot: int, prompt: list[int], resident: int, on_disk) -> int:
    """Read the prefix nodes ``on_disk`` back into ``slot``'s pages after its
    ``resident`` shared ones (the tree adopts them); returns the tokens matched."""
    disk_ids = [p for n in on_disk for p in n.disk]
    host = self.pool.table[slot, resident:resident + len(disk_ids)].tolist()
    start = time.perf_counter()
    self.state = jax.block_until_ready(
        self.model.write_pages(self.state, host, self.disk.read(disk_ids)))
    if len(disk_ids) in self._load_sizes:  # a new page count compiles: not timed
      self.disk.load_seconds += time.perf_counter() - start
      self.disk.pages_loaded += len(disk_ids)
    self._load_sizes.add(len(disk_ids))
    matched = (resident + len(disk_ids)) * self.model.page_size
    pages = self.pool.table[slot, :matched // self.model.page_size].tolist()
    adopted, _ = self.radix.insert(prompt[:matched], pages)
    self.pool.retain(adopted)
    self.disk_loaded_tokens += len(disk_ids) * self.model.page_size
    return matched

  def _import_pages(self, req: Request, slot: int, matched: int) -> int:
    """Write a handoff's pages past the ``matched`` cached prefix into ``slot``'s
    pages; returns the positions now cached."""
    start, end, fields = req.imported
    size = self.model.page_size
    first = matched // size
    host = self.pool.table[slot, first:-(-end // size)].tolist()
    skip = first - start // size
    self.state = self.model.write_pages(self.state, host, [f[skip:] for f in fields])
    return end

  def _spill(self, pages: list[int]) -> list[int]:
    """Write host pages to the disk tier (a cached prefix leaving the host)."""
    return self.disk.write(self.model.read_pages(self.state, pages))

  def _evict(self, num_pages: int, partition: int) -> int:
    """Evict cached prefixes until ``num_pages`` pages of ``partition`` are free."""
    drop = functools.partial(self.pool.drop, partition=partition)
    return self.radix.evict(num_pages, drop,
                            self._spill if self.disk is not None else None,
                            where=lambda pages: self.pool.page_partition(pages[0])
                            == partition)

  def _take_pages(self, slot: int, num_pages: int, shared: list[int]) -> bool:
    """``slot`` holds ``shared`` then fresh pages up to ``num_pages``, evicting
    unused cached prefixes when the pool is short; False (nothing held) if it
    cannot."""
    fresh = num_pages - len(shared)
    part = self.pool.slot_partition(slot)
    if fresh > self.pool.free_in(part) and self.radix is not None:
      if fresh > self.pool.free_in(part) + self._freeable().get(part, 0):
        return False  # evicting could not make room: keep the cached prefixes
      self._evict(fresh - self.pool.free_in(part), part)
    if fresh > self.pool.free_in(part):
      return False
    self.pool.share(slot, shared)
    return self.pool.grow(slot, num_pages)

  def _release(self, req: Request) -> None:
    self._lookups.pop(req.id, None)  # (a resumed request replays: built afresh)
    if req.radix_node is not None:
      self.radix.unlock(req.radix_node)
      req.radix_node = None
    self.pool.release(req.slot)
    self.slots[req.slot] = None
    self._device_in_use -= req.device_bytes
    req.slot, req.device_bytes = None, 0

  def _preempt(self, req: Request) -> None:
    """Free ``req``'s slot and pages; it resumes first, replaying its outputs."""
    self._release(req)
    req.state, req.cached = State.WAITING, 0
    req.metrics.preemptions += 1
    self.waiting.appendleft(req)

  def _end(self, req: Request, state: State, reason: str) -> None:
    req.state, req.reason = state, reason
    req.metrics.finished = self.now()

  # Decode ----------------------------------------------------------------------

  def _ensure_pages(self) -> None:
    """Every decoding request gets the page of the position it writes next,
    preempting the newest running requests while the pool is empty. The pages the
    step lacks are evicted at once per device (one walk of the prefix tree, not
    one per page)."""
    growing = [r for r in sorted((r for r in self.slots if r is not None and
                                  r.state is State.DECODING), key=lambda r: r.admit_order)
               if r.slot is not None and self._host_pages(r.total_length)]
    if self.radix is not None:
      short = collections.Counter()
      for req in growing:
        held = int((self.pool.table[req.slot] >= 0).sum())
        short[self.pool.slot_partition(req.slot)] += max(
            0, req.cached // self.model.page_size + 1 - held)
      for part, need in short.items():
        if need > self.pool.free_in(part):
          self._evict(need - self.pool.free_in(part), part)
    for req in growing:
      if req.slot is None:  # preempted below for an earlier request
        continue
      need = req.cached // self.model.page_size + 1
      part = self.pool.slot_partition(req.slot)
      while not self.pool.grow(req.slot, need):
        if self.radix is not None and self._evict(1, part):
          continue
        holders = [r for r in self.slots if r is not None and
                   self.pool.slot_partition(r.slot) == part and
                   (r is req or (self.pool.table[r.slot] >= 0).any())]
        victim = max(holders, key=lambda r: r.admit_order)
        self._preempt(victim)
        if victim is req:
          break

  def _upload_pages(self) -> None:
    if self.pool.dirty:
      self.state = self.model.set_pages(self.state, self.pool.table)
      self.pool.dirty = False

  def _decode(self) -> int:
    self._ensure_pages()
    self._note_peak()
    batch = [r for r in self.slots if r is not None and r.state is State.DECODING]
    if not batch:
      return 0
    self._upload_pages()
    num_slots = self.model.num_slots
    tokens = np.zeros((num_slots,), np.int32)
    active = np.zeros((num_slots,), bool)
    for req in batch:
      tokens[req.slot] = req.output[req.cached - len(req.prompt)]
      active[req.slot] = True
    try:
      self.state, logits = self.model.decode(self.state, tokens, active)
      decoded = batch
    except StepRefused as err:
      self.state = err.state
      decoded, logits = self._decode_apart(batch, tokens)
    for req in decoded:
      req.cached += 1
    if decoded:
      self._sample(decoded, logits, [r.slot for r in decoded],
                   [r.cached for r in decoded])
    if decoded and getattr(self.model, "lookahead", "none") == "draft":
      self._draft(decoded)
    return len(decoded)  # (a request that failed a refused step decoded nothing)

  def _decode_apart(self, batch: list[Request], tokens: np.ndarray):
    """After a refused step (nothing committed, so a retry is exact): step each
    request of ``batch`` alone, so that only the requests that refuse alone fail.
    Returns (the requests decoded, logits f32[S, V] with their rows). One step per
    request, on a refusal only; an inactive row's logits are garbage and each row's
    do not depend on the others', so every row is what the batch step gave it."""
    decoded, merged = [], None
    for req in batch:
      alone = np.zeros((self.model.num_slots,), bool)
      alone[req.slot] = True
      try:
        self.state, logits = self.model.decode(self.state, tokens, alone)
      except StepRefused as err:
        self.state = err.state
        self._release(req)
        self._end(req, State.FAILED, f"decode step refused: {err}")
        continue
      except Exception as err:  # noqa: BLE001 - a fault, not a refusal: re-raised by step
        # Whether the model wrote ``req``'s position is unknown: it fails. The
        # requests decoded alone before it are sampled; those after it were not
        # touched and decode next step.
        self._fail(err, [req], "its decode step alone")
        break
      decoded.append(req)
      row = np.asarray(logits[req.slot])
      if merged is None:
        merged = np.zeros((self.model.num_slots, row.shape[-1]), np.float32)
      merged[req.slot] = row
    return decoded, merged

  def _draft(self, batch: list[Request]) -> None:
    """The look-ahead: each request of ``batch`` that decodes on drafts its next
    token from the tokens it has fed (not the one just sampled: the draft stands
    in for it, as it would while the step still ran beside it)."""
    drafts = np.zeros((self.model.num_slots,), np.int32)
    active = np.zeros((self.model.num_slots,), bool)
    for req in batch:
      if req.state is not State.DECODING:  # (an ended request let its slot go)
        continue
      lookup = self._lookups.setdefault(req.id, PromptLookup())
      known = len(lookup.tokens)  # < req.cached: a step's token, or a whole prompt
      lookup.extend(req.prompt[known:req.cached] +
                    req.output[max(0, known - len(req.prompt)):req.cached - len(req.prompt)])
      drafts[req.slot] = lookup.match()[0]
      active[req.slot] = True
    if active.any():
      self.state = self.model.draft_pass(self.state, drafts, active)

  def _sample(self, batch: list[Request], logits, rows: list[int],
              positions: list[int]) -> None:
    """Sample the token at ``positions`` for each request from its row of
    ``logits``; outputs already known (a resumed request replaying) are kept, not
    re-sampled."""
    num = logits.shape[0]
    temperature, top_p = np.zeros((num,), np.float32), np.zeros((num,), np.float32)
    top_k, seed, pos = (np.zeros((num,), np.int32) for _ in range(3))
    processed_rows = np.zeros((num,), bool)
    for row, req, p in zip(rows, batch, positions):
      sp = req.sampling
      temperature[row], top_k[row], top_p[row], seed[row] = (
          sp.temperature, sp.top_k, sp.top_p, sp.seed)
      pos[row] = p
      processed_rows[row] = sp.logprobs is not None and sp.logprobs_mode == "processed"
    try:
      tokens, finite = map(np.asarray, sampling.sample(logits, temperature, top_k, top_p,
                                                       seed, pos))
      if any(r.sampling.logprobs is not None for r in batch):
        # One width for every N (one compile per logits shape); a vocabulary may be
        # smaller.
        top_n = min(MAX_LOGPROBS, logits.shape[-1])
        chosen, top_ids, top = map(np.asarray, sampling.logprobs(
            logits, tokens, temperature, top_k, top_p, processed_rows, top_n=top_n))
    except Exception as err:  # noqa: BLE001 - re-raised by step, once consistent
      # A request left without the token its next step feeds would wedge every
      # later step: it fails. One replaying knows its token and goes on.
      self._fail(err, [req for req, p in zip(batch, positions)
                       if not req.state.done and p - len(req.prompt) >= len(req.output)],
                 "sampling")
      return
    now = self.now()
    for row, req, p in zip(rows, batch, positions):
      if req.state.done:  # ended by an earlier on_token callback (abort, export)
        continue
      if not finite[row]:
        self._release(req)
        self._end(req, State.FAILED, f"non-finite logits at position {p}")
        continue
      index = p - len(req.prompt)  # the output this position holds
      if index < len(req.output):
        continue  # replaying after a preemption: known already
      token = int(tokens[row])
      req.output.append(token)
      if req.sampling.logprobs is not None:
        req.logprobs.append(float(chosen[row]))
        req.top_logprobs.append([(int(i), float(lp)) for i, lp in
                                 zip(top_ids[row, :req.sampling.logprobs],
                                     top[row, :req.sampling.logprobs])
                                 if lp > -np.inf])  # (processed: kept tokens only)
      self._new_tokens += 1
      req.metrics.token_times.append(now)
      if req.metrics.first_token is None:
        req.metrics.first_token = now
      if req.on_token:
        try:
          req.on_token(req, token)
        except Exception as err:  # noqa: BLE001 - re-raised by step, once consistent
          if not req.state.done:
            self._release(req)
            self._end(req, State.FAILED, f"on_token raised {type(err).__name__}: {err}")
          err.add_note(f"raised by on_token of request {req.id!r} (now "
                       f"{req.state.value}); the engine's step completed")
          self._step_errors.append(err)
          continue
        if req.state.done:  # the callback ended it (abort, export): released
          continue
      if len(req.output) >= req.max_new_tokens or token in req.stop_ids:
        self._release(req)
        self._end(req, State.FINISHED, "stop id" if token in req.stop_ids else "length")

  def _fail(self, err: Exception, reqs: list[Request], during: str) -> None:
    """Fail ``reqs`` (they let go) for ``err``, raised during a step; ``step``
    re-raises it once the step is done, the engine consistent."""
    for req in reqs:
      self._release(req)
      self._end(req, State.FAILED, f"{during} raised {type(err).__name__}: {err}")
    err.add_note(f"raised during {during}; the engine failed request(s) "
                 f"{[r.id for r in reqs]} and completed the step")
    self._step_errors.append(err)

  # Prefill ---------------------------------------------------------------------

  def _prefill(self, budget: float) -> int:
    req = self._prefilling()
    chunk, ran = self.model.chunk_size, 0
    while req is not None and (ran == 0 or budget >= chunk):
      self._upload_pages()
      if req.staged < req.cached:  # a cached prefix: staged from the host, not computed
        self.state = self.model.load_prefix(self.state, req.slot, req.cached)
        req.staged = req.cached
      if req.cached >= len(req.prompt):  # a handoff brought every computed position
        self._cache_prompt(req)
        self.state = self.model.start_decoding(self.state, req.slot, req.cached)
        req.state = State.DECODING
        break
      start = req.cached
      count = min(chunk, len(req.prompt) - start)
      tokens = np.zeros((chunk,), np.int32)
      tokens[:count] = req.prompt[start:start + count]
      timed = self.disk is not None and self.config.disk_policy == "auto"
      if timed:  # what came before is not this chunk's cost
        self.state = jax.block_until_ready(self.state)
      began = time.perf_counter()
      self.state, logits = self.model.prefill(self.state, req.slot, tokens, start, count)
      if timed:  # the cost a disk load is weighed against: the logits and the writes
        self.state, logits = jax.block_until_ready((self.state, logits))
        if len(tokens) in self._prefill_shapes:  # a chunk shape's first run compiles
          self._prefill_seconds += time.perf_counter() - began
          self._prefill_timed_tokens += count
        self._prefill_shapes.add(len(tokens))
      req.cached = req.staged = req.cached + count
      budget -= chunk
      ran += count
      if req.cached == len(req.prompt):
        self._cache_prompt(req)
        self.state = self.model.start_decoding(self.state, req.slot, req.cached)
        req.state = State.DECODING
        self._sample([req], logits[None], [0], [req.cached])
        req = None
    return ran

  def _holder(self, node, pages: list[int]):
    """``node``'s deepest ancestor (or itself) whose pages are those ``pages``
    holds at its depth."""
    while node.parent is not None and not self.radix.holds(node, pages):
      node = node.parent
    return node

  def _own_path_end(self, node, pages: list[int]):
    """The deepest node on ``node``'s path whose path from the root holds only
    ``pages`` (the request's own, at their depths): a lock pins every ancestor,
    so a request pins nothing above a node that is not its own."""
    keep = node
    while node.parent is not None:
      if not self.radix.holds(node, pages):
        keep = node.parent
      node = node.parent
    return keep

  def _cache_prompt(self, req: Request) -> None:
    """After its prefill: cache the request's whole prompt chunks (their pages)."""
    if self.radix is None or not self._host_pages(req.total_length):
      return
    length = len(req.prompt) // self.model.chunk_size * self.model.chunk_size
    if not length:
      return
    pages = self.pool.table[req.slot, :length // self.model.page_size].tolist()
    _, cached, on_disk = self.radix.peek(req.prompt[:length])
    part = self.pool.slot_partition(req.slot)
    if on_disk and any(self.pool.page_partition(p) != part for p in cached):
      # Data parallel, a request placed off its prefix's device: the path's nodes
      # on disk would take this device's pages below another device's prefix, a
      # path no device could share whole (and its own device could not cache
      # those chunks again). Not cached.
      return
    adopted, node = self.radix.insert(req.prompt[:length], pages)
    self.pool.retain(adopted)
    # Lock the deepest node of a path of this request's own pages. Where the tree
    # kept its own copy of a chunk the request computed again (a prompt of whole
    # chunks, all cached: its last chunk is always computed; a prefix cached on
    # another device, with the request's further chunks hung below it), that copy
    # is not the request's to pin: locked, it could never be evicted while the
    # request runs. Nodes below the lock stay alive through the request's page
    # references.
    node = self._own_path_end(node, pages)
    self.radix.lock(node)
    if req.radix_node is not None:
      self.radix.unlock(req.radix_node)
    req.radix_node = node
