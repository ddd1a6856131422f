"""tf.print and tf.debugging checks inside a mapped function, as in a tf.function.

Prints happen once per device, in device order, with that device's values;
a failed check raises `tf.errors.InvalidArgumentError` with the user's
message and the device, whether or not an output depends on it. Expected
texts are written out by hand.
"""

import os
import threading
import uuid

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax


def print_file():
  """A fresh file path and the `output_stream` that makes tf.print write to it."""
  path = os.path.join("/tmp", f"tfspmd_print_{uuid.uuid4().hex}.txt")
  return path, f"file://{path}"


def printed(path):
  with open(path) as f:
    text = f.read()
  os.remove(path)
  return text


def test_print_prints_each_device_values_in_device_order():
  path, stream = print_file()

  def f(x):
    tf.print("device", lax.axis_index("i"), "x =", x, output_stream=stream)
    return x * 2

  out = tfspmd.pmap(f, "i")(np.arange(8, dtype=np.int32).reshape(4, 2))
  np.testing.assert_array_equal(np.asarray(out), [[0, 2], [4, 6], [8, 10],
                                                  [12, 14]])
  assert printed(path) == ("device 0 x = [0 1]\ndevice 1 x = [2 3]\n"
                           "device 2 x = [4 5]\ndevice 3 x = [6 7]\n")


def test_print_of_a_function_that_returns_nothing():
  path, stream = print_file()

  def f(x):
    tf.print(x + 1, output_stream=stream)
    return ()

  assert tfspmd.pmap(f, "i")(np.array([10, 20], np.int32)) == ()
  assert printed(path) == "11\n21\n"


def test_prints_happen_in_program_order_on_every_call():
  path, stream = print_file()

  def f(x):
    tf.print("first", x, output_stream=stream)
    tf.print("second", -x, output_stream=stream)
    return x

  p = tfspmd.pmap(f, "i")
  p(np.array([1, 2], np.int32))
  p(np.array([3, 4], np.int32))
  assert printed(path) == ("first 1\nfirst 2\nsecond -1\nsecond -2\n"
                           "first 3\nfirst 4\nsecond -3\nsecond -4\n")


def test_print_inside_a_cond_prints_on_the_devices_taking_the_branch():
  path, stream = print_file()

  def f(x):
    def big():
      tf.print("big", x, output_stream=stream)
      return x * 10
    return tf.cond(x > 4, big, lambda: x)

  out = tfspmd.pmap(f, "i")(np.arange(8, dtype=np.int32))
  np.testing.assert_array_equal(np.asarray(out),
                                [0, 1, 2, 3, 4, 50, 60, 70])
  assert printed(path) == "big 5\nbig 6\nbig 7\n"


def test_print_inside_a_nested_pmap_prints_per_device_row_by_row():
  path, stream = print_file()

  def inner(x):
    tf.print(lax.axis_index("r"), lax.axis_index("c"), x, output_stream=stream)
    return x

  tfspmd.pmap(tfspmd.pmap(inner, "c"), "r")(
      np.arange(6, dtype=np.int32).reshape(2, 3))
  assert printed(path) == ("0 0 0\n0 1 1\n0 2 2\n"
                           "1 0 3\n1 1 4\n1 2 5\n")


@pytest.mark.parametrize("kind", ["assert_less", "Assert", "assert_all_finite",
                                  "check_numerics"])
def test_a_failing_check_no_output_needs_raises_with_its_message(kind):
  def f(x):
    if kind == "assert_less":
      tf.debugging.assert_less(x, 5.0, message="x must stay below five")
    elif kind == "Assert":
      tf.debugging.Assert(tf.reduce_all(x < 5.0),
                          ["x must stay below five, got", x])
    elif kind == "assert_all_finite":
      tf.debugging.assert_all_finite(tf.math.log(5.0 - x),
                                     "x must stay below five")
    else:
      tf.debugging.check_numerics(tf.math.log(5.0 - x),
                                  "x must stay below five")
    return x + 1

  values = np.arange(8, dtype=np.float32)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"x must stay below five.*device 5 of the function "
                           r"mapped over axis 'i'"):
    tfspmd.pmap(f, "i")(values)


def test_the_failing_assert_message_shows_the_device_data():
  def f(x):
    tf.debugging.Assert(tf.reduce_all(x < 3.0), ["bad x", x, "end"])
    return x

  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    tfspmd.pmap(f, "i")(np.arange(8, dtype=np.float32).reshape(4, 2))
  assert str(raised.value) == (
      "assertion failed: [bad x] [2 3] [end] (on device 1 of the function "
      "mapped over axis 'i')")


