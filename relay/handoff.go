package relay

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
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
//  3. runs the target's commands (an op per queue: LPUSH, ZADD, ...), each
//     op on its own, so that a WRONGTYPE on one queue's key refuses only that
//     queue's jobs;
//  4. records, in the record hash under a field of its own, the ids of the
//     rows whose op succeeded.
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
// It answers two elements per op: 1 and the last command's reply when the
// op ran, 2 and the guard key that existed when a guard skipped it, 0 and
// the error reply of the command that failed (the op's later commands are
// not run).
var handoffScript = redis.NewScript(`
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
local k = 3
local out = {}
local done = {}
while a <= #ARGV do
  local guard, ncmds, ids = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2]
  a = a + 3
  local status, reply = 1, ''
  for g = 1, guard do
    if status == 1 and redis.call('EXISTS', KEYS[k]) == 1 then status, reply = 2, KEYS[k] end
    k = k + 1
  end
  for c = 1, ncmds do
    local name, nkeys, nargs = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    a = a + 3
    if status == 1 then
      local r
      if nkeys == 1 then
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
  if status ~= 0 and ids ~= '' then done[#done + 1] = ids end
  out[#out + 1] = status
  out[#out + 1] = reply
end
if #done > 0 then
  redis.call('HSET', KEYS[2], ARGV[2], table.concat(done, ','))
end
return out
`)

// acquireScript starts a leadership: a new epoch and token in the fence
// hash. KEYS[1] the fence hash; ARGV the token, the holder, the time.
var acquireScript = redis.NewScript(`
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'holder', ARGV[2], 'since', ARGV[3])
return epoch
`)

// maxCommandArgs is the most arguments one command of the script takes: Lua
// 5.1's unpack fails past about 8,000. variadic splits longer ones.
const maxCommandArgs = 1000

// errFenced is returned by a push that the fence refused: another relay
// leads now. The relay steps down.
var errFenced = errors.New("fenced off")

// handoffKeys are the relay's own Redis keys, for one schema of one
// database, under the namespace: the fence hash and the record hash. A
// group of relays with Config.Queues has its own (group is its sorted
// queue list, comma-joined; "" for the relays of all queues): the leaders
// of two groups lead at the same time and must not fence each other.
type handoffKeys struct {
	fence, record string
}

func newHandoffKeys(namespace, database, schema, group string) handoffKeys {
	base := "stagedrain:" + database + ":" + schema + ":"
	if group != "" {
		base += "queues=" + group + ":"
	}
	if namespace != "" {
		base = namespace + ":" + base
	}
	return handoffKeys{fence: base + "fence", record: base + "handoff"}
}

// handoff runs the atomic push step and keeps what the relay knows of the
// record. It is used by the drain goroutine only.
type handoff struct {
	rdb  redis.UniversalClient
	keys handoffKeys

	token string // this leadership's fence token; "" until acquired
	epoch int64
	seq   int64 // batches pushed in this leadership, for record fields

	// delivered maps the id of a row that a push delivered, and whose
	// delete is not known to have committed, to its record field. Such a
	// row, claimed again, is deleted and not pushed.
	delivered map[int64]string
	// fields counts the ids in delivered by record field.
	fields map[string]int
	// clear lists record fields that may be deleted: their batches'
	// deletes committed. The next push deletes them.
	clear []string
	// reload says that the record in Redis may hold batches this relay
	// does not know of (a new leadership, a push whose reply was lost): it
	// is read before the next push.
	reload bool

	unit   pushUnit
	header []any

	// On a Redis Cluster (cluster.go): the slots whose fence this
	// leadership holds and whose record it has read, the slots each pushed
	// record field is in, and the slot each id of the last push went to.
	// delivered, fields and clear then hold slotRefs, not fields.
	cluster bool
	claimed map[int]bool
	parts   map[string][]int
	idSlot  map[int64]int
}

func newHandoff(rdb redis.UniversalClient, keys handoffKeys) *handoff {
	h := &handoff{rdb: rdb, keys: keys, delivered: make(map[int64]string), fields: make(map[string]int)}
	if _, ok := rdb.(*redis.ClusterClient); ok {
		h.cluster = true
		h.claimed, h.parts, h.idSlot = make(map[int]bool), make(map[string][]int), make(map[int64]int)
	}
	return h
}

