"""Mistakes with the Keras and tf.data adapters.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import keras
import numpy as np
import tensorflow as tf

from tfspmd.adapters import keras_training
from tfspmd.adapters import tf_data

from error_catalogue import case, KERAS
import mirrored


def _tiny_model(loss="mse", metrics=None):
  # Fixed names: Keras numbers unnamed layers per process, and the messages
  # name the variables.
  model = keras.Sequential(
      [keras.Input((2,)), keras.layers.Dense(1, name="dense")], name="tiny")
  model.compile(optimizer="sgd", loss=loss, metrics=metrics)
  return model


def _xy(rows=8):
  return np.ones((rows, 2), np.float32), np.ones((rows, 1), np.float32)


def _fit(**kwargs):
  x, y = _xy()
  arguments = dict(y=y, batch_size=8, verbose=0)
  arguments.update(kwargs)
  keras_training.KerasTrainer(_tiny_model()).fit(x, **arguments)


def _model_overriding(step):
  """A compiled functional model whose class replaces Keras' `step`."""
  custom = type("CustomStep", (keras.Model,), {
      step: lambda self, data: getattr(keras.Model, step)(self, data)})
  inputs = keras.Input((2,))
  model = custom(inputs, keras.layers.Dense(1, name="dense")(inputs),
                 name="custom")
  model.compile(optimizer="sgd", loss="mse")
  return model


def _built_trainer():
  trainer = keras_training.KerasTrainer(_tiny_model())
  trainer.build(tf.data.Dataset.from_tensors(_xy()))
  return trainer, tuple(list(part) for part in trainer.state)


@case("keras-not-a-keras-model", KERAS, "KerasTrainer of a tf.Module",
      TypeError, r"`model` must be a Keras 3 `keras.Model`, got "
      r"tensorflow.*Module")
def keras_not_a_keras_model():
  keras_training.KerasTrainer(tf.Module())


@case("keras-uncompiled", KERAS, "KerasTrainer of a model never compiled",
      ValueError, r"the model '.*' is not compiled with an optimizer")
def keras_uncompiled():
  keras_training.KerasTrainer(keras.Sequential(
      [keras.Input((2,)), keras.layers.Dense(1)], name="uncompiled"))


@case("keras-x-only-with-loss", KERAS,
      "fit on a dataset of x alone for a model compiled with a loss",
      ValueError, r"KerasTrainer.fit: the batches have no targets `y`, but "
      r"the model was compiled with a loss")
def keras_x_only_with_loss():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(_xy()[0]), verbose=0)


@case("keras-string-input", KERAS, "fit on string inputs", ValueError,
      r"x\['text'\] holds strings, which cannot go onto the devices.*"
      r"StringLookup")
def keras_string_input():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(({"text": tf.constant([["a"]] * 8)},
                                    _xy()[1])), verbose=0)


@case("keras-sample-weight-shape", KERAS,
      "sample weights of shape (batch, 3) for targets of shape (batch, 1)",
      ValueError, r"sample_weight has shape \(8, 3\), which does not fit y of "
      r"shape \(8, 1\)")
def keras_sample_weight_shape():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, y, np.ones((8, 3), np.float32))),
      verbose=0)


@case("keras-elements-of-4", KERAS, "fit on elements (x, y, w, extra)",
      ValueError, r"elements must be `x`, `\(x,\)`, `\(x, y\)` or `\(x, y, "
      r"sample_weight\)`; got a tuple of 4")
def keras_elements_of_4():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, y, y[:, 0], y)), verbose=0)


@case("keras-dataset-and-y", KERAS, "fit on a dataset, with y too",
      ValueError, r"with a tf.data.Dataset, give no `y`")
def keras_dataset_and_y():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, y)), y, verbose=0)


@case("keras-arrays-without-batch-size", KERAS, "fit on arrays, no batch_size",
      ValueError, r"arrays `x` and `y` with the global `batch_size`")
def keras_arrays_without_batch_size():
  _fit(batch_size=None)


@case("keras-arrays-of-different-lengths", KERAS,
      "fit on x of 8 rows and y of 6", ValueError,
      r"the arrays have different numbers of examples \(x: 8, y: 6\)")
