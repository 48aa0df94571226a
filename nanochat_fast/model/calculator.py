"""
The calculator tool the model calls in generation (`<|python_start|>expr<|python_end|>`): arithmetic and a
few string methods, e.g. calculate("1,250 * 3") -> "3750", calculate("'strawberry'.count('r')") -> "3",
calculate("__import__('os')") -> None (refused). The expression is parsed with `ast` and walked with an
allow-list, never passed to eval/exec, no name looked up; every value is bounded as it is made (MAX_INT_BITS,
MAX_LEN), the input by MAX_EXPR_CHARS and the tree by MAX_DEPTH: any input is answered in bounded time.
"""

import ast
import math
import operator
import re

MAX_EXPR_CHARS = 1000
MAX_DEPTH = 32
MAX_INT_BITS = 4096
MAX_LEN = 10_000

FUNCTIONS = {"len", "abs", "round", "min", "max", "int", "float", "str"}
STR_METHODS = set(
    "count upper lower title capitalize strip lstrip rstrip replace find startswith endswith split join".split()
)
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
ARITHMETIC = (*BINARY, ast.Pow)
DIGIT_GROUP_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class CalculatorError(ValueError):
    """The expression is not allowed, not valid, or its value would be too large."""


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _checked(v):
    """v, if it is a value the calculator may hold."""
    if isinstance(v, bool):
        raise CalculatorError("booleans are not supported")
    if not isinstance(v, (int, float, str, list)):
        raise CalculatorError(f"values of type {type(v).__name__} are not supported")
    if isinstance(v, int) and v.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"integer larger than {MAX_INT_BITS} bits")
    if isinstance(v, float) and not math.isfinite(v):
        raise CalculatorError("result is not a finite number")
    if isinstance(v, str) and len(v) > MAX_LEN:
        raise CalculatorError(f"string longer than {MAX_LEN:,} characters")
    if isinstance(v, list) and (len(v) > MAX_LEN or sum(len(s) for s in v) > MAX_LEN):
        raise CalculatorError(f"list larger than {MAX_LEN:,} characters")
    return v


def _depth_ok(tree):
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _power(a, b):
    if isinstance(a, int) and isinstance(b, int) and b >= 0:
        # |a|^b has about b * bits(a) bits: refuse before spending the time to compute it
        if b * max(1, abs(a).bit_length() - 1) > MAX_INT_BITS or b > MAX_INT_BITS:
            raise CalculatorError(f"power larger than {MAX_INT_BITS} bits")
        return a**b
    result = float(a) ** float(b)  # negative or fractional exponents: floats, O(1)
    if isinstance(result, complex):
        raise CalculatorError("complex results are not supported")
    return result


def _binary(op, a, b):
    if _is_number(a) and _is_number(b):
        if isinstance(op, ast.Pow):
            return _power(a, b)
        big = isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1
        if isinstance(op, ast.Mult) and big:
            raise CalculatorError(f"product larger than {MAX_INT_BITS} bits")
        return BINARY[type(op)](a, b)
    if isinstance(op, ast.Add) and isinstance(a, str) and isinstance(b, str):
        return a + b  # each at most MAX_LEN: _checked bounds the sum
    if isinstance(op, ast.Mult) and {type(a), type(b)} == {str, int}:
        text, times = (a, b) if isinstance(a, str) else (b, a)
        if len(text) * max(times, 0) > MAX_LEN:
            raise CalculatorError(f"string longer than {MAX_LEN:,} characters")
        return text * times
    raise CalculatorError(f"{type(op).__name__} is not supported between {type(a).__name__} and {type(b).__name__}")


def _function(name, args):
    if name == "len":
        if len(args) != 1 or not isinstance(args[0], (str, list)):
            raise CalculatorError("len() takes one string or list")
        return len(args[0])
    if name in ("int", "float", "str"):
        if len(args) != 1 or not isinstance(args[0], (int, float, str)) or isinstance(args[0], bool):
            raise CalculatorError(f"{name}() takes one number or string")
        if name != "str" and isinstance(args[0], str) and len(args[0]) > 1000:
            raise CalculatorError(f"{name}() of a string longer than 1,000 characters")
        return {"int": int, "float": float, "str": str}[name](args[0])
    if not args or not all(_is_number(a) for a in args):
        raise CalculatorError(f"{name}() takes numbers")
    if name == "abs" and len(args) == 1:
        return abs(args[0])
    if name == "round" and len(args) in (1, 2):
        if len(args) == 2 and (not isinstance(args[1], int) or abs(args[1]) > 100):
            raise CalculatorError("round() takes an integer number of digits up to 100")
        return round(*args)
    if name in ("min", "max") and len(args) >= 2:
        return (min if name == "min" else max)(args)
    raise CalculatorError(f"wrong number of arguments for {name}()")


