"""Lua scripts: every directory operation is ONE script call, so one round trip.

Data model (P = config.key_prefix, e.g. "kvmesh:dir"; all times are Redis
server milliseconds from TIME, so several directory processes agree on "now"):

    P:lease:<engine>          HASH  addr epoch running waiting free_slots free_blocks hb_ms
                                    PEXPIRE lease_ttl; exists <=> the engine is live
    P:engines                 ZSET  engine -> lease deadline ms (ListEngines, sweeper index)
    P:epochs                  HASH  engine -> last lease epoch (grows on each new lease)
    P:snap:<key>              HASH  engine -> "epoch:position:size_bytes:expires_ms"
                                    PEXPIRE = longest entry in it
    P:held:<engine>:<epoch>   ZSET  key -> expires_ms (what one lease published)
                                    PEXPIRE = longest entry in it
    P:orphans                 SET   "<engine>:<epoch>" lease sets waiting to be purged

An entry is visible only while (a) it has not expired and (b) its engine has a
live lease with the SAME epoch. (b) hides a lapsed engine's entries at once,
even if it re-registers before the sweeper ran; the sweeper then deletes them.

Scripts build key names from P instead of declaring KEYS: fine on a standalone
Redis/Valkey (or a primary with replicas), not on Redis Cluster.
Returned integers are Redis integers; positions and sizes come back as strings
so uint64 values never pass through Lua doubles.
"""

# Shared prologue: server time in ms and the entry value parser.
_PRELUDE = """
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function parse(v)  -- -> epoch, position, size, expires_ms
  local e, pos, size, x = string.match(v, '^(%d+):(%d+):(%d+):(%d+)$')
  return e, pos, size, tonumber(x)
end
"""

# ARGV: P, engine, addr, lease_ms, restarted(0|1), running, waiting, free_slots, free_blocks
# -> {epoch, new_lease(0|1)}
HEARTBEAT = _PRELUDE + """
local eid, addr, lease_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])
local lease = P .. ':lease:' .. eid
local epoch = redis.call('HGET', lease, 'epoch')
local new = 0
if (not epoch) or ARGV[5] == '1' then
  -- A new lease: entries of the previous epoch become invisible now and are
  -- queued for the sweeper.
  local old = epoch or redis.call('HGET', P .. ':epochs', eid)
  epoch = tostring(redis.call('HINCRBY', P .. ':epochs', eid, 1))
  if old then redis.call('SADD', P .. ':orphans', eid .. ':' .. old) end
  new = 1
end
redis.call('HSET', lease, 'epoch', epoch, 'addr', addr, 'running', ARGV[6], 'waiting', ARGV[7],
           'free_slots', ARGV[8], 'free_blocks', ARGV[9], 'hb_ms', now)
redis.call('PEXPIRE', lease, lease_ms)
redis.call('ZADD', P .. ':engines', now + lease_ms, eid)
return {tonumber(epoch), new}
"""

# ARGV: P, engine, then (key, position, size, ttl_ms) * n
# -> {1, published} or {0, 0} when the engine has no live lease
PUBLISH = _PRELUDE + """
local eid = ARGV[2]
local epoch = redis.call('HGET', P .. ':lease:' .. eid, 'epoch')
if not epoch then return {0, 0} end
local held = P .. ':held:' .. eid .. ':' .. epoch
local n, longest = 0, 0
for i = 3, #ARGV, 4 do
  local key, ttl = ARGV[i], tonumber(ARGV[i + 3])
  local exp = now + ttl
  local snap = P .. ':snap:' .. key
  redis.call('HSET', snap, eid, epoch .. ':' .. ARGV[i + 1] .. ':' .. ARGV[i + 2] .. ':' .. exp)
  if redis.call('PTTL', snap) < ttl then redis.call('PEXPIRE', snap, ttl) end
  redis.call('ZADD', held, exp, key)
  if ttl > longest then longest = ttl end
  n = n + 1
end
if n > 0 and redis.call('PTTL', held) < longest then redis.call('PEXPIRE', held, longest) end
-- Amortised cleanup: drop a bounded number of this lease's expired entries, so
-- a long-lived engine's hashes do not accumulate dead fields.
local gone = redis.call('ZRANGEBYSCORE', held, '-inf', now, 'LIMIT', 0, 256)
for _, key in ipairs(gone) do
  local snap = P .. ':snap:' .. key
  local v = redis.call('HGET', snap, eid)
  if v then
    local e, _, _, x = parse(v)
    if e == epoch and x <= now then redis.call('HDEL', snap, eid) end
  end
  redis.call('ZREM', held, key)
end
return {1, n}
"""

