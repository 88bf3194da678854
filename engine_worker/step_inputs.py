"""One step's model inputs, built in persistent buffers.

Model. Everything a step's forward pass reads besides the weights and the cache is
integers: token ids, positions, cache slots, the rows whose logits are wanted, and the
attention metadata (per sequence its context length, its range of query tokens, its
block table row; the chunk tiles of the Triton kernel). They are written with numpy
into host buffers allocated once (pinned on CUDA, so the copy is asynchronous) and sent
to fixed device buffers in two copies per step: one of the int64 vectors, one of the
block table rows the step uses. Nothing builds a device tensor from a Python list.

The vectors are packed densely in an order that depends only on the padded token and
sequence counts, so a decode step of a given padded size always finds its inputs at
the same device addresses (which a CUDA graph captured at that size reads).

The block table is kept on the host between steps: a row whose sequence is the same as
last step only gets its new block ids written; a row whose sequence changed is
rewritten. Entries past a sequence's context are never read.

Padded rows (a CUDA graph's batch filled up to its size) have context length 0, token
id 0, position 0 and slot -1: attention reads nothing for them and the KV write skips
them.

A model split over tensor-parallel ranks (models/layers/parallel.py): rank 0 prepares
each step and broadcasts its buffers (the header of where each vector lies, the
vectors, the block table rows) to the other ranks, which take them into their own
(``receive``) and run the same step on their shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from engine_worker.attention import AttentionMetadata
from engine_worker.block_manager import NULL_BLOCK
from engine_worker.models.layers.parallel import NOT_SPLIT, CollectiveClock, Parallel
from engine_worker.scheduler import ScheduledRequest


# Every packed vector starts on a multiple of 16 int64 elements (128 bytes): Triton
# specializes a kernel on whether each pointer it gets is 16-byte aligned, so vectors
# at offsets that follow the step's token count would compile a new variant of a
# kernel in the middle of serving (a second or so each) whenever the count's parity
# pattern is new.
_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# A step's header (int64): the vectors' end, the padded sequences, the sequences and
# tokens before padding, the sampled rows, the attention's decode rows and splits, then
# each vector's (start, stop) in the order of _VECTORS (a vector that is absent: -1, -1).
_VECTORS = ("ids", "positions", "slots", "local_slots", "seq_lens", "query_start",
            "logits_rows", "tile_seq", "tile_offset", "fill_rows", "fill_sources")
_HEADER = 7 + 2 * len(_VECTORS)
# A header whose first entry is this: no more steps (the ranks that follow stop).
_STOP = -1


class _Packer:
    """Lays a step's vectors out one after another in the int64 buffer, each on an
    _ALIGN boundary, so that their offsets depend only on the vectors' sizes."""

    def __init__(self, ints: np.ndarray) -> None:
        self.ints = ints
        self.used = 0  # the end of the last vector
        self._next = 0

    def put(self, size: int, values=(), pad: int = 0) -> slice:
        """A vector of ``size``: ``values`` first, then ``pad``."""
        at = self._next
        n = len(values)
        if n:
            self.ints[at:at + n] = values
        self.ints[at + n:at + size] = pad
        self.used, self._next = at + size, at + _aligned(size)
        return slice(at, at + size)


