"""The public op, ``tiled_attention``, and the torch custom op behind it.

``tiled_attention`` checks its arguments, compacts the mask and runs one implementation
(``_forward``: the cuTile kernel on a capable GPU, the reference algorithm elsewhere; its
backward, ``backward``, likewise) by one of three routes: a traced call (``torch.compile``)
goes through ``torch.ops.hf_tiled_attention.attention``, a ``torch.library`` custom op with a
fake implementation and a registered backward op; an eager call that autograd records goes
through ``_EagerAttention``, an ``autograd.Function``; eager inference calls it directly. The
two eager routes skip the dispatcher, whose round trips cost more host time than a short
call's kernels take. The implementations take the call's options as one record,
:class:`~hf_tiled_attention.call_options.CallOptions`, made once per call: by ``attention``
(and ``inference_call``) on the eager routes, from the registered ops' flat arguments by
``_op_call``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from . import autotune, value_head_dim
from .call_options import NO_OVERRIDES, CallOptions, call_options
from .checks import check_inputs, check_options, check_sinks
from .determinism import deterministic
from .kernel_params import NO_MASK
from .launch import LaunchPlan, Relaunch, plan_launch, repeatable_launch, run_kernel
from .masks import CompactMask, ModMask, mod_mask, reused_compact_mask
from .memo import Memo, may_keep_device_memory, memoize
from .mods import CompiledMods, compile_mods, mods_from_key, traced_mods
from .reference import (empty_output, in_output_layout, reference_attention,
                        reference_attention_backward)
from .schedule import (SHORT_QUERY_ROWS, Schedule, active_override, head_dim_tile,
                       resolve_schedule)

FORCE_REFERENCE_ENV = "HF_TILED_ATTENTION_FORCE_REFERENCE"
HIGHER_ORDER_UNSUPPORTED = (
    "hf_tiled_attention does not support higher-order gradients (differentiating a gradient "
    "taken with create_graph=True) or functorch transforms (torch.func.grad, vmap, jacrev, "
    "jvp, ...): like the fused kernels of torch's scaled_dot_product_attention, its backward "
    "is not itself differentiable and it has no batching rule. For these, use "
    "attn_implementation='eager' in transformers, or "
    "torch.nn.functional.scaled_dot_product_attention with the math backend (inside "
    "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)).")


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    schedule: Optional[Schedule] = None,
    return_lse: bool = False,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    sinks: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Scaled dot-product attention on the cuTile kernels (differentiable: see ``backward``).

    Args:
        query: ``(B, Hq, Sq, D)``; may be a strided view (e.g. ``(B, S, H, D)`` transposed).
        key, value: ``(B, Hkv, Skv, D)`` with ``Hq % Hkv == 0`` (GQA/MQA, K/V never repeated).
            fp16, bf16 or fp32 (fp32 runs the kernel's TF32 variant on GPU); ``D`` a multiple
            of 8 from 16 to 256. ``value`` may have a head dim ``Dv`` of its own
            (multi-head latent attention); the narrower side is padded with zero columns up
            to the wider (value_head_dim.py), which must be in that range, and the output
            has ``Dv``.
        attn_mask: bool (True = may attend) or additive float, broadcastable to
            ``(B, Hq, Sq, Skv)``. Key tiles it hides entirely are skipped; the per-tile table
            that says which is built once per mask tensor and reused while the tensor is
            unchanged (pass the same mask to every layer).
        is_causal: bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Skv - Sq``.
        scale: score scale, default ``1 / sqrt(D)``.
        window: sliding window ``W``: query ``i`` sees key ``j`` only if
            ``j > i + Skv - Sq - W``; without ``is_causal`` the window is symmetric,
            ``|j - (i + Skv - Sq)| < W``.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before masking. For
            16-bit inputs the kernel uses the hardware's approximate tanh (relative error about
            2**-11, finer than the 16-bit rounding of the probabilities), as in a ``score_mod``.
        schedule: kernel schedule overrides (see :class:`Schedule`); unset fields come from
            ``use_schedule`` and the default table.
        return_lse: also return the fp32 log-sum-exp ``(B, Hq, Sq)`` (natural log).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's
            signature: changes each scaled score (fp32) before masking and softmax
            (for 16-bit inputs the kernel runs it with fast math: the approximate tanh, and a
            division by a number as a multiplication by its reciprocal).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``: the key is visible where True (and
            where ``is_causal`` / ``window`` also allow it). Its block table (empty / partial /
            full per tile) is built on the device once per mod and shape and reused; empty
            tiles are skipped and full ones skip the mod. ``q_idx`` is the query row
            (0 .. Sq-1) and ``kv_idx`` the key (0 .. Skv-1), as in FlexAttention. Both mods
            run in the kernel (see :mod:`hf_tiled_attention.mods` for what they may contain)
            and in the reference path; ready-made ones are in
            :mod:`hf_tiled_attention.variants`. Under torch.compile they are translated once,
            at trace time: make them outside the compiled function.
        sinks: ``(Hq,)`` attention-sink logits (gpt-oss's learned sinks): each row's softmax
            gets one more term, ``exp(sinks[h])``, for a sink that is always visible, is not
            scaled, capped or modded, and whose value is zero. The output shrinks by
            ``Z / (Z + exp(sinks[h]))``; a row with no visible key stays exactly 0.

    Returns:
        ``out`` ``(B, Hq, Sq, Dv)`` in the input dtype, or ``(out, lse)``. A query row with no
        visible key gets an output of exactly 0 and an LSE of ``-inf`` (with ``sinks``: the
        sink's logit; the LSE always covers every term of the softmax).
    """
    if value_head_dim.differs(query, key, value):
        query, key, value, scale, value_dim = value_head_dim.padded_to_one_head_dim(
            query, key, value, scale)
        result = tiled_attention(query, key, value, attn_mask, is_causal=is_causal, scale=scale,
                                 window=window, softcap=softcap, schedule=schedule,
                                 return_lse=return_lse, score_mod=score_mod,
                                 mask_mod=mask_mod, sinks=sinks)
        if return_lse:
            return result[0][..., :value_dim], result[1]
        return result[..., :value_dim]
    check_inputs(query, key, value)
    check_options(is_causal, scale, window, softcap, schedule, return_lse)
    check_sinks(sinks, query)
    diag_offset = key.shape[2] - query.shape[2]
    mods = None
    if score_mod is not None or mask_mod is not None:
        mods = checked_mods(score_mod, mask_mod, attn_mask, softcap, query)
    out, lse = attention(query, key, value, attn_mask, causal=is_causal, scale=scale,
                         window=window, softcap=softcap, diag_offset=diag_offset,
                         schedule=schedule, return_lse=return_lse, mods=mods, sinks=sinks)
    return (out, lse) if return_lse else out


