package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// badRow is a row no worker could run, as an app may INSERT it into a
// table without the constraints that refuse it (a schema migrated before
// 008, or by hand): SQL values for staged_jobs' columns, and what the dead
// row must say.
type badRow struct {
	name, args, runAt, createdAt string // SQL literals
	reason                       string
}

var badRows = []badRow{
	{"'RunAtInfinity'", "'[]'", "'infinity'", "DEFAULT", "run_at is infinity: Go and the job systems cannot hold it"},
	{"'RunAtMinusInfinity'", "'[]'", "'-infinity'", "DEFAULT", "run_at is -infinity: Go and the job systems cannot hold it"},
	{"'CreatedAtInfinity'", "'[]'", "NULL", "'infinity'", "created_at is infinity: Go and the job systems cannot hold it"},
	{"'CreatedAtMinusInfinity'", "'[]'", "NULL", "'-infinity'", "created_at is -infinity: Go and the job systems cannot hold it"},
	{"''", "'[]'", "NULL", "DEFAULT", "job_name is empty"},
	{"'ArgsObject'", `'{"a": 1}'`, "NULL", "DEFAULT", "job_args is not a JSON array"},
	{"'ArgsScalar'", "'42'", "NULL", "DEFAULT", "job_args is not a JSON array"},
}

// insertBad inserts b into staged_jobs and returns its jid.
func (h *harness) insertBad(b badRow) string {
	h.t.Helper()
	var jid string
	err := h.conn.QueryRow(context.Background(), "INSERT INTO "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+
		" (job_name, job_args, run_at, created_at) VALUES ("+b.name+", "+b.args+", "+b.runAt+", "+b.createdAt+") RETURNING jid").Scan(&jid)
	if err != nil {
		h.t.Fatalf("insert %s: %v", b.name, err)
	}
	return jid
}

// Rows with an infinite run_at or created_at (Rails writes 'infinity' for
// Float::INFINITY), an empty job_name or job_args that are not an array,
// staged between good rows where the table's constraints were dropped:
// every good row is delivered, in order, and each bad row is in
// staged_jobs_dead with its reason and its values as staged, infinity
// included. Before, a row with an infinite run_at failed every claim: the
// batch rolled back and was retried for good, and nothing was delivered.
func TestNoRowStallsTheDrain(t *testing.T) {
	t.Parallel()
	for _, target := range []relay.Target{relay.TargetSidekiq, relay.TargetStreams} {
		t.Run(string(target), func(t *testing.T) {
			t.Parallel()
			testNoRowStallsTheDrain(t, target)
		})
	}
}

func testNoRowStallsTheDrain(t *testing.T, target relay.Target) {
	h := newHarness(t)
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	if _, err := h.conn.Exec(ctx, "ALTER TABLE "+table+
		" DROP CONSTRAINT staged_jobs_run_at_finite, DROP CONSTRAINT staged_jobs_created_at_finite,"+
		" DROP CONSTRAINT staged_jobs_job_name_check, DROP CONSTRAINT staged_jobs_job_args_check"); err != nil {
		t.Fatal(err)
	}
	var good, bad []string
	good = append(good, h.stage(relay.Job{Name: "Good", Args: []any{0}}))
	for i, b := range badRows {
		bad = append(bad, h.insertBad(b))
		good = append(good, h.stage(relay.Job{Name: "Good", Args: []any{i + 1}}))
	}
	cfg := h.config()
	cfg.Target = target
	cfg.BatchSize = 3 // bad rows in several batches, beside good ones
	cfg.PollInterval = time.Minute
	h.start(cfg)

	h.waitStaged(0)
	switch target {
	case relay.TargetStreams:
		stream := h.key("stream:default")
		testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("%d entries in %s", len(good), stream), func() (bool, string) {
			n, err := h.rdb.XLen(ctx, stream).Result()
			return err == nil && n == int64(len(good)), fmt.Sprint(n, err)
		})
		entries, err := h.rdb.XRange(ctx, stream, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range entries {
			jid, _ := e.Values["jid"].(string)
			got = append(got, jid)
		}
		if !slices.Equal(got, good) {
			t.Fatalf("%s holds jids %v, want the good rows %v", stream, got, good)
		}
	default:
		h.waitQueueLen("default", int64(len(good)), 10*time.Second)
		if got := h.queueJIDs("default"); !slices.Equal(got, good) {
			t.Fatalf("queue:default holds %v, want the good rows %v", got, good)
		}
	}
	dead := h.dead()
	if len(dead) != len(badRows) {
		t.Fatalf("staged_jobs_dead holds %d rows, want %d: %+v", len(dead), len(badRows), dead)
	}
	for i, d := range dead {
		b := badRows[i]
		if d.jid == nil || *d.jid != bad[i] || d.reason != b.reason || d.attempts != 1 {
			t.Errorf("dead row %d: jid %v, reason %q, attempts %d; want %s, %q, 1", d.id, d.jid, d.reason, d.attempts, bad[i], b.reason)
		}
		// Every column as staged: the infinite values too.
		created := "true" // DEFAULT: the INSERT's time
		if b.createdAt != "DEFAULT" {
			created = "created_at = " + b.createdAt + "::timestamptz"
		}
		var same bool
		err := h.conn.QueryRow(ctx, `SELECT run_at IS NOT DISTINCT FROM `+b.runAt+`::timestamptz
			AND `+created+`
			AND job_name = `+b.name+` AND job_args = `+b.args+`::jsonb
			FROM `+pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()+` WHERE id = $1`, d.id).Scan(&same)
		if err != nil {
			t.Fatal(err)
		}
		if !same {
			t.Errorf("dead row %d (%s) does not hold the values staged: run_at %s, created_at %s", d.id, b.name, b.runAt, b.createdAt)
		}
	}
	if n := h.logs.FilterMessage("batch failed, retrying").Len(); n != 0 {
		t.Errorf("%d failed batches, want none: bad rows are dead-lettered, not retried (%v)", n, messages(h.logs))
	}
}

