package relay

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// stagedJob is one claimed row of staged_jobs.
type stagedJob struct {
	id        int64
	name      string
	args      []byte // JSON text of a JSONB array
	queue     string
	runAt     *time.Time
	jid       string
	createdAt time.Time
	options   []byte   // JSON text of a JSONB object
	nulls     nullCols // columns read as NULL (a table made by hand): the row is poison
	bad       string   // why the source's mapping found the row poison, "" if it did not
	record    []byte   // the row as the source reads it back, for a source that needs it (stagedPushSource)
	// runAtInf and createdAtInf are pgtype.Infinity or NegativeInfinity
	// for a run_at or created_at that PostgreSQL holds as infinite (runAt
	// nil, createdAt zero then): no time.Time, epoch or job system's
	// timestamp can hold it, so the row is poison (bad), and is buried as
	// it was staged.
	runAtInf     pgtype.InfinityModifier
	createdAtInf pgtype.InfinityModifier
}

// nullCols is a set of the columns of a stagedJob that were NULL.
type nullCols uint8

const (
	nullName nullCols = 1 << iota
	nullArgs
	nullQueue
	nullJID
	nullCreatedAt
	nullOptions
)

// String names the first column of c, for a reason ("job_name").
func (c nullCols) String() string {
	for i, name := range [...]string{"job_name", "job_args", "queue", "jid", "created_at", "options"} {
		if c&(1<<i) != 0 {
			return name
		}
	}
	return ""
}

// tableSQL holds the statements of one schema's staged_jobs, with every
// identifier quoted once, here.
type tableSQL struct {
	claim    string
	claimDue string // claim, of rows whose run_at is due only
	// claimMark is claim, reading what the low-water mark needs
	// (lowwater.go); "" for a table that cannot have the mark.
	claimMark string
	// lastID is the quoted function that reads the table's sequence's last
	// value for the mark (011's stagedrain_last_id, gem_002.sql's
	// stagedrain_staged_push_last_id); markTable the quoted table and
	// markCheck the statement that says whether the table suits the mark
	// ($1 the table, $2 lastID's signature), and markOff the log line when
	// it does not (lowwater.go).
	lastID, markTable, markCheck, markOff string
	// claimDueMark is claimDue with the mark's reads: a target with no
	// scheduler (dueOnly) claims from the mark, and nextDueLook finds the
	// future rows it left below the mark once they are due (lowwater.go);
	// "" for a table that cannot have the mark that way.
	claimDueMark string
	// pollDue is claimDue's condition on a row t: a hot fleet's poll of a
	// schema with a target with no scheduler finds only the rows its claim
	// would take (fleet.go, pollChunkSQL).
	pollDue  string
	probe    string // the lowest id <= $1 still staged, above the last argument (lowwater.go)
	probeDue string // probe, of rows claimDue would take
	nextDue  string
	// nextDueLook is nextDue, and the look below the mark ($1) for rows
	// whose run_at came due since $2 (lowwater.go), and now().
	nextDueLook string
	reinsert    string
	backlog     string
	// backlogMark is backlog of the rows above the low-water mark ($2; the
	// queues are $3):
	// with the mark on, the rows below it were drained (lowwater.go), and
	// while a long transaction elsewhere holds the horizon their dead
	// index entries would make each sample walk them all.
	backlogMark string
	// backlogDueMark is backlogMark for a target with no scheduler: the
	// future rows a claim from the mark left below it count too (013's
	// index of the scheduled rows' run_at: a range from now()).
	backlogDueMark string
	bury           string
	version        string
	staged         string
}

