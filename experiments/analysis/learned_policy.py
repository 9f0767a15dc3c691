"""A learned eviction key: a small MLP over causal per-slot features, trained on the
replay of one trace and evaluated on another (text it never saw).

The target is Belady's order: among the candidates of one eviction (a stream's
filled slots at one step), the one requested again sooner should keep the higher
key (``loss="pairwise"``, a RankNet loss, as Parrot imitates Belady: the eviction
is a choice among candidates, not a verdict on each). A pair counts by how much
keeping one over the other is worth, ``|exp(-d_i / horizon) - exp(-d_j /
horizon)|`` for reuse distances d, so that order within the next few ``horizon``
steps matters and order among the far-away does not. ``loss="binary"`` (the key
before the thirty-seventh session) labels each candidate alone: is it requested
again within ``horizon`` steps? Either way the replay evicts the smallest key.
Training data comes from replays (``cache_sim.replay(..., collect=...)``): first
under a rank-like hand-made key, then, DAgger-style, under the learned key itself,
so the model also sees the residency its own evictions produce.

A key reads ``BASE_FEATURES`` by default. ``uses=FEATURES`` adds ``"drafted"``: the
next step's selection as a draft token's query names it (the trace's
``<name>_drafted``), which a deployment knows at eviction time only if it feeds the
draft beside the token (a two-token step); OasisKV's route to the next selection.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.analysis import cache_sim

FEATURES = cache_sim.LEARNED_FEATURES
# What a key reads by default: everything but the draft's next-step picks, which a
# deployment has only from a two-token step (the draft token fed beside the real one).
DRAFT_FEATURES = ("drafted",)
BASE_FEATURES = tuple(name for name in FEATURES if name not in DRAFT_FEATURES)
# The features a slot's own metadata gives (no per-position history kept past an
# eviction): what a jitted RESOLVE could compute from its per-slot arrays and the
# layer's miss counter.
SLOT_FEATURES = ("rank_now", "since_request", "since_fetch", "hits", "rel_pos", "churn")
LOSSES = ("pairwise", "binary")


def baseline_key(features: np.ndarray) -> np.ndarray:
  """The hand-made start: ``"rank"``'s key on the per-position history (the current
  rank, plus 0.3 x the request EMA)."""
  return (1.0 - features[..., FEATURES.index("rank_now")]
          + 0.3 * features[..., FEATURES.index("freq")])


@dataclasses.dataclass(frozen=True)
class KeyModel:
  """An MLP logit over standardized features (numpy forward: replay runs on host)."""

  mean: np.ndarray  # f32[F]
  std: np.ndarray  # f32[F]
  layers: tuple[tuple[np.ndarray, np.ndarray], ...]  # (w f32[in, out], b f32[out])
  horizon: int  # steps: the binary label's window, the pairwise discount's time constant
  uses: tuple[str, ...] = BASE_FEATURES  # the input columns, in FEATURES order
  history: int | None = None  # replay's ``history`` it was trained (and runs) with
  loss: str = "binary"  # what it was trained with (LOSSES)

  def __call__(self, features: np.ndarray) -> np.ndarray:
    cols = [FEATURES.index(name) for name in self.uses]
    h = (np.asarray(features, np.float32)[..., cols] - self.mean) / self.std
    for i, (w, b) in enumerate(self.layers):
      h = h @ w + b
      if i + 1 < len(self.layers):
        h = np.maximum(h, 0.0)
    return h[..., 0]

  def save(self, path: str | pathlib.Path) -> None:
    arrays = {f"w{i}": w for i, (w, _) in enumerate(self.layers)}
    arrays.update({f"b{i}": b for i, (_, b) in enumerate(self.layers)})
    np.savez(path, mean=self.mean, std=self.std, horizon=self.horizon,
             features=np.array(FEATURES), uses=np.array(self.uses),
             history=-1 if self.history is None else self.history, loss=self.loss,
             **arrays)

  @classmethod
  def load(cls, path: str | pathlib.Path) -> "KeyModel":
    data = np.load(path)
    saved = tuple(str(name) for name in data["features"])
    if saved != FEATURES[:len(saved)]:  # (features are only ever appended)
      raise ValueError(f"{path} was trained on features {saved}, this code computes "
                       f"{FEATURES}")
    n = sum(name.startswith("w") for name in data.files)
    history = int(data["history"]) if "history" in data.files else -1
    return cls(data["mean"], data["std"],
               tuple((data[f"w{i}"], data[f"b{i}"]) for i in range(n)),
               int(data["horizon"]), tuple(str(u) for u in data["uses"]),
               None if history < 0 else history,
               str(data["loss"]) if "loss" in data.files else "binary")


class Samples(NamedTuple):
  """Eviction candidates seen in replays (``collect``)."""

  features: np.ndarray  # f32[N, F]
  reuse_in: np.ndarray  # i32[N] steps to the next request (== steps_left: never)
  steps_left: np.ndarray  # i32[N] steps left in the trace (T - t)
  group: np.ndarray  # i32[N] one stream's candidates at one step, numbered, contiguous

  @classmethod
  def concatenate(cls, parts: Sequence["Samples"]) -> "Samples":
    """One set of samples; each part's groups stay apart (renumbered)."""
    offsets = np.cumsum([0] + [int(p.group.max(initial=-1)) + 1 for p in parts[:-1]])
    return cls(np.concatenate([p.features for p in parts]),
               np.concatenate([p.reuse_in for p in parts]),
               np.concatenate([p.steps_left for p in parts]),
               np.concatenate([p.group + o for p, o in zip(parts, offsets)]))


