"""The Lua bodies of a relay's scripts (RELAY_REQUEST, RELAY_TICK): one call asks for a whole
batch of replicas, so Redis runs one script and a few variadic calls per ~100 replicas instead
of a script per replica. Each runs after :data:`.lua.PRELUDE` (see :mod:`.scripts`)."""

from __future__ import annotations

# ARGV[5]: the batch ("<relay id>:<batch token>", the same across the batch's retries);
# ARGV[6..]: per replica: id, step, held quorum id, commit failures, shrink_only (0/1).
# Returns {round, id, why, id, why, ...}: the round the batch's requests joined and the
# replicas refused ("gone <left|dropped> <ms>", "join": not joined, "direct": it asked
# Redis itself this round); {-1} when an answer to this batch waits in its list already (a
# retry after its round formed): the caller reads the list, then sends what is still open.
RELAY_REQUEST_BODY = r"""
load_state(true)
local rk = ARGV[5]
local _, complete = sweep()
if rc(RRELAY .. rk, 'LLEN') > 0 then save(); return {-1} end
local ids = {}
for i = 6, #ARGV, 5 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then save(); return {S.round} end
local member = rc(K_PREV, 'SMISMEMBER', unpack(ids))
local had = rc(K_REQ, 'HMGET', unpack(ids))
-- Only a replica outside the last quorum can be gone or unjoined (a drop takes it out).
local refused, others = {}, {}
for k, id in ipairs(ids) do if member[k] == 0 then others[#others + 1] = id end end
if #others > 0 then
  local why, info = rc(K_GONE, 'HMGET', unpack(others)), rc(K_INFO, 'HMGET', unpack(others))
  for j, id in ipairs(others) do
    if why[j] then refused[id] = 'gone ' .. why[j] elseif not info[j] then refused[id] = 'join' end
  end
end
local mine = '@' .. rk
local zargs, hargs, held, added, joined = {}, {}, 0, 0, 0
for k, id in ipairs(ids) do
  local v = had[k]
  if v and not refused[id] then
    local tok = string.match(v, ' (%S+)$')
    if tok and string.byte(tok, 1) ~= 64 then refused[id] = 'direct' end
  end
  if not refused[id] then
    local i = 6 + (k - 1) * 5
    local step, h, cf, sh = ARGV[i + 1], tonumber(ARGV[i + 2]) or 0, ARGV[i + 3], ARGV[i + 4]
    if h > held then held = h end
    zargs[#zargs + 1] = NOW; zargs[#zargs + 1] = id
    hargs[#hargs + 1] = id; hargs[#hargs + 1] = step .. ' ' .. cf .. ' ' .. sh .. ' ' .. mine
    if not v then
      added = added + 1
      if member[k] == 1 then joined = joined + 1 end
    end
    note_steady(member[k] == 1, step, cf, sh)
  end
end
local out = {S.round}
for _, id in ipairs(ids) do
  if refused[id] then out[#out + 1] = id; out[#out + 1] = refused[id] end
end
if #hargs > 0 then
  if held > S.qid then lib().floor(held) end
  set('nhb', S.nhb + rc(K_HB, 'ZADD', unpack(zargs)))
  rc(K_REQ, 'HSET', unpack(hargs))
  set('nreq', S.nreq + added); set('joined_prev', S.joined_prev + joined)
  rc(K_RRELAYS, 'SADD', rk)
  if S.opened == '' then set('opened', NOW) end
  if not (complete and cannot_form()) then lib().try_form() end
end
save()
return out
"""

# ARGV[5]: the batch; ARGV[6]: "withdraw" when the caller gives up, else "wait"; ARGV[7..]:
# the ids still waiting. Returns {"drain"} when an answer waits in the batch's list (read it
# first), else per id: "pending", "lost" (Redis lost the request: send it again), "gone
# <why> <ms>", "direct" (it asked Redis itself) or "withdrawn".
RELAY_TICK_BODY = r"""
load_state(true)
local rk, withdraw = ARGV[5], ARGV[6] == 'withdraw'
local mine = ' @' .. rk
sweep()
local ids = {}
for i = 7, #ARGV do ids[#ids + 1] = ARGV[i] end
local function standing()
  if rc(RRELAY .. rk, 'LLEN') > 0 then return {'drain'} end
  local out = {}
  if #ids == 0 then return out end
  local v, why = rc(K_REQ, 'HMGET', unpack(ids)), rc(K_GONE, 'HMGET', unpack(ids))
  for k, _ in ipairs(ids) do
    if v[k] and string.sub(v[k], -#mine) == mine then out[k] = 'pending'
    elseif why[k] then out[k] = 'gone ' .. why[k]
    elseif v[k] then out[k] = 'direct'
    else out[k] = 'lost' end
  end
  return out
end
local out
if withdraw then
  out = standing()
  if out[1] ~= 'drain' then
    for k, id in ipairs(ids) do
      if out[k] == 'pending' then
        rc(K_REQ, 'HDEL', id)
        if rc(K_PREV, 'SISMEMBER', id) == 1 then set('joined_prev', S.joined_prev - 1) end
        out[k] = 'withdrawn'
      end
    end
    if rc(K_REQ, 'HLEN') == 0 then set('opened', '') end
  end
  lib().try_form()
else
  lib().try_form()
  out = standing()
end
save()
return out
"""
