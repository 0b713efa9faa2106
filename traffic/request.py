"""One request of a workload, as every part of the testbed sees it.

Prompts are sequences of 512-token block hashes (the Mooncake trace representation): two requests
whose `block_hashes` share a leading run share that many blocks of reusable prefix, so cache hits
are computable anywhere (router, prefix pools, analysis) without carrying token text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

from testbed.blocks import prompt_token_ids

if TYPE_CHECKING:
    import numpy as np



@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_s: float  # seconds from the start of the workload
    input_len: int  # prompt tokens
    output_len: int  # tokens to decode
    block_hashes: tuple[int, ...] = ()  # one per BLOCK_TOKENS of prompt (the last may be partial)
    session_id: int | None = None  # multi-turn conversation this request belongs to

    def prompt_token_ids(self, vocab_size: int) -> list[int]:
        """Deterministic token ids derived from the block hashes, so equal prefixes give equal tokens."""
        return prompt_token_ids(self.block_hashes, self.input_len, vocab_size, self.request_id)


@dataclass(frozen=True)
class RequestBatch:
    """Many requests as numpy columns (the form workloads are generated, analysed and written in).

    `Request` objects are for the serving path one at a time; a million of them are built in bulk here and
    materialised lazily (`__iter__`, `to_requests`). Block hashes are stored flat with offsets (CSR):
    request i owns ``hashes[hash_offsets[i]:hash_offsets[i + 1]]``. ``session_id`` is -1 for none.
    """

    arrival_s: "np.ndarray"
    input_len: "np.ndarray"
    output_len: "np.ndarray"
    session_id: "np.ndarray"
    hash_offsets: "np.ndarray"
    hashes: "np.ndarray"
    id_prefix: str = "r"

    def __len__(self) -> int:
        return len(self.arrival_s)

    def request_id(self, i: int) -> str:
        return f"{self.id_prefix}{i}"

    def block_hashes(self, i: int) -> tuple[int, ...]:
        return tuple(self.hashes[self.hash_offsets[i] : self.hash_offsets[i + 1]].tolist())

    def __iter__(self) -> "Iterator[Request]":
        arr, inp, out, ses = (c.tolist() for c in (self.arrival_s, self.input_len, self.output_len, self.session_id))
        offs, flat = self.hash_offsets.tolist(), self.hashes
        for i in range(len(arr)):
            yield Request(
                f"{self.id_prefix}{i}",
                arr[i],
                inp[i],
                out[i],
                tuple(flat[offs[i] : offs[i + 1]].tolist()),
                None if ses[i] < 0 else ses[i],
            )

    def to_requests(self) -> list[Request]:
        return list(self)

    def take(self, index: "np.ndarray") -> "RequestBatch":
        """Rows `index` (integer positions, in that order), renumbered from 0."""
        import numpy as np

        index = np.asarray(index, dtype=np.int64)
        starts, ends = self.hash_offsets[index], self.hash_offsets[index + 1]
        counts = ends - starts
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        pos = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1] - starts, counts)
        return RequestBatch(
            self.arrival_s[index], self.input_len[index], self.output_len[index], self.session_id[index],
            offsets, self.hashes[pos], self.id_prefix,
        )

    @staticmethod
    def from_requests(requests: "Iterable[Request]", id_prefix: str = "r") -> "RequestBatch":
        import numpy as np

        reqs = list(requests)
        counts = np.fromiter((len(r.block_hashes) for r in reqs), dtype=np.int64, count=len(reqs))
        offsets = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = np.fromiter((h for r in reqs for h in r.block_hashes), dtype=np.int64, count=int(offsets[-1]))
        return RequestBatch(
            np.fromiter((r.arrival_s for r in reqs), dtype=np.float64, count=len(reqs)),
            np.fromiter((r.input_len for r in reqs), dtype=np.int64, count=len(reqs)),
            np.fromiter((r.output_len for r in reqs), dtype=np.int64, count=len(reqs)),
            np.fromiter((-1 if r.session_id is None else r.session_id for r in reqs), dtype=np.int64, count=len(reqs)),
            offsets,
            flat,
            id_prefix,
        )
