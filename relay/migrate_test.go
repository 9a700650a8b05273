package relay_test

import (
	"context"
	"errors"
	"fmt"
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

	files, latest := freshInstall(t)
	first, err := relay.Migrate(ctx, conn, schema)
	if err != nil {
		t.Fatal(err)
	}
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

// freshInstall returns the files Migrate applies to a fresh schema, in
// order: the baseline (its wake file first) and every migration above it;
// and the latest version.
func freshInstall(t *testing.T) ([]string, int) {
	t.Helper()
	files, latest := embeddedMigrations(t)
	baselines, err := fs.Glob(sqlfiles.Files, "baseline_*.sql")
	if err != nil || len(baselines) != 1 {
		t.Fatalf("want one baseline in sql/, have %v (%v)", baselines, err)
	}
	v := strings.TrimSuffix(strings.TrimPrefix(baselines[0], "baseline_"), ".sql")
	want := []string{"wake_" + v + ".sql", baselines[0]}
	bv, err := strconv.Atoi(v)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		num, _, _ := strings.Cut(f, "_")
		if n, _ := strconv.Atoi(num); n > bv {
			want = append(want, f)
		}
	}
	return want, latest
}

// embeddedMigrations returns the migration files of sql/ (NNN_name.sql) in
// order, and the latest version: what this binary needs.
func embeddedMigrations(t *testing.T) ([]string, int) {
	t.Helper()
	files, err := fs.Glob(sqlfiles.Files, "[0-9][0-9][0-9]_*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("embedded migrations: %v, %v", files, err)
	}
	slices.Sort(files)
	num, _, _ := strings.Cut(files[len(files)-1], "_")
	latest, err := strconv.Atoi(num)
	if err != nil {
		t.Fatalf("migration %s: %v", files[len(files)-1], err)
	}
	return files, latest
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
	if files, _ := freshInstall(t); applied != len(files) {
		t.Fatalf("%d files applied across %d concurrent runs, want each of the %d once", applied, n, len(files))
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
		{"options set args", "job_name, job_args, options", `'J', '[]', '{"args": []}'`},
		{"options set queue", "job_name, job_args, options", `'J', '[]', '{"queue": "q"}'`},
		{"options set created_at", "job_name, job_args, options", `'J', '[]', '{"created_at": 1}'`},
		{"options set enqueued_at", "job_name, job_args, options", `'J', '[]', '{"enqueued_at": 1}'`},
		{"options set at", "job_name, job_args, options", `'J', '[]', '{"retry": 3, "at": 1}'`},
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
	schema := createSeedTable(t, h.conn, h.schema, seedColumns)
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
	schema := createSeedTable(t, h.conn, h.schema, seedColumns)
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

// The seed article's three-column staged_jobs table, and the same with
// nullable columns, as some copies of it have.
const (
	seedColumns         = `(id BIGSERIAL PRIMARY KEY, job_name TEXT NOT NULL, job_args JSONB NOT NULL)`
	nullableSeedColumns = `(id BIGSERIAL PRIMARY KEY, job_name TEXT, job_args JSONB)`
)

// createSeedTable creates schema with a staged_jobs table of columns, and
// returns the quoted schema name.
func createSeedTable(t *testing.T, conn *pgx.Conn, schema, columns string) string {
	t.Helper()
	quoted := pgx.Identifier{schema}.Sanitize()
	for _, q := range []string{
		`CREATE SCHEMA ` + quoted,
		`CREATE TABLE ` + quoted + `.staged_jobs ` + columns,
	} {
		if _, err := conn.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	return quoted
}

// Migrate makes job_name and job_args of a seed table NOT NULL, both when
// it upgrades the seed table and when 001 upgraded it earlier; NULL rows
// fail the migration with their count and a query that finds them, and
// change nothing.
func TestMigrateSeedColumnsNotNull(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name      string
		at001     bool // 001 applied by an earlier Migrate
		nullRows  int
		wantApply []string
	}{
		{name: "seed table", wantApply: []string{"001_staged_jobs.sql", "002_not_null.sql"}},
		{name: "seed table with NULL rows", nullRows: 2},
		{name: "at version 1", at001: true, wantApply: []string{"002_not_null.sql"}},
		{name: "at version 1 with NULL rows", at001: true, nullRows: 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			schema := testenv.Schema(t)
			conn := testenv.Conn(t, testenv.DatabaseURL())
			quoted := createSeedTable(t, conn, schema, nullableSeedColumns)
			if tt.at001 {
				applyFirstMigration(t, conn, schema)
			}
			rows := `('OldJob', '[1]')`
			if tt.nullRows > 0 {
				rows += `, (NULL, '[2]'), ('NullArgsJob', NULL)`
			}
			if _, err := conn.Exec(ctx, `INSERT INTO `+quoted+`.staged_jobs (job_name, job_args) VALUES `+rows); err != nil {
				t.Fatal(err)
			}
			before := schemaState(t, conn, schema)

			res, err := relay.Migrate(ctx, conn, schema)
			if tt.nullRows == 0 {
				if err != nil {
					t.Fatalf("Migrate: %v", err)
				}
				if !slices.Contains(res.Applied, "002_not_null.sql") || slices.Contains(res.Applied, "001_staged_jobs.sql") != !tt.at001 {
					t.Errorf("Migrate applied %v, want %v (and any later migration)", res.Applied, tt.wantApply)
				}
				if got := nullableColumns(t, conn, schema); len(got) != 0 {
					t.Errorf("after Migrate, columns %v are nullable, want job_name and job_args NOT NULL", got)
				}
				return
			}
			find := `SELECT id FROM ` + schema + `.staged_jobs WHERE job_name IS NULL OR job_args IS NULL`
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "23502" {
				t.Fatalf("Migrate = %v, want a not-null violation (23502)", err)
			}
			for _, want := range []string{fmt.Sprintf("%d rows", tt.nullRows), find, "002_not_null.sql"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Migrate error %q does not contain %q", err, want)
				}
			}
			if after := schemaState(t, conn, schema); after != before {
				t.Errorf("the failed Migrate changed the schema:\nbefore: %s\nafter:  %s", before, after)
			}
			// The query finds the rows; without them Migrate succeeds.
			if _, err := conn.Exec(ctx, `DELETE FROM `+quoted+`.staged_jobs WHERE id IN (`+find+`)`); err != nil {
				t.Fatal(err)
			}
			if _, err := relay.Migrate(ctx, conn, schema); err != nil {
				t.Fatalf("Migrate after deleting the NULL rows: %v", err)
			}
			if got := nullableColumns(t, conn, schema); len(got) != 0 {
				t.Errorf("after Migrate, columns %v are nullable, want job_name and job_args NOT NULL", got)
			}
		})
	}
}

