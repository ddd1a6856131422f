"""tfspmd.tree_util and tfspmd.tree: JAX's pytree functions, and custom nodes in maps.

Expected values are written out, most from the examples of JAX's
`jax.tree_util` documentation.
"""

import collections
import dataclasses
import operator

import numpy as np
import optree
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import tree_util

ATuple = collections.namedtuple("ATuple", "name")
Point = collections.namedtuple("Point", "x y")


class MyContainer:
  """JAX's documentation example of a custom node: a name and three values."""

  def __init__(self, name, a, b, c):
    self.name, self.a, self.b, self.c = name, a, b, c


tree_util.register_pytree_node(
    MyContainer, lambda c: ((c.a, c.b, c.c), c.name),
    lambda name, children: MyContainer(name, *children))


@tree_util.register_pytree_node_class
class Scaled:
  """A value and a scale that is part of the structure."""

  def __init__(self, value, scale):
    self.value, self.scale = value, scale

  def tree_flatten(self):
    return (self.value,), self.scale

  @classmethod
  def tree_unflatten(cls, scale, children):
    return cls(*children, scale)


class Named:
  """A node registered with keys for its children."""

  def __init__(self, first, second):
    self.first, self.second = first, second


tree_util.register_pytree_node(
    Named, lambda n: ((n.first, n.second), None),
    lambda _, children: Named(*children),
    flatten_with_keys_func=lambda n: (
        ((tree_util.GetAttrKey("first"), n.first),
         (tree_util.GetAttrKey("second"), n.second)), None))


@tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
  w: object
  b: object
  act: str = dataclasses.field(default="relu", metadata=dict(static=True))


@dataclasses.dataclass
class Struct:
  x: object
  y: object
  op: str


tree_util.register_dataclass(Struct, data_fields=["x", "y"],
                             meta_fields=["op"])


def paths_of(tree):
  return [(tree_util.keystr(path), leaf)
          for path, leaf in tree_util.tree_leaves_with_path(tree)]


# --- the functions, against JAX's documented results -------------------------


def test_tree_map_doubles_each_leaf_of_the_documented_tree():
  assert tree_util.tree_map(lambda x: x * 2, [1, {"k1": 2, "k2": (3, 4)}, 5]) == [
      2, {"k1": 4, "k2": (6, 8)}, 10]


def test_tree_map_over_several_trees():
  assert tree_util.tree_map(lambda x, y, z: x + y * z, {"a": 1, "b": (2, 3)},
                            {"a": 10, "b": (20, 30)},
                            {"a": 2, "b": (3, 4)}) == {"a": 21, "b": (62, 123)}


def test_tree_map_gives_subtrees_of_rest_where_tree_has_leaves():
  assert tree_util.tree_map(lambda x, sub: (x, sub), [1, 2],
                            [{"a": 3}, (4, 5)]) == [(1, {"a": 3}), (2, (4, 5))]


def test_tree_map_with_is_leaf_stops_at_chosen_subtrees():
  tree = {"a": (1, 2), "b": [3]}
  assert tree_util.tree_map(len, tree, is_leaf=lambda x: isinstance(
      x, (tuple, list))) == {"a": 2, "b": 1}


def test_tree_flatten_of_the_documented_dict():
  leaves, treedef = tree_util.tree_flatten({"a": 1, "b": (2, 3)})
  assert leaves == [1, 2, 3]
  assert treedef.num_leaves == 3
  assert treedef == tree_util.tree_structure({"a": 0, "b": (0, 0)})
  assert repr(treedef) == "PyTreeSpec({'a': *, 'b': (*, *)})"
  assert tree_util.tree_unflatten(treedef, [4, 5, 6]) == {"a": 4, "b": (5, 6)}


def test_tree_leaves_of_the_documented_trees():
  assert tree_util.tree_leaves([1, {"k1": 2, "k2": (3, 4)}, 5]) == [1, 2, 3, 4, 5]
  assert tree_util.tree_leaves((1, (2, 3), ())) == [1, 2, 3]
  assert tree_util.tree_leaves({"a": 2, "b": (2, 3)}) == [2, 2, 3]


def test_none_is_an_empty_subtree():
  assert tree_util.tree_leaves([1, None, {"a": None, "b": 2}]) == [1, 2]
  assert tree_util.tree_structure(None).num_leaves == 0
  assert tree_util.tree_map(lambda x: x + 1, {"a": None, "b": 1}) == {
      "a": None, "b": 2}


def test_is_leaf_can_make_none_a_leaf():
  assert tree_util.tree_leaves([1, None], is_leaf=lambda x: x is None) == [
      1, None]


