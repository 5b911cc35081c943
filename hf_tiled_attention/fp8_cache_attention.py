"""Attention over an FP8 cache's rows (fp8_cache.py), as "tiled" and "tiled_fp8" call it.

A call whose keys and values are FP8 rows (``uint8``) comes to :func:`attend_cache_rows`:

* a decode step (at most DECODE_QUERY_ROWS queries) with what the decode kernel computes
  (causal / window at any offset, a key padding or a one-row static-cache mask, softcap, sinks,
  GQA) on a GPU with FP8 conversion (sm_89 and newer) runs fp8_cache_kernel.py: the rows are
  read once, at 8 bits, never dequantised into memory. Eager calls launch directly; traced ones
  (torch.compile, CUDA graphs) go through the registered op ``hf_tiled_attention::
  fp8_cache_decode``, whose fake gives the shapes;
* every other call (a prefill, masks with more in them, the CPU) attends to the dequantised
  keys and values through the layer's own attention function: the same semantics.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from .fp8_cache import (check_rows, dequantize_rows, is_fp8_rows, key_rotation, keys_from_rows,
                        row_head_dim, rows_like, split_rows)
from .kernel_params import LOG2E, MergeConstants
from .launch import (BufferViews, buffer_views, current_stream, group_rows, kv_splits,
                     launch_device, merge_constants, next_power_of_two, packed_group_tile,
                     scaled_scores, split_buffers)
from .layer_call import LayerCall, read_call, route_for
from .memo import memoize
from .reference import empty_output
from .schedule import (DECODE_QUERY_ROWS, FP8_CACHE_KEYS, FP8_CACHE_LATENCY,
                       FP8_CACHE_OCCUPANCY, FP8_CACHE_PV_PARTS, FP8_CACHE_QK_PARTS,
                       FP8_CACHE_QUANT_TOKENS, FP8_CACHE_ROWS, Schedule, fp8_cache_pv_fast_acc,
                       head_dim_tile)

__all__ = ["attend_cache_rows", "cache_kernels_run_on", "decode", "decode_plan", "decode_step"]

# What launch.py's packing and key-split rules read of a schedule: pack GQA heads into a tile,
# split the keys automatically.
_DECODE = Schedule(pack_gqa=True, kv_splits=0)


@memoize(64)
def cache_kernels_run_on(device: torch.device) -> bool:
    """Whether the cache's kernels run on ``device``: the cuTile kernels' own conditions, and
    e4m3 conversion in hardware (sm_89 and newer)."""
    from .op import kernel_available
    return kernel_available(device) and torch.cuda.get_device_capability(device) >= (8, 9)


# ---------------------------------------------------------------------------------------------
# The adapters' entry
# ---------------------------------------------------------------------------------------------

def attend_cache_rows(forward: Callable, module: torch.nn.Module, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, attention_mask,
                      scaling: Optional[float], dropout: float, kwargs: dict
                      ) -> tuple[torch.Tensor, None]:
    """An attention function's call whose ``key`` / ``value`` are FP8 rows: the decode kernel
    where it computes the call, else ``forward`` (the calling adapter's own function) on the
    dequantised keys and values. Returns ``(out (B, Sq, Hq, D), None)``."""
    if not is_fp8_rows(value):
        raise ValueError(f"key is an FP8 cache's rows (uint8) but value is {value.dtype}: both "
                         "come from one Fp8DynamicCache / Fp8StaticCache")
    head_dim = check_rows(key, "key")
    check_rows(value, "value")
    if head_dim != query.shape[-1]:
        raise ValueError(f"key rows hold head dim {head_dim}, the query has {query.shape[-1]}")
    if _decodes(module, query, value, dropout, kwargs):
        call = read_call(module, query, key, attention_mask, scaling, kwargs)
        key_mask = _key_mask(call, query, key)
        if _kernel_computes(call, key_mask):
            return decode_step(query, key, value, key_mask, causal=call.causal,
                               scale=call.scale, window=call.window, softcap=call.softcap,
                               diag_offset=call.diag_offset,
                               sinks=call.sinks).transpose(1, 2), None
    return forward(module, query, keys_from_rows(key, query.dtype),
                   dequantize_rows(value, query.dtype), attention_mask, scaling=scaling,
                   dropout=dropout, **kwargs)


def _decodes(module, query: torch.Tensor, value: torch.Tensor, dropout: float,
             kwargs: dict) -> bool:
    """Whether the call is a decode step the kernel may take, before its mask is read: the
    rest (weights, dropout in training, autograd, context parallelism) goes to ``forward``,
    which computes it or names what it does not."""
    return (query.is_cuda and query.shape[2] <= DECODE_QUERY_ROWS
            and query.dtype in (torch.bfloat16, torch.float16)
            and row_head_dim(value) == query.shape[-1] and query.shape[-1] <= 256
            and cache_kernels_run_on(query.device)
            and not kwargs.get("output_attentions") and not (dropout and module.training)
            and not (torch.is_grad_enabled() and query.requires_grad)
            and not any(kwargs.get(name) is not None for name in ("indices", "block_indices"))
            and route_for(kwargs.get("position_ids")) is None)


def _key_mask(call: LayerCall, query: torch.Tensor, key: torch.Tensor
              ) -> Optional[torch.Tensor]:
    """The call's mask as the kernel's ``(B, 1, 1, Skv)`` bool key mask, when it is one (a key
    padding vector, or a static cache's one-row mask), else None."""
    mask = call.mask
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 \
            or mask.shape[2] != 1 or mask.shape[3] != key.shape[2] \
            or mask.shape[0] not in (1, query.shape[0]):
        return None
    return mask


def _kernel_computes(call: LayerCall, key_mask: Optional[torch.Tensor]) -> bool:
    """Whether the decode kernel computes the call's mask: its rule and at most a key mask."""
    return (call.mods is None and call.documents is None and call.position_bias is None
            and (call.mask is None or key_mask is not None))


# ---------------------------------------------------------------------------------------------
# The decode step
# ---------------------------------------------------------------------------------------------

def decode_step(query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                key_mask: Optional[torch.Tensor] = None, *, causal: bool = True,
                scale: Optional[float] = None, window: Optional[int] = None,
                softcap: Optional[float] = None, diag_offset: Optional[int] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``query`` over a cache's key rows (fp8_cache.quantize_keys: rotated where
    the head dim is a power of two) and value rows: the query rotated the same way (one small
    matmul) and the scale divided by ``D`` (``S S^T = D I``), then :func:`decode`."""
    dim = query.shape[-1]
    scale = float(scale) if scale is not None else dim ** -0.5
    signs = key_rotation(dim, query.device, query.dtype)
    if signs is not None:
        query, scale = query @ signs, scale / dim
    return decode(query, key_rows, value_rows, key_mask, causal=causal, scale=scale,
                  window=window, softcap=softcap, diag_offset=diag_offset, sinks=sinks)


def decode(query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
           key_mask: Optional[torch.Tensor] = None, *, causal: bool = True,
           scale: Optional[float] = None, window: Optional[int] = None,
           softcap: Optional[float] = None, diag_offset: Optional[int] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``query`` ``(B, Hq, Sq <= 16, D)`` (bf16/fp16, on a GPU the cache kernels
    run on) over the rows ``(B, Hkv, Skv, D + 16)``: the output ``(B, Hq, Sq, D)`` laid out as
    ``(B, Sq, Hq, D)``. ``key_mask`` ``(B or 1, 1, 1, Skv)`` bool hides keys; query row ``i``
    sits at key position ``i + diag_offset`` (default: bottom-right, ``Skv - Sq``)."""
    args = (key_mask,) + _step_arguments(query, key_rows, causal, scale, window, softcap,
                                         diag_offset)
    if torch.compiler.is_compiling():
        out, lse = torch.ops.hf_tiled_attention.fp8_cache_decode(query, key_rows, value_rows,
                                                                   *args)
    else:
        out, lse = _decode_launch(query, key_rows, value_rows, *args, eager=True)
    if sinks is not None:
        from .op import with_sinks
        out, _ = with_sinks(out, lse, sinks)
    return out


def _step_arguments(query, key_rows, causal, scale, window, softcap, diag_offset) -> tuple:
    """``(causal, scale, window, softcap, diag_offset)`` as the launches take them: the scale
    ``1/sqrt(D)`` and the bottom-right diagonal by default, 0 for no window or softcap."""
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    if diag_offset is None:
        diag_offset = key_rows.shape[2] - query.shape[2]
    return bool(causal), scale, int(window or 0), float(softcap or 0.0), int(diag_offset)


@torch.library.custom_op("hf_tiled_attention::fp8_cache_decode", mutates_args=())
def _decode_op(query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
               key_mask: Optional[torch.Tensor], causal: bool, scale: float, window: int,
               softcap: float, diag_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode_launch(query, key_rows, value_rows, key_mask, causal, scale, window,
                          softcap, diag_offset, eager=False)


@_decode_op.register_fake
def _decode_fake(query, key_rows, value_rows, key_mask, causal, scale, window, softcap,
                 diag_offset):
    return empty_output(query), query.new_empty(query.shape[:3], dtype=torch.float32)


class DecodePlan(NamedTuple):
    """A decode step's launches, worked out once per shape (memoised: per-call host time)."""
    constants: tuple              # fp8_cache_kernel's C
    grid: tuple                   # decode_cache_rows's
    merge_grid: tuple             # merge_splits's (when splits > 1)
    splits: int
    merge: Optional[MergeConstants]
    views: BufferViews            # the packed views and the split workspace (launch.py's)


@memoize(1024)
def decode_plan(batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_kv: int,
                head_dim: int, causal: bool, windowed: bool, softcapped: bool, key_mask: bool,
                sm_count: int) -> DecodePlan:
    """The launches of a decode step of this shape: GQA heads packed into the tile's rows as
    the bf16 kernel packs them (launch.packed_group_tile), the keys split over enough blocks to
    fill one wave of ``sm_count`` SMs (0: not split)."""
    from . import fp8_cache_kernel as K
    group = heads_q // heads_kv
    g_tile = packed_group_tile(_DECODE, seq_q, group, None)
    pack = min(group, g_tile)
    heads_grid = heads_q // pack
    rows = FP8_CACHE_ROWS // g_tile
    m_tiles = math.ceil(seq_q / rows)
    key_tiles = math.ceil(seq_kv / FP8_CACHE_KEYS)
    splits = kv_splits(_DECODE, m_tiles * heads_grid * batch, key_tiles, sm_count,
                       FP8_CACHE_OCCUPANCY, launch_bound=False)
    constants = [0] * K.CONSTANTS
    constants[K.ROWS], constants[K.G_TILE], constants[K.GROUP] = rows, g_tile, group // pack
    constants[K.TILE_N], constants[K.TILE_D] = FP8_CACHE_KEYS, head_dim_tile(head_dim)
    constants[K.CAUSAL], constants[K.WINDOWED] = causal, windowed
    constants[K.SOFTCAP], constants[K.KEY_MASK] = softcapped, key_mask
    constants[K.SPLIT] = splits > 1
    constants[K.K_LATENCY], constants[K.V_LATENCY] = FP8_CACHE_LATENCY
    constants[K.QK_PARTS], constants[K.PV_PARTS] = FP8_CACHE_QK_PARTS, FP8_CACHE_PV_PARTS
    constants[K.PV_FAST_ACC] = fp8_cache_pv_fast_acc(head_dim, math.ceil(key_tiles / splits))
    merge = None
    if splits > 1:
        merge = merge_constants(g_tile, min(rows, next_power_of_two(seq_q)), splits, head_dim,
                                True)
    return DecodePlan(tuple(constants), (m_tiles * splits, heads_grid, batch),
                      (m_tiles, heads_grid, batch), splits, merge,
                      buffer_views(batch, heads_q, heads_grid, seq_q, head_dim, g_tile, splits,
                                   m_tiles))


def decode_launches(query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                    key_mask: Optional[torch.Tensor], causal: bool, scale: float, window: int,
                    softcap: float, diag_offset: int, *, sm_count: int,
                    keep_for_stream: Optional[int] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple]]:
    """``(out, lse, [(kernel, grid, arguments)])`` of a decode step (meta tensors are fine):
    the decode kernel and, with split keys, the merge. ``keep_for_stream``: the split
    workspace is kept for that stream's next calls (launch.py)."""
    batch, heads_q, seq_q, head_dim = query.shape
    heads_kv, seq_kv = key_rows.shape[1], key_rows.shape[2]
    plan = decode_plan(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, causal, window > 0,
                       softcap > 0, key_mask is not None, sm_count)
    views = plan.views
    out = empty_output(query)
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    q_rows, out_rows, lse_rows = query, out, lse
    if views.group_rows is not None:  # packed: (B, Hkv, Sq, group, ...) views, no copies
        q_rows = group_rows(query, views.group_rows)
        out_rows, lse_rows = out.as_strided(*views.out_rows), lse.as_strided(*views.lse_rows)
    k8, k_scale = split_rows(key_rows)
    v8, v_scale = split_rows(value_rows)
    mask_arg = lse if key_mask is None else _kernel_key_mask(key_mask, batch)  # (unread: lse)
    score_scale, softcap_out = scaled_scores(scale, softcap or None, LOG2E)
    decode_kernel, merge_kernel = _kernels()
    # With split keys the decode writes each slice into the workspace, and the merge the output.
    written = (out_rows, lse_rows) if plan.splits == 1 else \
        split_buffers(views, query.device, keep_for_stream)[:2]
    launches = [(decode_kernel, plan.grid, (q_rows, k8, k_scale, v8, v_scale, mask_arg) +
                 tuple(written) + (score_scale, softcap_out, diag_offset, window, plan.splits,
                                   plan.constants))]
    if plan.splits > 1:
        launches.append((merge_kernel, plan.merge_grid, tuple(written) + (
            out_rows, lse_rows, plan.splits, plan.constants, tuple(plan.merge))))
    return out, lse, launches


def _kernel_key_mask(key_mask: torch.Tensor, batch: int) -> torch.Tensor:
    """``(B or 1, 1, 1, Skv)`` bool as the kernel's ``(B, Skv)`` uint8 (the same bytes)."""
    mask = key_mask[:, 0, 0, :]
    if mask.shape[0] != batch or mask.stride(-1) != 1:
        mask = mask.expand(batch, -1).contiguous()
    return mask.view(torch.uint8)


def _decode_launch(query, key_rows, value_rows, key_mask, causal, scale, window, softcap,
                   diag_offset, *, eager: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import cuda.tile as ct

    from .memo import may_keep_device_memory
    from .op import sm_count
    device = query.device
    stream = current_stream(device)
    keep = may_keep_device_memory(eager, device)
    out, lse, launches = decode_launches(query, key_rows, value_rows, key_mask, causal, scale,
                                         window, softcap, diag_offset,
                                         sm_count=sm_count(device),
                                         keep_for_stream=stream if keep else None)
    with launch_device(device):
        for kernel, grid, args in launches:
            ct.launch(stream, grid, kernel, args)
    return out, lse


@memoize(1)
def _kernels():
    """(decode, merge) with their compiler hints: the decode FP8_CACHE_OCCUPANCY blocks per SM,
    one warpgroup (a 64-row tile); the merge two warpgroups (its sm_90 cubins keep no stack at
    GQA shapes, 208-328 B with one)."""
    from . import fp8_cache_kernel as K
    return (K.decode_cache_rows_kernel.replace_hints(occupancy=FP8_CACHE_OCCUPANCY,
                                                     num_worker_warps=4),
            K.merge_splits_kernel.replace_hints(num_worker_warps=8))


# ---------------------------------------------------------------------------------------------
# Quantisation into rows on the GPU
# ---------------------------------------------------------------------------------------------

def quantize_launch(states: torch.Tensor, rows: torch.Tensor) -> tuple:
    """``(kernel, grid, arguments)`` of fp8_cache_kernel.quantize_tokens writing ``states``
    into ``rows`` (meta tensors are fine)."""
    from . import fp8_cache_kernel as K
    batch, heads, seq, head_dim = states.shape
    values, scales = split_rows(rows)
    constants = [0] * 2
    constants[K.QUANT_TOKENS], constants[K.QUANT_D] = FP8_CACHE_QUANT_TOKENS, \
        head_dim_tile(head_dim)
    return (K.quantize_tokens_kernel, (-(-seq // FP8_CACHE_QUANT_TOKENS), heads, batch),
            (states, values, scales, tuple(constants)))


def quantize_on_device(states: torch.Tensor) -> torch.Tensor:
    """fp8_cache.quantize_rows on a GPU: one launch. The rows' 12 bytes after the scale are
    left unwritten (nothing reads them)."""
    import cuda.tile as ct

    rows = rows_like(states)
    kernel, grid, args = quantize_launch(states, rows)
    with launch_device(states.device):
        ct.launch(current_stream(states.device), grid, kernel, args)
    return rows


# ---------------------------------------------------------------------------------------------
# Cubins without a GPU (CPU tests)
# ---------------------------------------------------------------------------------------------

def export_cubins(query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                  key_mask: Optional[torch.Tensor] = None, *, arch: str, causal: bool = True,
                  scale: Optional[float] = None, window: Optional[int] = None,
                  softcap: Optional[float] = None, diag_offset: Optional[int] = None,
                  sm_count: int = 132) -> list[bytes]:
    """The cubins of a decode step's launches (decode, and merge with split keys) for these
    tensors (meta tensors are fine), built without a GPU."""
    from .fp8 import export_kernel_cubin
    _, _, launches = decode_launches(query, key_rows, value_rows, key_mask,
                                     *_step_arguments(query, key_rows, causal, scale, window,
                                                      softcap, diag_offset),
                                     sm_count=sm_count)
    return [export_kernel_cubin(kernel, args, arch) for kernel, _, args in launches]


def export_quantize_cubin(states: torch.Tensor, *, arch: str) -> bytes:
    """The quantisation kernel's cubin for these states (meta tensors are fine)."""
    from .fp8 import export_kernel_cubin
    kernel, _, args = quantize_launch(states, rows_like(states))
    return export_kernel_cubin(kernel, args, arch)
