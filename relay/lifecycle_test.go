package relay_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A stop that arrives mid-batch lets the batch finish: its jobs are
// delivered once and deleted, not left to be pushed again.
func TestStopMidBatchFinishesTheBatch(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	relay.SetAfterPush(r, func(context.Context) error {
		cancel() // SIGTERM between push and delete
		return nil
	})
	jid := h.stage(relay.Job{Name: "InFlight"})
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run = %v, want nil after a stop", err)
	}
	if n := h.staged(); n != 0 {
		t.Fatalf("%d rows staged after the stop, want 0: the batch was not finished", n)
	}
	if jobs := h.queue("default"); len(jobs) != 1 || jobs[0].jid() != jid {
		t.Fatalf("queue:default = %v, want the one job %s", jobs, jid)
	}
	h.waitLog("released leadership", 1)
}

// Two relays on one schema: one leads, the other waits; when the leader
// stops, the standby takes over and drains.
func TestStandbyTakesOverWhenLeaderStops(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	leaderCfg := h.config()
	leaderLogs := h.logs
	leader, err := relay.New(leaderCfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stopLeader := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- leader.Run(ctx) }()
	testenv.WaitFor(t, 10*time.Second, "first relay to lead", func() (bool, string) {
		return leaderLogs.FilterMessage("became leader").Len() == 1, ""
	})

	standbyCfg := h.config() // h.logs now observes the standby
	h.start(standbyCfg)
	h.waitLog("standby: another relay is draining this schema", 1)

	first := h.stage(relay.Job{Name: "BeforeStop"})
	h.waitQueueLen("default", 1, 10*time.Second)
	if n := h.logs.FilterMessage("batch drained").Len(); n != 0 {
		t.Fatalf("standby drained %d batches while the leader ran, want 0", n)
	}

	stopLeader()
	if err := <-done; err != nil {
		t.Fatalf("leader Run = %v, want nil", err)
	}
	h.waitLog("became leader", 1)
	second := h.stage(relay.Job{Name: "AfterStop"})
	h.waitQueueLen("default", 2, 10*time.Second)
	if jobs := h.queue("default"); jobs[0].jid() != first || jobs[1].jid() != second {
		t.Fatalf("delivered %s, %s; want %s then %s", jobs[0].jid(), jobs[1].jid(), first, second)
	}
}

