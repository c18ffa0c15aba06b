"""Checkpoint conversion between the trainers: bit for bit, and it evaluates and trains.

Tolerance: the converted checkpoint's logits equal the original's to 1e-6
(absolute, logits are O(1)); the variables themselves must be bit-identical.
"""

import functools
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow.compat.v1 as tf1
from click.testing import CliRunner

from cifar10_towers import cli
from cifar10_towers import convert
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.common import preprocess
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import evaluation

import faults_support as fs


def _plan(device_plan, n):
  return devices.DevicePlan(device_plan.tower_devices[:n], device_plan.kind,
                            device_plan.num_cpu_devices)


@pytest.fixture(scope='module')
def legacy_dir(tmp_path_factory, synth_data_dir, device_plan):
  """A legacy train_dir after 6 steps on 2 towers."""
  from cifar10_towers.legacy import train as legacy_train
  train_dir = str(tmp_path_factory.mktemp('legacy_train'))
  config = config_lib.TrainConfig(data_dir=synth_data_dir, train_dir=train_dir,
                                  num_gpus=2, batch_size=8, max_steps=6,
                                  save_every=100)
  legacy_train.train(config, _plan(device_plan, 2), num_threads=2)
  return train_dir


def _checkpoint_tensors(path):
  reader = tf.train.load_checkpoint(path)
  return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)}


def _eval_images(data_dir, n=64):
  images, labels = fmt.read_records(fmt.eval_files(data_dir)[0])
  return (np.stack([preprocess.eval_image(tf.constant(im)).numpy()
                    for im in images[:n]]), labels[:n])


def _legacy_logits(path, images):
  """Logits of the moving-average weights, restored the legacy way."""
  from cifar10_towers.legacy import model as legacy_model
  with tf.Graph().as_default():
    logits = legacy_model.inference(tf.constant(images))
    ema = tf1.train.ExponentialMovingAverage(hparams.MOVING_AVERAGE_DECAY)
    saver = tf1.train.Saver(ema.variables_to_restore())
    with tf1.Session() as sess:
      saver.restore(sess, path)
      return sess.run(logits)


def _modern_logits(path, images):
  """Logits of the moving-average weights, restored the way modern eval does."""
  from cifar10_towers.modern import eval as modern_eval
  model = modern_eval.moving_average_model(checkpoints.read(path))
  return model.inference(tf.constant(images)).numpy()


@pytest.mark.slow
def test_round_trip_is_bit_for_bit(legacy_dir, tmp_path):
  modern_dir, back_dir = str(tmp_path / 'modern'), str(tmp_path / 'back')
  kind, to_kind, step, modern_path = convert.convert(legacy_dir, modern_dir)
  assert (kind, to_kind, step) == (checkpoints.LEGACY, checkpoints.MODERN, 6)
  assert os.path.basename(modern_path) == 'model.ckpt-6'
  assert checkpoints.read(tf.train.latest_checkpoint(modern_dir)).kind == checkpoints.MODERN
  kind, to_kind, step, back_path = convert.convert(modern_dir, back_dir)
  assert (kind, to_kind, step) == (checkpoints.MODERN, checkpoints.LEGACY, 6)

  original = _checkpoint_tensors(tf.train.latest_checkpoint(legacy_dir))
  restored = _checkpoint_tensors(back_path)
  assert set(restored) == set(original)
  assert len(original) == 21  # 10 weights, 10 moving averages, global_step
  for name, value in original.items():
    assert restored[name].dtype == value.dtype, name
    assert np.array_equal(restored[name], value), name
  # The moving averages differ from the weights after 6 steps, so a swap of
  # the two would have been caught above.
  assert not np.array_equal(original['local3/weights'],
                            original['local3/weights/ExponentialMovingAverage'])


