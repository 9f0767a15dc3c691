"""The numbers the experiment runners report, recomputed from their definitions.

``models.capacity`` and ``models.tiers`` term by term (the tiered device bytes, the
roofline's batch term, a Quest selector's fractional bytes per token rounded up, a
block device's miss bandwidth and the exposed IO fraction in a placement, the
defaults that must agree across modules), and the rows of ``experiments.capacity``,
``experiments.tiers``, ``experiments.step_time`` (its IO model and timed median) and
``experiments.miss_rate`` (the warm window), each from its own inputs: the formula
written out here, never the value the code under test returns (the tiers runner's
rows are checked against ``models.tiers.placement`` at the run's flags: the model
itself is checked term by term above). Inputs are fresh random draws; a failure
prints its seed.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from experiments import common
from models import capacity, tiers
from models.config import ModelConfig
from tests.test_experiments import only_run, run

GB = 1e9


def fresh_rng():
  seed = int(np.random.SeedSequence().entropy % 2**32)
  return np.random.default_rng(seed), f"seed={seed}"


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def rows_close(got: dict, want: dict, rel: float = 1e-12) -> bool:
  """Equal keys, floats within ``rel``, anything else equal (pytest.approx of a
  mapping refuses strings and None under a relative tolerance since pytest 9.2)."""
  return got.keys() == want.keys() and all(
      math.isclose(got[k], w, rel_tol=rel) if isinstance(w, float)
      and isinstance(got[k], (int, float)) else got[k] == w for k, w in want.items())


def smollm2_quest(page: int = 16) -> ModelConfig:
  """SmolLM2 with Quest pages (the accounting config experiments.capacity uses at 16)."""
  return ModelConfig.smollm2_135m().replace(selector="quest", top_k=256,
                                            quest_page_size=page)


def quest_bytes_per_token(cfg: ModelConfig) -> tuple[int, int]:
  """Quest's bytes per token and layer as a fraction: a min and a max key per KV
  head per page, over the page's tokens."""
  item = {"float32": 4, "bfloat16": 2}[cfg.dtype]
  return 2 * cfg.num_kv_heads * cfg.head_dim * item, cfg.quest_page_size


def want_bytes(cfg: ModelConfig, context: int, hot: int, page: int = 64,
               units: int = 1) -> dict:
  """Every field of a request's bytes, by the definitions in models/capacity.py."""
  L, row = cfg.num_layers, cfg.kv_bytes_per_token_per_layer
  if cfg.selector == "quest":
    num, den = quest_bytes_per_token(cfg)
    selector = ceil_div(L * context * num, den)
  elif cfg.selector == "dsa":
    item = {"float8_e4m3fn": 1, "bfloat16": 2}[cfg.indexer_dtype]
    selector = L * context * (cfg.indexer_head_dim * item + cfg.indexer_scale_bytes)
  else:
    selector = 0
  return dict(full_kv=L * context * row, selector_state=selector,
              hot_kv=L * (hot + 1) * row, metadata=L * units * hot * (4 + 4 + 4),
              host=L * ceil_div(context, page) * page * row)


def test_request_bytes_and_tiered_device_sum_every_device_part():
  """The tiered device bytes are the hot rows, the slot metadata and the selector
  state (the metadata was dropped from the sum), and the reduction is full / tiered."""
  rng, seed = fresh_rng()
  for cfg in (ModelConfig.glm_5_1(), ModelConfig.qwen3_30b_a3b(), smollm2_quest(7)):
    context = int(rng.integers(1, 300_000))
    hot = int(rng.integers(1, 8192))
    units = int(rng.integers(1, 4))
    want = want_bytes(cfg, context, hot, units=units)
    got = capacity.request_bytes(cfg, context, hot, units=units)
    assert {f: getattr(got, f) for f in want} == want, (cfg.name, context, hot, seed)
    tiered = want["hot_kv"] + want["metadata"] + want["selector_state"]
    full = want["full_kv"] + want["selector_state"]
    assert got.tiered_device == tiered, (cfg.name, seed)
    assert got.full_device == full, (cfg.name, seed)
    assert got.reduction == full / tiered, (cfg.name, seed)


