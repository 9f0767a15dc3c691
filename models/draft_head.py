"""An EAGLE-style draft head: next step's token from the model's own features.

The lookahead prefetch (docs/DESIGN.md, "Hiding host IO") fetches the rows the next
step will select while the current step runs, so it needs the next step's token
before the current step has produced it. At the start of the step that decodes
position p the model knows the input token ``x_p`` and the previous step's feature
``f_{p-1}`` (the last layer's hidden state, before the final norm). The head, one
layer on those features as in EAGLE (Li et al. 2024), predicts ``f_p``; the model's
own final norm and LM head turn the prediction into a draft of ``x_{p+1}``.

Trained by cross-entropy against a next token (the runner uses the model's own
greedy token, EAGLE's distillation) plus a smooth-L1 pull of the predicted feature
(normalised) towards the true one, with optax; saved with orbax.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import transformer as tfm
from models.config import ModelConfig

_FORMAT = "kvtier-draft-head-v2"  # v2: the fingerprint covers every weight


class DraftHead(nnx.Module):
  """The change ``f_p - f_{p-1}`` from ``[norm(f_{p-1}); embed(x_p)]``: a fusing
  projection and a gated MLP. The output projection starts at zero, so an untrained
  head predicts ``f_p = f_{p-1}`` (logits on the model's own scale, not noise)."""

  def __init__(self, embed_dim: int, hidden_dim: int, *, rngs: nnx.Rngs):
    self.embed_dim, self.hidden_dim = embed_dim, hidden_dim
    linear = lambda i, o, **kw: nnx.Linear(i, o, use_bias=False, rngs=rngs, **kw)
    self.fuse = linear(2 * embed_dim, embed_dim)
    self.norm = nnx.RMSNorm(embed_dim, rngs=rngs)
    self.gate, self.up = linear(embed_dim, hidden_dim), linear(embed_dim, hidden_dim)
    self.down = linear(hidden_dim, embed_dim, kernel_init=nnx.initializers.zeros)

  def __call__(self, feat_prev, token_embed):
    """feat_prev: [..., E] normalised previous features; token_embed: [..., E]."""
    h = self.norm(self.fuse(jnp.concatenate([feat_prev, token_embed], axis=-1)))
    return self.down(jax.nn.silu(self.gate(h)) * self.up(h))


def _normed(cfg: ModelConfig, weights, feat):
  return tfm.rms_norm(feat, weights["final_norm"], cfg.rms_eps)


def predict(cfg: ModelConfig, weights, head: DraftHead, feat_prev, token):
  """(predicted f_p [..., E], logits of x_{p+1} [..., V]) from f_{p-1} and x_p."""
  feat = feat_prev + head(_normed(cfg, weights, feat_prev), weights["embed"][token])
  return feat, tfm.lm_head(cfg, weights, feat)


@nnx.jit(static_argnames=("cfg",))
def draft_tokens(cfg: ModelConfig, weights, head: DraftHead, feat_prev, token):
  """i32[...]: the draft of x_{p+1} (greedy)."""
  return jnp.argmax(predict(cfg, weights, head, feat_prev, token)[1], axis=-1)


def examples(features, tokens):
  """Training pairs of a window: features [W, E] and tokens [W] (teacher-forced)
  give, for p = 1 .. W-2, inputs (f_{p-1}, x_p) and targets (f_p, x_{p+1})."""
  return features[:-2], tokens[1:-1], features[1:-1], tokens[2:]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300
  batch: int = 256
  lr: float = 2e-3
  feature_weight: float = 1.0
  weight_decay: float = 1e-4
  hidden_dim: int = 1536
  seed: int = 0


def decayed(params):
  """AdamW's weight-decay mask: the projections' kernels, not the RMSNorm's scale
  (decay would pull the scale towards 0, not towards an unscaled norm)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(getattr(key, "key", None) == "norm" for key in path),
      params)


def optimizer(head: DraftHead, tc: TrainConfig) -> nnx.Optimizer:
  """AdamW with a warm-up and cosine decay to lr / 10, decay masked (``decayed``)."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(1, tc.steps // 10),
                                                tc.steps, tc.lr / 10)
  return nnx.Optimizer(head, optax.adamw(schedule, weight_decay=tc.weight_decay,
                                         mask=decayed), wrt=nnx.Param)


