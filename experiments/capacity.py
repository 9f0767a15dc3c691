r"""Capacity and throughput at a fixed device budget: full KV vs the tiered cache.

Paper tables (HiSparse; docs/DESIGN.md, "The problem"): GLM-5.1 at 128K needs 13.09 GB of KV
per request vs ~0.4 GB of hot cache at B=4096 (but the DSA indexer keys, 1.35 GB,
stay on the device: ~7.6x, not 30x); concurrency ~60 at 32K and ~15 at 128K on
8xH200; throughput 3.1-4.7x at long context.

Table 4: bytes per request on device and on host vs context, for the presets and
B in {2k, 4k}, selector state counted; plus a measurement on the real model
(SmolLM2 + Quest, array sizes per memory kind) against the formula.
Table 6: requests that fit a device KV budget and the modelled decode throughput.

Command (~30 s on a 2-core CPU; the measured row loads SmolLM2 and prefills 2K):
  python -m experiments.capacity
"""

from __future__ import annotations

from absl import app, flags
import numpy as np

from experiments import common
from models import capacity
from models.config import ModelConfig

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["4096", "8192", "32768", "131072", "1048576"],
                  "Context lengths (tokens).")
flags.DEFINE_float("kv_budget_gb", 30.0, "Device KV budget per GPU: 8xH200 (1.1 TB) "
                   "minus ~750 GB of GLM-5.1 FP8 weights and activations leaves ~240 GB, "
                   "about the paper's ~60 requests at 32K (this table's accounting: 72 x 3.28 GB).")
flags.DEFINE_integer("devices", 8, "GPUs (throughput is summed over them).")
flags.DEFINE_integer("max_batch", 64, "Serving batch limit per GPU.")
flags.DEFINE_float("miss_rate", 0.134, "Miss rate for the IO term (paper LRU, B=2k).")
flags.DEFINE_float("link_gbps", 54.0, "Host->device GB/s (54: zero-copy fetch measured "
                   "on an H200, PCIe Gen5; ~450 for GH200 NVLink-C2C).")
flags.DEFINE_float("exposed_io", 1.0, "Fraction of miss traffic on the critical path.")
flags.DEFINE_bool("measure", True, "Measure SmolLM2 + Quest on this machine.")
flags.DEFINE_integer("measure_layers", None, "Measure only SmolLM2's first layers (a "
                     "quick check; the formula then counts as many); None: all 30.")
flags.DEFINE_string("out_root", None, "Results root.")

PRESETS = ("glm_5_1", "qwen3_30b_a3b", "deepseek_v3_2", "smollm2_135m")
GB = 1e9


def preset(name: str) -> ModelConfig:
  if name == "smollm2_135m":  # accounting only: the selector the runners use
    return ModelConfig.smollm2_135m().replace(selector="quest", top_k=256,
                                              quest_page_size=16)
  return ModelConfig.from_name(name)


def capacity_rows():
  rows = []
  for name in PRESETS:
    cfg = preset(name)
    for context in map(int, FLAGS.contexts):
      for mult in (2, 4):
        b = capacity.request_bytes(cfg, context, mult * cfg.top_k)
        rows.append(dict(model=name, context=context, B=f"{mult}k",
                         full_GB=b.full_device / GB, full_kv_GB=b.full_kv / GB,
                         tiered_GB=b.tiered_device / GB, hot_GB=b.hot_kv / GB,
                         selector_GB=b.selector_state / GB, host_GB=b.host / GB,
                         reduction=b.reduction))
  return rows


def throughput_rows():
  budget = FLAGS.kv_budget_gb * GB  # per device
  rows = []
  for name in ("glm_5_1", "qwen3_30b_a3b"):
    model = capacity.ThroughputModel(link_bandwidth=FLAGS.link_gbps * 1e9,
                                     exposed_io=FLAGS.exposed_io,
                                     weight_bytes=capacity.weight_bytes_per_device(
                                         name, FLAGS.devices))
    cfg = preset(name)
    for context in map(int, FLAGS.contexts):
      hot_slots = 2 * cfg.top_k
      b = capacity.request_bytes(cfg, context, hot_slots)
      n_full = capacity.concurrency(budget, b.full_device, FLAGS.max_batch)
      n_tier = capacity.concurrency(budget, b.tiered_device, FLAGS.max_batch)
      # A context that fits the hot cache never misses (no host traffic).
      miss = FLAGS.miss_rate if context > hot_slots else 0.0
      tp_full = FLAGS.devices * model.tokens_per_second(cfg, n_full, None,
                                                        context=context)
      tp_tier = FLAGS.devices * model.tokens_per_second(cfg, n_tier, miss, context=context)
      rows.append(dict(model=name, context=context,
                       weight_GB_per_device=model.weight_bytes / GB,
                       full_requests=FLAGS.devices * n_full,
                       tiered_requests=FLAGS.devices * n_tier, full_tok_s=tp_full,
                       tiered_tok_s=tp_tier,
                       speedup=tp_tier / tp_full if tp_full else None))
  return rows