// byQueue makes the claims take rows of the queues in $4 only (a relay with
// Config.Queues): the scan by id steps over other queues' rows, a heap
// fetch each (see README, "Several groups of queues").
func newTableSQL(schema string, byQueue bool) tableSQL {
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	claim := claimSQL{table: table, queue: "t.queue", byQueue: byQueue,
		returning: `t.id, t.job_name, t.job_args, t.queue, t.run_at, t.jid, t.created_at, t.options`}
	backlogWhere, probeWhere, backlogMarkWhere := "", "", ""
	probeAbove := ` AND id > $2::bigint` // where the probe starts (lowwater.go)
	if byQueue {
		backlogWhere = ` WHERE queue = ANY($2::text[])`
		probeWhere = ` AND queue = ANY($2::text[])`
		backlogMarkWhere = ` AND queue = ANY($3::text[])`
		probeAbove = ` AND id > $3::bigint`
	}
	markClaim := claim
	markClaim.mark = pgx.Identifier{schema, "stagedrain_last_id"}.Sanitize()
	// The rows a claim for a target with no scheduler takes: those whose
	// run_at is not in the future. A run_at of infinity (a table without
	// 008's CHECK) is never due: such rows are claimed too, to be
	// dead-lettered.
	const due = `(run_at IS NULL OR run_at <= now() OR NOT isfinite(run_at))`
	// Microseconds until the earliest future run_at, NULL if none: when to
	// wake for it. Through 013's index of the scheduled rows' run_at, from
	// now() to the first future one; a scan of the table without it.
	// Finite ones only: infinity minus now() is out of an interval's range.
	nextDue := `SELECT ceil(extract(epoch FROM min(run_at) - now()) * 1e6)::bigint FROM ` + table +
		` WHERE run_at > now() AND isfinite(run_at)`
	lookWhere := ""
	if byQueue {
		lookWhere = ` AND queue = ANY($3::text[])`
	}
	claimDue := ` AND ` + strings.ReplaceAll(due, "run_at", "t.run_at") // the claim's row is t
	// The backlog sample from the mark ($2): the rows above it, counted up
	// to $1, and the oldest created_at of the 100 lowest.
	countAbove := `(SELECT count(*) FROM (SELECT FROM ` + table + ` WHERE id > $2` + backlogMarkWhere + ` ORDER BY id LIMIT $1) c)`
	oldestAbove := `(SELECT min(created_at) FROM (SELECT created_at FROM ` + table + ` WHERE id > $2` + backlogMarkWhere + ` ORDER BY id LIMIT 100) o
				WHERE isfinite(created_at))`
	dead := pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()
	migrations := pgx.Identifier{schema, "stagedrain_migrations"}.Sanitize()
	return tableSQL{
		// Claim and delete in one statement: committed rows only (READ
		// COMMITTED sees nothing uncommitted), oldest id first, ids above $3
		// and not in $2 (rows this drain left staged). FOR UPDATE SKIP
		// LOCKED keeps them locked until the batch's transaction ends, so
		// even two relays that both think they lead never claim the same
		// row; a rollback, if the push fails, undoes the delete. It deletes
		// exactly the claimed rows: never "id <= max", which under READ
		// COMMITTED would delete a lower id committed after the claim. It
		// finds them by ctid, read from the rows it locked (no other session
		// can move or remove a locked row): a TID scan, where a join on id
		// hashed the whole table (a seq scan of every page the app's inserts
		// and the drain's deletes left, each claim) and "id = ANY" looked
		// each row up in the index again. RETURNING gives exactly what it
		// deleted, and only that is pushed.
		claim:     claim.sql(""),
		claimMark: markClaim.sql(""),
		lastID:    markClaim.mark,
		markTable: table,
		markCheck: markCheckSQL,
		markOff:   "claims start at the id index's start: staged_jobs.id's default is not CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval(<its own sequence, CACHE 1>) END (sql/018_id_default_inline.sql) or stagedrain_next_id() of it (011)",
		// Lock-free: rows a batch holds count as staged (lowwater.go).
		// Of the queues in $2 only, for a relay with Config.Queues: the
		// other groups' rows below its mark are theirs.
		// Above the id in the last argument only: the probe walks the
		// whole index below the mark only now and then (lowwater.go).
		probe: `SELECT id FROM ` + table + ` WHERE id <= $1` + probeAbove + probeWhere + ` ORDER BY id LIMIT 1`,
		// For a target with no scheduler: the future rows below the mark
		// are expected there (lowwater.go), and nextDueLook finds them
		// when due.
		probeDue: `SELECT id FROM ` + table + ` WHERE id <= $1` + probeAbove + probeWhere + ` AND ` + due + ` ORDER BY id LIMIT 1`,
		// For a target with no scheduler (streams, celery): rows whose
		// run_at is not in the future only. The scan by id steps over the
		// future rows above where it starts, each a heap fetch (see
		// README).
		claimDue:     claim.sql(claimDue),
		pollDue:      claimDue,
		claimDueMark: markClaim.sql(claimDue),
		nextDue:      nextDue,
		// One round trip after each drain: nextDue, and the lowest id at
		// or below the mark ($1) of the rows whose run_at came due after
		// $2 (the last look's now(), less a margin), through 013's index:
		// the future rows a claim from the mark left below it, now due
		// (lowwater.go). Of the queues in $3 only, with Config.Queues.
		nextDueLook: `SELECT (` + nextDue + `), (SELECT min(id) FROM ` + table +
			` WHERE run_at > $2 AND run_at <= now() AND isfinite(run_at) AND id <= $1` + lookWhere + `), now()`,
		// For the summary line: staged rows, counted up to $1, and the
		// oldest created_at among the 100 lowest ids (finite ones: an
		// infinite one, of a row about to be dead-lettered, would fail the
		// scan); of the queues in $2 only, for a relay with Config.Queues.
		backlog: `SELECT (SELECT count(*) FROM (SELECT FROM ` + table + backlogWhere + ` LIMIT $1) c),
			(SELECT min(created_at) FROM (SELECT created_at FROM ` + table + backlogWhere + ` ORDER BY id LIMIT 100) o
				WHERE isfinite(created_at))`,
		backlogMark: `SELECT ` + countAbove + `, ` + oldestAbove,
		backlogDueMark: `SELECT least($1, ` + countAbove + ` + (SELECT count(*) FROM (SELECT FROM ` + table +
			` WHERE run_at > now() AND id <= $2` + backlogMarkWhere + ` LIMIT $1) f)), ` + oldestAbove,
		// Puts back, unchanged, the rows of a batch that were not pushed.
		reinsert: `INSERT INTO ` + table + ` (` + claimColumns + `)
			SELECT id, job_name, job_args::jsonb, queue, run_at, jid, created_at, options::jsonb
			FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::timestamptz[], $6::text[], $7::timestamptz[], $8::text[])
				AS u(id, job_name, job_args, queue, run_at, jid, created_at, options)`,
		// Moves poison rows of a batch to the dead-letter table, columns
		// unchanged (NULLs too), with the reason; attempts is 1, as poison
		// is not retried. A row whose id is dead already (copied back into
		// staged_jobs by hand, not moved by dead retry) replaces it and
		// counts one more attempt: failing the commit instead would block
		// the queue on it for good.
		// Which of $1 are still staged (for the handoff record; rows a
		// transaction is deleting count until it commits).
		staged: `SELECT id FROM ` + table + ` WHERE id = ANY($1)`,
		bury: `INSERT INTO ` + dead + ` AS d (` + claimColumns + `, reason, attempts)
			SELECT id, job_name, job_args::jsonb, queue, run_at, jid, created_at, options::jsonb, reason, 1
			FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::timestamptz[], $6::text[], $7::timestamptz[], $8::text[], $9::text[])
				AS u(id, job_name, job_args, queue, run_at, jid, created_at, options, reason)
			ON CONFLICT (id) DO UPDATE SET job_name = excluded.job_name, job_args = excluded.job_args,
				queue = excluded.queue, run_at = excluded.run_at, jid = excluded.jid, created_at = excluded.created_at,
				options = excluded.options, reason = excluded.reason, failed_at = excluded.failed_at, attempts = d.attempts + 1`,
		// The schema version Migrate recorded; NULL when it recorded none,
		// and an undefined_table error when it never ran.
		version: `SELECT max(version) FROM ` + migrations,
	}
}

