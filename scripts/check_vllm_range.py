"""Check every vLLM name vllm-edsd depends on against the source of every supported vLLM release.

vllm-edsd claims a range of vLLM releases, but only the CPU builds installable here ever run
it. This script reads, with ``ast`` and without importing vLLM or needing a GPU, the source
distribution of the newest patch release of each vLLM minor from 0.24 to 0.33, and checks each
row against it:

* every row of the plugin's ``PATCHES`` and its ``REFUSAL`` (``vllm_edsd/serving/patches.py``),
  as its kind calls for (``vllm_names.expected``): a replaced method, an instance hook or an
  override has the signature the plugin's code expects (a hook on the proposer class vLLM
  instantiates), in the class or a vLLM base class it inherits from; a private attribute is
  defined or assigned there; an environment variable is one vLLM's ``envs`` reads; a config
  attribute is one vLLM's own code sets, or the row says why there is nothing to check; an
  exception's method exists;
* every name the plugin reads, calls or subclasses (``READ`` in
  ``vllm_edsd/serving/vllm_names.py``).

The expected shapes are recorded in ``vllm_names.py`` (not derived from one installed vLLM),
so a release that differs from the one the plugin was written against shows up as a break.
When the plugin starts to use another vLLM name, add it to ``READ``; a new row of ``PATCHES``
whose kind needs a recorded shape needs its entry in ``PATCHED`` (tests/unit/test_serving_vllm_range.py
fails without one). This is a static check: it finds names vLLM moved, renamed, removed or
reshaped, not changed behaviour.

A row judged on a release outside ``SUPPORTED_VLLM`` is "n/a" (the plugin refuses "edsd"
there, by ``REFUSAL``, which is checked on every release), as is a row whose ``versions`` leave
the release out. Where a row's entry has an ``applies_if`` (the condition the plugin itself
tests to choose between the CPU kernel rows), the condition must hold in exactly the releases
the row's ``versions`` claim: a release where they disagree is broken. Each cell: ``✓``
present with the expected shape; ``✗`` broken (the reason is listed under the table); ``–``
absent but optional (the plugin goes without it, as the row says); ``n/a``.

Source distributions come from PyPI (its JSON API) into a cache outside the repository,
checked against PyPI's sha256, resumed where a download stopped, and unpacked (the
``vllm/**.py`` files only) once. The table is printed and written as ``report.md`` and
``results.json`` (default: bench/results/vllm-range/). Exit status 1 when a row that applies
is broken, 2 when the releases could not be had.

Examples::

    python scripts/check_vllm_range.py                      # 0.24 ... 0.33, newest patch of each
    python scripts/check_vllm_range.py --releases 0.33.0    # one release
    python scripts/check_vllm_range.py --offline            # only what the cache holds
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urljoin

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the package beside this script, not an installed one
from vllm_edsd.serving.patches import PATCHES, REFUSAL  # noqa: E402
from vllm_edsd.serving.patching import Patch  # noqa: E402
from vllm_edsd.serving.versions import SUPPORTED_VLLM, version_supported  # noqa: E402
from vllm_edsd.serving.vllm_names import PATCHED, READ, VllmName, expected  # noqa: E402

PYPI_JSON = "https://pypi.org/pypi/vllm/json"
DEFAULT_CACHE = Path.home() / ".cache" / "vllm-edsd" / "vllm-sdists"
DEFAULT_OUT = ROOT / "bench" / "results" / "vllm-range"
MINORS = range(24, 34)  # 0.24 ... 0.33: the range the plugin claims
CHUNK = 1 << 20
SHOWN_PARAMETERS = 8  # a reason quotes a signature up to this many parameters
TYPE_CHECKING_NAMES = ("TYPE_CHECKING", "typing.TYPE_CHECKING")
DATACLASS_DECORATORS = ("dataclass", "config")  # vLLM's @config is a pydantic dataclass

OK, BROKEN, ABSENT, NOT_APPLICABLE = "✓", "✗", "–", "n/a"


# ---------------------------------------------------------------- releases: list, download, unpack


@dataclass(frozen=True)
class Release:
    version: str
    url: str
    sha256: str
    size: int


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def releases_from_listing(listing: dict, wanted: list[str] | None) -> list[Release]:
    """The sdists of ``wanted`` (or of the newest final patch release of each minor in MINORS)."""
    found: dict[str, Release] = {}
    for version, files in listing["releases"].items():
        if not re.fullmatch(r"0\.\d+\.\d+", version):
            continue  # pre-releases, dev and post releases: not what users install
        sdists = [f for f in files if f.get("packagetype") == "sdist" and not f.get("yanked")]
        if sdists:
            sdist = sdists[0]
            found[version] = Release(version, urljoin(PYPI_JSON, sdist["url"]), sdist["digests"]["sha256"],
                                     int(sdist["size"]))
    if wanted:
        missing = [v for v in wanted if v not in found]
        if missing:
            raise SystemExit(f"check_vllm_range: PyPI has no source distribution of vLLM {', '.join(missing)}")
        return [found[v] for v in wanted]
    newest: dict[int, Release] = {}
    for version in sorted(found, key=_version_key):
        minor = _version_key(version)[1]
        if minor in MINORS:
            newest[minor] = found[version]
    return [newest[m] for m in sorted(newest)]


def read_listing(cache: Path, offline: bool) -> dict:
    """PyPI's JSON for vLLM, kept in the cache; the cached copy where PyPI cannot be reached."""
    cached = cache / "pypi-vllm.json"
    if not offline:
        try:
            with urllib.request.urlopen(PYPI_JSON, timeout=60) as response:
                listing = json.load(response)
            cache.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({"releases": listing["releases"]}))
            return listing
        except (urllib.error.URLError, OSError) as exc:
            print(f"PyPI unreachable ({exc}); using the cached release list", flush=True)
    if not cached.exists():
        raise SystemExit(f"check_vllm_range: no cached release list in {cache}: run once with network")
    return json.loads(cached.read_text())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def download(release: Release, cache: Path) -> Path:
    """The release's sdist in the cache: resumed from a partial download, checked by sha256."""
    target = cache / f"vllm-{release.version}.tar.gz"
    if target.exists():
        return target
    partial = target.with_name(target.name + ".part")
    have = partial.stat().st_size if partial.exists() else 0
    if have < release.size:
        _fetch(release, partial, have)
    if _sha256(partial) != release.sha256:
        partial.unlink()
        raise SystemExit(f"check_vllm_range: vLLM {release.version}'s sdist does not match PyPI's sha256; "
                         "the partial file was removed: run again")
    partial.rename(target)
    return target


