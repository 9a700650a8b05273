package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// A hot fleet's shared drain. A fleet runs hot when its schemas' commits
// come often (fleethot.go), and then each commit's schema sees a trickle:
// over 200 schemas at 1,000 jobs/s, a hot poll every few milliseconds
// finds about ten schemas with a job each. Each schema drained on its own
// costs a transaction per job (a round trip that claims, the push, a
// round trip that commits), and at 200 schemas those transactions cost
// PostgreSQL and the relay more CPU than the app's own (issue 23).
//
// So the schemas a hot poll finds are drained together, in one
// transaction on one connection of the pool: one round trip claims a
// batch from each (each schema's own claim statement, in one pgx batch),
// each batch is pushed through its own schema's handoff record and fence,
// exactly as its own drain pushes it (each its own script, all of them in
// one Redis pipeline: one round trip, where a push of each took one and
// cost a tenth of the relay's CPU over 200 schemas), and one round trip
// puts back what Redis deferred, buries the poison, and commits them all.
// The handoff records make the shared commit as safe as a schema's own: a
// push that fails, or a commit that fails, rolls the whole transaction
// back, and each batch already pushed is marked delivered (handoff
// Uncommitted), so that when claimed again its rows are deleted, not
// pushed again. A schema whose handoff cannot share a pipeline (a Redis
// Cluster, whose push goes slot by slot; RedisWaitReplicas, whose WAIT
// needs the push's own connection) pushes on its own, at the same time as
// the pipeline.
//
// A cool fleet drains together the schemas its commits notify (the
// listener hands each notification to the shared drainer, notify,
// instead of waking the schema's drain): each schema sees a job now and
// then, and each job was a drain of its own, a wake-up, a claim, a push
// and a commit on one of the drain pool's sessions, which queued for them
// when the app's commits came close together over many schemas (at 1,000
// jobs/s over 200 schemas, p99 109-216ms). The shared drain takes every
// schema notified while the one before it ran. A schema whose gate is
// idle (a cool one's) has its claim look first for a commit that did not
// notify because another was notifying (lookBehindSQL), in the same round
// trip and before the claims' snapshots, as its own drain's first claim
// does; when the look finds one, the schema's own drain is woken, and
// looks again and waits for it. The gate stays idle throughout, so every
// commit after the claim notifies, or is behind one that does, whose
// drain looks (sql/014_wake_behind.sql): one claim is enough, whatever
// it found.
//
// A schema drains on its own instead (the poll wakes its drain, as
// before) when its own drain is running (drainMu: never both at once),
// when backpressure holds one of its queues back or Redis is nearly full,
// for a target with no scheduler (streams, celery: its drain arms the
// wake-up for the next due run_at), while a commit must wait for the standbys
// (WaitForStandby, synchronous replication), and until its leadership's
// first push has read whether replication is synchronous (syncKnown). A
// shared push that the fence refused ends the schema's lead, as its own
// push's refusal does (Relay.sharedEnd). A batch that comes back full
// (a backlog) wakes the schema's own drain too, which claims batch after
// batch from a cursor.

// sharedPushes bounds the pushes of a shared drain in flight at once.
const sharedPushes = 8

// sharedPart is one schema's batch in a shared drain.
type sharedPart struct {
	t    *tenant
	r    *Relay
	jobs []stagedJob
	l    *landing // once pushed
	// look, for a schema whose gate was idle, gets the transactions in
	// progress if a commit held its 'behind' lock (see sharedClaim).
	look *behindLook

	// The schema's low-water mark (nil: off), and what its claim read for
	// it (see sharedClaim), if it did (read).
	w       *lowWater
	lowered uint64
	clean   bool // no row skipped
	read    bool
	mark    markRead
}

