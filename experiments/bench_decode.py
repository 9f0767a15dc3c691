r"""Decode-step time: tiered cache vs full-KV sparse attention (same selections).

Paper table: HiSparse (arXiv 2608.07009) claims the resolution mechanism has "no
measurable per-token cost" next to sparse attention over a full HBM KV. This runner measures the step time of both paths on this machine, on a
synthetic selection stream whose step-to-step churn equals the paper's LRU miss rate
at B=2k (13.4%), and the memory each keeps on the accelerator. The variants alternate
step by step and ``vs_full_kv`` is the median of the per-round ratios, so a drifting
machine (this shared CPU moves 2x between minutes) moves both sides together.

Command (~1-2 min on a 2-core CPU):
  python -m experiments.bench_decode
Defaults: 4 requests, 4 layers, 32K context, B=2048, k=512, 8 q / 2 KV heads, D=128,
f32; full KV, the tiered step (XLA RESOLVE, the GPU's default) and the fused one
(``ImplConfig(fused=True)``: on this CPU one native call per layer). ``--smoke``
runs in seconds. ``--variants`` adds the tiered step's options (``OPTIONS``: index
sharing, the overlapped hit/miss attention, the lookahead prefetch of the exact
next selection, the Pallas kernels interpreted), e.g.
  python -m experiments.bench_decode --variants=full_kv,tiered,tiered_index_share2,tiered_overlap,tiered_lookahead
Results: results/bench_decode/<time>/.
"""

from __future__ import annotations

from absl import app, flags
import jax.numpy as jnp

from experiments import common, timing
from kvtier_jax.config import ImplConfig, TierConfig

FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 4, "R, requests decoded together.")
flags.DEFINE_integer("layers", 4, "L.")
flags.DEFINE_list("contexts", ["32768"], "Prompt lengths to measure.")
flags.DEFINE_integer("hot_slots", 2048, "B.")
flags.DEFINE_integer("top_k", 512, "k.")
flags.DEFINE_integer("q_heads", 8, "Hq.")
flags.DEFINE_integer("kv_heads", 2, "Hkv.")
flags.DEFINE_integer("head_dim", 128, "D.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "KV and query dtype "
                  "(float32 on this CPU: XLA:CPU has no fast bf16 dots).")
flags.DEFINE_float("churn", 0.134, "Per-step selection churn (paper's LRU miss rate).")
flags.DEFINE_integer("warmup", 3, "Untimed steps (compile).")
flags.DEFINE_integer("settle", 64, "Untimed rounds of every variant before the timed "
                     "ones: the hot cache's miss rate climbs from the warm start to "
                     "the selection churn over the first ~40 steps (timing inside "
                     "that climb flatters the tiered step).")
flags.DEFINE_integer("iters", 20, "Timed rounds (median); the variants alternate "
                     "step by step.")
# The tiered step's options, each a TierConfig change (ratios in the same run).
OPTIONS = {
    "tiered": {},
    "tiered_pallas": dict(impl="pallas"),
    "tiered_index_share2": dict(index_share=2),
    "tiered_overlap": dict(overlap_hit_miss=True),
    "tiered_lookahead": dict(lookahead_cap=64),  # prefetches the exact next selection
    "tiered_fused": dict(impl=ImplConfig(fused=True)),  # off GPU: one native call
    "tiered_fused_index_share2": dict(impl=ImplConfig(fused=True), index_share=2),
}
flags.DEFINE_list("variants", ["full_kv", "tiered", "tiered_fused"],
                  f"full_kv and any of {', '.join(OPTIONS)}.")
flags.DEFINE_bool("smoke", False, "Tiny shapes, seconds.")
flags.DEFINE_string("out_root", None, "Results root (default ./results).")

COLUMNS = ["context", "variant", "median_ms", "vs_full_kv", "miss_rate",
           "device_MiB", "host_MiB"]


def build(cfg: TierConfig, variant: str, inputs: timing.StepInputs) -> dict:
  """The variant's step (warmed up) and what it holds."""
  selector = timing.churn(cfg, inputs.context, FLAGS.churn)
  if variant == "full_kv":
    got = timing.time_full_kv(cfg, selector, inputs, FLAGS.warmup, 2)
  else:
    options = OPTIONS[variant]
    got = timing.time_tiered(cfg.replace(**options), selector, inputs, FLAGS.warmup, 2,
                             lookahead="lookahead_cap" in options)
  return dict(run=got["run"], stats=got.get("stats"),
              device_MiB=got["device_bytes"] / 2**20, host_MiB=got["host_bytes"] / 2**20)


def miss_rate(before: dict | None, after: dict | None) -> float | None:
  """Misses per lookup between two ``cache_stats`` (None: full KV)."""
  if before is None:
    return None
  misses = after["misses"] - before["misses"]
  return misses / max(1, misses + after["hits"] - before["hits"])


def render(out, rows) -> str:
  table = common.markdown_table(rows, COLUMNS)
  (out / "table.md").write_text(table + "\n")
  common.bar_plot(out / "plot.png", [f"{r['variant']}@{r['context']}" for r in rows],
                  [r["median_ms"] for r in rows], "ms / decode step",
                  f"decode step, R={FLAGS.requests} L={FLAGS.layers} "
                  f"B={FLAGS.hot_slots} k={FLAGS.top_k}")
  return table


def main(argv):
  del argv
  unknown = set(FLAGS.variants) - set(OPTIONS) - {"full_kv"}
  if unknown:
    raise app.UsageError(f"unknown variants {sorted(unknown)}: full_kv or {list(OPTIONS)}")
  if FLAGS.smoke:
    FLAGS.contexts, FLAGS.hot_slots, FLAGS.top_k = ["1024"], 128, 64
    FLAGS.head_dim, FLAGS.iters, FLAGS.warmup, FLAGS.settle = 64, 3, 1, 2
  out = common.start_run("bench_decode", FLAGS.flag_values_dict(), FLAGS.out_root)
  rows = []
  for context in map(int, FLAGS.contexts):
    # Every step any variant takes: build's warm-up and two timed steps, the
    # settling rounds, the timed rounds (and one spare).
    steps = FLAGS.warmup + 2 + FLAGS.settle + FLAGS.iters + 1
    cfg = TierConfig(num_layers=FLAGS.layers, num_requests=FLAGS.requests,
                     max_len=context + steps,
                     num_q_heads=FLAGS.q_heads, num_kv_heads=FLAGS.kv_heads,
                     head_dim=FLAGS.head_dim, hot_slots=FLAGS.hot_slots,
                     top_k=FLAGS.top_k, dtype=jnp.dtype(FLAGS.dtype))
    inputs = timing.make_inputs(cfg, context)
    built = {variant: build(cfg, variant, inputs) for variant in FLAGS.variants}
    stats = {v: b.pop("stats") for v, b in built.items()}
    runs = {v: b.pop("run") for v, b in built.items()}
    timing.run_rounds(runs, FLAGS.settle)  # past the miss rate's climb
    before = {v: fn and fn() for v, fn in stats.items()}
    medians, ratios = timing.interleaved_ms(runs, 0, FLAGS.iters)
    for variant, info in built.items():
      # Over the steps timed.
      info["miss_rate"] = miss_rate(before[variant], stats[variant] and stats[variant]())
      row = dict(context=context, variant=variant, median_ms=medians[variant],
                 vs_full_kv=ratios[variant] if FLAGS.variants[0] == "full_kv" else None,
                 **info)
      rows.append(row)
      common.append_row(out, row)
      print(f"  {variant} @ {context}: {row['median_ms']:.2f} ms", flush=True)
  print(render(out, rows))
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
