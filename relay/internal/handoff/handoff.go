package handoff

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The handoff: every batch reaches Redis in one Lua script that the relay
// owns, whatever the target. In one atomic step the script
//
//  1. checks the fence: the token of this leadership must be the one in the
//     fence hash, or the script refuses the whole batch (FENCED) and the
//     relay steps down;
//  2. deletes the records of earlier batches whose delete has committed;
//  3. runs the target's commands (an op per queue: LPUSH, ZADD, ...; or a
//     target's own Lua op, as BullMQ's add, whose writes depend on what the
//     queue's keys hold: see handoffScript), each op on its own, so that a
//     WRONGTYPE on one queue's key refuses only that queue's jobs;
//  4. records, in the record hash under a field of its own, the ids of the
//     rows whose op succeeded (the field is written even when none did).
//
// The step is safe to run twice: a copy that finds its batch's field in the
// record runs nothing and answers what the first copy delivered. go-redis
// resends a command after a read timeout (MaxRetries), and a resent copy
// would otherwise push the batch again. stagedrain run turns those
// retries off as well (MaxRetries -1; a cluster client's MaxRedirects -1).
// A push whose reply never came (a timeout, a lost connection) is settled
// from the record under a new token: the next push takes the fence again
// first, so a copy still on its way is refused, and the record read after
// holds whatever an earlier copy delivered.
//
// A record field is deleted only once the delete it covers is durable, on
// this PostgreSQL and on the standbys that could be promoted. The drain
// commits with synchronous_commit = off, so a COMMIT can return before its
// WAL is flushed; the relay notes the WAL insert position after each commit
// and deletes the field once pg_current_wal_flush_lsn() and the standbys'
// flush positions have passed it (standby.go; where those cannot be read,
// also not before Config.StandbyRetention has passed). A PostgreSQL crash
// that undoes a delete, or a failover to a standby that never got it, thus
// finds its rows still recorded, and they are deleted, not pushed again.
//
// The fence names PostgreSQL's system_identifier: a relay of another
// PostgreSQL cluster whose database and schema names match refuses to take
// it (ErrForeign) rather than read the other's record.
//
// A relay that pushed a batch and died, or lost PostgreSQL, before the
// batch's delete committed leaves those rows staged, and their ids recorded.
// The next leader (or the same relay, after a failed batch) loads the
// record before it pushes, and deletes such rows without pushing them again.
// The record of a batch is deleted once its delete commits, so the record
// hash holds the batches in flight, not every batch ever pushed.
//
// Each leadership sets a new random token in the fence hash when it first
// pushes (acquire), after PostgreSQL granted it the leader lock. A relay
// that lost the lock without noticing (frozen, cut off) still holds the old
// token: its pushes are refused, and its rows stay staged for the leader.
//
// On a Redis Cluster, a script runs on one hash slot: the push is one such
// step per slot, each with a fence and a record of that slot (cluster.go).

