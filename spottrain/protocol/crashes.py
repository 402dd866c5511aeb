"""How a node's workers failing is told to the controller: the record an agent keeps in its
node's hash (field :data:`CRASH_FIELD`), and what makes two failures "the same".

torchrun restarts a node's workers on its own when one fails (up to ``--max-restarts``
times). The agent watches those failures (:mod:`spottrain.agent.crashes`): torchrun's line
for each (the failing local rank and its exit code), the workers' last lines of output
before it, the newest step the node's workers reported, and how long the workers ran. It
keeps the newest as a :class:`Crash`, with how many failures in a row there were with no
training between; at :data:`CRASH_LOOP_FAILURES` it ends torchrun and its node fails with
that crash as the reason, which the controller counts in the run's give-up streak
(``controller.max_failed_launches``).

**The same reason** (:func:`same_crash`): the same :attr:`Crash.key` (the exit code and the
failing line with what differs from VM to VM blanked: numbers of three digits or more, ids,
addresses, the node's own name), or, when both failures came at a known training step, the
same step (a NaN or an out-of-memory at step 7 after every resume says different things on
different ranks: the rank that hit it, and its peers whose connection to it broke).

**Trained for a while** (:data:`TRAINED_S`): workers that ran this long without a failure
and whose node is in the rendezvous; the agent marks its node (field :data:`TRAINED_FIELD`)
and the controller ends a give-up streak of failures at no known step on it.

This is a format between releases (a fleet's agents and its controller may differ): never
rename a field. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .boot import reason_key

# The field of a node's hash holding its workers' newest failure (JSON of Crash), and the one
# that says its workers trained for a while since their last failure ("1", or "").
CRASH_FIELD = "crash"
TRAINED_FIELD = "trained"
# Failures in a row for the same reason, with no training between, that make a crash loop.
CRASH_LOOP_FAILURES = 3
# Seconds of workers running without a failure that count as training for a while.
TRAINED_S = 120.0
# Lines of the workers' output a crash keeps (the last ones before the failure).
TAIL_LINES = 5
LINE_CHARS = 300

# torchrun's own log lines (glog style: "E1128 19:53:12.031000 6182 torch/...] ..."): not
# the workers' output.
_TORCH_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+\S+\]")
# A Python traceback's frames, source lines and carets: never the line that says why.
_FRAME = re.compile(r"^(Traceback \(most recent call last\):|File \".*\", line \d+|[\s~^]+$)")
# What the C++ runtime prints when a process aborts on its way out after its error was said
# (a worker that raised exits with a gloo or NCCL thread still running): never the cause.
_ABORT = re.compile(
    r"^(\[rank\d+\]:\s*)?terminate called (without an active exception|recursively)$"
)


@dataclass(frozen=True)
class Crash:
    """One failure of a node's workers, as its agent saw it.

    Attributes:
        code: the failing worker's exit code (negative: the signal that killed it), or
            torchrun's own when torchrun failed without naming a worker.
        line: the failing line: the last line of the workers' output before the failure that
            is not a traceback's frame (``ModuleNotFoundError: No module named 'x'``).
        key: the failure's reason as compared (:func:`crash_key`).
        tail: the workers' last lines of output before the failure, oldest first.
        rank: the failing worker's local rank (-1: not named).
        step: the newest step the node's workers reported before failing, as the node's
            progress file holds it (written at most once a second: a hint, compared and not
            shown; None: none, a script without the SDK or one that failed before it
            reported a step on this VM).
        ran_s: seconds the workers ran before failing (since torchrun started them, or
            restarted them after the previous failure).
        count: failures in a row with no training (nor a change of the rendezvous'
            members) between them, this one included.
        loop: the agent ended torchrun for it (``count`` reached
            :data:`CRASH_LOOP_FAILURES`), or torchrun gave up on its own.
    """

    code: int
    line: str
    key: str
    tail: tuple[str, ...] = ()
    rank: int = -1
    step: int | None = None
    ran_s: float = 0.0
    count: int = 1
    loop: bool = False

    def why(self) -> str:
        """The crash in words: ``its workers failed 3 times in a row (local rank 0, exit
        code 1): ModuleNotFoundError: No module named 'x'`` (the line as the workers wrote
        it: escape it before showing it)."""
        times = "once" if self.count == 1 else f"{self.count} times in a row"
        who = f"local rank {self.rank}, " if self.rank >= 0 else ""
        said = f": {self.line}" if self.line else ""
        return f"its workers failed {times} ({who}exit code {self.code}){said}"

    def to_json(self) -> str:
        return json.dumps(
            {
                "code": self.code,
                "line": self.line,
                "key": self.key,
                "tail": list(self.tail),
                "rank": self.rank,
                "step": self.step,
                "ran_s": round(self.ran_s, 3),
                "count": self.count,
                "loop": self.loop,
            }
        )

    @classmethod
    def from_json(cls, text: str | None) -> Crash | None:
        """The crash a node's hash holds; None for nothing or what does not parse (a node
        writes it, and ``status`` must never break on one)."""
        try:
            d = json.loads(text or "null")
            if not isinstance(d, dict):
                return None
            step = d.get("step")
            return cls(
                code=int(d["code"]),
                line=str(d.get("line", ""))[:LINE_CHARS],
                key=str(d.get("key", "")),
                tail=tuple(str(x)[:LINE_CHARS] for x in d.get("tail", ())[-TAIL_LINES:]),
                rank=int(d.get("rank", -1)),
                step=None if step is None else int(step),
                ran_s=float(d.get("ran_s", 0.0)),
                count=max(1, int(d.get("count", 1))),
                loop=bool(d.get("loop", False)),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def crash_key(code: int, line: str, node: str = "") -> str:
    """A failure's reason as compared between failures and between VMs: the exit code and the
    failing line, with the node's own name and what differs from VM to VM blanked
    (:func:`spottrain.protocol.boot.reason_key`)."""
    if node:
        line = re.sub(rf"\b{re.escape(node)}\b", "<node>", line)
    return reason_key(f"exit {code}", line)


def same_crash(key_a: str, step_a: int | None, key_b: str, step_b: int | None) -> bool:
    """Whether two failures have the same reason: the same key, or the same known step."""
    return key_a == key_b or (step_a is not None and step_a == step_b)


def is_torch_log(line: str) -> bool:
    """Whether ``line`` is one of torchrun's own log lines, not the workers' output."""
    return bool(_TORCH_LOG.match(line))


def failing_line(lines: Sequence[str]) -> str:
    """The line that says why, of the workers' last lines of output: the last one that is
    not blank nor a traceback's frame, source line or carets (a traceback ends with the
    exception; argparse ends with ``prog: error: ...``) nor the C++ runtime's abort on the
    way out; "" when there is none."""
    for raw in reversed(lines):
        line = raw.strip()
        if line and not _FRAME.match(line) and not _ABORT.match(line):
            return line[:LINE_CHARS]
    return ""


def worker_lines(lines: Iterable[str]) -> list[str]:
    """``lines`` without torchrun's own log lines and blank ones."""
    return [x for x in lines if x.strip() and not is_torch_log(x)]
