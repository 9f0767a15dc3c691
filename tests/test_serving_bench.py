"""Load generation and serving metrics (kvtier_jax/serving/bench.py) on the numpy
``FakeModel``, with a step clock: every engine step takes one second, so send
times, arrivals and latencies are exact numbers the test can derive itself."""

import dataclasses

import numpy as np
import pytest

from kvtier_jax.serving import Engine, EngineConfig, SamplingParams, State
from kvtier_jax.serving import bench
from kvtier_jax.serving.request import Metrics, Request
from tests.test_serving import VOCAB, FakeModel, solo


class StepClock:
  """Engine time: +1 s per step; ``sleep`` jumps ahead."""

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t

  def on_step(self, row):
    self.t += 1.0

  def sleep(self, seconds):
    self.t += max(seconds, 1e-3)


def engine_with_clock(model=None, **config):
  clock = StepClock()
  engine = Engine(model or FakeModel(), EngineConfig(**config), clock=clock,
                  on_step=clock.on_step)
  return engine, clock


def specs(rng, num, arrivals=None):
  out = []
  for i in range(num):
    prompt = tuple(rng.integers(0, VOCAB - 1, int(rng.integers(3, 30))).tolist())
    out.append(bench.RequestSpec(f"q{i}", prompt, int(rng.integers(2, 12)),
                                 0.0 if arrivals is None else float(arrivals[i])))
  return out


def test_arrival_times_follow_the_gamma_process():
  assert (bench.arrival_times(5, float("inf")) == 0).all()
  rng = np.random.default_rng()
  n, rate = 20000, 4.0
  for burstiness in (1.0, 0.25, 4.0):
    times = bench.arrival_times(n, rate, burstiness, rng)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all()
    # Gamma(shape b, scale 1/(rate b)): mean 1/rate, coefficient of variation 1/sqrt(b).
    sd_of_mean = (1 / rate) / np.sqrt(burstiness) / np.sqrt(n)
    assert abs(gaps.mean() - 1 / rate) < 5 * sd_of_mean
    cv = gaps.std() / gaps.mean()
    assert abs(cv - 1 / np.sqrt(burstiness)) < 0.1 / np.sqrt(burstiness)
  for bad in (0.0, -1.0):
    with pytest.raises(ValueError, match="rate"):
      bench.arrival_times(3, bad)


def test_closed_loop_keeps_n_outstanding_and_sends_when_one_ends():
  rng = np.random.default_rng()
  engine, clock = engine_with_clock()
  workload = specs(rng, 7)
  served = bench.drive(engine, workload, max_concurrency=2, sleep=clock.sleep)
  assert [r.id for r in served.requests] == [w.id for w in workload]
  assert all(s["running"] + s["waiting"] <= 2 for s in served.steps)
  reqs = served.requests
  assert all(r.state is State.FINISHED for r in reqs)
  # The first two arrive at once; each later one when the k-th earlier one ended.
  finishes = sorted(r.metrics.finished for r in reqs)
  assert [r.metrics.arrival for r in reqs] == [0.0, 0.0] + finishes[:5]
  for r, w in zip(reqs, workload):
    assert r.output == solo(FakeModel, list(w.prompt), w.max_new_tokens)


class Allocating:
  """A state leaf still being computed on the device: the first wait takes
  ``seconds`` on ``clock``."""

  def __init__(self, clock, seconds=7.0):
    self.clock, self.seconds, self.pending = clock, seconds, True

  def block_until_ready(self):
    if self.pending:
      self.clock.t += self.seconds
      self.pending = False
    return self


