r"""Tier economics: cost per concurrent long-context request and per million decoded
tokens with the authoritative KV in HBM, host DDR5, CXL-attached DDR4 or NVMe, where
each link's bandwidth starts to bound the step, and when a cached prefix on a tier
is worth loading rather than recomputing.

Context: HiSparse keeps 128K-token requests in 0.4 GB of HBM instead of 13 GB by
moving the full KV to host DDR; DRAM prices have roughly tripled since late 2023,
and Meta's Vistara puts recycled DDR4 behind CXL to make that tier cheap. The model
is ``models/tiers.py``; the inputs our engine measures are flags with defaults from
WORKSPACE_NOTES.md (miss rate at B=2k, the prefix hit of a shared-prefix workload,
the H200's zero-copy link rate); ``--serve_results`` takes the hit rate and the
measured disk-load and prefill costs from an ``experiments.serve`` run instead.
Prices and bandwidths are flags; every default and its source is listed in
``table.md``.

Command (~5 s, no model):
  python -m experiments.tiers
  python -m experiments.tiers --serve_results=results/serve/<run>
Results: results/tiers/<time>/ (config.json, rows.jsonl, table.md, plot.png).
Last line: ``tiers: context=T ddr5_usd_per_mtok=A cxl_usd_per_mtok=B
hbm_usd_per_mtok=C cxl_vs_ddr5_request_cost=R``.
"""

from __future__ import annotations

import json
import math
import pathlib

from absl import app, flags

from experiments import common
from models import capacity, tiers
from models.config import ModelConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "glm_5_1", "Model preset (KV bytes, layers, k).")
flags.DEFINE_list("contexts", ["32768", "131072"], "Context lengths (tokens).")
flags.DEFINE_integer("hot_slots", 0, "B (0: 2k, the paper's default).")
flags.DEFINE_float("miss_rate", 0.134, "Miss rate once the context exceeds B (paper LRU "
                   "at B=2k 13.4%; ours 13.1% on SmolLM2 traces).")
flags.DEFINE_float("shared_fraction", 0.0, "Part of a request's KV shared with other "
                   "running requests through the prefix cache (the table adds a row set "
                   "at --serve_results' or the measured shared-prefix hit).")
flags.DEFINE_float("measured_shared", 0.648, "Prefix hit of the shared-prefix workload "
                   "(experiments.serve --shared_prefix_groups=6, WORKSPACE_NOTES.md).")
flags.DEFINE_float("exposed_io", 1.0, "Fraction of miss traffic on the critical path.")
flags.DEFINE_float("accelerator_usd", 32000.0, "Price of one accelerator (H200, "
                   "assumed, with its share of the node).")
flags.DEFINE_float("kv_budget_gb", 30.0, "HBM per accelerator for KV (8 x H200 minus "
                   "GLM-5.1 FP8 weights, as experiments.capacity).")
flags.DEFINE_float("years", 4.0, "Amortisation period.")
flags.DEFINE_float("prefill_tok_s", 10000.0, "Prefill tokens/s per accelerator for the "
                   "load-vs-recompute table (assumed for GLM-5.1 on an H200).")
for _key, _tier in tiers.TIERS.items():
  flags.DEFINE_float(f"{_key}_usd_per_gb", _tier.usd_per_gb, f"{_tier.name} $/GB.")
  flags.DEFINE_float(f"{_key}_gbps", _tier.link_gbps, f"{_tier.name} link GB/s.")
  flags.DEFINE_float(f"{_key}_gb", _tier.gb_per_accelerator,
                     f"{_tier.name} GB per accelerator.")
flags.DEFINE_string("serve_results", None, "An experiments.serve results folder: take "
                    "the prefix hit and the measured disk-load / prefill costs from it.")
flags.DEFINE_string("out_root", None, "Results root.")


