"""tfspmd.adapters.data_parallel: the user's own model.fit, over the devices.

Each run is compared with `model.fit` / `evaluate` / `predict` of an
identically initialised model on one device, with the same data in the same
order, and where it says so with `tf.distribute.MirroredStrategy` over the
same 8 logical devices.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfspmd
from tfspmd.adapters import data_parallel

import mirrored

FEATURES, CLASSES, EXAMPLES, BATCH = 5, 3, 96, 32

_traced_batch_sizes = []


@keras.saving.register_keras_serializable(package="tfspmd_tests")
class RecordBatchSize(keras.layers.Layer):
  """Passes its input through, recording the batch size it is traced with."""

  def call(self, x):
    _traced_batch_sizes.append(x.shape[0])
    return x


def data(seed=0, rows=EXAMPLES):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
  y = rng.integers(0, CLASSES, rows).astype(np.int32)
  return x, y


def mlp(optimizer="adam", seed=1, compile_now=True, units=8):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([
      keras.Input((FEATURES,)),
      RecordBatchSize(),
      keras.layers.Dense(units, activation="relu"),
      keras.layers.Dense(CLASSES),
  ])
  if compile_now:
    compile_mlp(model, optimizer)
  return model


def compile_mlp(model, optimizer="adam"):
  model.compile(
      optimizer=keras.optimizers.Adam(0.01) if optimizer == "adam" else
      optimizer,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"])


def assert_same_weights(model, reference, rtol=1e-5, atol=1e-6):
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def assert_same_history(history, expected, rtol=1e-5):
  assert sorted(history) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(history[name], expected[name], rtol=rtol,
                               err_msg=name)


def test_the_users_own_fit_runs_with_per_device_batches():
  x, y = data()
  model = data_parallel(mlp())
  _traced_batch_sizes.clear()
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  traced = {size for size in _traced_batch_sizes if size is not None}
  assert traced == {BATCH // len(tfspmd.devices())}


def test_fit_evaluate_predict_equal_one_device_keras():
  x, y = data()
  xv, yv = data(seed=5, rows=40)
  reference = mlp()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                           validation_data=(xv, yv), verbose=0).history
  model = data_parallel(mlp())
  history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                      validation_data=(xv, yv), verbose=0)
  assert model.history is history
  assert_same_history(history.history, expected)
  assert_same_weights(model, reference)
  np.testing.assert_allclose(model.evaluate(xv, yv, verbose=0),
                             reference.evaluate(xv, yv, verbose=0), rtol=1e-5)
  assert model.evaluate(xv, yv, return_dict=True, verbose=0).keys() == {
      "loss", "accuracy"}
  # 40 rows in batches of 32: the last batch (8 rows) is model.fit's too.
  np.testing.assert_allclose(model.predict(xv, verbose=0),
                             reference.predict(xv, verbose=0), rtol=1e-5,
                             atol=1e-6)


def test_arrays_without_batch_size_take_batches_of_32_as_keras():
  # 100 rows: batches of 32, 32, 32 and 4 (the last padded for the devices).
  x, y = data(rows=100)
  reference = mlp()
  reference.fit(x, y, epochs=2, shuffle=False, verbose=0)
  model = data_parallel(mlp())
  model.fit(x, y, epochs=2, shuffle=False, verbose=0)
  assert_same_weights(model, reference)


def test_positional_arguments_and_initial_epoch_as_keras():
  x, y = data()
  reference = mlp()
  expected = reference.fit(x, y, BATCH, 3, 0, None, 0.0, None, False,
                           initial_epoch=1).history
  model = data_parallel(mlp())
  history = model.fit(x, y, BATCH, 3, 0, None, 0.0, None, False,
                      initial_epoch=1)
  assert len(history.history["loss"]) == 2
  assert_same_history(history.history, expected)
  assert_same_weights(model, reference)


def test_compiled_after_the_line_and_compiled_again():
  x, y = data()
  reference = mlp()
  reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  compile_mlp(reference, keras.optimizers.SGD(0.1))
  reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  model = data_parallel(mlp(compile_now=False))
  with pytest.raises(ValueError, match="not compiled with an optimizer"):
    model.fit(x, y, batch_size=BATCH, verbose=0)
  compile_mlp(model)
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  compile_mlp(model, keras.optimizers.SGD(0.1))
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  assert_same_weights(model, reference)


def test_a_model_that_is_not_compiled_predicts():
  x, _ = data(rows=20)
  reference = mlp(compile_now=False)
  model = data_parallel(mlp(compile_now=False))
  # XLA's kernels round other than TensorFlow's in the last bits.
  np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                             reference.predict(x, batch_size=8, verbose=0),
                             rtol=1e-5)


class Batches(keras.utils.PyDataset):
  """A PyDataset of global batches, counting its epochs."""

  def __init__(self, x, y, batch):
    super().__init__()
    self.x, self.y, self.batch, self.epochs_ended = x, y, batch, 0

  def __len__(self):
    return len(self.x) // self.batch

  def __getitem__(self, index):
    rows = slice(index * self.batch, (index + 1) * self.batch)
    return self.x[rows], self.y[rows]

  def on_epoch_end(self):
    self.epochs_ended += 1


def test_a_py_dataset_and_a_generator_train_as_keras():
  x, y = data()
  reference = mlp()
  reference.fit(Batches(x, y, BATCH), epochs=2, shuffle=False, verbose=0)
  batches = Batches(x, y, BATCH)
  model = data_parallel(mlp())
  model.fit(batches, epochs=2, shuffle=False, verbose=0)
  assert_same_weights(model, reference)
  assert batches.epochs_ended == 2

  def generator():
    for k in range(0, EXAMPLES, BATCH):
      yield x[k:k + BATCH], y[k:k + BATCH]

  reference = mlp()
  reference.fit(generator(), epochs=1, verbose=0)
  model = data_parallel(mlp())
  model.fit(generator(), epochs=1, verbose=0)
  assert_same_weights(model, reference)
  np.testing.assert_allclose(
      model.predict((x[k:k + 16] for k in range(0, 48, 16)), verbose=0),
      reference.predict(x[:48], verbose=0), rtol=1e-5, atol=1e-6)


def test_steps_and_validation_steps_take_that_many_batches():
  x, y = data()
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
  reference = mlp()
  expected = reference.fit(dataset, epochs=2, validation_data=dataset,
                           validation_steps=1, verbose=0).history
  model = data_parallel(mlp())
  history = model.fit(dataset, epochs=2, validation_data=dataset,
                      validation_steps=1, verbose=0).history
  assert_same_history(history, expected)
  np.testing.assert_allclose(model.evaluate(dataset, steps=2, verbose=0),
                             reference.evaluate(dataset, steps=2, verbose=0),
                             rtol=1e-5)
  assert model.predict(dataset, steps=2, verbose=0).shape == (2 * BATCH,
                                                               CLASSES)
  # With arrays, steps and validation_steps count batches of batch_size.
  xv, yv = data(seed=5, rows=40)
  reference, model = mlp(), data_parallel(mlp())
  expected = reference.fit(x, y, batch_size=16, epochs=1, shuffle=False,
                           validation_data=(xv, yv), validation_steps=2,
                           verbose=0).history
  history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False,
                      validation_data=(xv, yv), validation_steps=2,
                      verbose=0).history
  assert_same_history(history, expected)
  np.testing.assert_allclose(
      model.evaluate(xv, yv, batch_size=8, steps=3, verbose=0),
      reference.evaluate(xv, yv, batch_size=8, steps=3, verbose=0), rtol=1e-5)


def test_callbacks_see_fits_logs():
  x, y = data()

  class Logs(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
      self.epochs.append((epoch, round(logs["loss"], 5)))

  reference, model = mlp(), data_parallel(mlp())
  expected, got = Logs(), Logs()
  reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                callbacks=[expected])
  model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
            callbacks=[got])
  assert got.epochs == expected.epochs and len(got.epochs) == 2


class CallRecord(keras.callbacks.Callback):
  """Records the hooks Keras calls and the logs or outputs they get."""

  def __init__(self):
    super().__init__()
    self.calls = []

  def _record(self, hook, step=None, logs=None):
    if isinstance(step, dict):  # on_test_end(logs), on_predict_end(logs)
      step, logs = None, step
    if logs and "outputs" in logs:
      logs = np.asarray(logs["outputs"]).shape
    elif logs:
      logs = {k: round(float(v), 5) for k, v in logs.items()}
    self.calls.append((hook, step, logs))

  def __getattribute__(self, name):
    if name.startswith(("on_test", "on_predict")):
      return lambda *args, **kwargs: self._record(name, *args, **kwargs)
    return super().__getattribute__(name)


def test_evaluate_and_predict_run_callbacks_and_the_progress_bar_as_keras(
    capsys):
  x, y = data()
  reference, model = mlp(), data_parallel(mlp())
  for run in (reference, model):
    run.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  records = {}
  for name, run in (("reference", reference), ("model", model)):
    record = CallRecord()
    capsys.readouterr()
    run.evaluate(x, y, batch_size=BATCH, callbacks=[record], verbose=1)
    run.predict(x[:80], batch_size=BATCH, callbacks=[record], verbose=1)
    records[name] = (record.calls, capsys.readouterr().out)
  calls, printed = records["model"]
  assert calls == records["reference"][0]
  assert [call[0] for call in calls] == (
      ["on_test_begin"] + ["on_test_batch_begin", "on_test_batch_end"] * 3 +
      ["on_test_end", "on_predict_begin"] +
      ["on_predict_batch_begin", "on_predict_batch_end"] * 3 +
      ["on_predict_end"])
  # Keras' progress bar: the batches of each call, as model.evaluate and
  # model.predict print them.
  assert "3/3" in printed and "accuracy:" in printed and "loss:" in printed


class OwnMetrics(keras.Sequential):
  """Computes its metrics itself, weighing each row by its sample weight."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.largest_logit = keras.metrics.Mean(name="largest_logit")

  def compute_metrics(self, x, y, y_pred, sample_weight=None):
    self.largest_logit.update_state(tf.reduce_max(y_pred, axis=-1),
                                    sample_weight=sample_weight)
    return super().compute_metrics(x, y, y_pred, sample_weight)


