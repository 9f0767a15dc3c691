r"""Serve a stream of requests with SmolLM2 and one cache backend; optionally check
every finished request against the sparse backend run alone (the dense one for
``--cache=dense``).

Paper context (HiSparse): with the KV in host memory a server admits several times
more concurrent long-context requests into the same device memory, which is where
its throughput and TTFT-under-load gains come from (docs/DESIGN.md, "The problem").

Command (~3 min on a 2-core CPU at the defaults; ``--check_exact`` adds one solo
run per request, ~2 min):
  python -m experiments.serve --cache=tiered --check_exact
  python -m experiments.serve --workload=requests.jsonl --cache=sparse
  # Requests split over 4 devices (fake CPU devices here), checked against one device;
  # then requests over 2 and KV heads over 2 (~6 min each):
  python -m experiments.serve --mesh=data:4 --check_exact
  python -m experiments.serve --mesh=data:2,model:2 --check_exact
  # Agent sessions with the prefix cache in the host tier (PDD's Decode Radix Cache
  # on HiSparse), on vs off (~4 min each):
  python -m experiments.serve --sessions=skewed --prefix_cache --check_exact
  # Shared system prompts arriving under load, admitted by arrival or by the longest
  # cached prefix (SGLang's LPM):
  python -m experiments.serve --shared_prefix_groups=4 --num_requests=24 \
      --request_rate=4 --prefix_cache --schedule=lpm
  # Stop after 40 engine steps and save the engine; then, in a new process, go on
  # from the snapshot (the same flags) and check every request's tokens:
  python -m experiments.serve --request_rate=1 --snapshot_at_step=40 \
      --snapshot_dir=/tmp/serve-snapshot
  python -m experiments.serve --request_rate=1 --restore=/tmp/serve-snapshot --check_exact
  # Shared system prompts, a host pool too small to keep them, a disk tier below it:
  python -m experiments.serve --shared_prefix_groups=6 --num_requests=24 --max_batch=4 \
      --prefix_cache --host_budget_mib=150 --disk_budget_mib=512 --check_exact
Workload JSONL (experiments/workloads.py): one request per line, ``{"id", "prompt":
text | "prompt_ids": [...], "max_new_tokens", "arrival_s", "temperature", "top_k",
"top_p", "seed", "stop_ids", "logprobs", "logprobs_mode"}`` (all but the prompt
and ``max_new_tokens`` optional; with ``logprobs``: N, requests.jsonl also holds
the request's ``output_ids``, ``logprobs`` and ``top_logprobs``, "raw" or
"processed" as ``SamplingParams`` says), or session turns
``{"id", "session", "append", "max_new_tokens"}``;
without ``--workload``, a synthetic one from the bundled corpus (Python's pydoc
topics): independent requests, or agent sessions (``--sessions=skewed|narrow``).
Results: results/serve/<time>/ (config.json, rows.jsonl (the summary),
requests.jsonl, steps.jsonl, table.md, plot.png). Last line: ``serve: cache=...
requests=N output_tokens=T throughput=X tok/s ttft_p50=A s ttft_p99=B s
tpot_p50=C ms max_concurrency=K prefill_tokens=P exact=E/F prefix_hit=H`` (N: every
request; F: the finished ones, ``-/F`` without ``--check_exact``; P: prompt tokens
computed; H: the fraction of prompt tokens served by the prefix cache).
"""

from __future__ import annotations

import collections
import math

from absl import app, flags
import numpy as np
from tqdm import tqdm

from experiments import common, model_setup, workloads
from kvtier_jax import sharding
from kvtier_jax.serving import Engine, State, bench, snapshot
from models import setup, text

FLAGS = flags.FLAGS
flags.DEFINE_string("workload", None, "JSONL of requests (default: synthetic).")
flags.DEFINE_enum("cache", "tiered", ["dense", "sparse", "tiered"], "Cache backend.")
flags.DEFINE_float("kv_budget_mib", 256.0, "Device MiB for per-request state and the "
                   "prefill staging buffer (the admission limit).")
