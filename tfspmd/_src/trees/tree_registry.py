"""Custom pytree nodes: classes that tfspmd flattens into their children.

JAX's registration functions, on optree's registry in tfspmd's namespace: a
registered class is a container in every tfspmd tree (the arguments and
results of pmap, vmap and shard_map, and `tfspmd.tree_util`), and in no other
optree user's trees.
"""

import dataclasses
import operator
from typing import (Any, Callable, Hashable, Iterable, Optional, Sequence,
                    Tuple, Type, TypeVar)

import optree

from tfspmd._src.core import tree_keys
from tfspmd._src.trees import tree

T = TypeVar("T")


def register_pytree_node(
    nodetype: Type[T],
    flatten_func: Callable[[T], Tuple[Iterable[Any], Hashable]],
    unflatten_func: Callable[[Hashable, Iterable[Any]], T],
    flatten_with_keys_func: Optional[
        Callable[[T], Tuple[Iterable[Tuple[Any, Any]], Hashable]]] = None,
) -> None:
  """Makes `nodetype` a pytree container, as JAX's `register_pytree_node`.

  Args:
    nodetype: The class to flatten into its children.
    flatten_func: `flatten_func(node) -> (children, aux_data)`; `aux_data`
      is hashable and is part of the tree structure.
    unflatten_func: `unflatten_func(aux_data, children) -> node`.
    flatten_with_keys_func: Optional `f(node) -> (((key, child), ...),
      aux_data)`, which names each child in key paths; without it the
      children are `FlattenedIndexKey(i)`.

  Raises:
    ValueError: If `nodetype` is already registered with tfspmd.

  Example:
    >>> from tfspmd import tree_util
    >>> class Pair:
    ...   def __init__(self, name, a, b):
    ...     self.name, self.a, self.b = name, a, b
    >>> tree_util.register_pytree_node(
    ...     Pair, lambda p: ((p.a, p.b), p.name),
    ...     lambda name, children: Pair(name, *children))
    >>> tree_util.tree_leaves([Pair('x', 1, 2), Pair('y', 3, 4)])
    [1, 2, 3, 4]
  """
  if flatten_with_keys_func is None:
    optree.register_pytree_node(nodetype, flatten_func, unflatten_func,
                                path_entry_type=optree.FlattenedEntry,
                                namespace=tree.NAMESPACE)
    return

  def flatten_with_entries(node):
    pairs, aux_data = flatten_with_keys_func(node)
    pairs = tuple(pairs)
    return ([child for _, child in pairs], aux_data,
            tuple(key for key, _ in pairs))

  # optree keeps the keys as the node's entries; paths use them as they are.
  optree.register_pytree_node(nodetype, flatten_with_entries, unflatten_func,
                              namespace=tree.NAMESPACE)
  tree_keys.set_entry_keys(nodetype, lambda key: key)


def register_pytree_node_class(cls: Type[T]) -> Type[T]:
  """Registers `cls` by its `tree_flatten` and `tree_unflatten` methods.

  As JAX's: `tree_flatten(self) -> (children, aux_data)` and the classmethod
  `tree_unflatten(cls, aux_data, children)`. Usable as a decorator.

  Args:
    cls: The class to register.

  Returns:
    `cls`.

  Example:
    >>> from tfspmd import tree_util
    >>> @tree_util.register_pytree_node_class
    ... class Scaled:
    ...   def __init__(self, value, scale):
    ...     self.value, self.scale = value, scale
    ...   def tree_flatten(self):
    ...     return (self.value,), self.scale
    ...   @classmethod
    ...   def tree_unflatten(cls, scale, children):
    ...     return cls(*children, scale)
    >>> tree_util.tree_map(lambda v: v + 1, Scaled(1, scale=10)).value
    2
  """
  register_pytree_node(cls, operator.methodcaller("tree_flatten"),
                       cls.tree_unflatten)
  return cls


