"""A digest of the code a class runs, as loaded in this process: what a cache of its outputs is keyed by."""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

# Class attributes that say where or how a class was written, not what it does, and caches that appear on it later
# (pickling an instance sets ``__slotnames__``).
_NOT_BEHAVIOUR = frozenset({"__doc__", "__module__", "__qualname__", "__dict__", "__weakref__", "__firstlineno__",
                            "__static_attributes__", "__slotnames__", "_abc_impl"})
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_DEEPEST = 6  # nesting of containers or wrappers followed


def class_code_digest(cls: type) -> str:
    """A SHA-256 digest of what an instance of ``cls`` runs: the bytecode, names, constants and default arguments of
    its functions (methods, static and class methods, properties, cached properties, partials, and the functions
    decorators wrap), its nested classes and its plain class attributes, over ``cls`` and its bases (not
    ``object``). It reads the code as loaded, not the source file (which may have been edited since), and is the
    same in every process: no addresses, no hash order, no file names or line numbers. A compiled class counts by
    its name; an object that is neither code nor plain data, by its type's name."""
    digest = hashlib.sha256()
    _add_class(digest, cls, set())
    return digest.hexdigest()


def _add_class(digest: Any, cls: type, seen: set[type]) -> None:
    for klass in cls.__mro__:
        if klass.__module__ == "builtins" or klass in seen:
            continue
        seen.add(klass)
        digest.update(f"class {klass.__module__}.{klass.__qualname__}".encode())
        for name, value in sorted(vars(klass).items(), key=lambda item: str(item[0])):
            if name in _NOT_BEHAVIOUR:
                continue
            digest.update(f"attribute {name}".encode())
            try:
                _add_value(digest, value, seen, 0)
            except Exception:  # an attribute that cannot be inspected counts by its type
                digest.update(type(value).__qualname__.encode())


def _add_value(digest: Any, value: Any, seen: set[type], depth: int) -> None:
    if depth > _DEEPEST:
        digest.update(b"...")
        return
    deeper = depth + 1
    if isinstance(value, (staticmethod, classmethod)):
        _add_value(digest, value.__func__, seen, deeper)
    elif isinstance(value, property):
        for accessor in (value.fget, value.fset, value.fdel):
            _add_value(digest, accessor, seen, deeper)
    elif isinstance(value, functools.cached_property):
        _add_value(digest, value.func, seen, deeper)
    elif isinstance(value, (functools.partial, functools.partialmethod)):
        _add_value(digest, value.func, seen, deeper)
        digest.update(stable_repr((value.args, value.keywords)).encode())
    elif isinstance(value, type):
        _add_class(digest, value, seen)
    elif isinstance(getattr(value, "__code__", None), types.CodeType):
        _add_code(digest, value.__code__)
        digest.update(stable_repr((value.__defaults__, value.__kwdefaults__)).encode())
        if hasattr(value, "__wrapped__"):  # a decorator's wrapper: the decorated function's code too
            _add_value(digest, value.__wrapped__, seen, deeper)
    elif hasattr(value, "__wrapped__"):  # a wrapper object (functools.lru_cache)
        digest.update(type(value).__qualname__.encode())
        _add_value(digest, value.__wrapped__, seen, deeper)
    else:
        digest.update(stable_repr(value).encode())


def _add_code(digest: Any, code: types.CodeType) -> None:
    """A code object's bytecode, names and constants (nested functions' too), not its file or line numbers."""
    digest.update(code.co_code + stable_repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _add_code(digest, constant)
        else:
            digest.update(stable_repr(constant).encode())


def stable_repr(value: Any, depth: int = 0) -> str:
    """``repr`` of plain data (scalars, and tuples, lists, sets and dicts of them) the same in every process: sets
    and dicts in sorted order; anything else by its type's name (its ``repr`` may hold an address)."""
    if isinstance(value, _SCALARS):
        return repr(value)
    if depth > _DEEPEST:
        return "..."
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(stable_repr(item, depth + 1) for item in value)})"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({', '.join(sorted(stable_repr(item, depth + 1) for item in value))})"
    if isinstance(value, dict):
        items = sorted(f"{stable_repr(key, depth + 1)}: {stable_repr(item, depth + 1)}" for key, item in value.items())
        return f"dict({', '.join(items)})"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"
