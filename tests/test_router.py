"""The prefix-aware router (kvtier_jax/serving/router.py) against a brute-force
record of what it sent where, and replicas in two processes (experiments.route)."""

import collections
import dataclasses
import re

import numpy as np
import pytest

from kvtier_jax.serving.router import Router
from tests.test_experiments import only_run, run
from tests.util import SMOKE_LAYERS

CHUNK = 4


def brute_match(sent: list[list[int]], prompt: list[int]) -> int:
  """Longest whole-chunk prefix of ``prompt`` shared with any prompt in ``sent``,
  short of ``prompt``'s last token (always prefilled: the engine's cache serves
  at most the whole chunks before it)."""
  best = 0
  for other in sent:
    n = 0
    while (n + CHUNK <= min(len(other), len(prompt) - 1)
           and other[n:n + CHUNK] == prompt[n:n + CHUNK]):
      n += CHUNK
    best = max(best, n)
  return best


def _ends(conn, count, timeout=30):
  """{request id: its "done" message's dict} of the next ``count`` requests a
  replica reports ended (other messages skipped)."""
  done = {}
  while len(done) < count:
    assert conn.poll(timeout), f"the replica stopped answering: {done}"
    kind, rid, *rest = conn.recv()
    if kind == "done":
      done[rid] = rest[0]
  return done


def test_a_replica_refuses_a_bad_request_and_serves_on():
  """A request its engine refuses (longer than the context) is reported failed, with
  no output, and the replica serves the next one with its solo tokens."""
  import multiprocessing
  import threading

  from kvtier_jax.serving import Engine, replica
  from tests.test_serving import FakeModel, solo
  ours, theirs = multiprocessing.Pipe()
  thread = threading.Thread(target=replica.serve,
                            args=(lambda: Engine(FakeModel()), theirs), daemon=True)
  thread.start()
  assert ours.recv() == ("ready",)
  ours.send(("submit", dict(id="long", prompt=list(range(200)), max_new_tokens=4)))
  ours.send(("submit", dict(id="fine", prompt=[3, 4, 5], max_new_tokens=4)))
  done = _ends(ours, 2)
  ours.send(("stop",))
  assert ours.recv()[0] == "stats"
  thread.join(10)
  assert done["long"] == dict(state="failed", output=[], cached_tokens=None)
  assert done["fine"] == dict(state="finished", output=solo(FakeModel, [3, 4, 5], 4),
                              cached_tokens=0)


def _replicas(count, factory):
  import multiprocessing
  import threading

  from kvtier_jax.serving import replica
  pipes = [multiprocessing.Pipe() for _ in range(count)]
  for _, theirs in pipes:
    threading.Thread(target=replica.serve, args=(factory, theirs), daemon=True).start()
  conns = [ours for ours, _ in pipes]
  for conn in conns:
    assert conn.poll(30) and conn.recv() == ("ready",)
  return conns


def _stop(conns):
  """Stop the replicas and take their last stats (a pipe closed first breaks the
  replica thread's reply)."""
  for conn in conns:
    conn.send(("stop",))
  for conn in conns:
    assert conn.poll(30) and conn.recv()[0] == "stats"


def test_replica_stats_count_each_prompt_once_under_preemption():
  """Three distinct prompts in a small host pool preempt each other: the replica's
  prompt and cached tokens (route.py's prefix hit) count each request at its first
  admission (they counted every admission: 330 prompt tokens for 90, and a 44%
  "hit" on prompts that share nothing)."""
  from kvtier_jax.serving import Engine, EngineConfig
  from tests.test_serving import FakeModel
  (conn,) = _replicas(1, lambda: Engine(FakeModel(num_host_pages=24),
                                        EngineConfig(prefix_cache=True, max_step_tokens=16)))
  rng = np.random.default_rng()
  # Distinct first tokens: no two prompts share a chunk.
  prompts = {f"r{i}": [i] + rng.integers(4, 62, 29).tolist() for i in range(3)}
  for rid, prompt in prompts.items():
    conn.send(("submit", dict(id=rid, prompt=prompt, max_new_tokens=50)))
  done = _ends(conn, len(prompts), timeout=60)
  conn.send(("stop",))
  kind, stats = conn.recv()
  assert all(d["state"] == "finished" for d in done.values()), done
  assert stats["replicas"][0]["prompt_tokens"] == 90
  assert stats["replicas"][0]["cached_tokens"] == 0
  assert stats["replicas"][0]["prefill_tokens"] > 90  # the preemptions recomputed


