package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A batch whose relay stops between claim and commit (frozen, or cut off)
// is rolled back by PostgreSQL after the drain sessions'
// idle_in_transaction_session_timeout: its rows can be claimed again while
// the relay still holds the batch. Here the relay's own push is held until
// another session can lock every row it claimed; its commit then fails, and
// the rows, claimed again, are deleted and not pushed again (the handoff
// record says they were delivered): each job once, nothing lost.
func TestFrozenBatchIsRolledBack(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	relay.SetDrainIdleInTx(r, 300*time.Millisecond)
	jids := h.stageMany(relay.Job{Name: "A"}, relay.Job{Name: "B"}, relay.Job{Name: "C"})
	claimable := fmt.Sprintf("SELECT count(*) FROM (SELECT id FROM %s FOR UPDATE SKIP LOCKED) s",
		pgx.Identifier{h.schema, "staged_jobs"}.Sanitize())
	var pushes atomic.Int32
	holding, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before the relay's own cleanup, which waits for Run
	relay.SetAfterPush(r, func(context.Context) error {
		if pushes.Add(1) == 1 {
			close(holding)
			<-release
		}
		return nil
	})
	h.run(r)

	select {
	case <-holding:
	case <-time.After(15 * time.Second):
		t.Fatalf("the batch was not pushed within 15s; logs: %v", messages(h.logs))
	}
	// The claim deleted the rows in a transaction of its own; until
	// PostgreSQL ends it, another session skips them as locked.
	testenv.WaitFor(t, 10*time.Second, "the held batch's rows to be claimable by another session", func() (bool, string) {
		var n int
		err := pgx.BeginFunc(context.Background(), h.conn, func(tx pgx.Tx) error {
			return tx.QueryRow(context.Background(), claimable).Scan(&n)
		})
		return err == nil && n == len(jids), fmt.Sprintf("%d of %d rows claimable (%v)", n, len(jids), err)
	})
	unblock()

	h.waitLog("batch failed, retrying", 1)
	h.waitStaged(0)
	h.waitRecordEmpty()
	if got := h.queueJIDs("default"); !slices.Equal(got, jids) {
		t.Fatalf("delivered %v, want %v: the held batch once", got, jids)
	}
	failed := h.logs.FilterMessage("batch failed, retrying").All()[0]
	if msg := fmt.Sprint(failed.ContextMap()["error"]); !strings.Contains(msg, "25P03") {
		t.Errorf("the held batch failed with %q, want PostgreSQL's idle-in-transaction timeout (SQLSTATE 25P03)", msg)
	}
}

// A listener whose backend stops delivering (frozen while its server
// still answers TCP, so keepalives see nothing) is noticed, logged at warn
// and replaced, and a job staged meanwhile is delivered by the drain after
// the reconnect, with the poll a minute away. The bound: the heartbeat
// period (1s here, 30s by default) without a notification, the heartbeat's
// send and its arrival bound (the lock connection's query timeout, 2s), and
// slack for a loaded machine: 10s here, about 32s by default; the new
// LISTEN follows after the reconnect backoff (100ms).
func TestSilentListenerIsReplaced(t *testing.T) {
	t.Parallel()
	h, pg := privateHarness(t)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.PollInterval = time.Minute
	const heartbeat = time.Second
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetListenerHeartbeat(r, heartbeat)
	idle := idleEvents(r)
	h.run(r)
	h.waitIdleAfterListen(idle)

	var pid int
	err = h.conn.QueryRow(context.Background(), `SELECT pid FROM pg_stat_activity WHERE query = $1`,
		"listen "+pgx.Identifier{relay.ChannelName(h.schema)}.Sanitize()).Scan(&pid)
	if err != nil {
		t.Fatalf("find the listener's backend: %v", err)
	}
	stopped := time.Now()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP backend %d: %v", pid, err)
	}
	// Registered after StartPostgres, so it runs before the server stops:
	// a stopped backend would hold up its shutdown.
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	// Staged while the listener is frozen: its notification goes to the
	// stopped backend, and only the drain after the reconnect finds it.
	frozenJid := h.stage(relay.Job{Name: "WhileFrozen"})

	h.waitLog("listener error, reconnecting", 1)
	noticed := h.logs.FilterMessage("listener error, reconnecting").All()[0]
	t.Logf("the listener noticed its backend stopped after %s: %v", noticed.Time.Sub(stopped), noticed.ContextMap()["error"])
	if d := noticed.Time.Sub(stopped); d > 10*time.Second {
		t.Errorf("the listener noticed its backend stopped after %s, want within 10s (%s heartbeat, 2s for it to arrive)", d, heartbeat)
	}
	if noticed.Level.String() != "warn" {
		t.Errorf("%q logged at %s, want warn", noticed.Message, noticed.Level)
	}
	if msg := fmt.Sprint(noticed.ContextMap()["error"]); !strings.Contains(msg, "no heartbeat") {
		t.Errorf("the listener's error %q does not say its heartbeat did not come through", msg)
	}
	h.waitLog("listener reconnected", 1)
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queueJIDs("default"); got[0] != frozenJid {
		t.Fatalf("delivered %v, want %s (staged while the listener was frozen)", got, frozenJid)
	}
	// Once the drain after the new LISTEN has gone idle, only a
	// notification to the new listener (or the poll, a minute away) can
	// deliver a job.
	for timeout := time.After(15 * time.Second); ; {
		select {
		case n := <-idle:
			if n < 2 {
				continue
			}
		case <-timeout:
			t.Fatalf("the relay did not go idle after its second LISTEN within 15s; logs: %v", messages(h.logs))
		}
		break
	}
	jid := h.stage(relay.Job{Name: "AfterReconnect"})
	h.waitQueueLen("default", 2, 10*time.Second)
	if got := h.queueJIDs("default"); got[1] != jid {
		t.Fatalf("delivered %v, want %s", got, jid)
	}
}

