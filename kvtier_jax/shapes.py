"""The one shape glossary of kvtier_jax, pallas_kernels and models.

Dimension letters used in shape comments (``# i32[L, R, U, B]``) and in the
jaxtyping aliases below:

* ``L``   layers that own a tiered cache.
* ``R``   request slots in the batch.
* ``T``   positions per request at most (``max_len``).
* ``Pg``  positions per host page; ``MP = ceil(T / Pg)`` pages per request;
          ``NH`` pages in the host pool (one more, the scratch page, absorbs
          writes that must not land).
* ``U``   cache units per request: 1 when one selection serves all KV heads of a
          request (DSA, SGLang-Quest), ``Hkv`` when each KV head selects its own
          positions (original Quest, NSA per group). Each unit has its own hot
          slots, LRU and selection.
* ``Hg``  KV heads per unit (``Hkv // U``).
* ``Hkv`` KV heads (``U * Hg``); ``G`` query heads per KV head; ``Hq = Hkv * G``.
* ``D``   head dimension.
* ``B``   hot slots per (layer, request, unit). Physical slot ``B`` (the
          ``B + 1``-th) is reserved for the newest token and never in the LRU.
* ``k``   positions selected per (layer, request, unit) per decode step
          (the sparse-attention budget), ``B >= k``.
* ``P``   prompt length (padded) at prefill.
* ``Dm``  model (residual) width; selectors read the layer's normalised input [R, Dm].
* ``NP`` / ``NB`` / ``NC``  Quest pages / NSA selection blocks / NSA compression
          blocks per request; ``H_I``, ``d_I`` DSA index heads and index dim.
* ``S``   slots of a selector's ring of recent raw keys (``selectors.base.write_recent``):
          Quest's page size, NSA's compression block.

A *row* is the KV of one position for one unit: ``[Hg, D]``. The host tier is a
page pool ``[L, NH + 1, Pg, U, Hg, D]`` (a position's rows for all units are
contiguous) read through the page table ``i32[R, MP]``; the hot cache is
``[L, R, U, B + 1, Hg, D]``.

The single sentinel is ``-1`` (``EMPTY``): an empty slot in ``slot_pos``, a padding
entry in ``selected``, "no slot" in resolve outputs.
"""

from jaxtyping import Array, Float, Int

EMPTY = -1

HostKV = Float[Array, "L NHp1 Pg U Hg D"]
HotKV = Float[Array, "L R U Bp1 Hg D"]
SlotPos = Int[Array, "*batch B"]
LruOrder = Int[Array, "*batch B"]
Selected = Int[Array, "*batch k"]
Newest = Int[Array, "*batch"]

__all__ = ["EMPTY", "HostKV", "HotKV", "SlotPos", "LruOrder", "Selected", "Newest"]
