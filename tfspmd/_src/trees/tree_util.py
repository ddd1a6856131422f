"""JAX's pytree functions over tfspmd's trees (`tfspmd.tree_util`).

The trees are the ones pmap, vmap and shard_map take and return: tuple,
list, dict (sorted keys), OrderedDict, defaultdict, namedtuple, None (an
empty subtree) and registered nodes; everything else is a leaf. A treedef is
optree's `PyTreeSpec` (JAX calls its own `PyTreeDef`).
"""

import functools
from typing import Any, Callable, Iterable, List, Optional, Tuple

import optree

from tfspmd._src.core import tree_keys
from tfspmd._src.trees import tree as tree_lib

PyTreeDef = optree.PyTreeSpec
IsLeaf = Optional[Callable[[Any], bool]]

# tree_reduce's default: no initializer, as functools.reduce.
_NO_INITIALIZER = object()


def tree_flatten(tree: Any,
                 is_leaf: IsLeaf = None) -> Tuple[List[Any], PyTreeDef]:
  """The leaves of `tree`, in order, and its structure.

  Args:
    tree: A pytree.
    is_leaf: Optional; a subtree for which it returns True is a leaf.

  Returns:
    `(leaves, treedef)`.

  Example:
    >>> from tfspmd import tree_util
    >>> leaves, treedef = tree_util.tree_flatten({'a': 1, 'b': (2, 3)})
    >>> leaves
    [1, 2, 3]
    >>> treedef
    PyTreeSpec({'a': *, 'b': (*, *)})
  """
  return tree_lib.flatten(tree, is_leaf)


def tree_unflatten(treedef: PyTreeDef, leaves: Iterable[Any]) -> Any:
  """Builds the tree of structure `treedef` from `leaves`.

  Example:
    >>> from tfspmd import tree_util
    >>> treedef = tree_util.tree_structure({'a': 0, 'b': (0, 0)})
    >>> tree_util.tree_unflatten(treedef, [1, 2, 3])
    {'a': 1, 'b': (2, 3)}
  """
  return treedef.unflatten(leaves)


def tree_leaves(tree: Any, is_leaf: IsLeaf = None) -> List[Any]:
  """The leaves of `tree`, in flatten order.

  Example:
    >>> from tfspmd import tree_util
    >>> tree_util.tree_leaves([1, {'k1': 2, 'k2': (3, 4)}, 5])
    [1, 2, 3, 4, 5]
  """
  return tree_lib.flatten(tree, is_leaf)[0]


def tree_structure(tree: Any, is_leaf: IsLeaf = None) -> PyTreeDef:
  """The structure of `tree`: its treedef.

  Example:
    >>> from tfspmd import tree_util
    >>> tree_util.tree_structure([1, None, {'x': 2}])
    PyTreeSpec([*, None, {'x': *}])
  """
  return tree_lib.flatten(tree, is_leaf)[1]


def tree_map(f: Callable[..., Any], tree: Any, *rest: Any,
             is_leaf: IsLeaf = None) -> Any:
  """Applies `f` to each leaf of `tree` (and the matching leaves of `rest`).

  Args:
    f: Called with a leaf of `tree` and the leaves of `rest` at its place.
    tree: A pytree.
    *rest: Trees with the structure of `tree` (or with subtrees where `tree`
      has leaves: `f` gets the subtree).
    is_leaf: Optional; a subtree of `tree` for which it returns True is a
      leaf.

  Returns:
    A tree of the structure of `tree` with the results of `f`.

  Raises:
    ValueError: If a tree of `rest` does not have `tree`'s structure.

  Example:
    >>> from tfspmd import tree_util
    >>> tree_util.tree_map(lambda x: x * 2, [1, {'k1': 2, 'k2': (3, 4)}, 5])
    [2, {'k1': 4, 'k2': (6, 8)}, 10]
    >>> tree_util.tree_map(lambda x, y: x + y, {'a': 1, 'b': 2},
    ...                    {'a': 10, 'b': 20})
    {'a': 11, 'b': 22}
  """
  leaves, treedef = tree_lib.flatten(tree, is_leaf)
  others = _flatten_rest(treedef, rest, "tree_map")
  return treedef.unflatten(map(f, leaves, *others))


def tree_flatten_with_path(
    tree: Any, is_leaf: IsLeaf = None
) -> Tuple[List[Tuple[tree_keys.KeyPath, Any]], PyTreeDef]:
  """`(key path, leaf)` of each leaf of `tree`, and its structure.

  Example:
    >>> from tfspmd import tree_util
    >>> pairs, _ = tree_util.tree_flatten_with_path({'a': [1, 2]})
    >>> pairs[1]
    ((DictKey(key='a'), SequenceKey(idx=1)), 2)
  """
  leaves, treedef = tree_lib.flatten(tree, is_leaf)
  return list(zip(tree_lib.key_paths(treedef), leaves)), treedef


