"""The KV wire format: checksummed, layer-by-layer frames sent straight from tensor memory.

Who knows what: the *encoder* turns a `LayerKV` into frames whose payloads are memoryviews of the
tensors' own storage (no copy; the transport hands header + payload to `sendmsg`). The *decoder*
(`FrameDecoder`) reads frames incrementally into buffers its caller chooses (so a receiver writes
payload bytes straight into the destination tensor), validates every header field before
allocating anything, and verifies each payload checksum. The *assembler* (`KVAssembler`) collects
the frames of one request into a `KVCache` (or, in profile mode, a verified byte count) and checks
the trailer: frame count, byte count, layer count and a whole-transfer digest.

Byte layout, limits and the checksum choice are specified in docs/kv.md. Nothing is unpickled.
"""

from __future__ import annotations

import math
import mmap
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from testbed.kv.cache import LAYER_KINDS, TENSOR_NAMES, KVCache, LayerKV

if TYPE_CHECKING:  # torch is imported where a tensor is made or viewed: profile mode never imports it (fast start)
    import torch

MAGIC = b"PFKV"
VERSION = 1

FRAME_DATA = 1
FRAME_TRAILER = 2
FRAME_ACK = 3
FRAME_ABORT = 4

FLAG_DISCARD = 0x1  # profile mode: payload is real bytes of the right size, verified and counted, not kept
KNOWN_FLAGS = FLAG_DISCARD

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_DIMS = 4

# prefix: magic, version, frame type, flags
PREFIX = struct.Struct("<4sBBH")
# data body: rid_len, kind, slot, dtype, layer_index, ndim, pad[3], shape[4], offset, length, checksum
DATA_BODY = struct.Struct("<BBBBIB3x4IQQQ")
# trailer body: rid_len, model_len, pad, layer_count, frame_count, payload_bytes, tokens, digest
TRAILER_BODY = struct.Struct("<BBHIQQQQ")
# ack / abort body: rid_len, status, reason_len, pad
ACK_BODY = struct.Struct("<BBH4x")
HEADER_CRC = struct.Struct("<I")
RECORD = struct.Struct("<IBQQQ")  # layer_index, slot, offset, length, checksum (whole-transfer digest input)

BODIES = {FRAME_DATA: DATA_BODY, FRAME_TRAILER: TRAILER_BODY, FRAME_ACK: ACK_BODY, FRAME_ABORT: ACK_BODY}
MAX_REASON_BYTES = 1024
MAX_REQUEST_ID_BYTES = 255  # a request id's UTF-8 length is one byte of every header

# dtype code on the wire -> torch dtype name, and each one's bytes per element
DTYPES: dict[int, str] = {
    1: "bfloat16",
    2: "float16",
    3: "float32",
    4: "float64",
    5: "uint8",
    6: "int8",
    7: "float8_e4m3fn",
    8: "float8_e5m2",
}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
ITEMSIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
KIND_CODES = {kind: i for i, kind in enumerate(LAYER_KINDS)}
# tensor rank per (kind, slot), from testbed.kv.cache's layout
RANKS = {("linear", 0): 3, ("linear", 1): 2, ("gqa", 0): 3, ("gqa", 1): 3, ("mla", 0): 2, ("mla", 1): 2, ("swa", 0): 3, ("swa", 1): 3}
REQUIRED_SLOTS = {"linear": (0,), "gqa": (0, 1), "mla": (0, 1), "swa": (0, 1)}


class WireError(ValueError):
    """Bytes on the wire that are not a valid KV frame or transfer; the message says which field and why."""


class ChecksumError(WireError):
    """A payload whose checksum does not match: the stream is still in sync, the request is not usable."""

    def __init__(self, message: str, header: DataHeader) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True)
class WireLimits:
    """Bounds on what a decoder will allocate for one frame, one tensor and one request."""

    max_frame_bytes: int = 64 << 20
    max_tensor_bytes: int = 8 << 30
    max_request_bytes: int = 64 << 30
    max_layers: int = 4096
    # frames of one request: each costs a record, so empty frames repeated (shape (0, 1, 1), no payload) grew a
    # receiver's memory without bound; a 64 GiB request in 1 MiB frames is 65,536
    max_frames: int = 1 << 18


