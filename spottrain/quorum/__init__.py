"""The replica quorum kept in the run's Redis (``train.replica.quorum: redis``).

It replaces torchft's lighthouse: the state is persisted with the run's Redis, quorum ids
come from a counter that never goes back, a replica can leave explicitly, and each step costs
O(1) bytes per replica on the wire (the full membership travels only when it changes).

Modules: :mod:`.model` (members, answers, the config), :mod:`.errors`, :mod:`.lua`,
:mod:`.lua_bodies`, :mod:`.lua_relay` and :mod:`.scripts` (the Lua that owns every key, its
argument layout and the key layout, the answer line's parser), :mod:`.client` (the blocking
client the agent's lighthouse shim and the tests use), :mod:`.confirm` (``wait_replicas``'
WAIT, and the deadlines of the client's blocking commands) and :mod:`.relay` (its
``request_batch``: a relay asking for a group of replicas in one call).

Relays and the steady FORM: at thousands of replicas a script call per replica per step is
what costs Redis (~54 us of its one thread each). A relay (one agent per ~100 replicas)
sends its group's requests as one RELAY_REQUEST (variadic ZADD, HSET, SMISMEMBER: one call
instead of 100) and gets one element back on its own list. A round is *steady* when every
member of the last quorum asked, nobody else, all at one step, with no commit failure and no
shrink_only, and nobody left or was dropped: the state tracks it per request in O(1)
(``steady``, ``rstep``), and such a round forms with the steady FORM, which reads no member's
request: it pushes one ``S`` line per relay batch (each member's rank is its index in the
cached roster) and one answer per direct requester (their ranks kept in ``ranks``), and
renames the requests away. Every other round runs the full FORM, which answers a relay's
members in one ``F`` element. Both give the answers the full FORM always gave (property
tested against direct requests and the rules over random rounds). Measured
(``bench/qscale/relay_cost.py``, relays of 100, a loaded 2-core machine): ~200-300 us of
Redis per batch, the steady FORM ~0.4 ms, ~26-37 ms of Redis CPU a round at 12,500 replicas
(~680 ms with a request per replica).

Costs on the wire (measured on Redis 7.0.15 with ``INFO stats`` net byte counters around one
steady-state round, replica ids ``replica-NNNNN:<uuid>``; the same at 3 and 12,500 replicas):

- per replica per step: 377 bytes to Redis (the REQUEST ``EVALSHA``, 260 bytes, plus one
  ``BLPOP``, 119) and 164 bytes back (the round number, and the BLPOP's key and answer
  element, 51 bytes: ``<token> <qid> <rank> <count> <max_step> <heal> <version> <failures>
  <epoch>``). Members behind ``max_step`` add ``<id>=<step>`` each to every answer of that
  round (rare: a replica whose commit failed).
- a membership change: the full roster is about 106 bytes a member, 1.32 MB at 12,500. A
  client reads it whole once (``roster()``); afterwards it follows the per-change deltas
  (``rlog``): one ``HMGET`` when nothing changed, and about 90 bytes plus ~110 a joined member
  and ~50 a removed one per change, so one replica lost at 12,500 costs each survivor ~0.2 kB
  instead of 1.32 MB (16.5 GB across the fleet). A replica starting fresh reads the 1.32 MB
  once; at a cold start of 12,500 replicas that is ~16.5 GB out of Redis in total.
- Redis CPU (``bench/qscale/script_cost.py --sizes 100,12500 --rounds 7``, Redis's own CPU
  time, 12,500 replicas, a loaded 2-core machine): a steady REQUEST ~22 us a call (a trivial
  script with the same arguments: 1.7 us; its 8 Redis calls ~12 us, Lua state handling the
  rest), HEARTBEAT of 8 ids ~31 us, the steady FORM (all members' answers, ~23 ms of it one
  LPUSH each) ~45 ms, a FORM that changes the membership (rewrites the roster) ~200-500 ms.
  So one Redis core spends ~0.32 s on a synchronised round of 12,500: the per-step quorum at
  that scale is bounded by Redis's CPU, not the wire. Heartbeats cost N / interval
  calls a second: 12,500 VMs heartbeating every 200 ms would take ~2 Redis cores; at that
  scale heartbeat every >= 1 s (a timeout >= 5 s, torchft's default) and skip a heartbeat
  when a request went out within the interval (a request is a heartbeat). A round stalled
  past the BLPOP slice makes every waiter TICK once a slice (12,500 x 30 us per ~250 ms).

Connection budget: per VM one connection blocked in ``BLPOP`` for the request, one shared by
its heartbeats, leave and roster reads (``QuorumClient`` takes them from its ``redis.Redis``
pool), plus the agent's own. 12,500 replicas on 12,500 VMs need 25,000-40,000 client
connections: Redis's ``maxclients`` (default 10,000) and its open-file limit must be raised
accordingly (the embedded Redis must set them). The client must not retry long inside redis-py
(``spottrain.redis_conn.connect``'s short backoff is right; redis-py's default of 1-10 s
backoffs would delay heartbeats past the timeout). Its ``socket_timeout`` bounds every command:
the BLPOP and WAIT slices (``min(max(join_timeout, heartbeat_timeout / 4), heartbeat_timeout /
2)``, the BLPOP's +-20 %) are cut to end 0.35 s inside it (:func:`.confirm.longest_block_s`;
redis-py does not lengthen it for a blocking command), at the cost of a TICK more per cut
slice while a round stalls.

Durability: every request carries the quorum id its replica holds and the counter is floored
to it, so ids never go back for any id a live replica holds, even when Redis restarted empty
or failed over to a replica that missed the last second (the state then gets a new ``epoch``
and a grace of one heartbeat timeout for the replicas to come back). ``wait_replicas`` makes
each answer wait until that many Redis replicas hold it (:mod:`.confirm`: a marker write and
``WAIT n <slice>`` on one connection, repeated until the request's deadline; short of it the
answer is not used and the request raises QuorumNotReplicated).

Refusals: a Redis that refuses the quorum's writes for a reason of its own (a replica after a
failover: ``READONLY``; ``LOADING``; ``BUSY``; ``OOM``; ``MISCONF``; ``NOREPLICAS``) is not
corruption: the scripts pass its reply on, a request rides it out until its deadline, and the
QuorumRedisRefused names the cause and the fix (:func:`.errors.refusal`).
"""