// handoffScript is the atomic push step.
//
// KEYS[1] the fence hash, KEYS[2] the record hash, then the keys of the ops'
// commands, in order. ARGV[1] the token, ARGV[2] this batch's record field,
// ARGV[3] how many record fields to delete, then those fields; then for
// each op: its number of guard keys (the op's first keys, which no command
// uses: if any of them exists, the op is skipped and counts as done, as
// when a key's existence means the op ran before), its number of commands,
// the ids it delivers as comma-separated text ("" for bookkeeping), then
// for each command: its name, its number of keys, its number of arguments,
// and the arguments.
//
// The guard count may instead be the text "<guards> <cmd> <limit>"
// (backpressure, see backpressure.go): the keys after the guard keys are
// then a length guard, whose length cmd measures; it must be below limit
// for the op to run. cmd is LLEN, ZCARD, XLEN, or XUNACKED with one key,
// or a sum with one key per term, "LLEN+LLEN+ZCARD", whose length is the
// sum of the terms (a BullMQ queue's waiting jobs are in its wait and
// paused lists and its prioritized set, target/bullmq.go; a Celery queue's in its
// list and its priority lists, target/celery.go). An op it stops runs nothing and
// delivers nothing. XUNACKED, for a stream, is what its slowest consumer
// group has not acknowledged (see unacked below): the first op of a run to
// a stream measures it, and each op that runs counts one entry more (each
// such op adds one entry); it is never a term of a sum.
//
// A command's name may be that of a Lua op instead (luaOps: a target's
// own Lua, such as bullmq.add, target/bullmq.go): it is called with the indexes of
// its keys in KEYS and its arguments in ARGV, and answers as a command
// does, an error reply ({err = ...}) included; a Lua error it raises is
// caught and is the op's error reply. A target needs one where what it
// writes depends on what Redis holds, as BullMQ's own add scripts read the
// queue's meta hash (paused, concurrency, the events stream's length) and
// the delayed and priority sets before they write.
//
// It answers two elements per op: 1 and the last command's reply when the
// op ran, 2 and the guard key that existed when a guard skipped it, 3 and
// the length when a length guard stopped it (for XUNACKED, a pair: the
// count and the slowest group, "" for none), 0 and the error reply of the
// Command that failed (the op's later commands are not run). When the
// record holds this batch's field already, it runs no op and answers two
// elements: -1 and the field's value (the ids the first run delivered).
var handoffScript = redis.NewScript(`
local luaOps = {} -- name -> function(k, a): a target's Lua op (see above)
` + bullmqLua + `
-- unacked is how many entries of the stream key its slowest consumer group
-- has not acknowledged, and that group's name: the most, over the groups
-- (XINFO GROUPS, Redis 7.0+), of pending (read, not acknowledged) plus lag
-- (not yet read). Entries a group has acknowledged stay in the stream, so
-- XLEN would never fall. A lag Redis cannot tell (nil: entries deleted
-- after the group's last-delivered-id) is counted by XRANGE after that id,
-- up to limit. With no group, or when XINFO fails, every entry counts
-- (XLEN; no stream: 0, another type: the op's own command fails).
local function unacked(key, limit)
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if groups.err or #groups == 0 then
    local n = redis.pcall('XLEN', key)
    if type(n) ~= 'number' then n = 0 end
    return n, ''
  end
  local most, slowest = -1, ''
  for _, g in ipairs(groups) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    local n = f['pending']
    if type(f['lag']) == 'number' then
      n = n + f['lag']
    elseif n < limit then
      n = n + #redis.call('XRANGE', key, '(' .. f['last-delivered-id'], '+', 'COUNT', limit - n)
    end
    if n > most then most, slowest = n, f['name'] end
    if most >= limit then break end
  end
  return most, slowest
end
local token = redis.call('HGET', KEYS[1], 'token')
if not token then
  return redis.error_reply('FENCED the fence is gone (Redis lost its data, or the key was deleted): this relay must take it again as leader')
end
if token ~= ARGV[1] then
  return redis.error_reply('FENCED this relay is no longer the leader: another relay took the fence')
end
local a = 4
local nclear = tonumber(ARGV[3])
for i = 0, nclear - 1, 500 do
  redis.call('HDEL', KEYS[2], unpack(ARGV, a + i, a + math.min(i + 499, nclear - 1)))
end
a = a + nclear
local prior = redis.call('HGET', KEYS[2], ARGV[2])
if prior then
  -- This push ran already (a client resent it after a timeout, or a
  -- delayed copy arrived): run nothing, and answer what the first run
  -- delivered. Writing the field again makes a WAIT after this call cover
  -- the first run's writes too.
  redis.call('HSET', KEYS[2], ARGV[2], prior)
  return {-1, prior}
end
local k = 3
local out = {}
local done = {}
local counted = {} -- XUNACKED: stream key -> {count, slowest group}
while a <= #ARGV do
  local guard, ncmds, ids = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2]
  local lencmd, limit
  if not guard then
    -- "<guards> <cmd> <limit>": a length guard follows the guard keys
    -- (backpressure); cmd may be a sum, "LLEN+LLEN+ZCARD".
    local g, c, l = string.match(ARGV[a], '^(%d+) ([%u+]+) (%d+)$')
    guard, lencmd, limit = tonumber(g), c, tonumber(l)
  end
  a = a + 3
  local status, reply = 1, ''
  for g = 1, guard do
    if status == 1 and redis.call('EXISTS', KEYS[k]) == 1 then status, reply = 2, KEYS[k] end
    k = k + 1
  end
  local unackedOf
  if lencmd then
    if lencmd == 'XUNACKED' then
      if status == 1 then
        unackedOf = counted[KEYS[k]]
        if not unackedOf then
          unackedOf = {unacked(KEYS[k], limit)}
          counted[KEYS[k]] = unackedOf
        end
        if unackedOf[1] >= limit then status, reply = 3, unackedOf end
      end
      k = k + 1
    else
      -- A key of another type fails the op's own command (WRONGTYPE). A
      -- sum has a key per term.
      local n = 0
      for c in string.gmatch(lencmd, '%u+') do
        if status == 1 then
          local m = redis.pcall(c, KEYS[k])
          if type(m) == 'number' then n = n + m end
        end
        k = k + 1
      end
      if status == 1 and n >= limit then status, reply = 3, n end
    end
  end
  for c = 1, ncmds do
    local name, nkeys, nargs = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    a = a + 3
    if status == 1 then
      local r
      local op = luaOps[name]
      if op then
        local ok, res = pcall(op, k, a)
        if ok then
          r = res
        else
          r = {err = type(res) == 'table' and res.err or tostring(res)}
        end
      elseif nkeys == 1 then
        -- The common case, without copying the arguments into a table.
        r = redis.pcall(name, KEYS[k], unpack(ARGV, a, a + nargs - 1))
      else
        local args = {}
        for i = 1, nkeys do args[i] = KEYS[k + i - 1] end
        for i = 1, nargs do args[nkeys + i] = ARGV[a + i - 1] end
        r = redis.pcall(name, unpack(args))
      end
      if type(r) == 'table' and r.err then
        status, reply = 0, r.err
      elseif r == false or type(r) == 'table' then
        reply = ''
      else
        reply = r
      end
    end
    k = k + nkeys
    a = a + nargs
  end
  if status == 1 and unackedOf then unackedOf[1] = unackedOf[1] + 1 end
  if (status == 1 or status == 2) and ids ~= '' then done[#done + 1] = ids end
  out[#out + 1] = status
  out[#out + 1] = reply
end
-- Always, even when nothing was delivered: a second run of this push must
-- find the field.
redis.call('HSET', KEYS[2], ARGV[2], table.concat(done, ','))
return out
`)

