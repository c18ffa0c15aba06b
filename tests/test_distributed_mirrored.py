"""modern.engines in one process: the MirroredStrategy engine, the cluster, the CLI.

The MirroredStrategy engine runs on the session's logical CPU devices and is
compared with modern.step.TowerStep (the towers) on the same batches and
initial variables, with docs/equivalence.md §2's tolerances. The multi-process tests are in
test_distributed_multiworker.py.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from click.testing import CliRunner

from cifar10_towers import cli
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import devices
from cifar10_towers.common import model_spec
from cifar10_towers.modern import checkpoints as modern_checkpoints
from cifar10_towers.modern import cluster as cluster_lib
from cifar10_towers.modern import engines
from cifar10_towers.modern import eval as eval_lib
from cifar10_towers.modern import inputs
from cifar10_towers.modern import step as modern_step
from cifar10_towers.modern import train
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import config as config_lib
import faults_support as fs

# docs/equivalence.md §2 tolerances.
GRAD_REL_TOL = 1e-5  # averaged gradients: max|a - b| <= 1e-5 * max|b|, per variable
LOSS_REL_TOL = 1e-6  # tower losses
FINAL_REL_TOL = 1e-4  # variables and moving averages after K steps
K_STEPS = 3


def _plan(num_towers):
  return devices.DevicePlan(
      tuple('/device:CPU:%d' % i for i in range(num_towers)), 'cpu', 4)


def _mirrored(plan, decay_steps):
  return engines.ReplicaStep(plan, decay_steps, strategy=engines.mirrored_strategy(plan))


def _batches(num_towers, batch, seed):
  rng = np.random.default_rng(seed)
  images = rng.standard_normal((num_towers, batch, 24, 24, 3)).astype(np.float32)
  labels = rng.integers(0, 10, (num_towers, batch)).astype(np.int32)
  return images, labels


@pytest.fixture(scope='module')
def initial_values():
  tf.random.set_seed(5)
  trainer = modern_step.TowerStep(_plan(1), decay_steps=100)
  return {name: var.numpy() for name, var in trainer.state.variables().items()}


def _assert_close(got, want, rel_tol, what):
  for name in model_spec.VARIABLE_NAMES:
    a, b = np.asarray(got[name]), np.asarray(want[name])
    np.testing.assert_allclose(a, b, rtol=0, atol=rel_tol * np.abs(b).max(),
                               err_msg='%s %s' % (what, name))


# --- the engine ---------------------------------------------------------------


@pytest.mark.parametrize('num_towers', [2, 4])
def test_mirrored_gradients_and_losses_equal_the_towers(num_towers, initial_values):
  images, labels = _batches(num_towers, 4, seed=num_towers)
  towers = modern_step.TowerStep(_plan(num_towers), decay_steps=100)
  towers.state.assign_variables(initial_values)
  mirrored = _mirrored(_plan(num_towers), decay_steps=100)
  mirrored.state.assign_variables(initial_values)
  assert mirrored.strategy.num_replicas_in_sync == num_towers
  want_grads, want_losses = towers.compute_gradients((images, labels))
  grads, losses = mirrored.compute_gradients((images, labels))
  assert list(grads) == list(model_spec.VARIABLE_NAMES)
  _assert_close(grads, {k: v.numpy() for k, v in want_grads.items()},
                GRAD_REL_TOL, 'gradient')
  assert losses.shape == (num_towers,)
  # Replica r trained on batch r: each loss is that tower's own.
  np.testing.assert_allclose(losses.numpy(), want_losses.numpy(), rtol=LOSS_REL_TOL)
  assert len(set(np.round(losses.numpy(), 4))) == num_towers


def test_mirrored_steps_equal_the_towers_steps(initial_values):
  """K steps with the learning-rate decay and the moving averages (docs/equivalence.md §2.3)."""
  towers = modern_step.TowerStep(_plan(2), decay_steps=2)  # lr 0.1, 0.1, then 0.01
  towers.state.assign_variables(initial_values)
  mirrored = _mirrored(_plan(2), decay_steps=2)
  mirrored.state.assign_variables(initial_values)
  for k in range(K_STEPS):
    batches = _batches(2, 4, seed=100 + k)
    want = towers.train_step(batches).numpy()
    got = mirrored.train_step(batches).numpy()
    np.testing.assert_allclose(got, want, rtol=LOSS_REL_TOL)
  assert int(mirrored.state.global_step.numpy()) == K_STEPS
  _assert_close({k: v.numpy() for k, v in mirrored.state.variables().items()},
                {k: v.numpy() for k, v in towers.state.variables().items()},
                FINAL_REL_TOL, 'variable')
  _assert_close({k: v.numpy() for k, v in mirrored.state.shadow_variables().items()},
                {k: v.numpy() for k, v in towers.state.shadow_variables().items()},
                FINAL_REL_TOL, 'moving average')
  # The steps moved the variables, and every replica holds the same copy.
  moved = mirrored.state.variables()['local3/weights']
  assert np.abs(moved.numpy() - initial_values['local3/weights']).max() > 1e-5
  for var in list(mirrored.state.variables().values()) + [mirrored.state.global_step]:
    copies = [copy.numpy() for copy in var.values]
    assert [copy.device for copy in var.values] == [
        tf.DeviceSpec.from_string(d).to_string()
        for d in ('/job:localhost/replica:0/task:0/device:CPU:0',
                  '/job:localhost/replica:0/task:0/device:CPU:1')]
    for copy in copies[1:]:
      np.testing.assert_array_equal(copy, copies[0])


def test_mirrored_checkpoints_have_the_towers_layout(initial_values, tmp_path,
                                                      synth_data_dir):
  mirrored = _mirrored(_plan(2), decay_steps=100)
  mirrored.state.assign_variables(initial_values)
  mirrored.train_step(_batches(2, 4, seed=1))
  path = modern_checkpoints.checkpoint_object(mirrored.state).save(str(tmp_path / 'm' / 'model.ckpt'))
  towers = modern_step.TowerStep(_plan(2), decay_steps=100)
  towers_path = modern_checkpoints.checkpoint_object(towers.state).save(str(tmp_path / 't' / 'model.ckpt'))
  assert ({name: shape for name, shape in tf.train.list_variables(path)}
          == {name: shape for name, shape in tf.train.list_variables(towers_path)})
  # The towers (and eval, and convert) read it.
  modern_checkpoints.checkpoint_object(towers.state).restore(path).assert_existing_objects_matched()
  assert int(towers.state.global_step.numpy()) == 1
  _assert_close({k: v.numpy() for k, v in towers.state.shadow_variables().items()},
                {k: v.numpy() for k, v in mirrored.state.shadow_variables().items()},
                0.0, 'restored average')
  counts = eval_lib.evaluate_contents(checkpoints.read(path), synth_data_dir)
  assert (counts.global_step, counts.total_count) == (1, 300)


def test_batches_must_be_one_per_replica():
  mirrored = _mirrored(_plan(2), decay_steps=100)
  with pytest.raises(ValueError, match=r'images must be \[N, batch'):
    mirrored.compute_gradients(_batches(3, 2, seed=0))


@pytest.mark.slow
def test_train_with_the_mirrored_strategy_saves_and_resumes(synth_data_dir, tmp_path):
  train_dir = tmp_path / 'train'
  settings = dict(data_dir=synth_data_dir, train_dir=str(train_dir), num_gpus=2,
                  batch_size=8, log_every=5, summary_every=5, save_every=5, seed=1,
                  strategy='mirrored')
  config = config_lib.TrainConfig(max_steps=10, **settings)
  with fs.Logged() as logged:
    assert train.train(config, _plan(2)) == 10
  lines = logged.out + logged.err
  assert [l for l in lines if ': step ' in l and 'examples/sec' in l][-1].split(
      ': step ')[1].startswith('10, loss = ')
  assert tf.train.latest_checkpoint(str(train_dir)) == str(train_dir / 'model.ckpt-10')
  config = config_lib.TrainConfig(max_steps=15, **settings)
  with fs.Logged() as logged:
    assert train.train(config, _plan(2)) == 15
  lines = logged.out + logged.err
  assert 'Resuming from %s at global step 10.' % (train_dir / 'model.ckpt-10') in lines
  path = tf.train.latest_checkpoint(str(train_dir))
  assert tf.train.load_variable(path, modern_checkpoints.checkpoint_key('global_step')) == 15


# --- sharding of the training records -----------------------------------------


@pytest.mark.parametrize('num_workers', [2, 3])
def test_workers_read_disjoint_shards_of_the_records(tmp_path, num_workers):
  """Worker w of W reads records w, w + W, ...: never one another worker reads.

  Record i has label i % W, so the labels a worker gets tell which records
  it read, whatever the distortions do to the images.
  """
  per_file = 12
  data_dir = str(tmp_path)
  os.makedirs(fmt.batches_dir(data_dir))
  rng = np.random.default_rng(0)
  for f, name in enumerate(fmt.TRAIN_FILES):
    index = np.arange(f * per_file, (f + 1) * per_file)
    images = rng.integers(0, 256, (per_file, 32, 32, 3)).astype(np.uint8)
    fmt.write_records(os.path.join(fmt.batches_dir(data_dir), name), images,
                      index % num_workers)
  for shard in range(num_workers):
    dataset = inputs.distorted_inputs(data_dir, batch_size=4, num_towers=2, seed=shard,
                                      num_shards=num_workers, shard_index=shard)
    labels = np.concatenate([l.numpy().ravel() for _, l in dataset.take(10)])
    assert labels.size == 80
    np.testing.assert_array_equal(labels, shard)
  with pytest.raises(ValueError, match='shard_index'):
    inputs.distorted_inputs(data_dir, 4, 1, num_shards=2, shard_index=2)


# --- the cluster ------------------------------------------------------------------


def test_cluster_from_worker_hosts():
  cluster = cluster_lib.resolve_cluster(('a:1', 'b:2', 'c:3'), 2, environ={})
  assert (cluster.num_workers, cluster.worker_index, cluster.is_chief) == (3, 2, False)
  assert cluster_lib.resolve_cluster(('a:1', 'b:2'), 0, environ={}).is_chief
  with pytest.raises(cluster_lib.ClusterError, match='--task_index 2'):
    cluster_lib.resolve_cluster(('a:1', 'b:2'), 2, environ={})


def test_cluster_from_tf_config():
  environ = {'TF_CONFIG': json.dumps({
      'cluster': {'chief': ['c:1'], 'worker': ['w:1', 'w:2']},
      'task': {'type': 'worker', 'index': 1}})}
  cluster = cluster_lib.resolve_cluster(environ=environ)
  # A 'chief' job is worker 0; the workers follow it.
  assert (cluster.num_workers, cluster.worker_index, cluster.is_chief) == (3, 2, False)
  spec = cluster.cluster_resolver().cluster_spec().as_dict()
  assert spec == {'chief': ['c:1'], 'worker': ['w:1', 'w:2']}
  environ['TF_CONFIG'] = json.dumps({'cluster': {'worker': ['w:1', 'w:2']},
                                     'task': {'type': 'worker', 'index': 0}})
  assert cluster_lib.resolve_cluster(environ=environ).is_chief


@pytest.mark.parametrize('tf_config,match', [
    ('', 'set TF_CONFIG'),
    ('{"cluster": ', 'not valid JSON'),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:1"]}, "task": {"type": "worker"}}',
     'its jobs are "worker" and one "chief" at most'),
    ('{"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": 1}}',
     'not in its cluster'),
    ('{"cluster": {"worker": ["w"]}, "task": {"type": "worker", "index": 0}}',
     'host:port'),
    ('{"cluster": {"worker": "w:1"}, "task": {"type": "worker", "index": 0}}',
     'lists of host:port'),
])
def test_bad_tf_config_is_named(tf_config, match):
  with pytest.raises(cluster_lib.ClusterError, match=match):
    cluster_lib.resolve_cluster(environ={'TF_CONFIG': tf_config})


@pytest.mark.parametrize('args,match', [
    (['--strategy', 'mirrored', '--worker_hosts', 'a:1,b:2'],
     '--worker_hosts is for --strategy multiworker'),
    (['--task_index', '1'], '--task_index is for --strategy multiworker'),
    (['--strategy', 'multiworker'], 'set TF_CONFIG'),
    (['--strategy', 'multiworker', '--worker_hosts', 'a:1,b'], 'not host:port'),
    (['--strategy', 'multiworker', '--worker_hosts', 'a:1,a:1'], 'twice'),
    (['--strategy', 'multiworker', '--worker_hosts', 'a:1,b:2', '--task_index', '2'],
     'not an index of the 2'),
    (['--strategy', 'multiworker', '--task_index', '1'], 'needs --worker_hosts'),
    (['--strategy', 'gossip'], "'gossip' is not one of"),
    (['--strategy', 'multiworker', '--worker_hosts', 'a:1,b:2', '--peer_timeout', '0'],
     '--peer_timeout'),
])
def test_cli_rejects_bad_strategy_flags(args, match, tmp_path, monkeypatch):
  monkeypatch.delenv('TF_CONFIG', raising=False)
  result = CliRunner().invoke(cli.cli, ['modern', '--data_dir', str(tmp_path / 'none'),
                                        '--train_dir', str(tmp_path / 't')] + args)
  assert result.exit_code == 2, result.output
  assert match in result.output
  assert 'Traceback' not in result.output
  assert not (tmp_path / 't').exists()  # nothing started


def test_legacy_has_no_strategies(tmp_path):
  result = CliRunner().invoke(cli.cli, ['legacy', '--strategy', 'mirrored',
                                        '--train_dir', str(tmp_path / 't')])
  assert result.exit_code == 2 and 'No such option' in result.output
