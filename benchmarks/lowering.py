"""What DTensor's SPMD expansion made of each collective.

For each collective, a pmap whose per-device program is that collective runs
once while DTensor dumps its MLIR after every pass. From the dumps this prints
the DTensor collective ops that SPMD expansion inserted and the TensorFlow
collective ops each device finally runs, with their per-device operand shapes,
so a lowering can be checked again on another TensorFlow version or device
type (docs/collectives.md records what TF 2.21 on CPU did).

Run: python -m benchmarks.lowering [--floats N]
"""

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

DUMP_DIR = tempfile.mkdtemp(prefix="tfspmd-lowering-")
# DTensor writes its per-pass MLIR only when this module logs at level 1, and
# reads both settings when TensorFlow loads: before the import.
os.environ["TF_CPP_VMODULE"] = "dtensor_mlir_passes=1"
os.environ["TF_DUMP_GRAPH_PREFIX"] = DUMP_DIR
os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position

lax = tfspmd.lax
AXIS = "i"
_DUMP_NAME = re.compile(
    r"dtensor\.(\d+)\.dtensor_mlir\.after_(.+?)\.__inference_(\w+)\.mlir$")
# An op, its attributes up to the type signature, and its operand types.
_OP = re.compile(r'"tf\.((?:DTensor|Collective)\w+)"\([^)]*\)(.*?) : \(([^)]*)\)')
_ATTRIBUTE = re.compile(r'\b(reduce_op|merge_op) = "(\w+)"')


def cases(count):
  """{name: (per-device program, per-device shape)} for `count` devices."""
  ring = [(i, (i + 1) % count) for i in range(count)]
  # Pairs of devices count // 2 apart, as the size GROUP_SIZE needs.
  pairs = [[i, i + count // 2] for i in range(count // 2)]

  def nested_psum(x):
    inner = tfspmd.pmap(lambda y: lax.psum(y, "rows"), axis_name="cols")
    return inner(x)

  return {
      "psum": (lambda x: lax.psum(x, AXIS), None),
      "pmean": (lambda x: lax.pmean(x, AXIS), None),
      "pmax": (lambda x: lax.pmax(x, AXIS), None),
      "pmin": (lambda x: lax.pmin(x, AXIS), None),
      "all_gather": (lambda x: lax.all_gather(x, AXIS), None),
      "all_gather tiled": (lambda x: lax.all_gather(x, AXIS, tiled=True), None),
      "psum_scatter": (lambda x: lax.psum_scatter(x, AXIS), "blocked"),
      "psum_scatter tiled": (lambda x: lax.psum_scatter(x, AXIS, tiled=True),
                             "blocked"),
      "ppermute (ring shift)": (lambda x: lax.ppermute(x, AXIS, ring), None),
      "pshuffle (reversal)": (
          lambda x: lax.pshuffle(x, AXIS, list(range(count))[::-1]), None),
      "all_to_all": (lambda x: lax.all_to_all(x, AXIS, 0, 0), "blocked"),
      "pswapaxes": (lambda x: lax.pswapaxes(x, AXIS, 0), "blocked"),
      "axis_index": (lambda x: x + tf.cast(lax.axis_index(AXIS), x.dtype),
                     None),
      f"psum over rows of a nested 2 x {count // 2} pmap": (nested_psum,
                                                           "nested"),
      f"psum, axis_index_groups={pairs}": (
          lambda x: lax.psum(x, AXIS, axis_index_groups=pairs), None),
      "all_gather, the same groups": (
          lambda x: lax.all_gather(x, AXIS, axis_index_groups=pairs), None),
      "psum_scatter, the same groups": (
          lambda x: lax.psum_scatter(x, AXIS, axis_index_groups=pairs),
          "blocked by group"),
      "all_to_all, the same groups": (
          lambda x: lax.all_to_all(x, AXIS, 0, 0, axis_index_groups=pairs),
          "blocked by group"),
  }


GROUP_SIZE = 2


def _dumps():
  """{function name: {pass name: path}} of every dump written so far."""
  found = collections.defaultdict(dict)
  for path in glob.glob(os.path.join(DUMP_DIR, "*.mlir")):
    match = _DUMP_NAME.search(os.path.basename(path))
    if match:
      order, pass_name, function = match.groups()
      found[function][(int(order), pass_name)] = path
  return found


def _ops(path):
  """'Op[attribute](operand shape)' for each DTensor/TF collective op in a dump."""
  ops = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      for name, attributes, operands in _OP.findall(line):
        shapes = re.findall(r"tensor<([^>]*)>", operands)
        details = []
        attribute = _ATTRIBUTE.search(attributes)
        if attribute:
          details.append(attribute.group(2))
        if name == "DTensorAllReduce":
          groups, size = shapes[1].split("x")[:2]
          details.append(f"{groups} group(s) of {size}")
        detail = f"[{', '.join(details)}]" if details else ""
        ops.append(f"{name}{detail}({shapes[0]})")
  return ops


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--floats", type=int, default=16,
                      help="float32 elements per device")
  options = parser.parse_args()

  count = tfspmd.device_count()
  rows = []
  for name, (program, kind) in cases(count).items():
    if kind == "blocked":
      shape = (count, count, max(1, options.floats // count))
      mapped = tfspmd.pmap(program, axis_name=AXIS)
    elif kind == "blocked by group":
      shape = (count, GROUP_SIZE, max(1, options.floats // GROUP_SIZE))
      mapped = tfspmd.pmap(program, axis_name=AXIS)
    elif kind == "nested":
      shape = (2, count // 2, options.floats)
      mapped = tfspmd.pmap(program, axis_name="rows")
    else:
      shape = (count, options.floats)
      mapped = tfspmd.pmap(program, axis_name=AXIS)
    before = set(_dumps())
    mapped(np.ones(shape, np.float32)).block_until_ready()
    new = [passes for function, passes in _dumps().items()
           if function not in before and function.startswith("program")]
    if len(new) != 1:
      raise RuntimeError(
          f"{name}: expected the dumps of one new program in {DUMP_DIR}, "
          f"found {len(new)}; is TF_CPP_VMODULE overridden?")
    passes = new[0]
    expanded = [path for (_, pass_name), path in passes.items()
                if pass_name == "DTensorSPMDExpansion"]
    last = passes[max(passes)]
    rows.append((name, ", ".join(_ops(expanded[0])) or "none",
                 ", ".join(_ops(last)) or "none (no communication)"))

  print(f"\nCollective ops per device, {count} devices, {options.floats} "
        f"float32 per device (dumps in {DUMP_DIR})\n")
  print("| collective | after DTensorSPMDExpansion | each device runs |")
  print("| --- | --- | --- |")
  for row in rows:
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  main()
