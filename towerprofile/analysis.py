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
SCOPES = ((EMA, ('ema', 'moving_average', 'ExponentialMovingAverage')),
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
  first = name.split('/')[0]
  return next((category for category, scopes in SCOPES if first.startswith(scopes)), rest)


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
  return '/device:%s:%s' % (matches[-1][0].upper(), matches[-1][1]) if matches else name


def pieces(spans, window):
  """Cuts the window at the spans' edges.

  Args:
    spans: iterable of (start, end, key).
    window: (start, end).

  Yields:
    (length, set of the keys of the spans covering that piece), in order.
  """
  lo, hi = window
  edges = [(lo, 0, None), (hi, 0, None)]
  for start, end, key in spans:
    start, end = max(start, lo), min(end, hi)
    if end > start:
      edges += [(start, 1, key), (end, -1, key)]
  active, last = collections.Counter(), lo
  for time, delta, key in sorted(edges, key=lambda edge: edge[0]):
    if time > last:
      yield time - last, {k for k, count in active.items() if count}
      last = time
    active[key] += delta


def _time_per_device(events):
  times = collections.Counter()
  for e in events:
    times[e.device] += e.end_us - e.start_us
  return times


def _median(values):
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
  split = dict.fromkeys(CATEGORIES + (IDLE,), 0.0)
  # Device or tower -> time during which any of its ops runs (overlaps counted
  # once); the number of towers computing at once -> time.
  busy, computing = collections.Counter(), collections.Counter()
  for length, active in pieces([(e.start_us, e.end_us, (CATEGORIES.index(e.category), e.device,
                                                        e.tower)) for e in events], window):
    split[CATEGORIES[min(rank for rank, _, _ in active)] if active else IDLE] += length
    towers = {tower for _, _, tower in active} - {None}
    for key in {device for _, device, _ in active} | towers:
      busy[key] += length
    computing[len(towers)] += length
  compute_us = sum(t for count, t in computing.items() if count)
  slowest = max([busy[i] for i in range(num_towers)], default=0)
  return {
      'step_us': step_us,
      'wall_us': wall_us,
      # The runtime's own time around the ops (dispatch, collecting the
      # trace): the step as measured in Python minus the traced window.
      'outside_trace_us': wall_us - step_us if wall_us is not None else None,
      'busy_fraction': {device: busy[device] / step_us
                        for device in sorted({e.device for e in events})},
      'split_us': split,
      # Time 2+ towers compute at once / time 1+ tower computes.
      'tower_overlap': None if num_towers < 2 else compute_us and sum(
          t for count, t in computing.items() if count > 1) / compute_us,
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
  steps = [analyze_step([e for e in events if e.step == k], window, len(planned),
                        wall_us[k] if wall_us else None) for k, window in enumerate(windows)]
  median = {key: _median([s[key] for s in steps]) for key in (
      'step_us', 'wall_us', 'outside_trace_us', 'tower_overlap', 'step_over_slowest_tower')}
  for key in ('split_us', 'busy_fraction'):
    median[key] = {k: _median([s[key].get(k, 0.0) for s in steps])
                   for k in dict.fromkeys(k for s in steps for k in s[key])}
  placement = []
  for i, device in enumerate(map(canonical_device, planned)):
    times = _time_per_device([e for e in events if e.tower == i])
    shares = {d: t / sum(times.values()) for d, t in sorted(times.items())}
    main = max(shares, key=shares.get, default=None)
    placement.append({'tower': i, 'planned': device, 'ran_on': shares, 'main_device': main,
                      'misplaced': bool(shares) and 1 - shares.get(device, 0) > MISPLACED_SHARE,
                      'on_variable_device': main == canonical_device(variable_device)})
  inputs = _time_per_device([e for e in events if e.category == INPUT])
  report = {'num_towers': len(planned), 'planned': [p['planned'] for p in placement],
            'variable_device': canonical_device(variable_device),
            'input_device': max(inputs, key=inputs.get, default='unknown'),  # where it ran longest
            'steps': steps, 'median': median, 'placement': placement}
  report['verdict'] = verdict(report)
  return report


def verdict(report):
  """One line: overlap, input wait, misplaced towers."""
  median = report['median']
  parts = ['1 tower, nothing to overlap' if median['tower_overlap'] is None
           else 'towers overlap %.2f' % median['tower_overlap']]
  if median['step_us']:
    parts.append('input waits %.0f%% of the step'
                 % (100.0 * median['split_us'][INPUT] / median['step_us']))
  parts += ['tower %(tower)d ran on %(main_device)s, planned %(planned)s' % p
            for p in report['placement'] if p['misplaced']] or ['no misplaced ops']
  return '; '.join(parts)
