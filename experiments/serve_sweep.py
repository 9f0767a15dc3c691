r"""Serving benchmark at a fixed device-memory budget: ``sparse`` (full KV on the
device) vs ``tiered`` (host tier + hot cache), same model, selector and requests.

Paper (HiSparse, arXiv 2608.07009, serving results): peak throughput 3.6x / 4.7x
(Qwen3-30B-A3B + Quest, GH200, 32K / 200K), 3.1x (GLM-5.1 + DSA, H200, 32K); mean
TTFT 829 s -> 171 s at concurrency 64 and TPOT 15.9 vs 16.0 ms (DeepSeek-V4-Flash).
In-place P/D multiplexing (AInfer-PD, arXiv 2609.00993): makespan -7.1% to -22.5%
on prefill-heavy RL rollouts. Those rows are printed beside ours (``PAPER``).

Commands:
  # The README's main job (~2-4 min on a 2-core CPU): SmolLM2 (real weights), 8
  # synthetic ~1K-token requests, closed loop at concurrency 8, one 200 MiB budget.
  python -m experiments.serve_sweep
  # The CPU sweep in WORKSPACE_NOTES.md (~27 min):
  python -m experiments.serve_sweep --contexts=1024 --concurrency=2,4,8 --num_requests=12 \
      --output_len=96 --prompt_spread=0.5
  # RL rollouts, decode-first chunked prefill vs prefill that blocks decode (~6 min):
  python -m experiments.serve_sweep --workload=rollout --caches=tiered \
      --prefill_policies=decode_first,blocking
  # Performance with dummy weights (GPU; experiments/gpu_check.py --sections=serve):
  python -m experiments.serve_sweep --model=qwen3_8b_like --contexts=32768 ...

Arrivals: closed loop (``--concurrency`` requests outstanding, the paper's setup),
optionally rate-limited (``--request_rate``, ``--burstiness``: Gamma, 1 = Poisson).
Workloads: ``synthetic`` (corpus windows; random ids with dummy weights),
``rollout`` or a JSONL path (experiments/workloads.py). Every variant serves the
same requests, so ``same_tokens`` (tokens equal to the sparse run's, greedy) checks
exactness for free (with dummy weights too: the same computation on other numbers).
Results: results/serve_sweep/<time>/
(config.json, rows.jsonl, points.jsonl (rows as they come, for runs cut short),
requests.jsonl, steps.jsonl, table.md, plot.png:
throughput vs concurrency, TTFT CDF, device and host memory over time).
"""

from __future__ import annotations

import math
import time

from absl import app, flags
import numpy as np
from tqdm import tqdm

from experiments import common, model_setup, workloads
from kvtier_jax.serving import State, bench
from models import setup, text

_START = time.perf_counter()  # --deadline_s counts from here (imports, model load)
FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2", "smollm2 (real weights) or a runnable preset "
                    "with dummy weights for performance runs (qwen3_8b_like, "
                    "smollm2_135m).")
flags.DEFINE_list("contexts", ["1024"], "Context lengths (prompt + output tokens).")
flags.DEFINE_list("concurrency", ["8"], "Closed-loop max concurrency per point.")
flags.DEFINE_list("caches", ["sparse", "tiered"], "Cache backends compared.")
flags.DEFINE_list("prefill_policies", ["decode_first"], "decode_first and/or blocking.")
flags.DEFINE_string("workload", "synthetic", "synthetic, rollout, or a JSONL path.")
flags.DEFINE_integer("num_requests", 8, "Requests (or trajectories) per point.")
flags.DEFINE_integer("output_len", 32, "New tokens per request (synthetic).")
flags.DEFINE_float("prompt_spread", 0.25, "Synthetic prompts are uniform in "
                   "[(1 - spread) * (context - output_len), context - output_len].")
flags.DEFINE_float("request_rate", math.inf, "Requests per second (inf: as the closed "
                   "loop allows).")
flags.DEFINE_float("burstiness", 1.0, "Gamma shape of the arrivals (1: Poisson).")
flags.DEFINE_integer("rollout_turns", 3, "Rollout: generation turns per trajectory.")
flags.DEFINE_integer("rollout_env_tokens", 128, "Rollout: tokens an environment turn adds.")
flags.DEFINE_float("rollout_env_seconds", 0.5, "Rollout: environment latency.")
flags.DEFINE_float("kv_budget_mib", 200.0, "Device MiB for per-request state and the "
                   "prefill staging buffer (the same for every cache).")
