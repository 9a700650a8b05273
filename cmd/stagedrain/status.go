package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
)

// statusFlags are status's flags.
type statusFlags struct {
	databaseURL string
	schema      string
	source      string
	json        bool
}

// newStatusFlags declares status's flags.
func newStatusFlags() (*flagSet, *statusFlags) {
	f := newFlagSet("status", "Show a schema's backlog by queue, its oldest staged job's age, its dead-letter\n"+
		"count and which relay leads, from PostgreSQL alone (no relay need run).")
	c := new(statusFlags)
	f.fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL connection `URL` (required; never logged)")
	f.env("database-url", "DATABASE_URL")
	f.fs.StringVar(&c.schema, "schema", "public", "PostgreSQL `schema` of the staged_jobs table")
	f.env("schema", "STAGEDRAIN_SCHEMA")
	f.fs.StringVar(&c.source, "source", string(relay.SourceStagedJobs), "the `table` drained: staged_jobs, or sidekiq_staged_push (the sidekiq-staged_push gem's sidekiq_staged_push_jobs)")
	f.env("source", "STAGEDRAIN_SOURCE")
	f.fs.BoolVar(&c.json, "json", false, "print one JSON object instead of a table")
	f.env("json", "STAGEDRAIN_STATUS_JSON")
	f.required("database-url", "schema", "source")
	return f, c
}

// schemaStatus is what status shows; its JSON is status --json's output.
type schemaStatus struct {
	Schema string `json:"schema"`
	// Staged counts every staged row; OldestAge is the age of the oldest
	// (by created_at), null when none is staged.
	Staged    int64         `json:"staged"`
	OldestAge *float64      `json:"oldest_age_seconds"`
	Queues    []queueStatus `json:"queues"`
	// Dead counts <schema>.staged_jobs_dead, null when there is no such table.
	Dead *int64 `json:"dead"`
	// Poison counts, with --source sidekiq_staged_push (null otherwise), the
	// staged rows whose payload no worker could run: the relay leaves them
	// in the table and skips them. They count in Staged too.
	Poison *int64 `json:"poison,omitempty"`
	// Leader is the session holding the leader lock, null when none does.
	Leader *leaderStatus `json:"leader"`
}

type queueStatus struct {
	Queue     string  `json:"queue"`
	Staged    int64   `json:"staged"`
	OldestAge float64 `json:"oldest_age_seconds"`
}

type leaderStatus struct {
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

func statusCmd(ctx context.Context, args []string, stdout io.Writer) error {
	f, c := newStatusFlags()
	if err := f.parse(args, stdout); err != nil {
		return err
	}
	if c.databaseURL == "" {
		return usagef("status: --database-url or $DATABASE_URL is required")
	}
	if err := relay.CheckDatabaseURL(c.databaseURL); err != nil {
		return usagef("status: %s: %s", f.source("database-url"), err)
	}
	if err := relay.CheckSchema(c.schema); err != nil {
		reason := err.Error()
		if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
			reason = fe.Reason
		}
		return usagef("status: %s %s", f.source("schema"), reason)
	}
	if err := relay.CheckSource(relay.Source(c.source)); err != nil {
		reason := err.Error()
		if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
			reason = fe.Reason
		}
		return usagef("status: %s %s", f.source("source"), reason)
	}
	cfg, err := pgx.ParseConfig(c.databaseURL)
	if err != nil { // CheckDatabaseURL parsed it already
		return usagef("status: %s cannot be parsed", f.source("database-url"))
	}
	tuneCommandConn(cfg, "stagedrain status")
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("status: connect to %s: %w", relay.DescribeDatabase(c.databaseURL), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	read := readStatus
	if relay.Source(c.source) == relay.SourceSidekiqStagedPush {
		read = readStagedPushStatus
	}
	st, err := read(ctx, conn, c.schema)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	if c.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	printStatus(stdout, st)
	return nil
}