// acquireScript starts a leadership: a new epoch and token in the fence
// hash. KEYS[1] the fence hash; ARGV the token, the holder, the time, the
// PostgreSQL system_identifier. A fence of another PostgreSQL cluster is
// refused (FOREIGN).
var acquireScript = redis.NewScript(foreignCheck + `
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'holder', ARGV[2], 'since', ARGV[3], 'system', ARGV[4])
return epoch
`)

// foreignCheck starts the acquire scripts: it refuses a fence hash
// (KEYS[1]) whose system_identifier is not ARGV[4].
const foreignCheck = `
local system = redis.call('HGET', KEYS[1], 'system')
if system and system ~= ARGV[4] then
  return redis.error_reply('FOREIGN the fence ' .. KEYS[1] .. ' belongs to the PostgreSQL cluster with system_identifier ' .. system .. ', not this one (' .. ARGV[4] .. '): two deployments share this Redis with the same database and schema names; give one of them its own --redis-namespace or Redis DB')
end
`

// maxCommandArgs is the most arguments one command of the script takes: Lua
// 5.1's unpack fails past about 8,000. variadic splits longer ones.
const maxCommandArgs = 1000

// dropScript deletes a fence hash and its record hash while the fence
// holds this leadership's token: KEYS[1] the fence, KEYS[2] (if given) the
// record, ARGV[1] the token. It answers 1 when it deleted them, else 0.
var dropScript = redis.NewScript(`
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
redis.call('DEL', unpack(KEYS))
return 1
`)

// ErrFenced is returned by a push that the fence refused: another relay
// leads now. The relay steps down.
var ErrFenced = errors.New("fenced off")

// ErrForeign is returned by a push whose fence belongs to another
// PostgreSQL cluster (relay.ErrForeignFence).
var ErrForeign = errors.New("the Redis fence belongs to another PostgreSQL cluster")

// Handoff runs the atomic push step and keeps what the relay knows of the
// record. It is used by the drain goroutine only.
type Handoff struct {
	rdb  redis.UniversalClient
	keys Keys

	token string // this leadership's fence token; "" until acquired
	// System is PostgreSQL's system_identifier, written into the fence
	// (ErrForeign). Set it before the first push.
	System string
	epoch  int64
	seq    int64 // batches pushed in this leadership, for record fields

	// delivered maps the id of a row that a push delivered, and whose
	// delete is not known to have committed, to its record field. Such a
	// row, claimed again, is deleted and not pushed.
	delivered map[int64]string
	// fields counts the ids in delivered by record field.
	fields map[string]int
	// clear lists record fields that may be deleted: their batches'
	// deletes committed. The next push deletes them.
	clear []string
	// unflushed holds record fields (or, on a cluster, slotRefs) that
	// clear will get once the WAL is flushed past lsn: the deletes they
	// cover committed, perhaps asynchronously.
	unflushed []walWait
	// Hold, when positive, keeps a field in unflushed at least this long
	// after its delete committed: the standbys' positions could not be
	// read (Config.StandbyRetention; standby.go).
	Hold time.Duration
	// reload says that the record in Redis may hold batches this relay
	// does not know of (a new leadership, a push whose reply was lost): it
	// is read before the next push.
	reload bool

	unit   Unit
	header []any

	// waitReplicas > 0: each push is followed, on its connection, by WAIT
	// for that many replicas within waitTimeout (Config.RedisWaitReplicas).
	waitReplicas int
	waitTimeout  time.Duration

	// On a Redis Cluster (cluster.go): the slots whose fence this
	// leadership holds and whose record it has read, the slots each pushed
	// record field is in, and the slot each id of the last push went to.
	// delivered, fields and clear then hold slotRefs, not fields.
	cluster bool
	claimed map[int]bool
	parts   map[string][]int
	idSlot  map[int64]int
}

// New returns a handoff through rdb (a *redis.ClusterClient: one fence and
// record per slot, cluster.go) under keys.
func New(rdb redis.UniversalClient, keys Keys) *Handoff {
	h := &Handoff{rdb: rdb, keys: keys, delivered: make(map[int64]string), fields: make(map[string]int)}
	if _, ok := rdb.(*redis.ClusterClient); ok {
		h.cluster = true
		h.claimed, h.parts, h.idSlot = make(map[int]bool), make(map[string][]int), make(map[int64]int)
	}
	return h
}

// Unit is the unit that targets build each batch into: the handoff reuses
// its buffers from batch to batch.
func (h *Handoff) Unit() *Unit { return &h.unit }

// Cluster reports whether the handoff runs on a Redis Cluster: a push then
// claims its slots (Claim) before it runs.
func (h *Handoff) Cluster() bool { return h.cluster }

// Delivering reports whether some rows were delivered by a push whose
// delete is not known to have committed (WasDelivered).
func (h *Handoff) Delivering() bool { return len(h.delivered) > 0 }

// WaitFor makes each push wait for n replicas (none when n is 0).
func (h *Handoff) WaitFor(n int, timeout time.Duration) *Handoff {
	h.waitReplicas, h.waitTimeout = n, timeout
	return h
}

// MustRun reports whether a push that runs no op must still run the
// script: with WAIT, a batch of rows an earlier push delivered deletes
// them only once the replicas have that push. The script's write of its
// record field comes after the earlier push's writes in the replication
// stream, so WAIT covers them too.
func (h *Handoff) MustRun(redelivered int) bool {
	return h.waitReplicas > 0 && redelivered > 0
}