def keras_arrays_of_different_lengths():
  _fit(y=np.ones((6, 1), np.float32))


@case("keras-x-scalar-tensor", KERAS, "fit on a scalar tensor as x",
      ValueError, r"`x` must be an array \(or a structure of arrays\) with the "
      r"examples along axis 0, or a tf.data.Dataset; got EagerTensor")
def keras_x_scalar_tensor():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.constant(1.), _xy()[1], batch_size=8, verbose=0)


@case("keras-batch-size-zero", KERAS, "fit(batch_size=0)", ValueError,
      r"`batch_size` must be an int >= 1, got 0")
def keras_batch_size_zero():
  _fit(batch_size=0)


@case("keras-epochs-string", KERAS, "fit(epochs='3')", ValueError,
      r"`epochs` must be an int >= 0, got '3'")
def keras_epochs_string():
  _fit(epochs="3")


@case("keras-steps-per-epoch-zero", KERAS, "fit(steps_per_epoch=0)",
      ValueError, r"`steps_per_epoch` must be an int >= 1 or None, got 0")
def keras_steps_per_epoch_zero():
  _fit(steps_per_epoch=0)


@case("keras-verbose", KERAS, "fit(verbose=3)", ValueError,
      r"`verbose` must be 'auto', 0, 1 or 2, got 3")
def keras_verbose():
  _fit(verbose=3)


@case("keras-callbacks-not-a-list", KERAS, "fit(callbacks=one_callback)",
      TypeError, r"`callbacks` must be a list of keras.callbacks.Callback, got "
      r"a History")
def keras_callbacks_not_a_list():
  _fit(callbacks=keras.callbacks.History())


@case("keras-callback-not-keras", KERAS, "fit(callbacks=[a function])",
      TypeError, r"callbacks\[0\] is a builtins.function, not a Keras 3")
def keras_callback_not_keras():
  _fit(callbacks=[lambda logs: None])


@case("keras-remainder", KERAS, "fit(remainder='drop')", ValueError,
      r"KerasTrainer.fit: `remainder` must be 'error' or 'pad', got 'drop'")
def keras_remainder():
  _fit(remainder="drop")


@case("keras-steps-per-epoch-multiple", KERAS,
      "steps_per_epoch not a multiple of steps_per_execution", ValueError,
      r"steps_per_epoch=3 must be a multiple of the model's "
      r"steps_per_execution=2")
def keras_steps_per_epoch_multiple():
  model = _tiny_model()
  model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
  x, y = _xy()
  keras_training.KerasTrainer(model).fit(x, y, batch_size=8,
                                         steps_per_epoch=3, shuffle=False,
                                         verbose=0)


@case("keras-state-before-build", KERAS, "setting state before any fit",
      ValueError, r"KerasTrainer.state can be set only once the model is "
      r"built")
def keras_state_before_build():
  keras_training.KerasTrainer(_tiny_model()).state = ([], [], [], [])


@case("keras-state-dtype", KERAS, "a state value of the wrong dtype",
      TypeError, r"KerasTrainer.state\[0\]\[0\] \('.*kernel'\) must have "
      r"dtype float32, got float64")
def keras_state_dtype():
  trainer, state = _built_trainer()
  trainer.state = ([np.zeros((2, 1))] + state[0][1:],) + state[1:]


@case("keras-state-shape", KERAS, "a state value of the wrong shape",
      ValueError, r"KerasTrainer.state\[0\]\[0\] \('.*kernel'\) must have "
      r"shape \(2, 1\), got \(3, 1\)")
def keras_state_shape():
  trainer, state = _built_trainer()
  trainer.state = ([np.zeros((3, 1), np.float32)] + state[0][1:],) + state[1:]


@case("keras-state-structure", KERAS, "a state of 3 parts", ValueError,
      r"KerasTrainer.state: expected 4 lists with \[2, 0, 2, 2\] values.*got "
      r"3 parts")
def keras_state_structure():
  trainer, state = _built_trainer()
  trainer.state = state[:3]


