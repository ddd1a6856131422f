"""Per-device randomness: stateless random ops with a seed per device.

The reference is the same TensorFlow op run with each device's seed, one
device at a time: eagerly where DTensor's executor runs the programs, and
compiled by XLA where the host executor does (XLA draws other numbers for
the same seed, as `tf.function(jit_compile=True)` does).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

from executors import as_the_program_runs

N = 8
KEYS = np.stack([np.array([k, 11], np.int32) for k in range(N)])
SEED = np.array([3, 4], np.int32)


def eager_per_device(draw, seeds):
  draw = as_the_program_runs(draw)
  return np.stack([draw(tf.constant(seed)).numpy() for seed in seeds])


def folded_seeds():
  fold_in = as_the_program_runs(tf.random.experimental.stateless_fold_in)
  return [fold_in(SEED, k).numpy() for k in range(N)]


DRAWS = {
    "normal": lambda seed: tf.random.stateless_normal([2, 3], seed=seed),
    "uniform": lambda seed: tf.random.stateless_uniform([5], seed=seed),
    "uniform_int": lambda seed: tf.random.stateless_uniform(
        [4], seed=seed, minval=0, maxval=100, dtype=tf.int32),
    "truncated_normal": lambda seed: tf.random.stateless_truncated_normal(
        [3], seed=seed),
    "v1_op": lambda seed: tf.raw_ops.StatelessRandomNormal(shape=[3],
                                                           seed=seed),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_a_key_per_device(name):
  out = np.asarray(tfspmd.pmap(DRAWS[name], "i")(KEYS))
  np.testing.assert_array_equal(out, eager_per_device(DRAWS[name], KEYS))
  assert len({row.tobytes() for row in out}) == N


def test_a_seed_folded_with_axis_index():
  draw = DRAWS["normal"]
  out = np.asarray(tfspmd.pmap(
      lambda x, seed: x + draw(tf.random.experimental.stateless_fold_in(
          seed, lax.axis_index("i"))), "i", in_axes=(0, None))(
              np.zeros((N, 2, 3), np.float32), SEED))
  np.testing.assert_array_equal(out, eager_per_device(draw, folded_seeds()))


def test_keys_split_per_device():
  out = np.asarray(tfspmd.pmap(
      lambda key: tf.random.experimental.stateless_split(key, 3)[2], "i")(KEYS))
  expected = np.stack([tf.random.experimental.stateless_split(k, 3)[2].numpy()
                       for k in KEYS])
  np.testing.assert_array_equal(out, expected)


def test_per_device_dropout_keeps_the_scale():
  x = np.ones((N, 64), np.float32)
  out = np.asarray(tfspmd.pmap(
      lambda v, seed: tf.nn.experimental.stateless_dropout(
          v, 0.5, seed=tf.random.experimental.stateless_fold_in(
              seed, lax.axis_index("i"))), "i", in_axes=(0, None))(x, SEED))
  expected = eager_per_device(
      lambda seed: tf.nn.experimental.stateless_dropout(
          tf.ones(64), 0.5, seed=seed), folded_seeds())
  np.testing.assert_array_equal(out, expected)
  assert set(np.unique(out)) <= {0., 2.}


def test_debug_mode_draws_the_same_numbers(dtensor_executor):
  # Debug mode runs TensorFlow's kernels, as DTensor's executor does on CPU.
  del dtensor_executor  # unused
  draw = DRAWS["uniform"]
  compiled = np.asarray(tfspmd.pmap(draw, "i")(KEYS))
  debugged = np.asarray(tfspmd.pmap(draw, "i", debug=True)(KEYS))
  np.testing.assert_array_equal(compiled, debugged)


def test_random_in_a_loop_with_a_per_device_key():
  def walk(key):
    def step(k, position):
      noise = tf.random.stateless_normal(
          [2], seed=tf.random.experimental.stateless_fold_in(key, k))
      return k + 1, position + lax.pmean(noise, "i")
    return tf.while_loop(lambda k, _: k < 3, step, (0, tf.zeros(2)))[1]

  draw = as_the_program_runs(lambda key, t: tf.random.stateless_normal(
      [2], seed=tf.random.experimental.stateless_fold_in(key, t)))
  noise = np.stack([[draw(key, t).numpy() for t in range(3)] for key in KEYS])
  expected = np.broadcast_to(noise.mean(0).sum(0), (N, 2))
  np.testing.assert_allclose(tfspmd.pmap(walk, "i")(KEYS), expected,
                             rtol=1e-5, atol=1e-6)


def test_generator_seeds_made_outside_one_column_per_device():
  seeds = tf.random.Generator.from_seed(5).make_seeds(N)
  out = np.asarray(tfspmd.pmap(
      lambda seed: tf.random.stateless_normal([3], seed=seed), "i",
      in_axes=1)(seeds))
  draw = lambda seed: tf.random.stateless_normal([3], seed=seed)
  np.testing.assert_array_equal(out, eager_per_device(draw,
                                                      np.asarray(seeds).T))