def test_an_own_compute_metrics_leaves_padding_rows_out():
  # 100 rows in batches of 32: the last batch of 4 is padded to 8, whose
  # padding rows the model's own metric must not weigh.
  def model_with_own_metrics():
    keras.utils.set_random_seed(1)
    model = OwnMetrics([keras.Input((FEATURES,)),
                        keras.layers.Dense(8, activation="relu"),
                        keras.layers.Dense(CLASSES)])
    compile_mlp(model)
    return model

  x, y = data(rows=100)
  model = data_parallel(model_with_own_metrics())
  history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                      verbose=0).history
  reference = model_with_own_metrics()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           verbose=0).history
  assert_same_history(history, expected)
  assert_same_weights(model, reference)


def embedding_model(seed=3):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([
      keras.Input((4,), dtype="int32"),
      keras.layers.Embedding(10, 6),
      keras.layers.GlobalAveragePooling1D(),
      keras.layers.Dense(2),
  ])
  model.compile(optimizer=keras.optimizers.Adam(0.05),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def test_embedding_with_adam_and_repeated_ids_equals_fit_and_mirrored():
  # Ids repeat within a batch and across devices: the embedding's gradient
  # is sparse (IndexedSlices), which Adam applies as fit gives it.
  rng = np.random.default_rng(4)
  x = rng.integers(0, 4, (64, 4)).astype(np.int32)
  y = rng.integers(0, 2, 64).astype(np.int32)
  reference = embedding_model()
  reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  strategy = mirrored.strategy()
  with strategy.scope():
    on_mirrored = embedding_model()
  with mirrored.inputs_without_autotuning():
    on_mirrored.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  model = data_parallel(embedding_model())
  model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  assert_same_weights(on_mirrored, reference)
  assert_same_weights(model, reference)


def test_a_library_that_calls_fit_itself_trains_over_the_devices(tmp_path):
  keras_tuner = pytest.importorskip("keras_tuner")
  x, y = data()
  xv, yv = data(seed=5, rows=32)

  def build(hp):
    return data_parallel(mlp(units=hp.Choice("units", [4, 8])))

  tuner = keras_tuner.GridSearch(build, objective="val_loss",
                                 directory=str(tmp_path), project_name="t")
  _traced_batch_sizes.clear()
  tuner.search(x, y, batch_size=BATCH, epochs=2, shuffle=False,
               validation_data=(xv, yv), verbose=0)
  assert {s for s in _traced_batch_sizes if s is not None} == {
      BATCH // len(tfspmd.devices()), len(yv) // len(tfspmd.devices())}
  trials = tuner.oracle.get_best_trials(2)
  assert sorted(t.hyperparameters.values["units"] for t in trials) == [4, 8]
  for trial in trials:
    reference = mlp(units=trial.hyperparameters.values["units"])
    history = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                            validation_data=(xv, yv), verbose=0)
    np.testing.assert_allclose(trial.score, min(history.history["val_loss"]),
                               rtol=1e-5)


def test_bad_uses_are_clear_errors():
  with pytest.raises(TypeError, match="data_parallel: `model` must be a "
                     "Keras 3"):
    data_parallel(object())
  model = data_parallel(mlp())
  assert data_parallel(model) is model
  with pytest.raises(ValueError, match="already runs data-parallel"):
    data_parallel(model, axis_name="batch")
  x, y = data()
  with pytest.raises(ValueError, match="`validation_steps` counts batches "
                     "of `validation_data`"):
    model.fit(x, y, validation_split=0.5, validation_steps=1, verbose=0)
  with pytest.raises(TypeError, match=r"^model\.predict: `callbacks` must "
                     r"be a list"):
    model.predict(x, callbacks=keras.callbacks.History())
  with pytest.raises(ValueError, match="`validation_steps` must be an int"):
    model.fit(x, y, validation_data=(x, y), validation_steps=0, verbose=0)
  # Messages name the method the user called, not the trainer behind it.
  with pytest.raises(ValueError, match=r"^model\.fit: `validation_split` must "
                     r"be a float"):
    model.fit(x, y, validation_split=1.5, verbose=0)
  with pytest.raises(ValueError, match=r"^model\.evaluate: the arrays have "
                     r"different numbers of examples"):
    model.evaluate(x, y[:10], verbose=0)


def test_the_model_saves_and_loads_as_its_own_class(tmp_path):
  x, y = data()
  model = data_parallel(mlp())
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert type(loaded) is keras.Sequential
  np.testing.assert_allclose(loaded.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def synchronized_batch_norm_model():
  keras.utils.set_random_seed(5)
  model = keras.Sequential([
      keras.Input((FEATURES,)),
      keras.layers.BatchNormalization(momentum=0.9, synchronized=True),
      keras.layers.Dense(CLASSES),
  ])
  model.compile(optimizer="sgd",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def test_synchronized_batch_norm_equals_fit_and_mirrored():
  # Every device normalizes by the moments of the global batch; with a last
  # batch of 16 rows (2 per device) as well.
  x, y = data(seed=6, rows=80)
  x = x * 2 + 5
  reference = synchronized_batch_norm_model()
  reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  strategy = mirrored.strategy()
  with strategy.scope():
    on_mirrored = synchronized_batch_norm_model()
  with mirrored.inputs_without_autotuning():
    on_mirrored.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                    verbose=0)
  model = data_parallel(synchronized_batch_norm_model())
  model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  assert_same_weights(on_mirrored, reference)
  assert_same_weights(model, reference)


def two_inputs_two_outputs():
  keras.utils.set_random_seed(2)
  a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
  hidden = keras.layers.Dense(4, activation="relu")(
      keras.layers.Concatenate()([a, b]))
  model = keras.Model({"a": a, "b": b},
                      {"reg": keras.layers.Dense(1, name="reg")(hidden),
                       "cls": keras.layers.Dense(3, name="cls")(hidden)})
  model.compile(optimizer="adam", loss={
      "reg": "mse",
      "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
                metrics={"cls": ["accuracy"]})
  return model


def test_dict_inputs_and_outputs_with_sample_weights_and_no_tf_warnings():
  # Many small variables (biases, Adam's moments of them, the step count)
  # cross between their two forms; none may make TensorFlow warn.
  rng = np.random.default_rng(0)
  x = {"a": rng.standard_normal((40, 3)).astype(np.float32),
       "b": rng.standard_normal((40, 2)).astype(np.float32)}
  y = {"reg": rng.standard_normal((40, 1)).astype(np.float32),
       "cls": rng.integers(0, 3, 40)}
  weights = rng.uniform(0.5, 1.5, 40).astype(np.float32)
  arguments = dict(sample_weight=weights, batch_size=16, epochs=2,
                   shuffle=False, verbose=0)
  reference = two_inputs_two_outputs()
  expected = reference.fit(x, y, **arguments).history
  warned = []
  handler = logging.Handler(level=logging.WARNING)
  handler.emit = lambda record: warned.append(record.getMessage())
  tf_logger = logging.getLogger("tensorflow")
  tf_logger.addHandler(handler)
  try:
    model = data_parallel(two_inputs_two_outputs())
    history = model.fit(x, y, **arguments).history
    predicted = model.predict(x, verbose=0)
  finally:
    tf_logger.removeHandler(handler)
  assert not warned, warned
  assert_same_history(history, expected, rtol=1e-5)
  assert_same_weights(model, reference)
  for name, value in reference.predict(x, verbose=0).items():
    np.testing.assert_allclose(predicted[name], value, rtol=1e-5, atol=1e-6)


def test_a_strategys_scope_is_a_clear_error_not_a_smaller_step():
  x, y = data()
  strategy = mirrored.strategy()
  model = data_parallel(mlp())
  with strategy.scope():
    with pytest.raises(ValueError, match=r"^model\.fit inside the scope of a "
                       r"tf\.distribute\.MirroredStrategy: .*outside any "
                       r"`with strategy\.scope\(\):`"):
      model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  # Built, compiled and trained in the scope: Keras would divide each
  # device's loss by the strategy's replicas once more.
  with strategy.scope():
    in_scope = data_parallel(mlp())
    with pytest.raises(ValueError, match=r"^model\.fit inside the scope"):
      in_scope.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  with pytest.raises(ValueError, match=r"^model\.(fit|evaluate|predict) on "
                     r"a model built under the scope of a tf\.distribute\."
                     r"MirroredStrategy"):
    in_scope.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  with pytest.raises(ValueError, match=r"^model\.predict on a model built"):
    in_scope.predict(x, verbose=0)
  # Out of the scope, the first model trains as fit does.
  reference = mlp()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                           verbose=0).history
  history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                      verbose=0).history
  assert_same_history(history, expected)
  assert_same_weights(model, reference)


def test_mixed_float16_with_an_embedding_equals_fit():
  rng = np.random.default_rng(4)
  x = rng.integers(0, 4, (64, 4)).astype(np.int32)
  y = rng.integers(0, 2, 64).astype(np.int32)
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    reference = embedding_model()
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                             verbose=0).history
    model = data_parallel(embedding_model())
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                        verbose=0).history
  finally:
    keras.mixed_precision.set_global_policy("float32")
  assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
  assert_same_history(history, expected, rtol=1e-3)
  assert_same_weights(model, reference, rtol=1e-3, atol=1e-4)


