package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
)

// drainLoop drains every time it is woken, until a claim comes back empty
// with the relay idle, and retries after a failure with capped exponential
// backoff. It returns nil when ctx ends, or an error retrying cannot fix.
func (r *Relay) drainLoop(ctx context.Context, pool *pgxpool.Pool, wake <-chan struct{}, g *gate) error {
	log := r.log.Named("drain")
	var bufs [2][]stagedJob
	// The drain holds drainMu while it works, and lets it go while it
	// waits to be woken: a hot fleet's shared drain (fleetdrain.go) takes
	// the schema's batches meanwhile. When the loop ends it waits for a
	// shared drain in flight to finish this schema's batch, as finish
	// does its own.
	//
	// The shared drain and the fleet's poll read the schema's mark
	// (r.mark): it is this leadership's from before the shared drain may
	// take a batch (drainOpen) until after it no longer can, and nil (the
	// index's start) between leaderships. A mark left from the last
	// leadership would be older than what another leader did since.
	tidyLater, markLater := make(chan struct{}, 1), make(chan struct{}, 1)
	defer func() {
		r.drainMu.Lock()
		r.drainOpen = false
		r.mark.Store(nil)
		r.drainMu.Unlock()
	}()
	locked := false
	unlock := func() {
		if locked {
			r.drainMu.Unlock()
			locked = false
		}
	}
	defer unlock()
	// Commits made while no relay was idle (none leading, or a leader
	// that died or stepped down) did not notify: the drain at start sees
	// those that ended, and the checks of g.late the rest.
	if err := g.inProgress(ctx, false); err != nil {
		return err
	}
	defer g.late.stop()
	// Where claims start (lowwater.go), and its probe, for this leadership.
	mark, err := r.markFor(ctx, pool)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	r.drainMu.Lock()
	r.mark.Store(mark)
	r.drainOpen, r.tidyLater, r.markLater, r.sharedEnd = true, tidyLater, markLater, nil
	r.drainMu.Unlock()
	var probeFound chan struct{} // nil, never ready, without the mark
	if mark != nil {
		probeFound = make(chan struct{}, 1)
		pctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); r.probe(pctx, pool, mark, probeFound) }()
		defer func() { cancel(); <-done }()
	}
	// due wakes the drain when the earliest future run_at is due, for a
	// target with no scheduler (dueOnly).
	due := time.NewTimer(time.Hour)
	due.Stop()
	defer due.Stop()
	var dueC <-chan time.Time
	// paused wakes the drain while backpressure holds jobs back.
	paused := time.NewTimer(time.Hour)
	paused.Stop()
	defer paused.Stop()
	var pausedC <-chan time.Time
	// tidy tidies the handoff record tidyEvery after the last drain that
	// did not (TidyDue).
	tidy := time.NewTimer(time.Hour)
	tidy.Stop()
	defer tidy.Stop()
	var tidyC <-chan time.Time
	// confirm wakes the drain to claim from the low-water mark a while
	// after a shared drain claimed from the schema (markLater). The mark
	// moves only when a claim confirms a candidate an earlier claim made
	// (lowwater.go), and a shared claim reads S once a second at most: the
	// last rows a shared drain took may be under no candidate, or under
	// one that no later claim comes to confirm until the schema's next
	// commit, and the mark would stay below them meanwhile, every claim
	// walking their dead index entries while a long transaction holds the
	// horizon. The drain's claim (empty, most often) makes a candidate
	// past them, and confirms it at once when no older transaction is in
	// progress; while candidates wait (one is), it claims again,
	// confirmWait apart, doubling from markConfirmFirst up to
	// markConfirmLast. Each shared drain starts it over, so a schema that
	// stays in shared drains pays nothing for it.
	confirm := time.NewTimer(time.Hour)
	confirm.Stop()
	defer confirm.Stop()
	var confirmC <-chan time.Time
	var confirmWait time.Duration
	for {
		unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-tidyC:
			tidyC = nil
			r.drainMu.Lock()
			locked = true
			r.tidy(ctx, pool, log)
			if r.hooks.tidied != nil {
				r.hooks.tidied(false)
			}
			continue
		case <-tidyLater:
			// A shared drain left the handoff record to tidy later.
			tidy.Reset(tidyEvery)
			tidyC = tidy.C
			continue
		case <-markLater:
			confirmWait = markConfirmFirst
			confirm.Reset(confirmWait)
			confirmC = confirm.C
			continue
		case <-confirmC:
			confirmC = nil
			if confirmWait > markConfirmFirst && !mark.unconfirmed() {
				continue
			}
			if confirmWait *= 2; confirmWait <= markConfirmLast {
				confirm.Reset(confirmWait)
				confirmC = confirm.C
			}
			if r.hooks.markConfirm != nil {
				r.hooks.markConfirm()
			}
		case <-wake:
		case <-probeFound:
		case <-pausedC:
			pausedC = nil
		case <-dueC:
		case <-g.late.C():
			select {
			case <-wake:
				// A wake-up is waiting: its drain sees what ended, and
				// the rest are checked later.
				g.late.arm(time.Now())
			default:
				ended, err := g.checkLate(ctx)
				if err != nil {
					return err
				}
				if !ended {
					continue
				}
				r.metrics.wakeLate.Inc()
			}
		}
		r.drainMu.Lock()
		locked = true
		if err := r.sharedEnd; err != nil {
			return err // counted by Run's loop
		}
		if over, _ := r.bp.memory(ctx, r); over {
			// Backpressure: claim nothing while Redis is nearly full, and
			// stay awake meanwhile, so that commits do not notify a relay
			// that would not drain them (the retry does).
			if err := g.wake(ctx); err != nil {
				return err
			}
			paused.Reset(pausedRetry)
			pausedC = paused.C
			continue
		}
		listens := r.listens.Load()
		for attempt := 0; ; {
			err := r.drain(ctx, pool, &bufs, g, wake, log)
			if err == nil {
				g.idleAt = time.Now()
				r.state.drained()
				r.bp.drainEnded()
				if attempt > 0 {
					log.Info("batch succeeded after retries", zap.Int("attempts", attempt+1))
				}
				break
			}
			if isFatal(err) || errors.Is(err, errLostLock) || errors.Is(err, errFenced) {
				return err // counted by Run's loop
			}
			if ctx.Err() != nil {
				return nil
			}
			r.metrics.batchFailed(err)
			// Awake while it cannot push (Redis down or hung): commits
			// need not notify a relay that would not drain them; the retry
			// does, and goes idle once it has drained.
			if err := g.wake(ctx); err != nil {
				return err
			}
			attempt++
			wait := backoff(attempt, r.cfg.MaxBackoff)
			level := zap.WarnLevel
			if isRedisRefusal(err) {
				level = zap.ErrorLevel // credentials or DB changed: needs an operator
			}
			if ce := log.Check(level, "batch failed, retrying"); ce != nil {
				ce.Write(zap.Error(err), zap.Int("attempt", attempt), zap.Duration("wait", wait))
			}
			if !sleep(ctx, wait) {
				return nil
			}
		}
		if r.handoff.TidyDue() {
			r.tidy(ctx, pool, log)
			if r.hooks.tidied != nil {
				r.hooks.tidied(true)
			}
		} else {
			// TidyEvery after the last drain: while drains keep coming,
			// their pushes delete the record fields done with.
			tidy.Reset(tidyEvery)
			tidyC = tidy.C
		}
		if r.dueOnly {
			var again bool
			if dueC, again = r.armDue(ctx, pool, due, mark, log); again {
				trySendWakeup(probeFound) // a row below the mark came due
			}
		}
		if r.bp.any() {
			paused.Reset(pausedRetry)
			pausedC = paused.C
		}
		g.paused = r.bp.any()
		r.heldBack.Store(g.paused) // a hot fleet's poll leaves it out

		if r.hooks.idle != nil {
			r.hooks.idle(listens)
		}
	}
}

