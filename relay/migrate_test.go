package relay_test

import (
	"context"
	"errors"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
	sqlfiles "github.com/stagedrain/stagedrain/sql"
)

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	conn := testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()

	first, err := relay.Migrate(ctx, conn, schema)
	if err != nil {
		t.Fatal(err)
	}
	files, latest := embeddedMigrations(t)
	if !slices.Equal(first.Applied, files) || first.Current != latest {
		t.Fatalf("first Migrate = %+v, want %v applied, version %d", first, files, latest)
	}
	second, err := relay.Migrate(ctx, conn, schema)
	if err != nil {
		t.Fatal(err)
	}
	if len(second.Applied) != 0 || second.Current != latest {
		t.Fatalf("second Migrate = %+v, want nothing applied, version %d", second, latest)
	}
}

// embeddedMigrations lists the files of sql/ in order and the version of
// the last.
func embeddedMigrations(t *testing.T) ([]string, int) {
	t.Helper()
	entries, err := fs.ReadDir(sqlfiles.Files, ".")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	latest, err := strconv.Atoi(strings.SplitN(names[len(names)-1], "_", 2)[0])
	if err != nil {
		t.Fatal(err)
	}
	return names, latest
}

// Migrations from several processes at once all succeed: the advisory lock
// serializes them and the later ones find nothing to do.
func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	ctx := context.Background()
	const n = 4
	conns := make([]*pgx.Conn, n)
	for i := range conns {
		conns[i] = testenv.Conn(t, testenv.DatabaseURL())
	}
	var wg sync.WaitGroup
	results := make([]relay.MigrateResult, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = relay.Migrate(ctx, conns[i], schema)
		}()
	}
	wg.Wait()
	applied := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("concurrent Migrate %d: %v", i, errs[i])
		}
		applied += len(results[i].Applied)
	}
	if files, _ := embeddedMigrations(t); applied != len(files) {
		t.Fatalf("%d migrations applied across %d concurrent runs, want each of the %d once", applied, n, len(files))
	}
}

// The table rejects, in the app's own transaction, rows no worker could
// run; the seed article's INSERT works unchanged.
func TestStagedJobsConstraints(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()

	var jid1, jid2 string
	if err := h.conn.QueryRow(ctx, `INSERT INTO `+table+` (job_name, job_args) VALUES ('WelcomeEmailJob', '[42]') RETURNING jid`).Scan(&jid1); err != nil {
		t.Fatalf("seed INSERT: %v", err)
	}
	if err := h.conn.QueryRow(ctx, `INSERT INTO `+table+` (job_name, job_args) VALUES ('WelcomeEmailJob', '[43]') RETURNING jid`).Scan(&jid2); err != nil {
		t.Fatalf("seed INSERT: %v", err)
	}
	if !jidRE.MatchString(jid1) || !jidRE.MatchString(jid2) || jid1 == jid2 {
		t.Fatalf("jids %q, %q: want two distinct 24-hex ids", jid1, jid2)
	}

	bad := []struct {
		name, cols, vals string
	}{
		{"empty job_name", "job_name, job_args", `'', '[]'`},
		{"empty queue", "job_name, job_args, queue", `'J', '[]', ''`},
		{"args an object", "job_name, job_args", `'J', '{"a": 1}'`},
		{"args a number", "job_name, job_args", `'J', '42'`},
		{"options an array", "job_name, job_args, options", `'J', '[]', '[1]'`},
		{"options set class", "job_name, job_args, options", `'J', '[]', '{"class": "Other"}'`},
		{"options set jid", "job_name, job_args, options", `'J', '[]', '{"jid": "x"}'`},
		{"empty jid", "job_name, job_args, jid", `'J', '[]', ''`},
	}
	for _, tc := range bad {
		_, err := h.conn.Exec(ctx, `INSERT INTO `+table+` (`+tc.cols+`) VALUES (`+tc.vals+`)`)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" {
			t.Errorf("%s: INSERT error = %v, want a check violation (23514)", tc.name, err)
		}
	}
}

