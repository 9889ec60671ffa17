"""An exact, bounded calculator for SWiRL's `<math_exp>` (and the tool world's `calculate`).

The expression is parsed by Python's `ast` module (parsing never runs code) and then
walked by a small interpreter that accepts only numbers, `+ - * / // % **`, unary
signs, parentheses and a whitelist of functions. Arithmetic is exact (`fractions.Fraction`);
sizes are bounded so that no input can exhaust memory or time. Every rejection is a
`ToolError(invalid_value, ...)` with a message an agent can act on.
"""
from __future__ import annotations

import ast
import decimal
import math
import re
from fractions import Fraction
from typing import Callable

from steprl_jax.tools.protocol import INVALID_VALUE, Tool, ToolError, object_schema

MAX_EXPRESSION_CHARS = 500
MAX_LITERAL_DIGITS = 100
MAX_RESULT_BITS = 3400  # about 1,000 decimal digits, for numerator and denominator alike
MAX_EXPONENT = 10_000
DECIMAL_PLACES = 10

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
# Spellings people (and models) use that mean the same thing.
_REWRITES = {"^": "**", "×": "*", "÷": "/", "−": "-"}


def _reject(message: str) -> ToolError:
    return ToolError(INVALID_VALUE, message)


def _bounded(value: Fraction) -> Fraction:
    if value.numerator.bit_length() > MAX_RESULT_BITS or value.denominator.bit_length() > MAX_RESULT_BITS:
        raise _reject("result too large (limit: about 1000 digits)")
    return value


def _integer(value: Fraction, what: str) -> int:
    if value.denominator != 1:
        raise _reject(f"{what} must be an integer, got {format_number(value)}")
    return value.numerator


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if base == 0 and exponent < 0:  # fractional exponents too: 0 ** -0.5
        raise _reject("zero cannot be raised to a negative power")
    if exponent.denominator == 1:
        e = exponent.numerator
        if abs(e) > MAX_EXPONENT:
            raise _reject(f"exponent {e} too large (limit {MAX_EXPONENT})")
        size = max(base.numerator.bit_length(), base.denominator.bit_length())
        if size > 1 and (size - 1) * abs(e) > MAX_RESULT_BITS:  # |base| >= 2 grows at least 2**e
            raise _reject("result too large (limit: about 1000 digits)")
        return _bounded(base**e)
    if base < 0:
        raise _reject("a negative number cannot be raised to a fractional power")
    if exponent.denominator <= 16:  # try an exact root first: 8 ** (1/3) == 2
        root = _exact_root(base, exponent.denominator)
        if root is not None:
            return _power(root, Fraction(exponent.numerator))
    try:
        return _bounded(Fraction(float(base) ** float(exponent)))
    except (OverflowError, ValueError):
        raise _reject("result too large (limit: about 1000 digits)") from None
    except ZeroDivisionError:  # a base below float's range reads as 0.0: 1e-400 ** -0.5
        raise _reject("base too small for a fractional power") from None


def _exact_root(value: Fraction, degree: int) -> Fraction | None:
    def root(n: int) -> int | None:
        r = round(n ** (1.0 / degree)) if n.bit_length() < 1000 else None
        if r is None:
            return None
        for candidate in (r - 1, r, r + 1):
            if candidate >= 0 and candidate**degree == n:
                return candidate
        return None

    num, den = root(value.numerator), root(value.denominator)
    return Fraction(num, den) if num is not None and den else None


def _sqrt(x: Fraction) -> Fraction:
    if x < 0:
        raise _reject("sqrt of a negative number")
    exact = _exact_root(x, 2)
    if exact is not None:
        return exact
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        return Fraction(decimal.Decimal(x.numerator).sqrt() / decimal.Decimal(x.denominator).sqrt())


def _round(x: Fraction, places: Fraction = Fraction(0)) -> Fraction:
    """Half away from zero (what people mean by rounding), to `places` decimals (0..15)."""
    n = _integer(places, "round's number of places")
    if not 0 <= n <= 15:
        raise _reject("round's number of places must be between 0 and 15")
    scale = Fraction(10) ** n
    magnitude = math.floor(abs(x) * scale + Fraction(1, 2))
    return Fraction(magnitude if x >= 0 else -magnitude) / scale


def _min_max(pick: Callable) -> Callable:
    def apply(*values: Fraction) -> Fraction:
        if not values:
            raise _reject("min/max need at least one argument")
        return pick(values)

    return apply


_FUNCTIONS: dict[str, tuple[Callable, tuple[int, int]]] = {
    "sqrt": (_sqrt, (1, 1)),
    "abs": (abs, (1, 1)),
    "round": (_round, (1, 2)),
    "floor": (lambda x: Fraction(math.floor(x)), (1, 1)),
    "ceil": (lambda x: Fraction(math.ceil(x)), (1, 1)),
    "min": (_min_max(min), (1, 50)),
    "max": (_min_max(max), (1, 50)),
}


