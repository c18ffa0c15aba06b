"""modern.train has one training loop, and every engine runs through it.

`runtime.training.train_loop` is wrapped to record the engine it is given; each
of towers, mirrored and multiworker (a one-worker cluster, in its own process
forked by tests/fork_server.py: MultiWorkerMirroredStrategy must start before
any other op) then trains 4 steps through `python cli.py modern`'s code and
saves model.ckpt-4.
Summaries are on (steps 2 and 4), and the event files are read back as
TensorBoard reads them: towers writes every tag of
common.tags.summary_tags, the replica engines the subset the README's
TensorBoard section names (summary_tags(n, activations=False)), all a graph.
"""

import os

import pytest
import tensorflow as tf

import faults_support as fs
from cifar10_towers.common import devices
from cifar10_towers.common import tags as tb_tags
from cifar10_towers.modern import engines
from cifar10_towers.modern import train
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import training

# Runs the CLI with runtime.training.train_loop wrapped to print its engine's class.
_SPY = '''
import sys
sys.path.insert(0, %(root)r)
from cifar10_towers.runtime import training
loop = training.train_loop
def spy(config, stop, engine, *args, **kwargs):
  print('ENGINE', type(engine).__name__, flush=True)
  return loop(config, stop, engine, *args, **kwargs)
training.train_loop = spy
from cifar10_towers import cli
sys.argv = ['cli.py'] + sys.argv[1:]
cli.main()
'''


def _spied(monkeypatch):
  seen = []
  loop = training.train_loop

  def spy(config, stop, engine, *args, **kwargs):
    seen.append(type(engine).__name__)
    return loop(config, stop, engine, *args, **kwargs)

  monkeypatch.setattr(training, 'train_loop', spy)
  return seen


def _check_summaries(train_dir, num_towers, activations):
  """train_dir's events: summary_tags(num_towers, activations) at steps 2 and 4, a graph."""
  tags, graph, acc = fs.read_tags(train_dir)
  assert tags == tb_tags.summary_tags(num_towers, activations=activations)
  assert graph
  assert [e.step for e in acc.Tensors(tb_tags.MEAN_LOSS_TAG)] == [2, 4]


def _settings(synth_data_dir, train_dir):
  return dict(data_dir=synth_data_dir, train_dir=str(train_dir), batch_size=8,
              max_steps=4, log_every=2, summary_every=2, save_every=100, seed=3)


@pytest.mark.slow
def test_towers_and_mirrored_run_through_the_one_loop(synth_data_dir, tmp_path,
                                                      monkeypatch):
  seen = _spied(monkeypatch)
  plan = devices.DevicePlan(('/device:CPU:0', '/device:CPU:1'), 'cpu', 4)
  for strategy in ('towers', 'mirrored'):
    train_dir = tmp_path / strategy
    config = config_lib.TrainConfig(num_gpus=2, strategy=strategy,
                                    **_settings(synth_data_dir, train_dir))
    with fs.Logged() as logged:
      assert train.train(config, plan) == 4
    lines = logged.out + logged.err
    assert sum(': step ' in line for line in lines) == 2, lines
    assert tf.train.latest_checkpoint(str(train_dir)) == str(train_dir / 'model.ckpt-4')
    _check_summaries(train_dir, 2, activations=strategy == 'towers')
  assert seen == ['Towers', 'Mirrored']
  assert engines.ENGINES == {'towers': engines.Towers, 'mirrored': engines.Mirrored,
                             'multiworker': engines.MultiWorker}


@pytest.mark.slow
def test_multiworker_runs_through_the_one_loop(synth_data_dir, tmp_path):
  train_dir = tmp_path / 'multiworker'
  port = fs.free_ports(1)[0]
  settings = _settings(synth_data_dir, train_dir)
  args = ['modern', '--strategy', 'multiworker', '--worker_hosts',
          '127.0.0.1:%d' % port]
  for key in ('data_dir', 'train_dir', 'batch_size', 'max_steps', 'log_every',
              'summary_every', 'save_every', 'seed'):
    args += ['--' + key, str(settings[key])]
  env = fs.cli_env()
  env.pop('TF_CONFIG', None)
  spy = tmp_path / 'spy.py'
  spy.write_text(_SPY % {'root': fs.ROOT})
  # `python spy.py ARGS`, forked by the fork server (no TensorFlow import of its own).
  proc = fs.Spawned([str(spy)] + args, env)
  stdout, stderr = proc.communicate(timeout=180)
  assert proc.returncode == 0, stderr[-3000:]
  lines = stdout.splitlines()
  assert [l for l in lines if l.startswith('ENGINE')] == ['ENGINE MultiWorker']
  assert sum(': step ' in line for line in lines) == 2, stdout
  assert tf.train.latest_checkpoint(str(train_dir)) == os.path.join(
      str(train_dir), 'model.ckpt-4')
  # On CPUs a worker runs one replica.
  _check_summaries(train_dir, 1, activations=False)