def test_quest_selector_state_rounds_a_fractional_byte_count_up():
  """Pages of 7 tokens make Quest's bytes per token a fraction: a request holds
  whole bytes, ceil(L x context x bytes/token), not the floor or the nearest."""
  rng, seed = fresh_rng()
  cfg = smollm2_quest(7)
  num, den = quest_bytes_per_token(cfg)
  assert num % den  # fractional bytes per token
  for _ in range(20):
    context = int(rng.integers(1, 100_000))
    total = cfg.num_layers * context * num
    if total % den == 0:
      continue
    got = capacity.request_bytes(cfg, context, 512).selector_state
    assert got == ceil_div(total, den), (context, seed)


def test_step_seconds_reads_k_rows_and_the_selector_state_per_request_of_the_batch():
  """One step reads the weights once and, for every request of the batch, k rows
  per layer and the selector's state over its whole context (GLM-5.1's indexer
  keys, Qwen's Quest page bounds: left out, 1.35 GB a 128K GLM request, the
  roofline read 1.8x too fast at batch 64): (W + batch x L x (k x row + T x
  selector bytes per token)) / HBM (the batch factor was dropped once, too)."""
  rng, seed = fresh_rng()
  for cfg, sel_bytes in ((ModelConfig.glm_5_1(), 128 + 4),  # FP8 key + f32 scale
                         (ModelConfig.qwen3_30b_a3b(), 2 * 4 * 128 * 2 / 16)):
    model = capacity.ThroughputModel(hbm_bandwidth=float(rng.uniform(1e12, 8e12)),
                                     weight_bytes=float(rng.uniform(1e9, 1e11)))
    read = cfg.num_layers * cfg.top_k * cfg.kv_bytes_per_token_per_layer
    for batch, context in zip(rng.choice(np.arange(2, 200), 2, replace=False),
                              rng.integers(1, 1 << 20, 2)):
      batch, context = int(batch), int(context)
      want = (model.weight_bytes + batch * cfg.num_layers * (
          cfg.top_k * cfg.kv_bytes_per_token_per_layer + context * sel_bytes)) \
          / model.hbm_bandwidth
      got = model.step_seconds(cfg, batch, None, context=context)
      assert got == pytest.approx(want, rel=1e-12), seed
      assert model.tokens_per_second(cfg, batch, None, context=context) == pytest.approx(
          batch / want, rel=1e-12), seed
  with pytest.raises(ValueError, match="context=0"):
    model.step_seconds(cfg, 4, None, context=0)
  with pytest.raises(ValueError, match="attends every token"):
    model.step_seconds(ModelConfig.smollm2_135m(), 4, None, context=64)


def test_defaults_agree_across_modules():
  """The roofline's default link is the DDR5 tier's measured 54 GB/s (pdd uses the
  default), and the accelerator's and the roofline's default weights are GLM-5.1's
  FP8 weights over 8 devices."""
  assert capacity.ThroughputModel().link_bandwidth == tiers.TIERS["ddr5"].link_gbps * GB
  glm_per_device = capacity.WEIGHT_BYTES["glm_5_1"] / 8
  assert tiers.Accelerator().weight_bytes == glm_per_device
  assert capacity.ThroughputModel().weight_bytes == glm_per_device
  assert capacity.weight_bytes_per_device("glm_5_1") == glm_per_device
  assert tiers.Accelerator().hbm_bandwidth == capacity.ThroughputModel().hbm_bandwidth


@pytest.mark.parametrize("exposed_io", [1.0, 0.5])
def test_placement_on_nvme_uses_the_miss_bandwidth_and_the_exposed_io(exposed_io):
  """An NVMe miss row costs a 4 KiB block read (or an IOP): the step's IO and the
  link-bound batch use that bandwidth, not the link's, and only the exposed part
  of it (exposed_io reaches both the roofline and the link-bound batch)."""
  rng, seed = fresh_rng()
  cfg, acc = ModelConfig.glm_5_1(), tiers.Accelerator()
  nvme = tiers.TIERS["nvme"]
  L, k, row = cfg.num_layers, cfg.top_k, cfg.kv_bytes_per_token_per_layer
  hot = 2 * k
  context = int(rng.integers(hot + 1, 300_000))
  miss = float(rng.uniform(0.05, 0.3))
  got = tiers.placement(cfg, context, acc, nvme, hot_slots=hot, miss_rate=miss,
                        exposed_io=exposed_io)
  link = min(nvme.link_gbps * GB, nvme.iops * row,
             nvme.link_gbps * GB * row / max(row, nvme.block_bytes))
  assert link < nvme.link_gbps * GB  # the case this checks
  b = want_bytes(cfg, context, hot)
  tiered = b["hot_kv"] + b["metadata"] + b["selector_state"]
  batch = min(acc.max_batch, math.floor(acc.kv_budget_gb * GB / tiered),
              math.floor(nvme.gb_per_accelerator * GB / b["host"]))
  read, scan = L * k * row, L * context * cfg.selector_bytes_per_token_per_layer
  step = ((acc.weight_bytes + batch * (read + scan)) / acc.hbm_bandwidth
          + exposed_io * batch * miss * read / link)
  assert got["requests"] == batch, seed
  assert got["tok_s"] == pytest.approx(batch / step, rel=1e-12), seed
  io, hbm = exposed_io * miss * read / link, (read + scan) / acc.hbm_bandwidth
  assert io > hbm
  assert got["link_bound_batch"] == pytest.approx(
      (acc.weight_bytes / acc.hbm_bandwidth) / (io - hbm), rel=1e-12), seed


