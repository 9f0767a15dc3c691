"""Distilling a DSA lightning indexer from a dense model's own attention.

A dense model (SmolLM2-135M) ships no indexer, so ``DSASelector`` has nothing to
score with. DeepSeek-V3.2's *dense warm-up* stage solves the same problem for a
model that already exists: freeze the model, and train only the indexer so that
its softmax over positions matches the distribution the main attention puts over
the same positions (KL loss), before any sparse training. This module is that
stage on arrays (hidden states, queries, keys); it knows nothing of the model, so
any decoder whose per-layer attention inputs can be captured can be distilled.

Choices, and why:

* **Target** (``attention_targets``): per (request, query position, layer), the
  main attention's causal probabilities summed over all query heads and
  L1-normalised, which is DeepSeek's warm-up target. Each head's row already sums
  to 1, so this equals the mean over heads. One distribution per query, not per
  head, because the indexer's selection is shared by all heads (U = 1); it is also
  the quantity ``OracleSelector(granularity="layer")`` ranks by, so the oracle
  top-k of the target is the best any shared selection can do.
* **Loss** (``distill_loss``): KL(target || softmax(I)) per query row over its
  causal positions, averaged over valid rows, with ``I`` computed by
  ``dsa.index_scores``: the trained scores are exactly what ``DSASelector``
  ranks at decode time (same RoPE, LayerNorm and head weighting).
* **Training** (``train_indexer``): all layers at once. The per-layer loss is
  vmapped over parameters stacked ``[L, ...]`` and summed; layers share no
  weights, so each layer's gradient is its own loss's gradient and AdamW (an
  element-wise update) trains every layer exactly as if alone. One jitted step
  for all layers compiles once and runs 30 layers' matmuls per dispatch, which is
  what keeps ~2K tokens x 30 layers inside a few minutes on a 2-core CPU.
* **Query subsampling**: the caller computes targets only for a subset of query
  positions (a full [L, P, P] target is 0.5 GB at P = 2048, 30 layers), and each
  step draws ``query_batch`` of those rows at random. Index keys are still
  computed for every position each step, because every query attends to all
  earlier positions and the keys depend on the weights being trained.

Shape letters (kvtier_jax/shapes.py, plus): ``Q`` query rows, ``T`` key
positions of a prompt (0..T-1), ``Dm`` model width, ``H_I`` / ``d_I`` index heads
and dim.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvtier_jax.selectors.dsa import (IndexerParams, index_keys, index_scores,
                                      init_indexer_params)

_PRECISION = jax.lax.Precision.HIGHEST

_ARRAY_FIELDS = ("wq", "wk", "k_norm_scale", "k_norm_bias", "ww")
_STATIC_FIELDS = ("rope_dim", "rope_theta", "norm_eps")
_FORMAT = "kvtier_jax.indexer/1"


# Targets and masks -----------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("num_keys",))
def causal_mask(query_positions, num_keys: int, lens=None):
  """Which keys each query row may see: ``s <= position`` and ``s < lens``.

  Args:
    query_positions: i32[R, Q] positions of the query rows (their index in the
      prompt).
    num_keys: T, prompt length (padded).
    lens: i32[R] valid prompt lengths (default all T). A query at or past its
      request's length is padding and sees nothing.

  Returns:
    bool[R, Q, T].
  """
  keys = jnp.arange(num_keys)
  mask = keys <= query_positions[..., None]  # [R, Q, T]
  if lens is not None:
    lens = jnp.asarray(lens)[:, None, None]
    mask &= (keys < lens) & (query_positions[..., None] < lens)
  return mask


def default_query_positions(num_requests: int, num_queries: int):
  """i32[R, Q] = 0..Q-1 for every request: all positions are query rows."""
  return jnp.broadcast_to(jnp.arange(num_queries, dtype=jnp.int32),
                          (num_requests, num_queries))


@jax.jit
def attention_targets(q, k, query_positions=None, lens=None):
  """The model's causal attention distribution per query row, shared by all heads.

  Per query head, ``softmax_s(q . k_s / sqrt(D))`` over the causal positions (the
  model's own scale and masking); then the mean over the ``Hq`` heads, i.e.
  DeepSeek-V3.2's "sum over heads, L1-normalise" (see the module docstring).

  Args:
    q: [R, Q, Hq, D] post-RoPE queries of the query rows.
    k: [R, T, Hkv, D] post-RoPE keys of the whole prompt (GQA: ``Hq`` is a
      multiple of ``Hkv``; query head ``h`` reads KV head ``h // G``).
    query_positions: i32[R, Q] the rows' positions (default 0..Q-1).
    lens: i32[R] valid prompt lengths (default T).

  Returns:
    f32[R, Q, T]: rows sum to 1 over the visible positions and are 0 elsewhere;
    rows of padding queries are all 0.
  """
  num_req, num_q, num_q_heads, head_dim = q.shape
  num_keys, num_kv_heads = k.shape[1], k.shape[2]
  if num_q_heads % num_kv_heads:
    raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
  if query_positions is None:
    query_positions = default_query_positions(num_req, num_q)
  group = num_q_heads // num_kv_heads
  mask = causal_mask(query_positions, num_keys, lens)  # [R, Q, T]
  q = q.astype(jnp.float32).reshape(num_req, num_q, num_kv_heads, group, head_dim)
  scores = jnp.einsum("rqkgd,rtkd->rkgqt", q, k.astype(jnp.float32),
                      precision=_PRECISION) * head_dim ** -0.5  # [R, Hkv, G, Q, T]
  row_valid = mask.any(-1)  # [R, Q]
  # Padding rows see no key: give them finite scores so the softmax stays finite.
  visible = mask | ~row_valid[..., None]
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).mean(axis=(1, 2))  # [R, Q, T]
  return jnp.where(mask, probs, 0.0)


# Loss ------------------------------------------------------------------------------
@jax.jit
def prompt_index_scores(params: IndexerParams, x, query_positions, mask):
  """One layer's indexer scores of query rows over a whole prompt.

  Index keys are computed for every prompt position (0..T-1), the queries are the
  rows of ``x`` at ``query_positions``; the scoring is ``dsa.index_scores``.

  Args:
    params: one layer's indexer weights.
    x: [R, T, Dm] normalised attention inputs of the prompt.
    query_positions: i32[R, Q].
    mask: bool[R, Q, T] visible keys (``causal_mask``).

  Returns:
    f32[R, Q, T], -inf where masked.
  """
  num_req, num_keys = x.shape[:2]
  key_positions = default_query_positions(num_req, num_keys)  # [R, T]
  keys = index_keys(params, x, key_positions)  # [R, T, d_I]
  x_q = jnp.take_along_axis(x, query_positions[..., None], axis=1)  # [R, Q, Dm]
  return index_scores(params, x_q, query_positions, keys, mask)


@jax.jit
def row_kl(target_p, scores, mask):
  """KL(target || softmax(scores)) per row over the masked-in positions.

  Args:
    target_p: f32[..., T], rows summing to 1 on ``mask`` (0 elsewhere).
    scores: f32[..., T] logits (values off ``mask`` are ignored).
    mask: bool[..., T].

  Returns:
    f32[...]; 0 for rows with no visible position.
  """
  row_valid = mask.any(-1, keepdims=True)
  scores = jnp.where(mask, scores, -jnp.inf)
  scores = jnp.where(row_valid, scores, 0.0)  # all-masked rows: finite, unused
  log_q = jnp.where(mask, jax.nn.log_softmax(scores, axis=-1), 0.0)
  target_p = jnp.where(mask, target_p, 0.0)
  neg_entropy = jax.scipy.special.xlogy(target_p, target_p).sum(-1)
  return neg_entropy - (target_p * log_q).sum(-1)


@jax.jit
def distill_loss(params_l: IndexerParams, x, positions, target_p, mask):
  """Mean KL(attention target || indexer distribution) over valid query rows.

  Args:
    params_l: one layer's indexer weights.
    x: [R, T, Dm] the layer's normalised attention inputs over the whole prompt
      (keys are built from every position).
    positions: i32[R, Q] the query rows' positions.
    target_p: f32[R, Q, T] ``attention_targets`` of those rows.
    mask: bool[R, Q, T] ``causal_mask`` of those rows.

  Returns:
    f32[] (nats); 0 iff the indexer's softmax equals the target on every valid
    row.
  """
  scores = prompt_index_scores(params_l, x, positions, mask)  # [R, Q, T]
  kl = row_kl(target_p, scores, mask)  # [R, Q]
  valid = mask.any(-1)
  return jnp.where(valid, kl, 0.0).sum() / jnp.maximum(valid.sum(), 1)


@jax.jit
def layer_losses(params: IndexerParams, layer_inputs, positions, targets, mask):
  """``distill_loss`` of every layer: stacked params [L, ...], inputs [L, R, T, Dm],
  targets [L, R, Q, T], shared positions / mask -> f32[L]."""
  return jax.vmap(distill_loss, in_axes=(0, 0, None, 0, None))(
      params, layer_inputs, positions, targets, mask)


# Training --------------------------------------------------------------------------
class TrainResult(NamedTuple):
  params: IndexerParams  # stacked [L, ...]
  losses: np.ndarray  # f32[steps, L] minibatch loss of each layer before each update


def _decay_mask(params: IndexerParams) -> IndexerParams:
  # Weight decay on the projections only; LayerNorm scale/bias stay free.
  return params.replace(wq=True, wk=True, k_norm_scale=False, k_norm_bias=False,
                        ww=True)


def make_optimizer(lr: float, steps: int, weight_decay: float = 1e-4,
                   warmup_steps: int | None = None) -> optax.GradientTransformation:
  """AdamW with linear warm-up and cosine decay to ``lr / 10``.

  The warm-up matters because the indexer starts near a uniform distribution and
  the first Adam steps (unit-size per element) would otherwise overshoot the
  scale of the head weights.
  """
  if warmup_steps is None:
    warmup_steps = max(1, steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=min(warmup_steps, steps),
      decay_steps=max(steps, 1), end_value=lr / 10)
  return optax.adamw(schedule, weight_decay=weight_decay, mask=_decay_mask)


def train_indexer(key, layer_inputs, targets, steps: int, lr: float, *,
                  query_positions, lens=None, num_index_heads: int = 4,
                  index_dim: int = 64, rope_dim: int = 32, rope_theta: float = 10000.0,
                  weight_decay: float = 1e-4, warmup_steps: int | None = None,
                  query_batch: int | None = None,
                  init_params: IndexerParams | None = None, log_every: int = 0,
                  log_fn: Callable[[int, float], None] | None = None) -> TrainResult:
  """Trains an indexer for every layer at once by KL to the attention targets.

  Args:
    key: PRNG key (initialisation and minibatches).
    layer_inputs: [L, R, T, Dm] per-layer normalised attention inputs of the
      training prompt(s), positions 0..T-1.
    targets: f32[L, R, Q, T] ``attention_targets`` of the query rows.
    steps: optimiser steps.
    lr: peak AdamW learning rate.
    query_positions: i32[R, Q] positions of the target rows.
    lens: i32[R] valid prompt lengths (default T).
    num_index_heads / index_dim / rope_dim / rope_theta: the indexer's shape
      (ignored when ``init_params`` is given). Pass the model's ``rope_theta``.
    weight_decay: AdamW decay of the projections.
    warmup_steps: default ``steps // 20``.
    query_batch: rows drawn (without replacement, same rows for every layer and
      request) per step; default all Q rows every step.
    init_params: start here instead of a random init (stacked [L, ...]).
    log_every / log_fn: call ``log_fn(step, mean loss over layers)`` every
      ``log_every`` steps (and at the last step).

  Returns:
    ``TrainResult`` with the trained stacked params and the loss history.
  """
  num_layers, num_req, num_keys, model_dim = layer_inputs.shape
  num_q = query_positions.shape[1]
  if targets.shape != (num_layers, num_req, num_q, num_keys):
    raise ValueError(f"targets {targets.shape} != (L, R, Q, T) = "
                     f"{(num_layers, num_req, num_q, num_keys)}")
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  batch = num_q if query_batch is None else min(query_batch, num_q)
  key_init, key_data = jax.random.split(key)
  params = init_params if init_params is not None else init_indexer_params(
      key_init, num_layers, model_dim, num_index_heads, index_dim, rope_dim,
      rope_theta)
  mask = causal_mask(query_positions, num_keys, lens)  # [R, Q, T]
  targets = jnp.where(mask, targets, 0.0)
  optimizer = make_optimizer(lr, steps, weight_decay, warmup_steps)
  opt_state = optimizer.init(params)

  def total_loss(params, inputs, positions, targets, mask):
    per_layer = layer_losses(params, inputs, positions, targets, mask)  # [L]
    return per_layer.sum(), per_layer

  @jax.jit
  def update(params, opt_state, step_key, inputs, positions, targets, mask):
    if batch < num_q:
      rows = jax.random.choice(step_key, num_q, (batch,), replace=False)
      positions, mask = positions[:, rows], mask[:, rows]
      targets = targets[:, :, rows]
    grads, per_layer = jax.grad(total_loss, has_aux=True)(
        params, inputs, positions, targets, mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, per_layer

  losses = []
  for step in range(steps):
    params, opt_state, per_layer = update(
        params, opt_state, jax.random.fold_in(key_data, step), layer_inputs,
        query_positions, targets, mask)
    losses.append(per_layer)
    if log_fn is not None and log_every and (step % log_every == 0 or
                                             step == steps - 1):
      log_fn(step, float(per_layer.mean()))
  return TrainResult(params, np.asarray(jnp.stack(losses)))


# Evaluation ------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("k",))
def topk_recall(scores, target_p, k: int):
  """Share of the true attention mass on the top-``k`` positions by ``scores``.

  Ties go to the lower position (``lax.top_k``). Masked positions must score
  -inf and carry zero target mass, so a row with fewer than ``k`` visible
  positions has recall 1 (every position fits).

  Args:
    scores: f32[..., T].
    target_p: f32[..., T] rows summing to 1 (``attention_targets``).
    k: positions kept (capped at T).

  Returns:
    f32[...]; ``topk_recall(target_p, target_p, k)`` is the oracle's, the best
    any k-subset can reach.
  """
  k = min(k, scores.shape[-1])
  _, idx = jax.lax.top_k(scores, k)  # [..., k]
  return jnp.take_along_axis(target_p, idx, axis=-1).sum(-1)


@functools.partial(jax.jit, static_argnames=("k",))
def oracle_recall(target_p, k: int):
  """``topk_recall`` of the target itself (the oracle top-k)."""
  return topk_recall(target_p, target_p, k)


# Checkpoints -----------------------------------------------------------------------
def save_indexer(path, params: IndexerParams, metadata: dict | None = None
                 ) -> pathlib.Path:
  """Saves stacked indexer params: arrays with orbax, static fields as JSON.

  ``IndexerParams``' RoPE/LayerNorm constants are static pytree fields, which an
  array checkpoint does not hold; ``indexer.json`` keeps them (and the array
  shapes, so ``load_indexer`` needs no template). Overwrites ``path``'s previous
  contents.

  Layout: ``path/arrays/`` (orbax ``StandardCheckpointer``), ``path/indexer.json``.

  Returns:
    The absolute checkpoint path.
  """
  import orbax.checkpoint as ocp
  path = pathlib.Path(path).absolute()  # orbax requires absolute paths
  path.mkdir(parents=True, exist_ok=True)
  arrays = {name: getattr(params, name) for name in _ARRAY_FIELDS}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path / "arrays", arrays, force=True)
  config = {
      "format": _FORMAT,
      "static": {name: getattr(params, name) for name in _STATIC_FIELDS},
      "arrays": {name: {"shape": list(a.shape), "dtype": str(a.dtype)}
                 for name, a in arrays.items()},
      "num_index_heads": params.num_index_heads,
      "index_dim": params.index_dim,
      "metadata": metadata or {},
  }
  (path / "indexer.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
  return path


def load_indexer_config(path) -> dict:
  """The ``indexer.json`` of a checkpoint (static fields, shapes, metadata)."""
  config = json.loads((pathlib.Path(path) / "indexer.json").read_text())
  if config.get("format") != _FORMAT:
    raise ValueError(f"{path}: format {config.get('format')!r}, expected {_FORMAT!r}")
  return config


def load_indexer(path) -> IndexerParams:
  """Rebuilds the ``IndexerParams`` written by ``save_indexer`` exactly."""
  import orbax.checkpoint as ocp
  path = pathlib.Path(path).absolute()
  config = load_indexer_config(path)
  abstract = {name: jax.ShapeDtypeStruct(tuple(spec["shape"]), jnp.dtype(spec["dtype"]))
              for name, spec in config["arrays"].items()}
  with ocp.StandardCheckpointer() as checkpointer:
    arrays = checkpointer.restore(path / "arrays", abstract)
  static = config["static"]
  return IndexerParams(**{name: arrays[name] for name in _ARRAY_FIELDS},
                       rope_dim=int(static["rope_dim"]),
                       rope_theta=float(static["rope_theta"]),
                       norm_eps=float(static["norm_eps"]))
