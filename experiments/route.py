r"""Engines as replicas in separate processes behind a router: prefix-aware routing
(each request to the replica holding its longest cached prefix, else the least
loaded; kvtier_jax/serving/router.py) against round-robin, on agent sessions.

Paper context: SGLang's HiSparse cannot combine its sparse hot cache with the radix
prefix cache; ours can (the Decode Radix Cache of PDD). Across replicas the prefix
only helps if a session's next turn reaches the replica that holds its history,
which is what SGLang's cache-aware router and KV-aware routers do.

Each replica is a process running the tiered engine with the prefix cache on
SmolLM2 (kvtier_jax/serving/replica.py). The processes join one multi-controller
runtime (``jax.distributed`` on localhost, gloo CPU collectives): their stats are
all-gathered by a collective. Both policies run on the same replicas (a fresh engine
each) and the same sessions; greedy tokens must be identical under both.

Command (~3.5 min on a 2-core CPU; ``--smoke`` ~1 min):
  python -m experiments.route --replicas=2
Results: results/route/<time>/ (config.json, rows.jsonl: one row per policy,
requests.jsonl, table.md, plot.png). Last line: ``route: replicas=N sessions=S
prefix_hit=A/B prefill_tokens=X/Y ttft_p50=P/Q s same_tokens=K/M`` (prefix routing /
round-robin).
"""

from __future__ import annotations

import multiprocessing
import socket

from absl import app, flags
import numpy as np

from experiments import common, workloads
from kvtier_jax.serving import replica

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 2, "Engine replicas (processes).")
flags.DEFINE_integer("sessions", 7, "Agent sessions (not a multiple of --replicas, "
                     "or round-robin keeps sessions together by chance).")
flags.DEFINE_integer("turns", 3, "Turns per session.")
flags.DEFINE_integer("first_len", 400, "Tokens of each session's first prompt.")
flags.DEFINE_integer("output_len", 8, "New tokens per turn.")
flags.DEFINE_float("session_gap_s", 0.5, "Seconds between session starts.")
flags.DEFINE_integer("max_batch", 4, "Slots per replica.")
flags.DEFINE_integer("hot_slots", 128, "B.")
flags.DEFINE_integer("top_k", 64, "k.")
flags.DEFINE_integer("chunk_size", 128, "Prompt tokens per prefill chunk.")
flags.DEFINE_integer("max_step_tokens", 256, "Tokens per engine step.")
flags.DEFINE_float("host_budget_mib", 1024.0, "Host MiB for each replica's page pool.")
flags.DEFINE_integer("model_layers", None, "Keep only SmolLM2's first n decoder layers "
                     "(real weights; smoke runs and tests).", lower_bound=1)
flags.DEFINE_bool("distributed", True, "Join the replicas in jax.distributed (gloo).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("out_root", None, "Results root.")
flags.DEFINE_bool("smoke", False, "Tiny run (tests).")

POLICIES = ("prefix", "round_robin")


def _replica_main(conn, index: int, count: int, port: int | None, config: dict) -> None:
  """One replica process: SmolLM2 + the tiered engine with the prefix cache."""
  import jax
  if port:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", count, index,
                               initialization_timeout=120)
  from jax.experimental import multihost_utils
  from kvtier_jax.serving import replica
  from kvtier_jax.serving.bench import RequestSpec
  from models import setup
  model, _, _ = setup.load_model_and_prompt(None, 1, num_layers=config["model_layers"])
  selector, params = setup.build_selector("quest", model.cfg, config["top_k"])
  device = jax.local_devices()[0]

  def factory():
    backend = workloads.build_backend(
        model, "tiered", selector=selector, params=params, max_batch=config["max_batch"],
        max_len=config["max_len"], chunk_size=config["chunk_size"], page_size=16,
        hot_slots=config["hot_slots"], host_budget_mib=config["host_budget_mib"],
        device=device)
    return workloads.build_engine(backend, max_step_tokens=config["max_step_tokens"],
                                  prefix_cache=True)
  workloads.warm_up(factory(), RequestSpec("warm", tuple(config["warm_prompt"]), 2),
                    config["chunk_size"])
  replica.serve(factory, conn,
                gather=multihost_utils.process_allgather if port else None)
  if port:
    jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _await(conns, kind: str) -> list:
  out = []
  for conn in conns:
    msg = conn.recv()
    if msg[0] != kind:
      raise RuntimeError(f"replica sent {msg[0]!r}, expected {kind!r}")
    out.append(msg[1:])
  return out


