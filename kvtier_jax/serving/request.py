"""A request's parameters, its lifecycle, and what it measured along the way."""

from __future__ import annotations

import dataclasses
import enum
import zlib
from typing import Callable, Sequence

import numpy as np


class State(enum.Enum):
  WAITING = "waiting"  # submitted (or preempted), no slot yet
  PREFILLING = "prefilling"  # has a slot and pages; its prompt runs in chunks
  DECODING = "decoding"  # in the decode batch
  FINISHED = "finished"  # reached max_new_tokens or a stop id
  ABORTED = "aborted"  # abort() was called
  FAILED = "failed"  # non-finite logits, a decode step refused it alone, on_token raised
  HANDED_OFF = "handed_off"  # exported to another engine (Engine.export)

  @property
  def done(self) -> bool:
    return self in (State.FINISHED, State.ABORTED, State.FAILED, State.HANDED_OFF)


MAX_LOGPROBS = 20  # the most likely tokens a request may ask for (OpenAI's top_logprobs)
LOGPROBS_MODES = ("raw", "processed")  # SamplingParams.logprobs_mode
F32_MAX = float(np.finfo(np.float32).max)
# The version of ``sampling.sample``'s draws: bumped whenever the token a sampled
# request draws at (seed, position, logits, parameters) changes. A snapshot or a
# handoff records it, and one of other draws (or none: older, before the sampler's
# kinds, its greedy bound and top-p's first token) that would continue a sampled
# request is refused: it would go on with other tokens. Greedy draws never change.
DRAWS = 2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Greedy when ``temperature`` is 0 (or below ``sampling.GREEDY_BELOW``, 1e-5, as
  in vLLM); else softmax(logits / temperature) over the ``top_k`` most likely
  tokens (0: all) whose cumulative probability first reaches ``top_p`` (the most
  likely token always). ``seed`` fixes the draws: the token at position p depends
  only on (seed, p, logits), never on the rest of the batch. None (the default): the
  engine derives one from the request's id at submission (``resolved``), so
  requests with the same prompt draw differently and a rerun with the same ids
  repeats; the request keeps the derived seed (snapshots, handoffs).

  ``logprobs``: None (the default) records none; N records, for each sampled
  token, its log-probability under the model's distribution (log-softmax of the
  raw logits, before temperature, top-k and top-p, as vLLM's default
  ``raw_logprobs``) and the N most likely tokens with theirs
  (``Request.logprobs``, ``Request.top_logprobs``; N <= ``MAX_LOGPROBS``).
  ``logprobs_mode="processed"`` records them under the distribution the sampler
  draws from instead (vLLM's ``processed_logprobs``): the logits over the
  temperature (1 when greedy), renormalised over the tokens top-k and top-p keep;
  the top lists then hold only kept tokens (fewer than N when fewer are kept)."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  logprobs: int | None = None
  logprobs_mode: str = "raw"

  def __post_init__(self):
    # numpy scalars become Python numbers (they travel as JSON in handoffs and
    # snapshots); anything else is left for ``check`` to refuse.
    for name, numpy_types, kind in (("temperature", (np.integer, np.floating), float),
                                    ("top_p", (np.integer, np.floating), float),
                                    ("top_k", np.integer, int), ("seed", np.integer, int),
                                    ("logprobs", np.integer, int)):
      if isinstance(getattr(self, name), numpy_types):
        object.__setattr__(self, name, kind(getattr(self, name)))

  def check(self) -> None:
    def real(x):
      return isinstance(x, (int, float)) and not isinstance(x, bool)
    # The engine samples in f32 / i32: a temperature past f32's range would become
    # inf, a top_k past i32's would not fit.
    if not (real(self.temperature) and 0 <= self.temperature <= F32_MAX):
      raise ValueError(f"temperature={self.temperature!r} must be a number in [0, "
                       f"{F32_MAX:.4g}] (f32)")
    if not is_int(self.top_k) or not 0 <= self.top_k < 2**31:
      raise ValueError(f"top_k={self.top_k!r} must be an int in [0, 2**31) (0: no limit)")
    if not (real(self.top_p) and 0.0 < self.top_p <= 1.0):
      raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
    if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**31):
      raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**31) or None")
    if self.logprobs is not None and not (is_int(self.logprobs)
                                          and 0 <= self.logprobs <= MAX_LOGPROBS):
      raise ValueError(f"logprobs={self.logprobs!r} must be an int in [0, "
                       f"{MAX_LOGPROBS}] or None")
    if not (isinstance(self.logprobs_mode, str) and self.logprobs_mode in LOGPROBS_MODES):
      raise ValueError(f"logprobs_mode={self.logprobs_mode!r:.80} must be one of "
                       f"{LOGPROBS_MODES}")

  def resolved(self, request_id: str) -> "SamplingParams":
    """These parameters with a seed: the given one, else a stable hash of the id."""
    if self.seed is not None:
      return self
    return dataclasses.replace(self, seed=zlib.crc32(request_id.encode()) & 0x7FFFFFFF)