@case("keras-own-step-undivided-batch", KERAS,
      "fit of a model with its own train_step on a batch the devices do "
      "not divide", ValueError,
      r"batch 0 has 12 examples, which does not divide by the 8 devices.*"
      r"CustomStep has its own train_step, which runs on every row it is "
      r"given, so no padding rows can be added")
def keras_own_step_undivided_batch():
  x, y = _xy(12)
  keras_training.KerasTrainer(_model_overriding("train_step")).fit(
      x, y, batch_size=12, remainder="pad", verbose=0)


@case("keras-own-step-stray-variable", KERAS,
      "a model's own train_step assigning a variable the model does not "
      "hold", ValueError,
      r"StrayAssign.train_step assigns variables that are not the model's, "
      r"its optimizer's or its metrics' \(a variable outside the model\)")
def keras_own_step_stray_variable():
  counter = keras.Variable(0.0, name="counter")

  def train_step(self, data):
    counter.assign_add(1.0)
    return keras.Model.train_step(self, data)

  custom = type("StrayAssign", (keras.Model,), {"train_step": train_step})
  inputs = keras.Input((2,))
  model = custom(inputs, keras.layers.Dense(1)(inputs))
  model.compile(optimizer="sgd", loss="mse")
  keras_training.KerasTrainer(model).fit(*_xy(), batch_size=8, verbose=0)


@case("keras-own-step-own-optimizers", KERAS,
      "a model's own train_step applying an optimizer of its own (a "
      "GAN's)", ValueError,
      r"TwoOptimizers.train_step applies the optimizer self.d_optimizer: on "
      r"several devices only the optimizer given to compile\(optimizer="
      r"\.\.\.\) has its gradients combined")
def keras_own_step_own_optimizers():
  class TwoOptimizers(keras.Model):

    def compile(self, d_optimizer, g_optimizer):
      super().compile(loss="mse")
      self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, data):
      x, y = data
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean((self(x) - y) ** 2)
      grads = tape.gradient(loss, self.trainable_weights)
      self.d_optimizer.apply(grads, self.trainable_weights)
      return {"loss": loss}

  inputs = keras.Input((2,))
  model = TwoOptimizers(inputs, keras.layers.Dense(1)(inputs))
  model.compile(keras.optimizers.Adam(), keras.optimizers.Adam())
  keras_training.KerasTrainer(model).fit(*_xy(), batch_size=8, verbose=0)


@case("keras-validation-data-tuple", KERAS,
      "fit(validation_data=(x,)), a tuple of 1", ValueError,
      r"`validation_data` must be a tuple \(x, y\) or \(x, y, "
      r"sample_weight\) of arrays, or a tf.data.Dataset of global batches; "
      r"got a tuple of 1")
def keras_validation_data_tuple():
  _fit(validation_data=(_xy()[0],))


@case("keras-validation-split-range", KERAS, "fit(validation_split=1.5)",
      ValueError, r"`validation_split` must be a float between 0 and 1 .*got "
      r"1.5")
def keras_validation_split_range():
  _fit(validation_split=1.5)


@case("keras-validation-split-dataset", KERAS,
      "fit(validation_split=...) on a tf.data.Dataset", ValueError,
      r"`validation_split` splits in-memory arrays; with a tf.data.Dataset "
      r"give `validation_data`")
def keras_validation_split_dataset():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(_xy()), validation_split=0.5, verbose=0)


@case("keras-validation-split-too-few-rows", KERAS,
      "fit(validation_split=0.95) of 8 rows", ValueError,
      r"validation_split=0.95 of 8 rows leaves no rows to train on")
def keras_validation_split_too_few_rows():
  _fit(validation_split=0.95)


@case("keras-validation-freq", KERAS, "fit(validation_freq=0)", ValueError,
      r"`validation_freq` must be an int >= 1 \(validate every that many "
      r"epochs\) or a list of epochs \(counted from 1\), got 0")
def keras_validation_freq():
  _fit(validation_data=_xy(), validation_freq=0)


@case("keras-shuffle-dataset", KERAS, "fit(dataset, shuffle=True)",
      ValueError, r"with a tf.data.Dataset, give no `shuffle`.*shuffle its "
      r"rows in the pipeline")
def keras_shuffle_dataset():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(_xy()), shuffle=True, verbose=0)


