"""Streaming loaders of the real logs (Criteo, Avazu, MovieLens): values parsed from the real samples in
../shared/data, the split, streaming, malformed-row accounting and wrong-format errors."""

from __future__ import annotations

import datetime
import gzip
import math

import numpy as np
import pytest

from herald_torchrec.data import _stream
from herald_torchrec.data._stream import parse_u64, validation_mask
from herald_torchrec.data.avazu import AVAZU_COLUMNS, AvazuSource, decode_hour
from herald_torchrec.data.criteo import CriteoSource, criteo_table_rows
from herald_torchrec.data.errors import DataFormatError
from herald_torchrec.data.movielens import MovieLensSource
from herald_torchrec.data.synthetic import CRITEO_KAGGLE_ROWS
from tests.helpers.ranks import REPO_ROOT

DATA = REPO_ROOT.parent / "shared" / "data"
CRITEO = DATA / "criteo_sample.tsv"
AVAZU = DATA / "avazu_sample.csv"
MOVIELENS = DATA / "movielens_ratings_sample.csv"
needs_samples = pytest.mark.skipif(
    not (CRITEO.exists() and AVAZU.exists() and MOVIELENS.exists()),
    reason=f"real-format samples not found in {DATA} (the shared folder beside the repo)",
)

M64 = (1 << 64) - 1


# ------------------------------------------------------------------------------ pure-Python references


def ref_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_fnv1a64(b: bytes) -> int:
    h = 0xCBF29CE484222325
    for c in b:
        h = ((h ^ c) * 0x100000001B3) & M64
    return h


def ref_criteo(line: str, rows: list[int]) -> tuple[float, list[float], list[int]]:
    f = line.rstrip("\n").split("\t")
    dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]]
    ids = [int(h, 16) % (r - 1) if h else r - 1 for h, r in zip(f[14:], rows)]
    return float(f[0]), dense, ids


def collect(batches) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    bs = list(batches)
    if not bs:
        return np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int64), np.zeros(0, np.float32), 0
    return (
        np.concatenate([b.dense for b in bs]),
        np.concatenate([b.ids for b in bs]),
        np.concatenate([b.labels for b in bs]),
        len(bs),
    )


def criteo_line(i: int, label: int | None = None) -> str:
    """A synthetic Criteo row whose C1 is the row index in hex (so the id of C1 gives the row back)."""
    lab = label if label is not None else i % 2
    dense = [str(i), "", str(-i)] + [str(k) for k in range(10)]
    cats = [format(i, "08x")] + ["" if k % 3 == 0 else format(k * 7919, "08x") for k in range(25)]
    return "\t".join([str(lab)] + dense + cats) + "\n"


BIG = [1 << 20] * 26  # C1 = row index (< 2^20 - 1) comes back unchanged


# ---------------------------------------------------------------------------------------------- Criteo


@needs_samples
def test_criteo_sample_values_and_counts():
    src = CriteoSource(CRITEO, val_fraction=0.0)
    assert src.num_dense == 13 and len(src.table_rows) == 26 and src.feature_names[0] == "C1"
    assert src.table_rows == [c + 1 for c in CRITEO_KAGGLE_ROWS]
    dense, ids, labels, nb = collect(src.train_batches(32))
    assert nb == 6 and ids.shape == (192, 26) and dense.shape == (192, 13) and dense.dtype == np.float32
    assert ids.dtype == np.int64 and labels.dtype == np.float32
    assert src.stats.rows_read == 200 and src.stats.rows_malformed == 0
    assert src.stats.samples_yielded == 192 and src.stats.samples_dropped == 8 and src.stats.complete

    # first row: 0 <tab> '' 3 260 '' 17668 ... | 05db9164 ... C19 and C20 empty
    assert labels[0] == 0.0
    assert dense[0, 0] == 0.0  # I1 empty -> 0
    assert dense[0, 1] == pytest.approx(math.log1p(3))
    assert dense[0, 2] == pytest.approx(math.log1p(260))
    assert dense[0, 4] == pytest.approx(math.log1p(17668))
    assert ids[0, 0] == 0x05DB9164 % (1460 + 1 - 1)
    assert ids[0, 2] == 0x9143C832 % 10131227
    assert ids[0, 18] == src.missing_ids[18] == 2173  # C19 (2173 values) empty -> last row of its table
    assert ids[0, 25] == src.missing_ids[25] == 142572
    # second row has I2 = -1 -> log1p(max(-1, 0)) = 0
    assert dense[1, 1] == 0.0 and dense[1, 2] == pytest.approx(math.log1p(19))

    # every row equals a pure-Python parse of the file
    lines = CRITEO.read_text().splitlines(keepends=True)
    for r, line in enumerate(lines[:192]):
        lab, d, i = ref_criteo(line, src.table_rows)
        assert labels[r] == lab
        np.testing.assert_allclose(dense[r], d, rtol=1e-6)
        assert ids[r].tolist() == i
    assert labels.sum() == sum(line[0] == "1" for line in lines[:192])
    assert all((0 <= ids[:, t]).all() and (ids[:, t] < src.table_rows[t]).all() for t in range(26))


