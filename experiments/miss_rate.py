r"""Hot-cache miss rate by replacement policy, cache size and selector, on real traces.

Paper table (HiSparse): GLM-5.1, k=2048, one 100K-token
LongBenchV2 request, 78 layers, first 1000 steps: B=k keeps 30% misses; at B=2k
LRU 13.4%, FIFO 17.2%, random 16.1%, Belady 8.2%; at B=4k LRU 6.7%.

Miss rate here = misses / selected entries (the newest position excluded: it has a
reserved slot), summed over layers, units and steps; ``cold`` counts every step from
an empty cache, ``warm`` only steps >= ``--warm_after`` (the paper's definition is
not public; we read it as misses/k averaged over steps and layers: padded rows make
ours a little higher, e.g. Quest's rows hold 247.5 of 256 entries on average, NSA's
240.6 of 320; gap closed does not depend on it). Belady minimises
the cold count; its warm rate is not a strict lower bound (a policy can move a few
misses, at most about B per stream, into the uncounted steps).

Command (~10 min on a 2-core CPU for the default trace):
  python -m experiments.miss_rate    # the latest trace of the pydoc text (not
                                     # the held-out or test text, kept for policies)
"""

from __future__ import annotations

import pathlib
import time

from absl import app, flags
import numpy as np
from tqdm import tqdm

from experiments import common
from experiments.analysis import cache_sim

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "traces.npz (default: the latest results/trace run).")
flags.DEFINE_list("policies", [p for p in cache_sim.POLICIES if p != "foresight"],
                  "Policies to replay ('foresight', an offline reference that reads "
                  "rankings, is reported by experiments/policies.py).")
flags.DEFINE_list("slots_per_k", ["1", "1.25", "1.5", "2", "4"], "B / k values.")
flags.DEFINE_list("selectors", [], "Selectors in the trace to use (default: all).")
flags.DEFINE_integer("warm_after", 32, "First step counted by the warm rate.")
flags.DEFINE_string("out_root", None, "Results root.")

PAPER = {("lru", 1.0): 0.30, ("lru", 2.0): 0.134, ("fifo", 2.0): 0.172,
         ("random", 2.0): 0.161, ("belady", 2.0): 0.082, ("lru", 4.0): 0.067}


def replay_rates(sel: np.ndarray, capacity: int, policy: str, warm_after: int,
                 ranks: np.ndarray | None = None):
  misses = cache_sim.replay(sel, capacity, policy, ranks=ranks)  # [S, T]
  valid = (sel >= 0).sum(-1)  # [S, T]
  cold = misses.sum() / max(1, valid.sum())
  warm = misses[:, warm_after:].sum() / max(1, valid[:, warm_after:].sum())
  return float(cold), float(warm)


def main(argv):
  del argv
  path = pathlib.Path(FLAGS.trace) if FLAGS.trace else common.latest_trace(None)
  known, prompt_file = common.trace_text(path)
  print(f"trace {path} (text: {prompt_file or 'pydoc' if known else 'unknown'})")
  data = np.load(path)
  names = FLAGS.selectors or common.trace_names(data)
  steps = min(data[n].shape[0] for n in names)
  if steps <= FLAGS.warm_after:  # (the warm rate would read 0 of 0 steps as 0%)
    raise app.UsageError(f"--warm_after={FLAGS.warm_after} leaves no step of the "
                         f"{steps}-step trace {path} to count")
  out = common.start_run("miss_rate", dict(FLAGS.flag_values_dict(), trace=str(path)),
                         FLAGS.out_root)
  rows = []
  for name in tqdm(names, desc="selectors"):
    sel = common.trace_streams(data[name])
    # The "rank" policy reads the recorded top-m ranking (without it, the row order).
    ranked = f"{name}_ranks"
    ranks = common.trace_streams(data[ranked]) if ranked in data.files else None
    k = sel.shape[-1]
    for mult in map(float, FLAGS.slots_per_k):
      capacity = int(round(mult * k))
      for policy in FLAGS.policies:
        start = time.perf_counter()
        cold, warm = replay_rates(sel, capacity, policy, FLAGS.warm_after, ranks)
        row = dict(selector=name, k=k, B=capacity, B_over_k=mult, policy=policy,
                   warm=warm, cold=cold, paper=PAPER.get((policy, mult)),
                   seconds=time.perf_counter() - start)
        rows.append(row)
        common.append_row(out, row)
        print(f"{name} B={capacity} {policy}: warm {warm:.4f} cold {cold:.4f}",
              flush=True)
  render(out, rows)


def render(out, rows):
  table = common.markdown_table(rows, ["selector", "k", "B", "policy", "warm", "cold",
                                       "paper"])
  (out / "table.md").write_text(table + "\n")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  selectors = sorted({r["selector"] for r in rows})
  fig, axes = plt.subplots(1, len(selectors), figsize=(3.2 * len(selectors), 3),
                           sharey=True, squeeze=False)
  for ax, name in zip(axes[0], selectors):
    for policy in sorted({r["policy"] for r in rows}):
      pts = sorted((r["B_over_k"], r["warm"]) for r in rows
                   if r["selector"] == name and r["policy"] == policy)
      ax.plot(*zip(*pts), marker="o", ms=3, label=policy)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("B / k")
  axes[0][0].set_ylabel("warm miss rate")
  axes[0][-1].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(out / "plot.png", dpi=120)
  plt.close(fig)
  print(table)
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
