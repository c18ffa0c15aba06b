"""modern.inputs: tf.data pipelines over the CIFAR-10 binary files."""

import os

import numpy as np
import pytest
import tensorflow as tf

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import preprocess
from cifar10_towers.modern import inputs


def test_eval_inputs_equal_shared_preprocessing_of_decoded_records(synth_data_dir):
  images, labels = fmt.read_records(
      os.path.join(fmt.batches_dir(synth_data_dir), 'test_batch.bin'))
  expected = np.stack([preprocess.eval_image(tf.constant(image)).numpy()
                       for image in images])
  batches = list(inputs.inputs(True, synth_data_dir, batch_size=128))
  # Every record exactly once, in file order; the final partial batch is kept.
  assert [int(b[1].shape[0]) for b in batches] == [128, 128, 44]
  got_images = np.concatenate([b[0].numpy() for b in batches])
  got_labels = np.concatenate([b[1].numpy() for b in batches])
  assert got_images.dtype == np.float32 and got_labels.dtype == np.int32
  np.testing.assert_array_equal(got_labels, labels)
  np.testing.assert_array_equal(got_images, expected)


def test_eval_inputs_over_the_training_files(synth_data_dir):
  total = sum(int(b.shape[0]) for _, b in inputs.inputs(False, synth_data_dir, 300))
  assert total == 5 * 200


def test_distorted_inputs_give_each_tower_its_own_batch(synth_data_dir):
  dataset = inputs.distorted_inputs(synth_data_dir, batch_size=8, num_towers=3, seed=1)
  images_spec, labels_spec = dataset.element_spec
  assert images_spec.shape == (3, 8, 24, 24, 3) and images_spec.dtype == tf.float32
  assert labels_spec.shape == (3, 8) and labels_spec.dtype == tf.int32
  images, labels = next(iter(dataset))
  images = images.numpy()
  assert np.isfinite(images).all()
  assert ((labels.numpy() >= 0) & (labels.numpy() <= 9)).all()
  # per_image_standardization: zero mean, unit variance per image.
  np.testing.assert_allclose(images.mean(axis=(2, 3, 4)), 0, atol=1e-4)
  np.testing.assert_allclose(images.std(axis=(2, 3, 4)), 1, atol=1e-3)
  flat = images.reshape(24, -1)
  assert len({row.tobytes() for row in flat}) == 24  # 24 distinct images


def test_distorted_inputs_repeat_and_shuffle(synth_data_dir):
  # 1000 records, 100 batches of 16: more than an epoch, shuffled across it.
  dataset = inputs.distorted_inputs(synth_data_dir, batch_size=16, num_towers=1, seed=3)
  labels = np.concatenate([l.numpy().ravel() for _, l in dataset.take(70)])
  assert labels.size == 1120
  _, file_labels = fmt.read_records(
      os.path.join(fmt.batches_dir(synth_data_dir), 'data_batch_1.bin'))
  assert not np.array_equal(labels[:200], file_labels)
  counts = np.bincount(labels, minlength=10)
  assert counts.min() > 60  # balanced classes stay roughly balanced


def test_missing_training_data_names_the_file(tmp_path):
  with pytest.raises(fmt.DataError, match='data_batch_1.bin'):
    inputs.distorted_inputs(str(tmp_path), 8, 1)


def test_no_pipeline_runs_the_autotuning_thread(synth_data_dir):
  """Its thread held up the iterator's deletion, so a stopped run's exit, for seconds."""
  for dataset in (inputs.distorted_inputs(synth_data_dir, 8, 2),
                  inputs.inputs(True, synth_data_dir, 8)):
    assert dataset.options().autotune.enabled is False
