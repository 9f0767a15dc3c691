r"""Hiding host IO: predictor agreement, critical-path misses, exposed IO per token.

Paper figures: HiSparse (docs/DESIGN.md, "Hiding host IO"): exposed IO per token 7.7 ms with
synchronous RESOLVE vs 3.0 ms with exact (index-shared) prefetch; prefetch reaches
85% of the no-IO ceiling; layer-ahead speculation gave no end-to-end gain. OasisKV
(arXiv 2608.08097): next-step top-K agreement 98.74% with an EAGLE-3 draft vs 83.9%
with the current query.

On SmolLM2-135M over pydoc text (dense attention, teacher-forced), per step:
* predictors of the next step's selection: (a) the current step's selection (the
  current query), (b) the selection of a prompt-lookup draft token run one
  position ahead without committing (no draft model); with ``--draft_ckpt``
  also (c) a trained draft head's token (``experiments.draft_head``: from the
  previous step's features and the current token, known when the step starts),
  (c') the prompt lookup where a bigram or longer matched, else the head's token
  (``backends.lookup_or_head``), and (d) the model's own next token (known only after the step: the ceiling of a
  draft); the offline ceiling of prefetch itself, (e) the next step's selection;
* critical-path misses of an LRU hot cache (B = 2k) without prefetch and with
  each predictor's positions prefetched after the step (at most ``--cap`` rows per
  layer), replayed with the library's own jitted RESOLVE; prefetched rows split
  into useful (selected next step) and wasted;
* index sharing (every ``--share`` layers): the shared layers' misses are fetched
  at the anchor, off their critical path;
* exposed IO per token for GLM-5.1 (k=2048, 78 layers, 1152-byte rows) at batch 8
  from each variant's critical miss rate, for H200 PCIe (54 GB/s, as measured by
  experiments/gpu_check.py) and GH200 NVLink-C2C (450 GB/s), plus the overlapped
  hit/miss attention model (the hit partial hides at most its own duration).

Command (~10 min on a 2-core CPU when first written; 3.2 min with a draft head on
2026-12-01):
  python -m experiments.prefetch
  python -m experiments.prefetch --prompt_file=<held-out text> --draft_ckpt=<head>
"""

from __future__ import annotations

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments import common, model_setup
from experiments.analysis import io_model
from experiments.analysis.tracing import TraceCarry, lookahead_picks, trace_step
from kvtier_jax.config import TierConfig
from kvtier_jax.draft import ngram_draft, ngram_match
from kvtier_jax.layer import prefetch_resolve
from kvtier_jax.resolve import resolve
from kvtier_jax.selectors.base import prefill_state
from models import backends, draft_head, setup
from models import cache as cache_lib
from models.config import ModelConfig
from models.transformer import apply_features, apply_prefill_with_inputs, lm_head

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 128, "Teacher-forced decode steps.")
flags.DEFINE_list("selectors", ["quest", "dsa", "oracle"], "Selectors to study.")
flags.DEFINE_integer("cap", 64, "Prefetched rows per layer and unit per step.")
flags.DEFINE_integer("share", 3, "Index sharing group size.")
flags.DEFINE_integer("batch", 8, "Concurrency of the IO model (the paper's 8).")
flags.DEFINE_bool("smoke", False, "Short run (tests).")
flags.DEFINE_string("out_root", None, "Results root.")

HBM = 4.8e12


