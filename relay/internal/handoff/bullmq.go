package handoff

// BullMQAdd is the name of the script's Lua op that adds one BullMQ job
// (bullmqLua): a target calls it with Unit.Call.
const BullMQAdd = "bullmq.add"

// bullmqLua is the Lua op bullmq.add of the push script (handoffScript,
// handoff.go): one job, as BullMQ 6.7.0's addStandardJob-9.lua,
// addPrioritizedJob-9.lua and addDelayedJob-6.lua add it (the parts of them
// a job without parent, repeat or deduplication runs), their includes
// copied: getOrSetMaxEvents, storeJob, isQueuePausedOrMaxed,
// addJobInTargetList and addBaseMarkerIfNeeded, addJobWithPriority and
// getPriorityScore, addDelayedJob, getDelayedScore, addDelayMarkerIfNeeded
// and getNextDelayedTimestamp. The op's guard has checked that the job key
// does not exist.
//
// KEYS: the job's hash, meta, id, events, marker, then for a standard job
// wait and active, for a prioritized one prioritized, active and pc, for a
// delayed one delayed. ARGV: the kind (wait, prioritized or delayed), the
// job id, name, data, opts (JSON), timestamp (ms), delay (ms), priority,
// and "1" for lifo.
//
// Before it writes, it checks the type of each key it writes (once per run
// of the script): BullMQ's scripts would stop halfway at a WRONGTYPE, and
// this one answers it, as the op's error reply, before any write, so that
// a job is either added whole or refused.
const bullmqLua = `
local bullmqChecked = {}
local function bullmqCheck(key, want)
  if bullmqChecked[key] then return nil end
  local t = redis.call('TYPE', key)
  t = t.ok or t
  if t ~= 'none' and t ~= want then
    return 'WRONGTYPE ' .. key .. ' holds a ' .. t .. ', where BullMQ keeps a ' .. want
  end
  if want == 'string' and t == 'string' and not tonumber(redis.call('GET', key)) then
    return 'WRONGTYPE ' .. key .. ' does not hold an integer, where BullMQ keeps a counter'
  end
  bullmqChecked[key] = true
  return nil
end
luaOps['bullmq.add'] = function(k, a) -- BullMQAdd
  local rcall = redis.call
  local jobKey, metaKey, idKey, eventsKey, markerKey = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local kind, jobId, name, data, opts = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local timestamp, delay, priority, lifo = ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8]
  local checks = {metaKey, 'hash', idKey, 'string', eventsKey, 'stream', markerKey, 'zset'}
  if kind == 'wait' then
    checks[9], checks[10], checks[11], checks[12] = KEYS[k + 5], 'list', KEYS[k + 6], 'list'
  elseif kind == 'prioritized' then
    checks[9], checks[10], checks[11], checks[12], checks[13], checks[14] = KEYS[k + 5], 'zset', KEYS[k + 6], 'list', KEYS[k + 7], 'string'
  else
    checks[9], checks[10] = KEYS[k + 5], 'zset'
  end
  for i = 1, #checks, 2 do
    local e = bullmqCheck(checks[i], checks[i + 1])
    if e then return redis.error_reply(e) end
  end
  local maxEvents = rcall('HGET', metaKey, 'opts.maxLenEvents')
  if maxEvents and not tonumber(maxEvents) then
    return redis.error_reply('ERR ' .. metaKey .. ' opts.maxLenEvents is not a number')
  end

  rcall('INCR', idKey)
  -- getOrSetMaxEvents
  if not maxEvents then
    maxEvents = 10000
    rcall('HSET', metaKey, 'opts.maxLenEvents', maxEvents)
  end
  -- storeJob
  rcall('HMSET', jobKey, 'name', name, 'data', data, 'opts', opts,
        'timestamp', timestamp, 'delay', delay, 'priority', priority)
  rcall('XADD', eventsKey, '*', 'event', 'added', 'jobId', jobId, 'name', name)

  if kind == 'delayed' then
    -- addDelayedJob, getDelayedScore
    local delayedKey = KEYS[k + 5]
    local delayedTimestamp = tonumber(timestamp) + tonumber(delay)
    local minScore = delayedTimestamp * 0x1000
    local maxScore = (delayedTimestamp + 1) * 0x1000 - 1
    local score = minScore
    local result = rcall('ZREVRANGEBYSCORE', delayedKey, maxScore, minScore, 'WITHSCORES', 'LIMIT', 0, 1)
    local currentMaxScore = tonumber(result[2])
    if currentMaxScore ~= nil then
      if currentMaxScore >= maxScore then score = maxScore else score = currentMaxScore + 1 end
    end
    rcall('ZADD', delayedKey, score, jobId)
    rcall('XADD', eventsKey, 'MAXLEN', '~', maxEvents, '*', 'event', 'delayed', 'jobId', jobId, 'delay', delayedTimestamp)
    -- addDelayMarkerIfNeeded, getNextDelayedTimestamp
    local first = rcall('ZRANGE', delayedKey, 0, 0, 'WITHSCORES')
    local nextTimestamp = tonumber(first[2])
    if nextTimestamp ~= nil then
      rcall('ZADD', markerKey, nextTimestamp / 0x1000, '1')
    end
    return jobId
  end

  -- isQueuePausedOrMaxed
  local activeKey = KEYS[k + 6]
  local isPausedOrMaxed = false
  local attributes = rcall('HMGET', metaKey, 'paused', 'concurrency')
  if attributes[1] then
    isPausedOrMaxed = true
  elseif attributes[2] then
    isPausedOrMaxed = rcall('LLEN', activeKey) >= tonumber(attributes[2])
  end
  if kind == 'prioritized' then
    -- addJobWithPriority, getPriorityScore
    local prioCounter = rcall('INCR', KEYS[k + 7])
    rcall('ZADD', KEYS[k + 5], tonumber(priority) * 0x100000000 + prioCounter % 0x100000000, jobId)
  else
    -- addJobInTargetList
    rcall(lifo == '1' and 'RPUSH' or 'LPUSH', KEYS[k + 5], jobId)
  end
  -- addBaseMarkerIfNeeded
  if not isPausedOrMaxed then
    rcall('ZADD', markerKey, 0, '0')
  end
  rcall('XADD', eventsKey, 'MAXLEN', '~', maxEvents, '*', 'event', 'waiting', 'jobId', jobId)
  return jobId
end
`
