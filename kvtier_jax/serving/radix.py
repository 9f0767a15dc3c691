"""A radix prefix cache over the host page pool (SGLang's RadixCache semantics).

The tree is keyed by token ids in units of ``unit`` tokens (the engine's prefill
chunk C, a multiple of the page size): a prefix is cached only as whole chunks,
because a chunk's K/V depend on nothing but the tokens up to its end when chunks
run at fixed boundaries, so a request that reuses them computes exactly what it
would have computed itself. Each edge holds the host pages of its tokens.

* ``match_prefix`` returns the pages of the longest cached prefix (splitting an
  edge matched part-way, as SGLang does) and touches it for LRU;
* ``insert`` adds a prefix, adopting the caller's pages for the part not cached
  yet (the caller takes a pool reference for each adopted page);
* ``lock`` / ``unlock`` count the running requests using a node and its
  ancestors; ``evict`` drops unlocked leaves, least recently used first, so a
  shared prefix outlives its suffixes.

Pages are shared by reference count (``PagePool``): the tree holds one reference
per cached page and every slot whose table lists it holds one, so dropping a tree
node frees only pages no request holds. What is cached: prompt chunks computed by
prefill. A request's generated tokens are not inserted: their K/V come from decode
steps (sparse attention), while a later request that has them in its prompt would
prefill them (dense attention), so reusing them would change its numbers.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Callable, Sequence


@dataclasses.dataclass(eq=False)
class Node:
  key: tuple[int, ...]  # this edge's tokens (whole units)
  pages: list[int]  # host pages of those tokens
  parent: "Node | None"
  children: dict[tuple[int, ...], "Node"] = dataclasses.field(default_factory=dict)
  lock: int = 0  # running requests using this node or a descendant
  last_used: int = 0


class RadixCache:
  """Prefixes of whole ``unit``-token chunks and their host pages."""

  def __init__(self, unit: int, page_size: int):
    if unit <= 0 or unit % page_size:
      raise ValueError(f"unit={unit} must be a positive multiple of page_size={page_size}")
    self.unit, self.page_size = unit, page_size
    self.root = Node((), [], None)
    self.root.lock = 1  # never evicted
    self._clock = itertools.count(1)
    self.num_pages = 0  # pages the tree holds a reference to

  def _first(self, tokens: Sequence[int], at: int) -> tuple[int, ...]:
    return tuple(tokens[at:at + self.unit])

  def _pages_of(self, tokens: int) -> int:
    return tokens // self.page_size

  def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
    """(pages, node) of the longest cached prefix of ``tokens`` in whole units."""
    tokens = list(tokens[:len(tokens) // self.unit * self.unit])
    node, at, pages = self.root, 0, []
    stamp = next(self._clock)
    while at < len(tokens):
      child = node.children.get(self._first(tokens, at))
      if child is None:
        break
      same = 0  # whole units of the edge that match
      while (same < len(child.key) and at + same < len(tokens)
             and tuple(child.key[same:same + self.unit]) == self._first(tokens, at + same)):
        same += self.unit
      if same < len(child.key):
        child = self._split(child, same)
      child.last_used = stamp
      pages += child.pages
      at += same
      node = child
    return pages, node

  def _split(self, child: Node, length: int) -> Node:
    """Cut ``child``'s edge after ``length`` tokens; returns the new upper node."""
    cut = self._pages_of(length)
    upper = Node(child.key[:length], child.pages[:cut], child.parent,
                 lock=child.lock, last_used=child.last_used)
    upper.children[self._first(child.key, length)] = child
    child.parent.children[self._first(child.key, 0)] = upper
    child.key, child.pages, child.parent = child.key[length:], child.pages[cut:], upper
    return upper

  def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[list[int], Node]:
    """Cache ``tokens`` (whole units) whose pages are ``pages``; returns (the pages
    the tree adopted: the caller adds a reference to each, the deepest node)."""
    if len(tokens) % self.unit or len(pages) != self._pages_of(len(tokens)):
      raise ValueError(f"{len(tokens)} tokens and {len(pages)} pages are not whole units "
                       f"of {self.unit} tokens / {self.unit // self.page_size} pages")
    _, node = self.match_prefix(tokens)
    depth = 0
    walk = node
    while walk is not self.root:
      depth += len(walk.key)
      walk = walk.parent
    if depth == len(tokens):
      return [], node
    new = Node(tuple(tokens[depth:]), list(pages[self._pages_of(depth):]), node,
               last_used=next(self._clock))
    node.children[self._first(new.key, 0)] = new
    self.num_pages += len(new.pages)
    return list(new.pages), new

  def lock(self, node: Node) -> None:
    while node is not None:
      node.lock += 1
      node = node.parent

  def unlock(self, node: Node) -> None:
    while node is not None:
      if node.lock <= 0:
        raise AssertionError("unlock without a lock")
      node.lock -= 1
      node = node.parent

  def evict(self, num_pages: int, drop: Callable[[list[int]], int]) -> int:
    """Drop unlocked leaves, least recently used first, until ``drop`` (which
    releases the tree's references and returns the pages that became free) has
    freed ``num_pages``; returns the pages freed."""
    leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and not n.lock]
    heapq.heapify(leaves)
    freed = 0
    while leaves and freed < num_pages:
      _, _, leaf = heapq.heappop(leaves)
      parent = leaf.parent
      del parent.children[self._first(leaf.key, 0)]
      self.num_pages -= len(leaf.pages)
      freed += drop(leaf.pages)
      if parent is not self.root and not parent.children and not parent.lock:
        heapq.heappush(leaves, (parent.last_used, id(parent), parent))
    return freed

  def _nodes(self):
    stack = [self.root]
    while stack:
      node = stack.pop()
      if node is not self.root:
        yield node
      stack.extend(node.children.values())

  def held_pages(self) -> list[int]:
    """Every page the tree references (tests: the pool's reference counts)."""
    return [p for n in self._nodes() for p in n.pages]
