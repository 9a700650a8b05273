package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Which commits notify, in each state of the relay (sql/010_wake_when_idle.sql):
// only while a relay is idle and listening does anybody hold the schema's
// "idle" lock, and only then do commits notify. No relay, a relay whose
// Redis is down, a relay paused by memory backpressure, and a poll-only
// relay (TestPollOnlyNeitherListensNorIsNotified) cost the app no
// notification.

// With no relay running, a commit does not notify, and the app's session
// holds no advisory lock after it: nobody holds "idle", before any relay
// ran and after a relay stopped (its locks go with its lead). Between the
// two, the running relay, idle, holds "idle" and the same commit
// notifies. The issue's "a relay that is not draining costs the app
// nothing".
func TestNoRelayCommitsDoNotNotify(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	url := testenv.DatabaseURL()
	listener := listen(t, url, h.schema)
	app := testenv.Conn(t, url)
	commit := func(name string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
			_, err := h.stager.Stage(ctx, tx, relay.Job{Name: name})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if held := appLocks(t, app); len(held) != 0 {
			t.Fatalf("after its commit, the app's session holds advisory locks %v, want none", held)
		}
	}

	// No relay has run.
	if n := h.advisoryLocks(relay.IdleLockName(h.schema), "ExclusiveLock", true); n != 0 {
		t.Fatalf("%d sessions hold the idle lock with no relay running, want none", n)
	}
	commit("BeforeAnyRelay")
	checkDidNotNotify(t, listener, h.schema, "a commit with no relay running")

	// A relay runs, and goes idle: the same commit notifies.
	cfg := h.config()
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	idle := idleEvents(r)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	var stopOnce sync.Once
	var runErr error
	stop := func() error {
		stopOnce.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(15 * time.Second):
				runErr = errors.New("Run did not return within 15s of cancel")
			}
		})
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	h.waitIdleAfterListen(idle)
	h.waitQueueLen("default", 1, 10*time.Second) // the drain at start's
	if n := h.advisoryLocks(relay.IdleLockName(h.schema), "ExclusiveLock", true); n != 1 {
		t.Fatalf("%d sessions hold the idle lock beside an idle relay, want 1", n)
	}
	staged := int64(1) // BeforeAnyRelay
	notifiesBesideIdle(t, h, listener, leaderPIDOf(t, h.conn, h.schema), app.PgConn().PID(), func() {
		commit("RelayIdle")
		staged++
	})
	h.waitQueueLen("default", staged, 10*time.Second)

	// The relay stops.
	if err := stop(); err != nil {
		t.Fatalf("Run = %v after cancel, want nil", err)
	}
	if n := h.advisoryLocks(relay.IdleLockName(h.schema), "ExclusiveLock", true); n != 0 {
		t.Fatalf("%d sessions hold the idle lock after the relay stopped, want none", n)
	}
	commit("AfterTheRelay")
	checkDidNotNotify(t, listener, h.schema, "a commit after the relay stopped")
}

