"""What the real-model runners share: flags, model + prompt, selector factory.

Selector sizes for SmolLM2 (8K trained context) follow the regime the feasibility
study found closest to the paper's (REAL_MODEL.md §5: k ~ 3% of the context, B = 2k):
k = 256 by default. NSA is scaled down the same way (32-token blocks, 8 blocks,
64-token window: k = 320 positions).
"""

from __future__ import annotations

import pathlib

from absl import flags, logging
import jax

from kvtier_jax import selectors as sel_lib
from models import text
from models.config import ModelConfig
from models.transformer import load_smollm2

SELECTORS = ("quest", "quest_kv", "dsa", "nsa", "oracle")
DEFAULT_INDEXER = pathlib.Path("results/indexer/smollm2")

flags.DEFINE_string("prompt_file", None, "Text file for the prompt (default: Python's "
                    "pydoc_data.topics, shipped with CPython).")
flags.DEFINE_integer("prompt_tokens", 1024, "Prompt length in tokens.")
flags.DEFINE_integer("offset", 0, "Token offset of the prompt in the text.")
flags.DEFINE_enum("selector", "quest", SELECTORS, "Sparse-attention selector "
                  "(quest_kv: Quest per KV head).")
flags.DEFINE_integer("top_k", 256, "k: positions per layer (Quest: token budget; "
                     "NSA derives its own k from blocks and window).")
flags.DEFINE_string("indexer_ckpt", None, "Distilled DSA indexer (default: "
                    f"{DEFAULT_INDEXER} if present; experiments/distill_indexer.py).")


def build_selector(name: str, cfg: ModelConfig, top_k: int,
                   indexer_ckpt: str | None = None):
  """(selector, selector params) for a model config."""
  group = cfg.num_q_heads // cfg.num_kv_heads
  heads = dict(num_kv_heads=cfg.num_kv_heads, q_per_kv=group, head_dim=cfg.head_dim)
  if name in ("quest", "quest_kv"):
    return sel_lib.QuestSelector(token_budget=top_k, page_size=16,
                                 granularity="kv_head" if name == "quest_kv" else "layer",
                                 **heads), None
  if name == "nsa":
    return sel_lib.NSASelector(block_size=32, num_blocks=8, num_initial=1, num_local=2,
                               window=64, **heads), None
  if name == "oracle":
    return sel_lib.OracleSelector(top_k=top_k, **heads), None
  if name == "dsa":
    path = pathlib.Path(indexer_ckpt) if indexer_ckpt else DEFAULT_INDEXER
    if path.exists():
      from kvtier_jax.selectors.distill import load_indexer
      params = load_indexer(path.resolve())
    else:
      logging.warning("no distilled indexer at %s: using a RANDOM indexer (run "
                      "python -m experiments.distill_indexer)", path)
      params = sel_lib.init_indexer_params(jax.random.key(0), cfg.num_layers,
                                           cfg.embed_dim, rope_theta=cfg.rope_theta)
    return sel_lib.DSASelector(top_k=top_k, index_dim=params.index_dim), params
  raise ValueError(f"unknown selector {name!r}; one of {SELECTORS}")


def load_model_and_prompt(prompt_file: str | None, prompt_tokens: int, offset: int = 0):
  """(model, tokenizer, prompt ids list)."""
  model, tokenizer, info = load_smollm2()
  logging.info("loaded %s in %.1f s", info["path"], info["load_seconds"])
  ids = text.tokenize_prompt(tokenizer, text.load_text(prompt_file), prompt_tokens,
                             offset=offset)
  if len(ids) < prompt_tokens:
    raise ValueError(f"the text has only {len(ids)} tokens after offset {offset}")
  return model, tokenizer, ids
