"""Lua scripts of the shared index (`meta_redis.RedisMeta`): each index change is
one script, so it is atomic against every other kvstore replica on the same Redis.

Data model (P = the index prefix, default `kvmesh:kv`; KEYS are always, in order):

    KEYS[1] P:o     hash  block key -> record JSON (below)
    KEYS[2] P:la    hash  block key -> last access (float text); apart from the record so a
                          touch never rewrites it
    KEYS[3] P:runs  hash  run id -> run JSON {"g","s","f","a","d","cr"}
    KEYS[4] P:live  hash  run id -> blocks whose record points at the run, plus the
                          overwrites still pending in P:pend
    KEYS[5] P:dead  set   runs with no live block left (shards still to delete)
    KEYS[6] P:info  hash  created (index creation time), bytes (committed bytes)
    KEYS[7] P:pend  hash  run id -> {"cr": time, "b": [[key, committed record JSON, last access], ...]}:
                          blocks of a run being written that overwrite committed ones; they
                          become current only at commit (a crash loses nothing acknowledged;
                          GC drops entries older than the grace and the run goes dead)

A record JSON always starts with `{"c":0` or `{"c":1` (complete flag), so a commit is a
prefix rewrite; the generation `g` is text (63-bit: Lua numbers are doubles).
"""

from __future__ import annotations

_PRELUDE = """
local O, LA, R, LIVE, DEAD, INFO, PEND = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local function release(run)
  if run ~= '' then
    if redis.call('HINCRBY', LIVE, run, -1) <= 0 then redis.call('SADD', DEAD, run) end
  end
end
local function forget(key)
  local old = redis.call('HGET', O, key)
  if old then
    local r = cjson.decode(old)
    if r.c == 1 then redis.call('HINCRBY', INFO, 'bytes', -r.s) end
    release(r.r)
    redis.call('HDEL', O, key)
    redis.call('HDEL', LA, key)
  end
  return old
end
local function insert(key, json, la)
  forget(key)
  local r = cjson.decode(json)
  redis.call('HSET', O, key, json)
  redis.call('HSET', LA, key, la)
  if r.r ~= '' then
    redis.call('HINCRBY', LIVE, r.r, 1)
    redis.call('SREM', DEAD, r.r)
  end
  if r.c == 1 then redis.call('HINCRBY', INFO, 'bytes', r.s) end
end
local function commit(key, gen)
  local cur = redis.call('HGET', O, key)
  if not cur then return false end
  local r = cjson.decode(cur)
  if r.g ~= gen or r.c == 1 then return false end
  redis.call('HSET', O, key, '{"c":1' .. string.sub(cur, 7))
  redis.call('HINCRBY', INFO, 'bytes', r.s)
  return true
end
"""

# ARGV: key, record JSON, last access -> 1
INSERT = _PRELUDE + """
insert(ARGV[1], ARGV[2], ARGV[3])
return 1
"""

# ARGV: key, generation ('' = any) -> the removed record JSON, or false
REMOVE = _PRELUDE + """
local cur = redis.call('HGET', O, ARGV[1])
if not cur then return false end
if ARGV[2] ~= '' and cjson.decode(cur).g ~= ARGV[2] then return false end
return forget(ARGV[1])
"""

# ARGV: key, generation -> 1 if committed now
COMMIT_PUT = _PRELUDE + """
if commit(ARGV[1], ARGV[2]) then return 1 end
return 0
"""

# ARGV: run, run JSON, now, then (key, record JSON, committed record JSON)* -> pending keys.
# A block whose key holds a committed record is pending (P:pend) until COMMIT_RUN.
BEGIN_RUN = _PRELUDE + """
local run = ARGV[1]
redis.call('HSET', R, run, ARGV[2])
redis.call('HSETNX', LIVE, run, 0)
local pend, keys = {}, {}
for i = 4, #ARGV, 3 do
  local key = ARGV[i]
  local cur = redis.call('HGET', O, key)
  if cur and cjson.decode(cur).c == 1 then
    table.insert(pend, {key, ARGV[i + 2], ARGV[3]})
    table.insert(keys, key)
    redis.call('HINCRBY', LIVE, run, 1)
  else
    insert(key, ARGV[i + 1], ARGV[3])
  end
end
if #pend > 0 then redis.call('HSET', PEND, run, cjson.encode({cr = tonumber(ARGV[3]), b = pend})) end
return keys
"""

