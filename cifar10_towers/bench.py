"""How fast the trainers are, against the same net in Keras `model.fit` and the machine.

For every (implementation, towers) combination the benchmark measures

- training images/sec in steady state: the trainer's own `train()` (its real
  input pipeline, step and logging), its plain steps (no summary, no save)
  timed in windows of 2 x ((window_steps + 5) // 2) steps, each step through
  the loop's `on_step`;
- what one summary step and one checkpoint save cost beyond a plain step,
  timed in the same windows (`_window_figures`), and the training
  images/sec at the default cadence, a summary step every 100 steps and a
  save every 1000, which every ratio uses (Keras writes neither: its plain
  images/sec);
- the input pipeline alone: images/sec the trainer's pipeline delivers to its
  towers when nothing trains;
- the baseline: the same net (`common.model_spec` layers, initializers and
  weight decay, staircase-decayed SGD with a 0.9999 weight average) in Keras
  `model.fit` under `tf.distribute.MirroredStrategy` over the same logical
  devices, fed pre-batched in-memory data, timed over epochs of
  `window_steps` steps;
- the matmul estimate: the best fp32 FLOP/s of large matmuls divided by the
  FLOPs one training image costs (forward x 3 less conv1's input gradient).
  It is a sample taken on a shared machine under the same load as the
  training windows, not a bound: a training window can beat it (one did in
  docs/bench.json), so nothing calls it a ceiling;
- peak memory: the RSS high-water mark of each contender's process;
- images per CPU-second: images over the CPU time the process used in the
  window (a trainer's: in its plain steps), an efficiency that other load on
  the machine disturbs far less than wall time does.

How. Every contender (Keras, legacy and modern for each tower count, and the
matmul) runs in its own process (multiprocessing's spawn: a fresh interpreter
running `contend`, its stdout discarded and its stderr kept in a file for the
error message), started once and then paced over a pipe: at each window
boundary it sends the window's times and waits, blocked, until the parent
says "go". The parent runs one window of
each contender in turn (a round; the order rotates from round to round), so
the windows a ratio compares are seconds apart, not minutes: this machine is
shared and its speed drifts by 20-40% from minute to minute. Every ratio is
the median over rounds of that round's ratio. Separate processes because the
trainers cannot share one: the CPU is split into logical devices once per
process, legacy's queue threads and tf.data's and Keras' thread pools would
compete, and peak memory is per process. A waiting contender uses no CPU once
its input buffers are full (legacy's queues, tf.data's prefetch); the few
batches buffered during the wait save the next window at most their
preprocessing, about 1% of a window. The inputs alone are then measured one
process each, unpaced: the same entry point, which then sends only its
result.

No click here: `cli.py bench` is the command line; `run`, `format_table`,
`write_json`, `read_json` and `plot` are the API. `plot` draws a report (a
fresh one or a `--json` file read back) as a PNG with matplotlib, which is
an optional extra.
"""

import collections
import dataclasses
import datetime
import importlib
import json
import logging
import math
import multiprocessing
import os
import platform
import re
import statistics
import tempfile
import time
import timeit

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import devices
from cifar10_towers.common import errors
from cifar10_towers.common import files
from cifar10_towers.common import hparams
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.datasets import synth
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import stderr_filter

logger = logging.getLogger(__name__)

BASELINE = 'keras'  # the contender every ratio is taken against
MATMUL = 'matmul'  # the contender that measures the machine's FLOP/s
GO = 'go'  # the parent's message: run one more window
BASELINE_DISTINCT_BATCHES = 8  # in-memory global batches the baseline cycles over
INPUT_WARMUP_WINDOWS = 2  # input-alone windows discarded (the shuffle buffer fills first)
INPUT_WINDOWS = 5  # input-alone timed windows
# Every contender trains at a tenth of upstream's rate: the same ops at the same
# speed, but at upstream's 0.1 a batch of 4 diverged within 430 steps (modern on
# the digits set, the bench of docs/performance.md), which ended the measurement.
LEARNING_RATE = hparams.INITIAL_LEARNING_RATE / 10
MATPLOTLIB_HINT = ('matplotlib is not installed, and --plot needs it: pip install '
                   'matplotlib (or the [profile] extra: pip install -e .[profile])')


