"""A request moving between engines: PDD's prefill -> relay decode -> main decode, or
any prefill / decode split.

``Engine.export`` packs a request into a ``Handoff`` (prompt, the tokens generated so
far, sampling parameters, and optionally the K/V of positions ``[kv_start,
kv_end)`` as host pages) and lets it go; ``Engine.accept`` queues it on another
engine, which continues it with exactly the tokens an uninterrupted run yields:

* **send KV**: the pages of every position the sender computed beyond what the
  receiver caches (prompt and generated tokens); the receiver writes them into its
  host tier and starts decoding at once. A prompt's K/V depend on its chunk
  boundaries in the last bits (the matmuls are blocked by chunk), so a receiver
  whose prefill chunk differs from the sender's, or whose model identity
  (``model_id``: the weights) differs, does not take them: it replays, as for
  **extend**, and caches only numbers it computed (so does one whose pages are of
  another size);
* **extend**: only token ids (plus, optionally, the prompt's whole chunks beyond the
  receiver's cached prefix): the receiver prefills what is missing of the prompt and
  replays the relayed outputs through its decode steps (no sampling), rebuilding
  their K/V as decode computed them. A batched *dense* extend (PDD's) would compute
  a generated token's K/V with dense attention where decode used sparse attention,
  so it would not reproduce the sender's numbers; the replay does, and costs one
  decode step per relayed token (shared with the running batch).

Sampling needs no RNG state: a draw is a function of (seed, position, logits).
``to_bytes`` / ``from_bytes`` frame a handoff for a socket (JSON header + raw
arrays, no pickle); ``send`` / ``recv`` move frames with an optional bandwidth cap.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import struct
import time
import ml_dtypes
import numpy as np

from kvtier_jax.serving.request import DRAWS, SamplingParams, is_int

KV_MODES = ("all", "prompt", "none")


@dataclasses.dataclass
class Handoff:
  """What crosses between engines for one request."""

  request_id: str
  prompt: list[int]
  output: list[int]  # generated so far (the relayed token ids)
  max_new_tokens: int
  sampling: SamplingParams = SamplingParams()
  stop_ids: list[int] = dataclasses.field(default_factory=list)
  kv_start: int = 0  # page-aligned; the receiver caches at least this prefix
  kv_end: int = 0  # positions [kv_start, kv_end) travel as pages (0: none)
  kv: list[np.ndarray] = dataclasses.field(default_factory=list)  # read_pages fields
  # The sender's prefill chunk. A prompt's K/V depend on its chunk boundaries in
  # the last bits, so only a receiver with the same chunks uses them (None: unknown).
  chunk_size: int | None = None
  # The sender's page size (positions per page): ``kv``'s pages and ``kv_start``'s
  # alignment are in it. A receiver with other pages replays (None: the receiver's).
  page_size: int | None = None
  # The sender's model identity (``ServingModel.model_id``): K/V computed by other
  # weights are not taken, the request replays instead (None: unknown).
  model_id: str | None = None
  # With ``sampling.logprobs`` set: ``Request.logprobs`` and ``top_logprobs`` of
  # the relayed outputs, one entry per output.
  logprobs: list[float] | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None
  # The sender's sampler (``request.DRAWS``; a frame without it: None, older). A
  # sampled request goes on only where the draws are the same.
  draws: int | None = DRAWS

  @property
  def kv_bytes(self) -> int:
    return sum(int(a.nbytes) for a in self.kv)

  def to_bytes(self) -> bytes:
    header = dict(request_id=self.request_id, prompt=self.prompt, output=self.output,
                  max_new_tokens=self.max_new_tokens,
                  sampling=dataclasses.asdict(self.sampling), stop_ids=self.stop_ids,
                  kv_start=self.kv_start, kv_end=self.kv_end, chunk_size=self.chunk_size,
                  page_size=self.page_size, model_id=self.model_id, logprobs=self.logprobs,
                  top_logprobs=self.top_logprobs, draws=self.draws,
                  kv=[dict(dtype=a.dtype.name, shape=list(a.shape)) for a in self.kv])
    blob = json.dumps(header).encode()
    parts = [struct.pack("<Q", len(blob)), blob]
    parts += [np.ascontiguousarray(a).tobytes() for a in self.kv]
    return b"".join(parts)

  @classmethod
  def from_bytes(cls, data: bytes) -> "Handoff":
    if len(data) < 8:
      raise ValueError(f"a truncated handoff ({len(data)} bytes, no header length)")
    (size,) = struct.unpack_from("<Q", data)
    if 8 + size > len(data):
      raise ValueError(f"a truncated handoff (a {size}-byte header, "
                       f"{len(data) - 8} bytes after its length)")
    try:
      header = json.loads(data[8:8 + size])
      specs = header.pop("kv")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
      raise ValueError(f"a malformed handoff header: {err}") from err
    if not isinstance(specs, list):
      raise ValueError(f"a malformed handoff header: kv={specs!r:.80} is not a list")
    at, kv = 8 + size, []
    for spec in specs:
      try:
        dtype, shape = _dtype(spec["dtype"]), list(spec["shape"])
      except (TypeError, KeyError) as err:
        raise ValueError(f"a malformed handoff page field {spec}: {err}") from err
      if (dtype.hasobject or dtype.itemsize == 0
          or not all(is_int(n) and n >= 0 for n in shape)):
        raise ValueError(f"a malformed handoff page field {spec}")
      count = int(np.prod(shape)) * dtype.itemsize
      if at + count > len(data):
        raise ValueError("a truncated handoff")
      kv.append(np.frombuffer(data, dtype, count // dtype.itemsize, at).reshape(
          shape).copy())
      at += count
    if at != len(data):
      raise ValueError(f"{len(data) - at} unexpected bytes after the handoff")
    try:
      header["sampling"] = SamplingParams(**header["sampling"])
      header.setdefault("draws", None)  # a sender from before it was sent
      return cls(kv=kv, **header)
    except (TypeError, KeyError) as err:
      raise ValueError(f"a malformed handoff header: {err}") from err


def _floating(dtype: np.dtype) -> bool:
  """NumPy's floats and ml_dtypes' (bfloat16, float8), which NumPy calls void."""
  try:
    ml_dtypes.finfo(dtype)
  except ValueError:
    return False
  return True


def _dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


# A framed, rate-capped transport (sockets on this machine stand in for the links) --


def send(sock: socket.socket, payload: bytes, bytes_per_s: float | None = None,
         block: int = 1 << 16) -> float:
  """Send one length-prefixed frame, at most ``bytes_per_s`` on average (a token
  bucket per ``block``); returns the seconds it took."""
  start = time.perf_counter()
  frame = struct.pack("<Q", len(payload)) + payload
  for at in range(0, len(frame), block):
    sock.sendall(frame[at:at + block])
    if bytes_per_s:
      due = start + min(at + block, len(frame)) / bytes_per_s  # bytes sent so far
      pause = due - time.perf_counter()
      if pause > 0:
        time.sleep(pause)
  return time.perf_counter() - start


def recv(sock: socket.socket, max_bytes: int | None = None) -> bytes:
  """One frame ``send`` wrote (raises ``ConnectionError`` if the peer closed).
  ``max_bytes``: refuse (``ValueError``) a frame announcing more, before reading
  it, so a corrupt or hostile length cannot make the reader buffer without end;
  the connection is then out of step and should be closed."""
  (size,) = struct.unpack("<Q", _read(sock, 8))
  if max_bytes is not None and size > max_bytes:
    raise ValueError(f"a frame of {size} bytes exceeds max_bytes={max_bytes}")
  return _read(sock, size)


def _read(sock: socket.socket, size: int) -> bytes:
  chunks, left = [], size
  while left:
    chunk = sock.recv(min(left, 1 << 20))
    if not chunk:
      raise ConnectionError("the peer closed the connection mid-frame")
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def check(handoff: Handoff, page_size: int, vocab_size: int, stop_ids=()) -> None:
  """Clear errors for a handoff an engine cannot continue; ``page_size`` and
  ``stop_ids``: the receiver's own (its eos ids end a request as the handoff's
  do; the pages are counted in the handoff's own size where it names one)."""
  if not isinstance(handoff.request_id, str):  # a frame from the wire: any JSON
    raise ValueError(f"the handoff's request_id {handoff.request_id!r:.80} is not a str")
  if not isinstance(handoff.sampling, SamplingParams):
    raise ValueError(f"the handoff's sampling {handoff.sampling!r:.80} is not "
                     "SamplingParams")
  handoff.sampling.check()  # (its logprobs size the lists checked below)
  if handoff.draws != DRAWS and handoff.sampling.temperature > 0:
    raise ValueError(f"request {handoff.request_id!r} samples, and its sender's draws "
                     f"(version {handoff.draws!r:.20}) are not this sampler's ({DRAWS}): "
                     "it would go on with other tokens")
  for name in ("prompt", "output", "stop_ids"):
    ids = getattr(handoff, name)
    if not isinstance(ids, (list, tuple)) or not all(map(is_int, ids)):
      raise ValueError(f"the handoff's {name} {ids!r:.80}: not integer ids in a list")
  if not handoff.prompt:
    raise ValueError("the handoff's prompt is empty")
  for name in ("max_new_tokens", "kv_start", "kv_end"):
    if not is_int(getattr(handoff, name)):
      raise ValueError(f"{name}={getattr(handoff, name)!r} must be an int")
  for name in ("chunk_size", "page_size"):
    value = getattr(handoff, name)
    if value is not None and not (is_int(value) and value >= 1):
      raise ValueError(f"{name}={value!r} must be a positive int or None")
  if handoff.model_id is not None and not isinstance(handoff.model_id, str):
    raise ValueError(f"model_id={handoff.model_id!r:.80} must be a str or None")
  if not all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in handoff.kv):
    raise ValueError("the handoff's page fields must be arrays of pages (ndim >= 1)")
  if len(handoff.output) >= handoff.max_new_tokens:
    raise ValueError(f"request {handoff.request_id!r} already has its "
                     f"{handoff.max_new_tokens} tokens: nothing to continue")
  stops = sorted(set(handoff.output) & (set(handoff.stop_ids) | set(stop_ids)))
  if stops:
    raise ValueError(f"request {handoff.request_id!r} already produced its stop id "
                     f"{stops[0]}: nothing to continue")
  bad = [t for t in handoff.output if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"relayed token ids {bad[:5]} are outside the vocabulary")
  _check_logprobs(handoff, vocab_size)
  if handoff.kv_end:
    # Positions with K/V at the sender: the prompt and every output but the last
    # (not fed yet); without outputs the receiver computes the last prompt position,
    # whose logits give the first token.
    last = len(handoff.prompt) + len(handoff.output) - 1
    size = handoff.page_size or page_size  # the sender's pages, where it says
    if handoff.kv_start % size or not 0 <= handoff.kv_start < handoff.kv_end <= last:
      raise ValueError(f"KV of positions [{handoff.kv_start}, {handoff.kv_end}) is not a "
                       f"page-aligned range of the {last} positions computed")
    pages = -(-handoff.kv_end // size) - handoff.kv_start // size
    if not handoff.kv or any(a.shape[0] != pages for a in handoff.kv):
      raise ValueError(f"positions [{handoff.kv_start}, {handoff.kv_end}) need {pages} "
                       f"pages; the handoff carries {[a.shape[0] for a in handoff.kv]}")


def _check_logprobs(handoff: Handoff, vocab_size: int) -> None:
  """A request that records log-probabilities carries one entry per relayed output
  (a finite float <= 0, and its ``min(N, vocab)`` best as (id, float) pairs, best
  first; processed ones: the kept tokens among those, at least one when N > 0);
  one that does not, none."""
  top_n = handoff.sampling.logprobs
  values, tops = handoff.logprobs or [], handoff.top_logprobs or []
  if top_n is None:
    if values or tops:
      raise ValueError("the handoff carries logprobs its sampling does not ask for "
                       "(logprobs=None)")
    return
  def log_prob(x):
    if not isinstance(x, (int, float)) or isinstance(x, bool):
      return False
    try:
      x = float(x)
    except OverflowError:  # a JSON integer of 400 digits
      return False
    return math.isfinite(x) and x <= 0
  num = len(handoff.output)
  if not (isinstance(values, list) and len(values) == num and all(map(log_prob, values))):
    raise ValueError(f"the handoff's logprobs {values!r:.80} must be {num} finite "
                     "numbers <= 0, one per relayed output")
  width = min(top_n, vocab_size)
  widths = (range(min(width, 1), width + 1) if handoff.sampling.logprobs_mode == "processed"
            else (width,))
  def best_first(top):
    return (isinstance(top, (list, tuple)) and len(top) in widths
            and all(isinstance(pair, (list, tuple)) and len(pair) == 2 and is_int(pair[0])
                    and 0 <= pair[0] < vocab_size and log_prob(pair[1]) for pair in top)
            and all(a[1] >= b[1] for a, b in zip(top, top[1:])))
  if not (isinstance(tops, list) and len(tops) == num and all(map(best_first, tops))):
    raise ValueError(f"the handoff's top_logprobs {tops!r:.80} must be {num} lists of "
                     f"{widths[0] if len(widths) == 1 else f'{widths[0]} to {width}'} "
                     "(token id, log-probability) pairs, best first, one per relayed "
                     "output")


def check_pages(handoff: Handoff, layout: list[np.ndarray]) -> None:
  """Clear errors for page contents the receiver cannot store: ``layout`` is one
  page of the receiver's own (``read_pages``), each field's page shape and dtype."""
  if len(handoff.kv) != len(layout):
    raise ValueError(f"the handoff carries {len(handoff.kv)} page fields; this engine's "
                     f"pages have {len(layout)}")
  for i, (got, want) in enumerate(zip(handoff.kv, layout)):
    if got.shape[1:] != want.shape[1:] or got.dtype != want.dtype:
      raise ValueError(f"page field {i} is {got.dtype}{list(got.shape[1:])} per page; "
                       f"this engine's is {want.dtype}{list(want.shape[1:])}")
    # Non-finite K/V would enter the prefix cache and poison later requests.
    if _floating(got.dtype) and not np.isfinite(got).all():
      raise ValueError(f"page field {i} holds non-finite values")