@case("keras-class-weight-type", KERAS, "fit(class_weight=[1.0, 2.0])",
      TypeError, r"`class_weight` must be a dict from class index \(an int "
      r">= 0\) to the weight of that class's rows, got \[1.0, 2.0\]")
def keras_class_weight_type():
  _fit(class_weight=[1.0, 2.0])


@case("keras-class-weight-and-sample-weight", KERAS,
      "fit(class_weight=..., sample_weight=...)", ValueError,
      r"give `class_weight` or sample weights, not both \(as model.fit\)")
def keras_class_weight_and_sample_weight():
  _fit(class_weight={0: 2.0}, sample_weight=np.ones(8, np.float32))


@case("keras-class-weight-several-targets", KERAS,
      "fit(class_weight=...) with several targets", ValueError,
      r"`class_weight` weighs the rows by a single target `y`; these batches "
      r"have several")
def keras_class_weight_several_targets():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, {"a": y, "b": y})),
      class_weight={0: 2.0}, verbose=0)


@case("keras-predict-batch-size", KERAS, "predict(batch_size=0)",
      ValueError, r"KerasTrainer.predict: `batch_size` must be an int >= 1, "
      r"got 0")
def keras_predict_batch_size():
  keras_training.KerasTrainer(_tiny_model()).predict(_xy()[0], batch_size=0)


@case("keras-predict-string-input", KERAS, "predict on string inputs",
      ValueError, r"KerasTrainer.predict: x holds strings, which cannot go "
      r"onto the devices.*StringLookup")
def keras_predict_string_input():
  keras_training.KerasTrainer(_tiny_model()).predict(np.array(["a"] * 8))


@case("keras-in-a-strategy-scope", KERAS,
      "fit inside a tf.distribute.MirroredStrategy's scope", ValueError,
      r"KerasTrainer.fit inside the scope of a tf.distribute."
      r"MirroredStrategy: .*outside any `with strategy.scope\(\):`")
def keras_in_a_strategy_scope():
  trainer = keras_training.KerasTrainer(_tiny_model())
  with mirrored.strategy().scope():
    trainer.fit(*_xy(), batch_size=8, verbose=0)


@case("device-batches-unbatched", KERAS, "device_batches of an unbatched "
      "dataset", ValueError, r"element\[1\] of `dataset` is a scalar .* "
      r"Batch it, e.g. `dataset.batch\(n\)`")
def device_batches_unbatched():
  x, y = _xy()
  tf_data.device_batches(tf.data.Dataset.from_tensor_slices((x, y[:, 0])))


@case("device-batches-sparse", KERAS, "device_batches of sparse elements",
      ValueError, r"element\[0\] of `dataset` is a sparse tensor .* "
      r"tf.sparse.to_dense")
def device_batches_sparse():
  tf_data.device_batches(tf.data.Dataset.from_tensors(
      (tf.sparse.from_dense(np.eye(8)), np.zeros(8))))


@case("device-batches-ragged", KERAS, "device_batches of ragged elements",
      ValueError, r"element\[0\] of `dataset` is a ragged tensor .*"
      r"t.to_tensor\(\)")
def device_batches_ragged():
  tf_data.device_batches(tf.data.Dataset.from_tensors(
      (tf.ragged.constant([[1.0], [2.0, 3.0]] * 4), np.zeros(8))))


@case("device-batches-not-divisible", KERAS,
      "a global batch of 4 rows on 8 devices", ValueError,
      r"batch 0 has 4 examples, which does not divide by the 8 devices.*"
      r"remainder='pad'")
def device_batches_not_divisible():
  list(tf_data.device_batches(tf.data.Dataset.from_tensors(np.ones((4, 2)))))


@case("device-batches-pad-needs-x-y", KERAS,
      "remainder='pad' on elements that are not (x, y[, w])", ValueError,
      r"remainder='pad'\) needs elements `\(x, y\)` or `\(x, y, "
      r"sample_weight\)`")
def device_batches_pad_needs_x_y():
  tf_data.device_batches(tf.data.Dataset.from_tensors(np.ones((4, 2))),
                         remainder="pad")
