"""A small real image set in the CIFAR-10 binary layout: scikit-learn's digits.

`sklearn.datasets.load_digits` ships with scikit-learn (no download): 1797
greyscale 8x8 handwritten digits, classes 0..9, intensities 0..16. Each is
enlarged 3x (nearest neighbour) to 24x24 and padded to 32x32 with the digit in
the middle, so the 24x24 central crop of evaluation keeps the whole digit and a
random training crop keeps most of it. scikit-learn is an optional dependency,
imported only when a conversion runs.
"""

import numpy as np

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.datasets import generated

CLASS_NAMES = tuple('0123456789')
VERSION = 1  # of the conversion, in GENERATED.json
NUM_IMAGES = 1797  # images in sklearn's load_digits
_SCALE = 3  # 8x8 -> 24x24
_MAX_VALUE = 16  # load_digits intensities are 0..16
TEST_FRACTION = 1 / 6  # of each class, held out for testing


def to_cifar_images(images):
  """Turns 8x8 digits into CIFAR-sized colour images.

  Args:
    images: float array [N, 8, 8], values 0..16, as load_digits gives them.

  Returns:
    uint8 [N, 32, 32, 3]: 3x nearest-neighbour enlargement to 24x24, centred on
    a black 32x32 canvas, scaled to 0..255 and repeated over the 3 channels.
  """
  big = images.repeat(_SCALE, axis=1).repeat(_SCALE, axis=2)
  pad = (fmt.HEIGHT - big.shape[1]) // 2  # 24x24 in the middle of 32x32
  pixels = np.rint(big * (255.0 / _MAX_VALUE)).astype(np.uint8)  # 16 -> 255
  return np.pad(pixels, ((0, 0), (pad, pad), (pad, pad)))[..., None].repeat(fmt.DEPTH, axis=3)


def split(labels, rng):
  """A shuffled split with about `TEST_FRACTION` of every class in the test set.

  Args:
    labels: int array [N].
    rng: numpy Generator.

  Returns:
    (train indices, test indices), each shuffled.
  """
  train, test = [], []
  for label in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == label))
    n_test = round(idx.size * TEST_FRACTION)
    test.append(idx[:n_test])
    train.append(idx[n_test:])
  return (rng.permutation(np.concatenate(train)),
          rng.permutation(np.concatenate(test)))


def convert_digits(data_dir, seed=0):
  """Writes scikit-learn's digits as `<data_dir>/cifar-10-batches-bin/`.

  The training images are spread evenly over `data_batch_1..5.bin`, the test
  images go to `test_batch.bin`, `batches.meta.txt` names the classes
  '0'..'9', and the marker `GENERATED.json` (`datasets.generated`) says the set
  is generated. The files are written aside and replace an existing
  directory's files all at once (`generated.write_set`): an interrupted or
  failed run changes nothing.

  Args:
    data_dir: str, the data directory (created if missing).
    seed: int, seeds the split and the order of the records.

  Returns:
    dict file name -> number of records written.

  Raises:
    common.cifar10_format.DataError: scikit-learn is not installed, the disk
      is full or read-only, or cifar-10-batches-bin is a file; nothing was
      changed (the message says what to do).
  """
  try:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise fmt.DataError('the digits data set comes with scikit-learn, which is not '
                        'installed: run `pip install scikit-learn`') from e
  digits = datasets.load_digits()
  images = to_cifar_images(digits.images)
  labels = digits.target
  train_idx, test_idx = split(labels, np.random.default_rng(seed))
  parts = np.array_split(train_idx, len(fmt.TRAIN_FILES)) + [test_idx]
  # Always marked: no fixture stands in for CIFAR-10 with the digits.
  return generated.write_set(
      data_dir, ((name, images[idx], labels[idx])
                 for name, idx in zip(fmt.DATA_FILES, parts)),
      labels.size * fmt.RECORD_BYTES, CLASS_NAMES, True, 'digits', VERSION, seed=seed)
