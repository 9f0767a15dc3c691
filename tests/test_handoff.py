"""Requests moving between engines (Engine.export / accept, serving/handoff.py): a
request continued elsewhere, by sent K/V pages or by replaying its relayed tokens,
yields the tokens of an uninterrupted run; handoffs survive the wire format; bad ones
are refused."""

import dataclasses
import functools
import json
import socket
import struct
import threading

import numpy as np
import pytest

from kvtier_jax.serving import Engine, EngineConfig, SamplingParams, State
from kvtier_jax.serving import handoff as handoff_lib
from tests.test_prefix_cache import shared_prefix_workload
from tests.test_serving import VOCAB, FakeModel, solo
from tests.util import SMOKE_LAYERS


def relay_workload(rng, num, pages=60, prefix_cache=True):
  """Requests start on engine ``p`` (prefill + relay decode) and move to ``d`` at
  random moments with a random kind of handoff; the rest finish where they are."""
  config = EngineConfig(max_step_tokens=20, prefix_cache=prefix_cache)
  p, d = Engine(FakeModel(num_host_pages=pages), config), Engine(
      FakeModel(num_host_pages=pages), config)
  pending, reqs, moved = shared_prefix_workload(rng, num), [], {}
  while pending or p.has_work or d.has_work:
    for _ in range(min(len(pending), int(rng.integers(0, 3)))):
      prompt, new, sp = pending.pop()
      reqs.append(p.submit(prompt, new, sp))
    live = [r for r in reqs if r.state in (State.DECODING, State.WAITING)
            and len(r.output) < r.max_new_tokens and r.id not in moved]
    if live and rng.random() < 0.5:
      decoding = [r for r in live if r.state is State.DECODING]
      pick = decoding if decoding and rng.random() < 0.8 else live
      req = pick[int(rng.integers(len(pick)))]
      kv = "none"
      if req.state is State.DECODING and p._host_pages(req.total_length):
        kv = str(rng.choice(["all", "prompt", "none"]))  # (short ones never leave the device)
      start = 0
      if kv != "none" and d.radix is not None and rng.random() < 0.5:
        # Send only what the receiver lacks (else all: it skips what it caches).
        usable = (len(req.prompt) - 1) // 8 * 8
        start = len(d.radix.match_prefix(req.prompt[:usable])[0]) * d.model.page_size
      end = req.cached if kv == "all" else len(req.prompt) // 8 * 8
      if kv != "none" and start >= end:
        kv, start = "none", 0
      handoff = p.export(req.id, kv=kv, start=start)
      handoff = handoff_lib.Handoff.from_bytes(handoff.to_bytes())  # over the wire
      moved[req.id] = (d.accept(handoff), kv)
    if p.has_work:
      p.step()
    if d.has_work:
      d.step()
    for engine in (p, d):
      engine.pool.check(engine.radix.held_pages() if engine.radix else ())
  return reqs, moved


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_moved_requests_yield_their_uninterrupted_tokens(prefix_cache):
  rng = np.random.default_rng()
  reqs, moved = relay_workload(rng, 60, prefix_cache=prefix_cache)
  assert len(moved) > 5 and {kv for _, kv in moved.values()} >= {"none", "all"}
  factory = lambda: FakeModel(num_host_pages=60)
  for req in reqs:
    final = moved[req.id][0] if req.id in moved else req
    assert final.state is State.FINISHED, (req.id, final.reason)
    if req.id in moved:
      assert req.state is State.HANDED_OFF and final.output[:len(req.output)] == req.output
    assert final.output == solo(factory, req.prompt, req.max_new_tokens, req.sampling), req.id