def train(cfg: ModelConfig, weights, feat_prev, token, feat_next, label,
          tc: TrainConfig = TrainConfig()):
  """Trains a head on examples (N rows each); returns (head, per-step losses
  [steps, 3]: total, cross-entropy, feature term)."""
  head = DraftHead(cfg.embed_dim, tc.hidden_dim, rngs=nnx.Rngs(tc.seed))
  opt = optimizer(head, tc)

  def loss_fn(head, weights, fp, tok, fn, lab):
    feat, logits = predict(cfg, weights, head, fp, tok)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, lab).mean()
    pull = optax.huber_loss(_normed(cfg, weights, feat), _normed(cfg, weights, fn)).mean()
    return ce + tc.feature_weight * pull, (ce, pull)

  # The model's weights are an argument, not a closure: closed over, they would be
  # embedded in the executable as constants (a 76 MB compile-cache entry for
  # SmolLM2's embedding, and 16 s to compress it).
  @nnx.jit
  def step(head, opt, weights, fp, tok, fn, lab):
    (loss, (ce, pull)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
        head, weights, fp, tok, fn, lab)
    opt.update(head, grads)
    return jnp.stack([loss, ce, pull])

  rng = np.random.default_rng(tc.seed)
  history = []
  for _ in range(tc.steps):
    rows = rng.integers(0, label.shape[0], tc.batch)
    history.append(np.asarray(step(head, opt, weights, feat_prev[rows],
                                   token[rows], feat_next[rows], label[rows])))
  return head, np.stack(history)


def save(path, head: DraftHead, metadata: dict | None = None,
         weights=None) -> pathlib.Path:
  """Saves the head's parameters (orbax) beside ``draft_head.json`` (its sizes and,
  given the model's ``weights``, their fingerprint)."""
  import orbax.checkpoint as ocp
  path = pathlib.Path(path).absolute()  # orbax requires absolute paths
  path.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path / "params", nnx.state(head, nnx.Param), force=True)
  (path / "draft_head.json").write_text(json.dumps(dict(
      format=_FORMAT, embed_dim=head.embed_dim, hidden_dim=head.hidden_dim,
      model_fingerprint=None if weights is None else tfm.model_fingerprint(weights),
      metadata=metadata or {}), indent=2, default=str) + "\n")
  return path


def metadata(path) -> dict:
  """What ``save`` was given as ``metadata`` (e.g. the text and span it trained on)."""
  return json.loads((pathlib.Path(path) / "draft_head.json").read_text())["metadata"]


def load(path, num_layers: int | None = None, embed_dim: int | None = None,
         weights=None) -> DraftHead:
  """The head ``save`` wrote, exactly. ``num_layers`` / ``embed_dim`` / ``weights``:
  the layers, width and weights of the model it will read; a head whose metadata
  says it was trained on another cut of the model (``model_layers``), whose width
  differs, or that was saved with another model's fingerprint, is refused, as it
  reads other features."""
  import orbax.checkpoint as ocp
  path = pathlib.Path(path).absolute()
  meta = json.loads((path / "draft_head.json").read_text())
  if meta.get("format") != _FORMAT:
    raise ValueError(f"{path}: format {meta.get('format')!r}, expected {_FORMAT!r}")
  saved_with = meta.get("model_fingerprint")
  if weights is not None and saved_with is None:
    warnings.warn(f"{path}: saved without its model's fingerprint (save(weights=...)): "
                  "whether it was trained on this model is not checked", stacklevel=2)
  elif weights is not None and saved_with != (here := tfm.model_fingerprint(weights)):
    raise ValueError(f"{path}: trained on another model (fingerprint {saved_with}, "
                     f"the model here: {here})")
  if embed_dim is not None and meta["embed_dim"] != embed_dim:
    raise ValueError(f"{path}: a head for features of width {meta['embed_dim']}, the "
                     f"model here has {embed_dim}")
  trained_on = meta["metadata"].get("model_layers")
  if num_layers is not None and trained_on is not None and trained_on != num_layers:
    raise ValueError(f"{path}: trained on the model's first {trained_on} layers, "
                     f"the model here has {num_layers}")
  abstract = nnx.eval_shape(lambda: DraftHead(meta["embed_dim"], meta["hidden_dim"],
                                              rngs=nnx.Rngs(0)))
  graph, state = nnx.split(abstract, nnx.Param)
  with ocp.StandardCheckpointer() as checkpointer:
    state = checkpointer.restore(path / "params", state)
  return nnx.merge(graph, state)
