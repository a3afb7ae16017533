"""Criteo Sponsored Search Conversion Log loader and the multi-hot path it needs (Samples bags, to_batch KJTs).

tests/data/criteo_search_sample.tsv is hand-written from the documented layout (23 tab-separated columns, -1 for
missing values, 32-hex-digit hashed ids, titles of space-separated hashed tokens): it is not an extract of the real
log. Its first row has a 3-token title with a repeated token, its second row is a sale with an empty (-1) title.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from herald_torchrec.data import build_source
from herald_torchrec.data._stream import validation_mask
from herald_torchrec.data.batch import to_batch
from herald_torchrec.data.criteo_search import (
    LEAK_COLUMNS,
    SEARCH_COLUMNS,
    SINGLE_HOT,
    CriteoSearchSource,
    parse_decimal,
    split_tokens,
)
from herald_torchrec.data.errors import DataFormatError
from herald_torchrec.data.samples import Bag, Samples
from herald_torchrec.models import FeatureSpec, build_model
from tests.data.test_loaders import ref_fnv1a64, ref_splitmix64
from tests.helpers.app_runs import run_app
from tests.helpers.ranks import REPO_ROOT

SAMPLE = Path(__file__).resolve().parent / "criteo_search_sample.tsv"
CRITEO_KAGGLE = REPO_ROOT.parent / "shared" / "data" / "criteo_sample.tsv"
ROWS = 1000


# ------------------------------------------------------------------------------ pure-Python references


def ref_id(field: str, rows: int) -> int:
    return rows - 1 if field in ("-1", "") else ref_splitmix64(ref_fnv1a64(field.encode())) % (rows - 1)


def ref_row(line: str, rows: int = ROWS) -> tuple[float, list[float], list[int], list[int]]:
    """(label, dense, single-hot ids, title bag) of one line, straight from the documented layout."""
    f = line.rstrip("\n").split("\t")
    col = {n: f[i] for i, n in enumerate(SEARCH_COLUMNS)}
    clicks = 0 if col["nb_clicks_1week"] == "-1" else int(col["nb_clicks_1week"])
    price = 0.0 if col["product_price"] == "-1" else float(col["product_price"])
    dense = [math.log1p(max(clicks, 0)), math.log1p(max(price, 0.0))]
    ids = [ref_id(col[n], rows) for n in SINGLE_HOT]
    title = col["product_title"]
    bag = [] if title == "-1" else [ref_splitmix64(ref_fnv1a64(t.encode())) % rows for t in title.split()]
    return float(col["Sale"]), dense, ids, bag


def collect(batches) -> Samples:
    return Samples.concat(list(batches))


def bag_rows(bag: Bag) -> list[list[int]]:
    off = bag.offsets
    return [bag.values[off[i] : off[i + 1]].tolist() for i in range(len(bag))]


def search_line(i: int, sale: int = 0, title: str = "AA BB", price: str = "9.5") -> str:
    """A synthetic row whose user_id is the row index (as a string)."""
    f = [str(sale), "-1", "-1", str(1596439471 + i), "3", price] + ["-1"] * 14 + [title, "P1", str(i)]
    return "\t".join(f) + "\n"


# ------------------------------------------------------------------------------------------- the sample


def test_sample_values_exact():
    src = CriteoSearchSource(SAMPLE, val_fraction=0.0, rows_per_table=ROWS)
    assert src.feature_names == list(SINGLE_HOT) + ["product_title"] and len(src.feature_names) == 17
    assert src.feature_names[:2] == ["product_age_group", "device_type"]
    assert src.feature_names[-3:-1] == ["partner_id", "user_id"]
    assert src.table_rows == [ROWS] * 17 and src.num_dense == 2 and src.bag_features == ("product_title",)
    s = collect(src.train_batches(10))
    assert len(s) == 100 and s.ids.shape == (100, 16) and s.dense.shape == (100, 2)
    assert s.ids.dtype == np.int64 and s.dense.dtype == np.float32 and s.labels.dtype == np.float32
    assert src.stats.rows_read == 100 and src.stats.rows_malformed == 0 and src.stats.samples_dropped == 0
    title = s.bags["product_title"]
    lines = SAMPLE.read_text().splitlines(keepends=True)

    # row 0: Sale 0, nb_clicks 12, price 49.9, title of 3 tokens (the first repeated)
    tok = lines[0].split("\t")[20].split(" ")
    assert len(tok) == 3 and tok[0] == tok[2] != tok[1]
    assert s.labels[0] == 0.0
    assert s.dense[0].tolist() == [pytest.approx(math.log1p(12)), pytest.approx(math.log1p(49.9))]
    want = [ref_splitmix64(ref_fnv1a64(t.encode())) % ROWS for t in tok]
    assert title.lengths[0] == 3 and bag_rows(title)[0] == want and want[0] == want[2]
    assert s.ids[0, 0] == ROWS - 1  # product_age_group -1 -> the reserved last row
    assert s.ids[0, 1] == ref_splitmix64(ref_fnv1a64(b"1A6FD60A34F639EEE11BF9E6B9689441")) % (ROWS - 1)
    # row 1: a sale, nb_clicks and price missing, empty title
    assert s.labels[1] == 1.0 and s.dense[1].tolist() == [0.0, 0.0]
    assert title.lengths[1] == 0 and bag_rows(title)[1] == []

    # every row equals a pure-Python parse of the file
    for r, line in enumerate(lines):
        lab, dense, ids, bag = ref_row(line)
        assert s.labels[r] == lab
        np.testing.assert_allclose(s.dense[r], dense, rtol=1e-6)
        assert s.ids[r].tolist() == ids
        assert bag_rows(title)[r] == bag
    assert s.labels.sum() == 13 and int((title.lengths == 0).sum()) == 14
    assert title.lengths.max() >= 8 and title.values.shape[0] == title.lengths.sum()


def test_leak_columns_are_not_read():
    src = CriteoSearchSource(SAMPLE, val_fraction=0.0, rows_per_table=ROWS)
    for name in (*LEAK_COLUMNS, "click_timestamp", "Sale"):
        assert name not in src.feature_names and name not in src.dense_names
    assert src.dense_names == ["nb_clicks_1week", "product_price"]
    assert LEAK_COLUMNS == ("SalesAmountInEuro", "time_delay_for_conversion")
    assert SEARCH_COLUMNS.index("SalesAmountInEuro") == 1 and SEARCH_COLUMNS.index("time_delay_for_conversion") == 2


def test_leak_column_contents_change_nothing(tmp_path):
    """The post-sale columns are -1 exactly when Sale = 0: a loader that read them would leak the label. Rewriting
    them (to anything, even text) must leave every sample unchanged."""
    lines = SAMPLE.read_text().splitlines(keepends=True)
    for line in lines:  # the leak, in the sample as in the real log
        f = line.split("\t")
        assert (f[0] == "0") == (f[1] == "-1") == (f[2] == "-1")
    scrambled = []
    for line in lines:
        f = line.split("\t")
        f[1], f[2] = "not-a-number", "123456789"
        scrambled.append("\t".join(f))
    path = tmp_path / "scrambled.tsv"
    path.write_text("".join(scrambled))
    a = collect(CriteoSearchSource(SAMPLE, val_fraction=0.0, rows_per_table=ROWS).train_batches(100))
    b = collect(CriteoSearchSource(path, val_fraction=0.0, rows_per_table=ROWS).train_batches(100))
    for x, y in [(a.dense, b.dense), (a.ids, b.ids), (a.labels, b.labels)]:
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.bags["product_title"].values, b.bags["product_title"].values)


def test_a_pass_from_a_training_sample():
    """`train_batches(g, start)` skips the split's first `start` samples (a resumed run's head) and cuts the rest into
    global batches: the stream after exactly `start` samples, whatever the global batch."""
    src = CriteoSearchSource(SAMPLE, val_fraction=0.3, rows_per_table=ROWS, chunk_bytes=700)
    every = collect(src.train_batches(1))
    for g, start in [(7, 5), (4, 0), (9, 33), (1, len(every) - 1)]:
        got = collect(src.train_batches(g, start))
        n = (len(every) - start) // g * g
        assert len(got) == n and src.pass_stats["train"].samples_skipped == start, (g, start)
        np.testing.assert_array_equal(got.ids, every.ids[start : start + n])
        np.testing.assert_array_equal(got.labels, every.labels[start : start + n])
    assert list(src.train_batches(3, len(every))) == []  # nothing after the last sample
    with pytest.raises(ValueError, match="start must be an integer >= 0"):
        src.train_batches(3, -1)


def test_split_blocks_and_gzip_give_the_same_stream(tmp_path):
    every = collect(CriteoSearchSource(SAMPLE, val_fraction=0.0, rows_per_table=ROWS).train_batches(1))
    src = CriteoSearchSource(SAMPLE, val_fraction=0.3, rows_per_table=ROWS, chunk_bytes=700)  # many small blocks
    train = collect(src.train_batches(7))  # batches straddle blocks: the buffer carries bags over
    val = collect(src.val_batches(1))
    want_val = validation_mask(np.arange(100), 0.3)
    n_train = int((~want_val).sum()) // 7 * 7
    assert len(train) == n_train and len(val) == int(want_val.sum()) and len(val) > 15
    assert src.pass_stats["train"].samples_dropped == int((~want_val).sum()) - n_train
    expect_train = every.take(np.flatnonzero(~want_val)[:n_train])
    expect_val = every.take(want_val)
    for got, exp in [(train, expect_train), (val, expect_val)]:
        np.testing.assert_array_equal(got.ids, exp.ids)
        np.testing.assert_array_equal(got.labels, exp.labels)
        assert bag_rows(got.bags["product_title"]) == bag_rows(exp.bags["product_title"])
    gz = tmp_path / "CriteoSearchData.gz"
    gz.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    z = collect(CriteoSearchSource(gz, val_fraction=0.0, rows_per_table=ROWS).train_batches(50))
    assert bag_rows(z.bags["product_title"]) == bag_rows(every.bags["product_title"])


def test_table_options_and_build_source():
    src = build_source({"name": "criteo_search", "path": str(SAMPLE), "rows_per_table": 64, "val_fraction": 0.0})
    assert isinstance(src, CriteoSearchSource) and src.table_rows == [64] * 17 and src.missing_ids == [63] * 16
    s = collect(src.train_batches(100))
    assert s.ids.max() <= 63 and s.bags["product_title"].values.max() < 64
    sizes = [10 + i for i in range(17)]
    assert CriteoSearchSource(SAMPLE, table_rows=sizes).table_rows == sizes
    with pytest.raises(ValueError, match="table_rows needs 17 sizes"):
        CriteoSearchSource(SAMPLE, table_rows=[10] * 16)
    with pytest.raises(ValueError, match="rows_per_table"):
        CriteoSearchSource(SAMPLE, rows_per_table=1)
    with pytest.raises(ValueError, match="needs a file"):
        build_source({"name": "criteo_search", "path": None})


# ------------------------------------------------------------------------------------ malformed / format


def test_malformed_rows_counted(tmp_path, capsys):
    good = [search_line(i, sale=i % 2) for i in range(10)]
    bad = [
        "1\t2\t3\n",  # line 5: wrong column count
        search_line(100).replace("0", "2", 1),  # Sale 2
        search_line(101, price="12,5"),  # not a decimal
        search_line(102).replace("\t3\t", "\tx\t", 1),  # nb_clicks_1week not an integer
        search_line(103).replace("\t1596439574\t", "\t2020-08-03\t", 1),  # click_timestamp not an integer
    ]
    lines = good[:4] + bad + good[4:]
    path = tmp_path / "bad.tsv"
    path.write_text("".join(lines))
    src = CriteoSearchSource(path, val_fraction=0.0, rows_per_table=ROWS)
    s = collect(src.train_batches(5))
    assert len(s) == 10 and s.labels.tolist() == [float(i % 2) for i in range(10)]
    assert s.ids[:, SINGLE_HOT.index("user_id")].tolist() == [ref_id(str(i), ROWS) for i in range(10)]
    assert bag_rows(s.bags["product_title"]) == [[ref_splitmix64(ref_fnv1a64(t)) % ROWS for t in (b"AA", b"BB")]] * 10
    assert src.stats.rows_read == 15 and src.stats.rows_malformed == 5
    assert src.stats.first_malformed_line == 5 and "23 tab-separated columns" in src.stats.first_malformed_reason
    err = capsys.readouterr().err
    assert "5 malformed of 15" in err and "line 5" in err and str(path) in err
    for line, what in zip(bad[1:], ["Sale must be 0 or 1", "product_price", "nb_clicks_1week", "click_timestamp"]):
        assert what in src._explain(line.rstrip("\n").encode())


def test_wrong_format_names_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        CriteoSearchSource(tmp_path / "nope.tsv")
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(DataFormatError, match=r"empty\.tsv:1: the file is empty"):
        CriteoSearchSource(empty)
    kaggle = tmp_path / "train.txt"  # a Criteo Kaggle line: 40 columns
    kaggle.write_text(("0\t1\t\t3" + "\t5" * 10 + "\t05db9164" * 26 + "\n") * 8)
    with pytest.raises(DataFormatError) as e:
        CriteoSearchSource(kaggle)
    assert isinstance(e.value, ValueError) and e.value.line == 1 and e.value.path == str(kaggle)
    assert "train.txt:1:" in str(e.value) and "23 tab-separated columns" in str(e.value)
    head = tmp_path / "garbage_head.tsv"
    head.write_text("garbage\n" * 5 + "".join(search_line(i) for i in range(5)))
    with pytest.raises(DataFormatError, match=r"garbage_head\.tsv:1: the first 5 data lines"):
        CriteoSearchSource(head)
    tiny = tmp_path / "tiny.tsv"
    tiny.write_text(search_line(0).replace("0", "x", 1))
    with pytest.raises(DataFormatError, match=r"tiny\.tsv:1: all 1 data lines are malformed.*Sale"):
        CriteoSearchSource(tiny)
    if CRITEO_KAGGLE.exists():
        with pytest.raises(DataFormatError, match=r"criteo_sample\.tsv:1: the first 5 data lines"):
            CriteoSearchSource(CRITEO_KAGGLE)


def test_field_parsers():
    fields = [b"149.0", b"-1", b"0.5", b"12", b"", b"1.", b".5", b"1e5", b"nan", b"1.2.3", b"-", b"--1", b"3-"]
    w = max(len(f) for f in fields)
    b = np.array([list(f.ljust(w, b"\0")) for f in fields], dtype=np.uint8)
    vals, ok = parse_decimal(b, np.array([len(f) for f in fields]))
    assert ok.tolist() == [True, True, True, True] + [False] * 9
    assert vals[:4].tolist() == [149.0, -1.0, 0.5, 12.0]

    titles = [b"AB CD AB", b"  X  ", b"", b"   ", b"ONE"]
    w = max(len(t) for t in titles)
    b = np.array([list(t.ljust(w, b"\0")) for t in titles], dtype=np.uint8)
    counts, h = split_tokens(b, np.array([len(t) for t in titles]))
    assert counts.tolist() == [3, 1, 0, 0, 1]
    assert h.tolist() == [ref_fnv1a64(t) for t in (b"AB", b"CD", b"AB", b"X", b"ONE")]


# ---------------------------------------------------------------------------------- bags: Samples, KJT


def _bagged() -> Samples:
    """4 samples; bag 'title' lengths [2, 0, 3, 1]."""
    return Samples(
        dense=np.arange(8, dtype=np.float32).reshape(4, 2),
        ids=np.array([[10, 20], [11, 21], [12, 22], [13, 23]], dtype=np.int64),
        labels=np.array([0, 1, 0, 1], dtype=np.float32),
        bags={"title": Bag(np.array([2, 0, 3, 1], dtype=np.int64), np.array([5, 6, 7, 8, 9, 4], dtype=np.int64))},
    )


def test_samples_take_and_concat_with_bags():
    s = _bagged()
    assert bag_rows(s.bags["title"]) == [[5, 6], [], [7, 8, 9], [4]]
    t = s.take(np.array([2, 0, 1, 2]))
    assert t.ids[:, 0].tolist() == [12, 10, 11, 12] and bag_rows(t.bags["title"]) == [[7, 8, 9], [5, 6], [], [7, 8, 9]]
    assert bag_rows(s.take(slice(1, 3)).bags["title"]) == [[], [7, 8, 9]]
    assert bag_rows(s.take(slice(None, None, 2)).bags["title"]) == [[5, 6], [7, 8, 9]]
    assert bag_rows(s.take(slice(3, 1)).bags["title"]) == []
    m = s.take(np.array([False, True, False, True]))
    assert m.labels.tolist() == [1.0, 1.0] and bag_rows(m.bags["title"]) == [[], [4]]
    assert bag_rows(s.take(np.array([-1])).bags["title"]) == [[4]]
    c = Samples.concat([s.take(slice(2, 4)), s.take(slice(0, 2))])
    assert c.ids[:, 1].tolist() == [22, 23, 20, 21] and bag_rows(c.bags["title"]) == [[7, 8, 9], [4], [5, 6], []]
    cp = s.copy()
    cp.bags["title"].values[0] = 99
    assert s.bags["title"].values[0] == 5
    # without bags nothing changes for existing sources
    plain = Samples(s.dense, s.ids, s.labels)
    assert plain.take(slice(0, 2)).bags is None and Samples.concat([plain, plain]).bags is None
    with pytest.raises(ValueError, match="different bags"):
        Samples.concat([s, plain])
    with pytest.raises(ValueError, match="bag 'title' has 3 samples"):
        Samples(s.dense, s.ids, s.labels, {"title": Bag(np.array([1, 1, 1]), np.array([1, 2, 3]))})
    with pytest.raises(ValueError, match="lengths"):
        Bag(np.array([1, 2], dtype=np.int64), np.array([1, 2], dtype=np.int64))
    with pytest.raises(TypeError, match="int64"):
        Bag(np.array([1], dtype=np.int32), np.array([1], dtype=np.int64))


def test_to_batch_kjt_with_empty_bags():
    s = _bagged()
    names = ["a", "b", "title"]  # the source's convention: ids columns first, then the bags
    batch = to_batch(s, ["title", "b"], names)
    kjt = batch.sparse_features
    assert kjt.keys() == ["title", "b"]
    assert kjt.values().dtype == torch.int64
    assert kjt.lengths().tolist() == [2, 0, 3, 1, 1, 1, 1, 1]
    assert kjt.values().tolist() == [5, 6, 7, 8, 9, 4, 20, 21, 22, 23]  # key-major
    assert kjt["title"].to_dense()[1].tolist() == [] and kjt["title"].to_dense()[2].tolist() == [7, 8, 9]
    assert batch.labels.tolist() == [0.0, 1.0, 0.0, 1.0] and batch.dense_features.shape == (4, 2)
    legacy = to_batch(s, [1, 0], ["b", "a"]).sparse_features  # the old (columns, keys) call
    assert legacy.keys() == ["b", "a"] and legacy.values().tolist() == [20, 21, 22, 23, 10, 11, 12, 13]
    with pytest.raises(ValueError, match="key 'zz' is not a feature"):
        to_batch(s, ["zz"], names)
    with pytest.raises(ValueError, match="no bag of that name"):
        to_batch(Samples(s.dense, s.ids, s.labels), ["title"], names)


def test_title_bag_reaches_the_model():
    """The DCN model's pooled title embedding of a sample is the sum of its tokens' rows (zero for an empty bag)."""
    src = CriteoSearchSource(SAMPLE, val_fraction=0.0, rows_per_table=64)
    s = next(src.train_batches(16))
    torch.manual_seed(0)
    spec = FeatureSpec(tuple(src.feature_names), tuple(src.table_rows), src.num_dense)
    model = build_model("dcn", spec, embedding_dim=8)
    batch = to_batch(s, list(spec.names), src.feature_names)
    pooled = model.ebc(batch.sparse_features).to_dict()
    weight = model.ebc.embedding_bags["t_product_title"].weight
    for i, toks in enumerate(bag_rows(s.bags["product_title"])):
        want = weight[toks].sum(0) if toks else torch.zeros(8)
        torch.testing.assert_close(pooled["product_title"][i].detach(), want.detach())
    assert (s.bags["product_title"].lengths == 0).any() and (s.bags["product_title"].lengths > 1).any()
    user = model.ebc.embedding_bags["t_user_id"].weight[torch.from_numpy(s.ids[:, -1])]
    torch.testing.assert_close(pooled["user_id"].detach(), user.detach())


# --------------------------------------------------------------------------------------------- the app


def test_app_trains_on_the_sample(tmp_path):
    """The paper's DCN workload under Herald on 2 ranks: the multi-hot title bags are scheduled like any feature."""
    p = run_app(
        [
            "data=criteo_search",
            f"data.path={SAMPLE}",
            "data.val_fraction=0.2",
            "model=dcn",
            "scheduler=herald",
            "trainer.steps=3",
            "trainer.batch_size=8",
            "trainer.log_interval=1",
            f"run_dir={tmp_path}",
        ],
        nproc=2,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["steps"] == 3 and m["world_size"] == 2 and m["config"]["data"]["name"] == "criteo_search"
    assert m["module_rows_by_kind"]["hit"] > 0 and m["module_rows_by_kind"]["shared_value"] > 0
    assert math.isfinite(m["first_loss"]) and math.isfinite(m["logloss"])
    assert "criteo_search ({'features': 17" in p.stdout
