"""Every example of the seed documents gives the seed's numbers."""

import numpy as np
import pytest

from examples import seed_examples


def test_squares():
  np.testing.assert_array_equal(seed_examples.squares(), np.arange(8) ** 2)


def test_batched_dot_on_three_devices():
  x = np.arange(3 * 2 * 2.).reshape((3, 2, 2))
  y = x ** 2
  expected = np.array([[[4., 9.], [12., 29.]],
                       [[244., 345.], [348., 493.]],
                       [[1412., 1737.], [1740., 2141.]]])
  np.testing.assert_allclose(expected, np.einsum("bij,bjk->bik", x, y))
  out = seed_examples.batched_dot()
  np.testing.assert_allclose(out, expected)
  assert [d.id for d in out.devices()] == [0, 1, 2]


def test_nine_replicas_on_eight_devices():
  message = seed_examples.too_many_replicas()
  assert "requires 9 replicas, but only 8 devices are available" in message


def test_broadcast_argument():
  first, second = seed_examples.broadcast_argument()
  np.testing.assert_allclose(first, [4., 5.])
  np.testing.assert_allclose(second, [8., 8.])


def test_normalize_by_psum():
  out = seed_examples.normalize_by_psum()
  np.testing.assert_allclose(out, [0., 0.16666667, 0.33333334, 0.5], rtol=1e-6)
  assert np.sum(out) == pytest.approx(1.0)


def test_nested_normalize_on_a_4x2_mesh():
  x = np.arange(8.).reshape((4, 2))
  row_normed, col_normed, doubly_normed = seed_examples.nested_normalize()
  np.testing.assert_allclose(row_normed, x / x.sum(0, keepdims=True), rtol=1e-6)
  np.testing.assert_allclose(col_normed, x / x.sum(1, keepdims=True), rtol=1e-6)
  np.testing.assert_allclose(doubly_normed, x / x.sum(), rtol=1e-6)
  np.testing.assert_allclose(np.sum(row_normed, 0), [1., 1.], rtol=1e-6)
  np.testing.assert_allclose(np.sum(col_normed, 1), [1., 1., 1., 1.], rtol=1e-6)
  assert np.sum(doubly_normed) == pytest.approx(1.0)
  assert row_normed.placement.spec == ("axis_0", "axis_1")


def test_device_subsets():
  first, last = seed_examples.device_subsets()
  np.testing.assert_allclose(first, np.arange(6.) / 15., rtol=1e-6)
  np.testing.assert_allclose(last, [13., 13.])
  assert [d.id for d in first.devices()] == [0, 1, 2, 3, 4, 5]
  assert [d.id for d in last.devices()] == [6, 7]


def test_tutorial_scale_by_two(capsys):
  out = seed_examples.tutorial_scale_by_two(8)
  np.testing.assert_array_equal(out, np.arange(32).reshape(8, 4) * 2)
  assert capsys.readouterr().out.count("Compiling and running") == 1


def test_tutorial_scale_and_add():
  out = seed_examples.tutorial_scale_and_add(8)
  np.testing.assert_allclose(out, np.arange(32.).reshape(8, 4) * 2 + 100.)


def test_tutorial_scale_and_sum():
  scaled, total = seed_examples.tutorial_scale_and_sum(8)
  np.testing.assert_array_equal(scaled, np.arange(32).reshape(8, 4) * 2)
  np.testing.assert_array_equal(total, np.full(8, np.sum(np.arange(32) * 2)))
  assert int(total[0]) == 992


def test_named_axis_computation():
  out = seed_examples.named_axis_computation()
  assert out.shape == (4, 5)
  np.testing.assert_array_equal(out, np.arange(20).reshape(4, 5) * 2)


def test_main_prints_every_example(capsys):
  seed_examples.main()
  printed = capsys.readouterr().out
  for expected in ["[ 0  1  4  9 16 25 36 49]", "requires 9 replicas",
                   "[13. 13.]", "Sum computed by pmap (device 0): 992"]:
    assert expected in printed
