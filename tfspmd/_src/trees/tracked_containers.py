"""TensorFlow's and Keras's tracking wrappers as the lists and dicts they hold.

A list or dict assigned to an attribute of a `tf.Module` is wrapped for
tracking (`ListWrapper`, `_DictWrapper`), as one of a Keras layer is
(`TrackedList`, `TrackedDict`). In tfspmd's trees they are the containers
they stand for, as in `tf.nest`: their items are leaves or subtrees (dict
keys in sorted order), and they rebuild as a plain list or dict.
"""

import sys

import optree

from tfspmd._src.core import tf_internal
from tfspmd._src.core import tree_keys

_KERAS_TRACKING = "keras.src.utils.tracking"
_keras_registered = False


def _flatten_list(node):
  return list(node), None


def _unflatten_list(_, children):
  return list(children)


def _flatten_dict(node):
  keys = sorted(node)
  return [node[key] for key in keys], tuple(keys), tuple(keys)


def _unflatten_dict(keys, children):
  return dict(zip(keys, children))


def _register(list_type, dict_type, namespace):
  optree.register_pytree_node(list_type, _flatten_list, _unflatten_list,
                              namespace=namespace)
  tree_keys.set_entry_keys(list_type, tree_keys.SequenceKey)
  optree.register_pytree_node(dict_type, _flatten_dict, _unflatten_dict,
                              namespace=namespace)
  tree_keys.set_entry_keys(dict_type, tree_keys.DictKey)


def register_tensorflow_wrappers(namespace):
  """Makes TensorFlow's tracking wrappers containers in `namespace`."""
  _register(*tf_internal.tracking_wrapper_types(), namespace)


def register_keras_wrappers_once_imported(namespace):
  """Makes Keras's tracking wrappers containers, once Keras is imported.

  Cheap to call on every flatten: tfspmd does not import Keras itself, and
  registers its wrappers the first time it finds Keras imported.
  """
  global _keras_registered
  if _keras_registered:
    return
  tracking = sys.modules.get(_KERAS_TRACKING)
  if tracking is None:
    return
  _keras_registered = True
  _register(tracking.TrackedList, tracking.TrackedDict, namespace)
