"""A training loop's state goes out of one call and into the next: one compile.

The state of a loop (weights, a bias of three, a step count, a loss average
that starts moving after a warm-up) leaves each call replicated or mapped
and comes back into the next, as a ShardedArray, through NumPy or through
device_put. DTensor folds small replicated inputs into its program (each
first change of one was another lowering and compile), and its expanded
programs' outputs report other devices than arrays placed from the host
(the first call fed with outputs compiled again). Each test runs ten steps
and checks that no call after the first lowered or compiled anything, and
that the values are NumPy's.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src.core import tf_internal
from tfspmd.sharding import NamedSharding
from tfspmd.sharding import PartitionSpec as P

DEVICES, ROWS, FEATURES, OUTPUTS, STEPS, WARM_UP = 8, 2, 4, 3, 10, 3


def initial_state():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32),
          "b": np.zeros(OUTPUTS, np.float32),
          "count": np.int32(0),
          "average": np.float32(0.0)}


def batches():
  rng = np.random.default_rng(1)
  return rng.normal(size=(DEVICES, ROWS, FEATURES)).astype(np.float32)


def step(state, x, axis):
  """One step on one device: its rows' squared outputs, gradients averaged."""
  w, b = state["w"], state["b"]
  with tf.GradientTape() as tape:
    tape.watch([w, b])
    y = tf.matmul(x, w) + b
    loss = tf.reduce_mean(y * y)
  grad_w, grad_b = lax.pmean(tape.gradient(loss, [w, b]), axis)
  loss = lax.pmean(loss, axis)
  rate = 0.1 / tf.cast(state["count"] + 1, tf.float32)
  average = tf.where(state["count"] >= WARM_UP,
                     0.9 * state["average"] + 0.1 * loss, state["average"])
  return {"w": w - rate * grad_w, "b": b - rate * grad_b,
          "count": state["count"] + 1, "average": average}, loss


def numpy_loop(state, x):
  """The same steps in float64 NumPy: the losses and the last state."""
  w, b = state["w"].astype(np.float64), state["b"].astype(np.float64)
  count, average, losses = 0, 0.0, []
  for _ in range(STEPS):
    y = x @ w + b  # (devices, rows, outputs)
    scale = 2.0 / (ROWS * OUTPUTS)
    grad_w = np.mean([scale * x[d].T @ y[d] for d in range(DEVICES)], axis=0)
    grad_b = np.mean([scale * y[d].sum(0) for d in range(DEVICES)], axis=0)
    loss = np.mean(y * y)
    rate = 0.1 / (count + 1)
    if count >= WARM_UP:
      average = 0.9 * average + 0.1 * loss
    w, b, count = w - rate * grad_w, b - rate * grad_b, count + 1
    losses.append(loss)
  return losses, {"w": w, "b": b, "count": count, "average": average}


def run_loop(call, state, x, between=lambda state: state):
  """Ten calls: the losses, the last state, and what calls 2-10 made.

  What they made is `(DTensor lowerings, compiled functions)`.
  """
  losses = []
  for number in range(STEPS):
    if number == 1:
      before = tf_internal.dtensor_lowerings_and_kernels()
    state, loss = call(between(state) if number else state, x)
    losses.append(np.asarray(loss).reshape(-1)[0])
  after = tf_internal.dtensor_lowerings_and_kernels()
  return losses, state, (after[0] - before[0], after[1] - before[1])


def one_copy(value, mapped):
  """A state leaf as one device holds it: mapped leaves hold one per device."""
  value = np.asarray(value)
  if not mapped:
    return value
  for copy in value[1:]:
    np.testing.assert_array_equal(copy, value[0])
  return value[0]


def check(x, losses, state, made, mapped=False):
  expected_losses, expected = numpy_loop(initial_state(), x)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  for name, value in expected.items():
    np.testing.assert_allclose(one_copy(state[name], mapped), value,
                               rtol=1e-5, atol=1e-6)
  assert made == (0, 0), (
      f"calls 2-{STEPS} made {made[0]} DTensor lowerings and compiled "
      f"{made[1]} functions")


def test_replicated_state_in_and_out():
  # As a Flax loop ported by a new user: NumPy state in with in_axes=None,
  # ShardedArrays out with out_axes=None and back in.
  call = tfspmd.pmap(lambda s, x: step(s, x, "i"), "i", in_axes=(None, 0),
                     out_axes=(None, None))
  x = batches()
  check(x, *run_loop(call, initial_state(), x))


def test_state_through_numpy_between_steps():
  call = tfspmd.pmap(lambda s, x: step(s, x, "i"), "i", in_axes=(None, 0),
                     out_axes=(None, None))
  x = batches()
  check(x, *run_loop(
      call, initial_state(), x,
      between=lambda s: {k: np.asarray(v) for k, v in s.items()}))


def test_state_mapped_as_flax_replicates_it():
  call = tfspmd.pmap(lambda s, x: step(s, x, "i"), "i")
  state = tfspmd.device_put_replicated(initial_state(), tfspmd.devices())
  x = batches()
  losses, state, made = run_loop(call, state, x)
  check(x, losses, state, made, mapped=True)


@pytest.mark.parametrize("placed", [False, True])
def test_replicated_state_of_a_shard_map(placed):
  mesh = tfspmd.make_mesh((DEVICES,), ("i",))
  call = tfspmd.shard_map(lambda s, x: step(s, x[0], "i"), mesh=mesh,
                          in_specs=(P(), P("i")), out_specs=(P(), P()))
  state = initial_state()
  if placed:
    state = tfspmd.device_put(state, NamedSharding(mesh, P()))
  x = batches()
  check(x, *run_loop(call, state, x))


def test_replicated_state_over_a_mesh_of_two_axes():
  mesh = tfspmd.make_mesh((2, 4), ("data", "model"))

  def two_axes(s, x):
    return step(s, x[0, 0], ("data", "model"))

  call = tfspmd.shard_map(two_axes, mesh=mesh,
                          in_specs=(P(), P("data", "model")),
                          out_specs=(P(), P()))
  x = batches()
  check(x, *run_loop(lambda s, x: call(s, x.reshape((2, 4) + x.shape[1:])),
                     initial_state(), x))
