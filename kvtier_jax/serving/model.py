"""What the serving engine needs from a model: the interface ``models/`` implements.

The engine never sees weights, layers or caches: only ``S`` request slots decoded
together (static shapes), prompt chunks of ``C`` tokens, logits, and the device and
host memory each request costs. The cache backends (full KV on the device, or the
tiered host tier + hot cache) live behind it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class ServingModel(Protocol):
  """A model with a cache backend, decoding ``num_slots`` requests together. It
  serves one engine at a time, the newest built on it (an older one refuses to step).

  Attributes:
    num_slots: S, requests decoded together (the compiled batch).
    max_len: T, positions a request may reach (prompt + outputs).
    chunk_size: C, prompt tokens per prefill call.
    page_size: host page size (also the granularity of host accounting).
    num_host_pages: pages in the host pool (0: no host tier).
    host_page_bytes: bytes of one host page (every layer's K and V).
    vocab_size: V.
  """

  num_slots: int
  max_len: int
  chunk_size: int
  page_size: int
  num_host_pages: int
  host_page_bytes: int
  vocab_size: int

  def device_bytes(self, length: int) -> int:
    """Device bytes a request of ``length`` positions holds while it runs (KV or
    hot cache, metadata, selector state)."""

  def staging_bytes(self) -> int:
    """Device bytes the prefill staging buffer holds (one request at a time)."""

  def host_pages(self, length: int) -> int:
    """Host pages a request of ``length`` positions needs (0: it never leaves the
    device, e.g. a context that fits the hot cache)."""

  def init(self) -> Any:
    """The state of every slot (empty)."""

  def set_pages(self, state: Any, table: np.ndarray) -> Any:
    """Install the page table i32[S, MP] (the engine allocates pages)."""

  def prefill(self, state: Any, slot: int, tokens: np.ndarray, start: int,
              count: int) -> tuple[Any, Any]:
    """Run prompt positions ``start .. start + count - 1`` of ``slot`` (``tokens``
    i32[C], zero-padded past ``count``; ``start`` a multiple of C). Returns
    (state, logits f32[V] of position ``start + count - 1``)."""

  def start_decoding(self, state: Any, slot: int, length: int) -> Any:
    """After the last prompt chunk: ``slot`` decodes next, ``length`` positions in."""

  def decode(self, state: Any, tokens: np.ndarray, active: np.ndarray
             ) -> tuple[Any, Any]:
    """One decode step of the active slots: ``tokens`` i32[S] at each active
    slot's next position. Returns (state, logits f32[S, V]); inactive rows are
    garbage and their slots unchanged. Raises ``StepRefused`` (with the state
    unchanged) when the step refused its input; the engine then steps each
    request alone, so an active row's logits must not depend on the other rows'
    tokens or activity."""

  # Optional: the look-ahead. A model whose ``lookahead`` is "draft" gets, after
  # each decode step, a draft of each still-decoding slot's next token.
  lookahead: str

  def draft_pass(self, state: Any, drafts: np.ndarray, active: np.ndarray) -> Any:
    """Run ``drafts`` i32[S] at each active slot's next position without
    committing anything the outputs depend on: only what is cached moves (the rows
    the next step would fetch, fetched now; ``stats`` may count them as
    ``prefetched``). A slot the model cannot run ahead (the tiered backend: no host
    page for that position yet) is left as it is."""

  # Optional: a data-parallel model (requests over D devices, one host tier each)
  # splits its slots and host pages into ``num_partitions`` equal ranges; slot s
  # may only hold pages of its own range (default 1).
  num_partitions: int

  # Optional: what a request's K/V depend on (a hash of the weights...). A handoff's
  # K/V are taken only by an engine whose model has the sender's ``model_id`` (a
  # model without one matches only another without one).
  model_id: str
  # Optional: what the tokens depend on beside the weights (the selector, index
  # sharing...): a snapshot restores only onto a model of the saved ``decode_id``.
  decode_id: str

  # Optional: a prefix cache (``EngineConfig.prefix_cache``) needs both.
  supports_prefix_cache: bool

  def load_prefix(self, state: Any, slot: int, length: int) -> Any:
    """Stage positions ``0 .. length - 1`` of ``slot`` from its host pages (a cached
    prefix of whole chunks, or every computed position of a request handed over
    with its pages) so its next prefill chunk (or ``start_decoding``) sees them."""

  # Optional: a disk tier (``EngineConfig.disk_pages``) needs both.
  def read_pages(self, state: Any, pages: list[int]) -> list[np.ndarray]:
    """The contents of host pages ``pages``: arrays [len(pages), ...], page i in
    row i (what a disk tier stores, byte for byte)."""

  def write_pages(self, state: Any, pages: list[int], fields: list[np.ndarray]) -> Any:
    """Host pages ``pages`` <- contents ``read_pages`` returned."""

  # Optional: ``snapshot.save`` / ``snapshot.restore`` need both.
  def snapshot(self, state: Any) -> list[np.ndarray]:
    """The state (and any host-side mirror) as numpy arrays."""

  def restore_state(self, arrays: list[np.ndarray]) -> Any:
    """The state ``snapshot`` returned, placed for this model's compiled steps;
    ``ValueError`` if the arrays do not fit it."""

  def stats(self, state: Any) -> dict:
    """Cumulative counters: hits, misses, host-to-device bytes (tiered)."""

  # Optional: counters that wrap (fixed-width on the device): ``{name: modulus}``;
  # the engine's per-step deltas are taken modulo it (exact while a step adds less).
  stats_modulus: dict
