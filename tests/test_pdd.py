"""The PDD simulator (experiments/analysis/pdd_sim.py): the fair-share WAN link
against hand-computed completion times, the trace's increments against a brute-force
prefix match, and the system's accounting (what each request waits for)."""

import math

import numpy as np
import pytest
import simpy

from experiments.analysis import pdd_sim


@pytest.mark.parametrize("per_flow, want", [(None, (1.3, 1.1)), (40.0, (2.5, 1.25))])
def test_fair_link_shares_the_line_and_caps_each_flow(per_flow, want):
  env = simpy.Environment()
  link = pdd_sim.FairLink(env, 100.0, per_flow)
  done = {}

  def flow(name, start, nbytes):
    yield env.timeout(start)
    yield link.send(nbytes)
    done[name] = env.now

  env.process(flow("a", 0.0, 100.0))
  env.process(flow("b", 0.5, 30.0))
  env.run()
  assert math.isclose(done["a"], want[0]) and math.isclose(done["b"], want[1])


def test_trace_increments_are_what_a_prefix_match_finds(monkeypatch):
  seen, inside = [], []  # [prompt or None (a warm context), inserted sequence]
  real_match = pdd_sim.RadixCache.match_prefix
  real_insert = pdd_sim.RadixCache.insert

  def match(self, tokens):
    if not inside:  # insert matches too: not a request
      seen.append([list(tokens), None])
    return real_match(self, tokens)

  def insert(self, tokens, pages):
    if seen and seen[-1][1] is None:
      seen[-1][1] = list(tokens)
    else:
      seen.append([None, list(tokens)])
    inside.append(1)
    try:
      return real_insert(self, tokens, pages)
    finally:
      inside.pop()

  monkeypatch.setattr(pdd_sim.RadixCache, "match_prefix", match)
  monkeypatch.setattr(pdd_sim.RadixCache, "insert", insert)
  seed = int(np.random.default_rng().integers(1000))
  trace = pdd_sim.generate_trace(pdd_sim.TraceConfig(rate=20, duration=3, sessions=12,
                                                     mean_input=4096, seed=seed))
  chunk = 4096 // 256
  assert sum(p is not None for p, _ in seen) == len(trace)
  inserted, requests = [], iter(trace)
  for prompt, after in seen:  # brute force: the longest common prefix with any earlier
    if prompt is not None:
      req = next(requests)
      best = max((next((i for i, (a, b) in enumerate(zip(seq, prompt)) if a != b),
                       min(len(seq), len(prompt))) for seq in inserted), default=0)
      assert req.cached_tokens == best * chunk and req.input_tokens == len(prompt) * chunk
    inserted.append(after)


@pytest.mark.parametrize("distribution", ["skewed", "narrow"])
def test_trace_hit_distributions_have_the_papers_shape(distribution):
  trace = pdd_sim.generate_trace(pdd_sim.TraceConfig(distribution=distribution, rate=40,
                                                     duration=20, mean_input=4096))
  hits = np.array([r.cached_tokens / r.input_tokens for r in trace])
  assert 0.85 <= hits.mean() <= 0.95
  if distribution == "skewed":  # 70-80% of requests >= 95%, a low tail
    assert 0.70 <= (hits >= 0.95).mean() <= 0.80 and np.percentile(hits, 5) < 0.6
  else:  # 85-95%
    assert ((hits > 0.8) & (hits < 0.97)).mean() > 0.9
  # Outputs: 30% under 100 tokens, 40% more under 500 (PDD's production trace).
  outputs = np.array([r.output_tokens for r in trace])
  assert abs((outputs < 100).mean() - 0.3) < 0.04 and abs((outputs < 500).mean() - 0.7) < 0.04


def test_a_mean_input_the_system_prompt_fills_is_refused():
  """At a mean input of 1024 tokens every context was the 2048-token system prompt
  alone: increments 0, every request a full hit, zero transfer (no error)."""
  with pytest.raises(ValueError, match="system prompt"):
    pdd_sim.generate_trace(pdd_sim.TraceConfig(mean_input=1024, duration=2))
  trace = pdd_sim.generate_trace(pdd_sim.TraceConfig(mean_input=3072, duration=2))
  assert np.mean([r.cached_tokens < r.input_tokens for r in trace]) > 0.5


