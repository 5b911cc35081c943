"""Attention variants written in Python: ``score_mod`` and ``mask_mod`` with FlexAttention's
signatures, run in the cuTile kernel and, as the same generated code, in the reference path.

    def score_mod(score, b, h, q_idx, kv_idx): return new_score      # fp32 scores, scaled
    def mask_mod(b, h, q_idx, kv_idx): return visible                 # bool

``b`` is the batch row, ``h`` the query head, ``q_idx`` the query row (0 .. Sq-1) and ``kv_idx``
the key (0 .. Skv-1). In the kernel ``b`` and ``h`` are scalars and ``q_idx`` / ``kv_idx`` a
column and a row of int32 indices; in the reference path they are broadcasting torch tensors.

The kernel is compiled from source, so :func:`compile_mods` translates a mod into a small
generated module (under the cache dir, named by the digest of its text) holding two versions of
every function: cuTile's (``score_mod`` / ``mask_mod``) and a torch twin (``score_mod_torch`` /
``mask_mod_torch``) that the reference path, the block tables and the registered op's
fake/reference side run. A tensor the mod closes over (or reads as a global) becomes an array
the launch passes (``t[i]`` becomes a gather), a captured number a constant, a captured
function is translated too (specialised on the constants it is called with), a ``for`` over a
captured tuple is unrolled, and ``torch.where`` / ``torch.tanh`` / ... become cuTile's. One
kernel per distinct generated text: two closures with the same code and constants share it,
and the text's digest is the key that lets mods cross ``torch.compile`` (see
:func:`traced_mods`).

What runs per element must be arithmetic, comparisons, ``& | ~``, those torch functions,
``abs`` / ``min`` / ``max``, indexing into captured tensors and calls of such functions. An
``if`` / conditional expression / ``and`` / ``or`` / ``not`` whose condition depends on the
mod's arguments, a loop that is not over a captured tuple or a constant ``range``, a list, dict
or comprehension, a method call (other than ``.to(...)`` and ``.new_ones/.new_zeros((),
dtype=torch.bool)``, which transformers' mask functions use) is a :class:`ModError` naming the
mod, the file and the line, on the CPU as on the GPU.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import math
import os
import sys
import types
from typing import Callable, Optional

import torch

from .memo import Memo, cache_dir
from .mod_translator import (MASK_MOD_PARAMS, SCORE_MOD_PARAMS, ModError, Translator,
                             adds_to_score, and_terms, canonical_text, capture_grad_entries,
                             derivative_entries, returned_expression)

__all__ = ["CompiledMods", "ModError", "compile_mods", "conjuncts", "follow", "index_grid",
           "mods_from_key", "structure", "traced_mods"]
_ROLES = (("score_mod", SCORE_MOD_PARAMS), ("mask_mod", MASK_MOD_PARAMS))


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledMods:
    """A call's mods, translated. ``key`` names the generated code (same text, same kernel);
    ``captures`` are the tensors the launch passes, in slot order; ``module`` holds cuTile's
    ``score_mod`` / ``mask_mod`` and their torch twins; ``names`` says which mods they are."""
    key: str
    module: types.ModuleType
    captures: tuple
    path: str
    names: str
    paths: tuple = ()  # per capture: (role, steps...) from the mod function (traced_mods)

    @property
    def score_mod(self) -> Optional[Callable]:
        """The score_mod as torch code (the twin, reading this call's captures), or None."""
        return self._twin("score_mod_torch")

    @property
    def mask_mod(self) -> Optional[Callable]:
        """The mask_mod as torch code (the twin, reading this call's captures), or None."""
        return self._twin("mask_mod_torch")

    @property
    def score_mod_additive(self) -> bool:
        """The score_mod adds terms to its score (see :func:`adds_to_score`): the backward
        kernels can run it (its derivative is 1)."""
        return bool(getattr(self.module, "SCORE_MOD_ADDITIVE", False))

    @property
    def score_mod_grad(self) -> Optional[Callable]:
        """The score_mod's derivative in its score as torch code (mod_derivative), or None: an
        additive score_mod (derivative 1) or one without a derivative rule here."""
        return self._twin("score_mod_grad_torch")

    @property
    def score_mod_differentiable(self) -> bool:
        """The backward kernels can run the score_mod: it adds terms to its score, or its
        derivative was derived (``score_mod_grad``)."""
        return self.score_mod_additive or hasattr(self.module, "score_mod_grad")

    @property
    def capture_grad_slots(self) -> tuple:
        """The capture slots whose gradient the dK/dV kernel can add (mod_translator
        .capture_grad_entries: the floating-point tensors the score_mod reads)."""
        return tuple(getattr(self.module, "CAPTURE_GRAD_SLOTS", ()))

    def capture_grad_twin(self) -> Optional[Callable]:
        """The torch twin of the kernels' capture-gradient adds, ``fn(p, ds, score, b, h,
        q_idx, kv_idx, grads, learnable_bits)`` (adds into ``grads``), or None."""
        fn = getattr(self.module, "score_mod_capture_grad_torch", None)
        if fn is None:
            return None
        captures = self.captures
        return lambda p, ds, s, b, h, q, kv, grads, bits: fn(p, ds, s, b, h, q, kv,
                                                             captures + tuple(grads), bits)

    def _twin(self, name: str) -> Optional[Callable]:
        fn = getattr(self.module, name, None)
        if fn is None:
            return None
        captures = self.captures
        return lambda *args: fn(*args, captures)

    def kernel_captures(self) -> tuple:
        """The captured tensors as the kernel reads them: bool as uint8 (same bytes)."""
        return tuple(t.view(torch.uint8) if t.dtype == torch.bool else t
                     for t in self.captures)


def compile_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable], *,
                 fast_math: bool = False) -> CompiledMods:
    """Translates the mods (memoised per pair of function objects while what their closures
    capture stays the same objects, and per :func:`structure`, whose new closures only read
    their tensors again). ``fast_math`` (for 16-bit inputs, whose probabilities are
    rounded more coarsely than this anyway): in the kernel ``torch.tanh`` becomes the
    hardware's approximate tanh (relative error about 2**-11, one instruction) and a division
    by a number a multiplication by its reciprocal (an IEEE division is a dozen instructions per
    score); the torch twin keeps both exact."""
    memo_key = (score_mod, mask_mod, fast_math)
    cached = _memo.get(memo_key)
    if cached is not None and all(still() for still in cached[1]):
        return cached[0]
    shape_key = (structure(score_mod), structure(mask_mod), fast_math)
    template = _templates.get(shape_key)
    if template is not None:
        compiled = _retargeted(template, score_mod, mask_mod)
        if compiled is not None:
            return compiled
    translation = _translate(score_mod, mask_mod, fast_math)
    compiled = CompiledMods(translation.key, load_generated(translation.key, translation.source),
                            tuple(translation.captures), str(generated_path(translation.key)),
                            translation.names, tuple(translation.paths))
    _memo.put(memo_key, (compiled, translation.guards))
    _templates.put(shape_key, (compiled, tuple(translation.aliases)))
    return compiled