// reset forgets the leadership: the next push acquires a new one, after
// reading the record.
func (h *handoff) reset() {
	h.token, h.epoch, h.seq = "", 0, 0
	h.reload = true
	clear(h.claimed)
}

// acquire takes the fence for a new leadership, then reads the record (the
// order matters: a push of the last leader is either in the record read
// after, or refused). holder names this relay in the fence hash.
func (h *handoff) acquire(ctx context.Context, holder string) error {
	if h.cluster {
		return h.acquireCluster(ctx, holder)
	}
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	token := hex.EncodeToString(raw[:])
	epoch, err := acquireScript.Run(ctx, h.rdb, []string{h.keys.fence},
		token, holder, time.Now().UTC().Format(time.RFC3339)).Int64()
	if err != nil {
		return fmt.Errorf("take the fence: %w", err)
	}
	h.token, h.epoch, h.seq = token, epoch, 0
	h.reload = true
	return h.load(ctx)
}

// load reads the record hash into delivered, when reload says so.
func (h *handoff) load(ctx context.Context) error {
	if !h.reload {
		return nil
	}
	if h.cluster {
		// Each slot's record is read again when the slot is claimed.
		clear(h.claimed)
		h.reload = false
		return nil
	}
	rec, err := h.rdb.HGetAll(ctx, h.keys.record).Result()
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
	h.reload = false
	return nil
}

// ready prepares a push: it takes the fence when this leadership has not
// yet, and reads the record when it may have changed.
func (h *handoff) ready(ctx context.Context, holder string) error {
	if h.token == "" {
		return h.acquire(ctx, holder)
	}
	return h.load(ctx)
}

// wasDelivered reports whether a push delivered the row with this id
// already (its delete did not commit).
func (h *handoff) wasDelivered(id int64) bool {
	_, ok := h.delivered[id]
	return ok
}

// push runs u's ops in one atomic step and reports, for each op, whether it
// delivered its rows. On an error nothing is known of what Redis did: the
// batch stays staged, and the record is read again before the next push.
// errFenced means another relay leads.
func (h *handoff) push(ctx context.Context, u *pushUnit) (field string, err error) {
	h.seq++
	field = strconv.FormatInt(h.epoch, 10) + ":" + strconv.FormatInt(h.seq, 10)
	if h.cluster {
		return field, h.pushCluster(ctx, u, field)
	}
	keys := append([]string{h.keys.fence, h.keys.record}, u.keys...)
	h.header = append(h.header[:0], h.token, field, len(h.clear))
	for _, f := range h.clear {
		h.header = append(h.header, f)
	}
	args := append(h.header, u.args...)
	reply, err := handoffScript.Run(ctx, h.rdb, keys, args...).Slice()
	if err != nil {
		h.reload = true
		if strings.HasPrefix(err.Error(), "FENCED") {
			h.token = ""
			return "", fmt.Errorf("%w: %w", errFenced, err)
		}
		return "", err
	}
	h.clear = h.clear[:0]
	if err := u.settle(reply); err != nil {
		h.reload = true
		return "", err
	}
	return field, nil
}

// committed records that the delete of a batch committed: the batch's own
// record field (if it pushed anything), and the rows it deleted that an
// earlier push had delivered, are done with.
func (h *handoff) committed(field string, redelivered []int64) {
	if h.cluster && field != "" {
		for _, s := range h.parts[field] {
			h.clear = append(h.clear, slotRef(s, field))
		}
		delete(h.parts, field)
	} else if field != "" {
		h.clear = append(h.clear, field)
	}
	for _, id := range redelivered {
		f, ok := h.delivered[id]
		if !ok {
			continue
		}
		delete(h.delivered, id)
		if h.fields[f]--; h.fields[f] == 0 {
			delete(h.fields, f)
			h.clear = append(h.clear, f)
		}
	}
}

