"""The node-logs bench runs end to end on a few chunks and ends with its JSON figures:
``--tail 100`` GETs only the newest chunks (a batch of eight, then the ones it prints),
where the whole read GETs every chunk, both after one LIST, and each prints what it should."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "node_logs.py"
CHUNKS, LINES = 60, 40


def test_tail_gets_a_few_newest_chunks_where_the_whole_read_gets_every_one() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--chunks", str(CHUNKS), "--lines", str(LINES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["chunks"] == CHUNKS
    assert figures["full_gets"] == CHUNKS
    assert figures["full_lines"] == CHUNKS * LINES
    assert figures["tail_lines"] == 100
    assert figures["full_lists"] == figures["tail_lists"] == 1
    # Newest first, eight at a time, until they hold 100 lines; then the chunks that print.
    printed = math.ceil(100 / LINES)
    assert 0 < figures["tail_gets"] <= 8 * math.ceil(printed / 8) + printed
    assert figures["tail_gets"] * 4 < figures["full_gets"]
    assert figures["tail_gets_vs_full"] < 0.25
    # The --tail figures are printed beside the whole read's, their anchor.
    assert "x the whole read's time" in out.stderr and "whole node:" in out.stderr
