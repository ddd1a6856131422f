"""Interleaved timing: every contender measured in the same rounds, medians out.

The machines these run on are shared and noisy, so contenders are measured
side by side in alternating rounds and compared by medians and ratios from
the same run, never across runs.
"""

import json
import os
import platform
import statistics
import time

# `bazel run` starts a script inside its runfiles; results belong in the checkout.
_ROOT = (os.environ.get("BUILD_WORKSPACE_DIRECTORY") or
         os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(_ROOT, "benchmarks", "results")


def same_cpu_devices_for_jax(count=8):
  """Gives tfspmd and JAX the same logical CPU devices, `count` of them.

  Call before TensorFlow or JAX is imported: both read these variables
  once. Values already set are kept.
  """
  os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", str(count))
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault(
      "XLA_FLAGS", "--xla_force_host_platform_device_count="
      f"{os.environ['TFSPMD_NUM_CPU_DEVICES']}")


def interleaved(contenders, *, rounds, calls_per_round, warmup=20,
                settle=None):
  """Times each `contenders[name]()` call, alternating contenders by round.

  Args:
    contenders: {name: function of no arguments}.
    rounds: Rounds, each calling every contender `calls_per_round` times.
    calls_per_round: Calls of one contender in a row.
    warmup: Untimed calls of each contender first.
    settle: If given, called untimed with what each call returned, before
      the next call: waiting there for asynchronous work (DTensor runs a
      program after its call returns) times each call from idle devices,
      so that no call pays for the work queued by the one before.

  Returns:
    {name: list of per-call seconds}.
  """
  settle = settle or (lambda _: None)
  for function in contenders.values():
    for _ in range(warmup):
      settle(function())
  samples = {name: [] for name in contenders}
  for _ in range(rounds):
    for name, function in contenders.items():
      for _ in range(calls_per_round):
        start = time.perf_counter()
        result = function()
        samples[name].append(time.perf_counter() - start)
        settle(result)
  return samples


def summarize(samples):
  """{name: {median_us, p10_us, p90_us, calls}}."""
  summary = {}
  for name, values in samples.items():
    ordered = sorted(values)
    summary[name] = {
        "median_us": statistics.median(ordered) * 1e6,
        "p10_us": ordered[len(ordered) // 10] * 1e6,
        "p90_us": ordered[(len(ordered) * 9) // 10] * 1e6,
        "calls": len(ordered),
    }
  return summary


def machine():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return {
      "platform": platform.platform(),
      "python": platform.python_version(),
      "tensorflow": tf.__version__,
      "cpu_count": os.cpu_count(),
  }


def print_table(title, rows, columns):
  """Prints `rows` (list of dicts) as a Markdown table of `columns`."""
  print(f"\n{title}\n")
  print("| " + " | ".join(columns) + " |")
  print("|" + "|".join(" --- " for _ in columns) + "|")
  for row in rows:
    cells = []
    for column in columns:
      value = row.get(column, "")
      cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
    print("| " + " | ".join(cells) + " |")


def write_results(name, payload):
  os.makedirs(RESULTS_DIR, exist_ok=True)
  path = os.path.join(RESULTS_DIR, f"{name}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=2, sort_keys=True)
    f.write("\n")
  return path


def on_executor(executor, function):
  """`function`, each call of it run under tfspmd's executor `executor`.

  tfspmd keys its programs on `tfspmd_executor`, so one process times the
  host executor and DTensor's side by side, each with its own programs.
  """
  import tfspmd  # pylint: disable=import-outside-toplevel

  def call():
    before = tfspmd.config.tfspmd_executor
    tfspmd.config.update("tfspmd_executor", executor)
    try:
      return function()
    finally:
      tfspmd.config.update("tfspmd_executor", before)
  return call