def test_the_engines_own_allocation_is_not_the_workloads_time():
  """A new engine's state may still be building when the drive starts (the tiered
  host pool: seconds at a large budget); its first step would wait for it. The
  drive waits first: latencies and duration are those of an engine built long
  before."""
  rng = np.random.default_rng()
  work = specs(rng, 4, [0.0, 0.0, 1.5, 4.0])
  engine, clock = engine_with_clock()
  ready = bench.drive(engine, work, sleep=clock.sleep)

  class Building(FakeModel):
    def init(self):
      return dict(super().init(), building=Allocating(clock))

    def prefill(self, state, slot, tokens, start, count):
      state["building"].block_until_ready()  # as the device runs after the writes
      return super().prefill(state, slot, tokens, start, count)

  clock = StepClock()
  engine = Engine(Building(), EngineConfig(), clock=clock, on_step=clock.on_step)
  building = bench.drive(engine, work, sleep=clock.sleep)
  assert clock.t > 7.0 and building.start == 7.0
  assert building.end - building.start == ready.end - ready.start
  for got, want in zip(building.requests, ready.requests):
    assert got.output == want.output
    assert got.metrics.summary() == want.metrics.summary()  # latencies


def test_a_steps_seconds_are_its_own_device_time():
  """A prefill chunk's device work, which nothing reads back in its step (not the
  last chunk: no token sampled), is its step's seconds, not the next step's."""
  clock = StepClock()

  class Chunking(FakeModel):
    def prefill(self, state, slot, tokens, start, count):
      state, logits = super().prefill(state, slot, tokens, start, count)
      return dict(state, chunk=Allocating(clock, 3.0)), logits

  rows = []
  def on_step(row):
    rows.append(row)
    clock.on_step(row)

  engine = Engine(Chunking(chunk_size=8), EngineConfig(max_step_tokens=8), clock=clock,
                  on_step=on_step)
  engine.submit(list(range(1, 40)), 3)
  engine.run()
  assert [row["seconds"] for row in rows] == [3.0 * (row["prefill_tokens"] > 0)
                                              for row in rows]
  assert sum(row["prefill_tokens"] > 0 for row in rows) == 5


def test_open_loop_arrivals_keep_their_due_time():
  rng = np.random.default_rng()
  engine, clock = engine_with_clock()
  arrivals = [0.0, 0.0, 2.5, 9.0, 30.0]
  served = bench.drive(engine, specs(rng, 5, arrivals), sleep=clock.sleep)
  for req, due in zip(served.requests, arrivals):
    assert req.metrics.arrival == due  # even when submitted after a step that ran past it
    assert req.metrics.admitted >= due and req.state is State.FINISHED
  assert served.requests[-1].metrics.admitted < 31.0  # the idle engine waited, then ran it


def test_rollout_turns_continue_the_trajectory_after_the_environment():
  rng = np.random.default_rng()
  engine, clock = engine_with_clock()
  rollouts = [bench.Rollout(f"traj{i}", tuple(rng.integers(0, VOCAB - 1, 6).tolist()),
                            (4, 3, 5), ((7, 8), (9,)), arrival_s=float(i), env_seconds=3.0)
              for i in range(2)]
  served = bench.drive(engine, rollouts, sleep=clock.sleep)
  by_id = {r.id: r for r in served.requests}
  assert set(by_id) == {f"traj{i}/t{t}" for i in range(2) for t in range(3)}
  for roll in rollouts:
    turns = [by_id[f"{roll.id}/t{t}"] for t in range(3)]
    assert turns[0].prompt == list(roll.prompt)
    for t in (1, 2):
      prev = turns[t - 1]
      assert turns[t].prompt == prev.prompt + prev.output + list(roll.env_tokens[t - 1])
      assert turns[t].metrics.arrival == prev.metrics.finished + roll.env_seconds
    for turn, new in zip(turns, roll.max_new_tokens):
      assert turn.state is State.FINISHED
      assert turn.output == solo(FakeModel, turn.prompt, new)
  with pytest.raises(ValueError, match="environment turns"):
    bench.Rollout("x", (1,), (2, 2), ())


