r"""Distil a DSA lightning indexer for frozen SmolLM2-135M (DeepSeek's dense warm-up).

What it reproduces: DeepSeek-V3.2's dense warm-up stage, which
trains only the lightning indexer, by KL to the frozen model's own attention
distribution (summed over heads, L1-normalised), so that a dense model can run
``DSASelector``. Here on a few thousand tokens of the stdlib pydoc text, every
layer at once, on CPU (kvtier_jax/selectors/distill.py explains the choices).

Reported, on a disjoint later span of the text (``--eval_offset``): per layer and
on average, the top-k recall of true attention mass (share of the head-averaged
attention probability that lands on the k selected positions) of the distilled
indexer, of the oracle top-k (the best any shared k-set can do), of the untrained
indexer the training started from, and of StreamingLLM's static sink + recent
window (how much a rule with no scoring at all already gets). Only query
positions with more than ``max(top_k)`` visible keys are scored, so no recall is
trivially 1. Before anything else the layer replay is checked against the
model's own prefill keys.

Command (defaults: 2048 training tokens, 2048 eval tokens, 150 AdamW steps of 64
query rows out of 512; on a 2-core CPU about 3.3 min wall, ~130 s of it
training, 2.4 GB peak RSS):
  python -m experiments.distill_indexer
``--smoke`` runs tiny spans in under a minute (it still loads the real model).
Results: results/distill_indexer/<time>/ (config.json, rows.jsonl, table.md,
plot.png); the indexer checkpoint: ``--out`` (orbax arrays + indexer.json),
readable with ``kvtier_jax.selectors.distill.load_indexer``.
"""

from __future__ import annotations

import functools
import pathlib
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from kvtier_jax.selectors import distill
from kvtier_jax.selectors.dsa import init_indexer_params
from models import text
from models import transformer as tfm

FLAGS = flags.FLAGS
flags.DEFINE_integer("train_tokens", 2048, "Training span length (one sequence).")
flags.DEFINE_integer("train_offset", 0, "Token offset of the training span.")
flags.DEFINE_integer("eval_tokens", 2048, "Evaluation span length (one sequence).")
flags.DEFINE_integer("eval_offset", 65536,
                     "Token offset of the evaluation span (after the training span).")
flags.DEFINE_integer("train_queries", 512,
                     "Query rows of the training span with attention targets.")
flags.DEFINE_integer("query_batch", 64, "Query rows per training step.")
flags.DEFINE_integer("eval_queries", 256, "Query rows scored on the evaluation span.")
flags.DEFINE_integer("steps", 150, "AdamW steps.")
flags.DEFINE_float("lr", 3e-3, "Peak learning rate (warm-up, cosine decay to lr/10).")
flags.DEFINE_float("weight_decay", 1e-4, "AdamW decay of the projections.")
flags.DEFINE_integer("num_index_heads", 4, "H_I.")
flags.DEFINE_integer("index_dim", 64, "d_I.")
flags.DEFINE_integer("rope_dim", 32, "Rotated leading features of index q/k.")
flags.DEFINE_list("top_k", ["64", "128", "256"], "k values to report recall at.")
flags.DEFINE_integer("seed", 0, "Initialisation, query rows and minibatches.")
flags.DEFINE_string("out", "results/indexer/smollm2",
                    "Checkpoint directory (--smoke: the run folder's indexer/; with "
                    "--out_root and no --out: <out_root>/indexer/smollm2).")
flags.DEFINE_string("prompt_file", None, "Text instead of the pydoc topics.")
flags.DEFINE_bool("smoke", False, "Tiny spans and few steps (under a minute).")
flags.DEFINE_string("out_root", None, "Results root (default ./results).")

_SMOKE = dict(train_tokens=256, eval_tokens=256, train_queries=64, query_batch=32,
              eval_queries=32, steps=3, top_k=["16", "32"])
_METHODS = ("distilled", "oracle", "random", "sink_recent")
_REPLAY_CHECK_TOKENS = 32
_REPLAY_ATOL = 1e-4


