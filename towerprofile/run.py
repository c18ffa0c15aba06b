"""One profile: scratch dirs, the trainer's adapter, the analysis, the outputs.

The outputs: a Chrome trace (trace.json), a PNG timeline (timeline.png, with
matplotlib) and the report (report.json, and as lines for the terminal).
"""

import dataclasses
import importlib
import json
import logging
import os
import tempfile

from cifar10_towers.common import cifar10_format
from cifar10_towers.common import devices
from cifar10_towers.common import files
from cifar10_towers.common import hparams
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.towerprofile import analysis

logger = logging.getLogger(__name__)

WARMUP_STEPS = 3  # untraced steps first: queues fill, functions trace, kernels warm up
SYNTH_PER_FILE = 200  # generated examples per data_batch file when no data_dir is given


def profile(impl, plan, batch_size, steps, data_dir=None, out_dir=None,
            misplace_tower=None, warmup=WARMUP_STEPS):
  """Trains a few traced steps of one trainer in scratch dirs and reports.

  Args:
    impl: 'legacy' or 'modern'.
    plan: common.devices.DevicePlan, the planned devices.
    batch_size: int, images per tower.
    steps: int >= 1, traced steps.
    data_dir: training data; None: small generated data in a scratch dir.
    out_dir: where trace.json, report.json, timeline.png go; None: nothing.
    misplace_tower: int or None, tower to pin to the variables' device: the
      stray `with tf.device('/cpu:0')` of the issue. The trainer builds with
      that plan, the report compares against `plan`.
    warmup: int, untraced steps first.

  Returns:
    (report dict, dict name -> written path).
  """
  trainer_plan = dataclasses.replace(plan, tower_devices=tuple(
      devices.VARIABLE_DEVICE if i == misplace_tower else device
      for i, device in enumerate(plan.tower_devices)))
  # A scratch train_dir: the profile never reads or writes the user's.
  with files.scratch(tempfile.gettempdir(), 'towerprofile_') as scratch:
    if data_dir is None:
      from cifar10_towers.datasets import synth  # pylint: disable=g-import-not-at-top
      data_dir = scratch
      synth.generate(data_dir, train_per_file=SYNTH_PER_FILE, num_test=10, seed=0)
    examples = cifar10_format.num_examples(cifar10_format.train_files(data_dir))
    if impl == 'legacy':
      logger.warning('legacy: the first step waits until the shuffle queue holds '
                     f'{hparams.min_queue_examples(examples)} images.')
    config = config_lib.TrainConfig(data_dir=data_dir, train_dir=scratch,
                                    num_gpus=plan.num_towers, batch_size=batch_size, seed=0)
    adapter = importlib.import_module(f'cifar10_towers.towerprofile.{impl}_trace')
    # extra: the report fields only that trainer's adapter has.
    events, windows, wall_us, extra = adapter.trace(
        config, trainer_plan, max(1, hparams.decay_steps(examples, batch_size, plan.num_towers)),
        steps, warmup)
  report = analysis.analyze(events, windows, plan.tower_devices, devices.VARIABLE_DEVICE,
                            wall_us)
  report.update(trainer=impl, misplace_tower=misplace_tower, **extra)
  return report, write_all(events, windows, report, out_dir) if out_dir else {}


def chrome_trace(events):
  """A Chrome trace (Perfetto, chrome://tracing) of the events, in the JSON object format.

  One process per device, one thread per category, so a device's row shows
  what it spent its time on; every op is a complete ('X') event.
  """
  names = sorted({e.device for e in events})
  origin = min((e.start_us for e in events), default=0.0)
  trace = [{'ph': 'M', 'name': f'{kind}_name', 'pid': pid, 'tid': tid, 'args': {'name': name}}
           for pid, device in enumerate(names) for kind, tid, name in
           [('process', 0, device)] + [('thread', *c) for c in enumerate(analysis.CATEGORIES)]]
  trace += [{'ph': 'X', 'name': e.name, 'cat': e.category, 'pid': names.index(e.device),
             'tid': analysis.CATEGORIES.index(e.category), 'ts': e.start_us - origin,
             'dur': max(e.end_us - e.start_us, 0.0),
             'args': {'op_type': e.op_type, 'device': e.device, 'step': e.step}}
            for e in events]
  return {'traceEvents': trace, 'displayTimeUnit': 'ms'}


