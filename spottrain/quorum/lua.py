"""The Lua sources of the quorum's scripts; :mod:`.scripts` assembles and documents them.

Every script starts with ``PRELUDE`` (keys, config, the Redis clock, the state with its stall
guard, the heartbeat sweep and TRY-FORM's check from counters) and ends with its own body.
All reads and writes of a quorum key go through ``rc``, which turns a Redis error
(WRONGTYPE, not an integer) into an error reply ``QCORRUPT <key> <what>``: garbage in a key
is reported, never waited on. A write Redis refuses for a reason of its own (``READONLY``,
``OOM``, ``MISCONF``, ``NOREPLICAS``, ...) is passed on as Redis's own error reply: the keys
are fine, and the client rides it out (Redis refuses only a script's first write, so nothing
was written).

Cost: Redis runs the whole prelude on every call, and at 12,500 replicas one Redis core runs
12,500 REQUESTs a round, so the prelude defines only what the steady REQUEST needs; drops,
the real TRY-FORM, FORM and the roster are built by ``lib()`` only in a call that uses them.
The state keeps counts of ``req``, ``prev`` and ``hb`` (``nreq``, ``nprev``, ``nhb``) so a
REQUEST that cannot form a round knows it without a call; a round forms only after the real
counts (HLEN, SCARD, ZCOUNT) confirm it, and every real check writes the counts back.
"""

from __future__ import annotations

