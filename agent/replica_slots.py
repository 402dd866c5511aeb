"""Which replica this node belongs to in replica mode: a slot claimed atomically in Redis.

Replica j is the slot ``replica-<j>`` of the run's ``replica_slots`` hash, whose value is
JSON ``{"nodes": [node ids], "at": unix s, "gen": n}``. A node takes the lowest slot with
fewer than ``nodes_per_replica`` live members; a member whose heartbeat key
(``RunKeys.heartbeat``, written by :class:`~spottrain.agent.node_record.NodeRecord`, gone once
it misses its TTL or its agent exits) no longer exists is dropped as the slot is claimed, so a
backfilled VM takes the place of a lost one and never doubles up with a live one.

**Generations.** A torchrun whose workers end without a signal (a replica that left on a
notice exits 0, a crash exhausts its restarts) closes its rendezvous for good, so a slot
cannot reuse one rendezvous for its whole life. A claim of a slot with no other live member
starts a new generation ``gen`` (the replica's rendezvous id is then
:func:`~spottrain.agent.replica_launch.replica_rdzv_id` of the slot and ``gen``); a node
joining members that are live takes their ``gen``. The highest generation each slot was given
is kept in ``RunKeys.replica_generations``, which a released slot leaves in place, so numbers
never repeat. A record without ``gen`` (written before generations) counts as generation 1.

:func:`choose_slot` is the decision, pure; :data:`CLAIM_LUA` does the same inside Redis, so
concurrent claims of many booting nodes cannot both see a slot free.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import redis

from spottrain.protocol.keys import RunKeys

SLOT_RE = re.compile(r"^replica-(\d+)\Z")


def slot_name(index: int) -> str:
    return f"replica-{index}"


def slot_index(name: str) -> int | None:
    """The j of ``replica-<j>``, or None for any other field (ignored by the claim)."""
    m = SLOT_RE.match(name)
    return int(m.group(1)) if m else None


# What a slot's record without "gen" counts as: the rendezvous id it used had no suffix.
LEGACY_GEN = 1


@dataclass(frozen=True)
class SlotClaim:
    """This node's slot, every live member of it after the claim (this node included), and
    the generation of the replica's rendezvous they share."""

    slot: str
    members: tuple[str, ...]
    gen: int = LEGACY_GEN

    @property
    def index(self) -> int:
        index = slot_index(self.slot)
        assert index is not None
        return index


def claim_gen(members: Sequence[str], node_id: str, record_gen: int, issued: int) -> int:
    """The generation a claim ends with: the slot's own while another member is live (they
    rendezvous together); else one above any the slot was ever given (its old rendezvous may
    be closed, and a late member of it must never meet the new one)."""
    if any(n != node_id for n in members):
        return record_gen
    return max(record_gen, issued) + 1


def choose_slot(
    slots: Mapping[str, Sequence[str]],
    live: Collection[str],
    node_id: str,
    nodes_per_replica: int,
    gens: Mapping[str, int] | None = None,
) -> SlotClaim:
    """The slot ``node_id`` takes, given each slot's listed members, the live nodes and
    each slot's generation (``gens``: absent counts as :data:`LEGACY_GEN` for a listed slot,
    0 for one without a record).

    A node already listed keeps its slot (an agent restarted on the same VM); otherwise it
    takes the lowest slot with fewer than ``nodes_per_replica`` live members. Members that
    are not live are dropped from the slot taken. See :func:`claim_gen` for the generation.
    """
    gens = gens or {}

    def gen_of(name: str, members: Sequence[str]) -> int:
        record = gens.get(name, LEGACY_GEN if name in slots else 0)
        return claim_gen(members, node_id, record, record)

    by_index: dict[int, list[str]] = {}
    for name, nodes in slots.items():
        index = slot_index(name)
        if index is not None:
            by_index[index] = [n for n in nodes if n in live or n == node_id]
    held = sorted(i for i, nodes in by_index.items() if node_id in nodes)
    if held:
        name, members = slot_name(held[0]), tuple(by_index[held[0]])
        return SlotClaim(name, members, gen_of(name, members))
    index = 0
    while len(by_index.get(index, [])) >= nodes_per_replica:
        index += 1
    name, members = slot_name(index), (*by_index.get(index, []), node_id)
    return SlotClaim(name, members, gen_of(name, members))


