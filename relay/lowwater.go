package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// The low-water mark: where a claim starts.
//
// A claim scans the id index in order. Rows the drain deleted stay in that
// index, and in the heap, until no session may still see them; a session
// that holds the xmin horizon back (pg_dump's snapshot, a report, an idle
// REPEATABLE READ transaction) keeps them all. A claim from the index's
// start walks every one, a heap fetch each: at 2,000 jobs/s, p50 went from
// 2.7 to 39.6 ms in 40 s, and kept growing (issue 24). So a claim starts
// at the mark L instead: every row with an id <= L has been drained, or
// will never appear. Its cost then depends on the rows above L, not on how
// many were deleted below it.
//
// Ids are not commit order: a transaction may draw id 5, stay open, and
// commit after id 6 was drained. So L can pass an id only once its
// transaction has ended. sql/011_id_after_xid.sql makes the id's default
// stagedrain_next_id(), which takes the transaction's id before nextval(),
// and sql/018_id_default_inline.sql writes that expression out as the
// default itself (CASE WHEN pg_current_xact_id() IS NOT NULL THEN
// nextval(seq) END, saving the app's INSERTs a parse of the function):
//
//	(I) a transaction T holding a default id i got its transaction id
//	    x(T) before the sequence handed out i.
//
// The proof that L only passes ids that are drained or will never be.
//
// Each claim c (claimSQL with mark) reads, in its statement, its
// snapshot's xmin(c), and then S(c), the sequence's last value
// (stagedrain_last_id(): a value handed out, to any session, committed or
// not). The one-time filter that reads them runs before the claim locks its
// first row, which is what gives the claim's own transaction its id X(c);
// a second statement in the same round trip reads X(c). By (I), every T
// holding a default id <= S(c) got x(T) before S(c) was read, so before
// X(c) was assigned: x(T) < X(c), since transaction ids are handed out in
// order. (S(c), X(c)) is a candidate.
//
// A claim that locked nothing has no transaction id. Its second
// statement reads instead the next transaction id to be handed out, N(c),
// after the claim statement ended, so after S(c) was read: every such
// x(T) < N(c) too, and (S(c), N(c)) is a candidate. PostgreSQL gives it
// by age(xid), which counts from the transaction's own id or, when it has
// none, from the next id, read at the transaction's first call of it (the
// claims call it nowhere else; markXidSQL). Not the snapshot's xmax: that
// is one past the latest *completed* id, and a transaction that took a
// newer id and is still open is at or above it (with xmax, the mark
// passed such a transaction's row while it was open, and the row reached
// Redis after rows staged after it: TestEmptyClaimsDoNotPassAnOpenID).
// It costs no transaction id, and it is what lets an empty claim after a
// fleet's shared drains carry the mark past their rows (drainLoop's
// confirm): a shared claim reads S once a second at most
// (sharedMarkEvery), so the last rows a shared drain took may be under no
// candidate at all.
//
// A later claim q confirms a candidate when xmin(q) >= X(c): then every
// x(T) < X(c) <= xmin(q), and a transaction id below a snapshot's xmin is
// no longer running (that is what PostgreSQL's own visibility rests on).
// So, at q's snapshot, each such T has committed, and its rows are visible
// to q unless already deleted, or has aborted, and its rows never will be.
// q qualifies when it started from L (id > L), came back short of the
// batch size (so it took every visible row above L that it could lock),
// left nothing out (no ids skipped, no queue excluded; for the run_at
// filter of a target with no scheduler, see below),
// and no other batch of this relay was in flight (whose
// locked rows it would have skipped, and whose rollback would put them
// back). When q's batch commits, with nothing put back, every row with an
// id in (L, S(c)] has been pushed and deleted: each was visible to q or
// never will exist. So L becomes S(c). A row put back (deferred by Redis,
// held by backpressure) lowers L below its id at once (lower), and any
// lowering while q was in flight cancels q's advance.
//
// What holds L back, then, is a transaction with an id that is older than
// the candidates: a long WRITING transaction (it may yet commit a low id),
// which is right. A read-only snapshot holder has no transaction id, so it
// is not in any snapshot's xmin (it shows in pg_stat_activity.backend_xmin
// only) and never holds L back, though it is what keeps the dead rows.
//
// What the mark cannot see: rows that get below L without the default
// (an id the app sets itself, stagedrain dead retry, which puts a row back
// with its own id), and rows that some other session had locked when q
// skipped them (SKIP LOCKED) and that stay (its transaction rolled back:
// the app's SELECT ... FOR UPDATE, a fenced-out relay's batch). The probe
// finds them: every probeEvery, a plain SELECT (no lock) of the lowest id
// <= L still there; finding one lowers L below it and wakes the drain.
// Most probes look above the L of the last probe only; one from the
// index's start runs every probeEvery too while it is cheap, and when it
// is not (it walks the dead index entries below L, which a held horizon
// keeps), once per 100 times its own duration (Relay.probe). So such a row
// waits at most probeEvery (5 s) plus one probe and one drain, about 6 s,
// when its id is above the L of the probe before it; below that, until
// the next probe from the index's start: also about 6 s, or 100 times that
// probe's duration while a long transaction elsewhere holds the horizon
// (about 26 s at 1.2 million dead rows).
//
// A fleet's schema has a mark of its own, as a relay of one schema, and
// the fleet's poll looks for rows above each schema's mark only.
//
// A target with no scheduler (streams, celery: dueOnly) claims the rows
// whose run_at is due only: a claim q leaves staged each row with a finite
// run_at > now(q), its transaction's start. Its L then says: every row
// with an id <= L has been drained, will never appear, or had a run_at
// after now(q) of the claim that confirmed it. Those rows are found when
// due by a look that runs after every drain, in the round trip that reads
// the next run_at (armDue): the lowest id <= L of the rows whose run_at is
// in (since, now()], through 013's index of the scheduled rows' run_at (a
// range of it, not a walk of the id index). since is the last look's now(),
// or the mark's making, less lookMargin. Found, L is lowered below it and
// the drain claims again at once. Why none is missed: a drain's claims and
// confirms run between two looks of the drain loop, so a look L1 before
// q's transaction began has now(L1) <= now(q) < run_at; the first look
// after the row's run_at passes, and after q confirmed, covers it, as the
// looks' ranges meet (each starts where the last ended, less the margin).
// The drain loop runs a look after every drain, and wakes for the earliest
// run_at (armDue), so it runs one within the poll interval of the row
// coming due, and the probe (below) looks for due rows only.
//
// A relay with Config.Queues claims its group's queues only, every time:
// its mark speaks of its group's rows only (every row of those queues with
// an id <= L was drained or never will be), and its probe looks for its
// group's rows only; the other groups' rows below L are theirs to claim.
//
// The gem's table (SourceSidekiqStagedPush) keeps the gem's id default,
// plain nextval(): sql/gem_002.sql adds a BEFORE INSERT statement trigger
// that takes the transaction id before any row's default runs, which is
// (I) for every default id, and stagedrain_staged_push_last_id() for S.
//
// Off (claims start at the index's start, as before 011) for a table whose
// id default is neither 018's expression nor stagedrain_next_id() of its
// own sequence (staged_jobs) or that lacks the
// enabled trigger (the gem's), whose sequence caches values (CACHE > 1: a
// session hands out a cached value long after the sequence moved past it),
// and for the gem's table with a target with no scheduler (its run_at is a
// field of the payload, which no index finds the due rows below L by).
type lowWater struct {
	mu      sync.Mutex
	mark    int64  // L; fromStart: nothing known
	lowered uint64 // counts lowerings, to cancel an advance they overlap
	cands   []markCandidate
	// lastFrom is where the last claim from the mark started (tests).
	lastFrom atomic.Int64
	// looked is PostgreSQL's now() at the last look for future rows below
	// L that came due (a target with no scheduler: see lowWater), or when
	// the mark was made; drain loop only.
	looked time.Time
}