# (score_mod, mask_mod, fast_math) -> (CompiledMods, guards). Keyed by the function objects.
_memo = Memo("translated mods", 256)
# (structure of each, fast_math) -> (CompiledMods, aliases): the transformers adapter makes new
# closures (holding per-forward tensors) every forward; their translation is the same text.
_templates = Memo("translated mods by structure", 256)


def _retargeted(template: tuple, score_mod, mask_mod) -> Optional[CompiledMods]:
    """The template's translation with the tensors these functions capture (found by the
    template's capture paths), or None when two paths that led to one tensor there lead to two
    here (the translation shares one slot between them)."""
    compiled, aliases = template
    roots = {"score_mod": score_mod, "mask_mod": mask_mod}
    captures = tuple(follow(roots[path[0]], path[1:]) for path in compiled.paths)
    if any(follow(roots[path[0]], path[1:]) is not captures[slot] for slot, path in aliases):
        return None
    return dataclasses.replace(compiled, captures=captures)


class _Translation:
    def __init__(self, source, captures, paths, guards, names, aliases):
        self.source, self.captures, self.paths = source, captures, paths
        self.guards, self.names, self.aliases = guards, names, aliases
        self.key = hashlib.sha256(source.encode()).hexdigest()[:16]


def _translate(score_mod, mask_mod, fast_math: bool) -> _Translation:
    translator = Translator(fast_math)
    entries = []
    names = []
    score_mod_name = None
    for role, params in _ROLES:
        fn = {"score_mod": score_mod, "mask_mod": mask_mod}[role]
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"{role} must be a function or None, got {type(fn).__name__}")
        name = translator.function(fn, role, params, path=(role,))
        entries += [f"{role} = {name}", f"{role}_torch = {name}_torch"]
        if role == "score_mod":
            additive = adds_to_score(translator.twins[name][0])
            entries.append(f"SCORE_MOD_ADDITIVE = {additive}")
            if not additive:
                entries += derivative_entries(translator, name)
            score_mod_name = name
        names.append(f"{role} {getattr(fn, '__qualname__', type(fn).__name__)}")
    if score_mod_name is not None:  # (after every role: the arrays follow all captures)
        entries += capture_grad_entries(translator, score_mod_name)
    source = "\n".join(["# Generated by hf_tiled_attention.mods from a score_mod / mask_mod.",
                        "import math", "import cuda.tile as ct", "import torch", "",
                        _TWIN_HELPERS] + translator.definitions + entries
                       + [f"NAMES = {', '.join(names)!r}",
                          f"CAPTURES = {len(translator.captures)}"]) + "\n"
    return _Translation(source, translator.captures, translator.paths, translator.guards,
                        ", ".join(names), translator.aliases)


