"""A model with its own train_step, test_step or predict_step, data-parallel.

The steps are written as Keras' guide "Customizing what happens in fit()"
writes them for TensorFlow: a GradientTape over `self.trainable_variables`,
`self.optimizer.apply`, metrics updated one by one. Each run is compared
with the same model's `fit` under `tf.distribute.MirroredStrategy` over
the same 8 logical devices (the gradients combined as it combines them)
and with one-device `fit` (the weights and the metrics by name), on
identically initialised models, the same data in the same order.
"""

import numpy as np
import pytest
import tensorflow as tf

from tensorflow import GradientTape

import keras
from tfspmd.adapters import data_parallel
from tfspmd.adapters import keras_training

import mirrored

FEATURES, EXAMPLES, BATCH = 12, 256, 32


class GuideModel(keras.Model):
  """The guide's first example: its own train_step, Keras' loss and metrics."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      loss = self.compute_loss(y=y, y_pred=y_pred)
    gradients = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply(gradients, self.trainable_variables)
    for metric in self.metrics:
      if metric.name == "loss":
        metric.update_state(loss)
      else:
        metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}


class OwnLossModel(keras.Model):
  """The guide's lower-level example: its own loss and metric objects."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.loss_tracker = keras.metrics.Mean(name="loss")
    self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
    self.loss_fn = keras.losses.MeanSquaredError()

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      loss = self.loss_fn(y, y_pred)
    gradients = tape.gradient(loss, self.trainable_weights)
    self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
    self.loss_tracker.update_state(loss)
    self.mae_metric.update_state(y, y_pred)
    return {"loss": self.loss_tracker.result(),
            "mae": self.mae_metric.result()}

  def test_step(self, data):
    x, y = data
    y_pred = self(x, training=False)
    self.loss_tracker.update_state(self.loss_fn(y, y_pred))
    self.mae_metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}

  def predict_step(self, data):
    x = data
    return {"prediction": self(x, training=False), "doubled": 2 * self(x)}

  @property
  def metrics(self):
    return [self.loss_tracker, self.mae_metric]


def data(seed=0, rows=EXAMPLES):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
  y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * rng.standard_normal(
      (rows, 1))).astype(np.float32)
  return x, y


def model_of(cls, optimizer="adam", seed=1, **compile_options):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((FEATURES,))
  hidden = keras.layers.Dense(16, activation="relu")(inputs)
  model = cls(inputs, keras.layers.Dense(1)(hidden))
  model.compile(
      optimizer=keras.optimizers.Adam(0.01) if optimizer == "adam" else
      keras.optimizers.SGD(0.05, momentum=0.9), **compile_options)
  return model


def guide_model(optimizer="adam", **options):
  return model_of(GuideModel, optimizer, loss="mse", metrics=["mae"],
                  **options)


def fitted(model, x, y, **fit_options):
  """`(model, history)` after `model.fit` on the data in its order."""
  history = model.fit(x, y, verbose=0, shuffle=False, **fit_options).history
  return model, history


def fitted_under_mirrored_strategy(make, x, y, **fit_options):
  with mirrored.strategy().scope():
    model = make()
  with mirrored.inputs_without_autotuning():
    return fitted(model, x, y, **fit_options)


def assert_same_weights(model, reference, rtol=1e-5, atol=1e-6):
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_guides_train_step_gives_mirrored_strategys_numbers(optimizer):
  x, y = data()
  model, history = fitted(data_parallel(guide_model(optimizer)), x, y,
                          batch_size=BATCH, epochs=3)
  reference, expected = fitted_under_mirrored_strategy(
      lambda: guide_model(optimizer), x, y, batch_size=BATCH, epochs=3)
  assert_same_weights(model, reference)
  assert sorted(history) == sorted(expected) == ["loss", "mae"]
  for name in expected:
    np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)


def test_the_guides_train_step_trains_as_fit_on_one_device():
  # The weights, and the metric by name, are one device's: its batch's
  # gradient is the mean of the devices'. The step's own loss log is the
  # loss Keras divides by the devices for the gradients' sum, as under
  # MirroredStrategy.
  x, y = data()
  model, history = fitted(data_parallel(guide_model()), x, y,
                          batch_size=BATCH, epochs=2)
  reference, expected = fitted(guide_model(), x, y, batch_size=BATCH,
                               epochs=2)
  assert_same_weights(model, reference)
  np.testing.assert_allclose(history["mae"], expected["mae"], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(history["loss"]) * 8,
                             expected["loss"], rtol=1e-5)


