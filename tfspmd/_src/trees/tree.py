"""Pytrees: flattening, rebuilding, leaf paths, axis specs as tree prefixes.

The trees are optree's with JAX's rules: tuple, list, dict (keys in sorted
order), OrderedDict (in insertion order), defaultdict, namedtuple and the
nodes registered with `tfspmd.tree_util` are containers, as are the lists
and dicts TensorFlow and Keras wrap for tracking (`tracked_containers`); None is an empty
container; anything else (a tensor, a ShardedArray, an array, a number) is a
leaf. A treedef is optree's `PyTreeSpec`: hashable, so it can be part of a
trace-cache key, with `unflatten(leaves)` and `num_leaves`.
"""

import collections

import optree

from tfspmd._src.core import tree_keys
from tfspmd._src.trees import tracked_containers

# tfspmd's nodes live in their own optree namespace, so that registering one
# changes no other optree user's trees (Keras's, for one).
NAMESPACE = "tfspmd"

tracked_containers.register_tensorflow_wrappers(NAMESPACE)

# Per treedef seen: each leaf's key path and that path printed, made once (a
# walk that also checks that its dict keys sort). Bounded: a program that
# makes ever-new structures must not grow it forever.
_PATHS = {}
_PATHS_SIZE = 1024


def flatten(tree, is_leaf=None):
  """Returns `(leaves, treedef)` of `tree`.

  Raises:
    TypeError: If a dict's keys cannot be sorted (as JAX, which sorts them).
  """
  tracked_containers.register_keras_wrappers_once_imported(NAMESPACE)
  leaves, treedef = optree.tree_flatten(tree, is_leaf, namespace=NAMESPACE)
  _paths(treedef)
  return leaves, treedef


class OutputTree:
  """The tree of what a traced function returns, kept beside its leaves.

  A function TensorFlow traces returns tensors only; the trace records the
  tree here and the caller rebuilds the output from the leaves.

  Example:
    >>> output = OutputTree()
    >>> leaves = output.leaves_of({"a": 1, "b": (2, 3)})
    >>> leaves
    [1, 2, 3]
    >>> output.rebuild([10, 20, 30])
    {'a': 10, 'b': (20, 30)}
  """

  def __init__(self):
    self.treedef = None

  def leaves_of(self, outputs):
    """The leaves of `outputs`, recording their tree."""
    leaves, self.treedef = flatten(outputs)
    return leaves

  def rebuild(self, leaves):
    """The recorded tree with `leaves` in it."""
    if self.treedef is None:
      raise RuntimeError("rebuild() before the traced function returned")
    return self.treedef.unflatten(list(leaves))


def flat_call_treedef(count):
  """The treedef of `(args, {})` for a tuple `args` of `count` leaves, made once.

  The same as `flatten((args, {}))[1]` for any such leaves (say tensors,
  arrays and `ShardedArray`s), without walking them: a pmap called with
  only arrays keys its trace cache by it.
  """
  treedef = _FLAT_CALLS.get(count)
  if treedef is None:
    treedef = _FLAT_CALLS[count] = flatten(((0,) * count, {}))[1]
  return treedef


_FLAT_CALLS = {}


def key_paths(treedef):
  """The key path (a tuple of keys) of each leaf of `treedef`, in order."""
  return _paths(treedef)[0]


def _paths(treedef):
  found = _PATHS.get(treedef)
  if found is None:
    paths = []
    _collect_key_paths(treedef, (), paths)
    if len(_PATHS) >= _PATHS_SIZE:
      _PATHS.clear()
    found = _PATHS[treedef] = (
        tuple(paths), tuple(tree_keys.keystr(path) for path in paths))
  return found


def _collect_key_paths(treedef, path, found):
  kind = treedef.kind
  if kind == optree.PyTreeKind.LEAF:
    found.append(path)
    return
  entries = treedef.entries()
  if kind in (optree.PyTreeKind.DICT, optree.PyTreeKind.DEFAULTDICT):
    _check_sortable(entries, path)
  keys = tree_keys.child_keys(kind, treedef.type, entries)
  for key, child in zip(keys, treedef.children()):
    _collect_key_paths(child, path + (key,), found)