def checksum(data: memoryview | bytes | bytearray) -> int:
    """xxh3-64 of a payload: ~17 GiB/s on one core here vs ~2-3 GiB/s for zlib.crc32 (docs/kv.md)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class DataHeader:
    request_id: str
    layer_index: int
    kind: str
    slot: int
    dtype: str  # a torch dtype name ("bfloat16"); a torch.dtype given here is turned into its name
    shape: tuple[int, ...]
    offset: int
    length: int
    checksum: int
    flags: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def discard(self) -> bool:
        return bool(self.flags & FLAG_DISCARD)


@dataclass(frozen=True)
class Trailer:
    request_id: str
    model: str
    tokens: int
    layer_count: int
    frame_count: int
    payload_bytes: int
    digest: int


@dataclass(frozen=True)
class Ack:
    """Receiver -> sender (FRAME_ACK) or sender -> receiver (FRAME_ABORT): a request's outcome."""

    request_id: str
    ok: bool
    reason: str = ""
    abort: bool = False


@dataclass
class Frame:
    """One encoded data frame: header bytes + zero-copy payload view."""

    header: bytes
    payload: memoryview
    record: bytes  # digest input (layer, slot, offset, length, checksum)

    @property
    def wire_bytes(self) -> int:
        return len(self.header) + self.payload.nbytes


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"`` (without importing torch)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _itemsize(dtype: str) -> int:
    return ITEMSIZES[dtype]


def _rid_bytes(request_id: str) -> bytes:
    rid = request_id.encode("utf-8")
    if not 1 <= len(rid) <= MAX_REQUEST_ID_BYTES:
        raise WireError(f"request_id: must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {len(rid)}")
    return rid


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU contiguous tensor as a flat memoryview (no copy); other tensors are copied once."""
    import torch

    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _seal(prefix_and_body: bytes, tail: bytes) -> bytes:
    return prefix_and_body + HEADER_CRC.pack(zlib.crc32(tail, zlib.crc32(prefix_and_body))) + tail


def encode_data_header(h: DataHeader) -> bytes:
    rid = _rid_bytes(h.request_id)
    shape = tuple(h.shape) + (0,) * (MAX_DIMS - len(h.shape))
    body = DATA_BODY.pack(len(rid), KIND_CODES[h.kind], h.slot, DTYPE_CODES[h.dtype], h.layer_index, len(h.shape), *shape, h.offset, h.length, h.checksum)
    return _seal(PREFIX.pack(MAGIC, VERSION, FRAME_DATA, h.flags) + body, rid)


def _record(h: DataHeader) -> bytes:
    return RECORD.pack(h.layer_index, h.slot, h.offset, h.length, h.checksum)


def tensor_frames(request_id: str, layer_index: int, kind: str, slot: int, data: memoryview, dtype: str | torch.dtype,
                  shape: Sequence[int], chunk_bytes: int = DEFAULT_CHUNK_BYTES, flags: int = 0,
                  checksums: Callable[[memoryview], int] = checksum) -> list[Frame]:
    """Frames of one tensor, split into chunks of at most `chunk_bytes` (the unit spread over connections)."""
    if chunk_bytes <= 0:
        raise WireError(f"chunk_bytes: must be > 0, got {chunk_bytes}")
    frames: list[Frame] = []
    total = data.nbytes
    for offset in range(0, max(total, 1), chunk_bytes):
        part = data[offset:offset + chunk_bytes]
        h = DataHeader(request_id, layer_index, kind, slot, dtype, tuple(shape), offset, part.nbytes, checksums(part), flags)
        frames.append(Frame(encode_data_header(h), part, _record(h)))
    return frames


def layer_frames(request_id: str, layer: LayerKV, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Frame]:
    """All frames of one layer, tensors in the kind's fixed order, payloads viewing tensor memory."""
    if layer.kind not in TENSOR_NAMES:
        raise WireError(f"layer kind: must be one of {', '.join(LAYER_KINDS)}, got {layer.kind!r}")
    names = TENSOR_NAMES[layer.kind]
    unknown = set(layer.tensors) - set(names)
    if unknown:
        raise WireError(f"layer {layer.layer_index} ({layer.kind}): unknown tensors {sorted(unknown)}; allowed {list(names)}")
    frames: list[Frame] = []
    for slot, name in enumerate(names):
        t = layer.tensors.get(name)
        if t is None:
            continue
        if dtype_name(t.dtype) not in DTYPE_CODES:
            raise WireError(f"layer {layer.layer_index} {name}: dtype {t.dtype} not supported on the wire")
        if t.dim() != RANKS[(layer.kind, slot)]:
            raise WireError(f"layer {layer.layer_index} {name}: expected {RANKS[(layer.kind, slot)]} dims, got shape {tuple(t.shape)}")
        frames += tensor_frames(request_id, layer.layer_index, layer.kind, slot, tensor_view(t), t.dtype, t.shape, chunk_bytes)
    return frames