// Reset forgets the leadership: the next push acquires a new one, after
// reading the record.
func (h *Handoff) Reset() {
	h.token, h.epoch, h.seq = "", 0, 0
	h.reload = true
	clear(h.claimed)
}

// acquire takes the fence for a new leadership, then reads the record (the
// order matters: a push of the last leader is either in the record read
// after, or refused). holder names this relay in the fence hash.
func (h *Handoff) acquire(ctx context.Context, holder string) error {
	if h.cluster {
		return h.acquireCluster(ctx, holder)
	}
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	token := hex.EncodeToString(raw[:])
	epoch, err := acquireScript.Run(ctx, h.rdb, []string{h.keys.Fence},
		token, holder, time.Now().UTC().Format(time.RFC3339), h.System).Int64()
	if err != nil {
		return fenceError(err)
	}
	h.token, h.epoch, h.seq = token, epoch, 0
	h.reload = true
	return h.load(ctx)
}

// load reads the record hash into delivered, when reload says so.
func (h *Handoff) load(ctx context.Context) error {
	if !h.reload {
		return nil
	}
	if h.cluster {
		// Each slot's record is read again when the slot is claimed.
		clear(h.claimed)
		h.reload = false
		return nil
	}
	rec, err := h.rdb.HGetAll(ctx, h.keys.Record).Result()
	if err != nil {
		return fmt.Errorf("read the handoff record: %w", err)
	}
	clear(h.delivered)
	clear(h.fields)
	for field, ids := range rec {
		for s := range strings.SplitSeq(ids, ",") {
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				continue // not ours: a field written by hand
			}
			h.delivered[id] = field
			h.fields[field]++
		}
		if h.fields[field] == 0 {
			h.clear = append(h.clear, field)
		}
	}
	h.forgetSettling()
	h.reload = false
	return nil
}

// forgetSettling drops from unflushed and clear the fields whose ids the
// record just read holds: their rows count as delivered again, and each such
// field waits anew once they are settled (deleted again, or found gone:
// Committed). A wait noted before the read may hold a WAL position of a
// server that has crashed since: the crash undid the field's delete, the
// new server's WAL passed that position long before the rows were deleted
// again (with synchronous_commit = off, perhaps not yet durably), and the
// field, deleted then, would not have covered them in a second crash.
func (h *Handoff) forgetSettling() {
	h.unflushed = slices.DeleteFunc(h.unflushed, func(w walWait) bool { return h.fields[w.ref] > 0 })
	h.clear = slices.DeleteFunc(h.clear, func(ref string) bool { return h.fields[ref] > 0 })
}

// Ready prepares a push: it takes the fence when this leadership has not
// yet, and reads the record when it may have changed.
func (h *Handoff) Ready(ctx context.Context, holder string) error {
	if h.token == "" {
		return h.acquire(ctx, holder)
	}
	return h.load(ctx)
}

// Drop deletes the fence and the record of a schema whose table is gone,
// after its last lead: it reports whether it did. It does so only while
// this leadership holds the fence and knows every batch in the record as
// settled (delivered and deleted, or delivering nothing): no row is left
// whose delete the record must still cover, and a table created again
// under the schema's name must not meet the old rows' ids in a record (it
// would delete its own rows of those ids unpushed). Otherwise, or on a
// cluster for the slots this leadership never claimed, the keys stay.
func (h *Handoff) Drop(ctx context.Context) (bool, error) {
	if h.token == "" || h.reload || len(h.delivered) > 0 {
		return false, nil
	}
	defer h.Reset()
	// On a cluster, the global fence first (its record is never written):
	// a leadership that took it since has claimed, or will claim, the
	// slots, and each slot's pair is deleted only while it is this one's.
	pairs := [][]string{{h.keys.Fence, h.keys.Record}}
	if h.cluster {
		pairs[0] = pairs[0][:1] // the global record is another slot's
	}
	for s := range h.claimed {
		k := h.keys.slot(s)
		pairs = append(pairs, []string{k.Fence, k.Record})
	}
	for i, keys := range pairs {
		n, err := dropScript.Run(ctx, h.rdb, keys, h.token).Int()
		if err != nil {
			return false, fmt.Errorf("delete the handoff record: %w", err)
		}
		if n == 0 && i == 0 {
			return false, nil // another leadership holds the fence
		}
	}
	return true, nil
}

// WasDelivered reports whether a push delivered the row with this id
// already (its delete did not commit).
func (h *Handoff) WasDelivered(id int64) bool {
	_, ok := h.delivered[id]
	return ok
}

// Push runs u's ops in one atomic step and reports, for each op, whether it
// delivered its rows. On an error nothing is known of what Redis did: the
// batch stays staged, and the record is read again before the next push.
// ErrFenced means another relay leads.
func (h *Handoff) Push(ctx context.Context, u *Unit) (field string, err error) {
	field = h.nextField()
	if h.cluster {
		return field, h.pushCluster(ctx, u, field)
	}
	keys, args := h.pushArgs(u, field)
	reply, err := h.run(ctx, keys, args)
	return h.pushed(u, field, reply, err)
}

// nextField is the record field of the next push.
func (h *Handoff) nextField() string {
	h.seq++
	return strconv.FormatInt(h.epoch, 10) + ":" + strconv.FormatInt(h.seq, 10)
}