def test_a_failed_turn_ends_its_session():
  """The sessions' client (route.py's): a turn the replica refuses (90 + 10 > 96
  positions) is reported failed and ends the session; its next turn (history + no
  output + the environment's tokens) is not sent."""
  from kvtier_jax.serving import Engine, bench, replica
  from tests.test_serving import FakeModel
  conns = _replicas(2, lambda: Engine(FakeModel()))
  session = bench.Rollout("s", tuple(i % 60 + 1 for i in range(90)), (10, 2), ((5,),))
  run = replica.drive_sessions(conns, [session], "prefix", 8, 0.0)
  _stop(conns)
  assert {rid: rec["state"] for rid, rec in run["records"].items()} == {"s/t0": "failed"}


def test_a_replica_that_hangs_alive_times_the_client_out():
  """A replica that takes requests and never answers (alive, so no ``EOFError``):
  the client raises after ``reply_timeout_s`` of silence, naming what is
  outstanding (it waited for good)."""
  import multiprocessing
  import time

  from kvtier_jax.serving import bench, replica
  ours, _theirs = multiprocessing.Pipe()  # nobody serves the other end
  session = bench.Rollout("s", (1, 2, 3), (4,), ())
  start = time.perf_counter()
  with pytest.raises(TimeoutError, match=r"s/t0"):
    replica.drive_sessions([ours], [session], "prefix", 8, 0.0, reply_timeout_s=0.3)
  assert 0.3 <= time.perf_counter() - start < 10


def test_sessions_whose_turns_share_an_id_are_refused_before_anything_is_sent():
  """Two turns of one id on two replicas: the second reply found its record spent
  (a KeyError mid-run); on one replica the engine refused it, and its failure was
  read as the first turn's."""
  import multiprocessing
  from kvtier_jax.serving import bench, replica
  ours, theirs = multiprocessing.Pipe()
  twins = [bench.Rollout("s", (1, 2, 3), (4,), ()) for _ in range(2)]
  named = bench.Rollout("a", (1, 2, 3), (4, 4), ((5,),), turn_ids=("x", "x"))
  for sessions in (twins, [named]):
    with pytest.raises(ValueError, match="more than one turn"):
      replica.drive_sessions([ours, ours], sessions, "prefix", 8, 0.0)
  assert not theirs.poll(0.1)  # nothing was sent


def test_sessions_keep_their_sampling_through_the_replicas():
  """A sampled session's turns decode with its own ``SamplingParams`` on the
  replica (they were sent without them and decoded greedily), its log-probabilities
  come back with them, and a submitted request's stop ids are the replica's
  engine's."""
  from kvtier_jax.serving import Engine, SamplingParams, bench, replica
  from tests.test_serving import FakeModel, solo
  sampled = SamplingParams(temperature=1.0, top_k=5, seed=7, logprobs=3,
                           logprobs_mode="processed")
  prompt = tuple(i % 50 + 3 for i in range(20))
  conns = _replicas(2, lambda: Engine(FakeModel()))
  sessions = [bench.Rollout("s", prompt, (8,), (), sampling=sampled),
              bench.Rollout("g", prompt[:12], (4,), ())]
  run = replica.drive_sessions(conns, sessions, "prefix", 8, 0.0)
  alone = Engine(FakeModel())
  want = alone.submit(list(prompt), 8, sampled)
  alone.run()
  assert want.output != solo(FakeModel, list(prompt), 8)  # the draw differs from greedy
  got = run["records"]["s/t0"]
  assert (got["output"], got["logprobs"]) == (want.output, want.logprobs)
  assert got["top_logprobs"] == [[list(pair) for pair in top] for top in want.top_logprobs]
  assert "logprobs" not in run["records"]["g/t0"]  # not asked for
  want = want.output
  stop = want[2]
  conns[0].send(("submit", dict(id="stops", prompt=list(prompt), max_new_tokens=8,
                                sampling=dataclasses.asdict(sampled), stop_ids=[stop])))
  while True:
    assert conns[0].poll(30)
    kind, rid, *rest = conns[0].recv()
    if kind == "done":
      break
  _stop(conns)
  assert rid == "stops" and rest[0]["output"] == want[:want.index(stop) + 1]


