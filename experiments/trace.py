r"""Selection traces of SmolLM2-135M over real text, for every selector at once.

Paper table: the inputs of HiSparse's cache-policy ablation (one
LongBenchV2 request, every sparse layer, first 1000 decode steps). Here: SmolLM2
over Python's pydoc text, a 7680-token prompt (the model's trained 8K context) and
512 teacher-forced decode steps (the text's own continuation is fed, so every
selector sees the same hidden states). The model attends densely; at every step
and layer each selector's choice is recorded (selections are
recorded, not fed back). The newest position is dropped from the rows (-1): the
tiered cache serves it from its reserved slot.

With ``--draft`` (the default) each step also runs a look-ahead pass of the
prompt-lookup draft of the next token (``kvtier_jax.draft.PromptLookup`` over the
tokens fed so far) one position ahead, committing nothing, and records what every
selector picks for it: ``<name>_drafted`` i16[T, L, U, k], the next step's
selection as a two-token step (the draft fed beside the token) would know it
during this step (the ``"drafted"`` feature of ``cache_sim``'s learned key), the
drafts ``draft_tokens`` i32[T] and ``tokens`` i32[prompt + T] (the prompt and the
tokens fed). It about triples the decode loop (2 -> 6 min here).

Command (~12-16 min on a 2-core CPU with --draft, ~8-10 without; needs
results/indexer/smollm2 for DSA, from experiments/distill_indexer.py):
  python -m experiments.trace
Output: results/trace/<time>/traces.npz with one i16[T, L, U, k] array per
selector (positions, -1 padding; row order = the selector's preference order), for
best-first selectors also ``<name>_ranks`` i16[T, L, U, m] (their top-m ranking,
m = ``--rank_depth``, whose first k entries are the selection: the input of the
rank-aware replacement policy), and
``recall`` f32[T, selectors, L] (the share of the model's head-averaged attention
mass each selection covers, at equal token budget), config.json, rows.jsonl
(per-selector recall, churn and size), table.md.
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments import common, model_setup
from experiments.analysis.tracing import TraceCarry, lookahead_picks, trace_step
from kvtier_jax.draft import PromptLookup
from kvtier_jax.selectors.base import prefill_state
from models import cache as cache_lib
from models import setup
from models.transformer import apply_prefill_with_inputs

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", common.FULL_TRACE_STEPS,
                     "Teacher-forced decode steps (fewer: not a full run for the tables).")
flags.DEFINE_list("selectors", ["quest", "quest_kv", "dsa", "nsa", "oracle"],
                  "Selectors to trace.")
flags.DEFINE_integer("rank_depth", 1024, "Also record each best-first selector's "
                     "top-m ranking (m = this; 0: off) for the rank-aware policy.")
flags.DEFINE_bool("smoke", False, "Short prompt, few steps (tests).")
flags.DEFINE_bool("draft", True, "Also record each selector's picks for the "
                  "prompt-lookup draft of the next token (<name>_drafted).")

# Selectors whose rows are best first, so a top-m row starts with the top-k one.
RANKED = ("quest", "quest_kv", "dsa", "oracle")
flags.DEFINE_string("out_root", None, "Results root.")


def churn(trace: np.ndarray) -> float:
  """Mean share of a row's positions that were not in the previous step's row."""
  fresh, total = 0, 0
  for t in range(1, trace.shape[0]):
    for idx in np.ndindex(*trace.shape[1:-1]):
      cur = trace[t][idx]
      cur = cur[cur >= 0]
      prev = trace[t - 1][idx]
      fresh += np.setdiff1d(cur, prev[prev >= 0], assume_unique=True).size
      total += cur.size
  return fresh / max(1, total)


def main(argv):
  del argv
  model_setup.refuse_given(model_setup.NO_LOOKAHEAD, "this runner runs no look-ahead "
                           "(generate, serve and prefetch do)")
  model_setup.refuse_given(("selector", "impl"), "this runner traces every selector of "
                           "--selectors on the sparse full-KV step")
  prompt, steps = (512, 16) if FLAGS.smoke else (FLAGS.prompt_tokens, FLAGS.steps)
  if not FLAGS.smoke and FLAGS["prompt_tokens"].using_default_value:
    prompt = 7680
  out = common.start_run("trace", dict(FLAGS.flag_values_dict(), prompt_tokens=prompt,
                                       steps=steps), FLAGS.out_root)
  model, _, ids = model_setup.load_model_and_prompt(FLAGS.prompt_file, prompt + steps,
                                                    FLAGS.offset)
  cfg = model.cfg
  depth = {name: max(FLAGS.top_k, FLAGS.rank_depth if name in RANKED else 0)
           for name in FLAGS.selectors}
  if FLAGS.smoke:
    depth = {name: min(d, 2 * FLAGS.top_k) for name, d in depth.items()}
  built = [setup.build_selector(name, cfg, depth[name], FLAGS.indexer_ckpt)
           for name in FLAGS.selectors]
  selectors = tuple(s for s, _ in built)
  params = tuple(p for _, p in built)
  weights = model.weights()
  tokens = np.asarray(ids, np.int32)[None]
  max_len = prompt + steps + 1
  start = time.perf_counter()
  lens = jnp.array([prompt], jnp.int32)
  _, k, v, h = apply_prefill_with_inputs(cfg, weights, jnp.asarray(tokens[:, :prompt]),
                                         lens)
  kv = cache_lib.dense_from_prefill(k, v, lens, max_len)
  states = tuple(prefill_state(s, cfg.num_layers, max_len, p, h, k, lens)
                 for s, p in zip(selectors, params))
  jax.block_until_ready((kv, states))
  del k, v, h
  print(f"prefill {prompt} tokens: {time.perf_counter() - start:.0f} s", flush=True)
  picks = tuple(jnp.zeros((cfg.num_layers, 1, s.num_units, s.top_k), jnp.int32)
                for s in selectors)
  recall0 = jnp.zeros((len(selectors), cfg.num_layers, 1), jnp.float32)
  carry = TraceCarry(kv, states, jax.tree.map(jnp.copy, params), picks, recall0)
  traces = [np.empty((steps, cfg.num_layers, s.num_units, s.top_k), np.int16)
            for s in selectors]  # ranked rows; the first k picks are the selection
  select_k = tuple(s.top_k * FLAGS.top_k // depth[n]
                   for n, s in zip(FLAGS.selectors, selectors))
  recall = np.zeros((steps, len(selectors), cfg.num_layers), np.float32)
  drafted = [np.full((steps if FLAGS.draft else 0, cfg.num_layers, s.num_units, k), -1,
                     np.int16) for s, k in zip(selectors, select_k)]
  draft_tokens = np.full((steps,), -1, np.int32)
  lookup = PromptLookup()
  lookup.extend(tokens[0, :prompt].tolist())
  for t in tqdm(range(steps), desc="decode steps", unit="step"):
    carry = trace_step(cfg, selectors, weights, jnp.asarray(tokens[:, prompt + t]), carry,
                       select_k)
    newest = prompt + t
    picks_t, recall_t = jax.device_get((carry.picks, carry.recall))
    for trace, pick in zip(traces, picks_t):
      trace[t] = np.where(pick[:, 0] == newest, -1, pick[:, 0])
    recall[t] = recall_t[:, :, 0]
    if FLAGS.draft:  # the next token's guess from what was fed, one position ahead
      lookup.extend([int(tokens[0, newest])])
      draft_tokens[t] = lookup.match()[0]
      ahead = jax.device_get(lookahead_picks(
          cfg, selectors, weights, jnp.asarray([draft_tokens[t]], jnp.int32), carry))
      for rows, pick, k in zip(drafted, ahead, select_k):  # its own position dropped
        rows[t] = np.where(pick[:, 0, :, :k] > newest, -1, pick[:, 0, :, :k])
  arrays = {}
  for name, trace, k, rows in zip(FLAGS.selectors, traces, select_k, drafted):
    arrays[name] = trace[..., :k]
    if trace.shape[-1] > k:
      arrays[f"{name}_ranks"] = trace
    if FLAGS.draft:
      arrays[f"{name}_drafted"] = rows
  if FLAGS.draft:
    arrays.update(draft_tokens=draft_tokens,
                  tokens=tokens[0, :prompt + steps].astype(np.int32))
    right = int((draft_tokens[:-1] == tokens[0, prompt + 1:prompt + steps]).sum())
    print(f"draft (prompt lookup) right at {right} of {steps - 1} steps", flush=True)
  np.savez_compressed(out / "traces.npz", **arrays, recall=recall,
                      prompt_tokens=prompt, steps=steps)
  traces = [arrays[name] for name in FLAGS.selectors]
  rows = []
  for i, (name, sel, trace) in enumerate(zip(FLAGS.selectors, selectors, traces)):
    rows.append(dict(selector=name, k=trace.shape[-1], units=sel.num_units,
                     rank_depth=depth[name] if depth[name] > FLAGS.top_k else 0,
                     recall=float(recall[:, i].mean()),
                     recall_min_layer=float(recall[:, i].mean(0).min()),
                     churn=churn(trace[:, :, :1] if trace.shape[2] > 1 else trace),
                     mean_valid=float((trace >= 0).sum(-1).mean())))
    common.append_row(out, rows[-1])
  table = common.markdown_table(rows, ["selector", "k", "rank_depth", "units", "recall",
                                       "recall_min_layer", "churn", "mean_valid"])
  (out / "table.md").write_text(table + "\n")
  print(table)
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