def test_dict_leaves_come_in_sorted_key_order():
  leaves, treedef = tree_util.tree_flatten({"b": 1, "a": 2, "c": 3})
  assert leaves == [2, 1, 3]
  assert treedef == tree_util.tree_structure({"a": 0, "b": 0, "c": 0})
  assert tree_util.tree_unflatten(treedef, [20, 10, 30]) == {
      "a": 20, "b": 10, "c": 30}


def test_ordered_dict_keeps_its_type_and_insertion_order():
  tree = collections.OrderedDict([("b", 1), ("a", 2)])
  assert tree_util.tree_leaves(tree) == [1, 2]
  out = tree_util.tree_map(lambda x: x * 10, tree)
  assert type(out) is collections.OrderedDict
  assert list(out.items()) == [("b", 10), ("a", 20)]


def test_defaultdict_keeps_its_type_and_default_factory():
  tree = collections.defaultdict(list, {"b": 1, "a": 2})
  out = tree_util.tree_map(lambda x: x + 1, tree)
  assert type(out) is collections.defaultdict
  assert out.default_factory is list
  assert dict(out) == {"a": 3, "b": 2}


def test_namedtuple_keeps_its_type():
  out = tree_util.tree_map(lambda v: v * 2, Point(1, 2))
  assert out == Point(2, 4) and type(out) is Point


def test_tree_reduce_and_tree_all():
  assert tree_util.tree_reduce(operator.add, [1, (2, 3), {"a": 4}]) == 10
  assert tree_util.tree_reduce(operator.add, [], 7) == 7
  assert tree_util.tree_reduce(max, {"a": (1, 5), "b": 3}) == 5
  assert tree_util.tree_all([True, {"a": True, "b": (True, 1)}])
  assert not tree_util.tree_all([True, {"a": True, "b": (True, False)}])
  assert tree_util.tree_all([])


def test_tree_transpose_turns_a_list_of_dicts_into_a_dict_of_lists():
  outer = tree_util.tree_structure([0, 0, 0])
  inner = tree_util.tree_structure({"a": 0, "b": 0})
  tree = [{"a": 1, "b": 2}, {"a": 3, "b": 4}, {"a": 5, "b": 6}]
  expected = {"a": [1, 3, 5], "b": [2, 4, 6]}
  assert tree_util.tree_transpose(outer, inner, tree) == expected
  assert tree_util.tree_transpose(outer, None, tree) == expected


# --- key paths ---------------------------------------------------------------


def test_keystr_prints_paths_as_jax_does():
  assert tree_util.keystr((tree_util.DictKey("a"), tree_util.SequenceKey(0))) == (
      "['a'][0]")
  assert tree_util.keystr((tree_util.GetAttrKey("x"),
                           tree_util.FlattenedIndexKey(2))) == (
                               ".x[<flat index 2>]")
  assert tree_util.keystr((tree_util.DictKey("a"), tree_util.SequenceKey(0)),
                          simple=True, separator="/") == "a/0"


def test_key_reprs_are_jaxs():
  assert repr(tree_util.DictKey("a")) == "DictKey(key='a')"
  assert repr(tree_util.SequenceKey(1)) == "SequenceKey(idx=1)"
  assert repr(tree_util.GetAttrKey("x")) == "GetAttrKey(name='x')"
  assert repr(tree_util.FlattenedIndexKey(0)) == "FlattenedIndexKey(key=0)"


def test_flatten_with_path_of_the_documented_tree():
  tree = [1, {"k1": 2, "k2": (3, 4)}, ATuple("foo")]
  assert [f"Value of tree{path}: {value}" for path, value in paths_of(tree)] == [
      "Value of tree[0]: 1",
      "Value of tree[1]['k1']: 2",
      "Value of tree[1]['k2'][0]: 3",
      "Value of tree[1]['k2'][1]: 4",
      "Value of tree[2].name: foo",
  ]


def test_flatten_with_path_gives_key_objects_and_the_structure():
  pairs, treedef = tree_util.tree_flatten_with_path({"a": [1, Point(2, 3)]})
  assert pairs == [
      ((tree_util.DictKey("a"), tree_util.SequenceKey(0)), 1),
      ((tree_util.DictKey("a"), tree_util.SequenceKey(1),
        tree_util.GetAttrKey("x")), 2),
      ((tree_util.DictKey("a"), tree_util.SequenceKey(1),
        tree_util.GetAttrKey("y")), 3),
  ]
  assert treedef == tree_util.tree_structure({"a": [0, Point(0, 0)]})


def test_map_with_path_passes_each_leafs_path_first():
  out = tree_util.tree_map_with_path(
      lambda path, x, y: f"{tree_util.keystr(path)}:{x + y}",
      {"a": (1, 2)}, {"a": (10, 20)})
  assert out == {"a": ("['a'][0]:11", "['a'][1]:22")}


# --- custom nodes ------------------------------------------------------------


