"""One module's source with the modules of our own package it imports carried inside, for a saved folder.

diffusers loads a custom component from ``<folder>/<component>/<library>.py`` (``save_for_remote_code`` names the file
after the module, ``hf_cgpu.flow.unet.py``). Inside diffusers' module cache that file is a module whose dotted name
has no parent package, so none of its imports can be relative, and an absolute ``import hf_cgpu...`` needs hf_cgpu
installed. ``carried_source`` therefore writes the file as one module: first each module of ``packages`` that it
imports (transitively, each once, dependencies first), then its own text, with those import statements taken out
(``name = original`` where an import renamed a name). A module that imports none of ours comes back unchanged.

What cannot be carried is refused with ``ValueError``, naming the module and the fix: an import of a module object of
ours (``import hf_cgpu.x``), and two carried modules that define one top-level name differently (one namespace would
hold both). Imports under ``if TYPE_CHECKING:`` are dropped, not carried: they never run.
"""

import ast
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Collection

# diffusers' dynamic-module loader copies every file a line of this shape names (its get_relative_imports): a carried
# file must hold none, or the load fails on a file that is not there.
_RELATIVE_IMPORT = re.compile(r"^\s*(?:import|from)\s+\.", flags=re.MULTILINE)


def _ours(module: str, packages: Collection[str]) -> bool:
    return module.split(".")[0] in packages


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.Module):
    """(import node, under ``if TYPE_CHECKING:``) for every import statement of the module, nested ones included."""
    def walk(node, checking):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, checking
            else:
                yield from walk(child, checking or _is_type_checking(child))
    yield from walk(tree, False)


