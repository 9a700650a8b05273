package admin

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/pgschema"
)

// ErrNoDeadChosen is the error of RetryDead or PurgeDead given none, or
// more than one, of IDs, All and OlderThan: an empty params never means
// every row.
var ErrNoDeadChosen = errors.New("give exactly one of IDs, All or OlderThan")

// DB is what an admin operation runs on: a *pgx.Conn, a *pgxpool.Pool, or a
// pgx.Tx (RetryDead and PurgeDead then run in a savepoint of it).
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Begin(ctx context.Context) (pgx.Tx, error)
}

// NotMigratedError is the error of an admin operation on a table that does
// not exist: run relay.Migrate (stagedrain migrate) first. It matches
// relay.ErrNotMigrated (errors.Is).
type NotMigratedError struct {
	Table string // quoted, with its schema
	hint  string
}

func (e *NotMigratedError) Error() string { return e.Table + " does not exist: " + e.hint }

// Is makes a NotMigratedError match relay.ErrNotMigrated.
func (e *NotMigratedError) Is(target error) bool { return target == relay.ErrNotMigrated }

const migrateHint = "run 'stagedrain migrate' first"

// regclassExists reports whether table (quoted) exists, for NotMigratedError.
func regclassExists(ctx context.Context, db DB, table string) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&ok); err != nil {
		return false, fmt.Errorf("look up %s: %w", table, err)
	}
	return ok, nil
}

// StatusParams says whose status ReadStatus reads.
type StatusParams struct {
	// Schema holds the tables; "" means "public".
	Schema string
	// Source is the table drained; "" means relay.SourceStagedJobs.
	Source relay.Source
}

// SchemaStatus is a schema's backlog, dead letters and leader; its JSON is
// stagedrain status --json's output.
type SchemaStatus struct {
	Schema string `json:"schema"`
	// Staged counts every staged row; OldestAge is the age in seconds of
	// the oldest (by created_at), nil when none is staged.
	Staged    int64         `json:"staged"`
	OldestAge *float64      `json:"oldest_age_seconds"`
	Queues    []QueueStatus `json:"queues"`
	// Dead counts <schema>.staged_jobs_dead, nil when there is no such table.
	Dead *int64 `json:"dead"`
	// Poison counts, with relay.SourceSidekiqStagedPush (nil otherwise), the
	// staged rows whose payload no worker could run: the relay leaves them
	// in the table and skips them. They count in Staged too.
	Poison *int64 `json:"poison,omitempty"`
	// Leader is the leader of the schema's one group of relays (the
	// relays of every queue, or of one list of relay.Config.Queues): nil when
	// none leads, and when several groups run (see Groups).
	Leader *LeaderStatus `json:"leader"`
	// Groups lists the groups of relays running on the schema, each with
	// its leader: the relays of every queue first, then the lists in byte
	// order. Empty when no relay runs. A group is seen by its relays'
	// locks: one whose relays have all stopped is not listed.
	Groups []GroupStatus `json:"groups"`
}

// GroupStatus is one group of a schema's relays: those of every queue, or
// those with one list of queues (relay.Config.Queues), and its leader.
type GroupStatus struct {
	// Queues is the group's list, sorted; nil for the relays of every
	// queue.
	Queues []string `json:"queues"`
	// Leader is the session holding the group's leader lock, nil when
	// none does (its relays stand by or start).
	Leader *LeaderStatus `json:"leader"`
}

// QueueStatus is one queue's backlog.
type QueueStatus struct {
	Queue     string  `json:"queue"`
	Staged    int64   `json:"staged"`
	OldestAge float64 `json:"oldest_age_seconds"`
}

// LeaderStatus is the session holding a schema's leader lock.
type LeaderStatus struct {
	// Host and PID are the relay's, from the application_name it sets
	// ("stagedrain leader <host>:<pid>"); empty and 0 when the database
	// URL set an application_name of its own.
	Host string `json:"host"`
	PID  int    `json:"pid"`
	// The lock connection, from pg_stat_activity.
	ApplicationName string    `json:"application_name"`
	BackendPID      int       `json:"backend_pid"`
	ClientAddr      string    `json:"client_addr"` // "" for a Unix socket
	ConnectedAt     time.Time `json:"connected_at"`
}

