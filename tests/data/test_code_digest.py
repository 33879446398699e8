"""The digest that keys cached tokens by a tokenizer's code: it must change with what the class runs, and only then."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_longshield import code_digest
from lightning_longshield.code_digest import class_code_digest

BASE = '''
import enum
import functools
import re

PATTERN = re.compile(r"\\w+|\\s")
OFFSET = 3


def _normalise(text):
    return text.replace("\\t", " ")


def scaled(factor):
    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args):
            return [factor * x for x in function(*args)]
        return wrapper
    return decorate


class Kind(enum.Enum):
    WORD = 1
    SPACE = 2


class Normalizer:
    def __call__(self, text):
        return text.lower()

class Base:
    def normalise(self, text):
        return text.strip()

class Tokenizer(Base):
    SPECIAL = ("<a>", "<b>")
    TABLE = {"x": 1, "y": 2}
    LIMIT = 10

    class Vocab:
        def lookup(self, token):
            return len(token)

    def encode(self, text, lower=True):
        return [ord(c) for c in (text.lower() if lower else text)]

    @staticmethod
    def wrap(function):
        @functools.wraps(function)
        def wrapper(*args):
            return function(*args)
        return wrapper

    @wrap
    def pieces(self, text):
        return text.split()

    @functools.lru_cache(maxsize=None)
    def cached(self, text):
        return text in {"a", "b"}

    @functools.cached_property
    def size(self):
        return 100

    split_on_space = functools.partialmethod(pieces)
    NORMALIZER = Normalizer()
    KIND = Kind.WORD

    def words(self, text):
        return [match.group() for match in PATTERN.finditer(_normalise(text))]

    @scaled(2)
    def doubled(self, text):
        return [ord(c) + OFFSET for c in text]

    @staticmethod
    def clean(text):
        return text.strip("-")

    @property
    def unk(self):
        return 0

    spaced = functools.partialmethod(encode, lower=True)
'''

CHANGES = {
    "a method's body": ("return [ord(c) for c in", "return [ord(c) + 1 for c in"),
    "a default argument": ("lower=True", "lower=False"),
    "a base class's method": ("text.strip()", "text.rstrip()"),
    "a decorated method's body": ("return text.split()", "return text.split(' ')"),
    "an lru_cache method's body": ('text in {"a", "b"}', 'text in {"a", "c"}'),
    "a cached property": ("return 100", "return 101"),
    "a nested class": ("return len(token)", "return len(token) + 1"),
    "a tuple class attribute": ('("<a>", "<b>")', '("<a>", "<c>")'),
    "a dict class attribute": ('{"x": 1, "y": 2}', '{"x": 1, "y": 3}'),
    "a scalar class attribute": ("LIMIT = 10", "LIMIT = 11"),
    "a module-level helper a method calls": ('" ")', '"  ")'),
    "a module-level pattern": ('|\\s")', '")'),
    "a module-level constant": ("OFFSET = 3", "OFFSET = 4"),
    "a decorator's argument (a closure)": ("@scaled(2)", "@scaled(3)"),
    "the class of an object held by the class": ("return text.lower()", "return text.upper()"),
    "an enum member's value": ("WORD = 1", "WORD = 3"),
    "a static method's body": ('strip("-")', 'strip("_")'),
    "a property's body": ("return 0", "return 1"),
    "a partialmethod's arguments": ("partialmethod(encode, lower=True)", "partialmethod(encode, lower=False)"),
}


def tokenizer_class(source: str) -> type:
    namespace: dict = {"__name__": "tokenizer_module"}
    exec(compile(source, "tokenizer_module.py", "exec", dont_inherit=True), namespace)  # not this file's __future__
    return namespace["Tokenizer"]


def test_the_same_code_gives_the_same_digest_wherever_it_stands_in_its_file():
    assert class_code_digest(tokenizer_class(BASE)) == class_code_digest(tokenizer_class("\n\n\n" + BASE))


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_each_change_to_what_the_class_runs_changes_the_digest(change):
    before, after = CHANGES[change]
    assert before in BASE
    assert class_code_digest(tokenizer_class(BASE.replace(before, after))) != class_code_digest(tokenizer_class(BASE))


def test_pickling_an_instance_leaves_the_digest_as_it_was():
    """pickle caches ``__slotnames__`` on the class the first time it saves an instance (`datasets` hashes by
    pickling): the second run of a tokenizer must find the first run's tokens."""
    cls = tokenizer_class(BASE)
    before = class_code_digest(cls)
    cls.__new__(cls).__reduce_ex__(2)  # what pickle.dumps calls first
    assert "__slotnames__" in vars(cls) and class_code_digest(cls) == before


def test_the_digest_is_the_same_in_every_process():
    """Sets and dicts are hashed in sorted order, so string hashing's per-process seed does not show."""
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('code_digest', {code_digest.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "namespace = {'__name__': 'tokenizer_module'}\n"
        "exec(compile(sys.stdin.read(), 'tokenizer_module.py', 'exec', dont_inherit=True), namespace)\n"
        "print(module.class_code_digest(namespace['Tokenizer']))\n"
    )
    digests = {
        subprocess.run([sys.executable, "-c", script], input=BASE, capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}, cwd=Path(__file__).parent).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1 and class_code_digest(tokenizer_class(BASE)) in digests


def test_stable_repr_names_objects_by_type_not_address():
    assert code_digest.stable_repr({"b": {2, 1}, "a": (object(),)}) == (
        "dict('a': tuple(<builtins.object>), 'b': set(1, 2))")


def test_caches_python_adds_to_a_class_and_cycles_leave_it_readable_and_unchanged():
    cycles = "Tokenizer.SELF = Tokenizer\nTokenizer.LOOP = []\nTokenizer.LOOP.append(Tokenizer.LOOP)\n"
    cls = tokenizer_class(BASE + cycles)
    before = class_code_digest(cls)
    assert isinstance(cls.__annotations__, dict)  # created on first read, on Python before 3.14
    assert class_code_digest(cls) == before
    shared: list = []
    shared.extend([shared] * 8)  # a list that holds itself eight times: read once, not 8 ** depth times
    cls.SHARED = shared
    after = class_code_digest(cls)
    assert after != before and class_code_digest(cls) == after


def test_classes_that_resist_reading_still_get_a_digest():
    source = '''
class Meta(type):
    def __eq__(cls, other):  # no __hash__: the class cannot sit in a set
        return cls is other
    __hash__ = None

class Hostile:
    def __getattr__(self, name):
        raise KeyError(name)

class Tokenizer(metaclass=Meta):
    HELD = Hostile()

    def encode(self, text):
        return list(text.encode())
'''
    first = class_code_digest(tokenizer_class(source))
    assert first == class_code_digest(tokenizer_class(source)) and len(first) == 64