def test_register_pytree_node_with_the_documented_container():
  tree = [MyContainer("Alice", 1, 2, 3), MyContainer("Bob", 4, 5, 6)]
  assert tree_util.tree_leaves(tree) == [1, 2, 3, 4, 5, 6]
  out = tree_util.tree_map(lambda x: x + 1, tree)
  assert [(c.name, c.a, c.b, c.c) for c in out] == [("Alice", 2, 3, 4),
                                                     ("Bob", 5, 6, 7)]
  assert [path for path, _ in paths_of(tree)][:2] == [
      "[0][<flat index 0>]", "[0][<flat index 1>]"]


def test_aux_data_is_part_of_the_structure():
  assert (tree_util.tree_structure(MyContainer("Alice", 1, 2, 3)) !=
          tree_util.tree_structure(MyContainer("Bob", 1, 2, 3)))
  assert (tree_util.tree_structure(Scaled(1, 2)) ==
          tree_util.tree_structure(Scaled(5, 2)))


def test_register_pytree_node_with_keys_names_the_children():
  assert paths_of(Named(1, [2])) == [(".first", 1), (".second[0]", 2)]


def test_register_pytree_node_class_uses_its_methods():
  out = tree_util.tree_map(lambda v: v + 1, Scaled(1, scale=10))
  assert (type(out), out.value, out.scale) == (Scaled, 2, 10)


def test_register_dataclass_with_data_and_meta_fields():
  leaves, treedef = tree_util.tree_flatten(Struct(x=1, y=2, op="add"))
  assert leaves == [1, 2]
  assert tree_util.tree_unflatten(treedef, [3, 4]) == Struct(3, 4, "add")
  assert treedef != tree_util.tree_structure(Struct(x=1, y=2, op="mul"))
  assert paths_of(Struct(x=1, y=2, op="add")) == [(".x", 1), (".y", 2)]


def test_register_dataclass_takes_static_fields_as_meta():
  assert tree_util.tree_leaves(Layer(w=1.0, b=2.0, act="tanh")) == [1.0, 2.0]
  assert tree_util.tree_map(lambda v: v * 2, Layer(1.0, 2.0)) == Layer(2.0, 4.0)


def test_register_dataclass_drop_fields_leaves_out_init_false_fields():
  @dataclasses.dataclass
  class WithCache:
    x: object
    cache: object = dataclasses.field(default=None, init=False)
  tree_util.register_dataclass(WithCache, ["x"], [], drop_fields=["cache"])
  assert tree_util.tree_leaves(WithCache(3)) == [3]


def test_registered_nodes_are_tfspmds_only():
  # Another optree user (Keras, for one) still sees a leaf.
  node = MyContainer("Alice", 1, 2, 3)
  assert optree.tree_leaves(node) == [node]


def test_tensors_and_sharded_arrays_are_leaves():
  sharded = tfspmd.pmap(lambda x: x)(np.arange(8.0))
  tensor = tf.constant([1.0, 2.0])
  leaves = tree_util.tree_leaves({"s": sharded, "t": tensor})
  assert leaves[0] is sharded and leaves[1] is tensor


def test_tree_module_has_jaxs_short_names():
  assert tfspmd.tree.map(lambda x: x + 1, {"a": 1, "b": (2, 3)}) == {
      "a": 2, "b": (3, 4)}
  leaves, treedef = tfspmd.tree.flatten([1, (2, 3)])
  assert tfspmd.tree.unflatten(treedef, leaves) == [1, (2, 3)]
  assert tfspmd.tree.leaves({"b": 1, "a": 2}) == [2, 1]
  assert tfspmd.tree.structure((1, 2)).num_leaves == 2
  assert tfspmd.tree.reduce(operator.mul, [2, (3, 4)]) == 24
  assert tfspmd.tree.all((True, [True]))
  assert tfspmd.tree.map_with_path(
      lambda p, x: tree_util.keystr(p), [0, {"k": 0}]) == ["[0]", {"k": "[1]['k']"}]
  assert [tree_util.keystr(p) for p, _ in
          tfspmd.tree.flatten_with_path({"a": [1]})[0]] == ["['a'][0]"]


# --- errors ------------------------------------------------------------------


def test_tree_map_names_both_structures_when_they_differ():
  with pytest.raises(ValueError) as raised:
    tree_util.tree_map(lambda x, y: x, {"a": 1, "b": 2}, {"a": 1, "c": 2})
  assert str(raised.value).startswith(
      "tree_map: rest[0] does not have the structure of tree: tree is "
      "{'a': *, 'b': *}, rest[0] is {'a': *, 'c': *} (")


def test_tree_map_names_a_list_given_for_a_tuple():
  with pytest.raises(ValueError, match=r"tree is \(\*, \*\), rest\[1\] is "
                     r"\[\*, \*\]"):
    tree_util.tree_map(lambda *xs: xs, (1, 2), (3, 4), [5, 6])