// applyFirstMigration brings schema to version 1 as a Migrate of a binary
// that had only 001 did: 001 applied and recorded.
func applyFirstMigration(t *testing.T, conn *pgx.Conn, schema string) {
	t.Helper()
	body, err := fs.ReadFile(sqlfiles.Files, "001_staged_jobs.sql")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		for _, q := range []string{
			`SET LOCAL search_path TO ` + pgx.Identifier{schema}.Sanitize(),
			`CREATE TABLE stagedrain_migrations (version INT PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())`,
			string(body),
			`INSERT INTO stagedrain_migrations (version, name) VALUES (1, '001_staged_jobs.sql')`,
		} {
			if _, err := tx.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("apply 001 to %s: %v", schema, err)
	}
}

// nullableColumns lists which of job_name and job_args of
// schema.staged_jobs are nullable.
func nullableColumns(t *testing.T, conn *pgx.Conn, schema string) []string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `SELECT attname::text FROM pg_attribute
		WHERE attrelid = $1::regclass AND attname IN ('job_name', 'job_args') AND NOT attnotnull ORDER BY attnum`,
		pgx.Identifier{schema, "staged_jobs"}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return cols
}

// schemaState describes schema's tables, their columns and constraints, and
// staged_jobs' rows, for comparing before and after.
func schemaState(t *testing.T, conn *pgx.Conn, schema string) string {
	t.Helper()
	var state string
	err := conn.QueryRow(context.Background(), `SELECT
		(SELECT string_agg(format('%s.%s %s notnull=%s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull), '; ' ORDER BY c.relname, a.attnum)
		   FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
		  WHERE c.relnamespace = $1::regnamespace AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped)
		|| ' | ' || coalesce((SELECT string_agg(conname, ', ' ORDER BY conname) FROM pg_constraint WHERE connamespace = $1::regnamespace), '')
		|| ' | ' || coalesce((SELECT string_agg(tgname, ', ' ORDER BY tgname) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = $1::regnamespace), '')`,
		pgx.Identifier{schema}.Sanitize()).Scan(&state)
	if err != nil {
		t.Fatalf("describe schema %s: %v", schema, err)
	}
	rows, err := conn.Query(context.Background(), `SELECT to_jsonb(s)::text FROM `+pgx.Identifier{schema, "staged_jobs"}.Sanitize()+` s ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	staged, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	versions := "no stagedrain_migrations"
	if tableExists(t, conn, schema, "stagedrain_migrations") {
		err := conn.QueryRow(context.Background(), `SELECT 'versions ' || coalesce(string_agg(version::text, ',' ORDER BY version), '') FROM `+
			pgx.Identifier{schema, "stagedrain_migrations"}.Sanitize()).Scan(&versions)
		if err != nil {
			t.Fatal(err)
		}
	}
	return state + " | " + versions + " | rows " + strings.Join(staged, ", ")
}

// tableExists reports whether schema.table exists.
func tableExists(t *testing.T, conn *pgx.Conn, schema, table string) bool {
	t.Helper()
	var exists bool
	if err := conn.QueryRow(context.Background(), `SELECT to_regclass($1) IS NOT NULL`, pgx.Identifier{schema, table}.Sanitize()).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	return exists
}

// A schema whose wake trigger is 006's (no WHEN, the function with the
// barrier), 007's (the WHEN on the schema's awake lock, a look in two
// statements) or 009's (one-expression looks, the opt-out, the WHEN that
// flags the queue already queued; a commit notifies unless a relay holds
// 'awake') or 010's (a commit notifies only while a relay holds the
// schema's or the row's queue's 'idle') gets the later wake migrations
// from Migrate, up to 010's function and 015's trigger, whose WHEN looks
// at the schema's 'idle' alone. Migrate again applies nothing.
// The migrations of other things, recorded, stay as they are.
func TestMigrateUpgradesTheWakeTrigger(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		from      string // the migration whose trigger the schema has
		plain     bool   // from's trigger has no WHEN
		forget    []int  // the versions to unrecord
		wantApply []string
	}{
		{from: "006_queue_gate.sql", plain: true, forget: []int{7, 9, 10, 15}, wantApply: []string{"007_wake_no_barrier.sql", "009_wake_once.sql", "010_wake_when_idle.sql", "015_wake_one_look.sql"}},
		{from: "007_wake_no_barrier.sql", forget: []int{9, 10, 15}, wantApply: []string{"009_wake_once.sql", "010_wake_when_idle.sql", "015_wake_one_look.sql"}},
		{from: "009_wake_once.sql", forget: []int{10, 15}, wantApply: []string{"010_wake_when_idle.sql", "015_wake_one_look.sql"}},
		{from: "010_wake_when_idle.sql", forget: []int{15}, wantApply: []string{"015_wake_one_look.sql"}},
	} {
		t.Run(tt.from, func(t *testing.T) {
			t.Parallel()
			schema := testenv.Schema(t)
			conn := testenv.Conn(t, testenv.DatabaseURL())
			ctx := context.Background()
			if _, err := relay.Migrate(ctx, conn, schema); err != nil {
				t.Fatal(err)
			}
			// Back to from's trigger, as a schema migrated by an earlier
			// release.
			body, err := fs.ReadFile(sqlfiles.Files, tt.from)
			if err != nil {
				t.Fatal(err)
			}
			stmts := []string{"SET LOCAL search_path TO " + pgx.Identifier{schema}.Sanitize(), string(body)}
			if tt.plain {
				stmts = append(stmts, `DROP TRIGGER stagedrain_wake ON staged_jobs`,
					`CREATE CONSTRAINT TRIGGER stagedrain_wake AFTER INSERT ON staged_jobs
						DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION stagedrain_wake()`)
			}
			for _, v := range tt.forget {
				stmts = append(stmts, fmt.Sprintf(`DELETE FROM %s WHERE version = %d`, pgx.Identifier{schema, "stagedrain_migrations"}.Sanitize(), v))
			}
			err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				for _, q := range stmts {
					if _, err := tx.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			definitions := func() (trigger, function string) {
				t.Helper()
				err := conn.QueryRow(ctx, `SELECT pg_get_triggerdef(t.oid), pg_get_functiondef(t.tgfoid)
					FROM pg_trigger t WHERE t.tgrelid = $1::regclass AND t.tgname = 'stagedrain_wake'`,
					pgx.Identifier{schema, "staged_jobs"}.Sanitize()).Scan(&trigger, &function)
				if err != nil {
					t.Fatal(err)
				}
				return trigger, function
			}
			if trig, fn := definitions(); strings.Contains(trig, "WHEN") != !tt.plain || strings.Contains(trig, "stagedrain_wake_once") ||
				strings.Contains(fn, "stagedrain-idle") != (tt.from == "010_wake_when_idle.sql") {
				t.Fatalf("setup: not %s's trigger:\n%s\n%s", tt.from, trig, fn)
			}

			res, err := relay.Migrate(ctx, conn, schema)
			if err != nil {
				t.Fatal(err)
			}
			_, latest := embeddedMigrations(t)
			if !slices.Equal(res.Applied, tt.wantApply) || res.Current != latest {
				t.Fatalf("Migrate = %+v, want %v applied, version %d", res, tt.wantApply, latest)
			}
			trig, fn := definitions()
			var key int32
			var flag string
			if err := conn.QueryRow(ctx, `SELECT hashtext($1), 'stagedrain.wake_' || $2::regclass::oid`,
				relay.IdleLockName(schema), pgx.Identifier{schema, "staged_jobs"}.Sanitize()).Scan(&key, &flag); err != nil {
				t.Fatal(err)
			}
			keyText := strconv.Itoa(int(key)) // how pg_get_triggerdef prints it
			if key < 0 {
				keyText = "'" + keyText + "'::integer"
			}
			for _, want := range []string{
				fmt.Sprintf("WHEN (((NOT (pg_try_advisory_lock(%s, (pg_backend_pid() %% 16)) AND pg_advisory_unlock(%s, (pg_backend_pid() %% 16)))) AND ", keyText, keyText),
				fmt.Sprintf("stagedrain_wake_once('%s'::text, new.queue))) EXECUTE", flag),
			} {
				if !strings.Contains(trig, want) {
					t.Fatalf("trigger after Migrate:\n%s\nwant it to contain\n%s", trig, want)
				}
			}
			if strings.Contains(fn, "barrier") || !strings.Contains(fn, "stagedrain.notify") || !strings.Contains(fn, "'stagedrain-idle:'") || strings.Contains(fn, "stagedrain-awake") {
				t.Fatalf("stagedrain_wake() after Migrate is not 010's:\n%s", fn)
			}
			again, err := relay.Migrate(ctx, conn, schema)
			if err != nil || len(again.Applied) != 0 {
				t.Fatalf("Migrate again = %+v, %v; want nothing applied", again, err)
			}
		})
	}
}

// A fresh install (the baseline, then the migrations above it) and an
// upgrade from 001 (001 applied, then Migrate) give the same schema: the
// same columns (name, type, nullability, default), constraints, indexes,
// functions, triggers, relations and comments, and the same
// stagedrain_migrations rows. Each schema's name, its hashtext key of
// 'idle' and its staged_jobs' oid (both in the trigger's WHEN) are
// normalized.
func TestBaselineMatchesUpgrade(t *testing.T) {
	t.Parallel()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()
	fresh, upgraded := testenv.Schema(t), testenv.Schema(t)
	baselineFiles, _ := freshInstall(t)

	res, err := relay.Migrate(ctx, conn, fresh)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Applied[:2], baselineFiles[:2]) {
		t.Fatalf("fresh Migrate applied %v, want the baseline %v first", res.Applied, baselineFiles[:2])
	}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{upgraded}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	applyFirstMigration(t, conn, upgraded)
	res, err = relay.Migrate(ctx, conn, upgraded)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Applied) == 0 || res.Applied[0] != "002_not_null.sql" {
		t.Fatalf("Migrate of version 1 applied %v, want 002_not_null.sql and on", res.Applied)
	}

	want, got := catalog(t, conn, upgraded), catalog(t, conn, fresh)
	if !slices.Equal(got, want) {
		for _, line := range want {
			if !slices.Contains(got, line) {
				t.Errorf("the upgrade has, the fresh install has not:\n%s", line)
			}
		}
		for _, line := range got {
			if !slices.Contains(want, line) {
				t.Errorf("the fresh install has, the upgrade has not:\n%s", line)
			}
		}
		t.Fatal("a fresh install and an upgrade from 001 differ")
	}
}

// catalog describes schema's objects, one line each, in a stable order,
// with the schema's name, its 'idle' key and its staged_jobs' oid
// replaced by placeholders.
func catalog(t *testing.T, conn *pgx.Conn, schema string) []string {
	t.Helper()
	ctx := context.Background()
	var lines []string
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		// Every name in the definitions below is qualified.
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO pg_catalog`); err != nil {
			return err
		}
		const q = `
		WITH n AS (SELECT oid FROM pg_namespace WHERE nspname = $1)
		SELECT 'relation ' || relname || ' ' || relkind::text || coalesce(' comment ' || obj_description(c.oid, 'pg_class'), '')
			FROM pg_class c WHERE relnamespace = (SELECT oid FROM n)
		UNION ALL
		SELECT format('column %s.%s #%s %s%s%s%s', c.relname, a.attname, a.attnum, format_type(a.atttypid, a.atttypmod),
				CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,
				coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), ''),
				coalesce(' identity ' || nullif(a.attidentity::text, ''), ''))
			FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
			LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
			WHERE c.relnamespace = (SELECT oid FROM n) AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND a.attnum > 0 AND NOT a.attisdropped
		UNION ALL
		SELECT format('constraint %s.%s %s deferrable=%s deferred=%s', conrelid::regclass, conname, pg_get_constraintdef(oid), condeferrable, condeferred)
			FROM pg_constraint WHERE connamespace = (SELECT oid FROM n)
		UNION ALL
		SELECT 'index ' || pg_get_indexdef(i.indexrelid)
			FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relnamespace = (SELECT oid FROM n)
		UNION ALL
		SELECT 'function ' || pg_get_functiondef(p.oid) || coalesce(' comment ' || obj_description(p.oid, 'pg_proc'), '')
			FROM pg_proc p WHERE pronamespace = (SELECT oid FROM n)
		UNION ALL
		SELECT 'trigger ' || pg_get_triggerdef(g.oid) || coalesce(' comment ' || obj_description(g.oid, 'pg_trigger'), '')
			FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid WHERE c.relnamespace = (SELECT oid FROM n) AND NOT g.tgisinternal
		UNION ALL
		SELECT 'sequence ' || s.seqrelid::regclass || ' ' || format_type(s.seqtypid, NULL) || ' ' || s.seqstart || ' ' || s.seqincrement || ' ' || s.seqmax
			|| coalesce(' owned by ' || (SELECT d.refobjid::regclass || '.' || d.refobjsubid FROM pg_depend d
				WHERE d.classid = 'pg_class'::regclass AND d.objid = s.seqrelid AND d.deptype IN ('a', 'i') AND d.refclassid = 'pg_class'::regclass), '')
			FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid WHERE c.relnamespace = (SELECT oid FROM n)
		ORDER BY 1`
		rows, err := tx.Query(ctx, q, schema)
		if err != nil {
			return err
		}
		if lines, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return err
		}
		rows, err = tx.Query(ctx, `SELECT format('migration %s %s', version, name) FROM `+pgx.Identifier{schema, "stagedrain_migrations"}.Sanitize()+` ORDER BY version`)
		if err != nil {
			return err
		}
		versions, err := pgx.CollectRows(rows, pgx.RowTo[string])
		lines = append(lines, versions...)
		return err
	})
	if err != nil {
		t.Fatalf("read the catalog of %s: %v", schema, err)
	}
	var key int32
	var oid uint32
	if err := conn.QueryRow(ctx, `SELECT hashtext($1), $2::regclass::oid`,
		relay.IdleLockName(schema), pgx.Identifier{schema, "staged_jobs"}.Sanitize()).Scan(&key, &oid); err != nil {
		t.Fatal(err)
	}
	// pg_get_triggerdef prints a negative key as '-N'::integer.
	normal := strings.NewReplacer(pgx.Identifier{schema}.Sanitize(), "SCHEMA", schema, "SCHEMA",
		"'"+strconv.Itoa(int(key))+"'::integer", "IDLE_KEY", strconv.Itoa(int(key)), "IDLE_KEY", "wake_"+strconv.FormatUint(uint64(oid), 10), "wake_OID")
	for i := range lines {
		lines[i] = normal.Replace(lines[i])
	}
	if len(lines) < 30 {
		t.Fatalf("catalog of %s: %d lines, want the whole schema:\n%s", schema, len(lines), strings.Join(lines, "\n"))
	}
	return lines
}

