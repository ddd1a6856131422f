"""tf.Variables and the mapped function: reads are broadcast, writes refused.

The expected values are NumPy arithmetic on the same numbers.
"""

import subprocess

import numpy as np
import pytest
import tensorflow as tf

import tfspmd

from child_process import run_python


def test_every_device_reads_the_variable_and_sees_later_assignments():
  scale = tf.Variable([1., 2.])
  f = tfspmd.pmap(lambda x: x * scale)
  x = np.arange(8, dtype=np.float32).reshape(4, 2)
  np.testing.assert_array_equal(f(x), x * [1., 2.])
  scale.assign([3., 4.])
  np.testing.assert_array_equal(f(x), x * [3., 4.])


def test_assigning_a_variable_inside_says_to_pass_the_state():
  total = tf.Variable([0., 0.])
  with pytest.raises(ValueError, match=r"writes to a tf.Variable \(AssignAddVariableOp\).*"
                     r"Pass the state as an argument and return its new value"):
    tfspmd.pmap(lambda x: total.assign_add(x))(np.ones((4, 2), np.float32))
  np.testing.assert_array_equal(total.numpy(), [0., 0.])


WRITE_MESSAGE = (r"the function mapped over axis 'i' writes to a tf.Variable "
                 r"\(AssignAddVariableOp\); a mapped function cannot assign "
                 r"per-device values to one variable")


def test_a_write_whose_result_nothing_reads_is_refused_too():
  # pfor vectorizes only what the outputs need: this write would vanish.
  total = tf.Variable(0.)
  with pytest.raises(ValueError, match=WRITE_MESSAGE):
    tfspmd.pmap(lambda x: (total.assign_add(tf.reduce_sum(x)), x)[1],
                "i")(np.ones((4, 2), np.float32))
  assert total.numpy() == 0.


def test_a_write_inside_a_loop_body_is_refused():
  total = tf.Variable(0.)

  def f(x):
    def body(k, acc):
      total.assign_add(1.)
      return k + 1, acc + x
    return tf.while_loop(lambda k, _: k < 3, body, (0, x))[1]

  with pytest.raises(ValueError, match=WRITE_MESSAGE):
    tfspmd.pmap(f, "i")(np.ones(4, np.float32))
  assert total.numpy() == 0.


@pytest.mark.parametrize("debug", [False, True], ids=["compiled", "debug"])
def test_debug_mode_refuses_a_write_with_the_compiled_message(debug):
  total = tf.Variable(0.)

  def f(x):
    total.assign_add(tf.reduce_sum(x))
    return x

  with pytest.raises(ValueError, match=WRITE_MESSAGE):
    tfspmd.pmap(f, "i", debug=debug)(np.ones((4, 2), np.float32))



@pytest.mark.parametrize("debug", [False, True], ids=["compiled", "debug"])
def test_an_optimizers_sparse_update_is_refused(debug):
  table = tf.Variable(np.ones((4, 2), np.float32))
  accumulator = tf.Variable(np.full((4, 2), 0.1, np.float32))

  def f(x):
    tf.raw_ops.ResourceSparseApplyAdagradV2(
        var=table.handle, accum=accumulator.handle, lr=0.1, epsilon=1e-7,
        grad=x, indices=tf.constant([1]))
    return x

  with pytest.raises(ValueError, match=r"writes to a tf.Variable "
                     r"\(ResourceSparseApplyAdagradV2\)"):
    tfspmd.pmap(f, "i", debug=debug)(np.ones((4, 1, 2), np.float32))
  np.testing.assert_array_equal(table.numpy(), np.ones((4, 2)))


def test_debug_mode_leaves_tensorflows_functions_as_they_were():
  from tensorflow.python.ops import gen_resource_variable_ops  # pylint: disable=g-import-not-at-top
  before = (gen_resource_variable_ops.assign_add_variable_op,
            tf.raw_ops.AssignAddVariableOp)
  total = tf.Variable(0.)

  def f(x):
    total.assign_add(tf.reduce_sum(x))
    return x

  with pytest.raises(ValueError, match=WRITE_MESSAGE):
    tfspmd.pmap(f, "i", debug=True)(np.ones((4, 2), np.float32))
  assert (gen_resource_variable_ops.assign_add_variable_op,
          tf.raw_ops.AssignAddVariableOp) == before
  # TensorFlow's own wrapper, not a guard around it.
  assert not hasattr(gen_resource_variable_ops.assign_add_variable_op,
                     "__wrapped__")
  total.assign_add(2.)
  assert total.numpy() == 2.