flags.DEFINE_float("host_budget_mib", 2048.0, "Host MiB for the tiered page pool.")
flags.DEFINE_integer("max_batch", 8, "Request slots decoded together (tiered; the "
                     "full-KV caches get as many as their budget admits, at most this: "
                     "their KV arrays are allocated per slot).")
flags.DEFINE_integer("hot_slots", 256, "B (tiered); k defaults to B / 2.")
flags.DEFINE_integer("page_size", 16, "Positions per host page.")
flags.DEFINE_integer("chunk_size", 256, "Prompt tokens per prefill chunk.")
flags.DEFINE_integer("max_step_tokens", 512, "Tokens per engine step.")
flags.DEFINE_float("slo_ttft_s", None, "Goodput: TTFT SLO (seconds).")
flags.DEFINE_float("slo_tpot_ms", None, "Goodput: TPOT SLO (ms).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_list("sampling", [], "synthetic / rollout: every request's SamplingParams "
                  "as key=value pairs, e.g. temperature=1,top_p=0.95 (default greedy; "
                  "seeded per request by its id).")
flags.DEFINE_float("budget_s", None, "Start no new point after this many seconds.")
flags.DEFINE_float("deadline_s", None, "Stop the running point this many seconds after "
                   "the process started (its row says cut: requests in flight are left "
                   "unfinished); a caller's kill would lose the point.")
flags.DEFINE_string("out_root", None, "Results root.")
flags.DEFINE_bool("smoke", False, "Tiny sweep (tests).")

# The published serving figures, with their settings (docs/DESIGN.md, "Serving").
PAPER = [
    dict(source="HiSparse", setting="Qwen3-30B-A3B + Quest, GH200, 32K",
         sparse="511 tok/s", tiered="1824 tok/s", ratio="3.6x"),
    dict(source="HiSparse", setting="Qwen3-30B-A3B + Quest, GH200, 200K",
         sparse="111 tok/s", tiered="520 tok/s", ratio="4.7x"),
    dict(source="HiSparse", setting="GLM-5.1 + DSA, H200, 32K / 160K",
         sparse="-", tiered="-", ratio="3.1x / 2.9x"),
    dict(source="HiSparse", setting="DeepSeek-V4-Flash, 2xB200, concurrency 64",
         sparse="600 tok/s, mean TTFT 829 s", tiered="1257 tok/s, mean TTFT 171 s",
         ratio="2.1x, TTFT 0.21x"),
    dict(source="HiSparse", setting="DeepSeek-V4-Flash, concurrency 16: TPOT",
         sparse="15.9 ms", tiered="16.0 ms", ratio="1.01x"),
    dict(source="AInfer-PD", setting="RL rollouts, in-place P/D multiplexing vs none",
         sparse="-", tiered="-", ratio="makespan -7.1% to -22.5%"),
]

TABLE_COLUMNS = ["context", "concurrency", "cache", "prefill_policy", "slots", "admissible",
                 "bound_by", "peak_concurrency", "output_throughput", "vs_sparse",
                 "decode_throughput", "decode_vs_sparse", "mean_decode_batch",
                 "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms",
                 "tpot_median_ms", "itl_p99_ms",
                 "goodput", "duration_s", "peak_device_mib", "peak_host_mib",
                 "preemptions", "same_tokens", "finished", "cut"]


def load_model():
  """(model, token stream for synthetic prompts, tokenizer or None, weights)."""
  if FLAGS.model == "smollm2":
    model, tokenizer, _ = model_setup.load_model_and_prompt(None, 1)
    stream = text.tokenize_prompt(tokenizer, text.load_text(), 60000)
    return model, stream, tokenizer, "real"
  override = {} if FLAGS.model_layers is None else dict(num_layers=FLAGS.model_layers)
  if FLAGS.decode_row_tile is not None:
    override["decode_row_tile"] = FLAGS.decode_row_tile
  model = setup.dummy_model(FLAGS.model, FLAGS.seed, **override)
  rng = np.random.default_rng(FLAGS.seed)
  return model, rng.integers(0, model.cfg.vocab_size, 1 << 20), None, "dummy"