def _method(text, name, args):
    if not isinstance(text, str):
        raise CalculatorError(f"methods are only allowed on strings, not {type(text).__name__}")
    if len(args) > 3 or not all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args):
        raise CalculatorError(f"str.{name}() takes up to three string or integer arguments")
    if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        if len(text) + (len(text) + 1) * len(args[1]) > MAX_LEN:  # worst case: every position replaced
            raise CalculatorError(f"string longer than {MAX_LEN:,} characters")
    if name == "join":
        if len(args) != 1 or not isinstance(args[0], (str, list)):
            raise CalculatorError("str.join() takes one string or list of strings")
        items = list(args[0])
        if not all(isinstance(s, str) for s in items) or len(text) * len(items) + sum(len(s) for s in items) > MAX_LEN:
            raise CalculatorError("str.join() takes strings and makes at most a bounded string")
    try:
        return getattr(str, name)(text, *args)  # name is one of STR_METHODS (checked by the caller)
    except (TypeError, ValueError) as e:
        raise CalculatorError(f"str.{name}(): {e}")


def _subscript(value, key):
    if not isinstance(value, (str, list)):
        raise CalculatorError(f"only strings and lists can be indexed, not {type(value).__name__}")
    if isinstance(key, slice):
        if key.step == 0:
            raise CalculatorError("slice step cannot be zero")
    elif not isinstance(key, int) or isinstance(key, bool):
        raise CalculatorError("indices must be integers")
    try:
        return value[key]
    except IndexError:
        raise CalculatorError("index out of range")


def _eval(node):
    if isinstance(node, ast.Constant):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        if not _is_number(v):
            raise CalculatorError("unary + and - take numbers")
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp) and isinstance(node.op, ARITHMETIC):
        return _checked(_binary(node.op, _eval(node.left), _eval(node.right)))
    if isinstance(node, ast.Call) and not node.keywords:
        if isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
            return _checked(_function(node.func.id, [_eval(a) for a in node.args]))
        if isinstance(node.func, ast.Attribute) and node.func.attr in STR_METHODS:
            return _checked(_method(_eval(node.func.value), node.func.attr, [_eval(a) for a in node.args]))
        raise CalculatorError(
            "only len, abs, round, min, max, int, float, str and string methods "
            f"({', '.join(sorted(STR_METHODS))}) can be called"
        )
    if isinstance(node, ast.Subscript):
        s = node.slice
        if isinstance(s, ast.Slice):
            bounds = [None if part is None else _eval(part) for part in (s.lower, s.upper, s.step)]
            if not all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in bounds):
                raise CalculatorError("slice bounds must be integers")
            key = slice(*bounds)
        else:
            key = _eval(s)
        return _checked(_subscript(_eval(node.value), key))
    raise CalculatorError(f"{type(node).__name__} is not allowed")


def evaluate(expr: str):
    """The value of `expr` (int, float, str or list of str); CalculatorError when it is not allowed."""
    if not isinstance(expr, str):
        raise CalculatorError("the expression must be a string")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPR_CHARS:,} characters")
    expr = DIGIT_GROUP_COMMA.sub("", expr.strip())
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not a valid expression ({type(e).__name__})")
    _depth_ok(tree)
    try:
        return _eval(tree.body)
    except (ZeroDivisionError, OverflowError) as e:
        raise CalculatorError(f"{type(e).__name__}: {e}")


def calculate(expr: str) -> str | None:
    """The result as text (5.0 as 5, other floats to 10 significant digits); None when refused."""
    try:
        v = evaluate(expr)
    except CalculatorError:
        return None
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:.10g}"
    return v if isinstance(v, str) else str(v)
