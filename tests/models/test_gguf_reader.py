"""GGUF reader: agrees with gguf.GGUFReader on valid files, rejects every malformed header instantly."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from models.errors import ModelFormatError, ModelNotFoundError
from models.formats import open_gguf
from tests.models.mmap_util import ends_in_mmap, header_corruptions

RNG = np.random.default_rng(0)


# ---------------------------------------------------------------- helpers


def reader_value(field: gguf.ReaderField):
    """A GGUFReader field as the value our reader should give for it."""
    value = field.contents()
    if field.types[0] == V.ARRAY and field.types[-1] not in (V.STRING, V.ARRAY):
        return np.array(value)
    return value


def assert_same_value(ours, theirs, key):
    if isinstance(ours, np.ndarray):
        assert isinstance(theirs, np.ndarray), key
        np.testing.assert_array_equal(ours, theirs, err_msg=key)
    else:
        assert type(ours) is type(theirs), (key, ours, theirs)
        assert ours == theirs, key


def assert_matches_reference(path: Path, tensor_bytes: bool = True) -> None:
    """Metadata, tensor table and tensor bytes equal what gguf.GGUFReader reads."""
    ref = gguf.GGUFReader(path)
    with open_gguf(path) as f:
        ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == ref_keys
        for k in ref_keys:
            assert_same_value(f.metadata[k], reader_value(ref.fields[k]), k)
        assert list(f.tensors) == [t.name for t in ref.tensors]
        for rt in ref.tensors:
            t = f.tensors[rt.name]
            assert t.ggml_type == int(rt.tensor_type)
            assert t.dims == tuple(int(d) for d in rt.shape)
            assert t.offset == rt.data_offset
            assert t.nbytes == rt.n_bytes
            if tensor_bytes:
                assert np.array_equal(t.raw().reshape(-1), rt.data.reshape(-1).view(np.uint8))


def write_gguf(path: Path, tensors: dict, alignment: int | None = None) -> Path:
    """Write a GGUF with every scalar/array metadata type and the given tensors via gguf.GGUFWriter.

    `tensors` maps name -> ndarray (plain types) or (uint8 blocks, quant type).
    """
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ü", "Ġthe"])
    w.add_key_value("t.ints", [1, -2, 3], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("t.floats", [0.5, -1.25], V.ARRAY, sub_type=V.FLOAT32)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sample_tensors() -> dict:
    x = RNG.standard_normal((8, 64)).astype(np.float32)
    return {
        "f32": RNG.standard_normal((3, 4, 8)).astype(np.float32),
        "f16": RNG.standard_normal((5, 16)).astype(np.float16),
        "f64": RNG.standard_normal(7),
        "i8": RNG.integers(-128, 127, (2, 9), dtype=np.int8),
        "i16": RNG.integers(-999, 999, (4, 3), dtype=np.int16),
        "i32": RNG.integers(-99999, 99999, (2, 2, 2, 3), dtype=np.int32),
        "bf16": (gguf.quants.quantize(x[:2], Q.BF16), Q.BF16),
        "q8_0": (gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0),
        "q4_1": (gguf.quants.quantize(x, Q.Q4_1), Q.Q4_1),
    }


# Hand-made files, for headers GGUFWriter refuses to write.


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def tinfo(name: str, dims, ggml_type: int = Q.F32, offset: int = 0) -> bytes:
    return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ggml_type) + u64(offset)


ARCH = kv("general.architecture", V.STRING, gstr("llama"))
W_INFO = tinfo("w", (4, 2))  # F32 (2, 4): 32 bytes at data offset 0
W_DATA = np.arange(8, dtype=np.float32).tobytes()


def gguf_bytes(kvs=(ARCH,), infos=(W_INFO,), data=W_DATA, *, magic=b"GGUF", version=3,
               n_tensors=None, n_kv=None, alignment=32) -> bytes:
    head = magic + u32(version)
    head += u64(len(infos) if n_tensors is None else n_tensors) + u64(len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + data


def write(tmp_path: Path, blob: bytes) -> Path:
    p = tmp_path / "m.gguf"
    p.write_bytes(blob)
    return p


def expect_error(tmp_path: Path, blob: bytes, words: str) -> ModelFormatError:
    p = write(tmp_path, blob)
    start = time.perf_counter()
    with pytest.raises(ModelFormatError) as e:
        open_gguf(p)
    assert time.perf_counter() - start < 0.5  # fails fast: no loop over claimed counts, no allocation
    assert e.value.path == p
    assert words in e.value.problem, e.value.problem
    return e.value


# ---------------------------------------------------------------- valid files


def test_writer_file_matches_gguf_reader(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", sample_tensors())
    assert_matches_reference(path)
    with open_gguf(path) as f:
        assert f.version == 3 and f.alignment == 32 and f.data_offset % 32 == 0
        assert f.architecture == "llama"
        assert f.get("t.u64") == 2**63 + 5 and f.get("missing", 7) == 7
        assert f.metadata["t.bool"] is True
        assert f.metadata["t.strs"] == ["a", "", "ü", "Ġthe"]
        assert f.metadata["t.ints"].dtype == np.int32


def test_typed_views_equal_written_arrays(tmp_path):
    src = sample_tensors()
    with open_gguf(write_gguf(tmp_path / "a.gguf", src)) as f:
        for name in ("f32", "f16", "f64", "i8", "i16", "i32"):
            a = f.tensors[name].array()
            assert a.dtype == src[name].dtype and a.shape == src[name].shape
            np.testing.assert_array_equal(a, src[name])
            assert f.tensors[name].shape == src[name].shape
        bf16 = f.tensors["bf16"].array()
        assert bf16.dtype == np.uint16 and bf16.shape == (2, 64)
        np.testing.assert_array_equal(bf16.view(np.uint8).reshape(2, 128), src["bf16"][0])
        with pytest.raises(ModelFormatError, match="block-quantized"):
            f.tensors["q8_0"].array()


def test_quantized_rows(tmp_path):
    src = sample_tensors()
    with open_gguf(write_gguf(tmp_path / "a.gguf", src)) as f:
        t = f.tensors["q4_1"]
        assert t.type_name == "Q4_1" and t.dims == (64, 8) and t.shape == (8, 64)
        assert (t.n_rows, t.row_nbytes) == (8, 2 * 20)
        np.testing.assert_array_equal(t.raw(), src["q4_1"][0])
        vec = f.tensors["f64"]
        assert (vec.n_rows, vec.row_nbytes) == (1, 7 * 8)
        cube = f.tensors["f32"]
        assert cube.dims == (8, 4, 3) and (cube.n_rows, cube.row_nbytes) == (12, 32)


def test_views_are_zero_copy_and_read_only(tmp_path):
    with open_gguf(write_gguf(tmp_path / "a.gguf", sample_tensors())) as f:
        for t in f.tensors.values():
            raw = t.raw()
            assert raw.dtype == np.uint8 and raw.flags.c_contiguous
            assert not raw.flags.owndata and not raw.flags.writeable
            assert ends_in_mmap(raw)
        arr = f.tensors["f32"].array()
        assert ends_in_mmap(arr) and not arr.flags.writeable
        assert np.shares_memory(arr, f.tensors["f32"].raw())
        with pytest.raises(ValueError):
            arr[0, 0, 0] = 1.0


def test_custom_alignment(tmp_path):
    with open_gguf(write_gguf(tmp_path / "a.gguf", sample_tensors(), alignment=64)) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        assert all(t.offset % 64 == 0 for t in f.tensors.values())


def test_close_keeps_handed_out_views_alive(tmp_path):
    f = open_gguf(write_gguf(tmp_path / "a.gguf", sample_tensors()))
    t = f.tensors["f32"]
    arr = t.array()
    expected = arr.copy()
    f.close()
    np.testing.assert_array_equal(arr, expected)
    with pytest.raises(ValueError, match="closed"):
        t.raw()
    f.close()  # closing twice is harmless


def test_v2_file_accepted(tmp_path):
    with open_gguf(write(tmp_path, gguf_bytes(version=2))) as f:
        assert f.version == 2
        np.testing.assert_array_equal(f.tensors["w"].array(), np.arange(8, dtype=np.float32).reshape(2, 4))


def test_handmade_baseline_and_nested_arrays(tmp_path):
    nested = u32(V.ARRAY) + u64(2) + (u32(V.INT16) + u64(2) + struct.pack("<hh", 1, -1)) + (
        u32(V.STRING) + u64(1) + gstr("x"))
    odd = kv("t.bytes", V.STRING, gstr(b"\xff\xfeok"))
    with open_gguf(write(tmp_path, gguf_bytes((ARCH, kv("t.nested", V.ARRAY, nested), odd)))) as f:
        inner_ints, inner_strs = f.metadata["t.nested"]
        np.testing.assert_array_equal(inner_ints, np.array([1, -1], dtype=np.int16))
        assert inner_strs == ["x"]
        # invalid UTF-8 in a value round-trips through surrogateescape
        assert f.metadata["t.bytes"].encode("utf-8", "surrogateescape") == b"\xff\xfeok"


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError):
        open_gguf(tmp_path / "nope.gguf")


@pytest.mark.slow
def test_real_smollm2_matches_gguf_reader(smollm2_path):
    assert_matches_reference(smollm2_path)


def test_real_smollm2_opens_fast(smollm2_path):
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        f = open_gguf(smollm2_path)
        best = min(best, time.perf_counter() - start)
    assert best < 0.3, f"open took {best:.3f} s"
    assert f.architecture == "llama"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(f.metadata["tokenizer.ggml.merges"]) == 48900
    assert len(f.tensors) == 272
    emb = f.tensors["token_embd.weight"]
    assert emb.type_name == "Q8_0" and emb.shape == (49152, 576)
    assert emb.raw().shape == (49152, 576 // 32 * 34) and ends_in_mmap(emb.raw())
    norm = f.tensors["output_norm.weight"].array()
    assert norm.dtype == np.float32 and norm.shape == (576,) and ends_in_mmap(norm)
    f.close()


# ---------------------------------------------------------------- malformed files


def test_baseline_is_valid(tmp_path):
    # every malformation below differs from this file in one field
    with open_gguf(write(tmp_path, gguf_bytes())) as f:
        assert list(f.tensors) == ["w"]


def test_empty_file(tmp_path):
    expect_error(tmp_path, b"", "too small")


def test_bad_magic(tmp_path):
    expect_error(tmp_path, gguf_bytes(magic=b"GGML"), "not a GGUF file")


def test_version_1(tmp_path):
    expect_error(tmp_path, gguf_bytes(version=1), "version 1")


def test_version_99(tmp_path):
    expect_error(tmp_path, gguf_bytes(version=99), "unsupported GGUF version 99")


def test_big_endian(tmp_path):
    expect_error(tmp_path, gguf_bytes(version=0x03000000), "big-endian")


def test_truncated_header(tmp_path):
    blob = gguf_bytes(kvs=(ARCH, kv("general.name", V.STRING, gstr("x" * 200))))
    expect_error(tmp_path, blob[:150], "header is truncated")


def test_huge_key_length(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=(u64(2**62) + b"k",)), "limit")


def test_huge_string_value_length(tmp_path):
    bad = gstr("general.name") + u32(V.STRING) + u64(2**62) + b"abc"
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, bad)), "truncated")


def test_header_over_size_limit(tmp_path):
    # a 300 MiB sparse file whose one string value claims 280 MiB: larger than any real header
    bad = gstr("general.name") + u32(V.STRING) + u64(280 << 20)
    p = write(tmp_path, gguf_bytes(kvs=(ARCH, bad)))
    with open(p, "r+b") as fh:
        fh.truncate(300 << 20)
    with pytest.raises(ModelFormatError, match="larger than the 256 MiB limit"):
        open_gguf(p)


def test_array_length_2_pow_63(tmp_path):
    bad = kv("t.arr", V.ARRAY, u32(V.UINT8) + u64(2**63) + b"\0" * 8)
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, bad)), "claims 9223372036854775808 elements")


def test_string_array_length_2_pow_63(tmp_path):
    bad = kv("tokenizer.ggml.tokens", V.ARRAY, u32(V.STRING) + u64(2**63) + gstr("a"))
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, bad)), "claims 9223372036854775808 elements")


def test_nested_array_length_2_pow_63(tmp_path):
    bad = kv("t.nested", V.ARRAY, u32(V.ARRAY) + u64(2**63))
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, bad)), "sub-arrays")


def test_arrays_nested_too_deep(tmp_path):
    payload = (u32(V.ARRAY) + u64(1)) * 10 + u32(V.UINT8) + u64(1) + b"\0"
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, kv("t.deep", V.ARRAY, payload))), "deeper")


def test_huge_tensor_count(tmp_path):
    expect_error(tmp_path, gguf_bytes(n_tensors=2**40), "tensors, more than the file can hold")


def test_huge_kv_count(tmp_path):
    expect_error(tmp_path, gguf_bytes(n_kv=2**63), "metadata keys, more than the file can hold")


def test_unknown_value_type(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, kv("t.x", 13, u32(0)))), "unknown value type 13")


def test_bool_out_of_range(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, kv("t.b", V.BOOL, b"\x02"))), "not 0 or 1")


def test_duplicate_key(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, ARCH)), "'general.architecture' appears twice")


def test_alignment_3(tmp_path):
    align = kv("general.alignment", V.UINT32, u32(3))
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, align)), "not a power of two")


def test_alignment_not_an_integer(tmp_path):
    align = kv("general.alignment", V.STRING, gstr("32"))
    expect_error(tmp_path, gguf_bytes(kvs=(ARCH, align)), "must be an integer")


def test_n_dims_0(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("w", ()),)), "has 0 dimensions")


def test_n_dims_5(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("w", (1, 1, 1, 1, 8)),)), "has 5 dimensions")


def test_dim_0(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("w", (4, 0)),)), "invalid dimension 0")


def test_dim_past_int64(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("w", (4, 2**63)),)), "invalid dimension")


def test_huge_dims_do_not_overflow(tmp_path):
    # 2**62 * 2**62 elements: a C int64 product would wrap around; ours must say "past the end"
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("w", (2**62, 2**62)),)), "runs past the end")


def test_unknown_type_id(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("w", (4, 2), ggml_type=4),)), "unknown ggml type id 4")


def test_ne0_not_multiple_of_block(tmp_path):
    info = tinfo("w", (16, 1), ggml_type=Q.Q8_0)
    expect_error(tmp_path, gguf_bytes(infos=(info,)), "not a multiple of its block size 32")


def test_misaligned_offset(tmp_path):
    infos = (tinfo("w", (4, 2), offset=0), tinfo("v", (4,), offset=40))
    expect_error(tmp_path, gguf_bytes(infos=infos, data=W_DATA * 3), "not a multiple of the alignment 32")


def test_offset_past_eof(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("w", (4, 2), offset=2**40),)), "runs past the end")


def test_overlapping_tensors(tmp_path):
    infos = (tinfo("w", (4, 2), offset=0), tinfo("v", (16,), offset=32), tinfo("u", (4,), offset=64))
    expect_error(tmp_path, gguf_bytes(infos=infos, data=W_DATA * 4), "'v' and 'u' overlap")


def test_duplicate_tensor_name(tmp_path):
    infos = (tinfo("w", (4, 2), offset=0), tinfo("w", (4,), offset=32))
    expect_error(tmp_path, gguf_bytes(infos=infos, data=W_DATA * 2), "'w' appears twice")


def test_empty_tensor_name(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo("", (4, 2)),)), "empty name")


def test_tensor_name_not_utf8(tmp_path):
    expect_error(tmp_path, gguf_bytes(infos=(tinfo(b"\xff", (4, 2)),)), "not valid UTF-8")


def test_truncated_data(tmp_path):
    blob = write_gguf(tmp_path / "full.gguf", sample_tensors()).read_bytes()
    last = None
    with open_gguf(tmp_path / "full.gguf") as f:
        last = max(t.offset + t.nbytes for t in f.tensors.values())
    expect_error(tmp_path, blob[: last - 1], "truncated or corrupt")


def test_random_header_corruption_never_escapes(tmp_path):
    # 400 seeded corruptions of a real header: each either fails with ModelFormatError or opens with
    # every tensor inside the file; no other exception, no out-of-bounds view
    good = write_gguf(tmp_path / "good.gguf", sample_tensors())
    blob = good.read_bytes()
    with open_gguf(good) as f:
        header_end = f.data_offset
    p = tmp_path / "fuzz.gguf"
    rejected = 0
    for b in header_corruptions(blob, header_end):
        p.write_bytes(b)
        try:
            f = open_gguf(p)
        except ModelFormatError:
            rejected += 1
            continue
        for t in f.tensors.values():
            assert t.offset + t.nbytes <= len(b) and t.raw().nbytes == t.nbytes
        f.close()
    assert rejected > 200  # most corruptions are caught


# ---------------------------------------------------------------- the metadata from a file's first bytes


def test_metadata_from_prefix_needs_the_whole_key_value_section_and_no_more(tmp_path):
    """A Range request's answer: the metadata once the prefix holds every key/value pair (tensor infos are
    not needed), None before that; foreign bytes are refused as in open_gguf."""
    from models.formats.gguf import metadata_from_prefix

    path = write_gguf(tmp_path / "a.gguf", sample_tensors())
    blob = path.read_bytes()
    with open_gguf(path) as f:
        want, first_tensor = f.metadata, next(iter(f.tensors))
    found = [n for n in range(len(blob) + 1) if metadata_from_prefix(blob[:n], len(blob), "a.gguf")]
    first = found[0]
    assert found == list(range(first, len(blob) + 1)), "once enough, every longer prefix is enough"
    got = metadata_from_prefix(blob[:first], len(blob), "a.gguf")
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert np.array_equal(got[k], v) if isinstance(v, np.ndarray) else got[k] == v, k
    # the last value ends exactly there: the first tensor info (its name's length) comes next
    assert blob[first : first + 8] == struct.pack("<Q", len(first_tensor.encode()))
    assert metadata_from_prefix(blob[:first], None, "a.gguf").keys() == want.keys(), "size unknown"
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        metadata_from_prefix(b"PK\x03\x04" + bytes(100), 5000, "z.gguf")
    with pytest.raises(ModelFormatError, match="short.gguf: .*(truncated|left)"):
        metadata_from_prefix(blob[: first - 1], first - 1, "short.gguf")  # the whole file, cut short
