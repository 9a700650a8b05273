// Package testenv gives each test its own corner of the shared PostgreSQL
// and Redis servers (a fresh schema, a Redis key namespace), starts private
// server instances for tests that stop or kill a server, and waits on
// conditions with a deadline instead of sleeping.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// DatabaseURL is the shared test database: $TEST_DATABASE_URL, or the
// PostgreSQL on 127.0.0.1:5432 that every development and CI machine has.
func DatabaseURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// RedisURL is the shared test Redis: $TEST_REDIS_URL or 127.0.0.1:6379 DB 0.
func RedisURL() string {
	if u := os.Getenv("TEST_REDIS_URL"); u != "" {
		return u
	}
	return "redis://127.0.0.1:6379/0"
}

// Name returns a fresh name, prefix + 12 random hex characters, lower case.
func Name(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// Conn opens a connection to url, closed when the test ends.
func Conn(t testing.TB, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect to test database: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// Schema returns the name of a schema that no other test uses (it does not
// create it), dropped with everything in it when the test ends.
func Schema(t testing.TB) string {
	t.Helper()
	return SchemaNamed(t, Name("sdtest_"))
}

// SchemaNamed is Schema with a name of the caller's choosing, which must be
// unique to the test.
func SchemaNamed(t testing.TB, schema string) string {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, DatabaseURL())
		if err != nil {
			t.Errorf("drop test schema: %v", err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop test schema: %v", err)
		}
	})
	return schema
}

// Redis returns a client of the shared test Redis and a namespace no other
// test uses; keys under "<namespace>:" are deleted when the test ends.
func Redis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	opts, err := redis.ParseURL(RedisURL())
	if err != nil {
		t.Fatalf("parse test redis URL: %v", err)
	}
	rdb := redis.NewClient(RedisOptions(opts))
	ns := Name("sdtest_")
	t.Cleanup(func() {
		ctx := context.Background()
		iter := rdb.Scan(ctx, 0, ns+":*", 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
		_ = rdb.Close()
	})
	return rdb, ns
}

// WaitFor polls cond every 10ms until it returns true, and fails the test
// with what cond last said if that takes longer than timeout.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, seen := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %s for %s; last seen: %s", timeout, what, seen)
		}
		time.Sleep(10 * time.Millisecond) // polling a condition, not waiting for readiness
	}
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listened on a
// moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// RedisOptions sets opts up as stagedrain's command does: the relay retries
// failed batches itself, so the client dials once and retries once.
func RedisOptions(opts *redis.Options) *redis.Options {
	opts.DisableIdentity = true
	opts.DialerRetries = 1
	opts.MaxRetries = 1
	return opts
}
