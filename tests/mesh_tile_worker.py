"""A row-tiled decode over a mesh of fake CPU devices (run by tests/test_sharding.py
in a subprocess: the device count is fixed when jax starts). A request among random
others on SmolLM2's first layers: its decode logits on data:2 meshes of two slot
counts against one device at one slot, and on data:2 x model:2 meshes of two slot
counts against a model:2 mesh (one data row) at one slot. Prints one JSON line; any mismatch raises."""

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()

import numpy as np  # noqa: E402

from kvtier_jax import sharding  # noqa: E402
from kvtier_jax.serving import Engine, EngineConfig, State  # noqa: E402
from kvtier_jax.serving.bench import (RequestSpec, decode_logits_among,  # noqa: E402
                                      random_others)
from models import serving, setup, sharded_serving  # noqa: E402
from tests.util import SMOKE_LAYERS  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
MAX_LEN, NEW_TOKENS = 320, 6


def main():
  rng = np.random.default_rng(SEED)
  model, _, ids = setup.load_model_and_prompt(None, 1 << 14, num_layers=SMOKE_LAYERS,
                                              decode_row_tile=8)
  # Quest per KV head: the selector a model axis shards (the heads split over it).
  selector, params = setup.build_selector("quest_kv", model.cfg, 64)
  offset = int(rng.integers(0, len(ids) - 200))
  target = RequestSpec("target", tuple(int(t) for t in ids[offset:offset + 200]), NEW_TOKENS)

  def logits(slots: int, mesh_text: str | None) -> np.ndarray:
    others = random_others(rng, slots + 1, model.cfg.vocab_size, (20, 240), (1, 8))
    kwargs = dict(selector=selector, selector_params=params, chunk_size=64, page_size=16,
                  hot_slots=128)
    if mesh_text is None:
      backend = serving.ServingBackend(model, "tiered", slots, MAX_LEN, **kwargs)
    else:
      mesh = sharding.make_mesh(sharding.parse_mesh(mesh_text))
      backend = sharded_serving.MeshServingBackend(model, "tiered", slots, MAX_LEN,
                                                   mesh=mesh, **kwargs)
    request, rows = decode_logits_among(Engine(backend, EngineConfig(max_step_tokens=64)),
                                        target, others)
    assert request.state is State.FINISHED and len(rows) == NEW_TOKENS - 1, request
    return rows

  one = logits(1, None)
  many = int(rng.integers(2, 5)) * 2  # 4, 6 or 8 slots: 2 to 4 per mesh row
  for slots in (2, many):
    rows = logits(slots, "data:2")
    assert np.array_equal(rows, one), (
        f"data:2 at {slots} slots differs from one device by "
        f"{float(np.abs(rows - one).max()):.3g} (seed {SEED})")
  # A model axis: the same bits at any slot count and data-row count of its width.
  narrow = logits(1, "model:2")
  for slots in (2, many):
    rows = logits(slots, "data:2,model:2")
    assert np.array_equal(rows, narrow), (
        f"data:2,model:2 at {slots} slots differs from model:2 at one slot by "
        f"{float(np.abs(rows - narrow).max()):.3g} (seed {SEED})")
  print(json.dumps(dict(seed=SEED, many=many,
                        model_axis_vs_one_device=float(np.abs(narrow - one).max()))))


if __name__ == "__main__":
  main()