// tidy tidies the handoff record (handoff.tidy); a failure leaves the
// fields for a later tidy.
func (r *Relay) tidy(ctx context.Context, pool *pgxpool.Pool, log *zap.Logger) {
	r.tidyWith(ctx, pool, log, func() (uint64, uint64, error) {
		return r.walPositions(ctx, pool)
	})
}

// tidyWith is tidy, with wal reading the WAL's positions when no delivered
// row waits (then only the flush position is used, and any read after the
// batches' commits will do: a hot fleet's shared drain reads it once for
// all its schemas, sharedWAL).
func (r *Relay) tidyWith(ctx context.Context, pool *pgxpool.Pool, log *zap.Logger, wal func() (uint64, uint64, error)) {
	if r.handoff.Delivering() {
		wal = func() (uint64, uint64, error) { return r.walPositions(ctx, pool) }
	}
	if err := r.handoff.Tidy(ctx, func(ids []int64) ([]int64, error) {
		return r.stillStaged(ctx, pool, ids)
	}, wal); err != nil && ctx.Err() == nil {
		log.Warn("could not tidy the handoff record", zap.Error(err))
	}
}

// claimed is a batch of rows deleted by its open transaction, on conn.
type claimed struct {
	conn  *pgxpool.Conn // nil when the claim found nothing (and committed)
	jobs  []stagedJob
	from  int64 // the claim took ids above this
	start time.Time
	// base: the claim started at the low-water mark (or the index's
	// start), not after a batch's last id. alone: no other batch of the
	// relay was in flight. clean: it skipped no ids and left out no queue.
	base, alone, clean bool
	mark               markRead // what it read for the mark (lowwater.go)
	lowered            uint64   // the mark's lowerings when it began
}

