"""common/gguf_reader.py: a GGUF file's metadata and tensors read as the gguf
package writes and reads them (every value type, every tensor's bytes), and files that
are not whole GGUF files refused with what is wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from common.errors import ModelLoadError
from common.model_files import _find_gguf
from common.gguf_reader import GgufReader


def written(path, alignment=None, endianess=None, tensors=True):
    """A file with a value of every GGUF type, arrays of numbers and strings, and
    tensors of a dense and two block types; returns what it holds."""
    from gguf import GGMLQuantizationType as T, GGUFEndian, GGUFValueType as V, GGUFWriter

    w = GGUFWriter(str(path), "llama", endianess=endianess or GGUFEndian.LITTLE)
    if alignment:
        w.add_custom_alignment(alignment)
    values = {"u8": (200, V.UINT8), "i8": (-100, V.INT8), "u16": (60000, V.UINT16),
              "i16": (-30000, V.INT16), "u32": (4_000_000_000, V.UINT32),
              "i32": (-2_000_000_000, V.INT32), "f32": (0.5, V.FLOAT32), "yes": (True, V.BOOL),
              "u64": (2**63 + 5, V.UINT64), "i64": (-(2**62), V.INT64),
              "f64": (1 / 3, V.FLOAT64), "text": ("héllo <|im_start|>", V.STRING)}
    for key, (value, vtype) in values.items():
        w.add_key_value(key, value, vtype)
    w.add_array("words", ["a", "", "ünï", "merge me"])
    w.add_array("scores", [1.5, -2.0, 0.25])
    w.add_key_value("ids", [3, 1, 4], V.ARRAY, sub_type=V.INT32)
    rng = np.random.default_rng(0)
    data = {"dense": (rng.standard_normal((3, 64)).astype(np.float32), T.F32),
            "q8": (rng.integers(0, 256, (5, 2 * 34), dtype=np.uint8), T.Q8_0),
            "q4": (rng.integers(0, 256, (2, 3 * 18), dtype=np.uint8), T.Q4_0)}
    for name, (array, ggml_type) in data.items() if tensors else ():
        w.add_tensor(name, array, raw_dtype=ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: v for k, (v, _) in values.items()}, data


def test_every_value_type_and_tensor_reads_as_written(tmp_path):
    from gguf import GGMLQuantizationType as T

    values, data = written(tmp_path / "a.gguf")
    r = GgufReader(tmp_path / "a.gguf")
    for key, value in values.items():
        assert r.fields[key] == value, key
    assert r.fields["general.architecture"] == "llama"
    assert r.fields["words"] == ["a", "", "ünï", "merge me"]
    assert r.fields["scores"].dtype == np.float32 and r.fields["scores"].tolist() == [1.5, -2, 0.25]
    assert r.fields["ids"].dtype == np.int32 and r.fields["ids"].tolist() == [3, 1, 4]
    assert [(t.name, t.shape, t.ggml_type, t.type_name) for t in r.tensors] == [
        ("dense", (64, 3), T.F32, "F32"), ("q8", (64, 5), T.Q8_0, "Q8_0"),
        ("q4", (96, 2), T.Q4_0, "Q4_0")]
    dense, q8, q4 = r.tensors
    assert np.array_equal(dense.data.view(np.float32), data["dense"][0])
    assert np.array_equal(q8.data, data["q8"][0]) and np.array_equal(q4.data, data["q4"][0])


def test_a_custom_alignment_places_the_data(tmp_path):
    _, data = written(tmp_path / "a.gguf", alignment=64)
    r = GgufReader(tmp_path / "a.gguf")
    assert r.fields["general.alignment"] == 64
    assert np.array_equal(r.tensors[2].data, data["q4"][0])


def test_the_default_models_file_reads_as_the_gguf_package_reads_it():
    """Every field (the 49,152-token vocabulary and its merges included) and every
    tensor's bytes, against gguf's own reader."""
    from gguf import GGUFReader, GGUFValueType as V

    path = _find_gguf()
    ours, theirs = GgufReader(path), GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for key, f in fields.items():
        if f.types == [V.ARRAY, V.STRING]:
            assert ours.fields[key] == [bytes(f.parts[i]).decode() for i in f.data], key
        elif f.types[0] == V.ARRAY:
            assert np.array_equal(ours.fields[key], np.concatenate([f.parts[i] for i in f.data]))
        else:
            assert ours.fields[key] == f.contents(), key
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.shape, mine.ggml_type) == \
            (t.name, tuple(map(int, t.shape)), int(t.tensor_type))
        assert np.array_equal(mine.data, np.asarray(t.data).view(np.uint8).reshape(mine.data.shape))


def rewritten(tmp_path, change):
    path = tmp_path / "a.gguf"
    written(path)
    blob = bytearray(path.read_bytes())
    out = tmp_path / "b.gguf"
    out.write_bytes(change(blob))
    return out


def tensor_type_at(blob: bytearray, name: bytes) -> int:
    """Where the ggml type of tensor ``name`` is, in its header entry (a 2-D one)."""
    at = blob.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    return at + 4 + 2 * 8


@pytest.mark.parametrize("change, message", [
    (lambda b: b"", r"b\.gguf is not a readable GGUF file"),
    (lambda b: b"GGML" + b[4:], r"b\.gguf is not a GGUF file \(it does not begin with 'GGUF'\)"),
    (lambda b: b[:4] + struct.pack("<I", 1) + b[8:], "is GGUF version 1; roseserve reads "
     "versions 2 and 3"),
    (lambda b: b[:200], r"b\.gguf is not a readable GGUF file: it ends inside its header"),
    (lambda b: b[:-40], r"b\.gguf is cut short: tensor 'q4' ends at byte \d+, the file at \d+"),
    (lambda b: b[:(t := tensor_type_at(b, b"q8"))] + struct.pack("<I", 99) + b[t + 4:],
     "tensor 'q8' has ggml type 99, which roseserve does not know"),
    (lambda b: b[:(t := tensor_type_at(b, b"dense"))] + struct.pack("<I", 12) + b[t + 4:],
     r"tensor 'dense' of shape \[64, 3\] is not whole Q4_K blocks of 256 a row"),
])
def test_a_file_that_is_not_a_whole_gguf_file_is_refused_with_what_is_wrong(
        tmp_path, change, message):
    with pytest.raises(ModelLoadError, match=message):
        GgufReader(rewritten(tmp_path, change))


def test_a_big_endian_file_is_refused_as_such(tmp_path):
    from gguf import GGUFEndian

    written(tmp_path / "a.gguf", endianess=GGUFEndian.BIG, tensors=False)
    with pytest.raises(ModelLoadError, match="is a big-endian GGUF file"):
        GgufReader(tmp_path / "a.gguf")


def test_a_metadata_value_of_no_gguf_type_is_refused(tmp_path):
    def change(b):
        at = b.index(b"u8") + 2   # the key "u8", then its value type
        return b[:at] + struct.pack("<I", 13) + b[at + 4:]

    with pytest.raises(ModelLoadError, match="has type 13, which GGUF does not define"):
        GgufReader(rewritten(tmp_path, change))