def main(argv):
  del argv
  if FLAGS.smoke:
    FLAGS.sessions, FLAGS.turns, FLAGS.first_len, FLAGS.output_len = 3, 2, 150, 4
    FLAGS.hot_slots, FLAGS.top_k, FLAGS.chunk_size, FLAGS.max_step_tokens = 64, 32, 64, 64
    FLAGS.max_batch, FLAGS.session_gap_s, FLAGS.host_budget_mib = 2, 0.2, 256.0
  out = common.start_run("route", FLAGS.flag_values_dict(), FLAGS.out_root)
  from models import setup, text
  _, tokenizer, _ = setup.load_model_and_prompt(None, 1)
  stream = text.tokenize_prompt(tokenizer, text.load_text(), 60000)
  sessions = workloads.sessions(stream, np.random.default_rng(FLAGS.seed), FLAGS.sessions,
                                FLAGS.first_len, FLAGS.turns, FLAGS.output_len, "skewed")
  longest = max(len(s.prompt) + sum(map(len, s.env_tokens)) + sum(s.max_new_tokens)
                for s in sessions)
  config = dict(model_layers=FLAGS.model_layers, top_k=FLAGS.top_k,
                max_batch=FLAGS.max_batch, hot_slots=FLAGS.hot_slots,
                host_budget_mib=FLAGS.host_budget_mib,
                chunk_size=FLAGS.chunk_size, max_step_tokens=FLAGS.max_step_tokens,
                max_len=-(-longest // FLAGS.chunk_size) * FLAGS.chunk_size,
                warm_prompt=list(sessions[0].prompt))
  port = _free_port() if FLAGS.distributed and FLAGS.replicas > 1 else None
  ctx = multiprocessing.get_context("spawn")
  pipes = [ctx.Pipe() for _ in range(FLAGS.replicas)]
  procs = [ctx.Process(target=_replica_main, args=(child, i, FLAGS.replicas, port, config),
                       daemon=True) for i, (_, child) in enumerate(pipes)]
  for proc in procs:
    proc.start()
  conns = [parent for parent, _ in pipes]
  print(f"platform: {common.platform()}; {FLAGS.replicas} replica processes"
        f"{' in jax.distributed (gloo)' if port else ''}; {len(sessions)} sessions x "
        f"{FLAGS.turns} turns", flush=True)
  _await(conns, "ready")
  rows, runs = [], {}
  for policy in POLICIES:
    run = replica.drive_sessions(conns, sessions, policy, FLAGS.chunk_size,
                                 FLAGS.session_gap_s, reply_timeout_s=600)  # a hang
    for conn in conns:
      conn.send(("reset",))
    stats = _await(conns, "stats")
    _await(conns, "ready")
    # Every replica reports all replicas' stats (the all-gather): they must agree.
    # (Without it each reports its own.)
    gathered = [s[0]["replicas"] for s in stats]
    if port and any(g != gathered[0] for g in gathered):
      raise RuntimeError("replicas disagree on the gathered stats")
    per = gathered[0] if port else [s[0]["replicas"][0] for s in stats]
    recs = list(run["records"].values())
    ttft = [r["ttft_s"] for r in recs if "ttft_s" in r]
    prompt = sum(p["prompt_tokens"] for p in per)
    row = dict(policy=policy, replicas=FLAGS.replicas, requests=len(recs),
               finished=sum(r.get("state") == "finished" for r in recs),
               prompt_tokens=prompt, cached_tokens=sum(p["cached_tokens"] for p in per),
               prefix_hit=sum(p["cached_tokens"] for p in per) / max(prompt, 1),
               prefill_tokens=sum(p["prefill_tokens"] for p in per),
               ttft_p50_s=float(np.percentile(ttft, 50)),
               ttft_p99_s=float(np.percentile(ttft, 99)),
               makespan_s=run["seconds"], routed_by_prefix=run["routed_by_prefix"],
               per_replica_requests=[sum(r["replica"] == i for r in recs)
                                     for i in range(FLAGS.replicas)],
               stats_by_collective=bool(port))
    rows.append(row)
    runs[policy] = run["records"]
    common.append_row(out, row)
    for rec in recs:
      common.append_jsonl(out / "requests.jsonl", dict(policy=policy, **rec))
  for conn in conns:
    conn.send(("stop",))
  _await(conns, "stats")
  for proc in procs:
    proc.join(timeout=60)
  other = runs["round_robin"]  # a session that failed at another turn there: not same
  same = sum(rid in other and rec.get("state") == other[rid].get("state") == "finished"
             and rec["output"] == other[rid]["output"]
             for rid, rec in runs["prefix"].items())  # (failed twice, [] twice: not same)
  columns = ["policy", "replicas", "requests", "finished", "prefix_hit", "prefill_tokens",
             "prompt_tokens", "ttft_p50_s", "ttft_p99_s", "makespan_s", "routed_by_prefix",
             "per_replica_requests"]
  table = common.markdown_table(rows, columns)
  (out / "table.md").write_text(table + "\n")
  common.bar_plot(out / "plot.png", [r["policy"] for r in rows],
                  [r["prefix_hit"] for r in rows], "prefix hit (prompt tokens cached)",
                  f"{FLAGS.replicas} replicas, {len(sessions)} agent sessions")
  print(table)
  print(f"results: {out}")
  a, b = rows
  print(f"route: replicas={FLAGS.replicas} sessions={len(sessions)} "
        f"prefix_hit={a['prefix_hit']:.3g}/{b['prefix_hit']:.3g} "
        f"prefill_tokens={a['prefill_tokens']}/{b['prefill_tokens']} "
        f"ttft_p50={a['ttft_p50_s']:.3g}/{b['ttft_p50_s']:.3g} s "
        f"same_tokens={same}/{len(runs['prefix'])}")


if __name__ == "__main__":
  app.run(main)
