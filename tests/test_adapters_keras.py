"""tfspmd.adapters.keras_training: an unchanged Keras model trained on 8 devices.

The reference is Keras itself: the same model, from the same initial
weights, trained by `model.fit` on one device with the same data in the same
order, batch = the global batch.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfspmd
from tfspmd.adapters import keras_training


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
      x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history

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


@pytest.mark.parametrize("jit_compile", [True, False])
def test_the_steps_are_compiled_by_xla_as_the_model_says(jit_compile,
                                                         caplog):
  # Keras' own default on a machine with only CPUs is no XLA.
  assert not mlp("sgd").jit_compile
  x, y = data()
  weights = initial_weights()
  reference = mlp(OPTIMIZERS["adam"](), weights=weights)
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           verbose=0).history
  model = mlp(OPTIMIZERS["adam"](), weights=weights)
  model.jit_compile = jit_compile
  caplog.set_level(logging.WARNING, logger="tfspmd")
  tfspmd.config.update("tfspmd_log_compiles", True)
  try:
    history = keras_training.KerasTrainer(model).fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  finally:
    tfspmd.config.update("tfspmd_log_compiles", False)
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  first_runs = [r.getMessage() for r in caplog.records
                if "KerasTrainer._train_step for" in r.getMessage() and
                not r.getMessage().startswith("tfspmd: traced")]
  on_host = tfspmd.config.tfspmd_executor != "dtensor"
  assert len(first_runs) == 1, first_runs
  assert first_runs[0].startswith(
      "tfspmd: ran op by op, without XLA," if on_host and not jit_compile
      else "tfspmd: lowered, compiled and ran"), first_runs


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
    trainer.fit(x, y, batch_size=BATCH, steps_per_epoch=6, shuffle=False,
                verbose=0)


def test_evaluate_equals_keras_evaluate():
  x, y = data(seed=3)
  model = mlp("sgd", weights=initial_weights())
  expected = model.evaluate(x, y, batch_size=BATCH, verbose=0,
                            return_dict=True)
  got = keras_training.KerasTrainer(model).evaluate(x, y, batch_size=BATCH,
                                                    return_dict=True)
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
  history = trainer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0,
                        callbacks=[callback]).history
  assert [s[0] for s in seen] == [0, 1]
  assert [s[1] for s in seen] == history["loss"]
  assert not np.array_equal(seen[0][2], seen[1][2])
  np.testing.assert_array_equal(seen[1][2], np.asarray(trainer.state[0][0]))


def embedding_model(optimizer):
  keras.utils.set_random_seed(11)
  model = keras.Sequential([
      keras.Input((5,), dtype="int32"),
      keras.layers.Embedding(12, 4),
      keras.layers.GlobalAveragePooling1D(),
      keras.layers.Dense(CLASSES)])
  model.compile(optimizer=optimizer, loss=keras.losses.
                SparseCategoricalCrossentropy(from_logits=True))
  return model


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.Adam(0.05), lambda: keras.optimizers.AdamW(0.05),
    lambda: keras.optimizers.Adamax(0.05), lambda: keras.optimizers.Lamb(0.01),
    lambda: keras.optimizers.SGD(0.5, momentum=0.9)])
def test_an_embedding_with_ids_repeated_in_a_batch_trains_as_keras_fit(
    optimizer):
  # 12 ids in rows of 5: each batch repeats ids within a device's rows and
  # across devices. Keras updates an Embedding's sparse gradient row by row
  # (Adam's second moment sums each looked-up row's square), which the
  # devices' rows, gathered, reproduce.
  rng = np.random.default_rng(2)
  ids = rng.integers(0, 12, (128, 5)).astype(np.int32)
  y = rng.integers(0, CLASSES, 128).astype(np.int32)
  reference = embedding_model(optimizer())
  expected = reference.fit(ids, y, batch_size=BATCH, epochs=2,
                           shuffle=False, verbose=0).history
  model = embedding_model(optimizer())
  history = keras_training.KerasTrainer(model).fit(
      ids, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.RMSprop(0.05), lambda: keras.optimizers.Adagrad(
        0.5)])
def test_an_optimizer_that_cannot_take_sparse_rows_warns(optimizer):
  rng = np.random.default_rng(2)
  ids = rng.integers(0, 12, (64, 5)).astype(np.int32)
  y = rng.integers(0, CLASSES, 64).astype(np.int32)
  model = embedding_model(optimizer())
  with pytest.warns(UserWarning, match="gets the gradient dense, summed "
                    "over the devices; where ids repeat in a batch"):
    history = keras_training.KerasTrainer(model).fit(
        ids, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  assert history["loss"][-1] < history["loss"][0]


def test_batch_norm_moving_statistics_are_those_of_the_global_batch():
  # Each device normalizes its 4 rows by their own moments; the moving
  # statistics are those of the 32 rows, as in model.fit (not the mean of
  # the devices' variances, which leaves out the spread of their means).
  x, y = data(seed=4)
  x = x[:BATCH] * 2 + 5
  reference = batch_norm_model()
  reference.fit(x, y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False,
                verbose=0)
  model = batch_norm_model()
  keras_training.KerasTrainer(model).fit(x, y[:BATCH], batch_size=BATCH,
                                         epochs=1, shuffle=False, verbose=0)
  layer = model.layers[0]
  np.testing.assert_allclose(layer.moving_mean, 0.1 * x.mean(0), rtol=1e-5)
  np.testing.assert_allclose(layer.moving_variance, 0.9 + 0.1 * x.var(0),
                             rtol=1e-5)
  assert not np.allclose(
      x.var(0), x.reshape(8, BATCH // 8, FEATURES).var(1).mean(0), rtol=0.05)
  for name in ("moving_mean", "moving_variance"):
    np.testing.assert_allclose(getattr(layer, name),
                               getattr(reference.layers[0], name), rtol=1e-5)


def test_an_uncompiled_model_is_an_error():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  with pytest.raises(ValueError, match="is not compiled with an optimizer"):
    keras_training.KerasTrainer(model)


def test_not_a_keras_3_model_is_an_error():
  with pytest.raises(TypeError, match="must be a Keras 3 `keras.Model`"):
    keras_training.KerasTrainer(tf.Module())


def test_a_train_step_that_calls_keras_own_trains_as_fit():
  class Custom(keras.Model):

    def train_step(self, data):
      return super().train_step(data)

  def compiled():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((2,))
    model = Custom(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model

  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 2)).astype(np.float32)
  y = rng.standard_normal((64, 1)).astype(np.float32)
  model = compiled()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
  reference = compiled()
  expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                           verbose=0).history
  # Keras' own step logs the loss it divided by the devices, undivided.
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


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
        batch_size=8, shuffle=False, verbose=0)


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
  trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  trainer.sync_to_model()

  # Keras itself, device by device: device k's Dropout draws from the seed
  # state (7 + k, 0); the gradients are averaged over the devices.
  grads, outputs = [], []
  for k, rows in enumerate(np.split(x, 8)):
    reference = model_with_dropout()
    reference.layers[0].seed_generator.state.assign([7 + k, 0])

    def forward_and_gradient(rows, reference=reference):
      with tf.GradientTape() as tape:
        out = reference(rows, training=True)
        loss = tf.reduce_mean(tf.square(out))
      return out, tape.gradient(loss, reference.trainable_variables)[0]

    # TensorFlow's kernels draw: the model, as Keras compiles it on a
    # machine of CPUs, is not compiled by XLA.
    out, grad = forward_and_gradient(rows)
    grads.append(grad.numpy())
    outputs.append(out.numpy())
  assert len({o.tobytes() for o in outputs}) == 8
  expected = np.ones((FEATURES, 1), np.float32) - 0.1 * np.mean(grads, 0)
  np.testing.assert_allclose(model.layers[1].kernel.numpy(), expected,
                             rtol=1e-5)
  np.testing.assert_array_equal(
      model.layers[0].seed_generator.state.numpy(), [7, 1])


# --- the model is followed: what callbacks and the user assign counts ------


def fit_both(make_callbacks, epochs=4, optimizer=lambda: keras.optimizers.SGD(
    0.1), data_seed=0, **kwargs):
  """Trains the same model by model.fit and KerasTrainer.fit, same callbacks."""
  x, y = data(data_seed)
  weights = initial_weights()
  reference = mlp(optimizer(), weights=weights)
  expected = reference.fit(x, y, batch_size=BATCH, epochs=epochs,
                           shuffle=False, verbose=0,
                           callbacks=make_callbacks(), **kwargs).history
  model = mlp(optimizer(), weights=weights)
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
      callbacks=make_callbacks(), **kwargs).history
  return model, history, reference, expected


def assert_same_training(model, history, reference, expected):
  assert sorted(history) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(history[name], expected[name], rtol=1e-5,
                               err_msg=name)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for got, want in zip(model.optimizer.variables,
                       reference.optimizer.variables):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-6)


def test_learning_rate_scheduler_equals_keras_fit():
  # lr 0 from epoch 2 on: the weights must stop moving there.
  schedule = lambda: [keras.callbacks.LearningRateScheduler(
      lambda epoch, lr: 0.0 if epoch >= 2 else lr * 0.5)]
  model, history, reference, expected = fit_both(schedule)
  assert_same_training(model, history, reference, expected)
  np.testing.assert_allclose(history["learning_rate"], [0.05, 0.025, 0, 0])
  assert history["loss"][2] != history["loss"][1]
  assert float(model.optimizer.learning_rate) == 0.0


def test_reduce_lr_on_plateau_equals_keras_fit():
  # min_delta=1 makes every epoch after the first a plateau: the rate
  # halves from there.
  plateau = lambda: [keras.callbacks.ReduceLROnPlateau(
      monitor="loss", factor=0.5, patience=0, min_delta=1.0)]
  model, history, reference, expected = fit_both(plateau)
  assert_same_training(model, history, reference, expected)
  np.testing.assert_allclose(history["learning_rate"],
                             [0.1, 0.1, 0.05, 0.025])


def test_early_stopping_restoring_the_best_weights_equals_keras_fit():
  # mode='max' on a falling loss: epoch 0 stays the best; training stops
  # after 2 more epochs and the weights of epoch 0 come back.
  stopping = lambda: [keras.callbacks.EarlyStopping(
      monitor="loss", mode="max", patience=2, restore_best_weights=True)]
  model, history, reference, expected = fit_both(stopping, epochs=6)
  assert len(history["loss"]) == len(expected["loss"]) == 3
  assert_same_training(model, history, reference, expected)


def test_a_callback_stopping_in_an_epoch_stops_there_as_in_keras_fit():
  class StopAfterTwoBatches(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if batch == 1:
        self.model.stop_training = True

  model, history, reference, expected = fit_both(
      lambda: [StopAfterTwoBatches()], epochs=3)
  assert len(history["loss"]) == 1
  assert_same_training(model, history, reference, expected)


def test_a_learning_rate_set_by_a_batch_callback_is_used_from_that_batch():
  class Warmup(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      self.model.optimizer.learning_rate.assign(0.02 * (batch + 1))

  assert_same_training(*fit_both(lambda: [Warmup()], epochs=2))


def test_set_weights_after_fit_is_what_evaluate_and_fit_use():
  x, y = data(seed=5)
  model = mlp(keras.optimizers.SGD(0.1), weights=initial_weights())
  trainer = keras_training.KerasTrainer(model)
  trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  keras.utils.set_random_seed(9)
  other = [w + np.random.default_rng(9).standard_normal(w.shape).astype(
      w.dtype) for w in model.get_weights()]
  model.set_weights(other)

  reference = mlp(keras.optimizers.SGD(0.1), weights=other)
  expected = reference.evaluate(x, y, batch_size=BATCH, verbose=0,
                                return_dict=True)
  got = trainer.evaluate(x, y, batch_size=BATCH, return_dict=True)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)

  # fit goes on from the assigned weights (and the optimizer state).
  reference.optimizer.iterations.assign(model.optimizer.iterations)
  reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_load_weights_after_fit_is_what_evaluate_uses(tmp_path):
  x, y = data(seed=6)
  saved = mlp("sgd", weights=[w * 2 for w in initial_weights()])
  saved.save_weights(str(tmp_path / "w.weights.h5"))
  model = mlp("sgd", weights=initial_weights())
  trainer = keras_training.KerasTrainer(model)
  trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  model.load_weights(str(tmp_path / "w.weights.h5"))
  expected = saved.evaluate(x, y, batch_size=BATCH, verbose=0,
                            return_dict=True)
  got = trainer.evaluate(x, y, batch_size=BATCH, return_dict=True)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)


def test_a_model_compiled_again_trains_with_its_new_optimizer():
  x, y = data(seed=7)
  model = mlp("sgd", weights=initial_weights())
  trainer = keras_training.KerasTrainer(model)
  trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  weights = model.get_weights()
  model.compile(optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=["accuracy"])
  reference = mlp(keras.optimizers.Adam(0.01), weights=weights)
  expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                           verbose=0).history
  history = trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0).history
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- padded remainders change nothing -------------------------------------


def test_padded_remainders_train_as_keras_fit_on_the_unpadded_batches():
  # 84 rows in batches of 32, 32, 20: the last is padded to 24; some rows
  # weigh 0 themselves, which padding must not be confused with.
  x, y = data(seed=8)
  x, y = x[:84], y[:84]
  w = np.tile(np.array([1.0, 0.0, 2.0, 0.5], np.float32), 21)
  dataset = lambda: tf.data.Dataset.from_tensor_slices((x, y, w)).batch(
      BATCH)
  weights = initial_weights()
  reference = mlp(keras.optimizers.SGD(0.1), weights=weights)
  expected = reference.fit(dataset(), epochs=2, verbose=0).history
  model = mlp(keras.optimizers.SGD(0.1), weights=weights)
  trainer = keras_training.KerasTrainer(model)
  history = trainer.fit(dataset(), epochs=2, verbose=0,
                        remainder="pad").history
  assert_same_training(model, history, reference, expected)


def test_padded_evaluate_equals_keras_evaluate_on_20_rows():
  x, y = data(seed=9)
  model = mlp("sgd", weights=initial_weights())
  expected = model.evaluate(x[:20], y[:20], batch_size=20, verbose=0,
                            return_dict=True)
  got = keras_training.KerasTrainer(model).evaluate(
      x[:20], y[:20], batch_size=20, remainder="pad", return_dict=True)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)


def batch_norm_model(synchronized=False):
  keras.utils.set_random_seed(5)
  model = keras.Sequential([keras.Input((FEATURES,)),
                            keras.layers.BatchNormalization(
                                momentum=0.9, synchronized=synchronized),
                            keras.layers.Dense(CLASSES)])
  model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model


@pytest.mark.parametrize("rows, epochs", [(20, 1), (5, 3)])
def test_padding_rows_are_left_out_of_batch_norm_statistics(rows, epochs):
  # 20 rows on 8 devices: 3 per device, device 6 has 2 real rows and
  # device 7 none. 5 rows: one per device, devices 5 to 7 none. The moving
  # statistics are those of the real rows of the batch, as in model.fit.
  x, y = data(seed=4)
  x = x[:rows] * 2 + 5
  y = y[:rows]
  reference = batch_norm_model()
  reference.fit(x, y, batch_size=rows, epochs=epochs, shuffle=False,
                verbose=0)
  model = batch_norm_model()
  keras_training.KerasTrainer(model).fit(x, y, batch_size=rows,
                                         epochs=epochs, shuffle=False,
                                         verbose=0, remainder="pad")
  mean, variance = np.zeros(FEATURES), np.ones(FEATURES)
  for _ in range(epochs):  # momentum 0.9
    mean = 0.9 * mean + 0.1 * x.mean(0)
    variance = 0.9 * variance + 0.1 * x.var(0)
  layer = model.layers[0]
  np.testing.assert_allclose(layer.moving_mean, mean, rtol=1e-5)
  np.testing.assert_allclose(layer.moving_variance, variance, rtol=1e-5)
  for name in ("moving_mean", "moving_variance"):
    np.testing.assert_allclose(getattr(layer, name),
                               getattr(reference.layers[0], name), rtol=1e-5)


@pytest.mark.parametrize("remainder, rows", [("error", BATCH), ("pad", 20)])
def test_synchronized_batch_norm_trains_as_keras_fit_on_the_global_batch(
    remainder, rows):
  # With synchronized=True every device normalizes by the moments of the
  # global batch (as under MirroredStrategy), so the weights after 3 epochs
  # are one-device model.fit's; per-device moments give others. 20 rows:
  # padding rows count nowhere.
  x, y = data(seed=6)
  x, y = x[:4 * rows] * 2 + 5, y[:4 * rows]
  reference = batch_norm_model(synchronized=True)
  reference.fit(x, y, batch_size=rows, epochs=3, shuffle=False, verbose=0)
  trained = {}
  for synchronized in (True, False):
    model = batch_norm_model(synchronized=synchronized)
    keras_training.KerasTrainer(model).fit(
        x, y, batch_size=rows, epochs=3, shuffle=False, verbose=0,
        remainder=remainder)
    trained[synchronized] = model.get_weights()
  for got, want in zip(trained[True], reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert not all(np.allclose(a, b, rtol=1e-3) for a, b in
                 zip(trained[False], reference.get_weights()))


# --- what a model without targets, and bad batches, get --------------------


def test_a_dataset_of_x_alone_trains_a_model_whose_losses_are_its_own():
  def model_with_own_loss():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(2, activity_regularizer=keras.regularizers.L2(0.1))])
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model

  x, _ = data(seed=10)
  dataset = tf.data.Dataset.from_tensor_slices(x).batch(BATCH)
  reference = model_with_own_loss()
  expected = reference.fit(dataset, epochs=2, verbose=0).history
  model = model_with_own_loss()
  history = keras_training.KerasTrainer(model).fit(dataset, epochs=2,
                                                   verbose=0).history
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_dataset_of_x_alone_for_a_compiled_loss_is_an_error_naming_y():
  x, _ = data()
  dataset = tf.data.Dataset.from_tensor_slices(x).batch(BATCH)
  with pytest.raises(ValueError, match=r"no targets `y`, but the model was "
                     r"compiled with a loss and metrics"):
    keras_training.KerasTrainer(mlp("sgd")).fit(dataset, verbose=0)


@pytest.mark.parametrize("shape", [(BATCH, 3), (BATCH, 1, 2)])
def test_sample_weights_that_do_not_fit_the_targets_are_an_error(shape):
  # Keras' fit fails on both (in the loss's broadcast).
  x, y = data()
  dataset = tf.data.Dataset.from_tensors(
      (x[:BATCH], y[:BATCH], np.ones(shape, np.float32)))
  with pytest.raises(ValueError, match=r"sample_weight has shape .* which "
                     r"does not fit y of shape"):
    keras_training.KerasTrainer(mlp("sgd")).fit(dataset, verbose=0)


def test_string_inputs_are_an_error_naming_the_input():
  inputs = keras.Input((1,), dtype="string", name="text")
  ids = keras.layers.StringLookup(vocabulary=["a", "b"])(inputs)
  model = keras.Model({"text": inputs}, keras.layers.Dense(1)(
      keras.ops.cast(ids, "float32")))
  model.compile(optimizer="sgd", loss="mse")
  dataset = tf.data.Dataset.from_tensors(
      ({"text": tf.constant([["a"]] * 8)}, tf.ones([8, 1])))
  with pytest.raises(ValueError, match=r"x\['text'\] holds strings.*"
                     r"StringLookup"):
    keras_training.KerasTrainer(model).fit(dataset, verbose=0)


@pytest.mark.parametrize("change, error, match", [
    (lambda s: ([s[0][0].numpy().astype(np.float64)] + s[0][1:],) + s[1:],
     TypeError, r"state\[0\]\[0\] \('sequential.*/kernel'\) must have dtype "
     r"float32, got float64"),
    (lambda s: ([np.zeros((2, 2), np.float32)] + s[0][1:],) + s[1:],
     ValueError, r"state\[0\]\[0\] .* must have shape \(6, 16\), got \(2, 2\)"),
    (lambda s: s[:3], ValueError, r"expected 4 lists .* got 3 parts"),
])
def test_a_state_unlike_the_models_is_an_error(change, error, match):
  x, y = data()
  trainer = keras_training.KerasTrainer(mlp("sgd"))
  trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  state = tuple(list(part) for part in trainer.state)
  with pytest.raises(error, match=match):
    trainer.state = change(state)


def test_an_assigned_state_is_written_into_the_model():
  x, y = data()
  model = mlp("sgd", weights=initial_weights())
  trainer = keras_training.KerasTrainer(model)
  trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  state = tuple(list(part) for part in trainer.state)
  zeros = np.zeros((FEATURES, 16), np.float32)
  trainer.state = ([zeros] + state[0][1:],) + state[1:]
  np.testing.assert_array_equal(model.layers[0].kernel.numpy(), zeros)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(epochs="3"), ValueError, r"`epochs` must be an int >= 0, got '3'"),
    (dict(epochs=2, steps_per_epoch=0), ValueError,
     r"`steps_per_epoch` must be an int >= 1 or None, got 0"),
    (dict(verbose=3), ValueError, r"`verbose` must be 'auto', 0, 1 or 2"),
    (dict(callbacks=keras.callbacks.History()), TypeError,
     r"`callbacks` must be a list"),
    (dict(callbacks=[lambda: None]), TypeError,
     r"callbacks\[0\] is a .*function, not a Keras 3"),
    (dict(batch_size=0), ValueError, r"`batch_size` must be an int >= 1"),
    (dict(remainder="drop"), ValueError,
     r"`remainder` must be 'error' or 'pad'"),
    (dict(y=np.zeros(10, np.int32)), ValueError,
     r"different numbers of examples \(x: 192, y: 10\)"),
])
def test_bad_fit_arguments_are_errors_naming_them(kwargs, error, match):
  x, y = data()
  arguments = dict(y=y, batch_size=BATCH, verbose=0)
  arguments.update(kwargs)
  with pytest.raises(error, match=match):
    keras_training.KerasTrainer(mlp("sgd")).fit(x, **arguments)