// A relay whose Redis is down (stopped) or hung (SIGSTOP, past the
// client's timeouts) holds no idle lock while its drain fails and retries:
// the commit that woke it (it was idle) notified, the ones after do not.
// Once Redis is back the jobs are delivered, and the relay goes idle
// again: its lock connection holds the idle lock, and a commit notifies.
func TestRedisDownRelayHoldsNoIdleLock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		timeout     time.Duration // the client's read and write timeouts; 0: go-redis's
		fault, heal func(*testenv.RedisServer)
	}{
		{"down", 0, (*testenv.RedisServer).Stop, (*testenv.RedisServer).Start},
		{"hung", 300 * time.Millisecond,
			func(s *testenv.RedisServer) { s.Signal(syscall.SIGSTOP) },
			func(s *testenv.RedisServer) { s.Signal(syscall.SIGCONT) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			url := testenv.DatabaseURL()
			srv := testenv.StartRedis(t)
			rdb := redis.NewClient(testenv.RedisOptions(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port),
				ReadTimeout: tc.timeout, WriteTimeout: tc.timeout}))
			t.Cleanup(func() { _ = rdb.Close() })
			h.rdb = rdb
			cfg := h.config()
			cfg.Redis = rdb
			cfg.PollInterval = time.Minute
			_, idle := h.startSignaled(cfg)
			h.waitIdleAfterListen(idle)
			pid := leaderPIDOf(t, h.conn, h.schema)
			if got := idleHolders(t, h.conn, h.schema); !slices.Equal(got, []uint32{pid}) {
				t.Fatalf("the idle lock is held by %v beside an idle relay, want its lock connection %d", got, pid)
			}

			// Redis fails; a commit wakes the idle relay, whose push fails.
			tc.fault(srv)
			healed := false
			t.Cleanup(func() {
				if !healed && tc.name == "hung" {
					tc.heal(srv) // a stopped server would not stop
				}
			})
			app := testenv.Conn(t, url)
			failed := h.logs.FilterMessage("batch failed, retrying").Len()
			jids := []string{stageOn(t, h, app, "WhileDown")}
			h.waitLog("batch failed, retrying", failed+1)
			if got := idleHolders(t, h.conn, h.schema); len(got) != 0 {
				t.Fatalf("the idle lock is held by %v after a failed drain, want nobody: commits would notify a relay that cannot push", got)
			}
			listener := listen(t, url, h.schema)
			jids = append(jids, stageOn(t, h, app, "StillDown"))
			checkDidNotNotify(t, listener, h.schema, "a commit beside a relay whose Redis is "+tc.name)
			h.waitLog("batch failed, retrying", failed+3)
			if got := idleHolders(t, h.conn, h.schema); len(got) != 0 {
				t.Fatalf("the idle lock is held by %v while the drain retries, want nobody", got)
			}
			if n := h.logs.FilterMessage("stepped down").Len(); n != 0 {
				t.Fatalf("the relay stepped down while Redis was %s; the case needs it leading", tc.name)
			}
			if n := h.staged(); n != 2 {
				t.Fatalf("%d rows staged while Redis is %s, want 2", n, tc.name)
			}

			// Redis is back: the retry delivers, and the relay goes idle again.
			tc.heal(srv)
			healed = true
			h.waitStaged(0)
			// The relay goes idle again, its lock connection holding the
			// idle lock, and a commit notifies it.
			notifiesBesideIdle(t, h, listener, pid, app.PgConn().PID(), func() {
				jids = append(jids, stageOn(t, h, app, "BackUp"))
			})
			h.waitQueueLen("default", int64(len(jids)), 10*time.Second)
			if got := h.queueJIDs("default"); !slices.Equal(got, jids) {
				t.Fatalf("delivered %v, want %v", got, jids)
			}
		})
	}
}

