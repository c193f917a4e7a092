"""The embed pipeline: texts -> tokenize -> encoder -> mean pooling -> L2 normalisation, as
sentence-transformers computes a sentence embedding (Transformer, Pooling(mean), Normalize).
Ray-free: the encoder is reached through an async ``infer(model_name, inputs)`` callable that the
caller supplies (the Ray layer passes one that calls the encoder's deployment; tests pass one
backed by ``ModelHost``).

Contract (``engines/embed/config.yaml``)::

    input  text       BYTES [N]       1 to max_texts UTF-8 texts, empty ones included
    output embedding  FP32  [N, H]    unit-length (L2) mean of the encoder's last hidden state
                                      over each text's tokens ([CLS] and [SEP] included)
           tokens     INT64 [N]       tokens each text used, after truncation
    response parameters, when a text was longer than max_seq_length tokens:
           {"truncated": [indices of the texts cut], "max_seq_length": 256}

Tokenization is the ``tokenizers`` library with the encoder's ``tokenizer.json`` (beside its
``model.onnx``), truncating at ``max_seq_length`` (sentence-transformers' ``max_seq_length``:
256 for all-MiniLM-L6-v2; its ``tokenizer.json`` itself says 128) and without the file's padding
(fixed to 128 in that file); a request of a few short texts (``INLINE_CHARACTERS``) is tokenized
on the event loop, a longer one in a worker thread; a long text is tokenized on a prefix
(``encode_bounded``), so the tokenizer's work follows what is kept, not the text's length,
whether it is cut or refused (``on_overlength``). Texts go to the encoder sorted by length, in
calls of ``batch_size``, ``step_calls_in_flight`` calls of a request at a time
(``pipelines.map_bounded``); the replica has ``replica_calls_in_flight`` encoder calls running at
once, all requests together, and the texts that wait meanwhile join into the next call, up to
``batch_size`` (``pipelines.JoinedCalls``): one text per request, as a query path sends, would
otherwise cost a hop per text. Each call pads its texts to its longest. The encoder's own
dynamic batching pads each call further to a sequence bucket (its
``dynamic_batching.sequence_buckets``, ``deployments.batching``), so calls of different lengths
join and the encoder sees a few sequence lengths: on a GPU each new shape costs a plan rebuild
(ONNX Runtime CUDA) or must sit in a TensorRT profile. The attention mask keeps the padding out
of attention and out of the mean, so a text's embedding depends neither on its padding nor on
the other texts of its call, its request's or other requests'.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Awaitable, Callable, Literal, Mapping, Optional, Sequence

import numpy as np
from pydantic import Field
from tokenizers import Encoding, Tokenizer, models, normalizers, pre_tokenizers

from . import JoinedCalls, PipelineParameters, map_bounded
from ..runtime.contract.config import ModelConfig
from ..runtime.contract.errors import ConfigError, InvalidInput, PayloadTooLarge
from ..runtime.contract.outputs import Outputs
from ..runtime.contract.repository import ModelRepository

InferFn = Callable[[str, dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]
"""``await infer(model_name, {input_name: array}) -> {output_name: array}``."""

TOKENIZER_FILENAME = "tokenizer.json"  # beside the encoder's model.onnx (tools.bert writes it there)
ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # token_type_ids optional
ENCODER_OUTPUT = "last_hidden_state"
NORM_EPS = 1e-12  # torch.nn.functional.normalize's eps, which sentence-transformers' Normalize uses
TEXT = "text"
# Texts of at most this many characters in all are tokenized on the event loop: for a query
# the hop to a worker thread and back costs more than the tokenizer (tens of µs).
INLINE_CHARACTERS = 256
# A text is first tokenized on its first max_seq_length x this many characters (English runs 4-6
# characters a token): one pass for almost every text that is cut.
PREFIX_CHARACTERS_PER_TOKEN = 8


def _settled(encoding: Encoding) -> bool:
    """Whether the tokens kept from a prefix are the whole text's: the prefix was cut
    (``overflowing``) and no kept token comes from its last word, the only one a cut can change
    (the pre-tokenizer splits words without looking past their neighbours)."""
    if not encoding.overflowing:
        return False
    kept = max((w for w in encoding.word_ids if w is not None), default=-1)
    last = max((w for w in encoding.overflowing[-1].word_ids if w is not None), default=-1)
    return kept < last


# Letters and digits, CJK ideographs left out: inside a word for BERT's pre-tokenizer (which
# splits at whitespace and punctuation, and its normalizer around each CJK ideograph).
_IN_WORD = re.compile("[^\\W_\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df"
                      "\U0002a700-\U0002b73f\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002f800-\U0002fa1f]+")


def _word_chars(tokenizer: Any) -> int | None:
    """WordPiece's ``max_input_chars_per_word`` for a BERT tokenizer (BertNormalizer or none,
    BertPreTokenizer, WordPiece): a longer word is one unknown token, however long. None for
    another kind of tokenizer."""
    if (isinstance(getattr(tokenizer, "model", None), models.WordPiece)
            and isinstance(getattr(tokenizer, "pre_tokenizer", None), pre_tokenizers.BertPreTokenizer)
            and (tokenizer.normalizer is None or isinstance(tokenizer.normalizer, normalizers.BertNormalizer))):
        return int(tokenizer.model.max_input_chars_per_word)
    return None


def encode_bounded(tokenizer: Tokenizer, texts: Sequence[str], max_seq_length: int) -> list[Encoding]:
    """``tokenizer.encode_batch(texts)`` (truncating at ``max_seq_length``), each text tokenized on
    a prefix: its first ``max_seq_length x PREFIX_CHARACTERS_PER_TOKEN`` characters, doubled while
    the prefix's tokens do not settle the answer (``_settled``: a prefix too short to be cut, or
    whose kept tokens reach its last word), up to the whole text. The ids, the count and whether
    a text was cut (``overflowing``) are what tokenizing the whole text gives, and a text of
    megabytes costs the tokenizer a few kilobytes.

    A word has no cut inside it that the tokenizer would agree with, so one long word is
    tokenized whole; for a BERT tokenizer (``_word_chars``), before a prefix grows, a run of
    letters and digits from its cut longer than WordPiece's word limit is shortened to one
    character over it (the word stays one unknown token), so a text of one long word costs
    the tokenizer little more either (emoji and other symbols are not shortened)."""
    size = max_seq_length * PREFIX_CHARACTERS_PER_TOKEN
    word_chars = _word_chars(tokenizer)
    texts = list(texts)
    encodings = tokenizer.encode_batch([t[:size] for t in texts])
    pending = [i for i, t in enumerate(texts) if len(t) > size and not _settled(encodings[i])]
    while pending:
        if word_chars is not None:
            for i in pending:
                run = _IN_WORD.match(texts[i], size)
                if run is not None and run.end() - size > word_chars + 1:
                    texts[i] = texts[i][:size + word_chars + 1] + texts[i][run.end():]
        size *= 2
        for i, encoding in zip(pending, tokenizer.encode_batch([texts[i][:size] for i in pending])):
            encodings[i] = encoding
        pending = [i for i in pending if len(texts[i]) > size and not _settled(encodings[i])]
    return encodings


class EmbedParameters(PipelineParameters):
    """The ``parameters`` of ``engines/embed/config.yaml``."""

    steps: tuple[str] = ("all-MiniLM-L6-v2",)  # the encoder
    max_seq_length: int = Field(256, ge=2)  # tokens per text, [CLS] and [SEP] included
    on_overlength: Literal["truncate", "reject"] = "truncate"  # reject: 413
    max_texts: int = Field(2048, ge=1)  # texts per request; more: 413
    batch_size: Optional[int] = Field(None, ge=1)  # texts per encoder call; None: its max_batch_size
    replica_calls_in_flight: int = Field(4, ge=1)  # encoder calls of all requests at once; more join (JoinedCalls)


def load_tokenizer(path: str, max_seq_length: int) -> Tokenizer:
    """The tokenizer of ``path`` truncating at ``max_seq_length`` tokens, without padding.

    Raises:
        ConfigError: the file cannot be read as a ``tokenizers`` tokenizer.
    """
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for a missing or bad file
        raise ConfigError(f"{path}: cannot read the tokenizer ({e}); the encoder's folder needs its "
                          f"{TOKENIZER_FILENAME} beside model.onnx") from None
    tokenizer.enable_truncation(max_length=max_seq_length)
    tokenizer.no_padding()
    return tokenizer


def decode_texts(name: str, array: np.ndarray, max_texts: int) -> list[str]:
    """The texts of input ``text`` (``(N,)`` object array of bytes) as str.

    Raises:
        InvalidInput: not a 1-D BYTES tensor, no text, or a text that is not UTF-8 (naming its
            index and the byte offset).
        PayloadTooLarge: more than ``max_texts`` texts.
    """
    if array.dtype != np.object_ or array.ndim != 1:
        raise InvalidInput(f"model '{name}' input '{TEXT}': datatype must be BYTES with shape [N] (N texts), "
                           f"got {array.dtype} shape {list(array.shape)}")
    if array.shape[0] == 0:
        raise InvalidInput(f"model '{name}' input '{TEXT}' holds no text; send 1 to {max_texts} texts")
    if array.shape[0] > max_texts:
        raise PayloadTooLarge(f"model '{name}' input '{TEXT}' holds {array.shape[0]} texts; "
                              f"at most {max_texts} are accepted per request")
    texts = []
    for index, item in enumerate(array):
        if isinstance(item, str):
            texts.append(item)
            continue
        if not isinstance(item, (bytes, bytearray, memoryview)):
            raise InvalidInput(f"model '{name}' input '{TEXT}'[{index}]: datatype must be BYTES (UTF-8 text)")
        try:
            texts.append(bytes(item).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidInput(f"model '{name}' input '{TEXT}'[{index}] is not UTF-8 text (invalid byte at "
                               f"offset {e.start}); send texts encoded as UTF-8") from None
    return texts


def mean_pool_normalized(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``(B, S, H)`` hidden states and ``(B, S)`` mask -> ``(B, H)`` float32: the mean over the
    masked-in tokens (sentence-transformers' ``Pooling`` mean mode, with its 1e-9 floor on the
    count), divided by its L2 norm (floored at ``NORM_EPS``)."""
    weights = mask.astype(np.float32)[:, :, np.newaxis]
    pooled = (hidden.astype(np.float32) * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), NORM_EPS)
    return (pooled / norms).astype(np.float32)