// sharedMarkEvery is how often a schema's shared claims read what its
// low-water mark needs (sharedClaim). Under load a hot fleet's schema is
// in a shared drain every 100-150ms with a job or two, and the read cost
// PostgreSQL half as much as the claim itself (25µs against 50µs, 200
// schemas at 2,600 jobs/s). A claim that does not read it neither adds a
// candidate nor confirms one, so the mark moves only less often: it stays
// at most about two reads behind, a second's rows of that schema, whose
// dead index entries a claim walks while a long transaction holds the
// horizon (at 1,000 jobs/s over 200 schemas, about five).
const sharedMarkEvery = time.Second

// sharedDrainer runs a fleet session's shared drains, one at a time,
// until ctx ends. The hot polls hand it the schemas they found (offer),
// the listener those whose commits notified (notify): those offered while
// a shared drain is in flight wait for the next one, which takes them
// all, but those a poll found by a row that drain deleted: a poll that
// ran while it claimed found the rows it was taking, and drained again
// each schema would come back empty (sharedClaimed).
type sharedDrainer struct {
	f      *fleet
	pool   *pgxpool.Pool
	mu     sync.Mutex
	next   []*tenant               // offered since the last shared drain began, in order
	offers map[*tenant]sharedOffer // of each schema of next
	ping   chan struct{}
	done   chan struct{}
}

// sharedOffer is how a schema came to the next shared drain.
type sharedOffer struct {
	polled   bool  // a hot poll found it,
	id       int64 // the highest id found, if polled
	notified bool  // its commit notified: taken whatever the polls found
}

func (f *fleet) startSharedDrainer(ctx context.Context, pool *pgxpool.Pool) *sharedDrainer {
	d := &sharedDrainer{f: f, pool: pool, offers: make(map[*tenant]sharedOffer),
		ping: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(d.done)
		for {
			select {
			case <-ctx.Done():
				return
			case <-d.ping:
			}
			d.f.drainShared(ctx, d.pool, d.take())
		}
	}()
	return d
}

// offer adds found to the next shared drain's schemas, ids the id found
// of each.
func (d *sharedDrainer) offer(found []*tenant, ids []int64) {
	d.mu.Lock()
	for i, t := range found {
		o := d.add(t)
		if !o.polled || ids[i] > o.id {
			o.id = ids[i]
		}
		o.polled = true
		d.offers[t] = o
	}
	d.mu.Unlock()
	trySendWakeup(d.ping)
}

// notify adds t, whose commit notified, to the next shared drain's
// schemas (the listener's goroutine calls it, for a fleet's channel).
func (d *sharedDrainer) notify(t *tenant) {
	d.mu.Lock()
	o := d.add(t)
	o.notified = true
	d.offers[t] = o
	d.mu.Unlock()
	trySendWakeup(d.ping)
}

// add puts t in next if it is not there yet, and returns its offer so
// far. d.mu is held.
func (d *sharedDrainer) add(t *tenant) sharedOffer {
	o, ok := d.offers[t]
	if !ok {
		d.next = append(d.next, t)
	}
	return o
}

// take returns the schemas offered since the last shared drain began, but
// those only a poll found, by a row the last shared drain deleted
// (sharedClaimed).
func (d *sharedDrainer) take() []*tenant {
	d.mu.Lock()
	defer d.mu.Unlock()
	found := slices.DeleteFunc(d.next, func(t *tenant) bool {
		o := d.offers[t]
		return !o.notified && t.r.sharedClaimed(o.id)
	})
	d.next = nil
	clear(d.offers)
	return found
}

func (d *sharedDrainer) wait() { <-d.done }

// sharable reports whether the shared drain may take r's batches (see the
// top of this file): its drain loop runs (its lead goes on), and nothing
// needs the schema's own drain. r.drainMu is held.
func (r *Relay) sharable(ctx context.Context) bool {
	if !r.drainOpen || r.sharedEnd != nil || r.dueOnly || r.cfg.WaitForStandby || !r.syncKnown || r.syncStandby {
		return false
	}
	if over, _ := r.bp.memory(ctx, r); over || r.bp.any() {
		return false
	}
	return true
}