def test_session_turns_continue_their_history_and_each_reports_one_first_token(
    monkeypatch):
  """Turn 2's prompt is turn 1's prompt + its output + the environment's tokens:
  its tokens are that prompt's solo tokens. Each request says "first" once (TTFT
  before E2E), and the router hears of every end (its load goes back to zero)."""
  from kvtier_jax.serving import Engine, bench, replica
  from kvtier_jax.serving.router import Router
  from tests.test_serving import FakeModel, solo
  ends = []

  class Recording(Router):
    def done(self, r):
      super().done(r)
      ends.append(list(self.load))

  monkeypatch.setattr(replica, "Router", Recording)
  rng = np.random.default_rng()
  prompt = tuple(rng.integers(3, 60, 20).tolist())
  env = tuple(rng.integers(3, 60, 3).tolist())
  conns = _replicas(2, lambda: Engine(FakeModel()))
  firsts = collections.Counter()
  recv = type(conns[0]).recv

  def counting(conn):
    msg = recv(conn)
    if msg[0] == "first":
      firsts[msg[1]] += 1
    return msg

  monkeypatch.setattr(type(conns[0]), "recv", counting)
  sessions = [bench.Rollout("s", prompt, (6, 5), (env,)),
              bench.Rollout("u", prompt[:9], (4,), ())]
  run = replica.drive_sessions(conns, sessions, "prefix", 8, 0.0)
  monkeypatch.undo()
  _stop(conns)
  records = run["records"]
  out0 = solo(FakeModel, list(prompt), 6)
  assert records["s/t0"]["output"] == out0
  assert records["s/t1"]["output"] == solo(FakeModel, list(prompt) + out0 + list(env), 5)
  assert records["s/t1"]["prompt_tokens"] == len(prompt) + 6 + len(env)
  assert firsts == {rid: 1 for rid in records}
  assert all(0 < rec["ttft_s"] <= rec["e2e_s"] for rec in records.values())
  assert len(ends) == len(records) == 3 and ends[-1] == [0, 0]