def png_timeline(events, windows, report):
  """One row per device, ops coloured by category, dotted step bounds: a matplotlib Figure.

  Raises:
    ImportError: matplotlib is not installed (it is needed).
  """
  from matplotlib import figure, patches  # pylint: disable=g-import-not-at-top
  names = sorted({e.device for e in events})
  origin = min(windows)[0]  # the first step's start
  fig = figure.Figure(figsize=(12, 1.0 + 0.7 * len(names)))
  axes = fig.add_subplot()
  # One bar per op, in its category's colour of tab10 (matplotlib's C0, C1, ...).
  axes.barh([names.index(e.device) for e in events],
            [(e.end_us - e.start_us) / 1e3 for e in events], 0.8,
            [(e.start_us - origin) / 1e3 for e in events], linewidth=0,
            color=[f'C{analysis.CATEGORIES.index(e.category)}' for e in events])
  axes.use_sticky_edges = False  # a margin, so the first and last step bounds show
  for edge in sum(windows, ()):
    axes.axvline((edge - origin) / 1e3, color='black', linestyle=':', linewidth=0.6)
  axes.set_yticks(range(len(names)), names)
  axes.invert_yaxis()
  axes.set_xlabel('ms')
  axes.set_title(report['verdict'], fontsize=9)
  axes.legend(handles=[patches.Patch(color=f'C{i}', label=category)
                       for i, category in enumerate(analysis.CATEGORIES)],
              loc='lower center', bbox_to_anchor=(0.5, 1.08), ncol=len(analysis.CATEGORIES),
              fontsize=8, frameon=False)
  fig.tight_layout()
  return fig


def write_all(events, windows, report, out_dir):
  """Writes trace.json, report.json and timeline.png into out_dir (created if missing).

  The three replace those there together, each whole (`common.files.replacing`).

  Returns:
    dict name -> path of what was written.

  Raises:
    common.files.WriteError: they could not be written (a full disk, say).
  """
  os.makedirs(out_dir, exist_ok=True)
  written = {name: os.path.join(out_dir, f'{name}.json') for name in ('trace', 'report')}
  try:
    timeline = png_timeline(events, windows, report)
    written['png'] = os.path.join(out_dir, 'timeline.png')
  except ImportError:
    logger.warning('matplotlib is not installed: no timeline.png '
                   '(pip install matplotlib, or the [profile] extra).')
  with files.replacing('--out', *written.values()) as temps:
    for path, content in zip(temps, (chrome_trace(events), report)):
      with open(path, 'w', encoding='utf-8') as f:
        json.dump(content, f, indent=1, sort_keys=True)
    if 'png' in written:
      timeline.savefig(temps[2], dpi=100)
  return written


def format_report(report):
  """The report as lines for the terminal."""
  median = report['median']
  step, slowest = median['step_us'] or 1.0, median['step_over_slowest_tower']
  lines = [f'{report["num_towers"]} tower(s); variables on {report["variable_device"]}; '
           f'input on {report["input_device"]}',
           f'step {step / 1e3:.1f} ms (traced), {(median["wall_us"] or 0) / 1e3:.1f} ms (wall); '
           f'step / slowest tower {format(slowest, ".2f") if slowest else "-"}',
           'median split of the step (idle: no op ran, e.g. the runtime dispatching):',
           *(f'  {category:<15} {value / 1e3:8.2f} ms {100.0 * value / step:5.1f}%'
             for category, value in median['split_us'].items()),
           'busy fraction per device:',
           *(f'  {device:<15} {busy:.2f}' for device, busy in median['busy_fraction'].items()),
           'placement:']
  for p in report['placement']:
    ran_on = ', '.join(f'{d} {100 * s:.1f}%' for d, s in p['ran_on'].items() if s >= 0.001)
    lines.append(f'  tower {p["tower"]} planned {p["planned"]} ran on '
                 f'{ran_on or "nowhere (no compute traced)"}{"  MISPLACED" * p["misplaced"]}')
  return lines + [f'verdict: {report["verdict"]}']