// drainShared drains the schemas of found together (see the top of this
// file); those it cannot take are woken to drain on their own.
func (f *fleet) drainShared(ctx context.Context, pool *pgxpool.Pool, found []*tenant) {
	var parts []*sharedPart
	for _, t := range found {
		c := t.r
		if !c.drainMu.TryLock() {
			trySendWakeup(t.wake) // draining: again once it is done
			continue
		}
		if !c.sharable(ctx) {
			c.drainMu.Unlock()
			trySendWakeup(t.wake) // its lead has ended, or its own drain is needed
			continue
		}
		p := &sharedPart{t: t, r: c}
		if g := c.gate.Load(); g != nil && !g.awake.Load() {
			p.look = &behindLook{schema: c.cfg.Schema}
		}
		parts = append(parts, p)
	}
	if len(parts) == 0 {
		return
	}
	err := f.sharedBatch(ctx, pool, parts)
	wal := &sharedWAL{pool: pool}
	for _, p := range parts {
		p.r.inFlight.Store(0) // committed or rolled back: the hot poll looks from the mark
		if err != nil {
			p.r.sharedIDs.Store(nil) // not deleted: found again
		}
	}
	var tidy []*Relay
	for _, p := range parts {
		c := p.r
		switch {
		case err != nil:
			// Its own drain claims again, and retries with backoff and a
			// log line if the failure lasts.
			trySendWakeup(p.t.wake)
		default:
			c.state.drained()
			c.bp.drainEnded()
			if c.handoff.TidyDue() {
				// As a schema's own drain does after its drain (delivered
				// rows wait): a claim of its own would cost as much again.
				tidy = append(tidy, c)
			} else {
				trySendWakeup(c.tidyLater) // its drain loop's timer, from now
			}
			if p.w != nil {
				trySendWakeup(c.markLater) // its drain loop claims from the mark later
			}
			if len(p.jobs) == c.cfg.BatchSize || c.bp.any() || p.look != nil && len(p.look.xids) > 0 {
				// A backlog, or a pause to keep: the schema's own drain
				// does those.
				trySendWakeup(p.t.wake)
			}
		}
	}
	tidyAll(ctx, pool, tidy, wal)
	for _, p := range parts {
		p.r.drainMu.Unlock()
	}
	if err != nil && ctx.Err() == nil {
		f.r.log.Debug("a shared drain failed: each of its schemas drains on its own", zap.Int("schemas", len(parts)), zap.Error(err))
	}
}

// tidyAll tidies the handoff records of rs, as tidyWith tidies each, with
// their deletes in one Redis round trip (handoff.TidyAll): over 200
// schemas, each due once a second, a round trip each cost about 4% of the
// relay's CPU. Their drains are held (drainMu).
func tidyAll(ctx context.Context, pool *pgxpool.Pool, rs []*Relay, wal *sharedWAL) {
	if len(rs) == 0 {
		return
	}
	hs := make([]*handoff.Handoff, len(rs))
	for i, c := range rs {
		hs[i] = c.handoff
	}
	errs := handoff.TidyAll(ctx, hs, func(i int, ids []int64) ([]int64, error) {
		return rs[i].stillStaged(ctx, pool, ids)
	}, func(i int) (uint64, uint64, error) {
		if c := rs[i]; c.handoff.Delivering() {
			return c.walPositions(ctx, pool) // read after stillStaged (tidyWith)
		}
		return wal.of(ctx, rs[i])()
	})
	for i, err := range errs {
		if err != nil && ctx.Err() == nil {
			rs[i].drainLog.Warn("could not tidy the handoff record", zap.Error(err))
		}
		if rs[i].hooks.tidied != nil {
			rs[i].hooks.tidied(true)
		}
	}
}

// sharedClaimed reports whether id is one of the rows the schema's last
// shared drain deleted: a hot poll whose snapshot was taken before that
// drain committed still sees it, and its schema would be drained again by
// a claim that comes back empty (with the poll in flight when each shared
// drain begins, a third of the claims over 200 schemas). A row that
// committed late, below those ids, is not one of them, and is found.
//
// For sharedStale after the claim only: a poll's snapshot is older than
// the shared drain's commit by a poll's duration at most (milliseconds),
// and a row with one of those ids that is staged after that was staged
// again (a delete that committed asynchronously, lost in PostgreSQL's
// crash); it is found then.
func (r *Relay) sharedClaimed(id int64) bool {
	d := r.sharedIDs.Load()
	if d == nil || time.Since(d.at) > sharedStale {
		return false
	}
	_, ok := slices.BinarySearch(d.ids, id)
	return ok
}

