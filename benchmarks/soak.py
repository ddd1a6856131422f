"""A process that runs for long: 1,000 loop programs kept alive, 10,000 steps.

Two phases in one process (8 logical CPU devices), as a long training job
with evaluation and many small programs would run:

  programs  1,000 distinct pmaps, each with a `tf.while_loop` around a psum
            (DTensor outlines each loop into a function of the process's one
            function library), all kept alive; each is called once when
            made, and every 100th the earlier ones are all called again.
  steps     10,000 steps of a training loop whose replicated state goes out
            of each call and into the next, a new host batch each step.

It prints the failures (none expected), how often DTensor met a function
name already taken and tfspmd lowered a program again under a new one, the
resident memory along the way (flat expected once warm), and the step time.

Run: python -m benchmarks.soak [--programs N] [--steps N] [--executor E]
(E: 'host' or 'dtensor', tfspmd's executor; results go to soak_E.json)
"""

import argparse
import os
import resource
import sys
import time

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from benchmarks import timing  # pylint: disable=wrong-import-position
from tfspmd import lax  # pylint: disable=wrong-import-position
from tfspmd._src.executors import dtensor_calls  # pylint: disable=wrong-import-position

DEVICES = 8


def resident_mib():
  """This process's resident memory now, in MiB."""
  with open("/proc/self/status", encoding="utf-8") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def count_renamings():
  """A counter of the programs lowered again under a new name."""
  count = [0]
  renamed = dtensor_calls.renamed

  def counting(*args):
    count[0] += 1
    return renamed(*args)

  dtensor_calls.renamed = counting
  return count


def loop_program(k):
  """The k-th distinct program: a while loop of psums, k-dependent."""
  limit = 2 + k % 5

  def per_device(x):
    def body(i, v):
      return i + 1, v + lax.psum(v, "i") * (1.0 / (k + 1))
    return tf.while_loop(lambda i, v: i < limit, body, (0, x))[1]

  return tfspmd.pmap(per_device, "i")


def expected_loop(k, x):
  v = x.astype(np.float64)
  for _ in range(2 + k % 5):
    v = v + v.sum(0) * (1.0 / (k + 1))
  return v


def programs_phase(count, report):
  x = np.arange(DEVICES * 3, dtype=np.float32).reshape(DEVICES, 3) / 10
  alive, failures, memory, seconds = [], [], [], []
  for k in range(count):
    start = time.perf_counter()
    try:
      f = loop_program(k)
      np.testing.assert_allclose(np.asarray(f(x)), expected_loop(k, x),
                                 rtol=1e-4)
      alive.append(f)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"program {k}: {type(e).__name__}: {str(e)[:200]}")
    seconds.append(time.perf_counter() - start)
    if (k + 1) % 100 == 0:
      for j, f in enumerate(alive):
        try:
          np.asarray(f(x))
        except Exception as e:  # pylint: disable=broad-except
          failures.append(f"again {j}: {type(e).__name__}: {str(e)[:200]}")
      memory.append(resident_mib())
      report(f"programs {k + 1}: {len(failures)} failures, "
             f"{memory[-1]:.0f} MiB, {np.median(seconds[-100:]):.3f} s each")
  memory.append(resident_mib())
  return {"failures": failures, "resident_mib": memory,
          "median_seconds": float(np.median(seconds))}


def step(state, x):
  with tf.GradientTape() as tape:
    tape.watch(state["w"])
    loss = tf.reduce_mean(tf.square(x @ state["w"] + state["b"]))
  grad = lax.pmean(tape.gradient(loss, state["w"]), "i")
  return {"w": state["w"] - 0.01 * grad, "b": state["b"] * 0.999,
          "count": state["count"] + 1}, lax.pmean(loss, "i")


def steps_phase(count, report):
  rng = np.random.default_rng(0)
  state = {"w": rng.standard_normal((16, 4)).astype(np.float32) * 0.1,
           "b": np.zeros(4, np.float32), "count": np.int32(0)}
  call = tfspmd.pmap(step, "i", in_axes=(None, 0), out_axes=(None, None))
  failures, memory, seconds = [], [], []
  for number in range(count):
    x = rng.standard_normal((DEVICES, 8, 16)).astype(np.float32)
    start = time.perf_counter()
    try:
      state, loss = call(state, x)
      float(loss)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"step {number}: {type(e).__name__}: {str(e)[:200]}")
    seconds.append(time.perf_counter() - start)
    if (number + 1) % 1000 == 0:
      memory.append(resident_mib())
      report(f"steps {number + 1}: {len(failures)} failures, "
             f"{memory[-1]:.0f} MiB, "
             f"{np.median(seconds[-1000:]) * 1e3:.2f} ms a step")
  memory.append(resident_mib())
  if int(np.asarray(state["count"])) != count - len(failures):
    failures.append(f"count {int(np.asarray(state['count']))} after "
                    f"{count} steps")
  return {"failures": failures, "resident_mib": memory,
          "median_ms": float(np.median(seconds[1:]) * 1e3)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--programs", type=int, default=1000)
  parser.add_argument("--steps", type=int, default=10000)
  parser.add_argument("--executor", choices=("host", "dtensor"),
                      default="host")
  options = parser.parse_args()
  tfspmd.config.update("tfspmd_executor", options.executor)
  renamings = count_renamings()
  report = lambda line: print(line, flush=True)  # pylint: disable=unnecessary-lambda-assignment
  start = resident_mib()
  programs = programs_phase(options.programs, report)
  steps = steps_phase(options.steps, report)
  rows = [
      dict(phase=f"{options.programs} loop programs kept alive",
           failures=len(programs["failures"]),
           start_mib=start, end_mib=programs["resident_mib"][-1],
           typical=f"{programs['median_seconds']:.3f} s a program"),
      dict(phase=f"{options.steps} training steps",
           failures=len(steps["failures"]),
           start_mib=steps["resident_mib"][0],
           end_mib=steps["resident_mib"][-1],
           typical=f"{steps['median_ms']:.2f} ms a step"),
  ]
  timing.print_table(
      f"One process, {DEVICES} CPU devices, the {options.executor} executor; "
      f"programs lowered again under a new name: {renamings[0]}", rows,
      ["phase", "failures", "start_mib", "end_mib", "typical"])
  for failure in programs["failures"] + steps["failures"]:
    print(failure)
  path = timing.write_results(f"soak_{options.executor}", dict(
      machine=timing.machine(), executor=options.executor, rows=rows,
      renamings=renamings[0],
      programs=programs, steps=steps, load_average=os.getloadavg()))
  print(f"Results written to {path}")


if __name__ == "__main__":
  main()
