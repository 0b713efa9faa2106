"""The KV wire format: bit-identical round trips, zero-copy encoding, and clear rejection of bad bytes."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import pytest
import torch

from testbed.kv.cache import KVCache, LayerKV
from testbed.kv.wire import (
    DATA_BODY, FLAG_DISCARD, HEADER_CRC, PREFIX, ChecksumError, DataFrame, DataHeader, FrameDecoder, KVAssembler,
    Trailer, WireError, WireLimits, decode_transfer, encode_cache, encode_data_header, encode_layer_frames,
    encode_trailer, layer_frames, transfer_digest, wire_bytes_for,
)

torch.set_num_threads(1)


def _layer(kind: str, index: int = 0, tokens: int = 37, dtype: torch.dtype = torch.bfloat16) -> LayerKV:
    g = torch.Generator().manual_seed(index + 1)

    def r(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt)

    if kind == "linear":
        return LayerKV(index, kind, {"state": r(4, 8, 6, dt=torch.float32), "conv": r(3, 40)})
    if kind == "gqa":
        return LayerKV(index, kind, {"k": r(tokens, 2, 12), "v": r(tokens, 2, 8)})
    if kind == "mla":
        return LayerKV(index, kind, {"latent": r(tokens, 32), "k_rope": r(tokens, 8)})
    return LayerKV(index, kind, {"k": r(min(tokens, 16), 2, 12), "v": r(min(tokens, 16), 2, 8)})


def _cache(kinds: list[str], tokens: int = 37) -> KVCache:
    return KVCache("req-7", "tiny-hybrid", tokens, [_layer(k, i, tokens) for i, k in enumerate(kinds)])


def _assert_same(a: KVCache, b: KVCache) -> None:
    assert (b.request_id, b.model, b.tokens) == (a.request_id, a.model, a.tokens)
    assert [(la.layer_index, la.kind) for la in a.layers] == [(lb.layer_index, lb.kind) for lb in b.layers]
    for la, lb in zip(a.layers, b.layers):
        assert list(la.tensors) == list(lb.tensors)
        for name, t in la.tensors.items():
            u = lb.tensors[name]
            assert u.dtype == t.dtype and u.shape == t.shape
            assert torch.equal(t.view(torch.uint8), u.view(torch.uint8)), f"layer {la.layer_index} {name} differs"


@pytest.mark.parametrize("kind", ["linear", "gqa", "mla", "swa"])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 100])
def test_round_trip_is_bit_identical_per_layer_kind(kind: str, chunk_bytes: int) -> None:
    cache = _cache([kind])
    data = b"".join(encode_cache(cache, chunk_bytes))
    _assert_same(cache, decode_transfer(data))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_round_trip_keeps_each_kv_dtype(dtype: torch.dtype) -> None:
    cache = KVCache("r", "m", 9, [_layer("gqa", 0, 9, dtype)])
    _assert_same(cache, decode_transfer(b"".join(encode_cache(cache))))


def test_hybrid_mix_round_trips_in_any_split_of_the_stream() -> None:
    cache = _cache(["linear", "linear", "mla", "linear", "gqa", "swa"])
    data = b"".join(encode_cache(cache, 256))
    decoder = FrameDecoder()
    asm = KVAssembler("req-7")
    items = []
    for i in range(0, len(data), 13):
        items += decoder.feed(data[i:i + 13])
    for item in items[:-1]:
        assert isinstance(item, DataFrame)
        asm.add(item)
    assert isinstance(items[-1], Trailer)
    _assert_same(cache, asm.finish(items[-1]))


def test_frames_are_assembled_in_any_order() -> None:
    cache = _cache(["linear", "gqa", "mla"])
    frames = [f for layer in cache.layers for f in layer_frames("req-7", layer, 64)]
    trailer = Trailer("req-7", cache.model, cache.tokens, 3, len(frames), sum(f.payload.nbytes for f in frames),
                      transfer_digest(f.record for f in frames))
    data = b"".join(f.header + bytes(f.payload) for f in reversed(frames)) + encode_trailer(trailer)
    _assert_same(cache, decode_transfer(data))


def test_encoding_does_not_copy_tensor_memory() -> None:
    layer = _layer("gqa", tokens=64)
    bufs = encode_layer_frames("r", layer)
    payload = bufs[1]
    assert isinstance(payload, memoryview)
    layer.tensors["k"].view(-1)[0] = 123.0  # a later write shows through: the payload views the tensor
    assert bytes(payload[:2]) == layer.tensors["k"].view(-1)[:1].view(torch.uint8).numpy().tobytes()


def test_header_overhead_at_1k_tokens_is_at_most_0_1_percent_for_every_preset() -> None:
    from testbed.models import spec as spec_mod

    for name in spec_mod.list_presets():
        spec = spec_mod.load_model_spec(name)
        sizes = [t.nbytes for i in range(len(spec.layers)) for t in spec.layer_tensors(i, 1024).values()]
        payload = sum(sizes)
        overhead = wire_bytes_for("req-000000001", sizes, spec.name) - payload
        assert overhead / payload <= 0.001, f"{name}: {overhead} header bytes on {payload}"


def test_wire_bytes_for_matches_the_encoder() -> None:
    cache = _cache(["linear", "gqa", "mla", "swa"])
    data = b"".join(encode_cache(cache, 100))
    sizes = [t.numel() * t.element_size() for layer in cache.layers for t in layer.tensors.values()]
    assert len(data) == wire_bytes_for(cache.request_id, sizes, cache.model, 100)


# ------------------------------------------------------------------------------- malformed input

def _good_header(**over: object) -> DataHeader:
    base = dict(request_id="r1", layer_index=0, kind="gqa", slot=0, dtype=torch.bfloat16, shape=(4, 2, 8),
                offset=0, length=128, checksum=0, flags=0)
    base.update(over)
    return DataHeader(**base)  # type: ignore[arg-type]


def _reseal(raw: bytes, fixed: int) -> bytes:
    """Recompute the header CRC after tampering, so the check under test is the one that fires."""
    body, tail = raw[:fixed - 4], raw[fixed:]
    return body + HEADER_CRC.pack(zlib.crc32(tail, zlib.crc32(body))) + tail


FIXED = PREFIX.size + DATA_BODY.size + HEADER_CRC.size


def _patch(raw: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(raw)
    struct.pack_into(fmt, b, offset, value)
    return _reseal(bytes(b), FIXED)


GOOD = encode_data_header(_good_header())
MALFORMED = [
    ("bad magic", b"XXXX" + GOOD[4:], "magic"),
    ("bad version", _patch(GOOD, 4, "<B", 9), "version"),
    ("unknown frame type", _patch(GOOD, 5, "<B", 77), "frame type"),
    ("unknown flag", _patch(GOOD, 6, "<H", 0x80), "flags"),
    ("header bit flip", GOOD[:30] + bytes([GOOD[30] ^ 1]) + GOOD[31:], "header checksum"),
    ("empty request id", _patch(GOOD, 8, "<B", 0), "request_id"),
    ("unknown kind", _patch(GOOD, 9, "<B", 9), "layer kind"),
    ("slot out of range", _patch(GOOD, 10, "<B", 5), "tensor slot"),
    ("unknown dtype", _patch(GOOD, 11, "<B", 200), "dtype"),
    ("zero dims", _patch(GOOD, 16, "<B", 0), "shape"),
    ("five dims", _patch(GOOD, 16, "<B", 5), "shape"),
    ("rank wrong for kind", _patch(GOOD, 16, "<B", 2), "shape"),
    ("shape not matching length", encode_data_header(_good_header(length=129)), "byte length"),
    ("chunk beyond the tensor", encode_data_header(_good_header(offset=100, length=64)), "byte length"),
    ("absurd shape", encode_data_header(_good_header(shape=(2**31, 2**31, 2**31), length=128)), "shape"),
    ("absurd length", encode_data_header(_good_header(shape=(2**31, 2**31, 2**31), length=2**62)), "shape"),
    ("absurd frame", encode_data_header(_good_header(shape=(2**20, 64, 64), length=2**30)), "frame limit"),
    ("absurd layer index", encode_data_header(_good_header(layer_index=2**31)), "layer index"),
    ("profile frame with a tensor dtype", encode_data_header(_good_header(flags=FLAG_DISCARD)), "profile frame"),
]


@pytest.mark.parametrize("raw,field", [(m[1], m[2]) for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_header_is_rejected_before_any_allocation(raw: bytes, field: str) -> None:
    sunk: list[DataHeader] = []
    decoder = FrameDecoder(WireLimits(max_frame_bytes=16 << 20), sink=lambda h: sunk.append(h))  # type: ignore[func-returns-value]
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=field):
            decoder.feed(raw + bytes(64))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sunk == [], "no payload buffer may be requested for a rejected header"
    assert peak < 1 << 20


def test_wrong_payload_checksum_is_a_checksum_error_and_keeps_the_stream_in_sync() -> None:
    cache = _cache(["gqa", "mla"])
    data = bytearray(b"".join(encode_cache(cache)))
    data[FIXED + len("req-7") + 5] ^= 0xFF  # first payload byte region
    decoder = FrameDecoder()
    with pytest.raises(ChecksumError, match="payload checksum") as err:
        decoder.feed(bytes(data))
    assert err.value.header.layer_index == 0
    assert decoder.idle


@pytest.mark.parametrize("cut", [3, 20, FIXED + 2, FIXED + 40, -10])
def test_truncated_stream_is_rejected(cut: int) -> None:
    data = b"".join(encode_cache(_cache(["gqa"])))
    with pytest.raises(WireError, match="truncated"):
        decode_transfer(data[:cut])


def _frames_and_trailer(cache: KVCache) -> tuple[list, Trailer]:
    frames = [f for layer in cache.layers for f in layer_frames(cache.request_id, layer, 64)]
    trailer = Trailer(cache.request_id, cache.model, cache.tokens, len(cache.layers), len(frames),
                      sum(f.payload.nbytes for f in frames), transfer_digest(f.record for f in frames))
    return frames, trailer


def _stream(frames: list, trailer: Trailer) -> bytes:
    return b"".join(f.header + bytes(f.payload) for f in frames) + encode_trailer(trailer)


TRAILER_CASES = {
    "missing frame": (lambda fr, t: (fr[1:], t), "frames"),
    "duplicate frame": (lambda fr, t: (fr + fr[:1], Trailer(**{**t.__dict__, "frame_count": t.frame_count + 1,
                                                            "payload_bytes": t.payload_bytes + fr[0].payload.nbytes})),
                        "more bytes|overlapping"),
    "wrong digest": (lambda fr, t: (fr, Trailer(**{**t.__dict__, "digest": t.digest ^ 1})), "whole-transfer checksum"),
    "wrong layer count": (lambda fr, t: (fr, Trailer(**{**t.__dict__, "layer_count": 5})), "layers"),
}


@pytest.mark.parametrize("case", list(TRAILER_CASES))
def test_transfer_that_disagrees_with_its_trailer_is_rejected(case: str) -> None:
    mutate, field = TRAILER_CASES[case]
    frames, trailer = _frames_and_trailer(_cache(["gqa", "mla"]))
    with pytest.raises(WireError, match=field):
        decode_transfer(_stream(*mutate(frames, trailer)))


def test_request_byte_limit_bounds_what_a_transfer_may_allocate() -> None:
    data = b"".join(encode_cache(_cache(["gqa", "gqa", "gqa"], tokens=64)))
    with pytest.raises(WireError, match="request limit"):
        decode_transfer(data, WireLimits(max_request_bytes=4096))


def test_frame_limit_bounds_the_records_a_transfer_may_keep() -> None:
    """Empty frames repeated cost a record each and no byte of the budget: a receiver's memory grew without bound."""
    data = b"".join(encode_cache(_cache(["gqa", "gqa"], tokens=64), 64))
    assert decode_transfer(data, WireLimits(max_frames=10_000))
    with pytest.raises(WireError, match="more than 3 frames"):
        decode_transfer(data, WireLimits(max_frames=3))


def test_layer_sent_with_two_kinds_is_rejected() -> None:
    a = layer_frames("r", LayerKV(0, "gqa", _layer("gqa").tensors))
    b = layer_frames("r", LayerKV(0, "swa", _layer("swa").tensors))
    asm = KVAssembler("r")
    asm.sink(FrameDecoder().feed(a[0].header + bytes(a[0].payload))[0].header)
    with pytest.raises(WireError, match="layer kind"):
        asm.sink(FrameDecoder().feed(b[0].header + bytes(b[0].payload))[0].header)


def test_unsupported_layer_content_is_refused_by_the_encoder() -> None:
    with pytest.raises(WireError, match="unknown tensors"):
        layer_frames("r", LayerKV(0, "gqa", {"q": torch.zeros(2, 2, 2)}))
    with pytest.raises(WireError, match="dims"):
        layer_frames("r", LayerKV(0, "gqa", {"k": torch.zeros(2, 2), "v": torch.zeros(2, 2)}))
    with pytest.raises(WireError, match="request_id"):
        layer_frames("x" * 300, _layer("gqa"))