// sharedDeleted are the ids a schema's shared drain claimed, sorted, and
// when.
type sharedDeleted struct {
	ids []int64
	at  time.Time
}

// sharedStale bounds how long after its claim a shared drain's ids are
// taken as deleted by the hot polls (sharedClaimed).
const sharedStale = time.Second

// sharedWAL reads the WAL's positions once, at its first use, and then
// gives each schema what it read (noted, as walPositions notes it): the
// tidies of a shared drain's schemas, each due once a second, took a round
// trip each for it (over 200 schemas, 250 a second).
type sharedWAL struct {
	pool *pgxpool.Pool
	read bool
	w    walRead
	err  error
}

// of is the WAL read for c's tidy (tidyWith).
func (s *sharedWAL) of(ctx context.Context, c *Relay) func() (uint64, uint64, error) {
	return func() (uint64, uint64, error) {
		if !s.read {
			s.read = true
			s.w, s.err = scanWAL(s.pool.QueryRow(ctx, walPositionsSQL))
			if s.err != nil {
				s.err = fmt.Errorf("read the WAL position: %w", s.err)
			}
		}
		if s.err != nil {
			return 0, 0, s.err
		}
		c.noteWAL(s.w)
		return s.w.insert, s.w.flush, nil
	}
}

// sharedBatch claims, pushes and commits a batch of each part, in one
// transaction (see the top of this file).
func (f *fleet) sharedBatch(ctx context.Context, pool *pgxpool.Pool, parts []*sharedPart) (err error) {
	// Once claimed, the batches are not cut short by ctx: they get
	// ShutdownTimeout to finish, as finish gives a schema's own.
	bctx, cancel := batchContext(ctx, f.r.cfg.ShutdownTimeout)
	defer cancel()

	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("shared claim: %w", err)
	}
	start := time.Now()
	if err := f.sharedClaim(ctx, conn.Conn(), parts); err != nil {
		claimed{conn: conn}.rollback(ctx)
		return err
	}
	for _, p := range parts {
		if len(p.jobs) == 0 {
			continue
		}
		ids := make([]int64, len(p.jobs))
		for i, j := range p.jobs {
			ids[i] = j.id
		}
		slices.Sort(ids)
		p.r.inFlight.Store(ids[len(ids)-1])
		p.r.sharedIDs.Store(&sharedDeleted{ids: ids, at: time.Now()})
	}
	var pushed []*sharedPart
	defer func() {
		if err == nil {
			return
		}
		claimed{conn: conn}.rollback(ctx)
		for _, p := range pushed {
			// The push delivered these rows; the delete did not commit.
			// Claimed again, they are deleted, not pushed.
			p.r.handoff.Uncommitted(p.l.res.field, p.l.res.pushed)
		}
		for _, p := range parts {
			if p.l != nil {
				p.r.tracer.end(p.l.span, &p.l.res, 0, err)
			}
		}
	}()
	errs := f.pushShared(bctx, parts, start)
	batch := &pgx.Batch{}
	var failed error
	for i, p := range parts {
		switch {
		case p.l == nil:
		case errs[i] != nil:
			// pushLanding has marked the rows its push delivered, if any.
			if errors.Is(errs[i], errFenced) || isFatal(errs[i]) {
				// Its drain loop ends the lead (Relay.sharedEnd).
				p.r.sharedEnd = errs[i]
			}
			if failed == nil {
				failed = fmt.Errorf("schema %q: %w", p.r.cfg.Schema, errs[i])
			}
		default:
			pushed = append(pushed, p)
			p.r.queueLanding(batch, p.l)
		}
	}
	if failed != nil {
		return failed
	}
	if len(pushed) == 0 {
		// Nothing claimed: end the transaction (the deferred rollback
		// does, should the COMMIT fail).
		if _, err := conn.Exec(bctx, "COMMIT"); err != nil {
			return fmt.Errorf("shared claim: commit: %w", err)
		}
		conn.Release()
		confirmMarks(parts)
		return nil
	}
	batch.Queue("COMMIT")
	// Every WAL position, or within walFresh of the last full read, the
	// insert position alone, as a schema's own commit reads them.
	var wal walRead
	var full bool
	f.sharedWAL.queue(batch, time.Now(), &wal, &full)
	if err := conn.SendBatch(bctx, batch).Close(); err != nil {
		return fmt.Errorf("shared commit: %w", err)
	}
	conn.Release()
	f.sharedCommits.Inc()
	for _, p := range pushed {
		c := p.r
		if full {
			c.noteWAL(wal)
		}
		c.landed(p.l, wal.insert, wal.flush, c.drainLog)
		for _, id := range p.l.left {
			p.w.lower(id) // put back: claims start below it
		}
		if len(p.l.left) > 0 {
			p.r.sharedIDs.Store(nil) // rows put back are staged again, to be found
		}
		if c.found != nil && len(p.jobs) < c.cfg.BatchSize {
			c.found.Add(int64(len(p.jobs))) // the fleet's heat (fleethot.go)
		}
		c.tracer.end(p.l.span, &p.l.res, p.l.buried, nil)
	}
	confirmMarks(parts)
	f.sharedBatches.Add(float64(len(pushed)))
	return nil
}

