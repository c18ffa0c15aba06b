"""scikit-learn's digits converted to the CIFAR-10 binary layout."""

import os
import sys

import numpy as np
import pytest

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.datasets import digits


@pytest.fixture(scope='module')
def source():
  """sklearn's digits; skips the test when scikit-learn is not installed."""
  datasets = pytest.importorskip('sklearn.datasets')
  return datasets.load_digits()


@pytest.fixture(scope='module')
def converted(source, tmp_path_factory):  # pylint: disable=unused-argument
  data_dir = str(tmp_path_factory.mktemp('digits'))
  return data_dir, digits.convert_digits(data_dir, seed=0)


def _all(data_dir):
  parts = [fmt.read_records(p)
           for p in fmt.train_files(data_dir) + fmt.eval_files(data_dir)]
  return (np.concatenate([images for images, _ in parts]),
          np.concatenate([labels for _, labels in parts]))


def test_counts_and_valid_files(converted):
  data_dir, counts = converted
  assert sum(counts.values()) == 1797 == digits.NUM_IMAGES
  assert counts['test_batch.bin'] == 299  # about 1/6 of every class
  # The training images are spread evenly over the five files.
  train_counts = [counts[n] for n in fmt.TRAIN_FILES]
  assert sum(train_counts) == 1498 and max(train_counts) - min(train_counts) <= 1
  problems, found = fmt.check_data_dir(data_dir)
  assert problems == [] and found == counts
  with open(os.path.join(fmt.batches_dir(data_dir), fmt.META_FILE)) as f:
    assert f.read().splitlines() == [str(d) for d in range(10)]


def test_labels_and_stratified_split(converted, source):
  data_dir, _ = converted
  _, labels = _all(data_dir)
  assert labels.min() == 0 and labels.max() == 9
  np.testing.assert_array_equal(np.bincount(labels, minlength=10),
                                np.bincount(source.target, minlength=10))
  _, test_labels = fmt.read_records(fmt.eval_files(data_dir)[0])
  per_class = np.bincount(test_labels, minlength=10)
  assert per_class.min() >= 29 and per_class.max() <= 31, per_class
  # Shuffled: the first training file is not one class after another.
  _, first = fmt.read_records(fmt.train_files(data_dir)[0])
  assert len(set(first[:30].tolist())) >= 5


def test_images_are_the_digits_enlarged_and_centred(converted, source):
  data_dir, _ = converted
  images, labels = _all(data_dir)
  assert images.shape == (1797, 32, 32, 3) and images.dtype == np.uint8
  # Grey: the three channels are equal.
  np.testing.assert_array_equal(images[..., 0], images[..., 1])
  np.testing.assert_array_equal(images[..., 0], images[..., 2])
  # A 4-pixel black border, so the 24x24 central crop holds the whole digit.
  border = images.copy()
  border[:, 4:28, 4:28] = 0
  assert border.max() == 0
  assert images.max() == 255
  # Each 3x3 block is one source pixel, scaled from 0..16 to 0..255.
  small = images[:, 4:28:3, 4:28:3, 0]  # [N, 8, 8]
  np.testing.assert_array_equal(images[:, 4:28, 4:28, 0],
                                small.repeat(3, axis=1).repeat(3, axis=2))
  assert set(np.unique(small)) <= {round(v * 255 / 16) for v in range(17)}
  # Every source digit, with its label, is there exactly once.
  def key(imgs, labs):
    return sorted((int(l),) + tuple(int(v) for v in i.reshape(-1))
                  for i, l in zip(imgs, labs))
  assert key(np.rint(small * 16.0 / 255.0), labels) == key(
      np.rint(source.images), source.target)


def test_same_seed_same_files_other_seed_other_split(source, tmp_path):  # pylint: disable=unused-argument
  a, b, c = (str(tmp_path / n) for n in 'abc')
  digits.convert_digits(a, seed=1)
  digits.convert_digits(b, seed=1)
  digits.convert_digits(c, seed=2)
  def read(d):
    with open(fmt.eval_files(d)[0], 'rb') as f:
      return f.read()
  assert read(a) == read(b)
  assert read(a) != read(c)


def test_without_sklearn_says_how_to_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'sklearn', None)  # import sklearn fails
  monkeypatch.setitem(sys.modules, 'sklearn.datasets', None)
  with pytest.raises(fmt.DataError, match='pip install scikit-learn'):
    digits.convert_digits(str(tmp_path))
  assert not os.path.exists(fmt.batches_dir(str(tmp_path)))