# Twin versions of the builtins a mod may call on per-element values (torch.minimum wants
# tensors on both sides).
_TWIN_HELPERS = '''
def _twin_abs(x):
    return torch.abs(torch.as_tensor(x))


def _twin_minimum(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


def _twin_maximum(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))


def _twin_index_add(target, index, values):
    *index, values = torch.broadcast_tensors(*map(torch.as_tensor, index),
                                            torch.as_tensor(values))
    target.index_put_(tuple(map(torch.Tensor.long, index)), values.to(target.dtype),
                      accumulate=True)
'''


def generated_path(key: str):
    return cache_dir() / "mods" / f"hf_tiled_attention_mod_{key}.py"


def load_generated(key: str, source: Optional[str] = None) -> types.ModuleType:
    """The generated module of ``key``: already imported, or written (``source`` given) where
    cuTile can read it and imported, or imported from the cache dir (a key a compiled graph
    holds, after this process's memo dropped it). cuTile reads a kernel's helpers from their
    source files, hence a file."""
    name = f"hf_tiled_attention_mod_{key}"
    if name in sys.modules:
        return sys.modules[name]
    path = generated_path(key)
    if source is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            tmp.replace(path)
    elif not path.exists():
        raise ModError(f"no generated mods module with key {key} (looked in {path})")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def mods_from_key(key: str, captures: tuple) -> CompiledMods:
    """The :class:`CompiledMods` of a generated module and this call's captured tensors: how
    the registered op gets its mods back from what crossed a traced graph."""
    module = load_generated(key)
    if len(captures) != module.CAPTURES:  # (one tensor captured twice translates to one slot)
        raise ValueError(f"mods_from_key: the generated mods {key} ({module.NAMES}) read "
                         f"{module.CAPTURES} captured tensors, got {len(captures)}")
    return CompiledMods(key, module, tuple(captures), str(generated_path(key)), module.NAMES)


# ---------------------------------------------------------------------------------------------
# Mods under torch.compile
# ---------------------------------------------------------------------------------------------

def traced_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable], *,
                fast_math: bool) -> tuple[str, tuple]:
    """``(key, captured tensors)`` of the mods inside code torch.compile traces: the
    translation runs once at trace time (its result is a constant of the graph), and the
    captured tensors are read from the mods' closures by code the graph traces, so they are
    graph inputs (a learnable tensor keeps its gradient). The mods must be made outside the
    compiled function (a closure made inside it over traced tensors cannot be translated)."""
    key, paths = _translate_constant(score_mod, mask_mod, fast_math)
    roots = {"score_mod": score_mod, "mask_mod": mask_mod}
    return key, tuple(follow(roots[path[0]], path[1:]) for path in paths)


