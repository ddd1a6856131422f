"""JAX's names, with JAX's signatures and the values JAX gives (jax 0.10.2)."""

import inspect
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import lax
from tfspmd._src.runtime import placement as placement_lib
from tfspmd.sharding import Mesh
from tfspmd.sharding import NamedSharding
from tfspmd.sharding import PartitionSpec as P
from tfspmd.sharding import SingleDeviceSharding

from child_process import run_python

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_host_packing(*args, **kwargs):
  raise AssertionError("a device-resident value was packed from the host")


# --- signatures -----------------------------------------------------------


@pytest.mark.parametrize("function, parameters", [
    (tfspmd.local_devices, ["process_index", "backend"]),
    (tfspmd.process_index, ["backend"]),
    (tfspmd.device_put, ["x", "device", "src", "donate", "may_alias"]),
    (tfspmd.device_get, ["x"]),
    (tfspmd.block_until_ready, ["x"]),
    (tfspmd.clear_caches, []),
    (tfspmd.device_put_sharded, ["shards", "devices"]),
    (tfspmd.device_put_replicated, ["x", "devices"]),
    (tfspmd.distributed.shutdown, []),
    (lax.scan, ["f", "init", "xs", "length", "reverse", "unroll"]),
    (lax.fori_loop, ["lower", "upper", "body_fun", "init_val", "unroll"]),
    (lax.while_loop, ["cond_fun", "body_fun", "init_val"]),
    (lax.cond, ["pred", "true_fun", "false_fun", "operands"]),
    (lax.switch, ["index", "branches", "operands"]),
    (lax.map, ["f", "xs", "batch_size"]),
])
def test_signatures_are_jaxs(function, parameters):
  assert list(inspect.signature(function).parameters) == parameters


@pytest.mark.parametrize("function", [tfspmd.grad, tfspmd.value_and_grad])
def test_grad_takes_jaxs_leading_parameters(function):
  # JAX's holomorphic, allow_int and reduce_axes follow; tfspmd takes
  # neither (docs/migrating_from_jax.md).
  parameters = inspect.signature(function).parameters
  assert list(parameters) == ["fun", "argnums", "has_aux"]
  assert parameters["argnums"].default == 0
  assert parameters["has_aux"].default is False


def test_initialize_takes_jaxs_parameters_in_jaxs_order():
  jax_order = ["coordinator_address", "num_processes", "process_id",
               "local_device_ids", "cluster_detection_method",
               "initialization_timeout", "heartbeat_timeout_seconds",
               "shutdown_timeout_seconds", "coordinator_bind_address",
               "slice_index", "partition_index"]
  parameters = inspect.signature(tfspmd.distributed.initialize).parameters
  assert list(parameters)[:len(jax_order)] == jax_order
  assert parameters["initialization_timeout"].default == 300
  assert parameters["heartbeat_timeout_seconds"].default == 100
  # None: the initialization timeout (JAX: 300 s), so that a process whose
  # peers failed exits about when it would fail to join.
  assert parameters["shutdown_timeout_seconds"].default is None


def test_vmap_takes_spmd_axis_name():
  assert "spmd_axis_name" in inspect.signature(tfspmd.vmap).parameters


# --- tfspmd.sharding -------------------------------------------------------


def test_named_sharding_has_mesh_spec_equality_and_hash():
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  s = NamedSharding(mesh, P("x"))
  assert s.mesh is mesh and s.spec == P("x")
  assert s == NamedSharding(mesh, P("x"))
  assert hash(s) == hash(NamedSharding(mesh, P("x")))
  # As in JAX, P('x') and P('x', None) are different specs of one layout.
  assert s != NamedSharding(mesh, P("x", None))
  assert s.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)
  assert s.device_set == set(tfspmd.devices()) and s.num_devices == 8
  assert repr(s) == ("NamedSharding(mesh=Mesh({'x': 4, 'y': 2}), "
                     "spec=PartitionSpec('x'))")


