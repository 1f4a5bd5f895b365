"""Checkpoints: the on-disk format (:mod:`plait.checkpoint.files`), a directory of them saved
every N steps (:class:`Checkpoints`), and the offline tools behind ``plait checkpoint``.

Saving and loading a job are :meth:`plait.Job.save` and :meth:`plait.Job.load`
(``plait/runtime/engine/checkpoint.py``).
"""

from plait.checkpoint.files import latest
from plait.checkpoint.manager import Checkpoints

__all__ = ["Checkpoints", "latest"]
