"""What users see: one TensorBoard tag set for both trainers, honest speed, progress lines.

Each trainer trains a few tiny steps in this process (batch 4, 2 towers,
summaries every 2 steps); the event files are read back as TensorBoard reads
them, and the log lines and heartbeat lines are checked.
"""

import collections
import importlib
import os
import re
import time

import numpy as np
import pytest
from tensorboard.util import tensor_util

from cifar10_towers.common import devices
from cifar10_towers.common import tags as tb_tags
from cifar10_towers.common import model_spec
from cifar10_towers.modern import engines
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import training
import faults_support as fs

SLOW_WRITE = 0.75  # seconds each summary write is slowed by
_MODERN_WRITE = engines.Towers.write_summaries  # named here: a rename fails at collection


def _slow_summary_writes(impl, monkeypatch):
  """Slows each summary write of `impl` by SLOW_WRITE seconds; the list of calls."""
  calls = []
  if impl == 'modern':
    write = _MODERN_WRITE

    def slow(*args, **kwargs):
      calls.append(time.time())
      time.sleep(SLOW_WRITE)
      return write(*args, **kwargs)
    monkeypatch.setattr(engines.Towers, write.__name__, slow)
  else:
    import tensorflow.compat.v1 as tf1  # pylint: disable=import-outside-toplevel
    add = tf1.summary.FileWriter.add_summary

    def slow_add(self, *args, **kwargs):
      calls.append(time.time())
      time.sleep(SLOW_WRITE)
      return add(self, *args, **kwargs)
    monkeypatch.setattr(tf1.summary.FileWriter, 'add_summary', slow_add)
  return calls


def _train(impl, synth_data_dir, train_dir, monkeypatch):
  """4 steps, summaries at 2 and 4 (slowed), one log line at 4; (tags, graph, lines)."""
  # Any wait of the first step past 50 ms says what it is doing.
  monkeypatch.setattr(training, 'HEARTBEAT_AFTER', 0.05)
  calls = _slow_summary_writes(impl, monkeypatch)
  trainer = importlib.import_module('cifar10_towers.%s.train' % impl)
  config = config_lib.TrainConfig(
      data_dir=synth_data_dir, train_dir=str(train_dir), num_gpus=2,
      batch_size=4, max_steps=4, log_every=4, summary_every=2, save_every=100,
      seed=1)
  extra = {'num_threads': 2} if impl == 'legacy' else {}
  with fs.Logged() as logged:
    assert trainer.train(config, devices.plan_devices(2), **extra) == 4
  lines = logged.out + logged.err
  assert len(calls) == 2, calls  # steps 2 and 4 wrote summaries, slowly
  tags, graph, acc = fs.read_tags(train_dir)
  return tags, graph, acc, lines


@pytest.fixture(scope='module')
def runs(synth_data_dir, tmp_path_factory):
  """Both trainers' (tags, graph, accumulator, lines), trained once for the module."""
  results = {}
  with pytest.MonkeyPatch.context() as monkeypatch:
    for impl in ('legacy', 'modern'):
      results[impl] = _train(impl, synth_data_dir,
                             tmp_path_factory.mktemp(impl) / 'train', monkeypatch)
      monkeypatch.undo()
  return results


@pytest.mark.slow
def test_both_trainers_write_the_same_tags(runs):
  legacy_tags, legacy_graph, _, _ = runs['legacy']
  modern_tags, modern_graph, _, _ = runs['modern']
  assert legacy_tags == modern_tags
  assert legacy_tags == tb_tags.summary_tags(2)
  assert legacy_graph and modern_graph


