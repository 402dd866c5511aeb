"""``spottrain logs --node N [-f] [--vm ID]``: a node's output, read back from the chunks its
VMs shipped to the run's logs store (``spottrain/protocol/node_logs.py`` has the layout).

The chunks outlive the VMs, so this answers for gone VMs (preempted, terminated, the run's
Redis gone: the run record holds the spec, which names the store) as for live ones. stdout
carries only the node's own bytes; everything spottrain says (a header per VM, a missing or
corrupt chunk) goes to stderr, so ``> node.log`` keeps the raw output. A terminal gets the
node's colours but every other control character escaped (a worker writes what it likes).
``--vm`` must name one of the node's VMs in the run: anything else is refused (exit 2).

A node whose boot failed says so first, on stderr (``spottrain: n3: boot failed in 'install
the environment': pip: ...``), from its boot report in the run's Redis, or in its archived
event log once the run ended.

A node's chunks are grouped by shipping session (one VM's agent from its start: the VM id
and ``started ms``), printed oldest session first and each in ``seq`` order. A gap in
``seq`` is a chunk lost (the VM died before it was sent) or not yet sent (uploads retried
out of order); following, a gap is held for one poll before it is called missing, and a
chunk that arrives after that is printed with a note that it is late.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from spottrain.agent.logship.settings import vm_name
from spottrain.cloud.storage.errors import (
    BucketNotFound,
    StorageError,
)
from spottrain.cloud.storage.interface import ObjectStore
from spottrain.cloud.stores import open_store
from spottrain.controller.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, err, run_state
from spottrain.controller.cli.node_log_reader import Reader, Session, write_out
from spottrain.controller.cli.parser import check_vm_id
from spottrain.controller.run.code import local_copy_to
from spottrain.controller.run.records import RunInfo
from spottrain.protocol import events as stream
from spottrain.protocol.boot import BootReport, report_from_fields
from spottrain.protocol.node_logs import ChunkName, default_logs_url, node_prefix, parse_chunk_key
from spottrain.protocol.states import RunPhase
from spottrain.safetext import escape_controls
from spottrain.spec import JobSpec

# How often `-f` lists the followed VM's new chunks (two small LIST requests a poll).
POLL_S = 3.0
# Following a run that ended: stop once this long brought no chunk. A VM's agent ships its
# last chunk within FINAL_FLUSH_S (5 s) of its drain, which may come after the run's end.
_END_QUIET_S = 10.0
# Following, every this many polls the whole node is listed, to find a replacement VM.
_WHOLE_EVERY = 10
# Above this many nodes, naming the nodes that did ship would list every chunk of the run
# (the store lists flat, without a delimiter): the error names the pattern instead.
_LIST_NODES_MAX = 64


def _pause(seconds: float) -> None:
    """The wait between polls; a test replaces it to drive `-f` without wall-clock pacing."""
    time.sleep(seconds)


def logs_url(info: RunInfo, spec: JobSpec) -> str | None:
    """The run's logs store: ``logs.to``, else ``<checkpoint.copy_to>/logs``; a local run
    without either ships beside the checkpoint copies its agents make (``local_copy_to``),
    as the boot script tells them (``controller/run/boot.py``)."""
    url = spec.logs_url()
    if url is None and "local" in spec.resources.clouds:
        url = default_logs_url(local_copy_to(spec))
    return url


def node_log(
    info: RunInfo,
    node: str,
    *,
    vm: str | None = None,
    follow: bool = False,
    interval: float = POLL_S,
    tail: int | None = None,
) -> int:
    """Print ``node``'s shipped output (only ``vm``'s, when given; only its last ``tail``
    lines, when given); ``follow`` keeps polling for new chunks and new VMs until Ctrl-C or
    the run's end. Returns the exit code: 1 when a chunk could not be read (the rest is still
    printed) or nothing was found."""
    if not interval > 0:
        err(f"--interval {interval:g} must be a positive number of seconds")
        return EXIT_BAD_INPUT
    if tail is not None and tail < 0:
        err(f"--tail {tail} must be a number of lines, 0 or more")
        return EXIT_BAD_INPUT
    failed = boot_failure(info, node)
    if failed is not None:
        err(failed)
    spec = info.spec()
    url = logs_url(info, spec)
    if url is None:
        return _nowhere(info, node)
    try:
        store = open_store(url)
        found = _list_node(store, info.run_id, node)
    except BucketNotFound as e:
        if not info.local_state_dir:
            err(f"cannot read node {node!r}'s logs from {url}: {e}")
            return EXIT_FAILED
        # A local run none of whose nodes shipped: its console files still hold the output.
        return console_log(info, node, vm=vm, follow=follow, tail=tail)
    except (StorageError, ValueError) as e:
        err(f"cannot read node {node!r}'s logs from {url}: {e}")
        return EXIT_FAILED
    ended = _ended_probe(info) if follow else None
    if not found:
        if info.local_state_dir:
            return console_log(info, node, vm=vm, follow=follow, tail=tail)
        if ended is None or ended():
            return _nothing_shipped(store, info, node, url)
        err(f"node {node!r} has shipped nothing yet to {_where(store, info.run_id, node)}")
        err("waiting for its first chunk (Ctrl-C to stop)")
    reader = Reader(store, node)
    reader.add(found)
    if vm is not None and vm not in reader.vm_ids() and vm_name(vm) in reader.vm_ids():
        vm = vm_name(vm)  # the id as the cloud spells it; chunk names replace odd characters
    reader.only_vm = vm
    if vm is not None and found and vm not in reader.vm_ids():
        if info.local_state_dir:  # a local VM that shipped nothing still has its console
            return console_log(info, node, vm=vm, follow=follow, tail=tail)
        err(f"node {node!r} of run {info.run_id} has no VM {vm!r}; its VMs: {reader.listing()}")
        return EXIT_BAD_INPUT
    if tail is not None:
        reader.start_at_tail(tail)
    try:
        if ended is not None:
            _follow(reader, store, info.run_id, node, interval, ended)
        else:
            reader.drain(final=True)
    except BrokenPipeError:  # `| head` has read enough
        _quiet_stdout()
        return EXIT_OK
    return EXIT_FAILED if reader.unreadable else EXIT_OK


def boot_failure(info: RunInfo, node: str) -> str | None:
    """The line that says ``node``'s boot failed (its last boot report: the run's Redis
    while the run lives, its archived events once it ended), control characters escaped;
    None when its boot did not fail or nothing says."""
    report: BootReport | None = None
    if not (info.dir / "events.jsonl").exists():
        state = run_state(info)
        if state is not None:
            try:
                report = state.boot_reports([node]).get(node)
            except Exception:  # a Redis that stopped answering: the output still prints
                report = None
    else:
        report = _archived_boot(info, node)
    if report is None or not report.failed:
        return None
    return escape_controls(report.line())


def _archived_boot(info: RunInfo, node: str) -> BootReport | None:
    """The node's last ``boot`` event in the run's archived event log."""
    last: BootReport | None = None
    try:
        with open(info.dir / "events.jsonl") as f:
            for line in f:
                if '"boot"' not in line:
                    continue
                try:
                    row = stream.from_archive_line(line)
                except (ValueError, AttributeError):
                    continue
                if row.get("type") == "boot" and row.get("node") == node:
                    last = report_from_fields(node, row) or last
    except OSError:
        return None
    return last


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail again."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _list_node(
    store: ObjectStore, run_id: str, node: str, newest: Session | None = None
) -> list[ChunkName]:
    """The node's chunks; with ``newest``, only that VM's from its next chunk on: two
    listings of at most 100 keys (seq is zero-padded, so a key prefix is a seq range),
    where the whole node's listing is a request per 1,000 chunks it ever shipped."""
    base = node_prefix(run_id, node)
    if newest is None:
        prefixes = [base]
    else:
        block = newest.next_seq // 100
        prefixes = [f"{base}{newest.vm}/{b:06d}" for b in (block, block + 1)]
    names = (parse_chunk_key(k) for p in prefixes for k in store.list(p))
    return [n for n in names if n is not None and n.run_id == run_id and n.node == node]


