package relay

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

// Source is the table the relay drains, and the layout of its rows.
type Source string

const (
	// SourceStagedJobs drains <schema>.staged_jobs, made by Migrate. The
	// default.
	SourceStagedJobs Source = "staged_jobs"
	// SourceSidekiqStagedPush drains <schema>.sidekiq_staged_push_jobs, the
	// table of the sidekiq-staged_push gem (payload: a Sidekiq job hash as
	// JSON). Migrate with WithSource adds only triggers to it: the wake
	// trigger, and the low-water mark's (sql/gem_002.sql).
	// Poison rows stay in the table: the relay skips them (see
	// Relay.poisoned).
	SourceSidekiqStagedPush Source = "sidekiq_staged_push"
)

// A source owns what the relay knows of the table it drains: the claim
// (and its due-only variant), the scan of a claimed row into a stagedJob,
// the reinsert of rows left staged, where poison rows go, the backlog
// query, and the check at leadership that the table is ready.
type source interface {
	// statements returns the source's SQL, identifiers quoted: claim,
	// claimDue, nextDue, backlog, staged, and, when it buries, bury.
	statements() tableSQL
	// scanner returns what reads the rows of one claim, each into a
	// stagedJob.
	scanner() rowScan
	// reinsert returns the statement and arguments that put jobs back,
	// unchanged.
	reinsert(jobs []stagedJob) (string, []any)
	// buries reports whether poison rows leave the table for a dead-letter
	// table (tableSQL.bury); if not, they are put back and skipped.
	buries() bool
	// check returns an error when the table is not ready for this binary
	// (ErrNotMigrated, ErrSchemaTooNew), at leadership.
	check(ctx context.Context, conn *pgx.Conn) error
}

func newSource(cfg Config, version int) (source, error) {
	if cfg.Source == SourceSidekiqStagedPush {
		s := newStagedPushSource(cfg.Schema)
		var err error
		_, s.wake, err = wakeFunction()
		return s, err
	}
	return &stagedJobsSource{schema: cfg.Schema, sql: newTableSQL(cfg.Schema, len(cfg.Queues) > 0), version: version}, nil
}

// stagedJobsSource is SourceStagedJobs.
type stagedJobsSource struct {
	schema  string
	sql     tableSQL
	version int // the schema version this binary needs
}

func (s *stagedJobsSource) statements() tableSQL { return s.sql }
func (s *stagedJobsSource) buries() bool         { return true }

func (s *stagedJobsSource) scanner() rowScan { return stagedJobScan() }

func (s *stagedJobsSource) reinsert(jobs []stagedJob) (string, []any) {
	return s.sql.reinsert, reinsertArgs(jobs)
}

// check compares the schema version that Migrate recorded with the one
// this binary needs, in one query: a schema Migrate never ran on, or one it
// has not brought up to date (ErrNotMigrated), would fail every drain with
// an error retrying cannot fix, and so would a schema a newer stagedrain has
// changed (ErrSchemaTooNew).
func (s *stagedJobsSource) check(ctx context.Context, conn *pgx.Conn) error {
	var have *int // nil: no version recorded
	err := conn.QueryRow(ctx, s.sql.version).Scan(&have)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") {
		err = nil // no stagedrain_migrations table, or no schema: never migrated
	}
	if err != nil {
		return fmt.Errorf("check schema version: %w", err)
	}
	switch {
	case have == nil:
		return fmt.Errorf("%w in %q: no schema version recorded (this stagedrain needs %d): run 'stagedrain migrate' first",
			ErrNotMigrated, s.schema, s.version)
	case *have < s.version:
		return fmt.Errorf("%w in %q: schema version %d is older than this stagedrain needs (%d): run 'stagedrain migrate' first",
			ErrNotMigrated, s.schema, *have, s.version)
	case *have > s.version:
		return fmt.Errorf("%w in %q: schema version %d is newer than this stagedrain knows (%d): upgrade stagedrain",
			ErrSchemaTooNew, s.schema, *have, s.version)
	}
	return nil
}

// stagedPushSource is SourceSidekiqStagedPush: the gem's table,
// sidekiq_staged_push_jobs(id bigserial, payload json NOT NULL, created_at,
// updated_at). Its payload is a Sidekiq job hash, often as raw as
// {"class":"HardWorker","args":[1]}: the relay completes it as Sidekiq's
// client would (see mapStagedPush).
//
// A claimed row keeps its whole record as JSON (to_json of the row), so
// that a row put back is the same row: every column, whatever the table
// holds, restored by json_populate_recordset from the row's own type.
type stagedPushSource struct {
	schema string
	table  string // quoted
	sql    tableSQL
	wake   int // the migration of the stagedrain_wake() this binary needs
}