flags.DEFINE_float("host_budget_mib", 1024.0, "Host MiB for the page pool (tiered).")
flags.DEFINE_integer("max_batch", 8, "Request slots decoded together.")
flags.DEFINE_integer("hot_slots", 128, "B (tiered).")
flags.DEFINE_integer("page_size", 16, "Positions per host page.")
flags.DEFINE_integer("chunk_size", 128, "Prompt tokens per prefill chunk.")
flags.DEFINE_integer("max_len", 1024, "Positions a request may reach.")
flags.DEFINE_integer("max_step_tokens", 256, "Tokens per engine step.")
flags.DEFINE_integer("num_requests", 12, "Synthetic workload: requests.")
flags.DEFINE_list("prompt_range", ["200", "700"], "Synthetic: prompt tokens min,max.")
flags.DEFINE_list("output_range", ["8", "24"], "Synthetic: new tokens min,max.")
flags.DEFINE_float("request_rate", 0.0, "Synthetic: Poisson arrivals per second "
                   "(0: all at once).")
flags.DEFINE_integer("seed", 0, "Synthetic workload seed.")
flags.DEFINE_list("sampling", [], "Synthetic: every request's SamplingParams as "
                  "key=value pairs, e.g. temperature=1,top_p=0.95 (default greedy; "
                  "seeded per request by its id). A --workload file sets its own.")
flags.DEFINE_enum("sessions", None, ["skewed", "narrow"], "Synthetic agent sessions "
                  "(--num_requests sessions of --session_turns turns, first prompt of "
                  "the largest --prompt_range; --max_len grows to fit) instead of "
                  "independent requests; the append-size distribution.")
flags.DEFINE_integer("session_turns", 4, "Turns per synthetic session.")
flags.DEFINE_integer("shared_prefix_groups", 0, "Synthetic: --num_requests requests in "
                     "this many groups sharing a system prompt of the largest "
                     "--prompt_range, each adding a question of 16-64 tokens (SGLang's "
                     "generated-shared-prefix; 0: independent requests).")
flags.DEFINE_bool("prefix_cache", False, "Reuse cached prompt prefixes in the host "
                  "tier (tiered).")
flags.DEFINE_float("disk_budget_mib", 0.0, "A disk tier of this many MiB below the host "
                   "pool for cached prefixes (with --prefix_cache; 0: none).")
flags.DEFINE_enum("disk_policy", "auto", ["auto", "load", "recompute"], "A prefix found "
                  "on disk is loaded back, recomputed, or whichever measured cheaper.")
flags.DEFINE_enum("schedule", "fcfs", ["fcfs", "lpm"], "Admission order: arrival "
                  "(fcfs) or the longest cached prefix first (lpm, SGLang's; needs "
                  "--prefix_cache).")
flags.DEFINE_bool("check_exact", False, "Decode every finished request alone with "
                  "the sparse backend (the dense one for --cache=dense, which attends "
                  "to every position) and compare tokens.")
flags.DEFINE_string("mesh", None, "Serve over a device mesh: data:4 (requests split "
                    "over 4 devices; --max_batch and the host budget split with them), "
                    "data:2,model:2 (and the KV heads over 2: --selector=quest becomes "
                    "quest_kv). On a CPU the devices are XLA's fake host devices.")
flags.DEFINE_integer("snapshot_at_step", 0, "Stop after this many engine steps, save "
                     "the engine (orbax, checksummed) to --snapshot_dir and exit; a "
                     "run with --restore goes on (0: serve to the end).")
flags.DEFINE_string("snapshot_dir", None, "Where --snapshot_at_step saves (default: "
                    "<results>/snapshot).")
flags.DEFINE_string("restore", None, "Continue the snapshot at this path: the same "
                    "flags and workload; requests it holds go on, the rest are sent on "
                    "their schedule (independent requests, not --sessions).")
flags.DEFINE_string("out_root", None, "Results root.")
flags.DEFINE_bool("smoke", False, "Tiny workload (tests).")


