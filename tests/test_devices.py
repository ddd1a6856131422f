"""Devices, processes and the logical CPU split."""

import os

import pytest

import tfspmd

from child_process import run_python


def test_eight_logical_cpu_devices():
  devices = tfspmd.devices()
  assert len(devices) == 8 == tfspmd.device_count() == tfspmd.local_device_count()
  assert [d.id for d in devices] == list(range(8))
  assert all(d.platform == "cpu" and d.process_index == 0 for d in devices)
  assert devices[3].name.endswith("/device:CPU:3")
  assert tfspmd.local_devices() == devices
  assert tfspmd.devices("cpu") == devices == tfspmd.devices("CPU")


def test_single_process():
  assert tfspmd.process_index() == 0
  assert tfspmd.process_count() == 1


def test_set_num_cpu_devices_with_the_count_in_force_is_allowed():
  tfspmd.set_num_cpu_devices(8)


def test_set_num_cpu_devices_after_initialization_raises():
  with pytest.raises(RuntimeError, match=r"set_num_cpu_devices\(4\) came too late"):
    tfspmd.set_num_cpu_devices(4)


@pytest.mark.parametrize("count, error", [(0, ValueError), (-2, ValueError),
                                          (2.0, TypeError), (True, TypeError)])
def test_set_num_cpu_devices_checks_its_argument(count, error):
  with pytest.raises(error, match="count"):
    tfspmd.set_num_cpu_devices(count)


def test_unknown_or_absent_backend():
  with pytest.raises(ValueError, match="`backend` must be"):
    tfspmd.devices("fpga")
  with pytest.raises(RuntimeError, match="no GPU devices"):
    tfspmd.devices("gpu")


def _run(code, **env):
  return run_python(code, devices=None, check=False,
                    cwd=os.path.dirname(os.path.dirname(__file__)), **env)


def test_importing_tfspmd_after_tensorflow_started_its_devices():
  # The user split the CPU into the logical devices the variable names:
  # tfspmd takes them.
  split = _run(
      "import tensorflow as tf\n"
      "tf.config.set_logical_device_configuration("
      "tf.config.list_physical_devices('CPU')[0],"
      " [tf.config.LogicalDeviceConfiguration()] * 8)\n"
      "tf.constant(1.)\n"
      "import tfspmd\n"
      "print(tfspmd.device_count(), tfspmd.pmap(lambda v: v * 2)("
      "tf.range(8)).numpy().tolist())", TFSPMD_NUM_CPU_DEVICES="8")
  assert split.returncode == 0, split.stderr[-3000:]
  assert split.stdout.split("\n")[0] == "8 [0, 2, 4, 6, 8, 10, 12, 14]"
  # Nobody split it: the message says why the variable set did not apply.
  late = _run("import tensorflow as tf; tf.constant(1.); import tfspmd",
              TFSPMD_NUM_CPU_DEVICES="8")
  assert late.returncode != 0
  assert (
      "RuntimeError: TFSPMD_NUM_CPU_DEVICES=8 is set, but TensorFlow started "
      "its devices before tfspmd was imported, with 1 logical CPU device(s), "
      "and cannot split the CPU any more. Import tfspmd before any "
      "TensorFlow op runs, or split the CPU yourself before the first op: "
      "tf.config.set_logical_device_configuration(tf.config."
      "list_physical_devices('CPU')[0], "
      "[tf.config.LogicalDeviceConfiguration()] * 8).") in late.stderr


def test_environment_variable_and_set_num_cpu_devices_in_a_fresh_process():
  result = _run(
      "import tfspmd; tfspmd.set_num_cpu_devices(3); "
      "print(tfspmd.device_count());"
      "import tensorflow as tf; tf.constant(1.);"
      "\ntry: tfspmd.set_num_cpu_devices(5)\n"
      "except RuntimeError as e: print('late:', e)",
      TFSPMD_NUM_CPU_DEVICES="")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[0] == "3"
  assert "came too late" in lines[1] and "3 logical CPU device" in lines[1]
  bad = _run("import tfspmd", TFSPMD_NUM_CPU_DEVICES="eight")
  assert bad.returncode != 0
  assert "TFSPMD_NUM_CPU_DEVICES must be a positive integer, got 'eight'" in bad.stderr
