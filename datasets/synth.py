"""A generated stand-in for CIFAR-10, written in the CIFAR binary format.

Learnable, but not all at once. Each class is a spatial pattern, not a
colour: every image gets random foreground and background colours, a random
phase or position, and Gaussian pixel noise (stddev 20), so only the pattern
tells the classes apart. Images are of two kinds, drawn at random:

- clear (65%): the two colours are 100-160 apart, 5-8 times the noise;
  the quick start's 200 steps (2 towers x 64) learn them: 99% right.
- faint (35%): the colours are at most 20 apart, the pattern drowned in the
  noise; after those 200 steps the network guesses them: 10% right.

So the quick start's precision @ 1 is neither chance nor ~1.0: 0.67-0.69
after 200 steps (both trainers, seeds 0 and 1), 0.10-0.25 after 20, 0.20 after
200 steps at a tenth of the learning rate (tests/test_synth.py checks these
bands). It says nothing about CIFAR-10, on which the original trainer reaches
~86% after 100K steps. Version 1 of this generator (every image clear, pixel
noise 10) gave ~1.0 after 200 steps.

The patterns are chosen to survive the training distortions of
docs/equivalence.md §1:

- random 24x24 crop of the 32x32 image: every periodic pattern has a period
  of at most 8 pixels, so a crop holds at least 3 periods; a crop only shifts
  the phase, which is random anyway. Rings and the disk are centred in the
  middle 16x16, so every crop shows part of them.
- random left-right flip: every pattern is mapped onto its own class.
  Horizontal and vertical stripes, checkerboards, rings, disks and noise are
  mirror-symmetric up to a shift; the crosshatch has both diagonals, which the
  flip swaps. No class is a mirror image of another (no +θ/-θ stripe pair).
- random brightness (±63) and contrast (0.2-1.8), then per-image
  standardization: brightness adds a constant and contrast scales deviations
  from the mean, which standardization undoes; colours and contrast carry no
  label, so nothing the label depends on is lost.

Classes (index: pattern):
  0: horizontal stripes, period 4     1: horizontal stripes, period 8
  2: vertical stripes, period 4       3: vertical stripes, period 8
  4: checkerboard, period 4           5: checkerboard, period 8
  6: crosshatch of both diagonals, period 6 along each axis
  7: concentric rings, period 6, around a random centre
  8: a filled disk of random radius at a random place
  9: fine random noise (independent per pixel)

The periods keep the classes apart in frequency too: a checkerboard of period
P is the sum of two diagonal waves of period P, so the crosshatch uses period
6, between the two checkerboards.

Deterministic for a seed: everything comes from one `numpy.random.Generator`.
"""

import copy

import numpy as np

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import hparams
from cifar10_towers.datasets import generated

CLASS_NAMES = tuple('hstripes4 hstripes8 vstripes4 vstripes8 checker4 checker8 crosshatch rings '
                    'disk noise'.split())

_SIZE = fmt.HEIGHT  # 32; the images are square
VERSION = 2  # in GENERATED.json; 1 drew every image clear, noise stddev 10
_PIXEL_NOISE = 20.0  # stddev of the Gaussian noise added to every pattern image
_FAINT_SHARE = 0.35  # share of the images whose colours are close
_CLEAR_DISTANCE = (100.0, 160.0)  # range of the colour distance of a clear image
_FAINT_DISTANCE = (0.0, 20.0)  # and of a faint one


CHUNK = 1000  # images made at once: bounds the float32 working memory (~50 MB)


def _patterns(labels, draws, noise):
  """Pattern intensities in [0, 1] for each label.

  Args:
    labels: int array [N] in 0..9.
    draws: the small per-image draws of these N images, each with N first:
      phase_y, phase_x, centre, radius, ring_phase.
    noise: float32 [N, 32, 32] in [0, 1), the pattern of the noise class.

  Returns:
    float32 [N, 32, 32]: 1 where the foreground colour goes, 0 for background.
  """
  phase_y, phase_x, centre, radius, ring_phase = draws
  yy, xx = np.mgrid[0:_SIZE, 0:_SIZE].astype(np.float32)[:, None]  # each [1, 32, 32]

  def square_wave(v, period):
    return np.floor(v / (period / 2)) % 2

  out = np.empty((labels.shape[0], _SIZE, _SIZE), np.float32)
  for label in range(hparams.NUM_CLASSES):
    i = np.flatnonzero(labels == label)
    y = yy + phase_y[i]  # [k, 32, 32]
    x = xx + phase_x[i]
    r = np.sqrt((yy - centre[i, 0, None, None]) ** 2 +
                (xx - centre[i, 1, None, None]) ** 2)
    period = 8 if label % 2 else 4  # of the stripes and checkerboards, 0-5
    if label < 2:  # horizontal stripes
      p = square_wave(y, period)
    elif label < 4:  # vertical stripes
      p = square_wave(x, period)
    elif label < 6:  # checkerboards
      p = (square_wave(y, period) + square_wave(x, period)) % 2
    elif label == 6:  # lines along both diagonals, 2 pixels wide, every 6
      p = ((x + y) % 6 < 2) | ((x - y) % 6 < 2)
    elif label == 7:  # concentric rings, period 6
      p = square_wave(r + ring_phase[i], 6)
    elif label == 8:  # filled disk
      p = r <= radius[i]
    else:  # fine noise
      p = noise[i]
    out[i] = p
  return out


def make_images(rng, labels):
  """Generated images of the given labels.

  Args:
    rng: numpy Generator.
    labels: int array [N] in 0..9.

  Returns:
    uint8 [N, 32, 32, 3] (height, width, channel).
  """
  return next(_image_pieces(rng, labels, len(labels)))[0]


