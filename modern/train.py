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

from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec
from cifar10_towers.modern import checkpoints as ckpt_lib
from cifar10_towers.modern import engines
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
def _write_summaries(writer, step, state, tower_losses, summaries, batches):
  """The tags of runtime.training.summary_tags with tf.summary, at `step`.

  Args:
    writer: the tf.summary writer.
    step: int, the global step reached.
    state: modern.step.TrainState after the step.
    tower_losses: numpy [replicas], the towers' total losses.
    summaries: what the step returned from inside it (see
      modern.step.Trainer.step); empty for the replica engines, which write
      no images either.
    batches: the step's (images, labels): tower 0's first images are written.
  """
  # The learning rate the step just taken used (read before the increment).
  lr = model_spec.learning_rate(step - 1, state.decay_steps, state.optimizer.learning_rate)
  values = {training.MEAN_LOSS_TAG: tower_losses.mean(), training.LEARNING_RATE_TAG: lr,
            **summaries, **state.variables(),
            # Deviation from upstream: every tower's loss summary is written.
            **{training.tower_tag(i, 'total_loss'): v for i, v in enumerate(tower_losses)},
            **{model_spec.average_name(name): var
               for name, var in state.shadow_variables().items()}}
  with writer.as_default():
    for tag, value in values.items():  # a histogram of each tensor, a scalar of each scalar
      value = tf.convert_to_tensor(value)
      (tf.summary.histogram if value.shape.rank else tf.summary.scalar)(tag, value, step=step)
    if summaries:  # the tags of training.image_tags()
      for tag, image in zip(training.image_tags(), batches[0][0]):
        tf.summary.image(tag, _displayable(image)[np.newaxis], step=step)


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
  try:
    with training.starting(config, config.num_gpus * engine.num_workers, engine.write_dir,
                           engine.lock_what) as (stop, examples_per_epoch, decay_steps):
      with stop.raising():
        if config.seed is not None:
          tf.random.set_seed(config.seed)
        engine.start(decay_steps)
        tf.debugging.set_log_device_placement(config.log_device_placement)
        checkpoint = ckpt_lib.checkpoint_object(engine.trainer.state)
        # Only the chief restores; the others take its state (engine.broadcast).
        resume_from = (ckpt_lib.restore_latest(config.train_dir, checkpoint,
                                               config.optimizer)
                       if engine.is_chief else None)
        save = ckpt_lib.StepSaver(checkpoint, engine.write_dir)  # after restore_latest
      with engine.watching(stop, save):
        return _train_loop(config, engine, save, resume_from, stop, on_step,
                           examples_per_epoch // engine.num_workers)
  finally:
    engine.close()


def _train_loop(config, engine, save, resume_from, stop, on_step, examples_per_worker):
  """`runtime.training.train_loop` on `engine`, after every worker took the chief's state.

  `examples_per_worker` (the records of this worker's shard) sizes the
  shuffle buffer the first batch waits for, which the first step's heartbeat
  line names.

  Returns:
    int, the global step reached.

  Raises:
    runtime.training.Stopped: the stop came before or during this run's
      first step, in a single process.
  """
  state = engine.trainer.state
  # traced: the latest step's (batches, write_summary), the first's when open_summaries runs
  alone, traced = engine.num_workers == 1, []

  def global_step():
    return int(state.global_step.numpy())

  step = global_step()
  try:
    # Synchronization point: every worker takes the chief's state (fresh or
    # restored), so all resume from the chief's checkpoint.
    with engine.waiting('the start-up', step, first=True):
      engine.broadcast()
  except engine.peer_errors as e:
    return engine.lost_peers(e, step, step, stop)  # nothing to save
  step = global_step()
  if resume_from:
    logger.info(f'Resuming from {resume_from} at global step {step}.')
    save.last_saved = step
  if step >= config.max_steps:
    logger.warning(training.nothing_to_train(step, config.max_steps, config.train_dir))
    return step
  # A single process stops at once until its first step is done; with peers
  # a stop rides on the step's vote instead, so that all stop after one step.
  with stop.raising() if alone else contextlib.nullcontext():
    iterator = iter(engine.dataset())

  def run_step(step, first, write_summary):
    # The first step traces and compiles the step function and fills the
    # shuffle buffer: seconds, tens of seconds on a busy machine, with
    # nothing written yet, so a stop ends it at once. (With peers a stop
    # rides on the step's vote instead, so that all stop after one step.)
    def progress(what):
      # During the first step, a heartbeat line saying `what` it waits for
      # past 5 s. Progress comes from the chief.
      return (training.heartbeat(lambda seconds: f'{what}... {seconds} s')
              if first and engine.is_chief else contextlib.nullcontext())

    with stop.raising() if first and alone else contextlib.nullcontext():
      with progress('Filling the shuffle buffer with '
                    f'{hparams.min_queue_examples(examples_per_worker)} examples'):
        batches = next(iterator)
      # The speed of the log lines counts the wait for the batch too (legacy's
      # session run dequeues it); `on_step` the step alone.
      start_time = time.time()
      with engine.waiting('the step', step, first=first), progress(
          'Building and tracing the step (first step)'):
        tower_losses, voted, summaries = engine.trainer.step(batches, stop.requested,
                                                             write_summary)
        tower_losses = tower_losses.numpy()  # (voted: a bool tensor, read by the loop)
    traced[:] = batches, write_summary
    return tower_losses, (tower_losses, summaries, batches), voted, time.time() - start_time

  def open_summaries():
    writer = tf.summary.create_file_writer(engine.write_dir)
    try:
      with writer.as_default():
        tf.summary.graph(engine.trainer.step_graph(*traced))
    except (tf.errors.OpError, OSError) as e:
      logger.warning(f'could not write the graph to TensorBoard summaries in {engine.write_dir} '
                     f'({str(e).strip().splitlines()[0]}).')
    return writer

  run = training.Run(
      images=config.batch_size * engine.trainer.num_towers, write_dir=engine.write_dir,
      chief=engine.is_chief, alone=alone, peer_errors=engine.peer_errors, step=run_step,
      held=global_step, save=save, open_summaries=open_summaries,
      write_summaries=lambda writer, step, summary: _write_summaries(writer, step, state, *summary),
      finish=engine.finish,
      lost_peers=engine.lost_peers,
      report_stop=engine.report_stop)
  return training.train_loop(config, stop, run, step, on_step)