@dataclass
class StepBatch:
    """A step's inputs on the device (views of the persistent buffers)."""

    input_ids: torch.Tensor  # (T,) int64, padded rows included
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    # (R,) int64: rows of the hidden states whose logits are computed: the sampled
    # rows (one per request that samples, in ``scheduled`` order), then prompt rows.
    logits_rows: torch.Tensor
    num_sampled: int
    # Sequences and tokens before padding.
    num_seqs: int
    num_tokens: int
    # (F,) int64 each: rows of input_ids whose ids are on the device only, and where
    # in the device's tokens each one is (StepInputs.prepare's fills).
    fill_rows: torch.Tensor
    fill_sources: torch.Tensor

    def fill_ids(self, tokens: Optional[torch.Tensor]) -> None:
        """Copies the device-only ids into input_ids (queued, before the forward)."""
        if self.fill_rows.numel():
            assert tokens is not None
            self.input_ids.index_copy_(0, self.fill_rows,
                                       tokens.index_select(0, self.fill_sources))


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, tile_tokens: int = 1,
                 windowed: bool = False, chunk_tiles: Optional[Callable] = None,
                 parallel: Parallel = NOT_SPLIT) -> None:
        """tile_tokens and chunk_tiles: the attention kernel's tiles of a step's chunks
        (AttentionBackend's; 1 and None: no tiles are needed). windowed: the sliding
        layers' blocks are a pool of their own (window_blocks.py): a second block table
        and slots, in meta.local. parallel: the tensor-parallel ranks, to which rank 0
        broadcasts every step it prepares (the others ``receive`` it)."""
        self.parallel = parallel
        self._header = torch.zeros(_HEADER, dtype=torch.int64,
                                   device=device if device.type == "cuda" else "cpu")
        self.block_size = block_size
        self.device = device
        self.tile_tokens = tile_tokens
        self._chunk_tiles = chunk_tiles
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.width = max_blocks_per_seq
        pin = device.type == "cuda"
        # Vectors: ids, positions, slots, logits rows (T each), seq_lens (S), query
        # start (S + 1), tile sequences and offsets (T each, at most a tile a token),
        # the rows whose ids come from the device and their sources (S each), and the
        # local slots (T: the sliding layers' pool's), each starting on an _ALIGN
        # boundary.
        size = 7 * max_tokens + 4 * max_seqs + 1 + 11 * _ALIGN
        self._host_ints = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(max_seqs, self.width, dtype=torch.int32,
                                        pin_memory=pin)
        self.ints = self._host_ints.numpy()
        self.tables = self._host_tables.numpy()
        self._host_local = (torch.zeros(max_seqs, self.width, dtype=torch.int32,
                                        pin_memory=pin) if windowed else None)
        self.local_tables = None if self._host_local is None else self._host_local.numpy()
        # Recorded after each step's copies: the host buffers are not written again
        # before the copies have read them (a step that samples nothing never waits
        # for the device otherwise).
        self._copied = torch.cuda.Event() if pin else None
        if pin:
            self._device_ints = torch.zeros(size, dtype=torch.int64, device=device)
            self.block_tables = torch.zeros(max_seqs, self.width, dtype=torch.int32,
                                             device=device)
            self.local_block_tables = (None if self._host_local is None else
                                       torch.zeros_like(self._host_local, device=device))
        else:  # the host buffers are the inputs
            self._device_ints = self._host_ints
            self.block_tables = self._host_tables
            self.local_block_tables = self._host_local
        # Per block-table row: the request it holds, how many of its block ids, and
        # how many entries of each table are let go of (NULL_BLOCK).
        self._row_owner: list[Optional[tuple]] = [None] * max_seqs
        self._row_blocks = [0] * max_seqs
        self._row_released = [0] * max_seqs
        self._row_local_released = [0] * max_seqs

    def prepare(self, scheduled: Sequence[ScheduledRequest], logits_rows: Sequence[int],
                num_sampled: int, pad_to: Optional[int] = None,
                num_splits: int = 1, fills: Sequence[tuple[int, int]] = (),
                pad_chunks: Optional[tuple[int, int]] = None,
                pad_tokens: Optional[int] = None) -> StepBatch:
        """``scheduled`` in the step's layout (step_layout): single-token queries
        first, then chunks. ``logits_rows``: the rows whose logits are computed, the
        ``num_sampled`` sampled ones first. ``pad_to``: a decode-only step's padded
        size (a CUDA graph's batch). ``pad_chunks``: a prompt-only step's padded
        (tokens, sequences) (a prompt graph's): its logits rows are padded to the
        sequences, its chunk tiles to chunk_tile_capacity. ``pad_tokens``: any step's
        tokens padded to this many, its sequences as they are (a piecewise graph's:
        gpu/graphs.py). ``fills``: (row, source)
        of the tokens whose ids are on the device only (placeholders in the requests'
        token ids): the caller copies them into ``input_ids`` (fill_rows,
        fill_sources)."""
        num_seqs = len(scheduled)
        q_lens = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64,
                             count=num_seqs)
        num_tokens = int(q_lens.sum())
        num_decode = int(np.argmax(q_lens > 1)) if (q_lens > 1).any() else num_seqs
        t, s = self._padded_sizes(num_tokens, num_seqs, num_decode, pad_to, pad_chunks,
                                  pad_tokens)
        if pad_chunks is not None:
            logits_rows = list(logits_rows) + [0] * (s - len(logits_rows))
        ends = starts + q_lens
        if self._copied is not None:
            self._copied.synchronize()
        self._write_tables(scheduled, ends)

        # The vectors, packed one after another (see _Packer); padded rows past the
        # real ones: no token (id 0, position 0, slot -1), no context.
        pack = _Packer(self.ints)
        ids = pack.put(t)
        self._write_ids(self.ints[ids][:num_tokens], scheduled, q_lens)
        query_start = np.zeros(s + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:num_seqs + 1])
        query_start[num_seqs + 1:] = num_tokens + np.arange(1, s - num_seqs + 1)
        seq_of = np.repeat(np.arange(num_seqs), q_lens)  # per token: its sequence
        positions = np.arange(num_tokens) - query_start[seq_of] + starts[seq_of]
        pos = pack.put(t, positions)
        bs = self.block_size
        slot = pack.put(t, self.tables[seq_of, positions // bs].astype(np.int64) * bs
                        + positions % bs, pad=-1)
        local_slot = None
        if self.local_tables is not None:
            local_slot = pack.put(t, self.local_tables[seq_of, positions // bs]
                                  .astype(np.int64) * bs + positions % bs, pad=-1)
        seq_lens = pack.put(s, ends)
        qs = pack.put(s + 1, query_start)
        rows = pack.put(len(logits_rows), logits_rows)
        tile_seq, tile_offset = self._tiles(q_lens[num_decode:], num_decode, pad_chunks)
        tiles = pack.put(len(tile_seq), tile_seq)
        offsets = pack.put(len(tile_offset), tile_offset)
        fill_rows = pack.put(len(fills), [row for row, _ in fills])
        fill_sources = pack.put(len(fills), [source for _, source in fills])

        vectors = (ids, pos, slot, local_slot or slice(-1, -1), seq_lens, qs, rows, tiles,
                   offsets, fill_rows, fill_sources)
        header = [pack.used, s, num_seqs, num_tokens, num_sampled,
                  num_decode if pad_to is None else s, num_splits]
        header += [i for v in vectors for i in (v.start, v.stop)]
        self._to_device(pack.used, s)
        if self.parallel.size > 1:
            self._send(header)
        return self._batch(header, ends.tolist(), query_start[:num_seqs + 1].tolist())

    def _to_device(self, used: int, s: int) -> None:
        """The host buffers' step copied to the device's (CUDA)."""
        if self._device_ints is self._host_ints:
            return
        self._device_ints[:used].copy_(self._host_ints[:used], non_blocking=True)
        self.block_tables[:s].copy_(self._host_tables[:s], non_blocking=True)
        if self._host_local is not None:
            self.local_block_tables[:s].copy_(self._host_local[:s], non_blocking=True)
        self._copied.record()

    def _batch(self, header: Sequence[int], seq_lens_host: list[int],
               query_start_host: list[int]) -> StepBatch:
        """The step the header describes, as views of the device buffers."""
        _, s, num_seqs, num_tokens, num_sampled, num_decode, num_splits = header[:7]
        dev = self._device_ints
        v = {name: dev[header[7 + 2 * i]:header[8 + 2 * i]]
             for i, name in enumerate(_VECTORS)}
        meta = AttentionMetadata(
            slot_mapping=v["slots"],
            num_decode=num_decode,
            block_tables=self.block_tables[:s],
            seq_lens=v["seq_lens"],
            query_start=v["query_start"],
            tile_seq=v["tile_seq"],
            tile_offset=v["tile_offset"],
            num_splits=num_splits,
            seq_lens_host=seq_lens_host,
            query_start_host=query_start_host,
        )
        if header[7 + 2 * _VECTORS.index("local_slots")] >= 0:
            meta.local = dataclasses.replace(meta, slot_mapping=v["local_slots"],
                                             block_tables=self.local_block_tables[:s])
        return StepBatch(v["ids"], v["positions"], meta, v["logits_rows"], num_sampled,
                         num_seqs, num_tokens, v["fill_rows"], v["fill_sources"])

    # -- tensor parallelism: the step broadcast from rank 0 ---------------------------

    def _buffers(self, used: int, s: int) -> list[torch.Tensor]:
        """What a step broadcasts besides its header: the vectors, the table rows (the
        device's buffers on CUDA, which NCCL moves; the host's on the CPU)."""
        out = [self._device_ints[:used], self.block_tables[:s]]
        if self.local_block_tables is not None:
            out.append(self.local_block_tables[:s])
        return out

    def _send(self, header: list[int]) -> None:
        group = self.parallel.group
        self._header.copy_(torch.tensor(header, dtype=torch.int64))
        for t in [self._header, *self._buffers(header[0], header[1])]:
            CollectiveClock.timed("broadcast", torch.distributed.broadcast, t, 0, group=group)

    def stop(self) -> None:
        """Rank 0: tell the ranks that follow its steps that there are no more."""
        self._header.fill_(_STOP)
        torch.distributed.broadcast(self._header, 0, group=self.parallel.group)

    def receive(self) -> Optional[StepBatch]:
        """A rank other than 0: the next step rank 0 prepared, in this rank's buffers;
        None when rank 0 stopped."""
        group = self.parallel.group
        torch.distributed.broadcast(self._header, 0, group=group)
        header = self._header.tolist()
        if header[0] == _STOP:
            return None
        for t in self._buffers(header[0], header[1]):
            torch.distributed.broadcast(t, 0, group=group)
        num_seqs = header[2]
        dev = self._device_ints
        at = 7 + 2 * _VECTORS.index("seq_lens")
        seq_lens = dev[header[at]:header[at] + num_seqs].tolist()
        at = 7 + 2 * _VECTORS.index("query_start")
        query_start = dev[header[at]:header[at] + num_seqs + 1].tolist()
        return self._batch(header, seq_lens, query_start)

    def _padded_sizes(self, num_tokens: int, num_seqs: int, num_decode: int,
                      pad_to: Optional[int], pad_chunks: Optional[tuple[int, int]],
                      pad_tokens: Optional[int] = None) -> tuple[int, int]:
        """The step's (tokens, sequences) with a graph's padding."""
        tokens, seqs = num_tokens, num_seqs
        if pad_tokens is not None:
            assert num_tokens <= pad_tokens <= self.max_tokens
            tokens = pad_tokens
        if pad_to is not None:
            assert num_decode == num_seqs and pad_to >= num_seqs
            tokens = seqs = pad_to
        if pad_chunks is not None:
            assert num_decode == 0 and num_tokens <= pad_chunks[0] and num_seqs <= pad_chunks[1]
            tokens, seqs = pad_chunks
        if num_tokens > self.max_tokens or seqs > self.max_seqs:
            raise ValueError(f"a step of {num_tokens} tokens in {num_seqs} sequences "
                             f"exceeds the buffers ({self.max_tokens}, {self.max_seqs})")
        return tokens, seqs

    @staticmethod
    def _write_ids(ids: np.ndarray, scheduled: Sequence[ScheduledRequest],
                   q_lens: np.ndarray) -> None:
        """Each request's scheduled token ids, in the step's layout."""
        at = 0
        for sr, n in zip(scheduled, q_lens.tolist()):
            r, start = sr.request, sr.request.num_computed_tokens
            if n == 1:
                ids[at] = r.token_ids[start]
            else:
                ids[at:at + n] = r.token_ids[start:start + n]
            at += n

    def _tiles(self, chunk_lens: np.ndarray, first_seq: int,
               pad_chunks: Optional[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The chunk tiles of the Triton kernel (sequence, first query token), padded
        to a prompt graph's fixed count with tiles that start past every chunk's end."""
        if self._chunk_tiles is None or not (len(chunk_lens) or pad_chunks):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        tile_seq, tile_offset = self._chunk_tiles(chunk_lens, first_seq, self.tile_tokens)
        if pad_chunks is None:
            return tile_seq, tile_offset
        padding = chunk_tile_capacity(*pad_chunks, self.tile_tokens) - len(tile_seq)
        return (np.concatenate([tile_seq, np.zeros(padding, np.int64)]),
                np.concatenate([tile_offset, np.full(padding, pad_chunks[0])]))

    def _write_tables(self, scheduled: Sequence[ScheduledRequest], ends: np.ndarray) -> None:
        """Each sequence's block ids into its row, only what changed since last step."""
        bs = self.block_size
        for row, (sr, end) in enumerate(zip(scheduled, ends.tolist())):
            r = sr.request
            needed = -(-end // bs)
            if needed > self.width:
                raise ValueError(f"a sequence of {end} tokens needs {needed} blocks; the "
                                 f"block table holds {self.width}")
            # A preempted request comes back with other blocks: it owns the row anew.
            owner = (r, r.num_preemptions)
            same = self._row_owner[row] == owner
            have = self._row_blocks[row] if same else 0
            self._write_row(self.tables, self._row_released, row, r.blocks, have, needed,
                            same)
            if self.local_tables is not None:
                self._write_row(self.local_tables, self._row_local_released, row,
                                r.blocks.window, have, needed, same)
            self._row_owner[row] = owner
            self._row_blocks[row] = max(have, needed)

    @staticmethod
    def _write_row(tables: np.ndarray, released_by_row: list[int], row: int, table,
                   have: int, needed: int, same: bool) -> None:
        """A row of a block table: its new block ids, and NULL_BLOCK where blocks were
        let go of since (window_blocks.py: a kernel may read a window's first block
        whole). A made-up step's request with no local table reads the null block."""
        if table is None:
            tables[row, have:needed] = NULL_BLOCK
            return
        first = released_by_row[row] if same else 0
        if table.released > first:
            tables[row, first:table.released] = NULL_BLOCK
        if needed > have:
            tables[row, have:needed] = table.block_ids[have:needed]
        released_by_row[row] = table.released


def chunk_tile_capacity(tokens: int, seqs: int, tile_tokens: int) -> int:
    """The most chunk tiles a step of this many tokens in this many sequences has."""
    return -(-tokens // tile_tokens) + seqs


def step_layout(scheduled: Sequence[ScheduledRequest]) -> tuple[list[int], list[int]]:
    """The step's flat layout: the order of ``scheduled`` in it (single-token queries
    first, then chunks, each group in schedule order) and, by index in ``scheduled``,
    the row of each request's first token."""
    order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_tokens > 1)
    first_rows = [0] * len(scheduled)
    at = 0
    for i in order:
        first_rows[i] = at
        at += scheduled[i].num_tokens
    return order, first_rows
