"""The fold is the only writer of the state (SPEC, "Shape"; issue 30, item 1): a source test.

Reads every library module outside ``core/state/`` (core, wire, executors, kvledger) and fails
on any statement that writes into a ``LedgerState`` or anything reached from one: an
assignment, augmented assignment or ``del`` whose target is an attribute or item of it, an
augmented assignment to a name bound to a part of it (``stack += pages`` extends the state's
list), or a call of a mutating method on it (``append``, ``pop``, ``update``, ``clear``, ...).

What counts as "the state", per function: an expression ``<anything>.state``, a parameter
annotated ``LedgerState``, a name bound to ``LedgerState(...)`` or ``LedgerState.from_canonical``,
and, transitively, every name bound to an attribute, item, method result or loop element of
one (``rec = st.requests.get(r)``, ``for rec in st.requests.values()``). Reading is free;
only ``core/state/`` (the fold's appliers, the allocator's helpers, the canonical form) writes.
The test proves it can fail: a snippet of each kind of write is caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("core", "wire", "executors", "kvledger")
EXEMPT = ("core/state/",)  # the fold, the allocator's helpers and the canonical form: the writers
MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "difference_update", "intersection_update", "symmetric_difference_update", "sort", "reverse", "move_to_end",
    "__setitem__", "__delitem__", "__iadd__",
})
STATE_TYPES = frozenset({"LedgerState"})


def _base(node: ast.AST) -> ast.AST:
    """The innermost object of an attribute / item / call chain (``st.requests[r].kv`` -> ``st``)."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return node


class _Writes(ast.NodeVisitor):
    """The writes into the state in one function (or a module's top level). ``held``: the
    attributes (``self.ps``) the module binds to a state or a part of one, anywhere."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[str] = []
        self.held: set[str] = set()
        self.own_state = False  # the function is a method of a class whose ``self.state`` is its own (not a ledger's)

    def check_function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module) -> None:
        derived: set[str] = set()
        args = fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs if not isinstance(fn, ast.Module) else []
        for a in args:
            ann = a.annotation
            if ann is not None and any(isinstance(n, ast.Name) and n.id in STATE_TYPES or
                                       isinstance(n, ast.Constant) and n.value in STATE_TYPES
                                       for n in ast.walk(ann)):
                derived.add(a.arg)
        body = list(_own_nodes(fn))
        changed = True
        while changed:  # names bound to parts of the state, to a fixed point
            changed = False
            for node in body:
                targets: list[ast.AST] = []
                value: ast.AST | None = None
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    targets, value = [node.target], node.value
                elif isinstance(node, (ast.For, ast.comprehension)):
                    targets, value = [node.target], node.iter
                elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                    targets, value = [node.optional_vars], node.context_expr
                if value is None:
                    continue
                pairs = [(t, value) for t in targets]
                if (len(targets) == 1 and isinstance(targets[0], (ast.Tuple, ast.List))
                        and isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(targets[0].elts)):
                    pairs = list(zip(targets[0].elts, value.elts, strict=True))  # a, b = x, y: element by element
                for t, v in pairs:
                    if not self._is_state(v, derived):
                        continue
                    for n in _bound_names(t):
                        if n not in derived:
                            derived.add(n)
                            changed = True
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.attr != "state":
                        name = ast.unparse(t)
                        if name not in self.held:
                            self.held.add(name)
                            changed = True
        for node in body:
            self._check(node, derived)

    def _is_state(self, expr: ast.AST, derived: set[str]) -> bool:
        """``expr`` is the state or a part of it: down its chain of attributes, items and method
        calls, an ``.state``, an attribute the module holds the state in, or a name bound to it."""
        if isinstance(expr, (ast.Tuple, ast.List)):
            return any(self._is_state(e, derived) for e in expr.elts)
        node = expr
        while True:
            if isinstance(node, ast.Attribute):
                if node.attr == "state" and not (self.own_state and isinstance(node.value, ast.Name)
                                                 and node.value.id == "self"):
                    return True
                if isinstance(node.value, ast.Name) and ast.unparse(node) in self.held:
                    return True
                node = node.value
            elif isinstance(node, ast.Subscript):
                node = node.value
            elif isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id in STATE_TYPES) or (
                        isinstance(f, ast.Attribute) and f.attr == "from_canonical"):
                    return True
                if not isinstance(f, ast.Attribute):
                    return False  # a function of it (list(st.free_stack)) makes something else
                node = f.value
            else:
                return isinstance(node, ast.Name) and node.id in derived

    def _check(self, node: ast.AST, derived: set[str]) -> None:
        where = f"{self.path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for part in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                    if isinstance(part, (ast.Attribute, ast.Subscript)) and self._is_state(part.value, derived):
                        self.found.append(f"{where}: writes {ast.unparse(part)}")
                    elif (isinstance(node, ast.AugAssign) and isinstance(part, ast.Name) and part.id in derived):
                        self.found.append(f"{where}: {ast.unparse(node).strip()} changes a part of the state in place")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and self._is_state(node.func.value, derived)):
            self.found.append(f"{where}: {ast.unparse(node)} changes the state")


def _bound_names(target: ast.AST):
    """The names an assignment target binds (``a``, ``a, b``, ``[a, *b]``), not those it writes into."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _bound_names(t)
    elif isinstance(target, ast.Starred):
        yield from _bound_names(target.value)


