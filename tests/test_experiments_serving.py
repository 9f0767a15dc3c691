"""The serving runners' --smoke paths (serve, serve_sweep, sessions with the prefix
cache): real SmolLM2 weights, exactness checked through the CLI. A file of its own
so the test workers split the experiment smokes (each is a subprocess of ~1 min)."""

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.test_experiments import only_run, run
from tests.util import SMOKE_LAYERS, default_codegen_env


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_serve_smoke_requests_and_sessions_with_the_prefix_cache_are_exact(tmp_path):
  """A JSONL workload served by the tiered engine with the prefix cache: independent
  requests (text and token-id prompts, staggered arrivals) and session turns, whose
  later turns hit the earlier prompt's chunks, over a 2 x 2 device mesh (requests and
  KV heads), admitted longest cached prefix first. --check_exact decodes each
  request's full prompt alone with the sparse backend on one device: every one must
  match."""
  from pydoc_data.topics import topics
  words, more = topics["assert"].split(), topics["import"].split()
  workload = tmp_path / "requests.jsonl"
  workload.write_text("\n".join(json.dumps(r) for r in [
      dict(id="text", prompt=" ".join(words[:90]), max_new_tokens=4),
      dict(id="ids", prompt_ids=list(range(1000, 1150)), max_new_tokens=5, arrival_s=0.5,
           logprobs=3),
      dict(id="short", prompt_ids=[42] * 20, max_new_tokens=3, arrival_s=1.0),
      dict(id="a1", session="a", append=" ".join(more[:110]), max_new_tokens=4),
      dict(id="a2", session="a", append=" ".join(more[110:125]), max_new_tokens=4),
      dict(id="a3", session="a", append=" ".join(more[125:130]), max_new_tokens=3),
  ]) + "\n")
  # Over a data:2 x model:2 mesh of fake CPU devices (requests over 2 rows, each with
  # its own host tier; SmolLM2's KV heads padded 3 -> 4 over 2 devices per row), so
  # the mesh path serves the prefix cache too; --check_exact runs on one device.
  out = run("experiments.serve", "--smoke", f"--model_layers={SMOKE_LAYERS}",
            "--prefix_cache", "--schedule=lpm", "--check_exact",
            "--mesh=data:2,model:2", f"--workload={workload}", f"--out_root={tmp_path}")
  last = out.strip().splitlines()[-1]
  pattern = (r"serve: cache=tiered requests=(\d+) output_tokens=\d+ throughput=[\d.e+-]+ "
             r"tok/s ttft_p50=[\d.e+-]+ s ttft_p99=[\d.e+-]+ s tpot_p50=[\d.e+-]+ ms "
             r"max_concurrency=\d+ prefill_tokens=\d+ exact=(\d+)/(\d+) "
             r"prefix_hit=([\d.e+-]+)")
  match = re.fullmatch(pattern, last)
  assert match, last
  requests, matched, finished = map(int, match.groups()[:3])
  assert matched == finished == requests == 6
  run_dir, rows = only_run(tmp_path, "serve")
  assert rows[0]["misses"] > 0  # contexts past the hot cache fetched from the host
  # Session turns 2 and 3 reuse turn 1's whole chunks; the others share nothing.
  assert rows[0]["prefix_hit"] > 0.15 and rows[0]["hit_p90"] > 0.5
  assert rows[0]["prefill_tokens"] < rows[0]["prompt_tokens"]
  served = {r["id"]: r for r in map(json.loads,
                                     (run_dir / "requests.jsonl").read_text().splitlines())}
  assert len(served) == requests
  ids = served["ids"]  # its log-probabilities: one entry per output, the 3 best
  assert len(ids["output_ids"]) == len(ids["logprobs"]) == len(ids["top_logprobs"]) == 5
  for token, chosen, top in zip(ids["output_ids"], ids["logprobs"], ids["top_logprobs"]):
    assert len(top) == 3 and top[0][0] == token and top[0][1] == chosen <= 0  # greedy
  assert "logprobs" not in served["text"]
  assert json.loads((run_dir / "config.json").read_text())["flags"]["schedule"] == "lpm"
  assert "mesh={'data': 2, 'model': 2}" in out
  # XLA kept every layout. The prefill compiles once per mesh row (its own devices):
  # the staging buffer is placed as a prefill chunk returns it (placed replicated,
  # each row's first chunk compiled it a second time: 4).
  assert "mesh: 0 per-slot outputs re-placed, 2 prefill compile(s) serving" in out, [
      line for line in out.splitlines() if line.startswith("mesh")]


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_the_serving_runners_serve_a_row_tiled_model(tmp_path):
  """``--decode_row_tile`` (the shared model flag) reaches the model each serving
  runner builds: serve's real SmolLM2, checked request by request against the sparse
  backend alone (one slot: with the tile, the same logits bits), and serve_sweep's
  dummy preset; each summary row records the tile it served."""
  out = run("experiments.serve", "--smoke", f"--model_layers={SMOKE_LAYERS}",
            "--decode_row_tile=8", "--check_exact", f"--out_root={tmp_path}")
  assert out.strip().splitlines()[-1].endswith("exact=4/4 prefix_hit=0"), out[-500:]
  _, rows = only_run(tmp_path, "serve")
  assert rows[0]["decode_row_tile"] == 8 and rows[0]["misses"] > 0
  run("experiments.serve_sweep", "--smoke", "--model=smollm2_135m", "--model_layers=2",
      "--decode_row_tile=8", "--sampling=temperature=1,top_k=20", f"--out_root={tmp_path}")
  _, rows = only_run(tmp_path, "serve_sweep")
  assert {(r["cache"], r["decode_row_tile"], r["weights"]) for r in rows} == {
      ("sparse", 8, "dummy"), ("tiered", 8, "dummy")}
  assert next(r for r in rows if r["cache"] == "tiered")["same_tokens"] == "3/3"