// leaderSQL finds the session holding schema's leader lock (see
// relay/leader.go) in this database, and when it connected.
const leaderSQL = `SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), a.backend_start
	FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
	WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND (l.classid::bigint << 32 | l.objid::bigint) = hashtextextended($1, 0)`

// readStatus reads schema's status. The backlog is one GROUP BY over
// staged_jobs: a full scan, fine for a command a person runs now and then
// on a table the relay keeps drained, not for a probe every second.
func readStatus(ctx context.Context, conn *pgx.Conn, schema string) (schemaStatus, error) {
	st := schemaStatus{Schema: schema, Queues: []queueStatus{}}
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	dead := pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()
	var hasTable, hasDead bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL`,
		table, dead).Scan(&hasTable, &hasDead); err != nil {
		return st, fmt.Errorf("look up %s: %w", table, err)
	}
	if !hasTable {
		return st, fmt.Errorf("%s does not exist: run 'stagedrain migrate' first", table)
	}
	// An infinite created_at (a row staged before migration 008, which
	// the relay dead-letters) has no age: the subtraction would fail.
	rows, err := conn.Query(ctx, `SELECT queue, count(*),
		coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE isfinite(created_at))), 0)::float8
		FROM `+table+` GROUP BY queue ORDER BY queue`)
	if err != nil {
		return st, fmt.Errorf("count staged jobs: %w", err)
	}
	st.Queues, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (queueStatus, error) {
		var q queueStatus
		err := row.Scan(&q.Queue, &q.Staged, &q.OldestAge)
		return q, err
	})
	if err != nil {
		return st, fmt.Errorf("count staged jobs: %w", err)
	}
	for _, q := range st.Queues {
		st.Staged += q.Staged
		if st.OldestAge == nil || q.OldestAge > *st.OldestAge {
			age := q.OldestAge
			st.OldestAge = &age
		}
	}
	if hasDead {
		var n int64
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM `+dead).Scan(&n); err != nil {
			return st, fmt.Errorf("count dead jobs: %w", err)
		}
		st.Dead = &n
	}
	return st, readLeader(ctx, conn, &st)
}

// stagedPushPoison is true for a payload of the gem's table (as json, j) no
// worker could run: the checks of the relay's mapping (relay/source.go)
// that SQL can make.
const stagedPushPoison = `(json_typeof(j) <> 'object'
	OR json_typeof(j -> 'class') IS DISTINCT FROM 'string' OR j ->> 'class' = ''
	OR json_typeof(j -> 'args') IS DISTINCT FROM 'array'
	OR (j -> 'queue' IS NOT NULL AND (json_typeof(j -> 'queue') <> 'string' OR j ->> 'queue' = ''))
	OR (j -> 'jid' IS NOT NULL AND (json_typeof(j -> 'jid') <> 'string' OR j ->> 'jid' = ''))
	OR (j -> 'at' IS NOT NULL AND json_typeof(j -> 'at') <> 'number')
	OR (j -> 'created_at' IS NOT NULL AND json_typeof(j -> 'created_at') <> 'number'))`

