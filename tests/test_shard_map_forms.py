"""shard_map's call forms and the mesh of a context, against NumPy.

JAX's `jax.shard_map(f, *, mesh, in_specs, out_specs, check_vma)`, the
older `jax.experimental.shard_map.shard_map(f, mesh, in_specs, out_specs,
check_rep, auto)`, the decorator forms, and a shard_map without a mesh
inside `tfspmd.set_mesh`. Their errors are in the catalogue
(tests/error_cases_shard_map.py, group "shard_map and meshes").
"""

import functools
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax


@pytest.fixture(name="mesh")
def fixture_mesh():
  return tfspmd.make_mesh((4, 2), ("x", "y"))


@pytest.fixture(autouse=True)
def no_mesh_left_set():
  yield
  tfspmd.set_mesh(None)


def row_sums_minus_mean(block):
  """Each block minus the mean over 'x' of its rows' sums over 'y'."""
  sums = lax.psum(block, "y")
  return sums - lax.pmean(sums, "x")


def expected_row_sums_minus_mean(x):
  """NumPy: x in 4 x 2 blocks, summed over the column blocks, centred."""
  blocks = x.reshape(4, 2, 2, 3).transpose(0, 2, 1, 3)  # (x, rows, y, cols)
  sums = blocks.sum(axis=2)                              # (x, rows, cols)
  return (sums - sums.mean(axis=0)).reshape(8, 3)


X = np.arange(48.).reshape(8, 6)


def test_positional_mesh_and_specs_as_the_older_shard_map(mesh):
  f = tfspmd.shard_map(row_sums_minus_mean, mesh, P("x", "y"), P("x", None))
  np.testing.assert_allclose(f(X), expected_row_sums_minus_mean(X))


def test_check_rep_positional_and_by_keyword(mesh):
  by_position = tfspmd.shard_map(lambda b: b * 2, mesh, P("x"), P("x"), True,
                                 frozenset())
  np.testing.assert_allclose(by_position(X), X * 2)
  by_keyword = tfspmd.shard_map(lambda b: b * 2, mesh, P("x"), P("x"),
                                check_rep=True)
  np.testing.assert_allclose(by_keyword(X), X * 2)


def plus_ten_times_y_index(block):
  """Varies along 'y': position k there adds 10 k."""
  return block + 10. * tf.cast(lax.axis_index("y"), block.dtype)


def test_check_rep_false_keeps_the_first_block_as_check_vma_false(mesh):
  rep = tfspmd.shard_map(plus_ten_times_y_index, mesh, P("x"), P("x"),
                         check_rep=False)
  vma = tfspmd.shard_map(plus_ten_times_y_index, mesh=mesh, in_specs=P("x"),
                         out_specs=P("x"), check_vma=False)
  # The block of position 0 along 'y', which adds 0.
  np.testing.assert_allclose(rep(X), X)
  np.testing.assert_allclose(vma(X), X)


def test_check_rep_true_checks_as_check_vma_true(mesh):
  with pytest.raises(ValueError, match="varies along the mesh axis 'y'"):
    tfspmd.shard_map(plus_ten_times_y_index, mesh, P("x"), P("x"),
                     check_rep=True)(X)


def test_keyword_form(mesh):
  f = tfspmd.shard_map(row_sums_minus_mean, mesh=mesh, in_specs=P("x", "y"),
                       out_specs=P("x", None))
  np.testing.assert_allclose(f(X), expected_row_sums_minus_mean(X))


