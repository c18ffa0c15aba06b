"""common.preprocess: batched decoding and distortions are the per-image ones, bit for bit.

The training pipelines decode and distort whole batches (`decode_records`,
`distort_images`); `decode_record` and `distort_image` are upstream's
per-image functions. Given the same random values, every image must come out
identical, not just close: the tolerance here is zero.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import random_ops

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import hparams
from cifar10_towers.common import preprocess

NUM_IMAGES = 64


@pytest.fixture(scope='module')
def batch():
  """Random uint8 images, labels and distortion values, one set per image."""
  rng = np.random.default_rng(5)
  images = rng.integers(0, 256, (NUM_IMAGES, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, NUM_IMAGES).astype(np.int32)
  offsets = rng.integers(0, 9, (NUM_IMAGES, 2)).astype(np.int32)
  offsets[:4] = [[0, 0], [8, 8], [0, 8], [8, 0]]  # the corners
  flips = rng.random(NUM_IMAGES) < 0.5
  deltas = rng.uniform(-63, 63, NUM_IMAGES).astype(np.float32)
  factors = rng.uniform(0.2, 1.8, NUM_IMAGES).astype(np.float32)
  return images, labels, (offsets, flips, deltas, factors)


def test_decode_records_equals_decode_record(batch):
  images, labels, _ = batch
  records = [fmt.encode_records(images[i:i + 1], labels[i:i + 1])
             for i in range(NUM_IMAGES)]
  got_images, got_labels = preprocess.decode_records(tf.constant(records))
  assert got_images.shape == (NUM_IMAGES, 32, 32, 3) and got_images.dtype == tf.uint8
  for i, record in enumerate(records):
    image, label = preprocess.decode_record(tf.constant(record))
    np.testing.assert_array_equal(got_images[i], image)
    assert int(got_labels[i]) == int(label)
  np.testing.assert_array_equal(got_images, images)
  np.testing.assert_array_equal(got_labels, labels)


def _distort_image_with(image, offset, flip, delta, factor, monkeypatch):
  """Upstream's per-image distort_image, its random ops returning the given values."""
  values = [tf.constant([offset[0], offset[1], 0], tf.int32),  # random_crop (% 9)
            tf.constant(0.25 if flip else 0.75),  # random_flip_left_right (< 0.5)
            tf.constant(delta),  # random_brightness
            tf.constant(factor)]  # random_contrast
  drawn = []

  def scripted_uniform(*args, **kwargs):
    del args, kwargs
    value = values[len(drawn)]
    drawn.append(value)
    return value

  with monkeypatch.context() as m:
    m.setattr(random_ops, 'random_uniform', scripted_uniform)
    result = preprocess.distort_image(tf.constant(image))
  assert len(drawn) == 4  # crop, flip, brightness, contrast: each drawn once
  return result.numpy()


def test_apply_distortions_is_distort_image_bit_for_bit(batch, monkeypatch):
  images, _, (offsets, flips, deltas, factors) = batch
  got = preprocess.apply_distortions(images, offsets, flips, deltas, factors).numpy()
  assert got.shape == (NUM_IMAGES, 24, 24, 3) and got.dtype == np.float32
  for i in range(NUM_IMAGES):
    want = _distort_image_with(images[i], offsets[i], flips[i], deltas[i], factors[i],
                               monkeypatch)
    np.testing.assert_array_equal(got[i], want, err_msg='image %d' % i)


def test_apply_distortions_is_the_same_in_tf_data_and_tf_function(batch):
  images, _, values = batch
  eager = preprocess.apply_distortions(images, *values).numpy()
  traced = tf.function(preprocess.apply_distortions)(images, *values).numpy()
  dataset = tf.data.Dataset.from_tensors((images,) + values).map(
      preprocess.apply_distortions)
  np.testing.assert_array_equal(traced, eager)
  np.testing.assert_array_equal(next(iter(dataset)).numpy(), eager)


def test_draw_distortions_has_each_images_own_values_in_range():
  tf.random.set_seed(11)
  offsets, flips, deltas, factors = [
      v.numpy() for v in preprocess.draw_distortions(20000)]
  assert offsets.shape == (20000, 2) and offsets.dtype == np.int32
  # Every crop offset 0..8 on both axes, about equally often.
  for axis in range(2):
    counts = np.bincount(offsets[:, axis], minlength=9)
    assert counts.size == 9 and counts.min() > 0.8 * 20000 / 9
  assert 0.45 < flips.mean() < 0.55
  max_delta = hparams.BRIGHTNESS_MAX_DELTA
  assert -max_delta <= deltas.min() < -0.9 * max_delta
  assert 0.9 * max_delta < deltas.max() <= max_delta
  assert hparams.CONTRAST_LOWER <= factors.min() < hparams.CONTRAST_LOWER + 0.01
  assert hparams.CONTRAST_UPPER - 0.01 < factors.max() <= hparams.CONTRAST_UPPER
  # Independent per image: the draws are not repeated across the batch.
  assert len(np.unique(deltas)) > 19000


def test_distort_images_is_standardized_and_keeps_static_shapes(batch):
  images, _, _ = batch
  got = preprocess.distort_images(tf.constant(images))
  assert got.shape == (NUM_IMAGES, 24, 24, 3)
  got = got.numpy()
  np.testing.assert_allclose(got.mean(axis=(1, 2, 3)), 0, atol=1e-4)
  np.testing.assert_allclose(got.std(axis=(1, 2, 3)), 1, atol=1e-3)
  spec = tf.data.Dataset.from_tensors(images).map(preprocess.distort_images).element_spec
  assert spec.shape == (NUM_IMAGES, 24, 24, 3)
