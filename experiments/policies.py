r"""Beyond LRU: online replacement policies against Belady on real selection traces.

Paper context (docs/DESIGN.md, "Replacement policies"): HiSparse ships LRU with hits promoted above fresh
misses (13.4% at B=2k on GLM-5.1) against Belady's 8.2%. The goal here: an online
(causal) policy that closes at least half of the LRU -> Belady gap at B=2k on our
traces; the best one is also selectable in the jitted RESOLVE
(``TierConfig.policy``).

Gap closed = (LRU - policy) / (LRU - Belady), pooled over layers, units and steps of
every selector's trace (cold start included). The rank-aware policy reads each
selector's top-m ranking recorded beside its trace (``<name>_ranks``; NSA has none,
so there it ranks by row order only).

Command (~8 min on a 2-core CPU):
  python -m experiments.policies          # newest full results/trace run
"""

from __future__ import annotations

import pathlib

from absl import app, flags
import numpy as np
from tqdm import tqdm

from experiments import common
from experiments.analysis import cache_sim

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "traces.npz (default: the newest full trace run).")
flags.DEFINE_list("slots_per_k", ["1.25", "1.5", "2", "4"], "B / k values.")
flags.DEFINE_string("out_root", None, "Results root.")

ONLINE = [p for p in cache_sim.POLICIES
          if p not in cache_sim.OFFLINE_POLICIES and p != "lru"]


def main(argv):
  del argv
  path = pathlib.Path(FLAGS.trace) if FLAGS.trace else common.latest_trace()
  data = np.load(path)
  names = common.trace_names(data)
  out = common.start_run("policies", dict(FLAGS.flag_values_dict(), trace=str(path)),
                         FLAGS.out_root)
  rows = []
  for name in tqdm(names, desc="selectors"):
    ranked = f"{name}_ranks"  # without it "rank" falls back to the row order
    ranks = common.trace_streams(data[ranked]) if ranked in data.files else None
    trace = (common.trace_streams(data[name]), None, ranks)
    for row in cache_sim.compare_policies([trace],
                                          [float(m) for m in FLAGS.slots_per_k],
                                          ["lru", "belady", *ONLINE]):
      row = dict(selector=name, B_over_k=row.pop("capacity"), **row)
      rows.append(row)
      common.append_row(out, row)
  two_k = [r for r in rows if r["B_over_k"] == 2.0 and r["policy"] in ONLINE]
  mean_gap = {p: np.mean([r["gap_closed"] for r in two_k if r["policy"] == p])
              for p in ONLINE}
  best = max(mean_gap, key=mean_gap.get)
  summary = (f"best online policy at B=2k (mean gap closed over selectors): {best} "
             f"{mean_gap[best]:.0%}; goal 50% "
             + ("met" if mean_gap[best] >= 0.5 else "NOT met"))
  wide = []
  for name in names:
    for mult in map(float, FLAGS.slots_per_k):
      sub = {r["policy"]: r for r in rows if r["selector"] == name and r["B_over_k"] == mult}
      entry = dict(selector=name, B_over_k=mult, lru=sub["lru"]["miss_rate"],
                   belady=sub["belady"]["miss_rate"])
      entry.update({p: f"{sub[p]['miss_rate']:.4f} ({sub[p]['gap_closed']:+.2f})"
                    for p in ONLINE})
      wide.append(entry)
  table = common.markdown_table(wide, ["selector", "B_over_k", "lru", "belady", *ONLINE])
  (out / "table.md").write_text(f"{summary}\n\nmiss rate (gap closed)\n\n{table}\n")
  common.bar_plot(out / "plot.png", ONLINE, [mean_gap[p] for p in ONLINE],
                  "LRU->Belady gap closed at B=2k", "online policies, mean over selectors")
  print(summary)
  print(table)
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
