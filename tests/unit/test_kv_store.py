"""The shared KV store (kv_store/) and an engine's link to it
(engine_worker/kv_store_link.py): blocks kept by layout and checked on the way in; a
prefix computed on one engine served to another from the store, token-identical; a
store that dies, restarts empty or holds another layout's blocks costs
recomputation, never a wrong token or a failed request. The store here is the real
process on its real socket; the engines' frames are carried by hand (``Pump``), so
that the store can be stopped exactly between them."""

from __future__ import annotations

import subprocess
import sys
import time
import zlib

import pytest
import zmq

from common.protocol import (STORE_REPLIES, STORE_REQUESTS, Codec, KvBlock, KvPull, KvPut,
                             Ping, StorePong)
from engine_worker.io_thread import PUT_CHANNEL
from engine_worker.kv_store_link import BACKOFF_FIRST_S
from helpers import greedy, make_engine, random_prompts
from kv_store.store import BlockStore

A, B = random_prompts([41, 41], seed=11)
FULL = (len(A) - 1) // 4   # blocks of 4: A's blocks a second engine looks up


def block(data: bytes, h: bytes = b"h" * 16) -> KvBlock:
    return KvBlock(h, zlib.crc32(data), data)


# -- the store's contents --------------------------------------------------------------

def test_blocks_are_kept_by_layout_and_checked_on_the_way_in():
    store = BlockStore(memory_bytes=1 << 20)
    assert store.put("m|a", block(b"x" * 100)) is None
    assert store.get("m|a", b"h" * 16).data == b"x" * 100
    assert store.get("m|b", b"h" * 16) is None           # another layout: never served
    bad = KvBlock(b"g" * 16, zlib.crc32(b"y" * 100) ^ 1, b"y" * 100)
    assert store.put("m|a", bad) == "checksum"
    assert store.put("m|a", block(b"z" * 99, b"k" * 16)) == "size"   # not the layout's size
    assert store.put("m|a", block(b"z" * 100, b"short")) == "hash"
    assert store.put("", block(b"z" * 100)) == "layout"
    stats = store.stats()
    assert (stats.num_put, stats.num_hits, stats.num_misses) == (1, 1, 1)
    assert stats.refused == {"checksum": 1, "size": 1, "hash": 1, "layout": 1}
    assert stats.blocks == {"memory": 1} and stats.bytes == {"memory": 100}


