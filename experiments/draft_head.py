r"""Train an EAGLE-style draft head for SmolLM2; its acceptance on a held-out text.

What it is for: the lookahead prefetch needs the next step's token before the
current step has produced it. OasisKV (arXiv 2608.08097) drafts it with an EAGLE-3
head (98.74% next-step top-K agreement); the prompt-lookup draft
(``kvtier_jax.draft.ngram_draft``) is right at 8 of 128 steps on our pydoc trace.

The head (``models/draft_head.py``) is trained on windows of the pydoc language
reference (``models.text.load_text``) and evaluated on windows of stdlib docstrings
(``load_heldout_text``), teacher-forced. Per position p, drafts of x_{p+1}:
* ``draft head``: from f_{p-1} and x_p (what is known when step p starts);
* ``prompt lookup``: from the tokens up to x_p (the same moment, no model);
* ``prompt lookup (n >= 2), else draft head``: the lookup where a bigram or longer
  matched, the head elsewhere (``models.backends.lookup_or_head``);
* ``model's next token``: the model's own LM head on f_p, known only once step p
  has run: the ceiling of any draft (100% acceptance in greedy decoding).
Acceptance is reported against the text's next token and against the model's own
greedy token (what a greedy generation would accept). The next-step selection
agreement and the critical-path misses it buys: ``experiments.prefetch`` on the
held-out text with ``--draft_ckpt`` (the command is printed).

Trained on the model's own greedy next token (EAGLE's recipe; ``--labels=text`` for
the text's). Command (defaults: 32 x 1024 training tokens, 4 x 1024 held-out tokens,
300 AdamW steps of 256 rows; ~4 min on a 2-core CPU):
  python -m experiments.draft_head
Results: results/draft_head/<time>/ (config.json, rows.jsonl, table.md, plot.png,
heldout.txt, draft_head/: the orbax checkpoint, ``models.draft_head.load``).
"""

from __future__ import annotations

from absl import app, flags
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments import common
from kvtier_jax.draft import ngram_draft, ngram_match
from models import backends, draft_head, text
from models import transformer as tfm

FLAGS = flags.FLAGS
flags.DEFINE_integer("window", 1024, "Tokens per window (one prefill each).")
flags.DEFINE_integer("train_windows", 32, "Training windows of the pydoc text.")
flags.DEFINE_integer("eval_windows", 4, "Held-out windows of the stdlib docstrings.")
flags.DEFINE_integer("steps", 300, "AdamW steps.")
flags.DEFINE_integer("batch", 256, "Rows per step.")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate (warm-up, cosine to lr/10).")
flags.DEFINE_enum("labels", "model", ["model", "text"], "Training targets: the model's "
                  "own greedy next token (EAGLE's distillation) or the text's.")
flags.DEFINE_integer("model_layers", None, "Keep only SmolLM2's first n decoder layers "
                     "(real weights; smoke runs and tests): the head is then for that "
                     "cut, and prefetch refuses it for another.", lower_bound=1)
flags.DEFINE_bool("smoke", False, "Tiny run (tests).")
flags.DEFINE_string("out_root", None, "Results root.")


def windowed_features(cfg, weights, ids, windows: int, window: int):
  """(features [n, W, E], tokens [n, W]) of consecutive windows of ``ids``."""
  tokens = np.asarray(ids[:windows * window], np.int32).reshape(windows, window)
  feats = [np.asarray(tfm.apply_features(cfg, weights, jnp.asarray(t[None]))[0])
           for t in tqdm(tokens, desc="features", unit="window")]
  return np.stack(feats), tokens


def stacked_examples(feats, tokens):
  parts = [draft_head.examples(f, t) for f, t in zip(feats, tokens)]
  return tuple(jnp.asarray(np.concatenate(cols)) for cols in zip(*parts))


def greedy_tokens(cfg, weights, feats, chunk: int = 2048):
  """i32[N]: the model's own next token from features [N, E] (its LM head, argmax)."""
  return np.concatenate([np.asarray(jnp.argmax(tfm.lm_head(cfg, weights,
                                                           feats[i:i + chunk]), -1))
                         for i in range(0, feats.shape[0], chunk)])


