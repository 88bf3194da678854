"""The engine worker's I/O thread (engine_worker/io_thread.py): the loop sends on the
ROUTER itself while this thread reads it, so a frame that arrives during one of the
loop's sends must still reach the loop."""

from __future__ import annotations

import queue
import threading

import zmq

from common.config import EngineServerConfig
from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, AbortRequests, Codec,
                             EngineStats, OutputBatch, RequestOutput)
from engine_worker.io_thread import IOThread

STATS = EngineStats(num_running=0, num_waiting=0, num_blocks_total=0, num_blocks_free=0,
                    num_blocks_used=0, num_blocks_cached=0, prefix_cache_query_tokens=0,
                    prefix_cache_hit_tokens=0, num_preemptions=0,
                    num_prompt_tokens_computed=0, num_generated_tokens=0)


def test_frames_arriving_while_the_loop_sends_all_reach_the_loop(tmp_path):
    """The loop sends a frame as fast as it can; the client answers some of them, one
    message at a time, each only after the previous one reached the loop. Every one
    must arrive: a send that takes the socket's news of an arriving frame has to wake
    the I/O thread (without that, a message waits for the next one, and the last one
    forever)."""
    ctx = zmq.Context()
    inbox: queue.Queue = queue.Queue()
    address = f"ipc://{tmp_path}/engine"
    io = IOThread(ctx, EngineServerConfig(bind=address), inbox, STATS, None)
    io.start()
    client = ctx.socket(zmq.DEALER)
    client.connect(address)
    to_engine = Codec(CLIENT_MESSAGES, ENGINE_MESSAGES)
    to_client = Codec(ENGINE_MESSAGES, CLIENT_MESSAGES)
    try:
        client.send_multipart(to_engine.encode(AbortRequests(request_ids=["hello"])))
        identity, first = inbox.get(timeout=5)
        assert first == AbortRequests(request_ids=["hello"])

        sending = True
        frame = to_client.encode(OutputBatch(outputs=[RequestOutput(request_id="r",
                                                                    new_token_ids=[1])]))

        def loop_sends() -> None:
            while sending:
                io.send([identity, *frame])

        sender = threading.Thread(target=loop_sends)
        sender.start()
        try:
            for i in range(300):
                client.recv_multipart()  # the loop's frames are flowing
                client.send_multipart(to_engine.encode(AbortRequests(request_ids=[str(i)])))
                try:
                    _, message = inbox.get(timeout=2)
                except queue.Empty:
                    raise AssertionError(f"message {i} did not reach the loop") from None
                assert message == AbortRequests(request_ids=[str(i)])
        finally:
            sending = False
            sender.join()
    finally:
        io.close()
        client.close(linger=0)
        ctx.term()
