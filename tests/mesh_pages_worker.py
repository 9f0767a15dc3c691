"""The mesh serving backend's host-page IO (models/sharded_serving.py: ``read_pages``
/ ``write_pages``, what a disk tier and the PDD relay call) against a numpy model of
the host tier, on 4 fake CPU devices as a data:2 x model:2 mesh (run by
tests/test_sharding.py in a subprocess: the device count is fixed when jax starts).
Prints one JSON line; any mismatch raises."""

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kvtier_jax import sharding  # noqa: E402
from models import serving, sharded_serving  # noqa: E402
from models import transformer as tfm  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.setup import build_selector  # noqa: E402

ROWS, PAGES_PER_ROW = 2, 6


def main():
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny")
  model = tfm.Transformer(cfg, rngs=nnx.Rngs(0))
  selector, _ = build_selector("quest_kv", cfg, top_k=16)
  mesh = sharding.make_mesh({"data": ROWS, "model": 2})
  backend = sharded_serving.MeshServingBackend(
      model, "tiered", 4, 64, mesh=mesh, selector=selector, chunk_size=16,
      page_size=8, hot_slots=32, host_pages=ROWS * PAGES_PER_ROW)
  one = serving.ServingBackend(model, "tiered", 2, 64, selector=selector, chunk_size=16,
                               page_size=8, hot_slots=32, host_pages=PAGES_PER_ROW)
  state = backend.init()
  num_pages = backend.num_host_pages
  assert num_pages == ROWS * PAGES_PER_ROW, num_pages

  # No pages: the one-device backend's empty fields ([0, L, Pg, U, Hg, D]).
  empty, want = backend.read_pages(state, []), one.read_pages(one.init(), [])
  assert [f.shape for f in empty] == [f.shape for f in want], (empty, want)
  assert [f.dtype for f in empty] == [f.dtype for f in want]
  assert empty[0].shape[0] == 0

  rng = np.random.default_rng()
  model_k = model_v = None
  writes = 0
  for _ in range(4):  # random subsets, random order, pages of both rows mixed
    pages = rng.permutation(num_pages)[:rng.integers(1, num_pages + 1)].tolist()
    shape = (len(pages),) + empty[0].shape[1:]
    k = rng.standard_normal(shape).astype(empty[0].dtype)
    v = rng.standard_normal(shape).astype(empty[1].dtype)
    state = backend.write_pages(state, pages, [k, v])
    writes += len(pages)
    if model_k is None:
      model_k = np.full((num_pages,) + shape[1:], np.nan, k.dtype)
      model_v = model_k.copy()
    model_k[pages], model_v[pages] = k, v
    written = np.flatnonzero(~np.isnan(model_k.reshape(num_pages, -1)[:, 0]))
    order = rng.permutation(written).tolist()
    got_k, got_v = backend.read_pages(state, order)
    np.testing.assert_array_equal(got_k, model_k[order])
    np.testing.assert_array_equal(got_v, model_v[order])
  # Global page p is row p // PAGES_PER_ROW's local page p % PAGES_PER_ROW (what
  # set_pages maps a slot's page table to): read each row's tier on its own.
  for row in range(ROWS):
    local = model_k[row * PAGES_PER_ROW:(row + 1) * PAGES_PER_ROW]
    held = np.flatnonzero(~np.isnan(local.reshape(PAGES_PER_ROW, -1)[:, 0])).tolist()
    _, (row_k, row_v) = backend._on_row(state, row, lambda b, s: (s, b.read_pages(s, held)))
    np.testing.assert_array_equal(row_k, local[held])
    np.testing.assert_array_equal(
        row_v, model_v[row * PAGES_PER_ROW:(row + 1) * PAGES_PER_ROW][held])
  # Ids no row holds (a write dropped, a read of uninitialised memory) and contents
  # of another page count: refused, the tier unchanged.
  one_page = [f[:1] for f in backend.read_pages(state, [0])]
  refused = 0
  for call in (lambda: backend.read_pages(state, [0, -1]),
               lambda: backend.read_pages(state, [num_pages]),
               lambda: backend.write_pages(state, [-1], one_page),
               lambda: backend.write_pages(state, [num_pages + 3], one_page),
               lambda: backend.write_pages(state, [0, 1], one_page)):
    try:
      call()
    except ValueError:
      refused += 1
  assert refused == 5, refused
  np.testing.assert_array_equal(backend.read_pages(state, [0])[0], one_page[0])
  # A slot's pages are its row's: slot 1 (row 0) takes row 0's page; slot 0 given
  # row 1's is refused. Tensor parallel names another model (its sums' order).
  table = np.full((4, 8), -1, np.int32)
  table[1, 0] = 1
  backend.set_pages(backend.init(), table)
  table[0, 0] = PAGES_PER_ROW
  try:
    backend.set_pages(backend.init(), table)
    raise AssertionError("a page of another row's host tier was taken")
  except ValueError as err:
    assert "another row" in str(err), err
  assert backend.model_id == one.model_id + "/tp2", (backend.model_id, one.model_id)
  print(json.dumps({"pages": num_pages, "writes": writes,
                    "empty_shape": list(empty[0].shape),
                    "dense_refused": dense_refuses_past_max_len(model, mesh),
                    "bad_input_refused": refuses_bad_input(model, mesh),
                    "counters": [decode_counters(mesh, heads) for heads in (2, 3)]}))