# KEYS[1]: the slots hash; KEYS[2]: the generations hash; KEYS[3..]: the heartbeat keys of
# the nodes ARGV[4..] (the caller lists every node it saw in the slots hash). ARGV: node id,
# nodes per replica, now. Mirrors choose_slot and claim_gen. A slot naming a node the caller
# did not list (a claim landed in between) answers {'retry'} and writes nothing: every key
# read is declared.
CLAIM_LUA = """
local me, k, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local known, alive = {[me] = true}, {[me] = true}
for i = 3, #KEYS do
  known[ARGV[i + 1]] = true
  if redis.call('EXISTS', KEYS[i]) == 1 then alive[ARGV[i + 1]] = true end
end
local slots, gens, mine = {}, {}, nil
local raw = redis.call('HGETALL', KEYS[1])
for i = 1, #raw, 2 do
  local j = string.match(raw[i], '^replica%-(%d+)$')
  if j then
    j = tonumber(j)
    local ok, body = pcall(cjson.decode, raw[i + 1])
    local nodes = {}
    gens[j] = 1
    if ok and type(body) == 'table' then
      if type(body.nodes) == 'table' then nodes = body.nodes end
      if tonumber(body.gen) then gens[j] = tonumber(body.gen) end
    end
    local kept = {}
    for _, n in ipairs(nodes) do
      if not known[n] then return {'retry', n} end
      if alive[n] then table.insert(kept, n) end
      if n == me and (mine == nil or j < mine) then mine = j end
    end
    slots[j] = kept
  end
end
local j = mine
if j == nil then
  j = 0
  while slots[j] ~= nil and #slots[j] >= k do j = j + 1 end
end
local members = slots[j] or {}
if mine == nil then table.insert(members, me) end
local field = 'replica-' .. j
local gen = gens[j] or 0
local others = 0
for _, n in ipairs(members) do if n ~= me then others = others + 1 end end
if others == 0 then
  local issued = tonumber(redis.call('HGET', KEYS[2], field) or 0) or 0
  gen = math.max(gen, issued) + 1
  redis.call('HSET', KEYS[2], field, gen)
end
redis.call('HSET', KEYS[1], field, cjson.encode({nodes = members, at = now, gen = gen}))
return {'ok', field, cjson.encode(members), tostring(gen)}
"""

# KEYS[1]: the slots hash. ARGV: slot, node id. Drops the node from the slot, and the slot
# once empty.
RELEASE_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local ok, body = pcall(cjson.decode, raw)
if not ok or type(body) ~= 'table' or type(body.nodes) ~= 'table' then return 0 end
local kept, dropped = {}, 0
for _, n in ipairs(body.nodes) do
  if n == ARGV[2] then dropped = 1 else table.insert(kept, n) end
end
if #kept == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  body.nodes = kept
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(body))
end
return dropped
"""

_CLAIM_TRIES = 20


def read_claims(client: redis.Redis, keys: RunKeys) -> dict[str, SlotClaim]:
    """Every slot as its record says (fields that are not slots, or not JSON, skipped)."""
    claims: dict[str, SlotClaim] = {}
    for raw_name, raw in client.hgetall(keys.replica_slots).items():
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        if slot_index(name) is None:
            continue
        try:
            body = json.loads(raw)
            nodes, gen = body.get("nodes", []), body.get("gen", LEGACY_GEN)
        except (ValueError, AttributeError):
            continue
        members = tuple(str(n) for n in nodes) if isinstance(nodes, list) else ()
        claims[name] = SlotClaim(name, members, gen if isinstance(gen, int) else LEGACY_GEN)
    return claims


def read_slots(client: redis.Redis, keys: RunKeys) -> dict[str, list[str]]:
    """Every slot and the nodes it lists."""
    return {name: list(c.members) for name, c in read_claims(client, keys).items()}


def find_claim(client: redis.Redis, keys: RunKeys, node_id: str) -> SlotClaim | None:
    """The slot (and generation) that lists ``node_id``, if any: where its replica's
    rendezvous is."""
    listing = [c for c in read_claims(client, keys).values() if node_id in c.members]
    return min(listing, key=lambda c: c.index) if listing else None


def claim_slot(
    client: redis.Redis, keys: RunKeys, node_id: str, nodes_per_replica: int
) -> SlotClaim:
    """Claim this node's slot atomically (see :func:`choose_slot`).

    Raises:
        redis.RedisError: Redis did not answer.
        RuntimeError: other nodes kept changing the hash through every try.
    """
    for _ in range(_CLAIM_TRIES):
        listed = sorted(
            {n for nodes in read_slots(client, keys).values() for n in nodes} - {node_id}
        )
        reply = client.eval(
            CLAIM_LUA,
            2 + len(listed),
            keys.replica_slots,
            keys.replica_generations,
            *(keys.heartbeat(n) for n in listed),
            node_id,
            nodes_per_replica,
            f"{time.time():.3f}",
            *listed,
        )
        status, *rest = (r.decode() if isinstance(r, bytes) else str(r) for r in reply)
        if status == "ok":
            return SlotClaim(rest[0], tuple(json.loads(rest[1])), int(rest[2]))
    raise RuntimeError(
        f"could not claim a replica slot in {keys.replica_slots} after {_CLAIM_TRIES} tries: "
        "other nodes kept changing it"
    )


def release_slot(client: redis.Redis, keys: RunKeys, claim: SlotClaim, node_id: str) -> bool:
    """Drop this node from its slot (a clean exit); True if it was listed there."""
    return bool(client.eval(RELEASE_LUA, 1, keys.replica_slots, claim.slot, node_id))