@needs_samples
def test_criteo_table_options_and_mix_hash():
    capped = CriteoSource(CRITEO, max_rows_per_table=1000, val_fraction=0.0)
    assert capped.table_rows == criteo_table_rows(1000)
    assert capped.table_rows[0] == 1000 and capped.table_rows[8] == 4  # 3 + missing row
    _, ids, _, _ = collect(capped.train_batches(200))
    assert ids[0, 0] == 0x05DB9164 % 999 and ids[0, 18] == capped.table_rows[18] - 1

    explicit = CriteoSource(CRITEO, table_rows=[101] * 26, hash_mode="mix", val_fraction=0.0)
    _, mids, _, _ = collect(explicit.train_batches(200))
    assert mids[0, 0] == ref_splitmix64(0x05DB9164) % 100
    assert mids[0, 18] == 100  # missing stays the last row
    assert mids.max() <= 100 and mids.min() >= 0

    with pytest.raises(ValueError, match="hash_mode"):
        CriteoSource(CRITEO, hash_mode="md5")
    with pytest.raises(ValueError, match="26 sizes"):
        CriteoSource(CRITEO, table_rows=[10] * 3)
    with pytest.raises(ValueError, match="global_batch"):
        CriteoSource(CRITEO).train_batches(0)


@needs_samples
def test_criteo_split_disjoint_deterministic():
    a = CriteoSource(CRITEO, val_fraction=0.25)
    _, tr, _, _ = collect(a.train_batches(1))
    _, va, _, _ = collect(a.val_batches(1))
    assert len(tr) + len(va) == 200 and len(va) > 20
    want_val = validation_mask(np.arange(200), 0.25)
    assert len(va) == int(want_val.sum())
    all_ids = CriteoSource(CRITEO, val_fraction=0.0)
    _, every, _, _ = collect(all_ids.train_batches(1))
    np.testing.assert_array_equal(tr, every[~want_val])
    np.testing.assert_array_equal(va, every[want_val])
    b = CriteoSource(CRITEO, val_fraction=0.25)
    _, tr2, _, _ = collect(b.train_batches(1))
    np.testing.assert_array_equal(tr, tr2)
    assert not validation_mask(np.arange(1000), 0.0).any() and validation_mask(np.arange(1000), 1.0).all()
    # a different split seed gives a different split
    assert (validation_mask(np.arange(1000), 0.3, split_seed=1) != validation_mask(np.arange(1000), 0.3)).any()