def test_sharding_module_names_jaxs_classes():
  assert Mesh is tfspmd.Mesh and P is tfspmd.PartitionSpec
  device = tfspmd.devices()[1]
  assert SingleDeviceSharding(device).device_set == {device}
  assert SingleDeviceSharding(device) == SingleDeviceSharding(device)


# --- device_put -------------------------------------------------------------


def test_device_put_named_sharding_splits_each_leaf_as_the_spec_says():
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  x = np.arange(16.).reshape(8, 2)
  out = tfspmd.device_put({"a": x, "b": x[:4]}, NamedSharding(mesh, P("x")))
  assert out["a"].sharding == NamedSharding(mesh, P("x"))
  assert dtensor.fetch_layout(out["a"].dtensor_value) == dtensor.Layout(
      ["x", dtensor.UNSHARDED], mesh.dtensor_mesh)
  np.testing.assert_array_equal(out["a"], x)
  np.testing.assert_array_equal(out["b"], x[:4])
  # Device 2 is at ('x' 1, 'y' 0): rows 2 and 3.
  np.testing.assert_array_equal(out["a"].addressable_shards[2].data,
                                x[2:4])


def test_device_put_of_a_sharded_array_relayouts_on_the_devices(monkeypatch):
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  x = np.arange(16.).reshape(8, 2)
  by_rows = tfspmd.device_put(x, NamedSharding(mesh, P("x")))
  monkeypatch.setattr(placement_lib, "pack_global_array", _no_host_packing)
  monkeypatch.setattr(placement_lib, "pack_host_array", _no_host_packing)
  by_columns = tfspmd.device_put(by_rows, NamedSharding(mesh, P(None, "y")))
  assert by_columns.sharding == NamedSharding(mesh, P(None, "y"))
  np.testing.assert_array_equal(by_columns, x)
  assert tfspmd.device_put(by_rows, by_rows.sharding) is by_rows


def test_device_put_result_goes_into_shard_map_as_it_is(monkeypatch,
                                                        dtensor_executor):
  # DTensor's executor moves blocks between layouts; the host's takes whole arrays.
  del dtensor_executor  # unused
  mesh = tfspmd.make_mesh((8,), ("x",))
  x = tfspmd.device_put(np.arange(16.), NamedSharding(mesh, P("x")))
  monkeypatch.setattr(placement_lib, "pack_global_array", _no_host_packing)
  monkeypatch.setattr(placement_lib, "pack_host_array", _no_host_packing)
  f = tfspmd.shard_map(lambda b: b - lax.pmean(b, "x"), mesh=mesh,
                       in_specs=P("x"), out_specs=P("x"))
  # Each device's block [2k, 2k + 1] less the mean of the blocks, [7, 8].
  np.testing.assert_allclose(f(x), np.arange(16.) - np.tile([7., 8.], 8))


def test_device_put_on_a_device_gives_a_tensor_there():
  device = tfspmd.devices()[3]
  out = tfspmd.device_put(np.arange(3), device)
  assert isinstance(out, tf.Tensor) and out.device == device.name
  np.testing.assert_array_equal(out, [0, 1, 2])
  split = tfspmd.pmap(lambda v: v * 2)(np.arange(8.))
  whole = tfspmd.device_put(split, SingleDeviceSharding(device))
  assert whole.device == device.name
  np.testing.assert_array_equal(whole, np.arange(8.) * 2)


def test_device_put_with_none_leaves_device_values_where_they_are():
  split = tfspmd.pmap(lambda v: v + 1)(np.arange(8.))
  tensor = tf.ones(2)
  out = tfspmd.device_put([split, tensor, 5.0])
  assert out[0] is split and out[1] is tensor
  assert out[2].device == tfspmd.devices()[0].name


