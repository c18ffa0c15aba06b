"""The CIFAR-10 multi-tower trainer in idiomatic TF2.

tf.data input, tf.function towers, tf.train.Checkpoint.

The same algorithm as `legacy/` (docs/equivalence.md §1) without `tf.compat.v1`, split the
same way so the two can be diffed file by file:

  inputs.py       tf.data pipelines over the CIFAR-10 binary files
  model.py        the variables (`Cifar10Model`), `inference`, `loss`, moving averages
  checkpoints.py  the checkpoint layout, resuming, saving once per step
  step.py         towers, `average_gradients`, the update (SGD, moving averages)
  engines.py      where the step runs: the towers, MirroredStrategy, or
                  MultiWorkerMirroredStrategy (with cluster.py, the workers' start-up)
  train.py        the one training loop, for every engine
  eval.py         precision @ 1 with the moving-average weights

Importing this package imports nothing heavy; import the modules you need.
"""
