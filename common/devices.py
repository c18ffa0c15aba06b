"""Where the towers run (docs/equivalence.md §3).

`--num_gpus N` means N towers. With at least N GPUs the towers go on the
first N GPUs. With fewer, the tool says so on stderr and splits the CPU into N
logical devices, so every multi-tower code path runs on any machine. Devices
are decided here once and passed to the trainers; nothing else names a device
except the variables' host, `/cpu:0`.
"""

import dataclasses
import logging

from cifar10_towers.common import errors

VARIABLE_DEVICE = '/cpu:0'  # upstream keeps all variables on the CPU
MAX_TOWERS = 64  # more logical devices than this is a typo, not a plan

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
    num_gpus: int >= 1, number of towers.

  Returns:
    DevicePlan.

  Raises:
    DeviceError: num_gpus is out of range or the devices cannot be created.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not 1 <= num_gpus <= MAX_TOWERS:
    raise DeviceError('--num_gpus must be between 1 and %d, got %d.'
                      % (MAX_TOWERS, num_gpus))
  gpus = tf.config.list_physical_devices('GPU')
  if len(gpus) >= num_gpus:
    return DevicePlan(tuple('/device:GPU:%d' % i for i in range(num_gpus)),
                      'gpu', 1)
  if num_gpus > 1 or gpus:
    logger.warning('%d tower(s) asked for, %d GPU(s) found: running the towers on %d '
                   'logical CPU devices.', num_gpus, len(gpus), num_gpus)
  cpu = tf.config.list_physical_devices('CPU')[0]
  configured = tf.config.get_logical_device_configuration(cpu)
  have = len(configured) if configured else 1
  if have < num_gpus:
    try:
      tf.config.set_logical_device_configuration(
          cpu, [tf.config.LogicalDeviceConfiguration()] * num_gpus)
    except RuntimeError as e:
      raise DeviceError(
          'cannot split the CPU into %d devices: TensorFlow already started '
          'with %d in this process (%s). Start a new process.'
          % (num_gpus, have, e)) from e
    have = num_gpus
  return DevicePlan(tuple('/device:CPU:%d' % i for i in range(num_gpus)),
                    'cpu', have)