@pytest.mark.slow
def test_the_tags_are_the_documented_names(runs):
  tags, _, _, _ = runs['modern']
  scalars, histograms = set(tags['scalars']), set(tags['histograms'])
  assert {'total_loss', 'learning_rate', 'tower_0/total_loss', 'tower_1/total_loss',
          'tower_1/cross_entropy', 'tower_0/local3/weight_loss',
          'tower_1/local4/weight_loss', 'tower_0/conv1/sparsity',
          'tower_1/softmax_linear/sparsity'} <= scalars
  assert {'conv1/weights', 'conv1/weights/ExponentialMovingAverage',
          'local4/biases/gradients', 'tower_0/conv2/activations',
          'tower_1/local3/activations'} <= histograms
  assert tags['images'] == ['images/image/0', 'images/image/1', 'images/image/2']
  # No TF-uniquified names ('total_loss_1', 'conv1/weights_1').
  assert not [t for t in scalars | histograms if re.search(r'_\d+(/|$)', t)
              and not t.startswith('tower_')]
  assert not [t for t in scalars | histograms if re.search(r'_loss_\d', t)]
  # The README lists them.
  with open(os.path.join(fs.ROOT, 'README.md'), encoding='utf-8') as f:
    readme = f.read()
  for name in ('total_loss', 'learning_rate', 'tower_N/cross_entropy',
               'tower_N/local3/weight_loss', 'tower_N/<layer>/activations',
               'tower_N/<layer>/sparsity', '<variable>/gradients',
               '<variable>/ExponentialMovingAverage', 'images/image/0'):
    assert name in readme, name


# The top level of legacy's graph in TensorBoard, as upstream's read: the input queue, the towers,
# their meeting, the update and the moving averages; then the model's variables (their names are
# the checkpoint's keys) and the run's machinery.
LEGACY_TOP_LEVEL = {'input', 'tower_0', 'tower_1', 'average_gradients', 'mean_loss',
                    'learning_rate', 'update', 'moving_average', 'global_step', 'summaries',
                    'train', 'save', 'init'} | {n.split('/')[0] for n in model_spec.VARIABLE_NAMES}
# The only conds (Switch, Merge; If in TF2's control flow), each folded inside its scope:
# tf.nn.zero_fraction's in upstream's sparsity summaries of each tower, and
# ExponentialMovingAverage.apply's choice of each shadow variable's initial value.
COND_PLACES = re.compile(r'(tower_\d+/zero_fraction(_\d+)?|moving_average)/cond(_\d+)?(/|$)')


def _tensorboard_auxiliary(graph):
  """The top-level nodes that TensorBoard's graph tab moves to "Auxiliary Nodes" for their inputs.

  Its rule (tensorboard 2.21, extractHighDegrees): a node with more top-level predecessors
  (those sending data; else all) than max(4, 2 * Q3 - Q1) of all top-level nodes' counts, where
  each function of the graph's library counts as one node without edges.
  """
  def top(name):  # '^tower_0/conv1/Conv2D', 'input/dequeue_0:1' -> 'tower_0', 'input'
    return name.lstrip('^').split('/')[0].split(':')[0]
  data, every = collections.defaultdict(set), collections.defaultdict(set)
  for node in graph.node:
    for source in node.input:
      if top(source) != top(node.name):
        every[top(node.name)].add(top(source))
        if not source.startswith('^'):
          data[top(node.name)].add(top(source))
  degrees = {top(n.name): len(data[top(n.name)] or every[top(n.name)]) for n in graph.node}
  counts = sorted(list(degrees.values()) + [0] * len(graph.library.function))
  q1, q3 = (counts[int(len(counts) * q + 0.5)] for q in (0.25, 0.75))  # JavaScript's rounding
  return {name for name, degree in degrees.items() if degree > max(4, 2 * q3 - q1)}


@pytest.mark.slow
def test_the_legacy_graph_shows_the_towers_and_where_they_meet(runs):
  graph = runs['legacy'][2].Graph()  # the GraphDef of the event file, as TensorBoard reads it
  assert {node.name.split('/')[0] for node in graph.node} == LEGACY_TOP_LEVEL
  conds = [n.name for n in graph.node
           if n.op in ('Switch', 'RefSwitch', 'Merge', 'If', 'StatelessIf')
           or re.search(r'(^|/)cond(_\d+)?(/|$)', n.name)]
  assert len(conds) >= 10, conds  # the 10 shadow variables' conds at least: the check sees them
  assert [c for c in conds if not COND_PLACES.match(c)] == []
  assert _tensorboard_auxiliary(graph) & {'input', 'tower_0', 'tower_1', 'average_gradients',
                                          'update', 'moving_average'} == set()