def make_engine(model, cache: str, selector, params, kv_budget_mib=None,
                prefix_cache=False, disk_budget_mib=0.0, mesh=None, schedule="fcfs",
                restore=None):
  """A fresh engine, or (``restore``: a snapshot's path) the one it saved."""
  backend = workloads.build_backend(
      model, cache, selector=selector, params=params, max_batch=FLAGS.max_batch,
      max_len=FLAGS.max_len, chunk_size=FLAGS.chunk_size, page_size=FLAGS.page_size,
      hot_slots=FLAGS.hot_slots, host_budget_mib=FLAGS.host_budget_mib, mesh=mesh,
      impl=model_setup.tier_impl(),
      lookahead=FLAGS.lookahead if cache == "tiered" else "none",  # (not --check_exact's)
      lookahead_cap=FLAGS.lookahead_cap)
  config = workloads.engine_config(backend, max_step_tokens=FLAGS.max_step_tokens,
                                   kv_budget_mib=kv_budget_mib, prefix_cache=prefix_cache,
                                   disk_budget_mib=disk_budget_mib,
                                   disk_policy=FLAGS.disk_policy, schedule=schedule)
  return Engine(backend, config) if restore is None else snapshot.restore(
      restore, backend, config)


def summarize(cache: str, served: bench.Served, engine, exact: str) -> dict:
  full = bench.summarize(served, host_page_bytes=engine.model.host_page_bytes)
  # Prompts first admitted in the run's window (after a restore: since then), as
  # its prefill steps are.
  admitted = bench.admitted_in_window(served)
  hits = [r.metrics.cached_tokens / len(r.prompt) for r in admitted]
  hit_quantiles = {f"hit_p{q}": float(np.percentile(hits, q)) if hits else None
                   for q in (10, 50, 90)}
  computed = sum(s["prefill_tokens"] for s in served.steps)
  prompt_tokens, cached_tokens = bench.first_admission_tokens(admitted)
  ms = lambda v: None if v is None else v / 1e3
  return dict(cache=cache, decode_row_tile=engine.model.cfg.decode_row_tile,
              requests=full["requests"], finished=full["finished"],
              refused=full["refused"],
              output_tokens=full["output_tokens"], throughput=full["output_throughput"],
              ttft_p50=ms(full["ttft_median_ms"]), ttft_p99=ms(full["ttft_p99_ms"]),
              tpot_p50_ms=full["tpot_median_ms"],
              max_concurrency=full["peak_concurrency"],
              prefill_tokens=computed, prompt_tokens=prompt_tokens,
              prefix_hit=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
              **hit_quantiles,
              # What a remote decode instance receives: the uncached increment (DRC).
              transfer_mib=(prompt_tokens - cached_tokens)
              * engine.model.cfg.kv_bytes_per_token() / 2**20,
              peak_host_mib=full["peak_host_mib"],
              preemptions=full["preemptions"],
              max_host_pages=max((s["peak_host_pages"] for s in served.steps), default=0),
              max_disk_mib=max((s["disk_pages"] for s in served.steps), default=0)
              * engine.model.host_page_bytes / 2**20,
              disk_loaded_tokens=engine.disk_loaded_tokens,
              disk_s_per_page=engine.disk and engine.disk.seconds_per_page,
              prefill_s_per_token=engine.prefill_seconds_per_token,
              page_size=engine.model.page_size,
              disk_recomputed_tokens=engine.disk_recomputed_tokens,
              max_device_mib=full["peak_device_mib"], misses=full["misses"],
              prefetched=full["prefetched"], lookahead=FLAGS.lookahead, exact=exact)


def last_line(row: dict) -> str:
  fmt = lambda v, scale=1.0: "nan" if v is None else f"{v * scale:.3g}"
  return (f"serve: cache={row['cache']} requests={row['requests']} "
          f"output_tokens={row['output_tokens']} throughput={row['throughput']:.3g} tok/s "
          f"ttft_p50={fmt(row['ttft_p50'])} s ttft_p99={fmt(row['ttft_p99'])} s "
          f"tpot_p50={fmt(row['tpot_p50_ms'])} ms max_concurrency={row['max_concurrency']} "
          f"prefill_tokens={row['prefill_tokens']} exact={row['exact']} "
          f"prefix_hit={row['prefix_hit']:.3g}")


