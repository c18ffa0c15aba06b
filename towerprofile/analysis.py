"""Interval math on a normalized trace: busy time, categories, overlap, placement.

Knows no TensorFlow. An adapter turns a trainer's trace into `Event`s, one per
op execution, and `analyze` answers the issue's questions from them:

* busy fraction of each device (union of its ops' intervals / step time);
* an exclusive split of each step into categories: every instant of the step
  goes to the highest-priority category running then, or to 'idle', so the
  split adds up to the traced step exactly and double counting is impossible;
* tower overlap: time during which 2+ towers compute / time during which 1+
  tower computes (1.0 all towers at once, 0.0 one after the other);
* placement: the device on which each tower's compute actually ran, against
  the device the plan gave it.
"""

import collections
import dataclasses
import re
import statistics

import numpy as np

# Categories, highest priority first: an instant where a tower computes and a
# copy runs counts as compute, so copies show only when they stall the towers.
CATEGORIES = FORWARD, BACKWARD, AVERAGE, UPDATE, EMA, INPUT, COPY, OTHER = (
    'forward', 'backward',
    'average',  # gradient averaging, where the towers meet
    'update',  # learning rate, apply gradients, global step
    'moving_average', 'input',  # dequeue (legacy) or iterator (modern)
    'copy',  # _Send/_Recv and memcpy between devices
    'other')
IDLE = 'idle'  # no op of the step runs
COMPUTE = (FORWARD, BACKWARD)
# Copies between devices (_Send/_Recv, on a GPU its memcpy lane) and the step's input wait.
COPY_OPS = re.compile(r'_(Host)?(Send|Recv)|MEMCPY(HtoD|DtoH|DtoD)?')
INPUT_OPS = ('QueueDequeueV2', 'QueueDequeueManyV2', 'IteratorGetNext', 'IteratorGetNextSync')
# The category of an op outside the towers by its first name scope (the first match wins).
# Modern's step (modern/step.py) names its parts as legacy's: average_gradients, update,
# moving_average; `unstack` splits each tower's batch off the one batch (legacy: dequeue_i).
SCOPES = ((EMA, ('ema', 'moving_average')),  # ExponentialMovingAverage: anywhere (categorize)
          (AVERAGE, ('average', 'mean_loss')),
          (INPUT, ('dequeue', 'prefetch_queue', 'shuffle_batch', 'IteratorGetNext', 'iterator',
                   'unstack')),
          (UPDATE, ('GradientDescent', 'ExponentialDecay', 'global_step', 'update',
                    'learning_rate', 'AssignSubVariableOp', 'AssignAddVariableOp')))

# A tower whose compute ran elsewhere than planned for more than this share of
# its compute time is misplaced (variable reads placed with the variables are
# a few microseconds and stay far below it).
MISPLACED_SHARE = 0.5

_TOWER = re.compile(r'^(?:.*/)?tower_(\d+)/')
_DEVICE = re.compile(r'(?:^|/)(?:device:)?(cpu|gpu|tpu):(\d+)', re.IGNORECASE)


def tower_of(name):
  """The tower index in an op name, or None: 'tower_1/conv1/Conv2D' -> 1."""
  match = _TOWER.match(name)
  return int(match[1]) if match else None


def categorize(name, op_type, rest=OTHER):
  """The category (one of CATEGORIES) of an op from its full name and its type if known.

  `rest` is the category of an op no rule knows.
  """
  if COPY_OPS.fullmatch(op_type) or 'memcpy' in name.lower():
    return COPY
  if tower_of(name) is not None:
    # legacy: tower_i/gradients/...; modern: gradient_tape/tower_i/...
    if name.startswith('gradient_tape/') or '/gradients/' in name:
      return BACKWARD
    # A tower reading a variable from its host is a copy.
    return COPY if 'ReadVariableOp' in name and op_type in ('ReadVariableOp', '') else FORWARD
  if 'ExponentialMovingAverage' in name:
    return EMA
  if op_type in INPUT_OPS:
    return INPUT
  # No scope holds a '/': the name starts with one iff its first scope does.
  return next((category for category, scopes in SCOPES if name.startswith(scopes)), rest)


@dataclasses.dataclass
class Event:
  """One op execution."""
  name: str  # full op name, e.g. 'tower_1/gradients/tower_1/conv1/Conv2D_grad'
  op_type: str  # e.g. 'Conv2DBackpropFilter', '_Send', '' if unknown
  device: str  # canonical device, e.g. '/device:CPU:1'
  start_us: float  # microseconds, same clock for all events of a step
  end_us: float
  step: int  # index of the traced step
  category: str | None = None  # None: `categorize` by name and type
  tower: int | None = dataclasses.field(init=False)  # whose compute this is, if a tower's

  def __post_init__(self):
    self.category = self.category or categorize(self.name, self.op_type)
    self.tower = tower_of(self.name) if self.category in COMPUTE else None


def canonical_device(name):
  """'/job:localhost/replica:0/task:0/device:CPU:1' or '/cpu:1' -> '/device:CPU:1'.

  A GPU trace lane such as '/device:GPU:0/stream:all' maps to its device.
  """
  matches = _DEVICE.findall(name)
  return f'/device:{matches[-1][0].upper()}:{matches[-1][1]}' if matches else name


