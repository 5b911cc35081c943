"""cuTile kernels of FP8 attention's quantisation: :func:`hf_tiled_attention.fp8.quantize`'s
rounding on the GPU in one pass over Q, K and V (the torch version makes about ten passes in
fp32, more time than the attention kernel itself at 8k tokens).

The sequence-wide statistics come first, from torch reductions that read the 16-bit inputs once
(Q's and K's means, V's largest magnitude per channel); then one block per tile of tokens of one
head:

* :func:`quantize_rows` (Q, and K with its bias rows): the row less its mean, times the random
  orthogonal matrix, one scale per token (its largest magnitude / 448), rounded to e4m3. The
  matrix is passed as its +-1 pattern in bf16 (exact) and the row split into a bf16 head and a
  bf16 remainder, so the two MMAs give the fp32 product to about 2**-16; the 1/sqrt(D) is
  applied in fp32 after. For K it also writes ``mean(q) . k`` for each query head of the group,
  from the centred fp32 row (the scores' exact part).
* :func:`quantize_values` (V): each channel divided by its scale, rounded to e4m3, and stored
  transposed, ``(B, Hkv, D, Skv rounded up to 16)``, the K-major layout the P V product wants;
  the keys past the sequence are written as zeros (a tile's rows past the end load as zeros).
"""

import cuda.tile as ct

from .kernel_params import AMAX_FLOOR, E4M3_MAX

# The constants tuple C (fp8.py builds it).
TILE_T = 0    # tokens per block
TILE_D = 1    # head dim rounded up to a power of two (extra columns read as zeros)
GROUP = 2     # quantize_rows: query heads per key head whose bias rows to write (0: none)
CONSTANTS = 3  # the tuple's length


def token_tile(X, C):
    """(tile, head, batch, this block's (T, D) fp32 tile of X), rows past the end zeros."""
    T = C[TILE_T]
    D = C[TILE_D]
    tile = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    x = ct.load(X, index=(batch, head, tile, 0), shape=(1, 1, T, D),
                padding_mode=ct.PaddingMode.ZERO).reshape((T, D)).astype(ct.float32)
    return tile, head, batch, x


def _channels(Stat, batch, head, D):
    """A ``(B, H, D)`` statistic's row as a (1, D) tile, padded channels zero."""
    return ct.load(Stat, index=(batch, head, 0), shape=(1, 1, D),
                   padding_mode=ct.PaddingMode.ZERO).reshape((1, D))


def quantize_rows(X, Mean, Rot, X8, Scale, QMean, Bias, inv_sqrt_d: float, C: ct.Constant):
    T = C[TILE_T]
    D = C[TILE_D]
    tile, head, batch, x = token_tile(X, C)
    centred = x - _channels(Mean, batch, head, D)
    high = centred.astype(ct.bfloat16)
    low = (centred - high.astype(ct.float32)).astype(ct.bfloat16)
    rot = ct.load(Rot, index=(0, 0), shape=(D, D))
    rotated = ct.mma(high, rot, ct.full((T, D), 0.0, dtype=ct.float32))
    rotated = ct.mma(low, rot, rotated) * inv_sqrt_d
    amax = ct.max(ct.abs(rotated), axis=-1, keepdims=True)
    amax = ct.maximum(amax, AMAX_FLOOR)
    scale = amax / E4M3_MAX
    # times the reciprocal, not divided per element (an IEEE division is a call per element);
    # a value may land one ulp from torch's x / scale, and round to the other e4m3 neighbour
    # where that ulp crosses the midpoint
    x8 = ct.minimum(ct.maximum(rotated * (E4M3_MAX / amax), -E4M3_MAX), E4M3_MAX)
    x8 = x8.astype(ct.float8_e4m3fn)
    ct.store(X8, index=(batch, head, tile, 0), tile=x8.reshape((1, 1, T, D)))
    ct.store(Scale, index=(batch, head, tile), tile=scale.reshape((1, 1, T)))
    for g in range(C[GROUP]):
        # mean(q) . k for query head head * GROUP + g: the part of its scores Q's rounding
        # leaves out, from the unrotated fp32 row (the rotation does not change a dot product)
        q_head = head * C[GROUP] + g
        bias = ct.sum(centred * _channels(QMean, batch, q_head, D), axis=-1)
        ct.store(Bias, index=(batch, q_head, tile), tile=bias.reshape((1, 1, T)))


def quantize_values(V, VScale, Vt8, C: ct.Constant):
    T = C[TILE_T]
    D = C[TILE_D]
    tile, head, batch, v = token_tile(V, C)
    scale = _channels(VScale, batch, head, D)
    inverse = ct.where(scale == 0.0, 0.0, 1.0 / scale)  # 0: the padded channels
    v8 = ct.minimum(ct.maximum(v * inverse, -E4M3_MAX), E4M3_MAX).astype(ct.float8_e4m3fn)
    ct.store(Vt8, index=(batch, head, 0, tile), tile=ct.transpose(v8).reshape((1, 1, D, T)))


quantize_rows_kernel = ct.kernel(quantize_rows)
quantize_values_kernel = ct.kernel(quantize_values)
