package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// The bench as a whole (its flags, its table, what it leaves behind) is
// tested through the binary, in cmd/stagedrain's bench_test.go; here, the
// figures' own arithmetic and what PostgreSQL counts.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The idle figures count what PostgreSQL counts: the empty statements of a
// session that touches no table (as the relay's lock session pings), which
// PostgreSQL 15 adds to pg_stat_database only when the session ends, the
// transaction ids of its pg_notify calls and their WAL. waitSessionsGone
// waits for the sessions named by the suffix only, not for others of the
// database.
func TestBenchIdleCountsWhatPostgreSQLCounts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := relaytest.Conn(t, relaytest.DatabaseURL())
	db := "stagedrain_benchidle_" + randomHex(6)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{db}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", db, err)
		}
	})
	dbURL, err := withDatabase(relaytest.DatabaseURL(), db)
	if err != nil {
		t.Fatal(err)
	}
	session := func(name string) *pgx.Conn {
		cfg, err := pgx.ParseConfig(dbURL)
		if err != nil {
			t.Fatal(err)
		}
		cfg.RuntimeParams["application_name"] = name
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close(ctx) })
		return conn
	}
	// Connected before the first reading, and still connected at the
	// last: waiting for it would time out.
	bystander := session("bystander")

	r0, err := readIdle(ctx, admin, db)
	if err != nil {
		t.Fatal(err)
	}
	pid := fmt.Sprint(r0.xid) // any suffix no other session has
	pinger := session("stagedrain test :" + pid)
	const pings, notifies = 40, 3
	for range pings {
		if err := pinger.Ping(ctx); err != nil { // an empty statement
			t.Fatal(err)
		}
	}
	for range notifies {
		if _, err := pinger.Exec(ctx, "SELECT pg_notify('stagedrain_benchidle', 'x')"); err != nil {
			t.Fatal(err)
		}
	}
	// While the session is connected its counts may be held back: the
	// wait does not end.
	if err := waitSessionsGone(ctx, admin, db, ":"+pid, 300*time.Millisecond); err == nil {
		t.Errorf("waitSessionsGone returned nil while the session it waits for was connected")
	}
	if err := pinger.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := waitSessionsGone(ctx, admin, db, ":"+pid, sessionsGoneTimeout); err != nil {
		t.Fatal(err)
	}
	r1, err := readIdle(ctx, admin, db)
	if err != nil {
		t.Fatal(err)
	}
	d := r1.sub(r0)
	// An autovacuum worker visiting the new database may add its own.
	if d.xacts < pings+notifies {
		t.Errorf("pg_stat_database counted %d transactions of database %s, want at least %d (%d empty statements, %d pg_notify)", d.xacts, db, pings+notifies, pings, notifies)
	}
	if d.xid < notifies {
		t.Errorf("transaction ids used: %d, want at least %d (one per pg_notify)", d.xid, notifies)
	}
	if d.wal <= 0 {
		t.Errorf("WAL written: %d bytes, want > 0 (the commit records of the pg_notify calls)", d.wal)
	}
	if err := bystander.Ping(ctx); err != nil {
		t.Errorf("the bystander session: %v", err)
	}
}

// The idle statements a second are the difference of two runs, never
// negative: when the shorter run counted more (its start-up or shutdown
// varied), the figure is 0 and says it was clamped.
func TestIdleStatementsNeverNegative(t *testing.T) {
	t.Parallel()
	run := func(xacts int64, ran time.Duration) idleRun {
		return idleRun{whole: idleReading{xacts: xacts}, ran: ran}
	}
	for _, tt := range []struct {
		short, long idleRun
		want        float64
		clamped     bool
	}{
		{run(40, 2*time.Second), run(100, 12*time.Second), 6, false},
		{run(120, 2*time.Second), run(100, 12*time.Second), 0, true},
	} {
		got, span, clamped, err := idleStatements(tt.short, tt.long)
		if err != nil || got != tt.want || clamped != tt.clamped || span != 10*time.Second {
			t.Errorf("idleStatements(%d in %s, %d in %s) = %v/s over %s, clamped %v, %v; want %v/s over 10s, clamped %v",
				tt.short.whole.xacts, tt.short.ran, tt.long.whole.xacts, tt.long.ran, got, span, clamped, err, tt.want, tt.clamped)
		}
	}
	if _, _, _, err := idleStatements(run(1, 5*time.Second), run(2, 5*time.Second)); err == nil {
		t.Error("idleStatements of two runs of the same length: nil error, want one")
	}
}