// pushArgs are the push script's keys and arguments for u under field.
// args shares h.header: it is good until h's next push.
func (h *Handoff) pushArgs(u *Unit, field string) (keys []string, args []any) {
	keys = append([]string{h.keys.Fence, h.keys.Record}, u.keys...)
	h.header = append(h.header[:0], h.token, field, len(h.clear))
	for _, f := range h.clear {
		h.header = append(h.header, f)
	}
	return keys, append(h.header, u.args...)
}

// pushed settles u from the push script's reply, or its error.
func (h *Handoff) pushed(u *Unit, field string, reply []any, err error) (string, error) {
	if err != nil {
		// Whether Redis ran it is unknown: settle it from the record,
		// under a new token (see the top of this file).
		h.token, h.reload = "", true
		if strings.HasPrefix(err.Error(), "FENCED") {
			return "", fmt.Errorf("%w: %w", ErrFenced, err)
		}
		return "", err
	}
	h.clear = h.clear[:0]
	if err := u.settle(nil, reply); err != nil {
		h.token, h.reload = "", true
		return "", err
	}
	return field, nil
}

// Pipelines reports whether h's pushes and tidies may share a pipeline with
// those of other handoffs on the same client (PushAll, TidyAll): not on a
// cluster, whose steps go slot by slot, nor with WAIT, which needs the
// push's own connection.
func (h *Handoff) Pipelines() bool { return !h.cluster && h.waitReplicas == 0 }

// PushAll is Push for several handoffs at once, hs[i] pushing us[i], each
// handoff at most once: those that Pipelines, through the first one's
// client, in one pipeline, one round trip where each Push is one (a hot
// fleet's shared drain pushes a batch of each of its schemas). Each
// handoff's script runs on its own, as its Push would run it, and each
// result is as its Push's would be. The others push one after the other.
func PushAll(ctx context.Context, hs []*Handoff, us []*Unit) (fields []string, errs []error) {
	fields, errs = make([]string, len(hs)), make([]error, len(hs))
	type queued struct {
		i     int
		field string
		keys  []string
		args  []any
		cmd   *redis.Cmd
	}
	var qs []queued
	pipe, joins := pipeline(hs)
	for i, h := range hs {
		if !joins(h) {
			fields[i], errs[i] = h.Push(ctx, us[i])
			continue
		}
		q := queued{i: i, field: h.nextField()}
		q.keys, q.args = h.pushArgs(us[i], q.field)
		q.cmd = handoffScript.EvalSha(ctx, pipe, q.keys, q.args...)
		qs = append(qs, q)
	}
	if len(qs) == 0 {
		return fields, errs
	}
	_, _ = pipe.Exec(ctx) // each command's error is its own
	for _, q := range qs {
		h := hs[q.i]
		reply, err := q.cmd.Slice()
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			// The script is not loaded (a Redis restarted, or flushed its
			// scripts): nothing ran. Run loads it.
			reply, err = handoffScript.Run(ctx, h.rdb, q.keys, q.args...).Slice()
		}
		fields[q.i], errs[q.i] = h.pushed(us[q.i], q.field, reply, err)
	}
	return fields, errs
}

// run runs the push script, then, with waitReplicas, WAIT on the same
// connection: the push counts only once enough replicas have it.
func (h *Handoff) run(ctx context.Context, keys []string, args []any) ([]any, error) {
	if h.waitReplicas == 0 {
		return handoffScript.Run(ctx, h.rdb, keys, args...).Slice()
	}
	c, ok := h.rdb.(*redis.Client)
	if !ok {
		return nil, fmt.Errorf("RedisWaitReplicas needs a *redis.Client, got %T", h.rdb)
	}
	conn := c.Conn()
	defer conn.Close()
	reply, err := handoffScript.Run(ctx, conn, keys, args...).Slice()
	if err != nil {
		return nil, err
	}
	n, err := conn.Wait(ctx, h.waitReplicas, h.waitTimeout).Result()
	if err != nil {
		return nil, fmt.Errorf("WAIT for %d replicas: %w", h.waitReplicas, err)
	}
	if int(n) < h.waitReplicas {
		return nil, fmt.Errorf("%w: %d of %d replicas acknowledged the push within %s", errTooFewReplicas, n, h.waitReplicas, h.waitTimeout)
	}
	return reply, nil
}

// errTooFewReplicas fails a push that fewer replicas than
// Config.RedisWaitReplicas acknowledged in time: its rows stay staged, and
// the next push settles it from the record.
var errTooFewReplicas = errors.New("redis WAIT: too few replicas")

// fenceError is the error of a script that takes the fence.
func fenceError(err error) error {
	if strings.HasPrefix(err.Error(), "FOREIGN") {
		return fmt.Errorf("%w: %s", ErrForeign, strings.TrimPrefix(err.Error(), "FOREIGN "))
	}
	return fmt.Errorf("take the fence: %w", err)
}

// walWait is a record field (or slotRef) to delete once the WAL is flushed
// past lsn (and, with hold, once hold has passed since at).
type walWait struct {
	ref string
	lsn uint64
	at  time.Time
}

// Abandon deletes, with the next push, the record field of a push whose
// rows stay staged whatever it delivered (none of them were delivered).
func (h *Handoff) Abandon(field string) {
	if !h.cluster {
		h.clear = append(h.clear, field)
		return
	}
	for _, s := range h.parts[field] {
		h.clear = append(h.clear, slotRef(s, field))
	}
	delete(h.parts, field)
}