// claimSQL builds a source's claim statements. Every source's claims
// take the same arguments and leave out the same rows; a source gives its
// table, the SQL of a row's queue and what the claim returns.
//
// Arguments: $1 the limit, $2 the ids to skip, $3 the id to claim above,
// with byQueue $4 the queues to take (Config.Queues), and last ($4, or $5
// with byQueue) the queues to leave out: those backpressure pauses for
// their length (backpressure.excluded), a text[], never NULL. Without the
// last, a long backlog of a paused queue would be claimed and put back,
// batch after batch, ahead of every other queue's rows.
type claimSQL struct {
	table string // quoted
	// queue is the SQL of a row's queue (the row is t). A NULL one (a
	// poison row of a table made by hand) is left out while any queue is.
	queue     string
	byQueue   bool
	returning string // the columns RETURNING gives, of the row t
	// mark, when set, is the quoted stagedrain_last_id(): the claim keeps
	// its snapshot's xmin and the sequence's last value for claimMarkSQL
	// (lowwater.go).
	mark string
}

// sql is the claim statement, with extra conditions on the rows (of t).
//
// The exclusion tests the array's cardinality first: with nothing left
// out (the common case) the queue's SQL is not evaluated, which for the
// gem's json payload is a parse of each row the claim scans (measured: a
// generic plan's scan of 200,000 rows took 131 ms with it, 57 ms without,
// 43 ms with no exclusion at all).
func (c claimSQL) sql(where string) string {
	out := "$4"
	if c.byQueue {
		where += ` AND ` + c.queue + ` = ANY($4::text[])`
		out = "$5"
	}
	where += ` AND (cardinality(` + out + `::text[]) = 0 OR ` + c.queue + ` <> ALL(` + out + `::text[]))`
	// The WAL insert position after the statement's snapshot and before
	// its first row lock, kept for the transaction: the commits the claim
	// sees are below it (standby.go). A one-time filter, read once.
	where += ` AND (SELECT set_config('stagedrain.claim_lsn', pg_current_wal_insert_lsn()::text, true)) IS NOT NULL`
	if c.mark != "" {
		// Read before the claim locks its first row, which gives its
		// transaction an id (lowwater.go).
		where += ` AND (SELECT set_config('stagedrain.claim_mark', pg_snapshot_xmin(pg_current_snapshot())::text || ' ' || coalesce(` +
			c.mark + `()::text, ''), true)) IS NOT NULL`
	}
	return `WITH b AS MATERIALIZED (SELECT ctid FROM ` + c.table + ` t` +
		` WHERE id > $3 AND id <> ALL($2)` + where + ` ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)` +
		` DELETE FROM ` + c.table + ` t WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM b)) RETURNING ` + c.returning
}