// stagedPushAt is the payload's "at" as numeric when it is a JSON number,
// else NULL: never an error that would fail every claim.
// The column is json (the gem's first migration) or jsonb (its later one).
const stagedPushAt = `CASE WHEN json_typeof((t.payload -> 'at')::json) = 'number' THEN (t.payload ->> 'at')::numeric END`

// stagedPushDue is a due-only claim's condition on a row t: its "at" is not
// in the future.
const stagedPushDue = ` AND NOT coalesce(` + stagedPushAt + ` > extract(epoch FROM now()), false)`

// stagedPushQueue is a row's queue, as mapStagedPush reads it: the
// payload's "queue", else "default" (a payload no worker could run gets
// one too, never NULL).
const stagedPushQueue = `coalesce(t.payload ->> 'queue', 'default')`

func newStagedPushSource(schema string) *stagedPushSource {
	table := pgx.Identifier{schema, sidekiqStagedPushTable}.Sanitize()
	claim := claimSQL{table: table, queue: stagedPushQueue,
		returning: `t.id, t.payload::text, extract(epoch FROM t.created_at)::float8, to_json(t)::text`}
	markClaim := claim
	markClaim.mark = pgx.Identifier{schema, "stagedrain_staged_push_last_id"}.Sanitize()
	// The oldest created_at (UTC, as Rails writes it) of the 100 lowest
	// ids of the rows in where.
	oldest := func(where string) string {
		return `(SELECT to_timestamp(extract(epoch FROM min(created_at))) FROM (SELECT created_at FROM ` + table + ` t` + where + ` ORDER BY id LIMIT 100) o
				WHERE isfinite(created_at))`
	}
	return &stagedPushSource{schema: schema, table: table, sql: tableSQL{
		claim: claim.sql(""),
		// From the low-water mark, as staged_jobs' (lowwater.go), with
		// gem_NNN.sql's trigger. Not for a target with no scheduler: the
		// payload's "at" has no index to find the future rows below the
		// mark by when they come due (claimDueMark, nextDueLook unset).
		claimMark: markClaim.sql(""),
		lastID:    markClaim.mark,
		markTable: table,
		markCheck: gemMarkCheckSQL,
		markOff:   "claims start at the id index's start: sidekiq_staged_push_jobs has no enabled stagedrain_xid_first trigger, or its id's default is not nextval() of a sequence with CACHE 1 (run 'stagedrain migrate --source sidekiq_staged_push'; sql/gem_002.sql)",
		probe:     `SELECT id FROM ` + table + ` WHERE id <= $1 AND id > $2::bigint ORDER BY id LIMIT 1`,
		backlogMark: `SELECT (SELECT count(*) FROM (SELECT FROM ` + table + ` WHERE id > $2 ORDER BY id LIMIT $1) c), ` +
			oldest(` WHERE id > $2`),
		// A job whose "at" is in the future stays staged until it is due.
		claimDue: claim.sql(stagedPushDue),
		pollDue:  stagedPushDue,
		// Microseconds until the earliest future "at" (at most a day),
		// NULL if none.
		nextDue: `SELECT ceil(least(min(at) - extract(epoch FROM now()), 86400) * 1e6)::bigint FROM (SELECT ` +
			stagedPushAt + ` AS at FROM ` + table + ` t) s WHERE at > extract(epoch FROM now())`,
		// A poison row's infinite created_at does not count: it stays in
		// the table, and would fail every scan of the oldest.
		backlog: `SELECT (SELECT count(*) FROM (SELECT FROM ` + table + ` LIMIT $1) c), ` + oldest(""),
		staged:  `SELECT id FROM ` + table + ` WHERE id = ANY($1)`,
		// Puts rows back from their records (to_json of each row).
		reinsert: `INSERT INTO ` + table + ` SELECT * FROM json_populate_recordset(NULL::` + table + `, $1::json)`,
	}}
}

func (s *stagedPushSource) statements() tableSQL { return s.sql }
func (s *stagedPushSource) buries() bool         { return false }

func (s *stagedPushSource) reinsert(jobs []stagedJob) (string, []any) {
	n := 2
	for i := range jobs {
		n += len(jobs[i].record) + 1
	}
	b := make([]byte, 0, n)
	b = append(b, '[')
	for i := range jobs {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, jobs[i].record...)
	}
	b = append(b, ']')
	return s.sql.reinsert, []any{string(b)}
}