def test_dict_keys_that_cannot_be_sorted_are_an_error():
  with pytest.raises(TypeError, match=r"dict at \['d'\] has keys that cannot "
                     r"be sorted \(\[1, 'a'\]\)"):
    tree_util.tree_leaves({"d": {1: 0, "a": 0}})


# --- custom nodes and dict kinds in pmap, vmap and shard_map ------------------


def test_pmap_over_a_registered_class_argument_and_result():
  x = np.arange(8.0, dtype=np.float32)
  out = tfspmd.pmap(lambda c: MyContainer(c.name, c.a + 1, c.b * 2, c.c))(
      MyContainer("Alice", x, x, x))
  assert type(out) is MyContainer and out.name == "Alice"
  np.testing.assert_array_equal(out.a, x + 1)
  np.testing.assert_array_equal(out.b, x * 2)


def test_pmap_in_axes_as_a_registered_class_prefix():
  x = np.arange(8.0, dtype=np.float32)
  out = tfspmd.pmap(lambda s: s.value * s.scale, in_axes=(Scaled(0, 3.0),))(
      Scaled(x, 3.0))
  np.testing.assert_array_equal(out, x * 3)


def test_pmap_ordered_dict_argument_comes_back_in_the_same_order():
  x = np.arange(8.0, dtype=np.float32)
  state = collections.OrderedDict([("z", x), ("a", x + 1), ("m", x + 2)])
  out = tfspmd.pmap(lambda s: collections.OrderedDict(
      (k, v * 2) for k, v in s.items()))(state)
  assert type(out) is collections.OrderedDict
  assert list(out) == ["z", "a", "m"]
  np.testing.assert_array_equal(out["a"], (x + 1) * 2)


def test_pmap_error_names_a_dataclass_field_path():
  with pytest.raises(ValueError, match=r"args\[0\]\.b of shape \(3,\)"):
    tfspmd.pmap(lambda layer: layer.w)(Layer(np.zeros(4), np.zeros(3)))


def test_vmap_over_a_dataclass():
  w = np.arange(6.0, dtype=np.float32).reshape(3, 2)
  b = np.array([1.0, 2.0, 3.0], np.float32)
  out = tfspmd.vmap(lambda layer: Layer(tf.reduce_sum(layer.w) + layer.b,
                                        layer.b, layer.act))(
                                            Layer(w, b, "tanh"))
  assert type(out) is Layer and out.act == "tanh"
  np.testing.assert_array_equal(out.w, [2.0, 7.0, 12.0])


def test_shard_map_over_a_registered_class():
  mesh = tfspmd.make_mesh((8,), ("data",))
  x = np.arange(16.0, dtype=np.float32)
  out = tfspmd.shard_map(
      lambda s: Scaled(s.value * s.scale, s.scale), mesh=mesh,
      in_specs=(tfspmd.P("data"),), out_specs=tfspmd.P("data"))(Scaled(x, 2.0))
  assert type(out) is Scaled and out.scale == 2.0
  np.testing.assert_array_equal(out.value, x * 2)


def test_a_tf_modules_list_and_dict_are_containers_as_in_tf_nest():
  module = tf.Module()
  module.weights = [np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)]
  module.state = {"b": np.full((8, 1), 2., np.float32),
                  "a": np.ones((8, 3), np.float32)}
  assert type(module.weights) is not list and type(module.state) is not dict
  assert tree_util.tree_leaves(module.state)[0].shape == (8, 3)  # sorted keys
  plus_one = tfspmd.pmap(lambda t: tree_util.tree_map(lambda v: v + 1., t))
  weights = plus_one(module.weights)
  assert type(weights) is list
  np.testing.assert_array_equal(weights[0], np.full((8, 2), 2.))
  np.testing.assert_array_equal(weights[1], np.ones((8, 1)))
  state = plus_one(module.state)
  assert type(state) is dict and sorted(state) == ["a", "b"]
  np.testing.assert_array_equal(state["b"], np.full((8, 1), 3.))
  assert [tree_util.keystr(path) for path, _ in
          tree_util.tree_flatten_with_path(module.state)[0]] == ["['a']",
                                                                 "['b']"]


def test_a_keras_layers_tracked_list_is_a_container():
  keras = pytest.importorskip("keras")
  from keras.src.utils import tracking  # pylint: disable=g-import-not-at-top
  tracked = tracking.TrackedList([np.ones((8, 2), np.float32)])
  tracked_dict = tracking.TrackedDict({"w": np.ones((8, 1), np.float32)})
  del keras
  doubled = tfspmd.pmap(lambda t: tree_util.tree_map(lambda v: v * 2., t))
  np.testing.assert_array_equal(doubled(tracked)[0], np.full((8, 2), 2.))
  np.testing.assert_array_equal(doubled(tracked_dict)["w"], np.full((8, 1), 2.))