@functools.partial(jax.jit, static_argnames=("cfg",))
def layer_activations(cfg, weights, tokens):
  """Replays the frozen model's prompt pass, keeping each layer's attention inputs.

  The same computation as ``transformer._prompt_layers`` (built from its public
  blocks, models/ unchanged), with the per-layer tensors the distillation needs
  as scan outputs.

  Args:
    cfg: the model's ``ModelConfig``.
    weights: ``Transformer.weights()``.
    tokens: i32[R, P].

  Returns:
    h [L, R, P, E] normalised attention inputs, q [L, R, P, Hq, D] and
    k [L, R, P, Hkv, D] post-RoPE queries and keys.
  """
  length = tokens.shape[1]
  x = weights["embed"][tokens]  # [R, P, E]
  cos, sin = tfm.rope_angles(jnp.arange(length), cfg.head_dim, cfg.rope_theta)
  names = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
  einsum = functools.partial(jnp.einsum, precision=tfm.PRECISION)

  def layer(x, w):
    h = tfm.rms_norm(x, w["attn_norm"], cfg.rms_eps)
    q = tfm.apply_rope(einsum("rpe,ehd->rphd", h, w["wq"]), cos, sin)
    k = tfm.apply_rope(einsum("rpe,ehd->rphd", h, w["wk"]), cos, sin)
    v = einsum("rpe,ehd->rphd", h, w["wv"])
    x = x + einsum("rphd,hde->rpe", tfm.causal_attention(q, k, v), w["wo"])
    mlp_in = tfm.rms_norm(x, w["mlp_norm"], cfg.rms_eps)
    x = x + tfm.gated_mlp(mlp_in, w["w_gate"], w["w_up"], w["w_down"])
    return x, (h, q, k)

  _, (h, q, k) = jax.lax.scan(layer, x, {n: weights[n] for n in names})
  return h, q, k


def check_replay(cfg, weights, tokens) -> float:
  """Max |k_replay - k_model| over every layer on a short prefix; raises past
  ``_REPLAY_ATOL`` (the replay must be the model, or the targets are not its
  attention)."""
  tokens = jnp.asarray(tokens[None, :_REPLAY_CHECK_TOKENS], jnp.int32)
  _, _, k_replay = layer_activations(cfg, weights, tokens)
  _, k_model, _ = tfm.apply_prefill(cfg, weights, tokens,
                                    jnp.array([tokens.shape[1]], jnp.int32))
  err = float(jnp.abs(k_replay - k_model).max())
  if err > _REPLAY_ATOL:
    raise RuntimeError(f"layer replay drifts from the model: max |dk| = {err}")
  return err


@jax.jit
def _layer_targets(q, k, query_positions):
  """attention_targets of every layer, one at a time (a vmap would hold all 30
  layers' [Hq, Q, T] probabilities at once): q [L, R, P, Hq, D] -> [L, R, Q, T]."""
  rows = query_positions[0]  # same rows for every request

  def one(qk):
    q_l, k_l = qk
    return distill.attention_targets(q_l[:, rows], k_l, query_positions)
  return jax.lax.map(one, (q, k))


@jax.jit
def _evaluate(params, h, targets, query_positions):
  """Per-layer indexer scores and eval KL: ([L, R, Q, T], f32[L])."""
  mask = distill.causal_mask(query_positions, h.shape[2])

  def one(args):
    p_l, h_l, t_l = args
    scores = distill.prompt_index_scores(p_l, h_l, query_positions, mask)
    return scores, distill.distill_loss(p_l, h_l, query_positions, t_l, mask)
  return jax.lax.map(one, (params, h, targets))


def _sink_recent_scores(query_positions, num_keys: int):
  """StreamingLLM's static rule as scores: position 0 (the attention sink) first,
  then the most recent positions. f32[1, 1, Q, T], -inf past each query (a
  reference for how much of the recall a fixed window already gets)."""
  pos = jnp.arange(num_keys, dtype=jnp.float32)
  scores = jnp.where(pos == 0, num_keys, pos)
  visible = distill.causal_mask(query_positions, num_keys)  # [R, Q, T]
  return jnp.where(visible, scores, -jnp.inf)[None]


def _rows(rng, low: int, high: int, count: int, random: bool):
  """Sorted distinct query positions in [low, high) as i32[1, n]."""
  count = min(count, high - low)
  if count < 1:
    raise ValueError(f"no query positions in [{low}, {high})")
  if random:
    pos = np.sort(rng.choice(np.arange(low, high), count, replace=False))
  else:
    pos = np.unique(np.linspace(low, high - 1, count).round().astype(np.int64))
  return jnp.asarray(pos[None], jnp.int32)