@pytest.mark.slow  # end to end in a subprocess: CI runs it (--runslow)
def test_serve_with_the_look_ahead_is_exact_and_fetches_ahead(tmp_path):
  """``serve --lookahead=draft``: every request (sampled: ``--sampling``) checked
  against the sparse backend alone (which runs no look-ahead), and the summary
  counts the rows fetched ahead apart from the misses left on the steps."""
  out = run("experiments.serve", "--smoke", f"--model_layers={SMOKE_LAYERS}",
            "--lookahead=draft", "--sampling=temperature=0.8,top_p=0.9", "--check_exact",
            f"--out_root={tmp_path}")
  assert out.strip().splitlines()[-1].endswith("exact=4/4 prefix_hit=0"), out[-500:]
  _, rows = only_run(tmp_path, "serve")
  assert rows[0]["lookahead"] == "draft"
  assert rows[0]["prefetched"] > 0


def test_serve_sweep_smoke_more_requests_at_the_same_budget_and_exact(tmp_path):
  """sparse vs tiered at one device budget on SmolLM2: the tiered engine admits and
  runs more requests at once, and every request's tokens equal the sparse run's. On
  XLA:CPU's default codegen, as the README's main job runs (the suite's other
  tests compile with the faster elemental emitters)."""
  # 4 MiB holds one sparse request of the cut model (bound by the device) and all
  # three tiered ones (bound by the slots).
  out = run("experiments.serve_sweep", "--smoke", f"--model_layers={SMOKE_LAYERS}",
            "--kv_budget_mib=4", f"--out_root={tmp_path}", env=default_codegen_env())
  run_dir, rows = only_run(tmp_path, "serve_sweep")
  by = {r["cache"]: r for r in rows}
  assert by.keys() == {"sparse", "tiered"}
  assert {r["num_layers"] for r in rows} == {SMOKE_LAYERS}  # a cut model says so
  assert f"SmolLM2-135M (its first {SMOKE_LAYERS} layers)" in out
  sparse, tiered = by["sparse"], by["tiered"]
  assert sparse["finished"] == tiered["finished"] == 3
  assert tiered["admissible"] > sparse["admissible"] and sparse["bound_by"] == "device"
  assert tiered["peak_concurrency"] > sparse["peak_concurrency"]
  assert tiered["same_tokens"] == "3/3" and tiered["misses"] > 0
  assert tiered["peak_host_mib"] > 0 == sparse["peak_host_mib"]
  assert (run_dir / "plot.png").stat().st_size > 0
  assert "Published (author-reported)" in out and "| 192 | 3 | tiered |" in out


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_serve_sweep_pairs_prompts_across_rates_and_refuses_flags_it_would_ignore(
    tmp_path):
  """Runs that differ only in --request_rate or --burstiness serve the same prompts
  (the arrivals drew from the prompts' generator, so a finite rate changed them); a
  JSONL workload refuses the synthetic flags (it ignored them) and the prompt-text
  flags (the corpus is bundled); so do serve's JSONL and session workloads, and a
  synthetic one the rollout's."""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  code = """
import numpy as np
from absl import flags
from experiments import serve_sweep
F = flags.FLAGS
def workload(*args):
  F.unparse_flags()
  F(["serve_sweep", *args])
  w = serve_sweep.make_workload(1024, np.arange(100000) % 5000, None,
                                np.random.default_rng(F.seed), None)
  return [r.prompt for r in w], [r.arrival_s for r in w]
(a, ta), (b, tb), (c, tc) = (workload(), workload("--request_rate=4"),
                             workload("--request_rate=4", "--burstiness=0.5"))
assert a == b == c, "prompts differ between rates"
assert max(ta) == 0 < max(tb) and tb != tc
print("paired")
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and "paired" in proc.stdout, proc.stderr[-3000:]
  path = tmp_path / "w.jsonl"
  path.write_text(json.dumps(dict(id="a", prompt_ids=[5, 6, 7], max_new_tokens=2)) + "\n")
  for runner, flags in (
      ("serve_sweep", (f"--workload={path}", "--request_rate=2")),
      ("serve_sweep", (f"--workload={path}", "--num_requests=4")),
      ("serve_sweep", (f"--workload={path}", "--contexts=4096")),
      ("serve_sweep", (f"--workload={path}", "--prompt_file=heldout")),
      ("serve_sweep", (f"--workload={path}", "--output_len=8")),
      ("serve_sweep", ("--rollout_turns=2",)),
      ("serve", (f"--workload={path}", "--seed=3")),
      ("serve", ("--sessions=skewed", "--request_rate=2")),
      ("serve", ("--session_turns=2",))):
    proc = subprocess.run([sys.executable, "-m", f"experiments.{runner}", *flags,
                           f"--out_root={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not used by this workload" in proc.stderr, (
        runner, flags, proc.stderr[-2000:])


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_serve_stops_at_a_snapshot_and_another_process_goes_on_exactly(tmp_path):
  """``--snapshot_at_step`` saves the engine mid-run (requests in flight, waiting or
  not yet sent: which, depends on this machine's speed, the arrivals being in
  seconds); a second process ``--restore``s it with the same flags, sends the rest
  on their schedule and every request's tokens equal its solo run
  (``--check_exact``)."""
  common = ("--smoke", f"--model_layers={SMOKE_LAYERS}", "--request_rate=2",
            f"--out_root={tmp_path}")
  snap = tmp_path / "snap"
  out = run("experiments.serve", *common, "--snapshot_at_step=6",
            f"--snapshot_dir={snap}")
  line = next(l for l in out.splitlines() if l.startswith("snapshot:"))
  match = re.fullmatch(r"snapshot: step 6, requests \{(.*)\}, (\d+) not sent yet; "
                       r"saved to (.*)", line)
  assert match and match.group(3) == str(snap), line
  states = dict(re.findall(r"'(\w+)': (\d+)", match.group(1)))
  assert int(match.group(2)) + sum(int(n) for s, n in states.items()
                                   if s != "finished") > 0, line  # work is left
  last = run("experiments.serve", *common, f"--restore={snap}",
             "--check_exact").strip().splitlines()[-1]
  # Its row covers the window since the restore: the requests not finished at the
  # snapshot; every request's tokens are checked.
  window = 4 - int(states.get("finished", 0))
  assert re.search(rf"requests={window} .* exact=4/4 ", last), last


def test_workload_files_refuse_ids_and_counts_that_are_not_integers(tmp_path):
  """``load_jsonl`` keeps integer ids as given and refuses a float (int() would
  truncate 1.9 into the id 1), sampling ``SamplingParams.check`` refuses, or a
  session turn's stop ids (a Rollout has none), naming the line."""
  from experiments import workloads  # noqa: PLC0415
  path = tmp_path / "w.jsonl"
  good = [dict(id="a", prompt_ids=[5, 6, 7], max_new_tokens=2, stop_ids=[9], top_k=3,
               logprobs=4, logprobs_mode="processed"),
          dict(id="s1", session="s", append_ids=[1, 2], max_new_tokens=3),
          dict(id="s2", session="s", append_ids=[4], max_new_tokens=1)]
  path.write_text("\n".join(map(json.dumps, good)) + "\n")
  spec, session = workloads.load_jsonl(path, tokenizer=None)
  assert (spec.prompt, spec.max_new_tokens, spec.stop_ids) == ((5, 6, 7), 2, (9,))
  assert (spec.sampling.top_k, spec.sampling.logprobs) == (3, 4)
  assert spec.sampling.logprobs_mode == "processed"
  assert (session.sampling.logprobs, session.sampling.logprobs_mode) == (None, "raw")
  assert (session.prompt, session.max_new_tokens, session.env_tokens) == (
      (1, 2), (3, 1), ((4,),))
  for change, match in ((dict(prompt_ids=[5, 6.9]), "prompt_ids"),
                        (dict(max_new_tokens=2.5), "max_new_tokens"),
                        (dict(stop_ids=[1.9]), "stop_ids"), (dict(stop_ids=3), "stop_ids"),
                        (dict(top_k=2.5), "top_k"), (dict(seed="1"), "seed"),
                        (dict(logprobs=1.0), "logprobs"), (dict(logprobs=21), "logprobs"),
                        (dict(logprobs_mode="processed_logprobs"), "logprobs_mode")):
    path.write_text(json.dumps(dict(good[0], **change)) + "\n")
    with pytest.raises(ValueError, match=f"w.jsonl:1: {match}"):
      workloads.load_jsonl(path, tokenizer=None)
  path.write_text(json.dumps(dict(good[1], stop_ids=[9])) + "\n")
  with pytest.raises(ValueError, match="w.jsonl:1: a session turn takes no stop_ids"):
    workloads.load_jsonl(path, tokenizer=None)


