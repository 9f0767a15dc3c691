"""Load generation and serving metrics, as ``vllm bench serve`` and SGLang's
``bench_serving`` measure a server.

* **Arrivals** (``arrival_times``): all at once (``rate=inf``), Poisson at a rate,
  or Gamma with a burstiness (shape; 1 is Poisson, < 1 burstier), as vLLM draws
  them. **Closed loop**: ``drive(..., max_concurrency=N)`` keeps at most N requests
  outstanding and sends the next when one ends (what the HiSparse paper ran).
* **Workloads**: ``RequestSpec`` (one request) and ``Rollout`` (an RL trajectory:
  generation turns separated by environment turns; each continuation is a new
  request whose prompt is the whole trajectory so far, sent after the
  environment's delay, so continuation prefills keep arriving while others decode).
* **Metrics** (``summarize``): request / output / total token throughput, goodput
  under TTFT and TPOT SLOs (DistServe's definition: requests meeting every SLO
  per second; None without an SLO), peak concurrency, decode throughput (tokens
  per second of the steps that ran no prompt chunk: what a decode instance of a
  P/D deployment, where HiSparse runs, sustains) and its mean batch; TTFT, TPOT,
  ITL and end-to-end latency as mean / median / P90 / P99; peak device bytes (the
  requests' charges; the fixed staging buffer is not in them) and host bytes; the
  run's length (``duration_s``).
* **One request's logits among others** (``decode_logits_among``): arrivals in
  engine steps, for comparing engines of other slot counts (batch invariance).

Times are the engine's clock (seconds); workload times are relative to the start
of ``drive``. A request's arrival (what its TTFT counts from) is its scheduled send
time, or under a closed loop the later of that and the moment a concurrency slot
freed: queueing for a slot is the client's, as in vLLM. The engine is stepped
synchronously, so a request due during a step is submitted after it, but its
arrival (and TTFT) keeps the due time.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import time
from typing import Callable, Sequence

import jax
import numpy as np

from kvtier_jax.serving.engine import Engine
from kvtier_jax.serving.request import Request, SamplingParams, State


@dataclasses.dataclass(frozen=True)
class RequestSpec:
  """One request of a workload; ``arrival_s`` is when the client sends it."""

  id: str
  prompt: tuple[int, ...]
  max_new_tokens: int
  arrival_s: float = 0.0
  sampling: SamplingParams = SamplingParams()
  stop_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Rollout:
  """An RL trajectory or a chat / agent session: ``prompt``, then for each turn a
  generation of up to ``max_new_tokens[i]`` tokens; between turns the environment
  (or the user) appends ``env_tokens[i]`` after ``env_seconds`` (len(env_tokens) =
  turns - 1). Turn i's request id is ``turn_ids[i]`` (default ``<id>/t<i>``)."""

  id: str
  prompt: tuple[int, ...]
  max_new_tokens: tuple[int, ...]
  env_tokens: tuple[tuple[int, ...], ...]
  arrival_s: float = 0.0
  env_seconds: float = 0.0
  sampling: SamplingParams = SamplingParams()
  turn_ids: tuple[str, ...] | None = None

  def __post_init__(self):
    if len(self.env_tokens) != len(self.max_new_tokens) - 1:
      raise ValueError(f"rollout {self.id}: {len(self.max_new_tokens)} turns need "
                       f"{len(self.max_new_tokens) - 1} environment turns, got "
                       f"{len(self.env_tokens)}")

  def turn(self, index: int, history: Sequence[int], arrival_s: float) -> RequestSpec:
    """Generation turn ``index`` whose prompt is ``history`` (the trajectory so far)."""
    rid = self.turn_ids[index] if self.turn_ids else f"{self.id}/t{index}"
    return RequestSpec(rid, tuple(history), self.max_new_tokens[index], arrival_s,
                       self.sampling)


def first_admission_tokens(requests: Sequence[Request]) -> tuple[int, int]:
  """(prompt tokens, of them served by the prefix cache) of the requests admitted,
  each at its first admission: a preempted request admitted again would count its
  prompt twice and hit its own cached prompt."""
  admitted = [r for r in requests if r.metrics.cached_tokens is not None]
  return (sum(len(r.prompt) for r in admitted),
          sum(r.metrics.cached_tokens for r in admitted))


