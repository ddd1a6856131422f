"""tfspmd's own Python per top-level pmap call: the call minus DTensor's.

Each case times a pmap call against the bare DTensor call of the very
program that pmap traced (taken from its trace cache), interleaved round by
round; `overhead_us` is the difference of their medians, the time tfspmd's
own Python adds (binding and flattening the arguments, the cache key,
placing, wrapping the results). The bare call does what a DTensor user must
do anyway: pack host inputs (`dtensor.pack` of one slice per device) and
set the program's DTensor switches in the C environment. DTensor runs a
program after its call returns: each timed call is waited for, untimed,
before the next, so every call starts from idle devices and none pays for
the work of the one before.

Cases, on every device (8 logical CPU devices), float32:
  - sharded_in: `pmap(lambda x: x + 1.0)` fed its own (8, 128) result;
  - numpy_in: the same pmap called on an (8, 128) NumPy array;
  - psum_two_args: `pmap(lambda x, w: psum(x * w, 'i'), in_axes=(0, None))`
    on an (8, 128) `ShardedArray` and a (128,) NumPy array.

The tfspmd measured is the one first on PYTHONPATH (this checkout when
none is given), so the same script measures two versions: run it in
alternation with PYTHONPATH naming each checkout, and compare
`overhead_us`, each run against its own bare calls.

Run: python benchmarks/call_overhead.py [--rounds N] [--calls N]
"""

import argparse
import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tfspmd from PYTHONPATH when it names one (this checkout's otherwise), but
# `benchmarks` always from this checkout: its results go beside this script.
sys.path.append(_ROOT)

import numpy as np  # pylint: disable=wrong-import-position
from tensorflow.experimental import dtensor  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from tfspmd import lax  # pylint: disable=wrong-import-position
from tfspmd._src.core import tf_internal  # pylint: disable=wrong-import-position

sys.path.insert(0, _ROOT)
from benchmarks import timing  # pylint: disable=wrong-import-position

_FEATURES = 128


def _program(pmapped):
  """The one program `pmapped` traced so far (private: its trace cache)."""
  programs = pmapped._programs.values()  # pylint: disable=protected-access
  assert len(programs) == 1, programs
  return programs[0]


def _bare(program):
  """`program`'s compiled function, called as a DTensor user would."""
  switches = program.dtensor_switches

  def call(*placed):
    for name in switches:
      os.putenv(name, "1")
    try:
      return program.function(*placed)
    finally:
      for name in switches:
        os.unsetenv(name)

  return call


def _host_pieces(array, count):
  """One slice of `array` per device along axis 0, as `dtensor.pack` takes."""
  step = array.shape[0] // count
  return [array[k * step:(k + 1) * step] for k in range(count)]


def _settle(result):
  """Waits for the devices to finish what `result` came from (untimed)."""
  for value in result if isinstance(result, (list, tuple)) else [result]:
    if isinstance(value, tfspmd.ShardedArray):
      value.block_until_ready()
    else:
      tf_internal.wait_for_pending_ops()
      dtensor.unpack(value)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--calls", type=int, default=50)
  options = parser.parse_args()

  count = tfspmd.device_count()
  host = np.ones((count, _FEATURES), np.float32)
  weights = np.full((_FEATURES,), 2.0, np.float32)
  add_one = tfspmd.pmap(lambda x: x + 1.0)
  reduce = tfspmd.pmap(lambda x, w: lax.psum(x * w, "i"), "i",
                       in_axes=(0, None))
  state = {"pmap": add_one(host)}
  fixed = state["pmap"]
  reduce(fixed, weights)
  add_one_bare = _bare(_program(add_one))
  reduce_bare = _bare(_program(reduce))
  split = fixed.layout
  whole = dtensor.Layout.replicated(split.mesh, 1)
  state["bare"] = fixed.dtensor_value

  def sharded_pmap():
    state["pmap"] = add_one(state["pmap"])
    return state["pmap"]

  def sharded_bare():
    state["bare"] = add_one_bare(state["bare"])[0]
    return state["bare"]

  contenders = {
      "sharded_in/pmap": sharded_pmap,
      "sharded_in/bare": sharded_bare,
      "numpy_in/pmap": lambda: add_one(host),
      "numpy_in/bare": lambda: add_one_bare(
          dtensor.pack(_host_pieces(host, count), split)),
      "psum_two_args/pmap": lambda: reduce(fixed, weights),
      "psum_two_args/bare": lambda: reduce_bare(
          fixed.dtensor_value, dtensor.pack([weights] * count, whole)),
  }
  samples = timing.interleaved(contenders, rounds=options.rounds,
                               calls_per_round=options.calls, settle=_settle)
  summary = timing.summarize(samples)
  overhead = {}
  rows = []
  for case in ("sharded_in", "numpy_in", "psum_two_args"):
    pmap_us = summary[f"{case}/pmap"]["median_us"]
    bare_us = summary[f"{case}/bare"]["median_us"]
    overhead[case] = pmap_us - bare_us
    rows.append(dict(case=case, pmap_median_us=pmap_us,
                     bare_median_us=bare_us, overhead_us=pmap_us - bare_us,
                     pmap_p90_us=summary[f"{case}/pmap"]["p90_us"],
                     bare_p90_us=summary[f"{case}/bare"]["p90_us"]))
  timing.print_table(
      f"tfspmd's own time per pmap call on {count} devices, tfspmd from "
      f"{os.path.dirname(tfspmd.__file__)} (medians of {options.rounds} x "
      f"{options.calls} interleaved calls, each from idle devices)",
      rows, ["case", "pmap_median_us", "bare_median_us", "overhead_us",
             "pmap_p90_us", "bare_p90_us"])

  # Both routes made every call and computed the same values.
  calls = 20 + options.rounds * options.calls
  np.testing.assert_allclose(state["pmap"].numpy(), 2.0 + calls)
  np.testing.assert_allclose(
      dtensor.unpack(state["bare"])[0].numpy(), 2.0 + calls)
  np.testing.assert_allclose(reduce(fixed, weights).numpy(),
                             np.full((count, _FEATURES), 2.0 * 2.0 * count))
  path = timing.write_results("call_overhead", {
      "machine": timing.machine(), "devices": count,
      "tfspmd": os.path.dirname(tfspmd.__file__), "results": summary,
      "overhead_us": overhead})
  print(f"\nwritten to {path}")


if __name__ == "__main__":
  main()