def test_passing_checks_change_no_result():
  def f(x, y):
    tf.debugging.assert_less(x, 100.0, message="small")
    tf.debugging.Assert(tf.reduce_all(y >= 0), ["y", y])
    checked = tf.debugging.check_numerics(x * y, "product")
    return checked + lax.psum(x, "i")

  x = np.arange(8, dtype=np.float32).reshape(8, 1) * 1.5
  y = np.arange(8, dtype=np.float32).reshape(8, 1) + 2
  out = tfspmd.pmap(f, "i")(x, y)
  np.testing.assert_allclose(np.asarray(out), x * y + x.sum(), rtol=1e-6)


def test_assert_inside_a_cond_checks_only_where_the_branch_runs():
  def f(x):
    def checked():
      tf.debugging.assert_less(x, 6.0, message="checked branch")
      return x
    return tf.cond(x >= 4.0, checked, lambda: -x)

  p = tfspmd.pmap(f, "i")
  np.testing.assert_array_equal(
      np.asarray(p(np.array([0, 1, 2, 3, 4, 5, 0, 1], np.float32))),
      [0, -1, -2, -3, 4, 5, 0, -1])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"checked branch.*on device 6 "):
    p(np.array([0, 1, 2, 3, 4, 5, 6, 1], np.float32))


def test_print_in_a_while_loop_is_a_clear_error():
  def f(x):
    def body(k, v):
      tf.print(v)
      return k + 1, v * 2
    return tf.while_loop(lambda k, v: k < 3, body, (0, x))[1]

  with pytest.raises(ValueError, match=r"inside a tf.while_loop in the "
                     r"function mapped over axis 'i'.*Move the print or "
                     r"assertion out of the loop.*debug=True"):
    tfspmd.pmap(f, "i")(np.ones(8, np.float32))


def test_under_a_gradient_tape_the_forward_prints_once_and_checks():
  path, stream = print_file()

  def f(x):
    tf.print("forward", x, output_stream=stream)
    tf.debugging.assert_less(x, 10.0, message="too large")
    return x * x

  p = tfspmd.pmap(f, "i")
  x = tf.constant([1.0, 2.0])
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = tf.convert_to_tensor(p(x))
  np.testing.assert_allclose(tape.gradient(y, x).numpy(), [2.0, 4.0])
  assert printed(path) == "forward 1\nforward 2\n"
  with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
    with tf.GradientTape() as tape:
      tape.watch(x)
      p(x * 10.0)


def test_effects_of_a_pmap_inside_a_tf_function():
  path, stream = print_file()

  def f(x):
    tf.print("in graph", x, output_stream=stream)
    tf.debugging.assert_less(x, 5, message="in graph check")
    return x + 1

  p = tfspmd.pmap(f, "i")
  run = tf.function(lambda x: p(x))
  np.testing.assert_array_equal(np.asarray(run(tf.constant([1, 2]))), [2, 3])
  assert printed(path) == "in graph 1\nin graph 2\n"
  with pytest.raises(tf.errors.InvalidArgumentError, match="in graph check"):
    run(tf.constant([1, 7]))


def test_print_inside_a_shard_map():
  path, stream = print_file()
  mesh = tfspmd.make_mesh((4,), ("x",))

  def f(block):
    tf.print("block", block, output_stream=stream)
    return block

  tfspmd.shard_map(f, mesh=mesh, in_specs=tfspmd.P("x"), out_specs=tfspmd.P("x"))(
      np.arange(8, dtype=np.int32))
  assert printed(path) == ("block [0 1]\nblock [2 3]\nblock [4 5]\n"
                           "block [6 7]\n")


def test_two_threads_tracing_at_once_each_keep_their_own_prints():
  # Both traces are inside their mapped functions at once: each program's
  # print must be recorded by its own trace.
  both_tracing = threading.Barrier(2, timeout=60)
  outcome = {}

  def traced_with_print(name, path):
    stream = f"file://{path}"

    def f(x):
      both_tracing.wait()
      tf.print(name, x, output_stream=stream)
      return x + 1

    return f

  def run(name):
    path, _ = print_file()
    try:
      out = tfspmd.pmap(traced_with_print(name, path), "i")(
          np.arange(2, dtype=np.int32))
      outcome[name] = (np.asarray(out).tolist(), printed(path))
    except Exception as e:  # pylint: disable=broad-except
      outcome[name] = e

  threads = [threading.Thread(target=run, args=(name,))
             for name in ("first", "second")]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(120)
  assert outcome == {"first": ([1, 2], "first 0\nfirst 1\n"),
                     "second": ([1, 2], "second 0\nsecond 1\n")}
