"""The Lua bodies of the direct scripts (JOIN, REQUEST, TICK, HEARTBEAT, LEAVE); each runs after
:data:`.lua.PRELUDE` in one script (see :mod:`.scripts`)."""

from __future__ import annotations

# ARGV[5..]: replica id, Member as a JSON array [address, store_address, world_size, data].
JOIN_BODY = r"""
load_state(false)
local id = ARGV[5]
local why = rc(K_GONE, 'HGET', id)
if why then save(); return redis.error_reply('QGONE ' .. id .. ' ' .. why) end
rc(K_INFO, 'HSET', id, ARGV[6])
save()
return 1
"""

# ARGV[5..]: replica id, step, held quorum id, commit failures, shrink_only (0/1), token.
REQUEST_BODY = r"""
-- The answer line the last FORM gave member ``id`` in the list of the relay batch that
-- asked for it (``last``: its request in that round), or nil when the list holds none.
local function relayed_answer(id, last)
  local rk = string.match(last, ' @(%S+)$')
  if not rk then return nil end
  for _, el in ipairs(rc(RRELAY .. rk, 'LRANGE', 0, -1)) do
    local kind, rnd = string.match(el, '^([SF]) (%d+)')
    if tonumber(rnd) == S.round - 1 then
      if kind == 'F' then
        local i = string.find(el, '\n' .. id .. ' ', 1, true)
        if i then
          local j = string.find(el, '\n', i + 1, true)
          return string.sub(el, i + #id + 2, (j or 0) - 1)
        end
      else
        local qid, version, count, max_step, epoch =
          string.match(el, '^S %d+ (%d+) (%d+) (%d+) (%-?%d+) (%S+)$')
        local rank = rc(K_RANKS, 'HGET', id)
        if qid and rank then
          return qid .. ' ' .. rank .. ' ' .. count .. ' ' .. max_step .. ' -1 ' .. version ..
            ' 0 ' .. epoch
        end
      end
    end
  end
  return nil
end

load_state(true)
local id, step, held = ARGV[5], ARGV[6], tonumber(ARGV[7])
local cf, shrink, tok = ARGV[8], ARGV[9], ARGV[10]
local _, complete = sweep()
-- A member of the last quorum is neither gone nor unjoined (a drop takes it out of prev).
local member = rc(K_PREV, 'SISMEMBER', id) == 1
if not member then
  local why = rc(K_GONE, 'HGET', id)
  if why then save(); return redis.error_reply('QGONE ' .. id .. ' ' .. why) end
  if rc(K_INFO, 'HEXISTS', id) == 0 then
    note_unjoined()
    save()
    return redis.error_reply('QJOIN ' .. id)
  end
end
-- A retry of a request whose round already formed: its answer waits in the list.
local waiting = rc(REPLY .. id, 'LRANGE', 0, -1)
for _, line in ipairs(waiting) do
  if string.sub(line, 1, #tok + 1) == tok .. ' ' then save(); return S.round - 1 end
end
-- A member that a relay asked for in the round that formed last, at this step, and whose
-- answer still waits in that relay batch's list: the relay died before passing it on. It is
-- answered from there (once), not counted in the next round.
local last = member and S.relayed == 1 and rc(K_LASTREQ, 'HGET', id)
if last and string.find(last, step .. ' ', 1, true) == 1 then
  local line = relayed_answer(id, last)
  if line then
    rc(K_LASTREQ, 'HDEL', id)
    rc(REPLY .. id, 'LPUSH', tok .. ' ' .. line)
    save()
    return S.round - 1
  end
end
if held > S.qid then lib().floor(held) end  -- seq >= qid always: only a larger id counts
if rc(K_HB, 'ZADD', NOW, id) == 1 then set('nhb', S.nhb + 1) end
if rc(K_REQ, 'HSET', id, step .. ' ' .. cf .. ' ' .. shrink .. ' ' .. tok) == 1 then
  set('nreq', S.nreq + 1)
  if #waiting > 0 then rc(REPLY .. id, 'DEL') end  -- answers to requests it gave up on
  if member then set('joined_prev', S.joined_prev + 1) end
end
-- The steady FORM answers a direct requester from rdirect (a relay's from its batch), kept
-- only while relays ask (the last round had some): a fleet that asks only directly forms
-- with the full FORM, which reads every request anyway, and spares each request the call.
if S.relayed == 1 then
  note_steady(member, step, cf, shrink)
  rc(K_RDIRECT, 'SADD', id)
elseif S.steady ~= 0 then
  set('steady', 0)
end
if S.opened == '' then set('opened', NOW) end
local round = S.round
if not (complete and cannot_form()) then lib().try_form() end
save()
return round
"""

# ARGV[5]: the waiting replica's id (a waiter that was dropped learns it here); ARGV[6]: the
# token of its request; ARGV[7]: "withdraw" when the waiter gives up. Returns where the request
# stands: "pending", "answered" (its answer waits in the list), "lost" (Redis lost it: send
# it again) or "withdrawn".
TICK_BODY = r"""
load_state(true)
local id, tok, withdraw = ARGV[5], ARGV[6], ARGV[7] == 'withdraw'
sweep()
local function standing()
  local v = rc(K_REQ, 'HGET', id)
  if v and string.sub(v, -#tok - 1) == ' ' .. tok then return 'pending' end
  for _, line in ipairs(rc(REPLY .. id, 'LRANGE', 0, -1)) do
    if string.sub(line, 1, #tok + 1) == tok .. ' ' then return 'answered' end
  end
  return 'lost'
end
local result = tok and standing() or 'ticked'
if result == 'pending' and withdraw then
  rc(K_REQ, 'HDEL', id)
  if rc(K_PREV, 'SISMEMBER', id) == 1 then set('joined_prev', S.joined_prev - 1) end
  if rc(K_REQ, 'HLEN') == 0 then set('opened', '') end
  result = 'withdrawn'
end
if lib().try_form() and result == 'pending' then result = standing() end
save()
local why = rc(K_GONE, 'HGET', id)
if why then return redis.error_reply('QGONE ' .. id .. ' ' .. why) end
return result
"""

# ARGV[5..]: replica ids. Returns the ids that are gone.
HEARTBEAT_BODY = r"""
load_state(false)  -- a replica may heartbeat before it joins: a first one is no loss
local dropped = sweep()
local live, gone = {}, {}
for i = 5, #ARGV, CHUNK do
  local ids = {}
  for j = i, math.min(i + CHUNK - 1, #ARGV) do ids[#ids + 1] = ARGV[j] end
  local why = rc(K_GONE, 'HMGET', unpack(ids))
  local args = {}
  for j, id in ipairs(ids) do
    if why[j] then gone[#gone + 1] = id else args[#args + 1] = NOW; args[#args + 1] = id end
  end
  if #args > 0 then set('nhb', S.nhb + rc(K_HB, 'ZADD', unpack(args))) end
end
if dropped > 0 then lib().try_form() end
save()
return gone
"""

# ARGV[5]: replica id.
LEAVE_BODY = r"""
load_state(true)
local id = ARGV[5]
local left = 0
if not rc(K_GONE, 'HGET', id) then lib().drop(id, 'left'); left = 1 end
lib().try_form()
save()
return left
"""
