"""Python source of an sglang wheel read with `ast` (nothing imported, so no CUDA code runs): where a
module-level name is defined, a class's methods and instance attributes through its bases, and a
function's parameters in a form two sources can be compared in."""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_NO_DEFAULT = "<required>"


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional_only", "positional", "var_positional", "keyword_only", "var_keyword"
    default: object  # a literal's value, else the default's source text; _NO_DEFAULT when required


class SourceTree:
    """The `.py` files of one package, from a wheel or a directory, parsed on demand."""

    def __init__(self, root: Path):
        root = Path(root)
        if root.is_dir():
            self._files = {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in root.rglob("*.py")}
        else:
            with zipfile.ZipFile(root) as zf:
                self._files = {n: zf.read(n).decode("utf-8") for n in zf.namelist() if n.endswith(".py")}
        self.module = cache(self._module)

    def has_module(self, dotted: str) -> bool:
        """A module file, a package, or a namespace package (a directory of modules without __init__.py)."""
        prefix = dotted.replace(".", "/") + "/"
        return self._path(dotted) is not None or any(path.startswith(prefix) for path in self._files)

    def _path(self, dotted: str) -> str | None:
        stem = dotted.replace(".", "/")
        for path in (f"{stem}.py", f"{stem}/__init__.py"):
            if path in self._files:
                return path
        return None

    def _module(self, dotted: str) -> ast.Module:
        path = self._path(dotted)
        if path is None:
            raise LookupError(f"no module {dotted}")
        return ast.parse(self._files[path])

    def resolve(self, dotted: str, name: str, depth: int = 0) -> tuple[str, ast.AST]:
        """(module, node) where `name`, as seen from module `dotted`, is defined: follows imports and `*`."""
        if depth > 20:
            raise LookupError(f"import cycle resolving {dotted}.{name}")
        tree = self.module(dotted)
        stars = []
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return dotted, node
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return dotted, node
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(node.module)
                    elif (alias.asname or alias.name) == name:
                        if self._path(f"{node.module}.{alias.name}") is not None:
                            return f"{node.module}.{alias.name}", self.module(f"{node.module}.{alias.name}")
                        return self.resolve(node.module, alias.name, depth + 1)
        for star in stars:
            if self._path(star) is not None:
                try:
                    return self.resolve(star, name, depth + 1)
                except LookupError:
                    pass
        raise LookupError(f"{dotted} defines no {name}")

    def class_chain(self, dotted: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases found in this package, nearest first (nn.Module and the like end it)."""
        module, node = self.resolve(dotted, name)
        if not isinstance(node, ast.ClassDef):
            raise LookupError(f"{dotted}.{name} is not a class")
        chain = [(module, node)]
        for base in node.bases:
            if isinstance(base, ast.Name):
                try:
                    chain += self.class_chain(module, base.id)
                except LookupError:
                    pass  # a base from outside the package (torch.nn.Module, ABC)
        return chain

    def method(self, dotted: str, cls: str, method: str) -> tuple[str, ast.FunctionDef]:
        """(module, def) of cls.method through its bases; a `forward(*args, **kwargs)` dispatcher is replaced by
        the `forward_native` it dispatches to on CPU, whose parameters are the ones callers pass."""
        chain = self.class_chain(dotted, cls)
        for module, node in chain:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    if method == "forward" and _is_dispatcher(item):
                        return self.method(dotted, cls, "forward_native")
                    return module, item
        raise LookupError(f"{dotted}.{cls} has no method {method}")

    def instance_attributes(self, dotted: str, cls: str) -> set[str]:
        """Names assigned as `self.NAME = ...` anywhere in the class or its bases, plus class-level names."""
        names = set()
        for _, node in self.class_chain(dotted, cls):
            for item in ast.walk(node):
                if isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    for target in targets:
                        for t in ast.walk(target):
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                names.add(t.attr)
            for item in node.body:
                if isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        return names

    def init_assignments(self, dotted: str, cls: str) -> set[str]:
        """Names the class's own __init__ assigns on self."""
        _, init = self.method(dotted, cls, "__init__")
        return {
            t.attr
            for item in ast.walk(init)
            if isinstance(item, (ast.Assign, ast.AnnAssign))
            for target in (item.targets if isinstance(item, ast.Assign) else [item.target])
            for t in ast.walk(target)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }

    def signature(self, dotted: str, fn: ast.FunctionDef, drop_self: bool) -> tuple[Param, ...]:
        return signature(fn, drop_self, lambda name: self._constant(dotted, name))

    def _constant(self, dotted: str, name: str):
        try:
            _, node = self.resolve(dotted, name)
        except LookupError:
            return None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
        return None


def _is_dispatcher(fn: ast.FunctionDef) -> bool:
    a = fn.args
    return a.vararg is not None and a.kwarg is not None and len(a.args) == 1


def signature(fn: ast.FunctionDef, drop_self: bool, constant=lambda name: None) -> tuple[Param, ...]:
    """The parameters of a def: names, kinds and defaults (literals and module constants by value)."""
    a = fn.args

    def value(node):
        if node is None:
            return _NO_DEFAULT
        try:
            return ast.literal_eval(node)
        except ValueError:
            if isinstance(node, ast.Name) and constant(node.id) is not None:
                return constant(node.id)
            return ast.unparse(node)

    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [
        Param(p.arg, "positional_only" if i < len(a.posonlyargs) else "positional", value(d))
        for i, (p, d) in enumerate(zip(positional, defaults))
    ]
    if a.vararg:
        params.append(Param(a.vararg.arg, "var_positional", _NO_DEFAULT))
    params += [Param(p.arg, "keyword_only", value(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "var_keyword", _NO_DEFAULT))
    if drop_self and params and params[0].kind in ("positional_only", "positional"):
        params = params[1:]
    return tuple(params)


def binding_error(params: tuple[Param, ...], n_positional: int, keywords: set[str]) -> str | None:
    """Why a call with that many positional arguments and those keywords cannot bind, or None when it can."""
    positional = [p for p in params if p.kind in ("positional_only", "positional")]
    if n_positional > len(positional) and not any(p.kind == "var_positional" for p in params):
        return f"takes {len(positional)} positional arguments, the plugin passes {n_positional}"
    by_keyword = {p.name for p in params if p.kind in ("positional", "keyword_only")}
    unknown = keywords - by_keyword
    if unknown and not any(p.kind == "var_keyword" for p in params):
        return f"has no parameter {sorted(unknown)}"
    filled = {p.name for p in positional[:n_positional]} | keywords
    missing = [p.name for p in params if p.default == _NO_DEFAULT and "var" not in p.kind and p.name not in filled]
    if missing:
        return f"requires {missing}, which the plugin does not pass"
    twice = {p.name for p in positional[:n_positional]} & keywords
    if twice:
        return f"gets {sorted(twice)} both by position and by keyword"
    return None
