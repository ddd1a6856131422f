"""adapters.keras_training: an unchanged Keras model trained on 8 devices.

The reference is Keras itself: the same model, from the same initial
weights, trained by `model.fit` on one device with the same data in the same
order, batch = the global batch.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
from adapters import keras_training

FEATURES, CLASSES, EXAMPLES, BATCH = 6, 3, 192, 32


def data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32)
  y = rng.integers(0, CLASSES, EXAMPLES).astype(np.int32)
  return x, y


def mlp(optimizer, steps_per_execution=1, weights=None):
  model = keras.Sequential([
      keras.Input((FEATURES,)),
      keras.layers.Dense(16, activation="relu"),
      keras.layers.Dense(16, activation="tanh",
                         kernel_regularizer=keras.regularizers.L2(1e-3)),
      keras.layers.Dense(CLASSES),
  ])
  model.compile(
      optimizer=optimizer,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], steps_per_execution=steps_per_execution)
  if weights is not None:
    model.set_weights(weights)
  return model


def initial_weights():
  keras.utils.set_random_seed(1)
  return mlp("sgd").get_weights()


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
}


@pytest.mark.parametrize("optimizer, steps_per_execution",
                         [("adam", 1), ("sgd_momentum", 3)])
def test_mlp_equals_one_device_keras_fit_after_3_epochs(optimizer,
                                                        steps_per_execution):
  x, y = data()
  weights = initial_weights()
  reference = mlp(OPTIMIZERS[optimizer](), weights=weights)
  expected = reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                           verbose=0).history

  model = mlp(OPTIMIZERS[optimizer](), steps_per_execution, weights=weights)
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=3, verbose=0).history

  assert sorted(history) == sorted(expected) == ["accuracy", "loss"]
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
  np.testing.assert_allclose(history["accuracy"], expected["accuracy"],
                             rtol=1e-5)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for got, want in zip(model.optimizer.variables, reference.optimizer.variables):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-6)
  assert history["loss"][-1] < history["loss"][0]


def test_repeated_shuffled_dataset_with_sample_weights_equals_keras_fit():
  # One endless reshuffled stream, read steps_per_epoch batches per epoch by
  # both: the same batches in the same order.
  x, y = data(seed=2)
  w = np.linspace(0.5, 2.0, EXAMPLES).astype(np.float32)
  # A dataset object's reshuffles go on from iteration to iteration: each run
  # gets its own.
  dataset = lambda: tf.data.Dataset.from_tensor_slices((x, y, w)).shuffle(
      EXAMPLES, seed=3, reshuffle_each_iteration=True).batch(BATCH).repeat()
  weights = initial_weights()
  reference = mlp(keras.optimizers.SGD(0.05), weights=weights)
  expected = reference.fit(dataset(), epochs=2, steps_per_epoch=6,
                           shuffle=False, verbose=0).history
  model = mlp(keras.optimizers.SGD(0.05), weights=weights)
  history = keras_training.KerasTrainer(model).fit(
      dataset(), epochs=2, steps_per_epoch=6, verbose=0).history
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_steps_per_epoch_not_a_multiple_of_steps_per_execution_is_an_error():
  x, y = data()
  trainer = keras_training.KerasTrainer(mlp("sgd", steps_per_execution=4))
  with pytest.raises(ValueError, match=r"steps_per_epoch=6 must be a multiple "
                     r"of the model's steps_per_execution=4"):
    trainer.fit(x, y, batch_size=BATCH, steps_per_epoch=6, verbose=0)


def test_evaluate_equals_keras_evaluate():
  x, y = data(seed=3)
  model = mlp("sgd", weights=initial_weights())
  expected = model.evaluate(x, y, batch_size=BATCH, verbose=0,
                            return_dict=True)
  got = keras_training.KerasTrainer(model).evaluate(x, y, batch_size=BATCH)
  assert sorted(got) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)


def test_callbacks_see_the_trained_model_at_each_epoch_end():
  x, y = data()
  model = mlp(keras.optimizers.SGD(0.1), weights=initial_weights())
  seen = []
  callback = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: seen.append(
          (epoch, logs["loss"], model.get_weights()[0].copy())))
  trainer = keras_training.KerasTrainer(model)
  history = trainer.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                        callbacks=[callback]).history
  assert [s[0] for s in seen] == [0, 1]
  assert [s[1] for s in seen] == history["loss"]
  assert not np.array_equal(seen[0][2], seen[1][2])
  np.testing.assert_array_equal(seen[1][2], np.asarray(trainer.state[0][0]))


def test_batch_norm_moving_statistics_are_averaged_over_devices():
  x, y = data(seed=4)
  keras.utils.set_random_seed(5)
  model = keras.Sequential([keras.Input((FEATURES,)),
                            keras.layers.BatchNormalization(momentum=0.9),
                            keras.layers.Dense(CLASSES)])
  model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  keras_training.KerasTrainer(model).fit(x[:BATCH], y[:BATCH],
                                         batch_size=BATCH, epochs=1, verbose=0)
  per_device = x[:BATCH].reshape(8, BATCH // 8, FEATURES)
  layer = model.layers[0]
  np.testing.assert_allclose(layer.moving_mean,
                             0.1 * per_device.mean(1).mean(0), rtol=1e-5,
                             atol=1e-7)
  np.testing.assert_allclose(layer.moving_variance,
                             0.9 + 0.1 * per_device.var(1).mean(0), rtol=1e-5)


def test_an_uncompiled_model_is_an_error():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  with pytest.raises(ValueError, match="is not compiled with an optimizer"):
    keras_training.KerasTrainer(model)


def test_not_a_keras_3_model_is_an_error():
  with pytest.raises(TypeError, match="must be a Keras 3 `keras.Model`"):
    keras_training.KerasTrainer(tf.Module())


def test_a_custom_train_step_is_an_error():
  class Custom(keras.Model):

    def train_step(self, data):
      return super().train_step(data)

  inputs = keras.Input((2,))
  model = Custom(inputs, keras.layers.Dense(1)(inputs))
  model.compile(optimizer="sgd", loss="mse")
  with pytest.raises(ValueError, match="overrides train_step, which cannot "
                     "run statelessly"):
    keras_training.KerasTrainer(model)


def test_a_model_reading_untracked_tf_variables_is_an_error():
  class Scale(keras.layers.Layer):

    def __init__(self):
      super().__init__()
      self.scale = tf.Variable(2.0, name="raw_scale")

    def call(self, x):
      return x * self.scale

  model = keras.Sequential([keras.Input((2,)), Scale(), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  with pytest.raises(ValueError, match=r"cannot run statelessly: its call "
                     r"reads tf.Variable\(s\) .*raw_scale"):
    keras_training.KerasTrainer(model).fit(
        np.ones((8, 2), np.float32), np.ones((8, 1), np.float32),
        batch_size=8, verbose=0)


def test_arrays_need_y_and_batch_size():
  model = mlp("sgd")
  with pytest.raises(ValueError, match="arrays `x` and `y` with the global "
                     "`batch_size`"):
    keras_training.KerasTrainer(model).fit(np.zeros((8, FEATURES)))


def test_dropout_draws_a_different_mask_on_each_device():
  def model_with_dropout():
    model = keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dropout(0.5, seed=7),
        keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model

  x = np.random.default_rng(6).standard_normal((BATCH, FEATURES)).astype(
      np.float32)
  y = np.zeros((BATCH, 1), np.float32)
  model = model_with_dropout()
  trainer = keras_training.KerasTrainer(model)
  trainer.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  trainer.sync_to_model()

  # Keras itself, device by device: device k's Dropout draws from the seed
  # state (7 + k, 0); the gradients are averaged over the devices.
  grads, outputs = [], []
  for k, rows in enumerate(np.split(x, 8)):
    reference = model_with_dropout()
    reference.layers[0].seed_generator.state.assign([7 + k, 0])
    with tf.GradientTape() as tape:
      out = reference(rows, training=True)
      loss = tf.reduce_mean(tf.square(out))
    grads.append(tape.gradient(loss, reference.trainable_variables)[0].numpy())
    outputs.append(out.numpy())
  assert len({o.tobytes() for o in outputs}) == 8
  expected = np.ones((FEATURES, 1), np.float32) - 0.1 * np.mean(grads, 0)
  np.testing.assert_allclose(model.layers[1].kernel.numpy(), expected,
                             rtol=1e-5)
  np.testing.assert_array_equal(
      model.layers[0].seed_generator.state.numpy(), [7, 1])