def measured_row(num_layers: int | None = None):
  """SmolLM2 + Quest, tiered, after a 2K prefill: arrays by memory kind vs formula.
  The host pool holds one scratch page past the request's pages (state.py: it
  absorbs writes that must not land, never read), which the formula leaves out."""
  import jax
  from models import setup
  from kvtier_jax import state as kv_state
  from kvtier_jax.selectors.base import state_bytes
  from models import backends
  model, _, ids = setup.load_model_and_prompt(None, 2048, num_layers=num_layers)
  selector, _ = setup.build_selector("quest", model.cfg, 256)
  runner = backends.Runner(model, "tiered", 2048 + 1, selector=selector, hot_slots=512)
  runner.prefill(np.asarray(ids, np.int32)[None], [2048])
  tier = runner.carry.tier
  hot = sum(x.nbytes for x in (tier.hot_k, tier.hot_v))
  meta = sum(x.nbytes for x in (tier.slot_pos, tier.lru, tier.slot_score))
  host = kv_state.array_bytes_by_memory_kind(tier).get(kv_state.host_memory_kind(), 0)
  scratch = runner.tier_cfg.page_bytes
  sel = sum(x.nbytes for x in jax.tree.leaves(runner.carry.sel))
  charged = model.cfg.num_layers * state_bytes(selector, 2049)  # what admission charges
  cfg = preset("smollm2_135m").replace(num_layers=model.cfg.num_layers)
  want = capacity.request_bytes(cfg, 2049, 512)
  return dict(model="smollm2_135m (measured)", layers=cfg.num_layers, context=2049,
              hot_MiB=hot / 2**20, hot_formula_MiB=want.hot_kv / 2**20,
              metadata_KiB=meta / 2**10, metadata_formula_KiB=want.metadata / 2**10,
              host_MiB=host / 2**20, host_scratch_MiB=scratch / 2**20,
              host_formula_MiB=want.host / 2**20, selector_MiB=sel / 2**20,
              selector_formula_MiB=want.selector_state / 2**20,
              selector_charged_MiB=charged / 2**20,
              kv_agrees=(hot, meta, host - scratch) == (want.hot_kv, want.metadata,
                                                        want.host),
              selector_agrees=sel == charged)


def main(argv):
  del argv
  out = common.start_run("capacity", FLAGS.flag_values_dict(), FLAGS.out_root)
  cap = capacity_rows()
  thr = throughput_rows()
  for row in cap:
    common.append_row(out, dict(table="capacity", **row))
  for row in thr:
    common.append_row(out, dict(table="throughput", **row))
  measured = measured_row(FLAGS.measure_layers) if FLAGS.measure else None
  if measured:
    common.append_row(out, dict(table="measured", **measured))
  text = ["## Bytes per request (device: KV + selector state; tiered: hot cache + "
          "slot metadata + selector state)",
          common.markdown_table(cap, ["model", "context", "B", "full_GB", "tiered_GB",
                                      "hot_GB", "selector_GB", "host_GB", "reduction"]),
          "", f"## Requests in {FLAGS.devices} x {FLAGS.kv_budget_gb:.0f} GB of device KV "
          f"and modelled decode throughput (B=2k, miss rate {FLAGS.miss_rate} once the "
          f"context exceeds B, link {FLAGS.link_gbps} GB/s per GPU, exposed IO "
          f"{FLAGS.exposed_io:.0%}, batch <= {FLAGS.max_batch} per GPU). Model: "
          + " ".join(capacity.ThroughputModel.__doc__.split()),
          common.markdown_table(thr, ["model", "context", "weight_GB_per_device",
                                      "full_requests",
                                      "tiered_requests", "full_tok_s", "tiered_tok_s",
                                      "speedup"])]
  if measured:
    text += ["", "## Measured on SmolLM2 + Quest (tiered, B=512, 2049 positions; "
             "kv_agrees: hot, metadata and host_MiB less host_scratch_MiB, the page "
             "pool's scratch page, equal their formulas; selector_formula_MiB is the "
             "paper's (model dtype, no rings), selector_charged_MiB what admission "
             "charges for this project's f32 state in whole pages with its ring, "
             "selector_agrees: equal to the measured)",
             common.markdown_table([measured], list(measured))]
  (out / "table.md").write_text("\n".join(text) + "\n")
  # Contexts where no full-KV request fits have no ratio (the table says so).
  glm = [r for r in thr if r["model"] == "glm_5_1" and r["speedup"] is not None]
  common.bar_plot(out / "plot.png", [str(r["context"]) for r in glm],
                  [r["speedup"] for r in glm], "tiered / full-KV tokens/s",
                  "GLM-5.1 modelled decode throughput at a fixed KV budget")
  print("\n".join(text))
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