def test_a_rollout_turn_that_outgrows_the_engine_ends_its_rollout_only():
  """FakeModel holds 96 positions: the long trajectory's third turn (30 + 10 + 20 +
  10 + 20 + 10 = 100) is refused and ends it; the short one runs all its turns."""
  rng = np.random.default_rng()
  engine, clock = engine_with_clock()
  draw = lambda n: tuple(rng.integers(0, VOCAB - 1, n).tolist())
  rollouts = [bench.Rollout("long", draw(30), (10, 10, 10), (draw(20), draw(20))),
              bench.Rollout("short", draw(6), (4, 3, 5), ((7, 8), (9,)))]
  served = bench.drive(engine, rollouts, sleep=clock.sleep)
  assert sorted(r.id for r in served.requests) == [
      "long/t0", "long/t1", "short/t0", "short/t1", "short/t2"]
  assert all(r.state is State.FINISHED for r in served.requests)
  assert [rid for rid, _ in served.refused] == ["long/t2"]
  assert "exceeds the context of 96" in served.refused[0][1]
  assert bench.summarize(served)["refused"] == 1
  with pytest.raises(ValueError):  # a first request that cannot fit is bad input
    bench.drive(engine_with_clock()[0], [bench.RequestSpec("big", draw(100), 4)])


def test_a_refused_turn_in_a_closed_loop_gives_its_slot_back():
  """Closed loop of 1: a rollout's refused turn took the free slot's time and never
  gave it back, so the next request found no slot (an IndexError ended the run)."""
  rng = np.random.default_rng()
  engine, clock = engine_with_clock()
  draw = lambda n: tuple(rng.integers(0, VOCAB - 1, n).tolist())
  work = [bench.Rollout("r", draw(40), (10, 4), (draw(60),)),  # turn 1: 110 > 96
          bench.RequestSpec("q", draw(10), 4, arrival_s=100.0)]
  served = bench.drive(engine, work, max_concurrency=1, sleep=clock.sleep)
  assert [(r.id, r.state) for r in served.requests] == [("r/t0", State.FINISHED),
                                                         ("q", State.FINISHED)]
  assert [rid for rid, _ in served.refused] == ["r/t1"]
  assert served.requests[1].metrics.arrival == 100.0


def test_a_resumed_closed_loop_sends_when_the_uninterrupted_one_does(tmp_path):
  """Closed loop of 2, stopped when the first request ends and restored: the
  restored request in flight holds its slot, so the rest arrive (and time their
  TTFT from) when the uninterrupted run sent them, not at time 0."""
  from kvtier_jax.serving import snapshot
  rng = np.random.default_rng()
  work = [bench.RequestSpec(f"q{i}", tuple(rng.integers(0, VOCAB - 1, 20).tolist()),
                            3 if i == 0 else int(rng.integers(6, 10))) for i in range(5)]
  engine, clock = engine_with_clock()
  whole = bench.drive(engine, work, max_concurrency=2, sleep=clock.sleep)
  want = {r.id: r.metrics.arrival for r in whole.requests}
  engine, clock = engine_with_clock()
  bench.drive(engine, work, max_concurrency=2, sleep=clock.sleep,
              until=lambda: engine.requests["q0"].state.done)
  assert {r.state.done for r in engine.requests.values()} == {True, False}
  snapshot.save(engine, tmp_path / "snap")
  clock = StepClock()
  back = snapshot.restore(tmp_path / "snap", FakeModel(), EngineConfig(), clock=clock,
                          on_step=clock.on_step)
  served = bench.drive(back, work, max_concurrency=2, sleep=clock.sleep, resume=True)
  assert {r.id: r.metrics.arrival for r in served.requests} == want
  assert max(s["running"] + s["waiting"] for s in served.steps) <= 2


def hand_request(rid, prompt_len, arrival, token_times, state=State.FINISHED):
  req = Request(rid, [1] * prompt_len, len(token_times), SamplingParams(), frozenset(),
                Metrics(arrival))
  req.output = [2] * len(token_times)
  req.metrics.first_token = token_times[0] if token_times else None
  req.metrics.token_times = list(token_times)
  req.metrics.finished = token_times[-1] if token_times else arrival
  req.state = state
  return req