def test_handoff_wire_format_and_refusals():
  rng = np.random.default_rng()
  kv = [rng.integers(-1, VOCAB, (3, 4)), rng.standard_normal((3, 2, 5)).astype(np.float32)]
  handoff = handoff_lib.Handoff("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5], 10,
                                SamplingParams(temperature=0.5, seed=3), [7], 0, 10, kv,
                                chunk_size=8)
  back = handoff_lib.Handoff.from_bytes(handoff.to_bytes())
  assert back.prompt == handoff.prompt and back.sampling == handoff.sampling
  assert back.chunk_size == 8
  assert all((a == b).all() and a.dtype == b.dtype for a, b in zip(back.kv, kv))
  with pytest.raises(ValueError, match="truncated"):
    handoff_lib.Handoff.from_bytes(handoff.to_bytes()[:-5])
  with pytest.raises(ValueError, match="1 unexpected bytes"):
    handoff_lib.Handoff.from_bytes(handoff.to_bytes() + b"\0")
  engine = Engine(FakeModel())
  with pytest.raises(ValueError, match="page-aligned"):  # 10 > 9 + 2 - 1 computed
    engine.accept(handoff_lib.Handoff("r", list(range(9)), [4, 5], 10, kv_start=0,
                                      kv_end=11, kv=kv))
  with pytest.raises(ValueError, match="already has"):
    engine.accept(handoff_lib.Handoff("r", [1, 2], [3, 4], 2))
  with pytest.raises(ValueError, match="stop id 3"):  # it finished at the sender
    engine.accept(handoff_lib.Handoff("r", [1, 2], [3], 5, stop_ids=[3, 9]))
  with pytest.raises(ValueError, match="need 3 pages"):
    engine.accept(handoff_lib.Handoff("r", list(range(9)), [4, 5], 10, kv_start=0,
                                      kv_end=9, kv=[k[:2] for k in kv]))
  assert not engine.requests  # refused: nothing queued
  req = engine.submit([1, 2, 3], 4)
  with pytest.raises(ValueError, match="no host pages"):  # a waiting request has none
    engine.export(req.id, kv="all")
  assert engine.export(req.id, kv="none").output == [] and req.state is State.HANDED_OFF
  short = engine.submit([1, 2, 3], 20)  # shorter than a chunk: no whole one to send
  while short.state is not State.DECODING:
    engine.step()
  with pytest.raises(ValueError, match="no whole prompt chunk"):
    engine.export(short.id, kv="prompt")
  assert short.state is State.DECODING


def test_malformed_frames_are_refused_clearly():
  """A frame from the wire that is not a handoff: a ValueError, whatever is wrong."""
  good = handoff_lib.Handoff("r", [1, 2], [], 3)
  header = json.loads(good.to_bytes()[8:])
  def frame(head, body=b""):
    blob = json.dumps(head).encode()
    return struct.pack("<Q", len(blob)) + blob + body
  bad = [b"", b"\0" * 5, struct.pack("<Q", 100) + b"{}", frame(header)[:-1],
         frame(dict(header, kv=[dict(dtype="int64", shape=[-1, 4])]), b"\0" * 64),
         frame(dict(header, kv=[dict(dtype="object", shape=[1])]), b"\0" * 8),
         frame(dict(header, kv=[dict(dtype="nonsense", shape=[1])]), b"\0" * 8),
         frame(dict(header, kv=[dict(shape=[1])]), b"\0" * 8),
         frame({k: v for k, v in header.items() if k != "kv"}),
         frame(dict(header, surprise=1)), frame([1, 2])]
  for data in bad:
    with pytest.raises(ValueError):
      handoff_lib.Handoff.from_bytes(data)
  assert handoff_lib.Handoff.from_bytes(frame(header)) == good
  # Frames that parse but hold the wrong types: refused by the receiver's check as
  # ValueErrors (not a TypeError or IndexError from deep inside), nothing queued.
  for data in (frame(dict(header, kv=5)), frame(dict(header, kv=None)),
               frame(dict(header, kv=[dict(dtype="S0", shape=[1])])),
               struct.pack("<Q", 20_000) + b"[" * 10_000 + b"]" * 10_000):
    with pytest.raises(ValueError):
      handoff_lib.Handoff.from_bytes(data)
  engine = Engine(FakeModel())
  for change, body in ((dict(max_new_tokens=None), b""), (dict(output=5), b""),
                       (dict(request_id=5), b""), (dict(request_id=[1]), b""),
                       (dict(stop_ids=[[1]]), b""), (dict(prompt="12"), b""),
                       (dict(kv_end=2, kv=[dict(dtype="int64", shape=[])]), b"\0" * 8)):
    with pytest.raises(ValueError):
      engine.accept(handoff_lib.Handoff.from_bytes(frame(dict(header, **change), body)))
  assert not engine.requests


