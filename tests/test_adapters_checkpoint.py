"""tfspmd.adapters.checkpoint: pmap training state through tf.train.Checkpoint.

A run resumed from a checkpoint must continue with bit-identical numbers to
the run that was never interrupted. A state restored onto other devices
keeps its global values, split over them as `like` is; whatever cannot keep
them (another global shape, dtype or set of leaves) is an error naming the
leaf, never a silent drop or swap.
"""

import collections
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfspmd
from tfspmd import lax
from tfspmd.adapters import checkpoint
from tfspmd.adapters import keras_training


def per_device_step():
  # w is replicated, s is one row per device: both must survive a restart.
  def step(w, s, x):
    w = w - 0.1 * lax.pmean(tf.reduce_sum(s * x, 0), "i")
    return w, s * 0.5 + tf.sin(x * w)
  return tfspmd.pmap(step, "i", in_axes=(None, 0, 0), out_axes=(None, 0))


def inputs(t):
  return np.random.default_rng(t).standard_normal((8, 4, 3)).astype(np.float32)


def test_resumed_pmap_state_continues_bit_identically(tmp_path):
  step = per_device_step()
  w0 = np.ones(3, np.float32)
  s0 = np.arange(96, dtype=np.float32).reshape(8, 4, 3) / 96
  w, s = w0, s0
  for t in range(4):
    w, s = step(w, s, inputs(t))

  resumed_w, resumed_s = w0, s0
  for t in range(2):
    resumed_w, resumed_s = step(resumed_w, resumed_s, inputs(t))
  path = checkpoint.save(str(tmp_path / "ckpt"), (resumed_w, resumed_s))
  resumed_w, resumed_s = checkpoint.restore(path, like=(resumed_w, resumed_s))
  assert isinstance(resumed_s, tfspmd.ShardedArray)
  assert resumed_s.placement is s.placement
  for t in range(2, 4):
    resumed_w, resumed_s = step(resumed_w, resumed_s, inputs(t))

  np.testing.assert_array_equal(resumed_w, w)
  np.testing.assert_array_equal(resumed_s, s)


def test_replicated_leaves_are_stored_once_and_split_ones_per_device(tmp_path):
  w, s = per_device_step()(np.ones(3, np.float32),
                           np.ones((8, 4, 3), np.float32), inputs(0))
  path = checkpoint.save(str(tmp_path / "ckpt"), {"w": w, "s": s})
  stored = {name: shape for name, shape in tf.train.list_variables(path)
            if name.startswith("state/")}
  # Each leaf under its path: 's' as 8 blocks, 'w' as one copy.
  assert stored == {
      **{f"state/leaves/['s']/{d}/.ATTRIBUTES/VARIABLE_VALUE": [1, 4, 3]
         for d in range(8)},
      "state/leaves/['w']/0/.ATTRIBUTES/VARIABLE_VALUE": [3],
      "state/layout/.ATTRIBUTES/VARIABLE_VALUE": []}
  reader = tf.train.load_checkpoint(path)
  for d in range(8):
    np.testing.assert_array_equal(
        reader.get_tensor(f"state/leaves/['s']/{d}/.ATTRIBUTES/VARIABLE_VALUE"),
        np.asarray(s)[d:d + 1])
  layout = json.loads(
      reader.get_tensor("state/layout/.ATTRIBUTES/VARIABLE_VALUE"))
  assert layout == {"format": 2, "leaves": [
      {"path": "['s']", "shape": [8, 4, 3], "dtype": "float32",
       "split": [8, 1, 1], "devices": 8},
      {"path": "['w']", "shape": [3], "dtype": "float32", "split": [1],
       "devices": 8}]}


def test_host_leaves_and_trackables_are_saved_beside(tmp_path):
  epoch = tf.Variable(7)
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         {"lr": np.float32(0.5), "seen": np.arange(3)},
                         epoch=epoch)
  epoch.assign(0)
  state = checkpoint.restore(
      path, like={"lr": np.float32(0), "seen": np.zeros(3, np.int64)},
      epoch=epoch)
  assert int(epoch) == 7
  assert state["lr"] == 0.5
  np.testing.assert_array_equal(state["seen"], [0, 1, 2])