MAX_PROFILE_LAYER_BYTES = (1 << 32) - 1  # a profile-mode layer's payload: its byte count is 32-bit on the wire


def profile_frames(request_id: str, layer_index: int, kind: str, nbytes: int, buffer: memoryview,
                   checksums: dict[int, int], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Frame]:
    """Profile mode: `nbytes` of real payload for one layer, every chunk sent from the same reusable
    `buffer` (>= chunk_bytes), framed and checksummed like a tensor; `checksums` caches per chunk length."""
    if kind not in KIND_CODES:
        raise WireError(f"layer kind: must be one of {', '.join(LAYER_KINDS)}, got {kind!r}")
    if nbytes <= 0 or nbytes > MAX_PROFILE_LAYER_BYTES:
        raise WireError(f"profile bytes: layer {layer_index} must carry 1..2^32-1 bytes, got {nbytes}")
    if buffer.nbytes < min(chunk_bytes, nbytes):
        raise WireError(f"profile buffer: {buffer.nbytes} bytes, smaller than a chunk ({chunk_bytes})")
    frames: list[Frame] = []
    for offset in range(0, nbytes, chunk_bytes):
        length = min(chunk_bytes, nbytes - offset)
        part = buffer[:length]
        if length not in checksums:
            checksums[length] = checksum(part)
        h = DataHeader(request_id, layer_index, kind, 0, "uint8", (nbytes,), offset, length, checksums[length], FLAG_DISCARD)
        frames.append(Frame(encode_data_header(h), part, _record(h)))
    return frames


def data_header_bytes(request_id: str) -> int:
    """Size of one data frame's header (fixed part + request id)."""
    return PREFIX.size + DATA_BODY.size + HEADER_CRC.size + len(_rid_bytes(request_id))