// ReadStatus reads a schema's status. The backlog is one GROUP BY over the
// table: a full scan, fine for a command a person runs now and then on a
// table the relay keeps drained, not for a probe every second. A table
// that is not there is a NotMigratedError.
func ReadStatus(ctx context.Context, db DB, p StatusParams) (*SchemaStatus, error) {
	schema, src := cmp.Or(p.Schema, "public"), cmp.Or(p.Source, relay.SourceStagedJobs)
	if err := relay.CheckSchema(schema); err != nil {
		return nil, err
	}
	if err := relay.CheckSource(src); err != nil {
		return nil, err
	}
	st := &SchemaStatus{Schema: schema, Queues: []QueueStatus{}}
	var err error
	if src == relay.SourceSidekiqStagedPush {
		err = readStagedPushBacklog(ctx, db, st)
	} else {
		err = readBacklog(ctx, db, st)
	}
	if err != nil {
		return nil, err
	}
	if st.Groups, err = ReadGroups(ctx, db, schema); err != nil {
		return nil, err
	}
	if len(st.Groups) == 1 {
		st.Leader = st.Groups[0].Leader
	}
	return st, nil
}

func readBacklog(ctx context.Context, db DB, st *SchemaStatus) error {
	table := pgx.Identifier{st.Schema, "staged_jobs"}.Sanitize()
	dead := pgx.Identifier{st.Schema, "staged_jobs_dead"}.Sanitize()
	var hasTable, hasDead bool
	if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL`,
		table, dead).Scan(&hasTable, &hasDead); err != nil {
		return fmt.Errorf("look up %s: %w", table, err)
	}
	if !hasTable {
		return &NotMigratedError{Table: table, hint: migrateHint}
	}
	// An infinite created_at (a row staged before migration 008, which
	// the relay dead-letters) has no age: the subtraction would fail.
	rows, err := db.Query(ctx, `SELECT queue, count(*),
		coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE isfinite(created_at))), 0)::float8
		FROM `+table+` GROUP BY queue ORDER BY queue`)
	if err != nil {
		return fmt.Errorf("count staged jobs: %w", err)
	}
	st.Queues, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (QueueStatus, error) {
		var q QueueStatus
		err := row.Scan(&q.Queue, &q.Staged, &q.OldestAge)
		return q, err
	})
	if err != nil {
		return fmt.Errorf("count staged jobs: %w", err)
	}
	st.total()
	if hasDead {
		var n int64
		if err := db.QueryRow(ctx, `SELECT count(*) FROM `+dead).Scan(&n); err != nil {
			return fmt.Errorf("count dead jobs: %w", err)
		}
		st.Dead = &n
	}
	return nil
}

// total sums the queues into Staged and OldestAge.
func (st *SchemaStatus) total() {
	for _, q := range st.Queues {
		st.Staged += q.Staged
		if st.OldestAge == nil || q.OldestAge > *st.OldestAge {
			age := q.OldestAge
			st.OldestAge = &age
		}
	}
}

// readStagedPushBacklog is readBacklog for the sidekiq-staged_push gem's
// table: by the queue the relay would push to (a payload without one goes
// to "default"), its poison rows (pgschema.StagedPushPoison) apart.
func readStagedPushBacklog(ctx context.Context, db DB, st *SchemaStatus) error {
	table := pgx.Identifier{st.Schema, pgschema.StagedPushTable}.Sanitize()
	ok, err := regclassExists(ctx, db, table)
	if err != nil {
		return err
	}
	if !ok {
		return &NotMigratedError{Table: table, hint: "install sidekiq-staged_push and run its migration, then 'stagedrain migrate --source sidekiq_staged_push'"}
	}
	// created_at is a timestamp without time zone, in UTC (Rails): its
	// epoch is read as UTC, whatever the session's time zone. A row with
	// an infinite created_at is poison (the relay sets it aside), and has
	// no age: JSON has no Infinity.
	rows, err := db.Query(ctx, `SELECT CASE WHEN `+pgschema.StagedPushPoison+` OR NOT isfinite(created_at) THEN NULL
			WHEN json_typeof(j -> 'queue') = 'string' THEN j ->> 'queue' ELSE 'default' END AS queue,
		count(*), coalesce(extract(epoch FROM now()) - extract(epoch FROM min(created_at) FILTER (WHERE isfinite(created_at))), 0)::float8
		FROM (SELECT payload::json AS j, created_at FROM `+table+`) t GROUP BY 1 ORDER BY 1`)
	if err != nil {
		return fmt.Errorf("count staged jobs: %w", err)
	}
	var poison int64
	st.Queues, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (QueueStatus, error) {
		var q QueueStatus
		var name *string
		err := row.Scan(&name, &q.Staged, &q.OldestAge)
		if name == nil {
			poison = q.Staged
		} else {
			q.Queue = *name
		}
		return q, err
	})
	if err != nil {
		return fmt.Errorf("count staged jobs: %w", err)
	}
	st.total()
	st.Queues = slices.DeleteFunc(st.Queues, func(q QueueStatus) bool { return q.Queue == "" })
	st.Poison = &poison
	return nil
}

// groupsSQL lists the groups whose group lock a session holds in schema
// $1 (relay/locks.go): each group's key (hashtext of its list, as pg_locks
// shows it), whether it is the group of every queue, and the words of its
// name locks in order (-1 for one not held; none for the group of every
// queue, or a relay of a release that spelled no name: with no length word
// held there is nothing to read, and LEAST(NULL, 65536) read 16,385 words,
// each a scan of every advisory lock held, 13 s a schema beside a fleet of
// 200).
const groupsSQL = `WITH held AS MATERIALIZED (
		SELECT l.classid::bigint AS k1, l.objid::bigint AS k2 FROM pg_locks l
		WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
		  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())),
	g AS (SELECT DISTINCT k2 AS key FROM held WHERE k1 = hashtext('stagedrain-group:' || $1)::bigint & 4294967295)
	SELECT g.key, g.key = hashtext('')::bigint & 4294967295,
		ARRAY(SELECT coalesce((SELECT min(h.k2) FROM held h
				WHERE h.k1 = hashtext('stagedrain-group-name:' || $1 || ':' || g.key || ':' || n)::bigint & 4294967295), -1)
			FROM generate_series(0, CASE WHEN len.word IS NULL THEN -1 ELSE (least(len.word, 65536) + 3) / 4 END) n ORDER BY n)
	FROM g LEFT JOIN LATERAL (SELECT min(h.k2) AS word FROM held h
		WHERE h.k1 = hashtext('stagedrain-group-name:' || $1 || ':' || g.key || ':0')::bigint & 4294967295) len ON true
	ORDER BY g.key`

// groupLeadersSQL checks the group names read ($1), each against the key
// it was read under ($2; NULL for the group of every queue), and finds the
// session holding each one's leader lock ($3, as pgschema.LeaderLockName names it)
// in this database, and when it connected.
const groupLeadersSQL = `SELECT t.key IS NULL OR hashtext(t.name)::bigint & 4294967295 = t.key,
		a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), a.backend_start
	FROM unnest($1::text[], $2::bigint[], $3::text[]) WITH ORDINALITY AS t(name, key, lock, i)
	LEFT JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND (l.classid::bigint << 32 | l.objid::bigint) = hashtextextended(t.lock, 0)
	LEFT JOIN pg_stat_activity a ON a.pid = l.pid
	ORDER BY t.i`

// ReadGroups reads, from pg_locks, the groups of relays running on schema
// and their leaders, as ReadStatus's Groups: the relays of every queue,
// listed when one of them holds its group lock or the leader lock (a
// relay of a release before groups takes no group lock), then each list
// of relay.Config.Queues that a running relay holds the locks of. It counts no
// table, so it is cheap enough for a probe.
func ReadGroups(ctx context.Context, db DB, schema string) ([]GroupStatus, error) {
	if err := relay.CheckSchema(schema); err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, groupsSQL, schema)
	if err != nil {
		return nil, fmt.Errorf("find the groups of relays: %w", err)
	}
	// The group of every queue is always asked for: its leader lock
	// shows it even without a group lock.
	names, keys, locks := []string{""}, []*int64{nil}, []string{pgschema.LeaderLockName(schema, "")}
	everyLocked := false
	var key int64
	var every bool
	var words []int64
	_, err = pgx.ForEachRow(rows, []any{&key, &every, &words}, func() error {
		if every {
			everyLocked = true
			return nil
		}
		group, ok := pgschema.ReadGroupName(words)
		if !ok {
			return nil // a relay of a release that spelled no name
		}
		k := key
		names, keys, locks = append(names, group), append(keys, &k), append(locks, pgschema.LeaderLockName(schema, group))
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("find the groups of relays: %w", err)
	}
	rows, err = db.Query(ctx, groupLeadersSQL, names, keys, locks)
	if err != nil {
		return nil, fmt.Errorf("find the leaders: %w", err)
	}
	groups := []GroupStatus{}
	i := 0
	var named bool
	var backend *int
	var app, addr *string
	var since *time.Time
	_, err = pgx.ForEachRow(rows, []any{&named, &backend, &app, &addr, &since}, func() error {
		defer func() { i++ }()
		var l *LeaderStatus
		if backend != nil {
			l = &LeaderStatus{BackendPID: *backend, ApplicationName: *app, ClientAddr: *addr, ConnectedAt: since.UTC()}
			l.Host, l.PID = parseApplicationName(l.ApplicationName)
		}
		switch {
		case i == 0:
			if everyLocked || l != nil {
				groups = append(groups, GroupStatus{Leader: l})
			}
		case named:
			groups = append(groups, GroupStatus{Queues: strings.Split(names[i], ","), Leader: l})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("find the leaders: %w", err)
	}
	slices.SortStableFunc(groups, func(a, b GroupStatus) int {
		if (a.Queues == nil) != (b.Queues == nil) {
			if a.Queues == nil {
				return -1
			}
			return 1
		}
		return strings.Compare(strings.Join(a.Queues, ","), strings.Join(b.Queues, ","))
	})
	return groups, nil
}

// parseApplicationName reads host and pid out of applicationName's
// "stagedrain <role> <host>:<pid>" for the leader; "", 0 from any other name.
func parseApplicationName(name string) (host string, pid int) {
	rest, ok := strings.CutPrefix(name, "stagedrain leader ")
	if !ok {
		return "", 0
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 0 {
		return "", 0
	}
	pid, err := strconv.Atoi(rest[i+1:])
	if err != nil {
		return "", 0
	}
	return rest[:i], pid
}

// DeadJob is a row of staged_jobs_dead: a job the relay could never push.
// Its JSON is an element of stagedrain dead list --json's output. RunAt and
// CreatedAt may be infinity or -infinity (the row died of it), printed as
// those strings; a time is printed as time.Time prints it, NULL as null.
type DeadJob struct {
	ID        int64              `json:"id"`
	JobName   *string            `json:"job_name"`
	JobArgs   json.RawMessage    `json:"job_args"`
	Queue     *string            `json:"queue"`
	RunAt     pgtype.Timestamptz `json:"run_at"`
	JID       *string            `json:"jid"`
	CreatedAt pgtype.Timestamptz `json:"created_at"`
	Options   json.RawMessage    `json:"options"`
	Reason    string             `json:"reason"`
	FailedAt  time.Time          `json:"failed_at"`
	Attempts  int                `json:"attempts"`
}

// ListDeadParams says which dead rows ListDead reads.
type ListDeadParams struct {
	// Schema holds staged_jobs_dead; "" means "public".
	Schema string
}

// ListDeadResult is the dead rows, oldest id first.
type ListDeadResult struct {
	Jobs []DeadJob
}

// deadTables are the quoted names of a schema's staged_jobs and
// staged_jobs_dead, once it is checked that the latter exists.
func deadTables(ctx context.Context, db DB, schema string) (staged, dead string, err error) {
	if err := relay.CheckSchema(schema); err != nil {
		return "", "", err
	}
	staged = pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	dead = pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()
	ok, err := regclassExists(ctx, db, dead)
	if err != nil {
		return "", "", err
	}
	if !ok {
		return "", "", &NotMigratedError{Table: dead, hint: migrateHint}
	}
	return staged, dead, nil
}

// ListDead reads the rows of a schema's staged_jobs_dead, oldest id first.
func ListDead(ctx context.Context, db DB, p ListDeadParams) (*ListDeadResult, error) {
	_, dead, err := deadTables(ctx, db, cmp.Or(p.Schema, "public"))
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, `SELECT id, job_name, job_args::text, queue, run_at, jid, created_at, options::text,
		reason, failed_at, attempts FROM `+dead+` ORDER BY id`)
	if err != nil {
		return nil, fmt.Errorf("read dead rows: %w", err)
	}
	jobs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadJob, error) {
		var j DeadJob
		var args, opts *string
		err := r.Scan(&j.ID, &j.JobName, &args, &j.Queue, &j.RunAt, &j.JID, &j.CreatedAt, &opts, &j.Reason, &j.FailedAt, &j.Attempts)
		j.JobArgs, j.Options = rawJSON(args), rawJSON(opts)
		return j, err
	})
	if err != nil {
		return nil, fmt.Errorf("read dead rows: %w", err)
	}
	if jobs == nil {
		jobs = []DeadJob{}
	}
	return &ListDeadResult{Jobs: jobs}, nil
}

func rawJSON(s *string) json.RawMessage {
	if s == nil {
		return json.RawMessage("null")
	}
	return json.RawMessage(*s)
}

// RetryDeadParams says which dead rows RetryDead moves back: IDs, or All
// (exactly one).
type RetryDeadParams struct {
	// Schema holds the tables; "" means "public".
	Schema string
	IDs    []int64
	All    bool
}

// RetryDeadResult says how many rows RetryDead moved back.
type RetryDeadResult struct {
	Moved int64
}

// DeadNotFoundError is the error of RetryDead or PurgeDead given ids that
// are not dead rows: nothing changed.
type DeadNotFoundError struct {
	IDs []int64 // the ids not found, in the order given
}

func (e *DeadNotFoundError) Error() string {
	ids := make([]string, len(e.IDs))
	for i, id := range e.IDs {
		ids[i] = strconv.FormatInt(id, 10)
	}
	return "no dead row with id " + strings.Join(ids, ", ") + ": nothing changed"
}

// dedupIDs checks ids and returns them without repeats, in order.
func dedupIDs(ids []int64) ([]int64, error) {
	var out []int64
	for _, id := range ids {
		if id < 1 {
			return nil, fmt.Errorf("dead row id %d: want a positive integer", id)
		}
		if !slices.Contains(out, id) {
			out = append(out, id)
		}
	}
	return out, nil
}

// RetryDead moves dead rows back into staged_jobs, keeping their id and
// jid, in one transaction; the relay drains them as any staged row. An id
// that is not a dead row fails it with a DeadNotFoundError, and nothing
// moves.
func RetryDead(ctx context.Context, db DB, p RetryDeadParams) (*RetryDeadResult, error) {
	if (len(p.IDs) > 0) == p.All {
		return nil, ErrNoDeadChosen
	}
	ids, err := dedupIDs(p.IDs)
	if err != nil {
		return nil, err
	}
	staged, dead, err := deadTables(ctx, db, cmp.Or(p.Schema, "public"))
	if err != nil {
		return nil, err
	}
	var n int64
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := lockDead(ctx, tx, dead, ids); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, `WITH moved AS (DELETE FROM `+dead+` WHERE $1::bigint[] IS NULL OR id = ANY($1)
			RETURNING `+pgschema.ClaimColumns+`)
			INSERT INTO `+staged+` (`+pgschema.ClaimColumns+`) SELECT `+pgschema.ClaimColumns+` FROM moved`, nilIfEmpty(ids))
		if err != nil {
			return fmt.Errorf("move dead rows back: %w", err)
		}
		n = tag.RowsAffected()
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &RetryDeadResult{Moved: n}, nil
}

// PurgeDeadParams says which dead rows PurgeDead deletes: IDs, All, or
// those that died more than OlderThan ago (exactly one).
type PurgeDeadParams struct {
	// Schema holds staged_jobs_dead; "" means "public".
	Schema    string
	IDs       []int64
	All       bool
	OlderThan time.Duration
}

// PurgeDeadResult says how many rows PurgeDead deleted.
type PurgeDeadResult struct {
	Purged int64
}

// PurgeDead deletes dead rows, in one transaction. An id that is not a
// dead row fails it with a DeadNotFoundError, and nothing is deleted.
func PurgeDead(ctx context.Context, db DB, p PurgeDeadParams) (*PurgeDeadResult, error) {
	chosen := 0
	for _, set := range []bool{len(p.IDs) > 0, p.All, p.OlderThan != 0} {
		if set {
			chosen++
		}
	}
	if chosen != 1 {
		return nil, ErrNoDeadChosen
	}
	if p.OlderThan < 0 {
		return nil, fmt.Errorf("OlderThan must be positive, got %s", p.OlderThan)
	}
	ids, err := dedupIDs(p.IDs)
	if err != nil {
		return nil, err
	}
	_, dead, err := deadTables(ctx, db, cmp.Or(p.Schema, "public"))
	if err != nil {
		return nil, err
	}
	var n int64
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := lockDead(ctx, tx, dead, ids); err != nil {
			return err
		}
		var age any
		if p.OlderThan > 0 {
			age = p.OlderThan
		}
		tag, err := tx.Exec(ctx, `DELETE FROM `+dead+` WHERE ($1::bigint[] IS NULL OR id = ANY($1))
			AND ($2::interval IS NULL OR failed_at < now() - $2::interval)`, nilIfEmpty(ids), age)
		if err != nil {
			return fmt.Errorf("delete dead rows: %w", err)
		}
		n = tag.RowsAffected()
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &PurgeDeadResult{Purged: n}, nil
}

// lockDead locks the dead rows ids and fails, naming them, if any is not
// there. With no ids it does nothing.
func lockDead(ctx context.Context, tx pgx.Tx, dead string, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, `SELECT id FROM `+dead+` WHERE id = ANY($1) FOR UPDATE`, ids)
	if err != nil {
		return fmt.Errorf("read dead rows: %w", err)
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("read dead rows: %w", err)
	}
	var missing []int64
	for _, id := range ids {
		if !slices.Contains(found, id) {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		return &DeadNotFoundError{IDs: missing}
	}
	return nil
}

func nilIfEmpty(ids []int64) []int64 {
	if len(ids) == 0 {
		return nil
	}
	return ids
}