def test_restoring_into_another_structure_is_an_error(tmp_path):
  out = tfspmd.pmap(lambda x: x)(np.zeros((8, 2), np.float32))
  path = checkpoint.save(str(tmp_path / "ckpt"), [out])
  with pytest.raises(ValueError, match=r"the checkpoint has no value for "
                     r"like\[1\]\. The checkpoint holds state\[0\]"):
    checkpoint.restore(path, like=[out, out])


# --- other device counts: the global value, re-split --------------------------

DEVICES = tfspmd.devices()
X = np.arange(48, dtype=np.float32).reshape(16, 3)
W = np.array([0.5, -1.0, 2.0], np.float32)


def shard_map_on(devices, spec):
  """x + 1 by shard_map over a 1-D mesh of `devices`, in and out split by `spec`."""
  mesh = tfspmd.make_mesh((len(devices),), ("x",), devices=devices)
  return tfspmd.shard_map(lambda b: b + 1, mesh=mesh, in_specs=spec,
                          out_specs=spec)


def elastic_state(count):
  """A (16, 3) array split in `count` blocks of rows, and a replicated (3,)."""
  devices = DEVICES[:count]
  rows = shard_map_on(devices, tfspmd.P("x"))(X)
  w = tfspmd.pmap(lambda w: w * 2, in_axes=None, out_axes=None,
                  axis_size=count, devices=devices)(W)
  return {"rows": rows, "w": w}


def assert_blocks(array, expected_blocks, devices):
  """Device i of `devices` holds `expected_blocks[i]`, exactly."""
  shards = array.addressable_shards
  assert [shard.device for shard in shards] == list(devices)
  for shard, expected in zip(shards, expected_blocks):
    assert np.max(np.abs(shard.data.numpy() - expected)) == 0


@pytest.mark.parametrize("saved_count, restored_count",
                         [(8, 4), (4, 8), (8, 1)])
def test_state_restores_onto_another_device_count_with_its_global_values(
    tmp_path, saved_count, restored_count):
  path = checkpoint.save(str(tmp_path / "ckpt"), elastic_state(saved_count))
  like = elastic_state(restored_count)
  restored = checkpoint.restore(path, like=like)

  rows = X + 1                       # the saved global values, from NumPy
  w = W * 2
  per_block = 16 // restored_count   # rows of the (16, 3) array per device
  devices = DEVICES[:restored_count]
  assert restored["rows"].shape == (16, 3)
  assert restored["rows"].placement is like["rows"].placement
  assert_blocks(restored["rows"],
                [rows[d * per_block:(d + 1) * per_block]
                 for d in range(restored_count)], devices)
  assert restored["w"].placement is like["w"].placement
  assert_blocks(restored["w"], [w] * restored_count, devices)
  np.testing.assert_array_equal(np.asarray(restored["rows"]), rows)


def test_a_2d_split_restores_onto_a_1d_split_and_replicated(tmp_path):
  mesh = tfspmd.make_mesh((2, 4), ("data", "model"))
  x = np.arange(64, dtype=np.float32).reshape(16, 4)
  spec = tfspmd.P("model", "data")
  saved = tfspmd.shard_map(lambda b: b * 3, mesh=mesh, in_specs=spec,
                           out_specs=spec)(x)
  path = checkpoint.save(str(tmp_path / "ckpt"), saved)
  assert [shape for name, shape in tf.train.list_variables(path)
          if name.startswith("state/leaves/")] == [[4, 2]] * 8

  zeros = np.zeros((16, 4), np.float32)
  split = checkpoint.restore(
      path, like=shard_map_on(DEVICES[4:], tfspmd.P("x"))(zeros))
  assert_blocks(split, [x[4 * d:4 * (d + 1)] * 3 for d in range(4)],
                DEVICES[4:])
  replicated = checkpoint.restore(
      path, like=shard_map_on(DEVICES[:2], tfspmd.P())(zeros))
  assert_blocks(replicated, [x * 3] * 2, DEVICES[:2])


def test_host_and_device_leaves_restore_into_each_other(tmp_path):
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         {"host": X, "device": elastic_state(8)["rows"]})
  like = {"host": elastic_state(4)["rows"], "device": np.zeros((16, 3),
                                                               np.float32)}
  restored = checkpoint.restore(path, like=like)
  assert_blocks(restored["host"], [X[4 * d:4 * (d + 1)] for d in range(4)],
                DEVICES[:4])
  assert isinstance(restored["device"], np.ndarray)
  np.testing.assert_array_equal(restored["device"], X + 1)


