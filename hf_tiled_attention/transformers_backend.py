"""transformers integration: ``attn_implementation="tiled"``.

Importing ``hf_tiled_attention`` calls :func:`register`, which adds two entries under one name:
``AttentionInterface["tiled"]`` (:func:`tiled_attention_forward`, which every model calls as
``(module, query, key, value, attention_mask, *, scaling, dropout, **kwargs)``) and
``AttentionMaskInterface["tiled"]`` (:func:`transformers_mask.tiled_mask`, which transformers'
``create_*_mask`` call with the pattern's ``mask_function``; without it transformers would hand
a custom backend ``attention_mask=None``). The adapter sees transformers through these two calls
only: the mask function (see transformers_mask.py) and the attention function's kwargs
(``sliding_window``, ``is_causal``, ``scaling``, ``softcap``, ``s_aux``, ``cu_seq_lens_*``,
``position_ids``).

Packed rows that only the kwargs reveal (``cu_seq_lens_q/k`` from
``DataCollatorWithFlattening``, or restarting ``position_ids`` with a cache) become a
same-document mask_mod over per-token ids (O(S) memory), under torch.compile too. Learned sinks
(``s_aux``) go to the op's ``sinks``; arguments the kernel has no mode for are an error.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch

from . import value_head_dim
from .checks import check_inputs
from .documents import key_documents, same_document, same_document_dense, same_document_key
from .fp8_cache import is_fp8_rows
from .fp8_cache_attention import attend_cache_rows
from .layer_call import LayerCall, active_owner, read_call, route_for
from .masks import CompactMask, compact_mask
from .memo import may_keep_device_memory, remembered
from .mods import CompiledMods, compile_mods, mods_from_key
from .op import attention as _op_attention
from .op import inference_call
from .serving import register_paged
from .transformers_mask import TiledMask, tiled_mask
from .variants import and_masks

__all__ = ["TiledMask", "is_tiled", "register", "tiled_attention_forward", "tiled_mask"]

DEFAULT_NAME = "tiled"
# Arguments that change what attention computes, for which the kernel has no mode: (name, what
# it is, what to use instead). A call with one fails rather than attend without it.
_UNSUPPORTED_KWARGS = (
    ("indices", "sparse attention (indices=...)", "'eager'"),  # the keys each query keeps (DSA)
    ("block_indices", "sparse attention (block_indices=...)", "'eager'"),
)


def register(name: str = DEFAULT_NAME) -> str:
    """Register the attention function and its mask function under ``name`` in transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface``; use it as ``attn_implementation``.
    Also registers ``"paged|<name>"``, what continuous batching runs (serving.py)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, tiled_attention_forward)
    AttentionMaskInterface.register(name, tiled_mask)
    register_paged(name)  # continuous batching's name for it, where transformers has one
    return name


def is_tiled(implementation) -> bool:
    """Whether ``implementation`` (a config's ``_attn_implementation``) is registered as
    "tiled" under its own or another name (:func:`register`)."""
    from transformers import AttentionInterface
    return isinstance(implementation, str) and \
        AttentionInterface().get(implementation) is tiled_attention_forward


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------

def tiled_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask, scaling: Optional[float] = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: ``query`` ``(B, Hq, Sq, D)`` (a strided view is fine),
    ``key``/``value`` ``(B, Hkv, Skv, D)``, unrepeated, or an FP8 cache's rows
    (fp8_cache_attention.py). Returns ``(out (B, Sq, Hq, D), None)``."""
    if is_fp8_rows(key):
        return attend_cache_rows(tiled_attention_forward, module, query, key, value,
                                 attention_mask, scaling, dropout, kwargs)
    if value_head_dim.differs(query, key, value):  # multi-head latent attention (DeepSeek)
        query, key, value, scaling, value_dim = value_head_dim.padded_to_one_head_dim(
            query, key, value, scaling)
        out, _ = tiled_attention_forward(module, query, key, value, attention_mask, scaling,
                                         dropout, **kwargs)
        return out[..., :value_dim], None
    repeat_key = None
    if type(attention_mask) is TiledMask and not torch.is_grad_enabled() and \
            not torch.compiler.is_compiling():
        # A decode step's layers repeat one call: the first one's launch, kept in the
        # forward's memo, serves the others (the host time of a layer is the step's time).
        # (Not while traced: the lookup reads the stream's capture state, a graph break.)
        repeat_key = _repeat_key(module, query, key, value, scaling, dropout, kwargs)
        signature, sources = repeat_key
        repeat = attention_mask.memo.get(signature)
        if repeat is not None and _same_objects(repeat[0], sources) and \
                not _config_asks_for_weights(module) and active_owner() is None and \
                not torch._C._are_functorch_transforms_active():
            return _launched(repeat[1], repeat[2], query, key, value), None
    _check_call(module, dropout, kwargs)
    check_inputs(query, key, value)
    route = route_for(kwargs.get("position_ids"))
    call = read_call(module, query, key, attention_mask, scaling, kwargs,
                     sharded=route is not None)
    if route is not None:  # inside context_parallel(): this rank's rows of the whole sequence
        return _in_layer_layout(route(call, query, key, value)), None
    return _attend(call, query, key, value, repeat_key), None


def _check_call(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Refuses what the kernels do not compute: attention weights, dropout while training,
    sparse attention's key lists."""
    if kwargs.get("output_attentions") or _config_asks_for_weights(module):
        raise ValueError("attn_implementation='tiled' does not compute attention weights "
                         "(output_attentions=True). Use attn_implementation='eager' to get them.")
    if dropout and getattr(module, "training", False):
        raise ValueError(
            f"attn_implementation='tiled' has no attention dropout, but the module is in "
            f"training mode with dropout={dropout}. To train with 'tiled', set "
            f"{_dropout_setting(module, dropout)} to 0.0 (most recent models train without "
            "it); for inference call model.eval(); to keep attention dropout, use "
            "attn_implementation='sdpa'.")
    for name, what, instead in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='tiled' does not support {what}; use "
                             f"attn_implementation={instead}.")