def test_device_put_takes_a_tree_prefix_of_targets():
  mesh = tfspmd.make_mesh((8,), ("x",))
  device = tfspmd.devices()[1]
  out = tfspmd.device_put((np.zeros(8), np.ones(2)),
                          (NamedSharding(mesh, P("x")), device))
  assert out[0].sharding == NamedSharding(mesh, P("x"))
  assert out[1].device == device.name


def test_device_put_donate_deletes_a_moved_input():
  mesh = tfspmd.make_mesh((8,), ("x",))
  split = tfspmd.pmap(lambda v: v)(np.arange(8.))
  moved = tfspmd.device_put(split, NamedSharding(mesh, P()), donate=True)
  assert split.is_deleted()
  np.testing.assert_array_equal(moved, np.arange(8.))


def test_device_put_may_alias_false_copies():
  split = tfspmd.pmap(lambda v: v)(np.arange(8.))
  copied = tfspmd.device_put(split, split.sharding, may_alias=False)
  assert copied is not split
  np.testing.assert_array_equal(copied, np.arange(8.))


@pytest.mark.parametrize("spec", [P(("x", "y")), P(("y", "x"))], ids=str)
def test_a_dimension_over_two_axes_is_split_over_both(spec):
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  out = tfspmd.device_put(np.arange(8.), NamedSharding(mesh, spec))
  assert out.sharding == NamedSharding(mesh, spec)
  np.testing.assert_array_equal(out, np.arange(8.))
  # Block k of one element, k counted major-to-minor over the spec's axes.
  for (i, j), device in np.ndenumerate(mesh.devices):
    (shard,) = [s for s in out.addressable_shards if s.device == device]
    k = 2 * i + j if spec == P(("x", "y")) else 4 * j + i
    assert shard.index == (slice(k, k + 1),)
    np.testing.assert_array_equal(shard.data, [float(k)])
  assert tfspmd.device_put(out, NamedSharding(mesh, spec)) is out


# --- device_put_sharded / device_put_replicated -----------------------------


def test_device_put_sharded_stacks_as_a_pmap_takes_it(monkeypatch):
  devices = tfspmd.local_devices()[:4]
  shards = [{"w": np.full(3, k, np.float32)} for k in range(4)]
  stacked = tfspmd.device_put_sharded(shards, devices)
  np.testing.assert_array_equal(
      stacked["w"], np.repeat(np.arange(4.), 3).reshape(4, 3))
  assert tuple(s.device for s in stacked["w"].addressable_shards) == devices
  monkeypatch.setattr(placement_lib, "pack_host_array", _no_host_packing)
  out = tfspmd.pmap(lambda t: t["w"] + lax.psum(t["w"], "i"), "i",
                    devices=devices)(stacked)
  np.testing.assert_array_equal(out, np.repeat(np.arange(4.) + 6, 3)
                                .reshape(4, 3))


def test_device_put_replicated_gives_every_device_x():
  devices = tfspmd.local_devices()[:3]
  out = tfspmd.device_put_replicated(np.array([1, 2]), devices)
  np.testing.assert_array_equal(out, [[1, 2]] * 3)
  assert tuple(s.device for s in out.addressable_shards) == devices
  np.testing.assert_array_equal(
      tfspmd.pmap(lambda v: v * 10, devices=devices)(out), [[10, 20]] * 3)


# --- device_get / block_until_ready ------------------------------------------


def test_device_get_fetches_arrays_and_leaves_the_rest():
  split = tfspmd.pmap(lambda v: v * 2)(np.arange(4, dtype=np.int32))
  out = tfspmd.device_get([1, split, tf.ones(2), "a", np.ones(1)])
  assert out[0] == 1 and out[3] == "a"
  assert isinstance(out[1], np.ndarray) and isinstance(out[2], np.ndarray)
  np.testing.assert_array_equal(out[1], [0, 2, 4, 6])
  np.testing.assert_array_equal(out[2], [1., 1.])


def test_block_until_ready_returns_its_argument():
  split = tfspmd.pmap(lambda v: v + 1)(np.arange(8.))
  tree = {"a": split, "b": 1}
  assert tfspmd.block_until_ready(tree) is tree


