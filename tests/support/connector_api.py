"""Whether a connector class can be called as vLLM's ``KVConnectorBase_V1`` calls it, from both sources, parsed.

Nothing is imported: :func:`methods_of` reads a class's methods (name, kind, abstract or not, parameters) out of a
source file with ``ast``, so a base class from a wheel that is not installed compares with ours in any interpreter.
:func:`api_problems` lists what would break a call: an abstract method not implemented, a method of another kind
(class method, property...), or a signature that refuses an argument list the base's signature accepts.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class Parameter:
    name: str
    has_default: bool
    positional_only: bool = False


@dataclass(frozen=True)
class Method:
    """A method as a caller sees it: parameters after ``self``/``cls``."""

    name: str
    kind: str  # "method", "classmethod", "staticmethod" or "property"
    abstract: bool
    positional: tuple[Parameter, ...]
    keyword_only: tuple[Parameter, ...]
    var_positional: bool
    var_keyword: bool

    def describe(self) -> str:
        """The signature in Python's notation, without annotations (for messages)."""
        parts = [p.name + ("=..." if p.has_default else "") for p in self.positional]
        if self.var_positional or self.keyword_only:
            parts.append("*args" if self.var_positional else "*")
        parts += [p.name + ("=..." if p.has_default else "") for p in self.keyword_only]
        if self.var_keyword:
            parts.append("**kwargs")
        return f"{self.name}({', '.join(parts)})" + (f" [{self.kind}]" if self.kind != "method" else "")


def methods_of(source: str, class_name: str) -> dict[str, Method]:
    """The methods defined in the body of class ``class_name`` of ``source`` (a module's text), by name."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            functions = (n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
            return {f.name: _method(f) for f in functions}
    raise LookupError(f"no class {class_name} in the source")


def _decorator_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)
    return names


def _method(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    decorators = _decorator_names(function)
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
    arguments = function.args
    plain = [*arguments.posonlyargs, *arguments.args]
    first_default = len(plain) - len(arguments.defaults)
    positional = [
        Parameter(a.arg, has_default=i >= first_default, positional_only=i < len(arguments.posonlyargs))
        for i, a in enumerate(plain)
    ]
    if kind != "staticmethod" and positional:
        positional = positional[1:]  # self / cls
    keyword_only = tuple(
        Parameter(a.arg, has_default=d is not None)
        for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    )
    return Method(
        name=function.name,
        kind=kind,
        abstract="abstractmethod" in decorators,
        positional=tuple(positional),
        keyword_only=keyword_only,
        var_positional=arguments.vararg is not None,
        var_keyword=arguments.kwarg is not None,
    )


def api_problems(base: dict[str, Method], ours: dict[str, Method]) -> list[str]:
    """What in ``ours`` (a connector's methods) would break vLLM calling it as ``base`` (the base class's
    methods) says: abstract methods not implemented, overrides of another kind or an incompatible signature."""
    problems = [
        f"{name}: abstract in the base class, not implemented"
        for name, m in base.items()
        if m.abstract and name not in ours
    ]
    for name, method in ours.items():
        if name in base:
            problems += [f"{name}: {p}" for p in call_problems(base[name], method)]
    return problems


def call_problems(base: Method, ours: Method) -> list[str]:
    """Why some argument list that ``base``'s signature accepts would fail against ``ours`` (empty: none)."""
    where = f"(vLLM: {base.describe()}; ours: {ours.describe()})"
    if base.kind != ours.kind:
        return [f"a {ours.kind} where the base class has a {base.kind} {where}"]
    problems = []
    for index, wanted in enumerate(base.positional):
        if index >= len(ours.positional):
            if not (ours.var_positional and (ours.var_keyword or wanted.positional_only)):
                problems.append(f"takes no parameter {index + 1} ({wanted.name}) {where}")
            continue
        got = ours.positional[index]
        if got.name != wanted.name and not wanted.positional_only and not got.positional_only:
            problems.append(f"parameter {index + 1} is named {got.name}, vLLM passes it as {wanted.name} {where}")
        if wanted.has_default and not got.has_default:
            problems.append(f"{got.name} has no default, vLLM may leave it out {where}")
    for extra in ours.positional[len(base.positional) :]:
        if not extra.has_default:
            problems.append(f"{extra.name} is required, vLLM does not pass it {where}")
        elif base.var_positional:
            problems.append(f"{extra.name} would take what vLLM passes as *args {where}")
    if base.var_positional and not ours.var_positional:
        problems.append(f"takes no *args, the base class does {where}")
    if base.var_keyword and not ours.var_keyword:
        problems.append(f"takes no **kwargs, the base class does {where}")
    ours_by_name = {p.name: p for p in (*ours.positional, *ours.keyword_only) if not p.positional_only}
    for wanted in base.keyword_only:
        got = ours_by_name.get(wanted.name)
        if got is None and not ours.var_keyword:
            problems.append(f"takes no keyword {wanted.name} {where}")
        elif got is not None and wanted.has_default and not got.has_default:
            problems.append(f"{got.name} has no default, vLLM may leave it out {where}")
    base_keywords = {p.name for p in base.keyword_only}
    for extra in ours.keyword_only:
        if extra.name not in base_keywords and not extra.has_default:
            problems.append(f"keyword {extra.name} is required, vLLM does not pass it {where}")
    return problems
