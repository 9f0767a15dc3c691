"""An engine replica in its own process, driven over a ``multiprocessing`` pipe (a
router in front of several of them: router.py).

Messages to the replica: ``("submit", request dict)`` (``id``, ``prompt``,
``max_new_tokens``; optional ``sampling``, a ``SamplingParams`` as a dict, and
``stop_ids``), ``("reset",)`` (report and start a fresh engine: a new
measurement on the same compiled model) and ``("stop",)``. From it: ``("ready",)``
once its engine is built, ``("first", id)`` at a request's first token, ``("done",
id, dict)`` when it ends: its ``state``, ``output`` and ``cached_tokens``
(``"failed"``, ``[]`` and None for a request its engine refused), and with
``sampling.logprobs`` its ``logprobs`` and ``top_logprobs`` (``Request``'s, the
pairs as lists); and ``("stats", dict)`` on reset
and stop: the engine's prompt tokens, those served by its prefix cache and the
prompt tokens it computed. With ``gather`` (the multi-controller runtime's
all-gather, e.g. ``jax.experimental.multihost_utils.process_allgather``) every
replica reports all replicas' stats, gathered by a collective, not by the router.

A replica never drops a request it was sent: one it cannot read or its engine
refuses is reported failed at once; a reset or a step that fails before it
completes ends every request still in flight (reported ``"aborted"``); a step
that fails after completing (the engine failed just the requests it touched) is
logged and the replica serves on. Every error goes to stderr.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing.connection
import sys
import time
import traceback
from typing import Callable

import numpy as np

from kvtier_jax.serving.bench import first_admission_tokens
from kvtier_jax.serving.request import Request, SamplingParams, State
from kvtier_jax.serving.router import Router

_STATS = ("prompt_tokens", "cached_tokens", "prefill_tokens", "steps")


def ended(req: Request) -> dict:
  """What a "done" message says of ``req``."""
  out = dict(state=req.state.value, output=list(req.output),
             cached_tokens=req.metrics.cached_tokens)
  if req.sampling.logprobs is not None:
    out.update(logprobs=list(req.logprobs),
               top_logprobs=[[list(pair) for pair in top] for top in req.top_logprobs])
  return out


def serve(engine_factory: Callable[[], object], conn, *,
          gather: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
  """Run engines from ``engine_factory`` on the messages of ``conn`` until stop."""
  engine, reported, computed = engine_factory(), set(), [0]
  conn.send(("ready",))

  def first_token(req, token):
    del token
    if len(req.output) == 1:
      conn.send(("first", req.id))

  def stats() -> dict:
    # Each request at its first admission: a preempted one admitted again would
    # count its prompt twice and hit its own cached prompt.
    prompt, cached = first_admission_tokens(list(engine.requests.values()))
    row = np.array([prompt, cached, computed[0], engine.steps], np.int64)
    rows = row[None] if gather is None else np.asarray(gather(row)).reshape(-1, row.size)
    return dict(replicas=[dict(zip(_STATS, map(int, r))) for r in rows])

  def report_ended() -> None:
    for req in engine.requests.values():
      if req.state.done and req.id not in reported:
        reported.add(req.id)
        conn.send(("done", req.id, ended(req)))

  def end_in_flight(why: str) -> None:
    """Abort every request not yet ended (a reset, an engine that failed mid-step)
    and report them: a client waits for each request it sent."""
    for req in list(engine.requests.values()):
      if not req.state.done:
        engine.abort(req.id)
        req.reason = why
    report_ended()

  def refuse(spec, err: Exception) -> None:
    print(f"replica: refused submit {spec!r:.200}: {type(err).__name__}: {err}",
          file=sys.stderr, flush=True)
    rid = spec.get("id") if isinstance(spec, dict) else None
    if isinstance(rid, str):  # (an unnamed request: nobody waits for it)
      conn.send(("done", rid, dict(state=State.FAILED.value, output=[],
                                   cached_tokens=None)))

  while True:
    while conn.poll(0 if engine.has_work else None):
      kind, *args = conn.recv()
      if kind == "submit":
        spec = args[0] if args else None
        try:
          engine.submit(spec["prompt"], spec["max_new_tokens"],
                        SamplingParams(**spec.get("sampling", {})),
                        stop_ids=spec.get("stop_ids", ()), request_id=spec["id"],
                        on_token=first_token)
        except (TypeError, ValueError, KeyError, AttributeError) as err:
          refuse(spec, err)  # too long, a taken id, bad sampling, malformed: serve on
      elif kind in ("reset", "stop"):
        end_in_flight(f"replica {kind} with the request in flight")
        conn.send(("stats", stats()))
        if kind == "stop":
          return
        engine, reported, computed = engine_factory(), set(), [0]
        conn.send(("ready",))
      else:
        print(f"replica: unknown message {kind!r:.80} ignored", file=sys.stderr, flush=True)
    if engine.has_work:
      steps = engine.steps
      try:
        computed[0] += engine.step()["prefill_tokens"]
      except Exception:  # noqa: BLE001 - a replica outlives one step's fault
        traceback.print_exc(file=sys.stderr)
        if engine.steps == steps:  # it did not complete: nothing in flight is sound
          end_in_flight("the engine's step failed before completing")
        # (else it completed: the engine failed just what the fault touched)
      report_ended()


def drive_sessions(conns, sessions, policy: str, chunk_size: int, gap_s: float, *,
                   reply_timeout_s: float | None = None) -> dict:
  """The client side: every session's turns (``bench.Rollout``s) through a
  ``Router`` to the replicas on ``conns``, session i starting at ``i * gap_s``; a
  turn's successor is sent ``env_seconds`` after it finished (a turn that failed
  ends its session, as ``bench.drive`` ends a rollout). Returns per-request
  records (replica, prompt tokens, TTFT, E2E, and the "done" message's fields).
  Turn ids must be unique (``ValueError`` before anything is sent).
  ``reply_timeout_s``: raise ``TimeoutError`` when requests are outstanding and no
  replica has said anything for that long (a replica that hangs but lives; one
  that exits raises ``EOFError``)."""
  ids = collections.Counter(s.turn(t, (), 0.0).id for s in sessions
                            for t in range(len(s.max_new_tokens)))
  taken = sorted(i for i, n in ids.items() if n > 1)
  if taken:  # their replies could not be told apart
    raise ValueError(f"request ids {taken[:5]} are used by more than one turn")
  router = Router(len(conns), chunk_size, policy)
  start = time.perf_counter()
  now = lambda: time.perf_counter() - start
  due = [(i * gap_s, s, 0, list(s.prompt)) for i, s in enumerate(sessions)]
  where, sent, records, outstanding = {}, {}, {}, 0
  heard = now()  # the last message from any replica (or the last submit)
  while due or outstanding:
    due.sort(key=lambda d: d[0])
    while due and due[0][0] <= now():
      _, session, turn, history = due.pop(0)
      spec = session.turn(turn, history, 0.0)
      replica = router.route(spec.prompt)
      conns[replica].send(("submit", dict(
          id=spec.id, prompt=list(spec.prompt), max_new_tokens=spec.max_new_tokens,
          sampling=dataclasses.asdict(spec.sampling), stop_ids=list(spec.stop_ids))))
      where[spec.id], sent[spec.id] = replica, now()
      records[spec.id] = dict(id=spec.id, replica=replica, prompt_tokens=len(history),
                              session=session, turn=turn, history=history)
      outstanding += 1
      heard = now()
    timeout = max(0.0, due[0][0] - now()) if due else None
    if outstanding and reply_timeout_s is not None:
      silent_until = heard + reply_timeout_s
      if now() >= silent_until:
        waiting = sorted(rid for rid, rec in records.items() if "state" not in rec)
        raise TimeoutError(f"no replica answered for {reply_timeout_s} s; "
                           f"outstanding: {waiting}")
      timeout = silent_until - now() if timeout is None else min(timeout,
                                                                 silent_until - now())
    for conn in multiprocessing.connection.wait(conns, timeout):
      heard = now()
      kind, rid, *rest = conn.recv()
      rec = records[rid]
      if kind == "first":
        rec["ttft_s"] = now() - sent[rid]
        continue
      (report,) = rest
      rec.update(report, e2e_s=now() - sent[rid])
      state, output = report["state"], report["output"]
      router.done(where[rid])
      if state == "failed" and report["cached_tokens"] is None:  # refused at submit
        router.forget(where[rid], rec["history"])
      outstanding -= 1
      session, turn = rec.pop("session"), rec["turn"]
      history = rec.pop("history")
      if state == "finished" and turn + 1 < len(session.max_new_tokens):
        nxt = history + output + list(session.env_tokens[turn])
        due.append((now() + session.env_seconds, session, turn + 1, nxt))
  return dict(records=records, seconds=now(), routed_by_prefix=router.routed_by_prefix)