@functools.partial(jax.jit, static_argnames=("capacity", "cap", "num_positions"))
def lru_with_prefetch(selections, predictions, capacity: int, cap: int,
                      num_positions: int):
  """LRU replay with the library's RESOLVE and its lookahead prefetch between steps.

  Args:
    selections: i32[T, S, k] per step and stream (-1 padding).
    predictions: i32[T, S, k] positions prefetched after step t for step t+1
      (all -1: no prefetch).
    capacity: B slots per stream; cap: prefetched rows per stream and step;
      num_positions: a bound on every position.

  Returns:
    (critical misses i32[T, S], prefetched i32[T, S], useful prefetched i32[T, S]):
    a prefetched row is useful when step t+1 selects it.
  """
  num_streams, num_sel = selections.shape[1:]
  # The replay as a one-layer tiered cache: one stream per request slot.
  cfg = TierConfig(num_layers=1, num_requests=num_streams, max_len=num_positions,
                   num_q_heads=1, num_kv_heads=1, head_dim=1, hot_slots=capacity,
                   top_k=num_sel, lookahead_cap=cap, impl="xla")
  slot_pos = jnp.full((num_streams, capacity), -1, jnp.int32)
  lru = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), slot_pos.shape)
  score = jnp.zeros(slot_pos.shape, jnp.float32)
  never = jnp.full((num_streams,), -1, jnp.int32)  # no reserved newest position
  past = jnp.full((num_streams,), num_positions, jnp.int32)  # every position exists

  def step(carry, xs):
    slot_pos, lru = carry
    sel, pred, nxt = xs
    res = resolve(slot_pos, lru, sel, never, lookup_method="search")
    pf, _ = prefetch_resolve(cfg, res.slot_pos, res.lru, score, pred, past)
    fetched = jnp.where(pf.is_miss, pred, -1)
    useful = (fetched[:, :, None] == jnp.where(nxt >= 0, nxt, -2)[:, None, :]).any(-1)
    return (pf.slot_pos, pf.lru), (res.is_miss.sum(-1, dtype=jnp.int32),
                                   pf.is_miss.sum(-1, dtype=jnp.int32),
                                   useful.sum(-1, dtype=jnp.int32))

  nxt = jnp.concatenate([selections[1:], jnp.full_like(selections[:1], -1)])
  _, out = jax.lax.scan(step, (slot_pos, lru), (selections, predictions, nxt))
  return out


def overlap(a: np.ndarray, b: np.ndarray) -> float:
  """Share of b's valid positions that a also names (rows: [..., k])."""
  hit = total = 0
  for idx in np.ndindex(*a.shape[:-1]):
    x, y = a[idx], b[idx]
    y = y[y >= 0]
    hit += np.intersect1d(x[x >= 0], y).size
    total += y.size
  return hit / max(1, total)


def streams(trace: np.ndarray) -> np.ndarray:
  """[T, L, U, k] -> [T, L*U, k]."""
  return trace.reshape(trace.shape[0], -1, trace.shape[-1]).astype(np.int32)


def exposed_io_ms(miss_rate: float, link: str, hidden_s_per_layer: float = 0.0,
                  fetching_layers: int | None = None) -> float:
  return io_model.exposed_io_ms(ModelConfig.glm_5_1(), FLAGS.batch, miss_rate,
                                io_model.LINKS[link], hidden_s_per_layer, fetching_layers)


