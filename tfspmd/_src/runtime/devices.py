"""The devices tfspmd maps over: logical CPU devices, GPUs, TPUs, processes.

TensorFlow shows one CPU device unless the physical CPU is split into logical
devices before TensorFlow creates its devices. tfspmd owns that split: set
`TFSPMD_NUM_CPU_DEVICES` in the environment, or call `set_num_cpu_devices`
first thing.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import tf_internal

NUM_CPU_DEVICES_ENV = "TFSPMD_NUM_CPU_DEVICES"
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Device:
  """One device a pmap can run on.

  Attributes:
    id: The device's id across all processes (unique within a platform).
    platform: 'cpu', 'gpu' or 'tpu'.
    process_index: The process that owns the device.
    local_id: The device's index among its process's devices of `platform`.
    name: TensorFlow's full name of the device.

  Example:
    >>> import tfspmd
    >>> device = tfspmd.devices()[3]
    >>> device, device.platform, device.process_index
    (Device(platform='cpu', id=3), 'cpu', 0)
    >>> device.name
    '/job:localhost/replica:0/task:0/device:CPU:3'
  """
  id: int
  platform: str
  process_index: int
  local_id: int
  name: str

  @property
  def device_kind(self) -> str:
    return self.platform.upper()

  def __repr__(self) -> str:
    return f"Device(platform={self.platform!r}, id={self.id})"


def set_num_cpu_devices(count: int) -> None:
  """Splits the host CPU into `count` logical devices for pmap to map over.

  Must run before TensorFlow creates its devices (before any op runs). Calling
  it again with the count already in force is allowed; any other count after
  initialization raises.

  Args:
    count: The number of logical CPU devices, a positive int.

  Raises:
    TypeError: If `count` is not an int.
    ValueError: If `count` is less than 1.
    RuntimeError: If TensorFlow already created its devices with another count.

  Example:
    >>> import tfspmd
    >>> tfspmd.set_num_cpu_devices(8)  # the count already in force: allowed
    >>> tfspmd.device_count("cpu")
    8
  """
  if isinstance(count, bool) or not isinstance(count, int):
    raise TypeError(
        f"set_num_cpu_devices: `count` must be an int, got {type(count).__name__} "
        f"{count!r}.")
  if count < 1:
    raise ValueError(f"set_num_cpu_devices: `count` must be >= 1, got {count}.")
  physical = tf.config.list_physical_devices("CPU")[0]
  if tf_internal.devices_initialized():
    current = len(tf.config.list_logical_devices("CPU"))
    if current == count:
      return
    raise RuntimeError(
        f"set_num_cpu_devices({count}) came too late: TensorFlow has already "
        f"created its devices, with {current} logical CPU device(s). Call it "
        f"before any TensorFlow op runs, or set {NUM_CPU_DEVICES_ENV}={count} in "
        f"the environment before starting Python.")
  tf.config.set_logical_device_configuration(
      physical, [tf.config.LogicalDeviceConfiguration()] * count)


def configure_from_environment():
  """Applies `TFSPMD_NUM_CPU_DEVICES` if it is set (when tfspmd is imported).

  TensorFlow may have started its devices before tfspmd was imported: that
  is fine where the user split the CPU into as many logical devices
  themselves, and otherwise too late to split it.
  """
  value = os.environ.get(NUM_CPU_DEVICES_ENV)
  if not value:
    return
  try:
    count = int(value)
  except ValueError:
    raise ValueError(
        f"{NUM_CPU_DEVICES_ENV} must be a positive integer, got {value!r}."
    ) from None
  if tf_internal.devices_initialized() and count >= 1:
    current = len(tf.config.list_logical_devices("CPU"))
    if current != count:
      raise RuntimeError(
          f"{NUM_CPU_DEVICES_ENV}={count} is set, but TensorFlow started its "
          f"devices before tfspmd was imported, with {current} logical CPU "
          f"device(s), and cannot split the CPU any more. Import tfspmd "
          f"before any TensorFlow op runs, or split the CPU yourself before "
          f"the first op: tf.config.set_logical_device_configuration("
          f"tf.config.list_physical_devices('CPU')[0], "
          f"[tf.config.LogicalDeviceConfiguration()] * {count}).")
    return
  set_num_cpu_devices(count)


def resolve_backend(backend):
  """The platform a pmap with `backend=backend` runs on: 'cpu', 'gpu' or 'tpu'.

  None picks the best platform present: TPU, then GPU, then CPU.
  """
  present = _platforms_present()
  if backend is None:
    for platform in ("tpu", "gpu", "cpu"):
      if platform in present:
        return platform
  if not isinstance(backend, str) or backend.lower() not in PLATFORMS:
    raise ValueError(
        f"`backend` must be None or one of {PLATFORMS}, got {backend!r}.")
  platform = backend.lower()
  if platform not in present:
    raise RuntimeError(
        f"backend={backend!r} was requested, but this process has no "
        f"{platform.upper()} devices; available backends: {sorted(present)}.")
  return platform


@functools.lru_cache(maxsize=None)
def _platforms_present():
  # Physical devices: listing them does not start TensorFlow's devices, which
  # `tfspmd.distributed.initialize` must precede.
  present = {"cpu"}
  if tf.config.list_physical_devices("GPU"):
    present.add("gpu")
  if (tf.config.list_physical_devices("TPU") or
      tf.config.list_physical_devices("TPU_SYSTEM")):
    present.add("tpu")
  return frozenset(present)


def process_index(backend: str | None = None) -> int:
  """The index of this process among all processes (0 in a single process).

  Args:
    backend: 'cpu', 'gpu', 'tpu', or None: checked as `devices` checks it;
      every platform of a process has the same index.

  Example:
    >>> import tfspmd
    >>> tfspmd.process_index()
    0
  """
  if backend is not None:
    resolve_backend(backend)
  return dtensor.client_id()


def process_count() -> int:
  """The number of processes running this program together.

  Example:
    >>> import tfspmd
    >>> tfspmd.process_count()
    1
  """
  return dtensor.num_clients()


@functools.lru_cache(maxsize=None)
def _local_devices(platform):
  _check_runtime(platform)
  process = dtensor.client_id()
  count = len(_own_logical_devices(platform))
  return tuple(
      Device(id=process * count + k, platform=platform, process_index=process,
             local_id=k, name=_full_name(process, platform, k))
      for k in range(count))


def _own_logical_devices(platform):
  """This process's logical devices of `platform`.

  With several processes TensorFlow lists every process's devices.
  """
  process = dtensor.client_id()
  return [device for device in tf.config.list_logical_devices(platform.upper())
          if tf.DeviceSpec.from_string(device.name).task in (None, process)]


def _check_runtime(platform):
  """Raises unless TensorFlow's runtime can give `platform`'s devices to a mesh.

  Brings up the TPU system of a single TPU host the first time it is needed.
  """
  if not tf_internal.accelerator_system_initialized():
    if dtensor.num_clients() > 1:
      raise RuntimeError(
          f"DTENSOR_JOBS names {dtensor.num_clients()} processes, but the "
          f"multi-process runtime was not started: call "
          f"tfspmd.distributed.initialize() first thing in every process, "
          f"before any TensorFlow op.")
    if platform == "tpu":
      if tf_internal.devices_initialized():
        raise RuntimeError(
            "TPUs need their system initialized before TensorFlow starts its "
            "devices: call tfspmd.distributed.initialize() first thing, "
            "before any TensorFlow op.")
      dtensor.initialize_accelerator_system("TPU")
  if platform == "gpu":
    logical = len(_own_logical_devices("gpu"))
    physical = len(tf.config.get_visible_devices("GPU"))
    if logical != physical:
      raise RuntimeError(
          f"tfspmd maps over one logical device per physical GPU (DTensor's "
          f"NCCL collectives need it), but this process has {logical} "
          f"logical GPU device(s) on {physical} GPU(s); remove the "
          f"tf.config.set_logical_device_configuration of the GPUs.")


def _full_name(process, platform, local_id):
  # Logical device names lack the job and task, which DTensor meshes need.
  return (f"/job:{dtensor.job_name()}/replica:0/task:{process}/"
          f"device:{platform.upper()}:{local_id}")


def local_devices(process_index: int | None = None,  # pylint: disable=redefined-outer-name
                  backend: str | None = None) -> tuple[Device, ...]:
  """The devices of one process (this one by default), in order.

  Args:
    process_index: The process whose devices to list, from 0; None for
      this process.
    backend: 'cpu', 'gpu', 'tpu', or None for the default platform.

  Returns:
    A tuple of `Device`.

  Raises:
    ValueError: If `process_index` is not the index of a process.

  Example:
    >>> import tfspmd
    >>> tfspmd.local_devices()[:2]
    (Device(platform='cpu', id=0), Device(platform='cpu', id=1))
    >>> tfspmd.local_devices(process_index=0) == tfspmd.local_devices()
    True
  """
  platform = resolve_backend(backend)
  if process_index is None:
    return _local_devices(platform)
  count = dtensor.num_clients()
  if (isinstance(process_index, bool) or
      not isinstance(process_index, int) or
      not 0 <= process_index < count):
    raise ValueError(
        f"local_devices: `process_index` must be the index of a process, an "
        f"int from 0 to {count - 1} ({count} process(es)), got "
        f"{process_index!r}.")
  return tuple(d for d in _all_devices(platform)
               if d.process_index == process_index)


@functools.lru_cache(maxsize=None)
def _all_devices(platform):
  # Every process has as many devices of a platform as this one (DTensor's
  # multi-client meshes assume it), numbered process by process.
  count = len(_local_devices(platform))
  return tuple(
      Device(id=process * count + k, platform=platform, process_index=process,
             local_id=k, name=_full_name(process, platform, k))
      for process in range(process_count()) for k in range(count))


def devices(backend: str | None = None) -> tuple[Device, ...]:
  """All devices of all processes, ordered by id.

  Args:
    backend: 'cpu', 'gpu', 'tpu', or None for the default platform.

  Returns:
    A tuple of `Device`.

  Example:
    >>> import tfspmd
    >>> len(tfspmd.devices())
    8
  """
  return _all_devices(resolve_backend(backend))


def device_count(backend: str | None = None) -> int:
  """The number of devices of all processes.

  Example:
    >>> import tfspmd
    >>> tfspmd.device_count()
    8
  """
  return len(devices(backend))


def local_device_count(backend: str | None = None) -> int:
  """The number of devices of this process.

  Example:
    >>> import tfspmd
    >>> tfspmd.local_device_count()
    8
  """
  return len(local_devices(backend=backend))
