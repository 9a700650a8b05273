package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// A PostgreSQL failover promotes a streaming standby, which holds what it
// had received when the primary died, no more. Two things follow for the
// handoff, and this file handles both.
//
// Never twice. The drain commits its delete with synchronous_commit = off,
// and a standby receives it later still. A record field (internal/handoff)
// recognises the rows its push delivered, so it must outlive its delete on
// every node that could become the primary: it is deleted only once the
// WAL position past the delete is flushed locally AND on every standby
// the relay can see: each physical walsender in pg_stat_replication
// (a walsender whose flush_lsn is not yet known counts as 0/0), and each
// physical replication slot not marked lost (restart_lsn, which for a
// physical slot follows its standby's flush, also while that standby is
// disconnected). A standby that is neither connected nor holds a slot
// cannot be seen. A role that may not read pg_stat_replication's positions
// (it needs pg_monitor or pg_read_all_stats) sees NULLs: while any
// walsender is listed, fields are then kept for Config.StandbyRetention
// after their delete committed, besides the local flush.
//
// Never a job whose commit a failover loses. A claim sees the commits that
// ended before its snapshot, and the commit records of those are in the WAL
// below the insert position read after it. The claim statement reads that
// position after its snapshot and before it writes WAL of its own
// (claimSQL): its row locks and deletes end on a WAL page that the WAL
// writer does not flush while the server is otherwise idle, so a position
// read after them may never reach a standby. With Config.WaitForStandby,
// or when synchronous_standby_names is set, the drain pushes a batch only
// once the standbys have flushed the WAL up to that position: the synchronous ones (sync_state sync or
// quorum) when synchronous_standby_names is set, otherwise every connected
// physical standby, and at least one. With synchronous replication this
// covers a commit whose wait for the standby was cancelled: PostgreSQL
// makes it visible locally, and its job would otherwise run for data the
// standby never got.

// walPositionsSQL reads, as byte offsets: the WAL's insert position; the
// position below which the WAL is flushed locally and on every standby
// that can be seen (see above); whether walsenders are listed whose
// positions this role may not read; whether synchronous_standby_names is
// set. Any role may run it (pg_stat_replication shows NULL positions to a
// role without pg_read_all_stats; pg_replication_slots is readable by all).
// It reads pg_stat_get_wal_senders(), the function under the
// pg_stat_replication view, which the view joins with every backend's
// activity: each batch runs it, and the join cost 0.03ms more a batch
// (0.11 against 0.08ms, prepared, on this machine).
const walPositionsSQL = `SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint,
	(LEAST(pg_current_wal_flush_lsn(), s.flush, p.flush) - '0/0'::pg_lsn)::bigint,
	s.unknown, current_setting('synchronous_standby_names') <> '', pg_postmaster_start_time()
FROM (SELECT CASE WHEN pg_has_role('pg_read_all_stats', 'USAGE') THEN min(coalesce(r.flush_lsn, '0/0'::pg_lsn)) END AS flush,
		count(*) > 0 AND NOT pg_has_role('pg_read_all_stats', 'USAGE') AS unknown
	FROM pg_stat_get_wal_senders() r
	WHERE NOT EXISTS (SELECT FROM pg_replication_slots l WHERE l.slot_type = 'logical' AND l.active_pid = r.pid)) s,
	(SELECT min(restart_lsn) AS flush FROM pg_replication_slots
	WHERE slot_type = 'physical' AND wal_status IS DISTINCT FROM 'lost') p`

// walInsertSQL reads the WAL's insert position alone, as walPositionsSQL
// does: what a batch's commit reads within walFresh of the last full read
// (drain.go, finish).
const walInsertSQL = `SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint, pg_postmaster_start_time()`

// walFresh is how long the flush positions and the standbys' state that
// walPositionsSQL read serve the batches that commit after it. Its two
// set-returning functions (the walsenders, the replication slots) cost the
// server about 80 us a call (one session, pgbench -M prepared: 146-161 us
// against 66-68 us for SELECT 1), once per batch, where batches come every
// few milliseconds. The insert position past each commit is read after
// each commit all the same; an older flush position holds the commit's
// record field longer, never shorter (positions only grow within a
// leadership, and each leadership's first commit reads them all; a server
// that started since the full read, such as a standby promoted while the
// drain's pool reconnected before the leader lock's loss was seen, has a
// postmaster start time of its own, and then the commit's field counts
// nothing as flushed until a full read says more); and a
// change to synchronous_standby_names is seen at most walFresh later,
// where it was seen one batch later before.
const walFresh = 20 * time.Millisecond