def per_device_rows(count, devices):
  """A pmap result of shape (count, 2): device d's row is [d, -d]."""
  rows = np.stack([np.arange(count), -np.arange(count)], 1).astype(np.float32)
  return tfspmd.pmap(lambda r: r * 1, devices=devices)(rows)


@pytest.mark.parametrize("saved_count, restored_count",
                         [(8, 4), (4, 8), (8, 1)])
def test_per_device_values_cannot_go_to_another_device_count(
    tmp_path, saved_count, restored_count):
  saved = per_device_rows(saved_count, DEVICES[:saved_count])
  path = checkpoint.save(str(tmp_path / "ckpt"), {"s": saved})
  like = {"s": per_device_rows(restored_count, DEVICES[:restored_count])}
  where = ("on 1 device" if restored_count == 1
           else f"split over {restored_count} devices")
  with pytest.raises(ValueError, match=(
      rf"like\['s'\] has shape \({restored_count}, 2\) {where}, but the "
      rf"checkpoint saved state\['s'\] as shape \({saved_count}, 2\) split "
      rf"over {saved_count} devices, one row of axis 0 per device\. .* "
      rf"restore it into a NumPy `like` of shape \({saved_count}, 2\)")):
    checkpoint.restore(path, like=like)

  # What the message says to do gives the saved rows.
  rows = checkpoint.restore(
      path, like={"s": np.zeros((saved_count, 2), np.float32)})["s"]
  np.testing.assert_array_equal(
      rows, np.stack([np.arange(saved_count), -np.arange(saved_count)], 1))


def test_per_device_values_move_to_as_many_other_devices(tmp_path):
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         per_device_rows(4, DEVICES[:4]))
  restored = checkpoint.restore(path, like=per_device_rows(4, DEVICES[4:]))
  assert_blocks(restored, [[[d, -d]] for d in range(4)], DEVICES[4:])


# --- leaves by path: no drop, no swap -----------------------------------------

KERNEL = np.arange(12, dtype=np.float32).reshape(4, 3)
BIAS = np.array([1, 2, 3], np.float32)


@pytest.mark.parametrize("like, message", [
    ({"bias": BIAS, "kern": KERNEL},
     r"the checkpoint has no value for like\['kern'\]; `like` has no place "
     r"for the saved state\['kernel'\], which would be lost\. The "
     r"checkpoint holds state\['bias'\], state\['kernel'\]"),
    ({"bias": BIAS, "kernel": KERNEL, "scale": BIAS},
     r"the checkpoint has no value for like\['scale'\]\. The checkpoint "
     r"holds"),
    ({"kernel": KERNEL},
     r"`like` has no place for the saved state\['bias'\], which would be "
     r"lost\."),
    ([BIAS, KERNEL],
     r"the checkpoint has no value for like\[0\], like\[1\]; `like` has "
     r"no place for the saved state\['bias'\], state\['kernel'\]"),
    ({"bias": BIAS, "kernel": KERNEL.T},
     r"like\['kernel'\] has shape \(3, 4\) on the host, but the checkpoint "
     r"saved state\['kernel'\] as shape \(4, 3\) on the host\. A restored "
     r"array keeps its saved global shape, split over any devices: restore "
     r"into a `like` of shape \(4, 3\)\."),
    ({"bias": BIAS.astype(np.float64), "kernel": KERNEL},
     r"like\['bias'\] has dtype float64, but the checkpoint saved "
     r"state\['bias'\] as float32\. Restore into a `like` of dtype float32"),
], ids=["renamed-key", "extra-key", "missing-key", "list-for-dict",
        "shape", "dtype"])
def test_a_like_whose_leaves_differ_from_the_saved_ones_is_an_error(
    tmp_path, like, message):
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         {"bias": BIAS, "kernel": KERNEL})
  with pytest.raises(ValueError, match=r"^checkpoint\.restore: .*" + message):
    checkpoint.restore(path, like=like)


