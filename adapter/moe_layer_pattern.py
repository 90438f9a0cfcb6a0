"""megatron's ``--moe-layer-freq`` pattern ("([1]*3+[0]*1)*3": 1 an expert layer, 0 a dense one) read without
``eval``. megatron.training's ``_eval_pattern`` checks the text's characters (digits, commas, brackets, ``+``,
``*``) and evals it: ``[1]*10**9`` builds a list of a billion entries before any check of its length, and
``[[1]]`` is a pattern of lists. Here the text is parsed as the expression it is, lists of ints joined by
``+`` and repeated by ``*``, its length known before a list is built; spaces are allowed ("[1, 1]").
"""

from __future__ import annotations

import ast

# no model has this many layers: a longer pattern is a slip (a power, a repeat too many), not a model
MOST_LAYERS = 10_000


def read(text: str) -> list[int]:
    """The pattern ``text`` spells; ValueError (argparse's usage error for the flag) for anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"not a pattern: {text!r}") from None
    pattern = _value(tree)
    if not isinstance(pattern, list):
        raise ValueError(f"not a list: {text!r}")
    return pattern


def _value(node: ast.expr) -> int | list[int]:
    """An int or a list of ints; a product is checked against ``MOST_LAYERS`` before it is built."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
        return _bounded([e.value for e in node.elts])
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            return _bounded(left + right)
        if isinstance(node.op, ast.Mult) and not (isinstance(left, list) and isinstance(right, list)):
            times, part = (left, right) if isinstance(right, list) else (right, left)
            size = times * (len(part) if isinstance(part, list) else part)
            _bounded(size)
            return part * times
    raise ValueError(f"only lists of ints, + between them and * by an int: {ast.unparse(node)!r}")


def _bounded(value: int | list[int]) -> int | list[int]:
    size = len(value) if isinstance(value, list) else value
    if size > MOST_LAYERS:
        raise ValueError(f"more than {MOST_LAYERS} layers")
    return value
