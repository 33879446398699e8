"""A digest of the code a class runs, as loaded in this process: what a cache of its outputs is keyed by."""

from __future__ import annotations

import enum
import functools
import hashlib
import re
import types
from typing import Any

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
#: How deep classes, wrappers and containers are followed from the class, and how many of them are read in all.
_DEEPEST, _MOST_NODES = 8, 200_000


def class_code_digest(cls: type) -> str:
    """A SHA-256 digest of what an instance of ``cls`` runs, over ``cls`` and its bases (not ``object``): its
    functions' bytecode, names, constants, default arguments and closures (methods, static and class methods,
    properties, cached properties, partials, the functions decorators wrap), the functions, classes, patterns and
    plain data of their own module that they name, nested classes, the classes of objects held as class attributes,
    and plain class attributes (scalars and containers of them, compiled patterns, enum members).

    It reads the code as loaded, not the source file (which may have been edited since), and is the same in every
    process: no addresses, no hash order, no file names or line numbers, and no double-underscore data (caches that
    Python and libraries add to a class as it is used). Class attributes that the code changes as it runs (a memo, a
    counter) change the digest: a cache miss, not stale tokens. A compiled class counts by its name; it never
    raises."""
    digest = _Digest()
    try:
        digest.add_class(cls, 0)
    except Exception as error:  # an object that cannot be read: counted by the failure's kind, the same every time
        digest.update(f"unreadable {type(error).__name__}")
    return digest.hexdigest()


class _Digest:
    """One SHA-256 over a class's code, each object read once (by identity: cycles end) within a node budget."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._seen: set[int] = set()
        self._nodes = 0

    def update(self, text: str) -> None:
        self._hash.update(text.encode() + b"\0")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def _first_visit(self, value: Any, depth: int) -> bool:
        """Whether to read ``value`` now: not seen before, not too deep, within the budget (else a marker)."""
        self._nodes += 1
        if depth > _DEEPEST or self._nodes > _MOST_NODES:
            self.update("...")
            return False
        if id(value) in self._seen:
            self.update("seen")
            return False
        self._seen.add(id(value))
        return True

    def add_class(self, cls: type, depth: int) -> None:
        for klass in cls.__mro__:
            if klass.__module__ == "builtins" or not self._first_visit(klass, depth):
                continue
            self.update(f"class {klass.__module__}.{klass.__qualname__}")
            if issubclass(klass, enum.Enum):
                self.update(stable_repr({name: member.value for name, member in klass.__members__.items()}))
            for name, value in sorted(vars(klass).items(), key=lambda item: str(item[0])):
                name = str(name)
                if name.startswith("__") and name.endswith("__") and not _is_code(value):
                    continue  # data Python or a library keeps on the class (annotations, slot names, schemas)
                self.update(f"attribute {name}")
                self.add_value(value, depth + 1)

    def add_value(self, value: Any, depth: int) -> None:
        if isinstance(value, (staticmethod, classmethod)):
            self.add_value(value.__func__, depth + 1)
        elif isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                self.add_value(accessor, depth + 1)
        elif isinstance(value, functools.cached_property):
            self.add_value(value.func, depth + 1)
        elif isinstance(value, (functools.partial, functools.partialmethod)):
            self.add_value(value.func, depth + 1)
            self.add_value((value.args, value.keywords), depth + 1)
        elif isinstance(value, type):
            self.add_class(value, depth + 1)
        elif isinstance(getattr(value, "__code__", None), types.CodeType):
            self._add_function(value, depth)
        elif hasattr(value, "__wrapped__") and not isinstance(value, _SCALARS):  # a wrapper object (lru_cache)
            self.update(type(value).__qualname__)
            self.add_value(value.__wrapped__, depth + 1)
        elif isinstance(value, re.Pattern):
            self.update(f"pattern {value.pattern!r} {value.flags}")
        elif isinstance(value, enum.Enum):
            self.update(f"member {type(value).__qualname__}.{value.name} {stable_repr(value.value)}")
        elif isinstance(value, (tuple, list, set, frozenset, dict)) or isinstance(value, _SCALARS):
            self.update(stable_repr(value))
        elif type(value).__module__ != "builtins":  # an object held by the class: what its class runs
            self.update(f"instance of {type(value).__qualname__}")
            self.add_class(type(value), depth + 1)
        else:
            self.update(f"<{type(value).__qualname__}>")

    def _add_function(self, function: Any, depth: int) -> None:
        if not self._first_visit(function, depth):
            return
        self._add_code(function.__code__)
        self.add_value((function.__defaults__, function.__kwdefaults__), depth + 1)
        for cell in function.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                contents = None
            self.add_value(contents, depth + 1)
        module = getattr(function, "__module__", None)
        for name in sorted(_names(function.__code__)):  # its own module's helpers and constants that it names
            target = function.__globals__.get(name)
            if isinstance(target, types.ModuleType) or target is None:
                continue
            if getattr(target, "__module__", module) == module or isinstance(target, (re.Pattern, *_SCALARS)):
                self.update(f"global {name}")
                self.add_value(target, depth + 1)
        if hasattr(function, "__wrapped__"):  # a decorator's wrapper: the decorated function too
            self.add_value(function.__wrapped__, depth + 1)

    def _add_code(self, code: types.CodeType) -> None:
        """A code object's bytecode, signature, names and constants (nested functions' too), not its file or line
        numbers."""
        self.update(code.co_code.hex())
        self.update(stable_repr((code.co_argcount, code.co_kwonlyargcount, code.co_flags, code.co_names,
                                 code.co_varnames, code.co_freevars)))
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType):
                self._add_code(constant)
            else:
                self.update(stable_repr(constant))


def _is_code(value: Any) -> bool:
    return isinstance(value, (staticmethod, classmethod, property, types.FunctionType))


def _names(code: types.CodeType) -> set[str]:
    """The global names a code object and its nested code objects read."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names(constant)
    return names


def stable_repr(value: Any, depth: int = 0, seen: set[int] | None = None) -> str:
    """``repr`` of plain data (scalars, and tuples, lists, sets and dicts of them) the same in every process: sets
    and dicts in sorted order; anything else by its type's name (its ``repr`` may hold an address). A container met
    again (a cycle, or one shared) is written once."""
    if isinstance(value, _SCALARS):
        return repr(value)
    if depth > _DEEPEST:
        return "..."
    if not isinstance(value, (tuple, list, set, frozenset, dict)):
        return f"<{type(value).__module__}.{type(value).__qualname__}>"
    seen = set() if seen is None else seen
    if id(value) in seen:
        return "seen"
    seen.add(id(value))
    if isinstance(value, dict):
        items = sorted(f"{stable_repr(key, depth + 1, seen)}: {stable_repr(item, depth + 1, seen)}"
                       for key, item in value.items())
        return f"dict({', '.join(items)})"
    parts = [stable_repr(item, depth + 1, seen) for item in value]
    return f"{type(value).__name__}({', '.join(sorted(parts) if isinstance(value, (set, frozenset)) else parts)})"
