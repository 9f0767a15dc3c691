"""Memory accounting: the formula against the arrays the cache really allocates, and
the paper's reference figures."""

import jax.numpy as jnp
import pytest

from kvtier_jax import state as kv_state
from kvtier_jax.config import TierConfig
from models import capacity
from models.config import ModelConfig


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_formula_matches_allocated_arrays(per_kv_head):
  """One selection per request, or one per KV head (3 units: 3x the metadata)."""
  cfg = ModelConfig.smollm2_135m().replace(selector="quest", top_k=64, quest_page_size=16)
  tier = TierConfig(num_layers=cfg.num_layers, num_requests=2, max_len=300,
                    num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, hot_slots=128, top_k=64, dtype=jnp.float32,
                    per_kv_head=per_kv_head)
  state = kv_state.init_state(tier)
  want = capacity.request_bytes(cfg, 300, 128, units=tier.num_units)
  assert (state.hot_k.nbytes + state.hot_v.nbytes) // 2 == want.hot_kv
  assert (state.slot_pos.nbytes + state.lru.nbytes + state.slot_score.nbytes) // 2 == \
      want.metadata
  # Two requests' pages plus the one scratch page of the pool.
  assert (state.host_k.nbytes + state.host_v.nbytes) // 2 == want.host + tier.page_bytes // 2


def test_glm_5_1_reference_figures():
  """The paper's figures: 13.09 GB full at 128K (KV + FP8 indexer key), ~0.4 GB of
  hot rows at B=4096, ~1.35 GB of indexer keys that stay on device (~7.6x)."""
  b = capacity.request_bytes(ModelConfig.glm_5_1(), 131072, 4096)
  assert b.full_device / 1e9 == pytest.approx(13.09, rel=0.01)
  assert b.hot_kv / 1e9 == pytest.approx(0.37, rel=0.01)
  assert b.selector_state / 1e9 == pytest.approx(1.35, rel=0.01)
  assert b.reduction == pytest.approx(7.6, rel=0.01)  # not 30x: indexer keys stay
  assert 6.0 < capacity.request_bytes(ModelConfig.glm_5_1(), 131072, 8192).reduction < 6.5


def test_throughput_model():
  cfg = ModelConfig.glm_5_1()
  model = capacity.ThroughputModel()
  tok_s = lambda m, batch, miss, context=32768: m.tokens_per_second(cfg, batch, miss,
                                                                   context=context)
  assert tok_s(model, 0, None) == 0.0
  # More requests never lower throughput; IO only costs; so does a longer context
  # (the selector scans all of it).
  assert tok_s(model, 32, None) > tok_s(model, 8, None)
  assert tok_s(model, 32, 0.1) < tok_s(model, 32, None)
  assert tok_s(model, 32, None, 131072) < tok_s(model, 32, None)
  hidden = capacity.ThroughputModel(exposed_io=0.0)
  assert tok_s(hidden, 32, 0.5) == tok_s(model, 32, None)
  assert capacity.concurrency(10e9, 3e9, 64) == 3
  assert capacity.concurrency(10e9, 1e6, 64) == 64


def test_exposed_io_counts_the_layers_that_fetch():
  """Misses x rows x bytes over the link plus its latency, per fetching layer, less
  what overlap hides; zero fetching layers expose nothing (it read as every layer)."""
  from experiments.analysis import io_model
  cfg = ModelConfig.glm_5_1()
  link = io_model.Link(bandwidth=50e9, latency=10e-6)
  layer_s = 8 * 0.25 * cfg.top_k * cfg.kv_bytes_per_token_per_layer / 50e9 + 10e-6
  assert io_model.exposed_io_ms(cfg, 8, 0.25, link) == pytest.approx(
      1e3 * cfg.num_layers * layer_s, rel=1e-12)
  assert io_model.exposed_io_ms(cfg, 8, 0.25, link, fetching_layers=26) == pytest.approx(
      1e3 * 26 * layer_s, rel=1e-12)
  assert io_model.exposed_io_ms(cfg, 8, 0.25, link, fetching_layers=0) == 0.0
  assert io_model.exposed_io_ms(cfg, 8, 0.25, link, hidden_s_per_layer=1.0) == 0.0
  with pytest.raises(ValueError, match="fetching_layers"):
    io_model.exposed_io_ms(cfg, 8, 0.25, link, fetching_layers=cfg.num_layers + 1)


