"""Mistakes with tfspmd.tree_util.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import dataclasses

import tfspmd

from error_catalogue import case, PYTREES


@case("tree-map-structures", PYTREES,
      "tree_map over trees of different structures", ValueError,
      r"tree_map: rest\[0\] does not have the structure of tree: tree is "
      r"\{'a': \*, 'b': \*\}, rest\[0\] is \{'a': \*, 'c': \*\}")
def tree_map_structures():
  tfspmd.tree_util.tree_map(lambda x, y: x, {"a": 1, "b": 2}, {"a": 1, "c": 2})


@case("dataclass-one-field-list", PYTREES,
      "register_dataclass with data_fields but no meta_fields", TypeError,
      r"register_dataclass: give both data_fields and meta_fields or neither; "
      r"got data_fields=\['x'\], meta_fields=None")
def dataclass_one_field_list():
  tfspmd.tree_util.register_dataclass(
      dataclasses.make_dataclass("OneList", ["x"]), data_fields=["x"])


@case("dataclass-not-a-dataclass", PYTREES,
      "register_dataclass of a plain class without its fields", TypeError,
      r"register_dataclass: data_fields and meta_fields are needed when "
      r"nodetype is not a dataclass")
def dataclass_not_a_dataclass():
  tfspmd.tree_util.register_dataclass(type("Plain", (), {}))


@case("dataclass-fields-missing", PYTREES,
      "register_dataclass fields that leave out a dataclass field", ValueError,
      r"must name every field of Partial with init=True .*; missing \['y'\], "
      r"unexpected \[\]")
def dataclass_fields_missing():
  tfspmd.tree_util.register_dataclass(
      dataclasses.make_dataclass("Partial", ["x", "y"]), data_fields=["x"],
      meta_fields=[])


@case("dataclass-fields-overlap", PYTREES,
      "register_dataclass naming a field as data and meta", ValueError,
      r"data_fields and meta_fields must not overlap; both name \['x'\]")
def dataclass_fields_overlap():
  tfspmd.tree_util.register_dataclass(type("Overlap", (), {}),
                                      data_fields=["x"], meta_fields=["x"])
