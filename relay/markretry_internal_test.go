package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A leadership's low-water mark check runs on a drain pool session that
// PostgreSQL may have ended since its last use (a restart): the check is
// tried again on another session, and the leadership gets its mark
// (markFor). Before, the leadership went on without one, every claim
// starting at the id index's start. With no server at all, the check's
// error is returned, to end the leadership and retry it, not to lead
// without the mark.
func TestMarkCheckOutlivesEndedSessions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, conn, _, pcfg := markRelay(t, "markretry")
	pcfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	// Both of the pool's sessions, used just now, then ended by the server.
	var pids []uint32
	var held []*pgxpool.Conn
	for range 2 {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var pid uint32
		if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		pids, held = append(pids, pid), append(held, c)
	}
	for _, c := range held {
		c.Release()
	}
	if _, err := conn.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", pids); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the pool's sessions ended", func() (bool, string) {
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])", pids).Scan(&n); err != nil {
			return false, err.Error()
		}
		return n == 0, fmt.Sprintf("%d of %v still there", n, pids)
	})

	mark, err := r.markFor(ctx, pool)
	if err != nil || mark == nil {
		t.Fatalf("markFor on a pool of ended sessions = %v, %v; want a mark, checked on a new session", mark, err)
	}

	down := pcfg.Copy()
	down.ConnConfig.Host, down.ConnConfig.Port = "127.0.0.1", 1 // nothing listens
	down.ConnConfig.Fallbacks = nil
	downPool, err := pgxpool.NewWithConfig(ctx, down)
	if err != nil {
		t.Fatal(err)
	}
	defer downPool.Close()
	if mark, err := r.markFor(ctx, downPool); err == nil {
		t.Fatalf("markFor with no server = %v, nil; want the error, so that the leadership is retried rather than led without a mark", mark)
	}
}

// markRelay returns a relay of a migrated schema of its own (prefix), a
// connection to its database, the schema, and the relay's own drain pool
// configuration (no ping for a session used within two polls), for tests
// of its low-water mark check.
func markRelay(t *testing.T, prefix string) (*Relay, *pgx.Conn, string, *pgxpool.Config) {
	t.Helper()
	url := testenv.DatabaseURL()
	schema := testenv.SchemaIn(t, url, prefix)
	conn := testenv.Conn(t, url)
	if _, err := Migrate(context.Background(), conn, schema); err != nil {
		t.Fatal(err)
	}
	rdb, ns := testenv.Redis(t)
	r, err := New(Config{DatabaseURL: url, Redis: rdb, RedisNamespace: ns, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	pcfg, err := r.drainPoolConfig()
	if err != nil {
		t.Fatal(err)
	}
	return r, conn, schema, pcfg
}