def make_workload(context: int, stream, tokenizer, rng, sampling) -> list:
  # Arrivals draw from their own generator: runs that differ only in --request_rate
  # or --burstiness serve the same prompts (paired).
  arrivals = bench.arrival_times(FLAGS.num_requests, FLAGS.request_rate, FLAGS.burstiness,
                                 np.random.default_rng((FLAGS.seed, 1)))
  if FLAGS.workload == "synthetic":
    hi = context - FLAGS.output_len
    lo = max(1, int((1 - FLAGS.prompt_spread) * hi))
    return workloads.sampled(workloads.synthetic(
        stream, rng, FLAGS.num_requests, (lo, hi), (FLAGS.output_len, FLAGS.output_len),
        arrivals), sampling)
  if FLAGS.workload == "rollout":
    turns, env = FLAGS.rollout_turns, FLAGS.rollout_env_tokens
    prompt = context - turns * FLAGS.output_len - (turns - 1) * env
    if prompt <= 0:
      raise ValueError(f"context {context} is too short for {turns} turns")
    return workloads.sampled(workloads.rollouts(
        stream, rng, FLAGS.num_requests, prompt, turns, FLAGS.output_len, env,
        FLAGS.rollout_env_seconds, arrivals), sampling)
  return workloads.load_jsonl(FLAGS.workload, tokenizer)


def lengths(workload) -> list[int]:
  """Positions each request reaches (a rollout: its first and its last turn)."""
  out = []
  for w in workload:
    if isinstance(w, bench.Rollout):
      out += [len(w.prompt) + w.max_new_tokens[0],
              len(w.prompt) + sum(map(len, w.env_tokens)) + sum(w.max_new_tokens)]
    else:
      out.append(len(w.prompt) + w.max_new_tokens)
  return out


def serve_point(model, selector, params, workload, context, concurrency, cache, policy,
                max_len, out, tag) -> tuple[dict, dict]:
  """Serve ``workload`` once; returns (summary row, {request id: output tokens})."""
  def backend(slots=FLAGS.max_batch):
    return workloads.build_backend(
        model, cache, selector=selector, params=params, max_batch=slots, max_len=max_len,
        chunk_size=FLAGS.chunk_size, page_size=FLAGS.page_size, hot_slots=FLAGS.hot_slots,
        host_budget_mib=FLAGS.host_budget_mib, impl=model_setup.tier_impl())
  slots = FLAGS.max_batch
  if cache != "tiered":
    # Full KV arrays are allocated per slot: as many slots as the budget could ever
    # admit (of the shortest requests); the budget still admits each request.
    admits, bound = workloads.admissible(backend(), FLAGS.kv_budget_mib,
                                         min(lengths(workload)))
    if admits < 1:  # the capacity wall: not one request fits
      print(f"{tag}: not one request of {min(lengths(workload))} positions fits "
            f"{FLAGS.kv_budget_mib:g} MiB", flush=True)
      return dict(context=context, concurrency=concurrency, cache=cache,
                  prefill_policy=policy, slots=0, admissible=0, bound_by=bound,
                  requests=0, finished=0, output_throughput=0.0, peak_concurrency=0,
                  duration_s=0.0), {}
    slots = min(slots, admits)
  make = lambda budget=None: workloads.build_engine(
      backend(slots), max_step_tokens=FLAGS.max_step_tokens, kv_budget_mib=budget,
      prefill_policy=policy)
  first = workload[0]
  spec = first.turn(0, first.prompt, 0.0) if isinstance(first, bench.Rollout) else first
  workloads.warm_up(make(), spec, FLAGS.chunk_size)
  engine = make(FLAGS.kv_budget_mib)
  total = sum(len(w.max_new_tokens) if isinstance(w, bench.Rollout) else 1
              for w in workload)
  stopped = []  # the deadline stopped the drive (a point finished in time is not cut)

  def past_deadline():
    if FLAGS.deadline_s is not None and time.perf_counter() - _START > FLAGS.deadline_s:
      stopped.append(True)
    return bool(stopped)

  with tqdm(total=total, desc=tag, unit="req", leave=False) as bar:
    served = bench.drive(engine, workload, max_concurrency=concurrency,
                         on_finish=lambda req: bar.update(), until=past_deadline)
  slo_tpot = None if FLAGS.slo_tpot_ms is None else FLAGS.slo_tpot_ms / 1e3
  row = dict(context=context, concurrency=concurrency, cache=cache, prefill_policy=policy,
             slots=slots, **dict(zip(("admissible", "bound_by"), workloads.admissible(
                 backend(), FLAGS.kv_budget_mib, context))),
             **bench.summarize(served, host_page_bytes=engine.model.host_page_bytes,
                               slo_ttft_s=FLAGS.slo_ttft_s, slo_tpot_s=slo_tpot),
             cut=bool(stopped))
  for req in served.requests:
    summary = req.metrics.summary()
    summary.pop("itl_s")
    common.append_jsonl(out / "requests.jsonl", dict(
        tag=tag, id=req.id, state=req.state.value, prompt_tokens=len(req.prompt),
        output_tokens=len(req.output), **summary))
  for step in served.steps:
    common.append_jsonl(out / "steps.jsonl", dict(tag=tag, **step))
  outputs = {r.id: r.output for r in served.requests if r.state is State.FINISHED}
  return row, outputs