// qualifies reports whether the claim can confirm the mark's candidates
// once its batch commits with nothing put back (lowwater.go).
func (c claimed) qualifies() bool {
	return c.base && c.alone && c.clean && c.mark.present
}

// drain drains batch after batch until a claim finds nothing while the
// relay is idle.
//
// From the second batch on, the relay marks itself awake (see gate): jobs
// are flowing, and commits need not NOTIFY while it keeps claiming. So it
// does from the first batch when the last drain ended less than lingerFor
// ago: commits arrive that often, and each one notifying would serialize
// them on PostgreSQL's notify lock, so slowly that no drain would ever find
// a second batch. When a claim comes back empty it goes idle, notes the
// transactions in progress (see gate.sleep), and claims once more; only an
// empty claim after that ends the drain. A drain that is idle and found
// one job ends there, unless a wake-up is already waiting: a commit since
// then has notified, or will (see the end of the loop).
//
// PostgreSQL is the bottleneck, so while a full batch is pushed, deleted and
// committed, the next is already being claimed on a second connection: its
// claim skips the rows the first batch holds locked. Batches are still
// pushed one after another, in id order. Rows a batch left staged (deferred
// by Redis: OOM, READONLY) are skipped by the rest of this drain and retried
// on the next; poison rows leave the table for staged_jobs_dead.
//
// A claim after a full batch starts after that batch's last id: an index
// scan from the table's start would step over every row deleted since the
// last vacuum, and slow a long drain down as it goes. Ids are not commit
// order, so a lower id can commit later: every claim after a short batch,
// and at least one a second, scans from the start.
func (r *Relay) drain(ctx context.Context, pool *pgxpool.Pool, bufs *[2][]stagedJob, g *gate, wake <-chan struct{}, log *zap.Logger) error {
	// Poison rows a source left staged, and rows backpressure holds back.
	if !g.awake.Load() && g.heldAwake() {
		// The fleet runs hot, or the listener lost its session: stop the
		// commits' notifications now.
		if err := g.wake(ctx); err != nil {
			return err
		}
	}
	skip := slices.Concat(r.poisoned, r.bp.drainStarts())
	r.excluded = r.bp.excluded()
	fullScan, lastFound := time.Now(), time.Now()
	var rate flowRate
	claimFromStart := func(buf *[]stagedJob, look *behindLook) (claimed, error) {
		fullScan = time.Now()
		return r.claim(ctx, pool, buf, skip, fromStart, true, look)
	}
	// A drain that starts idle may end idle, never passing through
	// gate.sleep: when a commit holds the schema's 'behind' lock (it did
	// not notify because another commit was notifying, 012 and 014), its
	// first claim reads the transactions in progress, in its round trip
	// and before its snapshot, for g.late. That commit has ended before
	// the claim (which then sees its row) or is listed (and drained when
	// it ends).
	var look *behindLook
	if !g.awake.Load() {
		look = &behindLook{schema: r.cfg.Schema}
	}
	cur, err := claimFromStart(&bufs[0], look)
	if err != nil {
		return err
	}
	if look != nil && len(look.xids) > 0 {
		g.late.add(look.xids, time.Now())
	}
	for i := 1; ; i++ {
		if cur.conn == nil { // the claim found nothing
			switch {
			case !cur.base:
				// It claimed from a cursor: the rest of the table may
				// hold rows that committed late.
			case !g.awake.Load() || g.pinned || g.heldAwake():
				return nil
			case time.Since(lastFound) < rate.linger():
				// Jobs were flowing a moment ago: look again shortly
				// rather than go idle, which would make the next commits
				// NOTIFY (serialized by PostgreSQL's notify lock) and
				// wake the relay again at once.
				if !sleep(ctx, lingerStepAfter(time.Since(lastFound))) {
					return nil
				}
			default:
				if err := g.sleep(ctx); err != nil {
					return err
				}
			}
			if cur, err = claimFromStart(&bufs[i%2], nil); err != nil {
				return err
			}
			continue
		}
		lastFound = time.Now()
		rate.found(len(cur.jobs), lastFound)
		if r.found != nil && len(cur.jobs) < r.cfg.BatchSize {
			// A fleet's commits, for its heat (fleethot.go): a short
			// batch's jobs. A backlog's full batches are not a flow of
			// commits, and make no fleet run hot.
			r.found.Add(int64(len(cur.jobs)))
		}
		if i > 1 || lastFound.Sub(g.idleAt) < lingerFor {
			if err := g.wake(ctx); err != nil {
				cur.rollback(ctx)
				return err
			}
		}
		full := len(cur.jobs) == r.cfg.BatchSize
		var next claimed
		var nextErr error
		claimedNext := make(chan struct{})
		if full {
			from := cur.jobs[len(cur.jobs)-1].id
			if time.Since(fullScan) >= rescanInterval {
				from, fullScan = fromStart, time.Now()
			}
			go func() {
				defer close(claimedNext)
				next, nextErr = r.claim(ctx, pool, &bufs[i%2], skip, from, false, nil)
			}()
		} else {
			close(claimedNext)
		}
		awoke := g.awakeIfSlow(ctx) // a Redis that hangs: see slowPush
		left, err := r.finish(ctx, cur, log)
		if werr := awoke(); werr != nil && err == nil {
			err = werr
		}
		<-claimedNext
		switch {
		case err != nil:
			next.rollback(ctx)
			return err
		case nextErr != nil:
			return nextErr
		case ctx.Err() != nil:
			next.rollback(ctx) // claimed, not pushed: its rows stay staged
			return nil
		}
		skip = append(skip, left...)
		for _, id := range left {
			r.mark.Load().lower(id) // put back: claims start below it
		}
		if !full && len(left) == 0 && cur.qualifies() {
			r.mark.Load().confirm(cur.mark.xmin, cur.lowered)
		}
		r.excluded = r.bp.leaveOut(r.excluded) // the claims that follow
		if r.bp.stop() {
			// Backpressure: the rest waits for the next drain
			// (backpressure.go), pausedRetry away at most. Stopped by
			// queues held back for their length, the relay goes idle
			// meanwhile, so that commits notify and wake it (a queue not
			// paused need not wait for the retry); the commits that saw
			// it awake are drained by that retry, or, if still in progress
			// now, as soon as they end (gate.sleep). Stopped because Redis
			// is nearly full, it stays awake, as the drain loop's own
			// memory check keeps it: every queue is paused, and a commit's
			// notification would only wake a relay that pushes nothing.
			next.rollback(ctx)
			if r.bp.memOver {
				return nil
			}
			g.paused = true
			// Before sleep takes the idle lock: a fleet going hot leaves
			// the locks of a schema held back alone (holdAwake).
			r.heldBack.Store(true)
			return g.sleep(ctx)
		}
		if !full && g.hot() {
			// The fleet's hot poll finds what comes next, with every
			// other schema's, in one statement: no claim to confirm.
			return nil
		}
		if !full && len(cur.jobs) == 1 && !g.awake.Load() && len(wake) == 0 {
			// Idle, a batch of one job (not full: a full batch's next
			// claim is already in flight), and no commit has notified
			// since this drain was woken: a claim now would most likely
			// come back empty, two round trips on a drain session and a pace
			// for each job where commits are sparse, as in each schema of
			// a fleet (issue 23). Nothing is missed: a commit that
			// has committed since the claim either notified, and its
			// wake-up drains again, or did not because another commit of
			// the schema was notifying, and that one's wake-up drains
			// again, whose look sees it (sql/014_wake_behind.sql). Where
			// commits come often, a wake-up is waiting or the claim found
			// several, and the drain claims again, which goes awake
			// (pace, linger), as before: with 16 writers in a closed loop
			// on one schema, 0.01-0.04% of the commits notified, with
			// this and without it.
			return nil
		}
		if !full {
			// Pace: the more jobs a short batch found, the longer until the
			// next claim, so that a busy app's commits meet fewer, larger
			// batches (each batch costs PostgreSQL a transaction on the
			// pages the app is inserting into).
			pace := min(max(time.Duration(len(cur.jobs))*pacePerJob, rate.minPace()), rate.maxPace())
			if !sleep(ctx, pace-time.Since(cur.start)) {
				return nil
			}
			if next, err = claimFromStart(&bufs[i%2], nil); err != nil {
				return err
			}
		}
		cur = next
	}
}

