from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ddiloco.platform.compression import CompressionError, decode_delta, encode_delta, encoded_nbytes

# Float rounding in x / scale and q * scale may add a few ulps to the ideal bound.
SLACK = 1 + 1e-5


def _blockwise_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """absmax of each element's block, broadcast back to the flat element positions."""
    flat = x.flatten()
    nb = -(-flat.numel() // block)
    padded = torch.nn.functional.pad(flat.abs(), (0, nb * block - flat.numel())).view(nb, block)
    return padded.amax(1).repeat_interleave(block)[: flat.numel()]


def _roundtrip(tensors: dict[str, torch.Tensor], codec: str, block: int = 64) -> dict[str, torch.Tensor]:
    enc, meta = encode_delta(tensors, codec, block)
    # Through a real safetensors blob, as the fragment store does.
    enc2 = st_load(st_save(enc, metadata=meta))
    return decode_delta(enc2, meta, {n: tuple(t.shape) for n, t in tensors.items()})


def test_literal_int8_block() -> None:
    x = torch.tensor([1.0, -0.5, 0.25, 0.0])
    enc, meta = encode_delta({"w": x}, "int8", block_size=4)
    assert enc["w::scale"].tolist() == pytest.approx([1 / 127])
    assert enc["w::q"].tolist() == [127, -64, 32, 0]  # round(-63.5) -> -64 (half to even), 31.75 -> 32
    assert meta["codec"] == "int8" and meta["block_size"] == "4"
    assert json.loads(meta["tensors"]) == {"w": {"shape": [4], "dtype": "float32"}}


def test_literal_int4_packing() -> None:
    x = torch.tensor([7.0, -7.0, 1.0])  # one block, scale 1
    enc, _ = encode_delta({"w": x}, "int4", block_size=8)
    # codes +8: 15, 1, 9, then padding 8; low nibble first.
    assert enc["w::q"].dtype == torch.uint8
    assert enc["w::q"].tolist() == [15 | (1 << 4), 9 | (8 << 4)]
    assert decode_delta(enc, encode_delta({"w": x}, "int4", block_size=8)[1])["w"].tolist() == [7.0, -7.0, 1.0]


@pytest.mark.parametrize("shape", [(1000,), (7, 13), (3, 5, 11), (1,), ()])
def test_int8_error_bound_per_block(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    y = _roundtrip({"w": x}, "int8")["w"]
    assert y.shape == x.shape and y.dtype == torch.float32
    bound = _blockwise_absmax(x, 64) / 254
    assert torch.all((y - x).abs().flatten() <= bound * SLACK)


@pytest.mark.parametrize("shape", [(1000,), (7, 13), (3, 5, 11), (1,)])
def test_int4_error_bound_per_block(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    y = _roundtrip({"w": x}, "int4", block=32)["w"]
    bound = _blockwise_absmax(x, 32) / 14
    assert torch.all((y - x).abs().flatten() <= bound * SLACK)


def test_bf16_relative_error_and_none_exact() -> None:
    x = torch.randn(4097, generator=torch.Generator().manual_seed(2))
    y = _roundtrip({"w": x}, "bf16")["w"]
    assert torch.all((y - x).abs() <= x.abs() * 2**-8)
    assert torch.equal(_roundtrip({"w": x}, "none")["w"], x)


def test_non_float32_inputs_decode_to_float32() -> None:
    x = torch.randn(100, dtype=torch.bfloat16)
    enc, meta = encode_delta({"w": x}, "int8")
    assert json.loads(meta["tensors"])["w"]["dtype"] == "bfloat16"
    assert decode_delta(enc, meta)["w"].dtype == torch.float32


def test_encode_does_not_alias_the_input() -> None:
    x = torch.ones(10)
    enc, _ = encode_delta({"w": x}, "none")
    x.add_(1)
    assert torch.equal(enc["w::q"], torch.ones(10))


def test_zero_blocks_decode_to_zero_without_nan() -> None:
    x = torch.zeros(200)
    x[150] = 2.0
    for codec in ("int8", "int4"):
        y = _roundtrip({"w": x}, codec)["w"]
        assert torch.isfinite(y).all()
        assert torch.equal(y[:128], torch.zeros(128))
        assert y[150].item() == pytest.approx(2.0)


def test_empty_tensor() -> None:
    for codec in ("none", "bf16", "int8", "int4"):
        assert _roundtrip({"w": torch.zeros(0, 3)}, codec)["w"].shape == (0, 3)


def test_non_finite_values_stay_non_finite() -> None:
    x = torch.ones(128)
    x[3] = float("nan")
    x[70] = float("inf")
    for codec in ("none", "bf16", "int8", "int4"):
        y = _roundtrip({"w": x}, codec)["w"]
        assert not torch.isfinite(y[:64]).all() and not torch.isfinite(y[64:]).all(), codec


def test_compression_ratios() -> None:
    x = {"a": torch.randn(64 * 1000), "b": torch.randn(32, 64)}
    n = 64 * 1000 + 32 * 64
    sizes = {c: encoded_nbytes(encode_delta(x, c, 64)[0]) for c in ("none", "bf16", "int8", "int4")}
    scales = 4 * (1000 + 32)
    assert sizes["none"] == 4 * n
    assert sizes["bf16"] == 2 * n
    assert sizes["int8"] == n + scales
    assert sizes["int4"] == n // 2 + scales
    assert sizes["int4"] / sizes["none"] == pytest.approx(1 / 8 + 1 / 64, rel=1e-3)


def test_multiple_tensors_keep_names_and_shapes() -> None:
    x = {"tok_embed.weight": torch.randn(10, 4), "blocks.0.attn.qkv.bias": torch.randn(12)}
    y = _roundtrip(x, "int8", block=8)
    assert {k: v.shape for k, v in y.items()} == {k: v.shape for k, v in x.items()}


# ----------------------------------------------------------------------------------- errors


def _encoded(codec: str = "int8") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    return encode_delta({"w": torch.randn(10, 10)}, codec, 16)


def test_encode_errors() -> None:
    with pytest.raises(CompressionError, match="unknown codec 'zip'"):
        encode_delta({"w": torch.ones(3)}, "zip")
    with pytest.raises(CompressionError, match="floating"):
        encode_delta({"w": torch.ones(3, dtype=torch.long)}, "int8")
    with pytest.raises(CompressionError, match="must not contain"):
        encode_delta({"w::q": torch.ones(3)}, "int8")
    with pytest.raises(CompressionError, match="block_size"):
        encode_delta({"w": torch.ones(3)}, "int8", 0)


def test_decode_unknown_codec_and_malformed_metadata() -> None:
    enc, meta = _encoded()
    with pytest.raises(CompressionError, match="unknown codec 'gzip'"):
        decode_delta(enc, {**meta, "codec": "gzip"})
    with pytest.raises(CompressionError, match="missing"):
        decode_delta(enc, {})
    with pytest.raises(CompressionError, match="lacks 'tensors'"):
        decode_delta(enc, {k: v for k, v in meta.items() if k != "tensors"})
    with pytest.raises(CompressionError, match="malformed"):
        decode_delta(enc, {**meta, "tensors": "{not json"})
    with pytest.raises(CompressionError, match="malformed"):
        decode_delta(enc, {**meta, "block_size": "sixty-four"})
    with pytest.raises(CompressionError, match="valid shape"):
        decode_delta(enc, {**meta, "tensors": json.dumps({"w": {"shape": [-1]}})})
    assert issubclass(CompressionError, ValueError)


def test_decode_missing_and_unexpected_keys() -> None:
    enc, meta = _encoded()
    with pytest.raises(CompressionError, match="missing tensor 'w::scale'"):
        decode_delta({"w::q": enc["w::q"]}, meta)
    with pytest.raises(CompressionError, match="unexpected tensors"):
        decode_delta({**enc, "extra": torch.ones(1)}, meta)


def test_decode_wrong_dtype_or_length() -> None:
    enc, meta = _encoded()
    with pytest.raises(CompressionError, match="dtype"):
        decode_delta({**enc, "w::q": enc["w::q"].to(torch.int16)}, meta)
    with pytest.raises(CompressionError, match="shape"):
        decode_delta({**enc, "w::q": enc["w::q"][:-1]}, meta)
    with pytest.raises(CompressionError, match="shape"):
        decode_delta({**enc, "w::scale": enc["w::scale"][:-1]}, meta)
    enc4, meta4 = _encoded("int4")
    bad = enc4["w::q"].clone()
    bad[0] = 0  # nibble 0 is code -8: never written
    with pytest.raises(CompressionError, match="outside"):
        decode_delta({**enc4, "w::q": bad}, meta4)


def test_decode_against_expected_shapes() -> None:
    enc, meta = _encoded()
    assert decode_delta(enc, meta, {"w": (10, 10)})["w"].shape == (10, 10)
    with pytest.raises(CompressionError, match=r"shape \(10, 10\), expected \(100,\)"):
        decode_delta(enc, meta, {"w": (100,)})
    with pytest.raises(CompressionError, match="missing \\['v'\\]"):
        decode_delta(enc, meta, {"w": (10, 10), "v": (3,)})
    with pytest.raises(CompressionError, match="unexpected \\['w'\\]"):
        decode_delta(enc, meta, {})


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_claimed_block_size_is_no_size_to_allocate(codec: str) -> None:
    # One block covering the whole tensor, whatever the claim: decoding must not size anything by 2**40.
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5))
    enc, meta = encode_delta({"w": x}, codec, block_size=1001)
    want = decode_delta(enc, meta)["w"]
    got = decode_delta(enc, {**meta, "block_size": str(2**40)})["w"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("codec", ["none", "bf16", "int8", "int4"])
def test_decode_into_a_flat_row_in_chunks_gives_the_same_values_and_norms(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddiloco.platform import compression

    g = torch.Generator().manual_seed(6)
    tensors = {"a": torch.randn(3, 333, generator=g), "b": torch.randn(77, generator=g), "c": torch.randn((), generator=g)}
    enc, meta = encode_delta(tensors, codec, block_size=16)
    want = decode_delta(enc, meta)
    layout = [("b", (77,)), ("a", (3, 333)), ("c", ())]  # the caller's order, not the blob's
    monkeypatch.setattr(compression, "DECODE_CHUNK", 40)  # many chunks, one ending mid-tensor
    row = torch.full((77 + 999 + 1,), float("nan"))
    sq = compression.decode_delta_into(enc, meta, layout, row)
    assert torch.equal(row, torch.cat([want["b"], want["a"].reshape(-1), want["c"].reshape(-1)]))
    torch.testing.assert_close(sq, torch.stack([want[n].double().pow(2).sum() for n, _ in layout]), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="contiguous float32 vector of 1077"):
        compression.decode_delta_into(enc, meta, layout, torch.empty(5))


def _host_encode_reference(tensors: dict[str, torch.Tensor], codec: str, block: int) -> dict[str, torch.Tensor]:
    """The encoder as it was before increments stayed on the device: a float32 host copy first, then the codec."""
    from ddiloco.platform.compression import _LEVELS, _pack4, _quantize

    out = {}
    for name, t in tensors.items():
        x = t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
        if codec == "none":
            out[name + "::q"] = x
        elif codec == "bf16":
            out[name + "::q"] = x.to(torch.bfloat16).contiguous()
        else:
            q, scale = _quantize(x.flatten(), block, _LEVELS[codec])
            out[name + "::q"] = (_pack4(q) if codec == "int4" else q).contiguous()
            out[name + "::scale"] = scale.contiguous()
    return out


@pytest.mark.parametrize("codec", ["none", "bf16", "int8", "int4"])
def test_encoding_where_the_increment_lives_gives_todays_blob_byte_for_byte(codec: str) -> None:
    from ddiloco.platform.store import encode_tensors

    g = torch.Generator().manual_seed(3)
    params = torch.randn(37, 29, generator=g)
    snapshot = params + 0.01 * torch.randn(37, 29, generator=g)
    # A learner's increment as the training thread now makes it: snapshot - rows of a live parameter (views) ...
    (inc,) = torch._foreach_sub([snapshot[5:30]], [params[5:30]])
    tensors, meta = encode_delta({"w": inc}, codec, 16)
    # ... and as it was made before: both sides staged to host memory, subtracted on the upload thread.
    ref = _host_encode_reference({"w": snapshot[5:30].clone() - params[5:30].clone()}, codec, 16)
    assert all(t.device.type == "cpu" for t in tensors.values()) and tensors.keys() == ref.keys()
    for k, t in ref.items():
        got = tensors[k]
        assert (got.dtype, got.shape) == (t.dtype, t.shape) and got.view(torch.uint8).numpy().tobytes() == t.view(
            torch.uint8
        ).numpy().tobytes(), k
    # safetensors orders the header's metadata map as it likes: the blobs are compared past it, as stored tensors.
    assert st_load(encode_tensors(tensors, meta)).keys() == st_load(encode_tensors(ref, meta)).keys()


def _codes_by_hand(x: torch.Tensor, block: int, levels: int) -> tuple[list[int], list[float]]:
    """Each block's scale absmax / levels, each value's code round-half-even(v / scale) within +-levels (0 where the
    scale is 0 or the value not a number), value by value in Python."""
    flat = [float(v) for v in x.detach().to(torch.float32).flatten()]
    codes, scales = [], []
    for a in range(0, len(flat), block):
        vals = torch.tensor(flat[a : a + block], dtype=torch.float32)
        s = (vals.abs().max() / levels).item() if len(vals) else 0.0
        scales.append(s)
        d = torch.tensor(s if s > 0 else 1.0, dtype=torch.float32)
        for v in vals:
            c = torch.round(v / d).item()
            codes.append(0 if c != c else int(max(-levels, min(levels, c))))
    return codes, scales


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("block", [1, 3, 8, 64])
def test_the_codes_and_scales_are_the_blockwise_quantization_value_by_value(codec: str, block: int) -> None:
    g = torch.Generator().manual_seed(block)
    tensors = {
        "a": torch.randn(5, 7, generator=g) * 1e-3,
        "b": torch.zeros(9),
        "c": torch.randn(11, generator=g).to(torch.bfloat16),
        "d": torch.randn(130, generator=g, dtype=torch.float64),
        "e": torch.tensor(2.5),
    }
    tensors["a"][1, 2] = float("nan")
    tensors["d"][7] = float("inf")
    levels = {"int8": 127, "int4": 7}[codec]
    enc, _ = encode_delta(tensors, codec, block)
    for name, x in tensors.items():
        codes, scales = _codes_by_hand(x, block, levels)
        assert enc[name + "::scale"].tolist() == pytest.approx(scales, rel=0, abs=0, nan_ok=True), name
        got = enc[name + "::q"]
        if codec == "int4":
            u = [c + 8 for c in codes] + ([8] if len(codes) % 2 else [])
            assert got.tolist() == [lo | (hi << 4) for lo, hi in zip(u[0::2], u[1::2])], name
        else:
            assert got.tolist() == codes, name


def test_a_compact_step_is_the_base_plus_the_decoded_delta_in_new_memory() -> None:
    from ddiloco.platform.compression import apply_encoded

    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(33, 7, generator=g), "b": torch.randn(5, generator=g), "s": torch.tensor(0.5)}
    delta = {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in base.items()}
    for codec in ("int8", "int4", "bf16", "none"):
        enc, meta = encode_delta(delta, codec, 16)
        decoded = decode_delta(enc, meta)
        got = apply_encoded(base, enc, meta)
        assert list(got) == list(base)
        for n in base:
            assert torch.equal(got[n], base[n] + decoded[n]) and got[n].shape == base[n].shape, (codec, n)
            assert got[n].untyped_storage().data_ptr() != base[n].untyped_storage().data_ptr()


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("block", [1, 3, 8, 64])
def test_a_fragment_quantized_as_one_buffer_gives_each_tensors_own_bytes(codec: str, block: int) -> None:
    """A GPU fragment of several tensors is quantized as one buffer (one set of kernels): run here on the CPU, each
    tensor's codes and scales must be what encoding it alone gives, NaN and inf blocks, a zero tensor and an odd last
    tensor included, whenever no block or int4 byte pair straddles two tensors."""
    from ddiloco.platform import compression as c

    g = torch.Generator().manual_seed(block)
    whole = 2 * block * (2 if codec == "int4" and block % 2 else 1)  # sizes that fill their blocks and pairs
    xs = [torch.randn(3 * whole, generator=g), torch.zeros(whole), torch.randn(whole, generator=g) * 1e-30,
          torch.randn(5 * whole + 3, generator=g)]
    xs[0][block + 1] = float("nan")
    xs[2][0] = float("inf")
    assert c._straddle_free([x.numel() for x in xs], codec, block)
    together = c._quantize_together(xs, codec, block)
    for i, (x, (q, scale)) in enumerate(zip(xs, together, strict=True)):
        alone = c._encode_one("t", x, codec, block)
        assert torch.equal(q, alone["t::q"]) and q.dtype == alone["t::q"].dtype, i
        assert scale.view(torch.int32).tolist() == alone["t::scale"].view(torch.int32).tolist(), i
        # Copies of their own, not views of the buffer: a blob's tensors must not share memory.
        assert q.untyped_storage().nbytes() == q.numel() * q.element_size(), i


def test_only_tensors_that_fill_their_blocks_are_laid_end_to_end() -> None:
    from ddiloco.platform import compression as c

    assert c._straddle_free([128, 64, 7], "int8", 64) and not c._straddle_free([128, 65, 64], "int8", 64)
    assert c._straddle_free([6, 3], "int8", 3) and not c._straddle_free([3, 6], "int4", 3)  # int4: 3 codes end mid-byte
    assert c._straddle_free([5], "int4", 64)  # one tensor: nothing to straddle
    # A CPU fragment is encoded a tensor at a time (one buffer leaves the cache there), as are unquantized codecs.
    cpu = [torch.randn(64), torch.randn(64)]
    assert not c._fusable(cpu, "int8", 64) and not c._fusable(cpu, "bf16", 64)