def compare_with_sparse(rows: list[dict], outputs: list[dict]) -> None:
  """Adds ``vs_sparse`` / ``decode_vs_sparse`` (throughput over the sparse run's)
  and ``same_tokens`` (finished requests whose tokens equal it) to sweep rows,
  per point: (context, concurrency, prefill policy). ``outputs``: {id: tokens}
  per row. A point without a sparse run gets none of them (dense attention's
  tokens are not the reference for exactness)."""
  points = collections.defaultdict(list)
  for row, out in zip(rows, outputs):
    points[(row["context"], row["concurrency"], row["prefill_policy"])].append((row, out))
  for group in points.values():
    ref = next(((r, o) for r, o in group if r["cache"] == "sparse"), None)
    if ref is None:
      continue
    for row, out in group:
      cut = row.get("cut") or ref[0].get("cut")  # a point cut short: not comparable
      for key, ratio in (("output_throughput", "vs_sparse"),
                         ("decode_throughput", "decode_vs_sparse")):
        row[ratio] = (row[key] / ref[0][key] if not cut
                      and row.get(key) and ref[0].get(key) else None)
      if row is not ref[0] and ref[1]:
        same = sum(out.get(k) == v for k, v in ref[1].items())
        row["same_tokens"] = f"{same}/{len(ref[1])}"


def arrival_times(num: int, rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> np.ndarray:
  """f64[num] send times: 0 for ``rate=inf``, else Gamma gaps of mean 1/rate and
  shape ``burstiness`` (vLLM: scale 1 / (rate * burstiness); 1 is Poisson)."""
  if rate <= 0 or burstiness <= 0:
    raise ValueError(f"rate={rate} and burstiness={burstiness} must be > 0 (inf: at once)")
  if math.isinf(rate) or num == 0:
    return np.zeros((num,))
  rng = rng or np.random.default_rng(0)
  gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num)
  return np.cumsum(gaps) - gaps[0]  # the first request at t = 0


@dataclasses.dataclass
class Served:
  """What ``drive`` observed: every request sent (in send order) and every step."""

  requests: list[Request]
  steps: list[dict]
  start: float
  end: float
  refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (id, why)
  # ``resume``: the engine's time at the restore, and each restored request's
  # (tokens in its output, done) then; ``summarize`` reports what came after.
  resumed_at: float | None = None
  at_resume: dict[str, tuple[int, bool]] = dataclasses.field(default_factory=dict)


def drive(engine: Engine, workload: Sequence[RequestSpec | Rollout], *,
          max_concurrency: int | None = None,
          on_finish: Callable[[Request], None] | None = None,
          sleep: Callable[[float], None] = time.sleep,
          until: Callable[[], bool] | None = None, resume: bool = False) -> Served:
  """Send ``workload`` to ``engine`` as a client would and step it until every
  request (and every rollout turn) has ended, or until ``until()`` is true after a
  step (requests in flight stay in the engine: a snapshot can take them on).

  ``max_concurrency``: at most this many requests outstanding (closed loop); a
  request is sent at its arrival time or when a slot frees, whichever is later.
  A rollout's next turn is sent ``env_seconds`` after its previous turn ends; a
  turn that does not finish (aborted, failed) ends its rollout, and so does a later
  turn the engine refuses (its history outgrew ``max_len`` or the host tier): it is
  listed in ``Served.refused``. A refused first request raises (bad input).

  ``resume``: the engine was restored from a snapshot of a run of this workload.
  Its requests count as sent (those in flight are waited for), workload requests
  it already holds are not sent again, and send times keep counting from the
  engine's time 0, so the rest of the workload keeps its schedule.
  """
  if max_concurrency is not None and max_concurrency <= 0:
    raise ValueError(f"max_concurrency={max_concurrency} must be positive")
  if resume and any(isinstance(w, Rollout) for w in workload):
    raise ValueError("resume continues independent requests, not rollouts")
  # (send time, order, spec, rollout or None, turn index)
  pending = [(float(w.arrival_s), n, w, None, 0) for n, w in enumerate(workload)
             if not (resume and w.id in engine.requests)]
  order = len(workload)
  outstanding: dict[str, tuple[Request, Rollout | None, int]] = {}
  sent: list[Request] = list(engine.requests.values()) if resume else []
  resumed_at = engine.now() if resume else None
  at_resume = {r.id: (len(r.output), r.state.done) for r in sent}
  for req in sent:
    if not req.state.done:
      outstanding[req.id] = (req, None, 0)
    elif on_finish:
      on_finish(req)
  steps: list[dict] = []
  refused: list[tuple[str, str]] = []
  # The engine's state may still be building on the device (a new engine's host
  # pool: seconds at a large budget): not the workload's time.
  engine.state = jax.block_until_ready(engine.state)
  start = 0.0 if resume else engine.now()
  # When each closed-loop slot last freed (a request sent to it arrives no earlier).
  freed = [start] * (max_concurrency or 0)
  if resume and max_concurrency:
    # Sends took the earliest times: the free slots hold the latest ones (the
    # restored requests still in flight hold theirs).
    times = sorted(freed + [r.metrics.finished for r in sent if r.state.done])
    freed = times[len(times) - max(0, max_concurrency - len(outstanding)):]
  while pending or outstanding:
    pending.sort(key=lambda p: (p[0], p[1]))
    now = engine.now()
    while pending and pending[0][0] <= now - start and (
        max_concurrency is None or len(outstanding) < max_concurrency):
      send, _, item, rollout, turn = pending.pop(0)
      arrival = slot_free = start + send
      if max_concurrency is not None:
        slot_free = heapq.heappop(freed)
        arrival = max(arrival, slot_free)
      if isinstance(item, Rollout):
        rollout, spec = item, item.turn(0, item.prompt, send)
      else:
        spec = item
      try:
        req = engine.submit(spec.prompt, spec.max_new_tokens, spec.sampling,
                            stop_ids=spec.stop_ids, request_id=spec.id, arrival=arrival)
      except ValueError as err:
        if not turn:
          raise
        refused.append((spec.id, str(err)))
        if max_concurrency is not None:  # nothing took the slot
          heapq.heappush(freed, slot_free)
        continue
      outstanding[req.id] = (req, rollout, turn)
      sent.append(req)
    if engine.has_work:
      steps.append(engine.step())
      if until is not None and until():
        break
    elif pending:
      sleep(max(0.0, min(0.05, start + pending[0][0] - engine.now())))
    for rid, (req, rollout, turn) in list(outstanding.items()):
      if not req.state.done:
        continue
      del outstanding[rid]
      if max_concurrency is not None:
        heapq.heappush(freed, req.metrics.finished)
      if on_finish:
        on_finish(req)
      if (rollout is not None and req.state is State.FINISHED
          and turn + 1 < len(rollout.max_new_tokens)):
        history = [*req.prompt, *req.output, *rollout.env_tokens[turn]]
        send = req.metrics.finished - start + rollout.env_seconds
        pending.append((send, order, rollout.turn(turn + 1, history, send), rollout,
                        turn + 1))
        order += 1
  return Served(sent, steps, start, engine.now(), refused, resumed_at, at_resume)