// markConfirmFirst is how long after a shared drain claimed from a
// schema its own drain claims from the low-water mark to move it past
// those rows (drainLoop's confirm); markConfirmLast is the longest wait
// between such claims while candidates wait: 2 s after the shared drain,
// then 4, 8, 16, 32 and 64 s after the claim before, six claims at most,
// the later ones only while an older transaction elsewhere keeps a
// candidate from being confirmed.
const (
	markConfirmFirst = 2 * time.Second
	markConfirmLast  = 32 * markConfirmFirst
)

// fromStart is the cursor of a claim from the table's start: any id, even
// zero or negative in a hand-made table. Passed to claim, it means the
// low-water mark (lowwater.go), which is the table's start without it.
const fromStart int64 = math.MinInt64

// rescanInterval is the longest a drain claims from a cursor before it
// scans from the table's start again for rows that committed late.
const rescanInterval = time.Second

// claim begins a transaction and claims up to BatchSize committed rows with
// ids above from into (*buf)[:0], in one round trip. When there are none it ends the
// transaction and returns a claimed with a nil conn. from fromStart claims
// from the low-water mark; alone says that no other batch is in flight.
// look, if not nil, gets the transactions in progress if a commit holds
// the schema's 'behind' lock, read in the same round trip before the
// claim takes its snapshot (lookBehindSQL).
func (r *Relay) claim(ctx context.Context, pool *pgxpool.Pool, buf *[]stagedJob, skip []int64, from int64, alone bool, look *behindLook) (claimed, error) {
	c := claimed{from: from, start: time.Now(), alone: alone, base: from == fromStart,
		clean: len(skip) == 0 && len(r.excluded) == 0}
	sql, mark, w := r.sql.claim, (*markRead)(nil), r.mark.Load()
	if w != nil {
		sql, mark = r.sql.claimMark, &c.mark
		if c.base {
			from, c.lowered = w.from()
			c.from = from
			w.lastFrom.Store(from)
		}
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return c, fmt.Errorf("claim batch: %w", err)
	}
	args := append(slices.Clip(r.claimArgs), r.excluded) // see claimSQL
	*buf, err = claimBatchMark(ctx, conn.Conn(), sql, r.src.scanner(), r.cfg.BatchSize, skip, from, *buf, mark, look, args...)
	if err != nil {
		claimed{conn: conn}.rollback(ctx)
		return c, err
	}
	w.noted(c.mark)
	if r.hooks.claimed != nil {
		r.hooks.claimed(len(*buf))
	}
	if len(*buf) == 0 {
		_, err := conn.Exec(ctx, "COMMIT")
		conn.Release()
		if err == nil && c.qualifies() {
			w.confirm(c.mark.xmin, c.lowered)
		}
		return c, err
	}
	c.conn, c.jobs = conn, *buf
	return c, nil
}