def test_tiers_rows_are_strict_json_where_the_link_never_bounds_the_step(tmp_path):
  """At a 1% miss rate DDR5's link never bounds the step (link_bound_batch = inf):
  rows.jsonl said Infinity, which strict JSON readers refuse; it says "inf"."""
  run("experiments.tiers", f"--out_root={tmp_path}", "--contexts=131072",
      "--miss_rate=0.01")
  run_dir = next((tmp_path / "tiers").iterdir())

  def refuse(constant):
    raise ValueError(f"not strict JSON: {constant}")

  rows = [json.loads(line, parse_constant=refuse)
          for line in (run_dir / "rows.jsonl").read_text().splitlines()]
  never = [r for r in rows if r.get("link_bound_batch") == "inf"]
  assert never and all(r["placement"] != "HBM (full KV)" for r in never)


def test_tiers_runner_rows_flags_and_serve_results(tmp_path):
  """Every placement row is the model's at the run's flags and shared fractions
  (the flag's and the --serve_results run's last prefix_hit); --ddr5_gb bounds
  the DDR5 tier; the last line's figures are the rows' at --shared_fraction; the
  load table has both prefix sizes per tier and the measured disk row."""
  rng, seed = fresh_rng()
  cfg = ModelConfig.glm_5_1()
  L, row_b = cfg.num_layers, cfg.kv_bytes_per_token_per_layer
  contexts = [32768, 131072]
  longest = max(contexts)
  host_longest = L * ceil_div(longest, 64) * 64 * row_b
  ddr5_gb = 3.5 * host_longest / GB  # three requests' own KV, not four
  miss, exposed = float(rng.uniform(0.05, 0.3)), float(rng.uniform(0.3, 1.0))
  hit = float(rng.uniform(0.3, 0.9))
  serve = tmp_path / "serve_run"
  serve.mkdir()
  page, disk_s, prefill_s = 64, float(rng.uniform(1e-4, 1e-2)), float(rng.uniform(1e-6, 1e-3))
  (serve / "rows.jsonl").write_text(
      json.dumps(dict(prefix_hit=0.01)) + "\n" + json.dumps(dict(
          prefix_hit=hit, disk_s_per_page=disk_s, prefill_s_per_token=prefill_s,
          page_size=page)) + "\n")
  out = run("experiments.tiers", f"--out_root={tmp_path}",
            f"--contexts={','.join(map(str, contexts))}", f"--miss_rate={miss!r}",
            f"--exposed_io={exposed!r}", f"--ddr5_gb={ddr5_gb!r}",
            f"--serve_results={serve}")
  _, rows = only_run(tmp_path, "tiers")
  placements = [r for r in rows if r["table"] == "placement"]
  loads = [r for r in rows if r["table"] == "load_or_recompute"]
  acc = tiers.Accelerator(weight_bytes=capacity.WEIGHT_BYTES["glm_5_1"] / 8)
  tier_set = dict(tiers.TIERS, ddr5=tiers.TIERS["ddr5"].replace(gb_per_accelerator=ddr5_gb))
  # The model recomputed at the run's inputs, row by row, in the runner's order.
  want = []
  for context in contexts:
    for fraction in (0.0, hit):
      for tier in (None, *tier_set.values()):
        want.append(dict(table="placement", shared=fraction, **tiers.placement(
            cfg, context, acc, tier, hot_slots=2 * cfg.top_k, miss_rate=miss,
            shared_fraction=fraction, exposed_io=exposed)))
  assert len(placements) == len(want), seed
  for got, w in zip(placements, want):
    assert rows_close(got, common.strict_json(w)), (got, w, seed)
  # --ddr5_gb: the tier holds three requests' KV at the longest context.
  pick = {r["placement"]: r for r in placements
          if r["context"] == longest and r["shared"] == 0.0}
  ddr5, cxl = pick["HBM hot + host DDR5"], pick["HBM hot + CXL DDR4 (Vistara)"]
  assert (ddr5["bound"], ddr5["requests"]) == ("host DDR5", 3), seed
  # Last line: the longest context at --shared_fraction (0), not the measured one.
  last = dict(kv.split("=") for kv in out.splitlines()[-1].split()[1:])
  assert int(last["context"]) == longest
  ratio = cxl["usd_per_request"] / ddr5["usd_per_request"]
  assert float(last["cxl_vs_ddr5_request_cost"]) == pytest.approx(ratio, rel=5e-3), seed
  other = {r["placement"]: r for r in placements
           if r["context"] == longest and r["shared"] == hit}
  other_ratio = (other["HBM hot + CXL DDR4 (Vistara)"]["usd_per_request"]
                 / other["HBM hot + host DDR5"]["usd_per_request"])
  assert abs(other_ratio / ratio - 1) > 0.02, seed  # the filter is observable
  for key, name in (("ddr5", "HBM hot + host DDR5"),
                    ("cxl", "HBM hot + CXL DDR4 (Vistara)"), ("hbm", "HBM (full KV)")):
    assert float(last[f"{key}_usd_per_mtok"]) == pytest.approx(
        pick[name]["usd_per_mtok"], rel=5e-3), (key, seed)
  # Loads: both prefix sizes per tier, bytes over the link plus one access.
  for tier in tier_set.values():
    mine = [r for r in loads if r["tier"] == tier.name]
    assert {r["prefix_tokens"] for r in mine} == {8192, 65536} and len(mine) == 2
    for r in mine:
      assert r["load_s"] == pytest.approx(r["prefix_tokens"] * L * row_b
                                          / (tier.link_gbps * GB)
                                          + tier.latency_us * 1e-6, rel=1e-12)
  measured = [r for r in loads if r["tier"] not in {t.name for t in tier_set.values()}]
  assert len(measured) == 1
  assert measured[0]["prefix_tokens"] == page and measured[0]["load_s"] == disk_s
  assert measured[0]["recompute_s"] == pytest.approx(prefill_s * page, rel=1e-12)
  assert measured[0]["load_wins"] == (disk_s / page < prefill_s)