def test_the_receiver_process_answers_a_frame_it_refuses_and_serves_on():
  """``experiments.handoff --two_process``'s receiver died on a frame it could not
  parse or a handoff its engine refused (the sender read "peer closed"): it now
  replies the error, and the next handoff is served."""
  import pathlib
  import subprocess
  import sys
  # (In its own process: the runner defines absl flags other runners define too.)
  code = """
import json
from experiments import handoff as runner
from kvtier_jax.serving import Engine
from kvtier_jax.serving import handoff as handoff_lib
from tests.test_serving import FakeModel
engine = Engine(FakeModel())
prompt = list(range(1, 20))
for frame in (b"junk", handoff_lib.Handoff("r", prompt, [1.5], 6).to_bytes(),
              handoff_lib.Handoff("ok", prompt, [], 6).to_bytes()):
  print(json.dumps(runner.answer(engine, frame)))
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, cwd=pathlib.Path(__file__).parents[1])
  assert proc.returncode == 0, proc.stderr[-3000:]
  junk, floats, ok = map(json.loads, proc.stdout.strip().splitlines()[-3:])
  for reply, why in ((junk, "truncated handoff"), (floats, "not integer ids")):
    assert set(reply) == {"error"} and why in reply["error"], reply
  assert ok["state"] == "finished" and ok["output"] == solo(FakeModel, list(range(1, 20)), 6)


def test_relayed_tokens_must_be_ids_and_the_receivers_eos_ends_them():
  """Relayed outputs that are not integer ids (a float through JSON, a bool) are
  refused, not truncated into the feed; so is an output holding one of the
  receiver's eos ids (the request ended there)."""
  prompt = list(range(1, 20))
  ref = solo(FakeModel, prompt, 6)
  engine = Engine(FakeModel())
  for output in ([float(ref[0]) + 0.9], [ref[0], True], [np.float32(ref[0])]):
    with pytest.raises(ValueError, match="not integer ids"):
      engine.accept(handoff_lib.Handoff("r", prompt, output, 6))
  with pytest.raises(ValueError, match="kv_end"):
    engine.accept(handoff_lib.Handoff("r", prompt, ref[:2], 6, kv_end=8.0))
  assert not engine.requests
  eos = ref[1]
  strict = Engine(FakeModel(), EngineConfig(eos_ids=(eos,)))
  with pytest.raises(ValueError, match=f"stop id {eos}"):
    strict.accept(handoff_lib.Handoff("r", prompt, ref[:3], 6))
  moved = strict.accept(handoff_lib.Handoff("r", prompt, [np.int64(ref[0])], 6))
  strict.run()
  assert moved.output == ref[:2] and all(type(t) is int for t in moved.output)


def test_export_inside_on_token_sends_what_the_receiver_can_continue():
  """``export`` called from ``on_token``: the request whose stop id was just sampled
  is refused (it ends here, as it would have), as is one on its last token; a peer
  in the same decode batch, fed this step but not sampled yet, sends K/V up to its
  newest output only, and the receiver continues it exactly."""
  prompt = list(range(1, 20))
  ref = solo(FakeModel, prompt, 10)
  engine = Engine(FakeModel())
  refused = []
  def on_token(req, token):
    if token == ref[2]:
      with pytest.raises(ValueError, match="produced its stop id"):
        engine.export(req.id, kv="none")
      refused.append(req.id)
  req = engine.submit(prompt, 10, stop_ids=[ref[2]], on_token=on_token)
  engine.run()
  assert refused == [req.id] and req.state is State.FINISHED and req.output == ref[:3]
  # Nor on its last token: it has all of them (the receiver would decode one more).
  def on_last(req, token):
    if len(req.output) == req.max_new_tokens:
      with pytest.raises(ValueError, match="has all its tokens"):
        engine.export(req.id, kv="none")
      refused.append(req.id)
  last = engine.submit(prompt, 4, on_token=on_last)
  engine.run()
  assert refused[-1] == last.id and last.state is State.FINISHED
  assert last.output == ref[:4]

  peer_prompt = list(range(30, 50))
  sender, box = Engine(FakeModel()), {}
  def export_peer(req, token):
    if len(req.output) == 4 and not box:
      box["handoff"] = sender.export("B", kv="all")
  first = sender.submit(prompt, 10, request_id="A", on_token=export_peer)
  sender.submit(peer_prompt, 10, request_id="B")
  sender.run()
  handoff = box["handoff"]
  assert handoff.kv_end == len(peer_prompt) + len(handoff.output) - 1
  receiver = Engine(FakeModel())
  moved = receiver.accept(handoff)
  receiver.run()
  assert first.output == ref and moved.output == solo(FakeModel, peer_prompt, 10)