// rollback ends the batch's transaction, which puts its rows back, and
// releases its connection (the pool drops a connection left in a
// transaction, so a failed rollback leaks nothing).
func (c claimed) rollback(ctx context.Context) {
	if c.conn != nil {
		_ = withTimeout(ctx, time.Second, func(ctx context.Context) error {
			_, err := c.conn.Exec(ctx, "ROLLBACK")
			return err
		})
		c.conn.Release()
	}
}

// finish pushes a claimed batch, moves its poison rows to staged_jobs_dead,
// puts back the rows Redis deferred, and commits, which makes the claim's
// delete of the pushed rows final. Any failure rolls the transaction back:
// the rows stay staged, and the handoff record (internal/handoff) says which of
// them the push delivered, so that they are deleted, not pushed again, when
// claimed next. left lists the rows it left staged (deferred by Redis, and
// logged).
//
// A row is poison when it can never be pushed: the payload builder rejects
// it (a NULL column, options that override a column), its payload is over
// MaxPayloadBytes, or Redis refused it with an error that waiting cannot fix
// (WRONGTYPE, see handoff.Permanent). It moves, unchanged, to the dead-letter
// table in this batch's transaction, and is logged once, at error, after
// the commit: the rows behind it flow on. A source with no dead-letter
// table (the gem's, SourceSidekiqStagedPush) puts it back unchanged
// instead, and the relay skips it for the rest of its leadership.
//
// Once claimed, a batch is not cut short by ctx: when ctx ends it gets
// ShutdownTimeout to finish, so a stop between push and delete does not
// leave work for the next leader.
func (r *Relay) finish(ctx context.Context, b claimed, log *zap.Logger) (left []int64, err error) {
	bctx, cancel := batchContext(ctx, r.cfg.ShutdownTimeout)
	defer cancel()
	defer func() {
		if err != nil {
			b.rollback(ctx)
		}
	}()

	l := &landing{b: b, span: r.tracer.start(bctx, b)} // span nil: tracing off
	if l.span != nil {
		defer func() { r.tracer.end(l.span, &l.res, l.buried, err) }()
	}
	if err := r.awaitStandby(bctx, b.conn, log); err != nil {
		return nil, err
	}
	if err := r.pushLanding(bctx, l, log); err != nil {
		return nil, err
	}
	// Put back what Redis deferred, bury the poison and commit, in one
	// round trip.
	batch := &pgx.Batch{}
	r.queueLanding(batch, l)
	if r.cfg.WaitForStandby || r.syncStandby {
		// The next batch waits for the standbys to have this commit:
		// flush it now, not when the WAL writer next wakes (standby.go).
		batch.Queue("SET LOCAL synchronous_commit = local")
	}
	batch.Queue("COMMIT")
	// In the same round trip, after the COMMIT: how far the WAL is
	// flushed, here and on the standbys, and a position past the commit's
	// record. The handoff record keeps this batch until the flush passes
	// it (internal/handoff, standby.go). Within walFresh of the last read
	// of them all, the insert position alone, and the flush read then.
	walRead := r.queueWAL(batch, time.Now())
	if err := b.conn.SendBatch(bctx, batch).Close(); err != nil {
		// The push delivered these rows; the delete may not have
		// committed. Claimed again, they are deleted, not pushed.
		r.handoff.Uncommitted(l.res.field, l.res.pushed)
		return nil, fmt.Errorf("commit: %w", err)
	}
	b.conn.Release()
	wal, flush := walRead()
	r.landed(l, wal, flush, log)
	return l.left, nil
}

