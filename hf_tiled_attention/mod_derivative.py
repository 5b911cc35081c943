"""The derivative of a translated score_mod in its score, by symbolic differentiation.

The backward needs ``d mod(s) / d s`` per score: dS = P * (dP - Delta) * mod'(s). The
translator (mod_translator.py) turns a score_mod into one expression of its arguments (its
assignments substituted), in cuTile's names (``ct.tanh``) and in torch's (``torch.tanh``);
:func:`score_derivative` turns
that expression into the expression of its derivative, in the same names, so the same
translation feeds the kernels (``score_mod_grad``) and the torch twin the tests check it with
(``score_mod_grad_torch``). What the translator accepts is covered: ``+ - * /``, ``**`` by a
constant, unary minus, ``where``, ``tanh``, ``exp``, ``exp2``, ``log``, ``log2``, ``sqrt``,
``sin``, ``cos``, ``abs``, ``minimum``, ``maximum``, ``floor`` / ``ceil`` (derivative 0), and
anything that does not read the score (gathers from captured tensors, index arithmetic: 0).
A call of another translated function on the score, or indexing by the score, has no
derivative here (:class:`NotDifferentiable`): that score_mod's backward stays on the
reference path. The derivatives follow torch autograd's conventions where a function has a
kink (``abs`` at 0: 0; ``minimum`` / ``maximum`` at a tie: half to each side).
"""

from __future__ import annotations

import ast
import copy
import math
from typing import Optional

# The functions of each namespace the translator emits, by the name the rules below use.
# (torch's twin calls the builtins through helpers of the generated module.)
_TWIN_BUILTINS = {"_twin_abs": "abs", "_twin_minimum": "minimum", "_twin_maximum": "maximum"}
_ZERO_DERIVATIVE = ("floor", "ceil")


class NotDifferentiable(ValueError):
    """The expression uses something this module has no derivative rule for."""


def score_derivative(expr: ast.expr, score: str, namespace: str) -> ast.expr:
    """The derivative of ``expr`` in the name ``score``, as an expression in the same names
    (``namespace``: ``"ct"`` or ``"torch"``, the module whose ``where`` the result calls). A
    derivative that is 0 everywhere is the constant 0.0."""
    derived = _Differentiator(score, namespace).d(expr)
    return ast.Constant(0.0) if derived is None else derived


class _Differentiator:
    """``d(node)``: the derivative as an AST, None for 0 (so the rules can drop terms)."""

    def __init__(self, score: str, namespace: str):
        self.score = score
        self.namespace = namespace

    def reads_score(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id == self.score for n in ast.walk(node))

    def d(self, node: ast.expr) -> Optional[ast.expr]:
        if not self.reads_score(node):
            return None
        if isinstance(node, ast.Name):
            return _ONE()
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return _neg(self.d(node.operand))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
            return self.d(node.operand)
        if isinstance(node, ast.BinOp):
            return self.binop(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise NotDifferentiable(f"no derivative rule for {ast.unparse(node)!r}")

    def binop(self, node: ast.BinOp) -> Optional[ast.expr]:
        left, right, op = node.left, node.right, node.op
        if isinstance(op, ast.Add):
            return _add(self.d(left), self.d(right))
        if isinstance(op, ast.Sub):
            return _add(self.d(left), _neg(self.d(right)))
        if isinstance(op, ast.Mult):
            return _add(_mul(self.d(left), right), _mul(left, self.d(right)))
        if isinstance(op, ast.Div):
            quotient = _div(self.d(left), right)
            if not self.reads_score(right):
                return quotient
            # d(a / b) = da / b - a * db / b**2
            return _add(quotient, _neg(_div(_mul(left, self.d(right)), _mul(right, right))))
        if isinstance(op, ast.Pow) and not self.reads_score(right):
            # d(a ** n) = n * a ** (n - 1) * da
            return _mul(_mul(right, _power(left, right)), self.d(left))
        raise NotDifferentiable(f"no derivative rule for {ast.unparse(node)!r}")

    def call(self, node: ast.Call) -> Optional[ast.expr]:
        name = _function_name(node, self.namespace)
        args = node.args
        if name == "where" and len(args) == 3 and not self.reads_score(args[0]):
            yes, no = self.d(args[1]), self.d(args[2])
            if yes is None and no is None:
                return None
            return self.where(args[0], _or_zero(yes), _or_zero(no))
        if name in _ZERO_DERIVATIVE:
            return None
        if name is None or len(args) not in (1, 2):
            raise NotDifferentiable(f"no derivative rule for {ast.unparse(node)!r}")
        if name in ("minimum", "maximum") and len(args) == 2:
            a, b = args
            first = ast.Compare(copy.deepcopy(a), [ast.Lt() if name == "minimum" else ast.Gt()],
                                [copy.deepcopy(b)])
            second = ast.Compare(copy.deepcopy(b), [ast.Lt() if name == "minimum" else ast.Gt()],
                                 [copy.deepcopy(a)])
            da, db = _or_zero(self.d(a)), _or_zero(self.d(b))
            tie = _mul(ast.Constant(0.5), _add(self.d(a), self.d(b)))
            return self.where(first, da, self.where(second, db, _or_zero(tie)))
        if len(args) != 1:
            raise NotDifferentiable(f"no derivative rule for {ast.unparse(node)!r}")
        x = args[0]
        outer = self.outer(name, node, x)
        return _mul(outer, self.d(x))

    def outer(self, name: str, call: ast.Call, x: ast.expr) -> ast.expr:
        """The derivative of a one-argument function at ``x`` (``call`` is f(x) itself)."""
        f = copy.deepcopy(call)
        if name == "tanh":  # 1 - tanh(x)^2
            return ast.BinOp(ast.Constant(1.0), ast.Sub(), ast.BinOp(f, ast.Mult(),
                                                                       copy.deepcopy(call)))
        if name == "exp":
            return f
        if name == "exp2":
            return ast.BinOp(f, ast.Mult(), ast.Constant(math.log(2.0)))
        if name == "log":
            return ast.BinOp(ast.Constant(1.0), ast.Div(), copy.deepcopy(x))
        if name == "log2":
            return ast.BinOp(ast.Constant(1.0 / math.log(2.0)), ast.Div(), copy.deepcopy(x))
        if name == "sqrt":
            return ast.BinOp(ast.Constant(0.5), ast.Div(), f)
        if name == "sin":
            return self.call_named("cos", x)
        if name == "cos":
            return ast.UnaryOp(ast.USub(), self.call_named("sin", x))
        if name == "abs":  # sign(x), 0 at 0 as torch's
            positive = ast.Compare(copy.deepcopy(x), [ast.Gt()], [ast.Constant(0.0)])
            negative = ast.Compare(copy.deepcopy(x), [ast.Lt()], [ast.Constant(0.0)])
            return self.where(positive, ast.Constant(1.0),
                              self.where(negative, ast.Constant(-1.0), ast.Constant(0.0)))
        raise NotDifferentiable(f"no derivative rule for {ast.unparse(call)!r}")

    def call_named(self, name: str, x: ast.expr) -> ast.Call:
        return ast.Call(ast.Attribute(ast.Name(self.namespace, ast.Load()), name, ast.Load()),
                        [copy.deepcopy(x)], [])

    def where(self, condition: ast.expr, yes: ast.expr, no: ast.expr) -> ast.Call:
        return ast.Call(ast.Attribute(ast.Name(self.namespace, ast.Load()), "where",
                                      ast.Load()), [copy.deepcopy(condition), yes, no], [])


def _function_name(node: ast.Call, namespace: str) -> Optional[str]:
    """``tanh`` of ``ct.tanh(...)`` / ``torch.tanh(...)`` (and of the twin's builtin helpers);
    None for any other call (another translated function, a method)."""
    func = node.func
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == namespace):
        return func.attr
    if isinstance(func, ast.Name) and func.id in _TWIN_BUILTINS:
        return _TWIN_BUILTINS[func.id]
    return None