// A relay paused by memory backpressure (RedisMaxMemoryRatio) holds no
// idle lock, whether the pause began while it was idle (a commit woke it)
// or part way through a drain (its push found Redis nearly full): commits
// do not notify it. When the memory is below the ratio again, it drains
// and goes idle. The memory is moved by setting the private Redis's
// maxmemory; the relay reads INFO memory afresh at each check (the idle
// hook and the push hook expire its 500ms cache).
func TestMemoryBackpressureHoldsNoIdleLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	url := testenv.DatabaseURL()
	srv := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	opts, err := redis.ParseURL(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	admin := redis.NewClient(testenv.RedisOptions(opts)) // the hooks'
	t.Cleanup(func() { _ = admin.Close() })
	h.rdb = rdb
	// setMaxMemory sets maxmemory to used_memory times factor.
	setMaxMemory := func(factor float64) error {
		info, err := admin.Info(ctx, "memory").Result()
		if err != nil {
			return err
		}
		for _, line := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
				used, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return err
				}
				return admin.ConfigSet(ctx, "maxmemory", strconv.FormatInt(int64(float64(used)*factor), 10)).Err()
			}
		}
		return errors.New("INFO memory has no used_memory")
	}
	// Over the ratio of 0.5 with room left (writes are not refused), and
	// far below it.
	const over, under = 1.25, 8
	if err := setMaxMemory(under); err != nil {
		t.Fatal(err)
	}

	cfg := h.config()
	cfg.Redis = rdb
	cfg.RedisMaxMemoryRatio = 0.5
	cfg.BatchSize = 1
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	locks := testenv.ConnTo(t, url) // the idle hook's
	idle := make(chan int64, 1000)
	stopChecked := make(chan error, 1)
	var checkStop atomic.Bool
	relay.SetOnIdle(r, func(listens int64) {
		relay.ExpireMemoryCheck(r)
		if relay.StoppedOnBackpressure(r) && checkStop.Swap(false) {
			stopChecked <- func() error {
				got, err := readIdleHolders(locks, h.schema)
				if err != nil {
					return err
				}
				if len(got) != 0 {
					return fmt.Errorf("the idle lock is held by %v after a drain stopped on memory backpressure, want nobody", got)
				}
				return nil
			}()
		}
		select {
		case idle <- listens:
		default:
		}
	})
	// The push hook makes Redis nearly full before the second push of the
	// drain it is armed for.
	var armed atomic.Bool
	var pushes atomic.Int32
	pushErr := make(chan error, 1)
	relay.SetBeforePush(r, func(context.Context) {
		if !armed.Load() || pushes.Add(1) != 2 {
			return
		}
		armed.Store(false)
		if err := setMaxMemory(over); err != nil {
			pushErr <- err
			return
		}
		relay.ExpireMemoryCheck(r)
	})
	h.run(r)
	h.waitIdleAfterListen(idle)
	pid := leaderPIDOf(t, h.conn, h.schema)
	app := testenv.Conn(t, url)
	paused := func() bool {
		return slices.Equal(r.Status().Paused, []relay.Paused{{Queue: "*", Reason: "memory"}})
	}
	// resume brings the memory back below the ratio, and waits until the
	// relay has drained everything and gone idle.
	resume := func(jids []string) {
		t.Helper()
		if err := setMaxMemory(under); err != nil {
			t.Fatal(err)
		}
		h.waitQueueLen("default", int64(len(jids)), 15*time.Second)
		// A row held back is skipped for a while: the order may differ.
		if got, want := slices.Sorted(slices.Values(h.queueJIDs("default"))), slices.Sorted(slices.Values(jids)); !slices.Equal(got, want) {
			t.Fatalf("delivered %v, want %v", got, want)
		}
		testenv.WaitFor(t, 15*time.Second, "the relay idle again, its lock connection holding the idle lock", func() (bool, string) {
			got := idleHolders(t, h.conn, h.schema)
			return slices.Equal(got, []uint32{pid}) && !paused(), fmt.Sprintf("held by %v, want %d; paused %v", got, pid, r.Status().Paused)
		})
	}

	// The pause begins while the relay is idle: a commit (which notifies)
	// wakes it, and it finds Redis nearly full.
	if err := setMaxMemory(over); err != nil {
		t.Fatal(err)
	}
	jids := []string{stageOn(t, h, app, "WokeIt")}
	testenv.WaitFor(t, 15*time.Second, "the relay paused, holding no idle lock", func() (bool, string) {
		got := idleHolders(t, h.conn, h.schema)
		return paused() && len(got) == 0, fmt.Sprintf("paused %v, idle lock held by %v", r.Status().Paused, got)
	})
	listener := listen(t, url, h.schema)
	jids = append(jids, stageOn(t, h, app, "WhilePaused"))
	checkDidNotNotify(t, listener, h.schema, "a commit beside a relay paused by memory backpressure")
	if n := h.staged(); n != 2 {
		t.Fatalf("%d rows staged while paused, want 2", n)
	}
	resume(jids)

	// The pause begins part way through a drain (its second batch).
	listener = listen(t, url, h.schema) // past the notifications so far
	armed.Store(true)
	checkStop.Store(true)
	faults := relayFaults(h)
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	more, err := h.stager.StageMany(ctx, tx, []relay.Job{{Name: "B1"}, {Name: "B2"}, {Name: "B3"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	jids = append(jids, more...)
	// The relay is idle since resume (it went idle after an empty claim,
	// with nothing left to push), and nothing but a fault can make it
	// leave idle: the commit notifies. Its drain of these rows is the
	// case, so a commit that did not notify is not tried again; the drain
	// still comes (the relay, awake or woken by the commit's end, finds
	// the rows), and the rest of the test holds, but the notification is
	// let go only when a fault the relay logged may have made it awake.
	switch pid, err := notifierWithin(listener, 10*time.Second); {
	case err == nil && pid != app.PgConn().PID():
		t.Fatalf("notification from backend %d, want the commit beside the idle relay (%d)", pid, app.PgConn().PID())
	case err == nil:
	case relayFaults(h) > faults:
		t.Logf("the commit beside the idle relay did not notify (%v), but the relay left idle around it for a fault; logs: %v", err, messages(h.logs))
	default:
		t.Fatalf("the commit beside the idle relay did not notify (%v); logs: %v", err, messages(h.logs))
	}
	select {
	case err := <-stopChecked:
		if err != nil {
			t.Fatal(err)
		}
	case err := <-pushErr:
		t.Fatalf("push hook: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatalf("no drain stopped on backpressure within 15s; logs: %v", messages(h.logs))
	}
	if !paused() {
		t.Fatalf("Status().Paused = %v after the stop, want * (memory)", r.Status().Paused)
	}
	jids = append(jids, stageOn(t, h, app, "AfterTheStop"))
	checkDidNotNotify(t, listener, h.schema, "a commit beside a relay stopped by memory backpressure")
	if got := idleHolders(t, h.conn, h.schema); len(got) != 0 {
		t.Fatalf("the idle lock is held by %v while paused, want nobody", got)
	}
	resume(jids)
}

// relayFaults counts the log lines of h's relay that say it left idle
// for a fault: its listener lost its session (deaf, the relay gives back
// its idle lock), a batch failed, or it stepped down.
func relayFaults(h *harness) int {
	n := 0
	for _, msg := range []string{"listener error, reconnecting", "batch failed, retrying", "stepped down"} {
		n += h.logs.FilterMessage(msg).Len()
	}
	return n
}

// stageOn commits one job on conn and returns its jid.
func stageOn(t *testing.T, h *harness, conn *pgx.Conn, name string) string {
	t.Helper()
	var jid string
	if err := pgx.BeginFunc(context.Background(), conn, func(tx pgx.Tx) error {
		var err error
		jid, err = h.stager.Stage(context.Background(), tx, relay.Job{Name: name})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return jid
}

// A relay whose push waits on a Redis that has stopped answering marks
// itself awake long before the client's read timeout ends the push
// (slowPush): commits stop notifying a relay that cannot drain, from the
// first hung push on, not from its failure. The read timeout here is a
// minute, so the idle lock can only have been released by the slow push.
func TestHungPushMarksTheRelayAwake(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	srv := testenv.StartRedis(t)
	rdb := redis.NewClient(testenv.RedisOptions(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port),
		ReadTimeout: time.Minute, WriteTimeout: time.Minute}))
	t.Cleanup(func() { _ = rdb.Close() })
	h.rdb = rdb
	cfg := h.config()
	cfg.Redis = rdb
	cfg.PollInterval = time.Minute
	_, idle := h.startSignaled(cfg)
	h.waitIdleAfterListen(idle)
	pid := leaderPIDOf(t, h.conn, h.schema)
	if got := idleHolders(t, h.conn, h.schema); !slices.Equal(got, []uint32{pid}) {
		t.Fatalf("the idle lock is held by %v beside an idle relay, want its lock connection %d", got, pid)
	}

	srv.Signal(syscall.SIGSTOP)
	t.Cleanup(func() { srv.Signal(syscall.SIGCONT) })
	app := testenv.Conn(t, testenv.DatabaseURL())
	jid := stageOn(t, h, app, "WhileHung")
	testenv.WaitFor(t, 20*time.Second, "nobody holding the idle lock while the push hangs", func() (bool, string) {
		got := idleHolders(t, h.conn, h.schema)
		return len(got) == 0, fmt.Sprintf("held by %v", got)
	})
	if n := h.logs.FilterMessage("batch failed, retrying").Len(); n != 0 {
		t.Fatalf("%d batches failed: the push was to hang for the client's minute", n)
	}
	srv.Signal(syscall.SIGCONT)
	h.waitQueueLen("default", 1, 20*time.Second)
	if got := h.queueJIDs("default"); !slices.Equal(got, []string{jid}) {
		t.Fatalf("delivered %v, want [%s]", got, jid)
	}
	testenv.WaitFor(t, 15*time.Second, "the relay idle again", func() (bool, string) {
		got := idleHolders(t, h.conn, h.schema)
		return slices.Equal(got, []uint32{pid}), fmt.Sprintf("held by %v, want %d", got, pid)
	})
}