// batchContext is the context of a claimed batch's push and commit: not
// cancelled with ctx, but grace after ctx ends (ShutdownTimeout), so that
// a stop between push and delete does not leave work for the next leader.
// cancel releases it.
func batchContext(ctx context.Context, grace time.Duration) (bctx context.Context, cancel func()) {
	bctx, cancelB := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() {
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-t.C:
			cancelB()
		case <-bctx.Done():
		}
	})
	return bctx, func() { stop(); cancelB() }
}

// landing is a claimed batch from its push to the end of its commit: what
// the push did with each row, and what the commit is to put back and bury.
type landing struct {
	b        claimed
	span     trace.Span // nil: tracing off
	res      pushResult
	pushedAt time.Time
	left     []int64     // rows put back: deferred by Redis, and poison a source does not bury
	held     []int64     // of left, those backpressure held back
	dead     []stagedJob // poison rows, with their reasons
	reasons  []string
	kept     []int64 // poison rows put back (a source that does not bury), not buried
	buried   int
}

// pushLanding pushes l's batch and sorts its rows (see finish). An error
// after the push has told the handoff record that the pushed rows may not
// be deleted.
func (r *Relay) pushLanding(ctx context.Context, l *landing, log *zap.Logger) error {
	l.pushedAt = time.Now()
	res, err := r.push(ctx, l.b.jobs, l.pushedAt)
	return r.landPushed(ctx, l, res, err, log)
}