def test_capacity_runner_tables_and_measured_row(tmp_path):
  """Tables 4 and 6 from each row's own model, context and B (B = 2k or 4k; GB of
  1e9 bytes; the tiered batch from the tiered device bytes; no misses while the
  context fits B; throughput summed over --devices, tiered over full), and the
  measured SmolLM2 row's formula columns in MiB / KiB."""
  rng, seed = fresh_rng()
  contexts = [4096, 8192, 131072, 1048576]
  devices = int(rng.integers(2, 9))
  budget_gb, max_batch = float(rng.uniform(20, 60)), int(rng.integers(16, 129))
  miss, link_gbps = float(rng.uniform(0.05, 0.3)), float(rng.uniform(30, 500))
  exposed = float(rng.uniform(0.3, 1.0))
  run("experiments.capacity", "--measure_layers=1",
      f"--contexts={','.join(map(str, contexts))}", f"--devices={devices}",
      f"--kv_budget_gb={budget_gb!r}", f"--max_batch={max_batch}",
      f"--miss_rate={miss!r}", f"--link_gbps={link_gbps!r}", f"--exposed_io={exposed!r}",
      f"--out_root={tmp_path}")
  _, rows = only_run(tmp_path, "capacity")
  presets = {"glm_5_1": ModelConfig.glm_5_1(), "qwen3_30b_a3b": ModelConfig.qwen3_30b_a3b(),
             "deepseek_v3_2": ModelConfig.deepseek_v3_2(), "smollm2_135m": smollm2_quest()}
  table4 = [r for r in rows if r["table"] == "capacity"]
  assert len(table4) == len(presets) * len(contexts) * 2
  for r in table4:
    cfg = presets[r["model"]]
    mult = {"2k": 2, "4k": 4}[r["B"]]
    b = want_bytes(cfg, r["context"], mult * cfg.top_k)
    full = b["full_kv"] + b["selector_state"]
    tiered = b["hot_kv"] + b["metadata"] + b["selector_state"]
    want = dict(full_GB=full / GB, full_kv_GB=b["full_kv"] / GB, tiered_GB=tiered / GB,
                hot_GB=b["hot_kv"] / GB, selector_GB=b["selector_state"] / GB,
                host_GB=b["host"] / GB, reduction=full / tiered)
    assert rows_close({f: r[f] for f in want}, want), (r, want, seed)
  assert {(r["model"], r["context"], r["B"]) for r in table4} == {
      (m, c, B) for m in presets for c in contexts for B in ("2k", "4k")}
  table6 = [r for r in rows if r["table"] == "throughput"]
  assert {(r["model"], r["context"]) for r in table6} == {
      (m, c) for m in ("glm_5_1", "qwen3_30b_a3b") for c in contexts}
  hbm = capacity.ThroughputModel().hbm_bandwidth
  for r in table6:
    cfg = presets[r["model"]]
    weights = capacity.WEIGHT_BYTES[r["model"]] / devices
    hot = 2 * cfg.top_k
    b = want_bytes(cfg, r["context"], hot)
    n_full = min(max_batch, math.floor(budget_gb * GB / (b["full_kv"] + b["selector_state"])))
    n_tier = min(max_batch, math.floor(budget_gb * GB / (b["hot_kv"] + b["metadata"]
                                                         + b["selector_state"])))
    read = cfg.num_layers * cfg.top_k * cfg.kv_bytes_per_token_per_layer
    scan = cfg.num_layers * r["context"] * cfg.selector_bytes_per_token_per_layer
    rate = miss if r["context"] > hot else 0.0

    def tok_s(n, m):
      if not n:
        return 0.0
      return devices * n / ((weights + n * (read + scan)) / hbm
                            + exposed * n * m * read / (link_gbps * 1e9))

    full_tok_s, tiered_tok_s = tok_s(n_full, 0.0), tok_s(n_tier, rate)
    want = dict(weight_GB_per_device=weights / GB, full_requests=devices * n_full,
                tiered_requests=devices * n_tier, full_tok_s=full_tok_s,
                tiered_tok_s=tiered_tok_s,
                speedup=tiered_tok_s / full_tok_s if full_tok_s else None)
    assert rows_close({f: r[f] for f in want}, want), (r, want, seed)
  # The boundary the miss guard decides: a context equal to B never misses.
  assert any(r["context"] == 2 * presets[r["model"]].top_k for r in table6)
  assert any(r["speedup"] is None for r in table6)
  measured = next(r for r in rows if r["table"] == "measured")
  L, row_b = measured["layers"], smollm2_quest().kv_bytes_per_token_per_layer
  assert L == 1 and measured["context"] == 2049
  assert measured["hot_MiB"] == measured["hot_formula_MiB"] == L * 513 * row_b / 2**20
  assert measured["metadata_KiB"] == measured["metadata_formula_KiB"] == L * 512 * 12 / 2**10
  assert measured["host_formula_MiB"] == L * ceil_div(2049, 64) * 64 * row_b / 2**20
  num, den = quest_bytes_per_token(smollm2_quest())
  assert measured["selector_formula_MiB"] == ceil_div(L * 2049 * num, den) / 2**20


