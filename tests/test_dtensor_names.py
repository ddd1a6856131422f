"""A program DTensor names a function for with a name already taken still runs.

DTensor (TF 2.21) names the functions it makes of a program's loops after
the loop op with a counter all programs share (`while_body`, `while1_body`,
...) and may hand out a name an earlier program's function has; the
process's one function library then refuses the new function. tfspmd lowers
such a program again under a new name. Each case runs in a new process, where
the names DTensor hands out start again from `while_body`, takes some of them
first, and checks the results against NumPy.

Without taking names first, plain DTensor programs meet the defect on their
own under glibc's allocator, which hands an op the address of one just freed:
the retry then needs the heap's freed blocks held (`heap_blocks`). The same
programs run under jemalloc and tcmalloc, which Debian's libjemalloc2 and
libtcmalloc-minimal4 provide (`.ci/test` installs them).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from child_process import run_python

# A step with a replicated carry: its loop is one DTensor makes a function of;
# the second call (carry from the first) lowers the program a second time.
_PROGRAM = """
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context
import tfspmd
from tfspmd import lax

def take(name):
  function_def = tf.function(lambda v: v * 3.0).get_concrete_function(
      tf.TensorSpec([], tf.float32)).function_def
  function_def.signature.name = name
  context.context().add_function_def(function_def)

for k in range({taken}):
  for part in ("body", "cond"):
    take(("while" if k == 0 else f"while{{k}}") + "_" + part)

def step(w, x):
  g = lax.pmean(w * x, "i")
  return w - 0.1 * g, tf.reduce_sum(g)

train = tfspmd.pmap(step, "i", steps=3, in_axes=(None, 0), out_axes=(None, 0))
x = np.arange(96, dtype=np.float32).reshape(8, 3, 4) / 96
before = tfspmd.pmap(lambda v: v * 2, "i")(np.ones((8, 2), np.float32))
w = np.ones(4, np.float32)
for call in range(2):
  try:
    w, losses = train(w, x)
  except RuntimeError as e:
    print("ERROR", " ".join(str(e).split()))
    w, losses = train(w, x)
  print("W", np.asarray(w).tolist())
  print("LOSSES", np.asarray(losses).tolist())
print("BEFORE", np.asarray(before).tolist())
print("NAMES", sorted(n for n in context.context().list_function_names()
                      if n.endswith("_body") and not n[-1].isdigit()))
"""


def _expected():
  """Weights and per-step sums after each of two calls of 3 steps, from NumPy."""
  x = np.arange(96, dtype=np.float64).reshape(8, 3, 4) / 96
  w, out = np.ones(4), []
  for _ in range(2):
    losses = np.zeros((8, 3))
    for t in range(3):
      g = (w * x[:, t]).mean(axis=0)
      losses[:, t] = g.sum()
      w = w - 0.1 * g
    out.append((w.copy(), losses))
  return out


def _check(lines):
  results = [line.split(" ", 1) for line in lines if not line.startswith(
      ("ERROR", "NAMES"))]
  values = {}
  for key, text in results:
    values.setdefault(key, []).append(np.array(eval(text)))  # pylint: disable=eval-used
  for (w, losses), got_w, got_losses in zip(_expected(), values["W"],
                                             values["LOSSES"]):
    np.testing.assert_allclose(got_w, w, rtol=1e-5)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
  np.testing.assert_array_equal(values["BEFORE"][0], np.full((8, 2), 2.0))


def test_a_name_taken_is_left_for_a_new_one():
  lines = run_python(_PROGRAM.format(taken=1), TFSPMD_EXECUTOR="dtensor").stdout.splitlines()
  _check(lines)
  assert not [line for line in lines if line.startswith("ERROR")]
  # The program's loop came back under the next name DTensor handed out.
  assert "while1_body" in lines[-1], lines[-1]


def test_names_taken_at_every_try_raise_one_error_and_the_next_call_runs():
  lines = run_python(_PROGRAM.format(taken=9), TFSPMD_EXECUTOR="dtensor").stdout.splitlines()
  _check(lines)
  errors = [line for line in lines if line.startswith("ERROR")]
  assert errors == [
      f"ERROR DTensor (TF {tf.__version__}) could not lower the function "
      "mapped over "
      "axis 'i': 8 times in a row, a name it gave a function it made of the "
      "program's loops or branches (last 'while7_cond') was already taken by "
      "an earlier program's function. Nothing ran and arrays computed before "
      "stay valid; calling it again lowers it under new names."]


# Plain DTensor programs, each with a loop DTensor makes a function of, all
# kept alive and called through tfspmd's caller. Under glibc's allocator an
# op made where a named one was freed often gets the old name; the caller
# lowers such a program again with the heap's freed blocks held.
_PLAIN_PROGRAMS = """
import contextlib
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor
import tfspmd
from tfspmd._src.executors import dtensor_calls, heap_blocks