@pytest.mark.slow
def test_converted_checkpoint_evaluates_the_same(legacy_dir, synth_data_dir, tmp_path):
  from cifar10_towers.legacy import eval as legacy_eval
  from cifar10_towers.modern import eval as modern_eval
  modern_dir = str(tmp_path / 'modern')
  _, _, _, modern_path = convert.convert(legacy_dir, modern_dir)
  images, _ = _eval_images(synth_data_dir)
  legacy_logits = _legacy_logits(tf.train.latest_checkpoint(legacy_dir), images)
  modern_logits = _modern_logits(modern_path, images)
  np.testing.assert_allclose(modern_logits, legacy_logits, rtol=0, atol=1e-6)
  (legacy,) = evaluation.run(legacy_dir, functools.partial(
      legacy_eval.evaluate_contents, data_dir=synth_data_dir, batch_size=64))
  (modern,) = evaluation.run(modern_dir, functools.partial(
      modern_eval.evaluate_contents, data_dir=synth_data_dir, batch_size=64))
  assert legacy.global_step == modern.global_step == 6
  assert modern.precision == legacy.precision


@pytest.mark.slow
def test_training_continues_from_converted(legacy_dir, synth_data_dir, tmp_path,
                                           device_plan):
  from cifar10_towers.modern import train as modern_train
  modern_dir = str(tmp_path / 'modern')
  convert.convert(legacy_dir, modern_dir)
  config = config_lib.TrainConfig(data_dir=synth_data_dir, train_dir=modern_dir,
                                  num_gpus=2, batch_size=8, max_steps=8,
                                  log_every=1)
  with fs.Logged() as logged:
    final = modern_train.train(config, _plan(device_plan, 2))
  lines = logged.out
  assert final == 8
  assert any('global step 6' in line for line in lines), lines
  assert not any('step 1,' in line for line in lines), lines
  assert os.path.basename(tf.train.latest_checkpoint(modern_dir)) == 'model.ckpt-8'


@pytest.mark.slow
def test_refuses_non_empty_target_and_leaves_it(legacy_dir, tmp_path):
  target = tmp_path / 'busy'
  target.mkdir()
  (target / 'notes.txt').write_bytes(b'keep me')
  with pytest.raises(convert.ConvertError, match='not empty'):
    convert.convert(legacy_dir, str(target))
  assert os.listdir(target) == ['notes.txt']
  assert (target / 'notes.txt').read_bytes() == b'keep me'
  assert not [p for p in os.listdir(tmp_path) if 'converting' in p]


def test_cli_convert_errors_are_one_line(tmp_path):
  empty = tmp_path / 'empty'
  empty.mkdir()
  result = CliRunner().invoke(cli.cli, ['convert', '--from_dir', str(empty),
                                        '--to_dir', str(tmp_path / 'out')])
  assert result.exit_code == 1
  assert 'no checkpoint in' in result.output
  assert 'Traceback' not in result.output
  assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_cli_convert(legacy_dir, tmp_path):
  result = CliRunner().invoke(cli.cli, ['convert', '--from_dir', legacy_dir,
                                        '--to_dir', str(tmp_path / 'm')])
  assert result.exit_code == 0, result.output
  assert 'legacy checkpoint' in result.output
  assert 'global step 6' in result.output
  assert 'python cli.py modern --train_dir' in result.output


# --- what convert refuses, in one line, changing nothing ----------------------

def _refused(args, *roots, code=1):
  """Runs `convert ARGS`; returns its one `Error:` line after checking that
  it exited with `code` without a traceback and changed nothing under the roots."""
  before = fs.snapshot(*roots)
  listed = {root: sorted(os.listdir(root)) for root in roots}
  exit_code, _, err, exception = fs.invoke_cli(['convert'] + list(args))
  assert exception is None and exit_code == code, (exit_code, err, exception)
  assert fs.changed(before, fs.snapshot(*roots)) == []
  assert set(fs.snapshot(*roots)) == set(before)  # nothing new either
  assert {root: sorted(os.listdir(root)) for root in roots} == listed
  return [line for line in fs.ours(err) if line.startswith('Error:')]