def test_batch_size_beside_a_dataset_is_ignored_as_keras_ignores_it():
  x, y = data()
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
  reference = mlp()
  expected = reference.fit(dataset, batch_size=8, epochs=2, verbose=0).history
  model = data_parallel(mlp())
  with pytest.warns(UserWarning, match=r"^model\.fit: `batch_size=8` is "
                    r"ignored, as Keras ignores it for a dataset"):
    history = model.fit(dataset, batch_size=8, epochs=2, verbose=0).history
  assert_same_history(history, expected)
  assert_same_weights(model, reference)
  with pytest.warns(UserWarning, match=r"^model\.evaluate: `batch_size=8`"):
    np.testing.assert_allclose(
        model.evaluate(dataset, batch_size=8, verbose=0),
        reference.evaluate(dataset, batch_size=8, verbose=0), rtol=1e-5)
  with pytest.warns(UserWarning, match=r"^model\.predict: `batch_size=8`"):
    np.testing.assert_allclose(
        model.predict(dataset, batch_size=8, verbose=0),
        reference.predict(dataset, batch_size=8, verbose=0), rtol=1e-5,
        atol=1e-6)


class _InterruptAfterBatch(keras.callbacks.Callback):

  def __init__(self, batch):
    super().__init__()
    self.batch = batch

  def on_train_batch_end(self, batch, logs=None):
    if batch == self.batch:
      raise KeyboardInterrupt