def _image_pieces(rng, labels, size):
  """`make_images(rng, labels)` in consecutive pieces, with bounded memory.

  The random numbers are drawn as one call over all N images would draw them,
  in the same order: the small per-image draws whole; the two big per-pixel
  draws (the noise class's pattern, [N, 32, 32], and the pixel noise,
  [N, 32, 32, 3]) `CHUNK` images at a time - the first from a copy of the
  generator, skipped in the original - so the same seed gives the same bytes
  whatever the pieces, and the float32 working memory is that of `CHUNK`
  images, not of N (2 GB for CIFAR-10's 60000).

  Args:
    rng: numpy Generator.
    labels: int array [N] in 0..9.
    size: int dividing N, the images of each piece.

  Yields:
    (uint8 [size, 32, 32, 3] (height, width, channel), their labels [size]) for
    each piece in turn.
  """
  n = len(labels)
  # The small per-image draws: phases, centres, radii, drawn for every image
  # so the random stream does not depend on the order of the classes.
  draws = (rng.integers(0, 8, n)[:, None, None],  # phase_y
           rng.integers(0, 8, n)[:, None, None],  # phase_x
           rng.uniform(8.0, 24.0, (n, 2)).astype(np.float32),  # centre
           rng.uniform(4.0, 9.0, n).astype(np.float32)[:, None, None],  # radius
           rng.uniform(0.0, 6.0, n).astype(np.float32)[:, None, None])  # ring_phase
  # The noise class's pattern comes next in the stream; a big per-pixel
  # draw: taken chunk by chunk from a copy, and skipped here the same way.
  noise_rng = copy.deepcopy(rng)
  for start in range(0, n, CHUNK):
    rng.random((min(CHUNK, n - start), _SIZE, _SIZE), dtype=np.float32)
  # Foreground and background colours: a random mid colour plus/minus half a
  # random colour difference, of a clear or a faint image's length.
  base = rng.uniform(60.0, 195.0, (n, 3))
  direction = rng.normal(size=(n, 3))
  direction /= np.linalg.norm(direction, axis=1, keepdims=True) + 1e-12
  faint = rng.random((n, 1)) < _FAINT_SHARE
  delta = direction * np.where(faint, rng.uniform(*_FAINT_DISTANCE, (n, 1)),
                               rng.uniform(*_CLEAR_DISTANCE, (n, 1)))
  background = (base - delta / 2).astype(np.float32)[:, None, None, :]
  difference = delta.astype(np.float32)[:, None, None, :]

  def chunk(part):
    """The images of the slice `part`; the pixel noise, last in the stream, drawn here."""
    noise = noise_rng.random((part.stop - part.start, _SIZE, _SIZE), dtype=np.float32)
    pattern = _patterns(labels[part], [d[part] for d in draws], noise)[..., None]
    images = background[part] + pattern * difference[part]  # [k, 32, 32, 3]
    images += _PIXEL_NOISE * rng.standard_normal(images.shape, dtype=np.float32)
    return np.clip(np.rint(images), 0, 255).astype(np.uint8)

  for start in range(0, n, size):
    yield (np.concatenate([chunk(slice(i, min(i + CHUNK, start + size)))
                           for i in range(start, start + size, CHUNK)]),
           labels[start:start + size])


def generate(data_dir, train_per_file=1000, num_test=1000, seed=0, mark=True,
             progress=None):
  """Writes a generated data set in the CIFAR-10 binary layout.

  Creates `<data_dir>/cifar-10-batches-bin/` with `data_batch_1.bin` ..
  `data_batch_5.bin` (`train_per_file` records each), `test_batch.bin`
  (`num_test` records), `batches.meta.txt` (the class names, one a line) and
  the marker `GENERATED.json` (`datasets.generated`).
  The files are written aside and replace an existing directory's files all
  at once (`generated.write_set`): an interrupted or failed run changes
  nothing. The files are made and written one at a time, so the
  memory used is about one file's worth, whatever the size.

  Args:
    data_dir: str, the data directory (created if missing).
    train_per_file: int >= 1, records in each training file.
    num_test: int >= 1, records in the test file.
    seed: int, the same seed gives byte-identical files.
    mark: bool, write GENERATED.json; False only for data that stands in
      for CIFAR-10 (the tests' fixtures), which no command will label.
    progress: optional callable(name, number, count), called as each .bin
      file is begun: its name, its number (1 to count) and the number of
      files (6).

  Returns:
    dict file name -> number of records written.

  Raises:
    common.cifar10_format.DataError: the disk is full or read-only, or
      cifar-10-batches-bin is a file; nothing was changed.
  """
  # Independent streams for train and test, so num_test does not change the
  # training images.
  train_rng, test_rng = [np.random.default_rng(s)
                         for s in np.random.SeedSequence(seed).spawn(2)]

  def files():
    # Each stream is drawn as if all its images were made at once (the labels
    # first, then `_image_pieces`), so the bytes do not depend on the files.
    for rng, stream_names, per_file in ((train_rng, fmt.TRAIN_FILES, train_per_file),
                                        (test_rng, fmt.EVAL_FILES, num_test)):
      # Each class n/10 times (up to one), in random order.
      labels = rng.permutation(np.arange(per_file * len(stream_names)) % hparams.NUM_CLASSES)
      pieces = _image_pieces(rng, labels, per_file)
      for name in stream_names:
        if progress:
          progress(name, fmt.DATA_FILES.index(name) + 1, len(fmt.DATA_FILES))
        yield (name, *next(pieces))

  num_records = train_per_file * len(fmt.TRAIN_FILES) + num_test
  return generated.write_set(
      data_dir, files(), num_records * fmt.RECORD_BYTES, CLASS_NAMES, mark, 'synth', VERSION,
      train_per_file=train_per_file, num_test=num_test, seed=seed)