def test_sampling_flags_parse_into_checked_params_and_sample_every_request():
  """``--sampling`` pairs become ``SamplingParams`` of the right types (checked:
  out-of-range values, unknown keys and values of another type are refused), and
  ``sampled`` gives every request and trajectory those params, keeping the rest."""
  from experiments import workloads  # noqa: PLC0415
  from kvtier_jax.serving import SamplingParams, bench  # noqa: PLC0415
  got = workloads.parse_sampling(["temperature=1", "top_k=40", "top_p=0.95", "seed=7",
                                  "logprobs=2", "logprobs_mode=processed"])
  assert got == SamplingParams(1.0, 40, 0.95, 7, 2, "processed")
  assert [type(v) for v in dataclasses.astuple(got)] == [float, int, float, int, int, str]
  assert workloads.parse_sampling([]) == SamplingParams()
  for bad, match in ((["top_p=0"], "top_p"), (["temp=1"], "key one of"),
                     (["top_k=2.5"], "not of type int"), (["temperature"], "key=value"),
                     (["logprobs_mode=best"], "logprobs_mode")):
    with pytest.raises(ValueError, match=match):
      workloads.parse_sampling(bad)
  work = [bench.RequestSpec("r", (1, 2), 3, 0.5, stop_ids=(9,)),
          bench.Rollout("t", (1, 2), (3, 4), ((5,),))]
  out = workloads.sampled(work, got)
  assert [w.sampling for w in out] == [got, got]
  assert out[0] == dataclasses.replace(work[0], sampling=got)
  assert out[1] == dataclasses.replace(work[1], sampling=got)