// With 008 applied, staged_jobs refuses an infinite run_at or created_at
// at INSERT, in the app's transaction, naming the constraint; NULL and
// finite values pass. staged_jobs_dead takes them: it holds such rows.
func TestFiniteTimesRefusedAtInsert(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	for _, tc := range []struct{ runAt, createdAt, constraint string }{
		{"'infinity'", "DEFAULT", "staged_jobs_run_at_finite"},
		{"'-infinity'", "DEFAULT", "staged_jobs_run_at_finite"},
		{"NULL", "'infinity'", "staged_jobs_created_at_finite"},
		{"NULL", "'-infinity'", "staged_jobs_created_at_finite"},
		{"'2026-11-30 06:00:00+00'", "DEFAULT", ""},
		{"NULL", "'2026-11-30 06:00:00+00'", ""},
	} {
		_, err := h.conn.Exec(ctx, "INSERT INTO "+table+" (job_name, job_args, run_at, created_at) VALUES ('J', '[]', "+tc.runAt+", "+tc.createdAt+")")
		var pgErr *pgconn.PgError
		switch {
		case tc.constraint == "" && err != nil:
			t.Errorf("run_at %s, created_at %s: %v, want the row staged", tc.runAt, tc.createdAt, err)
		case tc.constraint == "":
		case !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != tc.constraint ||
			!strings.Contains(pgErr.Message, tc.constraint):
			t.Errorf("run_at %s, created_at %s: %v, want a check_violation of %s", tc.runAt, tc.createdAt, err, tc.constraint)
		}
	}
	if _, err := h.conn.Exec(ctx, "INSERT INTO "+pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()+
		" (id, job_name, job_args, run_at, created_at, reason, attempts) VALUES (1, 'J', '[]', 'infinity', '-infinity', 'r', 1)"); err != nil {
		t.Errorf("staged_jobs_dead refused infinite times: %v", err)
	}
}

// 008 on a table that holds rows with infinite times already (a schema at
// version 7) does not fail, nor touch them: its constraints are NOT VALID,
// and the relay dead-letters such rows when it claims them.
func TestFiniteTimesMigrationKeepsExistingRows(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	// Back to version 7, as a schema migrated by the previous release.
	if _, err := h.conn.Exec(ctx, "ALTER TABLE "+table+
		" DROP CONSTRAINT staged_jobs_run_at_finite, DROP CONSTRAINT staged_jobs_created_at_finite;"+
		" DELETE FROM "+pgx.Identifier{h.schema, "stagedrain_migrations"}.Sanitize()+" WHERE version = 8"); err != nil {
		t.Fatal(err)
	}
	for _, b := range badRows[:4] {
		h.insertBad(b)
	}
	res, err := relay.Migrate(ctx, h.conn, h.schema)
	if err != nil {
		t.Fatalf("Migrate over rows with infinite times: %v", err)
	}
	if !slices.Equal(res.Applied, []string{"008_finite_times.sql"}) {
		t.Fatalf("Migrate = %+v, want 008 applied", res)
	}
	var rows, constraints int
	if err := h.conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+table+` WHERE NOT isfinite(run_at) OR NOT isfinite(created_at)),
		(SELECT count(*) FROM pg_constraint WHERE conrelid = $1::regclass AND NOT convalidated
			AND conname IN ('staged_jobs_run_at_finite', 'staged_jobs_created_at_finite'))`, table).Scan(&rows, &constraints); err != nil {
		t.Fatal(err)
	}
	if rows != 4 || constraints != 2 {
		t.Fatalf("after 008: %d rows with infinite times, %d NOT VALID constraints; want 4 and 2", rows, constraints)
	}
}
