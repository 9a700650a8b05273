package relaytest

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The test servers, shared and private. These are the ones stagedrain's
// own tests use (relay/internal/testenv holds them, so that the relay
// package's internal tests reach them too); an application's tests may
// use them as they are. The private servers' starters and types are
// stagedrain's own test helpers, not a stable API (see the package doc):
// they change with its tests, in any release.

// DatabaseURL is the shared test database: $TEST_DATABASE_URL, or
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable. A
// $TEST_DATABASE_URL that names no sslmode gets sslmode=disable, as a test
// server on loopback wants: pgx's default, sslmode=prefer, makes every
// connection TLS where the server has it on, and tries each connection
// twice where it has not. Name an sslmode in the URL to keep it.
func DatabaseURL() string { return testenv.DatabaseURL() }

// RedisURL is the shared test Redis: $TEST_REDIS_URL, or
// redis://127.0.0.1:6379/0.
func RedisURL() string { return testenv.RedisURL() }

// Redis returns a client of the shared test Redis (RedisURL), closed when
// the test ends, and a key namespace no other test uses (RedisNamespace).
// The client is set up as stagedrain's command sets up its own: it dials
// once and retries a command once, since the relay retries batches itself.
func Redis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	return testenv.Redis(t)
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listened on a
// moment ago, e.g. for a relay's --metrics-addr.
func FreePort(t testing.TB) int {
	t.Helper()
	return testenv.FreePort(t)
}

// RedisServer is a private redis-server, for a test that stops, freezes or
// restarts Redis, or needs one with options of its own. Its Port and URL
// say where it is; Stop kills it, Start starts it again on the same port
// and directory, Signal sends it a signal (SIGSTOP freezes it).
type RedisServer = testenv.RedisServer

// StartRedis starts a private redis-server (the redis-server program on
// $PATH) on a free loopback port, keeping nothing on disk, and waits until
// it answers PING. It is killed when the test ends. args are added to its
// command line: "--requirepass", "secret" for one that wants a password;
// "--appendonly", "yes" for one that keeps what it acknowledged across a
// Stop and Start.
//
// It is one of stagedrain's own test helpers, not a stable API (see the
// package doc).
func StartRedis(t testing.TB, args ...string) *RedisServer {
	t.Helper()
	return testenv.StartRedis(t, args...)
}

// PostgresServer is a private PostgreSQL cluster, for a test that stops or
// restarts PostgreSQL. Its Port and URL (of its postgres database, as the
// superuser postgres) say where it is; Stop stops it (fast mode: sessions
// are ended), Start starts it again.
type PostgresServer = testenv.PostgresServer

// StartPostgres creates a private cluster with initdb (trust auth, user
// postgres) and starts it on a free loopback port, with fsync off; it is
// stopped and removed when the test ends. The server programs are taken
// from $PG_BIN, else the newest /usr/lib/postgresql/*/bin (Debian's
// layout), else $PATH. A test run as root runs them as the postgres OS
// user, since PostgreSQL refuses root.
//
// It is one of stagedrain's own test helpers, not a stable API (see the
// package doc).
func StartPostgres(t testing.TB, settings ...string) *PostgresServer {
	t.Helper()
	return testenv.StartPostgres(t, settings...)
}

// RedisCluster is a private Redis Cluster of three masters and no
// replicas. Nodes are its servers; URL is its URL as go-redis's
// ParseClusterURL reads it (no password); Client a ClusterClient of it.
type RedisCluster = testenv.RedisCluster

// StartRedisCluster starts three cluster-enabled redis-servers, joins them
// with redis-cli --cluster create, and waits until each reports
// cluster_state:ok. args are added to each node's command line; with
// "--requirepass", p (and "--masterauth", p) the cluster is created and
// awaited with that password.
//
// It is one of stagedrain's own test helpers, not a stable API (see the
// package doc).
func StartRedisCluster(t testing.TB, args ...string) *RedisCluster {
	t.Helper()
	return testenv.StartRedisCluster(t, args...)
}

// RedisSentinel is a private redis-server in sentinel mode watching one
// primary as "mymaster". URL is the sentinel URL go-redis's
// ParseFailoverURL reads.
type RedisSentinel = testenv.RedisSentinel

// StartRedisSentinel starts a sentinel monitoring the primary at
// 127.0.0.1:primaryPort as "mymaster" and waits until it knows the
// primary. conf are more lines of its configuration, e.g.
// "sentinel auth-pass mymaster secret".
//
// It is one of stagedrain's own test helpers, not a stable API (see the
// package doc).
func StartRedisSentinel(t testing.TB, primaryPort int, conf ...string) *RedisSentinel {
	t.Helper()
	return testenv.StartRedisSentinel(t, primaryPort, conf...)
}

// Sidekiq is a running real Sidekiq (Debian's ruby-sidekiq); String is
// its output so far.
type Sidekiq = testenv.Sidekiq

// StartSidekiq starts `sidekiq --require file --queue default
// --concurrency 1` reading redisURL, killed (with its process group) when
// the test ends.
//
// It is one of stagedrain's own test helpers, not a stable API (see the
// package doc).
func StartSidekiq(t testing.TB, file, redisURL string) *Sidekiq {
	t.Helper()
	return testenv.StartSidekiq(t, file, redisURL)
}

// SessionState is a backend's state in pg_stat_activity and when it last
// changed (testenv.SessionState).
type SessionState = testenv.SessionState

// SessionStateOf reads the state of the backend pid, on conn: a test that
// must know whether a session ran a statement between two reads compares
// them. A session that is gone reads as State "".
func SessionStateOf(t testing.TB, conn *pgx.Conn, pid uint32) SessionState {
	t.Helper()
	return testenv.SessionStateOf(t, conn, pid)
}