def _attend(call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            repeat_key: Optional[tuple]) -> torch.Tensor:
    """The call on this process's whole sequence: the op's arguments from the record (the
    bias and the documents folded into the mask or a mask_mod, the mask compacted once per
    forward), through a repeatable launch where the forward's later layers can reuse it.
    Returns ``(B, Sq, Hq, D)``."""
    batch, heads_q, seq_q, _ = query.shape
    shape = (batch, heads_q, seq_q, key.shape[2])
    mask, mods, memo = call.mask, call.mods, call.memo
    if call.position_bias is not None:  # T5's relative bias (learned: it trains as a mask)
        # Shared by the layers unless autograd tracks it: a layer recomputed by gradient
        # checkpointing must build its own from its own inputs.
        bias = call.position_bias
        tracked = getattr(bias, "requires_grad", False) and torch.is_grad_enabled()
        mask = remembered(None if tracked else memo, "position_bias", (bias, mask),
                          lambda: _with_bias(bias, mask, mods, shape))
    if call.documents is not None:
        documents = call.documents
        doc_mods = remembered(memo, "documents", (documents, mask), lambda: _document_mods(
            documents, mask, call.overlay))
        if doc_mods is None:  # beside a dense or additive mask: one dense rule for both
            mask = _dense_documents(documents, mask)
        else:
            mask, mods = None, doc_mods  # the padding is in the document ids
    if mask is not None:
        mask = _compact_for_layer(mask, memo, query.device, shape)
    # A per-tile table pays off only when the forward's layers share it (through the memo).
    options = dict(causal=call.causal, scale=call.scale, window=call.window,
                   softcap=call.softcap, diag_offset=call.diag_offset,
                   key_mask_table=memo is not None, mods=mods)
    if repeat_key is not None and memo is not None and call.sinks is None and mods is None:
        launch = inference_call(query, key, value, mask, **options)
        if launch is not None:  # the layers that repeat this call launch it directly
            signature, sources = repeat_key
            relaunch = launch.repeatable(query, key, value)
            memo[signature] = (sources, launch, relaunch)
            return _launched(launch, relaunch, query, key, value)
    out, _ = _op_attention(query, key, value, mask, return_lse=False, sinks=call.sinks,
                           **options)
    return _in_layer_layout(out)


def _launched(call, relaunch, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> torch.Tensor:
    """The output of an inference call's launch (op.KernelCall) in the layer's layout: through
    its :class:`launch.Relaunch` (the fewest host steps) unless there is none, or the current
    device or stream is not the one it was made on."""
    out = None if relaunch is None else relaunch.launch(query, key, value)
    return _in_layer_layout(call.launch(query, key, value)[0]) if out is None else out


def _in_layer_layout(out: torch.Tensor) -> torch.Tensor:
    """(B, Sq, Hq, D) contiguous, as transformers' own attention functions return it: the op
    lays its output out that way in memory, so this is a view, not a copy."""
    return out.transpose(1, 2).contiguous()


# The kwargs the attention function reads that hold tensors, whose values the call depends on:
# a call repeats another only with the same objects.
_TENSOR_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "position_bias", "s_aux",
                  "sinks", "indices", "block_indices")
# The other kwargs it reads (flags and sizes), compared by value.
_VALUE_KWARGS = ("output_attentions", "is_causal", "sliding_window", "softcap")


def _repeat_key(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, scaling, dropout, kwargs: dict) -> tuple[tuple, tuple]:
    """(signature, sources) of a call: a later call in the same forward whose signature
    (tensor shapes, strides, dtypes, devices, the layer's flags and the value kwargs) is equal
    and whose tensor kwargs are the same objects makes the same launch."""
    signature = ("repeat", query.shape, query.stride(), key.shape, key.stride(), value.shape,
                 value.stride(), query.dtype, key.dtype, value.dtype, query.device, key.device,
                 value.device, type(query), type(key), type(value), scaling, dropout,
                 getattr(module, "training", False), getattr(module, "is_causal", True),
                 may_keep_device_memory(True, query.device),
                 *map(kwargs.get, _VALUE_KWARGS))
    return signature, tuple(map(kwargs.get, _TENSOR_KWARGS))


