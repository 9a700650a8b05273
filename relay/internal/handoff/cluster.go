package handoff

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The handoff on a Redis Cluster. A script runs only when all its keys are
// in one hash slot, so the atomic unit is a slot: a batch's push is one
// script call per slot its ops' keys are in (every key of an op must be in
// one slot: asynq's task, pending, scheduled and unique keys share the
// {<queue>} hash tag; a stream is one key), each with the fence check and
// the record of its part, in a fence hash and a record hash of that slot:
//
//	[<namespace>:]stagedrain:<database>:<schema>:{<tag>}:fence
//	[<namespace>:]stagedrain:<database>:<schema>:{<tag>}:handoff
//
// where <tag> is slotTag(slot), a short string that hashes to the slot. So
// exactly-once holds per part, as it holds per batch on a single Redis.
//
// Fencing across slots: acquire takes a new epoch from the global fence
// hash (stagedrain:<database>:<schema>:fence, in a slot of its own): at
// least the last one plus 1, and at least the time in milliseconds, so that
// epochs keep growing even if that hash is lost. Before a leadership first
// pushes to a slot, it claims the slot: one script, atomic on the slot,
// refuses (FENCED) if the slot's fence holds a newer epoch, else sets the
// slot's epoch and token to its own and returns the slot's record. Every
// Push then checks the slot's token, as on a single Redis. A deposed leader
// pushing to a slot that the new leader has claimed is refused; one pushing
// to a slot that the new leader has not claimed yet still succeeds, but its
// Push is in that slot's record when the new leader claims the slot, before
// its first push there: the rows it delivered are deleted, not pushed
// again. There is no window in which a deposed leader's push goes unseen,
// as long as Redis keeps what it acknowledged (as on a single Redis); the
// PostgreSQL leader lock and FOR UPDATE SKIP LOCKED remain the first guard.
//
// A new leadership reads records slot by slot, as it claims them: no scan
// of the cluster, no index of slots. A slot it never pushes to keeps the
// record of batches in flight when an old leadership ended only if the old
// leader never deleted them, which its rows' deletes would have let it do.

// acquireClusterScript starts a leadership on a cluster: a new epoch, above
// the last and at least ARGV[4] (the time in ms), and the token, in the
// global fence hash. KEYS[1] the fence hash; ARGV the token, the holder,
// the time, the PostgreSQL system_identifier, the time in milliseconds.
var acquireClusterScript = redis.NewScript(foreignCheck + `
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') + 1
local now = tonumber(ARGV[5])
if now > epoch then epoch = now end
redis.call('HSET', KEYS[1], 'epoch', string.format('%d', epoch), 'token', ARGV[1], 'holder', ARGV[2], 'since', ARGV[3], 'system', ARGV[4])
return epoch
`)

// claimScript makes a slot's fence this leadership's, and returns the
// slot's record (HGETALL). KEYS[1] the slot's fence hash, KEYS[2] its
// record hash; ARGV the epoch, the token, the holder, the time.
var claimScript = redis.NewScript(`
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
local mine = tonumber(ARGV[1])
if epoch > mine then
  return redis.error_reply('FENCED this relay is no longer the leader: a newer leadership claimed this cluster slot')
end
if epoch == mine and redis.call('HGET', KEYS[1], 'token') ~= ARGV[2] then
  return redis.error_reply('FENCED this relay is no longer the leader: another relay holds this epoch')
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'token', ARGV[2], 'holder', ARGV[3], 'since', ARGV[4])
return redis.call('HGETALL', KEYS[2])
`)

// acquireCluster takes a new epoch and token; the slots are claimed as
// pushes reach them.
func (h *Handoff) acquireCluster(ctx context.Context, holder string) error {
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	token := hex.EncodeToString(raw[:])
	now := time.Now().UTC()
	epoch, err := acquireClusterScript.Run(ctx, h.rdb, []string{h.keys.Fence},
		token, holder, now.Format(time.RFC3339), h.System, now.UnixMilli()).Int64()
	if err != nil {
		return fenceError(err)
	}
	h.token, h.epoch, h.seq = token, epoch, 0
	h.reload = false
	clear(h.claimed)
	clear(h.delivered)
	clear(h.fields)
	clear(h.parts)
	return nil
}

// opSlot returns the slot of op i of u, or -1 when its keys are in several.
func (u *Unit) opSlot(i int) (slot int, keys []string, args []any) {
	op := &u.ops[i]
	kend, aend := len(u.keys), len(u.args)
	if i+1 < len(u.ops) {
		kend, aend = u.ops[i+1].k0, u.ops[i+1].a0
	}
	keys, args = u.keys[op.k0:kend], u.args[op.a0:aend]
	slot = KeySlot(keys[0])
	for _, k := range keys[1:] {
		if KeySlot(k) != slot {
			return -1, keys, args
		}
	}
	return slot, keys, args
}

// Claim claims the slots of u's ops that this leadership has not claimed
// yet, reading their records. It reports whether those records show that
// an earlier push delivered some of u's rows: then u must be built again.
func (h *Handoff) Claim(ctx context.Context, u *Unit, holder string) (again bool, err error) {
	read := false
	for i := range u.ops {
		s, _, _ := u.opSlot(i)
		if s < 0 || h.claimed[s] {
			continue
		}
		if err := h.claimSlot(ctx, s, holder); err != nil {
			return false, err
		}
		read = true
	}
	if !read || len(h.delivered) == 0 {
		return false, nil
	}
	for _, op := range u.ops {
		for _, id := range op.IDs {
			if h.WasDelivered(id) {
				return true, nil
			}
		}
	}
	return false, nil
}

