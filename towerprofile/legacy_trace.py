"""The legacy adapter: a few FULL_TRACE steps of the queue-runner trainer.

The only contact with legacy/: `build_train_graph` and `session_config` (a
MonitoredSession runs the queue threads). RunMetadata.step_stats has one lane per device
(`/job:localhost/replica:0/task:0/device:CPU:1`, on a GPU also
`.../GPU:0/stream:all` and `.../GPU:0/memcpy`) with each op's start and end.
"""

import time

import tensorflow.compat.v1 as tf

from cifar10_towers.legacy import train
from cifar10_towers.towerprofile import analysis

INPUT_THREADS = 4  # preprocessing threads; the profile keeps the CPU for the towers


def events_from_step_stats(step_stats, step):
  """Yields the normalized events (analysis.Event) of one step's RunMetadata.step_stats."""
  for dev in step_stats.dev_stats:
    # A GPU's kernels appear twice: per stream and in 'stream:all'.
    if '/stream:' in dev.device and not dev.device.endswith('/stream:all'):
      continue
    for node in dev.node_stats:
      if node.node_name != '_SOURCE':
        start = node.all_start_nanos / 1e3 or node.all_start_micros
        # timeline_label: 'tower_0/conv1/Conv2D = Conv2D(a, b)'
        op_type = node.timeline_label.partition(' = ')[2].partition('(')[0].strip()
        yield analysis.Event(
            node.node_name, 'MEMCPY' if dev.device.endswith('/memcpy') else op_type,
            analysis.canonical_device(dev.device), start,
            start + (node.all_end_rel_nanos / 1e3 or node.all_end_rel_micros), step)


def trace(config, plan, decay_steps, steps, warmup):
  """Trains `warmup` then `steps` traced steps; nothing is written anywhere.

  Args:
    config: runtime.config.TrainConfig (train_dir is not used).
    plan: common.devices.DevicePlan the trainer builds with.
    decay_steps: int, of the learning rate schedule.
    steps: int >= 1, traced steps.
    warmup: int, untraced steps first (queues fill, kernels warm up).

  Returns:
    (events, windows, wall_us, {}): list of analysis.Event, per step the
    traced window (start_us, end_us), per step the time sess.run took (us),
    and no report fields of its own (modern's adapter has one).
  """
  events, windows, wall_us = [], [], []
  with tf.Graph().as_default():
    parts = train.build_train_graph(config, plan, decay_steps, INPUT_THREADS)
    # The MonitoredSession starts the queue threads and at the end stops them.
    with tf.train.MonitoredSession(tf.train.ChiefSessionCreator(
        tf.train.Scaffold(init_op=parts.init_op), config=train.session_config(plan))) as sess:
      for _ in range(warmup):
        sess.run(parts.towers.train_op)
      for k in range(steps):
        metadata = tf.RunMetadata()
        # step_stats times are wall-clock microseconds since the epoch, so
        # the call's own bounds place the window on the trace's clock: the
        # runtime's time before the first and after the last op (dispatch,
        # collecting the trace: 0.5 and 2-7 ms measured) is part of the step.
        called = time.time() * 1e6
        sess.run(parts.towers.train_op, run_metadata=metadata,
                 options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE))
        returned = time.time() * 1e6
        wall_us.append(returned - called)
        step_events = list(events_from_step_stats(metadata.step_stats, k))
        events += step_events
        windows.append((min([called] + [e.start_us for e in step_events]),
                        max([returned] + [e.end_us for e in step_events])))
  return events, windows, wall_us, {}