def test_system_accounting():
  trace = pdd_sim.generate_trace(pdd_sim.TraceConfig(rate=20, duration=5, mean_input=16384))
  cfg = pdd_sim.SystemConfig(wan_gbps=2.0, ttft_budget_s=0.5)
  pd, stats = pdd_sim.simulate(trace, pdd_sim.SystemConfig(**{**cfg.__dict__, "relay": False}))
  pdd, _ = pdd_sim.simulate(trace, cfg)
  for o in pd:  # conventional: prefill, then the WAN transfer, then a decode step
    r = o.request
    floor = r.increment / cfg.prefill_tok_s + o.transfer_s + cfg.tpot_s
    assert not o.relayed and o.ttft_s >= floor - 1e-9
    assert o.e2e_s >= o.ttft_s + cfg.tpot_s * (r.output_tokens - 1) - 1e-9
  assert stats["wan_bytes"] == sum(r.increment for r in trace) * cfg.kv_bytes_per_token
  relayed = [o for o in pdd if o.relayed]
  assert relayed and len(relayed) < len(pdd)
  by_arrival = {o.request.arrival: o for o in pd}
  for o in relayed:  # relayed: the first token does not wait for the WAN
    assert o.ttft_s < by_arrival[o.request.arrival].ttft_s
    assert 0 < o.relayed_tokens <= o.request.output_tokens
  assert {o.mode for o in relayed} <= {"catch-up", "one-shot", "finished on RLD"}


def test_a_relayed_request_hands_off_the_tokens_rld_produced():
  """One request, relayed (its WAN transfer estimate exceeds the budget), One-Shot:
  RLD starts after the RDMA copy, makes a token every tpot, and the WAN lands at
  0.24 s, after two of them (0.1102 s, 0.2102 s): the handoff carries 2 tokens."""
  req = pdd_sim.TraceRequest(arrival=0.0, session=0, input_tokens=10_000,
                             cached_tokens=0, output_tokens=50)
  cfg = pdd_sim.SystemConfig(kv_bytes_per_token=1000, wan_gbps=0.4, wan_rtt_s=0.03,
                             rdma_gbps=400.0, prefill_tok_s=1e6, tpot_s=0.1,
                             ttft_budget_s=0.1, catch_up_below=0.0)
  (out,), _ = pdd_sim.simulate([req], cfg)
  assert out.relayed and out.mode == "one-shot"
  assert out.ttft_s == pytest.approx(0.01 + 10e6 / 50e9 + 0.1)
  assert out.relayed_tokens == 2


def _one_md_slot_cfg(**kw):
  """One MD slot, One-Shot handoffs, a 50 MB/s WAN (tokens of 1 kB)."""
  return pdd_sim.SystemConfig(**{**dict(
      kv_bytes_per_token=1000, wan_gbps=0.4, wan_rtt_s=0.03, rdma_gbps=400.0,
      prefill_tok_s=1e6, tpot_s=0.1, ttft_budget_s=0.1, catch_up_below=0.0,
      md_slots=1), **kw})