// readStagedPushStatus is readStatus for --source sidekiq_staged_push: the
// backlog of the gem's table by the queue the relay would push to (a
// payload without one goes to "default"), its poison rows apart.
func readStagedPushStatus(ctx context.Context, conn *pgx.Conn, schema string) (schemaStatus, error) {
	st := schemaStatus{Schema: schema, Queues: []queueStatus{}}
	table := pgx.Identifier{schema, "sidekiq_staged_push_jobs"}.Sanitize()
	var hasTable bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&hasTable); err != nil {
		return st, fmt.Errorf("look up %s: %w", table, err)
	}
	if !hasTable {
		return st, fmt.Errorf("%s does not exist: install sidekiq-staged_push and run its migration, then 'stagedrain migrate --source sidekiq_staged_push'", table)
	}
	// created_at is a timestamp without time zone, in UTC (Rails): its
	// epoch is read as UTC, whatever the session's time zone.
	// A row with an infinite created_at is poison (the relay sets it
	// aside), and has no age: JSON has no Infinity.
	rows, err := conn.Query(ctx, `SELECT CASE WHEN `+stagedPushPoison+` OR NOT isfinite(created_at) THEN NULL
			WHEN json_typeof(j -> 'queue') = 'string' THEN j ->> 'queue' ELSE 'default' END AS queue,
		count(*), coalesce(extract(epoch FROM now()) - extract(epoch FROM min(created_at) FILTER (WHERE isfinite(created_at))), 0)::float8
		FROM (SELECT payload::json AS j, created_at FROM `+table+`) t GROUP BY 1 ORDER BY 1`)
	if err != nil {
		return st, fmt.Errorf("count staged jobs: %w", err)
	}
	var poison int64
	st.Queues, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (queueStatus, error) {
		var q queueStatus
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
		return st, fmt.Errorf("count staged jobs: %w", err)
	}
	for _, q := range st.Queues {
		st.Staged += q.Staged
		if st.OldestAge == nil || q.OldestAge > *st.OldestAge {
			age := q.OldestAge
			st.OldestAge = &age
		}
	}
	st.Queues = slices.DeleteFunc(st.Queues, func(q queueStatus) bool { return q.Queue == "" })
	st.Poison = &poison
	return st, readLeader(ctx, conn, &st)
}

// readLeader fills in st.Leader: the session holding the schema's leader
// lock, if any.
func readLeader(ctx context.Context, conn *pgx.Conn, st *schemaStatus) error {
	var l leaderStatus
	err := conn.QueryRow(ctx, leaderSQL, "stagedrain:"+st.Schema).
		Scan(&l.BackendPID, &l.ApplicationName, &l.ClientAddr, &l.ConnectedAt)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return fmt.Errorf("find the leader: %w", err)
	default:
		l.Host, l.PID = parseApplicationName(l.ApplicationName)
		l.ConnectedAt = l.ConnectedAt.UTC()
		st.Leader = &l
	}
	return nil
}

// parseApplicationName reads host and pid out of the relay's
// "stagedrain leader <host>:<pid>"; "", 0 from any other name.
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

// printStatus writes st as a table for people.
func printStatus(w io.Writer, st schemaStatus) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "schema\t%s\n", st.Schema)
	staged := strconv.FormatInt(st.Staged, 10)
	if st.OldestAge != nil {
		staged += ", oldest " + age(*st.OldestAge)
	}
	fmt.Fprintf(tw, "staged\t%s\n", staged)
	dead := "-"
	if st.Dead != nil {
		dead = strconv.FormatInt(*st.Dead, 10)
	}
	fmt.Fprintf(tw, "dead\t%s\n", dead)
	if st.Poison != nil {
		fmt.Fprintf(tw, "poison\t%d (left staged, skipped)\n", *st.Poison)
	}
	leader := "none"
	if l := st.Leader; l != nil {
		who := l.ApplicationName
		if l.Host != "" {
			who = fmt.Sprintf("%s pid %d", l.Host, l.PID)
		}
		from := ""
		if l.ClientAddr != "" {
			from = " from " + l.ClientAddr
		}
		leader = fmt.Sprintf("%s (backend %d%s, connected %s)", who, l.BackendPID, from, l.ConnectedAt.Format(time.RFC3339))
	}
	fmt.Fprintf(tw, "leader\t%s\n", leader)
	if len(st.Queues) > 0 {
		fmt.Fprintf(tw, "\nQUEUE\tSTAGED\tOLDEST\n")
		for _, q := range st.Queues {
			fmt.Fprintf(tw, "%s\t%d\t%s\n", q.Queue, q.Staged, age(q.OldestAge))
		}
	}
	_ = tw.Flush()
}

// age formats seconds for people: 0.4s, 12s, 3m20s, 5h2m0s.
func age(seconds float64) string {
	d := time.Duration(seconds * float64(time.Second))
	if d < 10*time.Second {
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}
