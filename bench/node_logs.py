"""Reading a node's shipped output back from S3 (moto's server on 127.0.0.1): the node's
whole output, then its last 100 lines (``spottrain logs --node n0`` and ``--tail 100``), over
one VM's ``--chunks`` chunks (a day of 15-second chunks is 5,760), each with ``--lines``
lines. Both go through the CLI's own entry (``node_logs.node_log``, the store it opens from
the run's spec); the lines each printed are counted, and the requests each made are counted
at the server, as they arrived over HTTP: GETs of a chunk and LISTs of the bucket.

    .venv/bin/python bench/node_logs.py [--chunks 1000] [--lines 40]

The whole read is the anchor: --tail's time and GETs are printed beside it, as a fraction of
it. The last line is one JSON object with ``chunks``, ``lines_per_chunk``, ``full_read_s``,
``full_gets``, ``full_lists``, ``full_lines``, ``tail_read_s``, ``tail_gets``, ``tail_lists``,
``tail_lines``, ``tail_vs_full`` (the time ratio) and ``tail_gets_vs_full``.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import parser, print_figures, ratio

BUCKET = "bench-logs"
RUN = "bench-run-1732270000"
VM = ("i-0bench", 1_732_270_000_000)
TAIL = 100
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "aws_job.yaml"


class Requests(logging.Handler):
    """The moto server's requests as they arrive, counted: werkzeug logs each one (``"GET
    /bucket/key HTTP/1.1" 200 -``) before it answers, so a read's count is whole when it
    returns. Nothing is printed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.gets = self.lists = self.other = 0

    def emit(self, record: logging.LogRecord) -> None:
        line = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        method, _, rest = line.partition(" ")
        path = rest.split(" ", 1)[0]
        if method == "GET" and "list-type=" in path:
            self.lists += 1
        elif method == "GET" and path.startswith(f"/{BUCKET}/"):
            self.gets += 1
        else:
            self.other += 1

    def reset(self) -> None:
        self.acquire()  # emit runs under the same lock, in the server's threads
        try:
            self.gets = self.lists = self.other = 0
        finally:
            self.release()


@contextlib.contextmanager
def moto_s3(requests: Requests) -> Iterator[str]:
    """A moto server with the bench's bucket, its requests counted, and the environment
    boto3 reads it from."""
    import boto3
    from moto.server import ThreadedMotoServer

    log = logging.getLogger("werkzeug")
    log.setLevel(logging.INFO)
    log.addHandler(requests)  # werkzeug adds no stderr handler of its own beside it
    log.propagate = False
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": endpoint,
        }
    )
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    try:
        yield f"s3://{BUCKET}/logs"
    finally:
        server.stop()


class LineCount(io.RawIOBase):
    """A stdout that keeps nothing but the number of lines written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.lines += data.count(b"\n")
        return len(data)


@dataclass(frozen=True)
class Read:
    """One read of the node: its time, the requests it made and the lines it printed."""

    seconds: float
    gets: int
    lists: int
    lines: int


def ship(url: str, chunks: int, lines: int) -> None:
    """The VM's chunks, as its agent names them, each with ``lines`` lines."""
    from spottrain.cloud.stores import open_store
    from spottrain.protocol.node_logs import ChunkName

    store = open_store(url)

    def put(seq: int) -> None:
        text = "".join(
            f"step {seq * lines + i} loss 2.{i:03d} tokens/s 81234\n" for i in range(lines)
        )
        store.put_bytes(ChunkName(VM[1], VM[0], seq, RUN, "n0").key(), gzip.compress(text.encode()))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(chunks)))


def read(info: Any, tail: int | None, requests: Requests) -> Read:
    """``spottrain logs --node n0 [--tail N]`` of the bench's run, its stdout counted."""
    from spottrain.controller.cli import node_logs

    sink = LineCount()
    out = io.TextIOWrapper(io.BufferedWriter(sink))
    requests.reset()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as notes:
        started = time.perf_counter()
        code = node_logs.node_log(info, "n0", tail=tail)
        elapsed = time.perf_counter() - started
        out.flush()
    assert code == 0, f"the read failed (exit {code}): {notes.getvalue()}"
    assert requests.other == 0, f"{requests.other} requests neither a GET nor a LIST"
    return Read(elapsed, requests.gets, requests.lists, sink.lines)


def run_info(home: str, url: str) -> Any:
    """The run's record, saved: the CLI finds the store in its spec (``logs.to``)."""
    from spottrain.controller.run.records import RunInfo

    info = RunInfo(
        run_id=RUN,
        spec_text=EXAMPLE.read_text() + f"logs:\n  to: {url}\n",
        spec_source="job.yaml",
        base_dir=home,
        redis_url="redis://127.0.0.1:9/0",  # gone: the run record alone must do
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    return info


def report(chunks: int, lines: int, full: Read, tail: Read) -> None:
    """Both reads, --tail beside the whole read, then the JSON line."""
    print(f"{chunks} chunks of {lines} lines from moto's S3, one VM:", file=sys.stderr)
    print(
        f"  whole node:  {full.seconds:7.2f} s, {full.gets:5d} GETs, {full.lists} LIST, "
        f"{full.lines} lines",
        file=sys.stderr,
    )
    print(
        f"  --tail {TAIL}:  {tail.seconds:7.2f} s, {tail.gets:5d} GETs, {tail.lists} LIST, "
        f"{tail.lines} lines  ({ratio(tail.seconds, full.seconds)}x the whole read's time, "
        f"{ratio(tail.gets, full.gets)}x its GETs)",
        file=sys.stderr,
    )
    print_figures(
        {
            "chunks": chunks,
            "lines_per_chunk": lines,
            "full_read_s": round(full.seconds, 3),
            "full_gets": full.gets,
            "full_lists": full.lists,
            "full_lines": full.lines,
            "tail_read_s": round(tail.seconds, 3),
            "tail_gets": tail.gets,
            "tail_lists": tail.lists,
            "tail_lines": tail.lines,
            "tail_vs_full": ratio(tail.seconds, full.seconds),
            "tail_gets_vs_full": ratio(tail.gets, full.gets),
        }
    )


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--chunks", type=int, default=1000, help="chunks the VM shipped")
    p.add_argument("--lines", type=int, default=40, help="lines in each chunk")
    a = p.parse_args()
    if a.chunks < 1 or a.lines < 1:
        p.error("--chunks and --lines must be 1 or more")
    requests = Requests()
    with tempfile.TemporaryDirectory() as home, moto_s3(requests) as url:
        os.environ["SPOTTRAIN_HOME"] = home
        info = run_info(home, url)
        ship(url, a.chunks, a.lines)
        full = read(info, None, requests)
        tail = read(info, TAIL, requests)
    assert full.lines == a.chunks * a.lines, f"the whole read printed {full.lines} lines"
    assert tail.lines == min(TAIL, a.chunks * a.lines), f"--tail printed {tail.lines} lines"
    report(a.chunks, a.lines, full, tail)


if __name__ == "__main__":
    main()