def test_an_interrupt_mid_epoch_leaves_the_last_steps_weights():
  x, y = data()
  reference = mlp()
  with pytest.raises(KeyboardInterrupt):
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[_InterruptAfterBatch(1)])
  model = data_parallel(mlp())
  with pytest.raises(KeyboardInterrupt):
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[_InterruptAfterBatch(1)])
  assert_same_weights(model, reference)
  # And fit goes on from there, as Keras' does.
  reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  assert_same_weights(model, reference)


def test_model_checkpoint_every_3_batches_saves_as_fit(tmp_path):
  x, y = data()
  saved = {}
  for name, model in (("fit", mlp()), ("data_parallel",
                                       data_parallel(mlp()))):
    path = tmp_path / name
    path.mkdir()
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(path / "{epoch}-{batch}.weights.h5"), save_weights_only=True,
        save_freq=3)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[checkpoint])
    saved[name] = sorted(p.name for p in path.iterdir())
  # 96 rows in batches of 16: 6 batches an epoch, saved after 3 and 6.
  assert saved["fit"] == saved["data_parallel"] == [
      "1-3.weights.h5", "1-6.weights.h5", "2-3.weights.h5", "2-6.weights.h5"]
  for file in saved["fit"]:
    reference, model = mlp(compile_now=False), mlp(compile_now=False)
    reference.load_weights(str(tmp_path / "fit" / file))
    model.load_weights(str(tmp_path / "data_parallel" / file))
    assert_same_weights(model, reference)


