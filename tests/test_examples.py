"""The examples run and give the numbers they claim."""

import json
import os
import sys

import numpy as np
import pytest

from child_process import run_python
from examples import model_parallel
from examples import ring_allreduce
from examples import train_digits


# In a process of its own, as its users run it: after hundreds of other
# programs in one process, DTensor (TF 2.21) can refuse the names it gives
# this training loop's functions at every try (README, on the names of the
# functions DTensor makes of loops; tests/test_dtensor_names.py).
_TRAIN_DIGITS = """
import json
from examples import train_digits
result = train_digits.main(["--epochs", "2", "--out", {out!r}])
print("RESULT", json.dumps(dict(
    same=bool(result["same"]),
    differences={{k: float(v) for k, v in result["differences"].items()}},
    loss=[float(v) for v in result["parallel"]["loss"]],
    accuracy=float(result["test"]["accuracy"]))))
"""


def test_train_digits_equals_one_device_and_writes_the_loss_curve(tmp_path):
  out = tmp_path / "loss.png"
  printed = run_python(_TRAIN_DIGITS.format(out=str(out)), timeout=600,
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p)
                       ).stdout
  result = json.loads(printed.split("RESULT ", 1)[1])
  assert result["same"]
  assert all(gap <= 1e-5 for gap in result["differences"].values())
  assert len(result["loss"]) == 2
  assert result["loss"][1] < result["loss"][0]
  assert result["accuracy"] > 0.8
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Keras' per-epoch lines, from both runs.
  assert printed.count("Epoch 2/2") == 2 and " - accuracy: " in printed
  assert f"loss curve: {out}" in printed
  assert "-> the same to 1e-5" in printed


# In a process of its own: it makes a MirroredStrategy of its own.
_CUSTOM_TRAINING_LOOP = """
import json
from examples import custom_training_loop
results, differences = custom_training_loop.main(["--epochs", "2"])
print("RESULT", json.dumps(dict(
    losses={name: [float(v) for v in losses]
            for name, (losses, _) in results.items()},
    differences={name: [float(v) for v in pair]
                 for name, pair in differences.items()})))
"""


def test_the_custom_training_loop_follows_mirrored_strategy():
  printed = run_python(_CUSTOM_TRAINING_LOOP, timeout=600,
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p)
                       ).stdout
  result = json.loads(printed.split("RESULT ", 1)[1])
  mirrored = np.array(result["losses"]["MirroredStrategy"])
  assert mirrored.shape == (30,) and mirrored[-1] < mirrored[0] / 2
  for name in ("tfspmd.pmap", "tfspmd.pmap, 5 steps a call"):
    np.testing.assert_allclose(result["losses"][name], mirrored, atol=1e-5)
    loss_gap, weight_gap = result["differences"][name]
    assert loss_gap <= 1e-5 and weight_gap <= 1e-4
  assert "-> the same to 1e-05 and 1e-04" in printed


def test_digits_ship_with_scikit_learn():
  (x, y), (x_test, y_test) = train_digits.load_digits()
  assert x.shape == (1440, 64) and x_test.shape == (357, 64)
  assert set(np.unique(y)) == set(range(10))
  assert 0 <= x.min() and x.max() <= 1


def test_model_parallel_mlp_equals_one_device():
  result = model_parallel.run(steps=3)
  assert all(gap < 1e-5 for gap in result["gaps"].values()), result["gaps"]
  assert result["losses"][-1] < result["losses"][0]
  assert result["output"].placement.spec[:2] == ("axis_0", "axis_1")


@pytest.mark.parametrize("devices, length", [(8, 16), (3, 6)])
def test_ring_all_reduce_equals_psum_and_numpy(devices, length):
  x = np.arange(devices * length, dtype=np.int32).reshape(devices, length)
  ring, psum = ring_allreduce.both_ways(x ** 2)
  expected = np.broadcast_to((x ** 2).sum(0), x.shape)
  np.testing.assert_array_equal(ring, expected)
  np.testing.assert_array_equal(psum, expected)


def test_ring_all_reduce_of_floats_is_close_to_psum():
  x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
  ring, psum = ring_allreduce.both_ways(x)
  np.testing.assert_allclose(ring, psum, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ring, np.broadcast_to(x.sum(0), x.shape),
                             rtol=1e-5, atol=1e-5)