STEP_TIME_SNIPPET = """
import json, sys, types
import numpy as np
from absl import flags
from experiments import step_time
args = json.loads(sys.argv[1])
flags.FLAGS(["step_time", *args["flags"]])
clock = iter(args["clock"])
step_time.time = types.SimpleNamespace(perf_counter=lambda: next(clock))

class Runner:
  def __init__(self, *a, **kw):
    pass
  def prefill(self, tokens, lens):
    return np.zeros((1, 8), np.float32)
  def step(self, tokens):
    return np.zeros((1, 8), np.float32)

step_time.backends.Runner = Runner
timed = step_time.time_backend(None, np.arange(64), "dense", 16, None, None)
print(json.dumps(dict(io=step_time.io_rows(), timed=timed)))
"""


def test_step_time_io_model_rows_and_the_timed_median():
  """The IO model's rows at --links/--miss_rate/--batch: misses x rows over the
  link plus the per-layer latency; and a step time is the median of the timed
  steps (a clock that ticks the draws)."""
  rng, seed = fresh_rng()
  links = [(f"l{i}", float(rng.uniform(10, 500)), float(rng.uniform(1, 50)))
           for i in range(2)]
  miss, batch = float(rng.uniform(0.01, 0.4)), int(rng.integers(9, 64))  # not 8: --batch
  steps = int(rng.integers(3, 9))
  starts = np.cumsum(rng.uniform(1, 2, steps))
  ends = starts + rng.exponential(0.05, steps)
  clock = [float(x) for pair in zip(starts, ends) for x in pair]
  flags_ = [f"--links={','.join(f'{n}:{g!r}:{u!r}' for n, g, u in links)}",
            f"--miss_rate={miss!r}", f"--batch={batch}", f"--steps={steps}"]
  proc = subprocess.run([sys.executable, "-c", STEP_TIME_SNIPPET,
                         json.dumps(dict(flags=flags_, clock=clock))],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.splitlines()[-1])
  cfg = ModelConfig.glm_5_1()
  L, k, row = cfg.num_layers, cfg.top_k, cfg.kv_bytes_per_token_per_layer
  assert [r["link"] for r in got["io"]] == [n for n, _, _ in links]
  for r, (_, gbps, us) in zip(got["io"], links):
    transfer = 1e3 * L * batch * miss * k * row / (gbps * 1e9)
    latency = 1e3 * L * us * 1e-6
    assert r["GBps"] == pytest.approx(gbps, rel=1e-12)
    assert r["miss_rate"] == miss and r["miss_source"] == "flag"
    assert r["transfer_ms"] == pytest.approx(transfer, rel=1e-12), seed
    assert r["latency_ms"] == pytest.approx(latency, rel=1e-12), seed
    assert r["exposed_io_ms"] == pytest.approx(transfer + latency, rel=1e-12), seed
  durations = np.asarray(clock[1::2]) - np.asarray(clock[0::2])
  assert got["timed"]["ms_per_step"] == pytest.approx(1e3 * np.median(durations),
                                                      rel=1e-12), seed


