"""Requests over a mesh (kvtier_jax/sharding.py, models/sharded_serving.py) on fake
CPU devices, in a subprocess (jax fixes its device count when it starts): the
sharded tiered step equals the one-device step in every array, refusals included.
The engine over a data x model mesh on SmolLM2 (prefix cache, sessions, exactness
against one device) is tests/test_experiments_serving.py's serve smoke."""

import json

import pytest

from kvtier_jax import sharding
from tests.test_experiments import run
from tests.util import smollm2_or_skip


def test_parse_mesh_and_clear_errors():
  assert sharding.parse_mesh("data:2,model:2") == {"data": 2, "model": 2}
  assert sharding.parse_mesh(None) == {"data": 1, "model": 1}
  for bad in ("data", "rows:2", "data:0", "data:x"):
    with pytest.raises(ValueError, match="axis"):
      sharding.parse_mesh(bad)
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    sharding.make_mesh({"data": 64})
  for bad in ({"Data": 4}, {"data": 0}, {"model": 1.5}):  # not a 1x1 mesh, silently
    with pytest.raises(ValueError, match="axes are"):
      sharding.make_mesh(bad)
  assert sharding.make_mesh({"data": 1}).shape == {"data": 1, "model": 1}


def test_sharded_step_equals_the_one_device_step_on_4_devices():
  """4 devices x 2 requests vs 8 requests on one device, 12 steps with random
  selections, NaN-poisoned memory and three refused steps (one request on one device
  repeats a position, twice; one's newest position has no page): outputs bit-equal, every device's hot cache, metadata,
  counters and host pages equal the one-device arrays of its requests."""
  out = run("tests.sharding_worker")
  result = json.loads(out.strip().splitlines()[-1])
  assert result["refused"] == 3 and result["misses"] > 0, result


@pytest.mark.slow  # six engines in a subprocess: CI runs it (--runslow)
def test_a_row_tiled_decode_over_a_mesh_is_the_same_bits_at_any_slot_count():
  """``decode_row_tile`` on a mesh engine (SmolLM2's first layers, a request among
  random others): on data:2 meshes of 2 and 4-8 slots its decode logits are one
  device's at one slot, bit for bit; on data:2 x model:2 meshes of those slot
  counts they are a model:2 mesh's (one data row) at one slot. Not one device's:
  the KV heads split over the model axis (3 padded to 4) sum in another order
  (DESIGN, "Moving a request between engines"). Untiled, a data:2 mesh at 6 slots
  differed from one device by 6.9e-5."""
  smollm2_or_skip()
  out = run("tests.mesh_tile_worker")
  result = json.loads(out.strip().splitlines()[-1])
  assert result["many"] in (4, 6, 8), result


def test_mesh_host_pages_read_and_write_like_a_numpy_host_tier():
  """A data:2 x model:2 mesh backend's read_pages / write_pages (a disk tier's and
  the relay's IO): random page subsets of both rows, in random order, read back what
  was written; each global page lands on its row's tier at its local index; no pages
  read as the one-device backend's empty fields. Its dense step refuses a slot at
  max_len, and input the one-device backend refuses. Its tiered step counts every
  layer's fetched rows (each device's counter is its own [L]; split over the row's
  heads, layers past L / 2 went uncounted), and hits and misses of the model's own
  heads only (3 KV heads padded to 4)."""
  out = run("tests.mesh_pages_worker")
  result = json.loads(out.strip().splitlines()[-1])
  assert result["pages"] == 12 and result["writes"] > 0, result
  assert result["empty_shape"][0] == 0, result
  assert result["dense_refused"] == 2, result  # a dense slot at max_len, twice
  assert result["bad_input_refused"] == 5, result  # as the one-device backend's
  # (The counters' checks are the worker's; SmolLM2's 3 heads pad to 4.)
  assert [c["padded"] > 0 for c in result["counters"]] == [False, True], result


def test_padded_kv_heads_contribute_exactly_zero():
  """SmolLM2 with its 3 KV heads padded to 4 (and 9 query heads to 12).

  Exact, on any CPU: the pad heads' attention output is exactly zero, so random
  output-projection rows for them give the logits of zero rows bit for bit (one
  program, only values times zero differ). Against the unpadded model the logits
  differ only in summation order over 12 vs 9 heads (8.9e-5 at most on an AVX-512
  CPU, 0 on the earlier ones), so they agree within the port's logit tolerance
  (tests/test_model.py) and greedy tokens are the same."""
  transformer = pytest.importorskip("models.transformer")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from tests.test_model import LOGIT_ATOL
  model, tokenizer = smollm2_or_skip()
  from models import text
  ids = jnp.asarray([text.tokenize_prompt(tokenizer, text.load_text(), 96)])
  cfg, weights = transformer.pad_kv_heads(model.cfg, model.weights(), 2)
  assert (cfg.num_kv_heads, cfg.num_q_heads) == (4, 12)
  got = np.asarray(transformer.apply_forward(cfg, weights, ids))
  pad_rows = np.arange(cfg.num_q_heads) >= model.cfg.num_q_heads  # [Hq]
  noise = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(2**31))),
                            weights["wo"].shape, weights["wo"].dtype)
  noisy = dict(weights, wo=jnp.where(pad_rows[None, :, None, None], noise, weights["wo"]))
  np.testing.assert_array_equal(np.asarray(transformer.apply_forward(cfg, noisy, ids)),
                                got)
  want = np.asarray(transformer.apply_forward(model.cfg, model.weights(), ids))
  np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_ATOL)
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  assert transformer.pad_kv_heads(model.cfg, model.weights(), 3)[0] is model.cfg