package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// A wake-up is a token in a channel of capacity 1: any number of
// notifications, polls and reconnects that arrive while a drain runs fold
// into one more drain after it, and none is ever lost.
func trySendWakeup(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// poll wakes the drain every jittered interval until ctx ends: the fallback
// that makes a lost notification cost latency, never a job. It counts each
// wake-up in polls.
func poll(ctx context.Context, interval time.Duration, wake chan<- struct{}, polls prometheus.Counter) {
	for sleep(ctx, jitter(interval)) {
		polls.Inc()
		trySendWakeup(wake)
	}
}

// armDue sets due to fire when the earliest future run_at of staged_jobs
// is due, or after the poll interval if that is sooner (the poll wakes the
// drain then anyway, and the next drain arms due again), and returns its
// channel; nil when no row waits for its run_at. For a target with no
// scheduler, whose claim skips rows not yet due: without it, a job due in
// 200ms would wait for the next poll. PostgreSQL computes the wait from
// its own clock, the one the claim's run_at <= now() reads.
func (r *Relay) armDue(ctx context.Context, pool *pgxpool.Pool, due *time.Timer, log *zap.Logger) <-chan time.Time {
	var us *int64
	if err := pool.QueryRow(ctx, r.sql.nextDue).Scan(&us); err != nil {
		if ctx.Err() == nil {
			log.Warn("could not read the next run_at; the poll wakes for it", zap.Error(err))
		}
		return nil
	}
	if us == nil {
		return nil
	}
	due.Reset(min(time.Duration(*us)*time.Microsecond, r.cfg.PollInterval))
	return due.C
}

// gate tells committing transactions whether to NOTIFY (see
// sql/003_wake_gate.sql): while the relay holds the schema's "awake"
// advisory lock, commits do not notify, since the relay is draining and will
// find their rows by itself. Notifying commits are serialized by
// PostgreSQL's notify lock; a relay that stays awake while jobs flow keeps
// that cost off the app.
//
// Going idle, the relay releases "awake", then takes and releases "barrier",
// which waits for every commit that saw it awake (they hold "barrier" shared
// until their COMMIT is done), and then drains once more: no commit is left
// without either a notification or a drain that sees it.
//
// The locks live on the leader's lock connection, so they go when
// leadership goes. In poll-only mode the relay is awake for good (pinned):
// no commit notifies, and the fallback poll does all the waking.
//
// A relay with Config.Queues holds the locks of its queues instead
// ("awake:<queue>" and "barrier:<queue>", sql/006_queue_gate.sql): a
// schema-wide "awake" would keep commits to other groups' queues from
// notifying their idle relays.
type gate struct {
	mu          *sync.Mutex // guards conn, shared with keepLock
	conn        *pgx.Conn
	awakeKeys   []string // the schema's lock, or one per queue of Config.Queues
	barrierKeys []string
	awake       bool
	pinned      bool          // poll-only: never goes idle
	idleAt      time.Time     // when the relay last went idle, or a drain ended
	timeout     time.Duration // bounds each statement: lock_timeout plus the lock connection's query timeout
}

// Each gate lock has 16 shards (two-key advisory locks: hashtext(name),
// shard); a committing backend uses shard pg_backend_pid() % 16.
const (
	// Every shard, in order. A lock_timeout part way leaves the shards
	// before it held, which the relay treats as awake (see wake).
	// Each lock of $1 in turn.
	gateLockSQL = `SELECT pg_advisory_lock(hashtext(k), s) FROM unnest($1::text[]) k, generate_series(0, 15) s`
	// Unlocking a shard not held only raises a WARNING.
	gateUnlockSQL = `SELECT pg_advisory_unlock(hashtext(k), s) FROM unnest($1::text[]) k, generate_series(0, 15) s`
	// Waits for the commits holding each shard shared, holding none.
	gateBarrierSQL = `SELECT pg_advisory_lock(hashtext(k), s), pg_advisory_unlock(hashtext(k), s) FROM unnest($1::text[]) k, generate_series(0, 15) s`
)

func awakeLockName(schema string) string   { return "stagedrain-awake:" + schema }
func barrierLockName(schema string) string { return "stagedrain-barrier:" + schema }

// gateLockNames are the gate's lock names for a relay of queues, or of
// all queues when queues is empty.
func gateLockNames(schema string, queues []string) (awake, barrier []string) {
	if len(queues) == 0 {
		return []string{awakeLockName(schema)}, []string{barrierLockName(schema)}
	}
	for _, q := range queues {
		awake = append(awake, awakeLockName(schema)+":"+q)
		barrier = append(barrier, barrierLockName(schema)+":"+q)
	}
	return awake, barrier
}

// wake marks the relay awake. If commits that decided to notify hold a
// shard of "awake" past the lock connection's lock_timeout, the shards
// before it are held and the rest are not: the relay counts as awake (its
// sleep releases them all and waits at the barrier), and commits on the
// shards not held go on notifying.
func (g *gate) wake(ctx context.Context) error {
	if g.awake {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	err := withDeadline(ctx, g.timeout, func(ctx context.Context) error {
		_, err := g.conn.Exec(ctx, gateLockSQL, g.awakeKeys)
		return err
	})
	if err != nil && !isLockTimeout(err) {
		return fmt.Errorf("%w: mark awake: %w", errLostLock, err)
	}
	g.awake = true
	return nil
}

// sleep marks the relay idle and waits (at most lock_timeout) until every
// commit that saw it awake is done, so that the drain the caller runs next
// sees their rows. timedOut reports that the wait gave up: a commit holds
// the barrier for longer (it ran the trigger early, under SET CONSTRAINTS
// ALL IMMEDIATE), and its rows come with the fallback poll.
func (g *gate) sleep(ctx context.Context) (timedOut bool, err error) {
	if !g.awake || g.pinned {
		return false, nil
	}
	g.awake = false
	g.idleAt = time.Now()
	return g.barrier(ctx, true)
}

// barrier waits for the commits that saw the relay awake, releasing
// "awake" first when unlock is set; all in one round trip.
func (g *gate) barrier(ctx context.Context, unlock bool) (timedOut bool, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	b := &pgx.Batch{}
	if unlock {
		b.Queue(gateUnlockSQL, g.awakeKeys)
	}
	b.Queue(gateBarrierSQL, g.barrierKeys)
	err = withDeadline(ctx, g.timeout, func(ctx context.Context) error {
		return g.conn.SendBatch(ctx, b).Close()
	})
	if isLockTimeout(err) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("%w: mark idle: %w", errLostLock, err)
	}
	return false, nil
}

func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03" // lock_not_available
}
