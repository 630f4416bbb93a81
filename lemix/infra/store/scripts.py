"""The Lua scripts of `Store`: each one is a step Redis runs atomically.

A script is used where a check and a write must not be split (a redelivered
or stale writer must find the task as the check saw it); MULTI/EXEC suffices
where nothing is read first. The scripts spell three task-hash fields
themselves: ``is_final``, ``status`` and ``attempt`` (`task_hash.IS_FINAL_FIELD`,
`STATUS_FIELD`, `ATTEMPT_FIELD`). The store assumes one Redis instance (no
cluster): scripts touch several keys.
"""

from __future__ import annotations

# KEYS[1] dedupe key, KEYS[2] intake stream, KEYS[3] the task's hash.
# ARGV[1] dedupe TTL in ms; ARGV[2] the request's hash (`request_hash`);
# ARGV[3] k, the number of state items; ARGV[4 .. 3+k] the state items (what
# the scheduler's intake step used to write: status, the first placement's
# attempt number, queued_t); ARGV[4+k ..] the task's field/value items.
# The dedupe key holds "- <request hash>" (markers written before this script
# hold "<intake entry id> <request hash>", or, before hashes existed, the
# entry id alone: its hash is unknown, so any payload counts as the same
# request). It is taken first (SET NX: one command for a new id, where a
# GET and a SET were two). Then the task's hash gets its fields and state
# (the task exists, queued, from this step on), and the intake entry says
# whether that hash was the task's own: `INTAKE_STATE_FIELD` "1" when every
# field written was new (HSET's reply; no extra command), "0" when the hash
# held some of them already (a finished task of an expired id): then the
# scheduler checks the task as it did before (`ACCEPT_LUA`). A cancel
# marker alone leaves it "1" (its field is not one of these): the scheduler
# that wrote it remembers to check (`services.scheduler.intake`). If the
# XADD fails, the marker is deleted again, and a hash this call made, so a
# refused Submit leaves neither a marker nor a task without its entry.
# Returns 1 (added), 0 (same id, same request: nothing written) or -1 (same id,
# another request: nothing written).
SUBMIT_LUA = """
if redis.call('SET', KEYS[1], '- ' .. ARGV[2], 'NX', 'PX', ARGV[1]) then
  local k = tonumber(ARGV[3])
  local num_new = redis.call('HSET', KEYS[3], unpack(ARGV, 4))
  local is_own = num_new * 2 == #ARGV - 3
  local items = {unpack(ARGV, 4 + k)}
  items[#items + 1] = 'intake_state'
  items[#items + 1] = is_own and '1' or '0'
  local added = redis.pcall('XADD', KEYS[2], '*', unpack(items))
  if type(added) == 'table' and added.err then
    redis.call('DEL', KEYS[1])
    if is_own then
      redis.call('DEL', KEYS[3])
    end
    return added
  end
  return 1
end
local seen = redis.call('GET', KEYS[1])
local hash = seen and string.match(seen, ' (%x+)$')
if hash and hash ~= ARGV[2] then
  return -1
end
return 0
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

# SET_STATE_LUA for a batch, in one call: KEYS the tasks' hashes; ARGV[1 ..
# m] the number of items of each task (m = #KEYS), then the items, task after
# task. Returns per task 1, or 0 when it was final (kept).
SET_STATES_LUA = """
local m = #KEYS
local at = m + 1
local out = {}
for i = 1, m do
  local n = tonumber(ARGV[i])
  if redis.call('HGET', KEYS[i], 'is_final') == '1' then
    out[i] = 0
  else
    redis.call('HSET', KEYS[i], unpack(ARGV, at, at + n - 1))
    out[i] = 1
  end
  at = at + n
end
return out
"""

# KEYS[1] task state hash, KEYS[2] output stream.
# ARGV[1] output MAXLEN (approximate), ARGV[2] TTL in ms of the hash and
# ARGV[3] of the output stream (0: none), ARGV[4] n = number of state items,
# ARGV[5 .. 4+n] state field/value items, ARGV[5+n ..] the final output
# message's field/value items.
# Returns the output entry id, or false when the task was already final.
FINISH_LUA = """
if redis.call('HGET', KEYS[1], 'is_final') == '1' then
  return false
end
local n = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], unpack(ARGV, 5, 4 + n))
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 5 + n))
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
elseif redis.call('HEXISTS', KEYS[1], 'cancelled') == 1 then
  -- kept forever: not with the TTL its cancel marker gave it (MARK_CANCELLED_LUA)
  redis.call('PERSIST', KEYS[1])
end
ttl = tonumber(ARGV[3])
if ttl > 0 then
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

# `FINISH_LUA`, fenced: ARGV[1] is the writer's attempt, ARGV[2] output
# MAXLEN, ARGV[3] TTL in ms for both keys (0: none), ARGV[4] n, then the n
# state items and the message items. Returns 1 (ended), 0 (already final) or
# -1 (fenced: the hash's attempt is set and differs); nothing is written
# unless 1.
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