@dataclasses.dataclass
class Metrics:
  """Wall-clock times (seconds on the engine's clock) and counts of one request."""

  arrival: float
  admitted: float | None = None  # first admission
  first_token: float | None = None
  token_times: list[float] = dataclasses.field(default_factory=list)
  finished: float | None = None
  preemptions: int = 0
  cached_tokens: int | None = None  # prompt tokens served by the prefix cache (first admission)

  def summary(self) -> dict:
    times = self.token_times
    itl = [b - a for a, b in zip(times, times[1:])]
    return dict(
        queue_s=None if self.admitted is None else self.admitted - self.arrival,
        ttft_s=None if self.first_token is None else self.first_token - self.arrival,
        tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        itl_s=itl,
        e2e_s=None if self.finished is None else self.finished - self.arrival,
        preemptions=self.preemptions, cached_tokens=self.cached_tokens)


@dataclasses.dataclass
class Request:
  """One request and everything the engine tracks about it."""

  id: str
  prompt: list[int]
  max_new_tokens: int
  sampling: SamplingParams
  stop_ids: frozenset[int]
  metrics: Metrics
  on_token: Callable[["Request", int], None] | None = None
  state: State = State.WAITING
  output: list[int] = dataclasses.field(default_factory=list)
  # With ``sampling.logprobs`` set, one entry per output token (relayed ones too):
  # its log-probability, and the most likely tokens as (id, log-probability).
  logprobs: list[float] = dataclasses.field(default_factory=list)
  top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  reason: str = ""
  # Engine bookkeeping (host side).
  slot: int | None = None
  device_bytes: int = 0  # charged to the device budget while it holds a slot
  cached: int = 0  # positions in the cache (prompt chunks run, then decoded tokens)
  staged: int = 0  # prompt positions in the model's staging buffer
  admit_order: int = -1
  overtaken: int = 0  # later arrivals admitted while it waited (schedule "lpm")
  radix_node: object = None  # the prefix-cache node it locks
  imported: tuple | None = None  # (kv_start, kv_end, pages) from a handoff
  relayed: int = 0  # leading tokens of ``output`` another engine generated (a handoff)
  prefix_seen: tuple[int, int] = (-1, 0)  # (radix version, cached prefix) "lpm" read

  @property
  def total_length(self) -> int:
    """The longest this request can get."""
    return len(self.prompt) + self.max_new_tokens


def is_int(x) -> bool:
  """An integer (Python or numpy), not a bool: a token id, a count, a seed."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_prompt(prompt: Sequence[int], vocab_size: int) -> list[int]:
  prompt = list(prompt)
  not_ids = [t for t in prompt if not is_int(t)]
  if not_ids:  # int() would truncate 61.9 into a token silently
    raise ValueError(f"prompt tokens {not_ids[:5]} are not integer ids")
  ids = [int(t) for t in prompt]
  if not ids:
    raise ValueError("the prompt is empty")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
  return ids
