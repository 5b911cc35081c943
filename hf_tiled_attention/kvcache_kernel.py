"""The bookkeeping of a ``flash_attn_with_kvcache`` call (flash_interface.py) in one cuTile
launch: the new tokens' K/V rows written into the paged cache through the block table, and the
key offsets and slot list of the varlen call that follows. In torch these are 16 of the 17
small kernels around the attention launch (the 17th, the output's zero fill, is gone too:
varlen's every_row), 48-64 us a call in a CUDA graph on an H100, half of a 268 MB step's
attention (perf-notes step 69).

Request ``b`` (``bid(0)``) has ``SeqLens[b]`` keys cached; its ``new`` tokens go to positions
``SeqLens[b] ..``, position ``p`` in slot ``Table[b, p // page] * page + p % page``. The varlen
call sees request ``b``'s keys at ``[b * row, b * row + length)`` of the slot list (the
table's rows expanded: ``Table[b, i] * page + o`` for the ``o``-th key of its ``i``-th page;
``row`` = max_pages * page, ``length`` = ``SeqLens[b] + new``), then an empty request up to
``(b + 1) * row``: ``CuK[2b] = b * row``, ``CuK[2b + 1] = b * row + length``. A padding
request (transformers pads a graph's batch with ``SeqLens`` -1) writes nothing and has no
keys."""

import cuda.tile as ct

from .varlen_kernel import Wide  # the cache may hold 2**31 elements or more

PAGE = 0      # the constants tuple C: slots per page
H_TILE = 1    # kv heads, rounded up to a power of two (extra rows neither read nor written)
D_TILE = 2    # head dim, likewise
PAGES_TILE = 3  # the slot list's tiles: pages (table entries) x
SLOT_TILE = 4   # slots of a page (powers of two; rows and columns past the table's masked)


def append_new_tokens(Table, SeqLens, KNew, VNew, KSlots: Wide, VSlots: Wide, CuK, Slots,
                      C: ct.Constant):
    """Table ``(B, max_pages)`` and SeqLens ``(B,)`` int32/64; KNew, VNew ``(B, new, Hkv, D)``;
    KSlots, VSlots the cache ``(pages * page, Hkv, D)``; CuK ``(2B + 1,)`` int32 (or longer:
    the rows past ``2B`` are not written); Slots ``(B * max_pages, page)`` int64, the slot
    list as a page per row."""
    b = ct.bid(0)
    _expand_table_row(Table, Slots, b, C)
    new = KNew.shape[1]
    cached = ct.load(SeqLens, index=(b,), shape=(1,)).item()
    row = Table.shape[1] * C[PAGE]   # slots per block-table row
    start = b * row
    one = ct.full((1,), 1, dtype=ct.int32)
    ct.store(CuK, index=(2 * b,), tile=one * start)
    length = max(cached + new, 0)   # SeqLens' dtype (int64 from a torch.tensor of ints)
    ct.store(CuK, index=(2 * b + 1,), tile=(one * (start + length)).astype(ct.int32))
    if b == SeqLens.shape[0] - 1:
        ct.store(CuK, index=(2 * b + 2,), tile=one * (start + row))
    if cached >= 0:
        for t in range(new):
            position = cached + t
            block = ct.load(Table, index=(b, position // C[PAGE]), shape=(1, 1)).item()
            slot = block * C[PAGE] + position % C[PAGE]
            _copy_row(KNew, KSlots, b, t, slot, C)
            _copy_row(VNew, VSlots, b, t, slot, C)


def _expand_table_row(Table, Slots, b, C):
    """Request ``b``'s rows of the slot list: ``Table[b, i] * page + o`` at ``(i, o)``."""
    max_pages = Table.shape[1]
    mine = Slots.slice(axis=0, start=b * max_pages, stop=(b + 1) * max_pages)
    column = ct.arange(C[SLOT_TILE], dtype=ct.int64)[None, :]
    for i in range(ct.cdiv(max_pages, C[PAGES_TILE])):
        blocks = ct.load(Table, index=(b, i), shape=(1, C[PAGES_TILE]),
                         padding_mode=ct.PaddingMode.ZERO)
        first = ct.transpose(blocks).astype(ct.int64) * C[PAGE]        # (PAGES_TILE, 1)
        for o in range(ct.cdiv(C[PAGE], C[SLOT_TILE])):
            ct.store(mine, index=(i, o), tile=first + (column + o * C[SLOT_TILE]))


def _copy_row(New, Slots, b, t, slot, C):
    """New token ``t`` of request ``b`` (all its kv heads) into cache slot ``slot``."""
    rows = ct.load(New, index=(b, t, 0, 0), shape=(1, 1, C[H_TILE], C[D_TILE]),
                   padding_mode=ct.PaddingMode.ZERO)
    ct.store(Slots, index=(slot, 0, 0), tile=rows.reshape((1, C[H_TILE], C[D_TILE])))


append_new_tokens_kernel = ct.kernel(append_new_tokens)