// pushShared pushes the batch of each part that claimed one, and sorts
// its rows, as pushLanding does for a schema's own batch: the units of
// the schemas whose handoff pipelines go in one pipeline (one Redis round
// trip for all of them, where each push is one), the others at the same
// time, sharedPushes at most. Each part touches its own schema's relay
// only, and its own Redis keys. errs[i] is part i's error.
func (f *fleet) pushShared(ctx context.Context, parts []*sharedPart, start time.Time) []error {
	errs := make([]error, len(parts))
	var piped []int
	var pps []preparedPush
	var wg sync.WaitGroup
	sem := make(chan struct{}, sharedPushes)
	for i, p := range parts {
		if len(p.jobs) == 0 {
			continue
		}
		c := p.r
		b := claimed{jobs: p.jobs, start: start}
		p.l = &landing{b: b, span: c.tracer.start(ctx, b)}
		if !c.handoff.Pipelines() {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				errs[i] = c.pushLanding(ctx, p.l, c.drainLog)
			})
			continue
		}
		p.l.pushedAt = time.Now()
		pp, err := c.preparePush(ctx, p.jobs, p.l.pushedAt)
		if err != nil || pp.u == nil {
			errs[i] = c.landPushed(ctx, p.l, pp.res, err, c.drainLog)
			continue
		}
		piped = append(piped, i)
		pps = append(pps, pp)
	}
	if len(piped) > 0 {
		hs := make([]*handoff.Handoff, len(piped))
		us := make([]*handoff.Unit, len(piped))
		for n, i := range piped {
			hs[n], us[n] = parts[i].r.handoff, pps[n].u
		}
		fields, perrs := handoff.PushAll(ctx, hs, us)
		for n, i := range piped {
			c := parts[i].r
			res, err := c.settlePush(pps[n], fields[n], perrs[n])
			errs[i] = c.landPushed(ctx, parts[i].l, res, err, c.drainLog)
		}
	}
	wg.Wait()
	return errs
}

