"""Legacy evaluation: every test record once, moving averages restored."""

import functools
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import faults_support as fs
from cifar10_towers.common import cifar10_format
from cifar10_towers.common import hparams
from cifar10_towers.legacy import eval as legacy_eval
from cifar10_towers.legacy import model
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import evaluation

NUM_TEST = 300  # not a multiple of the batch size 128
PREDICTED = 3  # the class the crafted averaged model always predicts


def _labels():
  """Class 3 at every 8th of the first 256 records and in the last 44."""
  labels = np.zeros(NUM_TEST, np.int32)
  labels[0:256:8] = PREDICTED
  labels[256:] = PREDICTED
  return labels


def _evaluate(checkpoint_dir, data_dir, batch_size=128, **run_args):
  """runtime.evaluation.run with the legacy evaluator: its Evaluations."""
  return evaluation.run(checkpoint_dir, functools.partial(
      legacy_eval.evaluate_contents, data_dir=data_dir, batch_size=batch_size), **run_args)


@pytest.fixture(scope='module')
def crafted(tmp_path_factory):
  """A test file with `_labels()` and a checkpoint at global step 7 whose
  moving averages always predict class 3 (its raw variables predict 5)."""
  root = tmp_path_factory.mktemp('legacy_eval')
  data_dir = str(root / 'data')
  os.makedirs(cifar10_format.batches_dir(data_dir))
  rng = np.random.default_rng(0)
  cifar10_format.write_records(
      os.path.join(cifar10_format.batches_dir(data_dir),
                   cifar10_format.EVAL_FILES[0]),
      rng.integers(0, 256, (NUM_TEST, 32, 32, 3), dtype=np.uint8), _labels())

  checkpoint_dir = str(root / 'train')
  with tf.Graph().as_default():
    images = tf.placeholder(tf.float32, [None, 24, 24, 3])
    model.inference(images)
    global_step = tf.train.get_or_create_global_step()
    ema = tf.train.ExponentialMovingAverage(hparams.MOVING_AVERAGE_DECAY)
    ema.apply(tf.trainable_variables())
    saver = tf.train.Saver(tf.global_variables())
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      global_step.load(7, sess)
      for var in tf.trainable_variables():
        # All weights and biases 0, so the logits are softmax_linear/biases.
        shadow = np.zeros(var.shape.as_list(), np.float32)
        raw = np.zeros(var.shape.as_list(), np.float32)
        if var.op.name == 'softmax_linear/biases':
          shadow[PREDICTED] = 1.0
          raw[5] = 1.0
        var.load(raw, sess)
        ema.average(var).load(shadow, sess)
      saver.save(sess, os.path.join(checkpoint_dir, 'model.ckpt'),
                 global_step=7)
  return data_dir, checkpoint_dir


def test_evaluate_counts_every_record_once(crafted):
  data_dir, checkpoint_dir = crafted
  with fs.Logged() as logged:
    (result,) = _evaluate(checkpoint_dir, data_dir)
  lines = logged.out
  # 76 of the 300 labels are 3. Upstream's wrap-around would have counted
  # 384 records, 87 of them 3s.
  assert result.precision == 76 / 300
  assert result.global_step == 7
  assert len(lines) == 1 and lines[0].endswith(
      'precision @ 1 = 0.253 (global step 7, model.ckpt-7)')


def test_evaluate_contents_counts(crafted):
  data_dir, checkpoint_dir = crafted
  contents = checkpoints.read(os.path.join(checkpoint_dir, 'model.ckpt-7'))
  assert legacy_eval.evaluate_contents(contents, data_dir, batch_size=128) == (76, 300, 7)
  # The first 100 records: 3s at 0, 8, ..., 96.
  assert legacy_eval.evaluate_contents(contents, data_dir, batch_size=128,
                                       num_examples=100) == (13, 100, 7)
  # More than the file holds means all of it.
  assert legacy_eval.evaluate_contents(contents, data_dir, batch_size=7,
                                       num_examples=10000) == (76, 300, 7)


def test_evaluate_writes_precision_summary(crafted, tmp_path):
  data_dir, checkpoint_dir = crafted
  eval_dir = str(tmp_path / 'eval')
  _evaluate(checkpoint_dir, data_dir, eval_dir=eval_dir)
  assert fs.precision_points(eval_dir) == [(7, pytest.approx(76 / 300))]


def test_evaluate_loop_evaluates_a_checkpoint_once(crafted):
  data_dir, checkpoint_dir = crafted
  with fs.Logged() as logged:
    results = _evaluate(checkpoint_dir, data_dir, interval_secs=0.01, max_evals=1)
  assert [(r.precision, r.global_step) for r in results] == [(76 / 300, 7)]
  assert 'global step 7' in logged.out[0]


def test_no_checkpoint_says_to_train_first(crafted, tmp_path):
  data_dir, _ = crafted
  with pytest.raises(checkpoints.CheckpointError, match='no checkpoint in .*Train first'):
    _evaluate(str(tmp_path), data_dir)


def test_checkpoint_without_averages_is_an_eval_error(crafted, tmp_path):
  data_dir, _ = crafted
  with tf.Graph().as_default():
    tf.Variable(1.0, name='something_else')
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      tf.train.Saver().save(sess, str(tmp_path / 'model.ckpt'), global_step=1)
  with pytest.raises(evaluation.EvalError, match='moving averages'):
    _evaluate(str(tmp_path), data_dir)


def test_modern_checkpoint_is_an_eval_error(crafted, tmp_path):
  data_dir, _ = crafted
  tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(tmp_path / 'model.ckpt'))
  with pytest.raises(evaluation.EvalError, match='modern evaluator'):
    _evaluate(str(tmp_path), data_dir)