// claimBatch begins a transaction on conn and, in the same round trip,
// claims (deletes) up to limit committed rows into dst[:0], sorted by id,
// each read by scan (nil: staged_jobs' columns, stagedJobScan).
// On success the transaction stays open: the caller commits what it pushed.
// extra are the statement's arguments after $3 (see claimSQL).
func claimBatch(ctx context.Context, conn *pgx.Conn, sql string, scan rowScan, limit int, skip []int64, from int64, dst []stagedJob, extra ...any) ([]stagedJob, error) {
	return claimBatchMark(ctx, conn, sql, scan, limit, skip, from, dst, nil, nil, extra...)
}

// claimBatchMark is claimBatch; with mark non-nil, sql is a tableSQL's
// claimMark, and mark gets what it read (lowwater.go); with look non-nil,
// look.xids gets the transactions in progress if a commit holds the
// schema's 'behind' lock (lookBehindSQL).
func claimBatchMark(ctx context.Context, conn *pgx.Conn, sql string, scan rowScan, limit int, skip []int64, from int64, dst []stagedJob, mark *markRead, look *behindLook, extra ...any) ([]stagedJob, error) {
	if skip == nil {
		skip = []int64{} // an empty array: NULL would make "id <> ALL" NULL
	}
	b := &pgx.Batch{}
	b.Queue(beginClaimSQL)
	if look != nil {
		// Its own statement, before the claim's snapshot (READ
		// COMMITTED): a transaction not listed here had released
		// 'behind', so its commit was visible, before the claim began.
		b.Queue(lookBehindSQL, look.schema)
	}
	b.Queue(sql, append([]any{limit, skip, from}, extra...)...)
	if mark != nil {
		b.Queue(claimMarkSQL)
	}
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return dst[:0], fmt.Errorf("begin: %w", err)
	}
	if look != nil {
		if err := br.QueryRow().Scan(&look.xids); err != nil {
			_ = br.Close()
			return dst[:0], fmt.Errorf("read the transactions in progress: %w", err)
		}
	}
	dst, err := readClaimed(br, scan, dst)
	if err != nil {
		_ = br.Close()
		return dst, fmt.Errorf("claim batch: %w", err)
	}
	if mark != nil {
		if err := mark.scan(br.QueryRow()); err != nil {
			_ = br.Close()
			return dst, fmt.Errorf("claim batch: read mark: %w", err)
		}
	}
	if err := br.Close(); err != nil {
		return dst, fmt.Errorf("claim batch: %w", err)
	}
	return dst, nil
}