def dense_refuses_past_max_len(model, mesh) -> int:
  """The mesh's dense step bypasses its rows' decode: a slot at max_len is still
  refused (its K/V write would be dropped), also after a snapshot is restored."""
  dense = sharded_serving.MeshServingBackend(model, "dense", 4, 16, mesh=mesh,
                                             chunk_size=16, page_size=8)
  state = dense.start_decoding(dense.init(), 3, 15)  # row 1's second slot
  tokens, last = np.array([1, 2, 3, 4], np.int32), np.array([0, 0, 0, 1], bool)
  state, _ = dense.decode(state, tokens, last)
  refused = 0
  for backend, state in ((dense, state), (dense, dense.restore_state(dense.snapshot(state)))):
    try:
      backend.decode(state, tokens, last)
    except ValueError as err:
      assert "reached max_len=16" in str(err), err
      refused += 1
  return refused


def refuses_bad_input(model, mesh) -> int:
  """As the one-device backend does, before the step: a token past the vocabulary
  (the embedding would clamp it: another token's logits), a mask or tokens of
  another length (broadcast over every slot), a bool slot (read as slot 1)."""
  dense = sharded_serving.MeshServingBackend(model, "dense", 4, 16, mesh=mesh,
                                             chunk_size=16, page_size=8)
  state = dense.start_decoding(dense.init(), 1, 4)
  tokens, one = np.array([1, 2, 3, 4], np.int32), np.array([0, 1, 0, 0], bool)
  vocab = model.cfg.vocab_size
  refused = 0
  for call, match in (
      (lambda: dense.decode(state, np.array([1, vocab, 3, 4], np.int32), one), "token ids"),
      (lambda: dense.decode(state, np.array([1, -1, 3, 4], np.int32), one), "token ids"),
      (lambda: dense.decode(state, tokens, np.array([True])), "must be (4,)"),
      (lambda: dense.decode(state, tokens[:2], one), "must be (4,)"),
      (lambda: dense.start_decoding(state, True, 4), "slot=True")):
    try:
      call()
    except ValueError as err:
      assert match in str(err), (match, err)
      refused += 1
  state, _ = dense.decode(state, tokens, one)  # the state is as it was: it decodes
  return refused


def decode_counters(mesh, kv_heads: int) -> dict:
  """A tiered mesh (model = 2) decoding one slot: every layer's fetched rows are
  counted, one per miss of every unit (padded heads' included: their rows cross the
  link), and ``stats`` counts hits and misses of the model's own heads only (a
  padded head selects over zero keys). Raises on a mismatch."""
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=4,
                                 num_q_heads=2 * kv_heads, num_kv_heads=kv_heads,
                                 head_dim=8, ffn_hidden_dim=48, name="tiny")
  model = tfm.Transformer(cfg, rngs=nnx.Rngs(1))
  prompt, steps, layers = 48, 6, cfg.num_layers
  selector, _ = build_selector("quest_kv", cfg, top_k=16)
  backend = sharded_serving.MeshServingBackend(
      model, "tiered", 4, 64, mesh=mesh, selector=selector, chunk_size=16,
      page_size=8, hot_slots=24, host_pages=ROWS * PAGES_PER_ROW * 2)
  table = np.full((4, 8), -1, np.int32)
  table[3] = backend._local_pages + np.arange(8)  # row 1's second slot
  state = backend.set_pages(backend.init(), table)
  tokens = np.random.default_rng().integers(0, 64, prompt + steps).astype(np.int32)
  for start in range(0, prompt, 16):
    state, _ = backend.prefill(state, 3, tokens[start:start + 16], start, 16)
  state = backend.start_decoding(state, 3, prompt)

  def arrays(state):
    tier = state.cache.tier  # fetched rows: every device's own [L], concatenated
    return (np.asarray(tier.hits), np.asarray(tier.misses),
            np.asarray(tier.fetched_rows).reshape(-1, layers).sum(0))

  before, stats_before = arrays(state), backend.stats(state)
  for p in range(prompt, prompt + steps):
    state, _ = backend.decode(state, np.where(np.arange(4) == 3, tokens[p], 0),
                              np.arange(4) == 3)
  hits, misses, fetched = (b - a for a, b in zip(before, arrays(state)))
  got = {k: v - stats_before[k] for k, v in backend.stats(state).items()}
  # A snapshot of rows at unequal lengths restores each row's length mirror: the
  # next step's logits are the uninterrupted backend's, bit for bit.
  again = sharded_serving.MeshServingBackend(
      model, "tiered", 4, 64, mesh=mesh, selector=selector, chunk_size=16,
      page_size=8, hot_slots=24, host_pages=ROWS * PAGES_PER_ROW * 2)
  restored = again.restore_state(backend.snapshot(state))
  last = np.where(np.arange(4) == 3, tokens[-1], 0)
  _, want_logits = backend.decode(state, last, np.arange(4) == 3)
  _, got_logits = again.decode(restored, last, np.arange(4) == 3)
  np.testing.assert_array_equal(np.asarray(got_logits)[3], np.asarray(want_logits)[3])
  assert (fetched == misses.sum((1, 2))).all() and (fetched > 0).all(), (fetched, misses)
  want = dict(hits=int(hits[:, :, :kv_heads].sum()), misses=int(misses[:, :, :kv_heads].sum()),
              fetched_rows=int(fetched.sum()))
  assert {k: got[k] for k in want} == want, (got, want)
  return dict(got, padded=int(hits[:, :, kv_heads:].sum() + misses[:, :, kv_heads:].sum()))


if __name__ == "__main__":
  main()