def random_others(rng: np.random.Generator, count: int, vocab_size: int,
                  prompt_lens: tuple[int, int], new_tokens: tuple[int, int],
                  arrival_steps: int = 6) -> list[tuple[int, RequestSpec]]:
  """``count`` requests of random token ids for ``decode_logits_among``: (arrival
  step in [0, arrival_steps), spec), prompt lengths and token counts drawn from the
  half-open ranges ``prompt_lens`` and ``new_tokens``."""
  others = []
  for i in range(count):
    at = int(rng.integers(0, arrival_steps))
    prompt = rng.integers(0, vocab_size, int(rng.integers(*prompt_lens)))
    others.append((at, RequestSpec(f"other{i}", tuple(prompt.tolist()),
                                   int(rng.integers(*new_tokens)))))
  return others


def decode_logits_among(engine: Engine, spec: RequestSpec,
                        others: Sequence[tuple[int, RequestSpec]]
                        ) -> tuple[Request, np.ndarray]:
  """Serve ``spec`` on ``engine`` while each of ``others`` ((engine step, request))
  is sent once the engine has taken that many steps; returns the request and its
  logits at each decode step it took part in [steps, V].

  What a batch-invariance check compares across engines of other slot counts:
  arrivals count engine steps, not seconds, so the batches the request meets depend
  on nothing timed. The others' ``arrival_s`` is ignored. A preempted request replays
  its outputs through decode steps when it resumes: those rows are recorded again."""
  rows, decode = [], engine.model.decode

  def recording(state, tokens, active):
    state, logits = decode(state, tokens, active)
    if target.slot is not None and active[target.slot]:
      rows.append(np.asarray(logits)[target.slot])
    return state, logits

  target = engine.submit(spec.prompt, spec.max_new_tokens, spec.sampling,
                         stop_ids=spec.stop_ids, request_id=spec.id)
  pending = collections.deque(sorted(others, key=lambda other: other[0]))  # stable
  engine.model.decode = recording
  try:
    while engine.has_work or pending:
      while pending and pending[0][0] <= engine.steps:
        other = pending.popleft()[1]
        engine.submit(other.prompt, other.max_new_tokens, other.sampling,
                      stop_ids=other.stop_ids, request_id=other.id)
      engine.step()
  finally:
    engine.model.decode = decode
  return target, np.stack(rows) if rows else np.zeros((0, engine.model.vocab_size))


# Metrics -----------------------------------------------------------------------