def collect(selections, ranks, capacity: int, key_fn, *, per_step: int = 32,
            seed: int = 0, history: int | None = None, drafted=None):
  """Samples of eviction candidates while replaying ``selections`` [S, T, k] under
  ``key_fn``: (features f32[N, F], steps to the next request i32[N], steps left
  in the trace i32[N], group i32[N]), a group being one stream's candidates at one
  step (numbered from 0, contiguous).

  ``per_step`` candidates per stream and step, drawn uniformly. Steps whose
  horizon would run past the trace's end are kept: the distance is then censored
  at T - t (a never-reused candidate has ``reuse_in == steps_left``), which
  ``train`` masks per horizon. ``drafted``: the draft's next-step picks
  (``cache_sim.replay``'s), for keys that read them.
  """
  rng = np.random.default_rng(seed)
  feats, dist, left, group, groups = [], [], [], [], [0]
  num_steps = np.shape(selections)[-2]

  def record(t, features, candidates, reuse_in):
    draw = np.where(candidates, rng.random(candidates.shape), 2.0)
    take = np.argsort(draw, axis=1)[:, :per_step]
    rows = np.arange(candidates.shape[0])[:, None]
    keep = candidates[rows, take]
    feats.append(features[rows, take][keep].astype(np.float32))
    dist.append(reuse_in[rows, take][keep].astype(np.int32))
    left.append(np.full(int(keep.sum()), num_steps - t, np.int32))
    numbered = groups[0] + np.cumsum(keep.any(axis=1)) - 1  # i64[S]: each row's group
    groups[0] += int(keep.any(axis=1).sum())
    group.append(np.broadcast_to(numbered[:, None], keep.shape)[keep])

  cache_sim.replay(selections, capacity, cache_sim.LEARNED, ranks=ranks, key_fn=key_fn,
                   collect=record, history=history, drafted=drafted)
  return Samples(np.concatenate(feats), np.concatenate(dist), np.concatenate(left),
                 np.concatenate(group).astype(np.int32))


def _binary_labels(samples: Samples, horizon: int):
  """(known bool[N], reused within ``horizon`` f32[N]): samples whose remaining trace
  is shorter than the horizon and which are not reused in it are dropped (their
  label is unknown). A never-reused candidate has ``reuse_in == steps_left``:
  not a reuse, even when that is within the horizon."""
  soon = (samples.reuse_in < samples.steps_left) & (samples.reuse_in <= horizon)
  known = soon | (samples.steps_left > horizon)
  y = soon[known].astype(np.float32)
  if known.sum() < 256 or y.min() == y.max():
    raise ValueError(f"{known.sum()} labelled samples, labels {sorted(set(y.tolist()))}: "
                     "too few (< 256) or one class only")
  return known, y


def padded_groups(group: np.ndarray) -> np.ndarray:
  """i32[G, P] the sample indices of each group (``group`` i32[N], contiguous),
  -1 past a group's end; P the largest group."""
  starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
  sizes = np.diff(np.r_[starts, group.shape[0]])
  offsets = np.arange(sizes.max(initial=0))
  return np.where(offsets < sizes[:, None], starts[:, None] + offsets, -1).astype(np.int32)


def pair_weights(reuse_in, valid, horizon: int):
  """f32[..., P, P] how much keeping candidate i over j is worth where i is reused
  sooner (``reuse_in`` [..., P] steps, ``valid`` bool[..., P]): the difference of
  their reuses discounted by exp(-d / horizon); 0 elsewhere. A never-reused
  candidate's distance is the trace's end, a lower bound: its weight against a
  later reuse is too small, never of the wrong sign."""
  d = reuse_in.astype(jnp.float32)
  sooner = (d[..., :, None] < d[..., None, :]) & valid[..., :, None] & valid[..., None, :]
  value = jnp.exp(-d / horizon)
  return jnp.where(sooner, value[..., :, None] - value[..., None, :], 0.0)