// flushed moves the fields whose deletes are on disk here and on the
// standbys (the WAL is flushed up to flush), and held for hold, from
// unflushed to clear.
func (h *Handoff) flushed(flush uint64) {
	kept := h.unflushed[:0]
	for _, w := range h.unflushed {
		if w.lsn <= flush && (h.Hold <= 0 || time.Since(w.at) >= h.Hold) {
			h.clear = append(h.clear, w.ref)
		} else {
			kept = append(kept, w)
		}
	}
	h.unflushed = kept
}

// Committed records that the delete of a batch committed: the batch's own
// record field (if it pushed anything), and the rows it deleted that an
// earlier push had delivered, are done with once the commit is durable:
// wal is the WAL position read after the commit, flush how far the WAL was
// flushed then (see the top of this file).
func (h *Handoff) Committed(field string, redelivered []int64, wal, flush uint64) {
	if h.cluster && field != "" {
		for _, s := range h.parts[field] {
			h.unflushed = append(h.unflushed, walWait{slotRef(s, field), wal, time.Now()})
		}
		delete(h.parts, field)
	} else if field != "" {
		h.unflushed = append(h.unflushed, walWait{field, wal, time.Now()})
	}
	for _, id := range redelivered {
		f, ok := h.delivered[id]
		if !ok {
			continue
		}
		delete(h.delivered, id)
		if h.fields[f]--; h.fields[f] == 0 {
			delete(h.fields, f)
			h.unflushed = append(h.unflushed, walWait{f, wal, time.Now()})
		}
	}
	h.flushed(flush)
}

// Uncommitted records that a batch whose push delivered ids did not commit
// its delete (or may not have): those rows, claimed again, are deleted
// without a push.
func (h *Handoff) Uncommitted(field string, ids []int64) {
	if field == "" {
		return
	}
	if len(ids) == 0 {
		h.Abandon(field)
		return
	}
	if h.cluster {
		// Its slots' refs with ids are in delivered now; the others
		// recorded nothing.
		got := make(map[int]bool)
		for _, id := range ids {
			got[h.idSlot[id]] = true
		}
		for _, s := range h.parts[field] {
			if !got[s] {
				h.clear = append(h.clear, slotRef(s, field))
			}
		}
		delete(h.parts, field)
	}
	for _, id := range ids {
		ref := field
		if h.cluster {
			ref = slotRef(h.idSlot[id], field)
		}
		h.delivered[id] = ref
		h.fields[ref]++
	}
}

// TidyEvery is how long after its last drain a quiet schema's drain loop
// tidies the record (TidyDue). A tidy costs a WAL-position read and an
// HDEL: after every drain it made a one-job drain 7 round trips instead of
// 5, and once a second it cost each schema of a fleet at 1,000 jobs/s over
// 200 schemas about as much as one of its drains. While drains keep
// coming, each push deletes the fields done with (the clear list it
// carries), so the record stays small without a tidy; fields waiting for
// the WAL flush stay in Redis until the next push or the tidy (a few bytes
// each).
const TidyEvery = time.Second

// TidyDue reports whether a drain's end tidies the record: only while
// delivered rows wait (their ids are looked up and forgotten). Otherwise
// the drain loop tidies TidyEvery after the last drain.
func (h *Handoff) TidyDue() bool {
	return len(h.delivered) > 0
}

// Tidy deletes the record fields that are done with, outside a push (when a
// drain ends), and forgets delivered rows that are no longer staged:
// staged is called with the delivered ids and returns those still staged;
// wal returns the WAL's insert and flush positions.
func (h *Handoff) Tidy(ctx context.Context, staged func([]int64) ([]int64, error), wal func() (insert, flush uint64, err error)) error {
	if err := h.settleTidy(staged, wal); err != nil {
		return err
	}
	if len(h.clear) == 0 {
		return nil
	}
	if h.cluster {
		return h.tidyCluster(ctx)
	}
	return h.cleared(h.rdb.HDel(ctx, h.keys.Record, h.clear...).Err())
}

// settleTidy is Tidy but its deletes in Redis: it moves to clear the fields
// that are done with.
func (h *Handoff) settleTidy(staged func([]int64) ([]int64, error), wal func() (insert, flush uint64, err error)) error {
	if len(h.delivered) == 0 && len(h.unflushed) > 0 {
		_, flush, err := wal()
		if err != nil {
			return err
		}
		h.flushed(flush)
	}
	if len(h.delivered) > 0 {
		ids := make([]int64, 0, len(h.delivered))
		for id := range h.delivered {
			ids = append(ids, id)
		}
		still, err := staged(ids)
		if err != nil {
			return err
		}
		keep := make(map[int64]bool, len(still))
		for _, id := range still {
			keep[id] = true
		}
		var gone []int64
		for _, id := range ids {
			if !keep[id] {
				gone = append(gone, id)
			}
		}
		// The deletes of the gone rows committed before staged read:
		// they are durable once the WAL is flushed past where it is now.
		insert, flush, err := wal()
		if err != nil {
			return err
		}
		h.Committed("", gone, insert, flush)
	}
	return nil
}