class _Evaluator:
    def __init__(self, source: str):
        self.source = source

    def visit(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        if isinstance(node, ast.Constant):
            return self.number(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.visit(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOL:
            return self.binary(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Tuple):
            raise _reject("commas are only allowed between function arguments (write 1000, not 1,000)")
        if isinstance(node, ast.Name):
            raise _reject(f"unknown name {node.id[:30]!r}: only numbers and the functions "
                          f"{', '.join(_FUNCTIONS)} are allowed")
        raise _reject(f"unsupported syntax ({type(node).__name__}): only arithmetic is allowed")

    def number(self, node: ast.Constant) -> Fraction:
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise _reject(f"unsupported literal {ast.get_source_segment(self.source, node)!r:.40}")
        # Without underscores before any check: the exponent of 1e+1_000_000_000 is not "+1".
        text = (ast.get_source_segment(self.source, node) or repr(node.value)).replace("_", "")
        if sum(ch.isdigit() for ch in text) > MAX_LITERAL_DIGITS:
            raise _reject(f"number too long (limit {MAX_LITERAL_DIGITS} digits)")
        exponent = re.search(r"[eE]([+-]?\d+)", text)
        if exponent and abs(int(exponent.group(1))) > 1000:  # Fraction('1e99999999') would build the integer
            raise _reject("number too large (scientific exponent limit 1000)")
        try:
            value = Fraction(text)  # the literal as written: 0.1 stays exactly 1/10
        except (ValueError, ZeroDivisionError):
            raise _reject(f"cannot read number {text[:40]!r}") from None
        return _bounded(value)

    def binary(self, node: ast.BinOp) -> Fraction:
        left, right = self.visit(node.left), self.visit(node.right)
        op = type(node.op)
        if op in _BINARY:
            return _bounded(_BINARY[op](left, right))
        if op is ast.Pow:
            return _power(left, right)
        if right == 0:
            raise _reject(f"division by zero in '{_SYMBOL[op]}'")
        if op is ast.Div:
            return _bounded(left / right)
        if op is ast.FloorDiv:
            return _bounded(Fraction(left // right))
        return _bounded(left % right)

    def call(self, node: ast.Call) -> Fraction:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            name = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise _reject(f"unknown function {name[:30]!r}; allowed: {', '.join(_FUNCTIONS)}")
        if node.keywords:
            raise _reject("keyword arguments are not allowed")
        fn, (lowest, highest) = _FUNCTIONS[node.func.id]
        if not lowest <= len(node.args) <= highest:
            raise _reject(f"{node.func.id} takes {lowest}..{highest} arguments, got {len(node.args)}")
        return _bounded(fn(*[self.visit(arg) for arg in node.args]))


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, or `ToolError(invalid_value)` saying why not."""
    if not isinstance(expression, str):
        raise _reject("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise _reject(f"expression too long ({len(expression)} characters, limit {MAX_EXPRESSION_CHARS})")
    source = expression.strip()
    for spelling, canonical in _REWRITES.items():
        source = source.replace(spelling, canonical)
    if not source:
        raise _reject("empty expression")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        reason = err.msg if isinstance(err, SyntaxError) else type(err).__name__
        raise _reject(f"cannot parse expression: {reason}") from None
    try:
        return _Evaluator(source).visit(tree)
    except RecursionError:
        raise _reject("expression nested too deeply") from None


def format_number(value: Fraction, places: int = DECIMAL_PLACES) -> str:
    """`24`, `2.5`, `-0.3333333333`: an integer, else a decimal with at most `places` digits."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = math.floor(abs(value) * 10**places + Fraction(1, 2))
    sign = "-" if value < 0 and scaled else ""
    whole, frac = divmod(scaled, 10**places)
    digits = str(frac).rjust(places, "0").rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def calculate(expression: str) -> str:
    """The formatted value of `expression` (raises `ToolError` on a bad expression)."""
    return format_number(evaluate(expression))


def calculator_tool(name: str = "calculator") -> Tool:
    return Tool(
        name=name,
        description=("Evaluate an arithmetic expression exactly. Supports numbers, + - * / // % ** and "
                     "parentheses, and the functions sqrt, abs, round, min, max, floor, ceil."),
        parameters=object_schema({"expression": {
            "type": "string", "description": "for example '(48 + 24) / 2' or 'sqrt(2) * 3'",
            "maxLength": MAX_EXPRESSION_CHARS}}),
        fn=calculate,
        timeout_s=2.0,
    )