// The stagedrain_wake() that Migrate WithSource(SourceSidekiqStagedPush)
// gives the gem's table is the one the migrations leave staged_jobs, and
// its trigger's comment names the last migration that changed it: applied
// one at a time, the migrations show which that is, without reading them.
func TestWakeFileIsCurrent(t *testing.T) {
	t.Parallel()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()
	upgraded, gem := testenv.Schema(t), testenv.Schema(t)
	files, _ := embeddedMigrations(t)
	function := func(schema string) string {
		t.Helper()
		var def string
		err := conn.QueryRow(ctx, `SELECT coalesce((SELECT pg_get_functiondef(p.oid) FROM pg_proc p
			WHERE p.pronamespace = $1::regnamespace AND p.proname = 'stagedrain_wake'), '')`, pgx.Identifier{schema}.Sanitize()).Scan(&def)
		if err != nil {
			t.Fatal(err)
		}
		return strings.NewReplacer(pgx.Identifier{schema}.Sanitize(), "SCHEMA", schema, "SCHEMA").Replace(def)
	}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{upgraded}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	var current string
	changed := 0
	for _, f := range files {
		body, err := fs.ReadFile(sqlfiles.Files, f)
		if err != nil {
			t.Fatal(err)
		}
		err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+pgx.Identifier{upgraded}.Sanitize()); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, string(body), pgx.QueryExecModeSimpleProtocol)
			return err
		})
		if err != nil {
			t.Fatalf("apply %s: %v", f, err)
		}
		if def := function(upgraded); def != current {
			current = def
			changed, _ = strconv.Atoi(f[:3])
		}
	}
	if current == "" {
		t.Fatal("no migration creates stagedrain_wake()")
	}

	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{gem}.Sanitize()+`;`+gemTableSQL(t, gem)); err != nil {
		t.Fatal(err)
	}
	if _, err := relay.Migrate(ctx, conn, gem, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
		t.Fatal(err)
	}
	if got := function(gem); got != current {
		t.Errorf("the gem's stagedrain_wake():\n%s\nwant the migrations' (last changed by version %d):\n%s", got, changed, current)
	}
	var comment string
	if err := conn.QueryRow(ctx, `SELECT coalesce(obj_description(t.oid, 'pg_trigger'), '') FROM pg_trigger t
		WHERE t.tgrelid = $1::regclass AND t.tgname = 'stagedrain_wake'`, pgx.Identifier{gem, "sidekiq_staged_push_jobs"}.Sanitize()).Scan(&comment); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("stagedrain_wake %d", changed); comment != want {
		t.Errorf("the gem's trigger comment is %q, want %q: the version of the last migration that changed stagedrain_wake()", comment, want)
	}
}

