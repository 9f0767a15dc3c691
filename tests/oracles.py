"""Independent numpy oracles: plain loops and float64, written from the spec, not
from the library code."""

from __future__ import annotations

import numpy as np


def prompt_lookup_oracle(history):
  """Prompt lookup by brute force: the longest n <= 3 whose last n tokens occurred
  earlier gives (the token after the latest such occurrence, n); else (the last
  token, 0)."""
  for n in (3, 2, 1):
    starts = [s for s in range(len(history) - n) if history[s:s + n] == history[-n:]]
    if len(history) > n and starts:
      return history[max(starts) + n], n
  return history[-1], 0


def resolve_row_oracle(slot_pos, lru, selected, newest):
  """One (request, layer) RESOLVE step, as docs/DESIGN.md ("RESOLVE") describes it."""
  slot_pos = [int(x) for x in slot_pos]
  lru = [int(x) for x in lru]
  selected = [int(x) for x in selected]
  num_slots = len(slot_pos)
  wanted = [p for p in selected if p >= 0 and p != newest]
  holder = {p: s for s, p in enumerate(slot_pos) if p >= 0}
  hit_slots = [s for s in lru if slot_pos[s] >= 0 and slot_pos[s] != newest
               and slot_pos[s] in wanted]
  evictable = [s for s in lru if s not in hit_slots]
  misses = [p for p in wanted if p not in holder]
  assert len(misses) <= len(evictable)
  victims = evictable[:len(misses)]
  new_slot_pos = list(slot_pos)
  for s, p in zip(victims, misses):
    new_slot_pos[s] = p
  new_lru = evictable[len(misses):] + victims + hit_slots
  where = {p: s for p, s in zip(misses, victims)}
  slot_out, is_miss = [], []
  for p in selected:
    if p < 0:
      slot_out.append(-1); is_miss.append(False)
    elif p == newest:
      slot_out.append(num_slots); is_miss.append(False)
    elif p in where:
      slot_out.append(where[p]); is_miss.append(True)
    else:
      slot_out.append(holder[p]); is_miss.append(False)
  return (np.array(new_slot_pos, np.int32), np.array(new_lru, np.int32),
          np.array(slot_out, np.int32), np.array(is_miss, bool))


def resolve_oracle(slot_pos, lru, selected, newest):
  """Batched over leading dims."""
  slot_pos, lru, selected = map(np.asarray, (slot_pos, lru, selected))
  newest = np.broadcast_to(np.asarray(newest), slot_pos.shape[:-1])
  batch = slot_pos.shape[:-1]
  outs = [resolve_row_oracle(slot_pos[i], lru[i], selected[i], int(newest[i]))
          for i in np.ndindex(*batch)]
  return tuple(np.stack([o[j] for o in outs]).reshape(batch + outs[0][j].shape)
               for j in range(4))


def sparse_attention_oracle(q, k_full, v_full, positions):
  """float64 attention of one query token over selected positions.

  q: [Hq, D]; k_full, v_full: [T, Hkv, D]; positions: [Hkv-units..] flattened as
  [U, k] with U dividing Hkv (unit u owns KV heads u*Hg..(u+1)*Hg-1); -1 = padding.
  Returns [Hq, D].
  """
  q = np.asarray(q, np.float64)
  k_full = np.asarray(k_full, np.float64)
  v_full = np.asarray(v_full, np.float64)
  positions = np.asarray(positions)
  num_q, head_dim = q.shape
  num_kv = k_full.shape[1]
  group = num_q // num_kv
  units = positions.shape[0]
  per_unit = num_kv // units
  out = np.zeros((num_q, head_dim))
  for h in range(num_q):
    kvh = h // group
    pos = [int(p) for p in positions[kvh // per_unit] if p >= 0]
    logits = np.array([q[h] @ k_full[p, kvh] for p in pos]) / np.sqrt(head_dim)
    w = np.exp(logits - logits.max())
    w /= w.sum()
    out[h] = sum(wi * v_full[p, kvh] for wi, p in zip(w, pos))
  return out