@pytest.mark.parametrize("output_tokens", [50, 8])
def test_rld_decodes_on_while_mds_slot_is_taken(output_tokens):
  """A holds MD's only slot until 1.03021 s (its 10-token increment lands at
  0.03021 s, then 10 tokens of 0.1 s). B (arrival 0.05 s) is relayed: prefill
  0.01 s, RDMA 0.2 ms, RLD decoding from 0.0602 s; its WAN lands at 0.29 s, but MD
  is busy: RLD decodes on. With 50 tokens the handoff starts at 1.03021 s with
  floor(9.7) = 9 tokens (One-Shot: extend 9 / 300 s, then 41 tokens on MD); with 8
  tokens RLD finishes at 0.8602 s, before MD frees: finished on RLD. (The old
  accounting handed off 2 tokens at the WAN's landing and kept B waiting.)"""
  cfg = _one_md_slot_cfg()
  a = pdd_sim.TraceRequest(arrival=0.0, session=0, input_tokens=1000, cached_tokens=990,
                           output_tokens=10)
  b = pdd_sim.TraceRequest(arrival=0.05, session=1, input_tokens=10_000,
                           cached_tokens=0, output_tokens=output_tokens)
  (out_a, out_b), _ = pdd_sim.simulate([a, b], cfg)
  assert not out_a.relayed and out_b.relayed
  assert out_a.e2e_s == pytest.approx(1e-5 + 0.03 + 1e4 / 50e6 + 1.0)
  started = 0.05 + 0.01 + 1e7 / 50e9
  md_free = 1e-5 + 0.03 + 1e4 / 50e6 + 1.0
  if output_tokens == 8:
    assert out_b.mode == "finished on RLD" and out_b.relayed_tokens == 8
    assert out_b.e2e_s == pytest.approx(started + 0.8 - 0.05)
    return
  assert out_b.mode == "one-shot" and out_b.relayed_tokens == 9
  assert out_b.handoff_s == pytest.approx(9 / 300)
  assert out_b.e2e_s == pytest.approx(md_free + 9 / 300 + 41 * 0.1 - 0.05)


def test_the_relay_estimate_counts_the_bytes_queued_ahead():
  """One WAN connection. X (20 MB) holds it from t = 0.02 s (after its prefill);
  Y (30 MB) queues for it from 0.031 s; Z (1 MB, ready at 0.051 s) would take
  0.05 s on a free line, but the line must first move the ~50 MB ahead of it
  (~1 s at 50 MB/s): Z is relayed. (The old estimate charged the queue Z's own
  1 MB per queued transfer: 0.07 s, not relayed.) With 16 connections Z shares
  the line with X only (0.07 s): not relayed."""
  trace = [pdd_sim.TraceRequest(arrival=t, session=i, input_tokens=n, cached_tokens=0,
                                output_tokens=5)
           for i, (t, n) in enumerate([(0.0, 20_000), (0.001, 30_000), (0.05, 1_000)])]
  one, _ = pdd_sim.simulate(trace, _one_md_slot_cfg(wan_connections=1, md_slots=8,
                                                    rld_slots=8))
  assert one[2].relayed and one[2].transfer_s > 0.9
  many, _ = pdd_sim.simulate(trace, _one_md_slot_cfg(wan_connections=16, md_slots=8,
                                                     rld_slots=8))
  assert not many[2].relayed


def test_the_relay_estimate_waits_for_the_first_connection_to_free():
  """Two connections, a 0.5 s budget. X (10 MB, on the line from 0.04 s) and Y
  (100 MB, from 0.131 s) hold both when Z (1 MB) is ready at 0.301 s; X has ~1.2 MB
  left at 25 MB/s: a connection frees in ~0.05 s and Z's transfer takes ~0.12 s,
  so Z is not relayed (waiting for all ~97 MB on the line read 2 s: relayed)."""
  trace = [pdd_sim.TraceRequest(arrival=t, session=i, input_tokens=n, cached_tokens=0,
                                output_tokens=5)
           for i, (t, n) in enumerate([(0.0, 10_000), (0.001, 100_000), (0.3, 1_000)])]
  out, _ = pdd_sim.simulate(trace, _one_md_slot_cfg(wan_connections=2, md_slots=8,
                                                    rld_slots=8, ttft_budget_s=0.5))
  assert not out[2].relayed and out[2].transfer_s < 0.5


def test_the_relay_estimate_counts_a_connection_held_through_its_round_trip():
  """One connection, taken by X (20 MB) at 0.02 s, in its 30 ms round trip until
  0.05 s, its bytes not on the line yet. Z (1 MB) is ready at 0.031 s and must
  wait ~0.4 s for X: it is relayed (counting only the bytes on the line, the
  estimate read 0.05 s)."""
  trace = [pdd_sim.TraceRequest(arrival=t, session=i, input_tokens=n, cached_tokens=0,
                                output_tokens=5)
           for i, (t, n) in enumerate([(0.0, 20_000), (0.03, 1_000)])]
  out, _ = pdd_sim.simulate(trace, _one_md_slot_cfg(wan_connections=1, md_slots=8,
                                                    rld_slots=8))
  assert out[1].relayed and out[1].transfer_s > 0.4