// Migrate with an unknown source refuses, naming the field, and creates
// nothing; WithSource(SourceStagedJobs) is Migrate's default.
func TestMigrateWithSource(t *testing.T) {
	t.Parallel()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()
	schema := testenv.Schema(t)
	var fe *relay.FieldError
	if _, err := relay.Migrate(ctx, conn, schema, relay.WithSource("nosuch")); !errors.As(err, &fe) || fe.Field != "Source" {
		t.Fatalf("Migrate WithSource(\"nosuch\") = %v, want a FieldError of Source", err)
	}
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists); err != nil || exists {
		t.Fatalf("schema %s exists after a refused Migrate (%v)", schema, err)
	}
	files, latest := freshInstall(t)
	res, err := relay.Migrate(ctx, conn, schema, relay.WithSource(relay.SourceStagedJobs))
	if err != nil || !slices.Equal(res.Applied, files) || res.Current != latest {
		t.Fatalf("Migrate WithSource(SourceStagedJobs) = %+v, %v; want %v applied, version %d", res, err, files, latest)
	}
}

// stagedrain_last_id(), which every claim of the low-water mark calls, is
// PL/pgSQL since 017 (its plan kept for the session, not made again at
// every claim), and still SECURITY DEFINER with a fixed search_path; it
// reads the sequence's last value, NULL before the first.
func TestLastIDIsPLpgSQL(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	conn := testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	checkLastIDFunc(t, conn, pgx.Identifier{schema, "stagedrain_last_id"}.Sanitize(), func() (id int64) {
		if err := conn.QueryRow(ctx, "INSERT INTO "+pgx.Identifier{schema, "staged_jobs"}.Sanitize()+
			" (job_name, job_args) VALUES ('J', '[]') RETURNING id").Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	})
}