def tier_set() -> dict[str, tiers.Tier]:
  return {key: tier.replace(usd_per_gb=FLAGS[f"{key}_usd_per_gb"].value,
                            link_gbps=FLAGS[f"{key}_gbps"].value,
                            gb_per_accelerator=FLAGS[f"{key}_gb"].value)
          for key, tier in tiers.TIERS.items()}


def measured_serve() -> dict:
  if not FLAGS.serve_results:
    return {}
  rows = [json.loads(line) for line in
          (pathlib.Path(FLAGS.serve_results) / "rows.jsonl").read_text().splitlines()]
  return rows[-1]


def main(argv):
  del argv
  out = common.start_run("tiers", FLAGS.flag_values_dict(), FLAGS.out_root)
  cfg = ModelConfig.from_name(FLAGS.model)
  hot = FLAGS.hot_slots or 2 * cfg.top_k
  acc = tiers.Accelerator(usd=FLAGS.accelerator_usd, kv_budget_gb=FLAGS.kv_budget_gb,
                          years=FLAGS.years,
                          weight_bytes=capacity.weight_bytes_per_device(FLAGS.model))
  measured = measured_serve()
  shared = measured.get("prefix_hit", FLAGS.measured_shared)
  placements = [None, *tier_set().values()]
  rows = []
  for context in map(int, FLAGS.contexts):
    for fraction in sorted({FLAGS.shared_fraction, shared}):
      for tier in placements:
        row = tiers.placement(cfg, context, acc, tier, hot_slots=hot,
                              miss_rate=FLAGS.miss_rate, shared_fraction=fraction,
                              exposed_io=FLAGS.exposed_io)
        rows.append(dict(table="placement", shared=fraction, **row))
  loads = [dict(table="load_or_recompute", **tiers.load_or_recompute(
      cfg, tier, prefix, FLAGS.prefill_tok_s))
           for tier in tier_set().values() for prefix in (8192, 65536)]
  if measured.get("disk_s_per_page") and measured.get("prefill_s_per_token"):
    per_token = measured["disk_s_per_page"] / measured["page_size"]
    loads.append(dict(table="load_or_recompute", tier="measured here: disk (tensorstore) "
                      "vs prefill on this machine", prefix_tokens=measured["page_size"],
                      load_s=measured["disk_s_per_page"],
                      recompute_s=measured["prefill_s_per_token"] * measured["page_size"],
                      load_wins=per_token < measured["prefill_s_per_token"],
                      breakeven_gbps=None))
  for row in rows + loads:
    # (A link that never bounds the step reads "inf": strict JSON.)
    common.append_row(out, common.strict_json(row))
  assumptions = [f"- accelerator: {acc.name}, ${acc.usd:,.0f}, {acc.kv_budget_gb:g} GB of "
                 f"HBM for KV, {acc.hbm_bandwidth / 1e12:g} TB/s, weights "
                 f"{acc.weight_bytes / 1e9:g} GB read per step, batch <= {acc.max_batch}, "
                 f"amortised over {acc.years:g} years (no power, no network)",
                 f"- model {FLAGS.model}: {cfg.kv_bytes_per_token_per_layer * cfg.num_layers}"
                 f" KV bytes per token, k={cfg.top_k}, B={hot}; miss rate "
                 f"{FLAGS.miss_rate:.3f} once the context exceeds B, exposed IO "
                 f"{FLAGS.exposed_io:.0%}",
                 f"- shared fraction {shared:.3f}: "
                 + ("from " + FLAGS.serve_results if measured else
                    "the measured shared-prefix prefix hit (WORKSPACE_NOTES.md)")]
  row_bytes = cfg.kv_bytes_per_token_per_layer
  assumptions += [f"- {t.name}: ${t.usd_per_gb:g}/GB, {t.link_gbps:g} GB/s "
                  f"({t.miss_bandwidth(row_bytes) / 1e9:.3g} GB/s of {row_bytes}-byte miss "
                  f"rows), +{t.latency_us:g} us, {t.gb_per_accelerator:g} GB per "
                  f"accelerator. {t.source}" for t in tier_set().values()]
  assumptions.append("- latency: the miss fetch is one batched transfer per layer, so a "
                     "tier's extra access latency (CXL ~50 ns) is paid once per layer "
                     "call, not per row; the roofline ignores it")
  columns = ["context", "shared", "placement", "device_GB", "below_GB", "shared_GB",
             "requests", "bound", "tok_s", "usd_per_request", "usd_per_mtok",
             "link_bound_batch"]
  text = ["## Cost per concurrent request and per million decoded tokens",
          common.markdown_table(rows, columns), "",
          f"## A cached prefix on a tier: load it back or recompute it (prefill "
          f"{FLAGS.prefill_tok_s:g} tok/s)",
          common.markdown_table(loads, ["tier", "prefix_tokens", "load_s", "recompute_s",
                                        "load_wins", "breakeven_gbps"]),
          "", "## Assumptions", *assumptions]
  (out / "table.md").write_text("\n".join(text) + "\n")
  plot(out / "plot.png", rows, cfg, acc)
  print("\n".join(text))
  print(f"results: {out}")
  longest = max(map(int, FLAGS.contexts))
  pick = {r["placement"]: r for r in rows
          if r["context"] == longest and r["shared"] == FLAGS.shared_fraction}
  ddr5 = pick[f"HBM hot + {tiers.TIERS['ddr5'].name}"]
  cxl = pick[f"HBM hot + {tiers.TIERS['cxl_ddr4'].name}"]
  print(f"tiers: context={longest} ddr5_usd_per_mtok={ddr5['usd_per_mtok']:.3g} "
        f"cxl_usd_per_mtok={cxl['usd_per_mtok']:.3g} "
        f"hbm_usd_per_mtok={pick['HBM (full KV)']['usd_per_mtok']:.3g} "
        f"cxl_vs_ddr5_request_cost={cxl['usd_per_request'] / ddr5['usd_per_request']:.3g}")


