"""What the cuTile kernels and the host share: the kernels' compile-time constants, declared
once, and the numbers both sides must agree on (mask kinds, tile states, block-table slots,
score units).

Pure Python (no torch, no cuTile), so the host imports it without a GPU toolchain and the
kernels import it as cuTile code. The attention kernel takes its constants as ONE
``ct.Constant`` parameter, an :class:`AttentionConstants` tuple, and reads a field as
``C[P.NAME]`` (``P`` this module): each field's index is a module constant of the same name,
derived from the declaration below, so adding a field is one line here. The forward's split
entry also takes a :class:`MergeConstants` tuple ``M``, read the same way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
E4M3_MAX = 448.0  # float8_e4m3fn's largest value (the FP8 kernel and its host side)
AMAX_FLOOR = 1e-30  # the largest magnitude an all-zero row is scaled by (its e4m3 values are
                    # zeros either way; a zero would make its scale's reciprocal infinite)
# The FP8 cache's scale is amax times this (a product rounds the same in a kernel and in torch;
# tileiras turns a division by a constant into one, so amax / 448 differed by an ulp)
SCALE_PER_AMAX = 1.0 / E4M3_MAX

# How a call's mask reaches the kernel (AttentionConstants.MASK_KIND).
NO_MASK = 0
BOOL_MASK = 1       # a bool tensor, read as uint8
ADDITIVE_MASK = 2   # a float tensor added to the scores; -inf hides a key
MASK_MOD = 3        # a translated mask_mod (mods.py), evaluated on partial tiles

# Per (query tile, key tile) state in a block table (masks.BlockTable.states).
TILE_EMPTY = 0      # nothing visible: the tile is skipped
TILE_PARTIAL = 1    # some keys hidden: the mask is applied per element
TILE_FULL = 2       # every key visible with zero bias: the mask is not even read

# How the backward's dK/dV kernel writes an additive mask's gradient (AttentionConstants
# .MASK_GRAD): not at all, a tile per (query tile, key tile), or a tile's sum over its rows.
NO_MASK_GRAD = 0
MASK_GRAD_ROWS = 1
MASK_GRAD_ROW_SUMS = 2

# Slots of a query tile's key-tile ranges in a block table (masks.BlockTable.ranges).
RANGE_FIRST = 0     # its first non-empty key tile
RANGE_GAP_LO = 1    # [GAP_LO, GAP_HI): its longest run of empty tiles before the full run
RANGE_GAP_HI = 2
RANGE_FULL_LO = 3   # [FULL_LO, FULL_HI): its longest run of full tiles
RANGE_FULL_HI = 4
RANGE_END = 5       # one past its last non-empty key tile
RANGE_ORDER = 6     # in row r: the row with the r-th most walked tiles (ties by index): the
                    # backward's blocks take their tiles longest first (BackwardSchedule
                    # .table_order)
RANGE_SLOTS = 7


class AttentionConstants(NamedTuple):
    """The attention kernel's compile-time constants (one kernel variant per distinct tuple)."""
    GROUP: int          # grid heads per key/value head: query heads, or with G_TILE > 1
                        # packed tiles (1; MQA's 32 heads as two tiles of 16: 2)
    G_TILE: int         # 1, or decode: a kv head's query heads as rows, padded to a power of 2
    TILE_M: int         # query rows per tile (positions x G_TILE heads)
    TILE_N: int         # keys per inner-loop step
    TILE_D: int         # head dim rounded up to a power of two (loads pad with zeros), or its
                        # leading power-of-two part when TAIL_D > 0
    TAIL_D: int         # 0, or the rest of the head dim as a second tile (80 = 64 + 16)
    CAUSAL: bool
    WINDOWED: bool
    SOFTCAP: bool
    APPROX_TANH: bool   # softcap's tanh: the hardware's approximate one (16-bit inputs)
    SCORE_MOD: bool     # scores pass through the translated score_mod
    SCORE_MOD_GRAD: bool  # backward: dS is multiplied by the score_mod's derivative (a mod
                          # that is not additive: mod_derivative)
    MASK_KIND: int      # NO_MASK, BOOL_MASK, ADDITIVE_MASK, MASK_MOD
    MASK_BATCHED: bool  # the mask has a batch dim of size B (else 1)
    MASK_HEADED: bool   # the mask has a head dim of size Hq (else 1)
    MASK_ROWS: bool     # the mask has one row per query (else one row for all queries)
    MASK_TABLE: bool    # TileState / TileRange hold the mask's block table (else the mask is
                        # applied on every visited tile; only for a key vector)
    SCORE_UNIT: float   # LOG2E: scores kept in log2 units; 1.0: natural units
    FOLD_SCALE: bool    # score_scale > 0 applied inside the exponent (no softcap or bias)
    WRITE_LSE: bool
    HEAVY_FIRST: bool   # causal: launch the longest query tiles first
    K_LATENCY: int      # load latency hints (Schedule.k_latency / v_latency)
    V_LATENCY: int
    LOAD_TRANSPOSED: bool  # backward: a tile needed as a transposed MMA operand is loaded
                           # transposed (a second load) instead of ct.transpose'd
    MASK_GRAD: int      # backward's dK/dV kernel: NO_MASK_GRAD, or it adds the additive mask's
                        # gradient (dS) to DMask per row (MASK_GRAD_ROWS) or as each query
                        # tile's row sum (MASK_GRAD_ROW_SUMS: a mask with one row)
    DQ_ADD: bool        # backward's dK/dV kernel also makes dQ, added into an fp32 array by
                        # TMA reduce-add (no dQ kernel; not bitwise reproducible)
    CAPTURE_GRADS: int  # backward's dK/dV kernel: a bit per captured tensor of the score_mod
                        # whose gradient it adds into an array its capture tuple holds after
                        # the tensors (mod_translator.capture_grad_entries); 0: none
    CAPTURE_PARTIALS: bool  # those arrays have one row per block of the dK/dV grid, which
                            # only that block adds into (deterministic mode; torch sums them)
    TABLE_ORDER: bool   # backward, a mask with a row per query: block i takes the table's row
                        # RANGE_ORDER of row i (longest walk first)
    EDGE_STATES: bool   # backward, a mask with a row per query: an edge step reads its tile's
                        # state and skips an empty tile (else it applies the mask unread,
                        # without a data-dependent branch: BackwardSchedule.edge_states)
    PDL: bool           # backward: launched as a programmatic dependent of the kernel before
                        # it; waits for it only before reading its rows (BackwardSchedule.pdl)
    UNCHECKED: bool     # backward: a step's LSE / Delta rows and block-table states are loaded
                        # without bounds checks (BackwardSchedule.unchecked_loads; the Delta
                        # kernel writes its rows padded to whole tiles)


class MergeConstants(NamedTuple):
    """The attention kernel's split entry's second constants tuple: how its last block per
    query tile merges the key splits (merge.py)."""
    MERGE_ROWS: int     # query positions merged at a time (a power of two dividing the tile's)
    SPLIT_TILE: int     # slices read per load
    CHUNK_D: int        # head-dim columns merged at a time
    D_CHUNKS: int       # CHUNK_D * D_CHUNKS >= the head dim
    MERGE_LSE: bool     # also store the merged LSE (the call returns it)


# C[P.CAUSAL], M[P.SPLIT_TILE] and friends: each field's index under its own name (so the two
# tuples' field names must differ).
assert not set(AttentionConstants._fields) & set(MergeConstants._fields)
for _index, _name in [*enumerate(AttentionConstants._fields),
                      *enumerate(MergeConstants._fields)]:
    globals()[_name] = _index
del _index, _name