def _own_nodes(fn: ast.AST):
    """The nodes of a function body, nested functions and classes left out (checked on their own)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def writes_in(source: str, path: str = "<snippet>") -> list[str]:
    tree = ast.parse(source)
    v = _Writes(path)
    functions = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    own = {id(fn) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and _own_state(cls)
           for fn in ast.walk(cls) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def check_all() -> None:
        for fn in functions:
            v.own_state = id(fn) in own
            v.check_function(fn)

    held = -1
    while held != len(v.held):  # the attributes bound to the state anywhere in the module, first
        held = len(v.held)
        check_all()
        v.found.clear()
    check_all()
    return sorted(set(v.found))


def _own_state(cls: ast.ClassDef) -> bool:
    """The class keeps a ``self.state`` of its own: it assigns it a literal container (a dict of
    tensors, say), which a ledger's state never is."""
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Attribute) and t.attr == "state" and isinstance(t.value, ast.Name)
                   and t.value.id == "self" for t in targets):
                v = node.value
                if isinstance(v, (ast.Dict, ast.List, ast.Set, ast.Tuple, ast.DictComp, ast.ListComp)) or (
                        isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("dict", "list")):
                    return True
    return False


def library_modules():
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(EXEMPT):
                yield rel


def test_no_module_outside_core_state_writes_the_state():
    found = []
    for rel in library_modules():
        found += writes_in((ROOT / rel).read_text(), rel)
    assert not found, "writes into the state outside core/state:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "def f(ledger):\n    ledger.state.seq += 2\n",
    "def f(self):\n    st = self.state\n    st.holder[3] = 7\n",
    "def f(self):\n    st = self.state\n    stack = st.free_stack\n    del stack[-1]\n",
    "def f(self, r):\n    rec = self.state.requests.get(r)\n    rec.kv.append(4)\n",
    "def f(self):\n    stack = self.state.free_stack\n    stack += [1, 2]\n",
    "def f(st: LedgerState):\n    st.cached.pop(3)\n",
    "def f(self):\n    for rec in self.state.requests.values():\n        rec.reserved.clear()\n",
    "def f(data):\n    ps = LedgerState.from_canonical(data)\n    ps.sharers = {}\n",
    "def f(self):\n    st, n = self.state, 3\n    st.marks.update({n: 1})\n",
    "class A:\n    def __init__(self, led):\n        self.ps = LedgerState()\n"
    "    def g(self):\n        self.ps.transitions = {}\n",
    "class Ledger:\n    def __init__(self):\n        self.state = LedgerState()\n"
    "    def f(self):\n        self.state.seq += 1\n",
])
def test_the_source_test_catches_each_kind_of_write(snippet):
    assert writes_in(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "def f(self):\n    st = self.state\n    return st.holder[3], len(st.free_stack), st.requests.get(1)\n",
    "def f(self):\n    pages = list(self.state.free_stack)\n    out = []\n    out.append(pages[0])\n",
    "def f(self):\n    self.state = object()\n",
    "class Memory:\n    def __init__(self):\n        self.state: dict = {}\n"
    "    def put(self, gid, t):\n        self.state[gid] = t\n",
])
def test_reading_the_state_is_not_a_write(snippet):
    assert not writes_in(snippet), snippet