// A schema with no staged_jobs table is an error Run returns at once,
// not one it retries forever.
func TestRunWithoutMigrationFails(t *testing.T) {
	t.Parallel()
	h := &harness{t: t, schema: testenv.Schema(t)}
	h.rdb, h.ns = testenv.Redis(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = r.Run(ctx)
	if err == nil || ctx.Err() != nil {
		t.Fatalf("Run = %v (ctx %v), want an error at once", err, ctx.Err())
	}
	if !errors.Is(err, relay.ErrNotMigrated) {
		t.Fatalf("Run = %v, want ErrNotMigrated", err)
	}
}

// Run compares the schema version Migrate recorded with the one it needs
// (its latest migration) and returns at once, before leading, when the
// schema is behind (ErrNotMigrated: the seed article's table Migrate never
// upgraded, too) or ahead of it (ErrSchemaTooNew).
func TestRunChecksSchemaVersion(t *testing.T) {
	t.Parallel()
	_, latest := embeddedMigrations(t)
	tests := []struct {
		name    string
		prepare func(t *testing.T, conn *pgx.Conn, schema string)
		want    error
		msg     string
	}{
		{"seed table, never migrated", func(t *testing.T, conn *pgx.Conn, schema string) {
			createSeedTable(t, conn, schema, seedColumns)
		}, relay.ErrNotMigrated, fmt.Sprintf("no schema version recorded (this stagedrain needs %d): run 'stagedrain migrate' first", latest)},
		{"no version recorded", func(t *testing.T, conn *pgx.Conn, schema string) {
			migrateAndRecord(t, conn, schema, `DELETE FROM stagedrain_migrations`)
		}, relay.ErrNotMigrated, "run 'stagedrain migrate' first"},
		{"older version", func(t *testing.T, conn *pgx.Conn, schema string) {
			migrateAndRecord(t, conn, schema, fmt.Sprintf(`DELETE FROM stagedrain_migrations WHERE version = %d`, latest))
		}, relay.ErrNotMigrated, fmt.Sprintf("schema version %d is older than this stagedrain needs (%d): run 'stagedrain migrate' first", latest-1, latest)},
		{"newer version", func(t *testing.T, conn *pgx.Conn, schema string) {
			migrateAndRecord(t, conn, schema, fmt.Sprintf(`INSERT INTO stagedrain_migrations (version, name) VALUES (%d, 'from_a_newer_stagedrain.sql')`, latest+1))
		}, relay.ErrSchemaTooNew, fmt.Sprintf("schema version %d is newer than this stagedrain knows (%d): upgrade stagedrain", latest+1, latest)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := &harness{t: t, schema: testenv.Schema(t)}
			h.rdb, h.ns = testenv.Redis(t)
			tt.prepare(t, testenv.Conn(t, testenv.DatabaseURL()), h.schema)
			r, err := relay.New(h.config())
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err = r.Run(ctx)
			if err == nil || ctx.Err() != nil {
				t.Fatalf("Run = %v (ctx %v), want an error at once", err, ctx.Err())
			}
			if !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("Run = %v, want %v with %q", err, tt.want, tt.msg)
			}
			if n := h.logs.FilterMessage("became leader").Len(); n != 0 {
				t.Errorf("the relay became leader %d times, want never", n)
			}
		})
	}
}

// A standby checks the schema version again when it takes over: a schema
// a newer stagedrain migrated while it waited makes Run return
// ErrSchemaTooNew instead of leading.
func TestStandbyChecksSchemaVersionOnTakeover(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	_, latest := embeddedMigrations(t)
	err := takeOverAfter(t, h, h.config, func() {
		if _, err := h.conn.Exec(context.Background(), `INSERT INTO `+pgx.Identifier{h.schema, "stagedrain_migrations"}.Sanitize()+
			` (version, name) VALUES ($1, 'from_a_newer_stagedrain.sql')`, latest+1); err != nil {
			t.Fatal(err)
		}
	})
	if !errors.Is(err, relay.ErrSchemaTooNew) {
		t.Fatalf("standby Run = %v, want ErrSchemaTooNew at takeover", err)
	}
}

// takeOverAfter runs a leader of h's schema, then a standby of the config
// standby returns, and once the standby stands by runs change and stops
// the leader. It returns the standby's Run error, which it waits 15s for,
// once it checked that the leader released leadership once and that the
// standby never became leader: the checks it failed came before.
func takeOverAfter(t *testing.T, h *harness, standby func() relay.Config, change func()) error {
	t.Helper()
	leader, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	leaderLogs := h.logs
	leaderCtx, stopLeader := context.WithCancel(context.Background())
	defer stopLeader()
	leaderDone := make(chan error, 1)
	go func() { leaderDone <- leader.Run(leaderCtx) }()
	h.waitLog("became leader", 1)

	s, err := relay.New(standby()) // h.logs are now the standby's
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	standbyDone := make(chan error, 1)
	go func() { standbyDone <- s.Run(ctx) }()
	h.waitLog("standby: another relay is draining this schema", 1)

	change()
	stopLeader()
	if err := <-leaderDone; err != nil {
		t.Fatalf("leader Run = %v, want nil after cancel", err)
	}
	if n := leaderLogs.FilterMessage("released leadership").Len(); n != 1 {
		t.Fatalf("the leader released leadership %d times, want once", n)
	}
	err = <-standbyDone
	if ctx.Err() != nil {
		t.Fatalf("standby Run = %v only when its 15s ran out, want a refusal at takeover", err)
	}
	if n := h.logs.FilterMessage("became leader").Len(); n != 0 {
		t.Errorf("the standby became leader %d times, want never", n)
	}
	return err
}

