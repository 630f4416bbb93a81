"""The Lua scripts of `Store`: each one is a step Redis runs atomically.

A script is used where a check and a write must not be split (a redelivered
or stale writer must find the task as the check saw it); MULTI/EXEC suffices
where nothing is read first. The scripts spell three task-hash fields
themselves: ``is_final``, ``status`` and ``attempt`` (`task_hash.IS_FINAL_FIELD`,
`STATUS_FIELD`, `ATTEMPT_FIELD`). The store assumes one Redis instance (no
cluster): scripts touch several keys.
"""

from __future__ import annotations

# KEYS[1] dedupe key, KEYS[2] intake stream.
# ARGV[1] dedupe TTL in ms; ARGV[2] the request's hash (`request_hash`);
# ARGV[3..] the task's field/value items.
# The dedupe key holds "<intake entry id> <request hash>" (a marker written
# before hashes existed holds the entry id alone: its hash is unknown, so any
# payload counts as the same request).
# Returns 1 (added), 0 (same id, same request: nothing written) or -1 (same id,
# another request: nothing written).
SUBMIT_LUA = """
local seen = redis.call('GET', KEYS[1])
if seen then
  local hash = string.match(seen, ' (%x+)$')
  if hash and hash ~= ARGV[2] then
    return -1
  end
  return 0
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('SET', KEYS[1], id .. ' ' .. ARGV[2], 'PX', ARGV[1])
return 1
"""

# KEYS[1] task state hash. ARGV: field/value items.
# Returns 1, or 0 when the task is already final (its state is then kept).
SET_STATE_LUA = """
if redis.call('HGET', KEYS[1], 'is_final') == '1' then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS[1] task state hash, KEYS[2] output stream.
# ARGV[1] output MAXLEN (approximate), ARGV[2] TTL in ms for both keys (0: none),
# ARGV[3] n = number of state items, ARGV[4 .. 3+n] state field/value items,
# ARGV[4+n ..] the final output message's field/value items.
# Returns the output entry id, or false when the task was already final.
FINISH_LUA = """
if redis.call('HGET', KEYS[1], 'is_final') == '1' then
  return false
end
local n = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 4, 3 + n))
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 4 + n))
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return id
"""

# KEYS[1] task state hash, KEYS[2] output stream. ARGV[1] TTL in ms.
# Expires both only when the task is final; returns 1 then, else 0.
EXPIRE_FINISHED_LUA = """
if redis.call('HGET', KEYS[1], 'is_final') ~= '1' then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# One executor iteration's token messages. Per message i: KEYS[2i-1] its task
# hash, KEYS[2i] its output stream. ARGV[1] output MAXLEN (approximate); then
# per message: the writer's attempt, the number n of field/value items, the n
# items. A message is appended only while its hash's attempt is unset or equal
# (read once per hash per call). Returns per message its entry id, or false
# when fenced (nothing written for it).
APPEND_FENCED_LUA = """
local written = {}
local held_of = {}
local at = 2
for i = 1, #KEYS / 2 do
  local hash = KEYS[2 * i - 1]
  local n = tonumber(ARGV[at + 1])
  local held = held_of[hash]
  if held == nil then
    held = redis.call('HGET', hash, 'attempt')
    held_of[hash] = held
  end
  if held == false or held == ARGV[at] then
    written[i] = redis.call('XADD', KEYS[2 * i], 'MAXLEN', '~', ARGV[1], '*',
                            unpack(ARGV, at + 2, at + 1 + n))
  else
    written[i] = false
  end
  at = at + 2 + n
end
return written
"""

# `FINISH_LUA`, fenced: ARGV[1] is the writer's attempt, ARGV[2..] are
# `FINISH_LUA`'s ARGV. Returns 1 (ended), 0 (already final) or -1 (fenced:
# the hash's attempt is set and differs); nothing is written unless 1.
FINISH_FENCED_LUA = """
local held = redis.call('HGET', KEYS[1], 'attempt')
if held and held ~= ARGV[1] then
  return -1
end
if redis.call('HGET', KEYS[1], 'is_final') == '1' then
  return 0
end
local n = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], unpack(ARGV, 5, 4 + n))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 5 + n))
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
"""

# KEYS[1] task hash, KEYS[2] output stream; ARGV[1] the attempt taken away.
# Makes it stale (attempt := ARGV[1] + 1) unless a newer placement already
# moved past it; a missing hash is not created. Then, in the same step, reads
# {is_final, status, output stream exists}: any output that exists was written
# before the fence, and none can follow from that attempt.
FENCE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local held = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
  local taken = tonumber(ARGV[1])
  if held <= taken then
    redis.call('HSET', KEYS[1], 'attempt', taken + 1)
  end
end
return {redis.call('HGET', KEYS[1], 'is_final') or '',
        redis.call('HGET', KEYS[1], 'status') or '',
        redis.call('EXISTS', KEYS[2])}
"""