func (s *stagedPushSource) scanner() rowScan { return s.scan }

func (s *stagedPushSource) scan(rows pgx.Rows, j *stagedJob) error {
	var payload []byte
	var created *float64
	if err := rows.Scan(&j.id, &payload, &created, &j.record); err != nil {
		return err
	}
	mapStagedPush(j, payload, created, time.Now())
	return nil
}

// mapStagedPush fills j from a Sidekiq job hash, completing it as
// Sidekiq's client would: queue "default", a random 24-hex jid, created_at
// from the row (else now); "at" becomes runAt (the schedule's score), and
// enqueued_at is the push's. Every other key (retry, backtrace, tags,
// bid, ...) goes to options unchanged; the sidekiq target writes retry
// true when it is missing. A payload no worker could run sets j.bad.
func mapStagedPush(j *stagedJob, payload []byte, created *float64, now time.Time) {
	*j = stagedJob{id: j.id, record: j.record, options: []byte("{}")}
	j.createdAt = now
	if created != nil {
		var ok bool
		if j.createdAt, ok = fromEpoch(*created); !ok {
			// 'infinity' or '-infinity' (the column's epoch is then ±Inf).
			j.bad = infiniteReason("created_at", pgtype.Infinity)
			if *created < 0 {
				j.bad = infiniteReason("created_at", pgtype.NegativeInfinity)
			}
			if !math.IsInf(*created, 0) {
				j.bad = "created_at is out of range"
			}
			return
		}
	}
	var hash map[string]json.RawMessage
	if payload == nil {
		j.bad = "payload is NULL"
		return
	}
	if err := json.Unmarshal(payload, &hash); err != nil || hash == nil {
		j.bad = "payload is not a JSON object"
		return
	}
	str := func(key string) (string, bool, error) {
		raw, ok := hash[key]
		if !ok {
			return "", false, nil
		}
		var s string
		if err := json.Unmarshal(raw, &s); err != nil || s == "" {
			return "", true, fmt.Errorf("payload's %q is not a non-empty string", key)
		}
		return s, true, nil
	}
	num := func(key string) (float64, bool, error) {
		raw, ok := hash[key]
		if !ok {
			return 0, false, nil
		}
		var f float64
		if err := json.Unmarshal(raw, &f); err != nil || string(bytes.TrimSpace(raw)) == "null" {
			return 0, true, fmt.Errorf("payload's %q is not a number", key)
		}
		return f, true, nil
	}
	var err error
	var ok bool
	if j.name, ok, err = str("class"); err != nil || !ok {
		j.bad = "payload has no \"class\""
		if err != nil {
			j.bad = err.Error()
		}
		return
	}
	args := bytes.TrimSpace(hash["args"])
	if len(args) == 0 || args[0] != '[' {
		j.bad = "payload's \"args\" is not a JSON array"
		return
	}
	j.args = args
	if j.queue, ok, err = str("queue"); err != nil {
		j.bad = err.Error()
		return
	} else if !ok {
		j.queue = "default"
	}
	if j.jid, ok, err = str("jid"); err != nil {
		j.bad = err.Error()
		return
	} else if !ok {
		j.jid = newJID()
	}
	if c, ok, err := num("created_at"); err != nil {
		j.bad = err.Error()
		return
	} else if ok {
		if c > 1e11 { // Sidekiq 8: integer milliseconds
			c /= 1000
		}
		if j.createdAt, ok = fromEpoch(c); !ok {
			j.bad = `payload's "created_at" is out of range`
			return
		}
	}
	if at, ok, err := num("at"); err != nil {
		j.bad = err.Error()
		return
	} else if ok {
		t, ok := fromEpoch(at)
		if !ok {
			j.bad = `payload's "at" is out of range`
			return
		}
		j.runAt = &t
	}
	var keys []string
	for k := range hash {
		switch k {
		case "class", "args", "queue", "jid", "created_at", "enqueued_at", "at":
		default:
			keys = append(keys, k)
		}
	}
	if len(keys) == 0 {
		return
	}
	slices.Sort(keys)
	o := []byte{'{'}
	for i, k := range keys {
		if i > 0 {
			o = append(o, ',')
		}
		o = targets.AppendJSONString(o, k)
		o = append(o, ':')
		o = append(o, bytes.TrimSpace(hash[k])...)
	}
	j.options = append(o, '}')
}