def test_criteo_streams_20k_rows(tmp_path, monkeypatch):
    path = tmp_path / "day_0"
    with open(path, "w") as f:
        for i in range(20_000):
            f.write(criteo_line(i))
    size = path.stat().st_size

    opened = []
    real_open = _stream.open_data

    def spy(p):
        fh = real_open(p)
        opened.append(fh)
        return fh

    monkeypatch.setattr(_stream, "open_data", spy)
    src = CriteoSource(path, table_rows=BIG, val_fraction=0.1, chunk_bytes=16 << 10)
    it = src.train_batches(1000)
    first = next(it)
    assert opened[-1].tell() < size // 10  # the first batch came before most of the file was read
    rest = list(it)
    batches = [first] + rest
    rows = np.concatenate([b.ids[:, 0] for b in batches])
    val = validation_mask(np.arange(20_000), 0.1)
    train_rows = np.flatnonzero(~val)
    assert len(batches) == len(train_rows) // 1000 and all(len(b) == 1000 for b in batches)
    np.testing.assert_array_equal(rows, train_rows[: len(rows)])  # file order, train rows only
    labels = np.concatenate([b.labels for b in batches])
    np.testing.assert_array_equal(labels, (rows % 2).astype(np.float32))
    d = np.concatenate([b.dense for b in batches])
    np.testing.assert_allclose(d[:, 0], np.log1p(rows), rtol=1e-6)
    assert (d[:, 2] == 0).all()  # negative -> 0
    assert src.stats.rows_read == 20_000 and src.stats.samples_dropped == len(train_rows) % 1000

    vrows = np.concatenate([b.ids[:, 0] for b in src.val_batches(100)])
    np.testing.assert_array_equal(vrows, np.flatnonzero(val)[: len(vrows)])
    assert 0.08 < val.mean() < 0.12

    # gzip gives the same stream
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    zsrc = CriteoSource(gz, table_rows=BIG, val_fraction=0.1)
    zrows = np.concatenate([b.ids[:, 0] for b in zsrc.train_batches(1000)])
    np.testing.assert_array_equal(zrows, rows)


def test_criteo_malformed_rows_counted(tmp_path, capsys):
    path = tmp_path / "bad.tsv"
    good = [criteo_line(i) for i in range(12)]
    lines = (
        good[:6]
        + [
            "1\t2\t3\n",  # line 7: wrong column count
            "x" + criteo_line(100)[1:],  # bad label
            criteo_line(101).replace("00000065", "zz000065"),  # bad hex in C1
            criteo_line(102).replace("\t102\t", "\t1.5\t", 1),  # non-integer dense
        ]
        + good[6:]
        + ["\n"]
    )  # trailing blank line: also malformed
    assert lines[7].split("\t")[0] == "x"
    path.write_text("".join(lines))
    src = CriteoSource(path, table_rows=BIG, val_fraction=0.0)
    _, ids, _, nb = collect(src.train_batches(4))
    assert nb == 3 and ids[:, 0].tolist() == list(range(12))
    assert src.stats.rows_read == 17 and src.stats.rows_malformed == 5
    assert src.stats.first_malformed_line == 7 and "40 tab-separated columns" in src.stats.first_malformed_reason
    err = capsys.readouterr().err
    assert "5 malformed of 17" in err and "line 7" in err and str(path) in err
    for bad, what in [(lines[7], "label"), (lines[8], "C1 must be a hex"), (lines[9], "I1 must be an integer")]:
        assert what in src._explain(bad.rstrip("\n").encode())


