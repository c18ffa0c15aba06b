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

import dataclasses
import re

# Categories, highest priority first: an instant where a tower computes and a
# copy runs counts as compute, so copies show only when they stall the towers.
FORWARD = 'forward'
BACKWARD = 'backward'
AVERAGE = 'average'  # gradient averaging, where the towers meet
UPDATE = 'update'  # learning rate, apply gradients, global step
EMA = 'moving_average'
INPUT = 'input'  # dequeue (legacy) or iterator (modern)
COPY = 'copy'  # _Send/_Recv and memcpy between devices
OTHER = 'other'
IDLE = 'idle'  # no op of the step runs
CATEGORIES = (FORWARD, BACKWARD, AVERAGE, UPDATE, EMA, INPUT, COPY, OTHER)
COMPUTE = (FORWARD, BACKWARD)

# A tower whose compute ran elsewhere than planned for more than this share of
# its compute time is misplaced (variable reads placed with the variables are
# a few microseconds and stay far below it).
MISPLACED_SHARE = 0.5

_TOWER = re.compile(r'^(?:.*/)?tower_(\d+)/')
_DEVICE = re.compile(r'(?:^|/)(?:device:)?(cpu|gpu|tpu):(\d+)',
                     re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Event:
  """One op execution."""
  name: str  # full op name, e.g. 'tower_1/gradients/tower_1/conv1/Conv2D_grad'
  op_type: str  # e.g. 'Conv2DBackpropFilter', '_Send', '' if unknown
  device: str  # canonical device, e.g. '/device:CPU:1'
  start_us: float  # microseconds, same clock for all events of a step
  end_us: float
  step: int  # index of the traced step
  category: str | None = None  # set by an adapter that knows better; None: by name


def tower_of(name):
  """The tower index in an op name, or None: 'tower_1/conv1/Conv2D' -> 1."""
  match = _TOWER.match(name)
  return int(match.group(1)) if match else None


def categorize(name, op_type=''):
  """The category of an op from its name scope and type.

  Args:
    name: str, the op's full name.
    op_type: str, the op's type if known.

  Returns:
    One of CATEGORIES.
  """
  if op_type in ('_Send', '_Recv', '_HostSend', '_HostRecv', 'MEMCPYHtoD',
                 'MEMCPYDtoH', 'MEMCPYDtoD') or 'memcpy' in name.lower():
    return COPY
  if tower_of(name) is not None:
    # legacy: tower_i/gradients/...; modern: gradient_tape/tower_i/...
    if name.startswith('gradient_tape/') or '/gradients/' in name:
      return BACKWARD
    if 'ReadVariableOp' in name and op_type in ('ReadVariableOp', ''):
      return COPY  # a tower reading a variable from its host
    return FORWARD
  first = name.split('/')[0]
  if 'ExponentialMovingAverage' in name or first in ('ema', 'moving_average'):
    return EMA
  if first.startswith(('average_gradients', 'average')) or first == 'mean_loss':
    return AVERAGE
  if (first.startswith(('dequeue', 'prefetch_queue', 'shuffle_batch',
                        'IteratorGetNext', 'iterator'))
      or op_type in ('QueueDequeueV2', 'QueueDequeueManyV2',
                     'IteratorGetNext', 'IteratorGetNextSync')):
    return INPUT
  if first.startswith(('GradientDescent', 'ExponentialDecay', 'global_step',
                       'update', 'learning_rate', 'AssignSubVariableOp',
                       'AssignAddVariableOp')):
    return UPDATE
  return OTHER


def category_of(event):
  """The event's category: the adapter's, else from its name and type."""
  return event.category or categorize(event.name, event.op_type)


def union_length(intervals):
  """Total length covered by (start, end) intervals, overlaps counted once."""
  total, cur_start, cur_end = 0.0, None, None
  for start, end in sorted(intervals):
    if cur_end is None or start > cur_end:
      if cur_end is not None:
        total += cur_end - cur_start
      cur_start, cur_end = start, end
    else:
      cur_end = max(cur_end, end)
  if cur_end is not None:
    total += cur_end - cur_start
  return total


def coverage_at_least(interval_sets, k):
  """Time during which at least k of the sets have an interval running.

  Args:
    interval_sets: list of lists of (start, end); within one set overlaps
      count once (a tower running two ops at once is one tower computing).
    k: int >= 1.

  Returns:
    float, the length of the time covered by k or more sets.
  """
  edges = []
  for intervals in interval_sets:
    merged = _merge(intervals)
    for start, end in merged:
      edges.append((start, 1))
      edges.append((end, -1))
  edges.sort(key=lambda e: (e[0], e[1]))  # ends before starts at a tie
  total, active, last = 0.0, 0, None
  for time, delta in edges:
    if active >= k and last is not None:
      total += time - last
    active += delta
    last = time
  return total


def _merge(intervals):
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return [tuple(m) for m in merged]


def exclusive_split(events, window):
  """Splits a window so each instant goes to one category (or IDLE).

  Args:
    events: iterable of Event.
    window: (start_us, end_us) of the step.

  Returns:
    dict category -> microseconds, over CATEGORIES + (IDLE,); the values add
    up to the window's length.
  """
  lo, hi = window
  edges = []
  for e in events:
    start, end = max(e.start_us, lo), min(e.end_us, hi)
    if end > start:
      rank = CATEGORIES.index(category_of(e))
      edges.append((start, 1, rank))
      edges.append((end, -1, rank))
  edges.sort(key=lambda e: (e[0], e[1]))
  counts = [0] * len(CATEGORIES)
  split = dict.fromkeys(CATEGORIES + (IDLE,), 0.0)
  last = lo
  for time, delta, rank in edges + [(hi, 0, 0)]:
    if time > last:
      active = [r for r, c in enumerate(counts) if c > 0]
      split[CATEGORIES[min(active)] if active else IDLE] += time - last
      last = time
    counts[rank] += delta
  return split


def tower_overlap(events, num_towers):
  """Time 2+ towers compute at once / time 1+ tower computes; None for 1 tower."""
  if num_towers < 2:
    return None
  sets = [[(e.start_us, e.end_us) for e in events
           if tower_of(e.name) == i and category_of(e) in COMPUTE]
          for i in range(num_towers)]
  any_tower = coverage_at_least(sets, 1)
  return coverage_at_least(sets, 2) / any_tower if any_tower else 0.0


def canonical_device(name):
  """'/job:localhost/replica:0/task:0/device:CPU:1' or '/cpu:1' -> '/device:CPU:1'.

  A GPU trace lane such as '/device:GPU:0/stream:all' maps to its device.
  """
  matches = _DEVICE.findall(name)
  if not matches:
    return name
  kind, index = matches[-1]
  return '/device:%s:%s' % (kind.upper(), index)


def placement(events, planned, variable_device):
  """Where each tower's compute ran, against the plan.

  Args:
    events: iterable of Event.
    planned: list of the planned device of tower i.
    variable_device: the variables' device.

  Returns:
    list of dicts, one per tower: tower, planned, ran_on (device -> share of
    the tower's compute time), main_device, misplaced (bool).
  """
  planned = [canonical_device(d) for d in planned]
  rows = []
  for i, plan_device in enumerate(planned):
    per_device = {}
    for e in events:
      if tower_of(e.name) == i and category_of(e) in COMPUTE:
        per_device[e.device] = (per_device.get(e.device, 0.0)
                                + e.end_us - e.start_us)
    total = sum(per_device.values())
    shares = {d: t / total for d, t in sorted(per_device.items())} if total else {}
    main = max(shares, key=shares.get) if shares else None
    elsewhere = 1.0 - shares.get(plan_device, 0.0) if shares else 0.0
    rows.append({'tower': i, 'planned': plan_device, 'ran_on': shares,
                 'main_device': main, 'misplaced': elsewhere > MISPLACED_SHARE,
                 'on_variable_device': main == canonical_device(variable_device)})
  return rows


def _median(values):
  values = sorted(v for v in values if v is not None)
  if not values:
    return None
  mid = len(values) // 2
  return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def analyze_step(events, window, num_towers, wall_us=None):
  """The numbers of one step.

  Args:
    events: list of Event of this step.
    window: (start_us, end_us) of the traced step.
    num_towers: int.
    wall_us: float, the step's time as the caller measured it, or None.

  Returns:
    dict.
  """
  step_us = window[1] - window[0]
  devices = sorted({e.device for e in events})
  busy = {d: union_length([(max(e.start_us, window[0]), min(e.end_us, window[1]))
                           for e in events if e.device == d]) / step_us
          for d in devices} if step_us > 0 else {}
  towers = []
  for i in range(num_towers):
    compute = [(e.start_us, e.end_us) for e in events if tower_of(e.name) == i
               and category_of(e) in COMPUTE]
    towers.append(union_length(compute))
  slowest = max(towers) if towers else 0.0
  return {
      'step_us': step_us,
      'wall_us': wall_us,
      # The runtime's own time around the ops (dispatch, collecting the
      # trace): the step as measured in Python minus the traced window.
      'outside_trace_us': wall_us - step_us if wall_us is not None else None,
      'busy_fraction': busy,
      'split_us': exclusive_split(events, window),
      'tower_compute_us': towers,
      'tower_overlap': tower_overlap(events, num_towers),
      'step_over_slowest_tower': step_us / slowest if slowest else None,
  }


def analyze(events, windows, planned, variable_device, input_device=None,
            wall_us=None):
  """The report over all traced steps.

  Args:
    events: list of Event (any steps).
    windows: list of (start_us, end_us), window k of step k.
    planned: list of tower i's planned device.
    variable_device: str.
    input_device: str, where the input pipeline runs; None: where the input
      ops of the trace ran longest.
    wall_us: list of measured step times (microseconds) or None.

  Returns:
    dict (JSON-serializable): 'steps', 'median', 'placement', 'verdict'.
  """
  num_towers = len(planned)
  steps = []
  for k, window in enumerate(windows):
    step_events = [e for e in events if e.step == k]
    steps.append(analyze_step(step_events, window, num_towers,
                              wall_us[k] if wall_us else None))
  median = {
      'step_us': _median([s['step_us'] for s in steps]),
      'wall_us': _median([s['wall_us'] for s in steps]),
      'outside_trace_us': _median([s['outside_trace_us'] for s in steps]),
      'tower_overlap': _median([s['tower_overlap'] for s in steps]),
      'step_over_slowest_tower': _median(
          [s['step_over_slowest_tower'] for s in steps]),
      'split_us': {c: _median([s['split_us'][c] for s in steps])
                   for c in CATEGORIES + (IDLE,)},
      'busy_fraction': {d: _median([s['busy_fraction'].get(d, 0.0) for s in steps])
                        for d in sorted({d for s in steps for d in s['busy_fraction']})},
  }
  places = placement(events, planned, variable_device)
  if input_device is None:  # where the input ops ran longest
    per_device = {}
    for e in events:
      if category_of(e) == INPUT:
        per_device[e.device] = (per_device.get(e.device, 0.0)
                                + e.end_us - e.start_us)
    input_device = max(per_device, key=per_device.get) if per_device else 'unknown'
  report = {'num_towers': num_towers, 'planned': [canonical_device(d) for d in planned],
            'variable_device': canonical_device(variable_device),
            'input_device': canonical_device(input_device),
            'steps': steps, 'median': median, 'placement': places}
  report['verdict'] = verdict(report)
  return report


def verdict(report):
  """One line: overlap, input wait, misplaced towers."""
  median = report['median']
  parts = []
  if median['tower_overlap'] is None:
    parts.append('1 tower, nothing to overlap')
  else:
    parts.append('towers overlap %.2f' % median['tower_overlap'])
  step = median['step_us'] or 0.0
  if step:
    parts.append('input waits %.0f%% of the step'
                 % (100.0 * median['split_us'][INPUT] / step))
  wrong = [p for p in report['placement'] if p['misplaced']]
  if wrong:
    parts.append('; '.join('tower %d ran on %s, planned %s'
                           % (p['tower'], p['main_device'], p['planned'])
                           for p in wrong))
  else:
    parts.append('no misplaced ops')
  return '; '.join(parts)