def test_own_loss_metrics_test_step_and_predict_step_as_mirrored_strategy():
  # The model's own loss object is a Keras loss, which Keras divides by the
  # devices under a strategy, in training and in evaluation alike.
  x, y = data()
  validation = data(seed=5, rows=64)
  model, history = fitted(data_parallel(model_of(OwnLossModel, "sgd")), x, y,
                          batch_size=BATCH, epochs=2,
                          validation_data=validation)
  reference, expected = fitted_under_mirrored_strategy(
      lambda: model_of(OwnLossModel, "sgd"), x, y, batch_size=BATCH,
      epochs=2, validation_data=validation)
  assert_same_weights(model, reference)
  assert sorted(history) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(history[name], expected[name], rtol=1e-5,
                               err_msg=name)
  test_x, test_y = data(seed=7, rows=80)
  with mirrored.inputs_without_autotuning():
    expected_evaluation = reference.evaluate(test_x, test_y, batch_size=16,
                                             verbose=0)
  np.testing.assert_allclose(
      model.evaluate(test_x, test_y, batch_size=16, verbose=0),
      expected_evaluation, rtol=1e-5)
  one_device = model_of(OwnLossModel, "sgd")
  one_device.set_weights(model.get_weights())
  predicted = model.predict(test_x[:75], batch_size=16, verbose=0)
  wanted = one_device.predict(test_x[:75], batch_size=16, verbose=0)
  assert sorted(predicted) == ["doubled", "prediction"]
  for name in wanted:
    np.testing.assert_allclose(predicted[name], wanted[name], rtol=1e-5,
                               atol=1e-6)


def test_several_steps_per_execution_of_an_own_train_step():
  x, y = data()
  model, _ = fitted(data_parallel(guide_model(steps_per_execution=4)), x, y,
                    batch_size=BATCH, epochs=2)
  reference, _ = fitted(guide_model(), x, y, batch_size=BATCH, epochs=2)
  assert_same_weights(model, reference)


def test_keras_trainer_runs_an_own_train_step_too():
  x, y = data()
  model = guide_model()
  keras_training.KerasTrainer(model).fit(x, y, batch_size=BATCH, epochs=2,
                                          shuffle=False, verbose=0)
  reference, _ = fitted(guide_model(), x, y, batch_size=BATCH, epochs=2)
  assert_same_weights(model, reference)


def test_a_batch_the_devices_do_not_divide_is_refused_for_an_own_step():
  # Padding rows would count in the model's own loss and metrics.
  x, y = data(rows=100)
  model = data_parallel(guide_model())
  with pytest.raises(ValueError, match=(
      r"GuideModel has its own train_step, which runs on every row .* "
      r"multiples of 8")):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


# A variable no model holds (a counter kept beside the model).
_COUNTER = []


class CountingModel(GuideModel):
  """Counts its steps in a variable the model does not hold."""

  def train_step(self, data):
    _COUNTER[0].assign_add(1.0)
    return super().train_step(data)


def test_assigning_a_variable_the_model_does_not_carry_is_an_error():
  if not _COUNTER:
    _COUNTER.append(keras.Variable(0.0, name="counter"))
  x, y = data()
  model = data_parallel(model_of(CountingModel, loss="mse"))
  with pytest.raises(ValueError, match=(
      r"CountingModel.train_step assigns variables that are not the "
      r"model's, its optimizer's or its metrics' \(a variable outside the "
      r"model\)")):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


class ImportedTapeModel(GuideModel):
  """Takes its tape by a name imported from TensorFlow."""

  def train_step(self, data):
    x, y = data
    with GradientTape() as tape:
      loss = self.compute_loss(y=y, y_pred=self(x, training=True))
    self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                         self.trainable_variables)
    return {"loss": loss}


def test_a_tape_imported_by_name_is_an_error_not_an_untrained_model():
  x, y = data()
  model = data_parallel(model_of(ImportedTapeModel, loss="mse"))
  with pytest.raises(ValueError, match=(
      r"a tape other than tf.GradientTape\(\) asked for the gradient by a "
      r"model variable.*from tensorflow import GradientTape")):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


class RegularizedModel(keras.Model):
  """Has layer losses and resets a metric in every step."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.batch_mae = keras.metrics.MeanAbsoluteError(name="batch_mae")

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      # compute_loss adds the layers' losses (the activity regularizer).
      loss = self.compute_loss(y=y, y_pred=y_pred)
    self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                         self.trainable_variables)
    self.batch_mae.reset_state()
    self.batch_mae.update_state(y, y_pred)
    return {"batch_mae": self.batch_mae.result()}

  @property
  def metrics(self):
    return [self.batch_mae]


def regularized_model():
  keras.utils.set_random_seed(2)
  inputs = keras.Input((FEATURES,))
  hidden = keras.layers.Dense(16, activation="relu",
                              activity_regularizer="l2")(inputs)
  model = RegularizedModel(inputs, keras.layers.Dense(1)(hidden))
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  return model


def test_layer_losses_and_a_metric_reset_in_the_step_as_on_one_device():
  # The activity regularizer's loss reaches the gradient, and a metric
  # reset in every step reports that step's global batch alone, as one
  # device's fit does.
  x, y = data()
  model, history = fitted(data_parallel(regularized_model()), x, y,
                          batch_size=BATCH, epochs=2)
  reference, expected = fitted(regularized_model(), x, y, batch_size=BATCH,
                               epochs=2)
  assert_same_weights(model, reference)
  np.testing.assert_allclose(history["batch_mae"], expected["batch_mae"],
                             rtol=1e-5)
