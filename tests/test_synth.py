"""Generated data: deterministic, balanced, valid, learnable after distortions,
and as hard as its docstring says: the quick start's run shows learning."""

import hashlib
import os
import re
import tracemalloc

import numpy as np
import pytest
import threadpoolctl

import faults_support as fs
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.datasets import synth

# The constant the memory tests patch, read here so that a rename fails at collection.
assert isinstance(synth.CHUNK, int)


def _read_dir(data_dir):
  train = [fmt.read_records(p) for p in fmt.train_files(data_dir)]
  x_train = np.concatenate([images for images, _ in train])
  y_train = np.concatenate([labels for _, labels in train])
  x_test, y_test = fmt.read_records(fmt.eval_files(data_dir)[0])
  return x_train, y_train, x_test, y_test


@pytest.fixture(scope='module')
def small_set(tmp_path_factory):
  """200 training images per file (1000 in all) and 500 test images, seed 1."""
  data_dir = str(tmp_path_factory.mktemp('synth'))
  counts = synth.generate(data_dir, train_per_file=200, num_test=500, seed=1)
  return data_dir, counts


def test_generate_writes_valid_files_and_counts(small_set):
  data_dir, counts = small_set
  expected = {name: 200 for name in fmt.TRAIN_FILES}
  expected['test_batch.bin'] = 500
  assert counts == expected
  problems, found = fmt.check_data_dir(data_dir)
  assert problems == []
  assert found == expected
  with open(os.path.join(fmt.batches_dir(data_dir), fmt.META_FILE)) as f:
    assert f.read().splitlines() == list(synth.CLASS_NAMES)
  assert len(synth.CLASS_NAMES) == 10


def test_labels_are_balanced_and_shuffled(small_set):
  x_train, y_train, x_test, y_test = _read_dir(small_set[0])
  assert x_train.shape == (1000, 32, 32, 3) and x_test.shape == (500, 32, 32, 3)
  np.testing.assert_array_equal(np.bincount(y_train, minlength=10), [100] * 10)
  np.testing.assert_array_equal(np.bincount(y_test, minlength=10), [50] * 10)
  # Shuffled: every training file holds many classes, not one block each.
  assert all(len(set(y_train[i:i + 200])) == 10 for i in range(0, 1000, 200))


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
  a, b, c = (str(tmp_path / n) for n in 'abc')
  synth.generate(a, train_per_file=20, num_test=30, seed=7)
  synth.generate(b, train_per_file=20, num_test=30, seed=7)
  synth.generate(c, train_per_file=20, num_test=30, seed=8)
  for name in fmt.TRAIN_FILES + fmt.EVAL_FILES:
    def raw(d, name=name):
      with open(os.path.join(fmt.batches_dir(d), name), 'rb') as f:
        return f.read()
    assert raw(a) == raw(b), name
    assert raw(a) != raw(c), name


def test_test_set_does_not_change_training_images(tmp_path):
  a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
  synth.generate(a, train_per_file=10, num_test=10, seed=3)
  synth.generate(b, train_per_file=10, num_test=40, seed=3)
  path = lambda d: os.path.join(fmt.batches_dir(d), 'data_batch_5.bin')
  with open(path(a), 'rb') as fa, open(path(b), 'rb') as fb:
    assert fa.read() == fb.read()


def test_images_use_the_range_and_vary(small_set):
  x_train, y_train, _, _ = _read_dir(small_set[0])
  # Random colours: per-image means spread widely within every class, so no
  # class can be told by its colour or brightness.
  means = x_train.reshape(1000, -1, 3).mean(axis=1)  # [N, 3]
  for label in range(10):
    class_means = means[y_train == label]
    assert class_means.std(axis=0).min() > 15, label
  # Every image has real contrast.
  assert x_train.reshape(1000, -1).std(axis=1).min() > 10


def test_synth_refuses_empty_files(tmp_path):
  # --train_per_file 0 would write empty data files: a usage error, nothing written.
  code, _, err, exception = fs.invoke_cli(
      ['data', 'synth', '--data_dir', tmp_path / 'd', '--train_per_file', 0])
  assert (code, exception) == (2, None), err
  assert "'--train_per_file': 0 is not in the range x>=1" in err, err
  assert not os.path.exists(tmp_path / 'd')