@pytest.fixture
def trained(legacy_dir, tmp_path):
  """A copy of the legacy train_dir: tmp_path/runs/train."""
  train = tmp_path / 'runs' / 'train'
  shutil.copytree(legacy_dir, train)
  return train


@pytest.mark.slow
@pytest.mark.parametrize('spelling', [
    'as given', 'with a trailing slash', 'through a symlink', 'relative'])
def test_cli_convert_refuses_the_same_directory(trained, tmp_path, monkeypatch,
                                                spelling):
  from_dir = str(trained)
  if spelling == 'as given':
    to_dir = from_dir
  elif spelling == 'with a trailing slash':
    to_dir = from_dir + '/'
  elif spelling == 'through a symlink':
    os.symlink(trained, tmp_path / 'link')
    to_dir = str(tmp_path / 'link')
  else:
    monkeypatch.chdir(tmp_path / 'runs')
    to_dir = os.path.join('..', 'runs', 'train')
  real = os.path.realpath(trained)
  assert _refused(['--from_dir', from_dir, '--to_dir', to_dir], str(tmp_path)) == [
      'Error: --to_dir %s is %s, --from_dir %s or inside it: the converted checkpoint '
      'goes to a directory of its own. Pass a new or empty directory outside it as '
      '--to_dir, e.g. %s_converted; nothing was converted.' % (to_dir, real, from_dir, real)]


@pytest.mark.slow
@pytest.mark.parametrize('inside', ['modern', 'a/b'])
def test_cli_convert_refuses_a_to_dir_inside_from_dir(trained, tmp_path, inside):
  to_dir = os.path.join(str(trained), inside)
  real = os.path.realpath(trained)
  assert _refused(['--from_dir', str(trained), '--to_dir', to_dir], str(tmp_path)) == [
      'Error: --to_dir %s is %s, --from_dir %s or inside it: the converted checkpoint '
      'goes to a directory of its own. Pass a new or empty directory outside it as '
      '--to_dir, e.g. %s_converted; nothing was converted.'
      % (to_dir, os.path.join(real, inside), trained, real)]


def test_cli_convert_refuses_a_missing_from_dir(tmp_path):
  missing = str(tmp_path / 'never_trained')
  assert _refused(['--from_dir', missing, '--to_dir', str(tmp_path / 'out')],
                  str(tmp_path), code=2) == [
      "Error: Invalid value for '--from_dir': Directory '%s' does not exist." % missing]


def _saver_checkpoint(directory, shapes):
  """A TF1 Saver checkpoint at step 5 of these variables and a global step."""
  os.makedirs(directory)
  with tf.Graph().as_default():
    for name, shape in shapes.items():
      tf1.get_variable(name, shape=shape)
    tf1.train.get_or_create_global_step()
    saver = tf1.train.Saver(save_relative_paths=True)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      saver.save(sess, os.path.join(directory, 'model.ckpt'), global_step=5)


_PASS_A_TRAIN_DIR = ('nothing was converted. Pass as --from_dir a train_dir that the '
                     'legacy or the modern trainer (or upstream\'s) trained.')


@pytest.mark.parametrize('shapes,problem', [
    ({'conv1/weights': [3, 3, 3, 64]},
     ': it holds conv1/weights with shape [3, 3, 3, 64], this model has [5, 5, 3, 64]'),
    ({'fc/weights': [10, 10]}, ', or an incomplete one: it lacks conv1/weights'),
], ids=['another shape', 'another variable'])
def test_cli_convert_refuses_a_checkpoint_of_another_model(tmp_path, shapes, problem):
  train = str(tmp_path / 'train')
  _saver_checkpoint(train, shapes)
  assert _refused(['--from_dir', train, '--to_dir', str(tmp_path / 'out')],
                  str(tmp_path)) == [
      'Error: %s/model.ckpt-5 is a checkpoint of another model%s; %s'
      % (train, problem, _PASS_A_TRAIN_DIR)]
