"""Pytrees: flattening, rebuilding and matching axis specs as tree prefixes.

The containers are tf.nest's: tuple, list, dict (keys in sorted order),
namedtuple; None is an empty container, as in JAX. Anything else is a leaf.
A `TreeDef` is hashable, so it can be part of a trace-cache key.
"""

import collections


def _is_namedtuple(value):
  return isinstance(value, tuple) and hasattr(type(value), "_fields")


class TreeDef:
  """The shape of a pytree without its leaves; hashable and comparable."""

  __slots__ = ("kind", "meta", "children", "num_leaves", "_hash")

  def __init__(self, kind, meta, children):
    self.kind = kind
    self.meta = meta
    self.children = children
    if kind == "leaf":
      self.num_leaves = 1
    else:
      self.num_leaves = sum(child.num_leaves for child in children)
    self._hash = hash((kind, meta, children))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return (isinstance(other, TreeDef) and self._hash == other._hash and
            self.kind == other.kind and self.meta == other.meta and
            self.children == other.children)

  def __repr__(self):
    if self.kind == "leaf":
      return "*"
    if self.kind == "none":
      return "None"
    inner = ", ".join(repr(child) for child in self.children)
    if self.kind == "dict":
      inner = ", ".join(f"{key!r}: {child!r}"
                        for key, child in zip(self.meta, self.children))
      return "{" + inner + "}"
    if self.kind == "list":
      return "[" + inner + "]"
    if self.kind == "namedtuple":
      return f"{self.meta.__name__}({inner})"
    return "(" + inner + ("," if len(self.children) == 1 else "") + ")"

  def unflatten(self, leaves):
    """Rebuilds the tree from `leaves` (in flatten order)."""
    iterator = iter(leaves)
    tree = self._build(iterator)
    return tree

  def _build(self, leaves):
    if self.kind == "leaf":
      return next(leaves)
    if self.kind == "none":
      return None
    values = [child._build(leaves) for child in self.children]  # pylint: disable=protected-access
    if self.kind == "tuple":
      return tuple(values)
    if self.kind == "list":
      return values
    if self.kind == "namedtuple":
      return self.meta(*values)
    return dict(zip(self.meta, values))


LEAF = TreeDef("leaf", None, ())


def _sorted_keys(mapping, path):
  try:
    return tuple(sorted(mapping))
  except TypeError:
    raise TypeError(
        f"dict at {path or 'the top level'} has keys that cannot be sorted "
        f"({list(mapping)!r}); pytree dicts need sortable keys.") from None


def flatten(tree):
  """Returns `(leaves, treedef)` of `tree`."""
  leaves = []
  return leaves, _flatten_into(tree, leaves, "")


def _flatten_into(tree, leaves, path):
  if tree is None:
    return TreeDef("none", None, ())
  kind = _kind(tree)
  if kind == "leaf":
    leaves.append(tree)
    return LEAF
  if kind == "dict":
    keys = _sorted_keys(tree, path)
    children = tuple(_flatten_into(tree[key], leaves, f"{path}[{key!r}]")
                     for key in keys)
    return TreeDef("dict", keys, children)
  children = tuple(_flatten_into(child, leaves, f"{path}[{i}]")
                   for i, child in enumerate(tree))
  meta = type(tree) if kind == "namedtuple" else None
  return TreeDef(kind, meta, children)


def _kind(tree):
  if isinstance(tree, tuple):
    return "namedtuple" if _is_namedtuple(tree) else "tuple"
  if isinstance(tree, list):
    return "list"
  if isinstance(tree, (dict, collections.abc.Mapping)):
    return "dict"
  return "leaf"


def leaf_paths(tree, root):
  """The path of each leaf of `tree`, in flatten order, e.g. `args[0]['w']`."""
  paths = []
  _collect_paths(tree, root, paths)
  return paths


def _collect_paths(tree, path, paths):
  if tree is None:
    return
  kind = _kind(tree)
  if kind == "leaf":
    paths.append(path)
  elif kind == "dict":
    for key in _sorted_keys(tree, path):
      _collect_paths(tree[key], f"{path}[{key!r}]", paths)
  elif kind == "namedtuple":
    for field, child in zip(tree._fields, tree):
      _collect_paths(child, f"{path}.{field}", paths)
  else:
    for i, child in enumerate(tree):
      _collect_paths(child, f"{path}[{i}]", paths)


def broadcast_prefix(prefix, tree, *, spec_name, root, is_spec_leaf):
  """Expands `prefix`, a tree prefix of `tree`, to one spec per leaf of `tree`.

  Args:
    prefix: A spec (for which `is_spec_leaf` is true) or a container of the
      same kind as `tree` at that level, holding prefixes of its children.
    tree: The pytree the specs describe.
    spec_name: The argument's name for error messages ('in_axes').
    root: The name of `tree` for error messages ('args').
    is_spec_leaf: Tells a spec (an axis) from a container of specs.

  Returns:
    A list with one spec per leaf of `tree`, in flatten order.

  Raises:
    ValueError: If `prefix` is not a tree prefix of `tree`.
  """
  specs = []
  _broadcast_into(prefix, tree, specs, spec_name, root, is_spec_leaf)
  return specs


def _broadcast_into(prefix, tree, specs, spec_name, path, is_spec_leaf):
  if is_spec_leaf(prefix):
    specs.extend([prefix] * len(flatten(tree)[0]))
    return
  if tree is None:
    return
  tree_kind, prefix_kind = _kind(tree), _kind(prefix)
  same_kind = (tree_kind == prefix_kind or
               {tree_kind, prefix_kind} <= {"tuple", "list", "namedtuple"})
  if tree_kind == "leaf" or not same_kind:
    raise ValueError(
        f"{spec_name} specification must be a tree prefix of the corresponding "
        f"value, got specification {prefix!r} for value tree "
        f"{flatten(tree)[1]!r} at {path}.")
  if tree_kind == "dict":
    tree_keys, prefix_keys = _sorted_keys(tree, path), _sorted_keys(prefix, path)
    if tree_keys != prefix_keys:
      raise ValueError(
          f"{spec_name} specification at {path} has keys {list(prefix_keys)}, "
          f"but the value there has keys {list(tree_keys)}.")
    for key in tree_keys:
      _broadcast_into(prefix[key], tree[key], specs, spec_name,
                      f"{path}[{key!r}]", is_spec_leaf)
    return
  if len(prefix) != len(tree):
    raise ValueError(
        f"{spec_name} specification at {path} has {len(prefix)} entries, but "
        f"the value there has {len(tree)}: {prefix!r}.")
  for i, (sub_prefix, child) in enumerate(zip(prefix, tree)):
    _broadcast_into(sub_prefix, child, specs, spec_name, f"{path}[{i}]",
                    is_spec_leaf)