def test_summary_metrics_from_their_definitions():
  reqs = [hand_request("a", 10, 0.0, [1.0, 1.5, 2.0]),  # TTFT 1, TPOT 0.5, ITL .5 .5
          hand_request("b", 20, 0.0, [2.0, 2.2]),  # TTFT 2, TPOT 0.2
          hand_request("c", 30, 1.0, [4.0, 5.0, 7.0, 8.0]),  # TTFT 3, TPOT 4/3, ITL 1 2 1
          hand_request("d", 40, 1.0, [], State.ABORTED)]
  # End-of-step counts one lower than the step's peaks: the peaks are what counts.
  steps = [dict(peak_running=r, peak_device_bytes=b, peak_host_pages=p, running=r - 1,
                device_bytes_in_use=b // 2, host_pages_in_use=p - 1, misses=m,
                decode_batch=d, new_tokens=n, prefill_tokens=f, seconds=t)
           for r, b, p, m, d, n, f, t in [(2, 2**20, 4, 1, 2, 2, 0, 0.5),
                                          (3, 3 * 2**20, 9, 2, 3, 3, 8, 1.0),
                                          (1, 2**19, 2, 0, 2, 1, 0, 0.25)]]
  row = bench.summarize(bench.Served(reqs, steps, 0.0, 10.0), host_page_bytes=2**18,
                        slo_ttft_s=2.5, slo_tpot_s=1.0)
  ttft = np.array([1.0, 2.0, 3.0]) * 1e3
  itl = np.array([0.5, 0.5, 0.2, 1.0, 2.0, 1.0]) * 1e3
  assert row["requests"] == 4 and row["finished"] == 3 and row["failed"] == 0
  assert row["output_tokens"] == 9 and row["prompt_tokens"] == 60
  assert row["request_throughput"] == pytest.approx(0.3)
  assert row["output_throughput"] == pytest.approx(0.9)
  assert row["total_token_throughput"] == pytest.approx(6.9)
  assert row["goodput"] == pytest.approx(0.2)  # a and b meet both SLOs; c misses both
  # No SLO given: every request would be "good"; no goodput is reported.
  assert bench.summarize(bench.Served(reqs, steps, 0.0, 10.0))["goodput"] is None
  # A TPOT SLO alone: a and b meet it; a one-token request has no TPOT and meets it.
  assert bench.summarize(bench.Served(reqs, steps, 0.0, 10.0),
                         slo_tpot_s=1.0)["goodput"] == pytest.approx(0.2)
  single = [hand_request("e", 10, 0.0, [1.0])]
  assert bench.summarize(bench.Served(single, [], 0.0, 4.0),
                         slo_tpot_s=0.1)["goodput"] == pytest.approx(0.25)
  # Prefix hits count the admitted requests: one never admitted adds no prompt.
  for req, cached in zip(reqs, (4, 0, 10, None)):
    req.metrics.cached_tokens = cached
  assert bench.first_admission_tokens(reqs) == (60, 14)
  assert row["peak_concurrency"] == 3 and row["misses"] == 3
  # The steps without a chunk; the last decoded 2 but one was a replayed output.
  assert row["decode_throughput"] == pytest.approx(3 / 0.75)
  assert row["mean_decode_batch"] == pytest.approx(2.0)
  assert row["peak_device_mib"] == pytest.approx(3.0)
  assert row["peak_host_mib"] == pytest.approx(9 / 4)
  assert row["ttft_mean_ms"] == pytest.approx(2000) and row["ttft_median_ms"] == 2000
  assert row["ttft_p90_ms"] == pytest.approx(np.percentile(ttft, 90))
  assert row["tpot_median_ms"] == pytest.approx(500)
  assert row["itl_p99_ms"] == pytest.approx(np.percentile(itl, 99))
  assert row["e2e_mean_ms"] == pytest.approx(np.mean([2.0, 2.2, 7.0]) * 1e3)