// markCandidate is a claim's (S, X): see lowWater.
type markCandidate struct {
	last int64  // S: the sequence's last value
	xid  uint64 // X: the claim's own transaction id
}

// maxCandidates bounds the candidates kept while none can be confirmed
// (a long writing transaction holds xmin back, or a backlog drains in full
// batches); past it, each new one replaces the newest kept.
const maxCandidates = 16

// probeEvery is how often the probe looks below L for rows the mark cannot
// see.
const probeEvery = 5 * time.Second

// markRead is what a claim with the mark read: its snapshot's xmin, the
// sequence's last value, its own transaction id.
type markRead struct {
	xmin    uint64
	last    int64
	lastOK  bool   // the sequence had handed out a value
	xid     uint64 // X: its transaction id, or, if it took none, the next id read after S
	xidOK   bool
	present bool // the claim ran with the mark and read these
}

// claimMarkSQL is read after the claim, in the same round trip: what its
// one-time filter kept (xmin, S), and its X (markXidSQL).
const claimMarkSQL = `SELECT current_setting('stagedrain.claim_mark', true), ` + markXidSQL

// markXidSQL is a claim's X (lowwater.go), read in the statement after the
// claim: its transaction's id or, when it locked nothing, the next
// transaction id to be handed out. age(xid) is PostgreSQL's next id (read
// at the transaction's first call, which this is) less xid, modulo 2^32:
// from the 32 bits of this statement's snapshot's xmin it gives the next
// id in full. (An xmin of 0-2, at a wrap of the 32 bits, gives age's
// INT_MAX: an X two billion ids on, never confirmed, which is safe.)
const markXidSQL = `coalesce(pg_current_xact_id_if_assigned()::text, (SELECT (m + age((m % 4294967296)::text::xid))::text
	FROM (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS m) s))`

