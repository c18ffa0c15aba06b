"""Answers "are my towers running in parallel?" for either trainer.

`analysis` works on a normalized event list and knows no TensorFlow; one small
adapter per trainer (`legacy_trace`, `modern_trace`) runs a few traced steps
and turns TensorFlow's trace into that list.
"""