def plot(path, rows, cfg, acc) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
  base = [r for r in rows if r["shared"] == FLAGS.shared_fraction]
  names = list(dict.fromkeys(r["placement"] for r in base))
  contexts = list(dict.fromkeys(r["context"] for r in base))
  width = 0.8 / len(contexts)
  for i, context in enumerate(contexts):
    values = [next(r["usd_per_mtok"] for r in base if r["context"] == context and
                   r["placement"] == n) for n in names]
    left.bar([j + i * width for j in range(len(names))], values, width,
             label=f"{context // 1024}K")
  left.set_xticks([j + width * (len(contexts) - 1) / 2 for j in range(len(names))], names,
                  rotation=15, ha="right", fontsize=7)
  left.set_ylabel("$ per million decoded tokens")
  left.set_title(f"{FLAGS.model}: cost by placement", fontsize=9)
  left.legend(fontsize=8)
  rates = [0.01 * i for i in range(1, 41)]
  for tier in tier_set().values():
    rate = tier.miss_bandwidth(cfg.kv_bytes_per_token_per_layer)
    bound = [tiers.link_bound_batch(cfg, acc, rate, m, FLAGS.exposed_io,
                                    context=max(contexts)) for m in rates]
    right.plot(rates, [b if math.isfinite(b) else float("nan") for b in bound],
               label=f"{tier.name} ({rate / 1e9:.3g} GB/s of miss rows)")
  right.axvline(FLAGS.miss_rate, color="grey", ls=":", lw=1)
  right.axhline(acc.max_batch, color="grey", ls="--", lw=1)
  right.set_yscale("log")
  right.set_xlabel("miss rate")
  right.set_ylabel("batch where the link bounds the step")
  right.set_title(f"above a line, the link is the bottleneck ({max(contexts) // 1024}K)",
                  fontsize=9)
  right.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