def checked_mods(score_mod, mask_mod, attn_mask, softcap, query) -> CompiledMods:
    """A call's ``score_mod`` / ``mask_mod`` checked against its other arguments and
    translated for the kernels (traced under torch.compile); their captured tensors must be on
    the query's device."""
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function or None, got {type(fn).__name__}")
    if mask_mod is not None and attn_mask is not None:
        raise ValueError("pass either attn_mask or mask_mod, not both (a dense mask can be "
                         "read by a mask_mod that indexes it)")
    if score_mod is not None and softcap is not None:
        raise ValueError("pass either softcap or score_mod, not both (variants.softcap(cap) is "
                         "softcap as a score_mod, to compose with others)")
    fast_math = query.dtype != torch.float32
    if torch.compiler.is_compiling():
        key, captures = traced_mods(score_mod, mask_mod, fast_math=fast_math)
        mods = mods_from_key(key, captures)
    else:
        mods = compile_mods(score_mod, mask_mod, fast_math=fast_math)
    for tensor in mods.captures:
        if tensor.device != query.device:
            raise ValueError(f"{mods.names} reads a captured tensor of shape {tuple(tensor.shape)} "
                             f"on {tensor.device}; mods run on the query's device "
                             f"({query.device}): move the tensor there")
    return mods


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Union[torch.Tensor, CompactMask, None], *, causal: bool,
              scale: Optional[float],
              window: Optional[int], softcap: Optional[float], diag_offset: int,
              schedule: Optional[Schedule] = None, return_lse: bool = True,
              key_mask_table: bool = True, mods: Optional[CompiledMods] = None,
              sinks: Optional[torch.Tensor] = None,
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Checked-argument entry with an explicit diagonal: query row ``i`` sits at key position
    ``i + diag_offset`` for causal and window masking (the transformers adapter uses this for
    caches whose keys extend past the current queries). ``attn_mask`` may also be a
    :class:`CompactMask` made by :func:`compact_mask` for this shape, which callers reuse across
    layers so its tile tables are built once; ``key_mask_table=False`` skips that table for a
    key-vector mask used once (the kernel then applies it on every key tile it visits).
    Returns ``(out, lse)``; ``lse`` is None unless ``return_lse`` (a kernel that skips it saves
    an allocation and its stores). ``mods``: a translated score_mod / mask_mod (eager only).
    ``sinks``: checked ``(Hq,)`` sink logits."""
    if sinks is not None:
        out, lse = attention(query, key, value, attn_mask, causal=causal, scale=scale,
                             window=window, softcap=softcap, diag_offset=diag_offset,
                             schedule=schedule, return_lse=True, key_mask_table=key_mask_table,
                             mods=mods)
        out, lse = with_sinks(out, lse, sinks)
        return out, (lse if return_lse else None)
    mask, scale = _compacted(attn_mask, query, key), _scale_or_default(scale, query)
    if not _unit_stride(query, key, value):
        # Tile loads need unit stride along D; every framework layout already has it.
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    compiling = torch.compiler.is_compiling()
    # (eager only: a transform would reach torch's own messages from deep inside the call)
    if not compiling and torch._C._are_functorch_transforms_active():
        raise RuntimeError(HIGHER_ORDER_UNSUPPORTED)
    if compiling:
        # Traced graphs need the registered op (fake impl; its backward is registered below),
        # whose schema is flat: its implementation makes the call's record (_op_call). Mods
        # cross as their generated code's key and their captured tensors.
        out, lse = torch.ops.hf_tiled_attention.attention(
            query, key, value, None if mask is None else mask.tensor,
            NO_MASK if mask is None else mask.kind, causal, scale, window or 0,
            float(softcap or 0.0), int(diag_offset), (schedule or NO_OVERRIDES).as_list(),
            None if mods is None else mods.key, [] if mods is None else list(mods.captures),
            False)
        return out, (lse if return_lse else None)
    mask = _kernel_mask(mask, mods, query, key, eager=True)
    recorded = _records_autograd(query, key, value, mask, mods)
    options = call_options(mask, causal=causal, scale=scale, window=window, softcap=softcap,
                           diag_offset=diag_offset, schedule=schedule,
                           # (the LSE of a recorded call is the backward's input)
                           return_lse=return_lse or recorded, key_mask_table=key_mask_table,
                           mods=mods)
    if recorded:
        captures = () if mods is None else mods.captures
        # An additive mask that requires grad is an input of the autograd node (its gradient
        # is the scores'); a bool mask or one autograd does not track is not.
        trained_mask = mask.tensor if isinstance(mask, CompactMask) and mask.trains else None
        out, lse = _EagerAttention.apply(query, key, value, mask, options, trained_mask,
                                         *captures)
        return out, (lse if return_lse else None)
    # Eager inference: call the implementation directly; the dispatcher round trip costs more
    # host time than a short attention call takes on the GPU.
    return _forward(query, key, value, mask, options)


def inference_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Union[torch.Tensor, CompactMask, None], *, causal: bool,
                   scale: Optional[float], window: Optional[int], softcap: Optional[float],
                   diag_offset: int, key_mask_table: bool = True,
                   mods: Optional[CompiledMods] = None) -> Optional[KernelCall]:
    """The kernel launch that :func:`attention` (no LSE, no sinks, default schedule) makes for
    an eager inference call of these arguments, worked out and not yet run, for a caller that
    repeats the call on other tensors of the same shapes, strides, dtypes and device (the
    transformers adapter: every layer of a decode step). None where such a call takes another
    route: traced, recorded by autograd, the reference path, or copies to unit stride."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or not _unit_stride(query, key, value)):
        return None
    mask = _compacted(attn_mask, query, key)
    if _records_autograd(query, key, value, mask, mods):
        return None
    mask = _kernel_mask(mask, mods, query, key, eager=True)
    return _kernel_call(query, key, value, mask, call_options(
        mask, causal=causal, scale=_scale_or_default(scale, query), window=window,
        softcap=softcap, diag_offset=diag_offset, key_mask_table=key_mask_table, mods=mods))