def test_debug_mode_lets_a_layer_create_and_initialize_its_weights():
  scale = []

  def f(x):
    # Creating a variable assigns its initial value: not a write to refuse.
    if not scale:
      scale.append(tf.Variable(tf.fill([2], 3.)))
    return x * scale[0]

  x = np.arange(8, dtype=np.float32).reshape(4, 2)
  out = tfspmd.pmap(f, "i", debug=True)(x[:1])
  np.testing.assert_array_equal(out, x[:1] * 3.)


def test_state_passed_as_an_argument_and_returned():
  total = tf.Variable(np.zeros((4, 2), np.float32))
  x = np.arange(8, dtype=np.float32).reshape(4, 2)
  step = tfspmd.pmap(lambda state, v: state + v)
  for _ in range(3):
    total.assign(step(total, x))
  np.testing.assert_array_equal(total.numpy(), 3 * x)


def test_an_op_whose_size_depends_on_per_device_data_is_named():
  with pytest.raises(ValueError, match="the op Unique \\(Unique\\) gets inputs "
                     "that differ between devices"):
    tfspmd.pmap(lambda v: tf.unique(v)[0][:1])(np.zeros((4, 3), np.float32))


# In a process of its own: TensorFlow hung on it (a collective and a
# variable's read in one functional loop share a rendezvous).
_READ_IN_A_LOOP_WITH_A_COLLECTIVE = """
import numpy as np
import tensorflow as tf
import tfspmd
from tfspmd import lax

rate = tf.Variable(np.full(4, 0.1, np.float32))
descend = tfspmd.pmap(lambda v: tf.while_loop(
    lambda k, a: k < 3, lambda k, a: (k + 1, a - rate * lax.pmean(a, "i")),
    (0, v))[1], "i")
print(np.asarray(descend(np.ones((8, 4), np.float32))).tolist())

def step(a):
  # The read sits in a branch of a cond in the loop steps= makes.
  scale = tf.cond(a[0] > 0, lambda: rate * 2.0, lambda: rate)
  new = a - scale * lax.pmean(a, "i")
  return new, tf.reduce_sum(new)
carry, sums = tfspmd.pmap(step, "i", steps=3)(np.ones((8, 4), np.float32))
print(np.asarray(carry).tolist())
print(np.asarray(sums).tolist())
"""


def test_a_read_inside_a_loop_with_a_collective():
  try:
    run = run_python(_READ_IN_A_LOOP_WITH_A_COLLECTIVE, check=False,
                     timeout=120)
  except subprocess.TimeoutExpired as e:
    raise AssertionError("the program did not end in 120 s") from e
  assert run.returncode == 0, run.stderr[-2000:]
  loop, carry, sums = (eval(line) for line in run.stdout.split("\n")[:3])  # pylint: disable=eval-used
  # a <- a - 0.1 mean(a) three times, from ones: every element 0.9 ** 3.
  np.testing.assert_allclose(loop, np.full((8, 4), 0.9 ** 3), rtol=1e-6)
  # a <- a - 0.2 mean(a) (a stays positive): 0.8 ** t after step t.
  np.testing.assert_allclose(carry, np.full((8, 4), 0.8 ** 3), rtol=1e-6)
  np.testing.assert_allclose(
      sums, [[4 * 0.8 ** t for t in (1, 2, 3)]] * 8, rtol=1e-6)


def test_a_value_passed_in_is_read_inside_a_loop_with_a_collective():
  rate = tf.Variable(np.full(4, 0.1, np.float32))
  descend = tfspmd.pmap(lambda v, r: tf.while_loop(
      lambda k, a: k < 3, lambda k, a: (k + 1, a - r * tfspmd.lax.pmean(a, "i")),
      (0, v))[1], "i", in_axes=(0, None))
  np.testing.assert_allclose(descend(np.ones((8, 4), np.float32), rate),
                             np.full((8, 4), 0.9 ** 3), rtol=1e-6)
