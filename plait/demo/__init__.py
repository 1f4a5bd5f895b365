"""``make demo``: the best real multi-process training plait can do so far.

``python -m plait.demo`` starts ``plait run`` with 4 local CPU workers; each runs
:mod:`plait.demo.train`, which trains a small GPT with Megatron-style tensor parallel (heads
and MLP split over ``tp``) and data parallel over ``dp``, on a character-level corpus that ships
with plait, and prints the falling loss.
"""