// checkLastIDFunc checks the low-water mark's reader of a sequence, fn
// (quoted): PL/pgSQL, SECURITY DEFINER, its search_path fixed; NULL before
// the first row, then the id insert returns.
func checkLastIDFunc(t *testing.T, conn *pgx.Conn, fn string, insert func() int64) {
	t.Helper()
	ctx := context.Background()
	var lang string
	var definer bool
	var config []string
	if err := conn.QueryRow(ctx, `SELECT l.lanname, p.prosecdef, coalesce(p.proconfig, '{}')
		FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.oid = $1::regprocedure`, fn+"()").Scan(&lang, &definer, &config); err != nil {
		t.Fatal(err)
	}
	if lang != "plpgsql" || !definer || !slices.Equal(config, []string{"search_path=pg_catalog, pg_temp"}) {
		t.Fatalf("%s(): language %s, SECURITY DEFINER %v, config %v; want plpgsql, true, [search_path=pg_catalog, pg_temp]", fn, lang, definer, config)
	}
	var last *int64
	if err := conn.QueryRow(ctx, "SELECT "+fn+"()").Scan(&last); err != nil || last != nil {
		t.Fatalf("%s() before any row = %v, %v; want NULL", fn, last, err)
	}
	id := insert()
	if err := conn.QueryRow(ctx, "SELECT "+fn+"()").Scan(&last); err != nil || last == nil || *last != id {
		t.Fatalf("%s() after a row of id %d = %v, %v", fn, id, last, err)
	}
}

