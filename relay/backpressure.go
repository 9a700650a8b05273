package relay

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// Backpressure: jobs wait in PostgreSQL, not in a Redis that is filling up.
//
// Config.MaxQueueLength gives each op that pushes to a queue a length guard
// in the push script (internal/handoff): an op whose queue holds the limit or
// more runs nothing, and its rows are deferred, as rows Redis refused with
// an error waiting may fix are, and put back. A batch checks each queue
// once, before it pushes to it, so a queue overshoots the limit by at most
// one batch. A stream's length is what its slowest consumer group has not
// acknowledged (XINFO GROUPS' pending plus lag, Redis 7.0+): its XLEN counts
// the entries consumers took and acknowledged too, and would never fall.
// A stream with no group counts every entry (XLEN): readers without a
// group leave no trace of what they read.
//
// Config.RedisMaxMemoryRatio is checked in Go: INFO memory, read at most
// every memoryCheckEvery, and while used_memory / maxmemory is at or above
// the ratio no batch is claimed, and a batch claimed meanwhile is put back
// whole.
//
// A drain skips the rows it left staged, and every drain skips the rows
// held back for pausedRetry; after at most maxPausedBatches batches that
// only put rows back a drain ends. While anything is paused the drain loop
// drains again every pausedRetry, retrying the held rows, and the pause
// ends by itself when a push to the queue runs (or a drain finds none of
// its rows held back), or when the memory is below the ratio.

// The leader publishes what it pauses in Redis, in the hash of pausedKey,
// for stagedrain status (admin.ReadPaused) to show: a relay's own Status and
// /readyz answer only where it runs. The hash expires pausedTTL after its
// last write, and is written again every pausedRefresh while anything is
// paused, so the entries of a relay that died or stopped leading vanish by
// themselves; a pause that ends deletes its field. It is written at the
// start of each drain and before each push (with the memory check), only
// when the pauses changed or a refresh is due: while anything is paused
// the drain loop drains every pausedRetry. A failed write is logged at
// debug and retried after pausedRefresh: the pause itself goes on.
const (
	pausedTTL     = 10 * time.Second
	pausedRefresh = time.Second
)

// memoryCheckEvery is how often, at most, INFO memory is read.
const memoryCheckEvery = 500 * time.Millisecond

// pausedRetry is how long the drain loop waits, while a queue or Redis is
// paused, before it drains again (a commit's wake-up may come sooner).
const pausedRetry = 500 * time.Millisecond

// maxPausedBatches is how many batches in a row one drain may put back
// whole, for backpressure, before it ends: a paused queue's backlog is not
// claimed and put back all at once, each drain.
const maxPausedBatches = 4

// memoryQueue is the queue label of the memory pause: it holds every queue.
const memoryQueue = "*"

const (
	reasonQueueLength = "queue_length"
	reasonMemory      = "memory"
)

// backpressure is the drain's view of what is paused. It is used by the
// drain goroutine only.
type backpressure struct {
	maxLen int64
	ratio  float64
	gauge  *prometheus.GaugeVec
	log    *zap.Logger
	state  *state // Status().Paused

	memChecked time.Time
	memOver    bool
	memWhy     string

	paused map[string]string // queue -> reason, while paused
	// The rows held back since heldSince, and their queues: every drain
	// skips them for pausedRetry, so that a drain woken meanwhile (by a
	// commit, or a late one) does not claim them again.
	heldIDs   []int64
	held      map[string]bool
	heldSince time.Time
	// allHeld counts the batches in a row, in this drain, that put every
	// row back for backpressure.
	allHeld int
	// lookedAt is when a drain last claimed the rows of the queues paused
	// for their length, to see whether their queues had room again; the
	// drains in between leave them out (excluded).
	lookedAt    time.Time
	excludedNow map[string]bool

	// What pausedKey holds of this relay's pauses (pub.fields), when it
	// was last written, and whether the pauses changed since.
	pub struct {
		key     string // "" until the first write
		fields  map[string]string
		at      time.Time
		retryAt time.Time // after a failed write
		dirty   bool
	}
}

func newBackpressure(cfg Config, gauge *prometheus.GaugeVec, log *zap.Logger) *backpressure {
	return &backpressure{maxLen: cfg.MaxQueueLength, ratio: cfg.RedisMaxMemoryRatio, gauge: gauge, log: log,
		paused: make(map[string]string), held: make(map[string]bool), excludedNow: make(map[string]bool)}
}