def wire_bytes_for(request_id: str, tensor_nbytes: Iterable[int], model: str = "",
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Bytes on the wire for tensors of these sizes: payload + one header per chunk + the trailer."""
    sizes = list(tensor_nbytes)
    frames = sum(max(1, -(-n // chunk_bytes)) for n in sizes)
    trailer = PREFIX.size + TRAILER_BODY.size + HEADER_CRC.size + len(_rid_bytes(request_id)) + len(model.encode())
    return sum(sizes) + frames * data_header_bytes(request_id) + trailer


def encode_layer_frames(request_id: str, layer: LayerKV, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[memoryview | bytes]:
    """Header and payload buffers of one layer, ready for scatter-gather `sendmsg` (payloads are not copied)."""
    out: list[memoryview | bytes] = []
    for f in layer_frames(request_id, layer, chunk_bytes):
        out += [f.header, f.payload]
    return out


def transfer_digest(records: Iterable[bytes]) -> int:
    """Whole-transfer checksum: xxh3-64 over the sorted per-frame records (order of arrival does not matter)."""
    h = xxhash.xxh3_64()
    for r in sorted(records):
        h.update(r)
    return h.intdigest()


def encode_trailer(t: Trailer) -> bytes:
    rid = _rid_bytes(t.request_id)
    model = t.model.encode("utf-8")
    if len(model) > 255:
        raise WireError(f"model: name must be at most 255 UTF-8 bytes, got {len(model)}")
    body = TRAILER_BODY.pack(len(rid), len(model), 0, t.layer_count, t.frame_count, t.payload_bytes, t.tokens, t.digest)
    return _seal(PREFIX.pack(MAGIC, VERSION, FRAME_TRAILER, 0) + body, rid + model)


def encode_ack(a: Ack) -> bytes:
    rid = _rid_bytes(a.request_id)
    reason = a.reason.encode("utf-8")[:MAX_REASON_BYTES]
    kind = FRAME_ABORT if a.abort else FRAME_ACK
    return _seal(PREFIX.pack(MAGIC, VERSION, kind, 0) + ACK_BODY.pack(len(rid), 1 if a.ok else 0, len(reason)), rid + reason)


def encode_cache(cache: KVCache, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[memoryview | bytes]:
    """A whole transfer (all layers + trailer) as buffers; `b"".join(...)` gives the byte stream."""
    frames = [f for layer in cache.layers for f in layer_frames(cache.request_id, layer, chunk_bytes)]
    trailer = Trailer(cache.request_id, cache.model, cache.tokens, len(cache.layers), len(frames),
                      sum(f.payload.nbytes for f in frames), transfer_digest(f.record for f in frames))
    out: list[memoryview | bytes] = []
    for f in frames:
        out += [f.header, f.payload]
    out.append(encode_trailer(trailer))
    return out


# ---------------------------------------------------------------------------------------------- decoding

def _decode_rid(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("request_id: not valid UTF-8") from None


def _parse_data(flags: int, body: tuple, tail: bytes, limits: WireLimits) -> DataHeader:
    rid_len, kind_code, slot, dtype_code, layer_index, ndim, *rest = body
    shape_all, offset, length, csum = tuple(rest[:MAX_DIMS]), rest[4], rest[5], rest[6]
    if kind_code >= len(LAYER_KINDS):
        raise WireError(f"layer kind: code {kind_code} unknown; allowed 0..{len(LAYER_KINDS) - 1} ({', '.join(LAYER_KINDS)})")
    kind = LAYER_KINDS[kind_code]
    if dtype_code not in DTYPES:
        raise WireError(f"dtype: code {dtype_code} unknown; allowed {sorted(DTYPES)}")
    dtype = DTYPES[dtype_code]
    if layer_index >= limits.max_layers:
        raise WireError(f"layer index: {layer_index} exceeds the limit of {limits.max_layers} layers")
    if not 1 <= ndim <= MAX_DIMS or any(shape_all[ndim:]):
        raise WireError(f"shape: {ndim} dims declared (allowed 1..{MAX_DIMS}, unused dims zero), got {shape_all}")
    shape = shape_all[:ndim]
    if flags & FLAG_DISCARD:
        if dtype != "uint8" or ndim != 1 or slot != 0:
            raise WireError(f"profile frame: must be uint8, 1-D, slot 0; got {dtype}, shape {shape}, slot {slot}")
    else:
        if slot >= len(TENSOR_NAMES[kind]):
            raise WireError(f"tensor slot: {slot} invalid for kind {kind} (tensors {list(TENSOR_NAMES[kind])})")
        if ndim != RANKS[(kind, slot)]:
            raise WireError(f"shape: {kind} {TENSOR_NAMES[kind][slot]} needs {RANKS[(kind, slot)]} dims, got {shape}")
    tensor_bytes = math.prod(shape) * _itemsize(dtype)
    if tensor_bytes > limits.max_tensor_bytes:
        raise WireError(f"shape: {shape} of {dtype} is {tensor_bytes} bytes, above the limit of {limits.max_tensor_bytes}")
    if length > limits.max_frame_bytes:
        raise WireError(f"byte length: {length} above the frame limit of {limits.max_frame_bytes}")
    if offset + length > tensor_bytes or (length == 0 and tensor_bytes > 0):
        raise WireError(f"byte length: shape {shape} of {dtype} holds {tensor_bytes} bytes but the frame covers "
                        f"offset {offset} + length {length}")
    return DataHeader(_decode_rid(tail[:rid_len]), layer_index, kind, slot, dtype, shape, offset, length, csum, flags)


def _parse_trailer(body: tuple, tail: bytes, limits: WireLimits) -> Trailer:
    rid_len, model_len, _, layer_count, frame_count, payload_bytes, tokens, digest = body
    if layer_count > limits.max_layers:
        raise WireError(f"trailer layer count: {layer_count} exceeds the limit of {limits.max_layers}")
    if payload_bytes > limits.max_request_bytes:
        raise WireError(f"trailer payload bytes: {payload_bytes} above the request limit of {limits.max_request_bytes}")
    try:
        model = tail[rid_len:rid_len + model_len].decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("trailer model: not valid UTF-8") from None
    return Trailer(_decode_rid(tail[:rid_len]), model, tokens, layer_count, frame_count, payload_bytes, digest)


def _parse_ack(ftype: int, body: tuple, tail: bytes) -> Ack:
    rid_len, status, _ = body
    if status > 1:
        raise WireError(f"ack status: {status} unknown; allowed 0 (failed) or 1 (ok)")
    reason = tail[rid_len:].decode("utf-8", errors="replace")
    return Ack(_decode_rid(tail[:rid_len]), bool(status), reason, abort=ftype == FRAME_ABORT)


PayloadSink = Callable[[DataHeader], memoryview | None]


@dataclass
class DataFrame:
    header: DataHeader
    payload: memoryview  # where the payload was written (a region of the sink's buffer)


class FrameDecoder:
    """Incremental decoder with bounded allocation: `next_buffer()` says where the next bytes go,
    `advance(n)` consumes them and returns a complete `DataFrame`/`Trailer`/`Ack`, or None.

    Headers are read in stages (prefix, body, strings) and validated, header CRC included, before any
    payload buffer exists. `sink(header)` may return a writable view of exactly `header.length` bytes
    (e.g. a region of the destination tensor); otherwise the decoder allocates one (≤ max_frame_bytes).
    A payload checksum mismatch raises `ChecksumError` with the stream still in sync; any other
    `WireError` means the stream cannot be trusted any more.
    """

    def __init__(self, limits: WireLimits = WireLimits(), sink: PayloadSink | None = None) -> None:
        self.limits = limits
        self.sink = sink
        self._buf = bytearray(PREFIX.size + DATA_BODY.size + HEADER_CRC.size + 255 + MAX_REASON_BYTES + 255)
        self._view = memoryview(self._buf)
        self._reset()

    def _reset(self) -> None:
        self._stage = "prefix"
        self._need = PREFIX.size
        self._have = 0
        self._target: memoryview = self._view[:PREFIX.size]
        self._header: DataHeader | None = None

    @property
    def idle(self) -> bool:
        """True between frames (a clean place for the stream to end)."""
        return self._stage == "prefix" and self._have == 0

    def next_buffer(self) -> memoryview:
        return self._target[self._have:self._need]

    def advance(self, n: int) -> DataFrame | Trailer | Ack | None:
        self._have += n
        if self._have < self._need:
            return None
        return self._step()

    def feed(self, data: bytes | bytearray | memoryview) -> list[DataFrame | Trailer | Ack]:
        """Decode from arbitrary splits of a byte stream (payloads are copied into sink/own buffers)."""
        out: list[DataFrame | Trailer | Ack] = []
        src = memoryview(data).cast("B")
        pos = 0
        while pos < len(src):
            dst = self.next_buffer()
            k = min(len(dst), len(src) - pos)
            dst[:k] = src[pos:pos + k]
            pos += k
            item = self.advance(k)
            if item is not None:
                out.append(item)
        return out

    def _step(self) -> DataFrame | Trailer | Ack | None:
        if self._stage == "prefix":
            magic, version, ftype, flags = PREFIX.unpack_from(self._buf, 0)
            if magic != MAGIC:
                raise WireError(f"magic: expected {MAGIC!r}, got {bytes(magic)!r} (not a KV stream, or out of sync)")
            if version != VERSION:
                raise WireError(f"version: {version} not supported (this decoder speaks version {VERSION})")
            if ftype not in BODIES:
                raise WireError(f"frame type: {ftype} unknown; allowed {sorted(BODIES)}")
            if flags & ~KNOWN_FLAGS or (flags and ftype != FRAME_DATA):
                raise WireError(f"flags: 0x{flags:x} not allowed for frame type {ftype}")
            self._ftype, self._flags = ftype, flags
            self._stage, self._need = "body", PREFIX.size + BODIES[ftype].size + HEADER_CRC.size
            self._target = self._view
            return None if self._have < self._need else self._step()
        if self._stage == "body":
            body_struct = BODIES[self._ftype]
            self._body = body_struct.unpack_from(self._buf, PREFIX.size)
            if self._body[0] == 0:
                raise WireError("request_id: empty")
            tail = self._body[0]
            if self._ftype == FRAME_TRAILER:
                tail += self._body[1]
            elif self._ftype in (FRAME_ACK, FRAME_ABORT):
                if self._body[2] > MAX_REASON_BYTES:
                    raise WireError(f"reason length: {self._body[2]} above {MAX_REASON_BYTES}")
                tail += self._body[2]
            self._fixed = self._need
            self._stage, self._need = "tail", self._need + tail
            return None if self._have < self._need else self._step()
        if self._stage == "tail":
            fixed = self._fixed
            (crc,) = HEADER_CRC.unpack_from(self._buf, fixed - HEADER_CRC.size)
            tail = bytes(self._buf[fixed:self._need])
            if crc != zlib.crc32(tail, zlib.crc32(self._buf[:fixed - HEADER_CRC.size])):
                raise WireError("header checksum: mismatch (corrupted header)")
            if self._ftype == FRAME_TRAILER:
                item: Trailer | Ack = _parse_trailer(self._body, tail, self.limits)
                self._reset()
                return item
            if self._ftype in (FRAME_ACK, FRAME_ABORT):
                item = _parse_ack(self._ftype, self._body, tail)
                self._reset()
                return item
            header = _parse_data(self._flags, self._body, tail, self.limits)
            target = self.sink(header) if self.sink is not None else None
            if target is None:
                target = memoryview(bytearray(header.length))
            elif target.nbytes != header.length:
                raise WireError(f"sink returned {target.nbytes} bytes for a {header.length}-byte payload")
            self._header, self._target = header, target.cast("B") if target.format != "B" else target
            self._stage, self._have, self._need = "payload", 0, header.length
            return None if self._need > 0 else self._step()
        header, payload = self._header, self._target
        assert header is not None
        self._reset()
        if checksum(payload) != header.checksum:
            raise ChecksumError(f"payload checksum: mismatch in request {header.request_id} layer {header.layer_index} "
                                f"({header.kind} {_slot_name(header)}) at offset {header.offset}", header)
        return DataFrame(header, payload)


def _slot_name(h: DataHeader) -> str:
    return "bytes" if h.discard else TENSOR_NAMES[h.kind][h.slot]


# ---------------------------------------------------------------------------------------------- assembly

HUGE_ALLOC_BYTES = 2 << 20
MADV_POPULATE_WRITE = 23


def alloc_tensor(shape: Sequence[int], dtype: str | torch.dtype) -> torch.Tensor:
    """A destination tensor. Large ones get their own anonymous mapping with transparent huge pages:
    first-touch page faults, not the copy, dominate receiving into fresh memory on VMs (measured
    0.5 GiB/s with 4 KiB pages vs ~2.2 GiB/s with 2 MiB pages, side by side; docs/kv.md)."""
    import torch

    dtype = getattr(torch, dtype_name(dtype))
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_ALLOC_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(tuple(shape), dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    try:
        region.madvise(MADV_POPULATE_WRITE)  # fault the whole region in one call (Linux >= 5.14)
    except OSError:
        pass
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(tuple(shape))

@dataclass
class _TensorParts:
    header: DataHeader
    tensor: torch.Tensor | None
    view: memoryview | None
    covered: list[tuple[int, int]] = field(default_factory=list)
    covered_bytes: int = 0
    alloc_lock: threading.Lock = field(default_factory=threading.Lock)  # one allocation, outside a receiver's lock

    def allocate(self) -> memoryview | None:
        """The destination tensor's bytes, allocated on first use (None: a discarded, profile-mode tensor). Safe from
        several threads: the first allocates, the others wait for it (`KVReceiver` calls it outside its own lock, so a
        large tensor's allocation, whose pages are faulted in at once, no longer stalls every other connection)."""
        if self.header.discard:
            return None
        with self.alloc_lock:
            if self.view is None:
                self.tensor = alloc_tensor(self.header.shape, self.header.dtype)
                self.view = tensor_view(self.tensor)
            return self.view


class KVAssembler:
    """Collects one request's frames (in any order, from any connection) into a verified result.

    Allocates each destination tensor once, on its first frame, within `limits.max_request_bytes`;
    rejects frames that disagree with earlier ones about a tensor (kind, dtype, shape) or overlap.
    """

    def __init__(self, request_id: str, limits: WireLimits = WireLimits()) -> None:
        self.request_id = request_id
        self.limits = limits
        self.parts: dict[tuple[int, int], _TensorParts] = {}
        self.kinds: dict[int, str] = {}
        self.records: list[bytes] = []
        self.allocated_bytes = 0
        self.payload_bytes = 0
        self.discard: bool | None = None

    def reserve(self, h: DataHeader) -> _TensorParts:
        """Check a frame's header against the transfer and reserve its tensor's bytes within the limits, without
        allocating them: the tensor is allocated on first use (`_TensorParts.allocate`; `KVReceiver` calls it where
        it holds no lock of its own)."""
        if h.request_id != self.request_id:
            raise WireError(f"request_id: frame for {h.request_id!r} given to the assembler of {self.request_id!r}")
        if self.discard is None:
            self.discard = h.discard
        elif self.discard != h.discard:
            raise WireError("flags: a transfer mixes profile (discard) and tensor frames")
        if self.kinds.setdefault(h.layer_index, h.kind) != h.kind:
            raise WireError(f"layer kind: layer {h.layer_index} sent as {self.kinds[h.layer_index]} and as {h.kind}")
        key = (h.layer_index, h.slot)
        parts = self.parts.get(key)
        if parts is None:
            size = h.tensor_bytes
            if self.allocated_bytes + size > self.limits.max_request_bytes:
                raise WireError(f"request {self.request_id}: {self.allocated_bytes + size} bytes exceeds the request "
                                f"limit of {self.limits.max_request_bytes}")
            if len(self.kinds) > self.limits.max_layers:
                raise WireError(f"request {self.request_id}: more than {self.limits.max_layers} layers")
            self.allocated_bytes += size  # reserved now; the tensor itself on first use (`_TensorParts.allocate`)
            parts = self.parts[key] = _TensorParts(h, None, None)
        elif (parts.header.dtype, parts.header.shape, parts.header.flags) != (h.dtype, h.shape, h.flags):
            raise WireError(f"layer {h.layer_index} {_slot_name(h)}: frames disagree on dtype/shape "
                            f"({parts.header.dtype} {parts.header.shape} vs {h.dtype} {h.shape})")
        return parts

    def sink(self, h: DataHeader) -> memoryview | None:
        """Where a frame's payload should be received: its place in the destination tensor (None: scratch)."""
        view = self.reserve(h).allocate()
        return None if view is None else view[h.offset:h.offset + h.length]

    def add(self, frame: DataFrame) -> None:
        """Record a verified frame; its payload must already be in place (via `sink`) or is copied there."""
        h = frame.header
        if len(self.records) >= self.limits.max_frames:
            raise WireError(f"request {self.request_id}: more than {self.limits.max_frames} frames")
        parts = self.reserve(h)
        if parts.allocate() is not None:
            assert parts.view is not None
            dst = parts.view[h.offset:h.offset + h.length]
            if frame.payload.obj is not parts.view.obj:  # not received in place via sink()
                dst[:] = frame.payload
        parts.covered.append((h.offset, h.length))
        parts.covered_bytes += h.length
        if parts.covered_bytes > h.tensor_bytes:
            raise WireError(f"layer {h.layer_index} {_slot_name(h)}: more bytes received than the shape holds (duplicate frame?)")
        self.payload_bytes += h.length
        self.records.append(_record(h))

    def finish(self, trailer: Trailer) -> KVCache | int:
        """Check the transfer against its trailer; return the `KVCache` (or the byte count in profile mode)."""
        if trailer.request_id != self.request_id:
            raise WireError(f"trailer: for {trailer.request_id!r}, expected {self.request_id!r}")
        if len(self.records) != trailer.frame_count or self.payload_bytes != trailer.payload_bytes:
            raise WireError(f"trailer: {trailer.frame_count} frames / {trailer.payload_bytes} bytes announced, "
                            f"{len(self.records)} / {self.payload_bytes} received")
        if len(self.kinds) != trailer.layer_count:
            raise WireError(f"trailer: {trailer.layer_count} layers announced, {len(self.kinds)} received")
        for (layer_index, _), parts in self.parts.items():
            spans = sorted(parts.covered)
            pos = 0
            for off, length in spans:
                if off != pos:
                    raise WireError(f"layer {layer_index} {_slot_name(parts.header)}: bytes {pos}..{off} missing or overlapping")
                pos = off + length
            if pos != parts.header.tensor_bytes:
                raise WireError(f"layer {layer_index} {_slot_name(parts.header)}: {pos} of {parts.header.tensor_bytes} bytes received")
        if transfer_digest(self.records) != trailer.digest:
            raise WireError(f"trailer: whole-transfer checksum mismatch for request {self.request_id}")
        if self.discard:
            return self.payload_bytes
        layers = []
        for layer_index in sorted(self.kinds):
            kind = self.kinds[layer_index]
            tensors = {name: self.parts[(layer_index, slot)].tensor for slot, name in enumerate(TENSOR_NAMES[kind])
                       if (layer_index, slot) in self.parts}
            missing = [TENSOR_NAMES[kind][s] for s in REQUIRED_SLOTS[kind] if (layer_index, s) not in self.parts]
            if missing:
                raise WireError(f"layer {layer_index} ({kind}): tensors {missing} missing")
            layers.append(LayerKV(layer_index, kind, tensors))  # type: ignore[arg-type]
        return KVCache(self.request_id, trailer.model, trailer.tokens, layers)


def decode_transfer(data: bytes | bytearray | memoryview, limits: WireLimits = WireLimits()) -> KVCache | int:
    """Decode one complete transfer from a byte stream (payloads land directly in their tensors)."""
    assembler: KVAssembler | None = None

    def sink(h: DataHeader) -> memoryview | None:
        nonlocal assembler
        if assembler is None:
            assembler = KVAssembler(h.request_id, limits)
        return assembler.sink(h)

    decoder = FrameDecoder(limits, sink)
    result: KVCache | int | None = None
    for item in decoder.feed(data):
        if result is not None:
            raise WireError("stream: bytes after the trailer")
        if isinstance(item, DataFrame):
            assert assembler is not None
            assembler.add(item)
        elif isinstance(item, Trailer):
            result = (assembler or KVAssembler(item.request_id, limits)).finish(item)
        else:
            raise WireError("stream: unexpected ack/abort frame inside a transfer")
    if result is None or not decoder.idle:
        raise WireError("stream: truncated (transfer ended before its trailer)")
    return result