def _compacted(attn_mask, query: torch.Tensor, key: torch.Tensor) -> Optional[CompactMask]:
    """The call's mask as a :class:`CompactMask` on the query's device (or None)."""
    mask = attn_mask
    if attn_mask is not None and not isinstance(attn_mask, CompactMask):
        mask = reused_compact_mask(attn_mask, query.shape[0], query.shape[1], query.shape[2],
                                   key.shape[2])
    if isinstance(mask, CompactMask) and mask.tensor.device != query.device:
        raise ValueError(f"attn_mask must be on the query's device ({query.device}), got "
                         f"{mask.tensor.device}")
    return mask


def _kernel_mask(mask: Optional[CompactMask], mods: Optional[CompiledMods], query: torch.Tensor,
                 key: torch.Tensor, eager: bool) -> Union[CompactMask, ModMask, None]:
    """The mask the kernels and the reference path read: with a mask_mod its :class:`ModMask`
    for this shape (shared while the call may keep device memory:
    memo.may_keep_device_memory), else the call's own."""
    if mods is None or mods.mask_mod is None:
        return mask
    return mod_mask(mods, query.shape[0], query.shape[1], query.shape[2], key.shape[2],
                    query.device, may_keep_device_memory(eager, query.device))


def _scale_or_default(scale: Optional[float], query: torch.Tensor) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _unit_stride(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1


def _records_autograd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: Union[CompactMask, ModMask, None],
                      mods: Optional[CompiledMods]) -> bool:
    """Whether autograd records this eager call: grad mode on and an input that requires grad
    (the additive mask's too: a bool mask, or one autograd does not track, is no input)."""
    if not torch.is_grad_enabled():
        return False
    captures = () if mods is None else mods.captures
    return (isinstance(mask, CompactMask) and mask.trains) or any(
        t.requires_grad for t in (query, key, value, *captures))


