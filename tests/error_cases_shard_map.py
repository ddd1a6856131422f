"""Mistakes with shard_map and meshes.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import numpy as np
import tensorflow as tf

import tfspmd

from error_catalogue import case, P, SHARD_MAP


def _mesh():
  return tfspmd.make_mesh((2, 4), ("data", "model"))


@case("shard-map-indivisible", SHARD_MAP,
      "an input dimension not divisible by the mesh axes that split it",
      ValueError, r"dimension 0 of args\[0\] has size 3.*not divisible by 2")
def shard_map_indivisible():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P("data"),
                   out_specs=tfspmd.P("data"))(np.zeros(3))


@case("shard-map-in-specs-list", SHARD_MAP,
      "in_specs=[P('data'), P('data')], a list, for two arguments", ValueError,
      r"shard_map: in_specs is a list, \[PartitionSpec\('data'\), "
      r"PartitionSpec\('data'\)\]; .*write in_specs=\(PartitionSpec\('data'\), "
      r"PartitionSpec\('data'\)\)")
def shard_map_in_specs_list():
  tfspmd.shard_map(lambda a, b: a + b, mesh=_mesh(),
                   in_specs=[tfspmd.P("data"), tfspmd.P("data")],
                   out_specs=tfspmd.P("data"))(np.zeros(2), np.zeros(2))


@case("shard-map-unknown-axis", SHARD_MAP,
      "a partition spec naming an axis the mesh does not have", ValueError,
      r"args\[0\] names the axis 'rows', which is not an axis of the mesh")
def shard_map_unknown_axis():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P("rows"),
                   out_specs=tfspmd.P())(np.zeros(4))


@case("shard-map-spec-too-long", SHARD_MAP,
      "a partition spec longer than the value's rank", ValueError,
      r"in spec PartitionSpec\('data', None\) for args\[0\] has 2 entries, "
      r"but the value has rank 1")
def shard_map_spec_too_long():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P("data", None),
                   out_specs=tfspmd.P())(np.zeros(4))


@case("shard-map-axis-twice", SHARD_MAP,
      "the same mesh axis twice in one partition spec", ValueError,
      r"args\[0\] names the mesh axis 'data' twice")
def shard_map_axis_twice():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(),
                   in_specs=tfspmd.P("data", "data"),
                   out_specs=tfspmd.P())(np.zeros((4, 4)))


@case("shard-map-out-spec-too-long", SHARD_MAP,
      "an out spec longer than the output's rank", ValueError,
      r"out spec PartitionSpec\('data', None\) for output has 2 entries")
def shard_map_out_spec_too_long():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P(),
                   out_specs=tfspmd.P("data", None))(np.zeros(4))


@case("shard-map-varying-output", SHARD_MAP,
      "an output that varies along a mesh axis its out spec leaves out",
      ValueError, r"shard_map: output varies along the mesh axis 'model', "
      r"which its out spec does not name")
def shard_map_varying_output():
  tfspmd.shard_map(
      lambda b: b + tf.cast(tfspmd.lax.axis_index("model"), tf.float64),
      mesh=_mesh(), in_specs=tfspmd.P("data"),
      out_specs=tfspmd.P("data"))(np.zeros(4))


@case("shard-map-inside-pmap", SHARD_MAP, "a shard_map inside a pmap",
      ValueError, r"shard_map inside a pmap or vmap is not supported")
def shard_map_inside_pmap():
  mesh = _mesh()
  P(lambda v: tfspmd.shard_map(lambda b: b, mesh=mesh, in_specs=tfspmd.P(),
                               out_specs=tfspmd.P())(v))(np.zeros(8))


@case("shard-map-not-a-mesh", SHARD_MAP, "a mesh that is not a tfspmd.Mesh",
      TypeError, r"`mesh` must be a tfspmd.Mesh")
def shard_map_not_a_mesh():
  tfspmd.shard_map(lambda b: b, mesh="mesh", in_specs=tfspmd.P(),
                   out_specs=tfspmd.P())


@case("shard-map-no-mesh", SHARD_MAP,
      "a shard_map without a mesh called where tfspmd.set_mesh set none",
      ValueError, r"shard_map: no `mesh` was given and none is set: pass "
      r"mesh=\.\.\., or call the function inside `with tfspmd.set_mesh")
def shard_map_no_mesh():
  tfspmd.shard_map(lambda b: b, in_specs=tfspmd.P(),
                   out_specs=tfspmd.P())(np.zeros(4))


@case("shard-map-missing-specs", SHARD_MAP, "a shard_map without out_specs",
      TypeError, r"shard_map: `out_specs` is missing: give a tfspmd.P per "
      r"output")
def shard_map_missing_specs():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P())


@case("shard-map-check-rep-and-check-vma", SHARD_MAP,
      "both check_rep and its newer name check_vma", TypeError,
      r"shard_map: give `check_vma` or its older name `check_rep`, not both")
def shard_map_check_rep_and_check_vma():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P(), tfspmd.P(),
                   check_rep=True, check_vma=True)


@case("shard-map-check-rep-not-bool", SHARD_MAP,
      "a check_rep that is not True or False", TypeError,
      r"shard_map: `check_rep` must be True or False, got 'yes'")
def shard_map_check_rep_not_bool():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P(), tfspmd.P(),
                   check_rep="yes")


@case("shard-map-auto", SHARD_MAP,
      "mesh axes left automatic (the older shard_map's `auto`)", ValueError,
      r"shard_map: `auto` must be empty, got \{'model'\}")
def shard_map_auto():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P("data"), tfspmd.P("data"),
                   auto=frozenset({"model"}))


@case("set-mesh-not-a-mesh", SHARD_MAP,
      "tfspmd.set_mesh of something that is not a tfspmd.Mesh", TypeError,
      r"set_mesh: `mesh` must be a tfspmd.Mesh \(tfspmd.make_mesh\(\.\.\.\)\) "
      r"or None, got str")
def set_mesh_not_a_mesh():
  tfspmd.set_mesh("mesh")


@case("make-mesh-axis-types", SHARD_MAP,
      "mesh axis types that are not one AxisType per axis", ValueError,
      r"make_mesh: `axis_types` must hold one tfspmd.sharding.AxisType per "
      r"axis name \('data', 'model'\), got \(Auto,\)")
def make_mesh_axis_types():
  tfspmd.make_mesh((2, 4), ("data", "model"),
                   (tfspmd.sharding.AxisType.Auto,))


@case("make-mesh-too-big", SHARD_MAP, "a mesh bigger than the devices there are",
      ValueError, r"a mesh of shape \(4, 4\) needs 16 devices, only 8 are "
      r"available. On CPU, split it into 16 logical devices before "
      r"TensorFlow starts: set TFSPMD_NUM_CPU_DEVICES=16")
def make_mesh_too_big():
  tfspmd.make_mesh((4, 4), ("a", "b"))


@case("mesh-dtensor-mesh-axis-name", SHARD_MAP,
      "the DTensor mesh of a mesh whose axis name DTensor cannot take",
      ValueError, r"Mesh.dtensor_mesh: the axis name 'a b' cannot name a "
      r"DTensor mesh dimension: DTensor takes only letters, digits")
def mesh_dtensor_mesh_axis_name():
  return tfspmd.make_mesh((2, 4), ("a b", "model")).dtensor_mesh