def _follow(
    reader: Reader,
    store: ObjectStore,
    run_id: str,
    node: str,
    interval: float,
    ended: Callable[[], bool],
) -> None:
    """Poll until Ctrl-C, or until the polls taken after the run ended bring nothing new
    for ``_END_QUIET_S`` (one poll at least): a VM ships its last chunk after its drain."""
    quiet_needed = max(1, math.ceil(_END_QUIET_S / interval))
    try:
        reader.drain(final=False)
        polls = quiet = 0
        while True:
            _pause(interval)
            polls += 1
            # Asked before listing: what the node shipped before the end is in this listing.
            over = ended()
            # The whole node (a replacement VM, late chunks of older ones) every few polls and
            # at the end; in between only the newest VM's next chunks.
            whole = over or polls % _WHOLE_EVERY == 0
            try:
                fresh = reader.add(
                    _list_node(store, run_id, node, None if whole else reader.newest())
                )
            except StorageError as e:  # the store's SDK has retried; the next poll may not fail
                reader.note(f"listing {_where(store, run_id, node)} failed: {e}; trying again")
                continue
            quiet = quiet + 1 if over and not fresh else 0
            reader.drain(final=quiet >= quiet_needed)
            if quiet >= quiet_needed:
                return
    except KeyboardInterrupt:
        sys.stdout.flush()


def _ended_probe(info: RunInfo) -> Callable[[], bool]:
    """Whether the run is over: archived, its Redis gone, or its phase done, failed or down."""
    state = run_state(info)

    def ended() -> bool:
        if state is None or (info.dir / "summary.json").exists():
            return True
        try:
            phase = state.ctl().get("phase")
        except Exception:  # a Redis that stopped answering: the run's controller is gone
            return True
        return phase in (RunPhase.DONE, RunPhase.FAILED, RunPhase.DOWN)

    return ended


# --- when nothing was shipped ------------------------------------------------------------------