def test_a_request_comes_back_to_the_engine_it_left():
  """A -> B -> A: A's record of the request it handed off gives way to the returning
  one. An id taken by a request that did not leave is refused with a way out
  (``accept(..., request_id=)``), nothing queued."""
  prompt = list(range(1, 20))
  a, b = Engine(FakeModel()), Engine(FakeModel())
  req = a.submit(prompt, 10, request_id="r")
  while len(req.output) < 2:
    a.step()
  away = b.accept(a.export("r", kv="all"))
  while len(away.output) < 5:
    b.step()
  back = a.accept(b.export("r", kv="all"))
  a.run()
  assert a.requests["r"] is back and back.output == solo(FakeModel, prompt, 10)
  assert [r.state for r in (req, away, back)] == [State.HANDED_OFF, State.HANDED_OFF,
                                                  State.FINISHED]
  sender, receiver = Engine(FakeModel()), Engine(FakeModel())
  receiver.submit([1, 2, 3], 2)  # receiver's "req-0"
  receiver.run()
  moving = sender.submit(prompt, 6)  # sender's "req-0"
  while len(moving.output) < 2:
    sender.step()
  handoff = sender.export(moving.id, kv="none")
  with pytest.raises(ValueError, match="already exists; accept"):
    receiver.accept(handoff)
  assert len(receiver.requests) == 1 and not receiver.has_work
  renamed = receiver.accept(handoff, request_id="from-sender")
  receiver.run()
  assert renamed.id == "from-sender" and renamed.output == solo(FakeModel, prompt, 6)


def test_a_handoffs_pages_are_not_booked_as_disk_prefix_recomputed():
  """A receiver that recomputes disk-tier prefixes ("recompute") and holds the
  prompt's first 24 positions on disk: a handoff with every position's K/V
  prefills nothing and recomputes nothing; the same prompt submitted recomputes
  those 24."""
  prompt = list(range(1, 34))
  config = EngineConfig(max_step_tokens=20, prefix_cache=True, disk_pages=20,
                        disk_policy="recompute")
  def receiver_with_prefix_on_disk():
    engine = Engine(FakeModel(num_host_pages=20), config)
    engine.submit(prompt[:24] + [60, 61], 2)  # caches 3 chunks of the prompt
    engine.run()
    engine.submit([50 + i % 10 for i in range(70)], 10)  # pushes them to disk
    engine.run()
    assert engine.radix.num_disk_pages == 6 and engine.disk_recomputed_tokens == 0
    return engine
  sender = Engine(FakeModel())
  req = sender.submit(prompt, 8, request_id="moved")
  while len(req.output) < 2:
    sender.step()
  receiver = receiver_with_prefix_on_disk()
  moved = receiver.accept(sender.export(req.id, kv="all"))
  prefilled = 0
  while receiver.has_work:
    prefilled += receiver.step()["prefill_tokens"]
  assert moved.output == solo(FakeModel, prompt, 8)
  assert prefilled == 0 and receiver.imported_tokens == len(prompt) + 1
  assert receiver.disk_recomputed_tokens == 0
  alone = receiver_with_prefix_on_disk()
  again = alone.submit(prompt, 8)
  alone.run()
  assert again.output == moved.output and alone.disk_recomputed_tokens == 24


def _exported_with_kv(prompt, new):
  """A request that decoded 3 tokens on a FakeModel engine, exported with its K/V."""
  sender = Engine(FakeModel())
  req = sender.submit(prompt, new)
  while len(req.output) < 3:
    sender.step()
  handoff = sender.export(req.id, kv="all")
  assert handoff.kv_end > 0
  return handoff


def test_a_receiver_that_keeps_the_request_on_the_device_replays_it():
  """A handoff with K/V to an engine where the whole request fits the hot cache
  (no host pages there): nothing is written to the receiver's host pages and the
  request continues with its uninterrupted tokens by replay."""
  prompt, new = list(range(1, 30)), 10
  handoff = _exported_with_kv(prompt, new)
  receiver = Engine(FakeModel(hot_slots=96))
  moved = receiver.accept(handoff)
  receiver.run()
  assert moved.output == solo(FakeModel, prompt, new)
  assert receiver.state["pages"] == {}


def test_a_receiver_that_cannot_restage_host_pages_replays_the_request():
  """A receiver whose model cannot restage positions from host pages (the tiered
  backend with DSA: its selector state comes from hidden states) took a handoff's
  K/V, then every step raised and the request held its slot for good. It replays
  the request now, with the uninterrupted tokens, and never reads the frame's
  pages (a model without ``read_pages`` accepts it too)."""
  @dataclasses.dataclass
  class NoRestage(FakeModel):
    supports_prefix_cache: bool = False

    def load_prefix(self, state, slot, length):
      raise ValueError("the tiered backend cannot load a cached prefix")

    def read_pages(self, state, pages):
      raise AttributeError("read_pages")

  prompt, new = list(range(1, 30)), 10
  handoff = _exported_with_kv(prompt, new)
  receiver = Engine(NoRestage())
  moved = receiver.accept(handoff)
  assert moved.imported is None
  receiver.run()
  assert moved.state is State.FINISHED and moved.output == solo(FakeModel, prompt, new)
  assert receiver.pool.in_use == 0