// walCache is the last full read of walPositionsSQL (walFresh): when it
// was made (zero: none yet) and what it read.
type walCache struct {
	at   time.Time
	read walRead
}

// queue queues in batch, after a COMMIT, the read of the WAL's positions
// into *w: all of walPositionsSQL, which *full then says and c keeps, or,
// within walFresh of c's read (at now), the insert position alone, with
// the flush position of c's read if the server has not started since,
// and 0 (nothing flushed) if it has; the rest of *w is c's.
func (c *walCache) queue(batch *pgx.Batch, now time.Time, w *walRead, full *bool) {
	if c.at.IsZero() || now.Sub(c.at) >= walFresh {
		batch.Queue(walPositionsSQL).QueryRow(func(row pgx.Row) (err error) {
			if *w, err = scanWAL(row); err == nil {
				*c, *full = walCache{at: now, read: *w}, true
			}
			return err
		})
		return
	}
	last := c.read
	batch.Queue(walInsertSQL).QueryRow(func(row pgx.Row) error {
		*w = last
		if err := row.Scan(&w.insert, &w.started); err != nil {
			return err
		}
		if !w.started.Equal(last.started) {
			w.flush = 0
		}
		return nil
	})
}

// queueWAL queues in batch, after a batch's COMMIT, the read of the WAL's
// positions (walCache.queue, with the relay's own cache). Once the batch
// has run, after notes a full read (noteWAL) and returns the insert
// position and the flush position.
func (r *Relay) queueWAL(batch *pgx.Batch, now time.Time) (after func() (wal, flush uint64)) {
	var w walRead
	var full bool
	r.walLast.queue(batch, now, &w, &full)
	return func() (uint64, uint64) {
		if full {
			r.noteWAL(w)
		}
		return w.insert, w.flush
	}
}

// readWAL scans walPositionsSQL's row: the insert position and the
// position every standby that can be seen has flushed. It sets how long
// the handoff keeps record fields past that (Config.StandbyRetention, when
// positions cannot be read) and whether replication is synchronous.
func (r *Relay) readWAL(row pgx.Row) (insert, flush uint64, err error) {
	w, err := scanWAL(row)
	if err != nil {
		return 0, 0, err
	}
	r.noteWAL(w)
	return w.insert, w.flush, nil
}

// walRead is a row of walPositionsSQL.
type walRead struct {
	insert, flush   uint64
	unknown, syncOn bool
	started         time.Time // the server's pg_postmaster_start_time()
}

func scanWAL(row pgx.Row) (w walRead, err error) {
	err = row.Scan(&w.insert, &w.flush, &w.unknown, &w.syncOn, &w.started)
	return w, err
}

// noteWAL keeps what w says of the standbys: whether the handoff record
// must hold batches for StandbyRetention (positions the role cannot read),
// and whether replication is synchronous.
func (r *Relay) noteWAL(w walRead) {
	r.handoff.Hold = 0
	if w.unknown {
		r.handoff.Hold = r.cfg.StandbyRetention
	}
	r.syncStandby, r.syncKnown = w.syncOn, true
}

// walPositions reads the WAL positions on a connection of pool
// (handoff.tidy).
func (r *Relay) walPositions(ctx context.Context, pool *pgxpool.Pool) (insert, flush uint64, err error) {
	insert, flush, err = r.readWAL(pool.QueryRow(ctx, walPositionsSQL))
	if err != nil {
		return 0, 0, fmt.Errorf("read the WAL position: %w", err)
	}
	return insert, flush, nil
}

// standbyFlushSQL reads, as byte offsets: the WAL insert position the
// claim noted (claimSQL: after its snapshot, before its own WAL; the
// insert position now, past the claim's own WAL, if it noted none); how many
// standbys count (see the top of this file), how many of them show a flush
// position, the least of those; whether this role may read them.
const standbyFlushSQL = `SELECT (coalesce(nullif(current_setting('stagedrain.claim_lsn', true), '')::pg_lsn, pg_current_wal_insert_lsn()) - '0/0'::pg_lsn)::bigint,
	count(*), count(r.flush_lsn), coalesce((min(r.flush_lsn) - '0/0'::pg_lsn)::bigint, 0),
	pg_has_role('pg_read_all_stats', 'USAGE')
FROM pg_stat_replication r
WHERE NOT EXISTS (SELECT FROM pg_replication_slots l WHERE l.slot_type = 'logical' AND l.active_pid = r.pid)
	AND (current_setting('synchronous_standby_names') = '' OR r.sync_state IN ('sync', 'quorum'))`

