"""towerprofile.analysis on synthetic events: interval math, categories, placement."""

import pytest

from cifar10_towers.towerprofile import analysis

CPU0, CPU1 = '/device:CPU:0', '/device:CPU:1'


def ev(name, device, start, end, step=0, op_type=''):
  return analysis.Event(name, op_type, device, float(start), float(end), step)


def keyed_pieces(spans, window):
  """(length, set of the keys of the spans covering it) of each piece, in order."""
  lengths, covers = analysis.pieces([span[:2] for span in spans], window)
  assert covers.shape == (len(spans), len(lengths))
  return [(length, {key for (_, _, key), on in zip(spans, column) if on})
          for length, column in zip(lengths.tolist(), covers.T)]


def test_pieces_cut_the_window_at_every_edge():
  spans = [(0, 10, 'a'), (5, 15, 'b'), (8, 9, 'c'), (2, 8, 'a'), (20, 30, 'a')]
  assert keyed_pieces(spans, (-5, 25)) == [
      (5, set()), (2, {'a'}), (3, {'a'}), (3, {'a', 'b'}), (1, {'a', 'b', 'c'}),
      (1, {'a', 'b'}), (5, {'b'}), (5, set()), (5, {'a'})]
  assert keyed_pieces([], (0, 10)) == [(10, set())]


def test_busy_fraction_counts_overlaps_once():
  events = [ev('a', CPU0, 0, 10), ev('b', CPU0, 5, 15), ev('c', CPU0, 20, 30),
            ev('d', CPU1, 0, 40)]
  busy = analysis.analyze_step(events, (0, 40), 1)['busy_fraction']
  assert busy == {CPU0: 25 / 40, CPU1: 1.0}


@pytest.mark.parametrize('towers,expected', [
    # Both towers at once: fully parallel.
    ([(0, 100), (0, 100)], 1.0),
    # One after the other: serialized.
    ([(0, 100), (100, 200)], 0.0),
    # Half of the 150 us of compute has both.
    ([(0, 100), (50, 150)], 50 / 150),
])
def test_tower_overlap(towers, expected):
  events = [ev('tower_%d/conv1/Conv2D' % i, 'd%d' % i, s, e)
            for i, (s, e) in enumerate(towers)]
  # One tower running two ops at once is still one tower.
  events.append(ev('tower_0/conv1/Relu', 'd0', 0, 10))
  step = analysis.analyze_step(events, (0, 200), 2)
  assert step['tower_overlap'] == pytest.approx(expected)


def test_tower_overlap_one_tower_is_none():
  step = analysis.analyze_step([ev('tower_0/a', CPU0, 0, 1)], (0, 1), 1)
  assert step['tower_overlap'] is None


@pytest.mark.parametrize('name,op_type,category', [
    ('tower_0/conv1/Conv2D', 'Conv2D', analysis.FORWARD),
    ('tower_1/gradients/tower_1/conv1/Conv2D_grad/X', 'Conv2DBackpropFilter',
     analysis.BACKWARD),
    ('gradient_tape/tower_1/conv1/Conv2DBackpropFilter', '', analysis.BACKWARD),
    ('average_gradients/Mean_3', 'Mean', analysis.AVERAGE),
    ('GradientDescent/update_conv1/weights/ResourceApplyGradientDescent', '',
     analysis.UPDATE),
    ('ExponentialMovingAverage/AssignMovingAvg', '', analysis.EMA),
    ('dequeue_1', 'QueueDequeueV2', analysis.INPUT),
    ('edge_12_tower_1/AddN', '_Send', analysis.COPY),
    ('tower_1/Conv2D/ReadVariableOp', 'ReadVariableOp', analysis.COPY),
    ('mystery', 'NoOp', analysis.OTHER),
])
def test_categorize(name, op_type, category):
  assert analysis.categorize(name, op_type) == category


def test_adapter_category_wins():
  event = analysis.Event('Mean_3', 'Mean', CPU0, 0, 1, 0, analysis.AVERAGE)
  assert event.category == analysis.AVERAGE


def test_exclusive_split_adds_up_and_prefers_compute():
  events = [
      ev('dequeue_0', CPU0, 0, 20, op_type='QueueDequeueV2'),
      ev('tower_0/conv1/Conv2D', CPU0, 10, 60),  # hides the input wait's end
      ev('tower_0/gradients/x', CPU0, 60, 90),
      ev('ExponentialMovingAverage/x', CPU0, 95, 100),
  ]
  split = analysis.analyze_step(events, (0, 100), 1)['split_us']
  assert sum(split.values()) == pytest.approx(100)
  assert split[analysis.INPUT] == 10
  assert split[analysis.FORWARD] == 50
  assert split[analysis.BACKWARD] == 30
  assert split[analysis.EMA] == 5
  assert split[analysis.IDLE] == 5


@pytest.mark.parametrize('name,device', [
    ('/job:localhost/replica:0/task:0/device:CPU:1', CPU1),
    ('/cpu:0', CPU0),
    ('/device:GPU:2/stream:all', '/device:GPU:2'),
    ('/job:localhost/replica:0/task:0/device:GPU:0/memcpy', '/device:GPU:0'),
])
def test_canonical_device(name, device):
  assert analysis.canonical_device(name) == device


