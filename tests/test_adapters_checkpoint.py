"""adapters.checkpoint: pmap training state through tf.train.Checkpoint.

A run resumed from a checkpoint must continue with bit-identical numbers to
the run that was never interrupted.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfspmd
from adapters import checkpoint
from adapters import keras_training
from tfspmd import lax


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
  # Leaves in tf.nest order: 's' (8 blocks), then 'w' (one copy).
  assert stored == {
      **{f"state/0/{d}/.ATTRIBUTES/VARIABLE_VALUE": [1, 4, 3]
         for d in range(8)},
      "state/1/.ATTRIBUTES/VARIABLE_VALUE": [3]}
  reader = tf.train.load_checkpoint(path)
  for d in range(8):
    np.testing.assert_array_equal(
        reader.get_tensor(f"state/0/{d}/.ATTRIBUTES/VARIABLE_VALUE"),
        np.asarray(s)[d:d + 1])


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
  with pytest.raises(ValueError, match="does not hold a state like `like`"):
    checkpoint.restore(path, like=[out, out])


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