def pieces(spans, window):
  """Cuts the window at the spans' edges.

  Args:
    spans: list of (start, end).
    window: (start, end).

  Returns:
    (lengths, covers): float [pieces], the pieces' lengths in order; bool
    [spans, pieces], whether span i runs during all of piece j.
  """
  starts, ends = np.clip(np.reshape(spans, (-1, 2)), *window).T
  edges = np.unique(np.concatenate([window, starts, ends]))
  return np.diff(edges), (starts[:, None] <= edges[:-1]) & (ends[:, None] >= edges[1:])


def _time_per_device(events):
  times = collections.Counter()
  for e in events:
    times[e.device] += e.end_us - e.start_us
  return times


def _median(values):
  """The median of numbers (None left out; none: None), or of dicts key by key (missing: 0)."""
  if isinstance(values[0], dict):
    return {k: _median([v.get(k, 0.0) for v in values])
            for k in dict.fromkeys(k for v in values for k in v)}
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def analyze_step(events, window, num_towers, wall_us=None):
  """The numbers of one step: busy fractions, exclusive split, tower overlap.

  Args:
    events: list of Event of this step.
    window: (start_us, end_us) of the traced step.
    num_towers: int.
    wall_us: float, the step's time as the caller measured it, or None.
  """
  step_us = window[1] - window[0]
  lengths, covers = pieces([(e.start_us, e.end_us) for e in events], window)

  def running(keep):  # per piece: whether an op that keep(event) selects runs
    return covers[[keep(e) for e in events]].any(axis=0)

  towers = [running(lambda e: e.tower == i) for i in range(num_towers)]
  at_once = sum(towers)  # per piece: how many towers compute
  computing = lengths @ (at_once > 0)
  slowest = max(lengths @ tower for tower in towers)
  # A piece's category: the highest-priority one of its running ops; none: idle.
  ranks = np.array([CATEGORIES.index(e.category) for e in events], int)[:, None]
  first = np.where(covers, ranks, len(CATEGORIES)).min(axis=0, initial=len(CATEGORIES))
  return {
      'step_us': step_us,
      'wall_us': wall_us,
      # The runtime's own time around the ops (dispatch, collecting the
      # trace): the step as measured in Python minus the traced window.
      'outside_trace_us': wall_us and wall_us - step_us,
      # Time during which any of the device's ops runs (overlaps counted once).
      'busy_fraction': {device: lengths @ running(lambda e: e.device == device) / step_us
                        for device in sorted({e.device for e in events})},
      'split_us': dict(zip(CATEGORIES + (IDLE,), np.bincount(
          first, lengths, len(CATEGORIES) + 1).tolist())),
      # Time 2+ towers compute at once / time 1+ tower computes.
      'tower_overlap': None if num_towers < 2
                       else computing and lengths @ (at_once > 1) / computing,
      'step_over_slowest_tower': step_us / slowest if slowest else None,
  }


def analyze(events, windows, planned, variable_device, wall_us=None):
  """The report over all traced steps.

  Args:
    events: list of Event (any steps).
    windows: list of (start_us, end_us), window k of step k.
    planned: list of tower i's planned device.
    variable_device: str.
    wall_us: list of measured step times (microseconds) or None.

  Returns:
    dict (JSON-serializable): 'steps', 'median', 'placement', 'verdict', ...
  """
  variable_device = canonical_device(variable_device)
  steps = [analyze_step([e for e in events if e.step == k], window, len(planned),
                        wall_us and wall_us[k]) for k, window in enumerate(windows)]
  placement = []
  for i, device in enumerate(map(canonical_device, planned)):
    times = _time_per_device([e for e in events if e.tower == i])
    shares = {d: t / times.total() for d, t in sorted(times.items())}
    main = max(shares, key=shares.get, default=None)
    placement.append({'tower': i, 'planned': device, 'ran_on': shares, 'main_device': main,
                      'misplaced': bool(shares) and 1 - shares.get(device, 0) > MISPLACED_SHARE,
                      'on_variable_device': main == variable_device})
  inputs = _time_per_device([e for e in events if e.category == INPUT])
  report = {'num_towers': len(planned), 'planned': [p['planned'] for p in placement],
            'variable_device': variable_device,
            'input_device': max(inputs, key=inputs.get, default='unknown'),  # where it ran longest
            'steps': steps, 'median': _median(steps), 'placement': placement}
  report['verdict'] = verdict(report)
  return report


def verdict(report):
  """One line: overlap, input wait, misplaced towers."""
  median = report['median']
  parts = ['1 tower, nothing to overlap' if median['tower_overlap'] is None
           else f'towers overlap {median["tower_overlap"]:.2f}']
  if median['step_us']:
    parts.append(f'input waits {100.0 * median["split_us"][INPUT] / median["step_us"]:.0f}% '
                 'of the step')
  parts += [f'tower {p["tower"]} ran on {p["main_device"]}, planned {p["planned"]}'
            for p in report['placement'] if p['misplaced']] or ['no misplaced ops']
  return '; '.join(parts)