def _two_tower_step(step, tower1_device, offset=0.0):
  return [
      ev('dequeue_0', CPU0, offset, offset + 5, step, 'QueueDequeueV2'),
      ev('tower_0/conv1/Conv2D', CPU0, offset + 5, offset + 50, step),
      ev('tower_1/conv1/Conv2D', tower1_device, offset + 5, offset + 50, step),
      ev('tower_1/Conv2D/ReadVariableOp', CPU0, offset + 5, offset + 6, step,
         'ReadVariableOp'),
      ev('average_gradients/Mean', CPU0, offset + 50, offset + 60, step),
  ]


def test_analyze_placement_and_verdict():
  events = _two_tower_step(0, CPU1) + _two_tower_step(1, CPU1, 100.0)
  report = analysis.analyze(events, [(0, 60), (100, 160)], ['/cpu:0', '/cpu:1'],
                            '/cpu:0', wall_us=[61.0, 62.0])
  assert [p['main_device'] for p in report['placement']] == [CPU0, CPU1]
  assert not any(p['misplaced'] for p in report['placement'])
  assert report['input_device'] == CPU0
  assert report['median']['tower_overlap'] == 1.0
  assert report['median']['busy_fraction'][CPU1] == pytest.approx(45 / 60)
  assert report['verdict'] == ('towers overlap 1.00; input waits 8% of the '
                               'step; no misplaced ops')


def test_analyze_flags_a_tower_on_another_device():
  events = _two_tower_step(0, CPU0)
  report = analysis.analyze(events, [(0, 60)], [CPU0, CPU1], CPU0)
  tower1 = report['placement'][1]
  assert tower1['misplaced'] and tower1['on_variable_device']
  assert tower1['ran_on'] == {CPU0: 1.0}
  assert 'tower 1 ran on /device:CPU:0, planned /device:CPU:1' in report['verdict']


@pytest.mark.parametrize('name,op_type,category', [
    # The step's name scopes (modern/step.py) are read as legacy's.
    ('average_gradients/stack_4', 'Pack', analysis.AVERAGE),
    ('average_gradients/Mean_4', 'Mean', analysis.AVERAGE),
    ('update/AssignSubVariableOp_4', 'AssignSubVariableOp', analysis.UPDATE),
    ('moving_average/Sub_3', 'Sub', analysis.EMA),
    # Each tower's batch split off the one batch: input, as legacy's dequeue_i.
    ('unstack_1', 'Unpack', analysis.INPUT),
    ('average_gradients/stack_4/_12', '_Send', analysis.COPY),
    ('gradient_tape/tower_1/conv1/Conv2DBackpropFilter', 'Conv2DBackpropFilter',
     analysis.BACKWARD),
    ('tower_0/conv1/Conv2D', 'Conv2D', analysis.FORWARD),
    # The rest on the variable device: the variables' reads, the clipping.
    ('clip_gradients/mul', 'Mul', analysis.UPDATE),
])
def test_modern_categories(name, op_type, category):
  # Modern's adapter: what no rule knows (on the variable device) is the update.
  assert analysis.categorize(name, op_type, analysis.UPDATE) == category


def test_a_gpu_plane_shared_by_logical_gpus_names_the_traced_device():
  """xplane has one plane per physical GPU: on logical GPUs of one GPU (2 towers on one H100
  put tower 1 "on GPU:0", a false MISPLACED), each kernel's logical GPU is the traced one's."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  from cifar10_towers.towerprofile import modern_trace  # pylint: disable=g-import-not-at-top
  space = xplane_pb2.XSpace()
  host = space.planes.add(name='/host:CPU')
  host.event_metadata[1].name = modern_trace.STEP_EVENT
  host.lines.add().events.add(metadata_id=1, offset_ps=0, duration_ps=10**9)
  gpu = space.planes.add(name='/device:GPU:0')
  gpu.stat_metadata[1].name = 'tf_op'
  gpu.event_metadata[2].name = 'a kernel'
  kernels = gpu.lines.add()
  for k in (0, 1):
    kernel = kernels.events.add(metadata_id=2, offset_ps=(k + 1) * 10**6, duration_ps=10**6)
    kernel.stats.add(metadata_id=1, str_value='tower_%d/conv1/Conv2D:Conv2D' % k)
  device_of = {'tower_%d/conv1/Conv2D' % k: '/device:GPU:%d' % k for k in (0, 1)}
  for logical_gpus, expected in ((False, ['/device:GPU:0', '/device:GPU:0']),
                                 (True, ['/device:GPU:0', '/device:GPU:1'])):
    events, windows, _ = modern_trace.events_from_xspace(space, device_of, logical_gpus)
    assert windows == [(0.0, 1000.0)]
    assert [(event.name, event.device) for event in events] == [
        ('tower_0/conv1/Conv2D', expected[0]), ('tower_1/conv1/Conv2D', expected[1])]
