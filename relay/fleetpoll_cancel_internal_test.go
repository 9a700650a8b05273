package relay

import (
	"context"
	"testing"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A fleet poll that runs past its timeout is cancelled by PostgreSQL, not
// by cutting its socket: its session, and the poll prepared on it, stay
// for the next poll (drainWatcher). A session lost at each timeout meant
// planning the union over every schema again on a new one, which beside
// a busy app timed out again (issue 23). Here the poll waits on a lock
// the test holds on one tenant's table.
func TestFleetPollTimeoutKeepsItsSession(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, led, _ := pollTenants(t, "fpcancel", []string{"a", "b"})
	s, pool := pollSession(t, r) // the relay's drain configuration, with its drainWatcher
	session := func() (pid uint32, prepared int) {
		t.Helper()
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		err = c.QueryRow(ctx, `SELECT pg_backend_pid(), (SELECT count(*) FROM pg_prepared_statements WHERE statement = $1)`, s.hotPollSQL[0]).
			Scan(&pid, &prepared)
		if err != nil {
			t.Fatal(err)
		}
		return pid, prepared
	}

	if _, err := s.poll(ctx, led, true); err != nil {
		t.Fatal(err)
	}
	pid, prepared := session()
	if prepared != 1 {
		t.Fatalf("the hot poll is prepared %d times on the pool's session, want once", prepared)
	}

	tx := testenv.LockTable(t, led[0].schema, "staged_jobs")
	if _, err := s.poll(ctx, led, true); err == nil {
		t.Fatal("the poll ended without error while a table it reads was locked: want its timeout")
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	if _, err := s.poll(ctx, led, true); err != nil {
		t.Fatalf("the poll after the timeout: %v", err)
	}
	after, prepared := session()
	if after != pid {
		t.Fatalf("the poll's session changed at its timeout (backend %d, then %d): the socket was cut, not the statement cancelled", pid, after)
	}
	if prepared != 1 {
		t.Fatalf("the hot poll is prepared %d times on the pool's session after the timeout, want once", prepared)
	}
}