def test_io_model_named_links_are_the_step_time_defaults():
  """``io_model.LINKS`` (what other runners use by name) are the links
  experiments.step_time models by default: name:GB/s:us."""
  from absl import flags
  from experiments import step_time  # noqa: F401 (defines --links)
  from experiments.analysis import io_model
  default = flags.FLAGS["links"].default
  assert len(default) == len(io_model.LINKS)
  for spec in default:
    name, gbps, us = spec.split(":")
    link = io_model.LINKS[name]
    assert (link.bandwidth, link.latency) == pytest.approx((float(gbps) * 1e9,
                                                            float(us) * 1e-6), rel=1e-12)
    parsed_name, parsed = io_model.Link.parse(spec)  # 20 * 1e-6 is not 20e-6 exactly
    assert parsed_name == name and (parsed.bandwidth, parsed.latency) == pytest.approx(
        (link.bandwidth, link.latency), rel=1e-12)


def test_miss_rate_warm_window(tmp_path):
  """The warm rate counts misses over selected (non-padding) entries of the steps
  from --warm_after on; the cold rate over every step."""
  from experiments import common
  from experiments.analysis import cache_sim
  rng, seed = fresh_rng()
  steps, layers, k = 40, 2, 16
  trace = np.full((steps, layers, 1, k), -1, np.int16)
  for t in range(steps):
    for l in range(layers):
      n = int(rng.integers(k // 2, k + 1))  # rows padded with -1, as Quest's are
      trace[t, l, 0, :n] = rng.choice(np.arange(t, t + 60), n, replace=False)
  path = tmp_path / "traces.npz"
  np.savez_compressed(path, toy=trace)
  warm_after = int(rng.integers(2, steps - 2))
  run("experiments.miss_rate", f"--trace={path}", "--slots_per_k=1,2",
      "--policies=lru,fifo", f"--warm_after={warm_after}", f"--out_root={tmp_path}")
  _, rows = only_run(tmp_path, "miss_rate")
  by = {(r["policy"], r["B"]): r for r in rows}
  assert set(by) == {(p, B) for p in ("lru", "fifo") for B in (k, 2 * k)}
  sel = common.trace_streams(trace)
  for (policy, B), r in by.items():
    misses = cache_sim.replay(sel, B, policy)
    warm = misses[:, warm_after:].sum() / (sel[:, warm_after:] >= 0).sum()
    cold = misses.sum() / (sel >= 0).sum()
    assert r["warm"] == pytest.approx(warm, rel=1e-12), (policy, B, warm_after, seed)
    assert r["cold"] == pytest.approx(cold, rel=1e-12), (policy, B, seed)
