"""A learned eviction key: a small MLP over causal per-slot features, trained on the
replay of one trace and evaluated on another (text it never saw).

The label is Belady's: will the slot's position be requested again within
``horizon`` steps? The key is the model's logit (higher keeps longer), so the
``"learned"`` replay evicts the slots least likely to be reused soon. Training
data comes from replays (``cache_sim.replay(..., collect=...)``): first under a
rank-like hand-made key, then, DAgger-style, under the learned key itself, so the
model also sees the residency its own evictions produce.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.analysis import cache_sim

FEATURES = cache_sim.LEARNED_FEATURES
# The features a slot's own metadata gives (no per-position history kept past an
# eviction): what a jitted RESOLVE could compute from its per-slot arrays and the
# layer's miss counter.
SLOT_FEATURES = ("rank_now", "since_request", "since_fetch", "hits", "rel_pos", "churn")


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
  horizon: int
  uses: tuple[str, ...] = FEATURES  # the input columns, in FEATURES order
  history: int | None = None  # replay's ``history`` it was trained (and runs) with

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
             history=-1 if self.history is None else self.history, **arrays)

  @classmethod
  def load(cls, path: str | pathlib.Path) -> "KeyModel":
    data = np.load(path)
    if tuple(data["features"]) != FEATURES:
      raise ValueError(f"{path} was trained on features {tuple(data['features'])}, "
                       f"this code computes {FEATURES}")
    n = sum(name.startswith("w") for name in data.files)
    history = int(data["history"]) if "history" in data.files else -1
    return cls(data["mean"], data["std"],
               tuple((data[f"w{i}"], data[f"b{i}"]) for i in range(n)),
               int(data["horizon"]), tuple(str(u) for u in data["uses"]),
               None if history < 0 else history)


def collect(selections, ranks, capacity: int, key_fn, *, per_step: int = 32,
            seed: int = 0, history: int | None = None):
  """Samples (features f32[N, F], steps to the next request i32[N]) of eviction
  candidates while replaying ``selections`` [S, T, k] under ``key_fn``.

  ``per_step`` candidates per stream and step, drawn uniformly. Steps whose
  horizon would run past the trace's end are kept: the distance is then censored
  at T - t, which ``train`` masks per horizon.
  """
  rng = np.random.default_rng(seed)
  feats, dist, left = [], [], []
  num_steps = np.shape(selections)[-2]

  def record(t, features, candidates, reuse_in):
    draw = np.where(candidates, rng.random(candidates.shape), 2.0)
    take = np.argsort(draw, axis=1)[:, :per_step]
    rows = np.arange(candidates.shape[0])[:, None]
    keep = candidates[rows, take]
    feats.append(features[rows, take][keep].astype(np.float32))
    dist.append(reuse_in[rows, take][keep].astype(np.int32))
    left.append(np.full(int(keep.sum()), num_steps - t, np.int32))

  cache_sim.replay(selections, capacity, cache_sim.LEARNED, ranks=ranks, key_fn=key_fn,
                   collect=record, history=history)
  return np.concatenate(feats), np.concatenate(dist), np.concatenate(left)


def train(features, reuse_in, steps_left, horizon: int, *, uses=FEATURES,
          hidden: int = 64, steps: int = 1500, batch: int = 4096,
          learning_rate: float = 3e-3, seed: int = 0) -> KeyModel:
  """Fits P(reuse within ``horizon`` steps) from the ``uses`` columns of
  ``features`` by logistic loss (optax AdamW).

  Samples whose remaining trace is shorter than the horizon and which are not
  reused in it are dropped (their label is unknown). A never-reused candidate has
  ``reuse_in == steps_left`` (T - t, ``collect``): not a reuse, even when that is
  within the horizon.
  """
  unknown = set(uses) - set(FEATURES)
  if unknown:
    raise ValueError(f"unknown features {sorted(unknown)}; expected from {FEATURES}")
  uses = tuple(name for name in FEATURES if name in uses)
  soon = (reuse_in < steps_left) & (reuse_in <= horizon)
  known = soon | (steps_left > horizon)
  x = np.asarray(features[known][:, [FEATURES.index(n) for n in uses]], np.float32)
  y = soon[known].astype(np.float32)
  if x.shape[0] < 256 or y.min() == y.max():
    raise ValueError(f"{x.shape[0]} labelled samples, labels {sorted(set(y.tolist()))}: "
                     "too few (< 256) or one class only")
  batch = min(batch, x.shape[0])
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
    return h[:, 0]

  def loss(params, xb, yb):
    return optax.sigmoid_binary_cross_entropy(logits(params, xb), yb).mean()

  opt = optax.adamw(optax.cosine_decay_schedule(learning_rate, steps), weight_decay=1e-4)
  state = opt.init(params)

  @jax.jit
  def update(params, state, xb, yb):
    grads = jax.grad(loss)(params, xb, yb)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  rng = np.random.default_rng(seed)
  for _ in range(steps):
    idx = rng.integers(0, x.shape[0], batch)
    params, state = update(params, state, x[idx], y[idx])
  layers = tuple((np.asarray(w, np.float32), np.asarray(b, np.float32))
                 for w, b in params)
  return KeyModel(mean.astype(np.float32), std.astype(np.float32), layers, horizon,
                  uses)


def fit(selections, ranks, capacity: int, horizon: int, *, rounds: int = 2,
        seed: int = 0, history: int | None = None, **train_kw) -> KeyModel:
  """Trains on ``selections`` [S, T, k] only: round 0 collects under
  ``baseline_key``, each later round adds samples under the previous model.
  ``history``: the replay's bound on the per-position history (None: none)."""
  data, key_fn, model = [], baseline_key, None
  for r in range(rounds):
    data.append(collect(selections, ranks, capacity, key_fn, seed=seed + r,
                        history=history))
    model = train(*(np.concatenate(parts) for parts in zip(*data)), horizon,
                  seed=seed, **train_kw)
    key_fn = model
  return dataclasses.replace(model, history=history)