# sha256 of the six .bin files, in TRAIN_FILES + EVAL_FILES order, as written
# by version 2 of the generator (issue 22; version 1's easy set wrote other
# bytes) with every image of a stream made at once (CHUNK above 100): the same
# seed must keep giving these bytes, whatever the size of the pieces.
PINNED_FILES = {
    # (train_per_file, num_test, seed): sha256
    (20, 30, 7): 'a21ad3d366ab9527f5317382ec71c4ca6cb12f235c40d56ec13fda04f731a7e4',
    (37, 23, 11): '073a2e6635198e76186acdf026ec1d45bdd7d3b42cddffa2ba1b8e0ec4de4368',
}
# make_images(default_rng(5), arange(25) % 10), as the cross-check draws its
# batches, and the generator's next draw after it (crosscheck draws on).
PINNED_IMAGES = 'eaa135694409d2a43026787badbd79ea9f418c0155e5e70c6dc2cc450c9fa700'
PINNED_NEXT_DRAW = 0.1785783632949075


@pytest.mark.parametrize('chunk', [1, 7, 1000])
def test_the_bytes_of_a_seed_do_not_depend_on_the_pieces(chunk, tmp_path,
                                                         monkeypatch):
  monkeypatch.setattr(synth, 'CHUNK', chunk)
  for (train_per_file, num_test, seed), expected in PINNED_FILES.items():
    data_dir = str(tmp_path / ('%d_%d_%d' % (train_per_file, num_test, seed)))
    synth.generate(data_dir, train_per_file=train_per_file, num_test=num_test,
                   seed=seed, mark=False)
    digest = hashlib.sha256()
    for name in fmt.TRAIN_FILES + fmt.EVAL_FILES:
      with open(os.path.join(fmt.batches_dir(data_dir), name), 'rb') as f:
        digest.update(f.read())
    assert digest.hexdigest() == expected, (train_per_file, num_test, seed)
  rng = np.random.default_rng(5)
  images = synth.make_images(rng, np.arange(25) % 10)
  assert hashlib.sha256(images.tobytes()).hexdigest() == PINNED_IMAGES
  assert rng.random() == PINNED_NEXT_DRAW


def test_generate_holds_about_one_file_in_memory(tmp_path, monkeypatch):
  """Made all at once, 2000 training images took ~60 files' worth (float32
  pixels, noise and patterns of every image); file by file, a file's pixels,
  its records and their bytes, and the float32 work of `CHUNK` images."""
  monkeypatch.setattr(synth, 'CHUNK', 50)
  train_per_file = 400
  file_bytes = train_per_file * fmt.RECORD_BYTES
  tracemalloc.start()
  try:
    synth.generate(str(tmp_path), train_per_file=train_per_file, num_test=10,
                   seed=0, mark=False)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 10 * file_bytes, '%.1f files\' worth' % (peak / file_bytes)


def test_generate_says_which_file_it_begins(tmp_path):
  begun = []
  synth.generate(str(tmp_path), train_per_file=2, num_test=3, seed=0,
                 progress=lambda *args: begun.append(args))
  assert begun == [(name, number, 6) for number, name in enumerate(
      fmt.TRAIN_FILES + fmt.EVAL_FILES, start=1)]


# --- Learnability -------------------------------------------------------------
# A classifier that sees only the distorted 24x24 crops must learn the classes
# of the clear images (the faint ones are hard by design: see the quick start's
# run below).
# The features are the log power spectrum of the standardized crop, summed over
# the channels: invariant to the crop's shift, to the channel colours' signs and
# (for these patterns) to the left-right flip, so a linear softmax on them is a
# fast stand-in for the convolutional model. Colour features alone must not
# work: that shows the label lives in the pattern, not in the colours.


def _standardize(x):
  """Per-image standardization, as tf.image.per_image_standardization."""
  mean = x.mean(axis=(1, 2, 3), keepdims=True)
  std = x.std(axis=(1, 2, 3), keepdims=True)
  return (x - mean) / np.maximum(std, 1.0 / np.sqrt(x[0].size))