def test_a_replica_outlives_faults_and_malformed_messages_and_loses_no_request():
  """A replica answers every request it was sent: a fault its engine survives (a
  refused batch, then one request's decode alone faults: that request fails, the
  other finishes with its solo tokens); a fault that stops a step before it
  completes (every request in flight is reported aborted); submits it cannot read
  and unknown messages (refused or ignored); a reset with a request in flight
  (reported aborted before the stats). After each, it serves the next request
  exactly. Before, each of these killed the replica or left a request unanswered."""
  import numpy as np  # noqa: PLC0415

  from kvtier_jax.driver import StepRefused  # noqa: PLC0415
  from kvtier_jax.serving import Engine  # noqa: PLC0415
  from tests.test_serving import FakeModel, solo  # noqa: PLC0415
  faulty, broken = 50, 51  # prompts starting with these fault

  class Flaky(FakeModel):
    def decode(self, state, tokens, active):
      slots = np.flatnonzero(active)
      first = [state["seq"][s][0] for s in slots]
      if broken in first:
        raise RuntimeError("the batch step faulted")  # before the step completes
      if faulty in first:
        if len(slots) > 1:
          raise StepRefused("batch refused", state)
        raise RuntimeError("a decode alone faulted")
      return super().decode(state, tokens, active)

  (conn,) = _replicas(1, lambda: Engine(Flaky(num_slots=4)))
  submit = lambda rid, prompt, new=6: conn.send(("submit", dict(
      id=rid, prompt=prompt, max_new_tokens=new)))
  submit("good", [3, 4, 5])
  submit("bad", [faulty, 4, 5])
  done = _ends(conn, 2)
  assert done["good"]["output"] == solo(FakeModel, [3, 4, 5], 6)
  assert done["bad"]["state"] == "failed"
  submit("a", [6, 7, 8], 20)
  submit("b", [broken, 7, 8])
  assert {rid: d["state"] for rid, d in _ends(conn, 2).items()} == dict(a="aborted",
                                                                       b="aborted")
  for message in (("submit", dict(id="m1", prompt=[3])), ("submit", ["m2"]), ("submit",),
                  ("resize", 3)):
    conn.send(message)
  submit("after", [9, 10, 11])
  done = _ends(conn, 2)  # m1 (named, unreadable) and after; m2 and the rest: no id
  assert done["m1"] == dict(state="failed", output=[], cached_tokens=None)
  assert done["after"]["output"] == solo(FakeModel, [9, 10, 11], 6)
  submit("cut", [12, 13, 14], 40)
  conn.send(("reset",))
  assert _ends(conn, 1)["cut"]["state"] == "aborted"
  assert conn.recv()[0] == "stats" and conn.recv() == ("ready",)
  submit("fresh", [15, 16])
  assert _ends(conn, 1)["fresh"]["output"] == solo(FakeModel, [15, 16], 6)
  _stop([conn])


def test_a_replica_refuses_a_malformed_sampling_and_resets_its_counts():
  """Sampling with an unknown field is refused like any bad request (it raised a
  TypeError and killed the replica); a reset starts its counts afresh: the same
  requests before and after report the same stats."""
  from kvtier_jax.serving import Engine, EngineConfig
  from tests.test_serving import FakeModel, solo
  (conn,) = _replicas(1, lambda: Engine(FakeModel(), EngineConfig(prefix_cache=True)))

  def serve(requests):
    for rid, prompt, sampling in requests:
      conn.send(("submit", dict(id=rid, prompt=prompt, max_new_tokens=3,
                                sampling=sampling)))
    return _ends(conn, len(requests))

  prompt = list(range(3, 23))
  done = serve([("bad", prompt, {"bogus": 1}), ("ok", prompt, {})])
  assert done["bad"] == dict(state="failed", output=[], cached_tokens=None)
  assert done["ok"]["output"] == solo(FakeModel, prompt, 3)
  stats = []
  for _ in range(2):
    conn.send(("reset",))
    kind, got = conn.recv()
    assert kind == "stats" and conn.recv() == ("ready",)
    stats.append(got)
    serve([("again", prompt, {})])
  conn.send(("stop",))
  kind, got = conn.recv()
  # The first reset reports the first engine's; every later engine served "again"
  # alone, from nothing, and reports the same counts.
  assert stats[1]["replicas"] == got["replicas"]
  assert got["replicas"][0]["prefill_tokens"] == len(prompt)


