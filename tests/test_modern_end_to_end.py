"""modern.train.train and modern.eval on generated data, end to end."""

import functools
import os
import re
import signal

import numpy as np
import pytest
import tensorflow as tf

from cifar10_towers.common import devices
from cifar10_towers.modern import checkpoints as modern_checkpoints
from cifar10_towers.modern import eval as eval_lib
from cifar10_towers.modern import step as modern_step
from cifar10_towers.modern import train
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import evaluation
from cifar10_towers.runtime import training
import faults_support as fs


def _config(synth_data_dir, train_dir, **kwargs):
  settings = dict(data_dir=synth_data_dir, train_dir=str(train_dir), num_gpus=2,
                  batch_size=16, log_every=10, summary_every=10, save_every=10, seed=1)
  settings.update(kwargs)
  return config_lib.TrainConfig(**settings)


def _plan(num_towers):
  return devices.plan_devices(num_towers)


def _summary_tags(train_dir):
  """{(tag, step)} of the summaries in train_dir's event files."""
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  tags = set()
  for name in os.listdir(train_dir):
    if name.startswith('events.out.tfevents'):
      for record in tf.data.TFRecordDataset(os.path.join(train_dir, name)):
        event = event_pb2.Event.FromString(record.numpy())
        tags.update((v.tag, event.step) for v in event.summary.value)
  return tags


def _evaluate(checkpoint_dir, data_dir, batch_size=128, **run_args):
  """runtime.evaluation.run with the modern evaluator: its Evaluations."""
  return evaluation.run(str(checkpoint_dir), functools.partial(
      eval_lib.evaluate_contents, data_dir=data_dir, batch_size=batch_size), **run_args)


def _steps_logged(lines):
  return [int(m.group(1)) for m in (re.search(r': step (\d+), loss = ', l) for l in lines) if m]


@pytest.mark.slow
def test_train_saves_resumes_and_evaluates(synth_data_dir, tmp_path, monkeypatch):
  # On a loaded machine the first step can outlast HEARTBEAT_AFTER and add a
  # heartbeat line; this test is about the log lines of the steps.
  monkeypatch.setattr(training, 'HEARTBEAT_AFTER', 3600.0)
  train_dir = tmp_path / 'train'  # created by train()
  config = _config(synth_data_dir, train_dir, max_steps=20)
  with fs.Logged() as logged:
    assert train.train(config, _plan(2)) == 20
  lines = logged.out
  assert _steps_logged(lines) == [10, 20]
  assert all('examples/sec' in l for l in lines[:-1])
  assert lines[-1] == ('Done: the newest checkpoint is %s. Evaluate it: python cli.py eval '
                       '--run_once --checkpoint_dir %s --data_dir %s'
                       % (train_dir / 'model.ckpt-20', train_dir, synth_data_dir))
  assert tf.train.latest_checkpoint(str(train_dir)) == str(train_dir / 'model.ckpt-20')
  assert (train_dir / 'model.ckpt-10.index').exists()
  assert _summary_tags(train_dir) >= {
      ('total_loss', 10), ('total_loss', 20), ('learning_rate', 20), ('tower_1/total_loss', 20),
      ('conv1/weights', 10), ('conv1/weights/ExponentialMovingAverage', 20)}

  config = _config(synth_data_dir, train_dir, max_steps=30)
  with fs.Logged() as logged:
    assert train.train(config, _plan(2)) == 30
  lines = logged.out
  assert 'Resuming from %s at global step 20.' % (train_dir / 'model.ckpt-20') in lines
  assert _steps_logged(lines) == [30]  # 10 more steps, not 30
  path = tf.train.latest_checkpoint(str(train_dir))
  assert path == str(train_dir / 'model.ckpt-30')
  assert tf.train.load_variable(path, modern_checkpoints.checkpoint_key('global_step')) == 30
  # The saved averages lag the weights.
  ema = tf.train.load_variable(
      path, modern_checkpoints.checkpoint_key('local4/weights/ExponentialMovingAverage'))
  raw = tf.train.load_variable(path, modern_checkpoints.checkpoint_key('local4/weights'))
  assert not np.array_equal(ema, raw)

  with logged:
    assert train.train(config, _plan(2)) == 30
  assert any('nothing to train' in w for w in logged.err)

  with fs.Logged() as logged:
    (result,) = _evaluate(train_dir, synth_data_dir)
  lines = logged.out
  assert result == (path, result.precision, 30)
  assert 0.0 <= result.precision <= 1.0
  assert re.fullmatch(r'.*: precision @ 1 = \d\.\d{3} \(global step 30, model.ckpt-30\)',
                      lines[0])
  counts = eval_lib.evaluate_contents(checkpoints.read(path), synth_data_dir, 128)
  assert (counts.global_step, counts.total_count) == (30, 300)  # every record exactly once
  assert counts.true_count / counts.total_count == result.precision
  assert eval_lib.evaluate_contents(checkpoints.read(path), synth_data_dir, 64,
                                    num_examples=100).total_count == 100
  assert _evaluate(train_dir, synth_data_dir, interval_secs=0, max_evals=1) == [result]


@pytest.mark.slow
def test_a_signal_stops_training_at_a_step_boundary_with_a_checkpoint(synth_data_dir, tmp_path,
                                                                     capsys):
  handler_before = signal.getsignal(signal.SIGINT)

  def then(line):
    if ': step 5,' in line:
      os.kill(os.getpid(), signal.SIGINT)  # like Ctrl-C

  config = _config(synth_data_dir, tmp_path, num_gpus=1, batch_size=8, max_steps=1000,
                   log_every=5)
  with fs.Logged(then):
    step = train.train(config, _plan(1))
  assert step == 5  # the signal came after step 5; no further step started
  assert capsys.readouterr().err.splitlines()[-1] == (
      'Stopped by SIGINT at global step 5; saved %s. The same command resumes from '
      'it.' % (tmp_path / 'model.ckpt-5'))
  assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / 'model.ckpt-5')
  assert signal.getsignal(signal.SIGINT) is handler_before  # restored


@pytest.mark.slow
def test_divergence_names_the_step_and_keeps_the_last_checkpoint(synth_data_dir, tmp_path):
  trainer = modern_step.TowerStep(_plan(1), decay_steps=100)
  trainer.state.variables()['softmax_linear/biases'].assign(np.full(10, np.nan, np.float32))
  trainer.state.global_step.assign(3)
  manager = tf.train.CheckpointManager(modern_checkpoints.checkpoint_object(trainer.state), str(tmp_path),
                                       max_to_keep=5, checkpoint_name='model.ckpt')
  manager.save(checkpoint_number=3)
  config = _config(synth_data_dir, tmp_path, num_gpus=1, batch_size=4, max_steps=10)
  with pytest.raises(training.TrainingError, match='at step 4 in tower 0'):
    train.train(config, _plan(1))
  assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / 'model.ckpt-3')


def test_evaluate_without_a_checkpoint_says_to_train_first(synth_data_dir, tmp_path):
  with pytest.raises(checkpoints.CheckpointError, match='no checkpoint in .*Train first'):
    _evaluate(tmp_path, synth_data_dir)


def test_evaluate_refuses_a_legacy_checkpoint(synth_data_dir, tmp_path):
  with tf.Graph().as_default():
    tf.compat.v1.Variable(0, dtype=tf.int64, name='global_step')
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      saver.save(sess, str(tmp_path / 'model.ckpt'), global_step=5)
  with pytest.raises(evaluation.EvalError, match='legacy'):
    _evaluate(tmp_path, synth_data_dir)
