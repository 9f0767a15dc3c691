"""Every runner's --smoke path writes config.json + rows.jsonl + table.md, and the
report collects them. Subprocesses: each runner defines its own absl flags."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from experiments import common
from tests.oracles import prompt_lookup_oracle


def run(module, *args, timeout=600, env=None):
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                        text=True, timeout=timeout, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def only_run(root, experiment):
  runs = list((root / experiment).iterdir())
  assert len(runs) == 1
  run_dir = runs[0]
  config = json.loads((run_dir / "config.json").read_text())
  rows = [json.loads(l) for l in (run_dir / "rows.jsonl").read_text().splitlines()]
  assert config["experiment"] == experiment and rows
  assert (run_dir / "table.md").read_text().startswith(("|", "#"))
  return run_dir, rows


@pytest.mark.parametrize("module,flag,why", [
    ("batch_invariance", "--lookahead=draft", "runs no look-ahead"),
    ("handoff", "--lookahead_cap=8", "runs no look-ahead"),
    ("handoff", "--selector=nsa", "relays with quest"),
    ("handoff", "--prompt_file=heldout", "over the bundled corpus"),
    ("parity", "--draft_ckpt=head", "runs no look-ahead"),
    ("serve_sweep", "--lookahead=draft", "runs no look-ahead"),
    ("step_time", "--lookahead=draft", "runs no look-ahead"),
    ("trace", "--draft_ckpt=head", "runs no look-ahead"),
    ("prefetch", "--lookahead=draft", "compares its own predictors"),
    ("serve", "--draft_ckpt=head", "drafts by prompt lookup"),
    ("serve", "--lookahead_cap=8", "caps --lookahead=draft"),
    ("generate", "--lookahead_cap=8", "caps --lookahead=draft")])
def test_runners_refuse_the_look_ahead_flags_they_do_not_read(module, flag, why):
  """The look-ahead's flags are shared (experiments/model_setup.py): a runner that
  does not read one refuses it before loading anything, not runs without it (so do
  the selection and text flags a runner does not read)."""
  proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", flag],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and flag.split("=")[0] in proc.stderr, proc.stderr[-2000:]
  assert why in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_bench_decode_smoke(tmp_path):
  variants = ["full_kv", "tiered", "tiered_index_share2", "tiered_overlap",
              "tiered_lookahead", "tiered_fused", "tiered_fused_index_share2"]
  out = run("experiments.bench_decode", "--smoke", f"--out_root={tmp_path}",
            f"--variants={','.join(variants)}")
  _, rows = only_run(tmp_path, "bench_decode")
  assert [r["variant"] for r in rows] == variants
  assert all(r["vs_full_kv"] > 0 for r in rows)
  tiered = next(r for r in rows if r["variant"] == "tiered")
  full = next(r for r in rows if r["variant"] == "full_kv")
  assert tiered["device_MiB"] < full["device_MiB"]
  assert 0.0 <= tiered["miss_rate"] <= 1.0 and full["miss_rate"] is None
  assert "| context |" in out


def test_capacity_tables(tmp_path):
  """At 1M tokens no full-KV request fits (no ratio): the table and the plot are
  still written."""
  run("experiments.capacity", "--measure=false", "--contexts=4096,131072,1048576",
      f"--out_root={tmp_path}")
  out, rows = only_run(tmp_path, "capacity")
  glm = [r for r in rows if r.get("model") == "glm_5_1" and r["table"] == "capacity"
         and r["context"] == 131072 and r["B"] == "2k"]
  assert glm and abs(glm[0]["full_GB"] - 13.09) < 0.1
  assert any(r["table"] == "throughput" and r["speedup"] is None for r in rows)
  # Each model's step reads its own weights (Qwen3-30B-A3B's were GLM-5.1's).
  weights = {r["model"]: r["weight_GB_per_device"] for r in rows if r["table"] == "throughput"}
  assert weights["glm_5_1"] == pytest.approx(750 / 8)
  assert weights["qwen3_30b_a3b"] == pytest.approx(61 / 8)
  assert (out / "table.md").exists() and (out / "plot.png").exists()


def test_capacity_measured_kv_bytes_agree_with_the_formula(tmp_path):
  """The host pool's scratch page (never read) is not the request's: the measured
  host bytes less it are the formula's, and the row says so."""
  run("experiments.capacity", "--measure_layers=2", "--contexts=4096",
      f"--out_root={tmp_path}")
  _, rows = only_run(tmp_path, "capacity")
  measured = next(r for r in rows if r["table"] == "measured")
  assert measured["layers"] == 2 and measured["host_scratch_MiB"] > 0
  assert measured["host_MiB"] - measured["host_scratch_MiB"] == pytest.approx(
      measured["host_formula_MiB"])
  assert measured["kv_agrees"] is True
  # What admission charges for the selector state (whole Quest pages, the ring)
  # is what the runner holds: 2049 positions end a page late.
  assert measured["selector_agrees"] is True
  assert measured["selector_MiB"] == pytest.approx(measured["selector_charged_MiB"])


