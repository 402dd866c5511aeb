"""Every numeric option of every ``spottrain`` command, and ``logs --node``/``--vm``, refused
as it is parsed: a value that is not finite, out of range or not a name (an empty node, a
path) ends the command with exit 2 and one line on stderr naming the option, before
anything reads a run, a file or a cloud. Through the real entry, on a real run record
(whose Redis is gone: nothing here may need it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from spec_samples import LOCAL

from spottrain.controller.cli import main as cli
from spottrain.controller.run.records import RunInfo

RUN = "bad-args-1732270000"


@pytest.fixture(autouse=True)
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunInfo:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    info = RunInfo(
        run_id=RUN,
        spec_text=yaml.safe_dump(LOCAL),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url="redis://127.0.0.1:9/0",  # gone
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    return info


def exit_code(argv: list[str]) -> int:
    """What ``spottrain ARGV`` exits with: main's return, a SystemExit's code, or 1 for an
    exception that escapes (Python's exit status for a traceback)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except Exception:
        return 1


BAD = [
    (["status", RUN, "-f", "--interval", "-1"], "--interval"),
    (["status", RUN, "-f", "--interval", "nan"], "--interval"),
    (["status", RUN, "-f", "--interval", "inf"], "--interval"),
    (["status", RUN, "-f", "--interval", "0"], "--interval"),
    (["logs", RUN, "--node", ""], "--node"),
    (["logs", RUN, "--node", "../x"], "--node"),
    (["logs", RUN, "--node", "n0", "--vm", "../../../outside"], "--vm"),
    (["logs", RUN, "--node", "n0", "-f", "--interval", "nan"], "--interval"),
    (["logs", RUN, "--tail", "1.5"], "--tail"),
    (["down", RUN, "--timeout", "nan"], "--timeout"),
    (["down", RUN, "--timeout", "-1"], "--timeout"),
    (["down", RUN, "--drain-timeout", "inf"], "--drain-timeout"),
    (["up", "job.yaml", "--interval", "nan"], "--interval"),
    (["resume", RUN, "--interval", "-2"], "--interval"),
    (["scale", "1.5", RUN], "nodes"),
    (["local", "capacity", "local-a", "-1"], "argument n"),
]


@pytest.mark.parametrize(
    ("argv", "option"), BAD, ids=[" ".join(x for x in a if x != RUN) for a, _ in BAD]
)
def test_a_bad_value_exits_2_with_one_line_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    assert option in lines[0] and lines[0].startswith("spottrain ")


def test_good_values_still_parse() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["down", RUN, "--timeout", "0", "--drain-timeout", "2.5"])
    assert (args.timeout, args.drain_timeout) == (0.0, 2.5)
    args = parser.parse_args(["logs", RUN, "--node", "n0", "--vm", "i-0abc", "--interval", "0.5"])
    assert (args.node, args.vm, args.interval) == ("n0", "i-0abc", 0.5)
    assert parser.parse_args(["status", "-f", "--interval", "1e-1"]).interval == 0.1
    assert parser.parse_args(["local", "capacity", "local-a", "0"]).n == 0