def test_a_requests_summary_from_its_times():
  """The per-request row the serve runners write: each latency from its definition
  (times exact in binary), and None where the request never got that far."""
  rng = np.random.default_rng()
  arrival, admitted, first, *gaps = np.cumsum(rng.integers(1, 9, 5)) / 4
  times = [first, first + gaps[0], first + gaps[0] + gaps[1]]
  metrics = Metrics(arrival=arrival, admitted=admitted, first_token=first,
                    token_times=times, finished=times[-1] + 0.25, preemptions=1,
                    cached_tokens=8)
  assert metrics.summary() == dict(
      queue_s=admitted - arrival, ttft_s=first - arrival, tpot_s=(times[2] - times[0]) / 2,
      itl_s=[times[1] - times[0], times[2] - times[1]], e2e_s=times[-1] + 0.25 - arrival,
      preemptions=1, cached_tokens=8)
  assert Metrics(arrival=arrival).summary() == dict(
      queue_s=None, ttft_s=None, tpot_s=None, itl_s=[], e2e_s=None, preemptions=0,
      cached_tokens=None)


def test_blocking_prefill_stalls_decode_and_tokens_stay_exact():
  rng = np.random.default_rng()
  workload = specs(rng, 6)
  workload[0] = dataclasses.replace(workload[0], prompt=workload[0].prompt * 2 + (5,) * 25)
  outputs = {}
  for policy in ("decode_first", "blocking"):
    # Host pages for three requests at their longest (24 pages each): no preemption,
    # so each prompt is prefilled once.
    engine, clock = engine_with_clock(FakeModel(num_slots=3, num_host_pages=72),
                                      max_step_tokens=12, prefill_policy=policy)
    served = bench.drive(engine, workload, sleep=clock.sleep)
    both = [s for s in served.steps if s["decode_batch"] and s["prefill_tokens"]]
    if policy == "blocking":
      assert not both  # a step prefills a whole prompt or decodes, never both
      # ... past the step budget (12): the first prompt is 31 tokens or more.
      assert sorted(s["prefill_tokens"] for s in served.steps if s["prefill_tokens"]) == \
          sorted(len(w.prompt) for w in workload)
      assert not any(r.metrics.preemptions for r in served.requests)
    else:
      assert both
    outputs[policy] = [r.output for r in served.requests]
  assert outputs["blocking"] == outputs["decode_first"]
  assert outputs["blocking"] == [solo(FakeModel, list(w.prompt), w.max_new_tokens)
                                 for w in workload]
  with pytest.raises(ValueError, match="prefill_policy"):
    EngineConfig(prefill_policy="eager")


