"""Real English prompts without downloads.

The default corpus is the Python standard library's own ``pydoc_data.topics``
(~465K characters of language-reference prose, PSF license), so every machine
that runs the tests already has it. Any UTF-8 file can replace it. A second,
disjoint text (``load_heldout_text``: the docstrings of a fixed list of stdlib
modules, library documentation rather than the language reference) is for
evaluating what was trained or tuned on the first. A third (``load_test_text``:
the docstrings of other stdlib modules) is for final reports only: nothing is
chosen by its numbers, so a choice made by the held-out text's can be tested on
it.
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np


HELDOUT = "heldout"  # the ``prompt_file`` name of ``load_heldout_text``
TEST = "test"  # the ``prompt_file`` name of ``load_test_text``


def load_text(prompt_file: str | pathlib.Path | None = None) -> str:
  """The prompt corpus: ``prompt_file``'s text, the pydoc topics (None), the
  held-out docstrings (``HELDOUT``; a file of that name: ``./heldout``) or the
  test docstrings (``TEST``).

  The topics dict's values are joined in sorted key order with a blank line
  between topics, so the text (and every token offset into it) is the same on
  every run and machine with the same Python minor version.
  """
  if prompt_file == HELDOUT:
    return load_heldout_text()
  if prompt_file == TEST:
    return load_test_text()
  if prompt_file is not None:
    return pathlib.Path(prompt_file).read_text(encoding="utf-8")
  from pydoc_data.topics import topics
  return "\n".join(topics[key] for key in sorted(topics))


# Modules whose docstrings make the held-out text (fixed: the text, and every
# token offset into it, depend only on the Python version).
HELDOUT_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "email.message", "enum", "fractions", "functools", "heapq",
    "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "pickle",
    "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess",
    "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid",
    "zipfile")


# Modules whose docstrings make the test text: none of the held-out ones.
TEST_MODULES = (
    "abc", "ast", "base64", "bisect", "bz2", "calendar", "cmd", "codecs",
    "concurrent.futures", "configparser", "contextvars", "copy", "difflib", "doctest",
    "email.utils", "filecmp", "fnmatch", "ftplib", "getopt", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "hmac", "html.parser", "http.server", "imaplib", "io",
    "ipaddress", "locale", "lzma", "mailbox", "mimetypes", "multiprocessing.pool",
    "numbers", "operator", "optparse", "pdb", "platform", "plistlib", "pprint", "queue",
    "sched", "secrets", "selectors", "shelve", "shlex", "smtplib", "struct", "tempfile",
    "timeit", "tokenize", "traceback", "types", "urllib.request", "warnings", "wave",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zoneinfo")


@functools.lru_cache(maxsize=1)
def load_heldout_text() -> str:
  """~240K characters of stdlib docstrings (``HELDOUT_MODULES``)."""
  return _docstrings(HELDOUT_MODULES)


@functools.lru_cache(maxsize=1)
def load_test_text() -> str:
  """Stdlib docstrings of ``TEST_MODULES`` (none of the held-out text's), for
  final reports of what was chosen on the held-out text. A docstring that shares
  a passage of ``SHARED_PASSAGE`` characters with the training or the held-out
  text is left out (a class inherits its base's docstring: ``plistlib``'s enum
  class brought ``enum.Enum``'s; ``pdb``'s repeats a pydoc topic)."""
  seen = passages(load_text(), load_heldout_text())
  return "\n\n".join(part for part in _docstring_parts(TEST_MODULES)
                     if not passages(part) & seen)


# Characters of a passage two texts share verbatim when they share it at all.
SHARED_PASSAGE = 100


def passages(*texts: str) -> set[int]:
  """Hashes of every ``SHARED_PASSAGE``-character window of ``texts``."""
  n = SHARED_PASSAGE
  return {hash(t[i:i + n]) for t in texts for i in range(len(t) - n + 1)}


def _docstrings(modules) -> str:
  return "\n\n".join(_docstring_parts(modules))


def _docstring_parts(modules) -> list[str]:
  """Each module's docstring, then those of its public classes and functions
  defined there (longer than 80 characters), sorted by name."""
  import importlib
  import inspect
  import sys
  import warnings
  if sys.flags.optimize >= 2:
    raise RuntimeError("python -OO (PYTHONOPTIMIZE=2) strips the docstrings that make "
                       "the held-out and test texts: they would be other, shorter texts")
  parts = []
  for name in modules:
    module = importlib.import_module(name)
    if doc := inspect.getdoc(module):
      parts.append(doc)
    for attr in sorted(dir(module)):
      with warnings.catch_warnings():  # typing.io / typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        obj = getattr(module, attr)
        doc = inspect.getdoc(obj)
      if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
        continue
      if doc and len(doc) > 80:
        parts.append(f"{attr}: {doc}")
  return parts


@functools.lru_cache(maxsize=4)
def _encode(tokenizer, text: str) -> np.ndarray:
  # Whole-text encoding (~0.3 s for the pydoc corpus), cached because traces
  # draw several windows from one text. Encoding a prefix instead could change
  # the last tokens before the cut.
  return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)


def tokenize_prompt(tokenizer, text: str, num_tokens: int,
                    offset: int = 0) -> np.ndarray:
  """Tokens ``[offset, offset + num_tokens)`` of the tokenized ``text``.

  Returns:
    i32[num_tokens].

  Raises:
    ValueError: the text has fewer than ``offset + num_tokens`` tokens.
  """
  if num_tokens < 0 or offset < 0:
    raise ValueError(f"{num_tokens=} and {offset=} must be >= 0")
  ids = _encode(tokenizer, text)
  if offset + num_tokens > ids.size:
    raise ValueError(f"the text has {ids.size} tokens; asked for "
                     f"[{offset}, {offset + num_tokens})")
  return ids[offset:offset + num_tokens].copy()
