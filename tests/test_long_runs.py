"""Long runs: memory stays flat over many calls, and threads share a pmap safely."""

import gc
import os
import threading
import tracemalloc

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

from child_process import run_python

CALLS = 10_000
THREADS, CALLS_PER_THREAD = 4, 500


def rss_bytes():
  """This process's resident set size, from /proc (Linux)."""
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status")


def sgd_step(w, x, y):
  """One data-parallel least-squares step: the gradient is averaged over devices."""
  error = tf.linalg.matvec(x, w) - y
  grad = lax.pmean(2. * tf.linalg.matvec(x, error, transpose_a=True) /
                   x.shape[0], "i")
  return w - 0.01 * grad, lax.psum(tf.reduce_sum(error * error), "i")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="reads the resident set size from /proc")
def test_10000_calls_of_a_step_grow_rss_by_less_than_20_mb():
  n = tfspmd.device_count()
  step = tfspmd.pmap(sgd_step, "i", in_axes=(0, 0, 0))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, 16, 4)).astype(np.float32)
  y = x @ np.array([1., -1., 2., .5], np.float32)
  w = np.zeros((n, 4), np.float32)
  for _ in range(200):  # traces, fills TensorFlow's and the allocator's caches
    w, loss = step(w, x, y)
  np.asarray(loss)
  gc.collect()
  before = rss_bytes()
  for _ in range(CALLS):
    w, loss = step(w, x, y)  # w stays on the devices; x, y are packed anew
  final_loss = np.asarray(loss)
  gc.collect()
  growth = rss_bytes() - before
  print(f"\nRSS growth over {CALLS} calls: {growth / 2 ** 20:.2f} MiB")
  assert growth < 20 * 2 ** 20, f"RSS grew by {growth / 2 ** 20:.1f} MiB"
  # One program: w came from the host in the first call and is a ShardedArray
  # on the devices in the rest, with the same shape.
  assert len(step._programs) == 1  # pylint: disable=protected-access
  # 10,200 steps of gradient descent found the weights.
  np.testing.assert_allclose(np.asarray(w), np.tile([1., -1., 2., .5], (n, 1)),
                             atol=1e-3)
  assert final_loss[0] < 1e-4


def test_python_allocations_stay_flat_over_calls():
  """What RSS cannot tell apart from DTensor's own leak: tfspmd's objects."""
  n = tfspmd.device_count()
  step = tfspmd.pmap(sgd_step, "i")
  x = np.ones((n, 16, 4), np.float32)
  y = np.ones((n, 16), np.float32)
  w = step(np.zeros((n, 4), np.float32), x, y)[0]
  for _ in range(50):
    w, _ = step(w, x, y)
  gc.collect()
  tracemalloc.start()
  try:
    # Caches that fill once (DTensor's among them, counted where tfspmd
    # calls `pack`) fill in the first thousand calls; a leak grows in both.
    for _ in range(1000):
      w, _ = step(w, x, y)
    gc.collect()
    before = tracemalloc.take_snapshot()
    for _ in range(1000):
      w, _ = step(w, x, y)
    gc.collect()
    after = tracemalloc.take_snapshot()
  finally:
    tracemalloc.stop()
  # Allocations made in tfspmd's own files: DTensor's `pack` keeps about
  # 60 bytes a call of its own (TF 2.21), which no tfspmd change can remove.
  own = [tracemalloc.Filter(True, "*/tfspmd/*")]
  growth = sum(stat.size_diff for stat in after.filter_traces(own).compare_to(
      before.filter_traces(own), "filename"))
  assert growth < 16 * 1024, f"Python allocations grew by {growth} bytes"


def _graphs_named(prefix):
  return sum(1 for o in gc.get_objects()
             if isinstance(o, tf.Graph) and
             getattr(o, "name", "").startswith(prefix))