PRELUDE = r"""
-- One declared key, the prefix of all: every quorum key shares the run's hash tag (one slot),
-- and a request carries its name once instead of ten times.
local P = KEYS[1]
local K_STATE, K_PREV, K_REQ, K_HB = P .. 'state', P .. 'prev', P .. 'req', P .. 'hb'
local K_INFO, K_GONE, REPLY = P .. 'info', P .. 'gone', P .. 'reply:'
local K_RDIRECT, K_RRELAYS, RRELAY = P .. 'rdirect', P .. 'rrelays', P .. 'relayreply:'
local K_LASTREQ, K_RANKS = P .. 'lastreq', P .. 'ranks'
local HB_TIMEOUT, JOIN_TIMEOUT = tonumber(ARGV[1]), tonumber(ARGV[2])
local MIN_REPLICAS, EPOCH_NEW = tonumber(ARGV[3]), ARGV[4]
local CHUNK = 1000
local pcall_ = redis.pcall

-- Redis refusing a write is not the key's fault: its own reply goes back unwrapped.
local REFUSALS = ' NOREPLICAS READONLY OOM MISCONF BUSY LOADING '

local function corrupt(key, what)
  local code = string.match(what, '^(%u+) ')
  if code and string.find(REFUSALS, ' ' .. code .. ' ', 1, true) then error({err = what}) end
  error({err = 'QCORRUPT ' .. key .. ' ' .. what})
end

local function rc(key, cmd, ...)
  local r = pcall_(cmd, key, ...)
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

-- The state hash, cached for this call; save() writes back the fields a call changed. A
-- steady REQUEST reads only the HOT fields; lib() reads the COLD ones.
local S = {}
local DIRTY_FIELDS = {}
local HOT = {'round', 'qid', 'opened', 'joined_prev', 'active', 'grace_until', 'nreq', 'nprev',
  'nhb', 'steady', 'rstep', 'relayed'}
local COLD = {'epoch', 'version', 'max_step', 'formed', 'dirty', 'held', 'ranks_v', 'created'}

local function set(field, v) S[field] = v; DIRTY_FIELDS[field] = true end

local function save()
  local args = {}
  for field, _ in pairs(DIRTY_FIELDS) do
    args[#args + 1] = field
    args[#args + 1] = type(S[field]) == 'number' and fmt(S[field]) or S[field]
  end
  if #args > 0 then rc(K_STATE, 'HSET', unpack(args)) end
end

local function parse(fields)
  local v = rc(K_STATE, 'HMGET', unpack(fields))
  for i = 1, #fields do
    local f, x = fields[i], v[i]
    if f == 'epoch' then S[f] = x or ''
    else
      S[f] = tonumber(x or 0)
      if S[f] == nil then
        if f == 'opened' and x == '' then S[f] = '' else num(K_STATE, f, x) end
      end
    end
  end
  return v
end

local function in_grace() return NOW < S.grace_until end

-- steady (2: no request yet, 1: steady so far, 0: not) stays 1 while every request of the
-- round is a member's of the last quorum at the round's first step (rstep), with no commit
-- failure and no shrink_only: then the answers are the last quorum's and the steady FORM
-- gives them without reading a member's request.
local function note_steady(member, step, cf, shrink)
  if S.steady == 0 then return end
  if not member or cf ~= '0' or shrink ~= '0' then set('steady', 0)
  elseif S.steady == 2 then set('steady', 1); set('rstep', tonumber(step))
  elseif S.rstep ~= tonumber(step) then set('steady', 0) end
end

-- A relay batch's reply list outlives a relay that died (its members asked directly): a
-- minute, or ten heartbeat timeouts, after its last line.
local RELAY_TTL = math.max(60000, 10 * HB_TIMEOUT)

local function relay_push(rk, line)
  rc(RRELAY .. rk, 'LPUSH', line)
  rc(RRELAY .. rk, 'PEXPIRE', RELAY_TTL)
end

local L  -- the rest of the functions, built by lib() when a call needs them
local lib

-- lost: the caller knew a state, so finding none means Redis lost it (an empty restart):
-- grant a grace of one heartbeat timeout for the live replicas to heartbeat again before
-- anyone counts as unhealthy or a round forms on the slow path. JOIN and HEARTBEAT cannot
-- tell a loss from a new run (a replica may heartbeat before it joins): they pass false, and
-- a REQUEST that then finds its replica unjoined grants the grace (note_unjoined).
local function load_state(lost)
  local v, found = parse(HOT), false
  for i = 1, #HOT do found = found or v[i] ~= false end
  if not found then
    for _, f in ipairs(HOT) do set(f, 0) end
    for _, f in ipairs(COLD) do set(f, 0) end
    -- The epoch: the creation time and the creating client's random part, unique per state.
    set('epoch', string.format('%x', NOW) .. EPOCH_NEW)
    set('round', 1); set('opened', ''); set('active', NOW); set('created', NOW)
    if lost then set('grace_until', NOW + HB_TIMEOUT) end
    lib().recount()
    return
  end
  if not v[9] then lib().recount() end  -- a state written before the counts were kept
  -- STALL GUARD: a gap of over timeout/2 since the last call may mean Redis itself did not
  -- run (fork, pause, restart): drop nobody for a timeout. Replicas that call seldom make
  -- such gaps too, and a grace blocks the slow path (a first round among them): so once a
  -- call came in a grace, only a gap of a whole timeout starts the next one. The first call
  -- after a grace then sweeps and may form, for any caller that calls at least once a
  -- timeout (a waiter's first round comes at most a timeout and two of its calls after its
  -- request). The cost: a second stall of under a timeout right after a grace gets none
  -- (a replica heartbeating every timeout/5 is dropped only by one of 0.8-1 timeout).
  local gap, came_in_grace = NOW - S.active, S.active < S.grace_until
  if gap > HB_TIMEOUT or (gap > HB_TIMEOUT / 2 and not came_in_grace) then
    set('grace_until', NOW + HB_TIMEOUT)
  end
  set('active', NOW)
end

-- A replica asked although the state does not know it: its client joined it in a state Redis
-- has lost since. When a call that could not tell a loss (JOIN, HEARTBEAT) made this state,
-- grant the loss's grace now, up to a timeout after the state was made.
local function note_unjoined()
  local created = lib() and S.created
  if created > 0 and S.grace_until < created + HB_TIMEOUT and NOW < created + HB_TIMEOUT then
    set('grace_until', created + HB_TIMEOUT)
  end
end

-- Drop up to 64 replicas whose heartbeat expired (none during a grace): run by every call
-- that can see a replica, so a frozen one is gone before it can ask again. Returns how many
-- it dropped, and whether every heartbeat left in hb is live (then H = ZCARD hb = S.nhb).
local function sweep()
  if in_grace() then return 0, true end
  local expired = rc(K_HB, 'ZRANGEBYSCORE', '-inf', fmt(NOW - HB_TIMEOUT), 'LIMIT', 0, 64)
  if #expired > 0 then
    local drop = lib().drop
    for _, id in ipairs(expired) do drop(id, 'dropped') end
  end
  return #expired, #expired < 64
end

-- TRY-FORM's guards and paths on the counts (no call), valid after a complete sweep or in a
-- grace: true when no round can form now; false means "maybe": lib().try_form() decides.
local function cannot_form()
  local R, H, Pn = S.nreq, S.nhb, S.nprev
  if R < 1 or R < MIN_REPLICAS or 2 * R <= H then return true end
  if Pn > 0 and S.joined_prev >= Pn then return false end
  if in_grace() then return true end
  return R < H and not (S.opened ~= '' and NOW - S.opened >= JOIN_TIMEOUT)
end

lib = function()
  if L then return L end
  local K_SEQ, K_ROSTER, K_GONE_AT, K_SORT = P .. 'seq', P .. 'roster', P .. 'gone_at', P .. 'sort'
  local K_RLOG, K_RLOG_VS, K_PDROP = P .. 'rlog', P .. 'rlog_vs', P .. 'pdrop'
  local RLOG_KEEP, GONE_CAP = 64, 100000
  if S.epoch == nil then parse(COLD) end

  -- The counts cannot_form reads, from the keys themselves.
  local function recount()
    set('nreq', rc(K_REQ, 'HLEN')); set('nprev', rc(K_PREV, 'SCARD'))
    set('nhb', rc(K_HB, 'ZCARD'))
  end

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
    if had_req then set('nreq', S.nreq - 1) end
    if rc(K_PREV, 'SREM', id) == 1 then
      set('dirty', 1); set('nprev', S.nprev - 1)
      rc(K_PDROP, 'SADD', id)  -- still in the roster: the next change's delta removes it
      if had_req then set('joined_prev', S.joined_prev - 1) end
    end
    if had_req and rc(K_REQ, 'HLEN') == 0 then set('opened', '') end
    if rc(K_HB, 'ZREM', id) == 1 then set('nhb', S.nhb - 1) end
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

  -- The open round's requests: ids (sorted; only the members of prev if one asked
  -- shrink_only), id -> step, id -> token, the largest commit failures, the steps' range.
  -- In a steady round every value starts alike ("<step> <cf> 0 "): only its token is cut out.
  local function read_requests()
    local flat = rc(K_REQ, 'HGETALL')
    local ids, step_of, tok_of, cf_of, shrink = {}, {}, {}, {}, false
    local find, sub, match = string.find, string.sub, string.match
    local pre = flat[2] and match(flat[2], '^%-?%d+ %d+ 0 ')
    local pre_step, pre_cf, n_pre = nil, 0, pre and #pre or 0
    if pre then
      pre_step, pre_cf = match(pre, '^(%S+) (%S+)')
      pre_step, pre_cf = tonumber(pre_step), tonumber(pre_cf)
    end
    for i = 1, #flat, 2 do
      local id, v = flat[i], flat[i + 1]
      local same = pre and find(v, pre, 1, true) == 1 and #v > n_pre
      if same and not find(v, ' ', n_pre + 1, true) then
        step_of[id], tok_of[id] = pre_step, sub(v, n_pre + 1)
      else
        local step, cf, sh, tok = match(v, '^(%-?%d+) (%d+) ([01]) (%S+)$')
        if not step then corrupt(K_REQ, 'field ' .. id .. ' = ' .. v .. ', not a request') end
        step_of[id], cf_of[id], tok_of[id] = tonumber(step), tonumber(cf), tok
        if sh == '1' then shrink = true end
      end
      ids[#ids + 1] = id
    end
    if shrink then
      local kept = {}
      for _, id in ipairs(ids) do
        if rc(K_PREV, 'SISMEMBER', id) == 1 then kept[#kept + 1] = id end
      end
      if #kept > 0 then ids = kept end
    end
    local lo, hi, cf_max = nil, nil, 0
    for _, id in ipairs(ids) do
      local s, cf = step_of[id], cf_of[id] or pre_cf
      if lo == nil or s < lo then lo = s end
      if hi == nil or s > hi then hi = s end
      if cf > cf_max then cf_max = cf end
    end
    return sorted(ids), step_of, tok_of, cf_max, lo, hi
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
    set('version', version); set('dirty', 0); set('nprev', #ids)
  end

  local function next_qid(changed, cf_max)
    if not (changed or cf_max > 0 or S.qid == 0 or S.held > S.qid) then return end
    local seq = num(K_SEQ, 'value', rc(K_SEQ, 'GET') or 0)
    if seq < S.qid then rc(K_SEQ, 'SET', fmt(S.qid)) end
    set('qid', rc(K_SEQ, 'INCR'))
  end

  -- The healing source for group rank 0, as torchft's compute_quorum_results: the i-th
  -- replica behind max_step heals from the (i mod #up-to-date)-th replica at max_step.
  local function heal_sources(ids, step_of, max_step)
    local up, behind, heal, tail = {}, {}, {}, {}
    for r, id in ipairs(ids) do
      if step_of[id] == max_step then up[#up + 1] = r - 1
      else
        behind[#behind + 1] = r - 1
        tail[#tail + 1] = ' ' .. id .. '=' .. fmt(step_of[id])
      end
    end
    for i, rank in ipairs(behind) do heal[rank] = up[((i - 1) % #up) + 1] end
    return heal, table.concat(tail)
  end

  -- R, Pn: the real HLEN req and SCARD prev. The membership is unchanged when nothing was
  -- dropped from prev and every formed id is a member of prev (joined_prev counts them) and
  -- as many as prev holds: no per-member check.
  -- The ranks of the last quorum's members (for the steady FORM's direct waiters), rewritten
  -- when its membership changed.
  local function write_ranks(ids)
    rc(K_RANKS, 'DEL')
    for i = 1, #ids, CHUNK do
      local args = {}
      for r = i, math.min(i + CHUNK - 1, #ids) do
        args[#args + 1] = ids[r]; args[#args + 1] = r - 1
      end
      rc(K_RANKS, 'HSET', unpack(args))
    end
    set('ranks_v', S.version)
  end

  -- The round is over: the next one opens (left: requesters left out wait on in it).
  local function next_round(max_step, left, relayed)
    set('relayed', relayed and 1 or 0)
    set('round', S.round + 1); set('joined_prev', 0); set('held', 0)
    set('formed', NOW); set('max_step', max_step); set('nreq', left)
    set('opened', left > 0 and NOW or ''); set('steady', left > 0 and 0 or 2)
  end

  -- The formed round's requests stay as lastreq until the next FORM: a member whose relay
  -- died before passing its answer on finds it through them (REQUEST).
  local function keep_requests()
    rc(K_LASTREQ, 'UNLINK')
    rc(K_REQ, 'RENAME', K_LASTREQ)
    rc(K_RDIRECT, 'DEL'); rc(K_RRELAYS, 'DEL')
  end

  -- The answers go to each direct requester's own list ("<token> <line>") and, for the
  -- members a relay batch asked for (token "@<batch>"), one "F" element per batch holding
  -- "<id> <line>" lines.
  local function form(R, Pn)
    local ids, step_of, tok_of, cf_max, lo, max_step = read_requests()
    local n = #ids
    local changed = S.dirty == 1 or n ~= Pn or S.joined_prev ~= n
    next_qid(changed, cf_max)
    if changed then change_membership(ids, S.qid) end
    if S.ranks_v ~= S.version then write_ranks(ids) end
    local heal, behind = {}, ''
    if lo ~= max_step then heal, behind = heal_sources(ids, step_of, max_step) end
    local head = ' ' .. fmt(S.qid) .. ' '
    local mid = ' ' .. fmt(n) .. ' ' .. fmt(max_step) .. ' '
    local tail = ' ' .. fmt(S.version) .. ' ' .. fmt(cf_max) .. ' ' .. S.epoch .. behind
    local up_to_date = mid .. '-1' .. tail  -- most members: no healing source to format
    local batches, byte, sub = {}, string.byte, string.sub
    for r = 1, n do
      local id, h = ids[r], heal[r - 1]
      local tok, answer = tok_of[id], head .. (r - 1) .. (h and mid .. h .. tail or up_to_date)
      if byte(tok, 1) == 64 then  -- '@': asked through a relay batch
        local rk = sub(tok, 2)
        local lines = batches[rk]
        if not lines then lines = {'F ' .. fmt(S.round)}; batches[rk] = lines end
        lines[#lines + 1] = id .. answer
      else
        local x = pcall_('LPUSH', REPLY .. id, tok .. answer)
        if type(x) == 'table' and x.err then corrupt(REPLY .. id, x.err) end
      end
    end
    for rk, lines in pairs(batches) do relay_push(rk, table.concat(lines, '\n')) end
    if n == R then
      keep_requests()
    else
      rc(K_LASTREQ, 'UNLINK')
      chunked(K_REQ, 'HDEL', ids, add_one)
      chunked(K_RDIRECT, 'SREM', ids, add_one)
    end
    next_round(max_step, R - n, next(batches) ~= nil)
  end

  -- The steady FORM: the last quorum again, every member at the round's step, so every
  -- answer is known without reading the requests: one "S" line per relay batch of the round,
  -- and each direct requester's line from the ranks.
  local function steady_form(n)
    local head = ' ' .. fmt(S.qid) .. ' '
    local tail = ' ' .. fmt(n) .. ' ' .. fmt(S.rstep) .. ' -1 ' .. fmt(S.version) .. ' 0 ' ..
      S.epoch
    local direct = rc(K_RDIRECT, 'SMEMBERS')
    for i = 1, #direct, CHUNK do
      local chunk = {}
      for j = i, math.min(i + CHUNK - 1, #direct) do chunk[#chunk + 1] = direct[j] end
      local vs, ranks = rc(K_REQ, 'HMGET', unpack(chunk)), rc(K_RANKS, 'HMGET', unpack(chunk))
      for j, id in ipairs(chunk) do
        local tok = vs[j] and string.match(vs[j], ' (%S+)$')
        if tok and string.byte(tok, 1) ~= 64 then
          local rank = tonumber(ranks[j])
          if not rank then corrupt(K_RANKS, 'no rank for member ' .. id) end
          rc(REPLY .. id, 'LPUSH', tok .. head .. fmt(rank) .. tail)
        end
      end
    end
    local line = 'S ' .. fmt(S.round) .. head .. fmt(S.version) .. ' ' .. fmt(n) .. ' ' ..
      fmt(S.rstep) .. ' ' .. S.epoch
    local relays = rc(K_RRELAYS, 'SMEMBERS')
    for _, rk in ipairs(relays) do relay_push(rk, line) end
    keep_requests()
    next_round(S.rstep, 0, #relays > 0)
  end

  -- TRY-FORM on the real counts (and they are written back for cannot_form).
  local function try_form()
    local R, Pn, Z = rc(K_REQ, 'HLEN'), rc(K_PREV, 'SCARD'), rc(K_HB, 'ZCARD')
    if S.nreq ~= R then set('nreq', R) end
    if S.nprev ~= Pn then set('nprev', Pn) end
    if S.nhb ~= Z then set('nhb', Z) end
    if R == 0 then return false end
    local grace = in_grace()
    local H = Z
    if not grace then H = rc(K_HB, 'ZCOUNT', '(' .. fmt(NOW - HB_TIMEOUT), '+inf') end
    -- Guards: enough replicas, and more than half of the heartbeating ones (split brain).
    if R < MIN_REPLICAS or 2 * R <= H then return false end
    if not (Pn > 0 and S.joined_prev >= Pn) then
      if grace then return false end
      local waited = S.opened ~= '' and NOW - S.opened >= JOIN_TIMEOUT
      if R < H and not waited then return false end
    end
    -- Every member of the last quorum asked, nobody else, steadily (see note_steady), with
    -- no new quorum id due: the steady FORM gives the answers the full one would.
    if S.steady == 1 and S.dirty == 0 and R == Pn and S.joined_prev == Pn and S.qid > 0
      and S.held <= S.qid and S.ranks_v == S.version then
      steady_form(R)
    else
      form(R, Pn)
    end
    return true
  end

  -- The floor: no quorum id a live replica holds is ever handed out again.
  local function floor(held)
    if held > num(K_SEQ, 'value', rc(K_SEQ, 'GET') or 0) then rc(K_SEQ, 'SET', fmt(held)) end
    if held > S.held then set('held', held) end
  end

  L = {drop = drop, try_form = try_form, floor = floor, recount = recount}
  return L
end
"""
