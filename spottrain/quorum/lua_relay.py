"""The Lua bodies of a relay's scripts (RELAY_REQUEST, RELAY_TICK): one call asks for a whole
batch of replicas, so Redis runs one script and a few variadic calls per ~100 replicas instead
of a script per replica. Each runs after :data:`.lua.PRELUDE` (see :mod:`.scripts`)."""

from __future__ import annotations

# ARGV[5]: the batch ("<relay id>:<batch token>", the same across the batch's retries);
# ARGV[6]: "U" (uniform: every replica at one step, no commit failure, no shrink_only: the
# steady case) then ARGV[7] = the step, ARGV[8] = the largest held quorum id, ARGV[9..] = the
# ids; or "V", then per replica: id, step, held quorum id, commit failures, shrink_only (0/1).
# Returns {round, id, why, id, why, ...}: the round the batch's requests joined and the
# replicas refused ("gone <left|dropped> <ms>", "join": not joined, "direct": it asked
# Redis itself this round); {-1} when an answer to this batch waits in its list already (a
# retry after its round formed): the caller reads the list, then sends what is still open.
RELAY_REQUEST_BODY = r"""
load_state(true)
local rk, uniform = ARGV[5], ARGV[6] == 'U'
local _, complete = sweep()
if rc(RRELAY .. rk, 'LLEN') > 0 then save(); return {-1} end
local ids, held, steps, cfs, shs = {}, 0, {}, {}, {}
if uniform then
  held = tonumber(ARGV[8]) or 0
  for i = 9, #ARGV do ids[i - 8] = ARGV[i] end
else
  for i = 7, #ARGV, 5 do
    local k = #ids + 1
    ids[k], steps[k], cfs[k], shs[k] = ARGV[i], ARGV[i + 1], ARGV[i + 3], ARGV[i + 4]
    local h = tonumber(ARGV[i + 2]) or 0
    if h > held then held = h end
  end
end
if #ids == 0 then save(); return {S.round} end
local member = rc(K_PREV, 'SMISMEMBER', unpack(ids))
-- Only a replica outside the last quorum can be gone or unjoined (a drop takes it out); a
-- replica that asked Redis itself this round is in rdirect (usually empty when relays ask).
local refused, others, new_other = {}, {}, 0
for k, id in ipairs(ids) do if member[k] == 0 then others[#others + 1] = id end end
if #others > 0 then
  local why, info = rc(K_GONE, 'HMGET', unpack(others)), rc(K_INFO, 'HMGET', unpack(others))
  local had = rc(K_REQ, 'HMGET', unpack(others))
  for j, id in ipairs(others) do
    if why[j] then refused[id] = 'gone ' .. why[j]
    elseif not info[j] then refused[id] = 'join'; note_unjoined()
    elseif not had[j] then new_other = new_other + 1 end
  end
end
-- rdirect is kept while relays ask (S.relayed); in the first relayed round, the requests.
local direct
if S.relayed == 1 then
  if rc(K_RDIRECT, 'SCARD') > 0 then direct = rc(K_RDIRECT, 'SMISMEMBER', unpack(ids)) end
else
  direct = {}
  for k, v in ipairs(rc(K_REQ, 'HMGET', unpack(ids))) do
    local tok = v and string.match(v, ' (%S+)$')
    direct[k] = (tok and string.byte(tok, 1) ~= 64) and 1 or 0
  end
end
for k, id in ipairs(direct and ids or {}) do
  if direct[k] == 1 and not refused[id] then
    refused[id] = 'direct'
    if member[k] == 0 and not rc(K_REQ, 'HGET', id) then new_other = new_other - 1 end
  end
end
local mine, now = '@' .. rk, fmt(NOW)
local same = uniform and ARGV[7] .. ' 0 0 ' .. mine  -- every value alike: made once
local zargs, hargs, z, all_members = {}, {}, 0, true
for k, id in ipairs(ids) do
  if not refused[id] then
    zargs[z + 1], zargs[z + 2], hargs[z + 1] = now, id, id
    if same then
      hargs[z + 2] = same
      all_members = all_members and member[k] == 1
    else
      hargs[z + 2] = steps[k] .. ' ' .. cfs[k] .. ' ' .. shs[k] .. ' ' .. mine
      note_steady(member[k] == 1, steps[k], cfs[k], shs[k])
    end
    z = z + 2
  end
end
if same and z > 0 then note_steady(all_members, ARGV[7], '0', '0') end
local out = {S.round}
for _, id in ipairs(ids) do
  if refused[id] then out[#out + 1] = id; out[#out + 1] = refused[id] end
end
if z > 0 then
  if held > S.qid then lib().floor(held) end
  set('nhb', S.nhb + rc(K_HB, 'ZADD', unpack(zargs)))
  -- New fields count once: a retry's are there already (HSET counts only new ones).
  local added = rc(K_REQ, 'HSET', unpack(hargs))
  set('nreq', S.nreq + added); set('joined_prev', S.joined_prev + added - new_other)
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
