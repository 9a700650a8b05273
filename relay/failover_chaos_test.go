package relay_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A failover under load, counted as the app sees it afterwards: an app
// commits jobs, each with a row of its own data, while two relays drain;
// the standby stops receiving (a lagging or partitioned replica) while the
// app goes on; the primary crashes and the standby is promoted. Against the
// data that survived on the new primary: lost (its data is there, its job
// never ran), duplicated (a jid pushed twice) and ghost (a job pushed whose
// data is gone). Synchronous replication, and asynchronous with
// WaitForStandby: 0 / 0 / 0. Asynchronous without it: 0 lost, 0
// duplicated; the ghosts are counted (the jobs of the commits the failover
// took back).
func TestFailoverChaos(t *testing.T) {
	for _, tc := range []struct {
		name          string
		sync, wait    bool
		ghostsAllowed bool
	}{
		{name: "synchronous", sync: true},
		{name: "asynchronous", ghostsAllowed: true},
		{name: "asynchronous wait-for-standby", wait: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			failoverChaos(t, tc.sync, tc.wait, tc.ghostsAllowed)
		})
	}
}

func failoverChaos(t *testing.T, syncRepl, wait, ghostsAllowed bool) {
	f := newFailover(t)
	h := f.h
	ctx := context.Background()
	if _, err := h.conn.Exec(ctx, `CREATE TABLE jobs.app_data (jid text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	if syncRepl {
		for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = '*'`, `SELECT pg_reload_conf()`} {
			if _, err := h.conn.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		testenv.WaitFor(t, 15*time.Second, "a synchronous standby", func() (bool, string) {
			var n int
			err := h.conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'`).Scan(&n)
			return err == nil && n == 1, fmt.Sprintf("%d, %v", n, err)
		})
	}
	for range 2 {
		cfg := h.config()
		cfg.DatabaseURL = f.multiHostURL
		cfg.WaitForStandby = wait
		h.start(cfg)
	}

	// The app: transactions of 5 jobs and their 5 data rows, until it
	// fails (the primary crashed) or is stopped.
	app := testenv.Conn(t, f.primary.URL())
	appPID := app.PgConn().PID()
	var mu sync.Mutex
	acked := 0
	stop := make(chan struct{})
	appDone := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				appDone <- nil
				return
			default:
			}
			err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
				for range 5 {
					jid, err := h.stager.Stage(ctx, tx, relay.Job{Name: "Chaos"})
					if err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO jobs.app_data (jid) VALUES ($1)`, jid); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				appDone <- err
				return
			}
			mu.Lock()
			acked += 5
			mu.Unlock()
		}
	}()
	ackedNow := func() int { mu.Lock(); defer mu.Unlock(); return acked }
	testenv.WaitFor(t, 30*time.Second, "500 jobs pushed", func() (bool, string) {
		n, err := h.rdb.LLen(ctx, h.key("queue:default")).Result()
		return err == nil && n >= 500, fmt.Sprintf("%d jobs, %d acknowledged, %v", n, ackedNow(), err)
	})

	// The standby lags from here on; the app goes on.
	f.standby.SetReceiving(f.primary, false)
	before := ackedNow()
	testenv.WaitFor(t, 30*time.Second, "the app to commit past the standby", func() (bool, string) {
		if syncRepl {
			// Its commits wait for the standby now.
			var ev string
			err := h.conn.QueryRow(ctx, `SELECT coalesce(wait_event, '') FROM pg_stat_activity WHERE pid = $1`, appPID).Scan(&ev)
			return err == nil && ev == "SyncRep", fmt.Sprintf("wait_event %q, %v", ev, err)
		}
		return ackedNow() >= before+500, fmt.Sprintf("%d acknowledged since", ackedNow()-before)
	})
	h.conn.Close(ctx)
	f.primary.Crash()
	close(stop)
	if err := <-appDone; err == nil && syncRepl {
		t.Fatal("the app's commit waiting for the standby returned without error after the crash")
	}
	ackedAll := ackedNow()
	f.standby.Promote()

	h.conn = testenv.Conn(t, f.standby.URL())
	if wait {
		// WaitForStandby pushes only what a standby has: the new primary
		// needs one of its own (as Patroni rejoins the old primary, or a
		// new replica is made).
		f.standby.StartStandby(t, "")
	}
	testenv.WaitFor(t, 30*time.Second, "the relays to drain the new primary", func() (bool, string) {
		n := h.staged()
		var repl string
		_ = h.conn.QueryRow(ctx, `SELECT coalesce(string_agg(format('%s %s flush %s sync %s', application_name, state, flush_lsn, sync_state), '; '), 'none') FROM pg_stat_replication`).Scan(&repl)
		return n == 0, fmt.Sprintf("%d staged; standbys: %s; logs %v", n, repl, messages(h.logs))
	})

	rows, err := h.conn.Query(ctx, `SELECT jid FROM jobs.app_data`)
	if err != nil {
		t.Fatal(err)
	}
	data, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	survived := make(map[string]bool, len(data))
	for _, jid := range data {
		survived[jid] = true
	}
	pushed := make(map[string]int)
	for _, jid := range h.queueJIDs("default") {
		pushed[jid]++
	}
	lost, dup, ghost := 0, 0, 0
	for jid := range survived {
		if pushed[jid] == 0 {
			lost++
		}
	}
	for jid, n := range pushed {
		if n > 1 {
			dup += n - 1
		}
		if !survived[jid] {
			ghost++
		}
	}
	t.Logf("app acknowledged %d jobs, %d survived on the new primary (%d acknowledged commits taken back by the failover); pushed %d distinct; lost %d, duplicated %d, ghost %d",
		ackedAll, len(survived), max(0, ackedAll-len(survived)), len(pushed), lost, dup, ghost)
	if lost != 0 || dup != 0 || (ghost != 0 && !ghostsAllowed) {
		t.Errorf("lost %d, duplicated %d, ghost %d; want 0 / 0 / %s", lost, dup, ghost, map[bool]string{true: "any", false: "0"}[ghostsAllowed])
	}
}