def test_step_time_reads_the_lru_miss_rate_of_the_pydoc_texts_trace(tmp_path,
                                                                     monkeypatch):
  """The IO model's miss rate comes from the newest miss_rate run on the pydoc
  text's DSA trace: a newer run on the held-out text's trace (whose rate it took
  before, labelled as ours) is passed over; without any, the paper's 13.4%."""
  from experiments import common, step_time
  monkeypatch.setattr(common, "RESULTS", tmp_path)
  assert step_time.latest_lru_miss_rate()[0] == 0.134
  rates = np.random.default_rng().uniform(0.05, 0.2, 2)
  for name, prompt_file, rate in (("20000101-000000", None, rates[0]),
                                  ("20000101-000001", "heldout", rates[1])):
    trace = tmp_path / "trace" / name
    trace.mkdir(parents=True)
    (trace / "config.json").write_text(json.dumps(dict(flags=dict(prompt_file=prompt_file))))
    run_dir = tmp_path / "miss_rate" / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(dict(flags=dict(
        trace=str(trace / "traces.npz")))))
    (run_dir / "rows.jsonl").write_text(json.dumps(dict(
        selector="dsa", policy="lru", B_over_k=2.0, warm=float(rate))) + "\n")
  rate, source = step_time.latest_lru_miss_rate()
  assert rate == rates[0] and "20000101-000000" in source
  # A run's --out_root is where its miss_rate runs are (it read results/ always).
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.setattr(common, "RESULTS", tmp_path / "elsewhere")
  assert step_time.latest_lru_miss_rate()[0] == 0.134
  assert step_time.latest_lru_miss_rate(tmp_path)[0] == rates[0]