// Migrate upgrades the seed article's minimal table in place, and the rows
// already in it are delivered.
func TestMigrateUpgradesSeedTable(t *testing.T) {
	t.Parallel()
	h := &harness{t: t, schema: testenv.Schema(t)}
	h.rdb, h.ns = testenv.Redis(t)
	h.conn = testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()
	schema := createSeedTable(t, h.conn, h.schema)
	if _, err := h.conn.Exec(ctx, `INSERT INTO `+schema+`.staged_jobs (job_name, job_args) VALUES ('OldJob', '[1]'), ('OldJob', '[2]')`); err != nil {
		t.Fatal(err)
	}
	if _, err := relay.Migrate(ctx, h.conn, h.schema); err != nil {
		t.Fatalf("migrate the seed table: %v", err)
	}
	h.stager = relay.NewStager(h.schema)
	h.start(h.config())
	h.waitQueueLen("default", 2, 10*time.Second)
	jobs := h.queue("default")
	for i, j := range jobs {
		if args, _ := j["args"].([]any); len(args) != 1 || args[0] != float64(i+1) || !jidRE.MatchString(j.jid()) {
			t.Fatalf("job %d = %v, want OldJob with args [%d] and a jid", i, j, i+1)
		}
	}
}

// Every identifier is quoted: a schema name with quotes, spaces, a
// semicolon and capitals works end to end, and so does one so long that its
// channel name is hashed.
func TestAwkwardSchemaNames(t *testing.T) {
	t.Parallel()
	for _, name := range []string{
		testenv.Name(`sdtest "Q"; DROP `),
		testenv.Name("sdtest_" + strings.Repeat("long", 12)), // 67 bytes with the prefix
	} {
		t.Run(name, func(t *testing.T) {
			if len(name) > 63 {
				name = name[:63]
			}
			h := &harness{t: t, schema: testenv.SchemaNamed(t, name)}
			h.rdb, h.ns = testenv.Redis(t)
			h.conn = testenv.Conn(t, testenv.DatabaseURL())
			if _, err := relay.Migrate(context.Background(), h.conn, h.schema); err != nil {
				t.Fatal(err)
			}
			h.stager = relay.NewStager(h.schema)
			cfg := h.config()
			cfg.PollInterval = time.Minute // only NOTIFY on the right channel delivers in time
			_, idle := h.startSignaled(cfg)
			h.waitIdleAfterListen(idle)
			jid := h.stage(relay.Job{Name: "AwkwardJob"})
			h.waitQueueLen("default", 1, 10*time.Second)
			if got := h.queue("default")[0].jid(); got != jid {
				t.Fatalf("delivered %s, want %s", got, jid)
			}
			if ch := relay.ChannelName(h.schema); len(ch) > 63 {
				t.Fatalf("ChannelName(%q) = %q, longer than PostgreSQL's 63 bytes", h.schema, ch)
			}
		})
	}
}

// A migration that would wait on an app transaction's lock gives up after
// its lock timeout instead of queueing the app's writes behind it.
func TestMigrateGivesUpOnBusyTable(t *testing.T) {
	t.Parallel()
	h := &harness{t: t, schema: testenv.Schema(t)}
	h.conn = testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()
	schema := createSeedTable(t, h.conn, h.schema)
	// An app transaction that has written to the seed table and stays open.
	app, err := testenv.Conn(t, testenv.DatabaseURL()).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer app.Rollback(ctx)
	if _, err := app.Exec(ctx, `INSERT INTO `+schema+`.staged_jobs (job_name, job_args) VALUES ('J', '[]')`); err != nil {
		t.Fatal(err)
	}
	// Without a lock timeout Migrate would wait as long as the app's
	// transaction stays open: here, until this deadline.
	mctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err = relay.Migrate(mctx, h.conn, h.schema)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
		t.Fatalf("Migrate on a busy table = %v, want a lock timeout (55P03)", err)
	}
}

// createSeedTable creates schema with the seed article's three-column
// staged_jobs table, and returns the quoted schema name.
func createSeedTable(t *testing.T, conn *pgx.Conn, schema string) string {
	t.Helper()
	quoted := pgx.Identifier{schema}.Sanitize()
	for _, q := range []string{
		`CREATE SCHEMA ` + quoted,
		`CREATE TABLE ` + quoted + `.staged_jobs (id BIGSERIAL PRIMARY KEY, job_name TEXT NOT NULL, job_args JSONB NOT NULL)`,
	} {
		if _, err := conn.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	return quoted
}
