"""The real model, its prompts and the selectors sized for it, in one call each.

Selector sizes for SmolLM2 (8K trained context) follow the regime closest to the
paper's (k ~ 3% of the context, B = 2k; docs/DESIGN.md, "Real model"): k = 256 by
default. NSA is scaled down the same way (32-token blocks, 8 blocks, 64-token
window: k = 320 positions).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import jax

from kvtier_jax import selectors as sel_lib
from models import text
from models.config import ModelConfig
from models.transformer import Transformer, dummy_params, load_smollm2

SELECTORS = ("quest", "quest_kv", "dsa", "nsa", "oracle")
DEFAULT_INDEXER = pathlib.Path("results/indexer/smollm2")
log = logging.getLogger(__name__)


def build_selector(name: str, cfg: ModelConfig, top_k: int,
                   indexer_ckpt: str | pathlib.Path | None = None):
  """(selector, selector params) for a model config.

  ``quest_kv`` is Quest per KV head; ``nsa`` has its paper's shape whatever
  ``top_k`` says (8 blocks of 32 + a window of 64: k = 320; its ``top_k`` is what
  the runners read); ``dsa`` loads the distilled indexer from
  ``indexer_ckpt`` (default ``DEFAULT_INDEXER``, under the working directory as
  experiments/distill_indexer.py writes it; where that is missing, a random one
  with a warning). A given ``indexer_ckpt`` that does not exist is an error.
  """
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
    if indexer_ckpt and not path.exists():  # not a random indexer in its name
      raise FileNotFoundError(f"no distilled indexer at {path} (python -m "
                              "experiments.distill_indexer writes one)")
    params = None
    if path.exists():
      from kvtier_jax.selectors.distill import load_indexer
      params = load_indexer(path.resolve())
      width = params.wq.shape[1]
      if width != cfg.embed_dim and indexer_ckpt:
        raise ValueError(f"{path}: an indexer of a width-{width} model; {cfg.name} "
                         f"has embed_dim={cfg.embed_dim}")
      if width != cfg.embed_dim:  # the default is SmolLM2's: another model has none
        log.warning("the indexer at %s is a width-%d model's (%s has %d): using a "
                    "RANDOM indexer", path, width, cfg.name, cfg.embed_dim)
        params = None
      else:
        params = _first_layers_of(params, cfg.num_layers, path)
    else:
      log.warning("no distilled indexer at %s: using a RANDOM indexer (run "
                  "python -m experiments.distill_indexer)", path)
    if params is None:
      params = sel_lib.init_indexer_params(jax.random.key(0), cfg.num_layers,
                                           cfg.embed_dim, rope_theta=cfg.rope_theta)
    return sel_lib.DSASelector(top_k=top_k, index_dim=params.index_dim), params
  raise ValueError(f"unknown selector {name!r}; one of {SELECTORS}")


def _first_layers_of(params, num_layers: int, path):
  """A distilled indexer for a model cut to its first layers (``num_layers``):
  those layers are the full model's, so are their indexers."""
  trained = params.wq.shape[0]
  if trained < num_layers:
    raise ValueError(f"{path}: an indexer for {trained} layers, the model has "
                     f"{num_layers}")
  return jax.tree.map(lambda a: a[:num_layers], params)


def load_model_and_prompt(prompt_file: str | None, prompt_tokens: int, offset: int = 0,
                          num_layers: int | None = None, decode_row_tile: int | None = None):
  """(model, tokenizer, prompt ids) of SmolLM2 over ``prompt_file`` (default: the
  pydoc corpus), tokens ``[offset, offset + prompt_tokens)``; ``num_layers``: only
  its first layers (``transformer.first_layers``, for smoke runs);
  ``decode_row_tile``: ``ModelConfig.decode_row_tile`` (a batch-invariant decode)."""
  model, tokenizer, info = load_smollm2(num_layers=num_layers)
  if decode_row_tile is not None:
    model = Transformer.from_params(
        dataclasses.replace(model.cfg, decode_row_tile=decode_row_tile), model.weights())
  if num_layers is not None:
    log.warning("SmolLM2 cut to its first %d layers (smoke run: not SmolLM2's tokens)",
                num_layers)
  log.info("loaded %s in %.1f s", info["path"], info["load_seconds"])
  ids = text.tokenize_prompt(tokenizer, text.load_text(prompt_file), prompt_tokens,
                             offset=offset)
  return model, tokenizer, ids


def dummy_model(name: str, seed: int = 0, **override) -> Transformer:
  """A runnable preset (``ModelConfig.from_name``) with dummy weights, for
  performance runs only: its tokens mean nothing, so never for exactness."""
  cfg = ModelConfig.from_name(name, **override)
  cfg.check_runnable()
  return Transformer.from_params(cfg, dummy_params(cfg, jax.random.key(seed)))
