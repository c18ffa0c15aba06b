"""Where the towers run (docs/equivalence.md §3).

`--num_gpus N` means N towers. With at least N GPUs the towers go on the
first N GPUs. With fewer, the tool says so on stderr and splits the GPUs into
logical GPUs of GPU_SPLIT_MB each (2 towers on 1 GPU: two logical GPUs of it),
or, with no GPU, the CPU into N logical devices, so every multi-tower code path
runs on any machine. Devices
are decided here once and passed to the trainers; nothing else names a device
except the variables' host, `/cpu:0`.
"""

import dataclasses
import logging

from cifar10_towers.common import errors

VARIABLE_DEVICE = '/cpu:0'  # upstream keeps all variables on the CPU
MAX_TOWERS = 64  # more logical devices than this is a typo, not a plan
GPU_SPLIT_MB = 4096  # memory of each logical GPU when the towers outnumber the GPUs

logger = logging.getLogger(__name__)


class DeviceError(errors.Failure):
  """The towers asked for cannot be provided; the message says what to do."""

  exit_code = 2  # a usage error: --num_gpus asks for what this machine cannot give


@dataclasses.dataclass(frozen=True)
class DevicePlan:
  """The devices of one run."""
  tower_devices: tuple  # device name of tower i, e.g. '/device:GPU:1' or '/device:CPU:1'
  kind: str  # 'gpu' (real GPUs) or 'cpu' (logical CPU devices)
  num_cpu_devices: int  # CPU devices a TF1 Session must create (ConfigProto device_count)

  @property
  def num_towers(self):
    return len(self.tower_devices)


def plan_devices(num_gpus):
  """Chooses and, when needed, creates the devices for `num_gpus` towers.

  Must run before TensorFlow initializes its devices in this process to split
  the CPU; if TensorFlow already runs with enough logical CPUs (as in the
  tests, which split the CPU once per session), those are reused.

  Args:
    num_gpus: int, number of towers, 1 to MAX_TOWERS (the CLI's --num_gpus range).

  Returns:
    DevicePlan.

  Raises:
    DeviceError: the devices cannot be created.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices('GPU')
  if 0 < len(gpus) < num_gpus:  # towers on logical GPUs, the first GPU's before the next one's
    per_gpu = -(-num_gpus // len(gpus))
    logger.warning(f'{num_gpus} tower(s) asked for, {len(gpus)} GPU(s) found: running the '
                   f'towers on logical GPUs of {GPU_SPLIT_MB} MiB, {per_gpu} per GPU.')
    for gpu in gpus:
      _split(gpu, per_gpu, GPU_SPLIT_MB)
  if gpus:
    kind, have = 'gpu', 1
  else:
    if num_gpus > 1:
      logger.warning(f'{num_gpus} tower(s) asked for, no GPU found: running the towers on '
                     f'{num_gpus} logical CPU devices.')
    kind, have = 'cpu', _split(tf.config.list_physical_devices('CPU')[0], num_gpus)
  return DevicePlan(tuple(f'/device:{kind.upper()}:{i}' for i in range(num_gpus)), kind, have)


def _split(device, count, memory_limit=None):
  """Splits a physical device into `count` logical ones unless it has as many; returns how many.

  Each logical GPU gets `memory_limit` MiB; a logical CPU has none.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  configured = tf.config.get_logical_device_configuration(device)
  have = len(configured) if configured else 1
  if have < count:
    try:
      tf.config.set_logical_device_configuration(
          device, [tf.config.LogicalDeviceConfiguration(memory_limit)] * count)
    except RuntimeError as e:
      raise DeviceError(
          f'cannot split {device.name} into {count} devices: TensorFlow already started with '
          f'{have} in this process ({e}). Start a new process.') from e
    have = count
  return have
