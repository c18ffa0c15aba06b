"""Decoding and per-image preprocessing, written once for both pipelines.

These functions only add TensorFlow ops, so the same code runs inside the
legacy tf.compat.v1 graph (queue runners) and inside modern tf.data maps.
"""

import tensorflow as tf

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import hparams


def decode_record(record):
  """Splits one fixed-length record into its image and label.

  Args:
    record: scalar string tensor of `RECORD_BYTES` (3073) bytes.

  Returns:
    image: uint8 [32, 32, 3] (height, width, depth).
    label: int32 scalar, 0..9.
  """
  images, labels = decode_records(tf.reshape(record, [1]))
  return images[0], labels[0]


def distort_image(image):
  """The training distortions of upstream `distorted_inputs`.

  Args:
    image: uint8 or float32 [32, 32, 3].

  Returns:
    float32 [24, 24, 3]: a random crop, randomly flipped left-right, with
    random brightness and contrast, then standardized per image.
  """
  size = hparams.IMAGE_SIZE
  image = tf.image.random_crop(tf.cast(image, tf.float32), [size, size, 3])
  image = tf.image.random_flip_left_right(image)
  image = tf.image.random_brightness(image, hparams.BRIGHTNESS_MAX_DELTA)
  image = tf.image.random_contrast(image, hparams.CONTRAST_LOWER, hparams.CONTRAST_UPPER)
  return tf.image.per_image_standardization(image)


def eval_image(image):
  """The evaluation preprocessing of upstream `inputs`: central crop, standardize.

  Args:
    image: uint8 or float32 [32, 32, 3].

  Returns:
    float32 [24, 24, 3].
  """
  size = hparams.IMAGE_SIZE
  return tf.image.per_image_standardization(
      tf.image.resize_with_crop_or_pad(tf.cast(image, tf.float32), size, size))


# --- whole batches at once (the training pipelines use these) ---------------
#
# Deviation from upstream: upstream decoded and distorted one record per
# Session run. Both pipelines now do it for a batch of records at once with
# the same arithmetic: given the same random values, every image comes out
# bit for bit as `distort_image` makes it (tests/test_preprocess.py checks
# it), and each image draws its own values from the same distributions. A
# batch costs about a third of the CPU time of its images one by one
# (docs/performance.md).

_CROP_LIMIT = fmt.HEIGHT - hparams.IMAGE_SIZE + 1  # 9 crop offsets per axis


def decode_records(records):
  """Splits fixed-length records into images and labels (`decode_record` for many).

  Args:
    records: string tensor [n], each `RECORD_BYTES` (3073) bytes.

  Returns:
    images: uint8 [n, 32, 32, 3] (height, width, depth).
    labels: int32 [n], 0..9.
  """
  record_bytes = tf.io.decode_raw(records, tf.uint8)  # [n, 3073]
  labels = tf.cast(record_bytes[:, 0], tf.int32)
  # Each image's bytes are depth-major [depth, height, width]; make them HWC.
  depth_major = tf.reshape(record_bytes[:, fmt.LABEL_BYTES:],
                           [-1, fmt.DEPTH, fmt.HEIGHT, fmt.WIDTH])
  images = tf.transpose(depth_major, [0, 2, 3, 1])
  images.set_shape([records.shape[0], fmt.HEIGHT, fmt.WIDTH, fmt.DEPTH])
  return images, labels


def draw_distortions(num_images):
  """The random values of `distort_image`, drawn for each of num_images images.

  Drawn as the tf.image random ops draw them: a crop offset is a uniform
  int32 in [0, 2**31 - 1) modulo the number of offsets (random_crop), the
  flip a uniform float < 0.5, the brightness delta uniform in
  [-BRIGHTNESS_MAX_DELTA, BRIGHTNESS_MAX_DELTA), the contrast factor uniform
  in [CONTRAST_LOWER, CONTRAST_UPPER).

  Args:
    num_images: int32 scalar.

  Returns:
    (offsets int32 [n, 2] (row, column), flips bool [n], deltas float32 [n],
     factors float32 [n]).
  """
  offsets = tf.random.uniform([num_images, 2], maxval=tf.int32.max,
                              dtype=tf.int32) % _CROP_LIMIT
  flips = tf.random.uniform([num_images], 0, 1.0) < 0.5
  deltas = tf.random.uniform([num_images], -hparams.BRIGHTNESS_MAX_DELTA,
                             hparams.BRIGHTNESS_MAX_DELTA)
  factors = tf.random.uniform([num_images], hparams.CONTRAST_LOWER,
                              hparams.CONTRAST_UPPER)
  return offsets, flips, deltas, factors


def apply_distortions(images, offsets, flips, deltas, factors):
  """`distort_image`'s arithmetic on a batch, with the random values given.

  Image i is cropped at offsets[i], flipped left-right if flips[i], brightened
  by deltas[i], its contrast scaled by factors[i] around its per-channel
  mean, then standardized: the ops of tf.image's random_crop (a slice),
  random_flip_left_right (a reverse), adjust_brightness (an add),
  adjust_contrast ((x - mean) * factor + mean, with AdjustContrastv2's mean)
  and per_image_standardization, in that order.

  Args:
    images: uint8 or float32 [n, 32, 32, 3].
    offsets: int32 [n, 2], crop row and column, each in 0..8.
    flips: bool [n].
    deltas: float32 [n].
    factors: float32 [n].

  Returns:
    float32 [n, 24, 24, 3].
  """
  size = hparams.IMAGE_SIZE
  per_image = lambda v: v[:, None, None, None]
  x = tf.cast(images, tf.float32)
  x = tf.gather(x, offsets[:, 0:1] + tf.range(size), axis=1, batch_dims=1)  # [n, 24, 32, 3]
  x = tf.gather(x, offsets[:, 1:2] + tf.range(size), axis=2, batch_dims=1)  # [n, 24, 24, 3]
  x = tf.where(per_image(flips), tf.reverse(x, [2]), x)
  x = x + per_image(deltas)
  # AdjustContrastv2 computes mean + factor * (x - mean); with factor 0 it
  # returns its own per-image, per-channel mean, broadcast.
  mean = tf.image.adjust_contrast(x, 0.0)
  x = (x - mean) * per_image(factors) + mean
  return tf.image.per_image_standardization(x)


def distort_images(images):
  """`distort_image` for a batch: each image with its own random values.

  Args:
    images: uint8 or float32 [n, 32, 32, 3].

  Returns:
    float32 [n, 24, 24, 3].
  """
  return apply_distortions(images, *draw_distortions(images.shape[0] or tf.shape(images)[0]))
