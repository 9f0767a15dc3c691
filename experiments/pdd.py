r"""Cross-datacenter prefill / relay-decode / main-decode (PDD, arXiv 2609.13161): a
discrete-event simulation (``experiments/analysis/pdd_sim.py``, SimPy) over an
agentic trace whose per-request increments come from our radix cache.

Paper tables reproduced beside ours (docs/DESIGN.md, "Cross-datacenter relay"):
* microbenchmark, 20 Gbps WAN, 80 req/s, mean 90% prefix hit: KV transfer P50 / P99
  248 ms / 18.9 s with a skewed hit distribution, 1.21 s / 25.5 s with a narrow
  85-95% one (connection pool 100% busy, mean wait 1.68 s);
* a 64K-input, 90%-hit trace: P90 TTFT -46% for PDD vs conventional cross-DC PD;
* bandwidth: 64K inputs at 80 req/s need > 180 Gbps even with the DRC (~10x less
  than without).

The paper does not give the microbenchmark's input length: it is fitted so that
the skewed P50 matches (one number fitted, the other five predicted). Every other
assumption (KV bytes per token, prefill speed, RTT, pool sizes) is a flag; the
table lists them.

Command (~30 s):
  python -m experiments.pdd
Results: results/pdd/<time>/ (config.json, rows.jsonl, table.md, plot.png).
Last line: ``pdd: skewed_p50=A s skewed_p99=B s narrow_p50=C s narrow_p99=D s
ttft_p90_cut=E%``.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import numpy as np

from experiments import common
from experiments.analysis import pdd_sim
from models import capacity
from models.config import ModelConfig

FLAGS = flags.FLAGS
flags.DEFINE_float("kv_bytes_per_token", 43e3, "KV bytes per token sent over the WAN "
                   "(43 KB: what the paper's '64K, 90% hit, 80 req/s needs > 180 Gbps' "
                   "implies; DeepSeek-V3-class MLA in FP8 is ~35-43 KB).")
flags.DEFINE_float("wan_gbps", 20.0, "WAN line rate P -> MD (paper: 20 Gbps).")
flags.DEFINE_integer("wan_connections", 16, "TCP connection pool size (not given).")
flags.DEFINE_float("wan_chunk_mb", 16.0, "Transfers go in chunks of this many MB, each "
                   "queueing for a connection (SGLang's chunked KV sender; not given). 0: "
                   "one connection per transfer.")
flags.DEFINE_float("wan_flow_gbps", 1.0, "One TCP connection's ceiling: window / RTT "
                   "(~4 MiB / 30 ms ~ 1 Gbps; not given). 0: none.")
flags.DEFINE_float("wan_rtt_s", 0.03, "WAN round trip per transfer (not given).")
flags.DEFINE_float("rdma_gbps", 400.0, "P -> RLD RDMA (one 400G NIC).")
flags.DEFINE_float("rate", 80.0, "Microbenchmark request rate (paper: 80 req/s).")
flags.DEFINE_float("duration", 60.0, "Seconds of arrivals per simulation.")
flags.DEFINE_integer("micro_input", 0, "Microbenchmark mean input tokens (0: fit to the "
                     "paper's skewed P50 of 248 ms).")
flags.DEFINE_integer("ttft_input", 65536, "TTFT study: mean input tokens (paper: 64K).")
flags.DEFINE_float("ttft_load", 0.85, "TTFT study: WAN load (bytes offered / what the "
                   "WAN carries: the line, or the connection pool's flows if less) that "
                   "sets its request rate (the paper's rate is not given).")
flags.DEFINE_float("prefill_tok_s", 20000.0, "Prefill tokens/s per P instance (H100, "
                   "assumed).")
flags.DEFINE_integer("prefill_instances", 64, "P instances.")
flags.DEFINE_integer("rld_slots", 48, "RelayDecode slots (paper: 3 H100s; 16 each).")
flags.DEFINE_float("extend_tok_s", 311.0, "MD extend over relayed ids, tokens/s (paper: "
                   "100 tokens in 321.4 ms).")
flags.DEFINE_float("ttft_budget_s", 2.0, "Relay when the estimated WAN transfer exceeds "
                   "this (tau: the TTFT SLO minus prefill).")
flags.DEFINE_float("catch_up_below", 0.5, "RLD utilisation below which handoffs are "
                   "Catch-Up (theta).")
flags.DEFINE_integer("seed", 0, "Trace seed.")
flags.DEFINE_string("out_root", None, "Results root.")
flags.DEFINE_bool("smoke", False, "Short runs (tests).")

PAPER = dict(skewed_p50=0.248, skewed_p99=18.883, narrow_p50=1.210, narrow_p99=25.542,
             narrow_wait=1.682, ttft_p90_cut=46.0, gbps_needed=180.0)


def system(**overrides) -> pdd_sim.SystemConfig:
  # Decode steps from our engine's roofline: GLM-5.1-class, tiered, batch 32, at the
  # TTFT study's context.
  tpot = capacity.ThroughputModel().step_seconds(ModelConfig.from_name("glm_5_1"), 32,
                                                 0.134, context=FLAGS.ttft_input)
  base = pdd_sim.SystemConfig(
      kv_bytes_per_token=FLAGS.kv_bytes_per_token, wan_gbps=FLAGS.wan_gbps,
      wan_flow_gbps=FLAGS.wan_flow_gbps or None, wan_chunk_mb=FLAGS.wan_chunk_mb,
      wan_connections=FLAGS.wan_connections, wan_rtt_s=FLAGS.wan_rtt_s,
      rdma_gbps=FLAGS.rdma_gbps, prefill_instances=FLAGS.prefill_instances,
      prefill_tok_s=FLAGS.prefill_tok_s, rld_slots=FLAGS.rld_slots, tpot_s=tpot,
      extend_tok_s=FLAGS.extend_tok_s, ttft_budget_s=FLAGS.ttft_budget_s,
      catch_up_below=FLAGS.catch_up_below)
  return dataclasses.replace(base, **overrides)


def trace(distribution, mean_input, rate):
  return pdd_sim.generate_trace(pdd_sim.TraceConfig(
      distribution=distribution, rate=rate, duration=FLAGS.duration,
      mean_input=mean_input, seed=FLAGS.seed))


def micro(distribution, mean_input) -> dict:
  requests = trace(distribution, mean_input, FLAGS.rate)
  outcomes, stats = pdd_sim.simulate(requests, system(relay=False))
  transfer = [o.transfer_s for o in outcomes]
  hits = [r.cached_tokens / r.input_tokens for r in requests]
  return dict(study="microbenchmark", distribution=distribution, mean_input=mean_input,
              requests=len(requests), mean_hit=float(np.mean(hits)),
              share_hit_ge_95=float(np.mean(np.asarray(hits) >= 0.95)),
              transfer_p50_s=float(np.percentile(transfer, 50)),
              transfer_p99_s=float(np.percentile(transfer, 99)),
              conn_utilisation=stats["conn_utilisation"],
              mean_conn_wait_s=stats["mean_conn_wait_s"],
              wan_gbps_offered=stats["wan_gbps_needed"])


def fit_micro_input() -> tuple[int, list[dict]]:
  """The mean input (tokens) whose skewed transfer P50 is nearest the paper's 248 ms,
  of those a geometric bisection probed, and the probes (mean_input,
  transfer_p50_s). Each probe draws its own trace, so the P50 is not monotone in
  the input near the target: the answer is a probed input, never an untried one."""
  # Below 2048 / 0.75 tokens a new context is the shared system prompt alone
  # (pdd_sim.generate_trace refuses such a mean input).
  lo, hi = 3072, 65536
  probes = []
  for _ in range(12 if not FLAGS.smoke else 4):
    mid = int((lo * hi) ** 0.5)
    probes.append(dict(study="fit", mean_input=mid,
                       transfer_p50_s=micro("skewed", mid)["transfer_p50_s"]))
    if probes[-1]["transfer_p50_s"] < PAPER["skewed_p50"]:
      lo = mid
    else:
      hi = mid
  best = min(probes, key=lambda p: abs(p["transfer_p50_s"] - PAPER["skewed_p50"]))
  return best["mean_input"], probes


def wan_capacity_gbps() -> float:
  """What the WAN can carry: the line, or the connection pool's flows if less."""
  if not FLAGS.wan_flow_gbps:
    return FLAGS.wan_gbps
  return min(FLAGS.wan_gbps, FLAGS.wan_connections * FLAGS.wan_flow_gbps)


