package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// readmeGrants returns the GRANT statements of the README's "Least-privilege
// role" block, for schema and role instead of its app and stagedrain_relay.
func readmeGrants(t testing.TB, schema, role string) []string {
	t.Helper()
	b, err := os.ReadFile("../cmd/stagedrain/README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "### Least-privilege role\n")
	if !ok {
		t.Fatal(`README.md has no "### Least-privilege role" section`)
	}
	_, block, ok := strings.Cut(section, "```sql\n")
	block, _, ok2 := strings.Cut(block, "```")
	if !ok || !ok2 {
		t.Fatal(`README.md's "Least-privilege role" section has no sql block`)
	}
	qs, qr := pgx.Identifier{schema}.Sanitize(), pgx.Identifier{role}.Sanitize()
	var grants []string
	for _, line := range strings.Split(block, "\n") {
		if !strings.HasPrefix(line, "GRANT ") {
			continue
		}
		g := strings.ReplaceAll(line, " app.", " "+qs+".")
		g = strings.ReplaceAll(g, " SCHEMA app ", " SCHEMA "+qs+" ")
		g = strings.ReplaceAll(g, " TO stagedrain_relay;", " TO "+qr)
		if g == line || strings.Contains(g, "stagedrain_relay") || strings.Contains(g, " app.") {
			t.Fatalf("README grant %q: want it ON app.<table> or SCHEMA app, TO stagedrain_relay", line)
		}
		grants = append(grants, g)
	}
	if len(grants) != 5 {
		t.Fatalf("README's Least-privilege role block has %d GRANT lines, want 5: %q", len(grants), grants)
	}
	return grants
}

// privilegeEnv is a migrated schema with two staged rows, and a role with
// the README's grants on it.
type privilegeEnv struct {
	schema, role string
	owner, as    *pgx.Conn // the schema's owner; the role
	relay        *Relay    // a relay of the role, not run
}

func newPrivilegeEnv(t *testing.T) *privilegeEnv {
	t.Helper()
	ctx := context.Background()
	e := &privilegeEnv{schema: testenv.Schema(t)}
	e.owner = testenv.Conn(t, testenv.DatabaseURL())
	if _, err := Migrate(ctx, e.owner, e.schema); err != nil {
		t.Fatal(err)
	}
	if _, err := e.owner.Exec(ctx, "INSERT INTO "+pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()+
		" (job_name, job_args) VALUES ('A', '[1]'), ('B', '[2]')"); err != nil {
		t.Fatal(err)
	}
	var roleURL string
	e.role, roleURL = testenv.RoleIn(t, testenv.DatabaseURL(), "sdtest_role_")
	e.grant(t)
	e.as = testenv.Conn(t, roleURL)
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { rdb.Close() })
	var err error
	if e.relay, err = New(Config{DatabaseURL: roleURL, Redis: rdb, Schema: e.schema, WaitForStandby: true}); err != nil {
		t.Fatal(err)
	}
	return e
}

// grant (re)applies the README's grants.
func (e *privilegeEnv) grant(t *testing.T) {
	t.Helper()
	for _, g := range readmeGrants(t, e.schema, e.role) {
		if _, err := e.owner.Exec(context.Background(), g); err != nil {
			t.Fatalf("%s: %v", g, err)
		}
	}
}