def _numpy_distort(rng, images):
  """Numpy proxy of the train distortions: crop, flip, brightness, contrast."""
  n = images.shape[0]
  x = images.astype(np.float32)
  oy, ox = rng.integers(0, 9, n), rng.integers(0, 9, n)
  rows = (oy[:, None] + np.arange(24))[:, :, None]
  cols = (ox[:, None] + np.arange(24))[:, None, :]
  x = x[np.arange(n)[:, None, None], rows, cols]  # [N, 24, 24, 3]
  flip = rng.random(n) < 0.5
  x[flip] = x[flip, :, ::-1]
  x += rng.uniform(-63, 63, (n, 1, 1, 1)).astype(np.float32)
  channel_mean = x.mean(axis=(1, 2), keepdims=True)
  x = (x - channel_mean) * rng.uniform(0.2, 1.8, (n, 1, 1, 1)) + channel_mean
  return _standardize(x)


def _numpy_eval(images):
  return _standardize(images[:, 4:28, 4:28].astype(np.float32))


def _tf_preprocess(fn, images):
  tf = pytest.importorskip('tensorflow')
  dataset = tf.data.Dataset.from_tensor_slices(images).map(fn).batch(500)
  return np.concatenate(list(dataset.as_numpy_iterator()))


def _spectrum_features(x):
  power = (np.abs(np.fft.fft2(x, axes=(1, 2))) ** 2).sum(axis=-1)
  return np.log1p(power).reshape(x.shape[0], -1)


@threadpoolctl.threadpool_limits.wrap(limits=1, user_api='blas')
def _fit_softmax(features, labels, steps=300, lr=0.5):
  """Plain gradient-descent softmax regression; returns a predict function.

  On one BLAS thread: these small products run 2-3x faster than on threads
  that contend with each other and TensorFlow's for the machine's cores.
  """
  mu, sd = features.mean(0), features.std(0) + 1e-6
  f = (features - mu) / sd
  w = np.zeros((f.shape[1], 10))
  b = np.zeros(10)
  onehot = np.eye(10)[labels]
  for _ in range(steps):
    z = f @ w + b
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    g = (p - onehot) / f.shape[0]
    w -= lr * (f.T @ g + 1e-3 * w)
    b -= lr * g.sum(axis=0)
  return lambda q: ((q - mu) / sd @ w + b).argmax(axis=1)


def _preprocessors(kind):
  if kind == 'numpy':
    rng = np.random.default_rng(0)
    return (lambda images: _numpy_distort(rng, images)), _numpy_eval
  pytest.importorskip('tensorflow')
  preprocess = pytest.importorskip('cifar10_towers.common.preprocess')
  return (lambda images: _tf_preprocess(preprocess.distort_image, images),
          lambda images: _tf_preprocess(preprocess.eval_image, images))


@pytest.fixture(scope='module')
def clear_set(tmp_path_factory):
  """As small_set, with every image clear."""
  data_dir = str(tmp_path_factory.mktemp('clear'))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(synth, '_FAINT_SHARE', 0.0)
    synth.generate(data_dir, train_per_file=200, num_test=500, seed=1)
  return data_dir


@pytest.mark.parametrize('kind', ['numpy', 'common.preprocess'])
def test_learnable_after_train_distortions(clear_set, kind):
  distort, evaluate = _preprocessors(kind)
  x_train, y_train, x_test, y_test = _read_dir(clear_set)
  # Two distorted copies of every training image.
  train = np.concatenate([distort(x_train), distort(x_train)])
  assert train.shape == (2000, 24, 24, 3)
  # 150 steps of gradient descent: these accuracies are the same as after 300.
  predict = _fit_softmax(_spectrum_features(train), np.tile(y_train, 2), steps=150)
  eval_correct = predict(_spectrum_features(evaluate(x_test))) == y_test
  distorted_correct = predict(_spectrum_features(distort(x_test))) == y_test
  # Measured 1.0 and 0.998 (both kinds; with the faint images too: ~0.77).
  assert eval_correct.mean() >= 0.9, eval_correct.mean()
  assert distorted_correct.mean() >= 0.9, distorted_correct.mean()
  # Every class on its own, so that no two classes merge (as stripes at +θ and
  # -θ would under the flip, each then right only half of the time).
  per_class = [distorted_correct[y_test == k].mean() for k in range(10)]
  assert min(per_class) >= 0.8, per_class  # measured 0.98 (noise), others 1.0


