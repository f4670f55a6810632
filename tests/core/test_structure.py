"""The Ledger along its seams (issue 30, item 3): ``scripts/sizes``' two tells find nothing in the library.

A class split across modules that borrow each other's privates shows two tells, and
``scripts/sizes`` reports both (exit status 1): a class annotating a private attribute it
never assigns (a mixin reaching into its host's fields), and ``from m import _x`` (a module
taking another's private name). The library holds neither; the tells are proved to fire on
a snippet of each.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _sizes():
    loader = importlib.machinery.SourceFileLoader("kvledger_sizes", str(ROOT / "scripts" / "sizes"))
    spec = importlib.util.spec_from_loader("kvledger_sizes", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_library_has_no_mixin_and_imports_no_private_name():
    sizes = _sizes()
    found = []
    for top in ("core", "wire", "executors", "kvledger"):
        for path in sorted((ROOT / top).rglob("*.py")):
            tells = sizes.tells(ast.parse(path.read_text()))
            found += [f"{path.relative_to(ROOT)}:{line} {what}" for line, what in tells]
    assert not found, "\n".join(found)


def test_the_tells_fire():
    sizes = _sizes()
    mixin = ast.parse("class RequestCommands:\n    _submit: object\n    state: object\n\n"
                      "    def reserve(self):\n        return self._submit(1)\n")
    assert [what.split()[0] for _, what in sizes.tells(mixin)] == ["mixin"]
    private = ast.parse("from .fold import _free_pages, marked_effect\nfrom . import _x as y\n")
    assert [what.split()[0] for _, what in sizes.tells(private)] == ["private", "private"]
    fine = ast.parse("import m as _m\nfrom m import __all__ as _all\n\nclass A:\n    __slots__ = ('_x',)\n"
                     "    _x: int\n\nclass B:\n    _y: int\n\n    def __init__(self):\n        self._y = 1\n")
    assert sizes.tells(fine) == []