def _same_objects(old: tuple, new: tuple) -> bool:
    return all(map(operator.is_, old, new))


def _config_asks_for_weights(module: torch.nn.Module) -> bool:
    """Whether the layer's config sets ``output_attentions``. Read from the config's own
    attributes: transformers' config ``__getattribute__`` (two layers of hooks) costs more host
    time than the rest of a decode call's checks."""
    config = getattr(module, "config", None)
    if torch.compiler.is_compiling():  # (traced once: dynamo cannot trace the direct read)
        return getattr(config, "output_attentions", False) is True
    try:
        own = object.__getattribute__(config, "__dict__")
    except AttributeError:  # (no config, or one without instance attributes)
        return getattr(config, "output_attentions", False) is True
    # (PreTrainedConfig keeps the flag behind a property, in _output_attentions)
    return own.get("_output_attentions", own.get("output_attentions", False)) is True


# Config attributes that hold a model's attention dropout, most common first (T5 and its kin
# call it dropout_rate, GPT-2 attn_pdrop, BERT attention_probs_dropout_prob).
_DROPOUT_SETTINGS = ("attention_dropout", "attn_dropout", "dropout_rate", "attn_pdrop",
                     "attention_probs_dropout_prob", "dropout")


def _dropout_setting(module: torch.nn.Module, dropout: float) -> str:
    """Where the layer's dropout comes from, to name in an error: the config attribute that
    holds this value, else the layer's own attribute."""
    config = getattr(module, "config", None)
    for name in _DROPOUT_SETTINGS:
        if getattr(config, name, None) == dropout:
            return f"the config's {name}"
    return "the attention dropout probability in the model's config"


def _with_bias(position_bias: torch.Tensor, mask: Optional[torch.Tensor],
               mods: Optional[CompiledMods], shape: tuple) -> torch.Tensor:
    """An additive mask: a model's ``position_bias`` (T5: ``(1, Hq, Sq, Skv)``, from a learned
    table) with the call's mask folded in (-inf where a bool mask hides a key, a float mask
    added), differentiable in the bias; the kernel's causal / window flags stay as they are."""
    if not isinstance(position_bias, torch.Tensor) or not position_bias.is_floating_point():
        raise TypeError(f"position_bias must be a floating-point tensor, got "
                        f"{getattr(position_bias, 'dtype', type(position_bias).__name__)}")
    if mods is not None:
        raise ValueError("attn_implementation='tiled' cannot combine a position_bias with the "
                         "mask overlay transformers made for this call (packed rows, chunks or "
                         "blocks); use attn_implementation='eager'")
    batch, heads_q, seq_q, seq_kv = shape
    bias = position_bias[..., -seq_kv:]
    try:
        torch.broadcast_shapes(bias.shape, shape)
    except RuntimeError:
        raise ValueError(f"position_bias of shape {tuple(position_bias.shape)} is not "
                         f"broadcastable to (B, Hq, Sq, Skv) = {shape}") from None
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def _document_mods(ids: torch.Tensor, mask, overlay: Optional[Callable]
                   ) -> Optional[CompiledMods]:
    """The same-document rule as a mask_mod: the pre-translated template (so it crosses
    torch.compile) on this call's ids, the key padding folded into the keys' ids, intersected
    with the mask function's overlays (eager) when there are any; None with a dense or additive
    mask (see :func:`_dense_documents`)."""
    key_padding = None
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape[-2] != 1:
            return None
        key_padding = mask.reshape(mask.shape[0], -1)
    key_ids = key_documents(ids, key_padding)
    query_ids, key_ids = ids.expand(key_ids.shape[0], -1).contiguous(), key_ids.contiguous()
    if overlay is None:
        return mods_from_key(same_document_key(), (query_ids, key_ids))
    return compile_mods(None, and_masks(overlay, same_document(query_ids, key_ids)))


def _dense_documents(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A dense (or additive) mask with the other documents hidden as well."""
    same = same_document_dense(ids)
    if mask.dtype == torch.bool:
        return mask & same
    return mask.masked_fill(~same, float("-inf"))


def _compact_for_layer(mask: torch.Tensor, memo: Optional[dict], device: torch.device,
                       shape: tuple) -> CompactMask:
    """The op's compact form of ``mask`` on the layer's device, kept in the forward's memo so
    the layers that share a mask share one copy per GPU (``device_map``) and its tile tables."""
    if memo is None or torch.compiler.is_compiling():
        return compact_mask(mask.to(device, non_blocking=True), *shape)
    moved = remembered(memo, ("moved", device), (mask,),
                        lambda: mask.to(device, non_blocking=True))
    return remembered(memo, ("compact", device, shape), (moved,),
                       lambda: compact_mask(moved, *shape))
