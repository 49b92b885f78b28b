"""Mutants: the single-point slips a developer makes, generated from a module's syntax tree.

Each mutant changes one node of one line: a comparison (``<`` for ``<=``, ``==`` for ``!=``, ``in``
for ``not in``), a boolean (``and`` for ``or``, one condition of an ``and``/``or`` dropped, a ``not``
dropped), ``any`` for ``all`` and ``min`` for ``max``, an integer one larger, a float doubled,
``True`` for ``False``, an arithmetic or bitwise operator swapped (``+``/``-``, ``*``/``/``,
``<<``/``>>``, ``&``/``|``), ``+=`` for ``-=``, or a statement dropped (a call made for its effect, a
state update, a ``+=``, a ``raise``). Text that only speaks (docstrings, messages, f-strings, log
calls, annotations, what a ``raise`` builds) is left alone, and so is a line marked
``# pragma: no mutate``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

SWAP_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}
SWAP_BINARY: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
    ast.BitXor: ast.BitOr,
}
SWAP_CALL = {"any": "all", "all": "any", "min": "max", "max": "min"}
LOGGERS = {"log", "logger", "_log", "LOG", "_logger", "warnings"}
NO_MUTATE = "pragma: no mutate"


@dataclass(frozen=True)
class Mutant:
    """One slip: ``source`` is the whole module with it planted."""

    module: str
    key: str  # stable across edits elsewhere: where (qualified name), what, and which occurrence
    line: int
    operator: str
    before: str
    after: str
    source: str

    def describe(self) -> str:
        return f"{self.module}:{self.line} [{self.operator}] {self.before!r} -> {self.after!r}"


class _Lines:
    """Source text with ast's (line, UTF-8 byte column) positions turned into string offsets."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.starts = [0]
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))
        self.lines = source.splitlines(keepends=True)

    def offset(self, line: int, byte_col: int) -> int:
        text = self.lines[line - 1]
        return self.starts[line - 1] + len(text.encode()[:byte_col].decode(errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        n: ast.expr | ast.stmt = node  # type: ignore[assignment]
        assert n.end_lineno is not None and n.end_col_offset is not None
        return self.offset(n.lineno, n.col_offset), self.offset(n.end_lineno, n.end_col_offset)

    def replace(self, node: ast.AST, text: str) -> tuple[str, str]:
        start, end = self.span(node)
        return self.source[start:end], self.source[:start] + text + self.source[end:]


def _silent(node: ast.AST) -> bool:
    """Subtrees that only speak: f-strings, log and warning calls."""
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = node.func.value
        return isinstance(owner, ast.Name) and owner.id in LOGGERS
    return False


def _typelike(node: ast.AST) -> bool:
    """``X | None``, ``list[int] | Foo``: a type's spelling, by convention capitalised or subscripted."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _typelike(node.left) or _typelike(node.right)
    if isinstance(node, ast.Constant):
        return node.value is None
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return isinstance(node, ast.Subscript) or name[:1].isupper() or name in ("int", "float", "str", "bool", "bytes")


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


class _Sites(ast.NodeVisitor):
    """Walks a module, yielding (qualified name, operator, node, replacement text) for each slip."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.functions = 0  # how deep in function bodies: there, numbers passed or listed are data
        self.found: list[tuple[str, str, ast.AST, str]] = []

    def add(self, operator: str, node: ast.AST, new: ast.AST | str) -> None:
        text = new if isinstance(new, str) else f"({ast.unparse(new)})"
        self.found.append((".".join(self.scope) or "<module>", operator, node, text))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for d in node.decorator_list:
            self.visit(d)
        self.scope.append(node.name)
        self._defaults(node.args)
        self.functions += 1
        for stmt in self._body(node.body):
            self.visit(stmt)
        self.functions -= 1
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _defaults(self, args: ast.arguments) -> None:
        for d in [*args.defaults, *(k for k in args.kw_defaults if k is not None)]:
            self.visit(d)

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        # a docstring only speaks
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            return body[1:]
        return body

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in self._body(node.body):
            self.visit(stmt)
        self.scope.pop()

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        if any(isinstance(t, ast.Attribute | ast.Subscript) for t in node.targets):
            self.add("drop", node, "pass")
        self.visit(node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.add("drop", node, "pass")
        swap = {ast.Add: ast.Sub, ast.Sub: ast.Add}.get(type(node.op))
        if swap is not None:
            self.add("augassign", node, ast.unparse(ast.AugAssign(node.target, swap(), node.value)))
        self.visit(node.value)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Call) and not _silent(node.value):
            self.add("drop", node, "pass")
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        self.add("drop", node, "pass")  # what it builds is a message: not visited

    def visit_Assert(self, node: ast.Assert) -> None:
        return  # narrowing for the type checker, or a message: not a behaviour

    def visit_If(self, node: ast.If) -> None:
        if _type_checking(node):
            return
        self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return

    def visit_Call(self, node: ast.Call) -> None:
        if _silent(node):
            return
        if isinstance(node.func, ast.Name) and node.func.id in SWAP_CALL:
            self.add("call", node.func, SWAP_CALL[node.func.id])
        self.visit(node.func)
        self._data([*node.args, *(k.value for k in node.keywords)])

    def _data(self, values: list[ast.expr]) -> None:
        """Numbers passed to a call or listed in a literal inside a function are data (a case's
        sizes, a shape): left alone; at module or class level they are named constants: mutated."""
        for v in values:
            number = isinstance(v, ast.Constant) or (isinstance(v, ast.UnaryOp) and isinstance(v.operand, ast.Constant))
            if not (number and self.functions):
                self.visit(v)

    def visit_List(self, node: ast.List | ast.Tuple | ast.Set) -> None:
        self._data(node.elts)

    visit_Tuple = visit_List  # type: ignore[assignment]
    visit_Set = visit_List  # type: ignore[assignment]

    def visit_Dict(self, node: ast.Dict) -> None:
        self._data([k for k in node.keys if k is not None])
        self._data(node.values)

    def visit_Compare(self, node: ast.Compare) -> None:
        for i, op in enumerate(node.ops):
            swap = SWAP_COMPARE.get(type(op))
            if swap is not None:
                ops = list(node.ops)
                ops[i] = swap()
                self.add("compare", node, ast.Compare(node.left, ops, node.comparators))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.add("boolean", node, ast.BoolOp(other, node.values))
        for i in range(len(node.values)):
            rest = node.values[:i] + node.values[i + 1:]
            self.add("condition", node, rest[0] if len(rest) == 1 else ast.BoolOp(node.op, rest))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self.add("not", node, node.operand)
        if isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            self._number(node, node.operand.value, negative=True)
            return
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = SWAP_BINARY.get(type(node.op))
        if isinstance(node.op, ast.BitOr) and (_typelike(node.left) or _typelike(node.right)):
            return  # a union of types (an alias): not arithmetic
        if swap is not None and not isinstance(node.left, ast.Constant | ast.JoinedStr):
            self.add("arith", node, ast.BinOp(node.left, swap(), node.right))
        elif swap is not None and isinstance(node.left, ast.Constant) and not isinstance(node.left.value, str):
            self.add("arith", node, ast.BinOp(node.left, swap(), node.right))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        self._number(node, node.value, negative=False)

    def _number(self, node: ast.AST, value: object, negative: bool) -> None:
        if isinstance(value, bool):
            self.add("bool", node, repr(not value))
        elif isinstance(value, int):
            new = -value + 1 if negative else value + 1
            self.add("number", node, f"({new})")
        elif isinstance(value, float):
            new_f = -value * 2 if negative else (value * 2 if value else 1.0)
            self.add("number", node, f"({new_f!r})")

    def visit_Slice(self, node: ast.Slice) -> None:
        self.generic_visit(node)

    def visit_arguments(self, node: ast.arguments) -> None:
        return  # annotations and defaults are visited where the function is


def mutants(module: str, source: str) -> Iterator[Mutant]:
    """Every slip planted one at a time in ``source`` (the text of ``module``)."""
    tree = ast.parse(source)
    lines = _Lines(source)
    sites = _Sites()
    sites.visit(tree)
    seen: dict[str, int] = {}
    for scope, operator, node, text in sites.found:
        line = node.lineno  # type: ignore[attr-defined]
        if NO_MUTATE in lines.lines[line - 1]:
            continue
        before, mutated = lines.replace(node, text)
        if before.strip() == text.strip("()"):
            continue
        what = f"{scope}:{operator}:{' '.join(before.split())}->{text}"
        seen[what] = seen.get(what, 0) + 1
        key = what if seen[what] == 1 else f"{what}#{seen[what]}"
        try:
            compile(mutated, module, "exec")
        except SyntaxError:
            continue
        yield Mutant(module, key, line, operator, " ".join(before.split()), text, mutated)