// readClaimed reads the rows of the batch's next statement, a claim, into
// dst[:0], each by scan (nil: staged_jobs' columns, stagedJobScan), sorted
// by id: RETURNING follows no order, and jobs of a queue are pushed in id
// order.
func readClaimed(br pgx.BatchResults, scan rowScan, dst []stagedJob) ([]stagedJob, error) {
	if scan == nil {
		scan = stagedJobScan()
	}
	dst = dst[:0]
	rows, err := br.Query()
	if err != nil {
		return dst, err
	}
	for rows.Next() {
		dst = append(dst, stagedJob{})
		if err := scan(rows, &dst[len(dst)-1]); err != nil {
			rows.Close()
			return dst, fmt.Errorf("scan row: %w", err)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return dst, err
	}
	slices.SortFunc(dst, func(a, b stagedJob) int { return cmp.Compare(a.id, b.id) })
	return dst, nil
}

// rowScan reads one claimed row into j.
type rowScan func(rows pgx.Rows, j *stagedJob) error

// stagedJobScan returns a rowScan of claimColumns, for one batch (it reuses
// its scratch values from row to row). Columns are scanned into nullable
// types: a NULL in a table made by hand makes its row poison (see
// stagedJob.nulls), not the whole batch fail. So is an infinite run_at or
// created_at (see stagedJob.runAtInf): scanned into a time.Time, it failed
// the claim, and so every drain, for good.
func stagedJobScan() rowScan {
	var name, queue, jid pgtype.Text
	var runAt, createdAt pgtype.Timestamptz
	return func(rows pgx.Rows, j *stagedJob) error {
		return scanStagedJob(rows, j, &name, &queue, &jid, &runAt, &createdAt)
	}
}

func scanStagedJob(rows pgx.Rows, j *stagedJob, name, queue, jid *pgtype.Text, runAt, createdAt *pgtype.Timestamptz) error {
	if err := rows.Scan(&j.id, name, &j.args, queue, runAt, jid, createdAt, &j.options); err != nil {
		return err
	}
	j.name, j.queue, j.jid, j.createdAt = name.String, queue.String, jid.String, createdAt.Time
	j.nulls, j.bad, j.record = 0, "", nil
	// A NULL leaves InfinityModifier Finite.
	j.runAt, j.runAtInf, j.createdAtInf = nil, runAt.InfinityModifier, createdAt.InfinityModifier
	switch {
	case j.runAtInf != pgtype.Finite:
		j.bad = infiniteReason("run_at", j.runAtInf)
	case runAt.Valid:
		t := runAt.Time
		j.runAt = &t
	}
	if j.createdAtInf != pgtype.Finite && j.bad == "" {
		j.bad = infiniteReason("created_at", j.createdAtInf)
	}
	for _, c := range [...]struct {
		null bool
		col  nullCols
	}{
		{!name.Valid, nullName}, {j.args == nil, nullArgs}, {!queue.Valid, nullQueue},
		{!jid.Valid, nullJID}, {!createdAt.Valid, nullCreatedAt}, {j.options == nil, nullOptions},
	} {
		if c.null {
			j.nulls |= c.col
		}
	}
	return nil
}

// infiniteReason is the dead-letter reason of a row whose column col is
// infinite.
func infiniteReason(col string, inf pgtype.InfinityModifier) string {
	return fmt.Sprintf("%s is %s: Go and the job systems cannot hold it", col, inf)
}

// timestamptz is a timestamp column as read by scanStagedJob, to write it
// back: inf when infinite, else t, NULL when t is nil.
func timestamptz(t *time.Time, inf pgtype.InfinityModifier) pgtype.Timestamptz {
	switch {
	case inf != pgtype.Finite:
		return pgtype.Timestamptz{InfinityModifier: inf, Valid: true}
	case t == nil:
		return pgtype.Timestamptz{}
	}
	return pgtype.Timestamptz{Time: *t, Valid: true}
}

// reinsertArgs are the columns of jobs as arrays, for tableSQL.reinsert.
func reinsertArgs(jobs []stagedJob) []any {
	n := len(jobs)
	ids, names, args, queues := make([]int64, n), make([]string, n), make([]string, n), make([]string, n)
	runAts, jids, createdAts, options := make([]pgtype.Timestamptz, n), make([]string, n), make([]pgtype.Timestamptz, n), make([]string, n)
	for i := range jobs {
		j := &jobs[i]
		ids[i], names[i], args[i], queues[i] = j.id, j.name, string(j.args), j.queue
		runAts[i], jids[i], createdAts[i], options[i] = timestamptz(j.runAt, j.runAtInf), j.jid, timestamptz(&j.createdAt, j.createdAtInf), string(j.options)
	}
	return []any{ids, names, args, queues, runAts, jids, createdAts, options}
}

// buryArgs are the columns of jobs as arrays, with each job's reason, for
// tableSQL.bury. A column read as NULL is written as NULL, one read as
// infinity as infinity.
func buryArgs(jobs []stagedJob, reasons []string) []any {
	n := len(jobs)
	ids, names, args, queues := make([]int64, n), make([]*string, n), make([]*string, n), make([]*string, n)
	runAts, jids, createdAts, options := make([]pgtype.Timestamptz, n), make([]*string, n), make([]pgtype.Timestamptz, n), make([]*string, n)
	for i := range jobs {
		j := &jobs[i]
		ids[i], runAts[i] = j.id, timestamptz(j.runAt, j.runAtInf)
		if j.nulls&nullName == 0 {
			names[i] = &j.name
		}
		if j.nulls&nullArgs == 0 {
			s := string(j.args)
			args[i] = &s
		}
		if j.nulls&nullQueue == 0 {
			queues[i] = &j.queue
		}
		if j.nulls&nullJID == 0 {
			jids[i] = &j.jid
		}
		if j.nulls&nullCreatedAt == 0 {
			createdAts[i] = timestamptz(&j.createdAt, j.createdAtInf)
		}
		if j.nulls&nullOptions == 0 {
			s := string(j.options)
			options[i] = &s
		}
	}
	return []any{ids, names, args, queues, runAts, jids, createdAts, options, reasons}
}