@pytest.mark.slow  # end to end in a subprocess: CI runs it (--runslow)
def test_batch_invariance_runner_tiled_logits_are_the_same_bits_at_every_slot_count(
    tmp_path):
  """``experiments.batch_invariance`` on SmolLM2's first layers: the tiled model's
  request decodes to the same bits on engines of 1, 3 and 5 slots (random others
  beside it, drawn from a fresh seed), and the step timing rows are written."""
  seed = int(np.random.default_rng().integers(2**31))
  out = run("experiments.batch_invariance", f"--model_layers={SMOKE_LAYERS}",
            "--prompt_tokens=150", "--top_k=32", "--slots=1,3,5", "--batch=1,4",
            "--iters=3", "--time_prompt_tokens=64", f"--seed={seed}",
            f"--out_root={tmp_path}")
  last = out.strip().splitlines()[-1]
  assert re.fullmatch(r"batch_invariance: tiled_max_abs_diff=0 untiled_max_abs_diff=\S+ "
                      r"step_ratio=[0-9.]+/[0-9.]+", last), last
  _, rows = only_run(tmp_path, "batch_invariance")
  tiled = [r for r in rows if r["part"] == "logits" and r["model"] == "tile 8"]
  assert [r["slots"] for r in tiled] == [1, 3, 5]
  assert all(r["same_bits"] and r["same_tokens"] for r in tiled), tiled
  assert [r["batch"] for r in rows if r["part"] == "step"] == [1, 4]
  # --impl would be recorded and ignored (its tiered cache runs the XLA step).
  refused = subprocess.run([sys.executable, "-m", "experiments.batch_invariance",
                            "--impl=fused", f"--out_root={tmp_path / 'impl'}"],
                           capture_output=True, text=True, timeout=600)
  assert refused.returncode and "--impl: this runner" in refused.stderr, refused.stderr
