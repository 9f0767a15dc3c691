"""Cross-datacenter prefill / relay-decode / main-decode (PDD) as a discrete-event
simulation (SimPy).

Prefill (P) runs in datacenter A; MainDecode (MD) in datacenter B keeps a Decode
Radix Cache, so P sends it only the increment of each prompt (the tokens beyond
MD's cached prefix) over a WAN link: a pool of TCP connections sharing the line
fairly. RelayDecode (RLD) sits beside P behind RDMA: a request whose increment
would take too long over the WAN (the trigger in docs/DESIGN.md: estimated transfer
> the TTFT budget, and RLD has a free slot; the estimate waits for a connection to
free when every one is taken) starts decoding on RLD at once while the WAN transfer
runs; once it has landed and MD has a slot for the request (RLD decodes on until
then), RLD sends MD the generated token ids and MD rebuilds their KV with one
extend (Extend-Decode handoff: Catch-Up while RLD is lightly loaded, RLD keeps
decoding until MD has caught up; One-Shot otherwise, RLD stops at once). MD always
finishes the request (DRC consistency). Conventional cross-DC PD is the same system
without RLD.

Per-request increments come from the real radix cache (``RadixCache``) replaying a
generated agentic trace in chunks of ``chunk`` tokens; step costs from
``models.capacity.ThroughputModel`` (our engine's roofline) unless given.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterator

import numpy as np
import simpy

from kvtier_jax.serving.radix import RadixCache

GBPS = 1e9 / 8  # bytes/s per Gbit/s


# The trace ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceRequest:
  arrival: float  # s
  session: int
  input_tokens: int
  cached_tokens: int  # matched on MD's radix cache
  output_tokens: int

  @property
  def increment(self) -> int:
    return self.input_tokens - self.cached_tokens


@dataclasses.dataclass(frozen=True)
class TraceConfig:
  """An agentic trace: sessions whose context grows turn by turn.

  Every session ran before the window (its context is cached: steady state).
  ``skewed``: most turns append a little (tool call + reply: hit >= 95%), 15%
  append a large tool result (hit 65-90%), and 3% start a new session or compact
  the context, sharing only the system prompt: PDD's production shape (70-80% of
  requests >= 95% hit, a tail of low-hit ones; measured 74-78% at 4K and 64K
  inputs, mean hit 0.88-0.92). ``narrow``: every turn appends 5-15% of its context
  (hit 87-96%). Outputs: 30% under 100 tokens and 40% more under 500 (PDD's
  "30% < 100, 40% < 500" read as two bands: "very short output").
  """

  distribution: str = "skewed"
  rate: float = 80.0  # requests / s
  duration: float = 60.0  # s of arrivals
  sessions: int = 400
  mean_input: int = 65536  # tokens
  system_prompt: int = 2048  # tokens every session shares
  chunk: int = 0  # radix granularity in tokens (0: mean_input / 256)
  output_quantiles: tuple = ((0.3, 100), (0.7, 500))  # (share, tokens) below
  new_context_share: float = 0.03  # skewed: turns that start over (system prompt only)
  large_result_share: float = 0.15  # skewed: turns that append a large tool result
  seed: int = 0


def _outputs(rng, n, quantiles) -> np.ndarray:
  """Short outputs with a long tail: a lognormal through two quantiles (the default
  30% < 100 tokens, 70% < 500: median 224, mean ~725)."""
  (p1, x1), (p2, x2) = quantiles
  z1, z2 = (statistics.NormalDist().inv_cdf(p) for p in (p1, p2))
  sigma = (math.log(x2) - math.log(x1)) / (z2 - z1)
  mu = math.log(x1) - z1 * sigma
  return np.maximum(1, rng.lognormal(mu, sigma, n)).astype(int)


def generate_trace(cfg: TraceConfig) -> list[TraceRequest]:
  """Requests in arrival order; each one's cached prefix is what MD's radix tree
  (chunk granularity, unbounded) matches when it arrives; a request's prompt and
  output are inserted after it (the next turn arrives after it finished)."""
  if cfg.distribution not in ("skewed", "narrow"):
    raise ValueError(f"distribution={cfg.distribution!r}: skewed or narrow")
  rng = np.random.default_rng(cfg.seed)
  chunk = cfg.chunk or max(1, cfg.mean_input // 256)
  tree = RadixCache(1, 1)
  fresh = iter(range(1 << 62))  # chunk ids
  system = [next(fresh) for _ in range(cfg.system_prompt // chunk)]
  lo, hi = int(cfg.mean_input * 0.75) // chunk, int(cfg.mean_input * 1.25) // chunk
  if lo <= len(system):
    raise ValueError(f"mean_input={cfg.mean_input}: new contexts (0.75-1.0x of it) "
                     f"would hold only the {cfg.system_prompt}-token system prompt; "
                     f"use a mean input above {cfg.system_prompt / 0.75:.0f} tokens")

  def new_context() -> list[int]:
    size = int(rng.integers(lo, (lo + hi) // 2))
    return system + [next(fresh) for _ in range(size - len(system))]

  def warm(ctx: list[int]) -> list[int]:
    tree.insert(ctx, list(range(len(ctx))))
    return ctx

  # Steady state: every session ran before the window, so its context is cached.
  contexts = [warm(new_context()) for _ in range(cfg.sessions)]
  arrivals = np.cumsum(rng.exponential(1 / cfg.rate, int(cfg.rate * cfg.duration)))
  outputs = _outputs(rng, len(arrivals), cfg.output_quantiles)
  out = []
  for t, output in zip(arrivals, outputs):
    s = int(rng.integers(cfg.sessions))
    ctx = contexts[s]
    if cfg.distribution == "narrow":
      if len(ctx) > hi:  # compacted earlier (and cached): sizes stay stationary
        ctx = warm(new_context())
      append = int(len(ctx) * rng.uniform(0.05, 0.15))
    else:
      u = rng.random()
      if u < cfg.new_context_share or len(ctx) > hi:  # a new session, or compacted
        ctx, append = new_context(), 0
      elif u < cfg.new_context_share + cfg.large_result_share:  # a large tool result
        append = int(len(ctx) * rng.uniform(0.1, 0.5))
      else:  # a tool call and a short reply
        append = int(rng.integers(1, max(2, len(ctx) // 40)))
    prompt = ctx + [next(fresh) for _ in range(append)]
    pages, _ = tree.match_prefix(prompt)
    contexts[s] = prompt + [next(fresh) for _ in range(max(1, int(output) // chunk))]
    tree.insert(contexts[s], list(range(len(contexts[s]))))
    out.append(TraceRequest(float(t), s, len(prompt) * chunk, len(pages) * chunk,
                            int(output)))
  return out


# The link -------------------------------------------------------------------------


class FairLink:
  """A line of ``rate`` bytes/s shared equally by the transfers on it (each capped
  at ``per_flow`` bytes/s): processor sharing, advanced event by event."""

  def __init__(self, env: simpy.Environment, rate: float, per_flow: float | None = None):
    self.env, self.rate, self.per_flow = env, rate, per_flow
    self.active: dict[simpy.Event, float] = {}
    self._last = env.now
    self._wake = env.event()
    env.process(self._run())

  def _share(self) -> float:
    share = self.rate / max(1, len(self.active))
    return min(share, self.per_flow) if self.per_flow else share

  def _advance(self) -> None:
    if self.active:
      moved = self._share() * (self.env.now - self._last)
      for event in self.active:
        self.active[event] -= moved
    self._last = self.env.now

  def remaining(self) -> list[float]:
    """Bytes each transfer on the line still has to move."""
    self._advance()
    return list(self.active.values())

  def send(self, nbytes: float) -> simpy.Event:
    """An event that fires when ``nbytes`` have crossed."""
    done = self.env.event()
    self._advance()
    if nbytes <= 0:
      done.succeed()
      return done
    self.active[done] = float(nbytes)
    if not self._wake.triggered:
      self._wake.succeed()
    return done

  def _run(self) -> Iterator[simpy.Event]:
    while True:
      if not self.active:
        self._wake = self.env.event()
        yield self._wake
        continue
      self._wake = self.env.event()
      soonest = min(self.active.values()) / self._share()
      yield self.env.timeout(max(soonest, 0.0)) | self._wake
      self._advance()
      done_below = self._share() * 1e-9  # < 1 ns left: done (the clock's float step)
      for event, left in list(self.active.items()):
        if left <= done_below:
          del self.active[event]
          event.succeed()


# The system -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SystemConfig:
  """PDD's three pools and two links. Defaults and their sources: experiments/pdd.py."""

  kv_bytes_per_token: float = 43e3
  wan_gbps: float = 20.0
  wan_flow_gbps: float | None = None  # one TCP connection's ceiling (window / RTT)
  wan_connections: int = 16
  wan_chunk_mb: float = 0.0  # > 0: a transfer goes in chunks, each taking a connection
  wan_rtt_s: float = 0.03
  rdma_gbps: float = 400.0
  prefill_instances: int = 32
  prefill_tok_s: float = 20000.0  # per P instance
  md_slots: int = 4096
  rld_slots: int = 48  # 3 GPUs
  tpot_s: float = 0.03  # MD / RLD decode step per token
  extend_tok_s: float = 300.0  # MD extend over relayed token ids (handoff)
  ttft_budget_s: float = 2.0  # relay when the estimated WAN transfer exceeds it
  catch_up_below: float = 0.5  # RLD utilisation under which handoffs are Catch-Up
  relay: bool = True  # False: conventional cross-DC PD