// uncommitted records that a batch whose push delivered ids did not commit
// its delete (or may not have): those rows, claimed again, are deleted
// without a push.
func (h *handoff) uncommitted(field string, ids []int64) {
	if h.cluster {
		delete(h.parts, field) // its slots' refs are in delivered now
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

// tidy deletes the record fields that are done with, outside a push (when a
// drain ends), and forgets delivered rows that are no longer staged:
// staged is called with the delivered ids and returns those still staged.
func (h *handoff) tidy(ctx context.Context, staged func([]int64) ([]int64, error)) error {
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
		h.committed("", gone)
	}
	if len(h.clear) == 0 {
		return nil
	}
	if h.cluster {
		return h.tidyCluster(ctx)
	}
	if err := h.rdb.HDel(ctx, h.keys.record, h.clear...).Err(); err != nil {
		return fmt.Errorf("delete handoff records: %w", err)
	}
	h.clear = h.clear[:0]
	return nil
}

// pushUnit is a batch's part of the atomic push step, built by a target: a
// list of ops, each delivering some rows, each made of Redis commands.
// Build one with begin, then command or variadic, for each op.
type pushUnit struct {
	keys []string // the commands' keys, in order
	args []any    // the ops' part of ARGV
	ops  []unitOp

	ncmds int // index in args of the current op's command count
	ids   []byte
}

// unitOp is one op of a pushUnit and, after settle, its outcome.
type unitOp struct {
	ids     []int64 // the rows it delivers; nil for bookkeeping
	err     error   // the error reply that refused it, after settle
	reply   any     // its last command's reply (or the guard key that skipped it), after settle
	skipped bool    // a guard key existed: the op did not run, and counts as done

	k0, a0 int // where its keys and its args start in the unit's
}

func (u *pushUnit) reset() {
	u.keys, u.args, u.ops, u.ids = u.keys[:0], u.args[:0], u.ops[:0], u.ids[:0]
}

// begin starts an op that delivers the rows ids (nil: bookkeeping, whose
// failure matters to no row). The op is skipped, and counts as done, if any
// of the guard keys exists ("" guards nothing).
func (u *pushUnit) begin(ids []int64, guards ...string) {
	u.ops = append(u.ops, unitOp{ids: ids, k0: len(u.keys), a0: len(u.args)})
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

// command adds a command on key to the current op.
func (u *pushUnit) command(name, key string, args ...any) {
	u.keys = append(u.keys, key)
	u.args = append(u.args, name, 1, len(args))
	u.args = append(u.args, args...)
	u.args[u.ncmds] = u.args[u.ncmds].(int) + 1
}

// variadic adds a command on key whose arguments repeat in groups of step
// (LPUSH's values, ZADD's score and member pairs) to the current op, as
// several commands when there are more than maxCommandArgs.
func (u *pushUnit) variadic(name, key string, step int, args []any) {
	chunk := maxCommandArgs / step * step
	for len(args) > chunk {
		u.command(name, key, args[:chunk]...)
		args = args[chunk:]
	}
	u.command(name, key, args...)
}

// settle reads the script's reply into the ops' outcomes.
func (u *pushUnit) settle(reply []any) error {
	if len(reply) != 2*len(u.ops) {
		return fmt.Errorf("push: %d replies for %d ops: %w", len(reply)/2, len(u.ops), errNoReply)
	}
	for i := range u.ops {
		if err := u.ops[i].settle(i, reply[2*i], reply[2*i+1]); err != nil {
			return err
		}
	}
	return nil
}

// settle reads the script's two reply elements for op i.
func (op *unitOp) settle(i int, status, reply any) error {
	st, _ := status.(int64)
	switch st {
	case 1, 2:
		op.reply, op.err, op.skipped = reply, nil, st == 2
	case 0:
		msg, _ := reply.(string)
		op.err = replyError(msg)
	default:
		return fmt.Errorf("push: op %d answered %v: %w", i, status, errNoReply)
	}
	return nil
}

// replyError is Redis's error reply to one command of an op.
type replyError string

func (e replyError) Error() string { return string(e) }

var errNoReply = errors.New("no reply proves that Redis ran the push")