def main(argv):
  del argv
  # --smoke's sizes, each unless given on the command line; config.json records
  # what ran.
  smoke = dict(window=128, train_windows=2, eval_windows=1, steps=6)
  ran = {name: value if FLAGS.smoke and not FLAGS[name].present else FLAGS[name].value
         for name, value in smoke.items()}
  window, train_windows, eval_windows, steps = (
      ran["window"], ran["train_windows"], ran["eval_windows"], ran["steps"])
  out = common.start_run("draft_head", dict(FLAGS.flag_values_dict(), **ran),
                         FLAGS.out_root)
  model, tokenizer, _ = tfm.load_smollm2(num_layers=FLAGS.model_layers)
  cfg, weights = model.cfg, model.weights()
  train_ids = text.tokenize_prompt(tokenizer, text.load_text(), train_windows * window)
  heldout = text.load_heldout_text()
  (out / "heldout.txt").write_text(heldout, encoding="utf-8")
  eval_ids = text.tokenize_prompt(tokenizer, heldout, eval_windows * window)

  train_f, train_t = windowed_features(cfg, weights, train_ids, train_windows, window)
  eval_f, eval_t = windowed_features(cfg, weights, eval_ids, eval_windows, window)
  tc = draft_head.TrainConfig(steps=steps, batch=FLAGS.batch, lr=FLAGS.lr)
  feat_prev, token, feat_next, label = stacked_examples(train_f, train_t)
  if FLAGS.labels == "model":
    label = jnp.asarray(greedy_tokens(cfg, weights, feat_next))
  head, history = draft_head.train(cfg, weights, feat_prev, token, feat_next, label, tc)
  ckpt = draft_head.save(out / "draft_head", head, dict(
      trained_on="pydoc_data.topics", windows=train_windows, window=window, steps=steps,
      labels=FLAGS.labels, model_layers=cfg.num_layers), weights=weights)
  head = draft_head.load(ckpt, weights=weights)  # evaluate what was saved

  feat_prev, token, feat_next, label = stacked_examples(eval_f, eval_t)
  drafts = {"draft head": np.asarray(draft_head.draft_tokens(cfg, weights, head,
                                                              feat_prev, token))}
  own = greedy_tokens(cfg, weights, feat_next)
  drafts["prompt lookup"] = np.array([ngram_draft(t[:p + 1])
                                      for t in eval_t for p in range(1, window - 1)])
  head_at = iter(drafts["draft head"].tolist())  # the same positions, in order
  drafts["prompt lookup (n >= 2), else draft head"] = np.array([
      backends.lookup_or_head(ngram_match(t[:p + 1]), next(head_at))
      for t in eval_t for p in range(1, window - 1)])
  drafts["model's next token (after the step)"] = own
  label = np.asarray(label)
  rows = [dict(draft=name, acceptance_vs_text=float((d == label).mean()),
               acceptance_vs_greedy=float((d == own).mean()), positions=int(label.size))
          for name, d in drafts.items()]
  ends = max(1, min(10, len(history) // 2))  # disjoint ends, even for a short run
  rows[0].update(train_loss_first=float(history[:ends, 1].mean()),
                 train_loss_last=float(history[-ends:, 1].mean()))
  for row in rows:
    common.append_row(out, row)
  table = common.markdown_table(rows, ["draft", "acceptance_vs_text",
                                       "acceptance_vs_greedy", "positions",
                                       "train_loss_first", "train_loss_last"])
  note = (f"trained on {train_windows}x{window} pydoc tokens ({FLAGS.labels}'s next "
          f"token), {steps} steps; evaluated "
          f"on {eval_windows}x{window} stdlib-docstring tokens (teacher-forced)")
  (out / "table.md").write_text(f"{note}\n\n{table}\n")
  common.bar_plot(out / "plot.png", [r["draft"][:18] for r in rows],
                  [r["acceptance_vs_text"] for r in rows],
                  "acceptance of the next token (held-out text)", "draft head")
  print(note)
  print(table)
  layers = f" --model_layers={FLAGS.model_layers}" if FLAGS.model_layers else ""
  print(f"next-step agreement and critical misses: python -m experiments.prefetch "
        f"--prompt_file={out / 'heldout.txt'} --draft_ckpt={ckpt}{layers}")
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
