"""make_array_from_callback, _single_device_arrays, _process_local_data.

JAX's ways of building a global array block by block, checked against the
NumPy array they stand for, the indices JAX hands its callback, and the
sharding they give. Several processes: tests/test_multiprocess.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd import NamedSharding
from tfspmd import P

DATA = np.arange(32, dtype=np.float32).reshape(8, 4)


@pytest.fixture(name="mesh")
def fixture_mesh():
  return tfspmd.make_mesh((4, 2), ("x", "y"))


@pytest.mark.parametrize("spec", [P("x", "y"), P(("x", "y")), P(None, "y"),
                                  P()])
def test_a_callback_gives_each_device_its_block(mesh, spec):
  sharding = NamedSharding(mesh, spec)
  asked = []

  def block(index):
    asked.append(index)
    return DATA[index]

  x = tfspmd.make_array_from_callback(DATA.shape, sharding, block)
  np.testing.assert_array_equal(np.asarray(x), DATA)
  assert x.sharding == sharding
  # Once per device, with the index of its block, as JAX calls it.
  assert sorted(map(repr, asked)) == sorted(
      repr(shard.index) for shard in x.addressable_shards)
  expected = tfspmd.device_put(DATA, sharding)
  for got, want in zip(x.addressable_shards, expected.addressable_shards):
    assert got.device == want.device and got.index == want.index
    np.testing.assert_array_equal(got.data.numpy(), want.data.numpy())


def test_the_callbacks_indices_are_jaxs(mesh):
  indices = {}

  def block(index):
    indices[len(indices)] = index
    return DATA[index]

  tfspmd.make_array_from_callback(DATA.shape, NamedSharding(mesh, P("x", "y")),
                                  block)
  # Device k of the 4 x 2 mesh: rows 2 (k // 2) on, columns 2 (k % 2) on.
  assert indices == {k: (slice(2 * (k // 2), 2 * (k // 2) + 2),
                         slice(2 * (k % 2), 2 * (k % 2) + 2))
                     for k in range(8)}


def test_a_global_array_goes_into_a_shard_map_as_it_lies(mesh):
  x = tfspmd.make_array_from_callback(
      DATA.shape, NamedSharding(mesh, P("x", "y")), lambda i: DATA[i])
  summed = tfspmd.shard_map(lambda b: lax.psum(b, "y"), mesh=mesh,
                            in_specs=P("x", "y"), out_specs=P("x", None))(x)
  np.testing.assert_array_equal(np.asarray(summed),
                                DATA[:, :2] + DATA[:, 2:])


def test_single_device_arrays_make_the_array_with_no_copy(mesh):
  x = tfspmd.device_put(DATA, NamedSharding(mesh, P("x", "y")))
  shards = x.addressable_shards
  blocks = []
  for shard in reversed(shards):  # any order: each array's device says
    with tf.device(shard.data.device):
      blocks.append(shard.data + 1)
  y = tfspmd.make_array_from_single_device_arrays(DATA.shape, x.sharding,
                                                  blocks)
  np.testing.assert_array_equal(np.asarray(y), DATA + 1)
  assert y.sharding == x.sharding


def test_process_local_data_of_one_process_is_the_whole_array(mesh):
  sharding = NamedSharding(mesh, P("x"))
  x = tfspmd.make_array_from_process_local_data(sharding, DATA)
  np.testing.assert_array_equal(np.asarray(x), DATA)
  assert x.sharding == sharding and x.shape == DATA.shape
  same = tfspmd.make_array_from_process_local_data(sharding, DATA,
                                                   global_shape=(8, 4))
  np.testing.assert_array_equal(np.asarray(same), DATA)


def _single(mesh, arrays):
  return tfspmd.make_array_from_single_device_arrays(
      DATA.shape, NamedSharding(mesh, P("x", "y")), arrays)


def _blocks(mesh):
  x = tfspmd.device_put(DATA, NamedSharding(mesh, P("x", "y")))
  return [shard.data for shard in x.addressable_shards]


@pytest.mark.parametrize("call, error, words", [
    (lambda mesh: tfspmd.make_array_from_callback(
        DATA.shape, P("x"), lambda i: DATA[i]), TypeError,
     "`sharding` must be a tfspmd.NamedSharding(mesh, spec), got "
     "PartitionSpec"),
    (lambda mesh: tfspmd.make_array_from_callback(
        DATA.shape, NamedSharding(mesh, P("x")), lambda i: DATA), ValueError,
     "data_callback returned an array of shape (8, 4) for the index "
     "(slice(0, 2, None), slice(None, None, None)), whose block has shape "
     "(2, 4)"),
    (lambda mesh: tfspmd.make_array_from_callback(
        (8, 4.5), NamedSharding(mesh, P("x")), lambda i: DATA[i]), TypeError,
     "`shape` must be a sequence of non-negative ints"),
    (lambda mesh: tfspmd.make_array_from_callback(
        (6, 4), NamedSharding(mesh, P("x")), lambda i: DATA[i]), ValueError,
     "splits dimension 0 4 ways, which does not evenly divide its size 6"),
    (lambda mesh: _single(mesh, _blocks(mesh)[:7]), ValueError,
     "no array lies on /job:localhost/replica:0/task:0/device:CPU:7"),
    (lambda mesh: _single(mesh, [np.zeros((2, 2))] * 8), TypeError,
     "arrays[0] must be a tf.Tensor on one device"),
    (lambda mesh: _single(mesh, _blocks(mesh)[:7] + _blocks(mesh)[:1]),
     ValueError, "two arrays lie on /job:localhost/replica:0/task:0/device:"
     "CPU:0"),
    (lambda mesh: tfspmd.make_array_from_process_local_data(
        NamedSharding(mesh, P("x")), DATA, global_shape=(16, 4)), ValueError,
     "local_data has shape (8, 4), but this process's part of an array of "
     "shape (16, 4)"),
])
def test_bad_arguments_name_what_was_expected(mesh, call, error, words):
  with pytest.raises(error) as raised:
    call(mesh)
  assert words in str(raised.value)