class BenchError(errors.Failure):
  """A measurement failed; the message names it and shows the worker's last error line."""


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What `run` measures and how long (the CLI checks the values)."""
  impls: tuple = ('legacy', 'modern')  # trainers to measure
  num_gpus: tuple = (1, 2)  # tower counts (logical CPU devices without GPUs)
  batch_size: int = 128  # images per tower per step
  data_dir: str | None = None  # CIFAR-10 data; None generates data in a temp dir
  rounds: int = 10  # timed rounds: one window of every contender each
  warmup_rounds: int = 2  # rounds run first and not counted
  window_steps: int = 10  # training steps per window
  matmul_size: int = 4096  # n of the n x n fp32 matmuls of the matmul estimate
  matmul_repeats: int = 2  # products per round; the estimate takes the best of all
  jit: bool = False  # XLA for both trainers (TrainConfig.jit); Keras keeps its default
  synth_per_file: int = 10000  # generated records per training file (CIFAR-10's size)
  timeout_secs: float = 900.0  # longest wait for one window (or a start) of a contender


def layer_flops_per_image():
  """FLOPs (2 per multiply-add) of each layer's forward product for one image.

  Convolutions and matmuls only (pooling, LRN and ReLU are a rounding error),
  in model_spec.LAYERS' order: conv1 at 24x24, conv2 at 12x12 (after the
  first stride-2 pool), then the three fully connected layers.
  """
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  size, flops = hparams.IMAGE_SIZE, []
  for layer in model_spec.LAYERS:
    conv = len(layer.weight_shape) == 4
    flops.append(2 * math.prod(layer.weight_shape) * (size * size if conv else 1))
    size //= hparams.POOL_STRIDE if conv else 1  # the SAME, stride-2 max pool of the block
  return flops


def training_flops_per_image():
  """FLOPs of one training image: about 105.3 MFLOP (the forward pass: 36.9).

  The forward product of every layer, then backward the same again for its
  weight gradient, and again for its input gradient except for the first
  layer: conv1's input is the images, which no variable depends on, so
  neither trainer (nor Keras) runs that product (a traced step of
  `cli.py profile` shows Conv2DBackpropInput for conv2 only). So 3 x forward
  less conv1's forward, not 3 x forward (which counted 5.5 MFLOP too many).
  """
  layers = layer_flops_per_image()
  return 3 * sum(layers) - layers[0]


# --- inside a contender process ------------------------------------------------


def _clocks(since=(0, 0)):
  """[wall, CPU] seconds of this process since `since`, an earlier `_clocks()`."""
  return [now - then for then, now in zip(since, (time.perf_counter(), time.process_time()))]


def _train_config(spec):
  """The trainer's settings: windows + 1 windows of 2 x half steps, a train_dir in the scratch.

  A save every half steps and a summary step every other save: each window
  holds a save, a summary step with a save, and window_steps plain steps
  (one more if odd; half: (window_steps + 5) // 2; `_window_figures`).
  """
  half = (spec['window_steps'] + 5) // 2
  return config_lib.TrainConfig(
      data_dir=spec['data_dir'], num_gpus=spec['num_gpus'], batch_size=spec['batch_size'],
      max_steps=(spec['windows'] + 1) * 2 * half + 2, save_every=half, summary_every=2 * half,
      jit=spec['jit'], optimizer=optimizer_lib.OptimizerSpec(learning_rate=LEARNING_RATE),
      # in the parent's scratch directory, which the parent removes
      train_dir=tempfile.mkdtemp(prefix='train_', dir=spec['scratch']))


def _window_figures(laps, half, window_steps):
  """A window's plain step time and its summary and save costs, from its laps.

  Args:
    laps: dict step % (2 x half) -> [wall, CPU seconds] from the `on_step`
      before to this step's: the step, and what the loop did after the step
      before. With a summary step and a save at step 0 (mod 2 x half) and a
      save at half, laps 0 and 1 hold a summary step and a save, laps half
      and half + 1 a save, whether the loop calls `on_step` before the
      summary's writing and the save (runtime.training.train_loop does) or
      after them; the others hold plain steps. The four are taken out of it.
    half: int, the steps between saves.
    window_steps: int.

  Returns:
    dict: seconds, cpu_seconds: of window_steps plain steps, at the mean
    plain lap; costs: summary_ms, save_ms, a summary step's and a save's
    cost beyond a plain step; cadence_seconds: of window_steps steps at the
    default cadence, a summary step every 100 and a save every 1000 steps
    (TrainConfig's defaults; there every tenth summary step is a save step,
    and their costs add up as here).
  """
  saves, both = (laps.pop(phase)[0] + laps.pop(phase + 1)[0] for phase in (half, 0))
  wall, cpu = map(statistics.fmean, zip(*laps.values()))
  save, summary = saves - 2 * wall, both - saves  # both: 2 x wall + summary + save
  return dict(seconds=wall * window_steps, cpu_seconds=cpu * window_steps,
              costs={'summary_ms': 1000 * summary, 'save_ms': 1000 * save},
              cadence_seconds=window_steps * (
                  wall + summary / config_lib.TrainConfig.summary_every +
                  save / config_lib.TrainConfig.save_every))


def contend_training(spec, boundary):
  """Runs one trainer's real `train()`, timing each step (`on_step`), a window every 2 x half.

  The first boundary (after graph building, queue filling or tracing, and one
  window of steps with its first summary and saves) is the ready one.
  """
  plan = devices.plan_devices(spec['num_gpus'])
  trainer = importlib.import_module(f"cifar10_towers.{spec['impl']}.train")
  config, laps, last = _train_config(spec), {}, _clocks()

  def on_step(step, *_):  # at step 2 (mod 2 x half): after the summary's and the saves' laps
    laps[step % config.summary_every] = _clocks(last)
    if step % config.summary_every == 2 < step:  # the first (step 2) is no boundary
      boundary(**_window_figures(laps, config.save_every, spec['window_steps']))
    last[:] = _clocks()  # (after the boundary's wait)

  trainer.train(config, plan, on_step=on_step)


def keras_model(keras):
  """The CIFAR-10 net of docs/equivalence.md §1 as a Keras model (the baseline's).

  The same layers, shapes, initializers (truncated normal weights, constant
  biases) and weight decay as `common.model_spec`: Keras' L2(l) adds
  l * sum(w**2), so wd * l2_loss(w) = wd * sum(w**2) / 2 is L2(wd / 2).
  """
  from cifar10_towers.common import lrn, model_spec  # pylint: disable=g-import-not-at-top
  layers = keras.layers

  def layer(name, activation='relu'):
    spec = model_spec.LAYERS_BY_NAME[name]
    *kernel, _, units = spec.weight_shape
    conv = dict(kernel_size=kernel, padding='same') if kernel else {}
    return (layers.Conv2D if conv else layers.Dense)(
        units, name=name, activation=activation, **conv,
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=spec.stddev),
        bias_initializer=keras.initializers.Constant(spec.bias_init),
        kernel_regularizer=keras.regularizers.L2(spec.wd / 2.0) if spec.wd else None)

  def pool(name):
    return layers.MaxPooling2D(hparams.POOL_KSIZE, hparams.POOL_STRIDE, padding='same',
                               name=name)

  size = hparams.IMAGE_SIZE
  return keras.Sequential([
      keras.Input((size, size, 3)), layer('conv1'), pool('pool1'),
      layers.Lambda(lrn.upstream_lrn, name='norm1'), layer('conv2'),
      layers.Lambda(lrn.upstream_lrn, name='norm2'), pool('pool2'), layers.Flatten(),
      layer('local3'), layer('local4'), layer('softmax_linear', activation=None)],
      name='cifar10')


def contend_baseline(spec, boundary):
  """Runs the same net in Keras `model.fit` under MirroredStrategy, a window per epoch.

  One `fit` call of windows + 1 epochs of `window_steps` steps; the first
  epoch's end (after tracing) is the ready boundary. The data: random
  batches, pre-batched in memory, so the baseline spends nothing on input.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  plan = devices.plan_devices(spec['num_gpus'])
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  size, rng = hparams.IMAGE_SIZE, np.random.default_rng(0)
  shape = (BASELINE_DISTINCT_BATCHES, spec['batch_size'] * spec['num_gpus'])
  dataset = tf.data.Dataset.from_tensor_slices((
      rng.standard_normal(shape + (size, size, 3), np.float32),
      rng.integers(0, hparams.NUM_CLASSES, shape, np.int32))).repeat().prefetch(2)
  with tf.distribute.MirroredStrategy(devices=list(plan.tower_devices)).scope():
    model = keras_model(keras)
    schedule = keras.optimizers.schedules.ExponentialDecay(
        LEARNING_RATE, staircase=True,
        decay_rate=hparams.LEARNING_RATE_DECAY_FACTOR, decay_steps=hparams.decay_steps(
            spec['records'], spec['batch_size'], spec['num_gpus']))
    model.compile(
        optimizer=keras.optimizers.SGD(
            schedule, use_ema=True, ema_momentum=hparams.MOVING_AVERAGE_DECAY),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(dataset, epochs=spec['windows'] + 1, steps_per_epoch=spec['window_steps'],
            verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                on_epoch_end=lambda epoch, logs: boundary())])


def contend_matmul(spec, boundary):
  """Measures fp32 matmul FLOP/s: each window, the best of `matmul_repeats` products."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = spec['matmul_size']
  a, b = tf.random.normal([2, n, n])  # two n x n matrices

  def product():  # eager CPU ops are synchronous; .numpy() makes sure
    tf.matmul(a, b)[0, 0].numpy()

  product()
  boundary()
  for _ in range(spec['windows']):
    seconds = timeit.repeat(product, number=1, repeat=spec['matmul_repeats'])
    boundary(flops_per_sec=2.0 * n ** 3 / min(seconds))


def _input_batches(spec):
  """The towers' batches of one trainer's input pipeline, endlessly.

  Legacy: a dequeue of its shared prefetch queue per tower (a MonitoredSession
  runs and at the end stops its queue threads); modern: one tf.data element
  (all towers' batches).
  """
  plan = devices.plan_devices(spec['num_gpus'])
  if spec['impl'] == 'modern':
    from cifar10_towers.modern import inputs  # pylint: disable=g-import-not-at-top
    yield from inputs.distorted_inputs(spec['data_dir'], spec['batch_size'],
                                       spec['num_gpus'])
    return
  import tensorflow.compat.v1 as tf  # pylint: disable=g-import-not-at-top
  from cifar10_towers.legacy import train  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    batches = train.tower_input_batches(_train_config(spec))
    with tf.train.MonitoredSession(tf.train.ChiefSessionCreator(
        config=train.session_config(plan))) as sess:
      while True:
        yield sess.run(batches)


def measure_input(spec, boundary):
  """Images/sec one trainer's input pipeline delivers to its towers, with no training.

  Unpaced. A "step" takes one batch for each tower, as a training step does;
  the first INPUT_WARMUP_WINDOWS windows are not counted.
  """
  del boundary
  batches = _input_batches(spec)
  next(batches)  # waits for the shuffle buffer (queue) to fill
  seconds = timeit.repeat(lambda: next(batches), number=spec['window_steps'],
                          repeat=INPUT_WARMUP_WINDOWS + INPUT_WINDOWS)
  images = spec['window_steps'] * spec['batch_size'] * spec['num_gpus']
  return {'window_images_per_sec': [images / s for s in seconds[INPUT_WARMUP_WINDOWS:]]}


CONTENDERS = {'train': contend_training, 'baseline': contend_baseline,
              MATMUL: contend_matmul, 'input': measure_input}


def contend(spec, conn, stderr_path):
  """A contender process' entry point: runs spec['kind'], then sends its result.

  Its stdout (the trainer's own output) is discarded, its stderr goes to
  stderr_path. The contender calls `boundary(**figures)` at each window
  boundary: it sends the window just run (its wall and CPU seconds, or those
  given in figures, and any other figures; at the first, ready boundary, the
  seconds since the start, which are not read) and waits, blocked, until the
  parent says go. The result holds what the contender returned and the RSS
  high-water mark of this process: /proc/self/status' VmHWM, which belongs to
  this program's own memory map (getrusage's ru_maxrss survives exec: it could
  be the parent's).
  """
  os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
  os.dup2(os.open(stderr_path, os.O_WRONLY), 2)
  stderr_filter.install()  # as cli.main: TensorFlow's known noise is no error line
  # Contenders share the GPUs: each takes the memory it uses, not all of it.
  os.environ.setdefault('TF_FORCE_GPU_ALLOW_GROWTH', 'true')
  start = _clocks()  # (wall, CPU) clock at the window's start

  def boundary(**figures):  # the contender's own seconds (a trainer's plain steps) first
    conn.send(dict(zip(('seconds', 'cpu_seconds'), _clocks(start)), **figures))
    conn.recv()  # GO; EOFError ends the contender if the parent went away
    start[:] = _clocks()

  result = CONTENDERS[spec['kind']](spec, boundary) or {}
  result['peak_rss_bytes'] = int(_proc_field('self/status', r'VmHWM:\s*(\d+)')) * 1024
  conn.send(result)


# --- orchestration (the parent process) --------------------------------------


class Contender:
  """A contender process (`contend` in a spawned interpreter), parent side."""

  def __init__(self, spec):
    self.spec = spec
    self._stderr = tempfile.NamedTemporaryFile(  # in the run's scratch, which goes with it
        mode='w+', prefix='stderr_', dir=spec['scratch'], delete=False)
    self._conn, child = multiprocessing.Pipe()
    self._proc = multiprocessing.get_context('spawn').Process(
        target=contend, args=(spec, child, self._stderr.name))
    self._proc.start()
    child.close()  # the contender's end: its exit is then our EOF

  def read(self):
    """The contender's next message (ready, a window, or its result).

    Raises:
      BenchError: it ended first, or timed out; the message holds its last
        error line.
    """
    try:
      if self._conn.poll(self.spec['timeout_secs']):
        return self._conn.recv()
      problem = f'timed out after {self.spec["timeout_secs"]:.0f} s'
    except EOFError:
      self._proc.join()
      last_line = (self._stderr.read().strip().splitlines() or ['no output'])[-1]
      problem = f'failed (exit {self._proc.exitcode}): {last_line}'
    self.kill()
    raise BenchError(f'{describe(self.spec)} {problem.rstrip(".")}. Run the measurement again; if '
                     'it keeps failing, train once with the same flags to see the error.')

  def window(self):
    """Runs one more window (after the last: the contender ends); returns `read()`."""
    self._conn.send(GO)
    return self.read()

  def kill(self):
    self._proc.kill()
    self._proc.join()


def describe(spec):
  """What a contender measures, in words (the progress line)."""
  kind = spec['kind']
  if kind == MATMUL:
    return (f'matmul rate: {spec["matmul_repeats"]} fp32 '
            f'{spec["matmul_size"]}x{spec["matmul_size"]} matmul(s)')
  what = {'train': 'training', 'input': 'input pipeline alone',
          'baseline': 'Keras model.fit, MirroredStrategy, in-memory data'}.get(kind, kind)
  xla = ' (XLA)' if spec.get('jit') and kind != 'baseline' else ''
  return f'{spec["impl"]}, {spec["num_gpus"]} tower(s) x batch {spec["batch_size"]}: {what}{xla}'


def _key(spec):
  return spec['impl'], spec['num_gpus']


def run(config, launch=Contender):
  """Runs every measurement of `config`, saying each step (info); returns `summarize`'s report.

  Args:
    config: BenchConfig.
    launch: callable(spec) -> a started Contender (tests may substitute
      it).

  Raises:
    BenchError: a measurement failed.
    common.cifar10_format.DataError: data_dir holds no valid training data.
  """
  # One scratch directory for the run: the generated data, the contenders'
  # train_dirs and stderr files; removed at the end, or by the next bench if
  # this one was killed (common.files.scratch).
  with files.scratch(tempfile.gettempdir(), 'bench_') as scratch:
    data_dir = config.data_dir or scratch
    if config.data_dir is None:
      logger.info(f'Generating {5 * config.synth_per_file} training records in {scratch} ...')
      synth.generate(scratch, train_per_file=config.synth_per_file, num_test=10)
    records = fmt.num_examples(fmt.train_files(data_dir))
    common = dict(dataclasses.asdict(config), data_dir=data_dir, records=records,
                  windows=config.warmup_rounds + config.rounds, scratch=scratch)
    # The paced contenders: per tower count Keras and each trainer; then the matmul.
    specs = [dict(common, kind='baseline' if impl == BASELINE else 'train', impl=impl, num_gpus=n)
             for n in config.num_gpus for impl in (BASELINE, *config.impls)
             ] + [dict(common, kind=MATMUL, impl=MATMUL, num_gpus=None)]
    logger.info(f'Starting {len(specs)} contenders, one process each: '
                f'{"; ".join(map(describe, specs))}')
    contenders, windows, inputs = [], collections.defaultdict(list), {}
    try:
      contenders.extend(map(launch, specs))
      for i, contender in enumerate(contenders):
        contender.read()  # its TensorFlow import, graph or trace: seconds each
        logger.info(f'Ready: {describe(contender.spec)} ({i + 1} of {len(specs)})')
      for r in range(-config.warmup_rounds, config.rounds):  # r < 0: warm-up
        label = (f'warm-up {config.warmup_rounds + r + 1}/{config.warmup_rounds}' if r < 0
                 else f'round {r + 1}/{config.rounds}')
        for contender in contenders:
          spec = contender.spec
          steps = '' if spec['kind'] == MATMUL else f', {config.window_steps} steps'
          logger.info(f'[{label}] measuring {describe(spec)}{steps}')
          windows[_key(spec)].append(contender.window())
        contenders.append(contenders.pop(0))  # the next round starts one contender later
      finals = {_key(c.spec): c.window() for c in contenders}
      # Then each input pipeline alone, one process each.
      for spec in [dict(s, kind='input') for s in specs if s['kind'] == 'train']:
        logger.info(f'[inputs] measuring {describe(spec)}')
        contenders.append(launch(spec))
        inputs[_key(spec)] = contenders[-1].read()
    finally:
      for contender in contenders:
        contender.kill()
  return summarize(config, windows, finals, inputs,
                   f'{config.data_dir or "generated (datasets.synth)"}, {records} records')


def _proc_field(name, pattern):
  """The first group of `pattern`'s first match (re.M) in /proc/`name`.

  Raises:
    OSError: no such file (not Linux); TypeError: no match.
  """
  with open(f'/proc/{name}', encoding='ascii', errors='replace') as f:
    return re.search(pattern, f.read(), re.M)[1]


def cpu_model():
  """The CPU's model name (Linux: /proc/cpuinfo), for the report."""
  try:
    return _proc_field('cpuinfo', r'^model name\s*:\s*(.*)$')
  except (OSError, TypeError):
    return platform.processor()


def summarize(config, windows, finals, inputs, data_description):
  """The report: rates, ratios and memory of every contender.

  Args:
    config: BenchConfig.
    windows: dict (impl, num_gpus) -> list of window dicts (seconds,
      cpu_seconds), in the order they ran: `config.warmup_rounds` warm-up
      windows first; the matmul's key is (MATMUL, None) and its windows hold
      flops_per_sec.
    finals: dict (impl, num_gpus) -> the contender's result (peak_rss_bytes).
    inputs: dict (impl, num_gpus) -> the input contender's result.
    data_description: str, where the training data came from.

  Returns:
    dict, JSON-serializable: settings, machine and one row per contender.
  """
  matmul_runs = [w['flops_per_sec'] for w in windows[MATMUL, None]]
  flops = training_flops_per_image()
  estimate = max(matmul_runs) / flops
  towers_key = f'ratio_to_{min(config.num_gpus)}_tower'

  def figures(impl, num_gpus):
    """Each timed window's images/sec, in round order: of its plain steps, at the default
    cadence (Keras has no cadence_seconds: it writes no summaries nor checkpoints, and it is
    its seconds) and per CPU second; and (a trainer's) its summary and save costs."""
    images = config.window_steps * config.batch_size * num_gpus
    return [{'images_per_sec': images / w['seconds'],
             'cadence_images_per_sec': images / w.get('cadence_seconds', w['seconds']),
             'images_per_cpu_second': images / w['cpu_seconds'], **w.get('costs', {})}
            for w in windows[impl, num_gpus][config.warmup_rounds:]]

  rows = []
  for num_gpus in config.num_gpus:
    for impl in (BASELINE, *config.impls):
      # Each round: its figures, and its ratios to that round's Keras and fewest towers.
      rounds = [dict(own, round=r, baseline_images_per_sec=base['images_per_sec'],
                     ratio_to_baseline=own['cadence_images_per_sec'] / base['images_per_sec'],
                     **{towers_key: own['cadence_images_per_sec'] / few['cadence_images_per_sec']})
                for r, (own, base, few) in enumerate(zip(
                    figures(impl, num_gpus), figures(BASELINE, num_gpus),
                    figures(impl, min(config.num_gpus))))]
      row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != 'round'}
      measured = [r['images_per_sec'] for r in rounds]
      result = inputs.get((impl, num_gpus))  # None: Keras has no input pipeline
      input_rate = result and statistics.median(result['window_images_per_sec'])
      rows.append(dict(
          row, impl=impl, num_gpus=num_gpus, batch_size=config.batch_size, rounds=rounds,
          jit=config.jit and impl != BASELINE, window_min=min(measured), window_max=max(measured),
          ratio_to_matmul_estimate=row['cadence_images_per_sec'] / estimate,
          peak_rss_bytes=finals[impl, num_gpus]['peak_rss_bytes'],
          input_images_per_sec=input_rate,
          input_window_images_per_sec=result and result['window_images_per_sec'],
          input_to_training=input_rate and input_rate / row['images_per_sec'],
          input_peak_rss_bytes=result and result['peak_rss_bytes']))
  return {
      'settings': dict(dataclasses.asdict(config), data=data_description),
      'measured_at': f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}',
      'machine': {
          'cpu_count': os.cpu_count(), 'cpu_model': cpu_model(),
          'matmul_size': config.matmul_size, 'matmul_flops_per_sec': max(matmul_runs),
          'matmul_runs_flops_per_sec': matmul_runs, 'training_flops_per_image': flops,
          'matmul_estimate_images_per_sec': estimate,
      },
      'rows': rows,
  }


def format_table(report):
  """The report as a text table with a header of how it was measured."""
  settings, machine = report['settings'], report['machine']
  fewest = min(settings['num_gpus'])
  fewest_key = f'ratio_to_{fewest}_tower'
  table = [(f'impl|towers|batch|img/s|windows min-max|summary ms|save ms|cadence img/s|'
            f'img/cpu-s|vs keras|vs matmul|vs {fewest} tower|input img/s|input/train|'
            'peak RSS MiB').split('|')]

  def cell(value, template='{:.0f}'):  # '-': Keras writes no summaries and reads no input
    return '-' if value is None else template.format(value)

  for row in report['rows']:
    table.append((
        f'{row["impl"]}{" (XLA)" * row["jit"]}|{row["num_gpus"]}|{row["batch_size"]}|'
        f'{row["images_per_sec"]:.0f}|{row["window_min"]:.0f}-{row["window_max"]:.0f}|'
        f'{cell(row.get("summary_ms"))}|{cell(row.get("save_ms"))}|'
        f'{cell(row.get("cadence_images_per_sec"))}|'
        f'{row["images_per_cpu_second"]:.0f}|{row["ratio_to_baseline"]:.2f}x|'
        f'{row["ratio_to_matmul_estimate"]:.2f}|{row[fewest_key]:.2f}x|'
        f'{cell(row["input_images_per_sec"])}|{cell(row["input_to_training"], "{:.1f}x")}|'
        f'{row["peak_rss_bytes"] / 2 ** 20:.0f}').split('|'))
  widths = [max(map(len, column)) for column in zip(*table)]
  size = machine['matmul_size']
  return '\n'.join([
      f'matmul estimate: best of {len(machine["matmul_runs_flops_per_sec"])} rounds of fp32 '
      f'{size}x{size} matmuls = {machine["matmul_flops_per_sec"] / 1e9:.1f} GFLOP/s / '
      f'{machine["training_flops_per_image"] / 1e6:.1f} MFLOP per training image (forward x 3 '
      f"less conv1's input gradient) = {machine['matmul_estimate_images_per_sec']:.0f} "
      'images/sec (a sample under the same load, not a bound)',
      f'training: median of {settings["rounds"]} rounds, one window of '
      f'{settings["window_steps"]} steps per contender each (the order rotating; '
      f'{settings["warmup_rounds"]} warm-up rounds first); ratios: median of the per-round '
      f'ratios; data: {settings["data"]}',
      'img/s: of plain steps; summary ms, save ms: the cost of a summary step and of a checkpoint '
      'save beyond a plain step; cadence img/s, which the ratios use: with a summary step every '
      '100 and a save every 1000 steps (the defaults) at those costs'
      if 'cadence_images_per_sec' in report['rows'][0] else
      'summary ms, save ms, cadence img/s: not measured (the report predates them): img/s and '
      'ratios are of whole windows, about one in ten holding a summary step', ''] + [
          '  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(r, widths))) for r in table])


def write_json(report, path):
  """Writes the report as JSON (`bench --json`), whole or not at all (common.files.WriteError)."""
  with files.replacing('--json', path) as [temp], open(temp, 'w', encoding='utf-8') as f:
    print(json.dumps(report, indent=2, sort_keys=True), file=f)


def read_json(path):
  """Reads back a report written by `write_json`, in today's names.

  Reports written before the matmul estimate was named for what it is call
  it 'ceiling_images_per_sec' (and each row's ratio 'ratio_to_ceiling'),
  computed from forward x 3 FLOPs per image: they get today's keys, values
  and FLOP count; what was measured (the matmul rates, every window) stays.
  Reports written before `--plot` say that they lack the CPU model and date.

  Raises:
    BenchError: the file cannot be read or holds no bench report (a figure
      that the table or the plot shows is missing).
  """
  try:
    with open(path, encoding='utf-8') as f:
      report = json.load(f)
  except (OSError, ValueError) as e:
    raise BenchError(f'cannot read {path}: {e}') from e
  try:
    machine = report['machine']
    if machine.pop('ceiling_images_per_sec', None) is not None:
      machine['training_flops_per_image'] = flops = training_flops_per_image()
      estimate = machine['matmul_estimate_images_per_sec'] = machine['matmul_flops_per_sec'] / flops
      for row in report['rows']:
        row.pop('ratio_to_ceiling', None)
        row['ratio_to_matmul_estimate'] = row['images_per_sec'] / estimate  # no costs then
    machine.setdefault('cpu_model', 'CPU model not recorded')  # in reports before --plot
    report.setdefault('measured_at', 'date not recorded')
    format_table(report)  # reads every other figure that the table and the plot show
    return report
  except (KeyError, TypeError, AttributeError, ValueError) as e:
    raise BenchError(f'{path} is not a bench results file (one written by bench --json)') from e


COLOURS = {BASELINE: 'grey', 'legacy': 'C0', 'modern': 'C1'}  # matplotlib's first two


def check_plotting():
  """matplotlib's Figure class; BenchError(MATPLOTLIB_HINT) if matplotlib is missing."""
  try:
    from matplotlib import figure  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise BenchError(MATPLOTLIB_HINT) from e
  return figure.Figure


def plot(report, path):
  """Draws `figure(report)` into a PNG file, whole or not at all (common.files.WriteError)."""
  with files.replacing('--plot', path) as [temp]:
    # The format by the path's extension, as savefig would choose it; PNG without one.
    figure(report).savefig(temp, dpi=100, format=os.path.splitext(path)[1][1:] or 'png')


def figure(report):
  """The report's training images/sec as a matplotlib bar chart.

  One bar per contender and tower count: the median img/s, the windows'
  min-max as error bars, and above it the trainer's ratio to Keras (the
  median of the per-round ratios); the matmul estimate a dotted line,
  labelled with how it was computed and not as a bound (a training window
  can beat it). The caption names the contenders, the settings, the data,
  the machine and when it was measured, and the report's 'note' if it has one.

  Returns:
    matplotlib.figure.Figure (no pyplot: nothing global is touched).

  Raises:
    BenchError: matplotlib is missing (MATPLOTLIB_HINT).
  """
  settings, machine = report['settings'], report['machine']
  fig = check_plotting()(figsize=(8, 5.2))
  axes = fig.add_subplot()
  for row in report['rows']:
    rate = row['images_per_sec']
    bar = axes.bar(f'{row["impl"]}{" (XLA)" * row["jit"]}\n{row["num_gpus"]} tower(s)',
                   rate, yerr=[[rate - row['window_min']], [row['window_max'] - rate]],
                   capsize=4, color=COLOURS[row['impl']])
    axes.bar_label(bar, [f'{rate:.0f}\n{row["ratio_to_baseline"]:.2f}x Keras'], padding=3,
                   fontsize=8)
  axes.axhline(machine['matmul_estimate_images_per_sec'], color='black', linestyle=':',
               label=f'matmul estimate {machine["matmul_estimate_images_per_sec"]:.0f} = best '
               f'fp32 {machine["matmul_size"]}x{machine["matmul_size"]} matmul rate, '
               f'{machine["matmul_flops_per_sec"] / 1e9:.1f} GFLOP/s, / '
               f'{machine["training_flops_per_image"] / 1e6:.1f} MFLOP per training image')
  axes.margins(y=0.3)  # room for the legend and the labels
  axes.set_ylabel('training images/sec')
  axes.set_title(f'Training images/sec, batch {settings["batch_size"]} per tower: bars median, '
                 'error bars windows min-max', fontsize=10)
  axes.legend(loc='upper left', fontsize=8, frameon=False)
  caption = '\n'.join(filter(None, [
      'keras: Keras model.fit of the same net (MirroredStrategy, in-memory data); the '
      'trainers: their own train() loop and input pipeline',
      f'{settings["rounds"]} rounds of one {settings["window_steps"]}-step window per contender '
      f'(after {settings["warmup_rounds"]} warm-up); ratios: median of per-round ratios to '
      f'Keras; data: {settings["data"]}',
      f'machine: {machine["cpu_count"]} CPUs, {machine["cpu_model"]}, {report["measured_at"]}',
      report.get('note')]))
  fig.text(0.01, 0.01, caption, fontsize=7, va='bottom', wrap=True)
  fig.tight_layout(rect=(0, 0.15, 1, 1))
  return fig