def test_a_traced_program_keeps_no_per_device_graph():
  """The per-device graph goes once its program is built, used or not.

  A collective's gradient (psum's transpose, taken by a tape inside the
  mapped function) is kept by its op, not by TensorFlow's process-wide
  gradient registry, which held every such graph for the rest of the
  process.
  """
  n = tfspmd.device_count()
  x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
  gc.collect()
  before = _graphs_named("tfspmd_per_device")

  def differentiated(scale):
    def per_device(v):
      with tf.GradientTape() as tape:
        tape.watch(v)
        total = lax.psum(v * scale, "i")
        loss = tf.reduce_sum(
            tf.while_loop(lambda k, t: k < 2,
                          lambda k, t: (k + 1, lax.psum(t, "i") / n),
                          (0, total), maximum_iterations=2)[1])
      return tape.gradient(loss, v)
    return tfspmd.pmap(per_device, "i")

  held = [differentiated(float(k)) for k in range(1, 6)]
  for k, mapped in enumerate(held, start=1):
    # d/dv of sum(psum(psum(psum(v*k))/n)/n) = n*k at every element.
    np.testing.assert_allclose(np.asarray(mapped(x)),
                               np.full((n, 3), n * k, np.float32))
  gc.collect()
  assert _graphs_named("tfspmd_per_device") == before


def test_threads_share_one_pmapped_function():
  n = tfspmd.device_count()
  f = tfspmd.pmap(lambda x, k: (lax.psum(x, "i") * k, x - lax.pmax(x, "i")),
                  "i", in_axes=(0, None))
  wrong, errors, done = [], [], [0] * THREADS

  def work(thread):
    try:
      # Each thread has its own input width: four signatures traced at once.
      width = thread + 1
      for call in range(CALLS_PER_THREAD):
        x = (np.arange(n * width, dtype=np.float32).reshape(n, width) +
             1000. * thread + call)
        k = np.float32(thread + 1)
        total, centered = f(x, k)
        if not (np.array_equal(np.asarray(total),
                               np.broadcast_to(x.sum(0) * k, x.shape)) and
                np.array_equal(np.asarray(centered), x - x.max(0))):
          wrong.append((thread, call))
        done[thread] += 1
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  print(f"\n{sum(done)} calls from {THREADS} threads, {len(wrong)} wrong, "
        f"{len(errors)} errors")
  assert not errors, errors[0]
  assert not wrong, wrong[:5]
  assert done == [CALLS_PER_THREAD] * THREADS
  assert len(f._programs) == THREADS  # pylint: disable=protected-access


def test_threads_each_running_their_own_kinds_of_programs():
  # Six threads trace and run a pmap, a shard_map over a 2 x 4 mesh, or a
  # pmap with steps= each, at once, in a process of their own: none may
  # wait for another forever (a timeout), and each gets NumPy's values.
  run = run_python(_OWN_PROGRAMS_IN_THREADS, timeout=600)
  assert run.stdout.split() == ["ok"] * 6, run.stdout


_OWN_PROGRAMS_IN_THREADS = """
import threading
import numpy as np
import tfspmd
from tfspmd import lax

outcome = ["not finished"] * 6


def work(k):
  x = np.full((8, 4), k + 1.0, np.float32)
  try:
    if k % 3 == 0:
      f = tfspmd.pmap(lambda v: lax.psum(v, "i") * (k + 1), "i")
      for _ in range(20):
        ok = np.allclose(np.asarray(f(x)), x.sum(0) * (k + 1))
    elif k % 3 == 1:
      mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
      f = tfspmd.shard_map(lambda v: lax.psum(v, ("a", "b")) + k, mesh=mesh,
                           in_specs=tfspmd.P(("a", "b")),
                           out_specs=tfspmd.P())
      for _ in range(20):
        ok = np.allclose(np.asarray(f(x)), x.sum(0, keepdims=True) + k)
    else:
      f = tfspmd.pmap(lambda c, v: (c + lax.pmean(v, "i"), c), "i", steps=3)
      for _ in range(10):
        total, _ = f(np.zeros(8, np.float32), x[:, :3])
        ok = np.allclose(np.asarray(total), 3 * (k + 1))
    outcome[k] = "ok" if ok else "wrong"
  except Exception as error:  # pylint: disable=broad-except
    outcome[k] = type(error).__name__


threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
for thread in threads:
  thread.start()
for thread in threads:
  thread.join()
print(" ".join(outcome))
"""


