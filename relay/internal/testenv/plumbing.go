package testenv

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
)

// The per-test corners of shared servers and WaitFor, for this project's
// tests and, through the public relay/relaytest, for applications' tests.
// They live here, not in relaytest, so that the relay package's own
// internal tests can use them without an import cycle (relaytest imports
// relay).

// SchemaIn returns the name (prefix + random hex) of a schema that no other test uses, in the
// database at databaseURL. It does not create it (relay.Migrate does); the
// schema is dropped with everything in it when the test ends.
func SchemaIn(t testing.TB, databaseURL, prefix string) string {
	t.Helper()
	return SchemaNamedIn(t, databaseURL, Name(prefix))
}

// SchemaNamedIn is SchemaIn with a name of the caller's choosing, which must be
// unique to the test.
func SchemaNamedIn(t testing.TB, databaseURL, schema string) string {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, databaseURL)
		if err != nil {
			t.Errorf("relaytest: drop test schema %s: %v", schema, err)
			return
		}
		defer conn.Close(ctx)
		// A relay the test has just killed may still have a session
		// finishing its transaction, and DROP ... CASCADE, locking the
		// schema's objects one by one, can deadlock with it (seen with two
		// suites at once). PostgreSQL aborts one of the two; the session
		// ends with the relay, so the drop goes again.
		for {
			_, err = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "40P01" && ctx.Err() == nil {
				continue
			}
			break
		}
		if err != nil {
			t.Errorf("relaytest: drop test schema %s: %v", schema, err)
		}
	})
	return schema
}

// ConnTo opens a connection to databaseURL, closed when the test ends.
func ConnTo(t testing.TB, databaseURL string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		t.Fatalf("relaytest: connect to the test database: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// RedisNamespace returns a Redis key namespace that no other test uses (for
// relay.Config.RedisNamespace); the keys under "<namespace>:" are deleted
// through rdb when the test ends, so rdb must stay open until then (close it
// in a t.Cleanup registered before this call, not in a defer).
func RedisNamespace(t testing.TB, rdb redis.UniversalClient, prefix string) string {
	t.Helper()
	ns := Name(prefix)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		iter := rdb.Scan(ctx, 0, ns+":*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		if err := iter.Err(); err != nil {
			t.Errorf("relaytest: list the keys of Redis namespace %s: %v", ns, err)
		}
		for _, k := range keys { // one by one: a cluster refuses a multi-slot DEL
			if err := rdb.Del(ctx, k).Err(); err != nil {
				t.Errorf("relaytest: delete %s: %v", k, err)
				return
			}
		}
	})
	return ns
}

// WaitFor calls cond every 10ms until it returns true, and fails the test
// with what cond last said (its second result) if that takes longer than
// timeout.
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

// RoleIn creates a LOGIN role (prefix + random hex) that no other test uses,
// with no privileges, in the cluster of databaseURL, and returns its name
// and databaseURL (a postgres:// URL) with that role as user. Roles are
// cluster-wide: when the test ends, failed or not, the role's privileges in
// the database are revoked, its sessions ended and the role dropped.
func RoleIn(t testing.TB, databaseURL, prefix string) (role, roleURL string) {
	t.Helper()
	u, err := url.Parse(databaseURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("relaytest: a role's URL needs a postgres:// database URL, got one that is not")
	}
	role = Name(prefix)
	quoted := pgx.Identifier{role}.Sanitize()
	conn := ConnTo(t, databaseURL)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := conn.Exec(ctx, "CREATE ROLE "+quoted+" LOGIN"); err != nil {
		t.Fatalf("relaytest: create role %s: %v", role, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, databaseURL)
		if err != nil {
			t.Errorf("relaytest: drop role %s: %v", role, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role); err != nil {
			t.Errorf("relaytest: end the sessions of role %s: %v", role, err)
		}
		for _, sql := range []string{
			"DROP OWNED BY " + quoted, // its privileges here; it owns nothing
			"DROP ROLE " + quoted,
		} {
			if _, err := conn.Exec(ctx, sql); err != nil {
				t.Errorf("relaytest: drop role %s: %v", role, err)
				return
			}
		}
	})
	u.User = url.User(role)
	return role, u.String()
}

// RunUntilCleanup runs run (a relay's Run) in a goroutine until the test
// ends, then cancels its context and checks that it returned nil within
// 15s.
func RunUntilCleanup(t testing.TB, run func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run returned %v, want nil after cancel", err)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("Run did not return within 15s of cancel")
		}
	})
}

// SessionState is a backend's state in pg_stat_activity and when it last
// changed: a statement changes both.
type SessionState struct {
	State string // "" when the session is gone
	Since string // state_change, to the microsecond
}

func (s SessionState) String() string { return fmt.Sprintf("%s since %s", s.State, s.Since) }

// SessionStateOf reads the state of the backend pid, on conn.
func SessionStateOf(t testing.TB, conn *pgx.Conn, pid uint32) SessionState {
	t.Helper()
	var s SessionState
	err := conn.QueryRow(context.Background(), `SELECT coalesce(state, ''), coalesce(to_char(state_change, 'YYYY-MM-DD HH24:MI:SS.US'), '')
		FROM pg_stat_activity WHERE pid = $1`, int64(pid)).Scan(&s.State, &s.Since)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("read pg_stat_activity: %v", err)
	}
	return s
}

// LockTable locks schema.table ACCESS EXCLUSIVE, as the app's ALTER TABLE
// would, in a transaction on a connection of its own, which the test rolls
// back (when it ends at the latest).
func LockTable(t testing.TB, schema, table string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := Conn(t, DatabaseURL()).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, "LOCK TABLE "+pgx.Identifier{schema, table}.Sanitize()+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	return tx
}