def offered_load(requests, seconds: float | None = None) -> float:
  """Bytes the trace offers the WAN per second (over ``seconds`` of arrivals,
  default --duration), over what it can carry."""
  sent = sum(r.increment for r in requests) * FLAGS.kv_bytes_per_token
  return sent / (seconds or FLAGS.duration) / (wan_capacity_gbps() * pdd_sim.GBPS)


def ttft_study() -> list[dict]:
  # The rate that offers --ttft_load, measured on the trace that runs: increments
  # are heavy-tailed (a few new sessions of ~64K tokens), so a short probe's mean
  # misjudges them (a 60-request probe set 98% of the line for a target of 85%).
  rate = 1.0
  for _ in range(4):
    requests = trace("skewed", FLAGS.ttft_input, rate)
    rate *= FLAGS.ttft_load / offered_load(requests)
  requests = trace("skewed", FLAGS.ttft_input, rate)
  # A new rate draws another trace (a 64K new session more or less), so the loop
  # need not settle on a short run: this trace's arrivals are rescaled instead, to
  # offer exactly the load asked (a Poisson process at the rate that does).
  scale = offered_load(requests) / FLAGS.ttft_load
  requests = [dataclasses.replace(r, arrival=r.arrival * scale) for r in requests]
  rate, seconds = rate / scale, FLAGS.duration * scale
  rows = []
  for name, relay in (("cross-DC PD", False), ("PDD", True)):
    outcomes, stats = pdd_sim.simulate(requests, system(relay=relay))
    ttft = [o.ttft_s for o in outcomes]
    relayed = [o for o in outcomes if o.relayed]
    # Handoffs only: a request that finished on RLD had none (its handoff_s is 0).
    handoffs = [o.handoff_s for o in relayed if o.mode != "finished on RLD"]
    rows.append(dict(study="ttft", system=name, rate=rate, requests=len(requests),
                     wan_load=offered_load(requests, seconds),
                     mean_input=FLAGS.ttft_input,
                     mean_hit=float(np.mean([r.cached_tokens / r.input_tokens
                                             for r in requests])),
                     ttft_p50_s=float(np.percentile(ttft, 50)),
                     ttft_p90_s=float(np.percentile(ttft, 90)),
                     ttft_p99_s=float(np.percentile(ttft, 99)),
                     relayed=len(relayed) / len(outcomes),
                     catch_up=sum(o.mode == "catch-up" for o in relayed),
                     one_shot=sum(o.mode == "one-shot" for o in relayed),
                     finished_on_rld=sum(o.mode == "finished on RLD" for o in relayed),
                     mean_handoff_s=float(np.mean(handoffs)) if handoffs else None,
                     conn_utilisation=stats["conn_utilisation"]))
    rows[-1]["_ttft"] = ttft
  return rows


