r"""Extend-Decode handoff on the real model: a request decoded for m tokens on one
engine (PDD's RelayDecode) continues on another (MainDecode), either by sending the
K/V pages of its m relayed tokens or by sending only their ids and replaying them
through the receiver's decode steps; tokens equal an uninterrupted run either way.

Paper (PDD, arXiv 2609.13161): for 100 relayed tokens the handoff takes 512.6 ms when the
incremental KV is sent and 321.4 ms with Extend-Decode.

Per m: the receiver's measured time from ``accept`` to its first new token (the
handoff's compute), the bytes that cross, and those bytes' time on a
``--wan_gbps`` link. With ``--two_process`` the receiver is a second process fed
over a local socket capped at ``--link_mbps`` (the P / D demonstration).

Command (~6 min on a 2-core CPU; ``--two_process --smoke`` ~1 min):
  python -m experiments.handoff
  python -m experiments.handoff --two_process --relayed=16
Results: results/handoff/<time>/ (config.json, rows.jsonl, table.md, plot.png).
Last line: ``handoff: relayed=M send_kv_s=A extend_s=B kv_mib=C exact=E/N``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from absl import app, flags

from experiments import common, model_setup
from kvtier_jax.serving import Engine, EngineConfig, SamplingParams
from kvtier_jax.serving import handoff as handoff_lib
from models import serving, setup, text

FLAGS = flags.FLAGS
flags.DEFINE_list("relayed", ["1", "4", "16", "64"], "Relayed tokens m.")
flags.DEFINE_integer("hot_slots", 128, "B.")
flags.DEFINE_float("wan_gbps", 20.0, "Link for the bytes' time (PDD's WAN).")
flags.DEFINE_bool("two_process", False, "Run the receiver in a second process over a "
                  "local socket.")
flags.DEFINE_float("link_mbps", 200.0, "Socket bandwidth cap (two-process mode), MB/s.")
flags.DEFINE_string("serve_port", None, "(internal) run as the receiver on this port.")
flags.DEFINE_string("out_root", None, "Results root.")
flags.DEFINE_bool("smoke", False, "Tiny run (tests).")

CHUNK, PAGE, SLOTS = 128, 16, 2
flags.DEFINE_integer("max_len", 1024, "Positions a request may reach.")


def build(model):
  selector, params = setup.build_selector("quest", model.cfg, FLAGS.hot_slots // 2)
  backend = serving.ServingBackend(model, "tiered", SLOTS, FLAGS.max_len, selector=selector,
                                   selector_params=params, hot_slots=FLAGS.hot_slots,
                                   chunk_size=CHUNK, page_size=PAGE)
  return Engine(backend, EngineConfig(max_step_tokens=CHUNK, prefix_cache=True))


def until(engine, done) -> None:
  while not done():
    engine.step()


def relay(engine, prompt, relayed, total, sp, rid):
  """Prefill and decode ``relayed`` tokens (the RelayDecode part)."""
  req = engine.submit(prompt, total, sp, request_id=rid)
  until(engine, lambda: len(req.output) >= relayed or req.state.done)
  if len(req.output) < relayed:  # (else an idle engine would be stepped forever)
    raise RuntimeError(f"request {rid} ended ({req.state.value}: {req.reason}) after "
                       f"{len(req.output)} of its {relayed} relayed tokens")
  return req


def receive(engine, handoff) -> tuple[float, object, int]:
  """Accept a handoff; returns (seconds to the first new token, the request, the
  positions whose K/V it imported: 0 when the receiver recomputed them)."""
  start, imported = time.perf_counter(), engine.imported_tokens
  req = engine.accept(handoff)
  known = len(handoff.output)
  until(engine, lambda: len(req.output) > known or req.state.done)
  seconds = time.perf_counter() - start
  until(engine, lambda: req.state.done)
  return seconds, req, engine.imported_tokens - imported


def answer(engine, frame: bytes) -> dict:
  """The reply to one frame: the finished request's, or why the frame or the
  handoff was refused (the sender raises that; the receiver serves on)."""
  try:
    seconds, req, imported = receive(engine, handoff_lib.Handoff.from_bytes(frame))
  except ValueError as e:  # an unparsable frame, a handoff the engine refuses
    return dict(error=f"{type(e).__name__}: {e}")
  return dict(id=req.id, output=req.output, seconds=seconds, state=req.state.value,
              imported=imported)


def serve_receiver(port: int) -> None:
  """The MainDecode process: accept handoffs from the socket, finish them, reply."""
  model, _, _ = model_setup.load_model_and_prompt(None, 1)
  engine = build(model)
  with socket.create_connection(("127.0.0.1", port)) as sock:
    while True:
      try:
        frame = handoff_lib.recv(sock)
      except ConnectionError:
        return
      handoff_lib.send(sock, json.dumps(answer(engine, frame)).encode())


def main(argv):
  del argv
  model_setup.refuse_given(model_setup.NO_LOOKAHEAD, "this runner runs no look-ahead "
                           "(generate, serve and prefetch do)")
  model_setup.refuse_given(["selector", "top_k", "impl", "indexer_ckpt", "prompt_file",
                            "offset"], "this runner relays with quest at k = "
                           "--hot_slots / 2 over the bundled corpus")
  if FLAGS.serve_port:
    serve_receiver(int(FLAGS.serve_port))
    return
  if FLAGS["prompt_tokens"].using_default_value:
    FLAGS.prompt_tokens = 200 if FLAGS.smoke else 600
  if FLAGS.smoke:
    FLAGS.relayed, FLAGS.max_len = ["3"], 256
  out = common.start_run("handoff", FLAGS.flag_values_dict(), FLAGS.out_root)
  peer = listener = receiver = None
  if FLAGS.two_process:  # start the receiver first: it loads and compiles meanwhile
    listener = socket.create_server(("127.0.0.1", 0))
    peer = subprocess.Popen([sys.executable, "-m", "experiments.handoff",
                             f"--serve_port={listener.getsockname()[1]}",
                             f"--hot_slots={FLAGS.hot_slots}", f"--max_len={FLAGS.max_len}",
                             *([f"--model_layers={FLAGS.model_layers}"]
                               if FLAGS.model_layers else []),
                             *([f"--decode_row_tile={FLAGS.decode_row_tile}"]
                               if FLAGS.decode_row_tile else [])],
                            env=dict(os.environ))
  model, tokenizer, _ = model_setup.load_model_and_prompt(None, 1)
  stream = text.tokenize_prompt(tokenizer, text.load_text(), FLAGS.prompt_tokens)
  relayed = list(map(int, FLAGS.relayed))
  total = max(relayed) + 8
  prompt = [int(t) for t in stream[:FLAGS.prompt_tokens]]
  cases = [("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=0.8,
                                                                     top_p=0.95, seed=11))]
  # The receiver already holds the prompt (P sent it MD's increment, PDD): the
  # handoff moves only what RelayDecode generated. The uninterrupted runs on the
  # receiver cache the prompt and are the reference.
  # As the receiver's prefix cache shares it: whole chunks, one token left to prefill.
  cached = (len(prompt) - 1) // CHUNK * CHUNK
  sender = build(model)
  relay(sender, prompt, 1, 2, SamplingParams(), "warm-up")  # the sender's jits
  if FLAGS.two_process:
    listener.settimeout(300)
    conn, _ = listener.accept()
  else:
    receiver = build(model)

  def send(handoff):
    """(seconds on the socket or None, receiver seconds to a new token, outputs,
    frame bytes, positions imported)."""
    frame = handoff.to_bytes()
    if not FLAGS.two_process:
      seconds, got, imported = receive(receiver, handoff_lib.Handoff.from_bytes(frame))
      return None, seconds, got.output, len(frame), imported
    sent_s = handoff_lib.send(conn, frame, FLAGS.link_mbps * 1e6)
    reply = json.loads(handoff_lib.recv(conn))
    if "error" in reply:  # (it used to die: the sender read "peer closed")
      raise RuntimeError(f"the receiver refused handoff {handoff.request_id}: "
                         f"{reply['error']}")
    return sent_s, reply["seconds"], reply["output"], len(frame), reply["imported"]

  reference = {}
  for name, sp in cases:  # uninterrupted, on the receiver (warms its cache and jits)
    fresh = handoff_lib.Handoff(f"ref-{name}", prompt, [], total, sp)
    reference[name] = send(fresh)[2]

  def handoff_of(rid, m, sp, mode):
    """Relay ``m`` tokens on the sender and export them with ``kv=mode``."""
    relay(sender, prompt, m, total, sp, rid)
    return sender.export(rid, kv=mode, start=cached if mode == "all" else 0)

  # The first handoff of a kind compiles its path here (pages written, the hot cache
  # restaged) and on the sender (pages read): a throwaway one keeps that out of the
  # measured rows.
  for mode in ("all", "none"):
    send(handoff_of(f"warm-up-{mode}", relayed[0], SamplingParams(), mode))
  rows, exact = [], 0
  for m in relayed:
    for mode in ("all", "none"):
      for name, sp in cases:
        handoff = handoff_of(f"{name}-{m}-{mode}", m, sp, mode)
        sent_s, seconds, output, frame_bytes, imported = send(handoff)
        same = output == reference[name]
        exact += same
        wire = frame_bytes / (FLAGS.wan_gbps * 1e9 / 8)
        rows.append(dict(relayed=m, handoff="send KV" if mode == "all" else "extend",
                         sampling=name, kv_mib=handoff.kv_bytes / 2**20,
                         frame_kib=frame_bytes / 2**10, imported_tokens=imported,
                         wire_s=wire, socket_s=sent_s,
                         receiver_s=seconds, total_s=seconds + wire, exact=same))
        common.append_row(out, rows[-1])
  if FLAGS.two_process:
    conn.close()
    peer.wait(timeout=120)
    listener.close()
  table = common.markdown_table(rows, ["relayed", "handoff", "sampling", "kv_mib",
                                       "frame_kib", "imported_tokens", "wire_s",
                                       "socket_s", "receiver_s",
                                       "total_s", "exact"])
  (out / "table.md").write_text(table + "\n")
  greedy = [r for r in rows if r["sampling"] == "greedy"]
  common.bar_plot(out / "plot.png", [f"{r['relayed']} {r['handoff']}" for r in greedy],
                  [r["total_s"] for r in greedy], "handoff seconds (receiver + wire)",
                  f"SmolLM2 tiered, {FLAGS.prompt_tokens}-token prompt, "
                  f"{FLAGS.wan_gbps:g} Gbps")
  print(table)
  print(f"results: {out}")
  top = max(relayed)
  pick = lambda kind: next(r for r in greedy if r["relayed"] == top and r["handoff"] == kind)
  print(f"handoff: relayed={top} send_kv_s={pick('send KV')['total_s']:.3g} "
        f"extend_s={pick('extend')['total_s']:.3g} "
        f"kv_mib={pick('send KV')['kv_mib']:.3g} exact={exact}/{len(rows)}")


if __name__ == "__main__":
  app.run(main)