# --- sharding of results ----------------------------------------------------


def test_a_pmap_result_names_its_mesh_axis_axis_0():
  out = tfspmd.pmap(lambda v: v)(np.zeros((4, 3)))
  assert out.sharding.spec == P("axis_0")
  assert out.sharding.mesh.shape == {"axis_0": 4}


def test_a_shard_map_result_names_the_mesh_it_ran_on():
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  f = tfspmd.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("x", "y"),
                       out_specs=P("x", "y"))
  assert f(np.zeros((8, 4))).sharding == NamedSharding(mesh, P("x", "y"))


# --- devices ----------------------------------------------------------------


def test_local_devices_of_a_process_index():
  assert tfspmd.local_devices(process_index=0) == tfspmd.local_devices()
  assert tfspmd.local_devices(0, "cpu") == tfspmd.local_devices()
  assert tfspmd.process_index(backend="cpu") == 0


# --- collectives of bools: JAX's dtypes --------------------------------------


@pytest.mark.parametrize("name, expected, dtype", [
    ("psum", [3, 3, 3, 3], tf.int32),
    ("pmax", [True] * 4, tf.bool),
    ("pmin", [False] * 4, tf.bool),
    ("pmean", [0.75] * 4, tf.float32),
])
def test_reductions_of_bools_as_jax(name, expected, dtype):
  reduce = getattr(lax, name)
  out = tfspmd.pmap(lambda b: reduce(b, "i"), "i")(
      np.array([True, False, True, True]))
  assert out.dtype == dtype
  np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("name, expected, dtype", [
    ("psum", [4, 4], tf.int32),
    ("pmax", [True, True], tf.bool),
    ("pmin", [True, True], tf.bool),
    ("pmean", [1., 1.], tf.float32),
])
def test_reductions_of_a_python_bool_as_jax(name, expected, dtype):
  reduce = getattr(lax, name)
  out = tfspmd.vmap(lambda v: reduce({"t": True}, "b")["t"], axis_name="b",
                    axis_size=4)(np.zeros(4))
  assert out.dtype == dtype
  np.testing.assert_array_equal(out[:2], expected)


def test_other_leaves_of_a_tree_keep_their_reduction():
  out = tfspmd.pmap(lambda v: lax.psum((v, v > 1), "i"), "i")(np.arange(4.))
  np.testing.assert_array_equal(out[0], [6.] * 4)
  np.testing.assert_array_equal(out[1], [2] * 4)


# --- vmap(spmd_axis_name=...) -----------------------------------------------


def test_vmap_spmd_axis_name_gives_jaxs_values():
  # jax.pmap(jax.vmap(f, axis_name='b', spmd_axis_name='i'), axis_name='i')
  f = tfspmd.pmap(tfspmd.vmap(lambda v: v * 2 + lax.psum(v, "b"),
                              axis_name="b", spmd_axis_name="i"),
                  axis_name="i")
  np.testing.assert_array_equal(
      f(np.arange(8.).reshape(4, 2)),
      [[1., 3.], [9., 11.], [17., 19.], [25., 27.]])


# --- JAX_ENABLE_X64 -----------------------------------------------------------


def _dtype_under(value):
  """The dtype a float64 NumPy input arrives as, with JAX_ENABLE_X64=value."""
  code = ("import numpy as np, tfspmd; "
          "print(tfspmd.config.jax_enable_x64, "
          "tfspmd.pmap(lambda x: x)(np.ones(2)).dtype.name)")
  done = run_python(code, devices=None, timeout=300, check=False, cwd=_ROOT,
                    JAX_ENABLE_X64=value, PYTHONPATH=_ROOT)
  return done.stdout.strip() or done.stderr.strip().splitlines()[-1]


def test_jax_enable_x64_in_the_environment_sets_x64_at_import():
  assert _dtype_under("0") == "False float32"
  assert _dtype_under("true") == "True float64"