def _activations(cfg, weights, tokens, what: str):
  start = time.perf_counter()
  acts = jax.block_until_ready(layer_activations(cfg, weights,
                                                 jnp.asarray(tokens[None], jnp.int32)))
  print(f"{what}: {tokens.size} tokens replayed in {time.perf_counter() - start:.1f} s")
  return acts


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
  if FLAGS.smoke:
    for name, value in _SMOKE.items():
      setattr(FLAGS, name, value)
  top_ks = sorted(int(k) for k in FLAGS.top_k)
  if FLAGS.eval_offset < FLAGS.train_offset + FLAGS.train_tokens:
    raise app.UsageError("--eval_offset must start after the training span")
  if FLAGS.eval_tokens <= top_ks[-1]:
    raise app.UsageError("--eval_tokens must exceed max(--top_k)")
  out = common.start_run("distill_indexer", FLAGS.flag_values_dict(), FLAGS.out_root)
  ckpt_dir = (out / "indexer" if FLAGS.smoke else pathlib.Path(FLAGS.out)
              if FLAGS["out"].present or FLAGS.out_root is None
              # Another results root keeps its indexer: the default one is what
              # --selector=dsa loads.
              else pathlib.Path(FLAGS.out_root, "indexer", "smollm2"))
  wall = time.perf_counter()

  model, tokenizer, info = tfm.load_smollm2()
  cfg, weights = model.cfg, model.weights()
  print(f"loaded {cfg.name} in {info['load_seconds']:.1f} s")
  corpus = text.load_text(FLAGS.prompt_file)
  train_tok = text.tokenize_prompt(tokenizer, corpus, FLAGS.train_tokens,
                                   FLAGS.train_offset)
  eval_tok = text.tokenize_prompt(tokenizer, corpus, FLAGS.eval_tokens,
                                  FLAGS.eval_offset)
  print(f"replay check (k, {_REPLAY_CHECK_TOKENS} tokens, all layers): max |diff| "
        f"{check_replay(cfg, weights, train_tok):.2e}")

  rng = np.random.default_rng(FLAGS.seed)
  # Training rows: random positions past the first few (whose targets are
  # near-trivial); eval rows: evenly spaced, each seeing > max(top_k) keys.
  train_rows = _rows(rng, min(16, FLAGS.train_tokens - 1), FLAGS.train_tokens,
                     FLAGS.train_queries, random=True)
  eval_rows = _rows(rng, top_ks[-1], FLAGS.eval_tokens, FLAGS.eval_queries,
                    random=False)

  h, q, k = _activations(cfg, weights, train_tok, "train span")
  start = time.perf_counter()
  targets = jax.block_until_ready(_layer_targets(q, k, train_rows))
  del q, k
  print(f"targets [L, R, Q, T] = {targets.shape} in {time.perf_counter() - start:.1f} s")

  key_init, key_train = jax.random.split(jax.random.PRNGKey(FLAGS.seed))
  init = init_indexer_params(key_init, cfg.num_layers, cfg.embed_dim,
                             FLAGS.num_index_heads, FLAGS.index_dim, FLAGS.rope_dim,
                             rope_theta=cfg.rope_theta)
  start = time.perf_counter()
  log = lambda step, loss: print(f"  step {step:4d}  mean KL {loss:.4f}  "
                                 f"({time.perf_counter() - start:.0f} s)")
  result = distill.train_indexer(
      key_train, h, targets, FLAGS.steps, FLAGS.lr, query_positions=train_rows,
      weight_decay=FLAGS.weight_decay, query_batch=FLAGS.query_batch,
      init_params=init, log_every=max(1, FLAGS.steps // 10), log_fn=log)
  params = jax.block_until_ready(result.params)
  train_seconds = time.perf_counter() - start
  _, train_kl = _evaluate(params, h, targets, train_rows)  # all rows, no dropout
  _, init_train_kl = _evaluate(init, h, targets, train_rows)
  print(f"trained {FLAGS.steps} steps in {train_seconds:.1f} s; train-span KL "
        f"(all {train_rows.shape[1]} rows) {float(init_train_kl.mean()):.4f} -> "
        f"{float(train_kl.mean()):.4f}")
  del h, targets

  ckpt = distill.save_indexer(ckpt_dir, params, metadata={
      "model": cfg.name, "train_tokens": FLAGS.train_tokens,
      "train_offset": FLAGS.train_offset, "steps": FLAGS.steps, "lr": FLAGS.lr,
      "final_train_kl": float(train_kl.mean()), "results": str(out)})
  restored = distill.load_indexer(ckpt)
  same = jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                   params, restored))
  if not same or jax.tree.structure(params) != jax.tree.structure(restored):
    raise RuntimeError(f"{ckpt}: reloaded indexer differs from the trained one")
  ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())

  h, q, k = _activations(cfg, weights, eval_tok, "eval span")
  targets = _layer_targets(q, k, eval_rows)  # [L, R, Q, T]
  del q, k
  scores, kls = {}, {}
  for name, p in (("distilled", params), ("random", init)):
    scores[name], kls[name] = _evaluate(p, h, targets, eval_rows)
  scores["oracle"] = targets
  scores["sink_recent"] = jnp.broadcast_to(_sink_recent_scores(eval_rows, h.shape[2]),
                                          targets.shape)
  recall = {(m, kk): np.asarray(jnp.mean(distill.topk_recall(scores[m], targets, kk),
                                         axis=(1, 2)))  # [L]
            for m in _METHODS for kk in top_ks}

  rows = []
  for layer in [*range(cfg.num_layers), "mean"]:
    pick = (lambda a: float(np.mean(a))) if layer == "mean" else (
        lambda a, i=layer: float(a[i]))
    for kk in top_ks:
      row = {"layer": layer, "k": kk, **{m: pick(recall[m, kk]) for m in _METHODS},
             "kl_distilled": pick(np.asarray(kls["distilled"])),
             "kl_random": pick(np.asarray(kls["random"])),
             "train_kl": pick(np.asarray(train_kl))}
      row["distilled_over_oracle"] = row["distilled"] / row["oracle"]
      rows.append(row)
      common.append_row(out, row)

  summary = {"wall_s": time.perf_counter() - wall, "train_s": train_seconds,
             "checkpoint": str(ckpt), "checkpoint_bytes": ckpt_bytes,
             "eval_rows": int(eval_rows.shape[1]), "eval_offset": FLAGS.eval_offset}
  render(out, rows, top_ks, summary)
  print((out / "table.md").read_text())
  print(f"results: {out}\ncheckpoint: {ckpt} ({ckpt_bytes / 2**20:.2f} MiB)\n"
        f"wall time {summary['wall_s']:.0f} s")