def test_on_batch_methods_run_over_the_devices(caplog):
  x, y = data()
  reference = mlp()
  model = data_parallel(mlp())
  caplog.set_level(logging.WARNING, logger="tfspmd")
  tfspmd.config.update("tfspmd_log_compiles", True)
  try:
    for rows in (slice(0, 32), slice(32, 52)):  # the second: 20 rows, padded
      np.testing.assert_allclose(
          model.train_on_batch(x[rows], y[rows]),
          reference.train_on_batch(x[rows], y[rows]), rtol=1e-5)
      assert_same_weights(model, reference)
    assert model.train_on_batch(x[:32], y[:32], return_dict=True).keys() == (
        reference.train_on_batch(x[:32], y[:32], return_dict=True).keys())
    np.testing.assert_allclose(model.test_on_batch(x[:20], y[:20]),
                               reference.test_on_batch(x[:20], y[:20]),
                               rtol=1e-5)
    np.testing.assert_allclose(model.predict_on_batch(x[:20]),
                               reference.predict_on_batch(x[:20]), rtol=1e-5,
                               atol=1e-6)
  finally:
    tfspmd.config.update("tfspmd_log_compiles", False)
  traced = " ".join(r.getMessage() for r in caplog.records)
  for step in ("_train_step", "_test_step", "_predict_step"):
    assert f"KerasTrainer.{step}" in traced, step


def test_predict_on_strings_is_a_clear_error():
  lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
  model = data_parallel(keras.Sequential(
      [keras.Input((1,), dtype="string"), lookup,
       keras.layers.Embedding(3, 2)]))
  words = np.array([["a"], ["b"], ["c"]])
  with pytest.raises(ValueError, match=r"^model\.predict: x holds strings, "
                     r"which cannot go onto the devices.*dataset\.map"
                     r"\(lookup\).*StringLookup or TextVectorization"):
    model.predict(words, verbose=0)
  with pytest.raises(ValueError, match=r"^model\.predict: x holds strings"):
    model.predict(tf.data.Dataset.from_tensor_slices(words).batch(2),
                  verbose=0)
