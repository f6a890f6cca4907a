"""Reading transformers' functions by their statements: what the fused paths check before they
stand in for a function (fusion/models/decode_checks.py, window_cache.py)."""

from __future__ import annotations

import ast
import inspect
import textwrap


def source_text(fn) -> str | None:
    """``fn``'s source with all whitespace removed (None where it has none)."""
    try:
        return "".join(inspect.getsource(fn).split())
    except (OSError, TypeError):
        return None


def body_statements(fn) -> list[str] | None:
    """The top-level statements of ``fn``'s body (its docstring left out), each unparsed with
    all whitespace removed; None where it has no source."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ["".join(ast.unparse(s).split()) for s in body]


def has_statements(fn, statements) -> bool:
    """Does ``fn``'s source (whitespace removed) hold each of ``statements``?"""
    src = source_text(fn)
    return src is not None and all(s in src for s in statements)


__all__ = ["body_statements", "has_statements", "source_text"]
