// Package relaytest helps an application test what it stages with
// stagedrain, in the manner of River's rivertest:
//
//   - RequireStaged, RequireStagedMany and RequireNotStaged check the rows of
//     staged_jobs as a transaction sees them, so a test can assert what the
//     code under test staged before (or without) committing;
//   - Drain runs the real relay on a schema until staged_jobs is empty, so a
//     test can then read the jobs from Redis as its workers would;
//   - Schema, Conn, RedisNamespace and WaitFor give each test its own schema
//     and Redis key namespace on shared servers, so tests run in parallel,
//     and wait on a condition with a deadline instead of sleeping; Role, a
//     database role of its own, to run the relay with only what it needs;
//   - DatabaseURL, RedisURL and Redis name the shared test servers, and
//     StartRedis and StartPostgres start private ones, for a test that
//     stops, freezes or restarts a server.
//
// Failures are reported through the testing.TB given, with what was
// expected and what was seen.
//
// # The server starters are not a stable API
//
// StartRedis, StartPostgres, StartRedisCluster, StartRedisSentinel and
// StartSidekiq, and the types they return (RedisServer, PostgresServer,
// RedisCluster, RedisSentinel, Sidekiq), are stagedrain's own test
// helpers, exported so that its command's tests reach them, as River's
// riverdbtest is River's. They are not a stable API: they change with
// stagedrain's tests, in any release, and a change to them is not a
// breaking change for the purpose of stagedrain's versioning. An
// application may use them, at that price; the rest of the package
// (RequireStaged, Drain, Schema, Redis, ...) is the API it can rely on.
package relaytest

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Schema returns the name of a schema that no other test uses, in the
// database at databaseURL. It does not create it (relay.Migrate does); the
// schema is dropped with everything in it when the test ends.
func Schema(t testing.TB, databaseURL string) string {
	t.Helper()
	return testenv.SchemaIn(t, databaseURL, "relaytest_")
}

// SchemaNamed is Schema with a name of the caller's choosing, which must be
// unique to the test.
func SchemaNamed(t testing.TB, databaseURL, schema string) string {
	t.Helper()
	return testenv.SchemaNamedIn(t, databaseURL, schema)
}

// Role creates a LOGIN role that no other test uses, with no privileges,
// in the cluster of databaseURL (a postgres:// URL), and returns its name,
// to GRANT it what the test needs, and databaseURL with that role as user
// (the server must let it in without a password: trust auth, as test
// servers have). When the test ends, failed or not, its sessions are
// ended, its privileges revoked and the role dropped.
func Role(t testing.TB, databaseURL string) (role, roleURL string) {
	t.Helper()
	return testenv.RoleIn(t, databaseURL, "relaytest_role_")
}

// Conn opens a connection to databaseURL, closed when the test ends.
func Conn(t testing.TB, databaseURL string) *pgx.Conn {
	t.Helper()
	return testenv.ConnTo(t, databaseURL)
}

// RedisNamespace returns a Redis key namespace that no other test uses (for
// relay.Config.RedisNamespace); the keys under "<namespace>:" are deleted
// through rdb when the test ends, so rdb must stay open until then (close it
// in a t.Cleanup registered before this call, not in a defer).
func RedisNamespace(t testing.TB, rdb redis.UniversalClient) string {
	t.Helper()
	return testenv.RedisNamespace(t, rdb, "relaytest_")
}

// WaitFor calls cond every 10ms until it returns true, and fails the test
// with what cond last said (its second result) if that takes longer than
// timeout.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	testenv.WaitFor(t, timeout, what, cond)
}
