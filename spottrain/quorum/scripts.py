"""The quorum's Lua scripts (the writers of its keys, but for the client's ``waited``
marker), their argument layout, and the answer line's parser.

Every script is called as ``EVALSHA <sha> 1 <script_keys(keys)> <config_args(...)> <own
args>``: one key, the prefix ``quorum_key("")`` of all the quorum's keys (they share the run's
hash tag, so one slot), then ARGV[1..4] = heartbeat timeout ms, join timeout ms, min_replicas,
an epoch candidate (8 hex; used only if the state is created); then each script's own
arguments:

- ``JOIN``: replica id, ``member_json(member)``. -> 1
- ``REQUEST``: replica id, step, held quorum id, commit failures, shrink_only (0/1), a token
  (unique per logical request, the same across its retries). -> the round number; the answer
  arrives on ``reply:<id>`` as ``"<token> <answer line>"`` (``split_reply``).
- ``TICK``: the waiting replica's id, its request's token, and ``withdraw`` when it gives
  up -> ``pending``, ``answered`` (the answer waits in the list), ``lost`` (Redis lost the
  request, e.g. restarted: send it again) or ``withdrawn``. Without a token: ``ticked``.
- ``HEARTBEAT``: replica ids. -> the ids among them that are gone.
- ``LEAVE``: replica id. -> 1 if it left now, 0 if it was gone already.
- ``RELAY_REQUEST``: a relay batch ``"<relay id>:<batch token>"``, then its items as
  ``relay_args`` lays them out. -> ``[round, id, why,
  ...]`` (the refused: ``gone <why> <ms>``, ``join``, ``direct``) or ``[-1]`` when the
  batch's answer already waits (read it first). The answers arrive on
  ``relayreply:<batch>`` (see :mod:`.relay`).
- ``RELAY_TICK``: the batch, ``wait`` or ``withdraw``, the ids still open. -> ``["drain"]``
  or per id ``pending``, ``lost``, ``gone <why> <ms>``, ``direct``, ``withdrawn``.

Error replies: ``QGONE <id> <left|dropped> <ms>``, ``QJOIN <id>`` (not joined: call JOIN,
e.g. after Redis lost its data), ``QCORRUPT <key> <what>`` (garbage in a key). A write Redis
refuses for a reason of its own (``NOREPLICAS``, ``READONLY``, ``OOM``, ``MISCONF``, ...)
comes back as Redis's own error reply, not as QCORRUPT (:func:`.errors.refusal`).

Keys (parts of ``RunKeys.quorum_key``): ``seq``, ``state``, ``prev``, ``req``, ``hb``,
``info``, ``roster``, ``gone``, ``reply:<id>`` as in the design, plus ``gone_at`` (zset id ->
ms, so the oldest tombstones can be trimmed at 100k), ``sort`` (scratch, empty between
calls; sorts replica ids by bytes only when Redis runs in a non-C collation locale),
``rlog`` (hash: the roster version a membership change started from -> the JSON delta
``{"version", "from", "add": [entries], "del": [ids]}``; the last 64, their order in the
list ``rlog_vs``) and ``pdrop`` (set: members of the last quorum dropped or left since, which
the next delta removes); for relays and the steady FORM: ``ranks`` (hash: member -> rank in
the last quorum, rewritten with the membership), ``rdirect`` and ``rrelays`` (sets: this
round's direct requesters and relay batches), ``lastreq`` (the last formed round's requests:
a member whose relay died finds its answer through them) and ``relayreply:<batch>`` (list,
expires a minute after its last answer). One key is the client's, not the scripts':
``waited`` (string ``1``), the marker it writes just before ``WAIT`` with ``wait_replicas``
(WAIT counts its own connection's last write; see :mod:`.confirm`); nothing reads it, and
deleting it is harmless. ``state``
also holds ``grace_until`` (the stall guard), ``dirty`` (a member of the last quorum was
dropped or left), ``held`` (the largest quorum id held by this round's requesters) and
``steady`` and ``rstep`` (the open round is steady so far, at that step: see
:data:`.lua.PRELUDE`'s ``note_steady``), ``ranks_v`` (the version ``ranks`` holds) and
``nreq``, ``nprev``, ``nhb`` (the sizes of ``req``, ``prev``, ``hb``, kept by the scripts so a
REQUEST that cannot form a round needs no call to know it; a round forms only on the keys'
real counts, which every such check writes back).
``info`` holds a member as the JSON array ``[address, store_address, world_size, data]`` so a
roster entry is ``[id, ...]`` built without decoding it.

The answer line (ASCII, space separated):
``<qid> <rank> <count> <max_step> <heal_from or -1> <version> <commit_failures max> <epoch>
[<id>=<step> ...]`` (the members behind max_step, in rank order).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import lua, lua_bodies, lua_relay
from spottrain.quorum.model import Answer, BatchItem, Member, QuorumConfig

KEY_PARTS = (
    "seq", "state", "prev", "req", "hb", "info", "roster", "gone", "gone_at", "sort", "rlog",
    "rlog_vs", "pdrop", "ranks", "rdirect", "rrelays", "lastreq",
)  # fmt: skip
REPLY_PART = "reply:"
RELAY_REPLY_PART = "relayreply:"

JOIN = lua.PRELUDE + lua_bodies.JOIN_BODY
REQUEST = lua.PRELUDE + lua_bodies.REQUEST_BODY
TICK = lua.PRELUDE + lua_bodies.TICK_BODY
HEARTBEAT = lua.PRELUDE + lua_bodies.HEARTBEAT_BODY
LEAVE = lua.PRELUDE + lua_bodies.LEAVE_BODY
RELAY_REQUEST = lua.PRELUDE + lua_relay.RELAY_REQUEST_BODY
RELAY_TICK = lua.PRELUDE + lua_relay.RELAY_TICK_BODY
ALL = {
    "JOIN": JOIN, "REQUEST": REQUEST, "TICK": TICK, "HEARTBEAT": HEARTBEAT, "LEAVE": LEAVE,
    "RELAY_REQUEST": RELAY_REQUEST, "RELAY_TICK": RELAY_TICK,
}  # fmt: skip


def script_keys(keys: RunKeys) -> list[str]:
    """KEYS for every script: the prefix of the quorum's keys."""
    return [keys.quorum_key("")]


