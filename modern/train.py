"""The modern trainer's one training loop, on any engine (modern.engines).

Upstream `cifar10_multi_gpu_train.py`'s `train()` (docs/equivalence.md §1) in
TF2: restore the newest checkpoint, run steps until max_steps, log every
log_every steps, write summaries and checkpoints. The step is in
modern/step.py (towers) and modern/engines.py (tf.distribute replicas); the
engine also keeps several worker processes together where there are any.
"""

import contextlib
import logging
import time

import numpy as np
import tensorflow as tf

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec
from cifar10_towers.modern import checkpoints as ckpt_lib
from cifar10_towers.modern import engines
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import ending
from cifar10_towers.runtime import lock
from cifar10_towers.runtime import training

logger = logging.getLogger(__name__)


def _displayable(image):
  """A float image scaled into [0, 1] as TF1's image summary scales it.

  Non-negative images: the largest value becomes 1. Otherwise 0 goes to
  127/255 and the image is scaled so that its smallest value is 0 or its
  largest 1 (tf.summary.image clips what lies outside [0, 1]).
  """
  image = np.asarray(image, np.float32)
  low, high = float(image.min()), float(image.max())
  if low >= 0:
    return image / high if high > 0 else image
  scale = 127.0 / -low
  if high > 0:
    scale = min(scale, 128.0 / high)
  return (image * scale + 127.0) / 255.0


# Deviation from upstream: both trainers write the tags of runtime.training.summary_tags.
def _write_summaries(state, step, tower_losses, lr, summaries):
  """The tags of runtime.training.summary_tags with tf.summary, at `step`.

  Args:
    state: modern.step.TrainState after the step.
    step: int, the global step reached.
    tower_losses: numpy [replicas], the towers' total losses.
    lr: float, the learning rate the step used.
    summaries: what the engine's step returned from inside the step
      (see modern.engines.Towers.step); empty for the replica engines.
  """
  # Deviation from upstream: every tower's loss summary is written.
  scalars = {training.MEAN_LOSS_TAG: tower_losses.mean(), training.LEARNING_RATE_TAG: lr}
  scalars.update((training.tower_tag(i, 'total_loss'), v) for i, v in enumerate(tower_losses))
  scalars.update(summaries.get('scalars', {}))
  histograms = {**summaries.get('histograms', {}), **state.variables()}
  histograms.update((training.average_tag(name), var)
                    for name, var in state.shadow_variables().items())
  for tag, value in scalars.items():
    tf.summary.scalar(tag, value, step=step)
  for tag, value in histograms.items():
    tf.summary.histogram(tag, tf.convert_to_tensor(value), step=step)
  images = summaries.get('images')
  if images is not None:
    for tag, image in zip(training.image_tags(), images):
      tf.summary.image(tag, _displayable(image)[np.newaxis], step=step)


def _first_step_progress(first, what):
  """During the chief's first step, a heartbeat line saying `what` it waits for past 5 s."""
  if not first:  # `first` only on the chief: progress comes from the chief
    return contextlib.nullcontext()
  return training.Heartbeat(lambda seconds: '%s... %d s' % (what, seconds))


@contextlib.contextmanager
def _summaries_may_fail(what):
  """A failed write of `what` in the block (e.g. disk full) is a warning: checkpoints decide."""
  try:
    yield
  except (tf.errors.OpError, OSError) as e:
    logger.warning('could not write %s (%s).', what, str(e).strip().splitlines()[0])