def _nowhere(info: RunInfo, node: str) -> int:
    err(
        f"run {info.run_id} ships no node output: its spec names neither logs.to nor "
        "checkpoint.copy_to. On a live VM read /var/log/spottrain-agent.log "
        f"(node {node}); set logs.to to keep the next run's"
    )
    return EXIT_FAILED


def _nothing_shipped(store: ObjectStore, info: RunInfo, node: str, url: str) -> int:
    where = _where(store, info.run_id, node)
    err(f"no output shipped for node {node!r} of run {info.run_id}: nothing under {where}")
    if info.spec().nodes.max > _LIST_NODES_MAX:
        err("  nodes are named n0, n1, ... (`spottrain status` lists the run's nodes)")
    else:
        try:
            names = (parse_chunk_key(k) for k in store.list(f"{info.run_id}/"))
            have = sorted({n.node for n in names if n}, key=_node_order)
        except StorageError as e:
            have = [f"(could not list {url}: {e})"]
        err(f"  nodes with shipped output: {', '.join(have) or 'none'}")
    err(
        "  the node may never have started, or not yet cut its first chunk, or the name is "
        f"wrong; the run ships to {url} (logs.to, else checkpoint.copy_to + /logs)"
    )
    return EXIT_FAILED


def _where(store: ObjectStore, run_id: str, node: str) -> str:
    # url() refuses a key ending in '/', which a prefix does.
    return store.url().rstrip("/") + "/" + node_prefix(run_id, node)


def _node_order(node: str) -> tuple[int, str]:
    digits = node[1:]
    return (int(digits), node) if node[:1] == "n" and digits.isdigit() else (1 << 62, node)


# --- the local cloud's console files ---------------------------------------------------------


def console_log(
    info: RunInfo,
    node: str,
    *,
    vm: str | None = None,
    follow: bool = False,
    tail: int | None = None,
) -> int:
    """A node's output from the local cloud's console log of its VM, kept on this machine;
    ``vm`` must be one of the node's VMs in this run (exit 2 if not): it names the file."""
    vms = local_vms(info, node)
    if vm is not None and vm not in vms:
        known = ", ".join(vms) or "none"
        err(f"node {node!r} of run {info.run_id} has no VM {vm!r}; its VMs: {known}")
        return EXIT_BAD_INPUT
    vm = vm or (vms[0] if vms else None)
    if not vm or not info.local_state_dir:
        err(
            f"no output kept for node {node!r} of run {info.run_id} (the local cloud keeps each "
            "VM's console; on AWS and GCP nodes ship their output to logs.to or "
            "checkpoint.copy_to + /logs)"
        )
        return EXIT_FAILED
    path = Path(info.local_state_dir) / "logs" / f"{vm}.log"
    if not path.exists():
        err(f"no console log of vm {vm!r} of node {node!r}: {path} does not exist")
        return EXIT_FAILED
    return _tail(path, follow, tail)


def local_vms(info: RunInfo, node: str) -> list[str]:
    """The local cloud's VMs of ``node`` in this run, the one its ledger holds first, then
    every VM the local cloud tagged with the run and the node; none an id could not be
    (one is a file name: :func:`~spottrain.controller.cli.parser.check_vm_id`)."""
    vms: list[str] = []
    state = run_state(info)
    if state is not None:
        rec = state.ledger().records.get(node)
        if rec and rec.instance_id:
            vms.append(rec.instance_id)
    if info.local_state_dir:
        for p in sorted((Path(info.local_state_dir) / "instances").glob("*.json")):
            try:
                rec_json = json.loads(p.read_text())
            except (OSError, ValueError):
                continue  # a record being written, or not one
            tags = rec_json.get("tags", {})
            if tags.get("spottrain-job") == info.run_id and tags.get("spottrain-node") == node:
                vms.append(str(rec_json.get("id", "")))
    return [v for v in dict.fromkeys(vms) if _is_vm_id(v)]


def _is_vm_id(value: str) -> bool:
    try:
        check_vm_id(value)
    except ValueError:
        return False
    return True


def _tail(path: Path, follow: bool, lines: int | None = None) -> int:
    with open(path, "rb") as f:
        if lines is not None:
            f.seek(last_lines_offset(f, lines))
        try:
            while True:
                write_out(f.read())
                if not follow:
                    return EXIT_OK
                _pause(0.5)
        except KeyboardInterrupt:
            return EXIT_OK
        except BrokenPipeError:
            _quiet_stdout()
            return EXIT_OK


def last_lines_offset(f: BinaryIO, lines: int, block: int = 1 << 16) -> int:
    """Where the last ``lines`` lines of ``f`` start, read backwards a block at a time (a
    console file may be gigabytes); a last line without its newline counts."""
    end = f.seek(0, os.SEEK_END)
    if lines == 0:
        return end
    pos, found = end, 0
    while pos > 0:
        step = min(block, pos)
        f.seek(pos - step)
        data = f.read(step)
        # Each newline starts the line after it, but for the one that ends the file.
        scan = data[:-1] if pos == end else data
        at = len(scan)
        while (at := scan.rfind(b"\n", 0, at)) >= 0:
            found += 1
            if found == lines:
                return pos - step + at + 1
        pos -= step
    return 0
