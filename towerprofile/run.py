"""One profile: scratch dirs, the trainer's adapter, the analysis, the outputs."""

import dataclasses
import shutil
import tempfile

from cifar10_towers.common import config as config_lib
from cifar10_towers.common import devices
from cifar10_towers.towerprofile import analysis
from cifar10_towers.towerprofile import render

IMPLS = ('legacy', 'modern')
WARMUP_STEPS = 3  # untraced steps first: queues fill, functions trace, kernels warm up
SYNTH_PER_FILE = 200  # generated examples per data_batch file when no data_dir is given


def misplaced_plan(plan, tower):
  """The demonstration's plan: `tower` pinned to the variables' device.

  This is the stray `with tf.device('/cpu:0')` of the issue: the trainer gets
  this plan, the report compares against `plan`.
  """
  if not 0 <= tower < plan.num_towers:
    raise ValueError('--misplace_tower must be in [0, %d), got %d'
                     % (plan.num_towers, tower))
  tower_devices = list(plan.tower_devices)
  tower_devices[tower] = devices.VARIABLE_DEVICE
  return dataclasses.replace(plan, tower_devices=tuple(tower_devices))


def profile(impl, plan, batch_size, steps, data_dir=None, out_dir=None,
            misplace_tower=None, seed=0, warmup=WARMUP_STEPS, warn=None):
  """Trains a few traced steps of one trainer in scratch dirs and reports.

  Args:
    impl: 'legacy' or 'modern'.
    plan: common.devices.DevicePlan, the planned devices.
    batch_size: int, images per tower.
    steps: int >= 1, traced steps.
    data_dir: training data; None: small generated data in a scratch dir.
    out_dir: where trace.json, report.json, timeline.png go; None: nothing.
    misplace_tower: int or None, tower to pin to the variable device.
    seed: int, graph/global seed.
    warmup: int, untraced steps first.
    warn: callable(str) for diagnostics.

  Returns:
    (report dict, dict name -> written path).
  """
  if impl not in IMPLS:
    raise ValueError('impl must be one of %s, got %r' % (IMPLS, impl))
  trainer_plan = (misplaced_plan(plan, misplace_tower)
                  if misplace_tower is not None else None)
  scratch = tempfile.mkdtemp(prefix='towerprofile_')
  try:
    if data_dir is None:
      from cifar10_towers.common import synth  # pylint: disable=g-import-not-at-top
      data_dir = '%s/data' % scratch
      synth.generate(data_dir, train_per_file=SYNTH_PER_FILE, num_test=10,
                     seed=seed)
    # A scratch train_dir: the profile never reads or writes the user's.
    config = config_lib.TrainConfig(
        data_dir=data_dir, train_dir='%s/train' % scratch,
        num_gpus=plan.num_towers, batch_size=batch_size, seed=seed)
    sources = None
    if impl == 'legacy' and warn:
      from cifar10_towers.common import cifar10_format  # pylint: disable=g-import-not-at-top
      from cifar10_towers.common import hparams  # pylint: disable=g-import-not-at-top
      warn('legacy: the first step waits until the shuffle queue holds %d '
           'images.' % hparams.min_queue_examples(cifar10_format.num_examples(
               cifar10_format.train_files(data_dir))))
    if impl == 'legacy':
      from cifar10_towers.towerprofile import legacy_trace  # pylint: disable=g-import-not-at-top
      events, windows, wall_us = legacy_trace.trace(
          config, plan, steps, warmup=warmup, trainer_plan=trainer_plan)
    else:
      from cifar10_towers.towerprofile import modern_trace  # pylint: disable=g-import-not-at-top
      events, windows, wall_us, sources = modern_trace.trace(
          config, plan, steps, warmup=warmup, trainer_plan=trainer_plan,
          logdir='%s/profiler' % scratch)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  report = analysis.analyze(events, windows, plan.tower_devices,
                            devices.VARIABLE_DEVICE, wall_us=wall_us)
  report['trainer'] = impl
  report['misplace_tower'] = misplace_tower
  if sources is not None:
    counts = {}
    for source in sources.values():
      counts[source] = counts.get(source, 0) + 1
    report['placement_sources'] = counts
  written = render.write_all(events, windows, report, out_dir, warn) if out_dir else {}
  return report, written