// beginClaimSQL begins a claim's transaction. READ COMMITTED, whatever the
// database's default_transaction_isolation: lookBehindSQL, a statement
// before the claim, must read the transactions in progress before the
// claim's snapshot is taken, and the claim must see each commit before it
// (REPEATABLE READ would give every statement the first one's snapshot).
const beginClaimSQL = "BEGIN ISOLATION LEVEL READ COMMITTED"

// scan reads claimMarkSQL's row.
func (m *markRead) scan(row pgx.Row) error {
	var kept string
	var xid *string
	if err := row.Scan(&kept, &xid); err != nil {
		return err
	}
	xminS, lastS, _ := strings.Cut(kept, " ")
	xmin, err := strconv.ParseUint(xminS, 10, 64)
	if err != nil {
		return fmt.Errorf("claim mark %q: %w", kept, err)
	}
	*m = markRead{xmin: xmin, present: true}
	if lastS != "" {
		if m.last, err = strconv.ParseInt(lastS, 10, 64); err != nil {
			return fmt.Errorf("claim mark %q: %w", kept, err)
		}
		m.lastOK = true
	}
	if xid != nil {
		if m.xid, err = strconv.ParseUint(*xid, 10, 64); err != nil {
			return fmt.Errorf("claim xid %q: %w", *xid, err)
		}
		m.xidOK = true
	}
	return nil
}

// from returns where a claim starts, and the count of lowerings to pass to
// confirm. A nil lowWater (the mark off) starts at the index's start.
func (w *lowWater) from() (int64, uint64) {
	if w == nil {
		return fromStart, 0
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mark, w.lowered
}

// noted keeps a claim's candidate.
func (w *lowWater) noted(m markRead) {
	if w == nil || !m.present || !m.lastOK || !m.xidOK {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if m.last <= w.mark {
		return
	}
	c := markCandidate{last: m.last, xid: m.xid}
	if len(w.cands) >= maxCandidates {
		// The newest replaces the newest kept: it is confirmed later but
		// reaches further, so that the last claim of a long backlog,
		// drained in full batches that confirm nothing, still takes the
		// mark to its end once the drain is idle (dropped, the mark stayed
		// where the 16th candidate was until new rows came).
		w.cands[len(w.cands)-1] = c
		return
	}
	w.cands = append(w.cands, c)
}

// confirm advances L after a qualifying claim (see lowWater) whose
// snapshot's xmin was xmin, begun when lowered was as from returned it, and
// whose batch committed with nothing put back.
func (w *lowWater) confirm(xmin uint64, lowered uint64) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if lowered != w.lowered {
		return
	}
	kept := w.cands[:0]
	for _, c := range w.cands {
		switch {
		case c.xid <= xmin:
			w.mark = max(w.mark, c.last)
		case c.last > w.mark:
			kept = append(kept, c)
		}
	}
	w.cands = kept
}

// unconfirmed reports whether candidates wait for a claim to confirm them.
func (w *lowWater) unconfirmed() bool {
	if w == nil {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.cands) > 0
}

// lower moves L below id: a row with that id is staged, or may be.
func (w *lowWater) lower(id int64) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.lowered++
	if id-1 < w.mark {
		w.mark = id - 1
	}
}

