"""Key paths: where a leaf sits in a pytree, as JAX names and prints it.

A path is a tuple of keys, one per level: `DictKey` for a dict entry,
`SequenceKey` for a list or tuple position, `GetAttrKey` for a namedtuple or
dataclass field, `FlattenedIndexKey` for a child of a custom node registered
without keys. `keystr` prints a path as JAX does: `['a'][0].x`.
"""

import dataclasses
from typing import Any, Callable, Hashable, Tuple

import optree


@dataclasses.dataclass(frozen=True)
class DictKey:
  """The key of a dict entry in a path; prints as `['a']`.

  Example:
    >>> from tfspmd.tree_util import DictKey
    >>> print(DictKey('a'))
    ['a']
  """
  key: Hashable

  def __str__(self):
    return f"[{self.key!r}]"


@dataclasses.dataclass(frozen=True)
class SequenceKey:
  """A position in a list or tuple in a path; prints as `[0]`.

  Example:
    >>> from tfspmd.tree_util import SequenceKey
    >>> print(SequenceKey(0))
    [0]
  """
  idx: int

  def __str__(self):
    return f"[{self.idx!r}]"


@dataclasses.dataclass(frozen=True)
class GetAttrKey:
  """A namedtuple or dataclass field in a path; prints as `.x`.

  Example:
    >>> from tfspmd.tree_util import GetAttrKey
    >>> print(GetAttrKey('x'))
    .x
  """
  name: str

  def __str__(self):
    return f".{self.name}"


@dataclasses.dataclass(frozen=True)
class FlattenedIndexKey:
  """A child of a custom node registered without keys; prints as JAX does.

  Example:
    >>> from tfspmd.tree_util import FlattenedIndexKey
    >>> print(FlattenedIndexKey(1))
    [<flat index 1>]
  """
  key: int

  def __str__(self):
    return f"[<flat index {self.key}>]"


KeyEntry = Any
KeyPath = Tuple[KeyEntry, ...]

_SIMPLE = {DictKey: "key", SequenceKey: "idx", GetAttrKey: "name",
           FlattenedIndexKey: "key"}

# How the entries optree keeps for a custom node type become keys; a type
# missing here gets `FlattenedIndexKey`s, as a JAX node without keys does.
_ENTRY_KEYS = {}


def keystr(keys: KeyPath, *, simple: bool = False,
           separator: str = "") -> str:
  """Prints a key path as JAX does.

  Args:
    keys: A key path, as `tree_flatten_with_path` gives each leaf.
    simple: Print each key bare (`a`, `0`, `x`) instead of as an accessor.
    separator: Put between the keys.

  Returns:
    The path as a string.

  Example:
    >>> from tfspmd import tree_util
    >>> [(path, _)] = tree_util.tree_flatten_with_path({'a': [1]})[0]
    >>> tree_util.keystr(path)
    "['a'][0]"
    >>> tree_util.keystr(path, simple=True, separator='/')
    'a/0'
  """
  if simple:
    return separator.join(
        str(getattr(key, _SIMPLE[type(key)])) if type(key) in _SIMPLE
        else str(key) for key in keys)
  return separator.join(str(key) for key in keys)


def set_entry_keys(node_type: type, to_key: Callable[[Any], Any]) -> None:
  """Makes the entries optree keeps for `node_type` into keys with `to_key`."""
  _ENTRY_KEYS[node_type] = to_key


DICT_KINDS = (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT,
              optree.PyTreeKind.DEFAULTDICT)
SEQUENCE_KINDS = (optree.PyTreeKind.TUPLE, optree.PyTreeKind.LIST,
                  optree.PyTreeKind.DEQUE)


def child_keys(kind: optree.PyTreeKind, node_type: type,
               entries: Tuple[Any, ...]) -> list:
  """The key of each child of a node of `kind` and `node_type`."""
  if kind in DICT_KINDS:
    return [DictKey(entry) for entry in entries]
  if kind in SEQUENCE_KINDS:
    return [SequenceKey(i) for i in range(len(entries))]
  if kind == optree.PyTreeKind.NAMEDTUPLE:
    return [GetAttrKey(name) for name in node_type._fields]
  if kind == optree.PyTreeKind.STRUCTSEQUENCE:
    return [GetAttrKey(name) for name in optree.structseq_fields(node_type)]
  to_key = _ENTRY_KEYS.get(node_type)
  if to_key is None:
    return [FlattenedIndexKey(i) for i in range(len(entries))]
  return [to_key(entry) for entry in entries]

