"""Trains a small Keras classifier data-parallel on 8 devices, then on one.

The data is scikit-learn's handwritten digits (1,797 8x8 images, shipped
inside the package: nothing is downloaded). The model is a plain Keras MLP,
compiled as usual; `tfspmd.adapters.data_parallel(model)` makes its own
`model.fit` train it through `tfspmd.pmap`, each global batch split over the
devices, printing Keras' per-epoch lines. The same model from the same
weights is then trained by Keras' own `model.fit` on one device, and the
last line compares the two.

Run: python examples/train_digits.py [--epochs N] [--out PATH]
(8 logical CPU devices unless TFSPMD_NUM_CPU_DEVICES says otherwise.)
"""

import argparse
import os
import time

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

import keras
import tfspmd
from tfspmd.adapters import data_parallel
# pylint: enable=g-import-not-at-top,wrong-import-position

GLOBAL_BATCH = 96
TRAIN_EXAMPLES = 1440  # 15 global batches of 96: 12 examples per device
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "output", "train_digits_loss.png")


def load_digits():
  """Train and test splits of the digits, pixels scaled to [0, 1]."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  digits = datasets.load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  train, test = order[:TRAIN_EXAMPLES], order[TRAIN_EXAMPLES:]
  return (x[train], y[train]), (x[test], y[test])


def train_dataset(x, y):
  """Global batches, reshuffled every epoch, repeated: one endless stream.

  Both runs read it through one iterator with steps_per_epoch, so they see
  the same batches in the same order. (Keras' fit of a finite dataset makes
  two iterators per epoch and so skips every other shuffle.)
  """
  dataset = tf.data.Dataset.from_tensor_slices((x, y))
  dataset = dataset.shuffle(len(x), seed=1, reshuffle_each_iteration=True)
  return dataset.batch(GLOBAL_BATCH).repeat()


def make_model(weights=None):
  model = keras.Sequential([
      keras.Input((64,)),
      keras.layers.Dense(128, activation="relu"),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(10),
  ])
  model.compile(
      optimizer=keras.optimizers.Adam(2e-3),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], steps_per_execution=5)
  if weights is not None:
    model.set_weights(weights)
  return model


def plot(histories, path):
  """Writes the per-epoch loss and accuracy of each run to a PNG."""
  import matplotlib  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  figure, (loss_axes, accuracy_axes) = pyplot.subplots(1, 2, figsize=(9, 3.5))
  for (label, history), style in zip(histories.items(), ("-o", "--x")):
    epochs = np.arange(1, len(history["loss"]) + 1)
    loss_axes.plot(epochs, history["loss"], style, label=label)
    accuracy_axes.plot(epochs, history["accuracy"], style, label=label)
  loss_axes.set(xlabel="epoch", ylabel="training loss", yscale="log")
  accuracy_axes.set(xlabel="epoch", ylabel="training accuracy")
  loss_axes.legend()
  figure.suptitle("Keras MLP on scikit-learn digits")
  figure.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  figure.savefig(path, dpi=100)
  pyplot.close(figure)


def run(epochs, out, verbose=1):
  """Trains both ways; returns what the closing lines report."""
  (x, y), (x_test, y_test) = load_digits()
  keras.utils.set_random_seed(0)
  weights = make_model().get_weights()
  devices = tfspmd.local_device_count()
  print(f"{len(x)} training and {len(x_test)} test digits; global batch "
        f"{GLOBAL_BATCH} = {devices} devices x {GLOBAL_BATCH // devices}")

  print(f"\n# data-parallel on {devices} devices "
        f"(tfspmd.adapters.data_parallel)")
  model = data_parallel(make_model(weights))
  start = time.perf_counter()
  steps = len(x) // GLOBAL_BATCH
  parallel = model.fit(train_dataset(x, y), epochs=epochs,
                       steps_per_epoch=steps,
                       verbose=2 if verbose else 0).history
  parallel_seconds = time.perf_counter() - start
  # One batch of all test digits, padded with rows that count nowhere to a
  # multiple of the devices: the accuracy counts the real digits only.
  test = model.evaluate(x_test, y_test, batch_size=len(x_test),
                        return_dict=True, verbose=0)
  print(f"test accuracy {test['accuracy']:.4f}; trained in "
        f"{parallel_seconds:.1f} s")

  print("\n# the same training on one device (keras Model.fit)")
  single_model = make_model(weights)
  start = time.perf_counter()
  single = single_model.fit(train_dataset(x, y), epochs=epochs,
                            steps_per_epoch=steps, shuffle=False,
                            verbose=2 if verbose else 0).history
  single_seconds = time.perf_counter() - start

  plot({f"{devices} devices (pmap)": parallel, "1 device (model.fit)": single},
       out)
  differences = {
      "loss": np.max(np.abs(np.subtract(parallel["loss"], single["loss"]))),
      "accuracy": np.max(np.abs(np.subtract(parallel["accuracy"],
                                            single["accuracy"]))),
      "weights": max(np.max(np.abs(a - b)) for a, b in zip(
          model.get_weights(), single_model.get_weights())),
  }
  same = all(d <= 1e-5 for d in differences.values())
  print(f"\nloss curve: {out}")
  print(f"{devices} devices vs 1 device after {epochs} epochs: loss "
        f"{parallel['loss'][-1]:.6f} vs {single['loss'][-1]:.6f}, accuracy "
        f"{parallel['accuracy'][-1]:.4f} vs {single['accuracy'][-1]:.4f}; "
        f"largest difference: loss {differences['loss']:.1e}, accuracy "
        f"{differences['accuracy']:.1e}, weights {differences['weights']:.1e} "
        f"-> {'the same' if same else 'NOT the same'} to 1e-5 "
        f"({parallel_seconds:.1f} s vs {single_seconds:.1f} s)")
  return dict(parallel=parallel, single=single, test=test,
              differences=differences, same=same,
              parallel_seconds=parallel_seconds,
              single_seconds=single_seconds)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=12)
  parser.add_argument("--out", default=DEFAULT_OUT,
                      help="where to write the loss-curve PNG")
  options = parser.parse_args(argv)
  result = run(options.epochs, options.out)
  if not result["same"]:
    raise SystemExit("the 8-device and 1-device runs differ by more than 1e-5")
  return result


if __name__ == "__main__":
  main()
