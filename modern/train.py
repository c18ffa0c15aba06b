"""The modern trainer's one training loop, on any engine (modern.engines).

Upstream `cifar10_multi_gpu_train.py`'s `train()` (docs/equivalence.md §1) in
TF2: restore the newest checkpoint, run steps until max_steps, log every
log_every steps, write summaries and checkpoints. The step is in
modern/step.py (towers) and modern/engines.py (tf.distribute replicas); the
engine also keeps several worker processes together where there are any.
"""

import tensorflow as tf

from cifar10_towers.modern import checkpoints as ckpt_lib
from cifar10_towers.modern import engines
from cifar10_towers.runtime import training


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
  with engines.ENGINES[config.strategy](config, plan) as engine, training.starting(
      config, config.num_gpus * engine.num_workers, engine.write_dir, engine.lock_what) as (
          stop, examples_per_epoch, decay_steps):
    with stop.raising():
      if config.seed is not None:
        tf.random.set_seed(config.seed)
      engine.start(decay_steps)
      tf.debugging.set_log_device_placement(config.log_device_placement)
      checkpoint = ckpt_lib.checkpoint_object(engine.state)
      # Only the chief restores; the others take its state (MultiWorker.run).
      resume_from = (ckpt_lib.restore_latest(config.train_dir, checkpoint, config.optimizer)
                     if engine.chief else None)
      engine.saver = ckpt_lib.step_saver(checkpoint, engine.write_dir)  # after restore_latest
    # The records of this worker's shard size the shuffle buffer the first
    # batch waits for, which the first step's heartbeat line names.
    engine.stop, engine.examples_per_worker = stop, examples_per_epoch // engine.num_workers
    return engine.run(resume_from, on_step)