def test_peaks_are_what_a_step_held_before_its_requests_let_go():
  """One- and two-token requests end in the step that admits them, so the counts at
  the end of a step miss them. The peaks must equal the brute-force maximum over
  steps of the requests (and their device charges) admitted by then and not ended
  before it, and the host pages any step's slots held."""
  rng = np.random.default_rng()
  model = FakeModel(num_slots=3)
  engine, clock = engine_with_clock(model, max_step_tokens=16)
  held = []
  engine._on_step = lambda row: (held.append(engine.pool.in_use), clock.on_step(row))
  # The last request takes one token: 1,1,1,1,1,2 (1 draw in 64) overlapped nothing,
  # peak_concurrency == ends, and the check below failed on it (16 in 1000 draws).
  work = [bench.RequestSpec(f"q{i}", tuple(rng.integers(0, VOCAB - 1, 14).tolist()),
                            int(rng.integers(1, 3)) if i < 5 else 1) for i in range(6)]
  served = bench.drive(engine, work, sleep=clock.sleep)
  row = bench.summarize(served, host_page_bytes=model.host_page_bytes)
  reqs = served.requests
  assert all(r.state is State.FINISHED for r in reqs)
  at = lambda s: [r for r in reqs if r.metrics.admitted <= s <= r.metrics.finished]
  times = sorted({r.metrics.admitted for r in reqs})
  ends = max(s["running"] for s in served.steps)
  assert row["peak_concurrency"] == max(len(at(s)) for s in times) > ends
  charge = lambda r: model.device_bytes(len(r.prompt) + r.max_new_tokens)
  assert row["peak_device_mib"] * 2**20 == max(sum(map(charge, at(s))) for s in times)
  # Pages: every live request holds ceil(prompt / page) at least (14 > hot_slots).
  least = max(sum(-(-len(r.prompt) // model.page_size) for r in at(s)) for s in times)
  assert row["peak_host_mib"] * 2**20 / model.host_page_bytes >= least > max(held)


def test_decode_throughput_counts_new_tokens_not_replays():
  """Under page pressure preempted requests replay their outputs through decode
  steps: those steps' batches count them, the new-token count does not. Every
  output token is counted once, at the step that sampled it."""
  rng = np.random.default_rng()
  engine, clock = engine_with_clock(FakeModel(num_host_pages=24), max_step_tokens=20)
  work = [bench.RequestSpec(f"q{i}", tuple(rng.integers(0, VOCAB - 1,
                                                        int(rng.integers(20, 45))).tolist()),
                            int(rng.integers(10, 30))) for i in range(30)]
  served = bench.drive(engine, work, sleep=clock.sleep)
  outputs = sum(len(r.output) for r in served.requests)
  assert sum(r.metrics.preemptions for r in served.requests) > 0, "no page pressure"
  assert sum(s["new_tokens"] for s in served.steps) == outputs
  first_tokens = sum(r.metrics.first_token is not None for r in served.requests)
  assert sum(s["decode_batch"] for s in served.steps) > outputs - first_tokens


def test_tokens_a_request_made_before_it_was_handed_off_count_on_the_sender():
  """A request decodes some tokens on one engine and moves to another: the sender's
  summary counts the tokens it made (it counted none, and the receiver leaves them
  out as relayed: nobody counted them), the receiver's the rest."""
  rng = np.random.default_rng()
  relayed, new = int(rng.integers(1, 6)), 10
  sender, receiver = Engine(FakeModel()), Engine(FakeModel())
  start = sender.now()
  req = sender.submit(list(range(1, 20)), new)
  while len(req.output) < relayed:
    sender.step()
  moved = receiver.accept(sender.export(req.id, kv="none"))
  sent = bench.summarize(bench.Served([req], [], start, sender.now()))
  receiver.run()
  got = bench.summarize(bench.Served([moved], [], start, receiver.now()))
  assert (sent["handed_off"], sent["output_tokens"]) == (1, relayed)
  assert (got["finished"], got["output_tokens"]) == (1, new - relayed)


def test_a_run_cut_short_counts_the_tokens_its_running_requests_made():
  """A deadline cut leaves requests running: their tokens were generated in the
  window (the throughput counted finished requests' only, so it moved with where
  the cut fell); failed ones stay out. A cut point is not compared with sparse."""
  reqs = [hand_request("a", 10, 0.0, [1.0, 2.0]),
          hand_request("b", 10, 0.0, [1.0, 2.0, 3.0], State.DECODING),
          hand_request("c", 10, 0.0, [1.0], State.FAILED)]
  reqs.append(hand_request("d", 10, 0.0, [], State.PREFILLING))  # no token yet
  row = bench.summarize(bench.Served(reqs, [], 0.0, 4.0))
  assert row["finished"] == 1 and row["unfinished"] == 2 and row["output_tokens"] == 5
  assert row["output_throughput"] == pytest.approx(5 / 4)
  # The prompts beside those tokens: a's and b's (b's were left out), not d's.
  assert row["total_token_throughput"] == pytest.approx((20 + 5) / 4)
  rows = [dict(context=1, concurrency=1, cache=c, prefill_policy="p", cut=cut,
               output_throughput=2.0, decode_throughput=2.0)
          for c, cut in (("sparse", False), ("tiered", True))]
  bench.compare_with_sparse(rows, [{}, {}])
  assert rows[0]["vs_sparse"] == 1.0 and rows[1]["vs_sparse"] is None
  # The sparse run cut short: nothing at the point compares with it.
  rows = [dict(context=1, concurrency=1, cache=c, prefill_policy="p", cut=cut,
               output_throughput=2.0, decode_throughput=2.0)
          for c, cut in (("sparse", True), ("tiered", False))]
  bench.compare_with_sparse(rows, [{}, {}])
  assert rows[0]["vs_sparse"] is None and rows[1]["vs_sparse"] is None


def test_sweep_ratios_compare_with_the_sparse_run_of_the_same_prefill_policy():
  rows = [dict(context=1024, concurrency=8, cache=cache, prefill_policy=policy,
               output_throughput=tput, decode_throughput=tput)
          for cache, policy, tput in (("sparse", "decode_first", 4.0),
                                      ("tiered", "decode_first", 2.0),
                                      ("sparse", "blocking", 1.0),
                                      ("tiered", "blocking", 3.0))]
  bench.compare_with_sparse(rows, [{} for _ in rows])
  assert [r["vs_sparse"] for r in rows] == [1.0, 0.5, 1.0, 3.0]
  assert [r["decode_vs_sparse"] for r in rows] == [1.0, 0.5, 1.0, 3.0]
  # No sparse run at a point: nothing to compare with (dense is not the reference).
  rows = [dict(context=1, concurrency=1, cache=cache, prefill_policy="p",
               output_throughput=2.0, decode_throughput=2.0) for cache in ("dense", "tiered")]
  bench.compare_with_sparse(rows, [{"r": [1, 2]}, {"r": [1, 2]}])
  assert all("same_tokens" not in r and "vs_sparse" not in r for r in rows)


def test_decode_logits_among_records_the_requests_rows_and_sends_the_others_at_their_steps():
  """``bench.decode_logits_among`` (the batch-invariance harness): the rows are the
  request's own decode logits (FakeModel's hash of its sequence so far: a row of
  another slot, a missed step or an extra one differs), each other request is sent
  once the engine has taken its step count, and the model's decode is put back."""
  rng = np.random.default_rng()
  model = FakeModel()
  engine = Engine(model, EngineConfig())
  first, target_spec = specs(rng, 2)
  others = bench.random_others(rng, 3, VOCAB - 1, (3, 30), (2, 12))  # no POISON token
  # Sent ahead, so the request lands in slot 1, and a prompt of several chunks, so
  # it sits in its slot through steps that decode the first request only.
  engine.submit(first.prompt, 12, request_id=first.id)
  target_spec = dataclasses.replace(target_spec, prompt=tuple(
      rng.integers(0, VOCAB - 1, 5 * model.chunk_size).tolist()))
  sent_at, submit = {}, engine.submit

  def recording_submit(*args, request_id=None, **kwargs):
    sent_at[request_id] = engine.steps
    return submit(*args, request_id=request_id, **kwargs)

  engine.submit = recording_submit
  target, rows = bench.decode_logits_among(engine, target_spec, others)
  assert sent_at == {target_spec.id: 0, **{spec.id: at for at, spec in others}}
  assert target.state is State.FINISHED and target.slot is None
  sequence = list(target_spec.prompt) + target.output
  want = [model._logits(sequence[:len(target_spec.prompt) + i])
          for i in range(1, len(target.output))]
  np.testing.assert_array_equal(rows, np.stack(want))
  assert model.decode.__func__ is FakeModel.decode


def test_arrival_times_of_no_requests():
  assert bench.arrival_times(0, 2.0).shape == (0,)



def test_prefix_hit_counts_each_request_once():
  """A preempted request is admitted again and then hits its own cached prompt:
  the prompt and cached tokens ``experiments.serve`` reports count each request at
  its first admission (``first_admission_tokens``), as ``summarize`` does, not
  every admission as the engine's counters do."""
  from tests.test_prefix_cache import shared_prefix_workload
  rng = np.random.default_rng()
  # 20 pages: a preemption in 300 of 300 draws (24 pages: 11 draws in 200 had none).
  engine, clock = engine_with_clock(FakeModel(num_host_pages=20), max_step_tokens=20,
                                    prefix_cache=True)
  work = [bench.RequestSpec(f"q{i}", tuple(p), new, sampling=sp)
          for i, (p, new, sp) in enumerate(shared_prefix_workload(rng, 30))]
  served = bench.drive(engine, work, sleep=clock.sleep)
  assert sum(r.metrics.preemptions for r in served.requests) > 0, "no preemption"
  assert all(r.state is State.FINISHED for r in served.requests)
  prompt, cached = bench.first_admission_tokens(served.requests)
  assert prompt == sum(len(r.prompt) for r in served.requests) < engine.prompt_tokens
  assert cached == sum(r.metrics.cached_tokens for r in served.requests)
  assert cached / prompt == pytest.approx(bench.summarize(served)["prefix_hit"])


def test_drive_stops_at_until_and_resumes_a_restored_engine(tmp_path):
  """Stopped after 5 steps (some requests done, some in flight, some not yet sent),
  saved and restored: ``resume`` waits for the restored requests, sends only the
  rest, each at its scheduled time, and every request ends with its solo tokens."""
  from kvtier_jax.serving import snapshot
  rng = np.random.default_rng()
  work = [bench.RequestSpec(f"q{i}", tuple(rng.integers(0, VOCAB - 1, 20).tolist()),
                            2 if i == 0 else 10 if i == 1 else int(rng.integers(2, 12)),
                            1.0 * i if i < 2 else 6.0 + 2.0 * i) for i in range(8)]
  engine, clock = engine_with_clock(FakeModel(num_host_pages=30), max_step_tokens=16)
  first = bench.drive(engine, work, sleep=clock.sleep,
                      until=lambda: engine.requests["q0"].state.done
                      and "q1" in engine.requests and engine.requests["q1"].output)
  states = {r.state for r in first.requests}
  assert State.FINISHED in states and len(first.requests) < len(work)
  # q1 is mid-decode: its tokens before the snapshot are the first run's.
  assert 0 < len(engine.requests["q1"].output) < 10
  assert any(not s.done for s in states)
  snapshot.save(engine, tmp_path / "snap")
  clock = StepClock()
  restored = snapshot.restore(tmp_path / "snap", FakeModel(num_host_pages=30),
                              EngineConfig(max_step_tokens=16), clock=clock,
                              on_step=clock.on_step)
  served = bench.drive(restored, work, sleep=clock.sleep, resume=True)
  by_id = {r.id: r for r in served.requests}
  assert sorted(by_id) == sorted(w.id for w in work)
  sent_before = {r.id for r in first.requests}
  for spec in work:
    req = by_id[spec.id]
    assert req.state is State.FINISHED, spec.id
    assert req.output == solo(FakeModel, list(spec.prompt), spec.max_new_tokens), spec.id
    if spec.id not in sent_before:
      assert req.metrics.arrival == spec.arrival_s, spec.id
  # The resumed run's row covers its own window: the requests not ended at the
  # restore, the tokens generated since, the time since.
  row, first_row = bench.summarize(served), bench.summarize(first)
  ended = {r.id for r in first.requests if r.state.done}
  assert {r.id for r in bench.window_requests(served)} == {w.id for w in work} - ended
  assert row["requests"] == len(work) - len(ended)
  assert row["finished"] == len(work) - len(ended)
  after = sum(len(by_id[s.id].output) for s in work) - sum(
      len(r.output) for r in first.requests)
  assert row["output_tokens"] == after
  assert first_row["output_tokens"] + row["output_tokens"] == sum(
      len(r.output) for r in served.requests)
  assert row["duration_s"] == pytest.approx(served.end - served.resumed_at)
  assert served.resumed_at == pytest.approx(first.end)
  # Prompts are the window's when first admitted in it: the two runs split them.
  before, since = bench.admitted_in_window(first), bench.admitted_in_window(served)
  assert {r.id for r in before} == {r.id for r in first.requests
                                    if r.metrics.admitted is not None}
  assert {r.id for r in before}.isdisjoint(r.id for r in since)
  assert {r.id for r in before} | {r.id for r in since} == {w.id for w in work}
  assert "q1" in {r.id for r in before} and since, (before, since)
  with pytest.raises(ValueError, match="rollouts"):
    bench.drive(restored, [bench.Rollout("r", (1, 2), (2, 2), ((3,),))], resume=True)