def render(out, rows, weights: str) -> str:
  table = common.markdown_table(rows, TABLE_COLUMNS)
  paper = common.markdown_table(PAPER, list(PAPER[0]))
  layers = f" (its first {FLAGS.model_layers} layers)" if FLAGS.model_layers else ""
  note = ("Ours: " + (f"SmolLM2-135M{layers}, real weights" if weights == "real" else
                      f"{FLAGS.model}{layers}, dummy weights (performance only)")
          + f", {common.platform()}, KV budget {FLAGS.kv_budget_mib:g} MiB, host "
          f"{FLAGS.host_budget_mib:g} MiB, B={FLAGS.hot_slots}, k={FLAGS.top_k}, "
          f"at most {FLAGS.max_batch} slots. vs_sparse: output tokens/s over the sparse "
          "run's at the same point; decode_throughput: tokens/s of the steps without a "
          "prompt chunk (a P/D decode instance's view); admissible / bound_by: requests "
          "of the full context length that fit at once, and the limit (slots, device "
          "budget, host pool); same_tokens: finished requests whose tokens equal the "
          "sparse run's (exactness of the implementation; on real weights, of the model's "
          "tokens too).")
  text_md = f"{table}\n\n{note}\n\nPublished (author-reported):\n\n{paper}\n"
  (out / "table.md").write_text(text_md)
  plot(out, rows)
  return text_md