def test_kv_from_another_model_is_not_taken():
  """K/V computed by other weights would decode other numbers here: a receiver
  whose ``model_id`` differs from the sender's (or who has one where the sender
  had none) replays the request; an equal id takes the pages, across the wire."""
  @dataclasses.dataclass
  class Named(FakeModel):
    model_id: str = "a"

  prompt, new = list(range(1, 30)), 10
  sender = Engine(Named())
  req = sender.submit(prompt, new)
  while len(req.output) < 3:
    sender.step()
  handoff = handoff_lib.Handoff.from_bytes(sender.export(req.id, kv="all").to_bytes())
  assert handoff.model_id == "a" and handoff.kv_end > 0
  unnamed = _exported_with_kv(prompt, new)
  assert unnamed.model_id is None
  for model, frame, takes in [(Named(), handoff, True), (Named(model_id="b"), handoff, False),
                              (FakeModel(), handoff, False), (Named(), unnamed, False),
                              (FakeModel(), unnamed, True)]:
    receiver = Engine(model)
    moved = receiver.accept(frame)
    assert (moved.imported is not None) == takes, (model, frame.model_id)
    receiver.run()
    assert moved.output == solo(FakeModel, prompt, new)
  with pytest.raises(ValueError, match="model_id"):
    Engine(Named()).accept(dataclasses.replace(handoff, model_id=3))
  # Pages of another layout (a tensor-parallel mesh pads its KV heads) from another
  # model: never read, the request replays; the same model's are refused.
  wider = dataclasses.replace(handoff, kv=[np.stack([f, f], -1) for f in handoff.kv])
  receiver = Engine(Named(model_id="b"))
  moved = receiver.accept(wider)
  assert moved.imported is None
  receiver.run()
  assert moved.output == solo(FakeModel, prompt, new)
  with pytest.raises(ValueError, match="page field"):
    Engine(Named()).accept(wider)


def test_pages_of_non_finite_kv_are_refused():
  """Non-finite K/V from the wire would enter the receiver's prefix cache and
  poison later requests sharing the prefix: refused, nothing queued (floats of
  NumPy's and ml_dtypes' kinds; integer fields are not floats)."""
  import ml_dtypes  # noqa: PLC0415

  for dtype in (np.float32, ml_dtypes.bfloat16):
    @dataclasses.dataclass
    class FloatPages(FakeModel):
      def read_pages(self, state, pages, dtype=dtype):
        return [np.zeros((len(pages), self.page_size), dtype)]

    prompt = list(range(1, 30))
    receiver = Engine(FloatPages())
    pages = np.zeros((7, 4), dtype)
    pages[np.random.default_rng().integers(7), 2] = np.nan
    # From the receiver's own chunking and model: pages it would take.
    frame = functools.partial(handoff_lib.Handoff, "h", prompt, [7], 5, kv_start=0,
                              kv_end=28, chunk_size=receiver.model.chunk_size)
    with pytest.raises(ValueError, match="non-finite"):
      receiver.accept(frame(kv=[pages]))
    assert not receiver.requests
    assert receiver.accept(frame(kv=[np.zeros((7, 4), dtype)])).imported is not None