// standbyWaitMax bounds the wait for the standbys in one batch: past it the
// batch is rolled back (its rows stay staged, and the claim's transaction
// does not hold back vacuum) and retried with backoff.
const standbyWaitMax = 5 * time.Second

// errStandbyBehind fails a batch whose commits no standby had flushed
// within standbyWaitMax.
var errStandbyBehind = errors.New("the standbys have not flushed the batch's commits")

// awaitStandby returns once the standbys (see the top of this file) have
// flushed the WAL up to the insert position read now, on the claim's
// connection after its snapshot: every commit the claim saw is then on
// them. It does nothing unless Config.WaitForStandby is set or replication
// is synchronous.
func (r *Relay) awaitStandby(ctx context.Context, conn *pgxpool.Conn, log *zap.Logger) error {
	if !r.cfg.WaitForStandby && !r.syncKnown {
		// Once a leadership, before its first push; then after each
		// batch's commit (walPositionsSQL).
		if err := conn.QueryRow(ctx, `SELECT current_setting('synchronous_standby_names') <> ''`).Scan(&r.syncStandby); err != nil {
			return fmt.Errorf("read synchronous_standby_names: %w", err)
		}
		r.syncKnown = true
	}
	if !r.cfg.WaitForStandby && !r.syncStandby {
		return nil
	}
	var target uint64
	start := time.Now()
	for pause := time.Millisecond; ; pause = min(2*pause, 20*time.Millisecond) {
		var insert, flush uint64
		var n, known int
		var readable bool
		if err := conn.QueryRow(ctx, standbyFlushSQL).Scan(&insert, &n, &known, &flush, &readable); err != nil {
			return fmt.Errorf("read the standbys' flush position: %w", err)
		}
		if target == 0 {
			target = insert
		}
		if !readable {
			if r.cfg.WaitForStandby {
				return &permissionError{err: errors.New("permission denied: --wait-for-standby (WaitForStandby) reads pg_stat_replication's flush_lsn"),
					needs: "grant the relay's role pg_monitor (or pg_read_all_stats)"}
			}
			if !r.syncWarned {
				log.Warn("synchronous replication, but this role cannot read the standbys' positions (grant pg_monitor): " +
					"a commit whose wait for the standby was cancelled may be pushed before the standby has it")
				r.syncWarned = true
			}
			return nil
		}
		if n > 0 && known == n && flush >= target {
			return nil
		}
		if r.hooks.standbyBehind != nil {
			r.hooks.standbyBehind(target)
		}
		if time.Since(start) >= standbyWaitMax {
			return fmt.Errorf("%w within %s: %d standbys counted, %d with a position, least flush %d < %d",
				errStandbyBehind, standbyWaitMax, n, known, flush, target)
		}
		if !sleep(ctx, pause) {
			return ctx.Err()
		}
	}
}

// errReadOnly ends a session whose PostgreSQL is read-only: a standby in
// recovery (a URL that names it, or a multi-host URL without
// target_session_attrs=read-write), or a server whose transactions are
// read-only by default. The relay looks again after readOnlyRetry.
var errReadOnly = errors.New("PostgreSQL is read-only (a standby, or default_transaction_read_only is on): not draining, looking again")

// readOnlyRetry is how soon a relay that met a read-only PostgreSQL
// connects again: a standby being promoted becomes writable within it.
const readOnlyRetry = 500 * time.Millisecond

// failoverRetry caps the wait between database sessions of a relay whose
// URL names several hosts, so that it finds a promoted standby soon.
const failoverRetry = time.Second

// checkWritable returns errReadOnly when conn's server is read-only.
func checkWritable(ctx context.Context, conn *pgx.Conn) error {
	var ro bool
	if err := conn.QueryRow(ctx, `SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool`).Scan(&ro); err != nil {
		return fmt.Errorf("check read-only: %w", err)
	}
	if ro {
		return errReadOnly
	}
	return nil
}
