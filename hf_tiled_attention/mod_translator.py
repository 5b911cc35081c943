"""The translator behind :mod:`mods`: a score_mod / mask_mod (a Python function) into two
generated functions, cuTile's and a torch twin, that share one list of captured tensors, and
what callers read off a translation (its returned expression, whether it adds to the score,
its derivative in the score, its ``&`` terms, its canonical text).

:class:`Translator` walks the function's source (``inspect``) and rewrites it node by node
(``_Rewriter``): a captured tensor becomes a slot of the capture list (``t[i]`` a gather), a
captured number a constant, a captured function is translated too (specialised on the
constants it is called with), a ``for`` over a captured tuple is unrolled, and torch functions
become cuTile's. Anything else is a :class:`ModError` naming the mod, the file and the line.
"""

from __future__ import annotations

import ast
import copy
import inspect
import math
import operator
import textwrap
import types
from typing import Callable, Optional

import torch

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
_CAPTURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64,
                   torch.int16, torch.int8, torch.uint8, torch.bool)


class ModError(TypeError):
    """A score_mod / mask_mod that cannot run in the kernel; the message names the problem."""


def returned_expression(definition: ast.FunctionDef) -> Optional[ast.expr]:
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


def adds_to_score(definition: ast.FunctionDef) -> bool:
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

    returned = returned_expression(definition)
    return returned is not None and additive(returned)


def derivative_entries(translator: "Translator", name: str) -> list[str]:
    """The generated module's ``score_mod_grad`` / ``score_mod_grad_torch``: the score_mod's
    derivative in its score (mod_derivative), in cuTile's names and torch's; nothing when it
    has none here (a body that is not plain assignments, or a rule missing), and then its
    backward runs the reference path."""
    texts = []
    for definition in (translator.ct_defs[name], translator.twins[name][0]):
        returned = returned_expression(definition)
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


_SITE = "_site"
# A learnable capture's read that depends on the query and the key through one index item
# (a bucket table) is added per distinct index of a tile while its tile spans at most this many
# indices (a tile-wide sum each), else per score (_add_term).
GRAD_BUCKET_SPAN = 32


def capture_grad_entries(translator: "Translator", name: str) -> list[str]:
    """The generated module's ``score_mod_capture_grad`` / ``..._torch`` and
    ``CAPTURE_GRAD_SLOTS``: for a score_mod that reads floating-point captured tensors, the
    function that adds each one's gradient, ``dS * d mod / d t[index]`` where the weight ``p``
    is not 0, into a gradient array per slot: the capture tuple it gets holds, after the
    captured tensors, one array per slot (``LEARNABLE``: a bit mask of the slots to add).
    Every read of ``t[index]`` (a gather) is one term, differentiated by mod_derivative with the
    read as the variable. cuTile's adds by atomics into fp32 arrays, in the dK/dV kernel's
    orientation (keys x queries: a term whose index reads no query, or no key, is summed over
    that axis first; one that reads neither, over the whole tile), with ``PARTIALS`` each
    block into its own row of an array with a leading dim per block of the dK/dV grid
    (deterministic mode: torch sums the rows); the torch twin by
    ``index_put_(accumulate=True)``. Nothing when the mod's body is not plain assignments, it
    reads no float tensor or a rule is missing (its backward then runs the reference path)."""
    floats = {slot for slot, t in enumerate(translator.captures) if t.is_floating_point()}
    grads_at = len(translator.captures)  # slot s's gradient array: captures[grads_at + s]
    texts = []
    for definition in (translator.ct_defs[name], translator.twins[name][0]):
        torch_twin = definition.name.endswith("_torch")
        returned = returned_expression(definition)
        if returned is None:
            return []
        params = [a.arg for a in definition.args.args if a.arg != CAPTURES]
        body, slots = [], []
        for slot, site in _capture_reads(returned, floats, torch_twin):
            text = ast.unparse(site)
            variable = _ReplaceSite(text).visit(copy.deepcopy(returned))
            try:
                derived = score_derivative(variable, _SITE, "torch" if torch_twin else "ct")
            except NotDifferentiable:
                return []
            if isinstance(derived, ast.Constant) and derived.value == 0.0:
                continue
            derived = _NameSubstitute({_SITE: site}).visit(derived)
            index = _read_index(site, torch_twin)
            reads = [[any(isinstance(n, ast.Name) and n.id == params[axis]
                          for n in ast.walk(item)) for axis in (3, 4)]  # (query, key)
                     for item in index]
            body.append(_add_term(slot, grads_at + slot, derived, index, reads, torch_twin))
            slots.append(slot)
        if not body:
            return []
        partials = "" if torch_twin else ", PARTIALS"
        grad = ast.parse(f"def {definition.name}_capture_grad(p, ds, {', '.join(params)}, "
                         f"{CAPTURES}, LEARNABLE{partials}):\n    pass").body[0]
        # this block's row of the per-block arrays (PARTIALS): its index in the dK/dV grid
        block = [] if torch_twin else ast.parse(
            "_blk = ct.bid(0) + ct.num_blocks(0) * (ct.bid(1) + ct.num_blocks(1) * ct.bid(2))"
        ).body
        grad.body = block + [stmt for term in body for stmt in ast.parse(term).body] + [
            ast.Return(ast.Name("ds", ast.Load()))]
        texts.append(ast.unparse(ast.fix_missing_locations(grad)) + "\n")
    return texts + [f"score_mod_capture_grad = {name}_capture_grad",
                    f"score_mod_capture_grad_torch = {name}_torch_capture_grad",
                    f"CAPTURE_GRAD_SLOTS = {tuple(sorted(set(slots)))!r}"]