def test_handoffs_the_receiver_cannot_continue_are_refused_before_queueing():
  """Prompt K/V with no output yet must leave the last prompt position to the
  receiver (its logits give the first token); pages of another layout from the
  same model and chunking (pages it would take) do not fit. Both refused, nothing
  queued, the engine goes on (another model's pages are replayed unread:
  ``test_kv_from_another_model_is_not_taken``)."""
  sender = Engine(FakeModel())
  prompt = list(range(1, 33))  # 4 whole chunks
  req = sender.submit(prompt, 5)
  while req.state is not State.DECODING:
    sender.step()
  kv = sender.model.read_pages(sender.state, sender.pool.table[req.slot, :8].tolist())
  receiver = Engine(FakeModel())
  with pytest.raises(ValueError, match="page-aligned range of the 31"):
    receiver.accept(handoff_lib.Handoff("h", prompt, [], 5, kv_start=0, kv_end=32, kv=kv))
  ours = functools.partial(handoff_lib.Handoff, "h", prompt[:29], [7], 5, kv_start=0,
                           kv_end=29, chunk_size=receiver.model.chunk_size)
  with pytest.raises(ValueError, match="page field 0"):
    receiver.accept(ours(kv=[np.zeros((8, 6), np.int64)]))
  with pytest.raises(ValueError, match="page fields"):
    receiver.accept(ours(kv=[kv[0], kv[0]]))
  # The receiver's page shape in another dtype: it would fail at admission, after
  # queueing.
  other_dtype = np.int32 if kv[0].dtype != np.int32 else np.int64
  with pytest.raises(ValueError, match="page field 0"):
    receiver.accept(ours(kv=[kv[0][:8].astype(other_dtype)]))
  # A relayed token one past the vocabulary; a K/V range off a page boundary.
  with pytest.raises(ValueError, match="outside the vocabulary"):
    receiver.accept(handoff_lib.Handoff("h", prompt[:29], [VOCAB], 5))
  with pytest.raises(ValueError, match="page-aligned"):
    receiver.accept(handoff_lib.Handoff("h", prompt[:29], [7], 5, kv_start=2, kv_end=29,
                                        kv=[kv[0][:8]]))
  assert not receiver.requests
  other = receiver.submit([3, 4, 5], 4)
  receiver.run()
  assert other.output == solo(FakeModel, [3, 4, 5], 4)


def test_a_receiver_with_other_chunks_replays_on_its_own_chunk_grid():
  """Prompt K/V from a sender with chunks of 4 are not the numbers a receiver with
  chunks of 8 computes (a real model's, in the last bits): the receiver replays the
  request, prefilling whole chunks of its own grid. A frame of its own chunk size
  whose K/V end off that grid (at 36, inside [32, 40)) keeps the K/V up to 32.
  Tokens are the uninterrupted run's."""
  @dataclasses.dataclass
  class GridModel(FakeModel):
    chunk_size: int = 8

    def prefill(self, state, slot, tokens, start, count):
      assert start % self.chunk_size == 0, (start, self.chunk_size)
      return FakeModel.prefill(self, state, slot, tokens, start, count)

  prompt, new = list(range(1, 40)), 6
  sender = Engine(FakeModel(chunk_size=4))
  req = sender.submit(prompt, new)
  while len(req.output) < 2:
    sender.step()
  handoff = sender.export(req.id, kv="prompt")
  assert handoff.kv_end == 36 and handoff.chunk_size == 4
  receiver = Engine(GridModel())
  moved = receiver.accept(handoff)
  assert moved.imported is None
  on_grid = receiver.accept(dataclasses.replace(handoff, chunk_size=8), request_id="grid")
  assert on_grid.imported[1] == 32 and on_grid.imported[2][0].shape[0] == 8
  unknown = receiver.accept(dataclasses.replace(handoff, chunk_size=None), request_id="?")
  assert unknown.imported is None
  receiver.run()
  for got in (moved, on_grid, unknown):
    assert got.output == solo(FakeModel, prompt, new)
  assert receiver.imported_tokens == 32  # only the frame of this chunk size
  with pytest.raises(ValueError, match="chunk_size=0"):
    receiver.accept(dataclasses.replace(handoff, chunk_size=0), request_id="bad")


def test_a_receiver_with_other_pages_replays_the_request():
  """K/V in pages of 4 positions are not a receiver's pages of 8: it replays the
  request (the frame's page count is checked in the sender's size, so it is not
  refused as short); one with pages of 4 takes them. A frame that names no page
  size (None) is counted in the receiver's. Tokens are the uninterrupted run's."""
  prompt, new = list(range(1, 30)), 8
  sender = Engine(FakeModel(page_size=4, num_host_pages=40))
  req = sender.submit(prompt, new)
  while len(req.output) < 3:
    sender.step()
  handoff = handoff_lib.Handoff.from_bytes(sender.export(req.id, kv="all").to_bytes())
  assert handoff.page_size == 4 and handoff.kv_end == 31
  other, same = (Engine(FakeModel(page_size=size, num_host_pages=40)) for size in (8, 4))
  replayed, kept = other.accept(handoff), same.accept(handoff)
  assert replayed.imported is None and kept.imported is not None
  for engine, got in ((other, replayed), (same, kept)):
    engine.run()
    assert got.output == solo(FakeModel, prompt, new)
  assert (other.imported_tokens, same.imported_tokens) == (0, 31)
  with pytest.raises(ValueError, match="need 4 pages"):  # 8 pages of 4 read as 8s
    other.accept(dataclasses.replace(handoff, page_size=None), request_id="old")
  with pytest.raises(ValueError, match="page_size=0"):
    other.accept(dataclasses.replace(handoff, page_size=0), request_id="bad")


