"""A radix prefix cache over the host page pool (SGLang's RadixCache semantics).

The tree is keyed by token ids in units of ``unit`` tokens (the engine's prefill
chunk C, a multiple of the page size): a prefix is cached only as whole chunks,
because a chunk's K/V depend on nothing but the tokens up to its end when chunks
run at fixed boundaries, so a request that reuses them computes exactly what it
would have computed itself. Each edge holds the host pages of its tokens.

* ``match_prefix`` returns the pages of the longest cached prefix (splitting an
  edge matched part-way, as SGLang does) and touches it for LRU;
  ``prefix_length`` only measures it (the scheduler's question);
* ``insert`` adds a prefix, adopting the caller's pages for the part not cached
  yet (the caller takes a pool reference for each adopted page);
* ``lock`` / ``unlock`` count the running requests using a node and its
  ancestors; ``evict`` drops unlocked leaves, least recently used first, so a
  shared prefix outlives its suffixes.

With a disk tier (``disk.py``) ``evict`` moves a leaf's pages to disk (``spill``)
instead of forgetting them: the node stays in the tree with disk page ids, and is
treated as a leaf by the next eviction once all its children are on disk, so the
host-resident nodes are always a top part of the tree and a matched path is some
resident nodes, then some on disk (``disk_path``). ``insert`` brings a path's disk
nodes back by adopting the caller's host pages for them (the engine wrote the
pages read from disk there, or recomputed them); when the disk is full its least
recently used unlocked leaves are dropped for good.

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
from typing import Callable, Sequence

from kvtier_jax.serving.disk import DiskTier


@dataclasses.dataclass(eq=False)
class Node:
  key: tuple[int, ...]  # this edge's tokens (whole units)
  pages: list[int]  # host pages of those tokens ([] while on disk)
  parent: "Node | None"
  disk: list[int] = dataclasses.field(default_factory=list)  # disk pages (on disk)
  children: dict[tuple[int, ...], "Node"] = dataclasses.field(default_factory=dict)
  lock: int = 0  # running requests using this node or a descendant
  last_used: int = 0


class RadixCache:
  """Prefixes of whole ``unit``-token chunks and their host pages."""

  def __init__(self, unit: int, page_size: int, disk: DiskTier | None = None):
    if unit <= 0 or unit % page_size:
      raise ValueError(f"unit={unit} must be a positive multiple of page_size={page_size}")
    self.unit, self.page_size, self.disk = unit, page_size, disk
    self.root = Node((), [], None)
    self.root.lock = 1  # never evicted
    self._next_stamp = 1  # LRU stamps: a plain int (the tree deep-copies)
    self.num_pages = 0  # host pages the tree holds a reference to
    self.num_disk_pages = 0  # disk pages of the nodes on disk
    # Bumped whenever a ``prefix_length`` answer may change (a node added or
    # removed): a scheduler may keep its answers until then.
    self.version = 0

  def _stamp(self) -> int:
    """A fresh LRU stamp, larger than every earlier one."""
    stamp, self._next_stamp = self._next_stamp, self._next_stamp + 1
    return stamp

  def _first(self, tokens: Sequence[int], at: int) -> tuple[int, ...]:
    return tuple(tokens[at:at + self.unit])

  def _pages_of(self, tokens: int) -> int:
    return tokens // self.page_size

  def _edge_match(self, child: Node, tokens: list[int], at: int) -> int:
    """Tokens (whole units) of ``child``'s edge that ``tokens[at:]`` starts with."""
    same = 0
    while (same < len(child.key) and at + same < len(tokens)
           and tuple(child.key[same:same + self.unit]) == self._first(tokens, at + same)):
      same += self.unit
    return same

  def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
    """(pages, node) of the longest cached prefix of ``tokens`` in whole units."""
    tokens = list(tokens[:len(tokens) // self.unit * self.unit])
    node, at, pages = self.root, 0, []
    stamp = self._stamp()
    while at < len(tokens):
      child = node.children.get(self._first(tokens, at))
      if child is None:
        break
      same = self._edge_match(child, tokens, at)
      if same < len(child.key):
        child = self._split(child, same)
      child.last_used = stamp
      pages += child.pages
      at += same
      node = child
    return pages, node

  def prefix_length(self, tokens: Sequence[int]) -> int:
    """Tokens of the longest cached prefix of ``tokens`` in whole units (host or
    disk), read without touching the tree (no split, no LRU stamp): what a
    scheduler may ask about every waiting request."""
    return self.peek(tokens)[0]

  def peek(self, tokens: Sequence[int]) -> tuple[int, list[int], bool]:
    """(tokens, host pages, whether part of it is on disk) of the longest cached
    prefix of ``tokens`` in whole units, read without touching the tree."""
    tokens = list(tokens[:len(tokens) // self.unit * self.unit])
    node, at, pages, on_disk = self.root, 0, [], False
    while at < len(tokens):
      child = node.children.get(self._first(tokens, at))
      if child is None:
        break
      same = self._edge_match(child, tokens, at)
      at += same
      pages += child.pages[:self._pages_of(same)]
      on_disk |= bool(child.disk) and same > 0
      if same < len(child.key):
        break
      node = child
    return at, pages, on_disk

  def _split(self, child: Node, length: int) -> Node:
    """Cut ``child``'s edge after ``length`` tokens; returns the new upper node."""
    cut = self._pages_of(length)
    upper = Node(child.key[:length], child.pages[:cut], child.parent,
                 disk=child.disk[:cut], lock=child.lock, last_used=child.last_used)
    upper.children[self._first(child.key, length)] = child
    child.parent.children[self._first(child.key, 0)] = upper
    child.key, child.pages, child.parent = child.key[length:], child.pages[cut:], upper
    child.disk = child.disk[cut:]
    return upper

  def disk_path(self, node: Node) -> list[Node]:
    """The nodes on disk on the path to ``node`` (root first): they end it."""
    path = []
    while node is not self.root and node.disk:
      path.append(node)
      node = node.parent
    return path[::-1]

  @staticmethod
  def depth(node: Node) -> int:
    """Tokens on the path to ``node``, itself included."""
    tokens = 0
    while node is not None:
      tokens += len(node.key)
      node = node.parent
    return tokens

  def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[list[int], Node]:
    """Cache ``tokens`` (whole units) whose pages are ``pages``; returns (the pages
    the tree adopted: the caller adds a reference to each, the deepest node).
    Nodes of the path that are on disk adopt the caller's pages (their disk pages
    are freed): those hold the same K/V, read back or recomputed."""
    if len(tokens) % self.unit or len(pages) != self._pages_of(len(tokens)):
      raise ValueError(f"{len(tokens)} tokens and {len(pages)} pages are not whole units "
                       f"of {self.unit} tokens / {self.unit // self.page_size} pages")
    _, node = self.match_prefix(tokens)
    adopted = []
    for on_disk in self.disk_path(node):
      start = self._pages_of(self.depth(on_disk) - len(on_disk.key))
      on_disk.pages = list(pages[start:start + len(on_disk.disk)])
      self.disk.free(on_disk.disk)
      self.num_disk_pages -= len(on_disk.disk)
      self.num_pages += len(on_disk.pages)
      on_disk.disk = []
      adopted += on_disk.pages
    depth = self.depth(node)
    if depth == len(tokens):
      return adopted, node
    new = Node(tuple(tokens[depth:]), list(pages[self._pages_of(depth):]), node,
               last_used=self._stamp())
    node.children[self._first(new.key, 0)] = new
    self.num_pages += len(new.pages)
    self.version += 1
    return adopted + new.pages, new

  def holds(self, node: Node, pages: Sequence[int]) -> bool:
    """Whether ``node``'s host pages are those ``pages`` (a path's pages from the
    root) has at its depth. A node on disk holds none: nothing to share."""
    start = self._pages_of(self.depth(node) - len(node.key))
    return bool(node.pages) and node.pages == list(pages[start:start + len(node.pages)])

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

  def evict(self, num_pages: int, drop: Callable[[list[int]], int],
            spill: Callable[[list[int]], list[int]] | None = None,
            where: Callable[[list[int]], bool] | None = None) -> int:
    """Give up host pages of unlocked leaves (nodes whose children are all on
    disk), least recently used first, until ``drop`` (which releases the tree's
    references and returns the pages that became free) has freed ``num_pages``;
    returns the pages freed. With a disk tier and ``spill`` (host pages -> disk
    ids, the pages' contents written there) a leaf moves to disk, else it is
    forgotten with its subtree.

    ``where(pages)`` (data parallel: the device that needs pages): its leaves go
    first, since another device's pages would free nothing here. When they are not
    enough, an unlocked node it accepts that other devices' host pages below it keep
    from being a leaf goes too, least recently used first, with that subtree (a
    suffix cannot outlive its prefix)."""
    freed = self._evict_leaves(num_pages, drop, spill, where)
    while where is not None and freed < num_pages:
      order = self._tie_order()
      blocked = [(n.last_used, order[id(n)], n) for n in self._nodes()
                 if n.pages and not n.lock and where(n.pages)]
      if not blocked:
        break
      for node in self._host_post_order(min(blocked, key=lambda t: t[:2])[2]):
        freed += self._give_up(node, drop, spill)
      freed += self._evict_leaves(num_pages - freed, drop, spill, where)
    return freed

  def _evict_leaves(self, num_pages, drop, spill, where) -> int:
    evictable = lambda n: self._evictable(n) and (where is None or where(n.pages))
    order = self._tie_order()
    leaves = [(n.last_used, order[id(n)], n) for n in self._nodes() if evictable(n)]
    heapq.heapify(leaves)
    freed = 0
    while leaves and freed < num_pages:
      _, _, leaf = heapq.heappop(leaves)
      parent = leaf.parent
      freed += self._give_up(leaf, drop, spill)
      if evictable(parent):
        heapq.heappush(leaves, (parent.last_used, order[id(parent)], parent))
    return freed

  def _tie_order(self) -> dict[int, tuple[int, int]]:
    """id(node) -> (-depth, rank): among nodes of one LRU stamp (a matched path
    shares one) the deepest goes first, then the tree's own order. Never the
    objects' addresses: a restored engine (new objects, the same tree) must evict
    as the original would."""
    order, depth = {}, {id(self.root): 0}
    for rank, node in enumerate(self._nodes()):
      depth[id(node)] = depth[id(node.parent)] + 1
      order[id(node)] = (-depth[id(node)], rank)
    return order

  def _give_up(self, leaf: Node, drop, spill) -> int:
    """``leaf``'s host pages to disk (``spill``, room permitting) or forgotten with
    its subtree; returns what ``drop`` freed."""
    if spill is not None and self.disk is not None:
      self._make_disk_room(len(leaf.pages), keep=leaf)
      if self.disk.num_free >= len(leaf.pages):
        leaf.disk = spill(leaf.pages)
        self.num_disk_pages += len(leaf.disk)
    pages, leaf.pages = leaf.pages, []
    self.num_pages -= len(pages)
    if not leaf.disk:
      self._remove(leaf)
    return drop(pages)

  @staticmethod
  def _host_post_order(node: Node) -> list[Node]:
    """``node``'s subtree's nodes with host pages, every child before its parent."""
    out, stack = [], [node]
    while stack:
      n = stack.pop()
      if n.pages:
        out.append(n)
      stack.extend(c for c in n.children.values() if c.pages or c.children)
    return out[::-1]

  def _evictable(self, node: Node) -> bool:
    return (node is not self.root and not node.lock and bool(node.pages)
            and all(c.disk for c in node.children.values()))

  def _remove(self, node: Node) -> None:
    """Forget ``node`` and its subtree (on disk: their disk pages are freed)."""
    del node.parent.children[self._first(node.key, 0)]
    self.version += 1
    stack = [node]
    while stack:
      n = stack.pop()
      if n.disk:
        self.disk.free(n.disk)
        self.num_disk_pages -= len(n.disk)
      stack.extend(n.children.values())

  def _make_disk_room(self, num_pages: int, keep: Node) -> None:
    """Forget unlocked disk leaves, least recently used first, until the disk has
    ``num_pages`` free (never ``keep``'s subtree: it is about to join it)."""
    if num_pages > self.disk.num_pages or self.disk.num_free >= num_pages:
      return
    inside = set()
    stack = [keep]
    while stack:
      n = stack.pop()
      inside.add(id(n))
      stack.extend(n.children.values())
    order = self._tie_order()
    leaves = [(n.last_used, order[id(n)], n) for n in self._nodes()
              if n.disk and not n.children and not n.lock and id(n) not in inside]
    heapq.heapify(leaves)
    while leaves and self.disk.num_free < num_pages:
      _, _, leaf = heapq.heappop(leaves)
      parent = leaf.parent
      self._remove(leaf)
      if parent.disk and not parent.children and not parent.lock:
        heapq.heappush(leaves, (parent.last_used, order[id(parent)], parent))

  def _nodes(self):
    stack = [self.root]
    while stack:
      node = stack.pop()
      if node is not self.root:
        yield node
      stack.extend(node.children.values())

  def evictable_pages(self, group: Callable[[list[int]], int] = lambda pages: 0
                      ) -> dict[int, list[int]]:
    """Host pages ``evict`` can give up when asked for all of them, by the group
    ``group(pages)`` of each node's pages (data parallel: the device): those of
    every unlocked node, under ``evict(where=<its group>)`` (a node is unlocked only
    when its whole subtree is)."""
    out: dict[int, list[int]] = {}
    for node in self._nodes():
      if node.pages and not node.lock:
        out.setdefault(group(node.pages), []).extend(node.pages)
    return out

  def held_pages(self) -> list[int]:
    """Every host page the tree references (tests: the pool's reference counts)."""
    return [p for n in self._nodes() for p in n.pages]

  def disk_pages(self) -> list[int]:
    """Every disk page the tree's nodes on disk hold (tests)."""
    return [p for n in self._nodes() for p in n.disk]