// landPushed is pushLanding once the push returned res or err.
func (r *Relay) landPushed(ctx context.Context, l *landing, res pushResult, err error, log *zap.Logger) error {
	b := l.b
	l.res = res
	if err != nil {
		return targetError{err}
	}
	r.tracer.event(l.span, "pushed")
	logDroppedTraces(log, b.jobs)
	for _, rj := range res.deferred {
		l.left = append(l.left, rj.id)
		if rj.held {
			l.held = append(l.held, rj.id) // logged once, by the pause (backpressure.go)
			continue
		}
		log.Warn("job refused by Redis, left staged", zap.Int64("id", rj.id), zap.String("reason", rj.reason), traceIDOf(b.jobs, rj.id))
	}
	r.bp.batchHeld(len(l.held), len(b.jobs))
	if poison := slices.Concat(res.rejected, res.refused); len(poison) > 0 {
		l.dead, l.reasons = poisoned(b.jobs, poison)
	}
	if r.hooks.afterPush != nil {
		if err := r.hooks.afterPush(ctx); err != nil {
			r.handoff.Uncommitted(res.field, res.pushed)
			return fmt.Errorf("after push: %w", err)
		}
	}
	// A source that does not bury poison (the gem's table, which has no
	// dead-letter table) puts it back with the deferred rows; this
	// leadership skips it from now on.
	if len(l.dead) > 0 && !r.src.buries() {
		for _, j := range l.dead {
			l.kept = append(l.kept, j.id)
		}
		l.left = append(l.left, l.kept...)
	}
	return nil
}

// queueLanding queues, in the batch that commits l, the statements that
// put back its rows left staged and bury its poison.
func (r *Relay) queueLanding(batch *pgx.Batch, l *landing) {
	if len(l.left) > 0 {
		sql, args := r.src.reinsert(unpushed(l.b.jobs, l.left))
		batch.Queue(sql, args...)
	}
	if len(l.dead) > 0 && l.kept == nil {
		batch.Queue(r.sql.bury, buryArgs(l.dead, l.reasons)...)
	}
}

// landed records l once its transaction has committed, at WAL position
// wal with the WAL flushed to flush: the handoff record, the holds of
// backpressure, the summary, and the poison's log lines.
func (r *Relay) landed(l *landing, wal, flush uint64, log *zap.Logger) {
	b, res := l.b, l.res
	r.tracer.event(l.span, "committed")
	r.handoff.Committed(res.field, res.redelivered, wal, flush)
	r.bp.hold(l.held) // once put back: a rolled-back batch's rows are not held
	l.buried = len(l.dead)
	if l.kept != nil {
		l.buried = 0
		r.poisoned = append(r.poisoned, l.kept...)
		r.summary.poisonKept(len(l.kept), len(r.poisoned))
	}
	r.summary.batch(b.jobs, func(id int64) bool {
		return slices.Contains(l.left, id) || slices.ContainsFunc(l.dead, func(j stagedJob) bool { return j.id == id })
	}, b.start, l.pushedAt, l.buried)
	for i := range l.dead {
		j := &l.dead[i]
		if l.kept != nil {
			log.Error("poison job left staged, skipped until the relay's next leadership", zap.Int64("id", j.id),
				zap.String("jid", j.jid), zap.String("queue", j.queue), zap.String("reason", l.reasons[i]), traceIDField(j))
			continue
		}
		log.Error("job dead-lettered", zap.Int64("id", j.id), zap.String("jid", j.jid),
			zap.String("queue", j.queue), zap.String("reason", l.reasons[i]), traceIDField(j))
	}
	if ce := log.Check(zap.DebugLevel, "batch drained"); ce != nil {
		ce.Write(
			zap.Int("count", len(res.pushed)),
			zap.Int("already_pushed", len(res.redelivered)),
			zap.Int("left_staged", len(res.deferred)),
			zap.Int("dead_lettered", l.buried),
			zap.Int("poison_left_staged", len(l.kept)),
			zap.Strings("queues", res.queues),
			zap.Int("scheduled", res.scheduled),
			zap.Int("skipped", res.skipped),
			zap.Duration("duration", time.Since(b.start)),
		)
	}
}

// poisoned returns the jobs named in poison, in batch order, each with its
// reason.
func poisoned(jobs []stagedJob, poison []rejectedJob) ([]stagedJob, []string) {
	reason := make(map[int64]string, len(poison))
	for _, p := range poison {
		reason[p.id] = p.reason
	}
	var out []stagedJob
	var reasons []string
	for _, j := range jobs {
		if why, ok := reason[j.id]; ok {
			out = append(out, j)
			reasons = append(reasons, why)
		}
	}
	return out, reasons
}

// unpushed returns the jobs whose ids are in left.
func unpushed(jobs []stagedJob, left []int64) []stagedJob {
	var out []stagedJob
	for _, j := range jobs {
		if slices.Contains(left, j.id) {
			out = append(out, j)
		}
	}
	return out
}