def main(argv):
  del argv
  if ModelConfig.glm_5_1().num_layers % FLAGS.share:
    raise app.UsageError(f"--share={FLAGS.share} must divide the IO model's "
                         f"{ModelConfig.glm_5_1().num_layers} layers (as index sharing "
                         "requires of a model)")
  model_setup.refuse_given(("lookahead", "lookahead_cap"), "this runner compares its "
                           "own predictors (the draft token among them)")
  model_setup.refuse_given(("selector", "impl"), "this runner traces every selector of "
                           "--selectors through its own XLA cache model")
  model_setup.check_draft_ckpt()
  prompt, steps = (384, 12) if FLAGS.smoke else (4096, FLAGS.steps)
  if FLAGS["prompt_tokens"].present:  # (the shared flag's default is not this table's)
    prompt = FLAGS.prompt_tokens
  if FLAGS["steps"].present:
    steps = FLAGS.steps
  out = common.start_run("prefetch", dict(FLAGS.flag_values_dict(), prompt_tokens=prompt,
                                          steps=steps), FLAGS.out_root)
  model, _, ids = model_setup.load_model_and_prompt(FLAGS.prompt_file, prompt + steps + 1,
                                                    FLAGS.offset)
  cfg = model.cfg
  built = [setup.build_selector(n, cfg, FLAGS.top_k, FLAGS.indexer_ckpt)
           for n in FLAGS.selectors]
  selectors, params = tuple(s for s, _ in built), tuple(p for _, p in built)
  weights, tokens = model.weights(), np.asarray(ids, np.int32)
  max_len = prompt + steps + 2
  lens = jnp.array([prompt], jnp.int32)
  _, k, v, h = apply_prefill_with_inputs(cfg, weights, jnp.asarray(tokens[None, :prompt]),
                                         lens)
  kv = cache_lib.dense_from_prefill(k, v, lens, max_len)
  states = tuple(prefill_state(s, cfg.num_layers, max_len, p, h, k, lens)
                 for s, p in zip(selectors, params))
  picks = tuple(jnp.zeros((cfg.num_layers, 1, s.num_units, s.top_k), jnp.int32)
                for s in selectors)
  recall0 = jnp.zeros((len(selectors), cfg.num_layers, 1), jnp.float32)
  carry = TraceCarry(kv, states, jax.tree.map(jnp.copy, params), picks, recall0)
  true = [np.full((steps, cfg.num_layers, s.num_units, s.top_k), -1, np.int32)
          for s in selectors]
  draft_kinds = ["draft token"]
  if FLAGS.draft_ckpt:
    # Teacher-forced features of the whole span (the dense forward: what each
    # decode step computes, up to float rounding).
    head = model_setup.load_draft_head(cfg, weights)
    feats = apply_features(cfg, weights, jnp.asarray(tokens[None, :prompt + steps + 1]))[0]
    head_drafts = np.asarray(draft_head.draft_tokens(
        cfg, weights, head, feats[prompt - 1:prompt + steps - 1],
        jnp.asarray(tokens[prompt:prompt + steps])))
    own_drafts = np.asarray(jnp.argmax(lm_head(cfg, weights,
                                               feats[prompt:prompt + steps]), -1))
    draft_kinds += ["draft head", "lookup, else head", "model's next token"]
  drafted = {kind: [np.full_like(t, -1) for t in true] for kind in draft_kinds}
  recall = np.zeros((steps, len(selectors)), np.float32)
  draft_hits = dict.fromkeys(draft_kinds, 0)
  for t in tqdm(range(steps), desc="decode steps", unit="step"):
    position = prompt + t
    carry = trace_step(cfg, selectors, weights, jnp.asarray(tokens[None, position]), carry)
    picks_t, recall_t = jax.device_get((carry.picks, carry.recall))
    for trace, pick in zip(true, picks_t):
      trace[t] = np.where(pick[:, 0] == position, -1, pick[:, 0])
    recall[t] = recall_t[:, :, 0].mean(-1)
    drafts = {"draft token": ngram_draft(tokens[:position + 1].tolist())}
    if FLAGS.draft_ckpt:
      drafts.update({"draft head": int(head_drafts[t]),
                     "lookup, else head": backends.lookup_or_head(
                         ngram_match(tokens[:position + 1].tolist()), head_drafts[t]),
                     "model's next token": int(own_drafts[t])})
    for kind, draft in drafts.items():
      draft_hits[kind] += int(draft == tokens[position + 1])
      ahead = lookahead_picks(cfg, selectors, weights, jnp.asarray([draft], jnp.int32),
                              carry)
      for trace, pick in zip(drafted[kind], jax.device_get(ahead)):
        trace[t] = np.where(pick[:, 0] > position, -1, pick[:, 0])  # next-step guess
  rows = []
  shifted = lambda x: np.concatenate([np.full_like(x[:1], -1), x[:-1]])  # S_{t-1} for S_t
  for i, (name, sel, real) in enumerate(zip(FLAGS.selectors, selectors, true)):
    k = sel.top_k
    agreement = {"prefetch: current query": overlap(shifted(real)[1:], real[1:])}
    sel_streams = jnp.asarray(streams(real))
    none = jnp.full_like(sel_streams, -1)
    # The offline ceiling: the next step's selection itself (every prefetched row
    # is useful; what stays critical is past the cap).
    upcoming = np.concatenate([real[1:], np.full_like(real[:1], -1)])
    agreement["prefetch: next selection (offline)"] = overlap(shifted(upcoming)[1:],
                                                               real[1:])
    variants = {"sync (no prefetch)": none,
                "prefetch: current query": jnp.asarray(streams(real)),
                "prefetch: next selection (offline)": jnp.asarray(streams(upcoming))}
    for kind in draft_kinds:
      guess = drafted[kind][i]
      agreement[f"prefetch: {kind}"] = overlap(shifted(guess)[1:], real[1:])
      variants[f"prefetch: {kind}"] = jnp.asarray(streams(guess))
    for variant, pred in variants.items():
      miss, pref, useful = (np.asarray(x) for x in lru_with_prefetch(
          sel_streams, pred, 2 * k, FLAGS.cap, max_len))
      # From step 1: step 0 fills the replay's empty cache, which the engine's warm
      # start does at prefill (miss_rate.py's warm rate leaves it out too).
      miss = miss[1:]
      # Rows prefetched after the last step serve no step of the trace: the
      # prefetches judged are those after steps 0..T-2, for the steps 1..T-1 counted.
      pref, useful = pref[:-1], useful[:-1]
      rate = miss.sum() / max(1, int((real[1:] >= 0).sum()))
      rows.append(dict(selector=name, variant=variant, critical_miss_rate=rate,
                       # (None without critical misses: no miss to divide by)
                       prefetched_per_miss=(pref.sum() / miss.sum() if miss.sum()
                                            else None),
                       useful_share=useful.sum() / pref.sum() if pref.sum() else None,
                       agreement=agreement.get(variant),
                       io_h200_ms=exposed_io_ms(rate, "h200_pcie5"),
                       io_gh200_ms=exposed_io_ms(rate, "gh200_c2c")))
    # Index sharing: anchors keep their misses, shared layers' are prefetched: only
    # the anchors (one layer in ``share``) fetch on the critical path.
    sync = rows[-len(variants)]
    base = sync["critical_miss_rate"]
    sync["recall"] = float(recall[:, i].mean())
    anchors = ModelConfig.glm_5_1().num_layers // FLAGS.share
    rows.append(dict(selector=name, variant=f"index shared by {FLAGS.share}",
                     critical_miss_rate=base / FLAGS.share,
                     agreement=overlap(real[:, :-1], real[:, 1:]),
                     io_h200_ms=exposed_io_ms(base, "h200_pcie5", fetching_layers=anchors),
                     io_gh200_ms=exposed_io_ms(base, "gh200_c2c", fetching_layers=anchors)))
    # Overlapped hit/miss attention: the hit partial (reading the resident rows at
    # HBM bandwidth) hides at most its own duration of each layer's fetch.
    hit_s = io_model.miss_bytes_per_layer(ModelConfig.glm_5_1(), FLAGS.batch,
                                          1 - base) / HBM
    rows.append(dict(selector=name, variant="overlapped hit/miss attention",
                     critical_miss_rate=base,
                     io_h200_ms=exposed_io_ms(base, "h200_pcie5", hit_s),
                     io_gh200_ms=exposed_io_ms(base, "gh200_c2c", hit_s)))
  for row in rows:
    common.append_row(out, row)
  correct = ", ".join(f"{kind} {hits}/{steps}" for kind, hits in draft_hits.items())
  note = (f"next token drafted correctly ('draft token': prompt lookup): {correct}; "
          f"'agreement' = share of the next step's selection the predictor named "
          f"(index sharing: share of layer l+1's selection in layer l's); IO model: "
          f"batch {FLAGS.batch}, GLM-5.1 rows; paper: 7.7 ms sync, 3.0 ms prefetch")
  table = common.markdown_table(rows, ["selector", "variant", "recall", "agreement",
                                       "critical_miss_rate", "prefetched_per_miss",
                                       "useful_share", "io_h200_ms", "io_gh200_ms"])
  (out / "table.md").write_text(f"{note}\n\n{table}\n")
  labels = [f"{r['selector']}:{r['variant'][:14]}" for r in rows]
  common.bar_plot(out / "plot.png", labels, [r["io_h200_ms"] for r in rows],
                  "exposed IO ms/token (H200 PCIe model)", "hiding host IO")
  print(note)
  print(table)
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