def _check_sortable(keys, path):
  try:
    sorted(keys)
  except TypeError:
    where = tree_keys.keystr(path) or "the top level"
    raise TypeError(
        f"dict at {where} has keys that cannot be sorted ({list(keys)!r}); "
        f"pytree dicts need sortable keys.") from None


def leaf_paths(tree, root):
  """The path of each leaf of `tree`, in flatten order, e.g. `args[0]['w']`."""
  return [root + text for text in _paths(flatten(tree)[1])[1]]


def describe(treedef):
  """`treedef` as messages show it: `{'a': *, 'b': (*, *)}`."""
  text = repr(treedef)[len("PyTreeSpec("):-1]
  return text.removesuffix(f", namespace={NAMESPACE!r}")


def broadcast_prefix(prefix, tree, *, spec_name, root, is_spec_leaf):
  """Expands `prefix`, a tree prefix of `tree`, to one spec per leaf of `tree`.

  Args:
    prefix: A spec (for which `is_spec_leaf` is true) or a container of the
      same kind as `tree` at that level, holding prefixes of its children.
      Tuples and lists stand for each other, as do the kinds of dict.
    tree: The pytree the specs describe.
    spec_name: The argument's name for error messages ('in_axes').
    root: The name of `tree` for error messages ('args').
    is_spec_leaf: Tells a spec (an axis) from a container of specs.

  Returns:
    A list with one spec per leaf of `tree`, in flatten order.

  Raises:
    ValueError: If `prefix` is not a tree prefix of `tree`.
  """
  treedef = flatten(tree)[1]
  specs = []
  _broadcast_into(prefix, treedef, specs, spec_name, root, is_spec_leaf)
  return specs


def _broadcast_into(prefix, treedef, specs, spec_name, path, is_spec_leaf):
  if is_spec_leaf(prefix):
    specs.extend([prefix] * treedef.num_leaves)
    return
  kind = treedef.kind
  if kind == optree.PyTreeKind.NONE:
    return
  if not _same_kind(prefix, treedef):
    raise ValueError(
        f"{spec_name} specification must be a tree prefix of the corresponding "
        f"value, got specification {prefix!r} for value tree "
        f"{describe(treedef)} at {path}.")
  entries = treedef.entries()
  keys = tree_keys.child_keys(kind, treedef.type, entries)
  if kind in tree_keys.DICT_KINDS:
    if set(prefix) != set(entries):
      raise ValueError(
          f"{spec_name} specification at {path} has keys "
          f"{_listed(prefix)}, but the value there has keys "
          f"{_listed(entries)}.")
    children = [prefix[key] for key in entries]
  elif kind == optree.PyTreeKind.CUSTOM:
    children = optree.tree_flatten_one_level(
        prefix, namespace=NAMESPACE).children
  else:
    children = prefix
  if len(children) != len(entries):
    raise ValueError(
        f"{spec_name} specification at {path} has {len(children)} entries, "
        f"but the value there has {len(entries)}: {prefix!r}.")
  for sub_prefix, child, key in zip(children, treedef.children(), keys):
    _broadcast_into(sub_prefix, child, specs, spec_name, f"{path}{key}",
                    is_spec_leaf)


def _same_kind(prefix, treedef):
  kind = treedef.kind
  if kind in tree_keys.DICT_KINDS:
    return isinstance(prefix, collections.abc.Mapping)
  if kind == optree.PyTreeKind.CUSTOM:
    return type(prefix) is treedef.type  # pylint: disable=unidiomatic-typecheck
  return kind != optree.PyTreeKind.LEAF and isinstance(prefix, (tuple, list))


def _listed(keys):
  try:
    return sorted(keys)
  except TypeError:
    return list(keys)