# ARGV: P, engine, key * n  -> {1, withdrawn} or {0, 0} when not registered
WITHDRAW = _PRELUDE + """
local eid = ARGV[2]
local epoch = redis.call('HGET', P .. ':lease:' .. eid, 'epoch')
if not epoch then return {0, 0} end
local held = P .. ':held:' .. eid .. ':' .. epoch
local n = 0
for i = 3, #ARGV do
  local snap = P .. ':snap:' .. ARGV[i]
  local v = redis.call('HGET', snap, eid)
  if v then
    local e, _, _, x = parse(v)
    if e == epoch then
      redis.call('HDEL', snap, eid)
      if x > now then n = n + 1 end
    end
  end
  redis.call('ZREM', held, ARGV[i])
end
return {1, n}
"""

# ARGV: P, key * n -> JSON text: one array per key, flat (engine, addr, position, size, ttl_ms)
# per holder. One JSON string instead of a nested RESP reply: redis-py parses RESP
# in Python (~5 us per element), json.loads is C; 1,000 keys: ~26 -> ~9 ms on a 2-core box.
# cjson writes an empty table as {}, which the caller reads as "no holders".
LOOKUP = _PRELUDE + """
local leases = {}  -- engine -> {epoch, addr} or false; each lease read once per call
local out = {}
for i = 2, #ARGV do
  local flat = redis.call('HGETALL', P .. ':snap:' .. ARGV[i])
  local row = {}
  for j = 1, #flat, 2 do
    local eid = flat[j]
    local e, pos, size, x = parse(flat[j + 1])
    if x and x > now then
      local l = leases[eid]
      if l == nil then
        local h = redis.call('HMGET', P .. ':lease:' .. eid, 'epoch', 'addr')
        if h[1] then l = {h[1], h[2]} else l = false end
        leases[eid] = l
      end
      if l and l[1] == e then
        table.insert(row, eid); table.insert(row, l[2]); table.insert(row, pos)
        table.insert(row, size); table.insert(row, x - now)
      end
    end
  end
  out[#out + 1] = row
end
return cjson.encode(out)
"""

# ARGV: P -> per live engine:
# {engine, addr, epoch, running, waiting, free_slots, free_blocks, hb_age_ms, lease_left_ms, entries}
LIST_ENGINES = _PRELUDE + """
local out = {}
for _, eid in ipairs(redis.call('ZRANGEBYSCORE', P .. ':engines', '(' .. now, '+inf')) do
  local lease = P .. ':lease:' .. eid
  local h = redis.call('HMGET', lease, 'addr', 'epoch', 'running', 'waiting', 'free_slots',
                       'free_blocks', 'hb_ms')
  if h[1] then
    local held = P .. ':held:' .. eid .. ':' .. h[2]
    out[#out + 1] = {eid, h[1], h[2], h[3], h[4], h[5], h[6], now - tonumber(h[7]),
                     redis.call('PTTL', lease), redis.call('ZCOUNT', held, '(' .. now, '+inf')}
  end
end
return out
"""

# ARGV: P, budget -> {lapsed, purged, orphans_left}
# Bounded work per call (Redis runs scripts one at a time); the caller loops.
SWEEP = _PRELUDE + """
local budget = tonumber(ARGV[2])
local lapsed = 0
for _, eid in ipairs(redis.call('ZRANGEBYSCORE', P .. ':engines', '-inf', now, 'LIMIT', 0, 128)) do
  if redis.call('EXISTS', P .. ':lease:' .. eid) == 0 then
    local epoch = redis.call('HGET', P .. ':epochs', eid)
    if epoch then redis.call('SADD', P .. ':orphans', eid .. ':' .. epoch) end
    redis.call('ZREM', P .. ':engines', eid)
    lapsed = lapsed + 1
  end
end
local done = 0
for _, o in ipairs(redis.call('SRANDMEMBER', P .. ':orphans', 16)) do
  if done >= budget then break end
  local eid, epoch = string.match(o, '^(.+):(%d+)$')
  local held = P .. ':held:' .. o
  for _, key in ipairs(redis.call('ZRANGE', held, 0, budget - done - 1)) do
    local snap = P .. ':snap:' .. key
    local v = redis.call('HGET', snap, eid)
    if v and parse(v) == epoch then redis.call('HDEL', snap, eid) end
    redis.call('ZREM', held, key)
    done = done + 1
  end
  if redis.call('EXISTS', held) == 0 then redis.call('SREM', P .. ':orphans', o) end
end
return {lapsed, done, redis.call('SCARD', P .. ':orphans')}
"""