def _first_order_only(backward_fn: Callable) -> Callable:
    """An autograd.Function's backward, run without recording; under create_graph=True its
    gradients come back tied to the saved tensors and incoming gradients they depend on
    through a node whose own backward raises HIGHER_ORDER_UNSUPPORTED. (autograd's
    once_differentiable ties them to the incoming gradients alone: differentiating them in
    the inputs then failed as "not used in the graph", or dropped this term silently.)"""
    @functools.wraps(backward_fn)
    def backward(ctx, *grad_outputs):
        higher_order = torch.is_grad_enabled()
        with torch.no_grad():
            grads = backward_fn(ctx, *grad_outputs)
        if not higher_order:
            return grads
        sources = [t for t in (*ctx.saved_tensors, *grad_outputs)
                   if t is not None and t.requires_grad]
        present = [g for g in grads if g is not None]
        tied = iter(_NotDifferentiable.apply(len(present), *present, *sources))
        return tuple(None if g is None else next(tied) for g in grads)
    return backward


class _NotDifferentiable(torch.autograd.Function):
    """``apply(count, *tensors, *sources)``: copies of the first ``count`` tensors that depend
    on ``sources`` as far as autograd knows; differentiating them raises
    HIGHER_ORDER_UNSUPPORTED."""

    @staticmethod
    def forward(ctx, count, *tensors):
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(HIGHER_ORDER_UNSUPPORTED)


