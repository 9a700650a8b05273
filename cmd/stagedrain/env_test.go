package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// Each test gets a fresh schema of the shared PostgreSQL and a key
// namespace of the shared Redis, and waits on conditions with a deadline
// instead of sleeping: relay/relaytest provides these (as it does to
// applications). What is left here is this package's own: the shared
// servers' addresses (as relay/internal/testenv has them, which Go's
// internal rule keeps out of reach) and checks of what the commands did.

// testDatabaseURL is the shared test database: $TEST_DATABASE_URL, or the
// PostgreSQL on 127.0.0.1:5432.
func testDatabaseURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// testRedisURL is the shared test Redis: $TEST_REDIS_URL or 127.0.0.1:6379 DB 0.
func testRedisURL() string {
	if u := os.Getenv("TEST_REDIS_URL"); u != "" {
		return u
	}
	return "redis://127.0.0.1:6379/0"
}

// testConn opens a connection to the shared test database, closed when the
// test ends.
func testConn(t testing.TB) *pgx.Conn {
	t.Helper()
	return relaytest.Conn(t, testDatabaseURL())
}

// testSchema returns the name of a schema no other test uses (it does not
// create it), dropped with everything in it when the test ends.
func testSchema(t testing.TB) string {
	t.Helper()
	return relaytest.Schema(t, testDatabaseURL())
}

// testRedis returns a client of the shared test Redis and a namespace no
// other test uses; keys under "<namespace>:" are deleted when the test ends.
func testRedis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	opts, err := redis.ParseURL(testRedisURL())
	if err != nil {
		t.Fatalf("parse test redis URL: %v", err)
	}
	opts.DisableIdentity = true
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() }) // runs after the namespace's cleanup
	return rdb, relaytest.RedisNamespace(t, rdb)
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
	cfg, err := pgx.ParseConfig(testDatabaseURL())
	if err != nil {
		t.Fatalf("parse test database URL: %v", err)
	}
	return fmt.Sprintf("postgres://%s@%s:%d/stagedrain_no_such_database?sslmode=disable", cfg.User, cfg.Host, cfg.Port)
}

// startRedisServer starts a private redis-server (as testenv.StartRedis
// does) on a free loopback port with extra args, waits until it answers,
// and kills it when the test ends. It returns the port.
func startRedisServer(t testing.TB, args ...string) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmd := exec.Command("redis-server", append([]string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", t.TempDir(),
		"--daemonize", "no", "--loglevel", "warning"}, args...)...)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), DisableIdentity: true, MaxRetries: -1})
	defer rdb.Close()
	relaytest.WaitFor(t, 10*time.Second, "redis-server to answer PING", func() (bool, string) {
		err := rdb.Ping(context.Background()).Err()
		var answer redis.Error // NOAUTH: it answers, to a client with no password
		return err == nil || errors.As(err, &answer), fmt.Sprint(err)
	})
	return port
}