def render(out: pathlib.Path, rows, top_ks, summary: dict) -> None:
  """table.md (one line per layer, recall of each method at each k) and plot.png
  (mean recall)."""
  by_layer = {}
  for row in rows:
    line = by_layer.setdefault(row["layer"], {
        "layer": row["layer"], "KL distilled": row["kl_distilled"],
        "KL random": row["kl_random"]})
    for m in _METHODS:
      line[f"{m}@{row['k']}"] = row[m]
  columns = ["layer"] + [f"{m}@{kk}" for kk in top_ks for m in _METHODS] + [
      "KL distilled", "KL random"]
  header = (f"Top-k recall of true attention mass (head-averaged), eval span of "
            f"{FLAGS.eval_tokens} tokens at offset {summary['eval_offset']}, "
            f"{summary['eval_rows']} query rows each seeing > {top_ks[-1]} keys. "
            f"distilled: the trained indexer; oracle: top-k of the attention itself; "
            f"random: the untrained indexer training started from; sink_recent: "
            f"position 0 + the k-1 most recent positions. "
            f"KL = eval KL(attention || indexer) in nats. Wall {summary['wall_s']:.0f} "
            f"s (training {summary['train_s']:.0f} s); checkpoint "
            f"{summary['checkpoint']} ({summary['checkpoint_bytes']} bytes).\n\n")
  (out / "table.md").write_text(
      header + common.markdown_table(list(by_layer.values()), columns) + "\n")
  means = [r for r in rows if r["layer"] == "mean"]
  common.bar_plot(out / "plot.png", [f"{m}@{r['k']}" for r in means for m in _METHODS],
                  [r[m] for r in means for m in _METHODS], "mean top-k recall",
                  "Distilled DSA indexer on SmolLM2-135M (eval span)")


if __name__ == "__main__":
  app.run(main)