def train(samples: Samples, horizon: int, *, loss: str = "pairwise", uses=BASE_FEATURES,
          hidden: int = 64, steps: int = 1500, batch: int = 4096,
          learning_rate: float = 3e-3, seed: int = 0) -> KeyModel:
  """Fits a key from the ``uses`` columns of ``samples.features`` (optax AdamW):

  * ``"pairwise"``: within each group, the candidate reused sooner keeps the higher
    key, pairs weighted by ``pair_weights`` (RankNet's logistic loss);
  * ``"binary"``: P(reuse within ``horizon`` steps), by logistic loss.

  ``batch`` samples per step (whole groups for the pairwise loss).
  """
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r}; expected one of {LOSSES}")
  unknown = set(uses) - set(FEATURES)
  if unknown:
    raise ValueError(f"unknown features {sorted(unknown)}; expected from {FEATURES}")
  uses = tuple(name for name in FEATURES if name in uses)
  x = np.asarray(samples.features[:, [FEATURES.index(n) for n in uses]], np.float32)
  if loss == "binary":
    known, y = _binary_labels(samples, horizon)
    x = x[known]
  else:
    rows = padded_groups(samples.group)  # i32[G, P]
    reuse = np.where(rows >= 0, samples.reuse_in[rows], 0)
    value = np.exp(-reuse.astype(np.float32) / np.float32(horizon))  # as pair_weights
    ordered = (np.where(rows >= 0, value, -np.inf).max(1)
               > np.where(rows >= 0, value, np.inf).min(1))  # some pair weighs > 0
    if ordered.sum() < 8:
      raise ValueError(f"{ordered.sum()} groups with candidates reused at different "
                       "times: too few (< 8) to rank")
    rows, reuse = rows[ordered], reuse[ordered]
  mean, std = x.mean(0), x.std(0) + 1e-6
  x = (x - mean) / std
  sizes = (x.shape[1], hidden, hidden, 1)
  key = jax.random.key(seed)
  params = []
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
    key, sub = jax.random.split(key)
    params.append((jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in),
                   jnp.zeros(fan_out)))

  def logits(params, xb):
    h = xb
    for i, (w, b) in enumerate(params):
      h = h @ w + b
      if i + 1 < len(params):
        h = jax.nn.relu(h)
    return h[..., 0]

  def binary_loss(params, xb, yb):  # xb f32[batch, F], yb f32[batch]
    return optax.sigmoid_binary_cross_entropy(logits(params, xb), yb).mean()

  def pairwise_loss(params, xb, reuse_b, valid_b):  # f32[g, P, F], i32[g, P], bool[g, P]
    keys = logits(params, xb)  # f32[g, P]
    weight = pair_weights(reuse_b, valid_b, horizon)  # f32[g, P, P]
    margin = keys[:, :, None] - keys[:, None, :]  # the sooner one's key minus the other's
    return ((weight * jax.nn.softplus(-margin)).sum()
            / jnp.maximum(weight.sum(), jnp.finfo(jnp.float32).tiny))

  opt = optax.adamw(optax.cosine_decay_schedule(learning_rate, steps), weight_decay=1e-4)
  state = opt.init(params)

  @functools.partial(jax.jit, static_argnums=0)
  def update(loss_fn, params, state, *batch_arrays):
    grads = jax.grad(loss_fn)(params, *batch_arrays)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  rng = np.random.default_rng(seed)
  for _ in range(steps):
    if loss == "binary":
      idx = rng.integers(0, x.shape[0], min(batch, x.shape[0]))
      params, state = update(binary_loss, params, state, x[idx], y[idx])
    else:
      idx = rng.integers(0, rows.shape[0], max(1, batch // rows.shape[1]))
      params, state = update(pairwise_loss, params, state, x[rows[idx]],
                             reuse[idx], rows[idx] >= 0)
  layers = tuple((np.asarray(w, np.float32), np.asarray(b, np.float32))
                 for w, b in params)
  return KeyModel(mean.astype(np.float32), std.astype(np.float32), layers, horizon,
                  uses, loss=loss)


def fit(selections, ranks, capacity: int, horizon: int, *, rounds: int = 2,
        seed: int = 0, history: int | None = None, drafted=None,
        **train_kw) -> KeyModel:
  """Trains on ``selections`` [S, T, k] only: round 0 collects under
  ``baseline_key``, each later round adds samples under the previous model.
  ``history``: the replay's bound on the per-position history (None: none);
  ``drafted``: the draft's next-step picks (with ``uses`` naming "drafted")."""
  data, key_fn, model = [], baseline_key, None
  for r in range(rounds):
    data.append(collect(selections, ranks, capacity, key_fn, seed=seed + r,
                        history=history, drafted=drafted))
    model = train(Samples.concatenate(data), horizon, seed=seed, **train_kw)
    key_fn = model
  return dataclasses.replace(model, history=history)