def test_step_time_counts_cache_traffic_over_the_timed_steps_only():
  """The warm-up steps right after prefill carry most of the misses: the cache
  counters, like the step time, are the timed steps', per step. A fake runner with
  the reviewer's misses per step (the first two are the warm-up)."""
  code = """
import json
import types
import numpy as np
from absl import flags
from experiments import step_time
MISSES, SELECTED = [224, 114, 34, 18, 34, 2], 256  # per decode step

class Runner:
  tier_cfg = types.SimpleNamespace(row_bytes=384)
  def __init__(self, *args, **kwargs):
    self.steps = 0
  def prefill(self, tokens, lens):
    return np.zeros((1, 8), np.float32)
  def step(self, tokens):
    self.steps += 1
    return np.zeros((1, 8), np.float32)
  def cache_stats(self):  # cumulative since prefill, as the runner's
    misses = sum(MISSES[:self.steps])
    return dict(hits=SELECTED * self.steps - misses, misses=misses,
                miss_rate=misses / (SELECTED * self.steps),
                host_to_device_bytes=3 * misses * 2 * self.tier_cfg.row_bytes)

flags.FLAGS(["step_time", "--steps=4"])
step_time.backends.Runner = Runner
row = step_time.time_backend(None, np.arange(64), "tiered", 16,
                             types.SimpleNamespace(top_k=4), None)
print(json.dumps(row))
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  row = json.loads(proc.stdout.strip().splitlines()[-1])
  timed = 34 + 18 + 34 + 2  # steps 3..6
  assert row["misses_per_token"] == pytest.approx(timed / 4)
  assert row["miss_rate"] == pytest.approx(timed / (4 * 256))
  assert row["useful_kib_per_token"] == pytest.approx(timed * 2 * 384 / 4 / 1024)
  assert row["moved_kib_per_token"] == pytest.approx(3 * row["useful_kib_per_token"])


def test_miss_rate_on_a_small_trace_and_report(tmp_path):
  rng = np.random.default_rng(0)
  trace = np.full((40, 2, 1, 16), -1, np.int16)
  for t in range(40):
    for l in range(2):
      trace[t, l, 0] = rng.choice(np.arange(t, t + 60), 16, replace=False)
  # A top-32 ranking beside it: the selection first, then 16 positions of earlier
  # steps (resident ones: what the rank policy orders its victims by).
  extra = np.full((40, 2, 1, 16), -1, np.int16)
  for t in range(40):
    for l in range(2):
      seen = np.setdiff1d(trace[max(0, t - 3):t, l, 0], trace[t, l, 0])
      seen = seen[seen >= 0]
      extra[t, l, 0, :min(16, seen.size)] = rng.permutation(seen)[:16]
  ranks = np.concatenate([trace, extra], axis=-1)
  path = tmp_path / "traces.npz"
  np.savez_compressed(path, toy=trace, toy_ranks=ranks)
  run("experiments.miss_rate", f"--trace={path}", "--slots_per_k=1,2",
      "--policies=lru,belady,rank", "--warm_after=8", f"--out_root={tmp_path}")
  _, rows = only_run(tmp_path, "miss_rate")
  by = {(r["policy"], r["B"]): r for r in rows}
  assert by[("belady", 32)]["warm"] <= by[("lru", 32)]["warm"] <= by[("lru", 16)]["warm"]
  # "rank" reads the recorded ranking (without it: the selection's row order).
  from experiments import common
  from experiments.analysis import cache_sim
  sel = common.trace_streams(trace)
  want = cache_sim.replay(sel, 32, "rank", ranks=common.trace_streams(ranks))
  assert want.sum() != cache_sim.replay(sel, 32, "rank").sum()  # the ranking matters
  assert by[("rank", 32)]["cold"] == pytest.approx(want.sum() / (sel >= 0).sum())
  # A trace no longer than --warm_after has no warm step: refused (its warm rate
  # read 0 of 0 steps as 0%).
  proc = subprocess.run([sys.executable, "-m", "experiments.miss_rate", f"--trace={path}",
                         "--warm_after=40", f"--out_root={tmp_path / 'refused'}"],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0 and "leaves no step of the 40-step trace" in proc.stderr
  # A newer --smoke run does not replace the full one; a section with only a smoke
  # run shows it, labelled (smoke runs replaced full ones in REPORT.md).
  for experiment in ("miss_rate", "bench_decode"):
    fake = tmp_path / experiment / "29991231-235959"
    fake.mkdir(parents=True)
    (fake / "config.json").write_text(json.dumps(dict(flags=dict(smoke=True))))
    (fake / "table.md").write_text(f"| smoke {experiment} |\n")
  # Table 1 names the pydoc text: a newer trace of the held-out text does not replace
  # its run; a section with no run of its title's text shows another, labelled.
  for name, prompt_file in (("20000101-000000", None), ("20000101-000001", "heldout")):
    trace_run = tmp_path / "trace" / name
    trace_run.mkdir(parents=True)
    (trace_run / "config.json").write_text(json.dumps(dict(flags=dict(
        smoke=False, prompt_file=prompt_file))))
    (trace_run / "table.md").write_text(f"| trace of {prompt_file or 'pydoc'} |\n")
  # A table's own headings go under its section's (## there, ### and below here).
  tiers_run = tmp_path / "tiers" / "20000101-000000"
  tiers_run.mkdir(parents=True)
  (tiers_run / "config.json").write_text(json.dumps(dict(flags=dict(smoke=False))))
  (tiers_run / "table.md").write_text("## Cost\n\n| a |\n\n```\n# kept\n```\n"
                                      "#### Deep\n")
  run("experiments.report", f"--results={tmp_path}")
  report = (tmp_path / "REPORT.md").read_text()
  assert "Table 2" in report and "| toy |" in report
  assert "text: unknown, not the title's" in report  # the toy trace has no config
  assert "| trace of pydoc |" in report and "| trace of heldout |" not in report
  assert "| smoke miss_rate |" not in report and "| smoke bench_decode |" in report
  assert report.count("a `--smoke` run") == 1
  assert "\n### Cost\n" in report and "\n# kept\n" in report and "\n##### Deep\n" in report
  assert "\n## Cost" not in report


def test_runs_started_in_one_second_get_their_own_folders(tmp_path, monkeypatch):
  """Two runs of one experiment in the same second shared a folder (``exist_ok``):
  the second's rows were appended to the first's."""
  import datetime

  from experiments import common

  class Frozen(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
      return cls(2026, 12, 3, 21, 0, 0)

  monkeypatch.setattr(common.datetime, "datetime", Frozen)
  runs = [common.start_run("twice", dict(run=i), str(tmp_path)) for i in range(12)]
  assert [r.name for r in runs[:3]] == ["20261203-210000", "20261203-210000-001",
                                        "20261203-210000-002"]
  assert sorted(runs) == runs  # in start order: "-010" after "-009"
  assert [json.loads((r / "config.json").read_text())["flags"]["run"]
          for r in runs] == list(range(12))


def test_config_json_is_strict_json(tmp_path):
  """A non-finite flag (serve_sweep's default --request_rate=inf) is written as a
  string: Infinity / NaN are not JSON, and readers other than Python's refuse them."""
  flags = dict(request_rate=float("inf"), rates=[1.0, float("nan")], depth=dict(x=-math.inf))
  run = common.start_run("strict", flags, str(tmp_path))
  strict = json.loads((run / "config.json").read_text(),
                      parse_constant=lambda name: pytest.fail(f"{name} in config.json"))
  assert strict["flags"] == dict(request_rate="inf", rates=[1.0, "nan"], depth=dict(x="-inf"))


TRITON_TIMEOUT = """
import importlib.util, json, subprocess, sys
from absl import flags
from experiments import gpu_check

flags.FLAGS(["gpu_check", "--out_dir=" + sys.argv[1]])
importlib.util.find_spec = lambda name: object()  # jax_triton "installed"
printed = "PROBE_ROW " + json.dumps(dict(check="device exact", ok=True, kernel="triton"))

def times_out(cmd, **kwargs):
  raise subprocess.TimeoutExpired(cmd, 180, output=printed.encode() + b"\\n",
                                  stderr=b"timing...")

subprocess.run = times_out
gpu_check.run_triton()
"""


def test_gpu_check_keeps_the_triton_probes_rows_when_it_times_out(tmp_path):
  """The probe's device check prints each row as it is known (its exactness before
  its timing); a probe cut at its limit kept none of them (only stderr's tail)."""
  proc = subprocess.run([sys.executable, "-c", TRITON_TIMEOUT, str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(l) for l in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
  assert rows == [dict(section="triton", check="device exact", ok=True, kernel="triton"),
                  dict(section="triton", error="timed out", tail="timing...")], rows


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_gpu_check_smoke_runs_clean(tmp_path):
  """The device script's smoke path (kernels interpreted): every check passes and no
  section errors, so a rare GPU loan is not spent on a harness bug. Left out to keep
  the suite short: the io section (step-time variants, 35 s here; it ran clean on
  the H200 twice), the serve section (20 s; serve_sweep with the script's model,
  whose own smoke is in test_experiments_serving.py) and the fused section's tests
  (the suite runs them itself; the numerics section exercises the same harness).
  The fused section's smoke times one variant per kernel path and only builds the
  configs of the others (the suite tests their steps)."""
  run("experiments.gpu_check", "--smoke", f"--out_dir={tmp_path}", "--budget_s=600",
      "--sections=fused,numerics,lookups,triton,sampler", "--numerics_filter=zero_copy",
      "--nofused_tests", "--warmup=1", "--iters=2")
  rows = [json.loads(l) for l in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
  assert not [r for r in rows if "error" in r]
  assert all(r["ok"] for r in rows if "ok" in r)
  numerics = [r["test"] for r in rows if r["section"] == "numerics" and "test" in r]
  assert len(numerics) == 2 and all("zero_copy" in t for t in numerics)
  timed = {r["variant"] for r in rows if r["section"] == "timing" and "median_ms" in r}
  assert {"full_kv", "tiered", "tiered_fused", "tiered_overlap_fetch_stream_1",
          "full_kv_again"} <= timed
  assert all(r["full_kv_drift"] > 0 for r in rows if r.get("variant") == "full_kv_again")
  built = {r["variant"] for r in rows if r.get("config") == "valid"}
  assert {"tiered_fused_xla_attention", "tiered_fused_index_share_2", "tiered_fused_rank",
          "tiered_overlap", "tiered_sliced_inputs", "tiered_fused_sliced_inputs"} <= built
  lookups = next(r for r in rows if r.get("op") == "resolve_lookups")
  assert all(v for k, v in lookups.items() if k.endswith("_exact"))
  sampler = [r for r in rows if r["section"] == "sampler"]
  assert len(sampler) == 10 and all(r.get("same_tokens", True) for r in sampler)
  assert sum("same_tokens" in r for r in sampler) == 6  # the window and ranked kinds
  # Off GPU the triton section says why it did not time (no jax-triton, or no GPU).
  assert [r for r in rows if r["section"] == "triton" and "skipped" in r], rows
  # Past --deadline_s the subprocess sections are skipped, not started (the device
  # tool kills a command at 600 s).
  late = tmp_path / "late"
  run("experiments.gpu_check", "--smoke", f"--out_dir={late}", "--deadline_s=1",
      "--sections=serve,graphs")
  rows = [json.loads(l) for l in (late / "gpu_check.jsonl").read_text().splitlines()]
  assert {r["section"] for r in rows if "skipped" in r} == {"serve", "graphs"}, rows
  assert not [r for r in rows if "error" in r]


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_gpu_check_serve_section_returns_its_files_within_the_device_limits(tmp_path):
  """The device tool returns at most 8 files, no deeper than two folders under
  $OUT: the serve section's run (its table, points, requests) comes back as one
  archive beside gpu_check.jsonl, its points also as rows there."""
  import tarfile  # noqa: PLC0415
  run("experiments.gpu_check", "--smoke", f"--out_dir={tmp_path}", "--sections=serve")
  files = [p for p in tmp_path.rglob("*") if p.is_file()]
  assert len(files) <= 8 and all(len(p.relative_to(tmp_path).parts) <= 3 for p in files)
  rows = [json.loads(l) for l in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
  assert not [r for r in rows if "error" in r], rows
  points = [r for r in rows if r["section"] == "serve" and "cache" in r]
  with tarfile.open(tmp_path / "serve_sweep.tar.gz") as tar:
    names = tar.getnames()
    archived = tar.extractfile(next(n for n in names if n.endswith("/points.jsonl")))
    assert len(archived.read().decode().splitlines()) == len(points) > 0
  assert any(n.endswith("/table.md") for n in names)


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_trace_smoke_records_rankings(tmp_path):
  """Best-first selectors also store a top-m ranking that starts with the selection."""
  run("experiments.trace", "--smoke", "--selectors=quest,oracle,nsa",
      f"--out_root={tmp_path}")
  run_dir, rows = only_run(tmp_path, "trace")
  data = np.load(run_dir / "traces.npz")
  for name in ("quest", "oracle"):
    sel, ranks = data[name], data[f"{name}_ranks"]
    assert ranks.shape[-1] > sel.shape[-1] == 256
    np.testing.assert_array_equal(ranks[..., :sel.shape[-1]], sel)
  assert "nsa_ranks" not in data.files
  assert {r["selector"]: r["k"] for r in rows} == {"quest": 256, "oracle": 256, "nsa": 320}
  # The shared flags it would record and not read: refused.
  for flag in ("--selector=oracle", "--impl=pallas"):
    proc = subprocess.run([sys.executable, "-m", "experiments.trace", "--smoke", flag,
                           f"--out_root={tmp_path / 'ignored'}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode and f"{flag.split('=')[0]}: this runner" in proc.stderr
  # The draft's picks (--draft, the default): each step's draft is the prompt lookup
  # over the prompt and the tokens fed so far; where it was the next token, its
  # picks are the next step's selection (the same position, the same context).
  tokens, drafts, prompt = data["tokens"], data["draft_tokens"], int(data["prompt_tokens"])
  steps = drafts.shape[0]
  assert [int(d) for d in drafts] == [
      prompt_lookup_oracle(tokens[:prompt + t + 1].tolist())[0] for t in range(steps)]
  right = [t for t in range(steps - 1) if drafts[t] == tokens[prompt + t + 1]]
  assert right and len(right) < steps - 1
  assert common.trace_names(data) == ["quest", "oracle", "nsa"]
  for name in ("quest", "oracle", "nsa"):
    sel, drafted = data[name], data[f"{name}_drafted"]
    assert drafted.shape == sel.shape
    assert (drafted.max(axis=(1, 2, 3)) <= prompt + np.arange(steps)).all()
    for t in right:
      for idx in np.ndindex(*sel.shape[1:3]):
        assert set(drafted[t][idx].tolist()) == set(sel[t + 1][idx].tolist()), (name, t)


def test_tiers_table_and_its_model(tmp_path):
  """experiments.tiers against the roofline it builds on: the link-bound batch is
  where the exposed miss IO equals the HBM reads; costs are the system's price over
  its lifetime per request and per token; more HBM per request, fewer requests."""
  import math

  from models import capacity, tiers
  from models.config import ModelConfig
  out = run("experiments.tiers", f"--out_root={tmp_path}", "--contexts=131072")
  run_dir, rows = only_run(tmp_path, "tiers")
  assert (run_dir / "plot.png").stat().st_size > 0 and out.splitlines()[-1].startswith(
      "tiers: context=131072 ddr5_usd_per_mtok=")
  cfg, acc = ModelConfig.from_name("glm_5_1"), tiers.Accelerator()
  ddr5 = tiers.TIERS["ddr5"]
  rng = np.random.default_rng()
  miss = float(rng.uniform(0.15, 0.3))  # a link-bound batch exists at 128K
  link = ddr5.miss_bandwidth(cfg.kv_bytes_per_token_per_layer)
  n = tiers.link_bound_batch(cfg, acc, link, miss, context=131072)
  model = capacity.ThroughputModel(link_bandwidth=link, weight_bytes=acc.weight_bytes)
  read = cfg.num_layers * (cfg.top_k * cfg.kv_bytes_per_token_per_layer
                           + 131072 * cfg.selector_bytes_per_token_per_layer)
  step = lambda m: model.step_seconds(cfg, 1, m, context=131072)
  io = step(miss) - step(None)
  assert math.isfinite(n) and math.isclose(
      n * io, acc.weight_bytes / acc.hbm_bandwidth + n * read / acc.hbm_bandwidth,
      rel_tol=1e-9)
  row = tiers.placement(cfg, 131072, acc, ddr5, hot_slots=2 * cfg.top_k, miss_rate=miss)
  b = capacity.request_bytes(cfg, 131072, 2 * cfg.top_k)
  assert row["requests"] == min(acc.max_batch, int(acc.kv_budget_gb * 1e9 // b.tiered_device))
  system = acc.usd + row["requests"] * b.host / 1e9 * ddr5.usd_per_gb
  assert math.isclose(row["usd_per_request"], system / row["requests"])
  tok_s = model.tokens_per_second(cfg, row["requests"], miss, context=131072)
  assert math.isclose(row["usd_per_mtok"],
                      system / (acc.years * 365 * 24 * 3600) / tok_s * 1e6, rel_tol=1e-9)
  full = tiers.placement(cfg, 131072, acc, None, hot_slots=2 * cfg.top_k, miss_rate=miss)
  assert full["requests"] == int(acc.kv_budget_gb * 1e9 // b.full_device) < row["requests"]
  assert {r["placement"] for r in rows if r["table"] == "placement"} >= {
      "HBM (full KV)", "HBM hot + host DDR5", "HBM hot + CXL DDR4 (Vistara)"}


def test_shared_prefix_workload_groups_share_exactly_their_system_prompt():
  from experiments import workloads
  rng = np.random.default_rng()
  stream = rng.integers(0, 1000, 5000)
  for _ in range(100):  # two groups may draw the same window (~7 draws in 10000)
    specs = workloads.shared_prefix(stream, rng, 40, 3, 100, (16, 64), (2, 5),
                                    arrivals=np.arange(40.0))
    if len({s.prompt[:100] for s in specs}) == len({s.id.split("-")[0] for s in specs}):
      break
  groups = {}
  for spec in specs:
    group = spec.id.split("-")[0]
    groups.setdefault(group, []).append(spec.prompt)
    assert 116 <= len(spec.prompt) <= 164 and 2 <= spec.max_new_tokens <= 5
  assert 1 < len(groups) <= 3 and [s.arrival_s for s in specs] == list(range(40))
  for prompts in groups.values():
    assert all(p[:100] == prompts[0][:100] for p in prompts)
  firsts = [prompts[0][:100] for prompts in groups.values()]
  assert len(set(firsts)) == len(firsts)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_warm_up_loads_a_cached_prefix_when_the_engine_caches_prefixes(prefix_cache):
  """The measured run then compiles nothing on its first prefix hit, nor its
  log-probabilities."""
  from experiments import workloads
  from kvtier_jax.serving import Engine, EngineConfig, SamplingParams, sampling
  from kvtier_jax.serving.bench import RequestSpec, drive
  from tests.test_serving import VOCAB, FakeModel

  loads = []

  class CountingModel(FakeModel):
    def load_prefix(self, state, slot, length):
      loads.append(length)
      return super().load_prefix(state, slot, length)

  model = CountingModel(hot_slots=0)  # every position in host pages
  engine = Engine(model, EngineConfig(max_step_tokens=20, prefix_cache=prefix_cache))
  prompt = tuple(np.random.default_rng().integers(0, VOCAB - 1, 30).tolist())
  workloads.warm_up(engine, RequestSpec("r", prompt, 4), model.chunk_size)
  assert loads == ([model.chunk_size] if prefix_cache else [])
  assert all(r.state.value == "finished" for r in engine.requests.values())
  # Nor does it compile log-probabilities, raw or processed, at any N.
  compiled = sampling.logprobs._cache_size()
  for i, mode in enumerate(("raw", "processed", "raw")):
    drive(Engine(CountingModel(hot_slots=0)), [RequestSpec(
        f"m{i}", prompt, 3, sampling=SamplingParams(logprobs=3 * i, logprobs_mode=mode))])
  assert sampling.logprobs._cache_size() == compiled


def test_pdd_smoke(tmp_path):
  out = run("experiments.pdd", "--smoke", f"--out_root={tmp_path}")
  run_dir, rows = only_run(tmp_path, "pdd")
  assert {r["study"] for r in rows} == {"fit", "microbenchmark", "ttft", "bandwidth"}
  # The TTFT study's rate offers the load asked (0.85 of what the WAN carries),
  # measured on the trace that runs; handoff times average real handoffs only.
  for row in (r for r in rows if r["study"] == "ttft"):
    assert abs(row["wan_load"] - 0.85) < 0.05, row
    if row["catch_up"] + row["one_shot"]:
      assert row["mean_handoff_s"] > 0
  assert (run_dir / "plot.png").stat().st_size > 0
  last = out.strip().splitlines()[-1]
  assert last.startswith("pdd: skewed_p50=") and "ttft_p90_cut=" in last
  # The fitted input is the probe nearest the paper's P50, and was measured.
  probes = [r for r in rows if r["study"] == "fit"]
  skewed = next(r for r in rows if r.get("distribution") == "skewed")
  nearest = min(probes, key=lambda r: abs(r["transfer_p50_s"] - 0.248))
  assert skewed["mean_input"] == nearest["mean_input"]
  assert skewed["transfer_p50_s"] == nearest["transfer_p50_s"]


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_policies_learns_on_one_trace_and_reports_on_another(tmp_path):
  """The learned key is trained on --train_trace and reported on --trace only; the
  same file for both is refused."""
  from experiments.analysis import cache_sim, learned_policy

  def save(name, seed):
    sel, _ = cache_sim.synthetic_trace(seed, streams=4, steps=48, k=16, context=768,
                                       facts=64)
    trace = np.moveaxis(sel.reshape(2, 2, 48, 16), 2, 0).astype(np.int16)
    # A draft that names the next step's selection (right at every step).
    drafted = np.concatenate([trace[1:], np.full_like(trace[:1], -1)])
    np.savez_compressed(tmp_path / name, toy=trace, toy_drafted=drafted)
    return tmp_path / name

  train, heldout = save("train.npz", 0), save("heldout.npz", 1)
  out = run("experiments.policies", f"--trace={heldout}", f"--train_trace={train}",
      "--slots_per_k=2,1.5", "--horizons=4,16", "--learned_steps=60", "--per_capacity",
      "--ghosts=0.5", f"--out_root={tmp_path}")
  run_dir, rows = only_run(tmp_path, "policies")
  training = [r for r in rows if r.get("table") == "learned_training"]
  assert sorted(r["horizon"] for r in training) == [4, 16]
  report = {r["policy"]: r for r in rows if "policy" in r and r["B_over_k"] == 2}
  assert report.keys() == {*cache_sim.POLICIES, "learned"} - {"foresight"}
  foresight = [r for r in rows if r.get("table") == "foresight"]
  assert [r["selector"] for r in foresight] == ["toy"]
  assert foresight[0]["h0"] == pytest.approx(report["rank"]["gap_closed"], rel=1e-12)
  assert set(foresight[0]) == {"table", "selector", "h0", "h1", "h2", "h4", "h8"}
  assert "exact foresight that reaches 50%: " in out
  assert report["belady"]["miss_rate"] <= report["learned"]["miss_rate"]
  model = learned_policy.KeyModel.load(run_dir / "learned_toy.npz")
  assert model.horizon in (4, 16) and model.uses == learned_policy.BASE_FEATURES
  assert model.loss == "pairwise"  # the default
  slot = learned_policy.KeyModel.load(run_dir / "learned_slot_features_toy.npz")
  assert slot.uses == learned_policy.SLOT_FEATURES and slot.horizon == model.horizon
  assert [r["table"] for r in rows if "slot_features_only" in r] == ["learned_slot_features"]
  sel = np.load(heldout)["toy"]
  # The ghost-bounded key (--ghosts=0.5: G = 16 of 32 slots) runs with its bound.
  ghosts = learned_policy.KeyModel.load(run_dir / "learned_toy_ghosts0.5B.npz")
  assert ghosts.history == 16 and ghosts.horizon == model.horizon and model.history is None
  streams = np.moveaxis(sel.astype(np.int64), 0, 2).reshape(4, 48, 16)
  bounds = {p: cache_sim.replay(streams, 32, p).sum() for p in ("lru", "belady")}
  got = cache_sim.replay(streams, 32, "learned", key_fn=ghosts, history=16).sum()
  ablation = next(r for r in rows if r.get("table") == "learned_slot_features")
  assert ablation["ghosts_0.5B"] == pytest.approx(
      (bounds["lru"] - got) / (bounds["lru"] - bounds["belady"]), rel=1e-12)
  # The key that reads the draft's picks, reported with the held-out trace's.
  drafting = learned_policy.KeyModel.load(run_dir / "learned_toy_with_draft.npz")
  assert drafting.uses == learned_policy.FEATURES and drafting.horizon == model.horizon
  drafted = np.load(heldout)["toy_drafted"]
  got = cache_sim.replay(streams, 32, "learned", key_fn=drafting,
                         drafted=np.moveaxis(drafted.astype(np.int64), 0, 2).reshape(
                             4, 48, 16)).sum()
  assert ablation["with_draft"] == pytest.approx(
      (bounds["lru"] - got) / (bounds["lru"] - bounds["belady"]), rel=1e-12)
  assert (f"learned with the draft's next-step picks (a two-token step): "
          f"{ablation['with_draft']:.0%}") in out
  got = cache_sim.replay(np.moveaxis(sel.astype(np.int64), 0, 2).reshape(4, 48, 16), 32,
                         "learned", key_fn=model).sum()
  assert report["learned"]["miss_rate"] == got / (sel >= 0).sum()
  # At 1.5k the key trained at 1.5k (the 2k horizon) is the one reported.
  tight = learned_policy.KeyModel.load(run_dir / "learned_toy_B1.5k.npz")
  assert tight.horizon == model.horizon
  got = cache_sim.replay(np.moveaxis(sel.astype(np.int64), 0, 2).reshape(4, 48, 16), 24,
                         "learned", key_fn=tight).sum()
  assert next(r["miss_rate"] for r in rows if r.get("policy") == "learned"
              and r["B_over_k"] == 1.5) == got / (sel >= 0).sum()
  proc = subprocess.run([sys.executable, "-m", "experiments.policies", f"--trace={train}",
                         f"--train_trace={train}", f"--out_root={tmp_path}"],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0 and "same file" in proc.stderr
  # Two runs' traces of one text (their config.json say so): refused too.
  for name in ("a", "b"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "traces.npz").write_bytes(train.read_bytes())
    (tmp_path / name / "config.json").write_text(json.dumps(
        dict(flags=dict(prompt_file="heldout", smoke=False))))
  proc = subprocess.run([sys.executable, "-m", "experiments.policies",
                         f"--trace={tmp_path / 'a' / 'traces.npz'}",
                         f"--train_trace={tmp_path / 'b' / 'traces.npz'}",
                         f"--out_root={tmp_path}"], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode != 0 and "same text" in proc.stderr


def test_the_probe_kernels_pallas_twin_is_the_numpy_reference():
  """The device check times the Triton-language probe kernel against this twin:
  in interpret mode it writes each row's misses (positions and host rows) in
  selection order and counts them, as the numpy reference does."""
  from experiments import triton_probe_twin as twin
  seed = int(np.random.SeedSequence().entropy % 2**31)
  sel, slot_of, host = twin.draw_inputs(np.random.default_rng(seed), 5, 32, 128, 16)
  pos = np.full(sel.shape, -7, np.int32)
  want = twin.reference(sel, slot_of, host, pos, np.full((5, 32, 16), np.nan, np.float32))
  got = twin.miss_fetch_pallas(sel, slot_of, host, interpret=True)
  assert want[2][0] > 0 and twin.written_lanes_match(got, want), seed
  # The comparison is not blind: a row's misses in another order fail it.
  pos_got = np.asarray(got[0]).copy()
  row = int(np.argmax((want[0] != -7).sum(1)))
  pos_got[row, :2] = pos_got[row, 1::-1]
  assert not twin.written_lanes_match((pos_got, got[1], got[2]), want), seed


def test_triton_probe_checks_a_triton_kernel_without_a_gpu(tmp_path):
  """Needs ``.[triton]`` (~1 GB; not in CI, which skips this): the Triton-language
  kernel run by Triton's interpreter against numpy, and lowered for sm_90 with its
  host operand zero-copy."""
  pytest.importorskip("triton")
  pytest.importorskip("jax_triton")
  run("experiments.triton_probe", f"--out_root={tmp_path}", "--rows=3", "--top_k=16")
  _, rows = only_run(tmp_path, "triton_probe")
  by_check = {r["check"]: r for r in rows}
  assert all(r["ok"] for r in rows) and "interpret" in by_check
  if "lower" in by_check:  # the twin compiles for sm_90 too, host rows in place
    assert by_check["pallas twin"]["whole_host_copies"] == 0
  assert by_check["interpret"]["misses"] > 0
  if "lower" in by_check:
    assert by_check["lower"]["whole_host_copies"] == 0
    assert by_check["lower"]["triton_calls"] == 1