def test_leaves_are_matched_by_path_not_by_position(tmp_path):
  saved_type = collections.namedtuple("Params", ["kernel", "bias", "scale"])
  like_type = collections.namedtuple("Params", ["scale", "bias", "kernel"])
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         saved_type(KERNEL, BIAS, BIAS * 10))
  zeros = np.zeros(3, np.float32)
  restored = checkpoint.restore(
      path, like=like_type(zeros, zeros, np.zeros((4, 3), np.float32)))
  assert isinstance(restored, like_type)
  np.testing.assert_array_equal(restored.kernel, KERNEL)
  np.testing.assert_array_equal(restored.bias, [1, 2, 3])
  np.testing.assert_array_equal(restored.scale, [10, 20, 30])


def test_a_none_leaf_is_an_error_that_says_what_to_do(tmp_path):
  path = str(tmp_path / "ckpt")
  with pytest.raises(TypeError, match=(
      r"checkpoint\.save: state\['opt'\]\[1\] is None, which a checkpoint "
      r"cannot hold: leave the leaf out of the state, or put an empty array "
      r"\(np\.zeros\(0\)\) in its place\.")):
    checkpoint.save(path, {"w": BIAS, "opt": [BIAS, None]})
  assert not os.listdir(tmp_path)

  checkpoint.save(path, {"w": BIAS})
  with pytest.raises(TypeError, match=r"checkpoint\.restore: like\['v'\] is "
                     r"None"):
    checkpoint.restore(path, like={"w": BIAS, "v": None})


def test_a_leaf_that_is_no_array_is_an_error(tmp_path):
  with pytest.raises(TypeError, match=(
      r"checkpoint\.save: state\['name'\] is a str, which a checkpoint "
      r"cannot hold: the leaves must be tfspmd\.ShardedArrays, tensors, "
      r"NumPy arrays or numbers\.")):
    checkpoint.save(str(tmp_path / "ckpt"), {"w": BIAS, "name": "run-3"})


def test_restoring_what_is_not_there_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match=(
      r"there is no checkpoint at '.*nowhere'\. Pass the path given to "
      r"checkpoint\.save, or the prefix it returned\.")):
    checkpoint.restore(str(tmp_path / "nowhere"), like=BIAS)

  raw = tf.train.Checkpoint(state=[tf.Variable(BIAS)]).write(
      str(tmp_path / "raw"))
  with pytest.raises(ValueError, match=(
      r"the checkpoint holds no state written by tfspmd\.adapters\.checkpoint"
      r"\.save "
      r"with its leaves' paths")):
    checkpoint.restore(raw, like=[BIAS])

  path = checkpoint.save(str(tmp_path / "ckpt"), BIAS, step=tf.Variable(3))
  with pytest.raises(ValueError, match=(
      r"the checkpoint holds nothing for the trackables \['epoch'\]; beside "
      r"the state it holds \['step'\]\.")):
    checkpoint.restore(path, like=BIAS, epoch=tf.Variable(0))


def classifier(weights=None):
  keras.utils.set_random_seed(3)
  model = keras.Sequential([keras.Input((4,)),
                            keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dense(3)])
  model.compile(optimizer=keras.optimizers.Adam(0.02),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                metrics=["accuracy"])
  if weights is not None:
    model.set_weights(weights)
  return model


def test_resumed_keras_training_is_bit_identical(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((96, 4)).astype(np.float32)
  y = rng.integers(0, 3, 96).astype(np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
  weights = classifier().get_weights()

  uninterrupted = classifier(weights)
  expected = keras_training.KerasTrainer(uninterrupted).fit(
      dataset, epochs=3, verbose=0).history

  first = keras_training.KerasTrainer(classifier(weights))
  first.fit(dataset, epochs=2, verbose=0)
  path = checkpoint.save(os.path.join(tmp_path, "ckpt"), first.state,
                         epoch=tf.Variable(2))

  model = classifier()  # other initial weights: all come from the checkpoint
  second = keras_training.KerasTrainer(model)
  second.build(dataset)
  epoch = tf.Variable(0)
  second.state = checkpoint.restore(path, like=second.state, epoch=epoch)
  history = second.fit(dataset, epochs=3, initial_epoch=int(epoch),
                       verbose=0).history

  assert history["loss"] == expected["loss"][2:]
  assert history["accuracy"] == expected["accuracy"][2:]
  for got, want in zip(model.get_weights(), uninterrupted.get_weights()):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(model.optimizer.variables,
                       uninterrupted.optimizer.variables):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