def plot(out, rows) -> None:
  import json
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
  variants = sorted({(r["cache"], r["prefill_policy"]) for r in rows})
  label = lambda cache, policy: cache if policy == "decode_first" else f"{cache} ({policy})"
  for ctx in sorted({r["context"] for r in rows}):
    for cache, policy in variants:
      pts = sorted((r["concurrency"], r["output_throughput"]) for r in rows
                   if (r["context"], r["cache"], r["prefill_policy"]) == (ctx, cache, policy))
      axes[0].plot(*zip(*pts), marker="o", label=f"{label(cache, policy)} @ {ctx}")
  axes[0].set(xlabel="max concurrency", ylabel="output tokens/s",
              title="throughput vs concurrency")
  axes[0].legend(fontsize=7)
  top = max(rows, key=lambda r: (r["concurrency"], r["context"]), default=None)
  point = "" if top is None else f"@{top['context']}/c{top['concurrency']}"
  # Every point skipped or at the capacity wall: no request was served.
  read = lambda name: ([json.loads(l) for l in (out / name).read_text().splitlines()]
                       if (out / name).exists() else [])
  reqs, steps = read("requests.jsonl"), read("steps.jsonl")
  for cache, policy in variants:
    tag = f"{cache}/{policy}{point}"
    ttft = np.sort([r["ttft_s"] for r in reqs if r["tag"] == tag  # the table's
                    and r["state"] == "finished" and r["ttft_s"] is not None])
    if ttft.size:
      axes[1].step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post",
                   label=label(cache, policy))
    mine = [s for s in steps if s["tag"] == tag]
    t = [s["t"] - mine[0]["t"] for s in mine] if mine else []
    line, = axes[2].step(t, [s["device_bytes_in_use"] / 2**20 for s in mine], where="post",
                         label=f"{label(cache, policy)} device")
    if any(s["host_bytes_in_use"] for s in mine):
      axes[2].step(t, [s["host_bytes_in_use"] / 2**20 for s in mine], where="post",
                   linestyle="--", color=line.get_color(),
                   label=f"{label(cache, policy)} host")
  axes[1].set(xlabel="TTFT (s)", ylabel="fraction of requests", title=f"TTFT CDF {point}")
  axes[1].legend(fontsize=7)
  axes[2].set(xlabel="engine time (s)", ylabel="MiB in use", title=f"memory {point}")
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "plot.png", dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  model_setup.refuse_given(model_setup.NO_LOOKAHEAD, "this runner runs no look-ahead "
                           "(generate, serve and prefetch do)")
  ignored = [f"--{name}" for name in ("prompt_file", "offset", "prompt_tokens")
             if FLAGS[name].present]
  rollout = ("rollout_turns", "rollout_env_tokens", "rollout_env_seconds")
  if FLAGS.workload not in ("synthetic", "rollout"):  # a JSONL file says these itself
    ignored += [f"--{name}" for name in ("request_rate", "burstiness", "num_requests",
                                         "contexts", "sampling", "output_len",
                                         "prompt_spread", *rollout) if FLAGS[name].present]
  elif FLAGS.workload == "synthetic":
    ignored += [f"--{name}" for name in rollout if FLAGS[name].present]
  if ignored:
    raise app.UsageError(f"{', '.join(ignored)}: not used by this workload (prompts "
                         "come from the bundled corpus, or from the JSONL file with "
                         "its own arrival_s)")
  if FLAGS.smoke:
    FLAGS.contexts, FLAGS.concurrency, FLAGS.num_requests = ["192"], ["3"], 3
    FLAGS.output_len, FLAGS.max_batch, FLAGS.hot_slots = 4, 3, 64
    FLAGS.chunk_size, FLAGS.max_step_tokens = 64, 128
    if FLAGS["kv_budget_mib"].using_default_value:
      FLAGS.kv_budget_mib = 20.0  # with the full model, sparse is bound by the device
    if FLAGS["host_budget_mib"].using_default_value:
      FLAGS.host_budget_mib = 256.0  # 3 short requests need ~30 MiB; 2 GiB costs 3 s
    FLAGS.rollout_turns, FLAGS.rollout_env_tokens, FLAGS.rollout_env_seconds = 2, 16, 0.0
  if FLAGS["top_k"].using_default_value:
    FLAGS.top_k = FLAGS.hot_slots // 2  # B = 2k, the paper's default
  try:
    sampling = workloads.parse_sampling(FLAGS.sampling)
  except ValueError as err:
    raise app.UsageError(str(err)) from None
  out = common.start_run("serve_sweep", FLAGS.flag_values_dict(), FLAGS.out_root)
  model, stream, tokenizer, weights = load_model()
  selector, params = setup.build_selector(FLAGS.selector, model.cfg, FLAGS.top_k,
                                          FLAGS.indexer_ckpt)
  print(f"platform: {common.platform()}; model {model.cfg.name} ({weights} weights); "
        f"caches {FLAGS.caches}; results {out}", flush=True)
  rows, outputs, t0 = [], [], time.perf_counter()
  for context in map(int, FLAGS.contexts):
    rng = np.random.default_rng(FLAGS.seed)
    workload = make_workload(context, stream, tokenizer, rng, sampling)
    if FLAGS.workload not in ("synthetic", "rollout"):
      context = max(lengths(workload))  # the file's longest request labels the rows
    max_len = -(-max(context, *lengths(workload)) // FLAGS.chunk_size) * FLAGS.chunk_size
    for concurrency in map(int, FLAGS.concurrency):
      for cache in FLAGS.caches:
        for policy in FLAGS.prefill_policies:
          tag = f"{cache}/{policy}@{context}/c{concurrency}"
          if FLAGS.budget_s is not None and time.perf_counter() - t0 > FLAGS.budget_s:
            print(f"{tag}: skipped (past --budget_s={FLAGS.budget_s:g})", flush=True)
            continue
          if FLAGS.deadline_s is not None and time.perf_counter() - _START > FLAGS.deadline_s:
            print(f"{tag}: skipped (past --deadline_s={FLAGS.deadline_s:g})", flush=True)
            continue
          row, outs = serve_point(model, selector, params, workload, context, concurrency,
                                  cache, policy, max_len, out, tag)
          row.update(model=model.cfg.name, num_layers=model.cfg.num_layers, weights=weights,
                     decode_row_tile=model.cfg.decode_row_tile, same_tokens=None,
                     vs_sparse=None, decode_vs_sparse=None)
          rows.append(row)
          outputs.append(outs)
          common.append_jsonl(out / "points.jsonl", row)  # as they come
          print(f"{tag}: {row['finished']}/{row['requests']} finished, "
                f"{row['output_throughput']:.3g} tok/s, peak concurrency "
                f"{row['peak_concurrency']} (admissible {row['admissible']}, "
                f"{row['bound_by']}-bound), {row['duration_s']:.1f} s", flush=True)
  bench.compare_with_sparse(rows, outputs)
  for row in rows:
    common.append_row(out, row)
  print(render(out, rows, weights))
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