// pipeline returns a pipeline on the client of the first of hs that
// Pipelines, and whether a handoff may go in it (it Pipelines, on that
// client); nil and never if none of hs Pipelines.
func pipeline(hs []*Handoff) (redis.Pipeliner, func(*Handoff) bool) {
	for _, first := range hs {
		if first.Pipelines() {
			return first.rdb.Pipeline(), func(h *Handoff) bool { return h.Pipelines() && h.rdb == first.rdb }
		}
	}
	return nil, func(*Handoff) bool { return false }
}

// cleared forgets the fields of clear once err says their HDEL ran.
func (h *Handoff) cleared(err error) error {
	if err != nil {
		return fmt.Errorf("delete handoff records: %w", err)
	}
	h.clear = h.clear[:0]
	return nil
}

// TidyAll is Tidy for several handoffs at once, with the record fields'
// deletes of those that Pipelines, through the first one's client, in one
// pipeline (the others delete theirs on their own). staged and wal are
// called with each handoff's index in hs.
func TidyAll(ctx context.Context, hs []*Handoff, staged func(i int, ids []int64) ([]int64, error), wal func(i int) (insert, flush uint64, err error)) []error {
	errs := make([]error, len(hs))
	var queued []int
	var cmds []*redis.IntCmd
	pipe, joins := pipeline(hs)
	for i, h := range hs {
		if !joins(h) {
			errs[i] = h.Tidy(ctx, func(ids []int64) ([]int64, error) { return staged(i, ids) },
				func() (uint64, uint64, error) { return wal(i) })
			continue
		}
		err := h.settleTidy(func(ids []int64) ([]int64, error) { return staged(i, ids) },
			func() (uint64, uint64, error) { return wal(i) })
		if err != nil {
			errs[i] = err
			continue
		}
		if len(h.clear) > 0 {
			queued = append(queued, i)
			cmds = append(cmds, pipe.HDel(ctx, h.keys.Record, h.clear...))
		}
	}
	if len(queued) == 0 {
		return errs
	}
	_, _ = pipe.Exec(ctx) // each command's error is its own
	for n, i := range queued {
		errs[i] = hs[i].cleared(cmds[n].Err())
	}
	return errs
}

// Unit is a batch's part of the atomic push step, built by a target: a
// list of ops, each delivering some rows, each made of Redis commands.
// Build one with Begin, then Limit, Command, Variadic or Call, for each op.
type Unit struct {
	keys []string // the commands' keys, in order
	args []any    // the ops' part of ARGV
	ops  []Op

	ncmds int // index in args of the current op's command count
	ids   []byte

	// MaxLen is Config.MaxQueueLength: when positive, Limit adds a length
	// guard to an op.
	MaxLen int64
}

// Limit makes the current op, before any of its commands, run only while
// the keys (queue's) hold fewer than maxLen entries together: cmd
// measures them, LLEN, ZCARD, XLEN, or XUNACKED for a stream whose op adds
// one entry (one key); with several keys, cmd is either one command that
// measures each of them or a sum with one term per key, "LLEN+LLEN+ZCARD"
// (see handoffScript). Without maxLen it does nothing.
func (u *Unit) Limit(queue, cmd string, keys ...string) {
	if u.MaxLen <= 0 {
		return
	}
	op := &u.ops[len(u.ops)-1]
	op.Queue, op.LenKey, op.Limit = queue, keys[0], u.MaxLen
	if len(keys) > 1 {
		op.LenKey += fmt.Sprintf(" (with %d more keys)", len(keys)-1) // their lengths are added up
		if !strings.Contains(cmd, "+") {
			cmd = strings.TrimSuffix(strings.Repeat(cmd+"+", len(keys)), "+")
		}
	}
	if strings.Count(cmd, "+")+1 != len(keys) || (len(keys) > 1 && strings.Contains(cmd, "XUNACKED")) {
		panic("relay: length guard " + cmd + " on " + strconv.Itoa(len(keys)) + " keys")
	}
	u.keys = append(u.keys, keys...)
	g := u.ncmds - 1
	u.args[g] = strconv.Itoa(u.args[g].(int)) + " " + cmd + " " + strconv.FormatInt(u.MaxLen, 10)
}

// Op is one op of a Unit and, after settle, its outcome.
type Op struct {
	IDs     []int64 // the rows it delivers; nil for bookkeeping
	Err     error   // the error reply that refused it, after the push
	Reply   any     // its last command's reply (or the guard key that skipped it), after the push
	Skipped bool    // a guard key existed: the op did not run, and counts as done
	Over    bool    // its length guard stopped it: the queue is full (backpressure)

	// The op's length guard, if Limit > 0: the queue it pushes to and its key.
	Queue, LenKey string
	Limit         int64

	k0, a0 int // where its keys and its args start in the unit's
}

// Ops are the unit's ops, in the order they were begun; after a push,
// each says what became of it.
func (u *Unit) Ops() []Op { return u.ops }

// Reset empties the unit for the next batch.
func (u *Unit) Reset() {
	u.keys, u.args, u.ops, u.ids = u.keys[:0], u.args[:0], u.ops[:0], u.ids[:0]
}