def test_decorator_forms(mesh):
  @tfspmd.shard_map(mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", None))
  def called(block):
    return row_sums_minus_mean(block)

  @functools.partial(tfspmd.shard_map, mesh=mesh, in_specs=P("x", "y"),
                     out_specs=P("x", None))
  def partial(block):
    return row_sums_minus_mean(block)

  expected = expected_row_sums_minus_mean(X)
  np.testing.assert_allclose(called(X), expected)
  np.testing.assert_allclose(partial(X), expected)
  assert called.__name__ == "called"


def test_no_mesh_inside_set_mesh_uses_the_context_mesh(mesh):
  f = tfspmd.shard_map(row_sums_minus_mean, in_specs=P("x", "y"),
                       out_specs=P("x", None))
  with tfspmd.set_mesh(mesh):
    np.testing.assert_allclose(f(X), expected_row_sums_minus_mean(X))


def test_decorator_without_mesh_inside_set_mesh(mesh):
  @tfspmd.shard_map(in_specs=P("x"), out_specs=P())
  def total(block):
    return lax.psum(tf.reduce_sum(block), "x")

  with tfspmd.set_mesh(mesh):
    np.testing.assert_allclose(total(np.arange(8.)), np.arange(8.).sum())


def test_the_mesh_is_read_at_each_call(mesh):
  f = tfspmd.shard_map(lambda b: lax.psum(b, "i"), in_specs=P("i"),
                       out_specs=P())
  with tfspmd.set_mesh(tfspmd.make_mesh((8,), ("i",))):
    np.testing.assert_allclose(f(np.arange(8.)), [28.])
  with tfspmd.set_mesh(tfspmd.make_mesh((2,), ("i",))):
    np.testing.assert_allclose(f(np.arange(8.)),
                               np.arange(8.).reshape(2, 4).sum(0))


def test_a_given_mesh_is_used_inside_set_mesh_of_another(mesh):
  line = tfspmd.make_mesh((8,), ("i",))
  f = tfspmd.shard_map(lambda b: lax.psum(b, "i"), mesh=line,
                       in_specs=P("i"), out_specs=P())
  with tfspmd.set_mesh(mesh):
    np.testing.assert_allclose(f(np.arange(8.)), [28.])


def test_set_mesh_as_a_setter_and_with_none(mesh):
  assert tfspmd.sharding.get_mesh() is None
  tfspmd.set_mesh(mesh)
  assert tfspmd.sharding.get_mesh() == mesh
  f = tfspmd.shard_map(lambda b: b + 1, in_specs=P("x"), out_specs=P("x"))
  np.testing.assert_allclose(f(X), X + 1)
  tfspmd.set_mesh(None)
  assert tfspmd.sharding.get_mesh() is None


def test_set_mesh_restores_the_previous_mesh_after_the_block(mesh):
  line = tfspmd.make_mesh((8,), ("i",))
  with tfspmd.set_mesh(mesh):
    with tfspmd.sharding.set_mesh(line):
      assert tfspmd.sharding.get_mesh() == line
    assert tfspmd.sharding.get_mesh() == mesh
  assert tfspmd.sharding.get_mesh() is None


def test_set_mesh_restores_after_an_exception(mesh):
  with pytest.raises(RuntimeError):
    with tfspmd.set_mesh(mesh):
      raise RuntimeError("inside")
  assert tfspmd.sharding.get_mesh() is None


def test_set_mesh_is_per_thread(mesh):
  seen = []
  with tfspmd.set_mesh(mesh):
    thread = threading.Thread(
        target=lambda: seen.append(tfspmd.sharding.get_mesh()))
    thread.start()
    thread.join()
  assert seen == [None]


def test_a_mesh_as_a_context_manager_sets_the_context_mesh(mesh):
  # JAX's older `with Mesh(devices, names) as mesh:` form, nested, with
  # set_mesh and the same mesh entered twice.
  line = tfspmd.make_mesh((8,), ("x",))
  fun = tfspmd.shard_map(row_sums_minus_mean, in_specs=P("x", "y"),
                         out_specs=P("x", None))
  with mesh as entered:
    assert entered is mesh
    np.testing.assert_allclose(fun(X), expected_row_sums_minus_mean(X))
    with line:
      assert tfspmd.sharding.get_mesh() is line
      with mesh:
        assert tfspmd.sharding.get_mesh() is mesh
        with tfspmd.set_mesh(line):
          assert tfspmd.sharding.get_mesh() is line
        assert tfspmd.sharding.get_mesh() is mesh
      assert tfspmd.sharding.get_mesh() is line
    assert tfspmd.sharding.get_mesh() is mesh
  assert tfspmd.sharding.get_mesh() is None
  with pytest.raises(RuntimeError):
    with mesh:
      raise RuntimeError("inside")
  assert tfspmd.sharding.get_mesh() is None


def test_a_mesh_entered_in_one_thread_is_not_another_threads(mesh):
  seen = []
  with mesh:
    thread = threading.Thread(
        target=lambda: seen.append(tfspmd.sharding.get_mesh()))
    thread.start()
    thread.join()
  assert seen == [None]


def test_sharding_set_mesh_is_tfspmd_set_mesh():
  assert tfspmd.sharding.set_mesh is tfspmd.set_mesh


def test_axis_types_are_recorded_with_jaxs_defaults():
  auto, explicit = tfspmd.sharding.AxisType.Auto, tfspmd.sharding.AxisType.Explicit
  assert tfspmd.make_mesh((4, 2), ("x", "y")).axis_types == (explicit, explicit)
  devices = np.array(tfspmd.devices()).reshape(4, 2)
  assert tfspmd.Mesh(devices, ("x", "y")).axis_types == (auto, auto)
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"), (auto, explicit))
  assert mesh.axis_types == (auto, explicit)
  assert repr(auto) == "Auto"


def test_axis_types_change_nothing(mesh):
  auto = tfspmd.sharding.AxisType.Auto
  auto_mesh = tfspmd.make_mesh((4, 2), ("x", "y"), (auto, auto))
  f = tfspmd.shard_map(row_sums_minus_mean, mesh=auto_mesh,
                       in_specs=P("x", "y"), out_specs=P("x", None))
  np.testing.assert_allclose(f(X), expected_row_sums_minus_mean(X))


def test_a_list_of_axis_names_in_a_spec_splits_as_their_tuple(mesh):
  assert P(["x", "y"]) == P(("x", "y"))
  assert P(["x", "y"], None).axes_of(0) == ("x", "y")
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  f = tfspmd.shard_map(
      lambda block: block * 2. + tf.cast(
          lax.axis_index("x") * 10 + lax.axis_index("y"), tf.float32),
      mesh=mesh, in_specs=P(["x", "y"]), out_specs=P(["x", "y"]))
  # Row r is block r of 8: device (r // 2, r % 2) of the 4 x 2 mesh.
  rows = np.arange(8)[:, None]
  np.testing.assert_array_equal(
      np.asarray(f(x)), x * 2 + (rows // 2) * 10 + rows % 2)