// memory reports whether the memory ratio pauses pushes now, and why,
// reading INFO memory at most every memoryCheckEvery. A failed read pauses
// nothing: the push itself then fails, or succeeds. Then it publishes the
// pauses, if they changed or a refresh is due.
func (b *backpressure) memory(ctx context.Context, r *Relay) (bool, string) {
	over, why := b.checkMemory(ctx, r)
	b.publish(ctx, r)
	return over, why
}

// publish writes the pauses to pausedKey if they changed since the last
// write, or the last was pausedRefresh ago and something is paused.
func (b *backpressure) publish(ctx context.Context, r *Relay) {
	p := &b.pub
	now := time.Now()
	if now.Before(p.retryAt) || !p.dirty && (len(b.paused) == 0 || now.Sub(p.at) < pausedRefresh) {
		return
	}
	if p.key == "" {
		p.key = pausedKey(r.cfg.RedisNamespace, r.pgCfg.Database, r.cfg.Schema)
	}
	var gone []string
	for q := range p.fields {
		if _, ok := b.paused[q]; !ok {
			gone = append(gone, q)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err := r.cfg.Redis.TxPipelined(ctx, func(pipe redis.Pipeliner) error {
		if len(gone) > 0 {
			pipe.HDel(ctx, p.key, gone...)
		}
		if len(b.paused) > 0 {
			args := make([]any, 0, 2*len(b.paused))
			for q, reason := range b.paused {
				args = append(args, q, reason)
			}
			pipe.HSet(ctx, p.key, args...)
			pipe.PExpire(ctx, p.key, pausedTTL)
		}
		return nil
	})
	if err != nil {
		b.log.Debug("could not publish the paused queues", zap.String("key", p.key), zap.Error(err))
		p.retryAt = now.Add(pausedRefresh)
		return
	}
	p.fields, p.at, p.dirty = maps.Clone(b.paused), now, false
}

// checkMemory is memory's check of the memory ratio.
func (b *backpressure) checkMemory(ctx context.Context, r *Relay) (bool, string) {
	if b.ratio <= 0 {
		return false, ""
	}
	if time.Since(b.memChecked) < memoryCheckEvery {
		return b.memOver, b.memWhy
	}
	b.memChecked = time.Now()
	info, err := r.cfg.Redis.Info(ctx, "memory").Result()
	if err != nil {
		b.log.Debug("could not read INFO memory", zap.Error(err))
		return b.memOver, b.memWhy
	}
	used, max := infoField(info, "used_memory"), infoField(info, "maxmemory")
	b.memOver = max > 0 && float64(used) >= b.ratio*float64(max)
	if b.memOver {
		b.memWhy = fmt.Sprintf("BACKPRESSURE Redis used_memory %d is %.3f of maxmemory %d >= --redis-max-memory-ratio %v",
			used, float64(used)/float64(max), max, b.ratio)
		b.pause(memoryQueue, reasonMemory, b.memWhy)
	} else {
		b.memWhy = ""
		b.resume(memoryQueue, fmt.Sprintf("Redis used_memory %d of maxmemory %d is below --redis-max-memory-ratio %v", used, max, b.ratio))
	}
	return b.memOver, b.memWhy
}

// infoField reads an integer field of an INFO reply; 0 if absent.
func infoField(info, name string) int64 {
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

// pause marks queue paused for reason, with a warn line when it was not.
func (b *backpressure) pause(queue, reason, why string) {
	if _, ok := b.paused[queue]; ok {
		return
	}
	b.paused[queue] = reason
	b.pub.dirty = true
	b.state.setPaused(b.paused)
	b.gauge.WithLabelValues(queue, reason).Set(1)
	b.log.Warn("backpressure: pushes paused, jobs wait in PostgreSQL", zap.String("queue", queue),
		zap.String("reason", reason), zap.String("detail", why))
}

// resume ends queue's pause, with an info line, if it was paused.
func (b *backpressure) resume(queue, why string) {
	reason, ok := b.paused[queue]
	if !ok {
		return
	}
	delete(b.paused, queue)
	b.pub.dirty = true
	b.state.setPaused(b.paused)
	b.gauge.WithLabelValues(queue, reason).Set(0)
	b.log.Info("backpressure: pushes resumed", zap.String("queue", queue), zap.String("reason", reason), zap.String("detail", why))
}

// any reports whether anything is paused.
func (b *backpressure) any() bool { return len(b.paused) > 0 }

// drainStarts starts a drain: it returns the rows the drain is to skip,
// those held back less than pausedRetry ago; older ones are retried.
func (b *backpressure) drainStarts() []int64 {
	b.allHeld = 0
	if time.Since(b.heldSince) >= pausedRetry {
		clear(b.held)
		b.heldIDs = b.heldIDs[:0]
	}
	return b.heldIDs
}

// hold notes rows a batch held back.
func (b *backpressure) hold(ids []int64) {
	if len(ids) == 0 {
		return
	}
	if len(b.heldIDs) == 0 {
		b.heldSince = time.Now()
	}
	b.heldIDs = append(b.heldIDs, ids...)
}

// batchHeld notes that a batch of n rows put held of them back for
// backpressure.
func (b *backpressure) batchHeld(held, n int) {
	if held > 0 && held == n {
		b.allHeld++
	} else {
		b.allHeld = 0
	}
}

// stop reports whether the drain should end here for backpressure: Redis is
// nearly full, or maxPausedBatches batches in a row held every row back.
func (b *backpressure) stop() bool {
	return b.memOver || b.allHeld >= maxPausedBatches
}

// excluded starts a drain's claims: it returns the queues paused for their
// length, which the drain's claims leave out, so that the rows of other
// queues behind a long paused backlog flow (a claim by id would otherwise
// take the paused rows first, batch after batch, and put them back). Every
// pausedRetry one drain looks: it leaves none out until a batch finds a
// queue still full (leaveOut); its push finds whether a paused queue has
// room again. Never nil (the claims' text[] argument).
func (b *backpressure) excluded() []string {
	clear(b.excludedNow)
	out := []string{}
	if time.Since(b.lookedAt) >= pausedRetry {
		b.lookedAt = time.Now()
		return out
	}
	for q, reason := range b.paused {
		if reason == reasonQueueLength {
			out = append(out, q)
			b.excludedNow[q] = true
		}
	}
	return out
}

// leaveOut ends a look (see excluded) at the queues it found still full:
// it adds to out, the drain's exclusion list, the queues paused for their
// length whose rows a batch held back since they were last retried, and
// returns it. Called after each batch, so that only a drain's first
// batches (the one that found the queue full, and the one claimed
// meanwhile) take a paused queue's rows: a look that claimed from the
// table's start, every pausedRetry, would otherwise put back
// maxPausedBatches batches of a long paused backlog and end, and never
// reach the rows of other queues behind it.
func (b *backpressure) leaveOut(out []string) []string {
	for q := range b.held {
		if b.paused[q] == reasonQueueLength && !b.excludedNow[q] {
			b.excludedNow[q] = true
			out = append(out, q)
		}
	}
	return out
}

// drainEnded ends the queue-length pauses of queues whose rows no drain
// held back since the rows were last retried: the drains claimed all there
// were, and pushed them. A queue this drain left out stays paused.
func (b *backpressure) drainEnded() {
	for q, reason := range b.paused {
		if reason == reasonQueueLength && !b.held[q] && !b.excludedNow[q] {
			b.resume(q, "no job of the queue was held back")
		}
	}
}

// pushed notes the outcome of a batch's ops: those a length guard stopped
// pause their queue, those that ran resume theirs.
func (b *backpressure) pushed(ops []handoff.Op) {
	if b.maxLen <= 0 {
		return
	}
	for i := range ops {
		op := &ops[i]
		switch {
		case op.Limit <= 0 || op.IDs == nil:
		case op.Over:
			b.held[op.Queue] = true
			b.pause(op.Queue, reasonQueueLength, op.Err.Error())
		case op.Err == nil:
			b.resume(op.Queue, fmt.Sprintf("%s held fewer than --max-queue-length %d", op.LenKey, op.Limit))
		}
	}
}

// reset forgets every pause when leadership ends: pauses are the leader's
// view of Redis, and a relay that does not lead pauses nothing (its
// gauges go to 0, Status().Paused to nil). The next leader, this relay
// again or another, finds them anew at its first push.
func (b *backpressure) reset() {
	for q, reason := range b.paused {
		b.gauge.WithLabelValues(q, reason).Set(0)
	}
	clear(b.paused)
	clear(b.held)
	clear(b.excludedNow)
	b.lookedAt = time.Time{}
	b.heldIDs = b.heldIDs[:0]
	b.memChecked, b.memOver, b.memWhy, b.allHeld = time.Time{}, false, "", 0
	b.state.setPaused(nil)
}