@pytest.mark.slow
def test_summaries_hold_the_steps_values(runs):
  for impl in ('legacy', 'modern'):
    _, _, acc, _ = runs[impl]
    steps = [e.step for e in acc.Tensors('tower_0/cross_entropy')]
    assert steps == [2, 4], (impl, steps)
    for tag in ('total_loss', 'tower_1/total_loss'):
      values = [float(tensor_util.make_ndarray(e.tensor_proto))
                for e in acc.Tensors(tag)]
      assert all(3.0 < v < 7.0 for v in values), (impl, tag, values)
    sparsity = [float(tensor_util.make_ndarray(e.tensor_proto))
                for e in acc.Tensors('tower_0/conv1/sparsity')]
    assert all(0.0 <= v <= 1.0 for v in sparsity), (impl, sparsity)


@pytest.mark.slow
def test_log_speed_excludes_slow_summary_writes(runs):
  for impl in ('legacy', 'modern'):
    lines = runs[impl][3]
    logged = [l for l in lines if ': step ' in l]
    assert len(logged) == 1, (impl, lines)
    m = re.search(r'step 4, loss = [\d.]+ \(([\d.]+) examples/sec; ([\d.]+) sec/batch\)',
                  logged[0])
    assert m, logged
    examples_per_sec, sec_per_batch = float(m.group(1)), float(m.group(2))
    # The slow writes of steps 2 and 4 are not in it (the old per-step
    # figure of step 4 could not see them either, but a wall-clock window
    # would): the window's plain step, step 3, is a tiny fraction of them.
    assert sec_per_batch < SLOW_WRITE / 3, (impl, logged[0])
    assert examples_per_sec == pytest.approx(8 / sec_per_batch, rel=0.05, abs=0.2)


@pytest.mark.slow
def test_first_step_says_what_it_waits_for(runs):
  legacy_lines, modern_lines = runs['legacy'][3], runs['modern'][3]
  assert any(re.match(r'(Filling the queue: \d+ of \d+ examples|Running the first '
                      r'step)\.\.\. \d+ s$', l) for l in legacy_lines), legacy_lines
  assert any(re.match(r'Building and tracing the step \(first step\)\.\.\. \d+ s$', l)
             for l in modern_lines), modern_lines


def test_log_window_means_over_plain_steps():
  window = training.LogWindow()
  assert window.rates() == (0.0, 0.0)
  window.add(30.0, 16, extra=True)  # the first step: tracing, filling
  window.add(0.1, 16)
  window.add(5.0, 16, extra=True)  # a summary step
  window.add(0.3, 16)
  examples_per_sec, sec_per_batch = window.rates()
  assert sec_per_batch == pytest.approx(0.2)
  assert examples_per_sec == pytest.approx(32 / 0.4)
  line = window.line(4, 4.5)
  assert line.endswith('step 4, loss = 4.50 (80.0 examples/sec; 0.200 sec/batch)')
  assert window.rates() == (0.0, 0.0)  # the next window starts empty
  window.add(2.0, 16, extra=True)  # only extra steps: they are the figure
  assert window.rates() == (8.0, 2.0)


def test_heartbeat_is_silent_when_fast_and_beats_when_slow(monkeypatch):
  monkeypatch.setattr(training, 'HEARTBEAT_AFTER', 0.3)
  monkeypatch.setattr(training, 'HEARTBEAT_EVERY', 0.2)
  with fs.Logged() as logged, training.heartbeat(lambda s: 'waiting %d' % s):
    pass
  assert logged.out == []
  monkeypatch.setattr(training, 'HEARTBEAT_AFTER', 0.1)
  with fs.Logged() as logged, training.heartbeat(lambda s: 'waiting %d' % s):
    time.sleep(0.65)
  lines = logged.out
  assert len(lines) >= 2, lines
  assert all(l.startswith('waiting ') for l in lines)


@pytest.mark.slow
def test_heartbeat_during_a_slow_first_step(tmp_path, synth_data_dir, monkeypatch):
  """`modern` whose first step is slowed by 2 s prints a line at 1 s (the heartbeat's
  5 s, shortened here)."""

  def slow():
    print('HOOK first step', flush=True)
    time.sleep(2)
  monkeypatch.setattr(training, 'HEARTBEAT_AFTER', 1.0)
  monkeypatch.setattr(engines.Towers, 'run_step', fs.at_call(1, slow, engines.Towers.run_step))
  code, out, err, exception = fs.invoke_cli(
      ['modern', '--data_dir', synth_data_dir, '--train_dir', tmp_path / 'train',
       '--num_gpus', 1, '--batch_size', 4, '--max_steps', 2, '--log_every', 1,
       '--summary_every', 1000])
  assert (code, exception) == (0, None), err[-2000:]
  lines = out.splitlines()
  hook = lines.index('HOOK first step')
  beats = [i for i, l in enumerate(lines)
           if l.startswith('Building and tracing the step (first step)... ')]
  assert beats and beats[0] > hook, lines
  steps = [i for i, l in enumerate(lines) if ': step ' in l]
  assert len(steps) == 2 and beats[-1] < steps[0], lines


