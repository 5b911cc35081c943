"""FP8 (e4m3) attention: an opt-in forward, bf16/fp16 in and out, both matrix products on the
FP8 tensor cores (fp8_kernel.py), and its CPU twin that rounds exactly as the kernel does.

How the inputs become e4m3 (:func:`quantize`: fp8_quant_kernel.py on a GPU, torch ops
elsewhere, :func:`quantize_torch`), chosen with eval/fp8_numerics.py (perplexity of
SmolLM2-135M with each scheme as its attention; results in eval/results/fp8-numerics/):

* Q and K are multiplied by one random orthogonal matrix (random signs times a normalised
  Walsh-Hadamard matrix, seeded per head dim): ``q . k`` is unchanged and a few large channels
  spread over all of them (FlashAttention-3's incoherent processing);
* K's mean over the sequence (per batch row, head and channel) is subtracted first: each score
  of a query row shifts by the same ``q . mean(k)``, which softmax does not see, and K's
  rounding error falls on the smaller differences (SageAttention's smoothing);
* Q's mean over the sequence is taken out too, and its part of each score, ``mean(q) . k``,
  added back exactly: one fp32 bias per head and key (SageAttention2's smoothing of Q). A
  decode step's single query leaves nothing to round: its scores are that bias;
* Q and K get one scale per token (amax / 448), V one per channel (over the sequence);
* the probabilities, at most 1 after the running max is subtracted, are stored as e4m3 times
  448 inside the kernel.

FP8 MMAs want both operands contiguous along the summed dim: K is, for Q K^T; for P V that is
the key dim, so V is stored transposed, ``(B, Hkv, D, Skv)``, by the quantisation (one more
pass over V, no extra memory beyond its e4m3 copy).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .checks import check_inputs, check_options, check_sinks
from .kernel_params import AMAX_FLOOR, E4M3_MAX, LOG2E
from .launch import current_stream, launch_device, scaled_scores
from .memo import memoize
from .schedule import FP8_HINTS, fp8_quant_tokens, fp8_tiles, head_dim_tile

ROTATION_SEED = 0


class Fp8Inputs(NamedTuple):
    """Attention's inputs as the FP8 kernel reads them (:func:`quantize`)."""
    q8: torch.Tensor        # (B, Hq, Sq, Dp) e4m3, Dp the head dim's power-of-two tile
    q_scale: torch.Tensor   # (B, Hq, Sq) fp32
    k8: torch.Tensor        # (B, Hkv, Skv, Dp) e4m3, smoothed
    k_scale: torch.Tensor   # (B, Hkv, Skv) fp32
    k_bias: torch.Tensor    # (B, Hq, Skv) fp32: mean(q) . k, the scores' exact part
    vt8: torch.Tensor       # (B, Hkv, D, Skv rounded up to 16) e4m3, V transposed
    v_scale: torch.Tensor   # (B, Hkv, D) fp32


def fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                  is_causal: bool = False, scale: Optional[float] = None,
                  window: Optional[int] = None, softcap: Optional[float] = None,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scaled dot-product attention with e4m3 operands (forward only); returns
    ``(B, Hq, Sq, D)`` in the query's dtype.

    Arguments as :func:`hf_tiled_attention.tiled_attention` (no mask, no mods): query
    ``(B, Hq, Sq, D)``, key/value ``(B, Hkv, Skv, D)`` bf16 or fp16, ``D`` a multiple of 16 up
    to 256; ``is_causal`` bottom-right aligned; ``window``, ``softcap``, ``sinks`` ``(Hq,)``.
    On a GPU with FP8 tensor cores (sm_89 and newer) the kernel runs; on the CPU the same
    rounding is emulated tile by tile (:func:`reference`)."""
    scale = _check(query, key, value, is_causal, scale, window, softcap, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError("fp8_attention has no backward (it serves inference); train with "
                         "tiled_attention in bf16")
    from .op import kernel_available
    inputs = quantize(query, key, value)
    if query.is_cuda and kernel_available(query.device):
        return _launch(inputs, query, is_causal, scale, window, softcap, sinks)
    return reference(inputs, query.shape[-1], is_causal, scale, window, softcap,
                     sinks).to(query.dtype)


# ---------------------------------------------------------------------------------------------
# Quantisation (torch; the same on every device)
# ---------------------------------------------------------------------------------------------

def hadamard(dim: int, generator: torch.Generator) -> torch.Tensor:
    """A random orthogonal ``(dim, dim)`` fp32 matrix: random signs (from ``generator``) times
    the normalised Walsh-Hadamard matrix (``dim`` a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1
    return signs[:, None] * h / math.sqrt(dim)


@memoize(16)
def rotation(dim: int, device: torch.device) -> torch.Tensor:
    """The matrix Q and K are multiplied by: :func:`hadamard` drawn from ROTATION_SEED."""
    return hadamard(dim, torch.Generator().manual_seed(ROTATION_SEED)).to(device)


@memoize(16)
def rotation_signs(dim: int, device: torch.device) -> torch.Tensor:
    """:func:`rotation` times sqrt(dim): its +-1 pattern, exact in bf16 (the MMA operand of
    fp8_quant_kernel.py, which applies the 1/sqrt(dim) in fp32)."""
    return (rotation(dim, device) * math.sqrt(dim)).round().to(torch.bfloat16)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to e4m3 (nearest even, saturating at 448)."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _token_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(-1).clamp_min(AMAX_FLOOR) / E4M3_MAX
    return to_e4m3(x, scale[..., None]), scale


def quantize(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Fp8Inputs:
    """The e4m3 copies and scales of the module docstring: on a GPU with the kernels, one pass
    of fp8_quant_kernel.py after three torch reductions; elsewhere (CPU, meta tensors)
    :func:`quantize_torch`, the definition the kernels are tested against."""
    from .op import kernel_available
    if query.is_cuda and kernel_available(query.device):
        return _quantize_on_device(query, key, value)
    return quantize_torch(query, key, value)


def quantize_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Fp8Inputs:
    """:func:`quantize` in torch ops (fp32 math on 16-bit inputs)."""
    dim = query.shape[-1]
    padded = head_dim_tile(dim)
    rot = rotation(padded, query.device)
    pad = (0, padded - dim)
    batch, heads_q, _, _ = query.shape
    heads_kv, seq_kv = key.shape[1], key.shape[2]
    q = query.float()
    q_mean = q.mean(dim=2, keepdim=True)
    k = key.float()
    k = k - k.mean(dim=2, keepdim=True)
    # mean(q) . k per query head: the heads of a group share their kv head's keys
    k_bias = (q_mean.view(batch, heads_kv, heads_q // heads_kv, dim) @ k.transpose(2, 3))
    q8, q_scale = _token_scaled(torch.nn.functional.pad(q - q_mean, pad) @ rot)
    k8, k_scale = _token_scaled(torch.nn.functional.pad(k, pad) @ rot)
    v = value.float()
    v_scale = v.abs().amax(2).clamp_min(AMAX_FLOOR) / E4M3_MAX
    vt = torch.nn.functional.pad(v.transpose(2, 3), (0, -seq_kv % 16))
    vt8 = to_e4m3(vt, v_scale[..., None])
    return Fp8Inputs(q8, q_scale, k8, k_scale, k_bias.reshape(batch, heads_q, seq_kv), vt8,
                     v_scale)


def _quantize_on_device(query, key, value) -> Fp8Inputs:
    import cuda.tile as ct

    inputs, launches = quantize_launches(query, key, value)
    stream = current_stream(query.device)
    with launch_device(query.device):
        for kernel, grid, args in launches:
            ct.launch(stream, grid, kernel, args)
    return inputs


def sequence_statistics(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q's mean, K's mean, V's per-channel scale) over the sequence, ``(B, H, D)`` fp32: each
    one torch reduction reading the 16-bit input once (no fp32 copy)."""
    v_amax = torch.maximum(value.amax(2), value.amin(2).neg()).float()
    return (query.mean(2, dtype=torch.float32), key.mean(2, dtype=torch.float32),
            v_amax.clamp_min(AMAX_FLOOR) / E4M3_MAX)


def quantized_outputs(query, key, value, v_scale: torch.Tensor) -> Fp8Inputs:
    """The kernels' output tensors, unwritten (with V's scales, which the kernels read)."""
    (batch, heads_q, seq_q, dim), (heads_kv, seq_kv) = query.shape, key.shape[1:3]
    padded = head_dim_tile(dim)
    f32, e4m3 = dict(dtype=torch.float32, device=query.device), \
        dict(dtype=torch.float8_e4m3fn, device=query.device)
    return Fp8Inputs(
        torch.empty(batch, heads_q, seq_q, padded, **e4m3),
        torch.empty(batch, heads_q, seq_q, **f32),
        torch.empty(batch, heads_kv, seq_kv, padded, **e4m3),
        torch.empty(batch, heads_kv, seq_kv, **f32), torch.empty(batch, heads_q, seq_kv, **f32),
        torch.empty(batch, heads_kv, dim, seq_kv + -seq_kv % 16, **e4m3), v_scale)


def quantize_launches(query, key, value) -> tuple[Fp8Inputs, list[tuple]]:
    """``(the outputs, [(kernel, grid, arguments)])`` of fp8_quant_kernel.py's three launches
    (Q's rows, K's rows with the bias, V; one block per tile of tokens of one head), after the
    sequence statistics they read."""
    from . import fp8_quant_kernel as K
    q_mean, k_mean, v_scale = sequence_statistics(query, key, value)
    o = quantized_outputs(query, key, value, v_scale)
    batch, heads_q, seq_q, dim = query.shape
    heads_kv, seq_kv = key.shape[1], key.shape[2]
    padded = head_dim_tile(dim)
    tokens = fp8_quant_tokens(dim)
    signs = rotation_signs(padded, query.device)
    inv_sqrt = 1.0 / math.sqrt(padded)

    def constants(group):
        c = [0] * K.CONSTANTS
        c[K.TILE_T], c[K.TILE_D], c[K.GROUP] = tokens, padded, group
        return tuple(c)
    return o, [
        # Q writes no bias rows (GROUP 0): its QMean and Bias arguments are placeholders
        (K.quantize_rows_kernel, (-(-seq_q // tokens), heads_q, batch),
         (query, q_mean, signs, o.q8, o.q_scale, q_mean, o.q_scale, inv_sqrt, constants(0))),
        (K.quantize_rows_kernel, (-(-seq_kv // tokens), heads_kv, batch),
         (key, k_mean, signs, o.k8, o.k_scale, q_mean, o.k_bias, inv_sqrt,
          constants(heads_q // heads_kv))),
        (K.quantize_values_kernel, (-(-seq_kv // tokens), heads_kv, batch),
         (value, v_scale, o.vt8, constants(0))),
    ]


# ---------------------------------------------------------------------------------------------
# The CPU twin: the kernel's tile loop in fp32, its roundings exactly
# ---------------------------------------------------------------------------------------------

def reference(inputs: Fp8Inputs, head_dim: int, is_causal: bool, scale: float,
              window: Optional[int], softcap: Optional[float],
              sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 ``(B, Hq, Sq, head_dim)``: key tiles of the kernel's width in order, a running max,
    the probabilities rounded to e4m3 times 448 against the running max, as fp8_kernel.py."""
    q8, q_scale, k8, k_scale, k_bias, vt8, v_scale = inputs
    batch, heads_q, seq_q, _ = q8.shape
    heads_kv, seq_kv = k8.shape[1], k8.shape[2]
    group = heads_q // heads_kv
    tile_n = fp8_tiles(head_dim)[1]
    q = q8.float()
    k = k8.float().repeat_interleave(group, 1)
    ks = k_scale.repeat_interleave(group, 1)
    v = vt8.float()[..., :seq_kv].transpose(2, 3).repeat_interleave(group, 1)
    score_scale, softcap_out = scaled_scores(scale, softcap, LOG2E)
    qs = q_scale[..., None] * score_scale
    pos = torch.arange(seq_q, device=q.device)[:, None] + (seq_kv - seq_q)
    m = torch.full((batch, heads_q, seq_q, 1), -math.inf, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(batch, heads_q, seq_q, v.shape[-1], device=q.device)
    for lo in range(0, seq_kv, tile_n):
        hi = min(lo + tile_n, seq_kv)
        s = (q @ k[:, :, lo:hi].transpose(2, 3)) * qs * ks[:, :, None, lo:hi] + \
            k_bias[:, :, None, lo:hi] * score_scale
        if softcap:
            s = torch.tanh(s) * softcap_out
        keys = torch.arange(lo, hi, device=q.device)[None, :]
        seen = torch.ones_like(s, dtype=torch.bool)
        if is_causal:
            seen &= keys <= pos
        if window:
            seen &= keys > pos - window
            if not is_causal:
                seen &= keys < pos + window
        s = s.masked_fill(~seen, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        shift = torch.where(m_new == -math.inf, 0.0, m_new)
        p = torch.exp2(s - shift)
        alpha = torch.exp2(m - shift)
        l = l * alpha + p.sum(-1, keepdim=True)
        p8 = (p * E4M3_MAX).to(torch.float8_e4m3fn).float()
        acc = acc * alpha + p8 @ v[:, :, lo:hi]
        m = m_new
    if sinks is not None:
        sink = sinks.float().to(q.device)[None, :, None, None] * LOG2E
        m_new = torch.maximum(m, sink)
        l = l * torch.exp2(m - m_new) + torch.exp2(sink - m_new)
        acc = acc * torch.exp2(m - m_new)
    vs = v_scale.repeat_interleave(group, 1)[:, :, None, :] / E4M3_MAX
    empty = l == 0
    return torch.where(empty, 0.0, acc * vs / torch.where(empty, 1.0, l))[..., :head_dim]


# ---------------------------------------------------------------------------------------------
# Checks and the launch
# ---------------------------------------------------------------------------------------------

def _check(query, key, value, is_causal, scale, window, softcap, sinks) -> float:
    """The op's checks (checks.py), then FP8's own: 16-bit inputs, head dims whose e4m3 rows
    are whole 16-byte units, FP8 tensor cores. Returns the scale."""
    check_inputs(query, key, value)
    check_options(is_causal, scale, window, softcap, None, False)
    check_sinks(sinks, query)
    if query.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_attention: query, key and value must be bfloat16 or float16 (FP8 "
                         f"attention quantises 16-bit inputs; fp32 would lose its precision "
                         f"silently: use tiled_attention), got {query.dtype}")
    dim = query.shape[-1]
    if dim % 16:
        raise ValueError(f"fp8_attention: head dim must be a multiple of 16 from 16 to 256 (an "
                         f"e4m3 row a whole number of 16-byte units), got {dim}")
    if query.is_cuda and torch.cuda.get_device_capability(query.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(query.device)
        raise ValueError(f"fp8_attention needs FP8 tensor cores (sm_89 or newer); "
                         f"{query.device} is sm_{major}{minor}: use tiled_attention")
    return float(scale) if scale is not None else dim ** -0.5


def launch_args(inputs: Fp8Inputs, out: torch.Tensor, is_causal: bool, scale: float,
                window: Optional[int], softcap: Optional[float],
                sinks: Optional[torch.Tensor]) -> tuple:
    """``(grid, kernel arguments)`` of one launch (the constants tuple last)."""
    from . import fp8_kernel as K
    batch, heads_q, seq_q, padded = inputs.q8.shape
    heads_kv, seq_kv = inputs.k8.shape[1], inputs.k8.shape[2]
    tile_m, tile_n = fp8_tiles(out.shape[-1])
    constants = [0] * K.CONSTANTS
    constants[K.TILE_M], constants[K.TILE_N], constants[K.TILE_D] = tile_m, tile_n, padded
    constants[K.GROUP] = heads_q // heads_kv
    constants[K.CAUSAL], constants[K.WINDOWED] = bool(is_causal), window is not None
    constants[K.SOFTCAP], constants[K.SINKS] = softcap is not None, sinks is not None
    constants[K.FAST_ACC] = True
    scalars = scaled_scores(scale, softcap, LOG2E)
    sinks_arg = sinks.float() if sinks is not None else inputs.v_scale  # unread without SINKS
    # Query tiles rounded up to whole clusters (a block past the rows stores nothing).
    tiles = -(-seq_q // tile_m)
    clusters = FP8_HINTS.get("num_ctas", 1)
    grid = (-(-tiles // clusters) * clusters, heads_q, batch)
    arrays = (inputs.q8, inputs.q_scale, inputs.k8, inputs.k_scale, inputs.k_bias, inputs.vt8,
              inputs.v_scale, sinks_arg, out)
    return grid, arrays + scalars + (seq_kv - seq_q, int(window or 0), tuple(constants))


def _launch(inputs: Fp8Inputs, query: torch.Tensor, is_causal, scale, window, softcap,
            sinks) -> torch.Tensor:
    import cuda.tile as ct

    batch, heads, seq, dim = query.shape
    out = query.new_empty(batch, seq, heads, dim).transpose(1, 2)  # transformers' layout
    grid, args = launch_args(inputs, out, is_causal, scale, window, softcap, sinks)
    with launch_device(query.device):
        ct.launch(current_stream(query.device), grid, _kernel(), args)
    return out


@memoize(1)
def _kernel():
    """The kernel with its compiler hints (schedule.FP8_HINTS: one block per SM, 8 worker
    warps, no clusters)."""
    import cuda.tile as ct

    from .fp8_kernel import fp8_forward
    return ct.kernel(fp8_forward, **FP8_HINTS)


def export_cubin(query, key, value, *, arch: str, is_causal=False, scale=None, window=None,
                 softcap=None, sinks=None) -> bytes:
    """The attention kernel's cubin for these arguments (meta tensors are fine), built without
    a GPU."""
    scale = _check(query, key, value, is_causal, scale, window, softcap, sinks)
    inputs = quantize_torch(query, key, value)  # on meta tensors: shapes, dtypes, strides
    out = torch.empty(query.shape, dtype=query.dtype, device="meta")
    _, args = launch_args(inputs, out, is_causal, scale, window, softcap, sinks)
    return export_kernel_cubin(_kernel(), args, arch)


def export_quantize_cubins(query, key, value, *, arch: str) -> list[bytes]:
    """The quantisation kernels' cubins, one per launch (Q, K, V), for these arguments (meta
    tensors are fine), built without a GPU."""
    _check(query, key, value, False, None, None, None, None)
    return [export_kernel_cubin(kernel, args, arch) for kernel, _, args in
            quantize_launches(query, key, value)[1]]


def export_kernel_cubin(kernel, args: tuple, arch: str) -> bytes:
    """One kernel's cubin for a launch's arguments: tensors as launches see them, Python floats
    as fp32 and ints as int32 scalars, constants tuples (``ct.Constant`` parameters) as they
    are."""
    import io

    import cuda.tile as ct
    from cuda.tile.compilation import (CallingConvention, KernelSignature, ScalarConstraint,
                                       export_kernel)

    from .launch import array_constraint
    scalar = {float: ScalarConstraint(ct.float32), int: ScalarConstraint(ct.int32)}
    constraints = [array_constraint(a) if isinstance(a, torch.Tensor)
                   else a if isinstance(a, tuple) else scalar[type(a)] for a in args]
    signature = KernelSignature(constraints, CallingConvention.cutile_python_v2())
    buffer = io.BytesIO()
    export_kernel(kernel, [signature], buffer, gpu_code=arch, output_format="cubin")
    return buffer.getvalue()