def tree_leaves_with_path(
    tree: Any, is_leaf: IsLeaf = None) -> List[Tuple[tree_keys.KeyPath, Any]]:
  """`(key path, leaf)` of each leaf of `tree`.

  Example:
    >>> from tfspmd import tree_util
    >>> for path, leaf in tree_util.tree_leaves_with_path({'a': (1, 2)}):
    ...   print(tree_util.keystr(path), leaf)
    ['a'][0] 1
    ['a'][1] 2
  """
  return tree_flatten_with_path(tree, is_leaf)[0]


def tree_map_with_path(f: Callable[..., Any], tree: Any, *rest: Any,
                       is_leaf: IsLeaf = None) -> Any:
  """`tree_map` where `f` also gets each leaf's key path first.

  Raises:
    ValueError: If a tree of `rest` does not have `tree`'s structure.

  Example:
    >>> from tfspmd import tree_util
    >>> tree_util.tree_map_with_path(
    ...     lambda path, x: f'{tree_util.keystr(path)}={x}', {'a': [1, 2]})
    {'a': ["['a'][0]=1", "['a'][1]=2"]}
  """
  leaves, treedef = tree_lib.flatten(tree, is_leaf)
  others = _flatten_rest(treedef, rest, "tree_map_with_path")
  return treedef.unflatten(
      map(f, tree_lib.key_paths(treedef), leaves, *others))


def tree_reduce(function: Callable[[Any, Any], Any], tree: Any,
                initializer: Any = _NO_INITIALIZER,
                is_leaf: IsLeaf = None) -> Any:
  """Folds the leaves of `tree` with `function`, as `functools.reduce`.

  Example:
    >>> import operator
    >>> from tfspmd import tree_util
    >>> tree_util.tree_reduce(operator.add, [1, (2, 3), {'a': 4}])
    10
  """
  leaves = tree_lib.flatten(tree, is_leaf)[0]
  if initializer is _NO_INITIALIZER:
    return functools.reduce(function, leaves)
  return functools.reduce(function, leaves, initializer)


def tree_all(tree: Any, *, is_leaf: IsLeaf = None) -> bool:
  """Whether every leaf of `tree` is true (True for a tree with no leaves).

  Example:
    >>> from tfspmd import tree_util
    >>> tree_util.tree_all([True, {'a': True, 'b': (True, False)}])
    False
  """
  return all(tree_lib.flatten(tree, is_leaf)[0])


def tree_transpose(outer_treedef: PyTreeDef,
                   inner_treedef: Optional[PyTreeDef],
                   pytree_to_transpose: Any) -> Any:
  """Turns a tree of `outer_treedef` of trees of `inner_treedef` inside out.

  Args:
    outer_treedef: The structure of the outer tree.
    inner_treedef: The structure of each inner tree; None takes the first's.
    pytree_to_transpose: The tree to transpose.

  Returns:
    A tree of `inner_treedef` of trees of `outer_treedef`.

  Example:
    >>> from tfspmd import tree_util
    >>> outer = tree_util.tree_structure([0, 0])
    >>> inner = tree_util.tree_structure({'a': 0, 'b': 0})
    >>> tree_util.tree_transpose(outer, inner,
    ...                          [{'a': 1, 'b': 2}, {'a': 3, 'b': 4}])
    {'a': [1, 3], 'b': [2, 4]}
  """
  if inner_treedef is None:
    first = outer_treedef.flatten_up_to(pytree_to_transpose)[0]
    inner_treedef = tree_structure(first)
  return optree.tree_transpose(outer_treedef, inner_treedef,
                               pytree_to_transpose)


def _flatten_rest(treedef, rest, function):
  """The leaves of each tree of `rest`, cut at the leaves of `treedef`."""
  others = []
  for i, other in enumerate(rest):
    try:
      others.append(treedef.flatten_up_to(other))
    except ValueError as e:
      other_treedef = optree.tree_structure(other, namespace=tree_lib.NAMESPACE)
      raise ValueError(
          f"{function}: rest[{i}] does not have the structure of tree: tree "
          f"is {tree_lib.describe(treedef)}, rest[{i}] is "
          f"{tree_lib.describe(other_treedef)} ({str(e).rstrip('.')}). Pass "
          f"trees of the same structure (or with subtrees where tree has "
          f"leaves).") from None
  return others