def test_the_log_line_says_how_far_the_run_is_and_the_time_left():
  line = training.log_line(100, 2.0, 50.0, 0.25, max_steps=3700)
  assert line.endswith(': step 100, loss = 2.00 (50.0 examples/sec; 0.250 sec/batch) '
                       '100/3700, 0:15:00 left')
  assert training.log_line(3700, 2.0, 50.0, 0.25, max_steps=3700).endswith(
      '3700/3700, 0:00:00 left')


@pytest.mark.slow
def test_on_a_terminal_the_log_line_updates_in_place(synth_data_dir, tmp_path):
  """Through a pty: one line rewritten per log step, then the last line on a fresh line."""
  import pty  # pylint: disable=import-outside-toplevel
  train_dir = str(tmp_path / 'train')
  leader, follower = pty.openpty()
  proc = fs.spawn_cli(['legacy', '--data_dir', synth_data_dir, '--train_dir', train_dir,
                       '--max_steps', 4] + list(fs.FAST_FLAGS), stdout=follower)
  os.close(follower)
  screen = b''
  while True:
    try:
      chunk = os.read(leader, 65536)
    except OSError:  # EIO: the process closed the pty
      break
    if not chunk:
      break
    screen += chunk
  err = proc.stderr.read()
  assert proc.wait(timeout=60) == 0, err
  os.close(leader)
  text = screen.decode().replace('\r\n', '\n')  # the pty's own newline translation
  lines = text.split('\n')
  updating = [l for l in lines if ': step ' in l]
  assert len(updating) == 1, lines  # every log line on the same row
  steps = updating[0].split('\r')[1:]
  assert [re.search(r': step (\d+), loss = [\d.]+ \(.*sec/batch\) (\d+)/4, \S+ left', s)
          .group(1, 2) for s in steps] == [(str(i), str(i)) for i in range(1, 5)], steps
  assert lines[lines.index(updating[0]) + 1] == (
      'Done: the newest checkpoint is %s/model.ckpt-4. Evaluate it: python cli.py eval '
      '--run_once --checkpoint_dir %s --data_dir %s' % (train_dir, train_dir, synth_data_dir))


@pytest.mark.parametrize('values', [
    np.random.default_rng(0).normal(0.1, 0.05, (64, 384)),  # many values
    np.full((2, 3), 0.1),  # a single value: all in the last bucket
    np.array([[0.0, 1.0], [1.0, 1.0]]),  # two values: edges at both ends
    np.array([[np.nan, 1.0], [2.0, 3.0]]),  # a NaN: NaN edges, nothing counted
    np.array([[np.inf, 1.0], [2.0, 3.0]]),  # an infinity: the finite values in bucket 0
    np.array([np.inf, np.inf]),  # a single infinite value: NaN width, nothing counted
], ids=['many', 'single', 'two', 'nan', 'inf', 'single_inf'])
def test_traced_histogram_writes_what_tf_summary_histogram_writes(values, tmp_path):
  """modern.step.histogram (traced, one Bincount) against tf.summary.histogram
  (eager): the same edges and counts, bit for bit (NaNs in the same places)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from cifar10_towers.modern import step  # pylint: disable=import-outside-toplevel
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=import-outside-toplevel
  data = tf.constant(values, tf.float32)
  written = {}
  for name, write in (('eager', tf.summary.histogram),
                      ('traced', tf.function(step.histogram, autograph=False))):
    writer = tf.summary.create_file_writer(str(tmp_path / name))
    with writer.as_default(step=1):
      write('h', data)
    writer.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / name))
    acc.Reload()
    written[name] = tf.make_ndarray(acc.Tensors('h')[0].tensor_proto)
  assert written['eager'].shape == (30, 3)
  np.testing.assert_array_equal(written['traced'], written['eager'])
