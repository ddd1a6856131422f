"""adapters.keras_training: what `model.fit` users reach for, against Keras.

Validation data and splits, class weights, shuffling, `predict`,
`evaluate`'s return values, the losses of a model with several outputs,
metrics, optimizer options and mixed precision policies: each compared with
`model.fit` / `model.evaluate` / `model.predict` of an identically
initialised copy of the model on one device, with the same data in the same
order.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
from tfspmd.adapters import _keras_inputs
from tfspmd.adapters import keras_training

import mirrored

FEATURES, CLASSES, EXAMPLES, BATCH = 5, 3, 96, 16


def data(seed=0, rows=EXAMPLES):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
  y = rng.integers(0, CLASSES, rows).astype(np.int32)
  return x, y


def mlp(optimizer="sgd", metrics=("accuracy",), seed=1):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([
      keras.Input((FEATURES,)),
      keras.layers.Dense(8, activation="relu"),
      keras.layers.Dense(CLASSES),
      # Under a mixed policy the loss is taken on float32 logits, as Keras
      # advises.
      keras.layers.Activation("linear", dtype="float32"),
  ])
  model.compile(
      optimizer=keras.optimizers.SGD(0.1) if optimizer == "sgd" else optimizer,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=list(metrics))
  return model


def assert_same_run(model, history, reference, expected, rtol=1e-5,
                    atol=1e-6):
  assert list(history) == list(expected)  # Keras reports names sorted
  for name in expected:
    np.testing.assert_allclose(history[name], expected[name], rtol=rtol,
                               err_msg=name)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(want, np.float32), rtol=rtol,
                               atol=atol)


# --- validation -------------------------------------------------------------


def test_validation_arrays_beside_a_training_dataset_give_keras_val_logs():
  # model.fit batches such arrays by 32: 48 rows, a batch of 32 and one of
  # 16.
  x, y = data()
  x_val, y_val = data(seed=3, rows=48)
  dataset = lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
  reference = mlp()
  expected = reference.fit(dataset(), epochs=2, verbose=0,
                           validation_data=(x_val, y_val)).history
  model = mlp()
  history = keras_training.KerasTrainer(model).fit(
      dataset(), epochs=2, verbose=0, validation_data=(x_val, y_val)).history
  assert_same_run(model, history, reference, expected)


def test_validation_data_arrays_give_keras_val_logs():
  x, y = data()
  x_val, y_val = data(seed=1, rows=40)
  w_val = np.linspace(0.5, 1.5, 40).astype(np.float32)
  reference = mlp()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           validation_data=(x_val, y_val, w_val),
                           validation_batch_size=8, verbose=0).history
  model = mlp()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=2, validation_data=(x_val, y_val, w_val),
      validation_batch_size=8, shuffle=False, verbose=0).history
  assert sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
  assert_same_run(model, history, reference, expected)


def test_validation_dataset_every_second_epoch_as_keras():
  x, y = data()
  x_val, y_val = data(seed=2, rows=48)
  validation = lambda: tf.data.Dataset.from_tensor_slices(
      (x_val, y_val)).batch(24)
  reference = mlp()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False,
                           validation_data=validation(), validation_freq=2,
                           verbose=0).history
  model = mlp()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=4, validation_data=validation(),
      validation_freq=2, shuffle=False, verbose=0).history
  assert len(history["loss"]) == 4 and len(history["val_loss"]) == 2
  assert_same_run(model, history, reference, expected)


def test_validation_split_takes_the_last_rows_as_keras():
  # 96 rows, 0.25: the first 72 train, the last 24 validate (padded to 24).
  x, y = data(seed=3)
  reference = mlp()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           validation_split=0.25, verbose=0).history
  model = mlp()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=2, validation_split=0.25, shuffle=False,
      verbose=0,
      remainder="pad").history
  assert_same_run(model, history, reference, expected)
  # The split is Keras' own: evaluating the last 24 rows gives val_loss.
  last = model.evaluate(x[72:], y[72:], batch_size=BATCH, verbose=0,
                        return_dict=True)
  np.testing.assert_allclose(history["val_loss"][-1], last["loss"],
                             rtol=1e-5)


def test_callbacks_see_the_validation_logs_at_epoch_end():
  x, y = data()
  seen = []
  callback = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: seen.append(sorted(logs)))
  keras_training.KerasTrainer(mlp()).fit(
      x, y, batch_size=BATCH, epochs=1, validation_data=(x[:16], y[:16]),
      callbacks=[callback], verbose=0)
  assert seen == [["accuracy", "loss", "val_accuracy", "val_loss"]]


# --- class weights and shuffling --------------------------------------------


def test_class_weight_equals_keras_fit():
  x, y = data(seed=4)
  class_weight = {0: 0.5, 2: 3.0}  # class 1 weighs 1
  reference = mlp()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           class_weight=class_weight, verbose=0).history
  model = mlp()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=2, class_weight=class_weight,
      shuffle=False, verbose=0).history
  assert_same_run(model, history, reference, expected)


def test_class_weight_of_one_hot_targets_in_a_dataset_equals_keras_fit():
  x, y = data(seed=5)
  one_hot = np.eye(CLASSES, dtype=np.float32)[y]

  def model_of_one_hot():
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    return model

  dataset = lambda: tf.data.Dataset.from_tensor_slices((x, one_hot)).batch(
      BATCH)
  # Every class named: Keras' own dataset path fails on a class it lacks.
  class_weight = {0: 1.0, 1: 4.0, 2: 0.5}
  reference = model_of_one_hot()
  expected = reference.fit(dataset(), epochs=1, class_weight=class_weight,
                           shuffle=False, verbose=0).history
  model = model_of_one_hot()
  history = keras_training.KerasTrainer(model).fit(
      dataset(), epochs=1, class_weight=class_weight, verbose=0).history
  assert_same_run(model, history, reference, expected)


def test_shuffle_false_takes_the_rows_in_order_as_keras_shuffle_false():
  x, y = data(seed=6)
  reference = mlp()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           verbose=0).history
  model = mlp()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  assert_same_run(model, history, reference, expected)


@pytest.mark.parametrize("shuffle", [True, None])  # None: fit's default
def test_shuffle_gives_every_epoch_a_new_order_of_all_rows(shuffle):
  rows = np.arange(EXAMPLES, dtype=np.float32)[:, None]
  dataset = _keras_inputs.global_batches(
      rows, rows, None, BATCH, "error", mlp(metrics=()), "fit",
      shuffle=shuffle)
  epochs = [np.concatenate([x.numpy()[:, 0] for x, _ in dataset])
            for _ in range(2)]
  for order in epochs:
    np.testing.assert_array_equal(np.sort(order), rows[:, 0])
    assert not np.array_equal(order, rows[:, 0])
  assert not np.array_equal(epochs[0], epochs[1])


def test_fit_shuffles_arrays_by_default_as_keras_fit_does():
  x, y = data(seed=7)
  ordered, default = mlp(), mlp()
  default.set_weights(ordered.get_weights())
  keras_training.KerasTrainer(ordered).fit(x, y, batch_size=BATCH, epochs=2,
                                           shuffle=False, verbose=0)
  keras_training.KerasTrainer(default).fit(x, y, batch_size=BATCH, epochs=2,
                                           verbose=0)
  assert not np.allclose(default.get_weights()[0], ordered.get_weights()[0])


def test_shuffled_training_differs_from_ordered_and_ends_close_to_keras():
  # Keras' permutations are its own: the losses agree only statistically.
  x, y = data(seed=7)
  keras.utils.set_random_seed(11)
  expected = mlp().fit(x, y, batch_size=BATCH, epochs=3, shuffle=True,
                       verbose=0).history
  ordered = mlp()
  keras_training.KerasTrainer(ordered).fit(x, y, batch_size=BATCH, epochs=3,
                                           shuffle=False, verbose=0)
  model = mlp()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=3, shuffle=True, verbose=0).history
  assert not np.allclose(model.get_weights()[0], ordered.get_weights()[0])
  np.testing.assert_allclose(history["loss"], expected["loss"], rtol=0.05)


# --- evaluate and predict ---------------------------------------------------


def test_evaluate_returns_what_keras_evaluate_returns():
  x, y = data(seed=8)
  for metrics in ((), ("accuracy",)):
    model = mlp(metrics=metrics)
    trainer = keras_training.KerasTrainer(model)
    for return_dict in (False, True):
      expected = model.evaluate(x, y, batch_size=BATCH, verbose=0,
                                return_dict=return_dict)
      got = trainer.evaluate(x, y, batch_size=BATCH, return_dict=return_dict)
      assert type(got) is type(expected)
      if return_dict:
        assert list(got) == list(expected)  # Keras's order of the names
        got, expected = list(got.values()), list(expected.values())
      np.testing.assert_allclose(got, expected, rtol=1e-5)
  assert isinstance(trainer.evaluate(x, y, batch_size=BATCH)[0], float)


def test_predict_equals_keras_predict_with_a_last_batch_of_2_rows():
  # 50 rows in batches of 16: the last one holds 2 rows for 8 devices.
  x, _ = data(seed=9, rows=50)
  model = mlp()
  expected = model.predict(x, batch_size=16, verbose=0)
  got = keras_training.KerasTrainer(model).predict(x, batch_size=16)
  assert isinstance(got, np.ndarray) and got.shape == expected.shape == (50, 3)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_predict_of_a_model_with_two_inputs_and_two_outputs_as_keras():
  keras.utils.set_random_seed(2)
  a, b = keras.Input((FEATURES,), name="a"), keras.Input((2,), name="b")
  hidden = keras.layers.Dense(4)(keras.layers.Concatenate()([a, b]))
  model = keras.Model({"a": a, "b": b},
                      {"score": keras.layers.Dense(1)(hidden),
                       "probs": keras.layers.Dense(3, activation="softmax")(
                           hidden)})
  model.compile(optimizer="sgd", loss={"score": "mse",
                                       "probs": "categorical_crossentropy"})
  x, _ = data(seed=10, rows=36)
  inputs = {"a": x, "b": x[:, :2] * 2}
  expected = model.predict(inputs, batch_size=12, verbose=0)
  got = keras_training.KerasTrainer(model).predict(
      tf.data.Dataset.from_tensor_slices(inputs).batch(12))
  assert sorted(got) == sorted(expected) == ["probs", "score"]
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5,
                               atol=1e-6)


def test_predict_after_fit_uses_the_trained_weights():
  x, y = data(seed=11)
  model = mlp()
  trainer = keras_training.KerasTrainer(model)
  trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  np.testing.assert_allclose(trainer.predict(x, batch_size=BATCH),
                             model.predict(x, batch_size=BATCH, verbose=0),
                             rtol=1e-5, atol=1e-6)


# --- several outputs ---------------------------------------------------------


def two_output_model():
  keras.utils.set_random_seed(3)
  inputs = keras.Input((FEATURES,))
  hidden = keras.layers.Dense(4, activation="tanh")(inputs)
  model = keras.Model(inputs, {
      "score": keras.layers.Dense(1, name="score")(hidden),
      "probs": keras.layers.Dense(CLASSES, activation="softmax",
                                  name="probs")(hidden)})
  model.compile(optimizer=keras.optimizers.SGD(0.1),
                loss={"score": "mse", "probs": "categorical_crossentropy"},
                loss_weights={"score": 0.5, "probs": 2.0},
                metrics={"score": ["mae"], "probs": ["accuracy"]})
  return model


def two_output_data(seed, rows):
  x, y = data(seed=seed, rows=rows)
  return x, {"score": x[:, :1] - 2 * x[:, 1:2],
             "probs": np.eye(CLASSES, dtype=np.float32)[y]}


@pytest.mark.parametrize("batch, remainder", [(BATCH, "error"), (20, "pad")])
def test_two_outputs_report_each_outputs_loss_as_keras_fit(batch, remainder):
  # 60 rows in batches of 20 (padded to 24 on 8 devices) or of 16.
  x, y = two_output_data(seed=15, rows=60 if remainder == "pad" else 64)
  x_val, y_val = two_output_data(seed=16, rows=32)
  arguments = dict(batch_size=batch, epochs=2, shuffle=False, verbose=0,
                   validation_data=(x_val, y_val))
  reference = two_output_model()
  expected = reference.fit(x, y, **arguments).history
  model = two_output_model()
  history = keras_training.KerasTrainer(model).fit(
      x, y, remainder=remainder, **arguments).history
  assert sorted(expected) == [
      "loss", "probs_accuracy", "probs_loss", "score_loss", "score_mae",
      "val_loss", "val_probs_accuracy", "val_probs_loss", "val_score_loss",
      "val_score_mae"]
  # The total is the weighted sum of the outputs' losses.
  np.testing.assert_allclose(
      np.asarray(expected["score_loss"]) * 0.5 +
      np.asarray(expected["probs_loss"]) * 2.0, expected["loss"], rtol=1e-5)
  assert all(value > 0 for value in history["score_loss"])
  assert_same_run(model, history, reference, expected)


@pytest.mark.parametrize("batch, remainder", [(BATCH, "error"), (20, "pad")])
def test_evaluate_of_two_outputs_returns_what_keras_evaluate_returns(
    batch, remainder):
  # 52 rows in batches of 20: the last one holds 12 (padded to 16).
  x, y = two_output_data(seed=17, rows=64 if remainder == "error" else 52)
  model = two_output_model()
  trainer = keras_training.KerasTrainer(model)
  for return_dict in (False, True):
    expected = model.evaluate(x, y, batch_size=batch, verbose=0,
                              return_dict=return_dict)
    got = trainer.evaluate(x, y, batch_size=batch, return_dict=return_dict,
                           remainder=remainder)
    assert type(got) is type(expected)
    if return_dict:
      assert list(got) == list(expected)
      assert sorted(got) == ["loss", "probs_accuracy", "probs_loss",
                             "score_loss", "score_mae"]
      by_name = got
      got, expected = list(got.values()), list(expected.values())
    assert len(got) == len(expected) == 5
    np.testing.assert_allclose(got, expected, rtol=1e-5)
  # Each output's loss is the mean of its batches' losses, each batch
  # weighing 1 (as in Keras' TensorFlow trainer), where 'loss' weighs each
  # batch by its rows.
  predictions = model.predict(x, batch_size=batch, verbose=0)
  starts = range(0, len(x), batch)
  score = [np.mean((predictions["score"][k:k + batch] -
                    y["score"][k:k + batch]) ** 2) for k in starts]
  probs = [np.mean(-np.sum(y["probs"][k:k + batch] * np.log(
      predictions["probs"][k:k + batch]), axis=1)) for k in starts]
  np.testing.assert_allclose(by_name["score_loss"], np.mean(score), rtol=1e-5)
  np.testing.assert_allclose(by_name["probs_loss"], np.mean(probs), rtol=1e-5)
  rows = [len(x[k:k + batch]) for k in starts]
  np.testing.assert_allclose(
      by_name["loss"], np.average(0.5 * np.asarray(score) +
                                  2.0 * np.asarray(probs), weights=rows),
      rtol=1e-5)


# --- metrics ----------------------------------------------------------------

METRICS = {
    "auc": lambda: keras.metrics.AUC(),
    "auc_pr": lambda: keras.metrics.AUC(curve="PR", num_thresholds=50),
    "auc_multi_label": lambda: keras.metrics.AUC(multi_label=True,
                                                 num_labels=CLASSES),
    "f1_score_per_class": lambda: keras.metrics.F1Score(),
    "fbeta_score_macro": lambda: keras.metrics.FBetaScore(average="macro",
                                                          beta=2.0),
    "precision_at_recall": lambda: keras.metrics.PrecisionAtRecall(0.5),
    "recall_at_precision": lambda: keras.metrics.RecallAtPrecision(0.5),
    "sensitivity_at_specificity": lambda: (
        keras.metrics.SensitivityAtSpecificity(0.5)),
    "top_2_accuracy": lambda: keras.metrics.TopKCategoricalAccuracy(k=2),
    "recall_top_1": lambda: keras.metrics.Recall(top_k=1),
    "r2_score": lambda: keras.metrics.R2Score(),
    "one_hot_mean_iou": lambda: keras.metrics.OneHotMeanIoU(
        num_classes=CLASSES),
    "one_hot_iou": lambda: keras.metrics.OneHotIoU(num_classes=CLASSES,
                                                   target_class_ids=[0, 2]),
    "true_positives_at_2_thresholds": lambda: keras.metrics.TruePositives(
        thresholds=[0.2, 0.5]),
}


def model_with_metric(metric):
  keras.backend.clear_session()  # the same metric names in both models
  keras.utils.set_random_seed(4)
  model = keras.Sequential([keras.Input((FEATURES,)),
                            keras.layers.Dense(CLASSES, activation="softmax")])
  model.compile(optimizer=keras.optimizers.SGD(0.1),
                loss="categorical_crossentropy", metrics=[metric()])
  return model


@pytest.mark.parametrize("metric", METRICS.values(), ids=list(METRICS))
def test_metric_in_fit_and_evaluate_as_keras(metric):
  # 60 rows in batches of 20, each padded to 24 on 8 devices.
  x, labels = data(seed=19, rows=60)
  y = np.eye(CLASSES, dtype=np.float32)[labels]
  arguments = dict(batch_size=20, epochs=2, shuffle=False, verbose=0)
  reference = model_with_metric(metric)
  expected = reference.fit(x, y, **arguments).history
  expected_evaluation = reference.evaluate(x, y, batch_size=20, verbose=0,
                                           return_dict=True)
  model = model_with_metric(metric)
  trainer = keras_training.KerasTrainer(model)
  history = trainer.fit(x, y, remainder="pad", **arguments).history
  evaluation = trainer.evaluate(x, y, batch_size=20, remainder="pad",
                                return_dict=True)
  assert list(history) == list(expected) and len(expected) == 2
  for name in expected:
    for got, want in zip(history[name], expected[name]):
      assert np.shape(got) == np.shape(want)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                 err_msg=name)
  assert list(evaluation) == list(expected_evaluation)
  for name, want in expected_evaluation.items():
    assert type(evaluation[name]) is type(want)
    np.testing.assert_allclose(evaluation[name], want, rtol=1e-5, atol=1e-6,
                               err_msg=name)


# --- mixed precision --------------------------------------------------------


@pytest.fixture
def mixed_policy(request):
  keras.mixed_precision.set_global_policy(request.param)
  yield request.param
  keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("mixed_policy", ["mixed_float16", "mixed_bfloat16"],
                         indirect=True)
def test_mixed_precision_trains_close_to_keras_fit(mixed_policy):
  x, y = data(seed=12)
  x_val, y_val = data(seed=13, rows=32)
  arguments = dict(batch_size=BATCH, epochs=2, verbose=0,
                   validation_data=(x_val, y_val))
  reference = mlp(keras.optimizers.Adam(0.01))
  expected = reference.fit(x, y, shuffle=False, **arguments).history
  model = mlp(keras.optimizers.Adam(0.01))
  assert model.layers[0].compute_dtype == mixed_policy[len("mixed_"):]
  history = keras_training.KerasTrainer(model).fit(x, y, shuffle=False,
                                                   **arguments).history
  # Half-precision activations, rounded differently by the devices'
  # per-row programs: float16 keeps 11 significant bits, bfloat16 8.
  rtol, atol = {"mixed_float16": (2e-2, 2e-3),
                "mixed_bfloat16": (5e-2, 1e-2)}[mixed_policy]
  assert_same_run(model, history, reference, expected, rtol=rtol, atol=atol)
  predictions = keras_training.KerasTrainer(model).predict(x_val)
  np.testing.assert_allclose(predictions, model.predict(x_val, verbose=0),
                             rtol=rtol, atol=atol)


def _steps_scale_and_loss(model, history):
  return (int(model.optimizer.iterations.numpy()),
          float(model.optimizer.dynamic_scale.numpy()), history["loss"][-1])


@pytest.mark.parametrize("mixed_policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("spread, reference_kind", [(3.0, "fit"),
                                                    (10.0, "mirrored")])
def test_float16_loss_scaling_applies_the_steps_keras_applies(
    mixed_policy, spread, reference_kind):
  # Keras divides each replica's loss by the replicas before scaling it and
  # sums their gradients: each device's scaled gradients are one device's
  # size, and overflow where MirroredStrategy's do. Scaling each device's
  # own mean loss overflowed 8 times sooner: at spread 3, 31 of fit's 32
  # steps applied and a scale of 16384 for 32768. At spread 10 one-device
  # fit overflows once where MirroredStrategy does not, which is the
  # reference there.
  del mixed_policy
  x, y = data(seed=12, rows=1024)
  x = x * spread
  arguments = dict(batch_size=64, epochs=2, shuffle=False, verbose=0)
  if reference_kind == "fit":
    reference = mlp(keras.optimizers.Adam(0.01))
  else:
    strategy = mirrored.strategy()
    with strategy.scope():
      reference = mlp(keras.optimizers.Adam(0.01))
  with mirrored.inputs_without_autotuning():
    history = reference.fit(x, y, **arguments).history
  expected = _steps_scale_and_loss(reference, history)
  model = mlp(keras.optimizers.Adam(0.01))
  got = _steps_scale_and_loss(
      model, keras_training.KerasTrainer(model).fit(x, y, **arguments).history)
  assert got[:2] == expected[:2]
  np.testing.assert_allclose(got[2], expected[2], rtol=2e-3)


@pytest.mark.parametrize("mixed_policy", ["mixed_float16"], indirect=True)
def test_loss_scale_skips_overflowing_steps_and_grows_as_keras(mixed_policy):
  # A first scale of 2**30 overflows float16 gradients: the scale halves on
  # each such step, which leaves the weights alone, and doubles after 2
  # finite steps in a row.
  def model_with_loss_scale():
    model = mlp()
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=2.0**30,
            dynamic_growth_steps=2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

  x, y = data(seed=14)
  reference = model_with_loss_scale()
  assert isinstance(reference.optimizer, keras.optimizers.LossScaleOptimizer)
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           verbose=0).history
  model = model_with_loss_scale()
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  assert_same_run(model, history, reference, expected, rtol=2e-2, atol=2e-3)
  scale = float(model.optimizer.dynamic_scale.numpy())
  assert scale == float(reference.optimizer.dynamic_scale.numpy())
  assert scale < 2.0**30
  assert int(model.optimizer.iterations.numpy()) == int(
      reference.optimizer.iterations.numpy())


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov_weight_decay": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True,
                                              ema_momentum=0.9),
    "adam_ema_overwrite": lambda: keras.optimizers.Adam(
        0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    "adam_gradient_accumulation": lambda: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=2),
    "rmsprop_global_clipnorm": lambda: keras.optimizers.RMSprop(
        0.01, global_clipnorm=1.0),
    "given_loss_scale_optimizer": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01)),
}


@pytest.mark.parametrize("mixed_policy", ["float32", "mixed_float16"],
                         indirect=True)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_options_train_as_keras_fit(optimizer, mixed_policy):
  # The policy is set before the models are built; under mixed_float16
  # Keras wraps each optimizer (but a LossScaleOptimizer) in one.
  x, y = data(seed=18, rows=64)
  reference = mlp(OPTIMIZERS[optimizer]())
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           verbose=0).history
  model = mlp(OPTIMIZERS[optimizer]())
  assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (
      mixed_policy == "mixed_float16" or optimizer.startswith("given"))
  history = keras_training.KerasTrainer(model).fit(
      x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  # float16 activations round differently in the devices' programs.
  rtol, atol = {"float32": (1e-5, 1e-6),
                "mixed_float16": (2e-2, 2e-3)}[mixed_policy]
  assert_same_run(model, history, reference, expected, rtol=rtol, atol=atol)
  for got, want in zip(model.optimizer.variables,
                       reference.optimizer.variables):
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(want, np.float32), rtol=rtol,
                               atol=atol, err_msg=got.path)


# --- a model's own test and predict steps -----------------------------------


class CustomTestStep(keras.Model):

  def test_step(self, data):
    return super().test_step(data)


class CustomPredictStep(keras.Model):

  def predict_step(self, data):
    return super().predict_step(data)


def _compiled(cls):
  keras.utils.set_random_seed(4)
  inputs = keras.Input((FEATURES,))
  model = cls(inputs, keras.layers.Dense(CLASSES)(inputs))
  model.compile(optimizer="sgd", loss="mse")
  return model


def test_a_models_own_test_step_runs_in_evaluate_and_validation():
  x, _ = data()
  y = np.zeros((EXAMPLES, CLASSES), np.float32)
  model = _compiled(CustomTestStep)
  trainer = keras_training.KerasTrainer(model)
  reference = _compiled(CustomTestStep)
  np.testing.assert_allclose(
      trainer.evaluate(x, y, batch_size=BATCH),
      reference.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)
  history = trainer.fit(x, y, batch_size=BATCH, validation_split=0.5,
                        shuffle=False, verbose=0).history
  expected = reference.fit(x, y, batch_size=BATCH, validation_split=0.5,
                           shuffle=False, verbose=0).history
  for name in ("loss", "val_loss"):
    np.testing.assert_allclose(history[name], expected[name], rtol=1e-5,
                               err_msg=name)


def test_a_models_own_predict_step_runs_in_predict():
  model = _compiled(CustomPredictStep)
  x = data()[0][:45]
  np.testing.assert_allclose(
      keras_training.KerasTrainer(model).predict(x, batch_size=BATCH),
      model.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-6)