def _capture_reads(expr: ast.expr, floats: set, torch_twin: bool) -> list[tuple]:
    """(slot, read) of each distinct read of a floating-point captured tensor in ``expr``."""
    found = {}
    for node in ast.walk(expr):
        array = None
        if torch_twin and isinstance(node, ast.Subscript):
            array = node.value
        elif (not torch_twin and isinstance(node, ast.Call)
              and ast.unparse(node.func) == "ct.gather"):
            array = node.args[0]
        if (isinstance(array, ast.Subscript) and isinstance(array.value, ast.Name)
                and array.value.id == CAPTURES and isinstance(array.slice, ast.Constant)
                and array.slice.value in floats):
            found.setdefault(ast.unparse(node), (array.slice.value, node))
    return list(found.values())


def _read_index(site: ast.expr, torch_twin: bool) -> list:
    index = site.slice if torch_twin else site.args[1]
    return list(index.elts) if isinstance(index, ast.Tuple) else [index]


def _add_term(slot: int, target: int, derived: ast.expr, index: list, reads: list,
              torch_twin: bool) -> str:
    """Source of one term's add into ``captures[target]`` (:func:`capture_grad_entries`);
    ``reads``: per index item, whether it reads (the query, the key)."""
    where = "torch.where" if torch_twin else "ct.where"
    items = _index_text(index)
    lines = [f"if LEARNABLE & {1 << slot}:",
             f"    _g = {where}(p > 0.0, ds * ({ast.unparse(derived)}), 0.0)"]
    if torch_twin:
        lines.append(f"    _twin_index_add({CAPTURES}[{target}], ({items}), _g)")
        return "\n".join(lines)
    reads_query, reads_key = (any(item[axis] for item in reads) for axis in (0, 1))
    varying = [i for i, item in enumerate(reads) if any(item)]
    # With PARTIALS the array has a row per block (_blk), which only this block adds into, in
    # the order of its loop: the sums repeat bit for bit (op.backward's deterministic mode).
    add = "ct.atomic_add({}[{}], ({{}}), {{}}, memory_order=ct.MemoryOrder.RELAXED)".format(
        CAPTURES, target)
    if reads_query and reads_key and len(varying) == 1:
        # One index item reads both (a bucket table: t[buckets[k - q], h]): the scores of a
        # tile land on few entries, and per-score atomics on one address serialise. So each
        # distinct index of the tile (between its least and greatest where p > 0) gets one
        # add of its scores' sum, while they span at most GRAD_BUCKET_SPAN values.
        at = varying[0]
        buckets, with_i = ([*index[:at], ast.Name(name, ast.Load()), *index[at + 1:]]
                           for name in ("_b", "_i"))
        # With PARTIALS every span goes index by index (per-score atomics that meet on one
        # address add in any order).
        tile_sum = "ct.sum(ct.where(_i == _b, _g, 0.0))"
        lines += [f"    _i = {ast.unparse(index[at])}",
                  "    _lo = ct.min(ct.where(p > 0.0, _i, 2147483647))",
                  "    _hi = ct.max(ct.where(p > 0.0, _i, -1))",
                  "    if PARTIALS:",
                  "        for _b in range(_lo, _hi + 1):",
                  "            " + add.format("_blk, " + _index_text(buckets), tile_sum),
                  f"    elif _hi - _lo < {GRAD_BUCKET_SPAN}:",
                  "        for _b in range(_lo, _hi + 1):",
                  "            " + add.format(_index_text(buckets), tile_sum),
                  "    else:",
                  "        " + add.format(_index_text(with_i), "_g")]
        return "\n".join(lines)
    if not reads_query and not reads_key:
        lines.append("    _g = ct.sum(_g)")
    elif not reads_key:  # keys are axis 0 of the dK/dV kernel's tiles
        lines.append("    _g = ct.sum(_g, axis=0, keepdims=True)")
    elif not reads_query:
        lines.append("    _g = ct.sum(_g, axis=1, keepdims=True)")
    lines += ["    if PARTIALS:", "        " + add.format("_blk, " + items, "_g"),
              "    else:", "        " + add.format(items, "_g")]
    return "\n".join(lines)