# ARGV: run, then (key, generation)* -> keys committed (new blocks, then overwrites)
COMMIT_RUN = _PRELUDE + """
local run, done = ARGV[1], {}
for i = 2, #ARGV, 2 do
  if commit(ARGV[i], ARGV[i + 1]) then table.insert(done, ARGV[i]) end
end
local pend = redis.call('HGET', PEND, run)
if pend then
  redis.call('HDEL', PEND, run)
  for _, b in ipairs(cjson.decode(pend).b) do
    release(run)
    insert(b[1], b[2], b[3])
    table.insert(done, b[1])
  end
end
return done
"""

# ARGV: run, then (key, generation)* -> 1. The run's shards did not land: its blocks go.
ABORT_RUN = _PRELUDE + """
local run = ARGV[1]
for i = 2, #ARGV, 2 do
  local cur = redis.call('HGET', O, ARGV[i])
  if cur and cjson.decode(cur).g == ARGV[i + 1] then forget(ARGV[i]) end
end
local pend = redis.call('HGET', PEND, run)
if pend then
  redis.call('HDEL', PEND, run)
  for _ in ipairs(cjson.decode(pend).b) do release(run) end
end
if tonumber(redis.call('HGET', LIVE, run) or '0') <= 0 then redis.call('SADD', DEAD, run) end
return 1
"""

# ARGV: run, run JSON -> 1 (reindex; an existing run row is kept as is)
ADD_RUN = _PRELUDE + """
redis.call('HSETNX', R, ARGV[1], ARGV[2])
redis.call('HSETNX', LIVE, ARGV[1], 0)
return 1
"""

# ARGV: run -> 1 if this call dropped the run (0: blocks left, or already dropped)
DROP_RUN = _PRELUDE + """
if tonumber(redis.call('HGET', LIVE, ARGV[1]) or '0') > 0 then return 0 end
redis.call('SREM', DEAD, ARGV[1])
redis.call('HDEL', LIVE, ARGV[1])
return redis.call('HDEL', R, ARGV[1])
"""

# ARGV: (key, last access)* -> how many moved forward (never back, never a removed key)
TOUCH = _PRELUDE + """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', O, ARGV[i]) == 1 then
    local old = tonumber(redis.call('HGET', LA, ARGV[i]) or '0')
    if tonumber(ARGV[i + 1]) > old then
      redis.call('HSET', LA, ARGV[i], ARGV[i + 1])
      n = n + 1
    end
  end
end
return n
"""

# ARGV: old run, new run, new run JSON, then (key, generation, new record JSON)* -> moved.
# Compaction: a block moves to the new run only if its record is still that generation,
# committed, in the old run (a delete or overwrite meanwhile wins); access time kept.
RELOCATE = _PRELUDE + """
local old, new, moved = ARGV[1], ARGV[2], 0
redis.call('HSET', R, new, ARGV[3])
redis.call('HSETNX', LIVE, new, 0)
for i = 4, #ARGV, 3 do
  local cur = redis.call('HGET', O, ARGV[i])
  if cur then
    local r = cjson.decode(cur)
    if r.g == ARGV[i + 1] and r.r == old and r.c == 1 then
      local la = redis.call('HGET', LA, ARGV[i]) or '0'
      insert(ARGV[i], ARGV[i + 2], la)
      moved = moved + 1
    end
  end
end
if moved == 0 then redis.call('SADD', DEAD, new) end
return moved
"""

# ARGV: (none) -> dead runs now: every run with no live block goes into P:dead (reindex)
FIND_DEAD = _PRELUDE + """
for _, run in ipairs(redis.call('HKEYS', R)) do
  if tonumber(redis.call('HGET', LIVE, run) or '0') <= 0 then redis.call('SADD', DEAD, run) end
end
return redis.call('SMEMBERS', DEAD)
"""

# ARGV: cutoff time -> pending overwrites dropped (their putter died before commit)
SWEEP_PENDING = _PRELUDE + """
local n = 0
for _, run in ipairs(redis.call('HKEYS', PEND)) do
  local p = cjson.decode(redis.call('HGET', PEND, run))
  if p.cr < tonumber(ARGV[1]) then
    redis.call('HDEL', PEND, run)
    for _ in ipairs(p.b) do release(run); n = n + 1 end
  end
end
return n
"""

# Leases (lease.py). KEYS[1] the lease key. ARGV: token, ttl ms -> 1 if held by token now
LEASE_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# ARGV: token -> 1 if released
LEASE_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