if {release_blocks}:
  heap_blocks.freed_blocks_held = contextlib.nullcontext
taken = [0]
name_taken = dtensor_calls.name_taken
def counting(error):
  met = name_taken(error)
  taken[0] += met
  return met
dtensor_calls.name_taken = counting

mesh = dtensor.create_mesh([("i", 8)], device_type="CPU")
x = dtensor.call_with_layout(
    tf.ones, dtensor.Layout.batch_sharded(mesh, "i", 2), shape=(8, 3))
alive, failed = [], 0
for k in range({programs}):
  @tf.function(jit_compile=True)
  def program(x, k=k):
    def body(i, v):
      return i + 1, v + tf.reduce_sum(v, 0, keepdims=True) / (k + 1)
    trips = tf.cast(tf.reduce_sum(x) > 0, tf.int32) + k % 3
    return tf.while_loop(lambda i, v: i < trips, body, (0, x))[1]
  concrete = program.get_concrete_function(x)
  call = dtensor_calls.flat_caller(concrete, concrete.captured_inputs)
  try:
    with dtensor.default_mesh(mesh):
      got = np.concatenate([t.numpy() for t in dtensor.unpack(call(x))])
    np.testing.assert_allclose(
        got, np.full((8, 3), (1 + 8 / (k + 1)) ** (1 + k % 3)), rtol=1e-5)
  except tf.errors.InvalidArgumentError:
    failed += 1
  alive.append(call)
print("FAILED", failed, "TAKEN", taken[0])
"""

_ALLOCATORS = {
    "glibc": None,
    "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
}


def _plain_programs(allocator, release_blocks=False, programs=60):
  """(programs that failed every try, names found taken) in a new process."""
  env = {}
  if _ALLOCATORS[allocator]:
    env["LD_PRELOAD"] = _ALLOCATORS[allocator]
  # DTensor names the functions of the programs its executor lowers.
  env["TFSPMD_EXECUTOR"] = "dtensor"
  run = run_python(_PLAIN_PROGRAMS.format(release_blocks=release_blocks,
                                          programs=programs),
                   timeout=300, **env)
  line = run.stdout.splitlines()[-1].split()
  return int(line[1]), int(line[3])


def test_under_glibc_the_retry_needs_the_freed_blocks_held():
  # When DTensor stops naming ops by the addresses of freed ones, `taken`
  # drops to 0 here and `heap_blocks` with the retry in `flat_caller` can go.
  failed, taken = _plain_programs("glibc", release_blocks=True)
  assert taken > 0
  assert failed > 0, "the retry alone lowered every program again"


@pytest.mark.parametrize("allocator", sorted(_ALLOCATORS))
def test_every_program_runs_under_each_allocator(allocator):
  assert os.path.exists(_ALLOCATORS[allocator] or "/"), (
      f"{allocator} is not installed: bash .ci/setup installs it")
  failed, _ = _plain_programs(allocator, programs=30)
  assert failed == 0
