"""``make demo``: the GPT example (examples/gpt) on 4 local CPU workers.

``python -m plait.demo`` starts ``plait run`` with 4 local workers; each runs
:mod:`plait.demo.train`, which trains a small GPT with Megatron-style tensor parallel (heads
and MLP split over ``tp``) and data parallel over ``dp``, on a character-level corpus that ships
with plait, and prints a progress bar, evaluation losses and a summary. ``plait.demo.train``
is also ``examples/gpt/train.py``: every mode plait builds, chosen with ``--mode``.
"""