// claimSlot claims one slot and replaces what delivered holds of its
// record with the record read.
func (h *Handoff) claimSlot(ctx context.Context, s int, holder string) error {
	k := h.keys.slot(s)
	rec, err := claimScript.Run(ctx, h.rdb, []string{k.Fence, k.Record},
		h.epoch, h.token, holder, time.Now().UTC().Format(time.RFC3339)).StringSlice()
	if err != nil {
		if strings.HasPrefix(err.Error(), "FENCED") {
			h.token = ""
			h.reload = true
			return fmt.Errorf("%w: %w", ErrFenced, err)
		}
		return fmt.Errorf("claim the fence of cluster slot %d: %w", s, err)
	}
	prefix := strconv.Itoa(s) + "/"
	for id, ref := range h.delivered {
		if strings.HasPrefix(ref, prefix) {
			delete(h.delivered, id)
		}
	}
	for ref := range h.fields {
		if strings.HasPrefix(ref, prefix) {
			delete(h.fields, ref)
		}
	}
	for i := 0; i+1 < len(rec); i += 2 {
		ref := slotRef(s, rec[i])
		for v := range strings.SplitSeq(rec[i+1], ",") {
			id, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				continue // not ours: a field written by hand
			}
			h.delivered[id] = ref
			h.fields[ref]++
		}
		if h.fields[ref] == 0 {
			h.clear = append(h.clear, ref)
		}
	}
	h.forgetSettling()
	h.claimed[s] = true
	return nil
}

// errCrossSlot refuses an op whose keys are in several cluster slots: no
// script can run it atomically. No target builds one.
const errCrossSlot = replyError("CROSSSLOT the job's keys are in different Redis Cluster slots: it cannot be pushed atomically")

// pushCluster runs u's ops as one script call per slot, each with the fence
// check and the record of its part under field.
func (h *Handoff) pushCluster(ctx context.Context, u *Unit, field string) error {
	var order []int
	groups := make(map[int][]int)
	for i := range u.ops {
		s, _, _ := u.opSlot(i)
		if s < 0 {
			u.ops[i].Err = errCrossSlot
			continue
		}
		if _, ok := groups[s]; !ok {
			order = append(order, s)
		}
		groups[s] = append(groups[s], i)
	}
	clear(h.idSlot)
	for _, s := range order {
		if err := h.pushPart(ctx, u, field, s, groups[s]); err != nil {
			// Parts pushed before are in their slots' records: read
			// them all again, under a new token, before the next push.
			h.token, h.reload = "", true
			delete(h.parts, field)
			if strings.HasPrefix(err.Error(), "FENCED") {
				return fmt.Errorf("%w: %w", ErrFenced, err)
			}
			return err
		}
	}
	return nil
}

// pushPart runs the ops of u in slot s in one script call.
func (h *Handoff) pushPart(ctx context.Context, u *Unit, field string, s int, ops []int) error {
	k := h.keys.slot(s)
	keys := []string{k.Fence, k.Record}
	args := []any{h.token, field, 0}
	var rest []string
	for _, ref := range h.clear {
		if rs, f := parseSlotRef(ref); rs == s {
			args = append(args, f)
		} else {
			rest = append(rest, ref)
		}
	}
	args[2] = len(args) - 3
	for _, i := range ops {
		_, ks, as := u.opSlot(i)
		keys = append(keys, ks...)
		args = append(args, as...)
	}
	reply, err := handoffScript.Run(ctx, h.rdb, keys, args...).Slice()
	if err != nil {
		return err
	}
	h.clear = append(h.clear[:0], rest...)
	// The script wrote the field in this slot's record, whatever it
	// delivered.
	h.parts[field] = append(h.parts[field], s)
	if err := u.settle(ops, reply); err != nil {
		return err
	}
	for _, i := range ops {
		if op := &u.ops[i]; op.Err == nil {
			for _, id := range op.IDs {
				h.idSlot[id] = s
			}
		}
	}
	return nil
}

// tidyCluster deletes the record fields in h.clear, slot by slot.
func (h *Handoff) tidyCluster(ctx context.Context) error {
	bySlot := make(map[int][]string)
	for _, ref := range h.clear {
		s, f := parseSlotRef(ref)
		bySlot[s] = append(bySlot[s], f)
	}
	for s, fields := range bySlot {
		if err := h.rdb.HDel(ctx, h.keys.slot(s).Record, fields...).Err(); err != nil {
			h.clear = h.clear[:0]
			for s, fields := range bySlot {
				for _, f := range fields {
					h.clear = append(h.clear, slotRef(s, f))
				}
			}
			return fmt.Errorf("delete handoff records: %w", err)
		}
		delete(bySlot, s)
	}
	h.clear = h.clear[:0]
	return nil
}

// Slot returns the cluster slot of op i of u, or -1 when its keys are in
// several: such an op is refused (CROSSSLOT) on a cluster.
func (u *Unit) Slot(i int) int {
	s, _, _ := u.opSlot(i)
	return s
}