def _index_text(index: list) -> str:
    return ", ".join(ast.unparse(i) for i in index) + ("," if len(index) == 1 else "")


class _ReplaceSite(ast.NodeTransformer):
    """Every node whose source is ``text`` becomes the name ``_site``."""

    def __init__(self, text: str):
        self.text = text

    def generic_visit(self, node):
        if isinstance(node, ast.expr) and ast.unparse(node) == self.text:
            return ast.Name(_SITE, ast.Load())
        return super().generic_visit(node)


def and_terms(node: Optional[ast.expr]) -> list:
    """The operands of a tree of ``&`` (constants True left out)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd):
        return and_terms(node.left) + and_terms(node.right)
    if isinstance(node, ast.Constant) and node.value is True:
        return []
    return [] if node is None else [node]


def canonical_text(definition: ast.FunctionDef) -> str:
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

class Translator:
    """Turns Python functions into cuTile-readable source and its torch twin, sharing one
    capture list."""

    def __init__(self, fast_math: bool = False):
        self.fast_math = fast_math
        self.definitions: list[str] = []
        self.captures: list[torch.Tensor] = []
        self.paths: list[tuple] = []                  # per slot: (role, steps...) to the tensor
        self.guards: list[Callable[[], bool]] = []    # "the captures are still the same"
        self.aliases: list[tuple] = []                # (slot, another path to its tensor)
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
                if path != self.paths[index]:  # one slot reached another way too
                    self.aliases.append((index, path))
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
    if fn.__name__ == "<lambda>":
        return _lambda_node(fn, role), 0
    try:
        lines, first = inspect.getsourcelines(fn)
        source = textwrap.dedent("".join(lines))
    except (OSError, TypeError) as exc:
        raise _no_source(fn, role, exc) from None
    offset = max(first, 1) - 1
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = ast.parse("if True:\n" + textwrap.indent(source, " "))
        offset -= 1
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == fn.__name__:
            return node, offset
    raise ModError(f"{role} {fn.__qualname__}: could not find its definition in its source; "
                   "write it as a def in a .py file")


def _lambda_node(fn: types.FunctionType, role: str) -> ast.Lambda:
    """A lambda's node in its whole file's syntax tree (a lambda may sit inside a statement
    that spans lines, which its own lines do not parse as): the lambdas with its parameters
    that start on its first line; of several, the one whose body holds the source positions
    of its code."""
    code = fn.__code__
    try:
        lines, _ = inspect.findsource(fn)
        tree = ast.parse("".join(lines))
    except (OSError, TypeError, SyntaxError) as exc:
        raise _no_source(fn, role, exc) from None
    wanted = list(code.co_varnames[:code.co_argcount])
    candidates = [node for node in ast.walk(tree) if isinstance(node, ast.Lambda)
                  and node.lineno == code.co_firstlineno
                  and [a.arg for a in node.args.args] == wanted]
    spans = _code_spans(code)
    if len(candidates) > 1 and spans:
        candidates = [node for node in candidates
                      if all(_holds(node.body, span) for span in spans)]
    if len(candidates) != 1:
        raise ModError(f"{role} {fn.__qualname__}: {len(candidates) or 'no'} lambdas with its "
                       f"parameters start on line {code.co_firstlineno} of "
                       f"{code.co_filename}, and which one it is cannot be told; give it a "
                       "line of its own or write it as a def")
    return candidates[0]


def _code_spans(code: types.CodeType) -> list:
    """``(line, column, end line, end column)`` of the source each instruction of ``code``
    came from (Python 3.11+; empty before), without the empty spans of bookkeeping ones."""
    positions = getattr(code, "co_positions", lambda: ())()
    return [(line, column, end_line, end_column)
            for line, end_line, column, end_column in positions
            if None not in (line, end_line, column, end_column)
            and (line, column) != (end_line, end_column)]


def _holds(node: ast.AST, span: tuple) -> bool:
    line, column, end_line, end_column = span
    return ((node.lineno, node.col_offset) <= (line, column)
            and (end_line, end_column) <= (node.end_lineno, node.end_col_offset))


def _no_source(fn: types.FunctionType, role: str, exc: Exception) -> ModError:
    return ModError(f"{role} {fn.__qualname__}: its source is not available ({exc}); define "
                    "it with def in a .py file")


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

    def __init__(self, translator: Translator, fn, role: str, args: list, constants: dict,
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
