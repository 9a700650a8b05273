// Package testenv holds the relay tests' conventions: which shared
// PostgreSQL and Redis they use, how their Redis clients are set up, and
// private server instances for tests that stop or kill a server
// (servers.go), and the per-test corners of shared servers (plumbing.go),
// which the public relay/relaytest passes on to applications' tests and to
// cmd/stagedrain's.
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	mathrand "math/rand/v2"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// DatabaseURL is the shared test database: $TEST_DATABASE_URL, or the
// PostgreSQL on 127.0.0.1:5432 that every development and CI machine has.
// A URL that names no sslmode gets sslmode=disable (see PlainText).
func DatabaseURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return PlainText(u)
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// PlainText returns databaseURL with sslmode=disable added when it names no
// sslmode. Without one, pgx (as libpq) defaults to sslmode=prefer: where the
// server has TLS on (as Debian's PostgreSQL has, with its snakeoil
// certificate) every connection is TLS, and where a server refuses TLS
// every connection is tried twice, which tests that read the socket or
// count connections cannot tell apart from what they check. A URL that
// names an sslmode, and a keyword/value string's sslmode, are kept.
func PlainText(databaseURL string) string {
	if strings.HasPrefix(databaseURL, "postgres://") || strings.HasPrefix(databaseURL, "postgresql://") {
		u, err := url.Parse(databaseURL)
		if err != nil || u.Query().Has("sslmode") {
			return databaseURL
		}
		q := u.Query()
		q.Set("sslmode", "disable")
		u.RawQuery = q.Encode()
		return u.String()
	}
	if strings.Contains(databaseURL, "sslmode=") || strings.TrimSpace(databaseURL) == "" {
		return databaseURL
	}
	return databaseURL + " sslmode=disable"
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
	return ConnTo(t, url)
}

// Schema returns the name of a schema of the shared database that no other
// test uses (it does not create it), dropped with everything in it when the
// test ends.
func Schema(t testing.TB) string {
	t.Helper()
	return SchemaNamedIn(t, DatabaseURL(), Name("sdtest_"))
}

// SchemaNamed is Schema with a name of the caller's choosing, which must be
// unique to the test.
func SchemaNamed(t testing.TB, schema string) string {
	t.Helper()
	return SchemaNamedIn(t, DatabaseURL(), schema)
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
	t.Cleanup(func() { _ = rdb.Close() }) // runs after the namespace's cleanup
	return rdb, RedisNamespace(t, rdb, "sdtest_")
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on, for a
// private server or a relay's listener. It is picked at random below the
// kernel's ephemeral range (ip_local_port_range), not from it: in that
// range any client socket, or one in TIME_WAIT, may hold the port by the
// time the server binds it, and the tests open and close thousands of
// connections (a private PostgreSQL standby once failed to start with its
// port taken). A pick at random also keeps two test binaries running at
// once from meeting on one port, but for the rare case.
func FreePort(t testing.TB) int {
	t.Helper()
	const lowest = 10000
	if high := ephemeralLow(); high-lowest >= 1000 {
		for range 100 {
			p := lowest + mathrand.IntN(high-lowest)
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
			if err == nil {
				_ = l.Close()
				return p
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// ephemeralLow is the first port of the kernel's ephemeral range, from
// which it gives client sockets their local port: Linux's
// /proc/sys/net/ipv4/ip_local_port_range, else 32768 (its default).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if lo, err := strconv.Atoi(f[0]); err == nil {
				return lo
			}
		}
	}
	return 32768
}

// RedisOptions sets opts up as stagedrain's command does: the relay retries
// failed batches itself, so the client dials once and retries once.
func RedisOptions(opts *redis.Options) *redis.Options {
	opts.DisableIdentity = true
	opts.DialerRetries = 1
	opts.MaxRetries = 1
	return opts
}
