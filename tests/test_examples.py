"""The examples run and give the numbers they claim."""

import numpy as np
import pytest

from examples import model_parallel
from examples import ring_allreduce
from examples import train_digits


def test_train_digits_equals_one_device_and_writes_the_loss_curve(
    tmp_path, capsys):
  out = tmp_path / "loss.png"
  result = train_digits.main(["--epochs", "2", "--out", str(out)])
  assert result["same"]
  assert all(gap <= 1e-5 for gap in result["differences"].values())
  assert len(result["parallel"]["loss"]) == 2
  assert result["parallel"]["loss"][1] < result["parallel"]["loss"][0]
  assert result["test"]["accuracy"] > 0.8
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  printed = capsys.readouterr().out
  assert "Epoch 2/2" in printed and "━" in printed  # Keras' progress bar
  assert f"loss curve: {out}" in printed
  assert "-> the same to 1e-5" in printed


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
