"""The numbers the PDD, policies and prefetch runners report, recomputed from their
definitions: each runner runs in a subprocess that records what its simulator or
replay returned per request (or per step), and every reported field (percentiles,
shares, rates, the summary line, the table's columns) is recomputed here from those
records with numpy; the PDD simulator's relay trigger and RDMA copy against hand
timings; the learned key's labels and hand-made start against their formulas."""

import inspect
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from experiments.analysis import cache_sim, learned_policy, pdd_sim
from tests.test_experiments import only_run, run

GBPS = 1e9 / 8  # bytes/s in one Gbit/s


def _python(code, *args, timeout=600):
  """Runs ``code`` (a runner with recording wrappers) in its own process: each
  runner defines its own absl flags."""
  proc = subprocess.run([sys.executable, "-c", code, *map(str, args)],
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


# PDD ------------------------------------------------------------------------------

# experiments.pdd's main, every pdd_sim.simulate call recorded (config, trace,
# per-request outcomes), with the flag defaults and the WAN capacity it reports.
PDD_HARNESS = """
import dataclasses, json, sys
from absl import app, flags
from experiments import pdd
from experiments.analysis import pdd_sim
calls, real = [], pdd_sim.simulate

def simulate(trace, cfg):
  outcomes, stats = real(trace, cfg)
  calls.append(dict(cfg=dataclasses.asdict(cfg), stats=stats,
                    requests=[dataclasses.asdict(r) for r in trace],
                    outcomes=[dict(transfer_s=o.transfer_s, ttft_s=o.ttft_s,
                                   relayed=o.relayed, mode=o.mode, handoff_s=o.handoff_s)
                              for o in outcomes]))
  return outcomes, stats

pdd_sim.simulate = simulate

def main(argv):
  pdd.main(argv)
  names = ("wan_gbps", "wan_connections", "wan_flow_gbps")
  with open(sys.argv[1], "w") as f:
    json.dump(dict(calls=calls, capacity=pdd.wan_capacity_gbps(),
                   defaults={n: flags.FLAGS[n].default for n in names}), f)

app.run(main, argv=["pdd", *sys.argv[2:]])
"""

MICRO_INPUT, DURATION, RATE = 8192, 8.0, 80.0  # the run's flags (rate: its default)


def _hits(requests):
  return np.array([r["cached_tokens"] / r["input_tokens"] for r in requests])


def _narrow_seed_with_a_hit_of_exactly_95(rng):
  """A seed whose narrow microbenchmark trace has a request at exactly 95% hit (19
  of 20 chunks): the only ones ``>= 0.95`` and ``> 0.95`` disagree on."""
  for _ in range(40):
    seed = int(rng.integers(1 << 30))
    trace = pdd_sim.generate_trace(pdd_sim.TraceConfig(
        distribution="narrow", rate=RATE, duration=DURATION, mean_input=MICRO_INPUT,
        seed=seed))
    hits = np.array([r.cached_tokens / r.input_tokens for r in trace])
    if (hits == 0.95).any():
      return seed, trace
  raise AssertionError("no seed in 40 gave a narrow trace with a 95% hit")


@pytest.fixture(scope="module")
def pdd_run(tmp_path_factory):
  """One runner's records, on a seed whose narrow trace has an exact 95% hit and
  whose PDD run has both handoffs and requests that finished on RLD (the cases
  the reported shares and means tell apart)."""
  rng = np.random.default_rng()
  seeds = []
  for attempt in range(4):
    seed, narrow = _narrow_seed_with_a_hit_of_exactly_95(rng)
    seeds.append(seed)
    root = tmp_path_factory.mktemp(f"pdd{attempt}")
    out = _python(PDD_HARNESS, root / "calls.json", f"--micro_input={MICRO_INPUT}",
                  f"--duration={DURATION}", f"--seed={seed}", f"--out_root={root}")
    rec = json.loads((root / "calls.json").read_text())
    relayed = [o for o in rec["calls"][3]["outcomes"] if o["relayed"]]
    modes = [o["mode"] for o in relayed]
    if "finished on RLD" in modes and {"catch-up", "one-shot"} & set(modes):
      break
  else:
    raise AssertionError(f"seeds {seeds}: no PDD run with both kinds of relayed request")
  run_dir, rows = only_run(root, "pdd")
  return dict(seed=seed, narrow=narrow, out=out, rows=rows, rec=rec,
              table=(run_dir / "table.md").read_text())


def test_pdd_microbenchmark_rows_are_percentiles_of_the_simulated_transfers(pdd_run):
  """Each microbenchmark row reads the conventional system's (no relay) transfers of
  its own trace: P50 and P99 of them, the share of requests at >= 95% hit (one is
  at exactly 95% here), and the simulator's link statistics."""
  seed, calls = pdd_run["seed"], pdd_run["rec"]["calls"]
  micro = [r for r in pdd_run["rows"] if r["study"] == "microbenchmark"]
  assert [r["distribution"] for r in micro] == ["skewed", "narrow"], seed
  narrow_trace = [dict(arrival=r.arrival, session=r.session, input_tokens=r.input_tokens,
                       cached_tokens=r.cached_tokens, output_tokens=r.output_tokens)
                  for r in pdd_run["narrow"]]
  assert calls[1]["requests"] == narrow_trace, seed  # the flags' trace
  for row, call in zip(micro, calls[:2]):
    assert call["cfg"]["relay"] is False, seed
    transfer = np.array([o["transfer_s"] for o in call["outcomes"]])
    hits = _hits(call["requests"])
    assert row["requests"] == len(call["requests"]) == int(RATE * DURATION), seed
    assert row["transfer_p50_s"] == pytest.approx(np.percentile(transfer, 50),
                                                  rel=1e-12), seed
    assert row["transfer_p99_s"] == pytest.approx(np.percentile(transfer, 99),
                                                  rel=1e-12), seed
    assert row["mean_hit"] == pytest.approx(hits.mean(), rel=1e-12), seed
    assert row["share_hit_ge_95"] == pytest.approx((hits >= 0.95).mean(), rel=1e-12), seed
    assert row["conn_utilisation"] == call["stats"]["conn_utilisation"], seed
    assert row["mean_conn_wait_s"] == call["stats"]["mean_conn_wait_s"], seed
    assert row["wan_gbps_offered"] == call["stats"]["wan_gbps_needed"], seed
  # The last line quotes the same percentiles.
  last = pdd_run["out"].strip().splitlines()[-1]
  for name, call in zip(("skewed", "narrow"), calls[:2]):
    transfer = [o["transfer_s"] for o in call["outcomes"]]
    for q in (50, 99):
      assert f"{name}_p{q}={np.percentile(transfer, q):.3g} s" in last, (seed, last)


def test_pdd_ttft_rows_and_the_p90_cut(pdd_run):
  """The TTFT rows summarise each system's simulated requests: percentiles of their
  TTFTs, the share relayed (of all requests), counts per handoff mode, the mean
  handoff over real handoffs only (a request that finished on RLD had none), and
  the headline cut is P90's: 100 (1 - P90 PDD / P90 PD)."""
  seed, calls = pdd_run["seed"], pdd_run["rec"]["calls"]
  ttft_rows = [r for r in pdd_run["rows"] if r["study"] == "ttft"]
  assert [r["system"] for r in ttft_rows] == ["cross-DC PD", "PDD"], seed
  p90 = []
  for row, call, relay in zip(ttft_rows, calls[2:4], (False, True)):
    assert call["cfg"]["relay"] is relay, seed
    outcomes = call["outcomes"]
    ttft = np.array([o["ttft_s"] for o in outcomes])
    relayed = [o for o in outcomes if o["relayed"]]
    handoffs = [o["handoff_s"] for o in relayed if o["mode"] != "finished on RLD"]
    for q in (50, 90, 99):
      assert row[f"ttft_p{q}_s"] == pytest.approx(np.percentile(ttft, q), rel=1e-12), seed
    p90.append(np.percentile(ttft, 90))
    assert row["requests"] == len(outcomes), seed
    assert row["relayed"] == pytest.approx(len(relayed) / len(outcomes), rel=1e-12), seed
    for mode, key in (("catch-up", "catch_up"), ("one-shot", "one_shot"),
                      ("finished on RLD", "finished_on_rld")):
      assert row[key] == sum(o["mode"] == mode for o in relayed), seed
    assert row["mean_hit"] == pytest.approx(_hits(call["requests"]).mean(), rel=1e-12)
    if relay:  # relayed requests of both kinds: the filter matters
      assert 0 < len(relayed) < len(outcomes) and handoffs, seed
      assert all(h > 0 for h in handoffs), seed
      assert row["mean_handoff_s"] == pytest.approx(np.mean(handoffs), rel=1e-12), seed
    else:
      assert not relayed and row["mean_handoff_s"] is None, seed
  cut = 100 * (1 - p90[1] / p90[0])
  last = pdd_run["out"].strip().splitlines()[-1]
  assert re.search(rf"ttft_p90_cut={re.escape(f'{cut:.3g}')}%$", last), (seed, cut, last)
  assert f"PDD cuts P90 by {cut:.0f}%" in pdd_run["table"], (seed, cut)


def test_pdd_wan_capacity_is_the_pool_of_flows_below_the_line(pdd_run):
  """What the WAN carries: the line (20 Gbps) or, if less, 16 connections of at most
  1 Gbps each: 16 Gbps. The TTFT study's rate offers 85% of that, and the table's
  heading says so."""
  seed, rec = pdd_run["seed"], pdd_run["rec"]
  d = rec["defaults"]
  assert rec["capacity"] == min(d["wan_gbps"], d["wan_connections"] * d["wan_flow_gbps"])
  assert rec["capacity"] == 16
  # The TTFT trace: n = int(rate * duration) arrivals, rescaled to the reported rate:
  # rate_reported * seconds = rate * duration, in [n, n + 1).
  call, row = rec["calls"][2], next(r for r in pdd_run["rows"] if r["study"] == "ttft")
  offered = sum(r["input_tokens"] - r["cached_tokens"] for r in call["requests"]) * (
      call["cfg"]["kv_bytes_per_token"])
  n = len(call["requests"])
  loads = [offered * row["rate"] / m / (16 * GBPS) for m in (n + 1, n)]
  assert loads[0] <= row["wan_load"] * (1 + 1e-9) and row["wan_load"] <= loads[1] * (
      1 + 1e-9), (seed, loads, row["wan_load"])
  assert row["wan_load"] == pytest.approx(0.85, rel=1e-6), seed
  assert "(85% of the 16 Gbps the WAN carries)" in pdd_run["table"], seed


def test_pdd_decode_step_is_the_rooflines_at_batch_32(pdd_run):
  """Every simulated system decodes at our roofline's step for GLM-5.1, tiered (13.4%
  miss rate), batch 32, the TTFT study's 64K context, as the assumptions line says."""
  from models import capacity
  from models.config import ModelConfig
  tpot = capacity.ThroughputModel().step_seconds(ModelConfig.from_name("glm_5_1"), 32,
                                                 0.134, context=65536)
  for other in (dict(batch=64, context=65536), dict(batch=32, context=32768)):
    assert tpot != capacity.ThroughputModel().step_seconds(
        ModelConfig.from_name("glm_5_1"), other["batch"], 0.134, context=other["context"])
  assert {c["cfg"]["tpot_s"] for c in pdd_run["rec"]["calls"]} == {tpot}
  assert f"decode: {tpot * 1e3:.1f} ms per token" in pdd_run["table"]


def test_pdd_bandwidth_row_is_bytes_over_the_span(pdd_run):
  """The bandwidth row: increments (with the DRC) or whole prompts (without) of a
  64K-input skewed trace at 80 req/s, in Gbit/s over its arrival span, and their
  ratio."""
  seed = pdd_run["seed"]
  trace = pdd_sim.generate_trace(pdd_sim.TraceConfig(
      distribution="skewed", rate=RATE, duration=DURATION, mean_input=65536, seed=seed))
  kv = pdd_run["rec"]["calls"][0]["cfg"]["kv_bytes_per_token"]
  with_drc = sum(r.input_tokens - r.cached_tokens for r in trace) * kv
  without = sum(r.input_tokens for r in trace) * kv
  span = trace[-1].arrival
  row = next(r for r in pdd_run["rows"] if r["study"] == "bandwidth")
  assert row["gbps_with_drc"] == pytest.approx(with_drc * 8 / span / 1e9, rel=1e-12), seed
  assert row["gbps_without_drc"] == pytest.approx(without * 8 / span / 1e9,
                                                  rel=1e-12), seed
  assert row["reduction"] == pytest.approx(without / with_drc, rel=1e-12) and (
      row["reduction"] > 1), seed


# The PDD simulator's relay trigger and RDMA copy -----------------------------------


def _cfg(rng, **kw):
  """A fast prefill, no per-flow cap, random line and round trip."""
  return pdd_sim.SystemConfig(**{**dict(
      kv_bytes_per_token=1000.0, wan_gbps=float(rng.uniform(0.2, 2.0)),
      wan_rtt_s=float(rng.uniform(0.01, 0.1)), prefill_tok_s=1e9, tpot_s=0.05,
      wan_connections=4), **kw})


def test_the_relay_estimate_counts_the_round_trip():
  """On an idle line a transfer is estimated at RTT + bytes / line rate: with a
  budget half an RTT above bytes / rate the request is relayed, with one and a half
  RTTs above it, not."""
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  tokens = int(rng.integers(2_000, 50_000))
  base = _cfg(rng)
  seconds = tokens * base.kv_bytes_per_token / (base.wan_gbps * GBPS)
  req = pdd_sim.TraceRequest(arrival=0.0, session=0, input_tokens=tokens,
                             cached_tokens=0, output_tokens=20)
  for extra, relayed in ((0.5, True), (1.5, False)):
    cfg = _cfg(rng, wan_gbps=base.wan_gbps, wan_rtt_s=base.wan_rtt_s,
               ttft_budget_s=seconds + extra * base.wan_rtt_s)
    (out,), _ = pdd_sim.simulate([req], cfg)
    assert out.relayed is relayed, (seed, extra)


def test_the_relay_estimate_shares_the_line_with_the_flow_on_it():
  """A (large) is on the line when B is ready; a connection is free, so B's estimate
  is RTT + its bytes at half the line: with a budget of RTT + 1.5 x bytes / rate, B
  is relayed (at the whole line it would read RTT + bytes / rate: not)."""
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  cfg = _cfg(rng)
  rate = cfg.wan_gbps * GBPS
  small = int(rng.integers(1_000, 20_000))
  # A's transfer lasts past B's arrival (B is ready 2 RTTs in: A is past its RTT).
  large = int(rate * 5 * cfg.wan_rtt_s / cfg.kv_bytes_per_token) + 10 * small
  trace = [pdd_sim.TraceRequest(arrival=0.0, session=0, input_tokens=large,
                                cached_tokens=0, output_tokens=20),
           pdd_sim.TraceRequest(arrival=2 * cfg.wan_rtt_s, session=1,
                                input_tokens=small, cached_tokens=0, output_tokens=20)]
  alone = small * cfg.kv_bytes_per_token / rate
  for extra, relayed in ((1.5, True), (2.5, False)):
    budget = cfg.wan_rtt_s + extra * alone
    outs, _ = pdd_sim.simulate(trace, pdd_sim.SystemConfig(
        **{**cfg.__dict__, "ttft_budget_s": budget}))
    assert outs[1].relayed is relayed, (seed, extra)


def test_a_relayed_request_copies_its_whole_kv_over_rdma():
  """RLD gets the whole prompt's KV (not the increment): the first token comes after
  the increment's prefill, the copy of every input token at the RDMA rate, and one
  decode step."""
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  tokens = int(rng.integers(20_000, 60_000))
  cached = int(tokens * rng.uniform(0.5, 0.9))
  cfg = _cfg(rng, rdma_gbps=float(rng.uniform(0.5, 2.0)), prefill_tok_s=1e5,
             ttft_budget_s=0.0, tpot_s=float(rng.uniform(0.01, 0.05)))
  req = pdd_sim.TraceRequest(arrival=0.25, session=0, input_tokens=tokens,
                             cached_tokens=cached, output_tokens=50)
  (out,), _ = pdd_sim.simulate([req], cfg)
  assert out.relayed, seed
  want = ((tokens - cached) / cfg.prefill_tok_s
          + tokens * cfg.kv_bytes_per_token / (cfg.rdma_gbps * GBPS) + cfg.tpot_s)
  assert out.ttft_s == pytest.approx(want, rel=1e-9), seed


# Policies and the learned key ------------------------------------------------------


def _toy_trace(path, seed):
  sel, _ = cache_sim.synthetic_trace(seed, streams=4, steps=48, k=16, context=768,
                                     facts=64)
  np.savez_compressed(path, toy=np.moveaxis(sel.reshape(2, 2, 48, 16), 2, 0).astype(
      np.int16))
  return path


def _md_table(text, header_start):
  """Rows ({column: cell}) of the markdown table whose header starts so."""
  lines = text.splitlines()
  i = next(i for i, l in enumerate(lines) if l.startswith(header_start))
  cols = [c.strip() for c in lines[i].strip("|").split("|")]
  out = []
  for line in lines[i + 2:]:
    if not line.startswith("|"):
      break
    out.append(dict(zip(cols, (c.strip() for c in line.strip("|").split("|")))))
  return out


def test_policies_summary_and_table_are_the_rows(tmp_path):
  """The kept learned key's horizon is the one that closed most of the gap on the
  training trace; the summary names the online policy with the largest mean gap
  closed at 2k, says whether it reaches 50%, and the first foresight horizon whose
  mean gap reaches 50%; the table's lru and belady columns are their miss rates."""
  seeds = np.random.default_rng().integers(1 << 30, size=2)
  train = _toy_trace(tmp_path / "train.npz", int(seeds[0]))
  heldout = _toy_trace(tmp_path / "heldout.npz", int(seeds[1]))
  out = run("experiments.policies", f"--trace={heldout}", f"--train_trace={train}",
            "--slots_per_k=2,1.5", "--horizons=2,4,16", "--learned_steps=60",
            "--learned_loss=binary", "--noper_capacity", "--ghosts=", "--foresight=1,2,4,8",
            f"--out_root={tmp_path}")
  run_dir, rows = only_run(tmp_path, "policies")
  training = [r for r in rows if r.get("table") == "learned_training"]
  assert [r["horizon"] for r in training] == [2, 4, 16], seeds
  best_gap = max(r["train_gap_closed"] for r in training)
  kept = next(r["horizon"] for r in training if r["train_gap_closed"] == best_gap)
  model = learned_policy.KeyModel.load(run_dir / "learned_toy.npz")
  assert (model.horizon, model.loss) == (kept, "binary"), (seeds, training)

  two_k = [r for r in rows if "policy" in r and r["B_over_k"] == 2]
  online = [p for p in dict.fromkeys(r["policy"] for r in two_k) if p not in
            ("lru", "belady")]
  assert "learned" in online and "foresight" not in online, seeds
  mean_gap = {p: np.mean([r["gap_closed"] for r in two_k if r["policy"] == p])
              for p in online}
  best = max(mean_gap, key=mean_gap.get)
  foresight = [r for r in rows if r.get("table") == "foresight"]
  reach = [h for h in (0, 1, 2, 4, 8)
           if np.mean([r[f"h{h}"] for r in foresight]) >= 0.5]
  summary = (f"best online policy at B=2k on {heldout.parent.name} (mean gap closed over "
             f"selectors): {best} {mean_gap[best]:.0%}; goal 50% "
             + ("met" if mean_gap[best] >= 0.5 else "NOT met")
             + "; exact foresight that reaches 50%: "
             + (f"{reach[0]} steps" if reach else "more than 8 steps"))
  assert summary in out.splitlines(), (seeds, summary, out[:600])

  table = (run_dir / "table.md").read_text()
  wide = _md_table(table, "| selector | B_over_k | lru | belady |")
  assert len(wide) == 2, seeds
  for entry in wide:
    mult = float(entry["B_over_k"])
    miss = {r["policy"]: r["miss_rate"] for r in rows
            if "policy" in r and r["B_over_k"] == mult}
    assert miss["lru"] != miss["belady"], seeds
    assert entry["lru"] == f"{miss['lru']:.4g}", (seeds, entry)
    assert entry["belady"] == f"{miss['belady']:.4g}", (seeds, entry)


def test_a_sample_whose_trace_ends_at_the_horizon_has_no_label():
  """A candidate not reused with exactly ``horizon`` steps left could still be
  reused at the horizon's last step past the trace: unknown, dropped. Samples whose
  only negatives are such are one class; with one step more left they are known."""
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  horizon, n = int(rng.integers(2, 20)), 300
  features = rng.random((2 * n, len(learned_policy.FEATURES))).astype(np.float32)
  reuse = np.concatenate([rng.integers(1, horizon + 1, n), np.full(n, horizon)])
  left = np.concatenate([np.full(n, horizon + 10), np.full(n, horizon)])
  group = np.arange(2 * n) // 16

  def train():
    return learned_policy.train(learned_policy.Samples(features, reuse, left, group),
                                horizon, loss="binary", steps=1)

  with pytest.raises(ValueError, match="one class only"):
    train()
  reuse[n:], left[n:] = horizon + 1, horizon + 1  # never reused, horizon + 1 left
  model = train()
  assert model.horizon == horizon, seed


def test_the_learned_keys_start_is_the_rank_key():
  """``baseline_key``, the DAgger start, is "rank"'s key (``rank_freq`` 0.3): 1 -
  the current rank + 0.3 x the request EMA."""
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  f = rng.random((7, 5, len(learned_policy.FEATURES)))
  rank = f[..., learned_policy.FEATURES.index("rank_now")]
  freq = f[..., learned_policy.FEATURES.index("freq")]
  np.testing.assert_allclose(learned_policy.baseline_key(f), 1 - rank + 0.3 * freq,
                             rtol=1e-12, err_msg=str(seed))
  assert inspect.signature(cache_sim.replay).parameters["rank_freq"].default == 0.3


# Prefetch ---------------------------------------------------------------------------

# experiments.prefetch's main, recording every lru_with_prefetch replay (inputs and
# outputs) and each decode step's per-layer recall.
PREFETCH_HARNESS = """
import sys
import numpy as np
from absl import app
from experiments import prefetch
replays, recalls = [], []
real_replay, real_step = prefetch.lru_with_prefetch, prefetch.trace_step

def lru_with_prefetch(selections, predictions, *args):
  out = real_replay(selections, predictions, *args)
  replays.append([np.asarray(x) for x in (selections, predictions, *out)])
  return out

def trace_step(*args):
  carry = real_step(*args)
  recalls.append(np.asarray(carry.recall))
  return carry

prefetch.lru_with_prefetch, prefetch.trace_step = lru_with_prefetch, trace_step

def main(argv):
  prefetch.main(argv)
  arrays = {f"replay{i}_{j}": x for i, r in enumerate(replays) for j, x in enumerate(r)}
  np.savez(sys.argv[1], recall=np.stack(recalls), **arrays)

app.run(main, argv=["prefetch", *sys.argv[2:]])
"""


def _overlap(a, b):
  """Share of b's valid (>= 0) positions that a's row also names, pooled."""
  hit = total = 0
  for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
    y = set(y[y >= 0].tolist())
    hit += len(y & set(x[x >= 0].tolist()))
    total += len(y)
  return hit / max(1, total)


def _io_ms(miss_rate, bandwidth, latency, batch, layers=None, hidden=0.0):
  """Exposed IO per token (ms): per layer, batch x miss rate x k rows of GLM-5.1's
  row bytes over the link, plus its latency, less what is hidden."""
  from models.config import ModelConfig
  glm = ModelConfig.glm_5_1()
  layer_s = (batch * miss_rate * glm.top_k * glm.kv_bytes_per_token_per_layer / bandwidth
             + latency - hidden)
  return 1e3 * (glm.num_layers if layers is None else layers) * max(0.0, layer_s)


def test_prefetch_rows_are_the_replays_counts(tmp_path):
  """Each variant's row reads its replay from step 1 on (step 0 fills the empty
  cache): critical miss rate = misses / selected rows of steps 1.., prefetched rows
  (after steps 0..T-2) per miss and their useful share, agreement = share of the
  next step's selection the predictor named; index sharing divides the sync miss
  rate by the group and fetches on the anchors only (78 / 3 layers); overlapped
  attention hides the hit partial (the 1 - miss rate resident rows at HBM speed);
  the sync row's recall is the mean over steps. NSA: its rows hold varying numbers
  of valid positions, so an agreement's direction (a names b, or b names a) shows."""
  from tests.util import smollm2_or_skip
  smollm2_or_skip(2)
  from models.config import ModelConfig
  layers, share = 2, 3
  _python(PREFETCH_HARNESS, tmp_path / "rec.npz", "--smoke", f"--model_layers={layers}",
          "--selectors=nsa", f"--share={share}", f"--out_root={tmp_path}")
  (run_dir,) = (tmp_path / "prefetch").iterdir()
  rows = [json.loads(l) for l in (run_dir / "rows.jsonl").read_text().splitlines()]
  config = json.loads((run_dir / "config.json").read_text())["flags"]
  rec = np.load(tmp_path / "rec.npz")
  batch = config["batch"]
  links = {"io_h200_ms": (54e9, 20e-6), "io_gh200_ms": (450e9, 5e-6)}
  variants = [r for r in rows if r["variant"] not in (
      f"index shared by {share}", "overlapped hit/miss attention")]
  assert [r["variant"] for r in variants] == [
      "sync (no prefetch)", "prefetch: current query",
      "prefetch: next selection (offline)", "prefetch: draft token"]
  sel = rec["replay0_0"]  # [T, L*U, k]
  real = sel.reshape(sel.shape[0], layers, -1, sel.shape[-1])  # [T, L, U, k]
  shifted = lambda x: np.concatenate([np.full_like(x[:1], -1), x[:-1]])
  discriminating = dict(pref_vs_useful=False)
  for i, row in enumerate(variants):
    s, pred, miss, pref, useful = (rec[f"replay{i}_{j}"] for j in range(5))
    np.testing.assert_array_equal(s, sel)
    rate = miss[1:].sum() / (s[1:] >= 0).sum()
    assert row["critical_miss_rate"] == pytest.approx(rate, rel=1e-12), row
    if miss[1:].sum():
      assert row["prefetched_per_miss"] == pytest.approx(
          pref[:-1].sum() / miss[1:].sum(), rel=1e-12), row
      discriminating["pref_vs_useful"] |= pref[:-1].sum() != useful[:-1].sum()
    else:
      assert row["prefetched_per_miss"] is None, row
    if pref[:-1].sum():
      assert row["useful_share"] == pytest.approx(
          useful[:-1].sum() / pref[:-1].sum(), rel=1e-12), row
    else:  # nothing prefetched: no share of it (it read 0)
      assert row["useful_share"] is None, row
    for key, (bw, lat) in links.items():
      assert row[key] == pytest.approx(_io_ms(rate, bw, lat, batch), rel=1e-9), row
    # The prediction for step t+1, made after step t, against step t+1's selection.
    guess = pred.reshape(real.shape)
    if i:
      assert row["agreement"] == pytest.approx(_overlap(shifted(guess)[1:], real[1:]),
                                               rel=1e-12), row
  assert all(discriminating.values()), discriminating
  sync = variants[0]
  assert (sel[0] >= 0).any() and sync["critical_miss_rate"] > 0  # step 0 is left out
  recall = rec["recall"][:, 0, :, 0].mean(-1)  # per step: mean over layers
  assert recall.max() > recall.mean()
  assert sync["recall"] == pytest.approx(recall.mean(), rel=1e-6)
  base = sync["critical_miss_rate"]
  shared = next(r for r in rows if r["variant"] == f"index shared by {share}")
  assert shared["critical_miss_rate"] == pytest.approx(base / share, rel=1e-12)
  anchors = ModelConfig.glm_5_1().num_layers // share
  assert anchors == 26
  for key, (bw, lat) in links.items():
    assert shared[key] == pytest.approx(_io_ms(base, bw, lat, batch, anchors), rel=1e-9)
  # Layer l's selection against layer l+1's: the share of l+1's that l names.
  assert shared["agreement"] == pytest.approx(_overlap(real[:, :-1], real[:, 1:]),
                                              rel=1e-12)
  overlapped = next(r for r in rows if r["variant"] == "overlapped hit/miss attention")
  glm = ModelConfig.glm_5_1()
  hidden = batch * (1 - base) * glm.top_k * glm.kv_bytes_per_token_per_layer / 4.8e12
  assert overlapped["critical_miss_rate"] == base
  for key, (bw, lat) in links.items():
    assert overlapped[key] == pytest.approx(_io_ms(base, bw, lat, batch, hidden=hidden),
                                            rel=1e-9)