// fromEpoch is float epoch seconds as a time, to the microsecond; false
// when s is not finite or its microseconds overflow an int64 (about
// 292,000 years either side of 1970), which no job system could hold.
func fromEpoch(s float64) (time.Time, bool) {
	us := math.Round(s * 1e6)
	if math.IsNaN(us) || us >= math.MaxInt64 || us <= math.MinInt64 {
		return time.Time{}, false
	}
	return time.UnixMicro(int64(us)), true
}

// newJID is a random Sidekiq jid: 24 lowercase hex digits.
func newJID() string {
	var b [12]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

// check verifies that the gem's table and the wake trigger are there, the
// trigger running the stagedrain_wake() this binary needs (there is no
// stagedrain_migrations table for this source).
func (s *stagedPushSource) check(ctx context.Context, conn *pgx.Conn) error {
	var table, trigger bool
	var comment string
	if err := conn.QueryRow(ctx, wakeTriggerSQL, s.table).Scan(&table, &trigger, &comment); err != nil {
		return fmt.Errorf("check %s: %w", s.table, err)
	}
	have := wakeVersion(comment)
	switch {
	case !table:
		return fmt.Errorf("%w in %q: no table %s (install sidekiq-staged_push and run its migration, then run 'stagedrain migrate --source sidekiq_staged_push' first)",
			ErrNotMigrated, s.schema, sidekiqStagedPushTable)
	case !trigger:
		return fmt.Errorf("%w in %q: %s has no stagedrain_wake trigger: run 'stagedrain migrate --source sidekiq_staged_push' first",
			ErrNotMigrated, s.schema, sidekiqStagedPushTable)
	case have < s.wake:
		return fmt.Errorf("%w in %q: the stagedrain_wake trigger of %s is older than this stagedrain needs (%d): run 'stagedrain migrate --source sidekiq_staged_push' first",
			ErrNotMigrated, s.schema, sidekiqStagedPushTable, s.wake)
	case have > s.wake:
		return fmt.Errorf("%w in %q: the stagedrain_wake trigger of %s is from a newer stagedrain (%d, this one knows %d): upgrade stagedrain",
			ErrSchemaTooNew, s.schema, sidekiqStagedPushTable, have, s.wake)
	}
	return nil
}

// The gem's table has no stagedrain_migrations: the trigger's comment
// records which migration's stagedrain_wake() it runs, "stagedrain_wake N",
// for the check at leadership.
const wakeCommentPrefix = "stagedrain_wake "

// wakeTriggerSQL reads, for the table $1: whether it exists, whether it has
// the stagedrain_wake trigger, and that trigger's comment.
const wakeTriggerSQL = `SELECT c.oid IS NOT NULL, t.oid IS NOT NULL, coalesce(obj_description(t.oid, 'pg_trigger'), '')
	FROM (SELECT to_regclass($1) AS oid) c
	LEFT JOIN pg_trigger t ON t.tgrelid = c.oid AND t.tgname = 'stagedrain_wake'`

// wakeVersion reads the version out of a trigger comment; 0 if none.
func wakeVersion(comment string) int {
	v, err := strconv.Atoi(strings.TrimPrefix(comment, wakeCommentPrefix))
	if err != nil || !strings.HasPrefix(comment, wakeCommentPrefix) {
		return 0
	}
	return v
}

// The gem's id-after-xid trigger (sql/gem_NNN.sql) records its version the
// same way: "stagedrain_gem N".
const gemCommentPrefix = "stagedrain_gem "

// gemTriggerSQL reads the comment of the table $1's stagedrain_xid_first
// trigger; "" when it has none.
const gemTriggerSQL = `SELECT coalesce((SELECT obj_description(t.oid, 'pg_trigger') FROM pg_trigger t
	WHERE t.tgrelid = $1::regclass AND t.tgname = 'stagedrain_xid_first'), '')`

// gemVersion reads the version out of the xid-first trigger's comment; 0
// if none.
func gemVersion(comment string) int {
	v, err := strconv.Atoi(strings.TrimPrefix(comment, gemCommentPrefix))
	if err != nil || !strings.HasPrefix(comment, gemCommentPrefix) {
		return 0
	}
	return v
}

// migrateStagedPush adds the wake trigger to the gem's table in schema: the
// stagedrain_wake() function (created or replaced) and, when missing, the
// deferred constraint trigger; and gem_NNN.sql's statement trigger, which
// gives the low-water mark its invariant there. Nothing else: no table, no
// schema, no change to the table's columns.
func migrateStagedPush(ctx context.Context, conn *pgx.Conn, schema string) (MigrateResult, error) {
	var res MigrateResult
	fn, version, err := wakeFunction()
	if err != nil {
		return res, fmt.Errorf("read sql/: %w", err)
	}
	gem, gemV, err := gemFile()
	if err != nil {
		return res, fmt.Errorf("read sql/: %w", err)
	}
	table := pgx.Identifier{schema, sidekiqStagedPushTable}.Sanitize()
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, migrateLockSQL, migrateLockName(schema)); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		var exists, hasTrigger bool
		var comment string
		if err := tx.QueryRow(ctx, wakeTriggerSQL, table).Scan(&exists, &hasTrigger, &comment); err != nil {
			return fmt.Errorf("look up %s: %w", table, err)
		}
		res.Current = wakeVersion(comment)
		if !exists {
			return fmt.Errorf("no table %s: install sidekiq-staged_push and run its migration first", table)
		}
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+pgx.Identifier{schema}.Sanitize()); err != nil {
			return fmt.Errorf("set search_path: %w", err)
		}
		// CREATE TRIGGER locks the app's table: rather fail than stall
		// the app's writes queued behind it.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
			return fmt.Errorf("set lock_timeout: %w", err)
		}
		var gemComment string
		if err := tx.QueryRow(ctx, gemTriggerSQL, table).Scan(&gemComment); err != nil {
			return fmt.Errorf("look up %s: %w", table, err)
		}
		gemHave := gemVersion(gemComment)
		if gemHave > gemV {
			return fmt.Errorf("the stagedrain_xid_first trigger of %s is from a newer stagedrain (%d, this one knows %d): upgrade stagedrain",
				table, gemHave, gemV)
		}
		if hasTrigger && res.Current == version && gemHave == gemV {
			return nil // nothing to do: write nothing
		}
		if res.Current > version {
			return fmt.Errorf("the stagedrain_wake trigger of %s is from a newer stagedrain (%d, this one knows %d): upgrade stagedrain",
				table, res.Current, version)
		}
		if !hasTrigger || res.Current < version {
			if _, err := tx.Exec(ctx, fn, pgx.QueryExecModeSimpleProtocol); err != nil {
				return fmt.Errorf("create stagedrain_wake(): %w", err)
			}
			res.Applied = append(res.Applied, fmt.Sprintf("stagedrain_wake() of wake_%03d.sql", version))
			if !hasTrigger {
				if _, err := tx.Exec(ctx, `CREATE CONSTRAINT TRIGGER stagedrain_wake
					AFTER INSERT ON `+table+`
					DEFERRABLE INITIALLY DEFERRED
					FOR EACH ROW EXECUTE FUNCTION stagedrain_wake()`); err != nil {
					return fmt.Errorf("create trigger stagedrain_wake: %w", err)
				}
				res.Applied = append(res.Applied, "stagedrain_wake trigger on "+sidekiqStagedPushTable)
			}
			if _, err := tx.Exec(ctx, `COMMENT ON TRIGGER stagedrain_wake ON `+table+` IS '`+wakeCommentPrefix+strconv.Itoa(version)+`'`); err != nil {
				return fmt.Errorf("comment on trigger stagedrain_wake: %w", err)
			}
		}
		if gemHave < gemV {
			// The id after the transaction id (gem_NNN.sql), for the
			// low-water mark.
			if _, err := tx.Exec(ctx, gem, pgx.QueryExecModeSimpleProtocol); err != nil {
				return fmt.Errorf("apply gem_%03d.sql: %w", gemV, err)
			}
			if _, err := tx.Exec(ctx, `COMMENT ON TRIGGER stagedrain_xid_first ON `+table+` IS '`+gemCommentPrefix+strconv.Itoa(gemV)+`'`); err != nil {
				return fmt.Errorf("comment on trigger stagedrain_xid_first: %w", err)
			}
			res.Applied = append(res.Applied, fmt.Sprintf("stagedrain_xid_first trigger on %s (gem_%03d.sql)", sidekiqStagedPushTable, gemV))
		}
		res.Current = version
		return nil
	})
	if err != nil {
		return MigrateResult{}, fmt.Errorf("migrate schema %q for source %s: %w", schema, SourceSidekiqStagedPush, err)
	}
	return res, nil
}

// CheckSource reports whether src names a source, as a *FieldError of
// field Source.
func CheckSource(src Source) error {
	if src != SourceStagedJobs && src != SourceSidekiqStagedPush {
		return fieldErr("Source", "must be %q or %q, got %q", SourceStagedJobs, SourceSidekiqStagedPush, src)
	}
	return nil
}