def test_jax_enable_x64_is_tfspmds_x64_switch():
  tfspmd.config.update("jax_enable_x64", False)
  try:
    assert not tfspmd.config.tfspmd_enable_x64
    assert tfspmd.pmap(lambda x: x)(np.ones(2)).dtype == tf.float32
  finally:
    tfspmd.config.update("jax_enable_x64", True)


@pytest.mark.parametrize("spec", [P("x"), P(None, "y"), P("y", "x"),
                                  P(("x", "y")), P(("y", "x"), None), P()])
def test_devices_indices_map_gives_each_devices_block(spec):
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  sizes = {"x": 4, "y": 2}
  indices = NamedSharding(mesh, spec).devices_indices_map((8, 4))
  assert list(indices) == list(mesh.devices.flat)
  for (i, j), device in np.ndenumerate(mesh.devices):
    at = {"x": i, "y": j}
    want = []
    for dimension, size in enumerate((8, 4)):
      axes = spec[dimension] if dimension < len(spec) else None
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      block, count = 0, 1
      for name in axes:  # the first name major, as in JAX
        block, count = block * sizes[name] + at[name], count * sizes[name]
      length = size // count
      want.append(slice(None) if not axes else
                  slice(block * length, (block + 1) * length))
    assert indices[device] == tuple(want), (spec, device)
  # One process: every device is addressable.
  assert NamedSharding(mesh, spec).addressable_devices_indices_map(
      (8, 4)) == indices
  assert mesh.local_devices == list(mesh.devices.flat)


def test_devices_indices_map_refuses_a_shape_the_spec_does_not_divide():
  sharding = NamedSharding(tfspmd.make_mesh((4, 2), ("x", "y")), P("x"))
  with pytest.raises(ValueError, match="does not evenly divide its size 6"):
    sharding.devices_indices_map((6, 2))


def test_addressable_data_is_each_devices_block_and_checks_its_index():
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  out = tfspmd.device_put(x, NamedSharding(tfspmd.make_mesh((8,), ("x",)),
                                           P("x")))
  for k in range(8):
    np.testing.assert_array_equal(out.addressable_data(k), x[k:k + 1])
  with pytest.raises(IndexError, match=r"`index` must be an int in \[0, 8\)"):
    out.addressable_data(8)


def test_dynamic_slice_clamps_its_starts_as_jax():
  x = np.arange(30).reshape(5, 6)
  for starts in [(0, 0), (4, 5), (-2, 3), (2, -9), (2, 1)]:
    # A negative start counts from the end, then the slice moves to fit.
    clamped = [min(max(s + d if s < 0 else s, 0), d - z)
               for s, d, z in zip(starts, (5, 6), (2, 3))]
    np.testing.assert_array_equal(
        lax.dynamic_slice(tf.constant(x), starts, (2, 3)),
        x[clamped[0]:clamped[0] + 2, clamped[1]:clamped[1] + 3])
  # One start per device, from axis_index: device k's block at 2k.
  got = np.asarray(tfspmd.pmap(
      lambda v: lax.dynamic_slice_in_dim(v, 2 * lax.axis_index("i"), 2),
      "i", in_axes=None, axis_size=8)(np.arange(10)))
  np.testing.assert_array_equal(
      got, [np.arange(10)[min(2 * k, 8):min(2 * k, 8) + 2] for k in range(8)])


def test_dynamic_slice_checks_its_sizes_and_axis():
  x = tf.zeros((3, 4))
  with pytest.raises(ValueError, match="one entry per dimension"):
    lax.dynamic_slice(x, (0,), (1, 1))
  with pytest.raises(ValueError, match=r"`slice_sizes`\[1\]=5 must lie in"):
    lax.dynamic_slice(x, (0, 0), (1, 5))
  with pytest.raises(ValueError, match="`axis`=2 is out of range"):
    lax.dynamic_slice_in_dim(x, 0, 1, axis=2)
