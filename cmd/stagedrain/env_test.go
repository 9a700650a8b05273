package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// Each test gets a fresh schema of the shared PostgreSQL and a key
// namespace of the shared Redis, and waits on conditions with a deadline
// instead of sleeping; private servers are started for the tests that stop
// them: relay/relaytest provides all of these (as it does to applications).
// What is left here is this package's own: checks of what the commands did.

// testDatabaseURL, testRedisURL and testRedis are relaytest's
// DatabaseURL, RedisURL and Redis under the names that cli_test.go,
// dead_test.go, retry_test.go and status_test.go still call; delete them
// once those call relaytest's.

// testConn opens a connection to the shared test database, closed when the
// test ends.
func testConn(t testing.TB) *pgx.Conn {
	t.Helper()
	return relaytest.Conn(t, relaytest.DatabaseURL())
}

// testSchema returns the name of a schema no other test uses (it does not
// create it), dropped with everything in it when the test ends.
func testSchema(t testing.TB) string {
	t.Helper()
	return relaytest.Schema(t, relaytest.DatabaseURL())
}

// tableExists reports whether schema.table exists.
func tableExists(t testing.TB, conn *pgx.Conn, schema, table string) bool {
	t.Helper()
	var exists bool
	err := conn.QueryRow(context.Background(), `SELECT to_regclass($1) IS NOT NULL`,
		pgx.Identifier{schema, table}.Sanitize()).Scan(&exists)
	if err != nil {
		t.Fatalf("look up %s.%s: %v", schema, table, err)
	}
	return exists
}

// schemaExists reports whether schema exists.
func schemaExists(t testing.TB, conn *pgx.Conn, schema string) bool {
	t.Helper()
	var exists bool
	err := conn.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists)
	if err != nil {
		t.Fatalf("look up schema %s: %v", schema, err)
	}
	return exists
}

// stagedCount counts the rows left in schema.staged_jobs.
func stagedCount(t testing.TB, conn *pgx.Conn, schema string) int {
	t.Helper()
	var n int
	err := conn.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{schema, "staged_jobs"}.Sanitize()).Scan(&n)
	if err != nil {
		t.Fatalf("count staged_jobs: %v", err)
	}
	return n
}

// lines splits output into its lines, without the final newline.
func lines(s string) []string {
	s = strings.TrimSuffix(s, "\n")
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

// noDatabaseURL is a URL of the shared server naming a database that does
// not exist: a command that gets past its checks by mistake fails at once
// (exit 1) instead of retrying forever.
func noDatabaseURL(t testing.TB) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(relaytest.DatabaseURL())
	if err != nil {
		t.Fatalf("parse test database URL: %v", err)
	}
	return fmt.Sprintf("postgres://%s@%s:%d/stagedrain_no_such_database?sslmode=disable", cfg.User, cfg.Host, cfg.Port)
}