// sharedClaim begins a transaction on conn and claims a batch from each
// part's schema, in one round trip: each schema's own claim statement,
// from its low-water mark, skipping the poison its source leaves staged.
func (f *fleet) sharedClaim(ctx context.Context, conn *pgx.Conn, parts []*sharedPart) error {
	b := &pgx.Batch{}
	b.Queue(beginClaimSQL)
	// The looks of the schemas whose gates are idle, each its own
	// statement before the claims' snapshots, as a schema's own drain
	// reads it before its first claim (Relay.drain).
	for _, p := range parts {
		if p.look != nil {
			b.Queue(lookBehindSQL, p.look.schema)
		}
	}
	// The low-water marks' reads (lowwater.go), each schema's before any
	// claim: its snapshot's xmin and S, its sequence's last value. The
	// transaction takes its id X at the first row any claim locks, after
	// every S was read, as a schema's own claim takes it after its S: so
	// (S, X) is a candidate of each schema's mark, by the same proof. An
	// xmin read before the claims is one they could have read: at most
	// theirs.
	now := time.Now()
	for _, p := range parts {
		if p.w = p.r.mark.Load(); p.w != nil && now.Sub(p.r.sharedMarkAt) >= sharedMarkEvery {
			p.read = true
			p.r.sharedMarkAt = now
			// claimMarkSQL's row, with no transaction id yet (read below).
			b.Queue(`SELECT pg_snapshot_xmin(pg_current_snapshot())::text || ' ' || coalesce(` +
				p.r.sql.lastID + `()::text, ''), NULL::text`)
		}
	}
	for _, p := range parts {
		c := p.r
		from := fromStart
		if p.w != nil {
			from, p.lowered = p.w.from()
			p.w.lastFrom.Store(from)
		}
		skip := c.poisoned
		if skip == nil {
			skip = []int64{} // NULL would make "id <> ALL" NULL
		}
		p.clean = len(skip) == 0
		args := append([]any{c.cfg.BatchSize, skip, from}, c.claimArgs...)
		args = append(args, []string{}) // no queue left out: none is paused (sharable)
		b.Queue(c.sql.claim, args...)
	}
	b.Queue(`SELECT ` + markXidSQL) // X, after every S
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return fmt.Errorf("begin: %w", err)
	}
	for _, p := range parts {
		if p.look == nil {
			continue
		}
		if err := br.QueryRow().Scan(&p.look.xids); err != nil {
			_ = br.Close()
			return fmt.Errorf("shared claim, schema %q: read the transactions in progress: %w", p.r.cfg.Schema, err)
		}
	}
	for _, p := range parts {
		if !p.read {
			continue
		}
		if err := p.mark.scan(br.QueryRow()); err != nil {
			_ = br.Close()
			return fmt.Errorf("shared claim, schema %q: read the mark: %w", p.r.cfg.Schema, err)
		}
	}
	for _, p := range parts {
		c := p.r
		jobs, err := readClaimed(br, c.src.scanner(), nil)
		if err != nil {
			_ = br.Close()
			return fmt.Errorf("shared claim, schema %q: %w", c.cfg.Schema, err)
		}
		p.jobs = jobs
	}
	var xid *string
	if err := br.QueryRow().Scan(&xid); err != nil {
		_ = br.Close()
		return fmt.Errorf("shared claim: read its transaction id: %w", err)
	}
	if err := br.Close(); err != nil {
		return fmt.Errorf("shared claim: %w", err)
	}
	for _, p := range parts {
		if !p.read {
			continue
		}
		if xid != nil {
			x, err := strconv.ParseUint(*xid, 10, 64)
			if err != nil {
				return fmt.Errorf("shared claim: xid %q: %w", *xid, err)
			}
			p.mark.xid, p.mark.xidOK = x, true
		}
		p.w.noted(p.mark)
	}
	return nil
}

// confirmMarks advances the parts' marks after their shared transaction
// committed (lowwater.go): a claim qualifies when it started from its mark
// (the shared claims all do), skipped nothing, came back short, and its
// batch put nothing back; the schema had no other batch in flight
// (drainMu).
func confirmMarks(parts []*sharedPart) {
	for _, p := range parts {
		if !p.read || !p.clean || len(p.jobs) >= p.r.cfg.BatchSize || p.l != nil && len(p.l.left) > 0 {
			continue
		}
		p.w.confirm(p.mark.xmin, p.lowered)
	}
}