// A listener whose backend freezes before its LISTEN is answered (the
// LISTEN itself has no deadline in pgxlisten, and no heartbeat is sent
// before a session listens) gives up on it after the lock connection's
// query timeout (2s; the socket's deadline, set in Connect and lifted once
// the LISTEN completed), logs at warn, and listens on a new connection.
func TestFrozenListenIsReplaced(t *testing.T) {
	t.Parallel()
	h, pg := privateHarness(t)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		stopped time.Time
		pid     int
	)
	// Registered after StartPostgres, so it runs before the server stops:
	// a stopped backend would hold up its shutdown.
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		if pid != 0 {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	})
	relay.SetOnListenerConnected(r, func(p uint32) {
		mu.Lock()
		defer mu.Unlock()
		if pid != 0 {
			return // the first listener only
		}
		if err := syscall.Kill(int(p), syscall.SIGSTOP); err != nil {
			t.Errorf("SIGSTOP backend %d: %v", p, err)
			return
		}
		pid, stopped = int(p), time.Now()
	})
	idle := idleEvents(r)
	h.run(r)

	h.waitLog("listener error, reconnecting", 1)
	noticed := h.logs.FilterMessage("listener error, reconnecting").All()[0]
	mu.Lock()
	d := noticed.Time.Sub(stopped)
	mu.Unlock()
	t.Logf("the listener gave up on its frozen LISTEN after %s: %v", d, noticed.ContextMap()["error"])
	if d > 8*time.Second {
		t.Errorf("the listener gave up on its frozen LISTEN after %s, want within 8s (2s, and slack)", d)
	}
	if noticed.Level.String() != "warn" {
		t.Errorf("%q logged at %s, want warn", noticed.Message, noticed.Level)
	}
	if msg := fmt.Sprint(noticed.ContextMap()["error"]); !strings.Contains(msg, "listen") {
		t.Errorf("the listener's error %q does not name its LISTEN", msg)
	}
	// The second connection LISTENs; a commit after the drain that
	// followed it is delivered by its notification (the poll is a minute
	// away).
	h.waitIdleAfterListen(idle)
	jid := h.stage(relay.Job{Name: "AfterFrozenListen"})
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queueJIDs("default"); got[0] != jid {
		t.Fatalf("delivered %v, want %s", got, jid)
	}
}

// While nothing comes through, the relay sends its listener a heartbeat
// every heartbeat period (300ms here, 30s by default), and only then: it
// arrives, the healthy listener is kept, no drain is woken, and each costs
// one transaction id, nothing else of the idle relay taking one. Measured
// with pg_snapshot_xmax(pg_current_snapshot()) on a private server with
// autovacuum off (its analyzes take ids), over a 3s window.
func TestListenerHeartbeatIsRare(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	h := &harness{t: t, schema: "jobs"}
	h.rdb, h.ns = testenv.Redis(t)
	h.conn = testenv.Conn(t, pg.URL())
	ctx := context.Background()
	for _, sql := range []string{"ALTER SYSTEM SET autovacuum = off", "SELECT pg_reload_conf()"} {
		if _, err := h.conn.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := relay.Migrate(ctx, h.conn, h.schema); err != nil {
		t.Fatal(err)
	}
	h.stager = relay.NewStager(h.schema)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.PollInterval = time.Minute
	const heartbeat, window = 300 * time.Millisecond, 3 * time.Second
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetListenerHeartbeat(r, heartbeat)
	idle := idleEvents(r)
	h.run(r)
	h.waitIdleAfterListen(idle)

	// A second listener on the channel sees what the relay's hears.
	watcher := testenv.Conn(t, pg.URL())
	if _, err := watcher.Exec(ctx, "LISTEN "+pgx.Identifier{relay.ChannelName(h.schema)}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	xmax := func() (x int64) {
		t.Helper()
		if err := h.conn.QueryRow(ctx, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").Scan(&x); err != nil {
			t.Fatal(err)
		}
		return x
	}
	x0 := xmax()
	wctx, cancel := context.WithTimeout(ctx, window)
	defer cancel()
	heartbeats := 0
	for {
		n, err := watcher.WaitForNotification(wctx)
		if err != nil {
			if wctx.Err() == nil {
				t.Fatal(err)
			}
			break
		}
		if n.Payload != "heartbeat" {
			t.Fatalf("notification %+v in an idle window, want heartbeats only", n)
		}
		heartbeats++
	}
	used := xmax() - x0
	t.Logf("%d heartbeats and %d transaction ids in %s idle, a heartbeat every %s without a notification", heartbeats, used, window, heartbeat)
	if heartbeats < 2 || heartbeats > int(window/heartbeat)+1 {
		t.Errorf("%d heartbeats in %s, want 2 to %d (one per %s without a notification)", heartbeats, window, int(window/heartbeat)+1, heartbeat)
	}
	// One more: a heartbeat committed as the window closed, and heard
	// after it.
	if used > int64(heartbeats)+1 {
		t.Errorf("%d transaction ids used in %s idle with %d heartbeats, want at most one per heartbeat", used, window, heartbeats)
	}
	if n := h.logs.FilterMessage("listener error, reconnecting").Len(); n != 0 {
		t.Errorf("the healthy listener was replaced %d times: %v", n, messages(h.logs))
	}
	select {
	case <-idle:
		t.Errorf("a drain ran in the idle window: heartbeats woke it")
	default:
	}
}