def reply_key(keys: RunKeys, replica_id: str) -> str:
    """The list a waiting replica BLPOPs for its answer."""
    return keys.quorum_key(REPLY_PART + replica_id)


def config_args(keys: RunKeys, config: QuorumConfig, epoch_candidate: str) -> list[str]:
    """ARGV[1..4], shared by every script (``keys`` is unused: kept for the callers)."""
    del keys
    return [
        str(int(config.heartbeat_timeout_ms)),
        str(int(config.join_timeout_ms)),
        str(int(config.min_replicas)),
        epoch_candidate,
    ]


# A replica id's limit in bytes (UTF-8), not characters: the relay's frames are sized from
# it (agent/quorum_shim/relay.py), so an id this check accepts always fits one.
MAX_REPLICA_ID_BYTES = 512
# Lua's numbers are doubles, exact only up to 2**53 (and its %d of a larger one wraps): a
# step or commit-failure count past this would come back changed from the scripts.
MAX_STEP = 2**53 - 1
# Quorum ids count up from the largest held one by INCR, which Lua reads back as a double:
# held ids stop here so the ids after them stay exact for 2**52 more rounds.
MAX_HELD_QUORUM_ID = 2**52


def check_replica_id(replica_id: str) -> str:
    """A replica id travels inside space-separated lines: refuse what would break them."""
    if (
        not replica_id
        or any(c.isspace() for c in replica_id)
        or len(replica_id.encode(errors="surrogatepass")) > MAX_REPLICA_ID_BYTES
    ):
        raise ValueError(
            f"replica id {replica_id[:80]!r} cannot be used by the Redis quorum: use 1-"
            f"{MAX_REPLICA_ID_BYTES} bytes (UTF-8; a CJK character takes 3) without whitespace"
        )
    return replica_id


def check_numbers(step: int, held_quorum_id: int, commit_failures: int) -> None:
    """Refuse a request's numbers that the scripts' Lua cannot hold exactly.

    Raises:
        ValueError: one is out of range (naming it and the range).
    """
    if not -MAX_STEP <= step <= MAX_STEP:
        raise ValueError(
            f"step {step} is out of the Redis quorum's range -{MAX_STEP}..{MAX_STEP} (its "
            "Lua holds numbers as doubles): pass the training step"
        )
    if held_quorum_id > MAX_HELD_QUORUM_ID:
        raise ValueError(
            f"held quorum id {held_quorum_id} is out of the Redis quorum's range "
            f"0..{MAX_HELD_QUORUM_ID}: no quorum hands out such an id, so the run's quorum "
            f"keys hold garbage; stop the run's replicas and delete them to reset the quorum"
        )
    if not 0 <= commit_failures <= MAX_STEP:
        raise ValueError(
            f"commit failures {commit_failures} is out of the Redis quorum's range 0..{MAX_STEP}"
        )