@torch.compiler.assume_constant_result
def _translate_constant(score_mod, mask_mod, fast_math: bool) -> tuple[str, tuple]:
    compiled = compile_mods(score_mod, mask_mod, fast_math=fast_math)
    return compiled.key, compiled.paths


def follow(obj, steps: tuple):
    """The object a path (:func:`conjuncts`, capture paths) leads to from a function."""
    for kind, where in steps:
        if kind == "cell":
            obj = obj.__closure__[where].cell_contents
        elif kind == "global":
            obj = obj.__globals__[where]
        else:  # "item": an element of a captured tuple or list
            obj = obj[where]
    return obj



# ---------------------------------------------------------------------------------------------
# Structure of a translated mask_mod
# ---------------------------------------------------------------------------------------------

def conjuncts(mask_mod: Callable) -> list[tuple[tuple, str]]:
    """The functions whose intersection ``mask_mod`` is, seen through its translation: a
    function whose result is an ``&`` of calls of other functions with its own arguments (as
    ``and_masks`` of FlexAttention, transformers or :mod:`variants` builds) is replaced by them,
    recursively. Each comes as its path from ``mask_mod`` (:func:`follow` finds it again in
    another function of the same :func:`structure`) and its canonical text (its translation with
    the parameters named ``p0 .. p3``), by which callers recognise known rules. Raises
    :class:`ModError` where the translator does."""
    translator = Translator()
    root = translator.function(mask_mod, "mask_mod", MASK_MOD_PARAMS, path=("mask_mod",))

    def leaves(name: str) -> list:
        definition, fn, path = translator.twins[name]
        params = [a.arg for a in definition.args.args]
        terms = and_terms(returned_expression(definition))
        calls = []
        for term in terms or [None]:
            if not (isinstance(term, ast.Call) and isinstance(term.func, ast.Name)
                    and term.func.id.removesuffix("_torch") in translator.twins
                    and [ast.unparse(a) for a in term.args] == params):
                return [(path[1:], canonical_text(definition))]
            calls.append(term.func.id[:-len("_torch")])
        return [leaf for callee in calls for leaf in leaves(callee)]

    return leaves(root)


def structure(fn) -> tuple:
    """What a translation of ``fn`` depends on: its code and, through its closure and the
    globals it reads, the numbers and the code it captures, recursively (a captured tensor
    counts by dtype and dims, not by value). Functions of one structure translate alike, up
    to the tensors they read: a memo keyed by this serves the new closures transformers makes
    for every forward."""
    visiting: set = set()

    def of(value):
        if isinstance(value, types.FunctionType):
            if id(value) in visiting:  # (a function that reaches itself)
                return ("again", value.__code__)
            visiting.add(id(value))
            cells = tuple(of(_cell_value(c)) for c in (value.__closure__ or ()))
            read = tuple((name, of(value.__globals__[name])) for name in value.__code__.co_names
                         if name in value.__globals__
                         and not isinstance(value.__globals__[name], types.ModuleType))
            visiting.discard(id(value))
            return (value.__code__, cells, read)
        if isinstance(value, (tuple, list)):
            return (type(value).__name__,) + tuple(of(v) for v in value)
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype, value.dim())
        if value is None or isinstance(value, (bool, int, float, str)):
            return (type(value).__name__, value)
        return ("object", id(value))  # (not translatable: the translation says so)
    return of(fn)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return None



def index_grid(batch: int, heads: tuple, rows: torch.Tensor, cols: torch.Tensor) -> tuple:
    """Broadcasting (b, h, q_idx, kv_idx) for the reference path and the block table: scores
    shaped ``(B, *heads, rows, cols)``; ``heads`` is ``(H,)``, or ``(Hkv, G)`` for grouped
    scores (query head ``kv_head * G + g``)."""
    n = len(heads)
    device = rows.device
    b = torch.arange(batch, device=device).view((batch,) + (1,) * (n + 2))
    h = torch.arange(math.prod(heads), device=device).view((1,) + tuple(heads) + (1, 1))
    q_idx = rows.view((1,) * (n + 1) + (-1, 1))
    kv_idx = cols.view((1,) * (n + 2) + (-1,))
    return b, h, q_idx, kv_idx