def test_tier_economics_from_hand_worked_values():
  """Each term of ``models.tiers`` and the throughput roofline, by hand: a block
  device's miss rate, the batch in the miss IO, the prefix cache's shared part on
  either side, a tier's capacity bound, the link-bound batch under prefetch, the
  load-or-recompute choice and its break-even."""
  import numpy as np

  from models import tiers
  rng = np.random.default_rng()
  cfg, acc = ModelConfig.glm_5_1(), tiers.Accelerator()
  row = cfg.kv_bytes_per_token_per_layer
  read = cfg.num_layers * cfg.top_k * row
  GB = 1e9
  # A block device reads a whole 4 KiB block per ~1 KiB row; IOPS may bound first.
  nvme = tiers.TIERS["nvme"]
  fast = nvme.replace(iops=1e12)
  assert fast.miss_bandwidth(row) == pytest.approx(nvme.link_gbps * GB * row / 4096)
  assert nvme.miss_bandwidth(row) == pytest.approx(min(nvme.iops * row,
                                                       nvme.link_gbps * GB * row / 4096))
  assert tiers.TIERS["ddr5"].miss_bandwidth(row) == 54 * GB  # byte-addressable
  # The miss IO grows with the batch.
  model = capacity.ThroughputModel(link_bandwidth=50e9, exposed_io=0.5)
  for batch in (1, 7, 64):
    miss = float(rng.uniform(0.01, 0.5))
    step = lambda m: model.step_seconds(cfg, batch, m, context=32768)
    assert step(miss) - step(None) \
        == pytest.approx(0.5 * batch * miss * read / 50e9, rel=1e-9)
  assert capacity.weight_bytes_per_device("glm_5_1", 4) == 750e9 / 4
  # The shared part of a prefix counts once: on the device (full KV) or below.
  context, hot = 131072, 4096
  b = capacity.request_bytes(cfg, context, hot)
  ddr5 = tiers.TIERS["ddr5"]
  full = tiers.placement(cfg, context, acc, None, hot_slots=hot, miss_rate=0.1,
                         shared_fraction=0.5)
  own = b.full_device - 0.5 * b.full_kv
  assert full["device_GB"] == pytest.approx(own / GB)
  assert full["shared_GB"] == pytest.approx(0.5 * b.full_kv / GB)
  assert full["requests"] == min(acc.max_batch, (acc.kv_budget_gb * GB - 0.5 * b.full_kv) // own)
  tiered = tiers.placement(cfg, context, acc, ddr5, hot_slots=hot, miss_rate=0.1,
                           shared_fraction=0.5)
  assert tiered["below_GB"] == pytest.approx(0.5 * b.host / GB)
  assert tiered["shared_GB"] == pytest.approx(0.5 * b.host / GB)
  # A tier holding the shared copy and three requests' own parts: three, and the
  # system pays for four halves.
  room = ddr5.replace(gb_per_accelerator=(0.5 * b.host + 3 * 0.5 * b.host) / GB + 1e-6)
  three = tiers.placement(cfg, context, acc, room, hot_slots=hot, miss_rate=0.1,
                          shared_fraction=0.5)
  assert three["bound"] == room.name and three["requests"] == 3
  assert three["system_usd"] == pytest.approx(acc.usd + 4 * 0.5 * b.host / GB * room.usd_per_gb)
  tight = acc.__class__(kv_budget_gb=0.4 * b.full_kv / GB)  # not even the shared copy
  assert tiers.placement(cfg, context, tight, None, hot_slots=hot, miss_rate=0.1,
                         shared_fraction=0.5)["requests"] == 0
  # A tier too small bounds the batch.
  small = ddr5.replace(gb_per_accelerator=3 * b.host / GB + 1)
  bounded = tiers.placement(cfg, context, acc, small, hot_slots=hot, miss_rate=0.1)
  assert bounded["bound"] == small.name and bounded["requests"] == 3
  # A context the hot cache holds misses nothing: no link bound.
  assert tiers.placement(cfg, hot, acc, ddr5, hot_slots=hot,
                         miss_rate=0.1)["link_bound_batch"] is None
  assert tiers.placement(cfg, hot + 1, acc, ddr5, hot_slots=hot,
                         miss_rate=0.1)["link_bound_batch"] is not None
  # Prefetch hiding half the IO: the link-bound batch of the exposed half.
  link, miss = 54e9, 0.3
  scan = cfg.num_layers * context * cfg.selector_bytes_per_token_per_layer
  io, hbm = 0.5 * miss * read / link, (read + scan) / acc.hbm_bandwidth
  assert tiers.link_bound_batch(cfg, acc, link, miss, exposed_io=0.5,
                                context=context) == pytest.approx(
      (acc.weight_bytes / acc.hbm_bandwidth) / (io - hbm))
  # Loading a prefix back: its bytes over the link plus one access latency.
  per_token = cfg.num_layers * row
  tokens = int(rng.integers(1000, 100000))
  even = nvme.link_gbps * GB / per_token  # prefill tokens/s where the two tie
  for prefill, wins in ((2 * even, False), (even / 2, True)):
    got = tiers.load_or_recompute(cfg, nvme, tokens, prefill)
    assert got["load_s"] == pytest.approx(tokens * per_token / (nvme.link_gbps * GB)
                                          + 80e-6, rel=1e-12)
    assert got["load_wins"] is wins
    assert got["breakeven_gbps"] == pytest.approx(per_token * prefill / GB)
