"""JAX's `jax.tree_util`: functions over pytrees, and registering new nodes.

The trees are those pmap, vmap and shard_map take and return: tuple, list,
dict (in sorted key order), OrderedDict (in insertion order), defaultdict,
namedtuple, None (an empty subtree) and the classes registered here; any
other value (a tensor, a ShardedArray, an array, a number) is a leaf. A class
registered here is a node in tfspmd's trees only, not in other libraries'.

>>> from tfspmd import tree_util
>>> tree_util.tree_map(lambda x: x + 1, {'x': 7, 'y': (42, 64)})
{'x': 8, 'y': (43, 65)}
"""

# pylint: disable=useless-import-alias
from tfspmd._src.core.tree_keys import DictKey as DictKey
from tfspmd._src.core.tree_keys import FlattenedIndexKey as FlattenedIndexKey
from tfspmd._src.core.tree_keys import GetAttrKey as GetAttrKey
from tfspmd._src.core.tree_keys import KeyEntry as KeyEntry
from tfspmd._src.core.tree_keys import KeyPath as KeyPath
from tfspmd._src.core.tree_keys import SequenceKey as SequenceKey
from tfspmd._src.core.tree_keys import keystr as keystr
from tfspmd._src.trees.tree_registry import register_dataclass as register_dataclass
from tfspmd._src.trees.tree_registry import register_pytree_node as register_pytree_node
from tfspmd._src.trees.tree_registry import register_pytree_node_class as register_pytree_node_class
from tfspmd._src.trees.tree_util import PyTreeDef as PyTreeDef
from tfspmd._src.trees.tree_util import tree_all as tree_all
from tfspmd._src.trees.tree_util import tree_flatten as tree_flatten
from tfspmd._src.trees.tree_util import tree_flatten_with_path as tree_flatten_with_path
from tfspmd._src.trees.tree_util import tree_leaves as tree_leaves
from tfspmd._src.trees.tree_util import tree_leaves_with_path as tree_leaves_with_path
from tfspmd._src.trees.tree_util import tree_map as tree_map
from tfspmd._src.trees.tree_util import tree_map_with_path as tree_map_with_path
from tfspmd._src.trees.tree_util import tree_reduce as tree_reduce
from tfspmd._src.trees.tree_util import tree_structure as tree_structure
from tfspmd._src.trees.tree_util import tree_transpose as tree_transpose
from tfspmd._src.trees.tree_util import tree_unflatten as tree_unflatten

__all__ = [
    "DictKey",
    "FlattenedIndexKey",
    "GetAttrKey",
    "KeyEntry",
    "KeyPath",
    "PyTreeDef",
    "SequenceKey",
    "keystr",
    "register_dataclass",
    "register_pytree_node",
    "register_pytree_node_class",
    "tree_all",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_leaves_with_path",
    "tree_map",
    "tree_map_with_path",
    "tree_reduce",
    "tree_structure",
    "tree_transpose",
    "tree_unflatten",
]
