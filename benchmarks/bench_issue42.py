"""Issue 42's kernel figures, each a ratio of calls timed interleaved in one run, idle and with
one core busy (a child process spinning on the last core):

    padded   a row of R real tokens + (L - R) padded (B=1, H=8, D=64, Toeplitz B and C,
             documents of 128 tokens), forward and forward+backward, against the R real
             tokens alone; the tail hidden as a padding document under key_padding_mask
             ("padding_document") or as one document per padded token ("distinct_ids").
             Target: <= 2x.
    decode   one decoding call (B=1, H=8, one query, D=64) against Lk cached keys, with and
             without a Toeplitz gate, float32 and bfloat16, against SDPA. Target: <= 1.2x.

python benchmarks/bench_issue42.py                       # both groups, idle and busy
python benchmarks/bench_issue42.py --groups decode --lengths 1024 4096 --repeats 15
python benchmarks/bench_issue42.py --json out.json       # every number as well
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from harness.contention import Condition
from urpe.bench.clocks import interleaved_medians
from urpe.kernels import Toeplitz, attention

HEADS, HEAD_DIM, DOCUMENT = 8, 64, 128
PADDED_LIMIT, DECODE_LIMIT = 2.0, 1.2


def _padded_calls(real: int, length: int, backward: bool, backend: str) -> dict:
    """name -> call: the real tokens alone and both padded rows."""
    gen = torch.Generator().manual_seed(0)
    width = 2 * length - 1
    table_b = 0.02 * torch.randn(HEADS, width, generator=gen)  # (H, 2L - 1)
    table_c = 1 + 0.1 * torch.randn(HEADS, width, generator=gen)

    def build(n: int, **hiding):
        shape = (1, HEADS, n, HEAD_DIM)
        q, k, v = (torch.randn(shape, generator=gen).requires_grad_(backward) for _ in range(3))
        offsets = slice(length - n, length + n - 1)  # the tables' entries of offsets -(n-1)..n-1
        terms = dict(bias=Toeplitz(table_b[:, offsets]), gate=Toeplitz(table_c[:, offsets]))

        def call():
            out = attention(q, k, v, backend=backend, **terms, **hiding)
            if backward:
                out.sum().backward()

        return call

    documents = torch.arange(real) // DOCUMENT  # (R,)
    tail = torch.arange(length - real)
    padded = (torch.arange(length) >= real)[None]  # (1, L)
    return {
        "real": build(real, document_ids=documents[None]),
        "padding_document": build(
            length,
            document_ids=torch.cat([documents, torch.full_like(tail, 10**6)])[None],
            key_padding_mask=padded,
        ),
        "distinct_ids": build(length, document_ids=torch.cat([documents, 10**6 + tail])[None]),
    }


def _decode_calls(keys: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(1, HEADS, keys, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    gate = Toeplitz(1 + 0.1 * torch.randn(HEADS, 2 * keys - 1, generator=gen))
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "cpp": lambda: attention(q, k, v, is_causal=True, backend="cpp"),
        "cpp_gate": lambda: attention(q, k, v, is_causal=True, gate=gate, backend="cpp"),
    }


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def run(args) -> list[dict]:
    records = []
    for condition in [Condition(args.threads, busy) for busy in args.conditions]:
        label = ("one core busy" if condition.busy else "idle") + (
            f", {args.threads} thread(s)" if args.threads else ""
        )
        with condition.applied():
            if "padded" in args.groups:
                for backward in (False, True):
                    calls = _padded_calls(args.real, args.padded_length, backward, args.backend)
                    with torch.set_grad_enabled(backward):
                        ms = interleaved_medians(calls, args.repeats)
                    mode = "fwd+bwd" if backward else "fwd"
                    for name in ("padding_document", "distinct_ids"):
                        ratio = ms[name] / ms["real"]
                        records.append(
                            dict(
                                group="padded",
                                condition=label,
                                mode=mode,
                                row=name,
                                ms=ms[name],
                                real_ms=ms["real"],
                                ratio=ratio,
                            )
                        )
                        print(
                            f"[{label}, {_load()}] padded {mode} {name}: {ms[name]:.2f} ms vs "
                            f"{ms['real']:.2f} ms real alone = {ratio:.2f}x "
                            f"(limit {PADDED_LIMIT})",
                            flush=True,
                        )
            if "decode" in args.groups:
                for dtype in args.dtypes:
                    for keys in args.lengths:
                        with torch.no_grad():
                            ms = interleaved_medians(
                                _decode_calls(keys, getattr(torch, dtype)), args.repeats
                            )
                        for name in ("cpp", "cpp_gate"):
                            ratio = ms[name] / ms["sdpa"]
                            records.append(
                                dict(
                                    group="decode",
                                    condition=label,
                                    dtype=dtype,
                                    keys=keys,
                                    row=name,
                                    ms=ms[name],
                                    sdpa_ms=ms["sdpa"],
                                    ratio=ratio,
                                )
                            )
                        print(
                            f"[{label}, {_load()}] decode {dtype} Lk={keys}: sdpa "
                            f"{ms['sdpa'] * 1e3:.0f} us, cpp {ms['cpp'] * 1e3:.0f} us "
                            f"({ms['cpp'] / ms['sdpa']:.2f}x), cpp gate "
                            f"{ms['cpp_gate'] * 1e3:.0f} us ({ms['cpp_gate'] / ms['sdpa']:.2f}x)"
                            f" (limit {DECODE_LIMIT})",
                            flush=True,
                        )
    return records


def main() -> int:
    parser = argparse.ArgumentParser("bench_issue42.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--groups", nargs="+", default=["padded", "decode"], choices=["padded", "decode"]
    )
    parser.add_argument(
        "--conditions",
        nargs="+",
        default=["idle", "busy"],
        choices=["idle", "busy"],
        help="idle, and/or one core busy",
    )
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=[1024, 4096, 16384, 32768],
        help="decode: cached keys",
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--real", type=int, default=512, help="padded: real tokens per row")
    parser.add_argument("--padded-length", type=int, default=4096, help="padded: row length")
    parser.add_argument("--backend", default="cpp", help="padded: the backend timed")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    parser.add_argument("--repeats", type=int, default=21, help="interleaved rounds per median")
    parser.add_argument("--json", help="write every record here")
    args = parser.parse_args()
    args.conditions = [c == "busy" for c in args.conditions]
    records = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