def train(config, plan, on_step=None):
  """Trains until global_step == config.max_steps, resuming from train_dir.

  With config.strategy's engine (modern.engines). With several workers
  (multiworker), the chief restores and every other worker takes its state;
  only the chief prints progress and keeps checkpoints and summaries; a stop
  request on any worker stops all after the same step; a wait for the peers
  that lasts past --peer_timeout ends the run (see modern.engines).

  Args:
    config: runtime.config.TrainConfig.
    plan: common.devices.DevicePlan with config.num_gpus tower devices.
    on_step: optional callable(step, seconds, images) after every step: the
      global step reached, the step's wall seconds, and the images it
      trained on over all replicas (bench paces itself with it).

  Returns:
    int, the global step reached (max_steps, or less if stopped by a signal).

  Raises:
    common.cifar10_format.DataError: training data missing or malformed.
    runtime.training.TrainingError: the loss diverged, train_dir holds a
      checkpoint this trainer cannot resume, the peers were lost or another
      worker was stopped (modern.cluster.StartupError: they never started).
    runtime.checkpoints.CheckpointError: the latest checkpoint is damaged or
      of another model, or a write into train_dir failed (e.g. disk full).
    runtime.lock.LockError: another run trains in train_dir.
    runtime.training.Stopped: a stop signal came before the first step
      was done; nothing was written.
    modern.cluster.ClusterError: the multiworker cluster is missing or malformed.
  """
  engine = engines.make(config, plan)
  with training.StopRequest() as stop:
    # Until the first step nothing is written: a stop ends the run at once.
    with stop.raising():
      # Deviation from upstream: the epoch size is what is on disk, not 50000.
      examples_per_epoch = fmt.num_examples(fmt.train_files(config.data_dir))
      # All replicas of all workers count, as upstream's num_gpus counted its towers.
      decay_steps = training.checked_decay_steps(
          examples_per_epoch, config.batch_size, config.num_gpus * engine.num_workers)
    try:
      # Deviation from upstream: train_dir is never deleted; training resumes.
      # One run at a time: a second one would write the same steps and
      # overwrite the first's checkpoints. The lock creates the dir if missing.
      with lock.exclusive(engine.write_dir, what=engine.lock_what):
        engine.prepare()
        with stop.raising():
          if config.seed is not None:
            tf.random.set_seed(config.seed)
          engine.start(decay_steps)
          if config.log_device_placement:
            tf.debugging.set_log_device_placement(True)
          state = engine.trainer.state
          checkpoint = ckpt_lib.checkpoint_object(state)
          # Only the chief restores; the others take its state (engine.broadcast).
          resume_from = (ckpt_lib.restore_latest(config.train_dir, checkpoint,
                                                 config.optimizer)
                         if engine.is_chief else None)
          manager = tf.train.CheckpointManager(  # after restore_latest: see there
              checkpoint, engine.write_dir, max_to_keep=ckpt_lib.MAX_TO_KEEP,
              checkpoint_name=config_lib.CHECKPOINT_BASENAME)
        save = ckpt_lib.StepSaver(state, manager, engine.write_dir)
        with engine.watching(stop, save):
          return _train_loop(config, engine, save, resume_from, decay_steps, stop, on_step,
                             examples_per_epoch // engine.num_workers)
    finally:
      engine.close()


def _train_loop(config, engine, save, resume_from, decay_steps, stop, on_step,
                examples_per_worker=0):
  """The steps, with log lines, summaries and checkpoints, until max_steps or a stop.

  A stop request (`stop`, a runtime.training.StopRequest) ends the loop at the
  next step boundary, with a checkpoint of that step. `examples_per_worker`
  (the records of this worker's shard) sizes the shuffle buffer the first
  batch waits for, which the first step's heartbeat line names.

  Returns:
    int, the global step reached.

  Raises:
    runtime.training.Stopped: the stop came before or during this run's
      first step, in a single process.
  """
  state = engine.trainer.state
  step = first_step = None

  def global_step():
    return int(state.global_step.numpy())

  try:
    # Synchronization point: every worker takes the chief's state (fresh or
    # restored), so all resume from the chief's checkpoint.
    with engine.waiting('the start-up', global_step(), first=True):
      engine.broadcast()
    step = first_step = global_step()
    if resume_from:
      logger.info('Resuming from %s at global step %d.', resume_from, step)
      save.last_saved = step
    if step >= config.max_steps:
      logger.warning(training.nothing_to_train(step, config.max_steps, config.train_dir))
      return step
    # A single process stops at once until its first step is done; with peers
    # a stop rides on the step's vote instead, so that all stop after one step.
    alone = engine.num_workers == 1
    with stop.raising() if alone else contextlib.nullcontext():
      iterator = iter(engine.dataset())
    writer = None  # opened after the first step: a stop before it writes nothing
    stopped_by = None
    # Deviation from upstream: the loss logged is the mean over towers, not the last tower's.
    # Deviation from upstream: examples/sec and sec/batch are means over the
    # steps since the last line, not divided by the towers (training.StepLog).
    # Progress comes from the chief.
    log = training.StepLog(config, config.batch_size * engine.trainer.num_towers, on_step,
                           speaks=engine.is_chief)
    while step < config.max_steps and not stopped_by:
      first = step == first_step
      write_summary = (step + 1) % config.summary_every == 0
      # The first step traces and compiles the step function and fills the
      # shuffle buffer: seconds, tens of seconds on a busy machine, with
      # nothing written yet, so a stop ends it at once. (With peers a stop
      # rides on the step's vote instead, so that all stop after one step.)
      with stop.raising() if first and alone else contextlib.nullcontext():
        fetch_time = time.time()
        with _first_step_progress(first and engine.is_chief, 'Filling the shuffle buffer '
                                  'with %d examples' % hparams.min_queue_examples(
                                      examples_per_worker)):
          batches = next(iterator)
        start_time = time.time()
        with engine.waiting('the step', step, first=first), _first_step_progress(
            first and engine.is_chief, 'Building and tracing the step (first step)'):
          tower_losses, summaries, voted = engine.step(batches, stop, write_summary)
      end_time = time.time()
      duration = end_time - start_time
      # Deviation from upstream: 'step N' and model.ckpt-N count the global step after the update.
      # Upstream logged and saved its 0-based loop index.
      # Before `step` counts it: a diverged step is never saved.
      training.check_divergence(global_step(), tower_losses)
      step = global_step()
      if writer is None:
        writer = tf.summary.create_file_writer(engine.write_dir)
        with _summaries_may_fail(
            'the graph to TensorBoard summaries in ' + engine.write_dir), \
            writer.as_default():
          tf.summary.graph(engine.trainer.step_graph(batches, write_summary))
      # The speed of the log lines counts the wait for the batch too (legacy's
      # session run dequeues it); the first and the summary steps only when
      # nothing else (training.LogWindow).
      log.add(step, float(tower_losses.mean()), end_time - fetch_time,
              first or write_summary, step_seconds=duration)
      if write_summary:  # the step just taken is a summary step
        # The learning rate the step just taken used (read before the increment).
        lr = float(model_spec.learning_rate(step - 1, decay_steps,
                                            config.optimizer.learning_rate))
        try:
          with writer.as_default():
            _write_summaries(state, step, tower_losses, lr, summaries)
        except (tf.errors.OpError, OSError) as e:  # e.g. disk full
          raise checkpoints.write_failed(
              engine.write_dir, 'TensorBoard summaries', e) from e
      if step % config.save_every == 0:
        save()
      # With peers, every worker stops after the step whose vote said so.
      if voted or (alone and stop.requested):
        stopped_by = stop.signal_name or engines.ANOTHER_WORKER
    path = save()  # with peers every worker saves: the chief's copy is kept
    with _summaries_may_fail('the last TensorBoard summaries to ' + engine.write_dir):
      writer.flush()
    # Synchronization point: no worker leaves before all have saved.
    with engine.waiting('the final barrier', step):
      engine.barrier()
  except engine.peer_errors as e:
    return engine.lost_peers(e, step, first_step, save, stop)
  except Exception as e:  # pylint: disable=broad-except
    if step is None:  # before the first broadcast: nothing to keep
      raise
    # The one ending path of a failure, whatever it was: keep the last
    # completed step if the variables still hold it, and say so in one line.
    raise ending.failed(e, first_step, step, global_step,
                        save.last_saved, save, config.train_dir) from e
  if not stopped_by and alone and stop.requested:
    stopped_by = stop.signal_name  # the stop came during the last save
  if stopped_by:
    engine.report_stop(stopped_by, step, path)
  elif engine.is_chief:
    training.report_end(None, step, path, config)
  return step