// Begin starts an op that delivers the rows ids (nil: bookkeeping, whose
// failure matters to no row). The op is skipped, and counts as done, if any
// of the guard keys exists ("" guards nothing).
func (u *Unit) Begin(ids []int64, guards ...string) {
	u.ops = append(u.ops, Op{IDs: ids, k0: len(u.keys), a0: len(u.args)})
	g := 0
	for _, key := range guards {
		if key != "" {
			u.keys = append(u.keys, key)
			g++
		}
	}
	start := len(u.ids)
	for i, id := range ids {
		if i > 0 {
			u.ids = append(u.ids, ',')
		}
		u.ids = strconv.AppendInt(u.ids, id, 10)
	}
	u.ncmds = len(u.args) + 1
	u.args = append(u.args, g, 0, u.ids[start:len(u.ids):len(u.ids)])
}

// Command adds a command on key to the current op.
func (u *Unit) Command(name, key string, args ...any) {
	u.keys = append(u.keys, key)
	u.args = append(u.args, name, 1, len(args))
	u.args = append(u.args, args...)
	u.args[u.ncmds] = u.args[u.ncmds].(int) + 1
}

// Call adds a command on several keys to the current op: a Redis command,
// or a Lua op of the script (luaOps, see handoffScript).
func (u *Unit) Call(name string, keys []string, args ...any) {
	u.keys = append(u.keys, keys...)
	u.args = append(u.args, name, len(keys), len(args))
	u.args = append(u.args, args...)
	u.args[u.ncmds] = u.args[u.ncmds].(int) + 1
}

// Variadic adds a command on key whose arguments repeat in groups of step
// (LPUSH's values, ZADD's score and member pairs) to the current op, as
// several commands when there are more than maxCommandArgs.
func (u *Unit) Variadic(name, key string, step int, args []any) {
	chunk := maxCommandArgs / step * step
	for len(args) > chunk {
		u.Command(name, key, args[:chunk]...)
		args = args[chunk:]
	}
	u.Command(name, key, args...)
}

// settle reads the script's reply into the outcomes of the ops it ran: the
// ops of u at the indexes ops, or all of them when ops is nil.
func (u *Unit) settle(ops []int, reply []any) error {
	n := len(ops)
	if ops == nil {
		n = len(u.ops)
	}
	at := func(j int) int {
		if ops == nil {
			return j
		}
		return ops[j]
	}
	if len(reply) == 2 {
		if st, _ := reply[0].(int64); st == replayed {
			prior, _ := reply[1].(string)
			u.settleReplay(n, at, prior)
			return nil
		}
	}
	if len(reply) != 2*n {
		return fmt.Errorf("push: %d replies for %d ops: %w", len(reply)/2, n, errNoReply)
	}
	for j := range n {
		i := at(j)
		if err := u.ops[i].settle(i, reply[2*j], reply[2*j+1]); err != nil {
			return err
		}
	}
	return nil
}

// replayed is the script's status when it found its batch's field in the
// record: it ran before, and ran nothing this time.
const replayed = -1

// settleReplay settles the ops of a push that ran before, from what its
// first run recorded (prior, comma-separated ids): an op whose rows are all
// there was delivered; any other was refused by the first run, for a reason
// now unknown, and its rows stay staged to be pushed again.
func (u *Unit) settleReplay(n int, at func(int) int, prior string) {
	got := make(map[int64]bool)
	for s := range strings.SplitSeq(prior, ",") {
		if id, err := strconv.ParseInt(s, 10, 64); err == nil {
			got[id] = true
		}
	}
	for j := range n {
		op := &u.ops[at(j)]
		op.Reply, op.Err, op.Skipped, op.Over = "", nil, false, false
		for _, id := range op.IDs {
			if !got[id] {
				op.Err = errReplayRefused
				break
			}
		}
	}
}

// errReplayRefused is the outcome of an op that the first run of a push
// refused, seen from a second run: waiting may fix it (TRYAGAIN), as the
// first run's reason is not known.
const errReplayRefused = replyError("TRYAGAIN the first run of this push did not deliver these jobs; they stay staged")

// settle reads the script's two reply elements for op i.
func (op *Op) settle(i int, status, reply any) error {
	st, _ := status.(int64)
	switch st {
	case 1, 2:
		op.Reply, op.Err, op.Skipped, op.Over = reply, nil, st == 2, false
	case 3:
		op.Reply, op.Skipped, op.Over = reply, false, true
		op.Err = replyError(op.overWhy(reply))
	case 0:
		msg, _ := reply.(string)
		op.Err = replyError(msg)
	default:
		return fmt.Errorf("push: op %d answered %v: %w", i, status, errNoReply)
	}
	return nil
}

// overWhy is the reason of an op its length guard stopped, from the
// guard's reply: the length, or for XUNACKED the count and the slowest
// consumer group.
func (op *Op) overWhy(reply any) string {
	if r, ok := reply.([]any); ok && len(r) == 2 {
		n, _ := r[0].(int64)
		if group, _ := r[1].(string); group != "" {
			return fmt.Sprintf("BACKPRESSURE %s: consumer group %q has %d entries not acknowledged (lag + pending) >= --max-queue-length %d",
				op.LenKey, group, n, op.Limit)
		}
		return fmt.Sprintf("BACKPRESSURE %s holds %d and has no consumer group >= --max-queue-length %d", op.LenKey, n, op.Limit)
	}
	n, _ := reply.(int64)
	return fmt.Sprintf("BACKPRESSURE %s holds %d >= --max-queue-length %d", op.LenKey, n, op.Limit)
}

// replyError is Redis's error reply to one command of an op.
type replyError string

func (e replyError) Error() string { return string(e) }

var errNoReply = errors.New("no reply proves that Redis ran the push")
