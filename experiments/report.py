r"""Collect the latest result of every experiment into results/REPORT.md.

Each section names the paper table it reproduces, the run (time, git SHA, device)
and its rendered table (each runner's table.md, written from its rows.jsonl).
Measuring never happens here.

Command (seconds):
  python -m experiments.report
"""

from __future__ import annotations

import json
import pathlib
import re

from absl import app, flags

from experiments import common
from models import text

FLAGS = flags.FLAGS
flags.DEFINE_string("results", str(common.RESULTS), "Results root.")

SECTIONS = [
    ("serve_sweep", "Serving at a fixed device budget, sparse vs tiered (paper: peak "
     "throughput 3.1-4.7x; mean TTFT 829 s -> 171 s at concurrency 64)",
     "python -m experiments.serve_sweep"),
    ("serve", "Serving one workload (continuous batching, exactness check)",
     "python -m experiments.serve --cache=tiered --check_exact"),
    ("trace", "Table 1 - selection traces (SmolLM2, pydoc text, 7680 + 512 steps)",
     "python -m experiments.trace"),
    ("miss_rate", "Table 2 - miss rate by policy x B x selector (paper: GLM-5.1 B=2k "
     "LRU 13.4%, FIFO 17.2%, random 16.1%, Belady 8.2%; B=k 30%; B=4k LRU 6.7%)",
     "python -m experiments.miss_rate"),
    ("policies", "Table 3 - beyond LRU: gap to Belady closed at B=2k, on held-out text "
     "(the learned key trained on the pydoc text)",
     "python -m experiments.policies"),
    ("pdd", "PDD: cross-datacenter relay decode (paper: transfer P50/P99 248 ms / "
     "18.9 s skewed vs 1.21 s / 25.5 s narrow; P90 TTFT -46%)", "python -m experiments.pdd"),
    ("handoff", "Extend-Decode handoff on SmolLM2 (paper: 512.6 ms send KV vs 321.4 ms "
     "extend for 100 tokens)", "python -m experiments.handoff"),
    ("batch_invariance", "A request's logits across engine slot counts, untiled vs "
     "a batch-invariant decode (decode_row_tile), and the tile's step cost",
     "python -m experiments.batch_invariance"),
    ("tiers", "Tier economics - cost per concurrent request and per million tokens "
     "with the KV in HBM, DDR5, CXL DDR4 or NVMe", "python -m experiments.tiers"),
    ("capacity", "Tables 4 and 6 - bytes per request; requests and modelled throughput "
     "at a fixed device budget (paper: 13.09 GB vs ~0.4 GB at 128K; 3.1-4.7x)",
     "python -m experiments.capacity"),
    ("step_time", "Table 5 - step time and IO (paper: 7.7 ms sync / 3.0 ms prefetch "
     "exposed IO per token)", "python -m experiments.step_time"),
    ("bench_decode", "Decode step, tiered vs full-KV sparse (synthetic selections)",
     "python -m experiments.bench_decode"),
    ("distill_indexer", "DSA indexer distilled onto SmolLM2: top-k recall",
     "python -m experiments.distill_indexer"),
    ("prefetch", "Hiding host IO: prefetch mechanisms", "python -m experiments.prefetch"),
    ("draft_head", "EAGLE-style draft head for SmolLM2: acceptance on held-out text "
     "beside prompt lookup (OasisKV: 98.74% next-selection agreement)",
     "python -m experiments.draft_head"),
    ("route", "Replica processes behind the prefix-aware router vs round-robin "
     "(agent sessions)", "python -m experiments.route"),
]


# The text a section's title names (``--prompt_file``: None is the pydoc corpus).
TITLE_TEXT = {"trace": None, "miss_rate": None, "policies": text.HELDOUT}


def _flags(run: pathlib.Path) -> dict:
  return json.loads((run / "config.json").read_text())["flags"]


def is_smoke(run: pathlib.Path) -> bool:
  return bool(_flags(run).get("smoke"))


def latest_run(root: pathlib.Path, experiment: str) -> pathlib.Path | None:
  """The newest full run of ``experiment`` (of the text its title names, where it
  names one and such a run exists); the newest ``--smoke`` one only when no full
  run exists (its section says so)."""
  runs = sorted(p.parent for p in (root / experiment).glob("*/table.md"))
  full = [r for r in runs if not is_smoke(r)]
  if experiment in TITLE_TEXT:
    full = [r for r in full if common.run_text(r) == (True, TITLE_TEXT[experiment])] or full
  return (full or runs or [None])[-1]


def nest_headings(markdown: str, level: int = 3) -> str:
  """``markdown`` with its headings moved down so the highest is at ``level``
  (a table's own ``##`` headings sit under its report section's ``##``); fenced
  code is left alone."""
  lines, fenced, depth = markdown.splitlines(), False, {}  # heading line -> its #s
  for i, line in enumerate(lines):
    fenced ^= line.startswith("```")
    if not fenced and re.match(r"#{1,6} ", line):
      depth[i] = len(line) - len(line.lstrip("#"))
  shift = max(0, level - min(depth.values(), default=level))
  for i, d in depth.items():
    lines[i] = "#" * min(shift, 6 - d) + lines[i]
  return "\n".join(lines)


def describe(run: pathlib.Path, experiment: str) -> str:
  """What of a run's flags the section's title does not say (its text where it is
  not the title's, a model cut to its first layers)."""
  notes = []
  known, read = common.run_text(run)
  if experiment in TITLE_TEXT and (known, read) != (True, TITLE_TEXT[experiment]):
    notes.append(f"text: {read or 'pydoc' if known else 'unknown'}, not the title's")
  if _flags(run).get("model_layers"):
    notes.append(f"SmolLM2's first {_flags(run)['model_layers']} layers")
  return f" ({'; '.join(notes)})" if notes else ""


def main(argv):
  del argv
  root = pathlib.Path(FLAGS.results)
  lines = ["# kvtier-jax results", "",
           "Regenerated by `python -m experiments.report` from the latest run of each "
           "experiment. Commands, figures and their reading: WORKSPACE_NOTES.md.", ""]
  for name, title, command in SECTIONS:
    run = latest_run(root, name)
    lines += [f"## {title}", ""]
    if run is None:
      lines += [f"(no run yet: `{command}`)", ""]
      continue
    config = json.loads((run / "config.json").read_text())
    smoke = " (a `--smoke` run: no full run yet)" if is_smoke(run) else ""
    smoke += describe(run, name)
    lines += [f"Run `{run.relative_to(root)}`{smoke}: `{command}`, {config.get('device_kind')}, "
              f"jax {config.get('jax')}, git {config.get('git_sha')}.", ""]
    lines += [nest_headings((run / "table.md").read_text().rstrip()), ""]
    if (run / "plot.png").exists():
      lines += [f"![{name}]({(run / 'plot.png').relative_to(root)})", ""]
  out = root / "REPORT.md"
  out.write_text("\n".join(lines) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
