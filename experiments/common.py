"""What every runner shares: result folders, config capture, tables and plots.

Each run writes ``results/<experiment>/<timestamp>/config.json`` (flags, jax version,
device, git SHA) and ``rows.jsonl``; ``markdown_table`` and ``line_plot`` turn rows
into ``table.md`` and ``plot.png`` (timing is in ``experiments/timing.py``).
Measuring never formats and rendering never measures.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import subprocess
from typing import Sequence

import jax
import numpy as np

RESULTS = pathlib.Path("results")


def git_sha() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def start_run(experiment: str, flag_values: dict, out_root: str | None = None) -> pathlib.Path:
  """Create the run folder and write config.json. Runs started in the same second
  get ``-001``, ``-002``... (one folder each: never rows appended to another run's;
  names still sort in start order)."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  root = pathlib.Path(out_root or RESULTS) / experiment
  root.mkdir(parents=True, exist_ok=True)
  for n in range(1000):
    out = root / (stamp if n == 0 else f"{stamp}-{n:03d}")
    try:
      out.mkdir()
      break
    except FileExistsError:
      continue
  else:
    raise FileExistsError(f"{root}: 1000 runs started at {stamp}")
  dev = jax.devices()[0]
  config = {"experiment": experiment, "flags": flag_values, "jax": jax.__version__,
            "device_kind": dev.device_kind, "platform": dev.platform,
            "git_sha": git_sha(), "started": stamp}
  # Strict JSON (a default --request_rate=inf is "inf", not Infinity, which other
  # readers refuse).
  (out / "config.json").write_text(json.dumps(strict_json(config), indent=2, default=str,
                                              allow_nan=False) + "\n")
  return out


def strict_json(value):
  """``value`` with every non-finite float as its str ("inf", "nan"): JSON that
  strict readers take (Python writes Infinity and NaN, which they refuse)."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, dict):
    return {k: strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v) for v in value]
  return value


def append_row(out: pathlib.Path, row: dict) -> None:
  append_jsonl(out / "rows.jsonl", row)


def append_jsonl(path: pathlib.Path, row: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(row, default=float) + "\n")


def ensure_devices(count: int) -> None:
  """On a CPU, give jax ``count`` devices (XLA's fake host devices) for a mesh; must
  run before jax starts its backend (a runner's ``main``, before any array)."""
  import os
  if count <= 1 or os.environ.get("JAX_PLATFORMS", "cpu") not in ("cpu", ""):
    return
  flag = f"--xla_force_host_platform_device_count={count}"
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def platform() -> str:
  """What the runner computes on, e.g. ``cpu (cpu)`` or ``gpu (NVIDIA H200)``."""
  dev = jax.devices()[0]
  return f"{dev.platform} ({dev.device_kind})"


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return "-" if v is None else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


def bar_plot(path: pathlib.Path, labels: Sequence[str], values: Sequence[float],
             ylabel: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(labels)), 3.2))
  ax.bar(range(len(values)), values, color="#4878a8")
  ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def line_plot(path: pathlib.Path, xs: Sequence[float], ys: Sequence[float],
              xlabel: str, ylabel: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5.0, 3.2))
  ax.step(xs, ys, where="post", color="#4878a8")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# Decode steps of a full trace run (``experiments.trace``'s default).
FULL_TRACE_STEPS = 512


def latest_trace(text: str | None = None) -> pathlib.Path:
  """The newest full trace run of one text (the run's ``--prompt_file``: None for
  the pydoc corpus, ``models.text.HELDOUT``, ``models.text.TEST``), or of any text
  with ``text="any"``. Full: not --smoke, of the whole model (not --model_layers:
  another model's selections) and at least ``FULL_TRACE_STEPS`` steps (a shorter
  run's tables sit in the miss-rate ramp)."""
  runs = sorted(pathlib.Path(RESULTS, "trace").glob("*/traces.npz"))
  flags_of = {r: json.loads((r.parent / "config.json").read_text())["flags"] for r in runs}
  full = [r for r in runs if not flags_of[r].get("smoke")
          and not flags_of[r].get("model_layers")
          and flags_of[r].get("steps", FULL_TRACE_STEPS) >= FULL_TRACE_STEPS
          and (text == "any" or flags_of[r].get("prompt_file") == text)]
  if not full:
    which = "" if text == "any" else f" --prompt_file={text}" if text else ""
    raise FileNotFoundError(f"no full trace (--steps >= {FULL_TRACE_STEPS}): run "
                            f"python -m experiments.trace{which} first")
  return full[-1]


def trace_text(path: pathlib.Path) -> tuple[bool, str | None]:
  """(whether it is known, the ``--prompt_file``) of the text a trace run traced:
  unknown for a traces.npz without its run's config.json."""
  config = pathlib.Path(path).parent / "config.json"
  if not config.exists():
    return False, None
  return True, json.loads(config.read_text())["flags"].get("prompt_file")


def run_text(run: pathlib.Path) -> tuple[bool, str | None]:
  """(known, ``--prompt_file``) of the text a run read: its own flag, or its
  trace's (miss_rate, policies); unknown for a trace without its run's config."""
  flags_ = json.loads((pathlib.Path(run) / "config.json").read_text())["flags"]
  if flags_.get("trace"):
    return trace_text(pathlib.Path(flags_["trace"]))
  return True, flags_.get("prompt_file")


def trace_names(data) -> list[str]:
  """Selector traces in a traces.npz (i16[T, L, U, k]; not their ``_ranks`` or
  ``_drafted``)."""
  return [n for n in data.files if data[n].ndim == 4
          and not n.endswith(("_ranks", "_drafted"))]


def trace_streams(trace: np.ndarray) -> np.ndarray:
  """[T, L, U, k] -> [L*U, T, k] independent (layer, unit) streams."""
  steps, layers, units, k = trace.shape
  return np.moveaxis(trace.astype(np.int64), 0, 2).reshape(layers * units, steps, k)
