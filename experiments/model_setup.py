"""The flags every real-model runner shares (the model and selector code lives in
models/setup.py)."""

from __future__ import annotations

import math

from absl import app, flags

from kvtier_jax.config import ImplConfig
from models import draft_head, setup
from models.setup import DEFAULT_INDEXER, SELECTORS

FLAGS = flags.FLAGS

flags.DEFINE_string("prompt_file", None, "Text file for the prompt (default: Python's "
                    "pydoc_data.topics, shipped with CPython; 'heldout': stdlib "
                    "docstrings, disjoint from it, models.text.load_heldout_text; "
                    "'test': other modules' docstrings, for final reports only).")
flags.DEFINE_integer("prompt_tokens", 1024, "Prompt length in tokens.")
flags.DEFINE_integer("offset", 0, "Token offset of the prompt in the text.")
flags.DEFINE_enum("selector", "quest", SELECTORS, "Sparse-attention selector "
                  "(quest_kv: Quest per KV head).")
flags.DEFINE_integer("top_k", 256, "k: positions per layer (Quest: token budget; "
                     "NSA derives its own k from blocks and window).")
flags.DEFINE_integer("model_layers", None, "Keep only SmolLM2's first n decoder layers "
                     "(real weights; embedding, final norm and head kept): quick smoke "
                     "runs and tests; its tokens are not SmolLM2's. Dummy presets: "
                     "their layer count.", lower_bound=1)
flags.DEFINE_string("indexer_ckpt", None, "Distilled DSA indexer (default: "
                    f"{DEFAULT_INDEXER} if present; experiments/distill_indexer.py).")
flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas", "fused"], "The tiered "
                  "cache's implementation: per op (auto, xla, pallas; a keyed policy "
                  "resolves in XLA), or fused: a layer's RESOLVE, fetch and cache writes "
                  "in one step (on a CPU one native call per layer, on a GPU the fused "
                  "Pallas kernels).")
flags.DEFINE_integer("decode_row_tile", None, "A batch-invariant decode: the step's "
                     "row-wise work runs over tiles of this many requests "
                     "(ModelConfig.decode_row_tile), so a request's logits are the same "
                     "bits whatever else shares its step, at some cost "
                     "(experiments.batch_invariance measures both; default: untiled).",
                     lower_bound=1)
flags.DEFINE_enum("lookahead", "none", ["none", "draft"], "Tiered: prefetch the next "
                  "step's rows by an uncommitted pass of a draft token (prompt lookup; "
                  "generate can add --draft_ckpt's head).")
flags.DEFINE_integer("lookahead_cap", 64, "Rows prefetched per layer and unit per step.",
                     lower_bound=1)
flags.DEFINE_string("draft_ckpt", None, "A draft head (experiments.draft_head) for the "
                    "lookahead's draft token: read on a text it was not trained on.")


def load_model_and_prompt(prompt_file: str | None, prompt_tokens: int, offset: int = 0):
  """``models.setup.load_model_and_prompt`` with the shared flags: SmolLM2's first
  ``--model_layers`` layers, its decode tiled by ``--decode_row_tile``."""
  return setup.load_model_and_prompt(prompt_file, prompt_tokens, offset,
                                     num_layers=FLAGS.model_layers,
                                     decode_row_tile=FLAGS.decode_row_tile)


NO_LOOKAHEAD = ("lookahead", "lookahead_cap", "draft_ckpt")


def refuse_given(names, why: str) -> None:
  """A ``UsageError`` for any of the shared flags ``names`` given on the command
  line: a runner that does not read them would otherwise run without them."""
  given = [f"--{name}" for name in names if FLAGS[name].present]
  if given:
    raise app.UsageError(f"{', '.join(given)}: {why}")


def tier_impl(keyed_policy: bool = False) -> ImplConfig:
  """The ``ImplConfig`` that ``--impl`` names."""
  if FLAGS.impl == "fused":
    return ImplConfig(fused=True)
  return ImplConfig(resolve="xla" if keyed_policy else FLAGS.impl,
                    attention=FLAGS.impl, fetch=FLAGS.impl)


def check_draft_ckpt() -> None:
  """Refuses ``--draft_ckpt`` on the span it was trained on (the pydoc text's first
  windows), where its drafts would be memorised: from the checkpoint's metadata,
  so a runner refuses before it loads the model."""
  if not FLAGS.draft_ckpt:
    return
  trained = draft_head.metadata(FLAGS.draft_ckpt)
  train_end = trained.get("windows", math.inf) * trained.get("window", math.inf)
  if (FLAGS.prompt_file is None and trained.get("trained_on") == "pydoc_data.topics"
      and FLAGS.offset < train_end):
    raise ValueError(f"{FLAGS.draft_ckpt} was trained on the pydoc text's first "
                     f"{train_end} tokens, which this run reads: pass "
                     "--prompt_file=<held-out text> (or an --offset past them)")


def load_draft_head(cfg, weights):
  """The ``--draft_ckpt`` head for this model (``check_draft_ckpt`` first)."""
  check_draft_ckpt()
  return draft_head.load(FLAGS.draft_ckpt, num_layers=cfg.num_layers,
                         embed_dim=cfg.embed_dim, weights=weights)