// migrateAndRecord migrates schema, then runs sql on its
// stagedrain_migrations to fake what another stagedrain recorded.
func migrateAndRecord(t *testing.T, conn *pgx.Conn, schema, sql string) {
	t.Helper()
	ctx := context.Background()
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SET search_path TO `+pgx.Identifier{schema}.Sanitize()+`; `+sql, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// PostgreSQL down when the relay starts and again mid-run: the relay logs,
// retries with backoff, and drains once the server is back.
func TestPostgresDownAtStartAndMidRun(t *testing.T) {
	t.Parallel()
	h, pg := privateHarness(t)
	h.conn.Close(context.Background())
	pg.Stop()

	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	h.start(cfg)
	h.waitLog("database session failed, retrying", 2)

	pg.Start()
	h.conn = testenv.Conn(t, pg.URL())
	first := h.stage(relay.Job{Name: "AfterStart"})
	h.waitQueueLen("default", 1, 15*time.Second)
	// Its batch committed: stopping the server between the push and the
	// commit would roll the delete back, and the job would come twice (at
	// least once).
	h.waitStaged(0)

	failures := h.logs.FilterMessage("database session failed, retrying").Len()
	h.conn.Close(context.Background())
	pg.Stop()
	h.waitLog("database session failed, retrying", failures+2)
	pg.Start()
	h.conn = testenv.Conn(t, pg.URL())
	second := h.stage(relay.Job{Name: "AfterRestart"})
	h.waitQueueLen("default", 2, 15*time.Second)
	if jobs := h.queue("default"); jobs[0].jid() != first || jobs[1].jid() != second {
		t.Fatalf("delivered %v, want %s then %s", jobs, first, second)
	}
}

// With no NOTIFY at all (the trigger dropped), the fallback poll still
// delivers.
func TestFallbackPollDeliversWithoutNotify(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	if _, err := h.conn.Exec(context.Background(), "DROP TRIGGER stagedrain_wake ON "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	cfg := h.config()
	cfg.PollInterval = 100 * time.Millisecond
	h.start(cfg)
	h.waitLog("listening", 1)
	// The first job may ride on the drains at start and after LISTEN;
	// once it has arrived, only the poll is left to deliver the second.
	first := h.stage(relay.Job{Name: "Polled"})
	h.waitQueueLen("default", 1, 10*time.Second)
	second := h.stage(relay.Job{Name: "Polled"})
	h.waitQueueLen("default", 2, 10*time.Second)
	if jobs := h.queue("default"); jobs[0].jid() != first || jobs[1].jid() != second {
		t.Fatalf("delivered %s, %s; want %s, %s", jobs[0].jid(), jobs[1].jid(), first, second)
	}
}

// When the leader's lock connection dies (and the lock with it), the relay
// stops draining, takes the lock again and goes on.
func TestLockConnectionLostAndRegained(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.start(h.config())
	h.waitLog("became leader", 1)
	ctx := context.Background()

	var pid int32
	err := h.conn.QueryRow(ctx, `SELECT pid FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 1 AND granted
		  AND (classid::bigint << 32 | objid::bigint) = hashtextextended($1, 0)`,
		"stagedrain:"+h.schema).Scan(&pid)
	if err != nil {
		t.Fatalf("find the leader's lock: %v", err)
	}
	var ok bool
	if err := h.conn.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, ok, err)
	}
	h.waitLog("stepped down", 1)
	h.waitLog("became leader", 2)
	jid := h.stage(relay.Job{Name: "AfterRelock"})
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queue("default")[0].jid(); got != jid {
		t.Fatalf("delivered %s, want %s", got, jid)
	}
}
