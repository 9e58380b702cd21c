"""A vLLM source tree read with ``ast``, without importing it, for scripts/check_vllm_range.py:
where a name is defined (through imports, star imports and lazy tables), a class's members and
base classes, a function's or dataclass's signature, the keys of a dict or ``Literal``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TYPE_CHECKING_NAMES = ("TYPE_CHECKING", "typing.TYPE_CHECKING")
DATACLASS_DECORATORS = ("dataclass", "config")  # vLLM's @config is a pydantic dataclass


@dataclass
class Found:
    """Where a name is defined: ``node`` is its class, function or assignment (None for a
    module, a name a module provides lazily, or one defined outside vLLM)."""

    module: str
    kind: str  # "module", "class", "function", "value", "dataclass" (its generated __init__), "lazy", "external"
    node: ast.AST | None = None
    owner: str = ""  # the class it was found in, for members


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in TYPE_CHECKING_NAMES


def _top_level(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, through ``if`` and ``try`` blocks (not ``if TYPE_CHECKING``)."""
    for statement in statements:
        if isinstance(statement, ast.If):
            if not _is_type_checking(statement.test):
                yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, *(h.body for h in statement.handlers), statement.orelse,
                          statement.finalbody):
                yield from _top_level(block)
        else:
            yield statement


def _assigned_names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
        targets = [statement.target]
    else:
        return []
    return [t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's parameter names in order, ``*args`` and ``**kwargs`` with their stars."""
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return names


class SourceTree:
    """The modules of one vLLM source tree (a directory holding ``vllm/``), read with ``ast``:
    what each binds at top level, its classes, their members and base classes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._parsed: dict[str, ast.Module | None] = {}

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def parse(self, module: str) -> ast.Module | None:
        if module not in self._parsed:
            path = self.module_file(module)
            self._parsed[module] = None if path is None else ast.parse(path.read_text(encoding="utf-8"), str(path))
        return self._parsed[module]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        path = self.module_file(module)
        package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
        parts = package.split(".")
        anchor = parts[: len(parts) - (node.level - 1)]
        return ".".join([*anchor, node.module] if node.module else anchor)

    def lookup(self, module: str, name: str, seen: frozenset = frozenset()) -> Found | None:
        """Where ``module.name`` is defined, following imports, star imports and lazy tables."""
        if module.split(".")[0] != "vllm":
            return Found(module, "external")  # defined outside vLLM: not followed
        if (module, name) in seen:
            return None  # an import cycle
        seen = seen | {(module, name)}
        tree = self.parse(module)
        if tree is None:
            return None
        found, stars = None, []
        for statement in _top_level(tree.body):
            found = self._binding(module, statement, name, seen, stars) or found
        for star in (s for s in stars if s.split(".")[0] == "vllm"):
            found = found or self.lookup(star, name, seen)
        if found is None and self.module_file(f"{module}.{name}"):
            found = Found(f"{module}.{name}", "module")
        return found or self._lazy(module, tree, name, seen)

    def _binding(self, module: str, statement: ast.stmt, name: str, seen: frozenset,
                 stars: list[str]) -> Found | None:
        """What ``statement`` binds to ``name``, if anything (the last binding wins, as in Python)."""
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
            return Found(module, "class" if isinstance(statement, ast.ClassDef) else "function", statement)
        if name in _assigned_names(statement):
            return Found(module, "value", statement)
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return Found(alias.name if alias.asname else name, "module")
        if isinstance(statement, ast.ImportFrom):
            source = self._absolute(module, statement)
            for alias in statement.names:
                if alias.name == "*":
                    stars.append(source)
                elif (alias.asname or alias.name) == name:
                    inner = self.lookup(source, alias.name, seen)
                    if inner is None and self.module_file(f"{source}.{alias.name}"):
                        inner = Found(f"{source}.{alias.name}", "module")
                    return inner
        return None

    def _lazy(self, module: str, tree: ast.Module, name: str, seen: frozenset) -> Found | None:
        """A name a module provides through ``__getattr__``: from a ``{"Name": ".module:attr"}``
        table where there is one (vllm/__init__.py), else named as a string inside ``__getattr__``."""
        for statement in _top_level(tree.body):
            value = getattr(statement, "value", None)
            if isinstance(value, ast.Dict) and _assigned_names(statement):
                for key, target in zip(value.keys, value.values):
                    if (isinstance(key, ast.Constant) and key.value == name and isinstance(target, ast.Constant)
                            and isinstance(target.value, str) and ":" in target.value):
                        where, _, attribute = target.value.partition(":")
                        where = module + where if where.startswith(".") else where  # a package's table
                        return self.lookup(where, attribute, seen)
        for statement in tree.body:
            if isinstance(statement, ast.FunctionDef) and statement.name == "__getattr__":
                if any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(statement)):
                    return Found(module, "lazy")
        return None

    def holds_text(self, module: str, text: str) -> bool:
        """Whether a string in the module's code (not a docstring) is ``text`` or begins with it."""
        tree = self.parse(module)
        if tree is None:
            return False
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                   and n.value.startswith(text) for n in ast.walk(tree))

    def bases(self, found: Found) -> Iterator[Found]:
        """The base classes of a class that vLLM defines (others are not followed)."""
        for base in found.node.bases:
            if isinstance(base, ast.Subscript):
                base = base.value  # Generic[T]
            head, _, rest = ast.unparse(base).partition(".")
            resolved = self.lookup(found.module, head)
            if resolved is not None and rest and resolved.kind == "module":
                resolved = self.lookup(resolved.module, rest)
            if resolved is not None and resolved.kind == "class":
                yield resolved

    def member(self, found: Found, name: str, seen: frozenset = frozenset()) -> Found | None:
        """``name`` of the class ``found``: defined in its body, assigned to ``self`` in one of its
        methods, or inherited from a vLLM base class; a dataclass's generated ``__init__``."""
        key = (found.module, found.node.name)
        if key in seen:
            return None
        seen = seen | {key}
        owner = f"{found.module}:{found.node.name}"
        for statement in found.node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and statement.name == name:
                kind = "class" if isinstance(statement, ast.ClassDef) else "function"
                return Found(found.module, kind, statement, owner)
            annotated = isinstance(statement, ast.AnnAssign) and ast.unparse(statement.target) == name
            if annotated or name in _assigned_names(statement):
                return Found(found.module, "value", statement, owner)
        assigned = _self_assignment(found.node, name)
        if assigned is not None:
            return Found(found.module, "value", assigned, owner)
        for base in self.bases(found):
            inherited = self.member(base, name, seen)
            if inherited is not None:
                return inherited
        if name == "__init__" and self.is_dataclass(found):
            return Found(found.module, "dataclass", found.node, owner)
        return None

    def is_dataclass(self, found: Found) -> bool:
        for decorator in found.node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if ast.unparse(target).rpartition(".")[2] in DATACLASS_DECORATORS:
                return True
        return any(self.is_dataclass(base) for base in self.bases(found))

    def fields(self, found: Found) -> list[str]:
        """A dataclass's fields in ``__init__`` order (its bases' first)."""
        names = [f for base in reversed(list(self.bases(found))) for f in self.fields(base)]
        for statement in found.node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) \
                    and "ClassVar" not in ast.unparse(statement.annotation) and statement.target.id not in names:
                names.append(statement.target.id)
        return names

    def signature(self, found: Found) -> list[str] | None:
        """The parameters of a function, of a class's ``__init__``, or of a dataclass's."""
        if found.kind == "function":
            return parameters(found.node)
        if found.kind == "dataclass":
            return ["self", *self.fields(found)]
        if found.kind == "class":
            init = self.member(found, "__init__")
            return None if init is None else self.signature(init)
        return None

    def members_of_value(self, found: Found, seen: frozenset = frozenset()) -> set[str]:
        """The keys of a module-level dict, or the strings of a ``Literal[...]`` alias (those of
        the aliases it names included)."""
        value = getattr(found.node, "value", None)
        return self._members(found.module, value, seen)

    def _members(self, module: str, value: ast.expr | None, seen: frozenset) -> set[str]:
        if isinstance(value, ast.Dict):
            return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if isinstance(value, ast.BinOp):
            return self._members(module, value.left, seen) | self._members(module, value.right, seen)
        if isinstance(value, ast.Subscript) and ast.unparse(value.value).rpartition(".")[2] == "Literal":
            items = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
            return set().union(*(self._members(module, item, seen) for item in items))
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return {value.value}
        if isinstance(value, ast.Name) and value.id not in seen:
            named = self.lookup(module, value.id)
            if named is not None and named.kind == "value":
                return self.members_of_value(named, seen | {value.id})
        return set()


def _self_assignment(cls: ast.ClassDef, name: str) -> ast.stmt | None:
    """The first ``self.name = ...`` in one of the class's own methods."""
    for statement in cls.body:
        if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(statement):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        return node
    return None


def attributes_set(function: ast.FunctionDef) -> set[str]:
    """The ``self.X`` a method assigns."""
    return {n.attr for n in ast.walk(function) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