class _EagerAttention(torch.autograd.Function):
    """Eager autograd's route to the forward and backward implementations (traced graphs take
    the registered ops): the same functions without the two dispatcher round trips of the
    registered op and its backward, which cost more host time than the kernels of a short
    layer take (eval/host_overhead.py's training row)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, options, trained_mask, *captures):
        out, lse = _forward(query, key, value, mask, options)
        # (the mask's tensor too: autograd then refuses a backward after it changed in place)
        ctx.save_for_backward(query, key, value, out, lse, *captures,
                              *((mask.tensor,) if isinstance(mask, CompactMask) else ()))
        ctx.mask, ctx.options = mask, options
        ctx.set_materialize_grads(False)  # an unused LSE brings no zero gradient to read
        return out, lse

    @staticmethod
    @_first_order_only
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors[:5]
        mask_grad = ctx.needs_input_grad[5]
        learnable = list(ctx.needs_input_grad[6:])
        if grad_out is None:  # only the LSE was used
            grad_out = torch.zeros_like(out)
        grads = backward(in_output_layout(grad_out), query, key, value, out, lse, grad_lse,
                         ctx.mask, ctx.options, learnable=learnable, mask_grad=mask_grad,
                         keep=may_keep_device_memory(True, query.device))
        rest = iter(grads[3:])
        return (grads[0], grads[1], grads[2], None, None,
                next(rest) if mask_grad else None,
                *(next(rest) if flag else None for flag in learnable))


def with_sinks(out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` / ``lse`` of a softmax over the keys, turned into those of the softmax with one
    more term per row, ``exp(sinks[h])``, whose value is zero: every weight is divided by
    ``1 + exp(sink - lse)``, so the output is scaled by ``sigmoid(lse - sink)`` (exactly 0 for a
    row with no visible key, ``lse = -inf``). Plain torch ops: traced and captured as they are,
    and differentiable in ``sinks``."""
    sink = sinks.float()[:, None]  # (Hq, 1) against lse (B, Hq, Sq)
    keep = torch.sigmoid(lse - sink)
    return (out * keep[..., None]).to(out.dtype), torch.logaddexp(lse, sink)