def member_json(member: Member) -> str:
    """A member as stored in ``info``: ``[address, store_address, world_size, data]``."""
    return json.dumps(
        [member.address, member.store_address, int(member.world_size), member.data],
        separators=(",", ":"),
    )


def request_args(
    replica_id: str, step: int, held_quorum_id: int, commit_failures: int, shrink_only: bool,
    token: str,
) -> list[str]:  # fmt: skip
    """REQUEST's own ARGV (after ``config_args``).

    Raises:
        ValueError: a number the scripts cannot hold exactly (:func:`check_numbers`).
    """
    check_numbers(int(step), int(held_quorum_id), max(0, int(commit_failures)))
    return [
        replica_id,
        str(int(step)),
        str(max(0, int(held_quorum_id))),
        str(max(0, int(commit_failures))),
        "1" if shrink_only else "0",
        token,
    ]


def relay_key(keys: RunKeys, batch: str) -> str:
    """The list a relay batch (``"<relay id>:<batch token>"``) BLPOPs for its answers."""
    return keys.quorum_key(RELAY_REPLY_PART + batch)


def relay_args(batch: str, items: Sequence[BatchItem], held: Sequence[int]) -> list[str]:
    """RELAY_REQUEST's own ARGV (``held``: each item's held quorum id, the client's own
    record included): the batch, then "U", the step, the largest held id and the ids when
    every item is at one step with no commit failure and no shrink_only (a steady round's
    batch: a fifth of the arguments), else "V" and five per item.

    Raises:
        ValueError: an item's number the scripts cannot hold exactly (:func:`check_numbers`).
    """
    for item, h in zip(items, held, strict=True):
        check_numbers(int(item.step), int(h), max(0, int(item.commit_failures)))
    steps = {int(x.step) for x in items}
    if len(steps) == 1 and not any(x.commit_failures > 0 or x.shrink_only for x in items):
        top = max(0, *(int(h) for h in held))
        return [batch, "U", str(steps.pop()), str(top), *(x.replica_id for x in items)]
    args = [batch, "V"]
    for item, h in zip(items, held, strict=True):
        args += [
            item.replica_id,
            str(int(item.step)),
            str(max(0, int(h))),
            str(max(0, int(item.commit_failures))),
            "1" if item.shrink_only else "0",
        ]
    return args


def split_reply(element: str | bytes) -> tuple[str, str]:
    """A ``reply:<id>`` element -> (token, answer line)."""
    text = element.decode() if isinstance(element, bytes) else element
    token, _, line = text.partition(" ")
    return token, line


def parse_answer(line: str | bytes) -> Answer:
    """Parse an answer line (see the module docstring).

    Raises:
        ValueError: not an answer line.
    """
    text = line.decode() if isinstance(line, bytes) else line
    parts = text.split(" ")
    if len(parts) < 8:
        raise ValueError(f"not a quorum answer line: {text!r}")
    qid, rank, count, max_step, heal, version, failures = (int(p) for p in parts[:7])
    behind: dict[str, int] = {}
    for item in parts[8:]:
        replica_id, sep, step = item.rpartition("=")
        if not sep:
            raise ValueError(f"not a quorum answer line (behind entry {item!r}): {text!r}")
        behind[replica_id] = int(step)
    return Answer(
        quorum_id=qid,
        replica_rank=rank,
        replica_count=count,
        max_step=max_step,
        heal_from=None if heal < 0 else heal,
        roster_version=version,
        commit_failures=failures,
        epoch=parts[7],
        behind=behind,
    )


def _member(m: list[Any]) -> Member:
    return Member(
        replica_id=str(m[0]),
        address=str(m[1]),
        store_address=str(m[2]),
        world_size=int(m[3]),
        data=str(m[4]),
    )


def apply_delta(members: dict[str, Member], doc: str | bytes) -> int:
    """Apply one ``rlog`` entry to ``members`` (replica id -> Member); returns the version it
    brings them to.

    Raises:
        ValueError: not a roster delta.
    """
    data = json.loads(doc)
    if not isinstance(data, dict) or not isinstance(data.get("add"), list):
        raise ValueError("not a roster delta")
    for replica_id in data["del"]:
        members.pop(str(replica_id), None)
    for m in data["add"]:
        members[str(m[0])] = _member(m)
    return int(data["version"])


def parse_roster(doc: str | bytes) -> tuple[int, list[Member]]:
    """The ``roster`` key's JSON -> (version, members sorted by replica id).

    Raises:
        ValueError: not a roster document.
    """
    data = json.loads(doc)
    if not isinstance(data, dict) or not isinstance(data.get("members"), list):
        raise ValueError("not a roster document")
    return int(data["version"]), [_member(m) for m in data["members"]]