// statements runs, as the role, every kind of statement that Run issues,
// each step in a transaction of its own that it rolls back, and returns the
// first error.
func (e *privilegeEnv) statements(ctx context.Context) error {
	r := e.relay
	steps := []struct {
		name string
		run  func(tx pgx.Tx) error
	}{
		{"version check", func(tx pgx.Tx) error {
			var v *int
			return tx.QueryRow(ctx, r.sql.version).Scan(&v)
		}},
		{"claim, then put back", func(tx pgx.Tx) error {
			// claimBatch begins a transaction of its own: nested in tx, a
			// BEGIN only warns, and tx's rollback ends it.
			jobs, err := claimBatch(ctx, tx.Conn(), r.sql.claim, nil, 10, nil, math.MinInt64, nil, []string{})
			if err != nil {
				return err
			}
			if len(jobs) != 2 {
				return fmt.Errorf("claimed %d rows, want 2", len(jobs))
			}
			_, err = tx.Exec(ctx, r.sql.reinsert, reinsertArgs(jobs)...)
			return err
		}},
		{"bury, twice (the second conflicts)", func(tx pgx.Tx) error {
			job := []stagedJob{{id: 1 << 40, name: "P", args: []byte("[]"), queue: "q", jid: "j", createdAt: time.Now(), options: []byte("{}")}}
			for range 2 {
				if _, err := tx.Exec(ctx, r.sql.bury, buryArgs(job, []string{"poison"})...); err != nil {
					return err
				}
			}
			return nil
		}},
		{"backlog", func(tx pgx.Tx) error {
			var n int
			var oldest *time.Time
			return tx.QueryRow(ctx, r.sql.backlog, backlogCap).Scan(&n, &oldest)
		}},
		{"NOTIFY queue usage", func(tx pgx.Tx) error {
			var usage float64
			return tx.QueryRow(ctx, notifyQueueUsageSQL).Scan(&usage)
		}},
		{"leader lock and wake gate", func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(tryLockSQL, r.lockKey)
			b.Queue(unlockSQL, r.lockKey)
			keys := gateLockNames(e.schema, []string{"q"})
			b.Queue(gateLockSQL, keys.args()...)
			b.Queue(gateUnlockSQL, keys.args()...)
			b.Queue(inProgressSQL)
			b.Queue(stillInProgressSQL, []int64{1})
			return tx.SendBatch(ctx, b).Close()
		}},
		{"listen", func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "LISTEN "+pgx.Identifier{ChannelName(e.schema)}.Sanitize())
			return err
		}},
		{"listener heartbeat", func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, heartbeatSQL, ChannelName(e.schema), heartbeatPayload)
			return err
		}},
		{"standby positions", func(tx pgx.Tx) error {
			var insert, flush uint64
			var n, known int
			var unknown, sync, readable bool
			if err := tx.QueryRow(ctx, walPositionsSQL).Scan(&insert, &flush, &unknown, &sync, new(time.Time)); err != nil {
				return err
			}
			if err := tx.QueryRow(ctx, walInsertSQL).Scan(&insert, new(time.Time)); err != nil {
				return err
			}
			if err := tx.QueryRow(ctx, standbyFlushSQL).Scan(&insert, &n, &known, &flush, &readable); err != nil {
				return err
			}
			if !readable {
				return &pgconn.PgError{Code: "42501", Message: "pg_stat_replication's positions are not readable"}
			}
			return nil
		}},
		{"session settings", func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = off; SET LOCAL lock_timeout = 200; SET LOCAL application_name = 'x'; SET LOCAL enable_seqscan = off; SET LOCAL plan_cache_mode = force_generic_plan")
			return err
		}},
	}
	for _, s := range steps {
		tx, err := e.as.Begin(ctx)
		if err != nil {
			return err
		}
		err = s.run(tx)
		_ = tx.Rollback(ctx)
		if err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// The README's grants are enough for every statement the relay issues, and
// the start check finds nothing missing; without any one of them, a
// statement fails for want of it, and the start check names it. So the
// grants are all needed, and the check asks for no more than they give.
func TestLeastPrivilegeStatements(t *testing.T) {
	t.Parallel()
	e := newPrivilegeEnv(t)
	ctx := context.Background()
	if err := e.statements(ctx); err != nil {
		t.Fatalf("as a role with the README's grants: %v", err)
	}
	if err := e.relay.checkPrivileges(ctx, e.as); err != nil {
		t.Fatalf("checkPrivileges with the README's grants = %v, want nil", err)
	}

	table := func(name string) string { return pgx.Identifier{e.schema, name}.Sanitize() }
	role := pgx.Identifier{e.role}.Sanitize()
	for _, tc := range []struct {
		revoke  string
		missing string // what checkPrivileges says is missing
	}{
		{"USAGE ON SCHEMA " + pgx.Identifier{e.schema}.Sanitize(), "USAGE on schema " + pgx.Identifier{e.schema}.Sanitize()},
		{"SELECT ON " + table("staged_jobs"), "SELECT on " + table("staged_jobs")},
		{"INSERT ON " + table("staged_jobs"), "INSERT on " + table("staged_jobs")},
		{"DELETE ON " + table("staged_jobs"), "DELETE on " + table("staged_jobs")},
		{"UPDATE (id) ON " + table("staged_jobs"), "UPDATE on " + table("staged_jobs")},
		{"SELECT ON " + table("staged_jobs_dead"), "SELECT on " + table("staged_jobs_dead")},
		{"INSERT ON " + table("staged_jobs_dead"), "INSERT on " + table("staged_jobs_dead")},
		{"UPDATE ON " + table("staged_jobs_dead"), "UPDATE on " + table("staged_jobs_dead")},
		{"SELECT ON " + table("stagedrain_migrations"), "SELECT on " + table("stagedrain_migrations")},
		{"pg_monitor", "pg_monitor"},
	} {
		t.Run(tc.revoke, func(t *testing.T) {
			if _, err := e.owner.Exec(ctx, "REVOKE "+tc.revoke+" FROM "+role); err != nil {
				t.Fatal(err)
			}
			defer e.grant(t)
			if err := e.statements(ctx); !isInsufficientPrivilege(err) {
				t.Errorf("statements without %s: %v, want one to fail with SQLSTATE 42501", tc.revoke, err)
			}
			err := e.relay.checkPrivileges(ctx, e.as)
			if !errors.Is(err, ErrPermission) || !strings.Contains(err.Error(), fmt.Sprintf("role %q lacks %s:", e.role, tc.missing)) {
				t.Fatalf("checkPrivileges = %v, want ErrPermission saying role %q lacks only %s", err, e.role, tc.missing)
			}
			if !strings.HasSuffix(err.Error(), `(see README "Least-privilege role")`) {
				t.Errorf("checkPrivileges = %v, want it to point at the README", err)
			}
		})
	}
}