@dataclasses.dataclass
class Outcome:
  request: TraceRequest
  transfer_s: float = math.nan  # WAN: connection wait + transfer
  conn_wait_s: float = 0.0
  ttft_s: float = math.nan
  e2e_s: float = math.nan
  relayed: bool = False
  mode: str = ""
  relayed_tokens: int = 0
  handoff_s: float = 0.0


def simulate(trace: list[TraceRequest], cfg: SystemConfig) -> tuple[list[Outcome], dict]:
  env = simpy.Environment()
  wan = FairLink(env, cfg.wan_gbps * GBPS,
                 cfg.wan_flow_gbps * GBPS if cfg.wan_flow_gbps else None)
  rdma = FairLink(env, cfg.rdma_gbps * GBPS)
  pool = simpy.Resource(env, cfg.wan_connections)
  prefill = simpy.Resource(env, cfg.prefill_instances)
  md = simpy.Resource(env, cfg.md_slots)
  rld = simpy.Resource(env, cfg.rld_slots)
  busy = {"area": 0.0, "last": 0.0, "end": 0.0}
  queued: list[float] = []  # bytes of the pieces waiting for a connection, in order
  in_rtt: list[float] = []  # bytes of the pieces holding one, in their round trip
  outcomes = []

  def conn_level():
    busy["area"] += pool.count * (env.now - busy["last"])
    busy["last"] = env.now
    if pool.count or pool.queue:
      busy["end"] = env.now

  def wan_transfer(nbytes, out):
    """Over a pooled connection; in chunks (SGLang's chunked KV sender), each queues
    for a connection again, so a long transfer cannot hold one while short ones wait."""
    start, left, first = env.now, nbytes, True
    chunk = cfg.wan_chunk_mb * 1e6 if cfg.wan_chunk_mb else nbytes
    while first or left > 0:
      asked = env.now
      piece = min(left, chunk)
      conn_level()
      queued.append(piece)
      with pool.request() as conn:
        yield conn
        queued.remove(piece)  # the first of its size: FIFO grants
        conn_level()
        out.conn_wait_s += env.now - asked
        if first:
          in_rtt.append(piece)
          yield env.timeout(cfg.wan_rtt_s)
          in_rtt.remove(piece)
        yield wan.send(piece)
        left -= piece
        first = False
        conn_level()
    out.transfer_s = env.now - start

  rate = cfg.wan_gbps * GBPS
  flow_cap = cfg.wan_flow_gbps * GBPS if cfg.wan_flow_gbps else math.inf

  def connection_wait() -> float:
    """Until a connection frees for a new transfer: the pieces holding one finish
    smallest first at fair shares (those in their round trip as if sending), and
    each freed connection goes to the next piece queued ahead."""
    if pool.count < cfg.wan_connections:
      return 0.0
    flows, ahead, wait = sorted(wan.remaining() + in_rtt), list(queued), 0.0
    while flows:
      per_flow = min(rate / len(flows), flow_cap)
      wait += flows[0] / per_flow
      flows = [left - flows[0] for left in flows[1:]]
      if not ahead:
        break
      flows = sorted(flows + [ahead.pop(0)])
    return wait

  def estimate_transfer(nbytes) -> float:
    share = min(rate / max(1, min(len(wan.active) + 1, cfg.wan_connections)), flow_cap)
    return cfg.wan_rtt_s + connection_wait() + nbytes / share

  def request(req: TraceRequest):
    out = Outcome(req)
    outcomes.append(out)
    yield env.timeout(req.arrival)
    with prefill.request() as p:
      yield p
      yield env.timeout(req.increment / cfg.prefill_tok_s)
    inc_bytes = req.increment * cfg.kv_bytes_per_token
    transfer = env.process(wan_transfer(inc_bytes, out))
    relay = (cfg.relay and estimate_transfer(inc_bytes) > cfg.ttft_budget_s
             and rld.count < cfg.rld_slots)
    if not relay:
      yield transfer
      with md.request() as slot:
        yield slot
        yield env.timeout(cfg.tpot_s)
        out.ttft_s = env.now - req.arrival
        yield env.timeout(cfg.tpot_s * (req.output_tokens - 1))
      out.e2e_s = env.now - req.arrival
      return
    out.relayed = True
    catch_up = rld.count / cfg.rld_slots < cfg.catch_up_below
    out.mode = "catch-up" if catch_up else "one-shot"
    slot = rld.request()
    yield slot
    yield rdma.send(req.input_tokens * cfg.kv_bytes_per_token)  # RLD gets the whole KV
    started = env.now
    yield env.timeout(cfg.tpot_s)
    out.ttft_s = env.now - req.arrival
    finished_on_rld = env.timeout(cfg.tpot_s * (req.output_tokens - 1))
    yield transfer | finished_on_rld
    # RLD decodes on until the handoff can start: the increment has landed and MD
    # has a slot for the request.
    md_slot = None
    if transfer.triggered:
      md_slot = md.request()
      yield md_slot | finished_on_rld
    # (A timeout counts as triggered once made: ``processed`` is "it has fired".)
    if finished_on_rld.processed and not (md_slot and md_slot.processed):
      # All tokens came from RLD; MD still ends the request (its radix cache).
      rld.release(slot)
      out.e2e_s, out.mode = env.now - req.arrival, "finished on RLD"
      yield transfer
      md_slot = md_slot or md.request()
      yield md_slot
      yield env.timeout(req.output_tokens / cfg.extend_tok_s)  # MD extends the outputs
      md.release(md_slot)
      out.relayed_tokens = req.output_tokens
      return
    # Tokens RLD has produced: one per tpot since it started (the first at started
    # + tpot, before this point); the epsilon keeps an exact multiple from rounding down.
    generated = min(req.output_tokens, max(1, int((env.now - started) / cfg.tpot_s + 1e-9)))
    handoff_start = env.now
    try:
      extend = generated / cfg.extend_tok_s
      if catch_up:  # RLD keeps going while MD extends; MD resumes where RLD stops
        caught = min(req.output_tokens, generated + int(extend / cfg.tpot_s))
        yield env.timeout(extend * caught / max(generated, 1))
        rld.release(slot)
        generated = caught
      else:  # RLD stops at once; the stream waits for MD's extend
        rld.release(slot)
        yield env.timeout(extend)
      out.relayed_tokens = generated
      out.handoff_s = env.now - handoff_start
      yield env.timeout(cfg.tpot_s * (req.output_tokens - generated))
    finally:
      md.release(md_slot)
    out.e2e_s = env.now - req.arrival

  for req in trace:
    env.process(request(req))
  env.run()
  conn_level()
  horizon = max(trace[-1].arrival, 1e-9)
  # Over the window the WAN was in use (arrivals to the last transfer).
  stats = dict(conn_utilisation=busy["area"] / (max(busy["end"], 1e-9) * cfg.wan_connections),
               mean_conn_wait_s=float(np.mean([o.conn_wait_s for o in outcomes])),
               wan_bytes=sum(o.request.increment for o in outcomes) * cfg.kv_bytes_per_token,
               full_bytes=sum(o.request.input_tokens for o in outcomes) * cfg.kv_bytes_per_token,
               horizon_s=horizon)
  stats["wan_gbps_needed"] = stats["wan_bytes"] / horizon / GBPS
  stats["wan_gbps_needed_without_drc"] = stats["full_bytes"] / horizon / GBPS
  return outcomes, stats
