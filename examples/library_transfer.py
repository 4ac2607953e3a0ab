"""Using pd-transfer as a library: a prefill process publishes its KV cache, a decode process pulls a
request's blocks from it. Run: `.venv/bin/python examples/library_transfer.py`.

The prefill side registers its cache tensors (dim 0: block index) and serves the side channel; the decode
side connects once per engine and then pulls (remote block ids -> local block ids) per request. Both sides
describe their cache with a KVCacheLayout: model fingerprint, TP rank/size, block size and layout, which
may differ between the two (the topology layer plans the reads). Each process reads pd-transfer's settings
(its ``PD_TRANSFER_*`` and UCX environment variables) once where it starts and hands them to what it makes.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.options import DecodeOptions, PrefillOptions
from pd_transfer.settings import Settings, apply_process_defaults, read_settings
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

MODEL = ModelFingerprint(model="example-llama", dtype="bfloat16", num_layers=4, total_num_kv_heads=8, head_size=64)
SECRET = "change-me"  # shared side-channel secret: a decode without it gets no metadata


def process_settings() -> Settings:
    """This process's settings, with UCX kept on loopback for this one-machine example (unless set otherwise)."""
    return apply_process_defaults(read_settings(), net_devices="lo")


def prefill(port_out: mp.Queue, done: mp.Event) -> None:
    from pd_transfer.connector.prefill.rank import PrefillRank, serve_engine

    settings = process_settings()

    layout = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=16)
    cache = KVCache.allocate(layout, num_blocks=64)  # an engine would pass its own tensors: KVCache.from_tensors
    for index, tensor in enumerate(cache.tensors):  # pretend the prompt was computed
        tensor.copy_(torch.full_like(tensor, float(index)))
    rank = PrefillRank(
        "prefill-0",
        cache,
        PrefillOptions(settings=settings),
        on_release=lambda request, readers: print(f"prefill: {request} released"),
    )
    server = serve_engine("prefill-0", [rank.rank_metadata], host="127.0.0.1", port=0, secret=SECRET)
    rank.hold("request-1", [9, 4, 7, 30])  # held for readers until they report or the lease runs out
    port_out.put(server.port)
    done.wait(60)
    server.stop()
    rank.close()


def main() -> None:
    from pd_transfer.connector.decode.rank import DecodeRank

    settings = process_settings()
    context = mp.get_context("spawn")
    ports, done = context.Queue(), context.Event()
    child = context.Process(target=prefill, args=(ports, done))
    child.start()
    port = ports.get(timeout=60)

    # the decode side holds its heads at a larger block size: 16-token blocks arrive regrouped into 64-token blocks
    layout = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=64)
    decode = DecodeRank(
        "decode-0", KVCache.allocate(layout, num_blocks=16), DecodeOptions(secret=SECRET, settings=settings)
    )
    stats = decode.pull(
        "request-1", "127.0.0.1", port, remote_block_ids=[9, 4, 7, 30], local_block_ids=[2], num_tokens=60
    )
    first_plane = decode.cache.tensors[0][2]  # layer 0, K, local block 2: (heads, 64 tokens, head size)
    print(f"decode: {stats.bytes} bytes in {stats.seconds * 1e3:.1f} ms (first pull: handshake included)")
    print(f"decode: layer 0 K, local block 2, head 0, token 0 holds {first_plane[0, 0, 0].item()}")
    ok = bool((first_plane[:, :60] == 0.0).all()) and bool((decode.cache.tensors[1][2][:, :60] == 1.0).all())
    print("match" if ok else "MISMATCH")
    decode.close()
    done.set()
    child.join(30)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
