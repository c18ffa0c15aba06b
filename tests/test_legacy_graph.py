"""The legacy multi-tower graph: placement, one input pipeline, loss terms, averaging."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.legacy import train
from cifar10_towers.runtime import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 4  # images per tower in the graph tests
DECAY_STEPS = 1000


def _plan(num_towers):
  return devices.plan_devices(num_towers)


def _batches(rng, num_towers, batch=BATCH):
  """Random preprocessed batches: float32 [N, B, 24, 24, 3], int32 [N, B]."""
  images = rng.standard_normal(
      (num_towers, batch, hparams.IMAGE_SIZE, hparams.IMAGE_SIZE, 3)).astype(
          np.float32)
  labels = rng.integers(0, hparams.NUM_CLASSES, (num_towers, batch)).astype(
      np.int32)
  return images, labels


class _Towers:
  """build_towers in its own graph, fed each tower's batch through placeholders.

  Built once per shape for the module (building is most of these tests' cost);
  each test runs it in a fresh session from a fresh initialization, on its own
  batches. The graph seed makes every fresh session's initial variables the same.
  """

  def __init__(self, num_towers, batch=BATCH, jit=False):
    self.plan = _plan(num_towers)
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.set_random_seed(1)
      shape = (batch, hparams.IMAGE_SIZE, hparams.IMAGE_SIZE, 3)
      self.inputs = [(tf.placeholder(tf.float32, shape), tf.placeholder(tf.int32, (batch,)))
                     for _ in range(num_towers)]
      self.towers = train.build_towers(self.inputs, self.plan, DECAY_STEPS, jit=jit)
      self.init = tf.global_variables_initializer()
      self.variables = {v.op.name: v for v in tf.global_variables()}

  def feed(self, images, labels):
    """The feed_dict of per-tower batches [N, B, ...]."""
    feed = {}
    for (image_input, label_input), tower_images, tower_labels in zip(
        self.inputs, images, labels):
      feed[image_input], feed[label_input] = tower_images, tower_labels
    return feed

  def session(self, config=None):
    """A fresh session, its variables initialized."""
    sess = tf.Session(graph=self.graph, config=config or tf.ConfigProto(
        allow_soft_placement=True, device_count={'CPU': self.plan.num_cpu_devices}))
    sess.run(self.init)
    return sess


@pytest.fixture(scope='module')
def built_towers():
  """_Towers(num_towers, batch, jit), each built once for the module."""
  built = {}

  def get(num_towers, batch=BATCH, jit=False):
    key = (num_towers, batch, jit)
    if key not in built:
      built[key] = _Towers(*key)
    return built[key]
  return get


@pytest.fixture(scope='module')
def train_graphs(synth_data_dir):
  """build_train_graph's graph, each tower count's built once for the module."""
  built = {}

  def get(num_towers):
    if num_towers not in built:
      config = config_lib.TrainConfig(data_dir=synth_data_dir, num_gpus=num_towers,
                                      batch_size=BATCH)
      with tf.Graph().as_default() as graph:
        train.build_train_graph(config, _plan(num_towers), DECAY_STEPS, num_threads=1)
      built[num_towers] = graph
    return built[num_towers]
  return get


@pytest.mark.parametrize('num_towers', [2, 4])
def test_tower_ops_on_tower_devices_and_variables_on_cpu(train_graphs, num_towers):
  plan = _plan(num_towers)
  graph = train_graphs(num_towers)
  with graph.as_default():
    counted = {i: 0 for i in range(num_towers)}
    for op in graph.get_operations():
      if not op.name.startswith('tower_'):
        continue
      i = int(op.name.split('/')[0][len('tower_'):])
      if op.type == 'ReadVariableOp':
        # A variable read carries no device: the placer puts it next to its
        # variable on the CPU, and the tower receives the value.
        assert op.device in ('', '/device:CPU:0'), op.name
        continue
      assert op.device == plan.tower_devices[i], (op.name, op.device)
      counted[i] += 1
    # Every tower holds the whole model and its gradients.
    assert all(n > 100 for n in counted.values()), counted
    assert len(set(counted.values())) == 1, counted
    convs = [op for op in graph.get_operations() if op.type == 'Conv2D']
    assert sorted(op.name.split('/')[0] for op in convs) == sorted(
        ['tower_%d' % i for i in range(num_towers)] * 2)

    variables = tf.global_variables()
    # 10 model variables, their 10 moving averages, global_step.
    assert len(variables) == 21
    names = {v.op.name for v in variables}
    assert 'global_step' in names
    assert 'local3/weights/ExponentialMovingAverage' in names
    for v in variables:
      assert v.device == '/device:CPU:0', (v.op.name, v.device)


def test_towers_run_on_their_devices(built_towers):
  """The placer keeps each tower on its logical device (partition graphs)."""
  built = built_towers(2)
  images, labels = _batches(np.random.default_rng(0), 2)
  with built.session() as sess:
    run_metadata = tf.RunMetadata()
    sess.run(built.towers.train_op, feed_dict=built.feed(images, labels),
             options=tf.RunOptions(output_partition_graphs=True),
             run_metadata=run_metadata)
  placed = {}
  for partition in run_metadata.partition_graphs:
    for node in partition.node:
      placed[node.name] = (node.op, node.device)
  for i in range(2):
    tower = {name: value for name, value in placed.items()
             if name.startswith('tower_%d/' % i)}
    # The arithmetic of the tower (forward and backward) runs on its device.
    # Grappler renames and fuses ops (e.g. _MklNativeFusedConv2D): match by
    # substring.
    compute = {name: (op, device) for name, (op, device) in tower.items()
               if any(kind in op for kind in (
                   'Conv2D', 'MatMul', 'LRN', 'MaxPool', 'L2Loss',
                   'SoftmaxCrossEntropy'))}
    assert len(compute) >= 10, tower
    for name, (op, device) in compute.items():
      assert device.endswith('/device:CPU:%d' % i), (name, op, device)
  assert placed['local3/weights'][1].endswith('/device:CPU:0')


@pytest.mark.parametrize('num_towers', [1, 2, 4])
def test_one_input_pipeline_for_all_towers(train_graphs, num_towers):
  graph = train_graphs(num_towers)
  with graph.as_default():
    types = [op.type for op in graph.get_operations()]
    assert types.count('FixedLengthRecordReaderV2') == 1
    assert types.count('RandomShuffleQueueV2') == 1  # shuffle_batch
    assert types.count('FIFOQueueV2') == 2  # file names, prefetch
    dequeues = [op for op in graph.get_operations()
                if op.type == 'QueueDequeueV2']
    assert len(dequeues) == num_towers
    # All towers dequeue from the one prefetch queue.
    assert {op.inputs[0].op.name for op in dequeues} == {
        'input/prefetch_queue/fifo_queue'}


@pytest.mark.parametrize('num_towers', [2, 4])
def test_each_tower_counts_weight_decay_once(built_towers, num_towers):
  built = built_towers(num_towers)
  towers, graph = built.towers, built.graph
  images, labels = _batches(np.random.default_rng(1), num_towers)
  with graph.as_default():
    for i in range(num_towers):
      total = towers.tower_losses[i].op
      assert total.type == 'AddN'
      assert sorted(t.op.name for t in total.inputs) == [
          'tower_%d/cross_entropy' % i,
          'tower_%d/local3/weight_loss' % i,
          'tower_%d/local4/weight_loss' % i]
    # What the scope filter prevents: model.loss's own unfiltered sum in the
    # last tower holds every tower's terms so far.
    unfiltered = graph.get_operation_by_name(
        'tower_%d/total_loss' % (num_towers - 1))
    assert len(unfiltered.inputs) == 3 * num_towers
    cross_entropies = [graph.get_tensor_by_name('tower_%d/cross_entropy:0' % i)
                       for i in range(num_towers)]
    variables = built.variables
    with built.session() as sess:
      totals, ces, w3, w4 = sess.run([
          towers.tower_losses, cross_entropies,
          variables['local3/weights'], variables['local4/weights']],
                                     feed_dict=built.feed(images, labels))
  decay = 0.004 * (np.sum(w3.astype(np.float64) ** 2) / 2 +
                   np.sum(w4.astype(np.float64) ** 2) / 2)
  assert decay > 1.0  # the initial local3 weights make it about 2.3
  for i in range(num_towers):
    # float32 sums of ~10^6 squares: 1e-5 relative.
    np.testing.assert_allclose(totals[i] - ces[i], decay, rtol=1e-5)


def test_average_gradients_is_the_mean():
  rng = np.random.default_rng(2)
  values = [[rng.standard_normal((3, 2)).astype(np.float32),
             rng.standard_normal((5,)).astype(np.float32)] for _ in range(3)]
  with tf.Graph().as_default():
    var_a = tf.Variable(tf.zeros((3, 2)), name='a')
    var_b = tf.Variable(tf.zeros((5,)), name='b')
    tower_grads = [[(tf.constant(g_a), var_a), (tf.constant(g_b), var_b)]
                   for g_a, g_b in values]
    averaged = train.average_gradients(tower_grads)
    assert [v for _, v in averaged] == [var_a, var_b]
    with tf.Session() as sess:
      got = sess.run([g for g, _ in averaged])
  # float32 mean of 3 numbers: 1e-6 relative.
  np.testing.assert_allclose(got[0], np.mean([v[0] for v in values], 0),
                             rtol=1e-6)
  np.testing.assert_allclose(got[1], np.mean([v[1] for v in values], 0),
                             rtol=1e-6)


def _averaged_gradients(built, images, labels, init_values=None):
  """Averaged gradients and variable values of the built towers on the batches."""
  averaged = built.towers.averaged_grads
  with built.session() as sess:
    if init_values is not None:
      for name, value in init_values.items():
        built.variables[name].load(value, sess)
    grads = sess.run({v.op.name: g for g, v in averaged}, feed_dict=built.feed(images, labels))
    values = sess.run({v.op.name: v for _, v in averaged})
  return grads, values


@pytest.mark.parametrize('num_towers', [2, 4])
def test_towers_equal_one_tower_on_the_concatenation(built_towers, num_towers):
  """docs/equivalence.md §2.4: the average is a true mean and weight decay counts once."""
  images, labels = _batches(np.random.default_rng(3), num_towers)
  grads, init_values = _averaged_gradients(built_towers(num_towers), images, labels)
  one_grads, _ = _averaged_gradients(
      built_towers(1, BATCH * num_towers),
      images.reshape((1, -1) + images.shape[2:]), labels.reshape(1, -1), init_values)
  assert len(grads) == 10
  for name, grad in grads.items():
    # docs/equivalence.md §2 tolerance: max|a - b| / max|b| <= 1e-5.
    scale = np.max(np.abs(one_grads[name]))
    assert np.max(np.abs(grad - one_grads[name])) / scale <= 1e-5, name


def test_step_applies_mean_gradient_then_moving_average(built_towers):
  """One step: v1 = v0 - 0.1 * grad; shadow = d * v0 + (1 - d) * v1, d = 2/11.

  The moving average runs after the update and uses num_updates = the new
  global step (1), so its decay is min(0.9999, (1 + 1) / (10 + 1)).
  """
  built = built_towers(2)
  towers, variables = built.towers, built.variables
  images, labels = _batches(np.random.default_rng(4), 2)
  feed = built.feed(images, labels)
  with built.session() as sess:
    assert sess.run(towers.lr) == pytest.approx(0.1)
    names = [v.op.name for _, v in towers.averaged_grads]
    v0 = sess.run({n: variables[n] for n in names})
    grads = sess.run({v.op.name: g for g, v in towers.averaged_grads}, feed_dict=feed)
    sess.run(towers.train_op, feed_dict=feed)
    v1 = sess.run({n: variables[n] for n in names})
    shadows = sess.run({n: towers.ema.average(variables[n]) for n in names})
    assert sess.run(towers.global_step) == 1
  decay = 2.0 / 11.0
  for n in names:
    # A few float32 operations: 1e-6 relative plus 1e-7 absolute.
    np.testing.assert_allclose(v1[n], v0[n] - 0.1 * grads[n],
                               rtol=1e-6, atol=1e-7, err_msg=n)
    np.testing.assert_allclose(shadows[n], decay * v0[n] + (1 - decay) * v1[n],
                               rtol=1e-6, atol=1e-7, err_msg=n)


@pytest.mark.slow
def test_importing_the_package_imports_no_tensorflow():
  code = ('import sys, legacy; '
          'assert "tensorflow" not in sys.modules, "TF imported"')
  subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT)


def test_jit_towers_compile_with_xla_and_give_the_same_losses(built_towers):
  """--jit means the same in both trainers: each tower's loss and gradients in XLA."""
  images, labels = _batches(np.random.default_rng(3), 2)
  results = {}
  for jit in (False, True):
    built = built_towers(2, BATCH, jit)
    with built.session(train.session_config(built.plan)) as sess:
      metadata = tf.RunMetadata()
      losses = sess.run(built.towers.tower_losses, feed_dict=built.feed(images, labels),
                        options=tf.RunOptions(output_partition_graphs=True),
                        run_metadata=metadata)
    ops = {node.op for graph in metadata.partition_graphs for node in graph.node}
    results[jit] = (np.array(losses), '_XlaRun' in ops)
  assert results[False][1] is False and results[True][1] is True
  # Same initial variables (graph seed), same batches: XLA's fused arithmetic
  # agrees to float32 rounding.
  np.testing.assert_allclose(results[True][0], results[False][0], rtol=1e-5)