def _power(base: ast.expr, exponent: ast.expr) -> ast.expr:
    """``base ** (exponent - 1)``, folded when the exponent is a number (``x ** 2`` -> ``x``)."""
    if isinstance(exponent, ast.Constant) and type(exponent.value) in (int, float):
        lower = exponent.value - 1
        if lower == 0:
            return _ONE()
        if lower == 1:
            return copy.deepcopy(base)
        return ast.BinOp(copy.deepcopy(base), ast.Pow(), ast.Constant(lower))
    return ast.BinOp(copy.deepcopy(base), ast.Pow(),
                     ast.BinOp(copy.deepcopy(exponent), ast.Sub(), ast.Constant(1)))


def _ONE() -> ast.Constant:
    return ast.Constant(1.0)


def _is_constant(node: Optional[ast.expr], value: float) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


def _or_zero(node: Optional[ast.expr]) -> ast.expr:
    return ast.Constant(0.0) if node is None else node


def _add(a: Optional[ast.expr], b: Optional[ast.expr]) -> Optional[ast.expr]:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(b, ast.UnaryOp) and isinstance(b.op, ast.USub):
        return ast.BinOp(a, ast.Sub(), b.operand)
    return ast.BinOp(a, ast.Add(), b)


def _neg(a: Optional[ast.expr]) -> Optional[ast.expr]:
    if a is None:
        return None
    if isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub):
        return a.operand
    if isinstance(a, ast.Constant) and isinstance(a.value, (int, float)):
        return ast.Constant(-a.value)
    return ast.UnaryOp(ast.USub(), a)


def _mul(a: Optional[ast.expr], b: Optional[ast.expr]) -> Optional[ast.expr]:
    """``a * b`` with either a derivative (None: 0) or an expression of the function; the
    function's sub-expressions are copied (an AST node appears once in a tree)."""
    if a is None or b is None:
        return None
    if _is_constant(a, 1.0):
        return copy.deepcopy(b)
    if _is_constant(b, 1.0):
        return copy.deepcopy(a)
    return ast.BinOp(copy.deepcopy(a), ast.Mult(), copy.deepcopy(b))


def _div(a: Optional[ast.expr], b: ast.expr) -> Optional[ast.expr]:
    if a is None:
        return None
    if _is_constant(b, 1.0):
        return a
    return ast.BinOp(copy.deepcopy(a), ast.Div(), copy.deepcopy(b))