def main(argv):
  del argv
  if FLAGS["top_k"].using_default_value:
    FLAGS.top_k = FLAGS.hot_slots // 2  # B = 2k, the paper's default
  if FLAGS.smoke:
    FLAGS.num_requests, FLAGS.prompt_range, FLAGS.output_range = 4, ["40", "150"], ["3", "6"]
    FLAGS.max_len, FLAGS.hot_slots, FLAGS.top_k, FLAGS.max_batch = 256, 64, 32, 3
    FLAGS.chunk_size, FLAGS.max_step_tokens = 64, 64
    if FLAGS["host_budget_mib"].using_default_value:
      FLAGS.host_budget_mib = 256.0  # the smoke's requests need ~30 MiB
  ignored = [f"--{name}" for name in ("prompt_file", "offset", "prompt_tokens")
             if FLAGS[name].present]
  if ignored:
    raise app.UsageError(f"{', '.join(ignored)}: not used here (prompts come from the "
                         "bundled corpus or --workload)")
  unused = (("request_rate", "prompt_range", "output_range", "num_requests", "seed",
             "sessions", "session_turns", "shared_prefix_groups") if FLAGS.workload
            else ("request_rate", "shared_prefix_groups") if FLAGS.sessions
            else ("session_turns",))
  ignored = [f"--{name}" for name in unused if FLAGS[name].present]
  if ignored:
    raise app.UsageError(f"{', '.join(ignored)}: not used by this workload (--workload: "
                         "each line says its own; --sessions: arrive at once, unshared)")
  model_setup.refuse_given(["draft_ckpt"], "the serving engine drafts by prompt lookup")
  if FLAGS.lookahead != "none" and (FLAGS.cache != "tiered" or FLAGS.mesh):
    raise app.UsageError("--lookahead needs --cache=tiered on one device")
  if FLAGS.lookahead == "none":
    model_setup.refuse_given(["lookahead_cap"], "it caps --lookahead=draft's prefetch")
  if FLAGS.restore and FLAGS.sessions:
    raise app.UsageError("--restore continues independent requests, not --sessions")
  if FLAGS.workload and FLAGS.sampling:
    raise app.UsageError("--sampling: not used with --workload (each line sets its own)")
  try:
    sampling = workloads.parse_sampling(FLAGS.sampling)
  except ValueError as err:
    raise app.UsageError(str(err)) from None
  data = sharding.parse_mesh(FLAGS.mesh)["data"]
  if FLAGS.smoke:
    FLAGS.max_batch = -(-FLAGS.max_batch // data) * data
  if FLAGS.max_batch % data:
    raise app.UsageError(f"--max_batch={FLAGS.max_batch} must split over data={data}")
  shape = sharding.parse_mesh(FLAGS.mesh)
  common.ensure_devices(shape["data"] * shape["model"])  # before jax starts
  mesh = sharding.make_mesh(shape) if FLAGS.mesh else None
  model, tokenizer, _ = model_setup.load_model_and_prompt(None, 1)
  rng = np.random.default_rng(FLAGS.seed)
  stream = text.tokenize_prompt(tokenizer, text.load_text(), 60000)
  if FLAGS.workload:
    workload = workloads.load_jsonl(FLAGS.workload, tokenizer)
  elif FLAGS.sessions:
    out_lo, out_hi = map(int, FLAGS.output_range)
    workload = workloads.sessions(stream, rng, FLAGS.num_requests,
                                  int(FLAGS.prompt_range[1]), FLAGS.session_turns,
                                  (out_lo + out_hi) // 2, FLAGS.sessions)
    longest = max(len(w.prompt) + sum(map(len, w.env_tokens)) + sum(w.max_new_tokens)
                  for w in workload)
    FLAGS.max_len = max(FLAGS.max_len, -(-longest // FLAGS.chunk_size) * FLAGS.chunk_size)
  else:
    # Their own generator: runs that differ only in the rate serve the same prompts.
    arrivals = bench.arrival_times(FLAGS.num_requests, FLAGS.request_rate or math.inf,
                                   rng=np.random.default_rng((FLAGS.seed, 1)))
    outputs = list(map(int, FLAGS.output_range))
    if FLAGS.shared_prefix_groups:
      workload = workloads.shared_prefix(stream, rng, FLAGS.num_requests,
                                         FLAGS.shared_prefix_groups,
                                         int(FLAGS.prompt_range[1]), (16, 64), outputs,
                                         arrivals)
    else:
      workload = workloads.synthetic(stream, rng, FLAGS.num_requests,
                                     list(map(int, FLAGS.prompt_range)), outputs, arrivals)
  if not FLAGS.workload:
    workload = workloads.sampled(workload, sampling)
  if shape["model"] > 1 and FLAGS.selector == "quest":
    FLAGS.selector = "quest_kv"  # tensor parallel splits the cache by KV head
  # After the flags the run changes (max_len for sessions, the selector for a mesh).
  out = common.start_run("serve", FLAGS.flag_values_dict(), FLAGS.out_root)
  selector, params = (None, None) if FLAGS.cache == "dense" else setup.build_selector(
      FLAGS.selector, model.cfg, FLAGS.top_k, FLAGS.indexer_ckpt)
  print(f"platform: {common.platform()}; {len(workload)} requests; cache={FLAGS.cache}"
        f"; mesh={dict(mesh.shape) if mesh else 'one device'}", flush=True)
  first = workload[0]
  first = first.turn(0, first.prompt, 0.0) if isinstance(first, bench.Rollout) else first
  workloads.warm_up(make_engine(model, FLAGS.cache, selector, params,
                                prefix_cache=FLAGS.prefix_cache, mesh=mesh), first,
                    FLAGS.chunk_size)
  engine = make_engine(model, FLAGS.cache, selector, params, FLAGS.kv_budget_mib,
                       FLAGS.prefix_cache, FLAGS.disk_budget_mib, mesh=mesh,
                       schedule=FLAGS.schedule, restore=FLAGS.restore)
  total = sum(len(w.max_new_tokens) if isinstance(w, bench.Rollout) else 1
              for w in workload)
  stop = (lambda: engine.steps >= FLAGS.snapshot_at_step) if FLAGS.snapshot_at_step else None
  with tqdm(total=total, desc=f"serve ({FLAGS.cache})", unit="req") as bar:
    served = bench.drive(engine, workload, on_finish=lambda req: bar.update(),
                         until=stop, resume=FLAGS.restore is not None)
  if stop is not None and stop():
    path = FLAGS.snapshot_dir or str(out / "snapshot")
    snapshot.save(engine, path)
    states = collections.Counter(r.state.value for r in engine.requests.values())
    print(f"snapshot: step {engine.steps}, requests {dict(sorted(states.items()))}, "
          f"{len(workload) - len(engine.requests)} not sent yet; saved to {path}")
    return
  prefills = engine.model.compiled_prefills()  # warm-up and served (not --check_exact)
  done = [r for r in served.requests if r.state is State.FINISHED]
  exact = f"-/{len(done)}"
  if FLAGS.check_exact:
    reference = "dense" if FLAGS.cache == "dense" else "sparse"
    workloads.warm_up(make_engine(model, reference, selector, params), first,
                      FLAGS.chunk_size)
    matched = 0
    for req in tqdm(done, desc=f"alone ({reference})", unit="req"):
      spec = bench.RequestSpec(req.id, tuple(req.prompt), req.max_new_tokens,
                               sampling=req.sampling, stop_ids=tuple(req.stop_ids))
      alone = bench.drive(make_engine(model, reference, selector, params), [spec])
      matched += alone.requests[0].output == req.output
    exact = f"{matched}/{len(done)}"
  for req in served.requests:
    summary = req.metrics.summary()
    summary.pop("itl_s")
    logprobs = {} if req.sampling.logprobs is None else dict(
        output_ids=req.output, logprobs=req.logprobs, top_logprobs=req.top_logprobs)
    common.append_jsonl(out / "requests.jsonl", dict(
        id=req.id, state=req.state.value, reason=req.reason, prompt_tokens=len(req.prompt),
        output_tokens=len(req.output), **summary, **logprobs))
  for step in served.steps:
    common.append_jsonl(out / "steps.jsonl", step)
  row = summarize(FLAGS.cache, served, engine, exact)
  common.append_row(out, row)
  table = common.markdown_table([row], list(row))
  (out / "table.md").write_text(table + "\n")
  common.line_plot(out / "plot.png", [s["t"] for s in served.steps],
                   [s["running"] for s in served.steps], "engine time (s)",
                   "requests holding a slot",
                   f"serve: cache={FLAGS.cache}, budget {FLAGS.kv_budget_mib:g} MiB")
  print(table)
  if mesh is not None:  # a per-slot output XLA placed off its row's layout is copied
    print(f"mesh: {engine.model.reshards} per-slot outputs re-placed, "
          f"{prefills} prefill compile(s) serving")
  print(f"results: {out}")
  print(last_line(row))


if __name__ == "__main__":
  app.run(main)