@torch.library.custom_op("hf_tiled_attention::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: Optional[torch.Tensor], mask_kind: int, causal: bool, scale: float,
                  window: int, softcap: float, diag_offset: int, schedule: list[int],
                  mods_key: Optional[str], captures: list[torch.Tensor], eager: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``eager``: called from eager code (a direct call: the package's own eager routes do not
    come here), not from a traced graph; such a call may keep its block tables for the next
    (memo.may_keep_device_memory). No default
    value: the dispatcher drops trailing arguments equal to their defaults, and autograd then
    expects one gradient fewer."""
    mask, options = _op_call(query, key, mask, mask_kind, causal, scale, window, softcap,
                             diag_offset, mods_key, captures, eager, Schedule.from_list(schedule))
    return _forward(query, key, value, mask, options, eager=eager)


def _op_call(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor],
             mask_kind: int, causal: bool, scale: float, window: int, softcap: float,
             diag_offset: int, mods_key: Optional[str], captures: list, eager: bool,
             schedule: Optional[Schedule] = None,
             ) -> tuple[Union[CompactMask, ModMask, None], CallOptions]:
    """The registered ops' flat arguments (a torch.library schema takes no record) as the
    call's kernel mask and :class:`CallOptions`. The mask comes compact: in an eager call it is
    the one kept per mask tensor, whose block tables the layers and the backward then share.
    Traced (torch.compile, CUDA graphs): a key-vector mask gets no per-tile table, which every
    layer of every step would rebuild; the kernel applies it on each visited tile. The backward
    op has no schedule (its kernels do not read the forward's)."""
    compact = None
    if mask is not None:
        compact = (reused_compact_mask(mask, query.shape[0], query.shape[1], query.shape[2],
                                       key.shape[2]) if eager else CompactMask(mask, mask_kind))
    mods = None if mods_key is None else mods_from_key(mods_key, tuple(captures))
    mask = _kernel_mask(compact, mods, query, key, eager)
    return mask, call_options(mask, causal=causal, scale=scale, window=window, softcap=softcap,
                              diag_offset=diag_offset, schedule=schedule, return_lse=True,
                              key_mask_table=eager, mods=mods)


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             mask: Union[CompactMask, ModMask, None], options: CallOptions, eager: bool = True,
             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The op's implementation: the cuTile kernel on a capable GPU, the reference elsewhere.
    The LSE is None unless ``options.return_lse`` (the kernel path skips it). ``eager``: False
    when called as the registered op (see :func:`launch.run_kernel`)."""
    call = _kernel_call(query, key, value, mask, options, eager)
    if call is not None:
        return call.launch(query, key, value)
    if query.numel():
        _warn_reference_once(query.device)
    mods = options.mods
    out, lse = reference_attention(query, key, value, mask, causal=options.causal,
                                   scale=options.scale, window=options.window,
                                   softcap=options.softcap, diag_offset=options.diag_offset,
                                   score_mod=None if mods is None else mods.score_mod)
    return out, (lse if options.return_lse else None)


class KernelCall(NamedTuple):
    """A call's kernel launch, worked out: its plan, the mask as the kernel reads it, and
    whether the launch may keep device memory. ``launch`` runs it on a call's tensors."""
    plan: LaunchPlan
    mask: Union[CompactMask, ModMask, None]
    keep: bool

    def launch(self, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return run_kernel(self.plan, query, key, value, self.mask, keep=self.keep)

    def repeatable(self, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> Optional[Relaunch]:
        """The launch as a :class:`launch.Relaunch` for calls that repeat it with these
        tensors' shapes, strides, dtypes and device (its arrays kept), or None where the
        call may not keep device memory or asks for an LSE."""
        if not self.keep or self.plan.return_lse:
            return None
        return repeatable_launch(self.plan, query, key, value, self.mask)


def _kernel_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: Union[CompactMask, ModMask, None], options: CallOptions,
                 eager: bool = True) -> Optional[KernelCall]:
    """The call's kernel launch, or None where the reference path runs it (no capable GPU or
    toolchain, or no element)."""
    device = query.device
    if query.numel() == 0 or not kernel_available(device):
        return None
    # (an eager call outside capture launches from the host every time: see launch.py)
    keep = may_keep_device_memory(eager, device)
    # The plan depends on shapes, dtypes and options only: every layer of a forward (and every
    # step of a static-cache decode) reuses the first call's. The schedule override and the
    # autotuner's state in force, and whether the launch may keep device memory, are the
    # process's state at the call, not the caller's options: key parts of their own.
    memo_key = (query.shape, key.shape, query.dtype, device, options, active_override(),
                autotune.state(), keep)
    plan = _plans.get(memo_key)
    if plan is None:
        plan = _plans.put(memo_key, _plan(query, key, value, mask, options, keep))
    # (tuple.__new__: the NamedTuple's own constructor is a Python function, and this runs on
    # every call)
    return tuple.__new__(KernelCall, (plan, mask, keep))


_plans = Memo("launch plans", 4096)


def _plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          mask: Union[CompactMask, ModMask, None], options: CallOptions,
          host_launched: bool = False) -> LaunchPlan:
    """The launch plan of a call: the default table's schedule (or the autotuner's, which may
    time candidates on this call's inputs first) under the call's overrides."""
    device = query.device
    arch_major = _arch_major(device)
    explicit, causal = options.schedule, options.causal

    def plan_with(schedule: Schedule) -> LaunchPlan:
        return plan_launch(query, key, options, schedule, sm_count=sm_count(device),
                           host_launched=host_launched)

    tuned = None
    if explicit == NO_OVERRIDES and active_override() is None and autotune.enabled():
        tune_key = autotune.TuneKey(arch_major, str(query.dtype).removeprefix("torch."),
                                    head_dim_tile(query.shape[-1]), causal,
                                    autotune.seq_bucket(key.shape[2]),
                                    query.shape[2] <= SHORT_QUERY_ROWS)
        tuned = autotune.tuned_schedule(  # (candidates keep no workspaces: eager=False)
            tune_key, lambda candidate: run_kernel(plan_with(resolve_schedule(
                None, arch_major, query.dtype, query.shape[-1], causal, tuned=candidate,
                seq_q=query.shape[2], seq_kv=key.shape[2])), query, key, value, mask,
                eager=False),
            cuda=True)
    return plan_with(resolve_schedule(explicit, arch_major, query.dtype, query.shape[-1],
                                      causal, tuned=tuned, seq_q=query.shape[2],
                                      seq_kv=key.shape[2]))


@memoize(64)
def _arch_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@memoize(64)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@_attention_op.register_fake
def _attention_fake(query, key, value, mask, mask_kind, causal, scale, window, softcap,
                    diag_offset, schedule, mods_key, captures, eager):
    return empty_output(query), query.new_empty(query.shape[:3], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    (query, key, value, mask, mask_kind, causal, scale, window, softcap, diag_offset, schedule,
     mods_key, captures, eager) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, mask, *captures)
    ctx.options = (mask_kind, causal, scale, window, softcap, diag_offset, mods_key)
    ctx.eager = eager
    ctx.mask_grad = bool(ctx.needs_input_grad[3])  # (only a float mask can require grad)
    ctx.learnable = [bool(ctx.needs_input_grad[12]) and c.requires_grad for c in captures]


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, mask, *captures = ctx.saved_tensors
    grads = torch.ops.hf_tiled_attention.attention_backward(
        grad_out, query, key, value, out, lse, grad_lse, mask, *ctx.options, captures,
        ctx.learnable, ctx.mask_grad, ctx.eager)
    rest = iter(grads[3:])
    d_mask = next(rest) if ctx.mask_grad else None
    d_captures = [next(rest) if flag else None for flag in ctx.learnable]
    return (grads[0], grads[1], grads[2], d_mask) + (None,) * 8 + (d_captures, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("hf_tiled_attention::attention_backward", mutates_args=())
def _attention_backward_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           grad_lse: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                           mask_kind: int, causal: bool, scale: float, window: int,
                           softcap: float, diag_offset: int, mods_key: Optional[str],
                           captures: list[torch.Tensor], learnable: list[bool],
                           mask_grad: bool, eager: bool) -> list[torch.Tensor]:
    """``[dq, dk, dv, (d mask if mask_grad), *(d capture for each capture flagged
    learnable)]``."""
    mask, options = _op_call(query, key, mask, mask_kind, causal, scale, window, softcap,
                             diag_offset, mods_key, captures, eager)
    return backward(in_output_layout(grad_out), query, key, value, out, lse, grad_lse, mask,
                    options, learnable=learnable, mask_grad=mask_grad,
                    keep=may_keep_device_memory(eager, query.device))


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, lse, grad_lse, mask, mask_kind,
                             causal, scale, window, softcap, diag_offset, mods_key, captures,
                             learnable, mask_grad, eager):
    return ([torch.empty_like(t, memory_format=torch.contiguous_format)
             for t in (query, key, value)]
            + ([torch.empty_like(mask)] if mask_grad else [])
            + [torch.empty_like(c) for c, flag in zip(captures, learnable) if flag])


def backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             grad_lse: Optional[torch.Tensor], mask: Union[CompactMask, ModMask, None],
             options: CallOptions, *, learnable: Sequence[bool] = (), mask_grad: bool = False,
             keep: bool = False) -> list[torch.Tensor]:
    """The backward op's implementation: the cuTile backward kernels on a capable GPU, the
    reference backward elsewhere and for a score_mod the kernels cannot run: one whose
    derivative in the score mod_derivative cannot derive, or that reads a tensor that requires
    grad (``learnable[i]`` flags ``options.mods.captures[i]``) whose gradient the kernels
    cannot add (mod_translator.capture_grad_entries), or in deterministic mode learnable
    tensors whose per-block gradient rows would not fit
    (backward_launch.capture_partials_fit); there the derivative is a vector-Jacobian
    product of the mod's torch twin, which also gives the learnable tensors' gradients. Returns
    ``[dq, dk, dv]``, then with ``mask_grad`` the gradient of the additive mask's compact
    tensor (in its dtype), then the learnable captures'. ``options`` and ``mask``: the forward
    call's record and the mask its kernels read.
    ``keep``: the block tables made may be kept for later calls
    (memo.may_keep_device_memory)."""
    mods = options.mods
    has_score_mod = mods is not None and mods.score_mod is not None
    # The kernels run a score_mod whose derivative in the score is 1 or was derived
    # (mod_derivative), and add the gradients of the tensors it reads that they can
    # (capture_grad_slots; in deterministic mode each block into its own rows, where they
    # fit); any other goes to the reference path.
    learned = [slot for slot, flag in enumerate(learnable) if flag]
    kernels_can = not has_score_mod or (mods.score_mod_differentiable
                                        and set(learned) <= set(mods.capture_grad_slots))
    rows_fit = True
    if learned and deterministic():
        from .backward_launch import capture_partials_fit
        rows_fit = capture_partials_fit(query, key, mods.captures, learnable)
    on_kernels = kernels_can and rows_fit
    if on_kernels and query.numel() and kernel_available(query.device):
        from .backward_launch import run_backward
        return run_backward(grad_out, query, key, value, out, lse, grad_lse, mask, options,
                            mask_grad=mask_grad, learnable=learnable, keep=keep)
    if query.numel() and query.device.type == "cuda" and not on_kernels:
        _warn_score_mod_backward_once(mods.names, kernels_can)
    dq, dk, dv, d_mask, d_learnable = reference_attention_backward(
        grad_out, query, key, value, out, lse, grad_lse, mask, causal=options.causal,
        scale=options.scale, window=options.window, softcap=options.softcap,
        diag_offset=options.diag_offset, mods=mods, learnable=learned, mask_grad=mask_grad)
    return ([dq, dk, dv] + ([d_mask.to(mask.tensor.dtype)] if mask_grad else [])
            + [grad.to(mods.captures[slot].dtype) for grad, slot in zip(d_learnable, learned)])


