"""The CIFAR-10 binary format: exact bytes, and errors that name file and record."""

import os

import numpy as np
import pytest

from cifar10_towers.common import cifar10_format as fmt


def _images_and_labels(n, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, n).astype(np.int32)
  return images, labels


def _write_all(data_dir, per_file=3):
  d = fmt.batches_dir(str(data_dir))
  os.makedirs(d, exist_ok=True)
  for i, name in enumerate(fmt.TRAIN_FILES + fmt.EVAL_FILES):
    images, labels = _images_and_labels(per_file, seed=i)
    fmt.write_records(os.path.join(d, name), images, labels)
  return d


def test_round_trip_gives_back_exact_pixels_and_labels(tmp_path):
  images, labels = _images_and_labels(7)
  path = str(tmp_path / 'x.bin')
  fmt.write_records(path, images, labels)
  got_images, got_labels = fmt.read_records(path)
  assert got_images.dtype == np.uint8 and got_images.shape == (7, 32, 32, 3)
  np.testing.assert_array_equal(got_images, images)
  np.testing.assert_array_equal(got_labels, labels)


def test_bytes_are_label_then_depth_major_planes(tmp_path):
  images = np.zeros((2, 32, 32, 3), np.uint8)
  # Record 1, row 5, column 7, blue channel (depth 2).
  images[1, 5, 7, 2] = 200
  images[1, 5, 7, 0] = 17  # red of the same pixel
  labels = np.array([3, 9])
  path = tmp_path / 'x.bin'
  fmt.write_records(str(path), images, labels)
  raw = path.read_bytes()
  assert len(raw) == 2 * 3073
  assert raw[0] == 3 and raw[3073] == 9
  record1 = 3073
  assert raw[record1 + 1 + 2 * 1024 + 5 * 32 + 7] == 200
  assert raw[record1 + 1 + 0 * 1024 + 5 * 32 + 7] == 17
  # Nothing else in record 1 is set.
  assert sum(1 for b in raw[record1 + 1:] if b) == 2
  # And decoding a hand-made record puts the byte back at [row, col, depth].
  hand = bytearray(3073)
  hand[0] = 4
  hand[1 + 1 * 1024 + 31 * 32 + 0] = 99  # green, last row, first column
  path.write_bytes(bytes(hand))
  got, got_labels = fmt.read_records(str(path))
  assert got_labels.tolist() == [4]
  assert got[0, 31, 0, 1] == 99 and int(got.sum()) == 99


def test_truncated_file_names_file_record_and_offset(tmp_path):
  images, labels = _images_and_labels(3)
  path = tmp_path / 'data_batch_1.bin'
  fmt.write_records(str(path), images, labels)
  path.write_bytes(path.read_bytes()[:2 * 3073 + 100])
  with pytest.raises(fmt.DataError) as e:
    fmt.read_records(str(path))
  msg = str(e.value)
  assert str(path) in msg
  assert 'record 2' in msg and 'offset %d' % (2 * 3073) in msg
  with pytest.raises(fmt.DataError, match='data_batch_1.bin'):
    fmt.num_examples([str(path)])


def test_label_byte_10_names_file_and_record(tmp_path):
  images, labels = _images_and_labels(4)
  path = tmp_path / 'test_batch.bin'
  fmt.write_records(str(path), images, labels)
  raw = bytearray(path.read_bytes())
  raw[2 * 3073] = 10
  path.write_bytes(bytes(raw))
  with pytest.raises(fmt.DataError) as e:
    fmt.read_records(str(path))
  msg = str(e.value)
  assert str(path) in msg
  assert 'record 2' in msg and 'label byte 10' in msg


def test_num_examples_counts_records_from_sizes(tmp_path):
  d = _write_all(tmp_path, per_file=3)
  assert fmt.num_examples(fmt.train_files(str(tmp_path))) == 15
  assert fmt.num_examples(fmt.eval_files(str(tmp_path))) == 3
  assert fmt.train_files(str(tmp_path))[0] == os.path.join(d, 'data_batch_1.bin')


def test_check_data_dir_good(tmp_path):
  _write_all(tmp_path, per_file=2)
  problems, counts = fmt.check_data_dir(str(tmp_path))
  assert problems == []
  assert counts == {name: 2 for name in fmt.TRAIN_FILES + fmt.EVAL_FILES}


def test_check_data_dir_reports_every_problem_at_once(tmp_path):
  d = _write_all(tmp_path, per_file=2)
  os.remove(os.path.join(d, 'data_batch_2.bin'))
  with open(os.path.join(d, 'data_batch_3.bin'), 'ab') as f:
    f.write(b'\x00' * 5)  # truncated last record
  raw = bytearray(open(os.path.join(d, 'test_batch.bin'), 'rb').read())
  raw[3073] = 10  # record 1 gets a bad label
  open(os.path.join(d, 'test_batch.bin'), 'wb').write(bytes(raw))
  open(os.path.join(d, 'data_batch_6.bin'), 'wb').write(b'')
  problems, counts = fmt.check_data_dir(str(tmp_path))
  text = '\n'.join(problems)
  assert len(problems) == 4, text
  assert 'data_batch_2.bin: missing' in text
  assert 'data_batch_3.bin' in text and 'record 2' in text
  assert 'test_batch.bin' in text and 'record 1' in text
  assert 'data_batch_6.bin: unexpected' in text
  assert sorted(counts) == ['data_batch_1.bin', 'data_batch_4.bin',
                            'data_batch_5.bin']


def test_check_data_dir_without_directory(tmp_path):
  problems, counts = fmt.check_data_dir(str(tmp_path / 'nothing'))
  assert len(problems) == 1 and 'directory not found' in problems[0]
  assert counts == {}


def test_missing_train_files_say_how_to_get_data(tmp_path):
  d = _write_all(tmp_path)
  os.remove(os.path.join(d, 'data_batch_4.bin'))
  os.remove(os.path.join(d, 'data_batch_5.bin'))
  with pytest.raises(fmt.DataError) as e:
    fmt.train_files(str(tmp_path))
  msg = str(e.value)
  assert 'data_batch_4.bin' in msg and '2 of 5 missing' in msg
  assert 'cli.py data download --data_dir %s' % tmp_path in msg
  assert 'cli.py data synth --data_dir %s' % tmp_path in msg
  # The test file is still there.
  assert fmt.eval_files(str(tmp_path)) == [os.path.join(d, 'test_batch.bin')]
