"""How a kernel tile's rows map onto the query-shaped arrays (Q, Out, Lse and the key splits'
partial results), shared by the attention kernel and the split merge.

A tile holds ``ROWS`` consecutive query positions of one head (``G_TILE`` 1: arrays
``(B, H, Sq, ...)``), or ``ROWS`` positions x ``G_TILE`` query heads of one key/value head
(``G_TILE`` > 1: arrays ``(B, Hkv, Sq, group, ...)``, heads fastest within a position). Loads
past Sq or the group read zeros (LSE: -inf); stores there are dropped.
"""

import cuda.tile as ct


def load_rows(Q, batch, head, m_tile, column, ROWS, G_TILE, WIDTH):
    """The ``(ROWS * G_TILE, WIDTH)`` tile at column tile ``column`` (in units of WIDTH)."""
    if G_TILE > 1:
        tile = ct.load(Q, index=(batch, head, m_tile, 0, column),
                       shape=(1, 1, ROWS, G_TILE, WIDTH), padding_mode=ct.PaddingMode.ZERO)
    else:
        tile = ct.load(Q, index=(batch, head, m_tile, column), shape=(1, 1, ROWS, WIDTH),
                       padding_mode=ct.PaddingMode.ZERO)
    return tile.reshape((ROWS * G_TILE, WIDTH))


def store_rows(Out, batch, head, m_tile, column, tile, ROWS, G_TILE, WIDTH):
    """Stores a ``(ROWS * G_TILE, WIDTH)`` fp32 tile where :func:`load_rows` reads it."""
    if G_TILE > 1:
        ct.store(Out, index=(batch, head, m_tile, 0, column),
                 tile=tile.reshape((1, 1, ROWS, G_TILE, WIDTH)).astype(Out.dtype))
    else:
        ct.store(Out, index=(batch, head, m_tile, column),
                 tile=tile.reshape((1, 1, ROWS, WIDTH)).astype(Out.dtype))


def store_lse(Lse, batch, head, m_tile, lse, ROWS, G_TILE):
    """Stores a ``(ROWS * G_TILE, 1)`` LSE column: ``(1, 1, ROWS[, G_TILE])`` of the Lse array.
    Plain stores, not TMA: a few bytes per tile."""
    if G_TILE > 1:
        ct.store(Lse, index=(batch, head, m_tile, 0), tile=lse.reshape((1, 1, ROWS, G_TILE)),
                 allow_tma=False)
    else:
        ct.store(Lse, index=(batch, head, m_tile), tile=lse.reshape((1, 1, ROWS)),
                 allow_tma=False)