def register_dataclass(nodetype: Type[T],
                       data_fields: Optional[Sequence[str]] = None,
                       meta_fields: Optional[Sequence[str]] = None,
                       drop_fields: Sequence[str] = ()) -> Type[T]:
  """Registers a dataclass-like class by its fields, as JAX's.

  Data fields are children (subtrees); meta fields are hashable values that
  are part of the tree structure. Without `data_fields` and `meta_fields`,
  `nodetype` must be a dataclass: fields marked
  `dataclasses.field(metadata=dict(static=True))` are meta fields, the
  others data fields. Usable as a decorator.

  Args:
    nodetype: The class; `nodetype(**fields)` must rebuild an instance.
    data_fields: The names of the fields that hold children.
    meta_fields: The names of the fields that are part of the structure.
    drop_fields: Fields of a dataclass to leave out of the node.

  Returns:
    `nodetype`.

  Raises:
    TypeError: If only one of `data_fields` and `meta_fields` is given, or
      neither is and `nodetype` is not a dataclass.
    ValueError: If the fields of a dataclass are not exactly its `init`
      fields less `drop_fields`, or a field is both data and meta.

  Example:
    >>> import dataclasses
    >>> from tfspmd import tree_util
    >>> @tree_util.register_dataclass
    ... @dataclasses.dataclass
    ... class Layer:
    ...   w: float
    ...   b: float
    ...   act: str = dataclasses.field(metadata=dict(static=True))
    >>> tree_util.tree_leaves(Layer(w=1.0, b=2.0, act='relu'))
    [1.0, 2.0]
  """
  data_fields, meta_fields = _fields(nodetype, data_fields, meta_fields,
                                     drop_fields)

  def flatten(node):
    return (tuple(getattr(node, name) for name in data_fields),
            tuple(getattr(node, name) for name in meta_fields), data_fields)

  def unflatten(meta, data):
    return nodetype(**dict(zip(meta_fields, meta)),
                    **dict(zip(data_fields, data)))

  optree.register_pytree_node(nodetype, flatten, unflatten,
                              path_entry_type=optree.GetAttrEntry,
                              namespace=tree.NAMESPACE)
  tree_keys.set_entry_keys(nodetype, tree_keys.GetAttrKey)
  return nodetype


def _fields(nodetype, data_fields, meta_fields, drop_fields):
  """`(data_fields, meta_fields)` as tuples, checked against the dataclass."""
  if data_fields is None or meta_fields is None:
    if (data_fields is None) != (meta_fields is None):
      raise TypeError(
          f"register_dataclass: give both data_fields and meta_fields or "
          f"neither; got data_fields={data_fields!r}, "
          f"meta_fields={meta_fields!r}.")
    if not dataclasses.is_dataclass(nodetype):
      raise TypeError(
          f"register_dataclass: data_fields and meta_fields are needed when "
          f"nodetype is not a dataclass; got nodetype="
          f"{getattr(nodetype, '__qualname__', nodetype)!r}.")
    fields = dataclasses.fields(nodetype)
    data_fields = [f.name for f in fields if not f.metadata.get("static")]
    meta_fields = [f.name for f in fields if f.metadata.get("static")]
  data_fields, meta_fields = tuple(data_fields), tuple(meta_fields)
  if dataclasses.is_dataclass(nodetype):
    init_fields = {f.name for f in dataclasses.fields(nodetype) if f.init}
    init_fields -= set(drop_fields)
    given = {*data_fields, *meta_fields}
    if given != init_fields:
      raise ValueError(
          f"register_dataclass: data_fields and meta_fields must name every "
          f"field of {nodetype.__name__} with init=True (less drop_fields) "
          f"and only those; missing {sorted(init_fields - given)}, "
          f"unexpected {sorted(given - init_fields)}. Add a field to "
          f"drop_fields to leave it out.")
  overlap = set(data_fields) & set(meta_fields)
  if overlap:
    raise ValueError(
        f"register_dataclass: data_fields and meta_fields must not overlap; "
        f"both name {sorted(overlap)}.")
  return data_fields, meta_fields