def test_wrong_format_and_missing_files(tmp_path):
    missing = tmp_path / "nope.tsv"
    for cls in (CriteoSource, AvazuSource, MovieLensSource):
        with pytest.raises(FileNotFoundError, match="nope.tsv"):
            cls(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    for cls in (CriteoSource, AvazuSource, MovieLensSource):
        with pytest.raises(DataFormatError, match=r"empty\.txt:1: the file is empty"):
            cls(empty)

    # Avazu-like CSV given to the Criteo loader: every line has 1 tab-field
    csv = tmp_path / "clicks.csv"
    csv.write_text("id,click,hour\n" + "1,0,14102100\n" * 10)
    with pytest.raises(DataFormatError) as e:
        CriteoSource(csv)
    assert isinstance(e.value, ValueError) and e.value.line == 1 and e.value.path == str(csv)
    assert "clicks.csv:1:" in str(e.value) and "40 tab-separated columns" in str(e.value)

    # first 5 data lines malformed, then good ones: still refused
    tsv = tmp_path / "garbage_head.tsv"
    tsv.write_text("".join("garbage\n" for _ in range(5)) + "".join(criteo_line(i) for i in range(5)))
    with pytest.raises(DataFormatError, match=r"garbage_head\.tsv:1: the first 5 data lines"):
        CriteoSource(tsv)
    # fewer than 5 lines, all malformed
    tiny = tmp_path / "tiny.tsv"
    tiny.write_text("a\tb\n")
    with pytest.raises(DataFormatError, match=r"tiny\.tsv:1: all 1 data lines are malformed"):
        CriteoSource(tiny)

    with pytest.raises(DataFormatError, match=r"clicks\.csv:1: not the Avazu header"):
        AvazuSource(csv)
    header_only = tmp_path / "header_only.csv"
    header_only.write_text(",".join(AVAZU_COLUMNS) + "\n")
    with pytest.raises(DataFormatError, match=r"header_only\.csv:2: no data rows"):
        AvazuSource(header_only)
    with pytest.raises(DataFormatError, match=r"clicks\.csv:1: not the MovieLens ratings.csv header"):
        MovieLensSource(csv)
    if CRITEO.exists():
        with pytest.raises(DataFormatError, match=r"criteo_sample\.tsv:1: not the Avazu header"):
            AvazuSource(CRITEO)
        with pytest.raises(DataFormatError, match=r"criteo_sample\.tsv:1: the first 5 data lines"):
            MovieLensSource(CRITEO)  # tab-separated -> u.data guess, 40 columns instead of 4


# ----------------------------------------------------------------------------------------------- Avazu


@needs_samples
def test_avazu_sample_values():
    src = AvazuSource(AVAZU, val_fraction=0.0)
    assert src.feature_names[:3] == ["hour_of_day", "weekday", "C1"] and len(src.feature_names) == 23
    assert src.table_rows[:2] == [24, 7] and src.num_dense == 2
    dense, ids, labels, nb = collect(src.train_batches(10))
    assert nb == 10 and ids.shape == (100, 23) and dense.shape == (100, 2)
    assert src.stats.rows_read == 100 and src.stats.rows_malformed == 0  # incl. ids above 2^63

    lines = AVAZU.read_text().splitlines()
    assert lines[0] == ",".join(AVAZU_COLUMNS)
    rows = [ln.split(",") for ln in lines[1:]]
    big = [int(r[0]) for r in rows if int(r[0]) >= 1 << 63]
    assert big, "the sample should hold ids above 2^63"
    assert parse_u64(rows[1][0]) == 10000169349117863715 > (1 << 63)
    assert parse_u64(b"18446744073709551615") == M64
    for bad in ("18446744073709551616", "-1", "1e5", "", "12a"):
        with pytest.raises(ValueError):
            parse_u64(bad)

    np.testing.assert_array_equal(labels, [float(r[1]) for r in rows])
    # 14102100 = 2014-10-21 (a Tuesday), 00h
    assert ids[0, 0] == 0 and ids[0, 1] == 1
    assert dense[0].tolist() == [0.0, pytest.approx(1 / 6)]
    for r, fields in enumerate(rows):
        want = [ref_splitmix64(ref_fnv1a64(v.encode())) % n for v, n in zip(fields[3:], src.table_rows[2:])]
        assert ids[r, 2:].tolist() == want
    assert ids[0, 2] == ref_splitmix64(ref_fnv1a64(b"1005")) % 16  # C1 = 1005, table 16


def test_avazu_hours_ids_and_modes(tmp_path):
    header = ",".join(AVAZU_COLUMNS) + "\n"
    rest = (
        "1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,ddd2926e,44956a24,"
        "1,2,15706,320,50,1722,0,35,-1,79\n"
    )
    body = [
        "18446744073709551615,1,14102913," + rest,  # max u64; 2014-10-29 (Wednesday) 13h
        "5,0,16022923," + rest,  # 2016-02-29 (Monday, leap day) 23h
        "18446744073709551616,0,14102100," + rest,  # id 2^64: malformed
        "7,0,14023000," + rest,  # Feb 30th: malformed
        "8,0,14102124," + rest,  # hour 24: malformed
        "9,1,14102105," + rest,  # 2014-10-21 (Tuesday) 5h
    ]
    path = tmp_path / "train.csv"
    path.write_text(header + "".join(body))
    src = AvazuSource(path, val_fraction=0.0, time_features="categorical")
    assert src.num_dense == 0
    dense, ids, labels, _ = collect(src.train_batches(1))
    assert dense.shape == (3, 0) and dense.dtype == np.float32
    assert ids[:, :2].tolist() == [[13, 2], [23, 0], [5, 1]]
    assert labels.tolist() == [1.0, 0.0, 1.0]
    assert src.stats.rows_malformed == 3 and src.stats.first_malformed_line == 4
    assert "unsigned 64-bit" in src.stats.first_malformed_reason
    assert decode_hour(14102913) == (13, datetime.date(2014, 10, 29).weekday()) == (13, 2)

    dsrc = AvazuSource(path, val_fraction=0.0, time_features="dense", table_rows=[1000] * 21)
    d2, i2, _, _ = collect(dsrc.train_batches(3))
    assert dsrc.feature_names[0] == "C1" and i2.shape == (3, 21) and dsrc.table_rows == [1000] * 21
    np.testing.assert_allclose(d2, [[13 / 23, 2 / 6], [1.0, 0.0], [5 / 23, 1 / 6]], rtol=1e-6)
    assert i2[0, 0] == ref_splitmix64(ref_fnv1a64(b"1005")) % 1000


# ------------------------------------------------------------------------------------------- MovieLens


@needs_samples
def test_movielens_remap_and_counts():
    src = MovieLensSource(MOVIELENS, num_negatives=0, val_fraction=0.2)
    rows = [ln.split(",") for ln in MOVIELENS.read_text().splitlines()[1:]]
    users = list(dict.fromkeys(int(r[0]) for r in rows))
    items = list(dict.fromkeys(int(r[1]) for r in rows))
    assert src.table_rows == [len(users), len(items)] and src.feature_names == ["user", "item"]
    assert src.user_map == {u: k for k, u in enumerate(users)} and src.user_map[3299] == 0
    assert src.item_map[235] == 0 and src.item_map[3256] == 1
    dense, tr, trl, _ = collect(src.train_batches(1))
    _, va, _, _ = collect(src.val_batches(1))
    assert dense.shape == (len(tr), 0) and len(tr) + len(va) == 200
    both = np.concatenate([tr, va])
    assert sorted(set(both[:, 0].tolist())) == list(range(len(users)))
    assert sorted(set(both[:, 1].tolist())) == list(range(len(items)))
    assert (trl == 1.0).all()  # NCF default: every rating is a positive
    val = validation_mask(np.arange(200), 0.2)
    want = [[src.user_map[int(r[0])], src.item_map[int(r[1])]] for r, v in zip(rows, val) if v]
    assert va.tolist() == want


@needs_samples
def test_movielens_negatives_deterministic():
    a = MovieLensSource(MOVIELENS, num_negatives=4, val_fraction=0.0)
    _, ids, labels, nb = collect(a.train_batches(50))
    assert nb == 20 and len(ids) == 1000 and a.stats.samples_yielded == 1000
    groups_ids = ids.reshape(200, 5, 2)
    groups_lab = labels.reshape(200, 5)
    assert (groups_lab[:, 0] == 1).all() and (groups_lab[:, 1:] == 0).all()
    assert (groups_ids[:, :, 0] == groups_ids[:, :1, 0]).all()  # same user
    assert (groups_ids[:, 1:, 1] != groups_ids[:, :1, 1]).all()  # never the positive's own item
    assert ids[:, 1].min() >= 0 and ids[:, 1].max() < a.table_rows[1]
    assert len(set(groups_ids[:, 1:, 1].ravel().tolist())) > 100  # spread over the items
    b = MovieLensSource(MOVIELENS, num_negatives=4, val_fraction=0.0)
    _, ids_b, labels_b, _ = collect(b.train_batches(50))
    np.testing.assert_array_equal(ids, ids_b)
    np.testing.assert_array_equal(labels, labels_b)
    c = MovieLensSource(MOVIELENS, num_negatives=4, val_fraction=0.0, neg_seed=1)
    _, ids_c, _, _ = collect(c.train_batches(50))
    assert (ids_c[:, 1] != ids[:, 1]).any() and (ids_c[::5] == ids[::5]).all()

    # explicit threshold: rating < 4 -> one label-0 row, no sampled negatives
    t = MovieLensSource(MOVIELENS, num_negatives=2, positive_threshold=4.0, val_fraction=0.0)
    _, _, tl, _ = collect(t.train_batches(1))
    ratings = [float(ln.split(",")[2]) for ln in MOVIELENS.read_text().splitlines()[1:]]
    npos = sum(r >= 4.0 for r in ratings)
    assert len(tl) == 3 * npos + (200 - npos) and tl.sum() == npos


def test_movielens_udata_dat_and_malformed(tmp_path, capsys):
    udata = tmp_path / "u.data"
    udata.write_text(
        "196\t242\t3\t881250949\n186\t302\t3\t891717742\n196\t377\t1\t878887116\nx\t1\t2\t3\n22\t377\t4.5\t878887116\n"
    )
    src = MovieLensSource(udata, num_negatives=0, val_fraction=0.0)
    assert src.fmt == "udata" and src.table_rows == [3, 3]
    _, ids, _, _ = collect(src.train_batches(1))
    assert ids.tolist() == [[0, 0], [1, 1], [0, 2], [2, 2]]
    assert src.stats.rows_malformed == 1 and src.stats.first_malformed_line == 4
    assert "user id must be an integer" in src.stats.first_malformed_reason
    assert "line 4" in capsys.readouterr().err

    dat = tmp_path / "ratings.dat"
    dat.write_text("1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n")
    d = MovieLensSource(dat, num_negatives=0, val_fraction=0.0)
    assert d.fmt == "dat" and d.table_rows == [2, 2]
    _, dids, _, _ = collect(d.train_batches(3))
    assert dids.tolist() == [[0, 0], [0, 1], [1, 0]]

    noheader = tmp_path / "ratings.csv"
    noheader.write_text("1,2,3.5,4\n")
    with pytest.raises(DataFormatError, match=r"ratings\.csv:1: not the MovieLens ratings.csv header"):
        MovieLensSource(noheader)


def test_block_boundaries_crlf_and_late_malformed(tmp_path):
    # lines cut across tiny blocks (smaller than one line) give the same stream as one big block
    path = tmp_path / "t.tsv"
    lines = [criteo_line(i) for i in range(3000)]
    lines[1500] = "junk\n"
    lines[2500] = "1\t2\n"
    path.write_text("".join(lines[:-1]) + lines[-1].rstrip("\n"))  # no final newline
    ref = CriteoSource(path, table_rows=BIG, val_fraction=0.0)
    _, ids, _, _ = collect(ref.train_batches(7))
    for chunk in (7, 4096):
        small = CriteoSource(path, table_rows=BIG, val_fraction=0.0, chunk_bytes=chunk)
        _, ids2, _, _ = collect(small.train_batches(7))
        np.testing.assert_array_equal(ids2, ids)
        assert small.stats.rows_read == 3000 and small.stats.rows_malformed == 2
        assert small.stats.first_malformed_line == 1501
    assert ids[:, 0].tolist() == [i for i in range(3000) if i not in (1500, 2500)][: len(ids)]
    assert len(ids) == 2998 // 7 * 7

    if AVAZU.exists():
        crlf = tmp_path / "crlf.csv"
        crlf.write_bytes(AVAZU.read_bytes().replace(b"\n", b"\r\n"))
        _, a, _, _ = collect(AvazuSource(crlf, val_fraction=0.0).train_batches(10))
        _, b, _, _ = collect(AvazuSource(AVAZU, val_fraction=0.0).train_batches(10))
        np.testing.assert_array_equal(a, b)
