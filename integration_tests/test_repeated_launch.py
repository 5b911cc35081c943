"""The adapter's repeated call: a forward's later layers launch what its first layer's full path
worked out (op.inference_call, kept in the TiledMask's memo). On the CPU with cuTile's launch
stubbed (eval/host_overhead.py's stubbed_launch), so each launch's arguments can be compared
with the full path's."""

import pytest
import torch

from eval.host_overhead import stubbed_launch
from hf_tiled_attention import op
from hf_tiled_attention import transformers_backend as tb
from hf_tiled_attention.transformers_mask import tiled_mask
from models import build

B, HQ, HKV, S, D = 2, 8, 2, 96, 64


class Layer(torch.nn.Module):
    """What the attention function reads off a model's attention module."""
    is_causal = True
    config = None


def _tensors(seed: int, seq_q: int = 1, heads_kv: int = HKV, seq: int = S):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seq_q, HQ, D, generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, heads_kv, seq, D, generator=g, dtype=torch.bfloat16)
    return q, k, torch.randn(B, heads_kv, seq, D, generator=g, dtype=torch.bfloat16)


def _described(value):
    """A launch argument as the comparison sees it: a tensor's layout and where its data is
    (its own storage for the layer's inputs; outputs are new each call), else the value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, tuple):
        return tuple(_described(v) for v in value)
    return value


@pytest.fixture
def launches(monkeypatch):
    """Every stubbed launch's (grid, kernel, args), and the calls the adapter makes to the
    full op and to inference_call."""
    import cuda.tile as ct

    seen = {"launch": [], "full": 0, "prepared": 0}
    with stubbed_launch():
        monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args, **kw:
                            seen["launch"].append((grid, kernel, args)))
        real_full, real_prepared = tb._op_attention, tb.inference_call

        def full(*args, **kwargs):
            seen["full"] += 1
            return real_full(*args, **kwargs)

        def prepared(*args, **kwargs):
            seen["prepared"] += 1
            return None if seen.get("full path only") else real_prepared(*args, **kwargs)
        monkeypatch.setattr(tb, "_op_attention", full)
        monkeypatch.setattr(tb, "inference_call", prepared)
        yield seen


@pytest.mark.parametrize("window, scaling, heads_kv, seq", [
    (None, D ** -0.5, HKV, S),  # query heads packed by kv head
    (32, None, HKV, S),
    (None, None, HQ, S),        # no GQA: one head per tile
    (None, None, HKV, 8192)])   # keys split over blocks, merged by the last (one launch)
def test_later_layers_launch_what_the_full_path_would(launches, window, scaling, heads_kv,
                                                      seq):
    """Four layers sharing one TiledMask (decode, left padding): the first works the launch
    out (inference_call), the others repeat it on their own tensors; the launches equal those
    the op makes for the four calls (the adapter's full path), argument for argument, and each
    layer's output is the array the kernel writes, in the layer's layout."""
    pad = torch.ones(B, seq, dtype=torch.long)
    pad[0, :5] = 0
    layer = Layer().eval()
    layers = [_tensors(seed, heads_kv=heads_kv, seq=seq) for seed in range(4)]
    kwargs = dict(scaling=scaling, dropout=0.0, sliding_window=window,
                  position_ids=torch.full((B, 1), seq - 1))
    with torch.no_grad():
        shared = tiled_mask(B, 1, seq, q_offset=seq - 1, attention_mask=pad)
        outs = [tb.tiled_attention_forward(layer, q, k, v, shared, **kwargs)[0]
                for q, k, v in layers]
        assert launches["prepared"] == 1 and launches["full"] == 0
        repeated, launches["launch"][:] = list(launches["launch"]), []
        launches["full path only"] = True  # (inference_call declines: the op runs each call)
        shared = tiled_mask(B, 1, seq, q_offset=seq - 1, attention_mask=pad)
        for q, k, v in layers:
            tb.tiled_attention_forward(layer, q, k, v, shared, **kwargs)
        assert launches["full"] == 4
    full = launches["launch"]
    assert len(repeated) == len(full) == 4
    for (grid, kernel, args), (grid_f, kernel_f, args_f) in zip(repeated, full):
        assert grid == grid_f and kernel is kernel_f
        assert _described(args) == _described(args_f)
    for (q, k, v), out, (_, _, args), (_, _, args_f) in zip(layers, outs, repeated, full):
        # the layer's own query (a packed view of it), keys and values
        assert args[0].data_ptr() == q.data_ptr() and args[1] is k and args[2] is v
        assert args_f[0].data_ptr() == q.data_ptr()
        # the output: the kernel's output array, seen as (B, Sq, Hq, D)
        assert out.shape == (B, 1, HQ, D) and out.is_contiguous()
        assert args[3].data_ptr() == out.data_ptr() and args[3].stride() == args_f[3].stride()
    if seq > S:  # the key splits' workspace and counts: one, kept for every layer
        for array in (9, 10, 11):
            assert len({args[array].data_ptr() for _, _, args in repeated}) == 1


def test_a_repeat_on_another_stream_is_launched_afresh(launches, monkeypatch):
    """The kept arrays of a repeated launch (placeholders, key-split workspace) are safe on the
    stream they were made for only: a layer on another stream takes the op's launch path."""
    from hf_tiled_attention import launch

    layer = Layer().eval()
    with torch.no_grad():
        mask = tiled_mask(B, 1, S, q_offset=S - 1)
        tb.tiled_attention_forward(layer, *_tensors(0), mask, scaling=0.125)
        calls = []
        real = launch.run_kernel
        monkeypatch.setattr(launch, "run_kernel", lambda *a, **kw: calls.append(1) or real(
            *a, **kw))
        monkeypatch.setattr(op, "run_kernel", launch.run_kernel)
        tb.tiled_attention_forward(layer, *_tensors(1), mask, scaling=0.125)
        assert calls == [] and len(launches["launch"]) == 2  # the same stream: repeated
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7)
        out = tb.tiled_attention_forward(layer, *_tensors(2), mask, scaling=0.125)[0]
        assert calls == [1] and len(launches["launch"]) == 3
        assert out.shape == (B, 1, HQ, D) and out.is_contiguous()
        assert launches["prepared"] == 1 and launches["full"] == 0


