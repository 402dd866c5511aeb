"""The Lua sources of the quorum's scripts; :mod:`.scripts` assembles and documents them.

Every script starts with ``PRELUDE`` (keys, config, the Redis clock, the state with its stall
guard, the shared TRY-FORM and FORM) and ends with its own body. All reads and writes of a
quorum key go through ``rc``, which turns a Redis error (WRONGTYPE, not an integer) into an
error reply ``QCORRUPT <key> <what>``: garbage in a key is reported, never waited on.
"""

from __future__ import annotations

PRELUDE = r"""
-- One declared key, the prefix of all: every quorum key shares the run's hash tag (one slot),
-- and a request carries its name once instead of ten times.
local P = KEYS[1]
local K_SEQ, K_STATE, K_PREV, K_REQ = P .. 'seq', P .. 'state', P .. 'prev', P .. 'req'
local K_HB, K_INFO, K_ROSTER, K_GONE = P .. 'hb', P .. 'info', P .. 'roster', P .. 'gone'
local K_GONE_AT, K_SORT, REPLY = P .. 'gone_at', P .. 'sort', P .. 'reply:'
local K_RLOG, K_RLOG_VS, K_PDROP = P .. 'rlog', P .. 'rlog_vs', P .. 'pdrop'
local RLOG_KEEP = 64
local HB_TIMEOUT = tonumber(ARGV[1])
local JOIN_TIMEOUT = tonumber(ARGV[2])
local MIN_REPLICAS = tonumber(ARGV[3])
local EPOCH_NEW = ARGV[4]
local GONE_CAP = 100000
local CHUNK = 1000

local function corrupt(key, what)
  error({err = 'QCORRUPT ' .. key .. ' ' .. what})
end

local function rc(key, cmd, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then corrupt(key, r.err) end
  return r
end

local function num(key, field, v)
  local n = tonumber(v)
  if n == nil then corrupt(key, 'field ' .. field .. ' = ' .. tostring(v) .. ', not a number') end
  return n
end

local function fmt(n) return string.format('%d', n) end

local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- The state hash, cached for this call; save() writes back the fields a call changed.
local S = {}
local DIRTY_FIELDS = {}
local FIELDS = {'epoch', 'qid', 'version', 'round', 'opened', 'joined_prev', 'max_step',
  'formed', 'active', 'grace_until', 'dirty', 'held'}

local function set(field, v) S[field] = v; DIRTY_FIELDS[field] = true end

local function save()
  local args = {}
  for field, _ in pairs(DIRTY_FIELDS) do
    args[#args + 1] = field
    args[#args + 1] = type(S[field]) == 'number' and fmt(S[field]) or S[field]
  end
  if #args > 0 then rc(K_STATE, 'HSET', unpack(args)) end
end

-- lost: a script other than JOIN found no state, so Redis lost it (an empty restart): grant
-- a grace of one heartbeat timeout for the live replicas to heartbeat again before anyone
-- counts as unhealthy or a round forms on the slow path.
local function load_state(lost)
  local v = rc(K_STATE, 'HMGET', unpack(FIELDS))
  if not v[1] then
    for _, f in ipairs(FIELDS) do set(f, 0) end
    -- The epoch: the creation time and the creating client's random part, unique per state.
    set('epoch', string.format('%x', NOW) .. EPOCH_NEW)
    set('round', 1); set('opened', ''); set('active', NOW)
    if lost then set('grace_until', NOW + HB_TIMEOUT) end
    return
  end
  for i, f in ipairs(FIELDS) do
    if f == 'epoch' then S[f] = v[i]
    elseif f == 'opened' then
      S[f] = (v[i] == '' or not v[i]) and '' or num(K_STATE, f, v[i])
    else S[f] = num(K_STATE, f, v[i] or 0) end
  end
  -- STALL GUARD: every replica calls in at least every timeout/2 (heartbeats), so a longer
  -- gap means Redis itself did not run (fork, pause, restart): drop nobody for a timeout.
  if NOW - S.active > HB_TIMEOUT / 2 then set('grace_until', NOW + HB_TIMEOUT) end
  set('active', NOW)
end

local function in_grace() return NOW < S.grace_until end

local function chunked(key, cmd, items, per)
  for i = 1, #items, CHUNK do
    local args = {}
    for j = i, math.min(i + CHUNK - 1, #items) do per(args, items[j]) end
    rc(key, cmd, unpack(args))
  end
end

local function add_one(args, x) args[#args + 1] = x end
local function add_zero(args, x) args[#args + 1] = 0; args[#args + 1] = x end

-- Sorted by bytes, as torchft sorts replica ids: Lua's '<' follows Redis's LC_COLLATE,
-- which equals byte order only in the C locales; elsewhere a scratch zset sorts.
local function sorted(ids)
  if #ids < 2 then return ids end
  if not ('a' < 'B') and not ('a:b' < 'a-c') and ('Z' < 'a') and ('a' < 'aa') then
    table.sort(ids)
    return ids
  end
  rc(K_SORT, 'DEL')
  chunked(K_SORT, 'ZADD', ids, add_zero)
  local out = rc(K_SORT, 'ZRANGE', 0, -1)
  rc(K_SORT, 'DEL')
  return out
end

local function drop(id, why)
  local had_req = rc(K_REQ, 'HDEL', id) == 1
  if rc(K_PREV, 'SREM', id) == 1 then
    set('dirty', 1)
    rc(K_PDROP, 'SADD', id)  -- still in the roster: the next change's delta removes it
    if had_req then set('joined_prev', S.joined_prev - 1) end
  end
  if had_req and rc(K_REQ, 'HLEN') == 0 then set('opened', '') end
  rc(K_HB, 'ZREM', id)
  rc(K_INFO, 'HDEL', id)
  rc(REPLY .. id, 'DEL')
  rc(K_GONE, 'HSET', id, why .. ' ' .. fmt(NOW))
  rc(K_GONE_AT, 'ZADD', NOW, id)
  if rc(K_GONE_AT, 'ZCARD') > GONE_CAP then
    local old = rc(K_GONE_AT, 'ZPOPMIN', CHUNK)
    local ids = {}
    for i = 1, #old, 2 do ids[#ids + 1] = old[i] end
    chunked(K_GONE, 'HDEL', ids, add_one)
  end
end

-- Drop up to 64 replicas whose heartbeat expired (none during a grace): run by every call
-- that can see a replica, so a frozen one is gone before it can ask again.
local function sweep()
  if in_grace() then return 0 end
  local expired = rc(K_HB, 'ZRANGEBYSCORE', '-inf', fmt(NOW - HB_TIMEOUT), 'LIMIT', 0, 64)
  for _, id in ipairs(expired) do drop(id, 'dropped') end
  return #expired
end

local function gone_why(id)
  return rc(K_GONE, 'HGET', id)
end

local function read_requests()
  local flat = rc(K_REQ, 'HGETALL')
  local reqs, ids, shrink = {}, {}, false
  for i = 1, #flat, 2 do
    local id, v = flat[i], flat[i + 1]
    local step, cf, sh, tok = string.match(v, '^(%-?%d+) (%d+) ([01]) (%S+)$')
    if not step then corrupt(K_REQ, 'field ' .. id .. ' = ' .. v .. ', not a request') end
    reqs[id] = {step = tonumber(step), cf = tonumber(cf), tok = tok}
    if sh == '1' then shrink = true end
    ids[#ids + 1] = id
  end
  if shrink then
    local kept = {}
    for _, id in ipairs(ids) do
      if rc(K_PREV, 'SISMEMBER', id) == 1 then kept[#kept + 1] = id end
    end
    if #kept > 0 then ids = kept end
  end
  return reqs, sorted(ids)
end

-- Roster entries [id, address, store_address, world_size, data] as JSON, built from the
-- stored arrays without decoding them.
local function member_entries(ids)
  local parts = {}
  for i = 1, #ids, CHUNK do
    local chunk = {}
    for j = i, math.min(i + CHUNK - 1, #ids) do chunk[#chunk + 1] = ids[j] end
    local infos = rc(K_INFO, 'HMGET', unpack(chunk))
    for j, id in ipairs(chunk) do
      local info = infos[j] or '["","",1,""]'
      if string.sub(info, 1, 1) ~= '[' or string.sub(info, -1) ~= ']' then
        corrupt(K_INFO, 'field ' .. id .. ' = ' .. info .. ', not a member')
      end
      parts[#parts + 1] = '[' .. cjson.encode(id) .. ',' .. string.sub(info, 2)
    end
  end
  return table.concat(parts, ',')
end

-- The membership changed: rewrite prev and the roster, and log the delta from the last
-- roster (rlog: from-version -> {"version", "from", "add", "del"}) so a cached roster is
-- brought up to date with O(change) bytes instead of the whole membership.
local function change_membership(ids, version)
  local new, old, added, removed = {}, {}, {}, {}
  for _, id in ipairs(ids) do new[id] = true end
  for _, id in ipairs(rc(K_PREV, 'SMEMBERS')) do
    old[id] = true
    if not new[id] then removed[#removed + 1] = id end
  end
  for _, id in ipairs(rc(K_PDROP, 'SMEMBERS')) do removed[#removed + 1] = id end
  for _, id in ipairs(ids) do if not old[id] then added[#added + 1] = id end end
  rc(K_PDROP, 'DEL')
  rc(K_PREV, 'DEL')
  chunked(K_PREV, 'SADD', ids, add_one)
  local doc = '{"version":' .. fmt(version) .. ',"members":[' .. member_entries(ids) .. ']}'
  rc(K_ROSTER, 'SET', doc)
  local del = #removed > 0 and cjson.encode(removed) or '[]'
  local delta = '{"version":' .. fmt(version) .. ',"from":' .. fmt(S.version) ..
    ',"add":[' .. member_entries(added) .. '],"del":' .. del .. '}'
  rc(K_RLOG, 'HSET', fmt(S.version), delta)
  if rc(K_RLOG_VS, 'RPUSH', fmt(S.version)) > RLOG_KEEP then
    rc(K_RLOG, 'HDEL', rc(K_RLOG_VS, 'LPOP'))
  end
  set('version', version); set('dirty', 0)
end

local function membership_changed(ids)
  if S.dirty == 1 or #ids ~= rc(K_PREV, 'SCARD') then return true end
  for _, id in ipairs(ids) do
    if rc(K_PREV, 'SISMEMBER', id) == 0 then return true end
  end
  return false
end

local function next_qid(changed, cf_max)
  if not (changed or cf_max > 0 or S.qid == 0 or S.held > S.qid) then return end
  local seq = num(K_SEQ, 'value', rc(K_SEQ, 'GET') or 0)
  if seq < S.qid then rc(K_SEQ, 'SET', fmt(S.qid)) end
  set('qid', rc(K_SEQ, 'INCR'))
end

-- The healing source for group rank 0, as torchft's compute_quorum_results: the i-th
-- replica behind max_step heals from the (i mod #up-to-date)-th replica at max_step.
local function heal_sources(ids, reqs, max_step)
  local up, behind, heal, tail = {}, {}, {}, {}
  for r, id in ipairs(ids) do
    if reqs[id].step == max_step then up[#up + 1] = r - 1
    else
      behind[#behind + 1] = r - 1
      tail[#tail + 1] = ' ' .. id .. '=' .. fmt(reqs[id].step)
    end
  end
  for i, rank in ipairs(behind) do heal[rank] = up[((i - 1) % #up) + 1] end
  return heal, table.concat(tail)
end

local function form()
  local reqs, ids = read_requests()
  local changed = membership_changed(ids)
  local max_step, cf_max = nil, 0
  for _, id in ipairs(ids) do
    local q = reqs[id]
    if max_step == nil or q.step > max_step then max_step = q.step end
    if q.cf > cf_max then cf_max = q.cf end
  end
  next_qid(changed, cf_max)
  if changed then change_membership(ids, S.qid) end
  local heal, behind = heal_sources(ids, reqs, max_step)
  local n = #ids
  local head = ' ' .. fmt(S.qid) .. ' '
  local mid = ' ' .. fmt(n) .. ' ' .. fmt(max_step) .. ' '
  local tail = ' ' .. fmt(S.version) .. ' ' .. fmt(cf_max) .. ' ' .. S.epoch .. behind
  for r, id in ipairs(ids) do
    local line = reqs[id].tok .. head .. fmt(r - 1) .. mid .. fmt(heal[r - 1] or -1) .. tail
    rc(REPLY .. id, 'LPUSH', line)
  end
  chunked(K_REQ, 'HDEL', ids, add_one)
  set('round', S.round + 1); set('joined_prev', 0); set('held', 0)
  set('formed', NOW); set('max_step', max_step)
  -- Requesters left out (shrink_only rounds) wait on in the next round.
  set('opened', rc(K_REQ, 'HLEN') > 0 and NOW or '')
end

local function try_form()
  local R = rc(K_REQ, 'HLEN')
  if R == 0 then return false end
  local grace = in_grace()
  local H
  if grace then H = rc(K_HB, 'ZCARD')
  else H = rc(K_HB, 'ZCOUNT', '(' .. fmt(NOW - HB_TIMEOUT), '+inf') end
  -- Guards: enough replicas, and more than half of the heartbeating ones (split brain).
  if R < MIN_REPLICAS or 2 * R <= H then return false end
  local P = rc(K_PREV, 'SCARD')
  if not (P > 0 and S.joined_prev >= P) then
    if grace then return false end
    local waited = S.opened ~= '' and NOW - S.opened >= JOIN_TIMEOUT
    if R < H and not waited then return false end
  end
  form()
  return true
end
"""