def test_a_sampled_request_goes_on_only_where_the_draws_are_the_same():
  """A receiver whose sampler draws otherwise (``request.DRAWS``; a frame from a
  sender that predates it names none) would go on with other tokens: it refuses a
  sampled request, and continues a greedy one (greedy draws never change) with the
  uninterrupted run's tokens."""
  seed = int(np.random.default_rng().integers(1000))
  for params in (SamplingParams(temperature=0.8, top_p=0.9, seed=seed), SamplingParams()):
    sender = Engine(FakeModel(num_host_pages=40))
    req = sender.submit(list(range(1, 30)), 8, params)
    while len(req.output) < 3:
      sender.step()
    frame = sender.export(req.id, kv="all").to_bytes()
    (size,) = struct.unpack_from("<Q", frame)
    header = json.loads(frame[8:8 + size])
    assert header.pop("draws") == handoff_lib.DRAWS
    blob = json.dumps(header).encode()
    older = handoff_lib.Handoff.from_bytes(struct.pack("<Q", len(blob)) + blob +
                                           frame[8 + size:])
    assert older.draws is None
    for handoff in (older, dataclasses.replace(older, draws=handoff_lib.DRAWS + 1)):
      receiver = Engine(FakeModel(num_host_pages=40))
      if params.temperature > 0:
        with pytest.raises(ValueError, match="other tokens"):
          receiver.accept(handoff)
        assert not receiver.requests
      else:
        got = receiver.accept(handoff)
        receiver.run()
        assert got.output == solo(FakeModel, req.prompt, 8, params)
    same = Engine(FakeModel(num_host_pages=40))
    got = same.accept(handoff_lib.Handoff.from_bytes(frame))
    same.run()
    assert got.output == solo(FakeModel, req.prompt, 8, params)


