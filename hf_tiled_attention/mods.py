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
import copy
import hashlib
import importlib.util
import inspect
import math
import operator
import os
import sys
import textwrap
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .memo import Memo, cache_dir
from .mod_derivative import NotDifferentiable, score_derivative

SCORE_MOD_PARAMS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_PARAMS = ("b", "h", "q_idx", "kv_idx")
# torch functions a mod may call, by their cuTile name.
TORCH_TO_CT = {"where": "where", "tanh": "tanh", "exp": "exp", "exp2": "exp2", "log": "log",
               "log2": "log2", "abs": "abs", "sqrt": "sqrt", "minimum": "minimum",
               "maximum": "maximum", "floor": "floor", "ceil": "ceil", "sin": "sin",
               "cos": "cos"}
# Python builtins on per-element values, by their cuTile / twin helper name.
BUILTINS = {abs: "abs", min: "minimum", max: "maximum"}
CAPTURES = "_captures"  # the generated functions' extra parameter: the captured arrays
_ROLES = (("score_mod", SCORE_MOD_PARAMS), ("mask_mod", MASK_MOD_PARAMS))
_CAPTURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64,
                   torch.int16, torch.int8, torch.uint8, torch.bool)


class ModError(TypeError):
    """A score_mod / mask_mod that cannot run in the kernel; the message names the problem."""


@dataclass(frozen=True, eq=False)
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
        """The score_mod adds terms to its score (see :func:`_adds_to_score`): the backward
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
    capture stays the same objects). ``fast_math`` (for 16-bit inputs, whose probabilities are
    rounded more coarsely than this anyway): in the kernel ``torch.tanh`` becomes the
    hardware's approximate tanh (relative error about 2**-11, one instruction) and a division
    by a number a multiplication by its reciprocal (an IEEE division is a dozen instructions per
    score); the torch twin keeps both exact."""
    memo_key = (score_mod, mask_mod, fast_math)
    cached = _memo.get(memo_key)
    if cached is not None and all(still() for still in cached[1]):
        return cached[0]
    translation = _translate(score_mod, mask_mod, fast_math)
    compiled = CompiledMods(translation.key, load_generated(translation.key, translation.source),
                            tuple(translation.captures), str(generated_path(translation.key)),
                            translation.names, tuple(translation.paths))
    _memo.put(memo_key, (compiled, translation.guards))
    return compiled


# (score_mod, mask_mod, fast_math) -> (CompiledMods, guards). Keyed by the function objects:
# the transformers adapter makes new closures (holding per-forward tensors) every forward.
_memo = Memo("translated mods", 256)


class _Translation:
    def __init__(self, source, captures, paths, guards, names):
        self.source, self.captures, self.paths = source, captures, paths
        self.guards, self.names = guards, names
        self.key = hashlib.sha256(source.encode()).hexdigest()[:16]


def _translate(score_mod, mask_mod, fast_math: bool) -> _Translation:
    translator = _Translator(fast_math)
    entries = []
    names = []
    for role, params in _ROLES:
        fn = {"score_mod": score_mod, "mask_mod": mask_mod}[role]
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"{role} must be a function or None, got {type(fn).__name__}")
        name = translator.function(fn, role, params, path=(role,))
        entries += [f"{role} = {name}", f"{role}_torch = {name}_torch"]
        if role == "score_mod":
            additive = _adds_to_score(translator.twins[name][0])
            entries.append(f"SCORE_MOD_ADDITIVE = {additive}")
            if not additive:
                entries += _derivative_entries(translator, name)
        names.append(f"{role} {getattr(fn, '__qualname__', type(fn).__name__)}")
    source = "\n".join(["# Generated by hf_tiled_attention.mods from a score_mod / mask_mod.",
                        "import math", "import cuda.tile as ct", "import torch", "",
                        _TWIN_HELPERS] + translator.definitions + entries
                       + [f"NAMES = {', '.join(names)!r}"]) + "\n"
    return _Translation(source, translator.captures, translator.paths, translator.guards,
                        ", ".join(names))