@pytest.mark.parametrize("change", ["position_ids", "sliding_window", "module causal", "shape",
                                    "strides", "grad", "dtype", "scaling"])
def test_a_different_call_takes_the_full_path(launches, change):
    """A call that differs from the first in anything the adapter reads does not repeat its
    launch: it works its own out (inference_call again, or the full op under autograd)."""
    layer, other = Layer().eval(), Layer().eval()
    position_ids = torch.full((B, 1), S - 1)
    q, k, v = _tensors(0)
    kwargs = dict(scaling=D ** -0.5, dropout=0.0, position_ids=position_ids)
    with torch.no_grad():
        mask = tiled_mask(B, 1, S, q_offset=S - 1)
        tb.tiled_attention_forward(layer, q, k, v, mask, **kwargs)
        tb.tiled_attention_forward(layer, *_tensors(1), mask, **kwargs)  # repeats
        assert launches["prepared"] == 1
        if change == "position_ids":
            kwargs["position_ids"] = position_ids.clone()
        elif change == "sliding_window":
            kwargs["sliding_window"] = 16
        elif change == "module causal":
            other.is_causal = False
            layer = other
        elif change == "shape":
            mask = tiled_mask(B, 2, S, q_offset=S - 2)
            q = _tensors(0, seq_q=2)[0]
            tb.tiled_attention_forward(layer, q, k, v, mask, **kwargs)
            assert launches["prepared"] == 2
            q = q[:, :, :1]  # (a narrower view: the same mask object, another shape)
        elif change == "strides":
            q = torch.cat([q.transpose(1, 2), q.transpose(1, 2)], -1)[..., :D].transpose(1, 2)
        elif change == "dtype":
            q, k, v = q.half(), k.half(), v.half()
        elif change == "scaling":
            kwargs["scaling"] = 0.5
        if change == "grad":
            with torch.enable_grad():
                q.requires_grad_()
                tb.tiled_attention_forward(layer, q, k, v, mask, **kwargs)
            assert launches["full"] == 1 and launches["prepared"] == 1
            return
        before = launches["prepared"]
        tb.tiled_attention_forward(layer, q, k, v, mask, **kwargs)
        assert launches["prepared"] == before + 1 and launches["full"] == 0


def test_repeats_still_refuse_what_the_full_path_refuses(launches):
    """A repeated call is checked like any other for what the adapter cannot do: attention
    weights asked for in the layer's config."""
    from transformers import LlamaConfig

    layer = Layer().eval()
    layer.config = LlamaConfig()
    q, k, v = _tensors(0)
    with torch.no_grad():
        mask = tiled_mask(B, 1, S, q_offset=S - 1)
        tb.tiled_attention_forward(layer, q, k, v, mask, scaling=0.125)
        layer.config.output_attentions = True
        with pytest.raises(ValueError, match="output_attentions"):
            tb.tiled_attention_forward(layer, q, k, v, mask, scaling=0.125)


@pytest.mark.parametrize("name, kinds", [("llama", 1), ("mistral", 1), ("gemma2", 2),
                                         ("gpt_oss", 0)])
def test_a_models_decode_step_works_its_launch_out_once(launches, name, kinds):
    """A whole model's decode step (tiny models, dynamic cache): one inference_call per kind of
    layer (Gemma 2 alternates sliding-window and full layers, each with its own mask), one
    launch per layer; gpt-oss's learned sinks take the full op in every layer."""
    from transformers import DynamicCache

    model = build(name, "tiled")
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)  # the prefill
        launches["prepared"], launches["full"], launches["launch"][:] = 0, 0, []
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    assert layers > 1
    full = 0 if kinds else layers
    assert (launches["prepared"], launches["full"]) == (kinds, full)
    assert len(launches["launch"]) >= layers


def test_every_kwarg_the_adapter_reads_is_part_of_the_repeat_key():
    """A kwarg the full path reads but the repeat key leaves out would let a later call repeat
    a launch made for another value: every ``kwargs.get("...")`` / ``kwargs["..."]`` of the
    adapter (and of the record it reads them into, layer_call.py) names a kwarg of
    _VALUE_KWARGS or _TENSOR_KWARGS (or of _UNSUPPORTED_KWARGS)."""
    import inspect
    import re

    from hf_tiled_attention import layer_call
    source = inspect.getsource(tb) + inspect.getsource(layer_call)
    read = set(re.findall(r'kwargs(?:\.get\(|\[)"(\w+)"', source))
    read |= {name for name, _, _ in tb._UNSUPPORTED_KWARGS}
    assert {"sliding_window", "position_ids", "indices"} <= read  # (the pattern finds them)
    assert read <= set(tb._VALUE_KWARGS) | set(tb._TENSOR_KWARGS)