// The gem's reader of its sequence, stagedrain_staged_push_last_id(), is
// PL/pgSQL since gem_002.sql, as stagedrain_last_id() since 017, and a
// table of gem_001 (its trigger's comment "stagedrain_gem 1") gets it from
// Migrate, which records version 2 and keeps one statement trigger.
func TestGemLastIDIsPLpgSQL(t *testing.T) {
	t.Parallel()
	h := newStagedPushHarness(t)
	ctx := context.Background()
	old, err := sqlfiles.Files.ReadFile("gem_001.sql")
	if err != nil {
		t.Fatal(err)
	}
	table := h.gemTable()
	if _, err := h.conn.Exec(ctx, "SET search_path TO "+pgx.Identifier{h.schema}.Sanitize()+";\n"+string(old)+
		"\nCOMMENT ON TRIGGER stagedrain_xid_first ON "+table+" IS 'stagedrain_gem 1'; RESET search_path;"); err != nil {
		t.Fatalf("apply gem_001.sql as an earlier release did: %v", err)
	}
	res, err := relay.Migrate(ctx, h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush))
	if err != nil {
		t.Fatal(err)
	}
	if want := "stagedrain_xid_first trigger on sidekiq_staged_push_jobs (gem_002.sql)"; !slices.Contains(res.Applied, want) {
		t.Fatalf("Migrate applied %q, want %q among them", res.Applied, want)
	}
	var comment string
	var triggers int
	if err := h.conn.QueryRow(ctx, `SELECT max(coalesce(obj_description(t.oid, 'pg_trigger'), '')), count(*) FROM pg_trigger t
		WHERE t.tgrelid = $1::regclass AND t.tgname = 'stagedrain_xid_first'`, table).Scan(&comment, &triggers); err != nil {
		t.Fatal(err)
	}
	if comment != "stagedrain_gem 2" || triggers != 1 {
		t.Fatalf("stagedrain_xid_first: %d triggers, comment %q; want 1, %q", triggers, comment, "stagedrain_gem 2")
	}
	checkLastIDFunc(t, h.conn, pgx.Identifier{h.schema, "stagedrain_staged_push_last_id"}.Sanitize(), func() int64 {
		return h.pushStaged(`{"class":"J","args":[],"jid":"j1","queue":"default"}`)[0]
	})
}
