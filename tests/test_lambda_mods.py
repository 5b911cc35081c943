"""Mods written as lambdas in a .py file: found in the file's syntax tree wherever they stand
(across lines, inside a call, beside another lambda on one line), or a clear error."""

import warnings

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention import mod_translator
from hf_tiled_attention.mods import ModError, compile_mods


@pytest.fixture(autouse=True)
def _quiet_reference_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reference path.*")
        yield


def _qkv():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(1, 2, 8, 16, generator=g) for _ in range(3)]


def _relative_bias(s, b, h, q_idx, kv_idx):
    return s + (kv_idx - q_idx) * 0.1


def _returned(mod, role="mask_mod") -> str:
    """The translated mod's returned expression (its cuTile text)."""
    mods = compile_mods(mod, None) if role == "score_mod" else compile_mods(None, mod)
    returns = [line.strip() for line in open(mods.path).read().splitlines()
               if line.strip().startswith("return") and "q_idx" in line]
    return returns[0]


def test_a_lambda_across_two_lines_of_a_call():
    q, k, v = _qkv()
    out = hta.tiled_attention(q, k, v,
                              score_mod=lambda s, b, h, q_idx, kv_idx:
                                  s + (kv_idx - q_idx) * 0.1)
    want = hta.tiled_attention(q, k, v, score_mod=_relative_bias)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_a_lambda_across_three_lines_with_its_body_split():
    q, k, v = _qkv()
    out = hta.tiled_attention(
        q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: (
            (q_idx >= kv_idx)
            & (q_idx - kv_idx < 3)))
    want = hta.tiled_attention(q, k, v, is_causal=True, window=3)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_two_lambdas_with_the_same_parameters_on_one_line():
    pair = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, lambda b, h, q_idx, kv_idx: q_idx < kv_idx)  # noqa: E501
    assert _returned(pair[0]) == "return q_idx >= kv_idx"
    assert _returned(pair[1]) == "return q_idx < kv_idx"


def test_a_score_mod_and_a_mask_mod_on_one_line():
    q, k, v = _qkv()
    out = hta.tiled_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)  # noqa: E501
    want = hta.tiled_attention(q, k, v, is_causal=True, scale=0.125)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_an_error_inside_a_multiline_lambda_names_its_line():
    mod = (lambda b, h, q_idx, kv_idx:
           q_idx.ge(kv_idx))
    with pytest.raises(ModError) as caught:
        compile_mods(None, mod)
    line = mod.__code__.co_firstlineno + 1  # the body's line, one below the lambda's
    assert f"line {line})" in str(caught.value) and "method call" in str(caught.value)


def test_lambdas_that_cannot_be_told_apart_are_a_clear_error(monkeypatch):
    """Without the code's source positions (Python 3.10), two lambdas with the same
    parameters on one line cannot be told apart: refused, with what to do."""
    monkeypatch.setattr(mod_translator, "_code_spans", lambda code: [])
    pair = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, lambda b, h, q_idx, kv_idx: q_idx < kv_idx)  # noqa: E501
    with pytest.raises(ModError, match=r"mask_mod .*<lambda>: 2 lambdas with its parameters "
                                       r"start on line \d+ .*give it a line of its own"):
        compile_mods(None, pair[0])


def test_a_lambda_without_a_file_is_a_clear_error():
    mod = eval("lambda b, h, q_idx, kv_idx: q_idx >= kv_idx")
    with pytest.raises(ModError, match=r"mask_mod <lambda>: its source is not available .*"
                                       r"define it with def in a .py file"):
        compile_mods(None, mod)