class EmbedPipeline:
    """Sentence embeddings through one encoder model.

    Args:
        infer: ``await infer(model_name, {input: array}) -> {output: array}``; raises the
            runtime's ``ServingError`` subclasses.
        tokenizer: a ``tokenizers.Tokenizer`` (``load_tokenizer``).
        encoder: the encoder's config (inputs ``ENCODER_INPUTS``, output ``ENCODER_OUTPUT``).
        parameters: ``EmbedParameters`` or a mapping of its fields (``config.parameters``).
        dimension: the pipeline's ``embedding`` width from its config (None: not checked).

    Raises:
        ConfigError: a parameter is invalid, or the encoder's config cannot take what the
            pipeline sends (its inputs, its batch and sequence bounds, its hidden size).
    """

    def __init__(self, infer: InferFn, tokenizer: Tokenizer, encoder: ModelConfig,
                 parameters: EmbedParameters | Mapping[str, Any] | None = None, name: str = "embed",
                 dimension: int | None = None) -> None:
        if not isinstance(parameters, EmbedParameters):
            parameters = EmbedParameters.parse(parameters or {}, f"model '{name}'")
        self.name = name
        self.parameters = parameters
        self.encoder = encoder
        self._infer = infer
        self._tokenizer = tokenizer
        self._inputs = self._check_encoder(encoder, dimension)
        limit = min(encoder.max_batch_size or 1, *(spec.bounds()[1][0] for spec in encoder.inputs))
        self._batch = min(parameters.batch_size or limit, limit)
        self._joined = JoinedCalls(self._embed, self._batch, parameters.replica_calls_in_flight)

    def _check_encoder(self, encoder: ModelConfig, dimension: int | None) -> tuple[str, ...]:
        """The encoder inputs the pipeline sends; raises ConfigError where it cannot serve."""
        names = [t.name for t in encoder.inputs]
        where = f"model '{encoder.name}' (the encoder of model '{self.name}')"
        if not {"input_ids", "attention_mask"} <= set(names) or set(names) - set(ENCODER_INPUTS):
            raise ConfigError(f"{where}: the embed pipeline sends inputs {list(ENCODER_INPUTS)} "
                              f"(token_type_ids optional); its config has {names}")
        outputs = {t.name: t for t in encoder.outputs}
        hidden = outputs.get(ENCODER_OUTPUT)
        if hidden is None or len(hidden.dims) != 3:
            raise ConfigError(f"{where}: the embed pipeline needs output '{ENCODER_OUTPUT}' of rank 3 "
                              f"[batch, sequence, hidden]; its config has {sorted(outputs)}")
        if dimension not in (None, -1) and hidden.dims[2] not in (-1, dimension):
            raise ConfigError(f"{where}: its hidden size {hidden.dims[2]} differs from the pipeline's "
                              f"embedding width {dimension}")
        for spec in encoder.inputs:
            lo, hi = spec.bounds()
            lo_seq, hi_seq = lo[1], hi[1]
            if not lo_seq <= 2 <= self.parameters.max_seq_length <= hi_seq:
                raise ConfigError(f"{where}: input '{spec.name}' admits sequences of {lo_seq} to {hi_seq} "
                                  f"tokens; the pipeline sends 2 to max_seq_length "
                                  f"{self.parameters.max_seq_length}")
        return tuple(n for n in ENCODER_INPUTS if n in names)

    @classmethod
    def from_repository(cls, repository: ModelRepository, infer: InferFn, name: str = "embed") -> "EmbedPipeline":
        """Build from ``<root>/<name>/config.yaml`` (its ``parameters``), the encoder's config and
        the ``tokenizer.json`` beside the encoder's latest ``model.onnx``.

        Raises:
            ModelNotFound: the encoder is not in the repository.
            ConfigError: see the class docstring and ``load_tokenizer``.
        """
        config = repository.get(name).config
        parameters = EmbedParameters.parse(config.parameters, f"model '{name}'")
        encoder = repository.get(parameters.steps[0])
        tokenizer = load_tokenizer(str(encoder.onnx_path().parent / TOKENIZER_FILENAME), parameters.max_seq_length)
        embedding = next((t for t in config.outputs if t.name == "embedding"), None)
        return cls(infer, tokenizer, encoder.config, parameters, name,
                   embedding.dims[-1] if embedding is not None else None)

    @property
    def steps(self) -> tuple[str]:
        """The model this pipeline calls: the encoder."""
        return (self.encoder.name,)

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> Outputs:
        """Tensor form of ``run``: ``{"text": BYTES [N]} -> {"embedding", "tokens"}``.

        Raises:
            InvalidInput, PayloadTooLarge: see ``decode_texts``; another input than ``text``.
        """
        extra = sorted(set(inputs) - {TEXT})
        if TEXT not in inputs or extra:
            raise InvalidInput(f"model '{self.name}' expects inputs ['{TEXT}']; got {sorted(inputs)}")
        return await self.run(decode_texts(self.name, inputs[TEXT], self.parameters.max_texts))

    async def run(self, texts: Sequence[str]) -> Outputs:
        """Embed ``texts`` (1 or more; see the module docstring).

        Returns:
            ``embedding`` ``(N, H)`` float32 unit rows and ``tokens`` ``(N,)`` int64, with the
            parameters ``truncated`` and ``max_seq_length`` when a text was cut.

        Raises:
            PayloadTooLarge: with ``on_overlength: reject``, a text over ``max_seq_length`` tokens.
            InferenceError, ModelNotReady, InferenceTimeout: passed on from ``infer``; its
                ``InvalidInput`` names the step (``pipelines.step_caller``).
        """
        limit = self.parameters.max_seq_length
        if sum(map(len, texts)) <= INLINE_CHARACTERS:
            encodings = self._tokenizer.encode_batch(list(texts))
        else:
            encodings = await asyncio.to_thread(encode_bounded, self._tokenizer, texts, limit)
        cut = [i for i, e in enumerate(encodings) if e.overflowing]
        if cut and self.parameters.on_overlength == "reject":
            raise PayloadTooLarge(
                f"model '{self.name}' input '{TEXT}'[{cut[0]}] is longer than {limit} tokens "
                f"({len(cut)} text(s) are); at most {limit} tokens per text are accepted (on_overlength: reject)")
        lengths = np.array([len(e.ids) for e in encodings], np.int64)
        order = np.argsort(lengths, kind="stable")  # similar lengths together: less padding
        groups = [order[i:i + self._batch] for i in range(0, len(order), self._batch)]
        if len(groups) == 1:
            pooled = [await self._joined([encodings[i] for i in groups[0]])]
        else:
            pooled = await map_bounded(lambda group: self._joined([encodings[i] for i in group]), groups,
                                       self.parameters.step_calls_in_flight)
        embedding = np.empty((len(encodings), pooled[0].shape[1]), np.float32)
        for group, rows in zip(groups, pooled):
            embedding[group] = rows
        parameters = {"truncated": cut, "max_seq_length": limit} if cut else {}
        return Outputs({"embedding": embedding, "tokens": lengths}, parameters)

    async def _embed(self, encodings: Sequence[Any]) -> np.ndarray:
        """One encoder call for ``encodings`` padded to the longest; returns ``(B, H)`` rows."""
        width = max(len(e.ids) for e in encodings)
        arrays = {n: np.zeros((len(encodings), width), np.int64) for n in self._inputs}
        for row, e in enumerate(encodings):
            n = len(e.ids)
            arrays["input_ids"][row, :n] = e.ids
            arrays["attention_mask"][row, :n] = e.attention_mask
            if "token_type_ids" in arrays:
                arrays["token_type_ids"][row, :n] = e.type_ids
        hidden = (await self._infer(self.encoder.name, arrays))[ENCODER_OUTPUT]
        return mean_pool_normalized(hidden, arrays["attention_mask"])
