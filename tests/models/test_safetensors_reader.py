"""Safetensors reader: single files and sharded repos as zero-copy views; malformed headers rejected."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.errors import ModelFormatError, ModelNotFoundError
from models.formats import open_safetensors, open_safetensors_repo
from tests.models.mmap_util import ends_in_mmap, header_corruptions

RNG = np.random.default_rng(1)


def sample() -> dict[str, np.ndarray]:
    return {
        "w.f32": RNG.standard_normal((3, 5)).astype(np.float32),
        "w.f16": RNG.standard_normal((4,)).astype(np.float16),
        "w.f64": RNG.standard_normal((2, 2, 2)),
        "w.i32": RNG.integers(-9, 9, (6,), dtype=np.int32),
        "w.i64": RNG.integers(-9, 9, (1, 3), dtype=np.int64),
        "w.u8": RNG.integers(0, 255, (7,), dtype=np.uint8),
        "w.bool": np.array([True, False, True]),
        "w.empty": np.zeros((0, 4), dtype=np.float32),
        "w.scalar": np.array(2.5, dtype=np.float32),
    }


def st_bytes(
    entries: dict, data: bytes, metadata: dict | None = None, raw_header: bytes | None = None
) -> bytes:
    """A hand-made safetensors file: u64 header length, JSON header padded to 8, data."""
    header = dict(entries)
    if metadata is not None:
        header["__metadata__"] = metadata
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def entry(dtype: str, shape, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


GOOD = {"a": entry("F32", (2,), 0, 8), "b": entry("I32", (2,), 8, 16)}
GOOD_DATA = np.array([1.5, -2], np.float32).tobytes() + np.array([7, 8], np.int32).tobytes()


def write(tmp_path: Path, blob: bytes, name: str = "m.safetensors") -> Path:
    p = tmp_path / name
    p.write_bytes(blob)
    return p


def expect_error(tmp_path: Path, blob: bytes, words: str) -> None:
    p = write(tmp_path, blob)
    with pytest.raises(ModelFormatError) as e:
        open_safetensors(p)
    assert e.value.path == p
    assert words in e.value.problem, e.value.problem


# ---------------------------------------------------------------- valid files


def test_matches_safetensors_load_file(tmp_path):
    src = sample()
    path = tmp_path / "m.safetensors"
    save_file(src, path, metadata={"format": "np", "note": "hi"})
    ref = load_file(path)
    with open_safetensors(path) as m:
        assert set(m.tensors) == set(src)
        assert m.metadata == {"format": "np", "note": "hi"}
        for name, want in ref.items():
            got = m.array(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            np.testing.assert_array_equal(got, want, err_msg=name)
            t = m.tensors[name]
            assert t.shape == want.shape and t.file == path and t.nbytes == want.nbytes
        assert m.tensors["w.f32"].dtype == "F32" and m.tensors["w.bool"].dtype == "BOOL"


def test_views_are_zero_copy_and_read_only(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(sample(), path)
    with open_safetensors(path) as m:
        for name in m.tensors:
            a = m.array(name)
            assert not a.flags.owndata and not a.flags.writeable, name
            assert ends_in_mmap(a), name
        a, b = m.array("w.f32"), m.array("w.f32")
        assert np.shares_memory(a, b)
        start, end = m.tensors["w.f32"].offsets
        assert path.read_bytes()[start:end] == a.tobytes()


def test_bf16_and_f8_as_raw_bits(tmp_path):
    bf16 = np.array([0x3F80, 0xC000, 0x0000], np.uint16)  # 1.0, -2.0, 0.0
    f8 = np.array([[0x38, 0xB8], [0x00, 0x7E]], np.uint8)
    blob = st_bytes({"x": entry("BF16", (3,), 0, 6), "s": entry("F8_E4M3", (2, 2), 6, 10)},
                    bf16.tobytes() + f8.tobytes())
    with open_safetensors(write(tmp_path, blob)) as m:
        x, s = m.array("x"), m.array("s")
        assert x.dtype == np.uint16 and s.dtype == np.uint8
        np.testing.assert_array_equal(x, bf16)
        np.testing.assert_array_equal(s, f8)
        assert m.tensors["x"].dtype == "BF16" and m.tensors["s"].dtype == "F8_E4M3"
        assert m.metadata == {}


def test_close_keeps_handed_out_views_alive(tmp_path):
    m = open_safetensors(write(tmp_path, st_bytes(GOOD, GOOD_DATA)))
    a = m.array("a")
    m.close()
    np.testing.assert_array_equal(a, [1.5, -2])
    with pytest.raises(ValueError, match="closed"):
        m.array("a")


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError):
        open_safetensors(tmp_path / "nope.safetensors")


# ---------------------------------------------------------------- malformed files


def test_baseline_is_valid(tmp_path):
    with open_safetensors(write(tmp_path, st_bytes(GOOD, GOOD_DATA))) as m:
        np.testing.assert_array_equal(m.array("b"), [7, 8])


def test_too_small(tmp_path):
    expect_error(tmp_path, b"\x01\x02", "too small")


def test_header_length_over_limit(tmp_path):
    expect_error(tmp_path, struct.pack("<Q", 2**40) + b"{}", "limit")


def test_header_length_past_eof(tmp_path):
    expect_error(tmp_path, struct.pack("<Q", 1000) + b"{}", "runs past the end")


def test_invalid_json(tmp_path):
    expect_error(tmp_path, st_bytes({}, b"", raw_header=b'{"a": '), "not valid JSON")


def test_header_not_utf8(tmp_path):
    expect_error(tmp_path, st_bytes({}, b"", raw_header=b'{"\xff": 1}'), "not valid JSON")


def test_header_not_an_object(tmp_path):
    expect_error(tmp_path, st_bytes({}, b"", raw_header=b"[1, 2]"), "not a JSON object")


def test_duplicate_name_in_header(tmp_path):
    raw = b'{"a": ' + json.dumps(GOOD["a"]).encode() + b', "a": ' + json.dumps(GOOD["a"]).encode() + b"}"
    expect_error(tmp_path, st_bytes({}, GOOD_DATA, raw_header=raw), "names 'a' twice")


def test_metadata_values_must_be_strings(tmp_path):
    expect_error(tmp_path, st_bytes(GOOD, GOOD_DATA, metadata={"n": 3}), "__metadata__")


def test_metadata_must_be_an_object(tmp_path):
    expect_error(tmp_path, st_bytes(GOOD, GOOD_DATA, metadata=[]), "__metadata__")


def test_entry_missing_field(tmp_path):
    expect_error(tmp_path, st_bytes({"a": {"dtype": "F32", "shape": [2]}}, GOOD_DATA), "exactly dtype")


def test_unknown_dtype(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F12", (2,), 0, 8)}, GOOD_DATA), "unknown dtype 'F12'")


def test_sub_byte_dtype(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F4", (16,), 0, 8)}, GOOD_DATA), "sub-byte")


def test_negative_dim(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F32", (-2,), 0, 8)}, GOOD_DATA), "invalid shape")


def test_float_dim(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F32", (2.0,), 0, 8)}, GOOD_DATA), "invalid shape")


def test_offsets_past_data(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F32", (4,), 8, 24)}, GOOD_DATA), "outside")


def test_offsets_reversed(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F32", (0,), 8, 0)}, GOOD_DATA), "outside")


def test_negative_offset(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F32", (2,), -8, 0)}, GOOD_DATA), "outside")


def test_nbytes_mismatch(tmp_path):
    expect_error(tmp_path, st_bytes({"a": entry("F32", (3,), 0, 8)}, GOOD_DATA), "needs 12")


def test_overlapping_tensors(tmp_path):
    entries = {"a": entry("F32", (2,), 0, 8), "b": entry("I32", (2,), 4, 12)}
    expect_error(tmp_path, st_bytes(entries, GOOD_DATA), "'a' and 'b' overlap")


def test_truncated_data(tmp_path):
    expect_error(tmp_path, st_bytes(GOOD, GOOD_DATA[:-1]), "outside")


# ---------------------------------------------------------------- repos


def make_sharded(folder: Path) -> dict[str, np.ndarray]:
    folder.mkdir()
    shard1 = {"model.embed.weight": RNG.standard_normal((4, 3)).astype(np.float32)}
    shard2 = {"model.norm.weight": np.ones(3, np.float16), "lm_head.weight": np.eye(3, dtype=np.float32)}
    save_file(shard1, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(shard2, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {n: "model-00001-of-00002.safetensors" for n in shard1}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in shard2}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return shard1 | shard2


def test_sharded_repo_with_index(tmp_path):
    src = make_sharded(tmp_path / "repo")
    # a stray file the index does not name is not read
    save_file({"other": np.zeros(1, np.float32)}, tmp_path / "repo" / "consolidated.safetensors")
    with open_safetensors_repo(tmp_path / "repo") as m:
        assert set(m.tensors) == set(src)
        assert m.metadata == {"format": "pt"}
        assert [p.name for p in m.files] == ["model-00001-of-00002.safetensors",
                                             "model-00002-of-00002.safetensors"]
        for name, want in src.items():
            got = m.array(name)
            np.testing.assert_array_equal(got, want)
            assert ends_in_mmap(got)
        assert m.tensors["lm_head.weight"].file.name == "model-00002-of-00002.safetensors"


def test_index_names_missing_shard(tmp_path):
    make_sharded(tmp_path / "repo")
    (tmp_path / "repo" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="missing"):
        open_safetensors_repo(tmp_path / "repo")


def test_index_lists_tensor_not_in_shard(tmp_path):
    make_sharded(tmp_path / "repo")
    index_path = tmp_path / "repo" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="ghost.*in no shard"):
        open_safetensors_repo(tmp_path / "repo")


def test_index_puts_tensor_in_wrong_shard(tmp_path):
    make_sharded(tmp_path / "repo")
    index_path = tmp_path / "repo" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="but it is in model-00002"):
        open_safetensors_repo(tmp_path / "repo")


def test_index_shard_outside_folder(tmp_path):
    make_sharded(tmp_path / "repo")
    index_path = tmp_path / "repo" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "../model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="invalid shard name"):
        open_safetensors_repo(tmp_path / "repo")


def test_index_not_json(tmp_path):
    make_sharded(tmp_path / "repo")
    (tmp_path / "repo" / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        open_safetensors_repo(tmp_path / "repo")


def test_duplicate_tensor_across_shards(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    save_file({"x": np.zeros(2, np.float32)}, folder / "a.safetensors")
    save_file({"x": np.ones(2, np.float32)}, folder / "b.safetensors")
    with pytest.raises(ModelFormatError, match="'x' is also in a.safetensors"):
        open_safetensors_repo(folder)


def test_repo_without_index_prefers_model_safetensors(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    save_file({"x": np.zeros(2, np.float32)}, folder / "model.safetensors")
    save_file({"x": np.ones(2, np.float32)}, folder / "consolidated.safetensors")
    with open_safetensors_repo(folder) as m:
        assert [p.name for p in m.files] == ["model.safetensors"]
        np.testing.assert_array_equal(m.array("x"), [0, 0])


def test_repo_without_index_reads_all_shards(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    save_file({"x": np.zeros(2, np.float32)}, folder / "a.safetensors")
    save_file({"y": np.ones(2, np.float32)}, folder / "b.safetensors")
    with open_safetensors_repo(folder) as m:
        assert list(m.tensors) == ["x", "y"]


def test_repo_with_no_safetensors(tmp_path):
    (tmp_path / "repo").mkdir()
    with pytest.raises(ModelNotFoundError):
        open_safetensors_repo(tmp_path / "repo")
    with pytest.raises(ModelNotFoundError):
        open_safetensors_repo(tmp_path / "missing")


def test_bad_shard_in_repo_reports_that_shard(tmp_path):
    make_sharded(tmp_path / "repo")
    bad = tmp_path / "repo" / "model-00002-of-00002.safetensors"
    bad.write_bytes(st_bytes({"lm_head.weight": entry("F32", (3, 3), 0, 36)}, b"\0" * 8))
    with pytest.raises(ModelFormatError) as e:
        open_safetensors_repo(tmp_path / "repo")
    assert e.value.path == bad


def test_random_header_corruption_never_escapes(tmp_path):
    # 400 seeded corruptions of a real header: ModelFormatError or a file whose every view is in bounds
    good = tmp_path / "good.safetensors"
    save_file(sample(), good)
    blob = good.read_bytes()
    header_end = 8 + struct.unpack_from("<Q", blob)[0]
    p = tmp_path / "fuzz.safetensors"
    rejected = 0
    for b in header_corruptions(blob, header_end):
        p.write_bytes(b)
        try:
            m = open_safetensors(p)
        except ModelFormatError:
            rejected += 1
            continue
        for name, t in m.tensors.items():
            assert t.offsets[1] <= len(b) and m.array(name).nbytes == t.nbytes
        m.close()
    assert rejected > 200