# Twin versions of the builtins a mod may call on per-element values (torch.minimum wants
# tensors on both sides).
_TWIN_HELPERS = '''
def _twin_abs(x):
    return torch.abs(torch.as_tensor(x))


def _twin_minimum(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


def _twin_maximum(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
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
    translator = _Translator()
    root = translator.function(mask_mod, "mask_mod", MASK_MOD_PARAMS, path=("mask_mod",))

    def leaves(name: str) -> list:
        definition, fn, path = translator.twins[name]
        params = [a.arg for a in definition.args.args]
        terms = _and_terms(_returned(definition))
        calls = []
        for term in terms or [None]:
            if not (isinstance(term, ast.Call) and isinstance(term.func, ast.Name)
                    and term.func.id.removesuffix("_torch") in translator.twins
                    and [ast.unparse(a) for a in term.args] == params):
                return [(path[1:], _canonical(definition))]
            calls.append(term.func.id[:-len("_torch")])
        return [leaf for callee in calls for leaf in leaves(callee)]

    return leaves(root)


def structure(fn) -> tuple:
    """What a translation of ``fn`` depends on: its code and, through its closure and the
    globals it reads, the numbers and the code it captures, recursively (a captured tensor
    counts by dtype and dims, not by value). Functions of one structure translate alike, up to the tensors they read: a memo
    keyed by this serves the new closures transformers makes for every forward."""
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


def _returned(definition: ast.FunctionDef) -> Optional[ast.expr]:
    """The returned expression of a body of plain assignments, with the assigned names
    substituted; None for anything else."""
    env: dict = {}

    def substitute(node):
        return _NameSubstitute(env).visit(copy.deepcopy(node))

    for stmt in definition.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(
                stmt.targets[0], ast.Name):
            env[stmt.targets[0].id] = substitute(stmt.value)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            env[stmt.target.id] = ast.BinOp(substitute(ast.Name(stmt.target.id, ast.Load())),
                                            stmt.op, substitute(stmt.value))
        elif isinstance(stmt, ast.Return):
            return substitute(stmt.value)
        else:
            return None
    return None


def _adds_to_score(definition: ast.FunctionDef) -> bool:
    """Whether a (generated) score_mod returns its score plus or minus terms that do not depend
    on it (ALiBi, a T5 bias table, any positional bias): its derivative in the score is then
    exactly 1, and the backward kernels run it as they run it forward."""
    score = definition.args.args[0].arg

    def free_of_score(node) -> bool:
        return not any(isinstance(n, ast.Name) and n.id == score for n in ast.walk(node))

    def additive(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id == score
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return ((additive(node.left) and free_of_score(node.right))
                    or (additive(node.right) and free_of_score(node.left)))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            return additive(node.left) and free_of_score(node.right)
        return False

    returned = _returned(definition)
    return returned is not None and additive(returned)


def _derivative_entries(translator: "_Translator", name: str) -> list[str]:
    """The generated module's ``score_mod_grad`` / ``score_mod_grad_torch``: the score_mod's
    derivative in its score (mod_derivative), in cuTile's names and torch's; nothing when it
    has none here (a body that is not plain assignments, or a rule missing), and then its
    backward runs the reference path."""
    texts = []
    for definition in (translator.ct_defs[name], translator.twins[name][0]):
        returned = _returned(definition)
        if returned is None:
            return []
        namespace = "torch" if definition.name.endswith("_torch") else "ct"
        try:
            derived = score_derivative(returned, definition.args.args[0].arg, namespace)
        except NotDifferentiable:
            return []
        grad = ast.FunctionDef(name=definition.name + "_grad",
                               args=copy.deepcopy(definition.args), body=[ast.Return(derived)],
                               decorator_list=[], returns=None, type_params=[])
        texts.append(ast.unparse(ast.fix_missing_locations(grad)) + "\n")
    return texts + [f"score_mod_grad = {name}_grad",
                    f"score_mod_grad_torch = {name}_torch_grad"]


def _and_terms(node: Optional[ast.expr]) -> list:
    """The operands of a tree of ``&`` (constants True left out)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd):
        return _and_terms(node.left) + _and_terms(node.right)
    if isinstance(node, ast.Constant) and node.value is True:
        return []
    return [] if node is None else [node]


def _canonical(definition: ast.FunctionDef) -> str:
    names = {a.arg: f"p{i}" for i, a in enumerate(definition.args.args)}
    body = [_NameSubstitute({k: ast.Name(v, ast.Load()) for k, v in names.items()}).visit(
        copy.deepcopy(stmt)) for stmt in definition.body]
    return "\n".join(ast.unparse(stmt) for stmt in body)


class _NameSubstitute(ast.NodeTransformer):
    def __init__(self, env: dict):
        self.env = env

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.env:
            return copy.deepcopy(self.env[node.id])
        return node


# ---------------------------------------------------------------------------------------------
# The translator
# ---------------------------------------------------------------------------------------------

class _Translator:
    """Turns Python functions into cuTile-readable source and its torch twin, sharing one
    capture list."""

    def __init__(self, fast_math: bool = False):
        self.fast_math = fast_math
        self.definitions: list[str] = []
        self.captures: list[torch.Tensor] = []
        self.paths: list[tuple] = []                  # per slot: (role, steps...) to the tensor
        self.guards: list[Callable[[], bool]] = []    # "the captures are still the same"
        self._functions: dict = {}                    # (id(fn), static args) -> name
        self._alive: list = []                        # keeps those ids unique
        self.twins: dict = {}                         # name -> (twin def, function)
        self.ct_defs: dict = {}                       # name -> its cuTile def

    @property
    def generated(self) -> set:
        return set(self._functions.values())

    def function(self, fn: Callable, role: str, params: Optional[tuple] = None, *,
                 path: tuple, static: tuple = ()) -> str:
        """The generated name of ``fn`` (translated once per translator and static
        arguments). ``static``: (parameter index, constant) pairs it is called with."""
        memo_key = (id(fn), static)
        if memo_key in self._functions:
            return self._functions[memo_key]
        if not isinstance(fn, types.FunctionType):
            raise ModError(f"{role} must be a Python function, got {type(fn).__name__}")
        node, line_offset = _function_node(fn, role)
        args = [a.arg for a in node.args.args]
        if node.args.vararg or node.args.kwarg or node.args.kwonlyargs:
            raise ModError(f"{role} {fn.__qualname__}: only plain positional parameters "
                           f"are supported")
        if params is not None and len(args) != len(params):
            raise ModError(f"{role} must take {len(params)} arguments {params}, "
                           f"{fn.__qualname__} takes {len(args)} {tuple(args)}")
        name = f"_fn{len(self._functions)}"
        self._functions[memo_key] = name
        self._alive.append(fn)
        body = node.body if isinstance(node, ast.FunctionDef) else [ast.Return(node.body)]
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str) and len(body) > 1):
            body = body[1:]  # the docstring
        constants = {args[i]: value for i, value in static}
        for mode in ("ct", "torch"):
            rewriter = _Rewriter(self, fn, role, args, constants, body, line_offset, mode, path)
            new_body = rewriter.statements(copy.deepcopy(body))
            definition = ast.FunctionDef(
                name=name if mode == "ct" else name + "_torch",
                args=ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in args]
                                   + [ast.arg(CAPTURES)], kwonlyargs=[], kw_defaults=[],
                                   defaults=[]),
                body=new_body or [ast.Pass()], decorator_list=[], returns=None, type_params=[])
            self.definitions.append(ast.unparse(ast.fix_missing_locations(definition)) + "\n")
            if mode == "torch":
                self.twins[name] = (definition, fn, path)
            else:
                self.ct_defs[name] = definition
        return name

    def slot(self, tensor: torch.Tensor, where: str, path: tuple) -> int:
        for index, held in enumerate(self.captures):
            if held is tensor:
                return index
        if tensor.dtype not in _CAPTURE_DTYPES:
            raise ModError(f"{where}: captured tensor has dtype {tensor.dtype}; the kernel "
                           "reads float16/bfloat16/float32, integer or bool tensors")
        self.captures.append(tensor)
        self.paths.append(path)
        return len(self.captures) - 1


def _function_node(fn: types.FunctionType, role: str):
    """The function's ``def`` (or lambda) node and the line offset that makes its line numbers
    the file's."""
    try:
        lines, first = inspect.getsourcelines(fn)
        source = textwrap.dedent("".join(lines))
    except (OSError, TypeError) as exc:
        raise ModError(f"{role} {fn.__qualname__}: its source is not available ({exc}); define "
                       "it with def in a .py file") from None
    offset = max(first, 1) - 1
    if fn.__name__ != "<lambda>":
        try:
            tree = ast.parse(source)
        except SyntaxError:
            tree = ast.parse("if True:\n" + textwrap.indent(source, " "))
            offset -= 1
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == fn.__name__:
                return node, offset
    else:
        wanted = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
        try:
            tree = ast.parse(source.strip().rstrip(",;\\"))
        except SyntaxError:
            tree = None
        lambdas = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda)
                   and [a.arg for a in n.args.args] == wanted] if tree else []
        if len(lambdas) == 1:
            return lambdas[0], offset
    raise ModError(f"{role} {fn.__qualname__}: could not find its definition in its source; "
                   "write it as a def in a .py file")


def _resolve(fn: types.FunctionType, name: str):
    """``(found, value, step, guard)`` for a free name of ``fn``: its closure cell, else its
    globals, else the builtins; ``step`` leads there from ``fn`` (None for builtins)."""
    code = fn.__code__
    if name in code.co_freevars and fn.__closure__:
        index = code.co_freevars.index(name)
        cell = fn.__closure__[index]
        try:
            value = cell.cell_contents
        except ValueError:
            return False, None, None, lambda: True
        return True, value, ("cell", index), lambda c=cell, v=value: c.cell_contents is v
    if name in fn.__globals__:
        value = fn.__globals__[name]
        return True, value, ("global", name), lambda g=fn.__globals__, v=value: g.get(name) is v
    builtins = fn.__globals__.get("__builtins__", {})
    builtins = builtins if isinstance(builtins, dict) else vars(builtins)
    if name in builtins:
        return True, builtins[name], None, lambda: True
    return False, None, None, lambda: True


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
           ast.BitXor: operator.xor}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_,
          ast.Invert: operator.invert}
_NOT_CONSTANT = object()


def _constant_value(node: ast.AST):
    """The value of an expression made of constants only (after translation), else
    _NOT_CONSTANT."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float)):
        return node.value
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "math" and node.attr in ("inf", "nan", "pi", "e")):
        return getattr(math, node.attr)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _constant_value(node.operand)
        return value if value is _NOT_CONSTANT else _UNARY[type(node.op)](value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _constant_value(node.left), _constant_value(node.right)
        if _NOT_CONSTANT in (left, right):
            return _NOT_CONSTANT
        try:
            return _BINOPS[type(node.op)](left, right)
        except (ArithmeticError, TypeError):
            return _NOT_CONSTANT
    return _NOT_CONSTANT


class _Rewriter(ast.NodeTransformer):
    """Rewrites one function body for one target: ``mode`` "ct" (cuTile) or "torch" (twin)."""

    def __init__(self, translator: _Translator, fn, role: str, args: list, constants: dict,
                 body: list, line_offset: int, mode: str, path: tuple):
        self.t, self.fn, self.role, self.mode, self.path = translator, fn, role, mode, path
        self.line_offset = line_offset
        self.constants = constants                 # parameters fixed by the caller
        self.locals = set(args) | _assigned_names(body)
        # Names whose values depend on the mod's arguments (parameters not fixed, and locals
        # assigned from such values or from captured tensors).
        self.dynamic = {a for a in args if a not in constants}
        self._find_dynamic(body)

    # -- helpers ---------------------------------------------------------------------------

    def _where(self, node) -> str:
        line = getattr(node, "lineno", None)
        file = getattr(self.fn.__code__, "co_filename", "?")
        at = f"line {line + self.line_offset}" if line is not None else "line ?"
        return f"{self.role} {self.fn.__qualname__} ({file}, {at})"

    def _refuse(self, node, what: str):
        raise ModError(f"{self._where(node)}: {what}")

    def _lookup(self, name: str, node):
        found, value, step, guard = _resolve(self.fn, name)
        if not found:
            self._refuse(node, f"name {name!r} is not defined")
        self.t.guards.append(guard)
        return value, (None if step is None else self.path + (step,))

    def _is_dynamic(self, node: ast.AST) -> bool:
        """Whether a (source) expression depends on the mod's arguments or reads a captured
        tensor: such a value is per element in the kernel."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                if sub.id in self.dynamic:
                    return True
                if sub.id not in self.locals and sub.id not in self.constants:
                    found, value, _, _ = _resolve(self.fn, sub.id)
                    if found and isinstance(value, torch.Tensor):
                        return True
        return False

    def _find_dynamic(self, body: list) -> None:
        changed = True
        while changed:
            changed = False
            for stmt in body:
                for node in ast.walk(stmt):
                    targets, value = (), None
                    if isinstance(node, ast.Assign):
                        targets, value = node.targets, node.value
                    elif isinstance(node, ast.AugAssign):
                        targets, value = [node.target], node
                    for target in targets:
                        for name in ast.walk(target):
                            if (isinstance(name, ast.Name) and name.id not in self.dynamic
                                    and self._is_dynamic(value)):
                                self.dynamic.add(name.id)
                                changed = True

    def _ct(self, name: str) -> ast.expr:
        """``ct.name`` (kernel) or ``torch.name`` (twin)."""
        module = "ct" if self.mode == "ct" else "torch"
        return ast.Attribute(ast.Name(module, ast.Load()), name, ast.Load())

    # -- statements ------------------------------------------------------------------------

    def statements(self, body: list) -> list:
        out = []
        for stmt in body:
            result = self.visit(stmt)
            out.extend(result if isinstance(result, list) else [result])
        return out

    def visit_Return(self, node):
        if node.value is None:
            self._refuse(node, "a mod must return a value")
        return self.generic_visit(node)

    def visit_Assign(self, node):
        for target in node.targets:
            if not isinstance(target, ast.Name):
                self._refuse(node, f"assign to plain names only, not {ast.unparse(target)!r}")
        return self.generic_visit(node)

    def visit_AugAssign(self, node):
        if not isinstance(node.target, ast.Name):
            self._refuse(node, f"assign to plain names only, not {ast.unparse(node.target)!r}")
        node.value = self.visit(node.value)
        return node

    def visit_Pass(self, node):
        return node

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant):  # a string as a comment
            return ast.Pass()
        self._refuse(node, f"an expression statement ({ast.unparse(node)!r}) does nothing in "
                           "a mod")

    def visit_If(self, node):
        if self._is_dynamic(node.test):
            self._refuse(node, f"`if {ast.unparse(node.test)}` depends on the mod's arguments "
                               "(a per-element value): use torch.where(condition, a, b)")
        node.test = self.visit(node.test)
        node.body = self.statements(node.body) or [ast.Pass()]
        node.orelse = self.statements(node.orelse)
        return node

    def visit_For(self, node):
        """Unrolled: over a captured tuple / list (of functions or numbers) or a constant
        ``range``."""
        if node.orelse or not isinstance(node.target, ast.Name):
            self._refuse(node, "only `for name in <captured tuple or range(...)>:` loops")
        items = None
        if isinstance(node.iter, ast.Name) and node.iter.id not in self.locals:
            value, path = self._lookup(node.iter.id, node)
            if isinstance(value, (tuple, list)):
                items = [(item, None if path is None else path + (("item", i),))
                         for i, item in enumerate(value)]
        elif (isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Name)
              and node.iter.func.id == "range" and not node.iter.keywords):
            bounds = [_constant_value(self.visit(copy.deepcopy(a))) for a in node.iter.args]
            if _NOT_CONSTANT not in bounds and all(isinstance(b, int) for b in bounds):
                items = [(i, None) for i in range(*bounds)]
        if items is None:
            self._refuse(node, f"`for ... in {ast.unparse(node.iter)}`: a mod may only loop "
                               "over a captured tuple or a constant range (it is unrolled)")
        out = []
        for item, path in items:
            bound = self._bind(node.target.id, item, path, node)
            for stmt in node.body:
                out.extend(self.statements([_NameSubstitute({node.target.id: bound}).visit(
                    copy.deepcopy(stmt))]))
        return out or [ast.Pass()]

    def _bind(self, name: str, item, path, node) -> ast.expr:
        """The expression a loop variable stands for in one unrolled copy of the body."""
        if isinstance(item, (bool, int, float)):
            return _number(item, node)
        if isinstance(item, types.FunctionType):
            return ast.Name(self._translate_callee(item, path, node, ()), ast.Load())
        self._refuse(node, f"loop over a {type(item).__name__}: a mod may loop over functions "
                           "or numbers")

    def generic_visit(self, node):
        allowed = (ast.Return, ast.Assign, ast.AugAssign, ast.BinOp, ast.UnaryOp, ast.Compare,
                   ast.Call, ast.Name, ast.Constant, ast.Subscript, ast.Attribute, ast.IfExp,
                   ast.BoolOp, ast.Load, ast.Store, ast.operator, ast.unaryop, ast.cmpop,
                   ast.boolop, ast.keyword, ast.Tuple)
        if not isinstance(node, allowed):
            kind = {ast.List: "a list", ast.Dict: "a dict", ast.Set: "a set",
                    ast.ListComp: "a list comprehension", ast.DictComp: "a dict comprehension",
                    ast.SetComp: "a set comprehension", ast.GeneratorExp: "a generator",
                    ast.While: "a while loop", ast.Lambda: "a lambda inside a mod",
                    ast.FunctionDef: "a def inside a mod", ast.JoinedStr: "an f-string",
                    ast.Starred: "*args"}.get(type(node), f"`{type(node).__name__}`")
            self._refuse(node, f"{kind} cannot run in the kernel (a mod computes one value per "
                               "element from its arguments, numbers and captured tensors)")
        return super().generic_visit(node)

    # -- expressions -----------------------------------------------------------------------

    def visit_Tuple(self, node):
        self._refuse(node, "a tuple cannot run in the kernel outside an index")

    def visit_IfExp(self, node):
        if self._is_dynamic(node.test):
            self._refuse(node, f"`... if {ast.unparse(node.test)} else ...` depends on the mod's "
                               "arguments: use torch.where(condition, a, b)")
        return self.generic_visit(node)

    def visit_BoolOp(self, node):
        if any(self._is_dynamic(v) for v in node.values):
            word = "and" if isinstance(node.op, ast.And) else "or"
            self._refuse(node, f"`{word}` on per-element values: use "
                               f"{'&' if word == 'and' else '|'} (with parentheses)")
        return self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not) and self._is_dynamic(node.operand):
            self._refuse(node, "`not` on a per-element value: use ~")
        return self.generic_visit(node)

    def visit_Compare(self, node):
        if len(node.ops) > 1 and self._is_dynamic(node):
            self._refuse(node, f"a chained comparison ({ast.unparse(node)!r}) on per-element "
                               "values: write (a < b) & (b < c)")
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name):
        if node.id in self.constants and isinstance(node.ctx, ast.Load):
            return _number(self.constants[node.id], node)
        if node.id in self.locals or not isinstance(node.ctx, ast.Load):
            return node
        value, path = self._lookup(node.id, node)
        if isinstance(value, (bool, int, float)):
            return _number(value, node)
        if value is math or value is torch:
            return node
        if isinstance(value, torch.Tensor):
            self._refuse(node, f"captured tensor {node.id!r} must be indexed ({node.id}[...]); "
                               "the kernel reads it element by element")
        if isinstance(value, types.FunctionType):
            return ast.copy_location(
                ast.Name(self._translate_callee(value, path, node, ()), ast.Load()), node)
        self._refuse(node, f"captured {node.id!r} is a {type(value).__name__}; a mod may "
                           "capture tensors, numbers and functions")

    def _translate_callee(self, fn, path, node, static: tuple) -> str:
        if path is None:
            self._refuse(node, f"function {fn.__qualname__} is not reachable from the mod")
        return self.t.function(fn, "function", path=path, static=static)

    def visit_Subscript(self, node: ast.Subscript):
        if not (isinstance(node.value, ast.Name) and node.value.id not in self.locals
                and node.value.id not in self.constants):
            self._refuse(node, f"indexing {ast.unparse(node.value)!r}: a mod may index captured "
                               "tensors only")
        value, path = self._lookup(node.value.id, node)
        if not isinstance(value, torch.Tensor):
            self._refuse(node, f"captured {node.value.id!r} is a {type(value).__name__}; a mod "
                               "may index captured tensors only")
        index = node.slice
        items = list(index.elts) if isinstance(index, ast.Tuple) else [index]
        if any(isinstance(i, (ast.Slice, ast.Starred)) for i in items):
            self._refuse(node, f"index {node.value.id} with one index per dim (no slices)")
        if len(items) != value.dim():
            self._refuse(node, f"{node.value.id} has {value.dim()} dims; index it with "
                               f"{value.dim()} indices, got {len(items)}")
        slot = self.t.slot(value, self._where(node), path)
        items = [self.visit(i) for i in items]
        array = ast.Subscript(ast.Name(CAPTURES, ast.Load()), ast.Constant(slot), ast.Load())
        if self.mode == "torch":
            return ast.copy_location(ast.Subscript(array, ast.Tuple(items, ast.Load()),
                                                   ast.Load()), node)
        gather = ast.Call(self._ct("gather"), [array, ast.Tuple(items, ast.Load())], [])
        if value.dtype == torch.bool:  # read as uint8 bytes
            gather = ast.Compare(gather, [ast.NotEq()], [ast.Constant(0)])
        return ast.copy_location(gather, node)

    def visit_Attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id not in self.locals:
            value, _ = self._lookup(node.value.id, node)
            if value is torch:
                if node.attr not in TORCH_TO_CT:
                    self._refuse(node, f"torch.{node.attr} is not available in the kernel; "
                                       f"supported: {', '.join(sorted(TORCH_TO_CT))}")
                if self.mode == "torch":
                    return node
                return ast.copy_location(self._ct(TORCH_TO_CT[node.attr]), node)
            if value is math:
                return node
        self._refuse(node, f"attribute access {ast.unparse(node)!r} is not supported in a mod")

    def visit_BinOp(self, node: ast.BinOp):
        new = self.generic_visit(node)
        if (self.mode == "ct" and self.t.fast_math and isinstance(new.op, ast.Div)
                and isinstance(new.right, ast.Constant)
                and type(new.right.value) in (int, float) and new.right.value != 0):
            return ast.copy_location(ast.BinOp(new.left, ast.Mult(),
                                               ast.Constant(1.0 / new.right.value)), node)
        return new

    def visit_Call(self, node: ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in self.t.generated:
            # a loop variable bound to a translated function (see visit_For)
            args = [self.visit(a) for a in node.args]
            name = func.id + ("_torch" if self.mode == "torch" else "")
            return ast.copy_location(ast.Call(ast.Name(name, ast.Load()), args + [
                ast.Name(CAPTURES, ast.Load())], []), node)
        if isinstance(func, ast.Attribute) and not (
                isinstance(func.value, ast.Name) and func.value.id not in self.locals
                and _resolve(self.fn, func.value.id)[1] in (torch, math)):
            return self._method_call(node)
        if isinstance(func, ast.Name) and func.id not in self.locals:
            value, path = self._lookup(func.id, node)
            if value is float and len(node.args) == 1 and not node.keywords and isinstance(
                    node.args[0], ast.Constant) and str(node.args[0].value).strip().lower() in (
                    "inf", "-inf", "+inf"):
                return _number(float(node.args[0].value), node)  # float("-inf")
            if node.keywords:
                self._refuse(node, "keyword arguments are not supported in a mod")
            if value in BUILTINS:
                return self._builtin(node, value)
            if isinstance(value, types.FunctionType):
                args = [self.visit(a) for a in node.args]
                static = tuple((i, v) for i, v in enumerate(map(_constant_value, args))
                               if v is not _NOT_CONSTANT)
                name = self._translate_callee(value, path, node, static)
                return ast.copy_location(ast.Call(ast.Name(name + (
                    "_torch" if self.mode == "torch" else ""), ast.Load()),
                    args + [ast.Name(CAPTURES, ast.Load())], []), node)
        if node.keywords:
            self._refuse(node, "keyword arguments are not supported in a mod")
        new = self.generic_visit(node)
        if self.mode == "ct" and self.t.fast_math and ast.unparse(new.func) == "ct.tanh":
            new.keywords.append(ast.keyword("rounding_mode", ast.parse(
                "ct.RoundingMode.APPROX", mode="eval").body))
        return new

    def _builtin(self, node: ast.Call, builtin) -> ast.expr:
        args = [self.visit(a) for a in node.args]
        if all(_constant_value(a) is not _NOT_CONSTANT for a in args):
            return ast.copy_location(ast.Call(node.func, args, []), node)
        if builtin is not abs and len(args) != 2:
            self._refuse(node, f"{builtin.__name__}() of per-element values takes two arguments")
        name = BUILTINS[builtin]
        func = self._ct(name) if self.mode == "ct" else ast.Name(f"_twin_{name}", ast.Load())
        return ast.copy_location(ast.Call(func, args, []), node)

    def _method_call(self, node: ast.Call) -> ast.expr:
        """The methods transformers' mask functions call on index tensors."""
        method = node.func.attr
        if method == "to":
            return self.visit(node.func.value)  # devices and dtypes are the kernel's own
        if method in ("new_ones", "new_zeros"):
            dtype = [k for k in node.keywords if k.arg == "dtype"]
            shape_ok = (len(node.args) == 1 and isinstance(node.args[0], ast.Tuple)
                        and not node.args[0].elts)
            if (shape_ok and len(dtype) == 1 and len(node.keywords) == 1
                    and ast.unparse(dtype[0].value) == "torch.bool"):
                return _number(method == "new_ones", node)
        self._refuse(node, f"attribute access {ast.unparse(node.func)!r} (a method call) is not "
                           "supported in a mod (torch functions and indexing are)")


def _assigned_names(body: list) -> set:
    names = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _number(value, node: ast.AST) -> ast.expr:
    """A captured or literal number as source: a constant, or ``math.inf`` / ``math.nan``."""
    if isinstance(value, float) and not math.isfinite(value):
        text = "math.nan" if math.isnan(value) else ("-math.inf" if value < 0 else "math.inf")
        return ast.copy_location(ast.parse(text, mode="eval").body, node)
    return ast.copy_location(ast.Constant(value), node)


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