def distribution(values: Sequence[float | None], scale: float = 1.0) -> dict:
  """mean / median / p90 / p99 of the finite values times ``scale`` (None: empty)."""
  vals = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
  if not vals.size:
    return dict(mean=None, median=None, p90=None, p99=None)
  vals = vals * scale
  return dict(mean=float(vals.mean()), median=float(np.median(vals)),
              p90=float(np.percentile(vals, 90)), p99=float(np.percentile(vals, 99)))


def window_requests(served: Served) -> list[Request]:
  """The requests a run's metrics cover: all it sent, or after a restore those
  that had not ended by then."""
  return [r for r in served.requests if not served.at_resume.get(r.id, (0, False))[1]]


def admitted_in_window(served: Served) -> list[Request]:
  """The window's requests first admitted in it: after a restore, a request
  prefilled before the snapshot was the saved run's (its prefill is not in this
  run's steps)."""
  return [r for r in window_requests(served) if r.metrics.admitted is not None
          and (served.resumed_at is None or r.metrics.admitted > served.resumed_at)]


def summarize(served: Served, *, host_page_bytes: int = 0,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
  """One flat row of serving metrics (latencies in ms, bytes in MiB).

  A resumed run (``drive(resume=True)``) reports its own window, from the restore
  on: the requests that had not ended by then and the tokens generated since
  (the run that saved the snapshot reported the rest).
  """
  steps, reqs = served.steps, window_requests(served)
  begin = served.start if served.resumed_at is None else served.resumed_at
  before = {rid: tokens for rid, (tokens, _) in served.at_resume.items()}
  done = [r for r in reqs if r.state is State.FINISHED]
  per = [r.metrics.summary() for r in done]
  duration = max(served.end - begin, 1e-9)
  prompt_tokens = sum(len(r.prompt) for r in done)
  # Generated here: an accepted handoff's relayed tokens are the sender's output,
  # a restored request's earlier tokens the saved run's. Requests still running (a
  # run cut at a deadline) generated theirs in the window too, as did requests
  # handed off to another engine before they left (the receiver leaves them out as
  # relayed); failed and aborted ones are left out.
  running = [r for r in reqs if not r.state.done]
  handed_off = [r for r in reqs if r.state is State.HANDED_OFF]
  made = {r.id: len(r.output) - max(r.relayed, before.get(r.id, 0))
          for r in done + running + handed_off}
  output_tokens = sum(made.values())
  # The prompts beside those tokens: a finished request's (vLLM's count), and a
  # running or handed-off one's that generated here (a run cut at a deadline).
  served_prompts = prompt_tokens + sum(len(r.prompt) for r in running + handed_off
                                       if made[r.id] > 0)
  # Steps with no prompt chunk: the steady decode a disaggregated decode instance runs.
  decode_only = [s for s in steps if s.get("decode_batch") and not s.get("prefill_tokens")]

  def good(p):
    return ((slo_ttft_s is None or (p["ttft_s"] is not None and p["ttft_s"] <= slo_ttft_s))
            and (slo_tpot_s is None or p["tpot_s"] is None or p["tpot_s"] <= slo_tpot_s))

  row = dict(requests=len(reqs), finished=len(done), unfinished=len(running),
             handed_off=len(handed_off), failed=sum(r.state is State.FAILED for r in reqs),
             refused=len(served.refused),
             duration_s=duration, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
             request_throughput=len(done) / duration,
             output_throughput=output_tokens / duration,
             total_token_throughput=(served_prompts + output_tokens) / duration,
             # Without an SLO every request would count: no goodput (as vLLM).
             goodput=(sum(map(good, per)) / duration
                      if (slo_ttft_s, slo_tpot_s) != (None, None) else None),
             peak_concurrency=max((s["peak_running"] for s in steps), default=0),
             decode_throughput=sum(s["new_tokens"] for s in decode_only)
             / max(sum(s["seconds"] for s in decode_only), 1e-9) if decode_only else None,
             mean_decode_batch=float(np.mean([s["decode_batch"] for s in decode_only]))
             if decode_only else None,
             preemptions=sum(r.metrics.preemptions for r in reqs),
             peak_device_mib=max((s["peak_device_bytes"] for s in steps), default=0)
             / 2**20,
             peak_host_mib=max((s["peak_host_pages"] for s in steps), default=0)
             * host_page_bytes / 2**20,
             prefix_hit=(sum(p["cached_tokens"] or 0 for p in per) / prompt_tokens
                         if prompt_tokens else None),
             misses=sum(s.get("misses", 0) for s in steps),
             prefetched=sum(s.get("prefetched", 0) for s in steps))
  for name, key in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s")):
    for stat, value in distribution([p[key] for p in per], 1e3).items():
      row[f"{name}_{stat}_ms"] = value
  for stat, value in distribution([t for p in per for t in p["itl_s"]], 1e3).items():
    row[f"itl_{stat}_ms"] = value
  return row