@pytest.mark.parametrize("executor", ["host", "dtensor"])
def test_seven_threads_of_programs_and_transfers_twenty_times(executor):
  # Six threads each trace and call their own programs while a seventh puts
  # arrays on the devices and reads them back, 20 rounds in a row in a
  # process of its own. On DTensor's executor a shard_map's reshapes
  # entered DTensor's device beside another thread's program: calls hung
  # (or failed with DTensor's internal errors). A thread stuck for 120 s
  # prints every thread's stack and ends the process.
  run = run_python(_SEVEN_THREADS, timeout=180, check=False,
                   TFSPMD_EXECUTOR=executor)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
  assert run.stdout.split() == ["ok"] * 20, run.stdout


_SEVEN_THREADS = """
import faulthandler
import sys
import threading
import numpy as np
import tensorflow as tf
import tfspmd
from tfspmd import lax

N = 8
faulthandler.dump_traceback_later(120, exit=True)


def check(got, expected):
  np.testing.assert_array_equal(np.asarray(got), expected)


def psum(r):
  f = tfspmd.pmap(lambda v: lax.psum(v, "i"), "i")
  for k in range(3):
    # Another width every other round: traced while other threads run.
    x = np.arange(N * (3 + r % 2), dtype=np.float32).reshape(N, -1) + k
    check(f(x), np.broadcast_to(x.sum(0), x.shape))


def all_gather(r):
  f = tfspmd.pmap(lambda v: lax.all_gather(v, "i"), "i")
  for k in range(3):
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2) * (k + 1) + r
    check(f(x), np.broadcast_to(x, (N,) + x.shape))


def loop(r):
  f = tfspmd.pmap(lambda v: tf.while_loop(
      lambda i, w: i < 3, lambda i, w: (i + 1, w + lax.psum(w, "i")),
      (0, v))[1], "i")
  for k in range(3):
    x = np.full((N, 2 + r % 3), 1.0 + k, np.float32)
    check(f(x), x * 9.0 ** 3)


def shard_map(r):
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  f = tfspmd.shard_map(lambda v: lax.psum(v, "b"), mesh=mesh,
                       in_specs=tfspmd.P("a", "b"),
                       out_specs=tfspmd.P("a", None))
  for k in range(3):
    x = np.arange(16, dtype=np.float32).reshape(2, 8) + k + r
    check(f(x), x.reshape(2, 4, 2).sum(1))


def steps(r):
  f = tfspmd.pmap(lambda c, v: (c + lax.psum(v, "i"), c), "i", steps=2)
  for k in range(3):
    x = np.arange(N * 6, dtype=np.float32).reshape(N, 2, 3) + k + r
    total, seen = f(np.zeros((N, 3), np.float32), x)
    step_sums = x.sum(0)
    check(total, np.broadcast_to(step_sums.sum(0), (N, 3)))
    check(seen, np.broadcast_to([np.zeros(3), step_sums[0]], (N, 2, 3)))


def nested(r):
  f = tfspmd.pmap(tfspmd.pmap(
      lambda v: lax.psum(v, ("i", "j")) + lax.psum(v, "j"), "j"), "i")
  for k in range(3):
    x = np.arange(8, dtype=np.float32).reshape(2, 4) + k + r
    check(f(x), np.broadcast_to(x.sum() + x.sum(1, keepdims=True), x.shape))


def transfers(r):
  double = tfspmd.pmap(lambda v: v * 2, "i")
  for k in range(3):
    rows = [np.full(3, d + k + r, np.float32) for d in range(N)]
    sharded = tfspmd.device_put_sharded(rows, tfspmd.devices())
    check(sharded, np.stack(rows))
    replicated = tfspmd.device_put_replicated(np.float32(k + r),
                                              tfspmd.devices())
    check(replicated, np.full(N, k + r, np.float32))
    check(double(sharded), 2 * np.stack(rows))


for r in range(20):
  failures = []

  def guarded(work):
    try:
      work(r)
    except BaseException as error:  # pylint: disable=broad-except
      failures.append(f"{work.__name__}: {type(error).__name__}: {error}")

  threads = [threading.Thread(target=guarded, args=(work,)) for work in
             (psum, all_gather, loop, shard_map, steps, nested, transfers)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  print("ok" if not failures else failures, flush=True)
  if failures:
    sys.exit(1)
"""