def _fetch(release: Release, partial: Path, have: int) -> None:
    """Append the rest of the sdist to ``partial`` (all of it where the server ignores ``Range``),
    saying how far it got at each quarter."""
    request = urllib.request.Request(release.url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(request, timeout=120) as response:
        if have and response.status != 206:
            have = 0
        with partial.open("ab" if have else "wb") as out:
            done, shown = have, -1
            for block in iter(lambda: response.read(CHUNK), b""):
                out.write(block)
                done += len(block)
                quarter = 4 * done // max(release.size, 1)
                if quarter != shown:
                    shown = quarter
                    print(f"  vLLM {release.version}: {done / 1e6:.0f} of {release.size / 1e6:.0f} MB", flush=True)


def unpack(release: Release, cache: Path) -> Path:
    """A directory holding the release's ``vllm/`` Python files, unpacked once from its sdist."""
    tree = cache / release.version
    if (tree / "vllm").is_dir():
        return tree
    sdist = download(release, cache)
    print(f"  vLLM {release.version}: unpacking vllm/**.py", flush=True)
    scratch = cache / f"{release.version}.unpacking"
    shutil.rmtree(scratch, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        for member in archive:
            parts = Path(member.name).parts
            inside = ".." not in parts and not Path(member.name).is_absolute()
            if inside and member.isfile() and len(parts) > 2 and parts[1] == "vllm" and parts[-1].endswith(".py"):
                destination = scratch.joinpath(*parts[1:])
                destination.parent.mkdir(parents=True, exist_ok=True)
                with archive.extractfile(member) as source:
                    destination.write_bytes(source.read())
    scratch.rename(tree)
    return tree


# ---------------------------------------------------------------- reading a source tree


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


def signature_problem(expected: str, actual: list[str]) -> str | None:
    """Why ``actual`` parameters do not fit ``expected`` (vllm_names.py's notation), or None."""
    parts = [p.strip() for p in expected.split(",") if p.strip()]
    shown = f"({', '.join(actual[:SHOWN_PARAMETERS])}{', …' if len(actual) > SHOWN_PARAMETERS else ''})"
    if "..." not in parts:
        return None if actual == parts else f"signature {shown}, expected ({expected})"
    cut = parts.index("...")
    leading, anywhere = parts[:cut], parts[cut + 1:]
    if actual[: len(leading)] != leading:
        return f"signature {shown} does not start ({', '.join(leading)})"
    missing = [name for name in anywhere if name not in actual]
    return f"signature {shown} lacks {', '.join(missing)}" if missing else None


# ---------------------------------------------------------------- judging one entry on one tree


@dataclass
class Cell:
    status: str
    reason: str = ""


def resolve(tree: SourceTree, entry: VllmName) -> tuple[Found | None, set[str] | None, str]:
    """(where ``entry`` is defined, the members when its owner is a dict or Literal, why not found)."""
    module, _, inner = entry.owner.partition(":")
    if tree.module_file(module) is None:
        return None, None, f"no module {module}"
    owner = tree.lookup(module, inner) if inner else Found(module, "module")
    if owner is None:
        return None, None, f"no {inner} in {module}"
    if not entry.name:
        return owner, None, ""
    if owner.kind == "class":
        found = tree.member(owner, entry.name)
        return found, None, "" if found else f"{inner} has no {entry.name} (nor its vLLM base classes)"
    if owner.kind == "value":
        return owner, tree.members_of_value(owner), ""
    if owner.kind == "module":
        found = tree.lookup(owner.module, entry.name)
        return found, None, "" if found else f"no {entry.name} in {owner.module}"
    return None, None, f"{entry.owner} is {owner.kind}: its members cannot be read"


def judge(tree: SourceTree, entry: VllmName) -> Cell:
    """The cell of ``entry`` on one source tree (its applicability is decided by the caller): on
    its owner, then on each class vLLM instantiates in its place (``used_as``)."""
    if entry.not_checked:
        return Cell(NOT_APPLICABLE, entry.not_checked)
    if entry.set_by:
        return set_as_vllm_sets(tree, entry)
    for owner in (entry.owner, *entry.used_as):
        cell = judge_name(tree, replace(entry, owner=owner, used_as=()))
        if cell.status != OK:
            return cell if owner == entry.owner else Cell(cell.status, f"on {owner}: {cell.reason}")
    return Cell(OK)


def set_as_vllm_sets(tree: SourceTree, entry: VllmName) -> Cell:
    """``entry.set_by``, a method of vLLM's, assigns an attribute ``entry.name`` (of any object:
    the config its model holds) as the plugin's code does."""
    owner, _, method = entry.set_by.rpartition(".")
    found, _, reason = resolve(tree, VllmName(owner, method, ""))
    if found is None or found.kind != "function":
        return Cell(BROKEN, reason or f"{entry.set_by} is a {found.kind}, not a method")
    stored = {n.attr for n in ast.walk(found.node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    if entry.name in stored:
        return Cell(OK)
    return Cell(BROKEN, f"vLLM's {entry.set_by.rpartition(':')[2]} no longer sets {entry.name}, which the plugin "
                        "sets as it did")


def judge_name(tree: SourceTree, entry: VllmName) -> Cell:
    """``entry`` on its own owner: present (or absent, as it asks), with its signature, reaching
    the subclasses it names, setting no more than it lists."""
    if entry.kind == "text":
        present = tree.holds_text(entry.owner, entry.name)
        reason = "" if present or tree.module_file(entry.owner) else f"no module {entry.owner}"
        return _presence(entry, present, reason or f"no string {entry.name!r} in {entry.owner}")
    found, members, reason = resolve(tree, entry)
    if members is not None:
        return _presence(entry, entry.name in members, f"{entry.name!r} is not among {entry.owner}'s")
    if found is None or entry.absent:
        return _presence(entry, found is not None, reason)
    if entry.signature is not None:
        actual = tree.signature(found)
        if actual is None:
            return Cell(BROKEN, f"{entry.label} is a {found.kind}, not a callable")
        problem = signature_problem(entry.signature, actual)
        if problem:
            return Cell(BROKEN, problem)
    missed = [why for cls in entry.reaches if (why := unreached(tree, found, cls, entry.name))]
    if missed:
        return Cell(BROKEN, "; ".join(missed))
    if entry.sets and found.kind == "function":
        extra = sorted(attributes_set(found.node) - set(entry.sets))
        if extra:
            return Cell(BROKEN, f"vLLM's {entry.label} also sets {', '.join(extra)}, which the plugin's "
                                "subclass does not")
    return Cell(OK)


def _presence(entry: VllmName, present: bool, reason: str) -> Cell:
    if entry.absent:
        return Cell(BROKEN, f"vLLM has {entry.name!r} itself") if present else Cell(OK)
    if present:
        return Cell(OK)
    return Cell(ABSENT, f"{reason} ({entry.optional})") if entry.optional else Cell(BROKEN, reason)


def unreached(tree: SourceTree, patched: Found, subclass: str, name: str) -> str | None:
    """Why a replacement of ``name`` at ``patched`` misses ``subclass``, or None where the
    subclass inherits it or its own ``name`` calls ``super().name``."""
    module, _, cls = subclass.partition(":")
    owner = tree.lookup(module, cls)
    if owner is None or owner.kind != "class":
        return f"no class {subclass}"
    own = tree.member(owner, name)
    if own is None or own.owner == patched.owner:
        return None if own else f"{cls} has no {name}"
    calls_super = any(isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Call)
                      and ast.unparse(n.value.func) == "super" for n in ast.walk(own.node))
    return None if calls_super else f"{cls} overrides {name} without calling super(): the replacement misses it"


def condition_met(tree: SourceTree, condition: str) -> bool:
    """``applies_if``: ``module:Class.attribute`` exists (``!`` first: does not)."""
    negate = condition.startswith("!")
    owner, _, name = condition.lstrip("!").rpartition(".")
    found, _, _ = resolve(tree, VllmName(owner, name, ""))
    return (found is not None) != negate


# ---------------------------------------------------------------- the rows


@dataclass
class Row:
    label: str
    source: str  # "PATCHES", "REFUSAL" or "READ"
    entry: VllmName | None  # None: a row of PATCHES without a check (vllm_names.expected)
    why: str = ""
    patch: Patch | None = None  # the row of PATCHES or REFUSAL; None for READ
    cells: dict[str, Cell] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.patch.kind if self.patch else ""


def rows() -> list[Row]:
    """One row per patch (its check from ``vllm_names.expected``) and per READ entry."""
    patches = PATCHES if REFUSAL in PATCHES else (*PATCHES, REFUSAL)
    result = []
    for patch in patches:
        entry = expected(patch)
        source = "REFUSAL" if patch is REFUSAL else "PATCHES"
        result.append(Row(entry.label if entry else patch.name, source, entry, patch.why, patch))
    used = {(patch.owner, patch.attribute) for patch in patches}
    stale = [f"{e.owner}.{e.name}" for e in PATCHED if (e.owner, e.name) not in used]
    if stale:
        raise SystemExit(f"check_vllm_range: vllm_names.PATCHED has entries no patch uses: {', '.join(stale)}")
    return result + [Row(entry.label, "READ", entry, entry.used_by) for entry in READ]


def fill(row: Row, version: str, tree: SourceTree) -> None:
    row.cells[version] = cell_of(row, version, tree)


def cell_of(row: Row, version: str, tree: SourceTree) -> Cell:
    """A row's cell on one release: n/a where the row does not apply there, broken where its
    ``versions`` and the plugin's own run-time condition (``applies_if``) disagree."""
    if row.entry is None:
        return Cell(BROKEN, "no check: record the expected shape in vllm_edsd/serving/vllm_names.py PATCHED")
    if row.source != "REFUSAL" and not version_supported(version):
        return Cell(NOT_APPLICABLE, "outside SUPPORTED_VLLM: the plugin refuses \"edsd\"")
    claimed = row.patch is None or row.source == "REFUSAL" or row.patch.claims(version)
    condition = row.entry.applies_if
    if condition and condition_met(tree, condition) != claimed:
        if claimed:
            return Cell(BROKEN, f"the row's versions ({row.patch.versions}) include {version}, where the plugin "
                                f"does not make it ({condition} does not hold)")
        return Cell(BROKEN, f"the plugin makes it in {version} ({condition} holds), which the row's versions "
                            f"({row.patch.versions}) leave out")
    if not claimed:
        return Cell(NOT_APPLICABLE, f"the row's versions: {row.patch.versions}")
    return judge(tree, row.entry)


# ---------------------------------------------------------------- output


METHODS = "vllm.config.speculative:SpeculativeMethod"


def speculative_methods(tree: SourceTree) -> set[str]:
    """The ``"method"`` values a release's ``SpeculativeConfig`` accepts."""
    found, _, _ = resolve(tree, VllmName(METHODS, "", ""))
    return tree.members_of_value(found) if found is not None and found.kind == "value" else set()


def method_changes(methods: dict[str, set[str]]) -> list[str]:
    """A line per release whose speculative methods differ from the release before it."""
    lines, before = [], None
    for version, now in methods.items():
        if before is None:
            lines.append(f"- {version}: {', '.join(sorted(now))}")
        elif now != before:
            changes = [f"+{m}" for m in sorted(now - before)] + [f"−{m}" for m in sorted(before - now)]
            lines.append(f"- {version}: {', '.join(changes)}")
        before = now
    return lines


def render(table: list[Row], versions: list[str], methods: dict[str, set[str]]) -> str:
    lo, hi = SUPPORTED_VLLM
    lines = [
        "# vLLM names vllm-edsd depends on, release by release",
        "",
        "Written by `python scripts/check_vllm_range.py`, which reads each release's source distribution "
        "from PyPI (no GPU, no import). Rows: `PATCHES` and `REFUSAL` of `vllm_edsd/serving/patches.py` (with "
        "each row's kind, checked as the kind calls for), then `READ` of `vllm_edsd/serving/vllm_names.py`, "
        "where each row's expected shape is recorded. "
        f"`SUPPORTED_VLLM` is [{lo[0]}.{lo[1]}, {hi[0]}.{hi[1]}).",
        "",
        f"{OK} present with the expected shape · {BROKEN} broken (reasons below) · {ABSENT} absent, optional "
        f"(the plugin goes without it) · {NOT_APPLICABLE} the row does not apply to that release",
        "",
        "| row | " + " | ".join(versions) + " |",
        "|---|" + "---|" * len(versions),
    ]
    for row in table:
        source = f"{row.source} ({row.kind})" if row.kind else row.source
        lines.append(f"| {source}: `{row.label}` | " + " | ".join(row.cells[v].status for v in versions) + " |")
    for title, status in (("Broken", BROKEN), ("Absent (optional)", ABSENT)):
        notes = [f"- {v} `{row.label}`: {row.cells[v].reason}" for row in table for v in versions
                 if row.cells[v].status == status]
        lines += ["", f"## {title}", "", *(notes or ["none"])]
    lines += ["", "## Not applicable in a supported release", "", *(not_applicable(table, versions) or ["none"])]
    lines += ["", "## vLLM's speculative methods", "",
              f"`{METHODS}`, in the first release read and then as it changes (the plugin translates "
              "`\"edsd\"` alone, to `\"eagle3\"`):", "", *method_changes(methods)]
    return "\n".join(lines) + "\n"


def not_applicable(table: list[Row], versions: list[str]) -> list[str]:
    """A line per row and reason for its n/a cells in supported releases: the releases its
    ``versions`` leave out, or why vLLM has nothing to check."""
    lines = []
    for row in table:
        by_reason: dict[str, list[str]] = {}
        for v in versions:
            if row.cells[v].status == NOT_APPLICABLE and version_supported(v):
                by_reason.setdefault(row.cells[v].reason, []).append(v)
        lines += [f"- `{row.label}` ({row.kind or row.source}) in {', '.join(vs)}: {reason}"
                  for reason, vs in by_reason.items()]
    return lines


def as_json(table: list[Row], versions: list[str]) -> dict:
    """The table as data: each row's cells, and a reason for every cell that is not a plain ✓."""
    return {
        "releases": versions,
        "supported_vllm": [list(bound) for bound in SUPPORTED_VLLM],
        "rows": [{"label": row.label, "source": row.source, "kind": row.kind or None, "why": row.why,
                  "owner": row.entry.owner if row.entry else None, "name": row.entry.name if row.entry else None,
                  "cells": {v: row.cells[v].status for v in versions},
                  "reasons": {v: row.cells[v].reason for v in versions if row.cells[v].reason}}
                 for row in table],
    }


def broken(table: list[Row]) -> int:
    return sum(cell.status == BROKEN for row in table for cell in row.cells.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="check_vllm_range.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rows, expected signatures and when each row applies: vllm_edsd/serving/vllm_names.py. "
               "A release that breaks a row: fix the plugin there if small, else narrow SUPPORTED_VLLM "
               "in vllm_edsd/serving/versions.py (and the README's support matrix).")
    parser.add_argument("--releases", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                        help="comma-separated vLLM versions (default: the newest patch of each minor 0.24-0.33)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"where sdists are downloaded and unpacked (default: {DEFAULT_CACHE})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where report.md and results.json are written (default: bench/results/vllm-range)")
    parser.add_argument("--offline", action="store_true",
                        help="do not ask PyPI: use the cached release list and sdists")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        releases = releases_from_listing(read_listing(args.cache, args.offline), args.releases)
        print(f"vLLM releases: {', '.join(r.version for r in releases)}", flush=True)
        trees = {r.version: SourceTree(unpack(r, args.cache)) for r in releases}
    except (urllib.error.URLError, OSError, tarfile.TarError) as exc:
        print(f"check_vllm_range: cannot get the vLLM sources: {exc}", file=sys.stderr)
        return 2
    table = rows()
    for version, tree in trees.items():
        for row in table:
            fill(row, version, tree)
    versions = list(trees)
    report = render(table, versions, {v: speculative_methods(tree) for v, tree in trees.items()})
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(report, encoding="utf-8")
    (args.out / "results.json").write_text(json.dumps(as_json(table, versions), indent=1, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
    count = broken(table)
    print(f"{count} broken cell(s); written to {args.out}", flush=True)
    return 1 if count else 0


if __name__ == "__main__":
    sys.exit(main())