def test_a_replica_that_answers_slowly_but_steadily_is_not_timed_out():
  """The client's silence clock restarts at every message: a request whose first
  token and end each come within ``reply_timeout_s``, though together they take
  longer, is served (the clock counted from the submit timed it out). The sleeps
  are floors: a loaded machine only makes a submit-counted clock surer to fire,
  and each gap has 0.7 s to spare."""
  import multiprocessing
  import threading
  import time

  from kvtier_jax.serving import bench, replica
  ours, theirs = multiprocessing.Pipe()

  def slow():
    _, spec = theirs.recv()
    time.sleep(0.8)
    theirs.send(("first", spec["id"]))
    time.sleep(0.8)
    theirs.send(("done", spec["id"], dict(state="finished", output=[7],
                                          cached_tokens=0)))

  threading.Thread(target=slow, daemon=True).start()
  run = replica.drive_sessions([ours], [bench.Rollout("s", (1, 2, 3), (1,), ())],
                               "prefix", 8, 0.0, reply_timeout_s=1.5)
  assert run["records"]["s/t0"]["output"] == [7]


def test_prefix_router_matches_brute_force_and_respects_load():
  rng = np.random.default_rng()
  prefixes = [rng.integers(0, 50, int(rng.integers(4, 20))).tolist() for _ in range(4)]
  router = Router(3, CHUNK, "prefix", balance_abs=2)
  sent = [[] for _ in range(3)]
  for _ in range(200):
    prompt = prefixes[int(rng.integers(4))] + rng.integers(0, 50, int(rng.integers(0, 9))).tolist()
    matches = [brute_match(s, prompt) for s in sent]
    assert [router.match(r, prompt) for r in range(3)] == matches
    load = list(router.load)
    pick = router.route(prompt)
    least = min(range(3), key=lambda r: (load[r], r))
    best = max(range(3), key=lambda r: (matches[r], -load[r], -r))
    want = best if matches[best] and load[best] - load[least] <= 2 else least
    assert pick == want
    sent[pick].append(prompt)
    if rng.random() < 0.5:  # a random outstanding request finishes
      busy = [r for r in range(3) if router.load[r]]
      router.done(busy[int(rng.integers(len(busy)))])
    if rng.random() < 0.2:  # a replica refused a prompt routed there
      held = [r for r in range(3) if sent[r]]
      replica = held[int(rng.integers(len(held)))]
      router.forget(replica, sent[replica].pop(int(rng.integers(len(sent[replica])))))
  assert router.routed_by_prefix > 0


def test_a_refused_prompt_is_forgotten_but_not_a_chunk_another_prompt_holds():
  router = Router(2, CHUNK, "prefix")
  shared, refused = list(range(8)), list(range(8)) + [50, 51, 52, 53]
  assert router.route(shared + [60]) == 0
  router.done(0)
  assert router.route(refused) == 0
  router.done(0)
  router.forget(0, refused)
  assert router.match(0, refused + [1]) == 8  # the first prompt's two chunks stay
  router.forget(0, shared + [60])
  assert router.match(0, refused + [1]) == 0


def test_the_client_forgets_a_prompt_a_replica_refused():
  """A session's turn refused by its replica (90 + 10 > 96 positions) leaves no
  chunk in the router's index: a later session sharing its first chunks is not
  routed by prefix to a replica that never cached them."""
  from kvtier_jax.serving import Engine, bench, replica
  from tests.test_serving import FakeModel
  conns = _replicas(2, lambda: Engine(FakeModel()))
  prompt = tuple(i % 60 + 1 for i in range(90))
  sessions = [bench.Rollout("long", prompt, (10,), ()),
              bench.Rollout("short", prompt[:40], (2,), ())]
  run = replica.drive_sessions(conns, sessions, "prefix", 8, 2.0)
  _stop(conns)
  states = {rid: rec["state"] for rid, rec in run["records"].items()}
  assert states == {"long/t0": "failed", "short/t0": "finished"}
  assert run["routed_by_prefix"] == 0