def bandwidth_row() -> dict:
  requests = trace("skewed", 65536, FLAGS.rate)
  total = sum(r.increment for r in requests) * FLAGS.kv_bytes_per_token
  full = sum(r.input_tokens for r in requests) * FLAGS.kv_bytes_per_token
  span = requests[-1].arrival
  return dict(study="bandwidth", mean_input=65536, rate=FLAGS.rate,
              gbps_with_drc=total / span / pdd_sim.GBPS,
              gbps_without_drc=full / span / pdd_sim.GBPS, reduction=full / total)


def main(argv):
  del argv
  if FLAGS.smoke:
    FLAGS.duration = 3.0
  out = common.start_run("pdd", FLAGS.flag_values_dict(), FLAGS.out_root)
  micro_input, probes = (FLAGS.micro_input, []) if FLAGS.micro_input else fit_micro_input()
  for probe in probes:
    common.append_row(out, probe)
  micro_rows = [micro(d, micro_input) for d in ("skewed", "narrow")]
  ttft_rows = ttft_study()
  bandwidth = bandwidth_row()
  for row in micro_rows + [{k: v for k, v in r.items() if k != "_ttft"} for r in ttft_rows]:
    common.append_row(out, row)
  common.append_row(out, bandwidth)
  skewed, narrow = micro_rows
  pd, pdd = ttft_rows
  cut = 100 * (1 - pdd["ttft_p90_s"] / pd["ttft_p90_s"])
  paper_micro = [dict(distribution="skewed (paper)", transfer_p50_s=PAPER["skewed_p50"],
                      transfer_p99_s=PAPER["skewed_p99"]),
                 dict(distribution="narrow (paper)", transfer_p50_s=PAPER["narrow_p50"],
                      transfer_p99_s=PAPER["narrow_p99"], conn_utilisation=1.0,
                      mean_conn_wait_s=PAPER["narrow_wait"])]
  sys_cfg = system()
  text = [f"## KV transfer microbenchmark: {FLAGS.wan_gbps:g} Gbps, {FLAGS.rate:g} req/s, "
          f"mean input {micro_input} tokens"
          + (" (fitted to the skewed P50)" if not FLAGS.micro_input else ""),
          common.markdown_table(micro_rows + paper_micro,
                                ["distribution", "mean_hit", "share_hit_ge_95",
                                 "transfer_p50_s", "transfer_p99_s", "conn_utilisation",
                                 "mean_conn_wait_s", "wan_gbps_offered"]),
          "", f"## TTFT, {FLAGS.ttft_input}-token inputs, skewed hits, "
          f"{pd['rate']:.2f} req/s ({pd['wan_load']:.0%} of the {wan_capacity_gbps():g} "
          f"Gbps the WAN carries): PDD cuts P90 by "
          f"{cut:.0f}% (paper: {PAPER['ttft_p90_cut']:g}%)",
          common.markdown_table(ttft_rows, ["system", "mean_hit", "ttft_p50_s", "ttft_p90_s",
                                            "ttft_p99_s", "relayed", "catch_up",
                                            "one_shot", "finished_on_rld",
                                            "mean_handoff_s"]),
          "", f"## WAN bandwidth for 64K inputs at {FLAGS.rate:g} req/s (paper: > "
          f"{PAPER['gbps_needed']:g} Gbps with the DRC, ~10x less than without)",
          common.markdown_table([bandwidth], ["gbps_with_drc", "gbps_without_drc",
                                              "reduction"]),
          "", "## Assumptions (not stated by the paper)",
          f"- KV bytes per token {FLAGS.kv_bytes_per_token:g}; WAN {FLAGS.wan_gbps:g} Gbps "
          f"shared fairly by a pool of {FLAGS.wan_connections} TCP connections of at most "
          f"{FLAGS.wan_flow_gbps:g} Gbps each, transfers in {FLAGS.wan_chunk_mb:g} MB chunks "
          "that each queue for a connection, "
          f"{FLAGS.wan_rtt_s * 1e3:g} ms RTT per transfer; RDMA {FLAGS.rdma_gbps:g} Gbps",
          f"- P: {FLAGS.prefill_instances} instances x {FLAGS.prefill_tok_s:g} tok/s, "
          "computing each prompt's increment (P caches prefixes like MD)",
          f"- decode: {sys_cfg.tpot_s * 1e3:.1f} ms per token (our roofline, GLM-5.1 "
          f"class, tiered, batch 32, {FLAGS.ttft_input // 1024}K context); RLD "
          f"{FLAGS.rld_slots} slots; MD extend "
          f"{FLAGS.extend_tok_s:g} tok/s",
          f"- relay when the estimated transfer > {FLAGS.ttft_budget_s:g} s and RLD has a "
          f"slot; Catch-Up below {FLAGS.catch_up_below:.0%} RLD use, else One-Shot",
          "- trace: steady-state agentic sessions (each context cached before the window), "
          "a turn's prompt = its session's context + an append, increments matched by "
          "RadixCache at 1/256 of the mean input; outputs log-normal (30% < 100 "
          "tokens, 70% < 500); skewed: 3% of turns restart, 15% add a large tool "
          "result"]
  (out / "table.md").write_text("\n".join(text) + "\n")
  plot(out / "plot.png", micro_input, ttft_rows)
  print("\n".join(text))
  print(f"results: {out}")
  print(f"pdd: skewed_p50={skewed['transfer_p50_s']:.3g} s "
        f"skewed_p99={skewed['transfer_p99_s']:.3g} s "
        f"narrow_p50={narrow['transfer_p50_s']:.3g} s "
        f"narrow_p99={narrow['transfer_p99_s']:.3g} s ttft_p90_cut={cut:.3g}%")


def plot(path, micro_input, ttft_rows) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
  for distribution in ("skewed", "narrow"):
    outcomes, _ = pdd_sim.simulate(trace(distribution, micro_input, FLAGS.rate),
                                   system(relay=False))
    x = np.sort([o.transfer_s for o in outcomes])
    left.plot(x, np.arange(1, len(x) + 1) / len(x), label=distribution)
  left.set_xscale("log")
  left.set_xlabel("KV transfer (s)")
  left.set_ylabel("CDF")
  left.set_title(f"{FLAGS.wan_gbps:g} Gbps, {FLAGS.rate:g} req/s", fontsize=9)
  left.legend(fontsize=8)
  for row in ttft_rows:
    x = np.sort(row["_ttft"])
    right.plot(x, np.arange(1, len(x) + 1) / len(x), label=row["system"])
  right.set_xscale("log")
  right.set_xlabel("TTFT (s)")
  right.set_title(f"{FLAGS.ttft_input}-token inputs, skewed hits", fontsize=9)
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
