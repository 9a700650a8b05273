package relay_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Status follows the relay from starting to leader to stopped, with the
// time of its last drain; CheckReady is nil while it leads with PostgreSQL
// answering, and an ErrNotReady while PostgreSQL is down, before Run and
// after it.
func TestStatusAndReadiness(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	h := &harness{t: t, schema: "jobs"}
	h.rdb, h.ns = testenv.Redis(t)
	conn := testenv.Conn(t, pg.URL())
	if _, err := relay.Migrate(context.Background(), conn, h.schema); err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())

	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.LeaderInterval = 50 * time.Millisecond
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if st := r.Status(); st.Role != relay.RoleStarting || st.Since.IsZero() {
		t.Errorf("Status before Run = %+v, want role starting with a since", st)
	}
	if err := r.CheckReady(ctx); !errors.Is(err, relay.ErrNotReady) {
		t.Errorf("CheckReady before Run = %v, want ErrNotReady", err)
	}

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	defer cancel()

	waitReady := func(want bool) {
		t.Helper()
		testenv.WaitFor(t, 20*time.Second, fmt.Sprintf("CheckReady ready=%v", want), func() (bool, string) {
			err := r.CheckReady(ctx)
			st := r.Status()
			if want {
				return err == nil && st.Role == relay.RoleLeader, fmt.Sprintf("%v, %+v", err, st)
			}
			return errors.Is(err, relay.ErrNotReady), fmt.Sprintf("%v, %+v", err, st)
		})
	}
	waitReady(true)
	testenv.WaitFor(t, 10*time.Second, "a successful drain", func() (bool, string) {
		st := r.Status()
		return !st.LastDrain.IsZero(), fmt.Sprintf("%+v", st)
	})

	pg.Stop()
	waitReady(false)
	if st := r.Status(); st.LastError == "" {
		t.Errorf("Status with PostgreSQL down = %+v, want a last error", st)
	}
	pg.Start()
	waitReady(true)

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run returned %v, want nil", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return within 15s of cancel")
	}
	if st := r.Status(); st.Role != relay.RoleStopped {
		t.Errorf("Status after Run = %+v, want role stopped", st)
	}
	if err := r.CheckReady(ctx); !errors.Is(err, relay.ErrNotReady) {
		t.Errorf("CheckReady after Run = %v, want ErrNotReady", err)
	}
}