def test_baselines_and_bad_input():
  rr = Router(3, CHUNK, "round_robin")
  assert [rr.route([1] * 8) for _ in range(5)] == [0, 1, 2, 0, 1]
  ll = Router(2, CHUNK, "least_loaded")
  assert [ll.route([1]) for _ in range(3)] == [0, 1, 0]
  ll.done(0)
  ll.done(0)
  with pytest.raises(ValueError, match="no outstanding"):
    ll.done(0)
  with pytest.raises(ValueError, match="policy"):
    Router(2, CHUNK, "random")
  forgetful = Router(1, CHUNK, "prefix", max_chunks=2)
  forgetful.route(list(range(12)))  # three chunks: the last is forgotten
  assert forgetful.match(0, list(range(13))) == 8
  # A replica out of range would book another's load (-1: the last), or fail later.
  for call in (lambda: ll.done(-1), lambda: ll.done(2), lambda: ll.forget(-1, [1]),
               lambda: ll.match(2, [1]), lambda: ll.done(True)):
    with pytest.raises(ValueError, match="replica=.* must be an int in"):
      call()
  assert ll.load == [0, 1]
  for kwargs in (dict(max_chunks=-1), dict(balance_abs=-1)):
    with pytest.raises(ValueError, match="must be >= 0"):
      Router(2, CHUNK, **kwargs)


def test_a_prompt_of_whole_chunks_matches_all_but_its_last():
  """The engine prefills a prompt's last token whatever it has cached, so a prompt
  of whole chunks can reuse all of them but the last (``Engine._shareable``): the
  router counted that last chunk too, one chunk of over-estimate."""
  router = Router(1, CHUNK, "prefix")
  router.route(list(range(12)))  # three whole chunks, all cached by the replica
  assert router.match(0, list(range(12))) == 8  # the same prompt again
  assert router.match(0, list(range(13))) == 12  # a longer one: all three
  assert router.match(0, list(range(9))) == 8 and router.match(0, list(range(8))) == 4
  assert router.match(0, [0]) == 0 and router.match(0, []) == 0


def test_the_router_forgets_a_prompts_last_chunks_first():
  """Past ``max_chunks`` the index drops a prompt's deepest chunks, never its first:
  a match stops at the first missing chunk, so forgetting A's first chunk lost all
  of A while its unreachable later chunks kept their room (match 0 here)."""
  router = Router(1, CHUNK, "prefix", max_chunks=4)
  a, b = list(range(12)), list(range(100, 108))  # three chunks, then two others
  longer = lambda p: p + [999]  # a later turn: every chunk of p is shareable
  router.route(a)
  router.route(b)
  assert router.match(0, longer(a)) == 8 and router.match(0, longer(b)) == 8
  router.route(a)  # A routed again: its chunks are the most recent, B's go
  assert router.match(0, longer(a)) == 12 and router.match(0, longer(b)) == 4


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
@pytest.mark.parametrize("distributed", [True, False])
def test_route_smoke_two_processes(tmp_path, distributed):
  """Two replica processes in jax.distributed (gloo): both policies finish every
  turn with the same tokens, the stats come back by an all-gather, and prefix
  routing serves more prompt tokens from the cache than round-robin (SmolLM2's
  first ``SMOKE_LAYERS``). Without jax.distributed each replica reports its own
  stats (the runner compared them as if gathered, and always raised)."""
  out = run("experiments.route", "--smoke", f"--model_layers={SMOKE_LAYERS}",
            f"--out_root={tmp_path}", *([] if distributed else ["--nodistributed"]))
  last = out.strip().splitlines()[-1]
  m = re.fullmatch(r"route: replicas=2 sessions=3 prefix_hit=([\d.e+-]+)/([\d.e+-]+) "
                   r"prefill_tokens=(\d+)/(\d+) ttft_p50=[\d.e+-]+/[\d.e+-]+ s "
                   r"same_tokens=(\d+)/(\d+)", last)
  assert m, last
  hit_prefix, hit_rr = float(m[1]), float(m[2])
  assert m[5] == m[6] == "6"
  assert hit_prefix > hit_rr and int(m[3]) < int(m[4])
  _, rows = only_run(tmp_path, "route")
  assert all(r["stats_by_collective"] == distributed and r["finished"] == 6 for r in rows)