def test_memory_is_least_recently_used_first_out_to_disk_and_found_after_a_restart(tmp_path):
    store = BlockStore(memory_bytes=300, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    for i in range(3):
        store.put("m", block(bytes([i]) * 100, bytes([i]) * 16))
    store.get("m", bytes([0]) * 16)                      # 0 now the most recent
    store.put("m", block(b"\x03" * 100, b"\x03" * 16))   # pushes 1 out, to disk
    assert [h[:1] for _, h in store.entries] == [b"\x02", b"\x00", b"\x03"]
    store.disks["m"].flush()
    assert store.stats().blocks == {"memory": 3, "disk": 1}
    assert store.get("m", b"\x01" * 16).data == b"\x01" * 100   # back from disk
    store.flush()
    again = BlockStore(memory_bytes=300, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    assert again.get("m", b"\x03" * 16).data == b"\x03" * 100
    assert again.get("other", b"\x03" * 16) is None
    assert not (tmp_path / "other").exists() and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("args, message", [
    (["--memory", "0"], "--memory and --disk must be positive"),
    (["--disk", "nan"], "--memory and --disk must be positive"),
    (["--bind", "tcp://0.0.0.0:5559"], "CURVE"),   # beyond loopback: a key, or said so
])
def test_bad_flags_are_refused(args, message):
    proc = subprocess.run([sys.executable, "-m", "kv_store", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# -- engines and the store process ---------------------------------------------------

class StoreProcess:
    def __init__(self, address: str) -> None:
        self.address = address
        self.proc = subprocess.Popen([sys.executable, "-m", "kv_store", "--bind", address,
                                      "--memory", "0.05"])
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(address)
        codec = Codec(STORE_REQUESTS, STORE_REPLIES)
        sock.send_multipart(codec.encode(Ping(nonce=1)))
        assert sock.poll(30_000), "the KV store did not answer"
        sock.close(linger=0)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Pump:
    """An engine's frames to the store and the answers back, as its server would carry
    them (a DEALER of its own)."""

    def __init__(self, engine, address: str) -> None:
        self.engine, self.address = engine, address
        self.codec = Codec(STORE_REQUESTS, STORE_REPLIES)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def carry(self, wait_ms: int = 20) -> None:
        for address, message in self.engine.kv.pulls():
            # (puts on a socket of their own: PUT_CHANNEL)
            assert address.removeprefix(PUT_CHANNEL) == self.address
            assert isinstance(message, KvPut) == address.startswith(PUT_CHANNEL)
            self.sock.send_multipart(self.codec.encode(message))
        while self.sock.poll(wait_ms):
            reply = self.codec.decode(self.sock.recv_multipart())
            if isinstance(reply, StorePong):
                self.engine.kv.store.pong(reply)
            else:
                self.engine.kv.receive(self.address, reply)
        self.engine.kv.expire()

    def run(self, request_id: str, prompt, max_tokens: int = 6) -> list[int]:
        e = self.engine
        e.add_request(request_id, prompt, greedy(max_tokens))
        tokens: list[int] = []
        while e.has_unfinished_requests():
            self.carry()
            for out in e.step():
                assert out.error is None, out.error
                tokens += out.new_token_ids
        self.carry()   # the finished request's blocks, put
        return tokens


@pytest.fixture
def store(tmp_path):
    s = StoreProcess(f"ipc://{tmp_path}/kv-store.sock")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    ref = make_engine(tiny_llama_dir, num_blocks=256, max_model_len=128)
    return {i: ref.generate([p], greedy(6))[0] for i, p in enumerate((A, B))}


def engine(model_dir, store, **kw):
    e = make_engine(model_dir, block_size=4, num_blocks=64, max_model_len=128,
                    kv_store_address=store.address, kv_store_timeout_s=0.5, **kw)
    return e, Pump(e, store.address)


def test_a_prefix_computed_on_one_engine_is_served_to_another(tiny_llama_dir, store, expected):
    (a, pa), (b, pb) = engine(tiny_llama_dir, store), engine(tiny_llama_dir, store)
    assert pa.run("a", A) == expected[0]
    # every full block of prompt and reply (the last token's KV is never computed)
    assert a.stats().kv_store_put_blocks == (len(A) + 6 - 1) // 4
    assert a.stats().kv_store_misses == FULL                # nothing there before
    before = b.num_prompt_tokens_computed
    assert pb.run("b", A) == expected[0]
    stats = b.stats()
    assert stats.kv_store_hits == FULL and stats.kv_store_misses == 0
    assert b.num_prompt_tokens_computed - before == len(A) - FULL * 4
    assert stats.prefix_cache_hit_tokens == FULL * 4
    # the store's own figures, as it answered b's ping: a's blocks (b put none new
    # but its reply's)
    assert stats.kv_store_blocks["memory"] == (len(A) + 6 - 1) // 4
    assert stats.kv_store_bytes["memory"] == 11 * b.kv.store.store.block_bytes
    assert b.block_manager.num_used_blocks == 0


def test_a_running_requests_blocks_reach_the_store_as_they_fill(tiny_llama_dir, store,
                                                                 expected):
    """A failover: engine a stops answering mid-request (it never finishes it), and
    engine b continues the request after the tokens a sent. b pulls every block a had
    computed, prompt and output, rather than computing them again."""
    (a, pa), (b, pb) = engine(tiny_llama_dir, store), engine(tiny_llama_dir, store)
    a.add_request("a", A, greedy(6))
    sent: list[int] = []
    while len(sent) < 4:
        pa.carry()
        for out in a.step():
            sent += out.new_token_ids
    a.kv.poll()   # (a's next step would put what this one filled)
    pa.carry()
    computed = len(A) + len(sent) - 1   # (the last token's KV is not computed yet)
    assert a.has_unfinished_requests() and a.stats().kv_store_put_blocks == computed // 4
    b.add_request("b", A, greedy(6), output_token_ids=sent)
    rest: list[int] = []
    while b.has_unfinished_requests():
        pb.carry()
        for out in b.step():
            assert out.error is None, out.error
            rest += out.new_token_ids
    assert sent + rest == expected[0]
    assert b.stats().kv_store_hits == computed // 4
    assert b.stats().prefix_cache_hit_tokens == computed // 4 * 4


def test_the_store_dying_mid_transfer_costs_recomputation(tiny_llama_dir, store, expected):
    (a, pa), (b, pb) = engine(tiny_llama_dir, store), engine(tiny_llama_dir, store)
    pa.run("a", A)
    store.stop()   # b's pull goes unanswered: its deadline, then the prompt computed
    started = time.monotonic()
    assert pb.run("b", A) == expected[0]
    assert 0.5 <= time.monotonic() - started < 5
    stats = b.stats()
    assert stats.kv_store_errors == {"deadline": 1} and stats.kv_store_hits == 0
    assert not stats.kv_store_up                            # left alone for a while
    started = time.monotonic()
    assert pb.run("b2", B) == expected[1]                   # no wait while it backs off
    assert time.monotonic() - started < 0.5 + BACKOFF_FIRST_S
    assert b.block_manager.num_used_blocks == 0


def test_a_store_restarted_empty_is_filled_again(tiny_llama_dir, tmp_path, expected):
    address = f"ipc://{tmp_path}/kv-store.sock"
    first = StoreProcess(address)
    (a, pa), (b, pb) = engine(tiny_llama_dir, first), engine(tiny_llama_dir, first)
    pa.run("a", A)
    first.stop()
    again = StoreProcess(address)
    try:
        assert pb.run("b", A) == expected[0]                # a miss: computed
        assert b.stats().kv_store_hits == 0
        (c, pc) = engine(tiny_llama_dir, again)
        assert pc.run("c", A) == expected[0]                # b put it back
        assert c.stats().kv_store_hits == FULL
    finally:
        again.stop()


def test_a_store_never_serves_blocks_of_another_layout(tiny_llama_dir, tiny_llama_hd8_dir,
                                                       store):
    (a, pa) = engine(tiny_llama_dir, store)
    pa.run("a", A)
    (other, po) = engine(tiny_llama_hd8_dir, store)
    po.run("o", A)
    assert other.stats().kv_store_hits == 0 and other.stats().kv_store_misses == FULL


def test_hostile_frames_leave_the_store_serving(store, tiny_llama_dir, expected):
    """Garbage, a put of a bad block and a pull of nothing: the store answers on."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(store.address)
    codec = Codec(STORE_REQUESTS, STORE_REPLIES)
    sock.send_multipart([b"\x07", b"\xc1garbage"])
    sock.send_multipart([b"\x63", b""])
    sock.send_multipart(codec.encode(KvPut(layout="x", blocks=[
        KvBlock(b"h" * 16, 0, b"data")])))
    sock.send_multipart(codec.encode(KvPull(request_id="r", hashes=[], layout="x")))
    assert sock.poll(5000)
    reply = codec.decode(sock.recv_multipart())
    assert reply.blocks == [] and reply.error is None
    sock.send_multipart(codec.encode(Ping(nonce=2)))
    assert sock.poll(5000)
    stats = codec.decode(sock.recv_multipart()).stats
    assert stats.refused == {"checksum": 1} and stats.num_put == 0
    sock.close()
    (a, pa) = engine(tiny_llama_dir, store)
    assert pa.run("a", A) == expected[0]