def test_mean_colour_alone_is_at_chance(small_set):
  x_train, y_train, x_test, y_test = _read_dir(small_set[0])
  def colour(x):
    return x.astype(np.float32).reshape(x.shape[0], -1, 3).mean(axis=1)
  predict = _fit_softmax(colour(x_train), y_train)
  accuracy = np.mean(predict(colour(x_test)) == y_test)
  assert accuracy < 0.2, accuracy  # measured 0.092


# --- The quick start's run ----------------------------------------------------
# What `data synth` writes by default shows learning without saturating (issue
# 22): with the quick start's flags (2 towers x 64) precision @ 1 is in
# 0.50-0.90 after 200 steps, at least 0.15 above step 20's, and a broken trainer
# (a tenth of the learning rate) stays below 0.50. Modern here; .ci/run checks
# legacy's 200 steps in the quick start itself.


@pytest.fixture(scope='module')
def quick_start_set(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp('quick_start'))
  synth.generate(data_dir)  # `data synth`'s defaults: 5 x 1000 + 1000 records, seed 0
  return data_dir


def _train(data_dir, train_dir, max_steps, *flags):
  """`modern`'s arguments with the quick start's flags up to max_steps (resuming train_dir)."""
  return ['modern', '--num_gpus', 2, '--batch_size', 64, '--max_steps', max_steps,
          '--data_dir', data_dir, '--train_dir', train_dir] + list(flags)


def _precision_of(data_dir, train_dir, max_steps):
  """eval's precision @ 1 of train_dir's newest checkpoint, which must be of max_steps."""
  code, out, err, exception = fs.invoke_cli(
      ['eval', '--run_once', '--data_dir', data_dir, '--checkpoint_dir', train_dir])
  assert (code, exception) == (0, None), err
  found = re.search(r'precision @ 1 = ([0-9.]+) \(global step (\d+),', out)
  assert found and int(found.group(2)) == max_steps, out
  return float(found.group(1))


def _precision_after(data_dir, train_dir, max_steps, *flags):
  """`modern` with the quick start's flags up to max_steps (resuming
  train_dir), then eval's precision @ 1 of its newest checkpoint."""
  code, out, err, exception = fs.invoke_cli(_train(data_dir, train_dir, max_steps, *flags))
  assert (code, exception) == (0, None), err
  return _precision_of(data_dir, train_dir, max_steps)


@pytest.fixture(scope='module')
def learning_runs(quick_start_set, tmp_path_factory):
  """The quick start's run in this process (precision @ 1 after 20 steps, then after
  200), while a forked `modern` process (tests/fork_server.py) trains at a tenth of
  the learning rate beside it: two runs share the 2 cores better than one after the
  other. Returns (at_20, at_200, the tenth's precision after 200 steps)."""
  base = tmp_path_factory.mktemp('learning')
  tenth_dir = str(base / 'tenth')
  tenth = fs.Running(_train(quick_start_set, tenth_dir, 200, '--learning_rate', 0.01),
                     forked=True)
  try:
    train_dir = str(base / 'train')
    at_20 = _precision_after(quick_start_set, train_dir, 20)
    at_200 = _precision_after(quick_start_set, train_dir, 200)  # resumes at 20
    code, _, err = tenth.finish(timeout=600)
    assert code == 0, err[-3000:]
  finally:
    if tenth.proc.poll() is None:
      tenth.kill()
  return at_20, at_200, _precision_of(quick_start_set, tenth_dir, 200)


@pytest.mark.slow
def test_the_quick_starts_run_shows_learning(learning_runs):
  # Measured with seed 0: 0.101 after 20 steps, 0.689 after 200 (seed 1:
  # 0.246 and 0.674; legacy after the quick start's 200 steps: 0.692).
  at_20, at_200, _ = learning_runs
  assert 0.5 <= at_200 <= 0.9, (at_20, at_200)
  assert at_20 <= at_200 - 0.15, (at_20, at_200)


@pytest.mark.slow
def test_a_tenth_of_the_learning_rate_stays_below_half(learning_runs):
  # Measured with seed 0: 0.198 after 200 steps (0.689 at the full rate).
  precision = learning_runs[2]
  assert precision < 0.5, precision