def _top_level(tree: ast.Module):
    """Statements run at import time: the module body and the blocks of its top-level if / try / with."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)) and not _is_type_checking(node):
            todo[:0] = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                        *(s for h in getattr(node, "handlers", []) for s in h.body)]


class _Module:
    """One module of ours: its source, its parsed tree, and what each of its own imports carries in."""

    def __init__(self, name: str, packages: Collection[str]):
        self.name = name
        module = importlib.import_module(name)
        self.package = module.__package__ or name.rpartition(".")[0]
        self.source = inspect.getsource(module)
        self.tree = ast.parse(self.source)
        self.edits: list[tuple[ast.stmt, str]] = []  # (statement, what replaces it)
        self.needs: list[str] = []  # our modules it imports, in import order
        self.bound: dict[str, set] = {}  # top-level name -> what binds it
        self.futures: list[str] = []
        for node, checking in _imports(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                self.futures += [a.name for a in node.names]
                self.edits.append((node, ""))
            elif checking:
                if self._target(node, packages):
                    self.edits.append((node, "pass"))  # never runs: nothing to carry
            elif isinstance(node, ast.Import) and any(_ours(a.name, packages) for a in node.names):
                raise ValueError(f"{name} line {node.lineno}: `import {node.names[0].name}` binds a module of "
                                 f"{'/'.join(sorted(packages))}, which a saved folder cannot carry; import the names "
                                 "it uses (from MODULE import NAME)")
            elif target := self._target(node, packages):
                self.edits.append((node, self._carry(node, target)))
        for node in _top_level(self.tree):
            self._bind(node, packages)

    def _target(self, node, packages) -> str | None:
        """The absolute module a ``from`` import of ours reads (None: not ours)."""
        if not isinstance(node, ast.ImportFrom):
            return None
        written = "." * node.level + (node.module or "")
        target = importlib.util.resolve_name(written, self.package) if node.level else written
        return target if _ours(target, packages) else None

    def _carry(self, node: ast.ImportFrom, target: str) -> str:
        """Note the modules ``node`` (which reads ``target``) needs; return the assignments that keep its names
        (``pass``: none needed)."""
        module = importlib.import_module(target)
        renames = []
        for alias in node.names:
            if alias.name == "*":
                self.needs.append(target)
                continue
            obj = getattr(module, alias.name, None)
            submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{target}.{alias.name}") is not None
            if inspect.ismodule(obj) or (obj is None and submodule):
                raise ValueError(f"{self.name} line {node.lineno}: `from {'.' * node.level}{node.module or ''} import "
                                 f"{alias.name}` binds a module, which a saved folder cannot carry; import the names "
                                 f"it uses (from {target}.{alias.name} import NAME)")
            where, name = target, alias.name
            defined = getattr(obj, "__module__", None)
            if ((inspect.isclass(obj) or inspect.isfunction(obj)) and defined
                    and getattr(sys.modules.get(defined), obj.__name__, None) is obj):
                where, name = defined, obj.__name__  # carry the module that defines it, not one that re-exports it
            self.needs.append(where)
            if (alias.asname or alias.name) != name:
                renames.append(f"{alias.asname or alias.name} = {name}")
        return "; ".join(renames) or "pass"

    def _bind(self, node: ast.AST, packages) -> None:
        """Record the top-level names ``node`` binds, each with what it is bound to."""
        def bind(name, what):
            if not (name.startswith("__") and name.endswith("__")):
                self.bound.setdefault(name, set()).add(what)

        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name, (self.name, node.name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        bind(n.id, (self.name, n.id))
        elif isinstance(node, ast.Import):
            for a in node.names:
                bind(a.asname or a.name.split(".")[0], ("import", a.name if a.asname else a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            target = self._target(node, packages)
            for a in node.names:
                if not target:
                    bind(a.asname or a.name, ("from", node.module, a.name))
                elif a.asname and a.asname != a.name:  # carried under its own name, and renamed here
                    bind(a.asname, ("from", target, a.name))

    def text(self) -> str:
        """The source with the carried and ``__future__`` imports taken out (UTF-8 byte offsets, as ast gives)."""
        data = self.source.encode("utf-8")
        starts = [0]
        for line in data.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        for node, new in sorted(self.edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
            a = starts[node.lineno - 1] + node.col_offset
            b = starts[node.end_lineno - 1] + node.end_col_offset
            if node.col_offset == 0 and new in ("", "pass"):
                new = ""
                b += data[b:b + 1] == b"\n"  # a whole line that goes: no blank line left behind
            data = data[:a] + new.encode("utf-8") + data[b:]
        return data.decode("utf-8")


def carried_source(obj, packages: Collection[str]) -> str:
    """The source of ``obj``'s module (``obj``: a class, or a module) with every module of ``packages`` it imports
    carried in, loadable where none of ``packages`` is installed (see the module docstring)."""
    name = obj.__name__ if inspect.ismodule(obj) else obj.__module__
    modules: dict[str, _Module] = {}

    def visit(module_name: str) -> None:  # dependencies first, each module once
        if module_name in modules:
            return
        modules[module_name] = module = _Module(module_name, packages)
        for needed in module.needs:
            visit(needed)
        modules[module_name] = modules.pop(module_name)  # after what it needs

    visit(name)
    entry = modules[name]
    if len(modules) == 1:
        return entry.source
    owner: dict[str, tuple[str, set]] = {}
    for module in modules.values():
        for bound, what in module.bound.items():
            first = owner.setdefault(bound, (module.name, what))
            if first[1] != what:
                raise ValueError(f"{first[0]} and {module.name} both define {bound!r}; a saved folder carries them as "
                                 f"one module, so rename one of them")
    futures = sorted({f for m in modules.values() for f in m.futures})
    about = (f"{name}, with the modules of {'/'.join(sorted(packages))} it imports carried in: "
             f"{', '.join(m for m in modules if m != name)}.")
    parts = [f'"""{textwrap.fill(about, 116)}"""\n']
    if futures:
        parts.append(f"from __future__ import {', '.join(futures)}\n")
    parts += [f"\n# ---- {m.name}\n{m.text()}" for m in modules.values()]
    text = "".join(parts)
    found = _RELATIVE_IMPORT.search(text)
    if found:
        line = text[found.start():].lstrip().splitlines()[0]
        raise ValueError(f"{name}: the carried source holds the line {line!r}, which diffusers' loader reads as an "
                         "import of a file; reword it")
    return text


__all__ = ["carried_source"]
