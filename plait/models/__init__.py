"""Built-in models for the demo, ``plait plan --model``, tests and benchmarks.

One module per family (:mod:`~plait.models.gpt`, :mod:`~plait.models.llama`,
:mod:`~plait.models.bert`, :mod:`~plait.models.mlp`, :mod:`~plait.models.cnn`), each a plain
``torch.nn.Module`` with its loss; :mod:`~plait.models.zoo` builds any of them by kind from a
:class:`ModelSpec` (:func:`build`), on the meta device for sizes that would not fit.
"""

from plait.models.bert import Bert, bert_loss
from plait.models.cnn import SmallCNN, classify_loss
from plait.models.gpt import (
    Block,
    GPTConfig,
    TinyGPT,
    annotate_megatron,
    gpt_loss,
    token_batches,
)
from plait.models.llama import Llama, lm_loss
from plait.models.mlp import MLP, FeedForward, mlp_loss
from plait.models.spec import KINDS, Batch, LossFn, ModelSpec
from plait.models.zoo import build, parameter_count

__all__ = [
    "KINDS",
    "MLP",
    "Batch",
    "Bert",
    "Block",
    "FeedForward",
    "GPTConfig",
    "Llama",
    "LossFn",
    "ModelSpec",
    "SmallCNN",
    "TinyGPT",
    "annotate_megatron",
    "bert_loss",
    "build",
    "classify_loss",
    "gpt_loss",
    "lm_loss",
    "mlp_loss",
    "parameter_count",
    "token_batches",
]
