"""tfspmd.adapters._keras_internal: a Keras that moved a private name is a clear error.

The adapters accept any Keras that keeps the private names they use where the
tested versions keep them (tests/keras_versions.sh reruns the adapters' tests
on each). These tests take a name away and check the error names it, the
installed Keras version and the tested versions.
"""

import re
import types

import pytest
import tensorflow as tf

import keras
from keras.src.optimizers.base_optimizer import BaseOptimizer
from tfspmd.adapters import _keras_internal
from tfspmd.adapters import keras_training


def expect_unsupported(*missing_names):
  """`pytest.raises` for the error naming `missing_names`, in that order."""
  return pytest.raises(
      ImportError,
      match=re.escape(
          f"the installed Keras {keras.__version__} does not have (moved or "
          f"removed): {', '.join(missing_names)}. tfspmd.adapters is tested with "
          f"Keras {', '.join(_keras_internal.TESTED_KERAS_VERSIONS)}"))


def test_installed_keras_has_every_private_class():
  classes = _keras_internal.import_private_classes()
  assert classes["TensorFlowTrainer"] is _keras_internal.TensorFlowTrainer
  assert classes["BaseOptimizer"] is BaseOptimizer
  assert classes["BatchNormalization"] is keras.layers.BatchNormalization


def test_missing_methods_are_named(monkeypatch):
  monkeypatch.delattr(BaseOptimizer, "_backend_update_step")
  monkeypatch.delattr(BaseOptimizer, "_var_key")
  prefix = "keras.src.optimizers.base_optimizer.BaseOptimizer"
  with expect_unsupported(f"{prefix}._backend_update_step",
                          f"{prefix}._var_key"):
    _keras_internal.import_private_classes()


def test_missing_module_and_class_are_named():
  moved = (("keras.src.trainers.moved_away", "Trainer", ("fit",)),
           ("keras.layers", "RemovedLayer", ("call",)))
  with expect_unsupported("keras.src.trainers.moved_away",
                          "keras.layers.RemovedLayer"):
    _keras_internal.import_private_classes(moved)


def test_module_failing_on_another_import_is_not_blamed_on_keras(
    tmp_path, monkeypatch):
  (tmp_path / "needs_absent_dependency.py").write_text(
      "import absent_dependency_of_a_keras_module\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ModuleNotFoundError,
                     match="absent_dependency_of_a_keras_module"):
    _keras_internal.import_private_classes(
        (("needs_absent_dependency", "Trainer", ()),))


def compiled_model():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5),
                            keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  return model


def test_compiled_model_has_every_private_attribute():
  model = compiled_model()
  _keras_internal.check_instance_attributes(model)
  _keras_internal.build(model, (tf.TensorSpec((None, 3), tf.float32),
                                tf.TensorSpec((None, 1), tf.float32)))
  assert _keras_internal.seed_state_positions(model)


def test_trainer_names_a_missing_model_attribute(monkeypatch):
  model = compiled_model()
  monkeypatch.delattr(model, "_compile_metrics")
  with expect_unsupported("keras.Model._compile_metrics"):
    keras_training.KerasTrainer(model)


def test_missing_instance_attributes_are_named():
  attributes = dict.fromkeys(_keras_internal.MODEL_ATTRIBUTES)
  del attributes["_loss_tracker"]
  model = types.SimpleNamespace(
      optimizer=types.SimpleNamespace(), **attributes)
  with expect_unsupported("keras.Model._loss_tracker",
                          "keras.optimizers.Optimizer._trainable_variables",
                          "keras.optimizers.Optimizer._learning_rate"):
    _keras_internal.check_instance_attributes(model)