# ARGV[5..]: replica id, Member as a JSON array [address, store_address, world_size, data].
JOIN_BODY = r"""
load_state(false)
local id = ARGV[5]
local why = gone_why(id)
if why then save(); return redis.error_reply('QGONE ' .. id .. ' ' .. why) end
rc(K_INFO, 'HSET', id, ARGV[6])
save()
return 1
"""

# ARGV[5..]: replica id, step, held quorum id, commit failures, shrink_only (0/1), token.
REQUEST_BODY = r"""
load_state(true)
local id, step, held = ARGV[5], ARGV[6], tonumber(ARGV[7])
local cf, shrink, tok = ARGV[8], ARGV[9], ARGV[10]
sweep()
local why = gone_why(id)
if why then save(); return redis.error_reply('QGONE ' .. id .. ' ' .. why) end
if rc(K_INFO, 'HEXISTS', id) == 0 then save(); return redis.error_reply('QJOIN ' .. id) end
-- A retry of a request whose round already formed: its answer waits in the list.
local waiting = rc(REPLY .. id, 'LRANGE', 0, -1)
for _, line in ipairs(waiting) do
  if string.sub(line, 1, #tok + 1) == tok .. ' ' then save(); return S.round - 1 end
end
-- The floor: no quorum id a live replica holds is ever handed out again.
if held > S.qid then  -- seq >= qid always: only an id above the state's can raise it
  if held > num(K_SEQ, 'value', rc(K_SEQ, 'GET') or 0) then rc(K_SEQ, 'SET', fmt(held)) end
  if held > S.held then set('held', held) end
end
rc(K_HB, 'ZADD', NOW, id)
if rc(K_REQ, 'HSET', id, step .. ' ' .. cf .. ' ' .. shrink .. ' ' .. tok) == 1 then
  rc(REPLY .. id, 'DEL')  -- answers to requests this replica gave up on
  if rc(K_PREV, 'SISMEMBER', id) == 1 then set('joined_prev', S.joined_prev + 1) end
end
if S.opened == '' then set('opened', NOW) end
local round = S.round
try_form()
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
if try_form() and result == 'pending' then result = standing() end
save()
local why = gone_why(id)
if why then return redis.error_reply('QGONE ' .. id .. ' ' .. why) end
return result
"""

# ARGV[5..]: replica ids. Returns the ids that are gone.
HEARTBEAT_BODY = r"""
load_state(true)
local dropped = sweep()
local live, gone = {}, {}
for i = 5, #ARGV do
  if gone_why(ARGV[i]) then gone[#gone + 1] = ARGV[i] else live[#live + 1] = ARGV[i] end
end
chunked(K_HB, 'ZADD', live, function(args, id) args[#args + 1] = NOW; args[#args + 1] = id end)
if dropped > 0 then try_form() end
save()
return gone
"""

# ARGV[5]: replica id.
LEAVE_BODY = r"""
load_state(true)
local id = ARGV[5]
local left = 0
if not gone_why(id) then drop(id, 'left'); left = 1 end
try_form()
save()
return left
"""