def test_the_runners_relay_raises_for_a_request_that_ends_before_its_tokens():
  """``experiments.handoff.relay`` waited for the relayed tokens with no exit: a
  request that failed first (non-finite logits here) had it step an idle engine
  forever. (A subprocess: the runner defines absl flags.)"""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  code = """
from experiments import handoff as runner
from kvtier_jax.serving import Engine, SamplingParams
from tests.test_serving import FakeModel, POISON
try:
  runner.relay(Engine(FakeModel()), [3, 4, POISON], 3, 8, SamplingParams(), "r")
except RuntimeError as err:
  print("refused:", err)
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120)
  assert "refused: request r ended (failed: non-finite logits" in proc.stdout, (
      proc.stdout[-2000:] + proc.stderr[-2000:])
  assert "after 0 of its 3 relayed tokens" in proc.stdout


def test_send_and_recv_frames_at_a_capped_rate():
  a, b = socket.socketpair()
  payload = np.random.default_rng().bytes(300_000)
  got = {}
  reader = threading.Thread(target=lambda: got.setdefault("data", handoff_lib.recv(b)))
  reader.start()
  seconds = handoff_lib.send(a, payload, bytes_per_s=3e6)
  reader.join()
  assert got["data"] == payload and seconds >= 0.09  # 300 KB at 3 MB/s
  a.close()
  with pytest.raises(ConnectionError):
    handoff_lib.recv(b)


def test_recv_refuses_a_frame_longer_than_max_bytes_before_reading_it():
  a, b = socket.socketpair()
  size = int(np.random.default_rng().integers(10, 1000))
  a.sendall(struct.pack("<Q", 1 << 40) + bytes(size))  # announces 1 TiB, sends less
  with pytest.raises(ValueError, match="max_bytes"):
    handoff_lib.recv(b, max_bytes=1 << 30)
  handoff_lib.send(a, bytes(size))
  b.recv(size)  # (the refused frame's bytes)
  assert handoff_lib.recv(b, max_bytes=size) == bytes(size)  # at the limit: taken
  a.close()
  b.close()


@pytest.mark.parametrize("size", [1000, 70_000, 3 << 16])
def test_a_capped_send_takes_its_bytes_over_the_rate(monkeypatch, size):
  """On a clock that only sleeps move: a frame of n bytes (8 of length + payload)
  takes n / rate, its last block included (it waited as if that block were full:
  65 ms for a 1 KB frame at 1 MB/s)."""
  import types
  clock = [0.0]
  monkeypatch.setattr(handoff_lib, "time", types.SimpleNamespace(
      perf_counter=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s)))
  sent = []
  sock = types.SimpleNamespace(sendall=sent.append)
  seconds = handoff_lib.send(sock, bytes(size), bytes_per_s=1e6)
  assert b"".join(sent)[8:] == bytes(size)
  assert seconds == pytest.approx((size + 8) / 1e6, rel=1e-9)


def test_a_snapshot_keeps_handoffs_not_yet_admitted(tmp_path):
  from kvtier_jax.serving import bench, snapshot
  rng = np.random.default_rng()
  model = lambda slots=3: FakeModel(num_slots=slots, max_len=128, num_host_pages=80)
  p = Engine(model(), EngineConfig(max_step_tokens=20))
  d_config = EngineConfig(max_step_tokens=20, prefix_cache=True)
  d = Engine(model(1), d_config)
  reqs = [p.submit(prompt, 30, sp) for prompt, _, sp in
          shared_prefix_workload(rng, 3)]  # none ends before all have decoded twice
  while any(r.state is not State.DECODING or len(r.output) < 2 for r in reqs):
    p.step()
  moved = [d.accept(p.export(r.id, kv="all")) for r in reqs]
  relayed = {m.id: m.relayed for m in moved}
  assert relayed == {r.id: len(r.output) for r in reqs}
  d.step()  # one slot: the others wait with their pages in memory
  assert sum(m.state is State.WAITING and m.imported is not None for m in moved) == 2
  snapshot.save(d, tmp_path / "snap")
  back = snapshot.restore(tmp_path / "snap", model(1), d_config)
  before = back.imported_tokens
  served = bench.drive(back, [], resume=True)
  for req in reqs:
    assert back.requests[req.id].output == solo(model, req.prompt, req.max_new_tokens,
                                                req.sampling)
    assert back.requests[req.id].relayed == relayed[req.id]
  assert back.imported_tokens > before  # the waiting ones came with their pages
  # The receiver's output counts only what it generated, not the sender's tokens.
  assert bench.summarize(served)["output_tokens"] == sum(
      r.max_new_tokens - relayed[r.id] for r in reqs)


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_two_engine_processes_hand_off_over_a_capped_socket(tmp_path):
  """P / D demonstration on SmolLM2: a second process (the main decode) receives
  handoffs over a local socket capped at 50 MB/s (pages, or relayed ids to replay)
  and its tokens equal its own uninterrupted runs, greedy and seeded sampling. The
  prompt is one whole chunk, so the receiver's cache shares none of it, and a
  "send KV" handoff is imported, every position of it (it started at the chunk
  end, past the receiver's match: the K/V was sent, dropped and recomputed). Both
  processes serve a row-tiled decode (``--decode_row_tile`` reaches the receiver: a
  receiver of another tile refuses the K/V, whose ``model_id`` names it)."""
  from tests.test_experiments import only_run, run
  out = run("experiments.handoff", "--two_process", "--smoke", "--link_mbps=50",
            f"--model_layers={SMOKE_LAYERS}", "--prompt_tokens=128", "--decode_row_tile=8",
            f"--out_root={tmp_path}")
  _, rows = only_run(tmp_path, "handoff")
  assert {r["handoff"] for r in rows} == {"send KV", "extend"} and all(r["exact"] for r in rows)
  for row in rows:  # 128 prompt + 3 relayed positions, the newest computed there
    assert row["imported_tokens"] == (130 if row["handoff"] == "send KV" else 0), row
  sent = next(r for r in rows if r["handoff"] == "send KV")
  assert sent["socket_s"] >= sent["frame_kib"] * 1024 / 50e6  # the cap held
  assert out.strip().splitlines()[-1].endswith("exact=4/4")


def test_handoff_books_at_their_boundaries():
  """An export from its last computed position sends no K/V: refused. Positions a
  handoff brought are imported, not cache hits (engine.cached_tokens counts the
  prefix cache only)."""
  from tests.test_serving import FakeModel
  prompt = [3 + i % 40 for i in range(30)]
  sender = Engine(FakeModel())
  req = sender.submit(prompt, 8, request_id="moved")
  computed = lambda: min(req.cached, len(req.prompt) + len(req.output) - 1)
  while not req.output or computed() % 4:  # the last computed position on a page edge
    sender.step()
  with pytest.raises(ValueError, match="below"):
    sender.export("moved", kv="all", start=computed())
  receiver = Engine(FakeModel())
  moved = receiver.accept(sender.export("moved", kv="all"))
  receiver.run()
  assert moved.state is State.FINISHED
  assert receiver.imported_tokens > 0 and receiver.cached_tokens == 0