// get returns L, for tests and the summary.
func (w *lowWater) get() int64 {
	if w == nil {
		return fromStart
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mark
}

// markCheckSQL says whether the table suits the mark: its id default is
// 018's CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval(seq) END
// or 011's stagedrain_next_id(seq), the same expression as a function, and
// depends on the column's own sequence, which hands out one value at a
// time; and stagedrain_last_id() exists.
const markCheckSQL = `SELECT coalesce((
	SELECT (btrim(regexp_replace(pg_get_expr(d.adbin, d.adrelid), '\s+', ' ', 'g'))
				LIKE 'CASE WHEN (pg_current_xact_id() IS NOT NULL) THEN nextval(%) ELSE NULL::bigint END'
			OR pg_get_expr(d.adbin, d.adrelid) LIKE '%stagedrain_next_id(%')
		AND EXISTS (SELECT FROM pg_depend p WHERE p.classid = 'pg_attrdef'::regclass AND p.objid = d.oid
			AND p.refclassid = 'pg_class'::regclass AND p.refobjid = pg_get_serial_sequence($1, 'id')::regclass)
		AND (SELECT s.seqcache = 1 FROM pg_sequence s WHERE s.seqrelid = pg_get_serial_sequence($1, 'id')::regclass)
		AND to_regprocedure($2) IS NOT NULL
	FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
	WHERE d.adrelid = $1::regclass AND a.attname = 'id'), false), now()`

// gemMarkCheckSQL is markCheckSQL for the gem's table (gem_002.sql): its
// id's default is the plain nextval() of its own sequence, which hands out
// one value at a time, and the enabled stagedrain_xid_first statement
// trigger gives every INSERT its transaction id before that default runs.
const gemMarkCheckSQL = `SELECT coalesce((
	SELECT pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval(%'
		AND (SELECT s.seqcache = 1 FROM pg_sequence s WHERE s.seqrelid = pg_get_serial_sequence($1, 'id')::regclass)
		AND to_regprocedure($2) IS NOT NULL
		AND EXISTS (SELECT FROM pg_trigger t WHERE t.tgrelid = $1::regclass AND t.tgname = 'stagedrain_xid_first'
			AND t.tgenabled IN ('O', 'A') AND t.tgtype & 7 = 6) -- BEFORE, INSERT, FOR EACH STATEMENT
	FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
	WHERE d.adrelid = $1::regclass AND a.attname = 'id'), false), now()`

// newLowWater returns the mark for this leadership, nil when it is off
// (see lowWater).
func (r *Relay) newLowWater(ctx context.Context, pool *pgxpool.Pool) (*lowWater, error) {
	if r.sql.claimMark == "" || r.dueOnly && r.sql.nextDueLook == "" {
		if r.sql.lastID != "" { // a table with a mark, but not for this target
			r.log.Named("drain").Info("claims start at the id index's start: a target with no scheduler finds the due rows below the mark by their run_at, which this table has no index of",
				zap.String("target", string(r.cfg.Target)))
		}
		return nil, nil
	}
	var ok bool
	var now time.Time
	err := pool.QueryRow(ctx, r.sql.markCheck, r.sql.markTable, r.sql.lastID+"()").Scan(&ok, &now)
	if err != nil {
		return nil, fmt.Errorf("low-water mark check: %w", err)
	}
	if !ok {
		r.log.Named("drain").Info(r.sql.markOff)
		return nil, nil
	}
	// Every claim of this leadership begins after now: the rows they
	// leave below the mark as not yet due are due after it.
	return &lowWater{mark: fromStart, looked: now}, nil
}

// markFor is newLowWater, its check tried again when it fails: a
// leadership begins on a drain pool whose sessions PostgreSQL may have
// ended (it restarted, failed over, or an operator ran
// pg_terminate_backend), and the pool hands a session out without a ping
// when it was used within the last two polls (drainPoolConfig). Each
// failed try leaves its broken session out of the pool, so MaxConns+1
// tries reach a working one when the server is up.
//
// A check that still fails for a session's sake (the connection, or a
// FATAL from the server) is returned: it ends the leadership, which is
// retried with backoff. Before, the leadership went on without a mark:
// every claim of it started at the id index's start and walked the dead
// index entries below (lowWater), for as long as it led: 9 times in the
// relays' logs of 10 full chaos runs, each right after PostgreSQL
// restarted. A refusal (an ERROR: the table changed under it, a
// privilege) is not retried, and the leadership goes on without the mark,
// logged, as before.
func (r *Relay) markFor(ctx context.Context, pool *pgxpool.Pool) (*lowWater, error) {
	tries := int(pool.Config().MaxConns) + 1
	var err error
	for range tries {
		var mark *lowWater
		if mark, err = r.newLowWater(ctx, pool); err == nil || ctx.Err() != nil {
			return mark, err
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Severity == "ERROR" {
			r.log.Named("drain").Warn("claims start at the id index's start", zap.Error(err))
			return nil, nil
		}
	}
	return nil, err
}

// lookMargin widens each look for future rows below the mark that came
// due (see lowWater) back from the last look's now(): now() is each
// transaction's start on PostgreSQL's clock, which a clock step may move
// back. A row in the overlap is looked at twice, and claimed once.
const lookMargin = 5 * time.Second

// lookSince is where the next look for rows that came due starts.
func (w *lowWater) lookSince() time.Time { return w.looked.Add(-lookMargin) }

// probe looks below L every probeEvery, until ctx ends, for a row the mark
// cannot see (see lowWater); it lowers L below the lowest one it finds and
// signals found. A failed probe is retried at the next.
//
// A probe from the index's start walks every dead index entry below L,
// and while a long transaction elsewhere holds the horizon they are all
// there: 256 ms and 17,000 buffers a probe after 1.2 million dead rows
// (a 173 MiB table, more than shared_buffers: the walk also evicted the
// pages the app's inserts and the claims use), every 5 s. So most probes
// look above the L of the last probe only (what it looked at below that
// has not changed since, unless a row was put there since), and one from
// the index's start runs when fullProbeDue says: every probeEvery while it
// is cheap, at most fullProbeShare of the time otherwise.
func (r *Relay) probe(ctx context.Context, pool *pgxpool.Pool, w *lowWater, found chan<- struct{}) {
	every := cmp.Or(r.hooks.probeEvery, probeEvery)
	above := fromStart     // where a probe that is not full starts: the last probe's L
	var lastFull time.Time // the first probe is full
	var fullTook time.Duration
	turn := time.Now()
	for sleep(ctx, probeWait(every)) {
		if r.hooks.probeTurn != nil {
			r.hooks.probeTurn(r.cfg.Schema, time.Since(turn))
		}
		turn = time.Now()
		below, _ := w.from()
		if below == fromStart {
			continue
		}
		full := fullProbeDue(lastFull, fullTook, every, time.Now())
		from := above
		if full {
			from = fromStart
		}
		start := time.Now()
		var id int64
		err := withTimeout(ctx, every, func(ctx context.Context) error {
			// With Config.Queues, of the group's queues only (claimArgs).
			args := append(append([]any{below}, r.claimArgs...), from)
			return pool.QueryRow(ctx, r.sql.probe, args...).Scan(&id)
		})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			if ctx.Err() == nil {
				r.log.Named("drain").Warn("probe below the low-water mark failed", zap.Error(err))
			}
			continue
		}
		if full {
			lastFull, fullTook = start, time.Since(start)
		}
		above = below
		if err != nil { // none found
			continue
		}
		w.lower(id)
		if r.hooks.probeFound != nil {
			r.hooks.probeFound(id)
		}
		trySendWakeup(found)
	}
}

// probeWait is the wait before a probe: every, less up to a quarter of
// it at random. A fleet takes the leads of its schemas in one round trip,
// so their drains, and their probes, start together; waiting every alone,
// the probes of a fleet of 200 ran together every probeEvery, 200 queries
// at once on the drain pool's sessions, ahead of the drains waiting for
// them (at the bench's app-cost fleet of 200, started beside the app's
// full speed, all 200 timed out, "probe below the low-water mark failed",
// in the same 220ms). Spread over a quarter of the interval they come one
// at a time; shortening only, the wait stays within probeEvery, and the
// bound on a row below the mark with it.
func probeWait(every time.Duration) time.Duration {
	return every - rand.N(every/4+1)
}

// fullProbeShare bounds the time the probes from the index's start take:
// one runs when the last one's duration, divided by this share, has
// passed since it started (and probeEvery at least), so they take at most
// 1% of a drain connection's time whatever the dead rows below L.
const fullProbeShare = 0.01

// fullProbeDue reports whether the probe at now looks from the index's
// start: the last one started at last (zero: none yet) and took took.
func fullProbeDue(last time.Time, took, every time.Duration, now time.Time) bool {
	return last.IsZero() || now.Sub(last) >= max(every, time.Duration(float64(took)/fullProbeShare))
}