@memoize(64)
def _warn_score_mod_backward_once(names: str, deterministic_mode: bool = False) -> None:
    why = ("in deterministic mode the kernels add a learnable captured tensor's gradient "
           "into a copy per block of the grid, and these would take more than "
           "backward_launch.CAPTURE_PARTIALS_MAX_BYTES" if deterministic_mode else
           "the kernels run a score_mod whose derivative in the score they can derive (one "
           "expression of + - * /, where, tanh, exp, log, ... of the score, captured tensors "
           "read by index)")
    warnings.warn(f"hf_tiled_attention: the backward of {names} runs the reference path on the "
                  f"GPU (torch autograd of the mod, chunk by chunk): correct but slower than the "
                  f"kernels; {why}.", RuntimeWarning, stacklevel=3)


@memoize(64)
def kernel_available(device: torch.device) -> bool:
    """Whether the cuTile kernel can run on ``device`` (CUDA, sm_80+, cuda-tile importable)."""
    if os.environ.get(FORCE_REFERENCE_ENV, "") not in ("", "0"):
        return False
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    try:
        import cuda.tile  # noqa: F401
    except Exception:  # a missing or broken toolchain means the reference path
        return False
    return True


@memoize(64)
def _warn_reference_once(device: torch.device) -> None:
    if device.type == "cuda" and os.environ.get(FORCE_REFERENCE_ENV, "") in ("", "0"):
        reason = "no cuTile-capable GPU/toolchain (sm_80+ and cuda-tile needed)"
    elif device.type == "cuda":
        reason = f"{FORCE_REFERENCE_ENV} is set"
    else:
        reason = f"tensors are on {device.type}"
    warnings.warn(f"hf_tiled_attention: {reason}; using the pure-PyTorch reference path "
                  "(same semantics, much slower).", RuntimeWarning, stacklevel=3)
