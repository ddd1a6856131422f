"""`tfspmd.experimental`: JAX's `jax.experimental` names for many devices.

mesh_utils' arrays are checked against the layouts JAX's documentation
gives (a block of devices per process, the blocks in order along each
axis), with devices of several processes made up where one process has
only its own.
"""

import numpy as np
import pytest

import tfspmd
from tfspmd import P
from tfspmd._src.runtime.devices import Device
from tfspmd.experimental import mesh_utils
from tfspmd.experimental import multihost_utils
from tfspmd.experimental import shard_map as shard_map_module


def processes_of(devices_per_process, count):
  """Made-up CPU devices of `count` processes, ids in process order."""
  return [Device(id=p * devices_per_process + k, platform="cpu",
                 process_index=p, local_id=k,
                 name=f"/job:worker/replica:0/task:{p}/device:CPU:{k}")
          for p in range(count) for k in range(devices_per_process)]


def ids(grid):
  return np.vectorize(lambda device: device.id)(grid).tolist()


def test_create_device_mesh_lays_out_the_devices_in_order():
  grid = mesh_utils.create_device_mesh((2, 4))
  assert ids(grid) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  mesh = tfspmd.Mesh(grid, ("data", "model"))
  f = tfspmd.shard_map(lambda b: b + 1, mesh=mesh, in_specs=P("data", "model"),
                       out_specs=P("data", "model"))
  x = np.arange(16.).reshape(4, 4)
  np.testing.assert_array_equal(np.asarray(f(x)), x + 1)
  devices = tfspmd.devices()[::-1]
  assert ids(mesh_utils.create_device_mesh((4, 2), devices)) == [
      [7, 6], [5, 4], [3, 2], [1, 0]]


def test_a_hybrid_mesh_puts_each_process_in_a_block():
  devices = processes_of(4, 2)
  # Processes along the first axis: each row is one process's devices.
  assert ids(mesh_utils.create_hybrid_device_mesh((1, 4), (2, 1),
                                                  devices)) == [
      [0, 1, 2, 3], [4, 5, 6, 7]]
  # Along the second: each process a 2 x 2 block, side by side.
  assert ids(mesh_utils.create_hybrid_device_mesh((2, 2), (1, 2),
                                                  devices)) == [
      [0, 1, 4, 5], [2, 3, 6, 7]]
  # Processes in the order their devices come, unsorted.
  shuffled = devices[4:] + devices[:4]
  assert ids(mesh_utils.create_hybrid_device_mesh(
      (1, 4), (2, 1), shuffled, should_sort_granules_by_key=False)) == [
          [4, 5, 6, 7], [0, 1, 2, 3]]
  assert ids(mesh_utils.create_hybrid_device_mesh((2, 4), (1, 1))) == [
      [0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("call, error, words", [
    (lambda: mesh_utils.create_device_mesh((3, 2)), ValueError,
     "a mesh of shape (3, 2) holds 6 devices, but 8 were given"),
    (lambda: mesh_utils.create_device_mesh((2, 4.0)), TypeError,
     "`mesh_shape` must be a sequence of positive ints"),
    (lambda: mesh_utils.create_device_mesh((8,), ["cpu:0"] * 8), TypeError,
     "`devices` must be tfspmd devices"),
    (lambda: mesh_utils.create_device_mesh(
        (8,), contiguous_submeshes="yes"), TypeError,
     "`contiguous_submeshes` must be a bool"),
    (lambda: mesh_utils.create_hybrid_device_mesh((2, 4), (2, 1)),
     ValueError, "lays out 2 processes, but the devices belong to 1"),
    (lambda: mesh_utils.create_hybrid_device_mesh((8,), (1, 1)), ValueError,
     "must have one size per mesh axis each"),
    (lambda: mesh_utils.create_hybrid_device_mesh(
        (1, 4), (2, 1), processes_of(4, 2)[:7]), ValueError,
     "process 1 holds 3 of the devices, but a block of `mesh_shape` (1, 4) "
     "holds 4"),
])
def test_bad_arguments_name_what_was_expected(call, error, words):
  with pytest.raises(error) as raised:
    call()
  assert words in str(raised.value)


def test_the_experimental_shard_map_is_shard_map_in_its_older_form():
  assert shard_map_module.shard_map is tfspmd.shard_map
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  f = shard_map_module.shard_map(lambda b: tfspmd.lax.psum(b, "y"), mesh,
                                 in_specs=P("x", "y"), out_specs=P("x", None),
                                 check_rep=True)
  x = np.arange(32.).reshape(8, 4)
  np.testing.assert_array_equal(
      np.asarray(f(x)), x.reshape(8, 2, 2).sum(1))


# --- multihost_utils with one process (several: test_multiprocess.py) -------


def test_process_allgather_of_one_process_stacks_or_tiles():
  tree = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "flag": True,
          "wide": np.float64(2.5)}
  gathered = multihost_utils.process_allgather(tree)
  np.testing.assert_array_equal(gathered["a"], tree["a"][None])
  np.testing.assert_array_equal(gathered["flag"], [True])
  assert gathered["wide"].dtype == np.float64 and gathered["wide"] == [2.5]
  np.testing.assert_array_equal(
      multihost_utils.process_allgather(tree["a"], tiled=True), tree["a"])
  placed = tfspmd.device_put(np.arange(8.), tfspmd.NamedSharding(
      tfspmd.make_mesh((8,), ("i",)), P("i")))
  np.testing.assert_array_equal(multihost_utils.process_allgather(placed),
                                np.arange(8.)[None])


def test_broadcast_one_to_all_and_sync_of_one_process():
  out = multihost_utils.broadcast_one_to_all({"step": np.int32(7),
                                              "w": np.ones(3)})
  assert out["step"] == 7 and out["step"].dtype == np.int32
  np.testing.assert_array_equal(out["w"], np.ones(3))
  assert multihost_utils.sync_global_devices("saved") is None


def test_host_local_and_global_arrays_of_one_process_are_the_same_array():
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  local = {"rows": np.arange(16.).reshape(8, 2), "step": np.int32(3)}
  global_tree = multihost_utils.host_local_array_to_global_array(
      local, mesh, {"rows": P("x", "y"), "step": None})
  assert global_tree["rows"].sharding == tfspmd.NamedSharding(mesh,
                                                              P("x", "y"))
  back = multihost_utils.global_array_to_host_local_array(
      global_tree, mesh, {"rows": P("x", "y"), "step": P()})
  np.testing.assert_array_equal(np.asarray(back["rows"]), local["rows"])
  assert int(back["step"]) == 3


@pytest.mark.parametrize("call, error, words", [
    (lambda: multihost_utils.process_allgather(np.float32(1), tiled=True),
     ValueError, "in_tree is a scalar, which tiled=True cannot concatenate"),
    (lambda: multihost_utils.process_allgather(["text"]), TypeError,
     "in_tree[0] is str of dtype <U4; give arrays of numbers or bools"),
    (lambda: multihost_utils.broadcast_one_to_all(1.0, is_source=False),
     ValueError, "no process has is_source=True"),
    (lambda: multihost_utils.sync_global_devices(3), TypeError,
     "`name` must be a str"),
    (lambda: multihost_utils.host_local_array_to_global_array(
        np.ones(8), "mesh", P("x")), TypeError,
     "`global_mesh` must be a tfspmd.Mesh"),
])
def test_multihost_utils_name_bad_arguments(call, error, words):
  with pytest.raises(error) as raised:
    call()
  assert words in str(raised.value)