# One executor flush (`FencingOps.write_node_batch`) in one step: the
# placements it records, its token messages, then its task ends and each
# end's completion entry. KEYS[1] completions stream; then per placement its
# task hash; then per token message its task hash and output stream; then
# the same pair per end. ARGV[1] output MAXLEN (approximate), ARGV[2] number
# of placements, ARGV[3] number of token messages; then per placement: the
# writer's attempt, n, n field/value items (the placed state), written only
# while the hash's attempt equals the writer's and the task is not final (a
# missing hash is not created); per token message: the writer's attempt, n,
# n field/value items (as APPEND_FENCED_LUA); then per end: kind ("finish":
# FINISH_FENCED_LUA's end; "report": the completion alone, e.g. requeued
# training; "fenced": known fenced, nothing but the completion), the
# writer's attempt, TTL in ms (0: none), ns + ns state items, nm + nm
# end-message items, nc + nc completion items. Counters are the writer's to
# keep (the outcomes say what to count). Returns per placement 1 (written),
# 0 (final, or no hash) or -1 (fenced); per token message 1 (written) or 0
# (fenced); then per end 1 (ended, or reported), 0 (already final) or -1
# (fenced).
WRITE_NODE_BATCH_LUA = """
local out = {}
-- Per task hash, {attempt, is_final} read once (one HMGET): tokens change
-- neither; an end written here marks it final for a later end of the batch.
local state_of = {}
local function state(hash)
  local held = state_of[hash]
  if held == nil then
    held = redis.call('HMGET', hash, 'attempt', 'is_final')
    state_of[hash] = held
  end
  return held
end
local function attempt(hash)
  return state(hash)[1]
end
local num_places = tonumber(ARGV[2])
local num_tokens = tonumber(ARGV[3])
local at = 4
local k = 2
for i = 1, num_places do
  local held = state(KEYS[k])
  local n = tonumber(ARGV[at + 1])
  if held[1] == false or held[2] == '1' then
    out[#out + 1] = 0
  elseif held[1] ~= ARGV[at] then
    out[#out + 1] = -1
  else
    redis.call('HSET', KEYS[k], unpack(ARGV, at + 2, at + 1 + n))
    out[#out + 1] = 1
  end
  at = at + 2 + n
  k = k + 1
end
for i = 1, num_tokens do
  local held = attempt(KEYS[k])
  local n = tonumber(ARGV[at + 1])
  if held == false or held == ARGV[at] then
    redis.call('XADD', KEYS[k + 1], 'MAXLEN', '~', ARGV[1], '*',
               unpack(ARGV, at + 2, at + 1 + n))
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  at = at + 2 + n
  k = k + 2
end
while at <= #ARGV do
  local kind, writer, ttl = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  local ns = tonumber(ARGV[at + 3])
  local state_at = at + 4
  local nm = tonumber(ARGV[state_at + ns])
  local message_at = state_at + ns + 1
  local nc = tonumber(ARGV[message_at + nm])
  local completion_at = message_at + nm + 1
  local outcome = 1
  if kind == 'fenced' then
    outcome = -1
  elseif kind == 'finish' then
    local held = attempt(KEYS[k])
    if held and held ~= writer then
      outcome = -1
    elseif state(KEYS[k])[2] == '1' then
      outcome = 0
    else
      redis.call('HSET', KEYS[k], unpack(ARGV, state_at, state_at + ns - 1))
      state(KEYS[k])[2] = '1'
      redis.call('XADD', KEYS[k + 1], 'MAXLEN', '~', ARGV[1], '*',
                 unpack(ARGV, message_at, message_at + nm - 1))
      if ttl > 0 then
        redis.call('PEXPIRE', KEYS[k], ttl)
        redis.call('PEXPIRE', KEYS[k + 1], ttl)
      end
    end
  end
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, completion_at, completion_at + nc - 1))
  out[#out + 1] = outcome
  at = completion_at + nc
  k = k + 2
end
return out
"""

# KEYS[1] a task's hash. ARGV[1] TTL in ms. Cancel before placement: the
# hash gets ``cancelled=1``; one the call creates (the task is not taken yet,
# and may never come) expires after the TTL. Returns 1 when the hash existed.
MARK_CANCELLED_LUA = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('HSET', KEYS[1], 'cancelled', '1')
if existed == 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return existed
"""

# The scheduler's intake step for a batch of tasks: per task its checks and,
# when it is to be taken, its state, in one step (one EVALSHA per batch: a
# script call per task cost a command per task). Per task i (0-based):
# KEYS[2i+1] its hash, KEYS[2i+2] the lease of its gateway, or its hash
# again when it names no gateway (no lease then). A lease is read once per
# call (tasks of one gateway share it). ARGV[1] = m, the number of tasks;
# ARGV[2 .. 1+m] the number of state items of each; then the items, task
# after task. One HMGET per task reads whether it is final, its attempt and
# its cancel marker (MARK_CANCELLED_LUA); the items are written (merged)
# only when the task is neither final nor cancelled, together with the
# number of its next placement (`attempt` + 1, in the same HSET: what the
# scheduler's HINCRBY before its first Dispatch did, one command less).
# Returns {is final, is cancelled, has a lease} as 1/0 and the attempt
# numbered (0: none), per task, flattened.
ACCEPT_LUA = """
local m = tonumber(ARGV[1])
local at = 2 + m
local out = {}
local lease_of = {}
for i = 0, m - 1 do
  local n = tonumber(ARGV[2 + i])
  local hash = KEYS[2 * i + 1]
  local held = redis.call('HMGET', hash, 'is_final', 'attempt', 'cancelled')
  local is_final = held[1] == '1'
  local is_cancelled = held[3] == '1'
  local attempt = 0
  if not is_final and not is_cancelled then
    attempt = tonumber(held[2] or '0') + 1
    local items = {unpack(ARGV, at, at + n - 1)}
    items[#items + 1] = 'attempt'
    items[#items + 1] = tostring(attempt)
    redis.call('HSET', hash, unpack(items))
  end
  at = at + n
  out[#out + 1] = is_final and 1 or 0
  out[#out + 1] = is_cancelled and 1 or 0
  local lease = KEYS[2 * i + 2]
  if lease == hash then
    out[#out + 1] = 0
  else
    if lease_of[lease] == nil then
      lease_of[lease] = redis.call('EXISTS', lease)
    end
    out[#out + 1] = lease_of[lease]
  end
  out[#out + 1] = attempt
end
return out
"""
