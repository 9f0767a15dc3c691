r"""Serve a stream of requests with SmolLM2 and one cache backend; optionally check
every finished request against the sparse backend run alone.

Paper context (HiSparse): with the KV in host memory a server admits several times
more concurrent long-context requests into the same device memory, which is where
its throughput and TTFT-under-load gains come from (docs/DESIGN.md, "The problem").

Command (~3 min on a 2-core CPU at the defaults; ``--check_exact`` adds one solo
run per request, ~2 min):
  python -m experiments.serve --cache=tiered --check_exact
  python -m experiments.serve --workload=requests.jsonl --cache=sparse
Workload JSONL, one request per line: ``{"id", "prompt": text | "prompt_ids": [...],
"max_new_tokens", "arrival_s" (optional), "temperature", "top_k", "top_p", "seed",
"stop_ids" (optional)}``; without ``--workload``, a synthetic one from the bundled
corpus (Python's pydoc topics). Results: results/serve/<time>/ (config.json,
rows.jsonl (the summary), requests.jsonl, steps.jsonl, table.md, plot.png). Last
line: ``serve: cache=... requests=N output_tokens=T throughput=X tok/s
ttft_p50=A s ttft_p99=B s tpot_p50=C ms max_concurrency=K prefill_tokens=P
exact=E/N`` (N: finished requests; ``-/N`` without ``--check_exact``).
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app, flags
import numpy as np

from experiments import common, model_setup  # noqa: F401 (model_setup: shared flags)
from kvtier_jax.serving import Engine, EngineConfig, SamplingParams, State, percentiles
from models import serving, setup, text

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
flags.DEFINE_bool("check_exact", False, "Decode every finished request alone with "
                  "the sparse backend (the dense one for --cache=dense, which attends "
                  "to every position) and compare tokens.")
flags.DEFINE_string("out_root", None, "Results root.")
flags.DEFINE_bool("smoke", False, "Tiny workload (tests).")


def synthetic(tokenizer) -> list[dict]:
  rng = np.random.default_rng(FLAGS.seed)
  ids = text.tokenize_prompt(tokenizer, text.load_text(), 60000)
  lo, hi = map(int, FLAGS.prompt_range)
  out_lo, out_hi = map(int, FLAGS.output_range)
  arrival, rows = 0.0, []
  for i in range(FLAGS.num_requests):
    plen = int(rng.integers(lo, hi + 1))
    start = int(rng.integers(0, len(ids) - plen))
    if FLAGS.request_rate > 0:
      arrival += float(rng.exponential(1.0 / FLAGS.request_rate))
    rows.append(dict(id=f"r{i}", prompt_ids=ids[start:start + plen].tolist(),
                     max_new_tokens=int(rng.integers(out_lo, out_hi + 1)),
                     arrival_s=arrival))
  return rows


def load_workload(path: str, tokenizer) -> list[dict]:
  rows = []
  for n, line in enumerate(pathlib.Path(path).read_text().splitlines()):
    if not line.strip():
      continue
    row = json.loads(line)
    if "prompt_ids" not in row:
      if "prompt" not in row:
        raise ValueError(f"{path}:{n + 1}: a request needs 'prompt' or 'prompt_ids'")
      row["prompt_ids"] = tokenizer.encode(row["prompt"], add_special_tokens=False).ids
    row.setdefault("id", f"r{n}")
    rows.append(row)
  return rows


def build(model, cache: str, selector, params, kv_budget_mib=None):
  host_pages = serving.ServingBackend.pages_for_bytes(
      model.cfg, FLAGS.page_size, FLAGS.host_budget_mib * 2**20)
  extra = dict(hot_slots=FLAGS.hot_slots, host_pages=host_pages) if cache == "tiered" else {}
  if cache != "dense":
    extra.update(selector=selector, selector_params=params)
  backend = serving.ServingBackend(model, cache, FLAGS.max_batch, FLAGS.max_len,
                                   chunk_size=FLAGS.chunk_size, page_size=FLAGS.page_size,
                                   **extra)
  budget = None if kv_budget_mib is None else int(kv_budget_mib * 2**20)
  return Engine(backend, EngineConfig(max_step_tokens=FLAGS.max_step_tokens,
                                      kv_budget_bytes=budget))


def sampling_of(row) -> SamplingParams:
  return SamplingParams(temperature=float(row.get("temperature", 0.0)),
                        top_k=int(row.get("top_k", 0)), top_p=float(row.get("top_p", 1.0)),
                        seed=int(row.get("seed", 0)))


def run(engine: Engine, workload: list[dict], steps_out=None) -> dict:
  """Serve ``workload`` in real time (arrivals on the engine's clock)."""
  pending = sorted(workload, key=lambda r: r.get("arrival_s", 0.0))
  reqs = {}
  while pending or engine.has_work:
    while pending and pending[0].get("arrival_s", 0.0) <= engine.now():
      row = pending.pop(0)
      reqs[row["id"]] = engine.submit(row["prompt_ids"], int(row["max_new_tokens"]),
                                      sampling_of(row), stop_ids=row.get("stop_ids", ()),
                                      request_id=str(row["id"]),
                                      arrival=row.get("arrival_s", 0.0))
    if engine.has_work:
      step = engine.step()
      if steps_out is not None:
        steps_out.append(step)
    elif pending:
      time.sleep(max(0.0, min(0.05, pending[0]["arrival_s"] - engine.now())))
  return reqs


def warm_up(make_engine, workload) -> None:
  """Compile the prefill, the decode step and the sampler on a throwaway engine
  (the jitted functions are shared), so no request's TTFT includes compiling."""
  engine = make_engine()
  row = dict(workload[0], id="warm-up", max_new_tokens=2, arrival_s=0.0)
  row["prompt_ids"] = row["prompt_ids"][:FLAGS.chunk_size + 1]
  run(engine, [row])


def summarize(cache: str, reqs: dict, steps: list[dict], exact: str) -> dict:
  done = [r for r in reqs.values() if r.state is State.FINISHED]
  per = [r.metrics.summary() for r in done]
  out_tokens = sum(len(r.output) for r in done)
  start = min((r.metrics.arrival for r in reqs.values()), default=0.0)
  end = max((r.metrics.finished or 0.0 for r in reqs.values()), default=0.0)
  ttft = percentiles([p["ttft_s"] for p in per])
  tpot = percentiles([p["tpot_s"] for p in per])
  return dict(cache=cache, requests=len(reqs), finished=len(done),
              output_tokens=out_tokens,
              throughput=out_tokens / max(end - start, 1e-9),
              ttft_p50=ttft["p50"], ttft_p99=ttft["p99"], tpot_p50_ms=(
                  None if tpot["p50"] is None else 1e3 * tpot["p50"]),
              max_concurrency=max((s["running"] for s in steps), default=0),
              prefill_tokens=sum(s["prefill_tokens"] for s in steps),
              preemptions=sum(r.metrics.preemptions for r in reqs.values()),
              max_host_pages=max((s["host_pages_in_use"] for s in steps), default=0),
              max_device_mib=max((s["device_bytes_in_use"] for s in steps), default=0)
              / 2**20,
              misses=sum(s.get("misses", 0) for s in steps), exact=exact)


def last_line(row: dict) -> str:
  fmt = lambda v, scale=1.0: "nan" if v is None else f"{v * scale:.3g}"
  return (f"serve: cache={row['cache']} requests={row['requests']} "
          f"output_tokens={row['output_tokens']} throughput={row['throughput']:.3g} tok/s "
          f"ttft_p50={fmt(row['ttft_p50'])} s ttft_p99={fmt(row['ttft_p99'])} s "
          f"tpot_p50={fmt(row['tpot_p50_ms'])} ms max_concurrency={row['max_concurrency']} "
          f"prefill_tokens={row['prefill_tokens']} exact={row['exact']}")


def main(argv):
  del argv
  if FLAGS["top_k"].using_default_value:
    FLAGS.top_k = FLAGS.hot_slots // 2  # B = 2k, the paper's default
  if FLAGS.smoke:
    FLAGS.num_requests, FLAGS.prompt_range, FLAGS.output_range = 4, ["40", "150"], ["3", "6"]
    FLAGS.max_len, FLAGS.hot_slots, FLAGS.top_k, FLAGS.max_batch = 256, 64, 32, 3
    FLAGS.chunk_size, FLAGS.max_step_tokens = 64, 64
  out = common.start_run("serve", FLAGS.flag_values_dict(), FLAGS.out_root)
  model, tokenizer, _ = setup.load_model_and_prompt(None, 1)
  workload = (load_workload(FLAGS.workload, tokenizer) if FLAGS.workload
              else synthetic(tokenizer))
  selector, params = (None, None) if FLAGS.cache == "dense" else setup.build_selector(
      FLAGS.selector, model.cfg, FLAGS.top_k, FLAGS.indexer_ckpt)
  print(f"platform: {common.platform()}; {len(workload)} requests; cache={FLAGS.cache}",
        flush=True)
  warm_up(lambda: build(model, FLAGS.cache, selector, params), workload)
  engine = build(model, FLAGS.cache, selector, params, FLAGS.kv_budget_mib)
  steps: list[dict] = []
  reqs = run(engine, workload, steps)
  done = {k: r for k, r in reqs.items() if r.state is State.FINISHED}
  exact = f"-/{len(done)}"
  if FLAGS.check_exact:
    reference = "dense" if FLAGS.cache == "dense" else "sparse"
    matched = 0
    rows = {r["id"]: r for r in workload}
    warm_up(lambda: build(model, reference, selector, params), workload)
    for rid, req in done.items():
      alone = run(build(model, reference, selector, params), [dict(rows[rid], arrival_s=0.0)])
      matched += alone[rid].output == req.output
    exact = f"{matched}/{len(done)}"
  for req in reqs.values():
    common.append_jsonl(out / "requests.jsonl", dict(
        id=req.id, state=req.state.value, reason=req.reason, prompt_tokens=len(req.prompt),
        output_tokens=len(req.output), **req.metrics.summary()))
  for step in steps:
    common.append_jsonl(out / "steps.jsonl", step)
  row = summarize(FLAGS.cache, reqs, steps, exact)
  common.append_row(out, row)
  table = common.markdown_table([row], list(row))
  (out / "table.md").write_text(table + "\n")
  common.line_plot(out / "plot.png", [s["t"] for s in steps], [s["running"] for s in steps],
                   "engine time (s)", "requests holding a slot",
                   f"serve: cache={FLAGS.cache}, budget {FLAGS.kv_budget_mib:g} MiB")
  print(table)
  print(f"results: {out}")
  print(last_line(row))


if __name__ == "__main__":
  app.run(main)
